#!/usr/bin/env bash
# One device call: behemoth 1D tensor parallelism (tp=2, with and without sequence
# parallelism) vs stock DTensor TP and FSDP2 on the same 2 GPUs, and the largest batch
# each behemoth variant fits at seq 2048.   Usage: bash benchmarks/run_tp.sh [size] [mbs]
set -u
size=${1:-1.3b}; mbs=${2:-8}
out=${OUT:-/tmp}
source "$(dirname "$0")/env.sh" "$out/tp.log"
run() { echo "## $*" | tee -a "$out/tp.log"; timeout 300 "$@" 2>&1 | grep -E "RESULT|Error|error" | tail -3 | tee -a "$out/tp.log"; }
tr="torchrun --standalone --nproc-per-node 2"
bf16="env CUDA_DEVICE_MAX_CONNECTIONS=1 $tr benchmarks/bench_gpt.py --size gpt-$size --mbs $mbs --tp 2 --zero 1 --param-dtype bf16"
if [ -n "${VARIANTS:-}" ]; then
  # VARIANTS="1 2 4 2c": only pure-bf16 1D tp=2 with Plan.tp_overlap 1, 2, 4 and 2 with compiled
  # blocks (c), between two FSDP2 runs; SP=1 adds --sp to each.
  run $tr benchmarks/peer_baseline.py --size "$size" --mode fsdp --mbs "$mbs"
  for v in $VARIANTS; do
    k=${v%c}; c=""; [ "$v" != "$k" ] && c="--compile"
    run $bf16 --tp-overlap "$k" $c ${SP:+--sp}
  done
  run $tr benchmarks/peer_baseline.py --size "$size" --mode fsdp --mbs "$mbs"
  exit 0
fi
[ -z "${SKIP_DTENSOR:-}" ] && run $tr benchmarks/peer_baseline.py --size "$size" --mode tp --mbs "$mbs"   # SKIP_DTENSOR=1 skips it
run $tr benchmarks/peer_baseline.py --size "$size" --mode fsdp --mbs "$mbs"
run $tr benchmarks/bench_gpt.py --size "gpt-$size" --mbs "$mbs" --tp 2
run $tr benchmarks/bench_gpt.py --size "gpt-$size" --mbs "$mbs" --tp 2 --sp
# pure bf16 as the FSDP2 peer runs (bf16 parameters over fp32 masters ZeRO-1 keeps: Megatron's bf16)
run $bf16
run $bf16 --sp
if [ -n "${PROBE:-}" ]; then
  run $tr benchmarks/bench_gpt.py --size "gpt-$size" --mbs "$mbs" --tp 2 --probe-max-mbs
  run $tr benchmarks/bench_gpt.py --size "gpt-$size" --mbs "$mbs" --tp 2 --sp --probe-max-mbs
fi

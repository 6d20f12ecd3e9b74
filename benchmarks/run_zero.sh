#!/usr/bin/env bash
# One device call on 2 GPUs: behemoth ZeRO stages vs stock FSDP2 (bf16 parameters, fp32
# reduction) on the same GPUs and model.   Usage: bash benchmarks/run_zero.sh [size] [mbs] [stages]
# EXTRA="--param-dtype bf16" adds options to every behemoth run; REPEAT=n runs the whole set n times.
set -u
size=${1:-1.3b}; mbs=${2:-8}; stages=${3:-"3"}
out=${OUT:-/tmp}
source "$(dirname "$0")/env.sh" "$out/zero.log"
run() { echo "## $*" | tee -a "$out/zero.log"; timeout 300 "$@" 2>&1 | grep -E "RESULT|Error|error" | tail -3 | tee -a "$out/zero.log"; }
tr="torchrun --standalone --nproc-per-node 2"
for _ in $(seq "${REPEAT:-1}"); do
  run $tr benchmarks/peer_baseline.py --size "$size" --mode fsdp --mbs "$mbs"
  for z in $stages; do
    run $tr benchmarks/bench_gpt.py --size "gpt-$size" --mbs "$mbs" --zero "$z" ${EXTRA:-}
  done
done

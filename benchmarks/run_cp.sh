#!/usr/bin/env bash
# One device call (2 GPUs): context parallelism on GPT-1.3B, bf16.
#   1. the attention cores: ring (fused flash blocks / plain blocks) and Ulysses vs one GPU's
#      flash SDPA on the whole sequence -- outputs/gradients checked in bf16, and timed;
#   2. stock PyTorch single GPU (peer_baseline.py) and behemoth on one GPU at seq 16k, and
#      behemoth cp=2 (ring, ulysses) at seq 32k: throughput at equal work (TFLOP/s/GPU);
#   3. with PROBE=1: the longest sequence that trains on one GPU and with cp=2 (each mode).
# Usage: bash benchmarks/run_cp.sh [size]     (log in $OUT/cp.log when OUT is set)
set -u
size=${1:-1.3b}
out=${OUT:-/tmp}
export BEHEMOTH_TIMEOUT=${BEHEMOTH_TIMEOUT:-180}
source "$(dirname "$0")/env.sh" "$out/cp.log"
run() { echo "## $*" | tee -a "$out/cp.log"; timeout "${T:-600}" "$@" 2>&1 | grep -E "RESULT|probe:|Error|error" | tail -12 | tee -a "$out/cp.log"; }
t1="torchrun --standalone --nproc-per-node 1"
t2="torchrun --standalone --nproc-per-node 2"
for s in 8192 32768; do
  run $t2 benchmarks/bench_cp.py --check --seq $s
done
run $t1 benchmarks/peer_baseline.py --size "$size" --mode ddp --mbs 1 --seq 16384
run $t1 benchmarks/bench_cp.py --size "gpt-$size" --cp 1 --seq 16384
run $t2 benchmarks/bench_cp.py --size "gpt-$size" --cp 2 --mode ring --seq 32768
run $t2 benchmarks/bench_cp.py --size "gpt-$size" --cp 2 --mode ulysses --seq 32768
if [ -n "${PROBE:-}" ]; then
  run $t1 benchmarks/bench_cp.py --size "gpt-$size" --cp 1 --probe-max-seq --seq 16384
  run $t2 benchmarks/bench_cp.py --size "gpt-$size" --cp 2 --mode ring --probe-max-seq --seq 32768
  run $t2 benchmarks/bench_cp.py --size "gpt-$size" --cp 2 --mode ulysses --probe-max-seq --seq 32768
fi

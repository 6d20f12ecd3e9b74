#!/usr/bin/env bash
# One device call (CP GPUs, default 2): context parallelism on GPT-1.3B, bf16.
#   1. the attention cores: ring (fused flash blocks / plain blocks) and Ulysses vs one GPU's
#      flash SDPA on the whole sequence -- outputs/gradients checked in bf16, and timed;
#   2. stock PyTorch single GPU (peer_baseline.py) and behemoth on one GPU at seq 16k, and
#      behemoth cp=CP (ring, ulysses) at seq CP x 16k: throughput at equal work per GPU;
#   3. with PROBE=1: the longest sequence that trains on one GPU (climbing from 40k by 2k) and
#      with cp=CP under ZeRO-3 over the cp group (each mode, climbing from 0.95 x CP x 43k by 8k).
# Usage: [CP=4] [PROBE=1] [CHECK=0] bash benchmarks/run_cp.sh [size]   (log in $OUT/cp.log)
set -u
size=${1:-1.3b}
cp=${CP:-2}
out=${OUT:-/tmp}
export BEHEMOTH_TIMEOUT=${BEHEMOTH_TIMEOUT:-180}
source "$(dirname "$0")/env.sh" "$out/cp.log"
run() { echo "## $*" | tee -a "$out/cp.log"; timeout "${T:-600}" "$@" 2>&1 | grep -E "RESULT|probe:|Error|error" | tail -12 | tee -a "$out/cp.log"; }
t1="torchrun --standalone --nproc-per-node 1"
tn="torchrun --standalone --nproc-per-node $cp"
if [ "${CHECK:-1}" = 1 ]; then
  for s in 8192 32768; do
    run $tn benchmarks/bench_cp.py --check --seq $s
  done
fi
long=$((16384 * cp))
run $t1 benchmarks/peer_baseline.py --size "$size" --mode ddp --mbs 1 --seq 16384
run $t1 benchmarks/bench_cp.py --size "gpt-$size" --cp 1 --seq 16384
run $tn benchmarks/bench_cp.py --size "gpt-$size" --cp "$cp" --mode ring --seq $long
run $tn benchmarks/bench_cp.py --size "gpt-$size" --cp "$cp" --mode ulysses --seq $long
if [ -n "${PROBE:-}" ]; then
  # start near the answer (the probe only climbs): one H200 trained 43k, one H100 about half
  mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
  if [ "${mib:-0}" -gt 100000 ]; then one=43008; else one=20480; fi
  start=$(( (one * cp * 19 / 20 + 8191) / 8192 * 8192 ))  # 0.95 x cp x one GPU's, to 8k
  run $t1 benchmarks/bench_cp.py --size "gpt-$size" --cp 1 --probe-max-seq --probe-growth 1 --seq $((one - 2048)) \
    --seq-step 2048
  for m in ulysses ring; do
    run $tn benchmarks/bench_cp.py --size "gpt-$size" --cp "$cp" --mode $m --zero 3 --probe-max-seq --probe-growth 1 \
      --seq $start --seq-step 8192
  done
fi

#!/usr/bin/env bash
# One device call: behemoth DP vs stock PyTorch (single GPU, DDP, FSDP2) on the same GPUs.
# Usage: bash benchmarks/run_dp.sh [size] [mbs]   (results in $OUT/dp.log when OUT is set)
set -u
size=${1:-1.3b}; mbs=${2:-8}
out=${OUT:-/tmp}
ngpu=$(python3 -c "import torch; print(torch.cuda.device_count())")
source "$(dirname "$0")/env.sh" "$out/dp.log"
run() { echo "## $*" | tee -a "$out/dp.log"; timeout 300 "$@" 2>&1 | grep -E "RESULT|Error|error" | tail -3 | tee -a "$out/dp.log"; }
run torchrun --standalone --nproc-per-node 1 benchmarks/peer_baseline.py --size "$size" --mode ddp --mbs "$mbs"
run torchrun --standalone --nproc-per-node 1 benchmarks/bench_gpt.py --size "gpt-$size" --mbs "$mbs"
if [ "$ngpu" -ge 2 ]; then
  run torchrun --standalone --nproc-per-node 2 benchmarks/peer_baseline.py --size "$size" --mode ddp --mbs "$mbs"
  run torchrun --standalone --nproc-per-node 2 benchmarks/peer_baseline.py --size "$size" --mode fsdp --mbs "$mbs"
  for b in ${BUCKETS:-25}; do
    run torchrun --standalone --nproc-per-node 2 benchmarks/bench_gpt.py --size "gpt-$size" --mbs "$mbs" --bucket-mb "$b"
  done
fi

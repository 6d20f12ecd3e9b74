#!/usr/bin/env bash
# One device call on 4 GPUs: behemoth 2D (Optimus, q=2) vs 1D (Megatron) tensor parallelism at
# tp=4 on the same GPUs and model: throughput at one batch, then the largest batch each fits.
# Usage: bash benchmarks/run_tp4.sh [size] [mbs]      (log in $OUT/tp4.log when OUT is set)
set -u
size=${1:-1.3b}; mbs=${2:-8}
out=${OUT:-/tmp}
source "$(dirname "$0")/env.sh" "$out/tp4.log"
run() { echo "## $*" | tee -a "$out/tp4.log"; timeout "$T" "$@" 2>&1 | grep -E "RESULT|Error|error" | tail -3 | tee -a "$out/tp4.log"; }
tr="torchrun --standalone --nproc-per-node 4"
T=100 run $tr benchmarks/bench_gpt.py --size "gpt-$size" --mbs "$mbs" --tp 4 --tp-mode 1d
T=100 run $tr benchmarks/bench_gpt.py --size "gpt-$size" --mbs "$mbs" --tp 4 --tp-mode 2d
T=110 run $tr benchmarks/bench_gpt.py --size "gpt-$size" --mbs "$mbs" --tp 4 --tp-mode 2d --probe-max-mbs
T=110 run $tr benchmarks/bench_gpt.py --size "gpt-$size" --mbs "$mbs" --tp 4 --tp-mode 1d --probe-max-mbs

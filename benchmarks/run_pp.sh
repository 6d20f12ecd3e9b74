#!/usr/bin/env bash
# One device call on 2 GPUs: behemoth's pipeline. Usage: bash benchmarks/run_pp.sh [size] [mbs] [extra...]
# Each run is bounded (timeout, --dump-after prints every rank's Python stack on a hang) and NCCL's
# flight recorder dumps its last operations per rank under $OUT on a collective timeout.
set -u
size=${1:-2.7b}; mbs=${2:-1}; shift 2 || true
out=${OUT:-/tmp}
export BEHEMOTH_TIMEOUT=${BEHEMOTH_TIMEOUT:-90}
export TORCH_NCCL_TRACE_BUFFER_SIZE=2000 TORCH_NCCL_DUMP_ON_TIMEOUT=1 TORCH_NCCL_DEBUG_INFO_TEMP_FILE="$out/nccl_trace_rank_"
source "$(dirname "$0")/env.sh" "$out/pp.log"
timeout "${T:-300}" torchrun --standalone --nproc-per-node 2 benchmarks/bench_pp.py --size "gpt-$size" --mbs "$mbs" \
  --dump-after "${DUMP:-240}" "$@" 2>&1 | grep -v "^$" | tail -150 | tee -a "$out/pp.log"

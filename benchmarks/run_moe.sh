#!/usr/bin/env bash
# One device call (2 GPUs; NGPU=4 for 4): mixture of experts under expert parallelism
# (bench_moe.py), the peer in the same call:
#   1. dispatch + combine at 4,096 tokens per rank, hidden 4,096, 8 experts, top-2, bf16, ep = NGPU;
#      one MoE layer (FFN 14,336, 16k tokens per rank) vs a dense SwiGLU of the same active FLOPs,
#      balanced / uniform / Zipf routings, bf16 parameters and fp32 under autocast;
#   2. end-to-end training of the mixtral-4b and olmoe-1b-7b presets under Plan(ep=NGPU) (with
#      NGPU=4 also ep=2 x ep_dp=2, ZeRO-1), bf16 autocast: tokens/s, MFU on active FLOPs, memory;
#   3. the peer: transformers' MixtralForCausalLM at the mixtral-4b shape with stock FSDP2 and
#      transformers' grouped_mm experts (peer_hf_mixtral.py, a copy of ../shared's).
# Usage: bash benchmarks/run_moe.sh     (log in $OUT/moe.log, each run's full output in $OUT/moe-*.txt;
#        OLMOE_MBS: olmoe's sequences per rank at ep = 2, default 2 -- 4 does not fit 80 GB cards;
#        SKIP_PEER=1 skips the peer; a CPU smoke check of the script:
#        NGPU=2 SKIP_PEER=1 BENCH_EXTRA="--tiny --device cpu" bash benchmarks/run_moe.sh)
set -u
n=${NGPU:-2}
out=${OUT:-/tmp}
log="$out/moe.log"
export BEHEMOTH_TIMEOUT=${BEHEMOTH_TIMEOUT:-120} PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
source "$(dirname "$0")/env.sh" "$log"
run() {   # name, seconds, command...
  local name=$1 t=$2; shift 2
  echo "## $name: $*" | tee -a "$log"
  local s=$SECONDS
  timeout "$t" torchrun --standalone --nproc-per-node "$n" "$@" > "$out/moe-$name.txt" 2>&1
  echo "rc=$? in $((SECONDS - s)) s" | tee -a "$log"
  grep -E "^RESULT|OutOfMemory|Error" "$out/moe-$name.txt" | tail -12 | tee -a "$log"
}
# BENCH_EXTRA is split into flags on purpose
# shellcheck disable=SC2086
bench() { local name=$1 t=$2; shift 2; run "$name" "$t" benchmarks/bench_moe.py "$@" ${BENCH_EXTRA:-}; }
bench layer 180 --part dispatch,layer --precisions bf16,autocast
bench mixtral-ep$n 150 --part model --size mixtral-4b --mbs 4
if [ "$n" -ge 4 ]; then
  bench olmoe-ep$n 150 --part model --size olmoe-1b-7b --mbs 4
  bench mixtral-ep2-zero1 150 --part model --size mixtral-4b --mbs 4 --ep 2 --zero 1
  bench olmoe-ep2-zero1 150 --part model --size olmoe-1b-7b --mbs "${OLMOE_MBS:-2}" --ep 2 --zero 1
else
  bench olmoe-ep$n 150 --part model --size olmoe-1b-7b --mbs "${OLMOE_MBS:-2}"
fi
[ -z "${SKIP_PEER:-}" ] && run peer-hf-mixtral 150 benchmarks/peer_hf_mixtral.py --experts grouped_mm --mbs 4

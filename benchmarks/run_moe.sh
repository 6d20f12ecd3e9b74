#!/usr/bin/env bash
# One device call (2 GPUs; NGPU=4 for 4): mixture of experts under expert parallelism
# (bench_moe.py), the peer in the same call:
#   1. dispatch + combine at 4,096 tokens per rank, hidden 4,096, 8 experts, top-2, ep = NGPU;
#      one MoE layer (FFN 14,336, 16k tokens per rank) vs a dense SwiGLU of the same active FLOPs,
#      balanced / uniform / Zipf routings; both in bf16 and as Plan(precision="bf16") runs them
#      (fp32 parameters and residual stream under autocast);
#   2. end-to-end training of the mixtral-4b preset under Plan(ep=NGPU), bf16 autocast: tokens/s,
#      MFU on active FLOPs, memory; then its peer, transformers' MixtralForCausalLM at the same shape
#      with stock FSDP2 and transformers' grouped_mm experts (peer_hf_mixtral.py, a copy of ../shared's);
#   3. the olmoe-1b-7b preset the same way (with NGPU=4 also both presets at ep=2 x ep_dp=2, ZeRO-1).
# Usage: bash benchmarks/run_moe.sh     (log in $OUT/moe.log, each run's full output in $OUT/moe-*.txt;
#        OLMOE_MBS: olmoe's sequences per rank at ep = 2, default 4 on cards of 120 GB or more, else 2
#        (its experts' fp32 state alone is 54 GiB per rank at ep = 2), halved once after an OOM;
#        DEADLINE: seconds by which the last run ends (default 570); SKIP_PEER=1 skips the peer;
#        QUICK=1 stops after behemoth's Mixtral (dispatch, layer and one model: about 2 minutes);
#        OVERLAP=1 runs only the overlapped expert exchange, chunks 1 vs 2 vs 4 (Plan.ep_overlap):
#        the layer part (bf16; balanced, zipf, zipf-spread) with --chunks 1,2,4 in one process, then
#        mixtral-4b at ep = NGPU once per chunk count (a process each); about 4 minutes on 2 GPUs;
#        a CPU smoke check of the script:
#        NGPU=2 SKIP_PEER=1 BENCH_EXTRA="--tiny --device cpu" bash benchmarks/run_moe.sh)
set -u
n=${NGPU:-2}
out=${OUT:-/tmp}
log="$out/moe.log"
export BEHEMOTH_TIMEOUT=${BEHEMOTH_TIMEOUT:-120} PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
source "$(dirname "$0")/env.sh" "$log"
deadline=${DEADLINE:-570}   # seconds: every run is cut to end by then (a device call's limit is 600)
run() {   # name, seconds, command...
  local name=$1 t=$2; shift 2
  [ $((SECONDS + t)) -gt "$deadline" ] && t=$((deadline - SECONDS))
  if [ "$t" -lt 30 ]; then echo "## $name: skipped, ${t} s left before DEADLINE=$deadline" | tee -a "$log"; return; fi
  echo "## $name (limit $t s): $*" | tee -a "$log"
  local s=$SECONDS
  timeout "$t" torchrun --standalone --nproc-per-node "$n" "$@" > "$out/moe-$name.txt" 2>&1
  echo "rc=$? in $((SECONDS - s)) s" | tee -a "$log"
  grep -E "^RESULT|OutOfMemory|Error" "$out/moe-$name.txt" | tail -12 | tee -a "$log"
}
# BENCH_EXTRA is split into flags on purpose
# shellcheck disable=SC2086
bench() { local name=$1 t=$2; shift 2; run "$name" "$t" benchmarks/bench_moe.py "$@" ${BENCH_EXTRA:-}; }
# olmoe at ep = 2: the largest batch that fits the card, halved once if it runs out of memory
mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
olmoe_mbs=${OLMOE_MBS:-$([ "${mib:-0}" -ge 120000 ] && echo 4 || echo 2)}
olmoe_ep2() {   # name, extra flags...
  local name=$1; shift
  bench "$name" 110 --part model --size olmoe-1b-7b --mbs "$olmoe_mbs" "$@"
  if grep -qs OutOfMemory "$out/moe-$name.txt" && [ "$olmoe_mbs" -gt 1 ]; then
    bench "$name-mbs$((olmoe_mbs / 2))" 110 --part model --size olmoe-1b-7b --mbs $((olmoe_mbs / 2)) "$@"
  fi
}
if [ -n "${OVERLAP:-}" ]; then
  bench overlap-layer 120 --part layer --precisions bf16 --routings balanced,zipf,zipf-spread --chunks 1,2,4 --iters 20
  for c in 1 2 4; do bench "overlap-mixtral-chunks$c" 90 --part model --size mixtral-4b --mbs 4 --chunks "$c"; done
  exit 0
fi
bench layer 120 --part dispatch,layer --precisions bf16,autocast
bench mixtral-ep$n 110 --part model --size mixtral-4b --mbs 4
[ -n "${QUICK:-}" ] && exit 0
[ -z "${SKIP_PEER:-}" ] && run peer-hf-mixtral 110 benchmarks/peer_hf_mixtral.py --experts grouped_mm --mbs 4
if [ "$n" -ge 4 ]; then
  bench olmoe-ep$n 110 --part model --size olmoe-1b-7b --mbs 4
  bench mixtral-ep2-zero1 110 --part model --size mixtral-4b --mbs 4 --ep 2 --zero 1
  olmoe_ep2 olmoe-ep2-zero1 --ep 2 --zero 1
else
  olmoe_ep2 olmoe-ep$n
fi

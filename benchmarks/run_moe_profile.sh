#!/usr/bin/env bash
# One device call (2 GPUs): the mixtral-4b preset at planner_proof.py's batch (16 sequences of 2,048
# tokens a step, bf16 autocast) under several layouts, one process each: bench_moe.py --part model
# times STEPS steps, then profiles PROFILE more (--profile: each rank's top CUDA kernels and CPU ops,
# the MoE layers' annotated ranges, wall vs GPU-busy time, device-to-host copies, host syncs and
# host reads per step); TRACE=1 keeps each rank's chrome trace (gzipped, tens of MB) in $OUT/moe_traces.
#   bash benchmarks/run_moe_profile.sh          # the three layouts below, about 3 minutes
#   PLANS="pp=2,microbatches=16,schedule=interleaved,virtual_stages=2" bash benchmarks/run_moe_profile.sh
# PLANS: layouts as bench_moe.py --plan takes them, separated by spaces; BATCH (16), STEPS (6),
# PROFILE (3), NGPU (2), EXTRA: more bench_moe.py flags (a CPU smoke check of the script:
# EXTRA="--tiny --device cpu" BATCH=8 bash benchmarks/run_moe_profile.sh). Log: $OUT/moe_profile.log;
# each run's whole output in $OUT/moe-profile-<n>.txt.
set -u
out=${OUT:-/tmp}
log="$out/moe_profile.log"
export BEHEMOTH_TIMEOUT=${BEHEMOTH_TIMEOUT:-120}
source "$(dirname "$0")/env.sh" "$log"
PLANS=${PLANS:-"dp=2,ep=2 pp=2,microbatches=8,schedule=1f1b tp=2,tp_overlap=2,microbatches=4,zero=3"}
n=0
for plan in $PLANS; do
  n=$((n + 1))
  echo "### $plan" | tee -a "$log"
  timeout 280 torchrun --standalone --nproc-per-node "${NGPU:-2}" benchmarks/bench_moe.py --part model \
    --plan "$plan" --batch "${BATCH:-16}" --steps "${STEPS:-6}" --profile "${PROFILE:-3}" \
    ${TRACE:+--trace "$out/moe_traces"} ${EXTRA:-} > "$out/moe-profile-$n.txt" 2>&1
  echo "exit $?" >> "$out/moe-profile-$n.txt"
  grep -vE "^(W|I)[0-9]{4} |USDT|^\*+$|OMP_NUM_THREADS" "$out/moe-profile-$n.txt" | tee -a "$log"
done

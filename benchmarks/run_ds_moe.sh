#!/usr/bin/env bash
# One device call on GPUS GPUs (default 2): DeepSpeed-MoE (peer_ds_moe.py: ZeRO-2 + expert parallelism,
# ep = GPUS) against behemoth's expert parallelism (bench_moe.py --part model, ep = GPUS) on the mixtral-4b shape,
# each at every MBS (sequences per rank), the peer first. DeepSpeed travels as wheels: the call
# names .whl in carry (.whl/INSTALL.txt holds the install line this script runs).
#   bash benchmarks/run_ds_moe.sh        (log in $OUT/ds_moe.log, each run's output in $OUT/dsmoe-*.txt)
# MBS: default "4 8"; BH_PLAN: behemoth's plan, default its best measured recipe
# "dp=GPUS,ep=GPUS,compile=True,zero=1,param_dtype=bf16" (BH_PLAIN=1 also runs Plan(dp=GPUS, ep=GPUS) at the
# first MBS); DS_EXTRA: extra peer_ds_moe.py flags (e.g. "--capacity-factor 1.25"); SKIP_BH=1 runs
# the peer alone; CHECK=1 first compares the peer's forward with behemoth's model at tiny shapes on the
# GPUs (peer_ds_moe.py --check, about 20 s); DEADLINE: seconds by which the last run ends (default 570).
set -u
out=${OUT:-/tmp}
log="$out/ds_moe.log"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site DS_ACCELERATOR=cuda PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
source "$(dirname "$0")/env.sh" "$log"   # prepends src/: PYTHONPATH=src:/tmp/site
python3 -c "import torch, deepspeed; print('torch', torch.__version__, 'deepspeed', deepspeed.__version__)" 2>&1 | tail -1 | tee -a "$log"
deadline=${DEADLINE:-570}
gpus=${GPUS:-2}
run() {   # name, seconds, command...
  local name=$1 t=$2; shift 2
  [ $((SECONDS + t)) -gt "$deadline" ] && t=$((deadline - SECONDS))
  if [ "$t" -lt 30 ]; then echo "## $name: skipped, ${t} s left before DEADLINE=$deadline" | tee -a "$log"; return; fi
  echo "## $name (limit $t s): $*" | tee -a "$log"
  local s=$SECONDS
  timeout "$t" torchrun --standalone --nproc-per-node "$gpus" "$@" > "$out/dsmoe-$name.txt" 2>&1
  echo "rc=$? in $((SECONDS - s)) s" | tee -a "$log"
  grep -E "^RESULT|OutOfMemory|Error" "$out/dsmoe-$name.txt" | tail -6 | tee -a "$log"
}
[ -n "${CHECK:-}" ] && run check 60 benchmarks/peer_ds_moe.py --tiny --check
plan=${BH_PLAN:-dp=$gpus,ep=$gpus,compile=True,zero=1,param_dtype=bf16}
first=1
for m in ${MBS:-4 8}; do
  # DS_EXTRA is split into flags on purpose
  # shellcheck disable=SC2086
  run "deepspeed-mbs$m" 150 benchmarks/peer_ds_moe.py --mbs "$m" ${DS_EXTRA:-}
  [ -n "${SKIP_BH:-}" ] && continue
  run "behemoth-mbs$m" 150 benchmarks/bench_moe.py --part model --size mixtral-4b --mbs "$m" --plan "$plan"
  if [ -n "$first" ] && [ -n "${BH_PLAIN:-}" ]; then
    run "behemoth-plain-mbs$m" 110 benchmarks/bench_moe.py --part model --size mixtral-4b --mbs "$m" --plan "dp=$gpus,ep=$gpus"
  fi
  first=
done

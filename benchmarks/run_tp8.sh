#!/usr/bin/env bash
# One device call on 8 GPUs: 1D (± SP, tp_overlap), 2.5D (q = 2, d = 2) and 3D (q = 2, ± tp_overlap)
# tensor parallelism at tp = 8 on one GPT size, at the same global batch, each with one step's
# ledger bytes per axis beside planner/axis_traffic.py's prediction; then dp × tp (dp 2 × 2D tp 4,
# dp 4 × 1D tp 2) against stock FSDP2 on the same 8 GPUs; then the largest batch 1D, 2.5D and 3D fit.
#
#   bash benchmarks/run_tp8.sh                      # GPT-1.3B, mbs 8, all three parts
#   SIZE=6.9b PARTS="speed batch" bash benchmarks/run_tp8.sh
#   DRY=1 bash benchmarks/run_tp8.sh                # GPT-350M on 8 CPU (gloo) processes, no peers and no
#                                                   # batch probe: checks the script and the ledger
#
# SIZE: 1.3b, 6.9b, ... (gpt-SIZE); MBS: sequences per dp rank; PARTS: speed, dp, batch; T: seconds per run.
set -u
size=${SIZE:-1.3b}; mbs=${MBS:-8}; parts=${PARTS:-speed dp batch}; T=${T:-150}
out=${OUT:-/tmp}
log="$out/tp8_$size.log"
if [ -n "${DRY:-}" ]; then  # no GPU: the same runs on a tiny model, peers skipped
  export PYTHONPATH=$PWD/src:${PYTHONPATH:-} PYTHONUNBUFFERED=1
  model=(--size gpt-350m --seq 64 --vocab 256 --steps 3); peers=""  # 16 heads: divisible by tp = 8
  parts=${PARTS:-speed dp}  # a probe grows the batch until memory runs out: not on a CPU
else
  source "$(dirname "$0")/env.sh" "$log"
  model=(--size "gpt-$size"); peers=1
fi
run() { echo "## $*" | tee -a "$log"; timeout "$T" "$@" 2>&1 | grep -E "RESULT|Error|error" | tail -3 | tee -a "$log"; }
tr="torchrun --standalone --nproc-per-node 8"
bench="$tr benchmarks/bench_gpt.py ${model[*]}"
for part in $parts; do
  case $part in
    speed)
      run $bench --mbs "$mbs" --tp 8 --tp-mode 1d --ledger
      run $bench --mbs "$mbs" --tp 8 --tp-mode 1d --sp --ledger
      run $bench --mbs "$mbs" --tp 8 --tp-mode 1d --tp-overlap 2 --ledger
      run $bench --mbs "$mbs" --tp 8 --tp-mode 2.5d --tp-depth 2 --ledger
      run $bench --mbs "$mbs" --tp 8 --tp-mode 3d --ledger
      run $bench --mbs "$mbs" --tp 8 --tp-mode 3d --tp-overlap 2 --ledger
      ;;
    dp)  # dp ranks each take mbs sequences: FSDP2 at the same global batch takes mbs * dp / 8 per GPU
      [ -n "$peers" ] && run $tr benchmarks/peer_baseline.py --size "$size" --mode fsdp --mbs "$((mbs / 4))"
      run $bench --mbs "$mbs" --tp 4 --tp-mode 2d --ledger
      run $bench --mbs "$((mbs / 2))" --tp 2 --tp-mode 1d --ledger
      ;;
    batch)
      run $bench --mbs "$mbs" --tp 8 --tp-mode 1d --probe-max-mbs
      run $bench --mbs "$mbs" --tp 8 --tp-mode 2.5d --tp-depth 2 --probe-max-mbs
      run $bench --mbs "$mbs" --tp 8 --tp-mode 3d --probe-max-mbs
      ;;
    *) echo "unknown part $part (speed, dp, batch)" >&2; exit 2 ;;
  esac
done

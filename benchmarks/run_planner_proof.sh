#!/usr/bin/env bash
# One device call (under 10 minutes): calibrate the machine (<= 60 s; skipped when CAL names a
# calibration), then the proof for each model on each GPU count with that calibration: predicted vs
# measured step time and memory, one JSON line per layout and a summary line per run.
#
#   bash benchmarks/run_planner_proof.sh [model] [layouts]          # gpt-1.3b, 12: on 2 then 4 GPUs
#   MODELS=gpt-6.9b GPUS=4 BUDGET=240 bash benchmarks/run_planner_proof.sh
#   MODELS="llama-8b mixtral-4b" GPUS=2 CAL=h200 bash benchmarks/run_planner_proof.sh
#
# MODELS: presets of behemoth.models (gpt-1.3b, gpt-6.7b, llama-8b, mixtral-4b, ...) or gpt-6.9b
# (gpt-6.7b with its own head table, as bench_gpt.py builds GPT-6.9B). GPUS: GPU counts (the
# machine must have the largest). LAYOUTS (12), STEPS (timed steps after WARMUP untimed ones; 3, 1).
# BUDGET: seconds per run (default 200), counted from its start (imports, search, every layout's
# build and warm-up): a run starts no layout expected to take it past them, prints a running summary
# after each layout and a final one, and is stopped BUDGET + 60 s after it starts. A run whose
# processes die before the final summary (a failed layout taking NCCL down, or a layout that failed
# on one rank while the others waited in its collectives: planner_proof.py ends those within 30 s)
# is started again, up to five times while the budget lasts, with --resume: the layouts done are
# kept, the one it died in counts as failed. The collectives' timeout (BEHEMOTH_TIMEOUT, 120 s
# unless set) ends a run blocked in any other way before the outer timeout.
# CAL: a calibration (h100, h200, a JSON path) instead of calibrating. EXTRA: more flags for
# planner_proof.py (e.g. --no-offload, --steps 3). PLANS: layouts to run first, as
# Plan.describe() prints them, separated by ';' (e.g. an earlier run's, to compare). RESUME: the
# rows file of an earlier call of the same run (same model, GPUs, CAL and flags): it goes on from
# there, across device calls (a run longer than one call's limit).
set -u
MODELS=${MODELS:-${1:-gpt-1.3b}}; LAYOUTS=${LAYOUTS:-${2:-12}}; GPUS=${GPUS:-2 4}
STEPS=${STEPS:-3}; WARMUP=${WARMUP:-1}; BUDGET=${BUDGET:-200}; EXTRA=${EXTRA:-}
out=${OUT:-/tmp}
export BEHEMOTH_TIMEOUT=${BEHEMOTH_TIMEOUT:-120}
source "$(dirname "$0")/env.sh" "$out/planner_proof.log"
most=$(printf '%s\n' $GPUS | sort -n | tail -1)
if [ -n "${CAL:-}" ]; then
  cal=$CAL
else
  timeout 90 torchrun --standalone --nproc-per-node "$most" benchmarks/calibrate.py --out "$out/calibration.json" \
    > "$out/calibrate.log" 2>&1 || {
    # a calibration that failed (or that the planner rejects) is not used: the shipped one of the card
    rm -f "$out/calibration.json"
    echo "calibration failed: see calibrate.log; the shipped calibration is used" | tee -a "$out/planner_proof.log"
  }
  cal="$out/calibration.json"
  [ -f "$cal" ] || { cal=h100; nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && cal=h200; }
fi
for model in $MODELS; do
  case $model in
    gpt-6.9b) args=(--model gpt-6.7b --untied) ;;
    *) args=(--model "$model") ;;
  esac
  [ -n "${PLANS:-}" ] && args+=(--include "$PLANS")
  for n in $GPUS; do
    devs=$(seq -s, 0 $((n - 1)))
    echo "# $model on $n GPUs, calibration $cal, $(date -u +%H:%M:%S)" | tee -a "$out/planner_proof.log"
    # a run that ends early (a rank killed by an error its layout caused) is resumed without the
    # layouts it finished, the one it ended inside counted as failed, within the same budget
    rows="$out/proof_${model}_${n}gpus.jsonl"; : > "$rows"; start=$(date +%s)
    # RESUME: an earlier call's rows of this run (its summaries dropped), whose layouts are kept
    [ -n "${RESUME:-}" ] && grep -v '"summary": true' "$RESUME" > "$rows"
    for attempt in 1 2 3 4 5 6; do
      left=$((BUDGET - ($(date +%s) - start)))
      [ "$left" -gt 20 ] || break
      resume=(); [ -s "$rows" ] && resume=(--resume "$rows")
      before=$(wc -l < "$rows")
      CUDA_VISIBLE_DEVICES=$devs timeout $((left + 60)) torchrun --standalone --nproc-per-node "$n" \
        benchmarks/planner_proof.py "${args[@]}" --layouts "$LAYOUTS" --steps "$STEPS" --warmup "$WARMUP" --budget-s "$left" \
        --calibration "$cal" ${resume[@]+"${resume[@]}"} $EXTRA 2>>"$out/planner_proof.err" | tee -a "$out/planner_proof.log" "$rows"
      grep -q '"final": true' "$rows" && break
      # an attempt that wrote nothing fails before its first layout (the same way each time): stop
      [ "$(wc -l < "$rows")" -gt "$before" ] || { echo "# no layout ran in attempt $attempt: stopped" | tee -a "$out/planner_proof.log"; break; }
      echo "# the run ended before its summary (attempt $attempt); resuming" | tee -a "$out/planner_proof.log"
    done
  done
done

#!/usr/bin/env bash
# One device call (4 GPUs, under 10 minutes): calibrate the machine (<= 60 s), then the proof on 2 and
# 4 GPUs with that calibration: predicted vs measured step time and memory, one JSON line per
# layout.   Usage: bash benchmarks/run_planner_proof.sh [model] [layouts]
set -u
model=${1:-gpt-1.3b}; layouts=${2:-12}
out=${OUT:-/tmp}
source "$(dirname "$0")/env.sh" "$out/planner_proof.log"
timeout 90 torchrun --standalone --nproc-per-node 4 benchmarks/calibrate.py --out "$out/calibration.json" \
  > "$out/calibrate.log" 2>&1 || { echo "calibration failed: see calibrate.log" | tee -a "$out/planner_proof.log"; }
cal="$out/calibration.json"; [ -f "$cal" ] || cal=h100
for n in 2 4; do
  devs=$(seq -s, 0 $((n - 1)))
  CUDA_VISIBLE_DEVICES=$devs timeout 240 torchrun --standalone --nproc-per-node "$n" benchmarks/planner_proof.py \
    --model "$model" --layouts "$layouts" --calibration "$cal" 2>>"$out/planner_proof.err" | tee -a "$out/planner_proof.log"
done

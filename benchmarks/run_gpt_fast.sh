#!/usr/bin/env bash
# One device call on 2 GPUs: the gpt-fast peer (benchmarks/peer_gpt_fast.py: pytorch-labs/gpt-fast's
# own code, Llama-3-8B shape, random bf16 weights, decode step compiled as its --compile, greedy)
# at tp = 1 and tp = 2, for batch 1 (prompt 128, 256 new tokens) and batch 64 (prompt 512, 128 new).
# Needs the gpt-fast snapshot at peers/gpt-fast (or GPT_FAST=DIR).   Usage: bash benchmarks/run_gpt_fast.sh
set -u
out=${OUT:-/tmp}
source "$(dirname "$0")/env.sh" "$out/gpt_fast.log"
run() { echo "## $*" | tee -a "$out/gpt_fast.log"; timeout 600 "$@" 2>&1 | grep -E "RESULT|Error|error" | tail -40 | tee -a "$out/gpt_fast.log"; }
cases="--gpt-fast ${GPT_FAST:-peers/gpt-fast} --compile --batch 1,64 --prompt 128,512 --new 256,128"
run python3 benchmarks/peer_gpt_fast.py --tp 1 $cases
run torchrun --standalone --nproc-per-node 2 benchmarks/peer_gpt_fast.py --tp 2 $cases

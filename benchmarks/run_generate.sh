#!/usr/bin/env bash
# One device call on 4 GPUs: generation with behemoth's Llama at the Llama-3-8B shape (bf16, random
# weights, batch 1, prompt 128, 256 new tokens) at tp = 1, 2, 4, eager and with the decode step
# compiled (the whole decode step one CUDA graph, with and without the one-shot all-reduce at tp > 1),
# transformers' generate as the peer in the same run; transformers' own tensor parallelism
# (tp_plan="auto") at tp = 2 and 4, batch 1 and 64; then 2D against 1D at tp = 4 for batch 1, 8,
# 64, 256.   Usage: bash benchmarks/run_generate.sh
set -u
out=${OUT:-/tmp}
source "$(dirname "$0")/env.sh" "$out/generate.log"
run() { echo "## $*" | tee -a "$out/generate.log"; timeout 900 "$@" 2>&1 | grep -E "RESULT|PROFILE|Error|error" | tail -120 | tee -a "$out/generate.log"; }
tr="torchrun --standalone --nproc-per-node 4"
run $tr benchmarks/generate.py --profile
run $tr benchmarks/generate.py --compile --one-shot both --no-peer --profile
run env CUDA_VISIBLE_DEVICES=0,1 torchrun --standalone --nproc-per-node 2 benchmarks/peer_hf_tp_generate.py --batch 1,64
run $tr benchmarks/peer_hf_tp_generate.py --batch 1,64
run $tr benchmarks/generate.py --sweep 2d-vs-1d

#!/usr/bin/env bash
# One device call on one GPU: DeepSpeed ZeRO-Offload (peer_deepspeed.py, stage 2, optimizer on
# the CPU) vs behemoth on the same card, host and model: ZeRO-3 offload="auto" and, the same
# mechanism as ZeRO-Offload, ZeRO-2 offload="cpu" (fp32 and bf16 parameters). DeepSpeed's wheels must be in .whl (see
# peer_deepspeed.py's docstring; the run names .whl in carry).
#   bash benchmarks/run_deepspeed.sh 6.7b 8          (log in $OUT/deepspeed.log; SKIP_FP32=1 skips zero 2 with fp32 parameters,
#                                                     SKIP_AUTO=1 zero 3 auto, SKIP_BF16=1 zero 2 with bf16
#                                                     parameters, SKIP_DS=1 DeepSpeed; BH_LIMIT: zero 3 auto's
#                                                     seconds, AUTO_EXTRA: its extra bench_gpt.py flags, e.g.
#                                                     "--param-dtype bf16"; DS_STAGE: DeepSpeed's stage, 2 or 3)
set -u
size=${1:-6.7b}; mbs=${2:-8}
out=${OUT:-/tmp}
log="$out/deepspeed.log"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
source "$(dirname "$0")/env.sh" "$log"
free -g | head -2 | tee -a "$log"; echo "cores: $(nproc)" | tee -a "$log"
run() {   # name, seconds, command...
  local name=$1 t=$2; shift 2
  echo "## $name" | tee -a "$log"
  timeout "$t" torchrun --standalone --nproc-per-node 1 "$@" > "$out/$name.txt" 2>&1
  echo "rc=$?" | tee -a "$log"
  grep -E "RESULT|OutOfMemory|MemoryError|Killed|Error" "$out/$name.txt" | tail -3 | tee -a "$log"
}
stage=${DS_STAGE:-2}
[ -z "${SKIP_DS:-}" ] && run deepspeed-z$stage-$size "${DS_LIMIT:-300}" benchmarks/peer_deepspeed.py --size "$size" --stage "$stage" --mbs "$mbs" --ckpt --steps 5
# AUTO_EXTRA is split into flags on purpose
# shellcheck disable=SC2086
[ -z "${SKIP_AUTO:-}" ] && run bh-auto-$size "${BH_LIMIT:-150}" benchmarks/bench_gpt.py --size "gpt-$size" --mbs "$mbs" --ckpt --steps 6 --zero 3 --offload auto --host-init ${AUTO_EXTRA:-}
[ -z "${SKIP_FP32:-}" ] && run bh-zero2-cpu-$size 200 benchmarks/bench_gpt.py --size "gpt-$size" --mbs "$mbs" --ckpt --steps 6 --zero 2 --offload cpu
# DeepSpeed's bf16 numerics: bf16 parameters on the GPU (fp32 masters on the host), no autocast
[ -z "${SKIP_BF16:-}" ] && run bh-zero2-cpu-bf16-$size 200 benchmarks/bench_gpt.py --size "gpt-$size" --mbs "$mbs" --ckpt --steps 6 --zero 2 --offload cpu --param-dtype bf16

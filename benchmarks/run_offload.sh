#!/usr/bin/env bash
# One device call on one GPU: plain PyTorch (peer_baseline.py, AdamW, bf16 autocast, activation
# checkpointing) vs behemoth ZeRO-3 with offload="auto" on the same card and host.
#   bash benchmarks/run_offload.sh plain:6.7b:8 bh:6.7b:8 bh:13b:4 ...   (log in $OUT/offload.log)
set -u
out=${OUT:-/tmp}
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
log="$out/offload.log"
source "$(dirname "$0")/env.sh" "$log"
free -g | head -2 | tee -a "$log"; echo "cores: $(nproc)" | tee -a "$log"
for spec in "$@"; do
  IFS=: read -r who size mbs <<< "$spec"
  if [ "$who" = plain ]; then
    cmd=(benchmarks/peer_baseline.py --size "$size" --mode ddp --mbs "$mbs" --ckpt --steps "${STEPS:-7}")
  else
    cmd=(benchmarks/bench_gpt.py --size "gpt-$size" --mbs "$mbs" --ckpt --steps "${STEPS:-7}" --zero 3 --offload auto --host-init ${EXTRA:-})
  fi
  echo "## $who $size mbs=$mbs" | tee -a "$log"
  timeout "${LIMIT:-300}" torchrun --standalone --nproc-per-node 1 "${cmd[@]}" > "$out/$who-$size.txt" 2>&1
  echo "rc=$?" | tee -a "$log"
  grep -E "RESULT|OutOfMemory|MemoryError|Kept|Offloaded|budget|Predicted|after boost|^step|^setup" "$out/$who-$size.txt" | tail -14 | tee -a "$log"
done

# Sourced by every benchmarks/run_*.sh: the environment each GPU run uses (behemoth from src/,
# unbuffered output, NVLink multicast off) and the cards (name, memory) written to the top of
# the run's log.   Usage: source "$(dirname "$0")/env.sh" LOGFILE
export PYTHONPATH=$PWD/src:${PYTHONPATH:-} PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee -a "$1"

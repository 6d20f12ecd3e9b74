"""The host kernels of ZeRO offload's CPU update, timed on this machine: PyTorch's fused CPU
AdamW, the gradient's vector_norm and the fp32 -> bf16 conversion of a master into a pinned
staging buffer, on one chunk-sized shard, in the main thread and in a worker thread set up as
behemoth's CPU-update worker is (zero/overlap.py). Tells whether the worker's per-step time is
the kernels' or something around them.

    python benchmarks/cpu_kernels.py [elements, default 256M]
"""

from __future__ import annotations

import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch


def timed(fn, reps: int = 3) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps


def kernels(n: int) -> dict[str, float]:
    pin = torch.cuda.is_available()
    master = torch.randn(n, pin_memory=pin)
    grad = torch.randn(n, pin_memory=pin)
    low = torch.empty(n, dtype=torch.bfloat16, pin_memory=pin)
    p = torch.nn.Parameter(master)
    p.grad = grad
    opt = torch.optim.AdamW([p], lr=1e-4, fused=True)
    return {
        "threads": torch.get_num_threads(),
        "adamw_gparam_s": n / timed(opt.step) / 1e9,
        "norm_gb_s": 4 * n / timed(lambda: torch.linalg.vector_norm(grad)) / 1e9,
        "to_bf16_gb_s": 4 * n / timed(lambda: low.copy_(master)) / 1e9,
    }


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 256 * 2**20
    print("main thread:", {k: round(v, 2) for k, v in kernels(n).items()}, flush=True)
    with ThreadPoolExecutor(1, initializer=torch.set_num_threads, initargs=(torch.get_num_threads(),)) as pool:
        print("worker thread:", {k: round(v, 2) for k, v in pool.submit(kernels, n).result().items()}, flush=True)


if __name__ == "__main__":
    main()

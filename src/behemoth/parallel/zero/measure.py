"""What ``offload='auto'`` measures about this machine before it places chunks: the pinned
host->device bandwidth, the CPU optimizer's update rate and the host's available memory
(:class:`~.optimizer.ZeroOptimizer` feeds them to :func:`~.placement.static_split`)."""
from __future__ import annotations

import time

import torch

__all__ = ["cpu_update_rate", "host_available", "host_bandwidth"]


def cpu_update_rate(cls, defaults: dict, fused_cpu=()) -> float:
    """Measured fp32 parameter bytes per second the CPU optimizer ``cls`` updates (its fused CPU
    kernel when ``cls.__name__`` is in ``fused_cpu``). The update streams parameter, gradient and
    state through memory: measured on 32M elements (0.5 GB with Adam's two moments), past the
    last-level cache, or the rate is the cache's (measured on 4M elements, the 64-core host of the
    22B benchmark predicted 0.43 s for a CPU update of 17B parameters)."""
    n = 1 << 25
    p = torch.zeros(n)
    p.grad = torch.full((n,), 1e-3)
    kw = {k: v for k, v in defaults.items() if k not in ("fused", "foreach")}
    opt = cls([p], **kw, **({"fused": True} if cls.__name__ in fused_cpu else {}))
    opt.step()
    t0 = time.perf_counter()
    for _ in range(3):
        opt.step()
    return 3 * 4 * n / (time.perf_counter() - t0)


def host_available() -> int | None:
    """MemAvailable of this host in bytes (Linux), else None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def host_bandwidth(device: torch.device) -> float:
    """Measured pinned host->device bandwidth in bytes/s (25e9, PCIe 4 x16, on a CPU run)."""
    if device.type != "cuda":
        return 25e9
    src = torch.empty(64 * 2**20, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty_like(src, device=device)
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(4):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize(device)
    return 4 * src.numel() / (time.perf_counter() - t0)

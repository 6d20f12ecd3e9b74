"""What ``offload='auto'`` measures before it places chunks: the pinned host->device bandwidth,
the CPU optimizer's update rate and the host's available memory (:class:`~.optimizer.ZeroOptimizer`
feeds them to :func:`~.placement.static_split`), and the warm-up step's peak of non-model device
memory (:class:`OtherPeak`); and the memory tracer (:func:`memory_report`): model data vs
other data per device."""

from __future__ import annotations

import time

import torch

__all__ = ["OtherPeak", "cpu_update_rate", "host_available", "host_bandwidth", "memory_report", "optimizer_state_bytes"]


class OtherPeak:
    """The peak of a step's device memory that is not model data (activations, the loss's
    logits, workspaces, chunks in flight), which ``offload='auto'`` measures in its warm-up
    step to size the budget of model data for the steps after it.

    Read in segments between the gather hooks' calls (:meth:`sample`, every module boundary
    forward and backward): each segment's allocator peak minus the *smaller* of the model data
    at its two ends. One reading at the end of the step (its peak minus the model data then)
    is wrong by the gradients: they appear during the backward, after the peak of the
    activations, so subtracting them counts as free what the peak's moment did not hold
    (GPT-13B on one H200: 5.5 GiB measured, the next step out of memory). A chunk gathered
    inside a segment counts as other data there: the error is on the safe side.

    ``model_bytes()``, ``peak()`` and ``reset()`` are the store's model bytes on the device
    and the allocator's peak and its reset (injected, so that the arithmetic is tested on a
    machine without a GPU). Resetting the peak means the warm-up step's
    ``torch.cuda.max_memory_allocated()`` covers only its last segment."""

    def __init__(self, model_bytes, peak, reset) -> None:
        self.model_bytes, self.peak, self.reset = model_bytes, peak, reset
        self.value = 0
        self._model: int | None = None

    @property
    def running(self) -> bool:
        return self._model is not None

    def start(self) -> None:
        """At the start of the step (again after an out-of-memory retry)."""
        self.value, self._model = 0, self.model_bytes()
        self.reset()

    def sample(self) -> None:
        if self._model is None:
            return
        now = self.model_bytes()
        self.value = max(self.value, self.peak() - min(self._model, now))
        self._model = now
        self.reset()

    def finish(self) -> int | None:
        """The step's peak of other data, or None if :meth:`start` was not called."""
        if self._model is None:
            return None
        self.sample()
        self._model = None
        return self.value


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


OFFLOAD_HOST_SHARE = 0.9
"""The share of the host's available memory offloaded chunks may take (the rest for the process,
the data loader and the page cache): the placement's budget and the check before allocating."""


def offload_host_budget(ranks_on_host: int) -> float | None:
    """Host bytes one of ``ranks_on_host`` ranks may give its offloaded chunks, by the share the
    runtime allows (:data:`OFFLOAD_HOST_SHARE` of MemAvailable, split evenly): what ``plan="auto"``
    and the planner's proof plan with. None where the host does not say."""
    avail = host_available()
    return None if avail is None else OFFLOAD_HOST_SHARE * avail / max(1, ranks_on_host)


def agreed_offload_host_budget(world: int) -> float | None:
    """:func:`offload_host_budget` for this host's ranks (``LOCAL_WORLD_SIZE``), the least any of
    the ``world`` ranks reads (one all-reduce over the default group), so that every rank plans with
    the same figure: what ``plan="auto"`` and the planner's proof search with. None where a host
    does not say."""
    import os

    import torch.distributed as dist

    from ...comm import Axis, all_reduce_scalars
    from ...ledger import Ledger

    mine = offload_host_budget(int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    axis = Axis("world", world, dist.get_rank(), tuple(range(world)), None, Ledger())
    (least,) = all_reduce_scalars([-1.0 if mine is None else mine], axis, "min")
    return None if least < 0 else least


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


def optimizer_state_bytes(optimizer: torch.optim.Optimizer, device_type: str) -> int:
    """Bytes of ``optimizer``'s state tensors on ``device_type``."""
    return sum(
        v.numel() * v.element_size()
        for st in optimizer.state.values()
        for v in st.values()
        if isinstance(v, torch.Tensor) and v.device.type == device_type
    )


def memory_report(model_bytes, optimizer: torch.optim.Optimizer) -> dict[str, dict[str, int]]:
    """The memory tracer: per device type (``'cuda'``, ``'cpu'``), the model data one rank holds
    now -- ``model_bytes(device_type)`` (parameters, gradients, masters) plus the optimizer's
    state -- and, on a GPU, ``other`` = allocated - model data (activations, workspaces,
    gathered chunks in flight)."""
    report = {}
    for dev in ("cuda", "cpu"):
        d = dict(model_bytes(dev))
        d["optimizer"] = optimizer_state_bytes(optimizer, dev)
        if dev == "cuda" and torch.cuda.is_available():
            d["other"] = max(0, torch.cuda.memory_allocated() - sum(d.values()))
        report[dev] = d
    return report

"""``plan="auto"``: the plan the search ranks first for a model on this job's devices.

:func:`auto_plan` reads the model's shape (a preset name, a config, or a model with a
``.config``), builds a :class:`~.cluster.Cluster` of ``world`` GPUs and returns the fastest
plan that fits (:func:`~.search.search`); it is deterministic, so every rank that calls it
with the same arguments gets the same plan. ``bh.boost(model, optimizer, plan="auto")`` calls
it with the job's world size and the device's memory. Pure: no process group.
"""

from __future__ import annotations

import dataclasses

from ..plan import Plan
from .calibration import Calibration, load_calibration
from .cluster import Cluster
from .search import Limits, SearchResult, search
from .workload import workload_for

__all__ = ["auto_plan", "auto_search"]


def auto_search(
    model,
    world: int,
    *,
    global_batch: int | None = None,
    seq_len: int | None = None,
    gpu_bytes: float | None = None,
    host_bytes: float | None = None,
    gpus_per_node: int = 8,
    calibration: Calibration | str = "h100",
    limits: Limits | None = None,
) -> SearchResult:
    """The ranked search behind :func:`auto_plan` (same arguments)."""
    if not isinstance(world, int) or world < 1:
        raise ValueError(f"auto_plan: world={world!r} must be an integer >= 1 (the number of GPUs).")
    cal = calibration if isinstance(calibration, Calibration) else load_calibration(calibration)
    w = workload_for(model, seq_len=seq_len, global_batch=global_batch or 8 * world)
    kw = {} if host_bytes is None else {"host_bytes": host_bytes}
    cluster = Cluster(
        num_gpus=world, gpus_per_node=min(gpus_per_node, world), gpu_bytes=gpu_bytes, calibration=cal, **kw
    )
    return search(w, cluster, limits)


def auto_plan(model, world: int, **kwargs) -> Plan:
    """The fastest plan that fits ``model`` on ``world`` GPUs, by the cost model.

    ``global_batch`` (sequences per step; default 8 per GPU), ``seq_len`` (default the
    model's), ``gpu_bytes`` / ``host_bytes`` per GPU (default the calibration's / 256 GiB),
    ``gpus_per_node`` (8), ``calibration`` (a shipped name or a ``Calibration``), ``limits``
    (:class:`~.search.Limits`). Raises ``ValueError`` naming what the fastest plan would need
    when none fits."""
    res = auto_search(model, world, **kwargs)
    if not res.ranked:
        need = res.unfit.why_not if res.unfit else "no legal plan for this model and world size"
        raise ValueError(
            f"auto_plan: no plan fits {world} GPU(s): the best one {need}. Add GPUs or memory "
            f"(gpu_bytes / host_bytes), lower the global batch or the sequence length."
        )
    best = res.best.plan
    return dataclasses.replace(best, dp=None)  # the world fills it again at boost

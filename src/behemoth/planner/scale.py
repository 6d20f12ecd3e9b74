"""Simulation at scale: one model on 64-1,024 GPUs (NVLink islands of ``gpus_per_node``,
inter-node bandwidth and latency as parameters), a per-step breakdown of each scale's best
plan, and where 2D / 2.5D / 3D tensor parallelism overtake 1D.

Two views per GPU count and tensor-parallel mode:

* **pure** -- every GPU in one tensor-parallel group (dp = pp = cp = 1), the setting of
  Optimus's and Tesseract's experiments; each mode's best variant (sequence parallelism,
  over-decomposition, ZeRO, micro-batches, checkpointing) by the cost model;
* **best** -- the full search restricted to that mode (tp may be 1: a mode that never pays
  for itself shows as the plain-dp/pp optimum).

:func:`overtakes` names, per mode, the smallest GPU count at which it predicts a faster
step than 1D in a view. Pure; ``behemoth plan --scale MODEL`` prints it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from .cluster import Cluster
from .cost import Prediction
from .search import Limits, search
from .workload import Workload

__all__ = ["ScalePoint", "scale_sweep", "overtakes", "format_sweep"]

MODES = ("1d", "2d", "2.5d", "3d")


@dataclass(frozen=True)
class ScalePoint:
    gpus: int
    mode: str
    view: str
    """'pure' or 'best'."""
    best: Prediction | None
    """The mode's fastest plan that fits (None: no legal plan of that mode fits)."""


def _pure_ok(mode: str, n: int) -> bool:
    if mode == "2d":
        return math.isqrt(n) ** 2 == n
    if mode == "3d":
        return round(n ** (1 / 3)) ** 3 == n
    if mode == "2.5d":
        return any(n % d == 0 and math.isqrt(n // d) ** 2 == n // d and n // d > 1 for d in range(2, n + 1))
    return True


def scale_sweep(
    w: Workload,
    cluster: Cluster,
    gpu_counts=(64, 128, 256, 512, 1024),
    *,
    views=("pure", "best"),
    limits: Limits | None = None,
) -> list[ScalePoint]:
    """Each view x GPU count x tensor-parallel mode: the best plan (``cluster`` gives the node
    size, memory, calibration and inter-node figures; its ``num_gpus`` is replaced). The global
    batch grows with the GPU count from ``w.global_batch`` at the first count (weak scaling)."""
    base = limits or Limits(top=1)
    out = []
    for n in gpu_counts:
        c = dataclasses.replace(cluster, num_gpus=n)
        wn = dataclasses.replace(w, global_batch=max(1, w.global_batch * n // gpu_counts[0]))
        for view in views:
            for mode in MODES:
                if view == "pure":
                    if not _pure_ok(mode, n):
                        out.append(ScalePoint(n, mode, view, None))
                        continue
                    lim = dataclasses.replace(base, tp_modes=(mode,), min_tp=n, max_tp=n, max_pp=1, max_cp=1, top=1)
                else:
                    lim = dataclasses.replace(base, tp_modes=(mode,), top=1)
                res = search(wn, c, lim)
                out.append(ScalePoint(n, mode, view, res.ranked[0] if res.ranked else None))
    return out


def overtakes(points: list[ScalePoint], view: str) -> dict[str, int | None]:
    """Per mode other than 1D, the smallest GPU count at which its best plan is faster than
    1D's in ``view`` (None: never in the sweep; a count where either has no plan that fits
    compares nothing)."""
    by = {(p.gpus, p.mode): p.best for p in points if p.view == view}
    counts = sorted({p.gpus for p in points})
    out: dict[str, int | None] = {}
    for mode in MODES[1:]:
        out[mode] = None
        for n in counts:
            a, b = by.get((n, mode)), by.get((n, "1d"))
            if a is not None and b is not None and a.step < b.step:
                out[mode] = n
                break
    return out


def format_sweep(points: list[ScalePoint]) -> str:
    lines = []
    for view in sorted({p.view for p in points}, reverse=True):
        lines.append(f"view '{view}': predicted tokens/s (MFU) of each tensor-parallel mode's best plan")
        lines.append(f"{'GPUs':>6}  " + "  ".join(f"{m:>22}" for m in MODES) + "   best plan's step breakdown")
        for n in sorted({p.gpus for p in points}):
            row = {p.mode: p.best for p in points if p.view == view and p.gpus == n}
            cells = [f"{row[m].tokens_per_s:>14,.0f} ({row[m].mfu:.2f})" if row.get(m) else f"{'-':>22}" for m in MODES]
            fastest = min((p for p in row.values() if p), key=lambda p: p.step, default=None)
            brk = ""
            if fastest is not None:
                brk = (
                    f"{fastest.plan.describe()}: compute {fastest.compute:.2f} s, exposed comm "
                    f"{fastest.exposed_comm:.2f} s, bubble {fastest.bubble:.2f} s, optimizer {fastest.optimizer:.2f} s"
                )
            lines.append(f"{n:>6}  " + "  ".join(cells) + "   " + brk)
        ov = overtakes(points, view)
        lines.append(
            "overtakes 1D at: "
            + ", ".join(f"{m} {'from ' + str(g) + ' GPUs' if g else 'not in this sweep'}" for m, g in ov.items())
        )
        lines.append("")
    return "\n".join(lines)

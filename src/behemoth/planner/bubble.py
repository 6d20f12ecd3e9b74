"""Pipeline makespan and bubble from the schedule simulator, cached for the search.

:func:`pipeline_time` runs ``behemoth.parallel.pipeline.simulate`` on the plan's schedule with
times in units of one micro-batch's forward through a stage (so one simulation serves every
layout with the same schedule, ``pp``, micro-batches, virtual stages, backward/forward ratio
and message latency ratio) and scales the makespan back. Past ``SIMULATE_LIMIT`` actions per
rank it uses the closed forms that schedules.py states and its tests check against the
simulator: ``(m + p - 1)(t_f + t_b)`` for GPipe and 1F1B, idle time divided by ``v`` when
interleaved, ``(p - 1) max(t_f, t_bi, t_f + t_bi - t_bw)`` idle per rank for ZB-H1 (the paper's
``(p - 1)(t_f + t_bi - t_bw)`` where ``t_bi >= t_bw``; the simulator's beyond it, checked over
a grid of ``t_bi / t_bw`` splits in tests/unit/test_planner_host.py). Either way the
pipeline's fill and drain add ``2 (p - 1)`` message latencies (the steady state's sends are
asynchronous). Peak in-flight micro-batches (activation memory) come from the same place.
"""

from __future__ import annotations

from functools import lru_cache

from ..parallel.pipeline.schedules import make_schedule
from ..parallel.pipeline.simulate import simulate

__all__ = ["pipeline_time", "peak_inflight", "rank_inflight", "ranks_inflight", "SIMULATE_LIMIT"]

SIMULATE_LIMIT = 512
"""Simulate when a schedule has at most this many actions (``2 pp m v``, ``3 pp m v`` for
zero-bubble); beyond it, the closed forms."""


@lru_cache(maxsize=4096)
def _simulated(schedule: str, pp: int, m: int, v: int, ratio: float, bi: float = 0.5) -> tuple[float, float]:
    acts = make_schedule(schedule, pp, m, v)
    kw = dict(t_f=1.0, t_b=ratio)
    if schedule == "zero-bubble":
        kw.update(t_bi=ratio * bi, t_bw=ratio * (1 - bi))
    r = simulate(acts, pp, **kw)
    return r.makespan, max(r.peak_inflight) / v


def _closed(schedule: str, pp: int, m: int, v: int, ratio: float, bi: float = 0.5) -> tuple[float, float]:
    work = m * (1.0 + ratio)
    if schedule == "gpipe":
        return work + (pp - 1) * (1.0 + ratio), float(m)
    if schedule == "interleaved":
        idle = (pp - 1) * (1.0 + ratio) / v
        return work + idle, float(m) if m <= pp else min(m, pp + (pp - 1) / v)
    if schedule == "zero-bubble":
        t_bi, t_bw = ratio * bi, ratio * (1 - bi)
        idle = (pp - 1) * max(1.0, t_bi, 1.0 + t_bi - t_bw)
        return work + idle, float(min(m, pp))
    return work + (pp - 1) * (1.0 + ratio), float(min(m, pp))


def peak_inflight(schedule: str, pp: int, m: int, v: int) -> float:
    """The most micro-batches whose activations one rank holds at once, in whole-stage units:
    ``m`` for GPipe, ``min(m, pp)`` for 1F1B and ZB-H1, ``pp + (pp - 1)/v`` for the interleaved
    schedule once ``m > pp`` (Narayanan et al.'s ``1 + (p-1)/(p v)`` times 1F1B's); 1 without a pipeline. The simulator's
    ``peak_inflight`` agrees (tests/unit/test_planner_cost.py)."""
    if pp == 1:
        return 1.0
    return _closed(schedule, pp, m, v, 2.0)[1]


def rank_inflight(schedule: str, pp: int, m: int, v: int, rank: int) -> float:
    """The most micro-batches whose activations pipeline rank ``rank`` holds at once, in
    whole-stage units: ``m`` for GPipe, ``min(m, pp - rank)`` for 1F1B (the warm-up forwards a
    rank runs before its first backward, one fewer each rank down the pipeline), for the
    interleaved schedule the simulator's where it is cheap, else ``min(m, pp + (pp - 1 - 2 rank)
    / v)`` (the simulator's when ``m`` is a multiple of ``pp`` above it), and ``min(m, pp)`` on
    every rank for ZB-H1, whose input-gradient pass (BI) keeps the micro-batch's graph
    for its weight-gradient pass (BW: ``retain_graph`` in ``parallel/pipeline/executor.py``), so
    its saved tensors live until BW (the simulator's ``peak_held``). 1 without a pipeline."""
    if pp == 1:
        return 1.0
    return ranks_inflight(schedule, pp, m, v)[rank]


@lru_cache(maxsize=4096)
def ranks_inflight(schedule: str, pp: int, m: int, v: int) -> tuple[float, ...]:
    """:func:`rank_inflight` of every rank, ``(1.0,)`` without a pipeline (cached)."""
    if pp == 1:
        return (1.0,)
    if schedule == "interleaved" and 2 * pp * m * v <= SIMULATE_LIMIT:
        r = simulate(make_schedule(schedule, pp, m, v), pp)
        return tuple(x / v for x in r.peak_inflight)
    if schedule == "zero-bubble":
        return (float(min(m, pp)),) * pp
    if schedule == "gpipe":
        return (float(m),) * pp
    if schedule == "interleaved":
        return tuple(float(min(m, pp + (pp - 1 - 2 * r) / v)) for r in range(pp))
    return tuple(float(min(m, pp - r)) for r in range(pp))


def pipeline_time(
    schedule: str, pp: int, m: int, v: int, t_f: float, t_b: float, t_comm: float = 0.0, t_bi: float | None = None
) -> tuple[float, float, float]:
    """``(makespan, bubble, peak)`` of ``m`` micro-batches through ``pp`` stages, one
    micro-batch's forward and backward through a stage taking ``t_f`` and ``t_b`` seconds and a
    message ``t_comm``; ``bubble = makespan - m (t_f + t_b)``; ``peak``: the most micro-batches
    whose activations a rank holds at once, in whole-stage units. Zero-bubble: ``t_bi`` of
    ``t_b`` is the input-gradient pass (BI), the rest the weight-gradient pass (BW); default half."""
    if pp == 1:
        return m * (t_f + t_b), 0.0, 1.0
    if t_f <= 0:
        return 0.0, 0.0, float(min(m, pp))
    ratio = round(4 * t_b / t_f) / 4  # one simulation serves every ratio within 1/8
    bi = 0.5 if t_bi is None or t_b <= 0 else round(8 * t_bi / t_b) / 8
    fn = _simulated if 3 * pp * m * v <= SIMULATE_LIMIT else _closed
    span, peak = fn(schedule, pp, m, v, ratio, bi)
    # the simulated idle time, rescaled from the rounded ratio to the actual times
    idle = (span - m * (1.0 + ratio)) * (t_f + t_b) / (1.0 + ratio)
    bubble = max(0.0, idle) + 2 * (pp - 1) * t_comm
    return m * (t_f + t_b) + bubble, bubble, peak

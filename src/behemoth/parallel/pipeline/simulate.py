"""The pipeline-schedule simulator: runs a schedule's per-rank action lists against each
other with given action times, rejects dependency violations, deadlocks and channel-order
breaks, and reports makespan, bubble and peak in-flight micro-batches (what
``tests/unit/test_pipeline_schedules.py`` checks, and the pipeline engine runs at build).
Split from :mod:`.schedules` (the schedules themselves); everything is re-exported there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .schedules import BI, BW, Action, B, F, check_fifo, check_schedule, stage_of

__all__ = ["SimResult", "simulate", "render"]


@dataclass(frozen=True)
class SimResult:
    """What :func:`simulate` measured. Per-rank tuples are indexed by pipeline rank."""

    makespan: float
    """Time from the first action's start to the last action's end."""
    busy: tuple[float, ...]
    """Compute time of each rank."""
    idle: tuple[float, ...]
    """``makespan - busy`` of each rank."""
    bubble_fraction: float
    """``sum(idle) / (pp * makespan)``."""
    peak_inflight: tuple[int, ...]
    """Most (micro-batch, chunk) pairs whose F is done and whose B or BI is not: activation memory."""
    peak_held: tuple[int, ...]
    """As ``peak_inflight`` but until B or BW: includes the inputs kept for a pending BW."""
    timeline: tuple[tuple[tuple[Action, float, float], ...], ...]
    """Per rank, ``(action, start, end)`` in execution order."""


def simulate(
    actions: Sequence[Sequence[Action]],
    pp: int,
    *,
    t_f: float = 1.0,
    t_b: float = 2.0,
    t_bi: float = 1.0,
    t_bw: float = 1.0,
    t_comm: float = 0.0,
) -> SimResult:
    """Execute every rank's actions in order under data dependencies; return times and peaks.

    ``t_f``, ``t_b``, ``t_bi``, ``t_bw`` are the times of one micro-batch through one rank's
    share of the model; with ``v`` chunks per rank a chunk takes ``1/v`` of them, so makespans
    of different schedules compare directly. ``t_comm`` is the latency of one message.

    An action starts when its rank is free and its inputs exist: F of (mb, s) needs F of
    (mb, s-1); B/BI of (mb, s) needs F of (mb, s) and B/BI of (mb, s+1); BW needs BI of
    (mb, s). A dependency on another rank arrives ``t_comm`` after it finished (sends are
    asynchronous: a rank never waits for its own sends). Raises ``ValueError`` on a
    structural problem, on a deadlock (naming what each stuck rank waits for), or on a
    channel the receiver consumes out of send order (:func:`check_schedule`).
    """
    for name, t in (("t_f", t_f), ("t_b", t_b), ("t_bi", t_bi), ("t_bw", t_bw), ("t_comm", t_comm)):
        if not t >= 0:
            raise ValueError(f"simulate: {name}={t!r} must be a time >= 0.")
    m, v = check_schedule(actions, pp, fifo=False)  # the FIFO rule after the run: a deadlock says more
    last = pp * v - 1
    dur = {F: t_f / v, B: t_b / v, BI: t_bi / v, BW: t_bw / v}
    done: dict[tuple[str, int, int], float] = {}  # ("F"|"G"|"W", mb, stage) -> end time; G = input grad
    clock = [0.0] * pp
    ptr = [0] * pp
    timeline: list[list[tuple[Action, float, float]]] = [[] for _ in range(pp)]

    def needs(a: Action, s: int) -> list[tuple[str, int, int]]:
        if a.kind == F:
            return [(F, a.microbatch, s - 1)] if s > 0 else []
        if a.kind == BW:
            return [("G", a.microbatch, s)]
        return [(F, a.microbatch, s)] + ([("G", a.microbatch, s + 1)] if s < last else [])

    progress = True
    while progress:
        progress = False
        for r in range(pp):
            while ptr[r] < len(actions[r]):
                a = actions[r][ptr[r]]
                s = stage_of(r, a.chunk, pp)
                deps = needs(a, s)
                if any(d not in done for d in deps):
                    break
                start = max([clock[r]] + [done[d] + (t_comm if d[2] % pp != r else 0.0) for d in deps])
                end = start + dur[a.kind]
                clock[r] = end
                if a.kind == F:
                    done[(F, a.microbatch, s)] = end
                if a.kind in (B, BI):
                    done[("G", a.microbatch, s)] = end
                timeline[r].append((a, start, end))
                ptr[r] += 1
                progress = True
    stuck = [r for r in range(pp) if ptr[r] < len(actions[r])]
    if stuck:
        lines = []
        for r in stuck:
            a = actions[r][ptr[r]]
            s = stage_of(r, a.chunk, pp)
            missing = [d for d in needs(a, s) if d not in done]
            what = ", ".join(
                f"{'F' if k == F else 'input gradient'} of micro-batch {mb} at stage {st} (rank {st % pp})"
                for k, mb, st in missing
            )
            lines.append(f"rank {r} at step {ptr[r]} ({a!r}, stage {s}) waits for {what}")
        raise ValueError(
            "schedule deadlocks: " + "; ".join(lines) + ". Every rank's order must let each "
            "awaited action run first; give the ranks more warm-up forwards or reorder."
        )
    check_fifo(actions, pp, v)
    makespan = max(clock)
    busy = tuple(sum(e - b for _, b, e in tl) for tl in timeline)
    idle = tuple(makespan - x for x in busy)
    return SimResult(
        makespan,
        busy,
        idle,
        sum(idle) / (pp * makespan) if makespan else 0.0,
        tuple(_peak(acts, (B, BI)) for acts in actions),
        tuple(_peak(acts, (B, BW)) for acts in actions),
        tuple(tuple(tl) for tl in timeline),
    )


def _peak(acts: Sequence[Action], release: tuple[str, ...]) -> int:
    live = peak = 0
    for a in acts:
        if a.kind == F:
            live += 1
            peak = max(peak, live)
        elif a.kind in release:
            live -= 1
    return peak


def render(result: SimResult, *, unit: float = 1.0) -> str:
    """ASCII timeline of a simulation, one row per rank, one character per ``unit`` of time.

    Micro-batch ``i`` (mod 10) shows as the digit ``i`` in a forward, the letter ``"ABCDEFGHIJ"[i]``
    in a full backward, ``"abcdefghij"[i]`` in a BI; a BW is ``*`` and idle time ``.``."""
    cells = int(round(result.makespan / unit))
    rows = []
    for r, tl in enumerate(result.timeline):
        row = ["."] * cells
        for a, start, end in tl:
            mb = a.microbatch % 10
            ch = {F: str(mb), B: "ABCDEFGHIJ"[mb], BI: "abcdefghij"[mb], BW: "*"}[a.kind]
            for k in range(int(round(start / unit)), int(round(end / unit))):
                row[k] = ch
        rows.append(f"rank {r}: " + "".join(row))
    return "\n".join(rows)

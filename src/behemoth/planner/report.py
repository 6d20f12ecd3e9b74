"""What ``behemoth plan --search`` prints: the ranked table, why the runner-up lost, and a
Chrome trace of a plan's step (``chrome://tracing`` / Perfetto JSON).

Pure text and dicts from :class:`~.cost.Prediction` objects.
"""

from __future__ import annotations

import json

from ..parallel.pipeline.schedules import make_schedule
from ..parallel.pipeline.simulate import simulate
from .bubble import SIMULATE_LIMIT
from .cost import Prediction
from .search import SearchResult

__all__ = ["table", "explain", "chrome_trace"]

GIB = 2.0**30


def _layout(p: Prediction) -> str:
    plan = p.plan
    parts = [f"dp{plan.dp}"]
    if plan.tp > 1:
        mode = plan.tp_mode + (f"x{plan.tp_depth}" if plan.tp_mode == "2.5d" else "")
        parts.append(f"tp{plan.tp}:{mode}" + ("+sp" if plan.sequence_parallel else "") + (
            f"+ov{plan.tp_overlap}" if plan.tp_overlap > 1 else ""
        ))  # fmt: skip
    if plan.pp > 1:
        sched = plan.schedule + (f"/v{plan.virtual_stages}" if plan.virtual_stages > 1 else "")
        parts.append(f"pp{plan.pp}:{sched}")
    if plan.cp > 1:
        parts.append(f"cp{plan.cp}:{plan.cp_mode}")
    if plan.ep > 1:
        parts.append(f"ep{plan.ep}" + (f"+ov{plan.ep_overlap}" if plan.ep_overlap > 1 else ""))
    parts.append(
        f"z{plan.zero}" + (f"+{plan.offload}" if plan.offload else "") + ("+bf16p" if plan.param_dtype else "")
    )
    parts.append(f"mbs{p.micro_batch_size}x{plan.microbatches}")
    if plan.activation_checkpointing:
        parts.append("ckpt")
    return " ".join(parts)


def _gb(b: float) -> str:
    return f"{b / 1e9:.2f}"


def table(res: SearchResult, rows: int = 10) -> str:
    """The top ``rows`` plans: tokens/s, MFU, step, memory per GPU, GB per axis per step,
    exposed communication, bubble, offload time."""
    head = (
        f"{'#':>3}  {'layout':<46} {'tokens/s':>10} {'MFU':>5} {'step s':>8} {'GiB/GPU':>8}  "
        f"{'GB per axis (tp/cp/dp/pp/ep)':<30} {'exposed s':>9} {'bubble s':>8} {'offload s':>9}"
    )
    lines = [head, "-" * len(head)]
    for i, p in enumerate(res.ranked[:rows], 1):
        ax = "/".join(_gb(sum(p.bytes.get(b, 0.0) for b in _SYNC) if a == "dp" else p.bytes.get(a, 0.0)) for a in
                      ("tp", "cp", "dp", "pp", "ep"))  # fmt: skip
        lines.append(
            f"{i:>3}  {_layout(p):<46} {p.tokens_per_s:>10,.0f} {p.mfu:>5.2f} {p.step:>8.3f} "
            f"{p.memory.gpu_total / GIB:>8.1f}  {ax:<30} {p.exposed_comm:>9.3f} {p.bubble:>8.3f} {p.offload:>9.3f}"
        )
    lines.append(
        f"{res.evaluated:,} layouts costed, {res.fits:,} fit; "
        f"{sum(res.refused.values()):,} candidates refused (Plan's rules or the model's shape)."
    )
    if not res.ranked and res.unfit is not None:
        lines.append(f"nothing fits: the fastest layout, {_layout(res.unfit)}, {res.unfit.why_not}.")
    return "\n".join(lines)


_SYNC = ("dp", "dp_cp", "ep_dp", "ep_dp_cp", "dp_tp", "dp_cp_tp", "ep_dp_tp", "ep_dp_cp_tp")
"""The gradient axes: the dense parameters' (dp, x cp) and the experts' (ep_dp, x cp); under tensor
parallelism an MoE block's parameters' (the same, x tp)."""


def _parts(p: Prediction) -> dict[str, float]:
    return {
        "compute": p.compute / max(1, p.plan.pp) if p.plan.pp > 1 else p.compute,
        "exposed tp": p.exposed.get("tp", 0.0),
        "exposed cp": p.exposed.get("cp", 0.0),
        "exposed ep": p.exposed.get("ep", 0.0),
        "exposed gradient sync": sum(p.exposed.get(a, 0.0) for a in _SYNC),
        "pipeline bubble": p.bubble,
        "host issue (device waits)": p.host_wait,
        "optimizer": p.optimizer,
        "offload": p.offload,
    }


def explain(res: SearchResult) -> str:
    """Why the runner-up lost to the winner: the terms of the step that differ most."""
    if len(res.ranked) < 2:
        return "only one plan fits: nothing to compare." if res.ranked else "no plan fits."
    a, b = res.ranked[0], res.ranked[1]
    pa, pb = _parts(a), _parts(b)
    diffs = sorted(((pb[k] - pa[k], k) for k in pa), reverse=True)
    lines = [
        f"winner:    {_layout(a)}  {a.step:.4f} s/step, {a.memory.gpu_total / GIB:.1f} GiB/GPU",
        f"runner-up: {_layout(b)}  {b.step:.4f} s/step ({100 * (b.step / a.step - 1):+.1f}%), "
        f"{b.memory.gpu_total / GIB:.1f} GiB/GPU",
        "the runner-up spends more on:",
    ]
    for d, k in diffs:
        if d > 1e-6:
            lines.append(f"  {k:<25} {pb[k]:.4f} s vs {pa[k]:.4f} s  (+{d:.4f} s)")
    gains = [(d, k) for d, k in diffs if d < -1e-6]
    if gains:
        lines.append("and saves on:")
        for d, k in sorted(gains):
            lines.append(f"  {k:<25} {pb[k]:.4f} s vs {pa[k]:.4f} s  ({d:.4f} s)")
    if a.plan.ep > 1 or b.plan.ep > 1:
        lines.append("expert all-to-alls (ep_overlap: chunks overlapping the experts' GEMMs):")
        for name, p in (("winner", a), ("runner-up", b)):
            if p.plan.ep > 1:
                hidden = p.comm.get("ep", 0.0) - p.exposed.get("ep", 0.0)
                lines.append(
                    f"  {name:<10} ep_overlap={p.plan.ep_overlap}: {p.comm.get('ep', 0.0):.4f} s, "
                    f"{hidden:.4f} s hidden behind the experts' GEMMs"
                )
    return "\n".join(lines)


def chrome_trace(p: Prediction, path: str | None = None) -> dict:
    """A Chrome trace (``{"traceEvents": [...]}``) of one predicted step: one row of phases
    (compute, bubble, exposed sync, optimizer, offload), one row per axis with its
    communication time and, for a pipeline of at most ``SIMULATE_LIMIT`` actions, one row per
    pipeline rank with every forward and backward as the schedule simulator placed them.
    Written to ``path`` when given."""
    events, t = [], 0.0
    plan = p.plan
    t_f, t_b, t_comm = p.stage_times
    if plan.pp > 1 and t_f > 0 and 3 * plan.pp * plan.microbatches * plan.virtual_stages <= SIMULATE_LIMIT:
        acts = make_schedule(plan.schedule, plan.pp, plan.microbatches, plan.virtual_stages)
        kw = dict(t_f=t_f, t_b=t_b, t_comm=t_comm)
        if plan.schedule == "zero-bubble":
            kw.update(t_bi=t_b / 2, t_bw=t_b / 2)
        for rank, timeline in enumerate(simulate(acts, plan.pp, **kw).timeline):
            for a, start, end in timeline:
                events.append(
                    {
                        "name": f"{a.kind} mb{a.microbatch}" + (f" chunk{a.chunk}" if plan.virtual_stages > 1 else ""),
                        "ph": "X",
                        "pid": 1,
                        "tid": f"pipeline rank {rank}",
                        "ts": start * 1e6,
                        "dur": (end - start) * 1e6,
                    }
                )
    for name, dur in p.phases:
        if dur > 0:
            events.append({"name": name, "ph": "X", "pid": 0, "tid": "step", "ts": t * 1e6, "dur": dur * 1e6})
            t += dur
    for axis, secs in sorted(p.comm.items()):
        events.append(
            {
                "name": f"{axis}: {p.bytes.get(axis, 0.0) / 1e9:.2f} GB, {p.exposed.get(axis, 0.0):.4f} s exposed",
                "ph": "X",
                "pid": 0,
                "tid": f"comm {axis}",
                "ts": 0.0,
                "dur": secs * 1e6,
            }
        )
    trace = {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"plan": p.plan.describe()}}
    if path:
        with open(path, "w") as f:
            json.dump(trace, f)
    return trace

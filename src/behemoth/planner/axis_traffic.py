"""Bytes per mesh axis of one training step of a plan: what the comm ledger would count.

Per axis, for one rank, per optimizer step (``microbatches`` forward + backward passes):

* ``tp`` (every tensor-parallel sub-axis together): :func:`~.traffic.model_traffic` of the
  micro-batch (``seq / cp`` tokens per sequence under context parallelism), once per
  micro-batch; under a pipeline, the blocks of one stage (the embedding's, head's and loss's
  collectives counted on every stage: an upper bound for the middle ones);
* ``cp``: :func:`~.context_traffic.cp_model_traffic` of the stage's layers, per micro-batch;
* ``dp`` (``dp_cp`` under context parallelism, the axis gradients reduce over): ZeRO stage 0
  all-reduces the fp32 gradients once per step, stage 1 reduce-scatters them once, stage 2
  once per micro-batch, stage 3 once per micro-batch after gathering the parameters forward
  and backward; stages 1 and 2 all-gather the updated parameters after the step; and two
  float64 scalars (token count, loss sum) are all-reduced every step. Chunk padding is not
  counted (it is below a chunk per rank);
* ``pp``: every micro-batch's activation sent forward and its input gradient sent backward by
  each of the rank's stages (the residual stream's element size; the ledger books a transfer
  on its sender);
* ``ep``: each MoE layer's dispatch and combine all-to-alls, forward and backward.

The wire bytes use the ring formulas of :mod:`.collectives`. Pure; checked against the ledger
of real runs in tests/dist/test_planner_ledger.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from ..plan import Plan
from .collectives import all_gather_bytes, all_reduce_bytes, reduce_scatter_bytes
from .context_traffic import cp_model_traffic
from .traffic import block_traffic, model_traffic
from .workload import Workload

__all__ = ["Dtypes", "local_params", "step_traffic"]


@dataclass(frozen=True)
class Dtypes:
    """Element sizes: ``compute`` of the Linears' inputs and outputs (2 under bf16 autocast),
    ``stream`` of the residual stream between blocks, ``param`` of parameters and gradients."""

    compute: int = 2
    stream: int = 4
    param: int = 4

    @classmethod
    def of(cls, plan: Plan) -> Dtypes:
        low = plan.precision in ("bf16", "fp16")
        return cls(compute=2 if low else 4, stream=4, param=4)


def _tp_kwargs(plan: Plan) -> dict:
    if plan.tp_mode == "1d":
        return {"sequence_parallel": plan.sequence_parallel}
    if plan.tp_mode in ("2d", "2.5d"):
        return {"depth": plan.tp_depth}
    return {}


def tp_step_bytes(plan: Plan, w: Workload, *, layers: int, edges: bool = True, dt: Dtypes | None = None) -> float:
    """Wire bytes over the tensor-parallel axes for one step of ``layers`` blocks (plus the
    embedding, head and loss when ``edges``)."""
    if plan.tp == 1:
        return 0.0
    dt = dt or Dtypes.of(plan)
    mbs = w.global_batch // (plan.dp * plan.microbatches)
    extra = tuple(sorted(_tp_kwargs(plan).items()))
    block, rest = _tp_micro(plan.tp_mode, w.shape, mbs, w.seq_len // plan.cp, plan.tp, extra, dt)
    return (block * layers + (rest if edges else 0.0)) * plan.microbatches


@lru_cache(maxsize=65536)
def _tp_micro(mode, shape, mbs: int, seq: int, tp: int, extra: tuple, dt: Dtypes) -> tuple[float, float]:
    """(one block's bytes, the embedding's + head's + loss's bytes) of one micro-batch."""
    kw = dict(batch=mbs, seq=seq, tp=tp, dtype_bytes=dt.compute, param_bytes=dt.param, **dict(extra))
    block = block_traffic(mode, shape, **kw).total
    full = model_traffic(mode, shape, stream_bytes=dt.stream, **kw).total
    return block, full - block * shape.num_layers


@lru_cache(maxsize=65536)
def _cp_micro(shape, mbs: int, seq: int, cp: int, mode: str, tp: int, dtype_bytes: int) -> float:
    return cp_model_traffic(shape, batch=mbs, seq=seq, cp=cp, mode=mode, tp=tp, dtype_bytes=dtype_bytes).total


def local_params(plan: Plan, w: Workload, *, layers: int | None = None, edges: bool = True) -> float:
    """Parameters one rank holds before ZeRO sharding: its stage's blocks (all of them when
    ``layers`` is None and pp == 1) split over tp, experts over ep, the embedding and head
    when ``edges``. Replicated norm and bias parameters are counted as split (a small error)."""
    layers = w.shape.num_layers // plan.pp if layers is None else layers
    dense = w.block_params - w.expert_params
    n = layers * (dense / plan.tp + w.expert_params / (plan.ep * plan.tp))
    if edges:
        n += (w.embedding_params + w.head_params) / plan.tp
    return n


def step_traffic(plan: Plan, w: Workload, *, stage: int | None = None, dt: Dtypes | None = None) -> dict[str, float]:
    """Wire bytes per axis one rank sends in one optimizer step under ``plan`` (resolved: ``dp``
    set). ``stage``: the pipeline stage of the rank (None: the last, which holds the head)."""
    dt = dt or Dtypes.of(plan)
    s, m = w.shape, plan.microbatches
    mbs = w.global_batch // (plan.dp * m)
    if mbs * plan.dp * m != w.global_batch:
        raise ValueError(
            f"global batch {w.global_batch} is not dp * microbatches * micro-batch size "
            f"(dp={plan.dp}, microbatches={m})."
        )
    pp = plan.pp
    stage = pp - 1 if stage is None else stage
    layers = s.num_layers // pp + (1 if stage < s.num_layers % pp else 0)
    out: dict[str, float] = {}
    if plan.tp > 1:
        out["tp"] = tp_step_bytes(plan, w, layers=layers, dt=dt)
    if plan.cp > 1:
        one = _cp_micro(s, mbs, w.seq_len, plan.cp, plan.cp_mode, plan.tp, dt.compute)
        out["cp"] = one / s.num_layers * layers * m
    g = plan.dp * plan.cp
    if g > 1:
        edges = pp == 1 or stage in (0, pp - 1)
        grads = local_params(plan, w, layers=layers, edges=edges) * dt.param
        params = local_params(plan, w, layers=layers, edges=edges) * dt.param
        z = plan.zero
        if z == 0:
            b = all_reduce_bytes(grads, g)
        elif z == 1:
            b = reduce_scatter_bytes(grads, g) + all_gather_bytes(params, g)
        elif z == 2:
            b = m * reduce_scatter_bytes(grads, g) + all_gather_bytes(params, g)
        else:
            b = m * (reduce_scatter_bytes(grads, g) + 2 * all_gather_bytes(params, g))
        out["dp_cp" if plan.cp > 1 else "dp"] = b + 2 * all_reduce_bytes(8, g)
    if pp > 1:
        act = mbs * w.seq_len // plan.cp * s.hidden * dt.stream / _tp_stream_split(plan)
        last = pp * plan.virtual_stages - 1
        stages = [c * pp + stage for c in range(plan.virtual_stages)]
        # a rank books what it sends: each stage's activation forward (but the last stage's)
        # and its input gradient backward (but the first stage's), per micro-batch
        out["pp"] = m * act * sum((st < last) + (st > 0) for st in stages)
    if plan.ep > 1 and w.num_experts:
        tokens = mbs * w.seq_len // plan.cp * w.experts_top_k
        one = tokens * s.hidden * dt.compute * (plan.ep - 1) / plan.ep
        out["ep"] = 4 * one * layers * m  # dispatch + combine, forward and backward
    return out


def _tp_stream_split(plan: Plan) -> int:
    """How much of the residual stream one rank sends between stages: 1D tp keeps it whole
    (each tp rank sends its copy), 2D splits it over the q x q grid."""
    if plan.tp_mode in ("2d", "2.5d"):
        return plan.tp
    return 1

"""What one rank holds under a plan: its pipeline stage's blocks, and the parameters of its
tensor-parallel shard of them, before ZeRO sharding -- exactly what ``bh.parallelize`` leaves
on it, tensor by tensor:

=============================  =========  ==========================  ============================
parameter                      1D         2D, 2.5D (d x q x q)        3D (q x q x q)
=============================  =========  ==========================  ============================
Linear weights, token table    / tp       / q**2 (replicated over d)  / q**3
column biases (q, k, v, fc)    / tp       / q                         / q
row biases (out, proj)         whole      / q                         / q
norm weights and biases        whole      / q                         / q
learned position table         whole      / q                         / q
=============================  =========  ==========================  ============================

k and v projections with fewer kv heads than the layout splits the heads (1D: ``K < tp``;
2D / 2.5D: ``K < q``) are replicated: 1D keeps them whole, 2D / 2.5D keep a ``[K D, h/q]``
block (their biases whole). Experts stay whole on every tensor-parallel rank and are split
over ``ep``; the router is replicated. 2.5D is 2D on ``d`` batch slabs: its ``d q q`` ranks hold
the ``q q`` shards of 2D, each replicated over depth. Pure; tests/dist/test_planner_memory.py
checks the counts against parallelized models, rank by rank.
"""

from __future__ import annotations

from functools import lru_cache

from ..parallel.pipeline.partition import estimate_block_costs, virtual_partition
from ..plan import Plan
from .traffic import tp_grid
from .workload import Workload

__all__ = ["block_local_params", "grid_splits", "local_params", "stage_layers", "weight_split"]


def grid_splits(plan: Plan) -> tuple[int, int]:
    """``(weight shards, vector shards)``: how many ways tensor parallelism of ``plan`` cuts a
    Linear's weight (and the token table) and a grid layout's bias, norm or position vector."""
    return _splits(plan.tp, plan.tp_mode, plan.tp_depth)


def _splits(tp: int, tp_mode: str, tp_depth: int) -> tuple[int, int]:
    if tp == 1 or tp_mode == "1d":
        return tp, 1
    q, d = tp_grid(tp, tp_mode, tp_depth)
    return (q**3 if tp_mode == "3d" else q * q), q


def weight_split(plan: Plan) -> int:
    """How many shards tensor parallelism cuts a weight into: tp, but 2.5D's ``d * q * q`` ranks
    hold ``q * q`` shards, each replicated over the depth axis."""
    return grid_splits(plan)[0]


def block_local_params(plan: Plan, w: Workload) -> float:
    """Parameters of one block on one rank (experts split over ``ep``)."""
    return _block(w, plan.tp, plan.tp_mode, plan.tp_depth, plan.ep)


@lru_cache(maxsize=4096)
def _block(w: Workload, tp: int, tp_mode: str, tp_depth: int, ep: int) -> float:
    s = w.shape
    ws, vs = _splits(tp, tp_mode, tp_depth)
    one_d = tp > 1 and tp_mode == "1d"
    h, d, n, k = s.hidden, s.head_dim, s.num_heads, s.num_kv_heads
    bias = 1 if s.linear_bias else 0
    row_bias = h * bias / (1 if one_d else vs)  # out and proj: whole on every 1D rank
    col_bias = tp if one_d else vs  # column biases split as their weight's output: tp (1D) or q (grid)
    # attention: q, out; k and v split with the heads unless there are too few kv heads
    out = (h * n * d) / ws + (n * d * h) / ws + bias * n * d / col_bias + row_bias
    heads_split = tp if one_d else vs
    if k < heads_split and k < n:  # replicated k and v projections
        kv_w = k * d * h if one_d else k * d * h / vs
        out += 2 * (kv_w + bias * k * d)
    else:
        out += 2 * (k * d * h / ws + bias * k * d / col_bias)
    # MLP: dense, or experts whole on every tp rank (over ep) and a replicated router
    if w.num_experts:
        out += w.expert_params / ep + h * w.num_experts
    else:
        f, up = s.ffn_hidden, (2 if s.gated_mlp else 1)
        out += (up * h * f + f * h) / ws + bias * up * f / col_bias + row_bias
    return out + 2 * s.norm_params / vs


def local_params(plan: Plan, w: Workload, *, layers: int | None = None, stage: int | None = None) -> float:
    """Parameters one rank holds before ZeRO sharding: ``layers`` blocks (default: its share of
    them, :func:`block_local_params` each), and the parts of its pipeline stage: the whole
    model's embeddings, final norm and head without a pipeline (``stage`` None); the
    embeddings on the first stage; the final norm and the head's table (its own, or its copy
    of a tied embedding) on the last."""
    s = w.shape
    if layers is None:
        layers = stage_layers(plan, w)[plan.pp - 1 if stage is None else stage]
    ws, vs = grid_splits(plan)
    table = s.vocab_size * s.hidden / ws
    embeddings = table + s.max_positions * s.hidden / vs
    head = s.norm_params / vs + (0 if w.tied_embeddings else table)
    n = layers * block_local_params(plan, w)
    last = plan.pp * plan.virtual_stages - 1
    stages = None if stage is None or plan.pp == 1 else {c * plan.pp + stage for c in range(plan.virtual_stages)}
    if stages is None:
        return n + embeddings + head
    if 0 in stages:
        n += embeddings
    if last in stages:
        n += s.norm_params / vs + table
    return n


def stage_layers(plan: Plan, w: Workload) -> tuple[int, ...]:
    """Blocks each pipeline rank holds (over its chunks): the runtime's own balanced split
    (``behemoth.parallel.pipeline.partition``: blocks by estimated cost, the embedding on the
    first stage, the head on the last) where its O(stages x blocks**2) search is cheap (up to
    ``EXACT_SPLIT_WORK``); past that, blocks dealt out evenly (the first ranks one more)."""
    if plan.pp == 1:
        return (w.shape.num_layers,)
    return _stage_layers(w.shape, w.seq_len, plan.pp, plan.virtual_stages)


EXACT_SPLIT_WORK = 200_000


@lru_cache(maxsize=1024)
def _stage_layers(shape, seq: int, pp: int, v: int) -> tuple[int, ...]:
    n = shape.num_layers
    if pp * v * n * n > EXACT_SPLIT_WORK:
        return tuple(n // pp + (1 if r < n % pp else 0) for r in range(pp))
    costs = estimate_block_costs(shape, seq_len=seq)
    split = virtual_partition(costs.blocks, pp, v, first_extra=costs.first_extra, last_extra=costs.last_extra)
    return tuple(sum(b - a for a, b in chunks) for chunks in split)

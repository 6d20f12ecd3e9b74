"""Bytes per mesh axis of one training step of a plan: what the comm ledger would count.

Per axis, for one rank, per optimizer step (``microbatches`` forward + backward passes):

* ``tp`` (every tensor-parallel sub-axis together): :func:`~.traffic.model_traffic` of the
  micro-batch (``seq / cp`` tokens per sequence under context parallelism), once per
  micro-batch; under a pipeline, the blocks of one stage (the embedding's, head's and loss's
  collectives counted on every stage: an upper bound for the middle ones); a checkpointed
  block's recomputed forward runs its forward collectives again, and under the zero-bubble
  schedule a stage with an input gradient runs its blocks' backward collectives twice (BI, then
  BW backpropagating through the stage again), as the ledger books them; under 1D an MoE
  block's token split over tp (its shares' statistics, its output and input gradient gathered:
  :func:`~.tp1d_traffic.tp1d_block_traffic`), under the 2D, 2.5D and 3D grids its grid row's
  all-to-alls of whole rows over ``tp_col`` and its statistics summed over the grid's axes
  (:func:`~.tp2d_traffic.grid_experts_traffic`), a recompute without the exchange that puts its
  output back (:func:`token_split_output_bytes`); its router's and experts' gradients are
  summed in the step's gradient sync instead (``dp_tp`` below);
* ``cp``: :func:`~.context_traffic.cp_model_traffic` of the stage's layers, per micro-batch;
  under the zero-bubble schedule a stage with an input gradient (all but the first) sends the
  backward's share twice: its weight-gradient pass (BW) backpropagates through the attention's
  collectives again, as the ledger shows (the first stage runs one backward);
* ``dp`` (``dp_cp`` under context parallelism, the axis gradients reduce over): ZeRO stage 0
  all-reduces the fp32 gradients once per step, stage 1 reduce-scatters them once, stage 2
  once per micro-batch, stage 3 once per micro-batch after gathering the parameters forward
  and backward; stages 1 and 2 all-gather the updated parameters after the step; the step's
  float64 loss sum (and a MoE model's router losses beside it) is all-reduced over it, its
  float64 token count over ``dp`` alone (every cp rank holds its dp rank's batch); each MoE
  layer all-reduces its balancing statistics (2E + 1 float64) over it every forward, a
  checkpointed block's recompute included (:func:`balance_bytes`); gradients travel in fp32,
  gathered parameters in their own dtype (``param_dtype='bf16'``: 2 bytes); at stages 1-3 the
  step's gradient norm sums each rank's float32 share over it (``parallel/zero/norm.py``). Stage
  3 without a pipeline gathers the chunks its forward ends in (the final norm's to the head's)
  once per micro-batch, not twice: they stay gathered into the backward
  (:func:`~.zero3_traffic.zero3_resident_params`); with activation checkpointing as without (a
  block's recompute gathers its chunks for the backward, which keeps them:
  ``parallel/zero/hooks.py``; with several micro-batches the prefetch window of a checkpointed
  run's trace keeps a few chunks across them, so it gathers fewer than counted). Chunk padding is not counted (it is below a chunk per
  group);
* ``ep_dp`` (``ep_dp_cp`` under context parallelism): under expert parallelism the experts'
  parameters sync over it as the dense ones over ``dp`` (the same ZeRO stage's collectives;
  ``parallel/expert/style.py``'s ``expert_param_axes``); nothing where it has one rank;
* ``dp_tp``, ``ep_dp_tp`` (``dp_cp_tp``, ``ep_dp_cp_tp`` under context parallelism): under
  tensor parallelism (every mode) each tp rank runs an MoE block on its own share of the tokens,
  so the block's parameters, whole on every tp rank, sync over the data axis times tp, once per
  step as the dense ones over the data axis (the same ZeRO stage's collectives,
  :func:`tp_summed_params`): the router, and the experts at ``ep = 1``, over ``dp_tp``; the
  experts under expert parallelism over ``ep_dp_tp`` (:func:`expert_axis`); the data axis then
  syncs the dense parameters alone;
* ``pp``: every micro-batch's activation sent forward and its input gradient sent backward by
  each of the rank's stages (the residual stream's element size; the ledger books a transfer
  on its sender); the all-reduce of a tied embedding's gradient between the first and the
  last stage; the loss sum's all-reduce over the stages;
* ``ep``: each MoE layer's split-size exchange (one even all-to-all of ``ep_overlap * E`` int64
  counts), dispatch and combine all-to-alls forward (one per chunk each, the same rows), the
  reverse pair backward (the pair again in a checkpointed block's recompute, which reuses its
  forward's split sizes, and in zero-bubble's BW); the rows of this tensor-parallel rank's share of
  the tokens (1/tp of them under every tp mode) as if routing were even (the ledger books the
  routed ones): :func:`ep_layer_bytes`; under ``Plan.ep_dedup`` one row per (token,
  member) pair, its routing weights and slots packed after it; at ZeRO stage 0 the step's gradient norm
  sums the experts' float32 share over it (``parallel/zero/norm.py``).

The wire bytes use the ring formulas of :mod:`.collectives`. Pure; checked against the ledger
of real runs in tests/dist/test_planner_ledger.py (mixture-of-experts models:
test_planner_expert_ledger.py, and under the grids test_planner_expert_grid_ledger.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from ..plan import Plan
from .collectives import all_gather_bytes, all_reduce_bytes, reduce_scatter_bytes
from .context_traffic import cp_model_traffic
from .moe_bytes import token_split, tp_summed_params
from .params import local_params, stage_layers, weight_split
from .traffic import block_traffic, model_traffic, tp_grid
from .workload import Workload
from .zero3_traffic import zero3_resident_params

__all__ = [
    "Dtypes",
    "balance_bytes",
    "block_axis",
    "ep_layer_bytes",
    "expert_axis",
    "expert_local_params",
    "member_exchange",
    "members_per_token",
    "step_traffic",
    "token_split_output_bytes",
]


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


def _tp_kwargs(plan: Plan, w: Workload) -> dict:
    experts = {"experts": w.num_experts} if w.num_experts else {}
    if plan.tp_mode == "1d":
        return {"sequence_parallel": plan.sequence_parallel, **experts}
    if plan.tp_mode in ("2d", "2.5d"):
        return {"depth": plan.tp_depth, **experts}
    return experts


def tp_step_bytes(
    plan: Plan,
    w: Workload,
    *,
    layers: int,
    edges: bool = True,
    dt: Dtypes | None = None,
    diagonal: bool = False,
    twice_backward: bool = False,
) -> float:
    """Wire bytes over the tensor-parallel axes for one step of ``layers`` blocks (plus the
    embedding, head and loss when ``edges``); ``diagonal``: a 2D/2.5D rank on its grid's
    diagonal (no embedding swap). Grid modes also all-reduce the step's float64 loss sum (and a
    MoE model's router losses beside it) over each tp axis that splits the batch (2D: one of q; 2.5D: depth and one of q; 3D: two of q).
    Activation checkpointing runs each block's forward collectives again in its backward;
    ``twice_backward`` (a zero-bubble stage with an input gradient) the blocks' backward ones."""
    if plan.tp == 1:
        return 0.0
    dt = dt or Dtypes.of(plan)
    mbs = w.global_batch // (plan.dp * plan.microbatches)
    extra = tuple(sorted(_tp_kwargs(plan, w).items()))
    if plan.tp_mode in ("2d", "2.5d") and diagonal:
        extra += (("diagonal", True),)
    fwd, bwd, rest = _tp_micro(plan.tp_mode, w.shape, mbs, w.seq_len // plan.cp, plan.tp, extra, dt)
    again = fwd - token_split_output_bytes(plan, w, mbs, dt) if plan.activation_checkpointing else 0.0
    block = fwd + bwd + again + (bwd if twice_backward else 0.0)
    total = (block * layers + (rest if edges else 0.0)) * plan.microbatches
    if plan.tp_mode != "1d":
        q, d = tp_grid(plan.tp, plan.tp_mode, plan.tp_depth)
        axes = {"2d": (q,), "2.5d": (d, q), "3d": (q, q)}[plan.tp_mode]
        totals = 2 if w.num_experts else 1  # the loss sum, a MoE model's router losses beside it
        total += sum(all_reduce_bytes(8 * totals, a) for a in axes if a > 1)
    return total


def token_split_output_bytes(plan: Plan, w: Workload, mbs: int, dt: Dtypes) -> float:
    """Wire bytes of the collective that puts one MoE block's output back in the tensor-parallel
    layout from this rank's share of the tokens (``parallel/expert/tokens.py``'s ``give``), per
    micro-batch of ``mbs`` sequences: 1D's all-gather of the ``[T, h]`` output (none under sequence
    parallelism: the block returns its shard), a grid row's all-to-all of its ``T / (tp / q)``
    tokens' rows back to hidden blocks; T padded to a multiple of tp (1D) or those tokens to a
    multiple of q (grids) where the sequence does not divide. A checkpointed block's recompute does
    not run it again: nothing its backward keeps comes after it, and torch's non-reentrant
    checkpoint stops recomputing once it has every kept tensor back. 0 for a dense model."""
    if plan.tp == 1 or not w.num_experts or (plan.tp_mode == "1d" and plan.sequence_parallel):
        return 0.0
    seq = w.seq_len // plan.cp
    h, t = w.shape.hidden, mbs * seq
    if plan.tp_mode == "1d":
        rows = t if seq % plan.tp == 0 else -(-t // plan.tp) * plan.tp
        return all_gather_bytes(rows * h * dt.stream, plan.tp)
    q, _ = tp_grid(plan.tp, plan.tp_mode, plan.tp_depth)
    tokens = t * q // plan.tp
    return all_gather_bytes(-(-tokens // q) * q * h / q * dt.stream, q)


@lru_cache(maxsize=65536)
def _tp_micro(mode, shape, mbs: int, seq: int, tp: int, extra: tuple, dt: Dtypes) -> tuple[float, float, float]:
    """(one block's forward bytes, its backward bytes, the embedding's + head's + loss's bytes)
    of one micro-batch."""
    kw = dict(batch=mbs, seq=seq, tp=tp, dtype_bytes=dt.compute, param_bytes=dt.param, **dict(extra))
    model_only = {k: kw.pop(k) for k in ("diagonal",) if k in kw}
    # an MoE block's token split moves the residual stream's dtype (a dense grid block ignores it)
    block = block_traffic(mode, shape, **kw, stream_bytes=dt.stream)
    full = model_traffic(mode, shape, stream_bytes=dt.stream, **kw, **model_only).total
    return block.forward, block.backward, full - block.total * shape.num_layers


_cp_traffic = lru_cache(maxsize=65536)(cp_model_traffic)  # one per micro-batch shape, shared by the search's plans


def step_traffic(
    plan: Plan, w: Workload, *, stage: int | None = None, dt: Dtypes | None = None, diagonal: bool = False
) -> dict[str, float]:
    """Wire bytes per axis one rank sends in one optimizer step under ``plan`` (resolved: ``dp``
    set). ``stage``: the pipeline stage of the rank (None: the last, which holds the head);
    ``diagonal``: a rank on a 2D/2.5D grid's diagonal (the others send more)."""
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
    layers = stage_layers(plan, w)[stage]
    out: dict[str, float] = {}
    totals = 2 if w.num_experts else 1  # float64 per step: the loss sum, a MoE model's router losses
    zb_twice = plan.pp > 1 and plan.schedule == "zero-bubble" and stage > 0
    if plan.tp > 1:
        out["tp"] = tp_step_bytes(plan, w, layers=layers, dt=dt, diagonal=diagonal, twice_backward=zb_twice)
    if plan.cp > 1:
        t = _cp_traffic(
            s,
            batch=mbs,
            seq=w.seq_len,
            cp=plan.cp,
            mode=plan.cp_mode,
            tp=plan.tp,
            tp_mode=plan.tp_mode,
            tp_depth=plan.tp_depth,
            dtype_bytes=dt.compute,
        )
        fwd, bwd = t.forward, t.backward
        if zb_twice:
            bwd *= 2  # the weight-gradient pass (BW) runs the attention's backward collectives again
        if plan.activation_checkpointing:
            fwd *= 2  # the recomputed forward runs them again
        out["cp"] = (fwd + bwd) / s.num_layers * layers * m
    g = plan.dp * plan.cp
    # under tensor parallelism an MoE block's parameters sync over the data axis times tp (their
    # partial gradients summed there once per step): the router (and the experts at ep = 1) over
    # dp_tp, the experts under expert parallelism over ep_dp_tp (x cp)
    summed = tp_summed_params(plan, w, layers)
    experts = expert_local_params(plan, w, layers)
    if summed:
        out[block_axis(plan)] = _sync_bytes(plan, summed - experts, g * plan.tp, dt)
    if g > 1:
        # the dense parameters (the MoE blocks' sync over their own axes)
        dense = local_params(plan, w, layers=layers, stage=stage if pp > 1 else None) - (summed or experts)
        axis = "dp_cp" if plan.cp > 1 else "dp"
        # the step's loss sum (and a MoE model's router losses beside it); its token count over dp
        # alone (every cp rank holds its dp rank's whole batch: engine.py's _loss_normaliser)
        # ZeRO-3 without a pipeline: the chunks the forward ends in stay gathered into the backward
        z3 = plan.zero == 3 and pp == 1
        resident = zero3_resident_params(plan, w) if z3 else 0
        out[axis] = _sync_bytes(plan, dense, g, dt, resident) + all_reduce_bytes(8 * totals, g)
        if plan.dp > 1:
            out["dp"] = out.get("dp", 0.0) + all_reduce_bytes(8, plan.dp)
        out[axis] += balance_bytes(plan, w) * layers * m * (2 if plan.activation_checkpointing else 1)
        if plan.zero:
            out[axis] += all_reduce_bytes(4, g)  # the step's gradient norm: each rank's fp32 share of it
    if experts and g // plan.ep * plan.tp > 1:
        out[expert_axis(plan)] = _sync_bytes(plan, experts, g // plan.ep * plan.tp, dt)
    if pp > 1:
        act = mbs * w.seq_len // plan.cp * s.hidden * dt.stream / _tp_stream_split(plan)
        last = pp * plan.virtual_stages - 1
        stages = [c * pp + stage for c in range(plan.virtual_stages)]
        # a rank books what it sends: each stage's activation forward (but the last stage's)
        # and its input gradient backward (but the first stage's), per micro-batch
        sent = m * act * sum((st < last) + (st > 0) for st in stages)
        if w.tied_embeddings and (0 in stages) != (last in stages):
            # the tied embedding's two copies, on the first and the last stage, sum their gradients
            sent += all_reduce_bytes(s.vocab_size * s.hidden / weight_split(plan) * dt.param, 2)
        out["pp"] = sent + all_reduce_bytes(8 * totals, pp)  # and the step's loss sum (router losses) over the stages
    if plan.ep > 1 and w.num_experts:
        # dispatch + combine forward and backward; a recomputed forward runs its two row
        # all-to-alls again (it reuses the forward's split sizes: parallel/expert/replay.py)
        splits, one, meta = ep_layer_bytes(plan, w, mbs, dt)
        # (the member exchange's recompute sends its rows alone: its weights and slots are kept)
        rows = 2 * one + meta + (2 * one if plan.activation_checkpointing else 0)
        backward = (2 * one + meta) * (2 if zb_twice else 1)  # zero-bubble's BW runs the reverse pair again
        out["ep"] = (splits + rows + backward) * layers * m
        if plan.zero == 0:
            # the step's gradient norm: the experts' float32 share summed over the ranks that
            # split them (parallel/zero/norm.py)
            out["ep"] += all_reduce_bytes(4, plan.ep)
    return out


def _sync_bytes(plan: Plan, n: float, g: int, dt: Dtypes, resident: float = 0.0) -> float:
    """Wire bytes of the gradient sync of ``n`` parameters over a group of ``g`` ranks: ZeRO
    stage 0 all-reduces the fp32 gradients once per step, 1 reduce-scatters them once, 2 once per
    micro-batch, 3 once per micro-batch after gathering the parameters forward and backward (a
    pipeline stage's ZeRO-2/3 once per step, after its last micro-batch: its gradients accumulate
    in full chunks in between) -- but ``resident`` of them, the chunks the forward ends in, which
    stay gathered into the backward (:func:`.zero3_traffic.zero3_resident_params`): once per
    micro-batch; 1 and 2 all-gather the updated parameters after the step."""
    m = plan.microbatches
    grads, params = n * dt.param, n * (2 if plan.param_dtype == "bf16" else dt.param)
    reductions = m if plan.pp == 1 else 1
    z = plan.zero
    if z == 0:
        return all_reduce_bytes(grads, g)
    if z == 1:
        return reduce_scatter_bytes(grads, g) + all_gather_bytes(params, g)
    if z == 2:
        return reductions * reduce_scatter_bytes(grads, g) + all_gather_bytes(params, g)
    gathered = (2 * n - resident) * (params / n if n else 0.0)
    return reductions * reduce_scatter_bytes(grads, g) + m * all_gather_bytes(gathered, g)


def expert_local_params(plan: Plan, w: Workload, layers: int) -> float:
    """Expert parameters one rank holds in ``layers`` MoE blocks under expert parallelism (their
    gradients sum over ``ep_dp``, not ``dp``: ``parallel/expert/style.py``'s
    ``expert_param_axes``); 0 at ``ep = 1``, where the experts are dense parameters."""
    if plan.ep == 1 or not w.num_experts:
        return 0.0
    return layers * w.expert_params / plan.ep


def expert_axis(plan: Plan) -> str:
    """The axis expert gradients sum over under expert parallelism: ``ep_dp``, ``ep_dp_cp`` under
    context parallelism; times tp (``ep_dp_tp``, ``ep_dp_cp_tp``) under tensor parallelism, whose
    ranks each run their share of the block's tokens."""
    return ("ep_dp_cp" if plan.cp > 1 else "ep_dp") + ("_tp" if plan.tp > 1 else "")


def block_axis(plan: Plan) -> str:
    """The axis an MoE block's other parameters (its router; its experts at ``ep = 1``) sum their
    gradients over under tensor parallelism: the data axis times tp, ``dp_tp`` or ``dp_cp_tp``
    (``parallel/expert/style.py``'s ``expert_param_axes``)."""
    return ("dp_cp" if plan.cp > 1 else "dp") + "_tp"


def balance_bytes(plan: Plan, w: Workload) -> float:
    """Wire bytes of one MoE layer's balancing statistics in one forward: its expert counts, the
    capacity's drops and its token count (2E + 1 float64) all-reduced over the data axis (dp,
    x cp) when it has more than one rank (``parallel/expert/style.py``); 0 for a dense model."""
    g = plan.dp * plan.cp
    if not w.num_experts or g == 1:
        return 0.0
    return all_reduce_bytes((2 * w.num_experts + 1) * 8, g)


def member_exchange(plan: Plan, w: Workload) -> bool:
    """Whether the MoE layers send each token once per ep member holding its experts
    (``parallel/expert/dispatch_members.py``'s ``dedup_applies``): ``Plan.ep_dedup``, ep > 1,
    top-k > 1, more than one expert a member, one chunk (the planner counts no capacity)."""
    ep, e, k = plan.ep, w.num_experts, w.experts_top_k
    return plan.ep_dedup and ep > 1 and k > 1 and e // ep > 1 and plan.ep_overlap == 1


def members_per_token(plan: Plan, w: Workload) -> float:
    """The ep members a token's k experts sit on, on average (``Workload.expert_spread``; by
    default as if drawn uniformly: one minus the chance that none of the k is on a given member,
    times ep)."""
    ep, e, k = plan.ep, w.num_experts, w.experts_top_k
    if w.expert_spread is not None:
        return float(min(w.expert_spread, ep, k))
    return ep * (1 - math.comb(e - e // ep, k) / math.comb(e, k))


def ep_layer_bytes(plan: Plan, w: Workload, mbs: int, dt: Dtypes) -> tuple[float, float, float]:
    """``(splits, rows, meta)``: wire bytes one rank sends per MoE layer and micro-batch of
    ``mbs`` sequences in the split sizes' even all-to-all (int64, one per expert and chunk of
    ``Plan.ep_overlap``; (ep-1)/ep of them leave the rank), in one all-to-all of the rows (a
    dispatch or a combine, all chunks together: the chunks split the same rows) of this tp rank's
    share of the tokens (:func:`~.moe_bytes.token_split`), as if routing were even, in the experts' GEMM dtype (dispatch casts the rows to autocast's before they
    leave: parallel/expert/traffic.py), and the bytes the member exchange packs after each pair's
    row (its k float32 routing weights and k int16 slots, in whole elements of the row; as many
    back in the backward). Under the member
    exchange (:func:`member_exchange`) the rows are the (token, member) pairs
    (:func:`members_per_token` a token) and the split sizes ``E + ep`` int64. 0 without expert
    parallelism."""
    if plan.ep == 1 or not w.num_experts:
        return 0.0, 0.0, 0.0
    leave = (plan.ep - 1) / plan.ep
    tokens = mbs * w.seq_len // plan.cp / token_split(plan)  # the tp ranks route their shares of them
    if member_exchange(plan, w):
        pairs = tokens * members_per_token(plan, w)
        splits = (w.num_experts + plan.ep) * 8 * leave
        meta = -(-w.experts_top_k * 6 // dt.compute) * dt.compute  # k float32 weights, k int16 slots
        return splits, pairs * w.shape.hidden * dt.compute * leave, pairs * meta * leave
    rows = tokens * w.experts_top_k
    return plan.ep_overlap * w.num_experts * 8 * leave, rows * w.shape.hidden * dt.compute * leave, 0.0


def _tp_stream_split(plan: Plan) -> int:
    """How much of the residual stream one rank sends between stages: 1D tp keeps it whole
    (each tp rank sends its copy) but with sequence parallelism splits its sequence (each tp
    rank sends its shard), 2D, 2.5D and 3D split it over their grid (each rank sends its block
    of rows and hidden)."""
    if plan.tp_mode in ("2d", "2.5d", "3d") or (plan.tp_mode == "1d" and plan.sequence_parallel):
        return plan.tp
    return 1

"""Compute time of one micro-batch through one transformer block (and the head), per rank.

A roofline per GEMM shape: each Linear's GEMM ``[m, k] @ [k, n]`` as tensor parallelism
splits it runs at the calibration's rate for its size (:meth:`Calibration.gemm_seconds`):

* 1D (Megatron): a column Linear ``(T, in, out/p)``, a row Linear ``(T, in/p, out)``;
  ``tp_overlap = k`` splits the row GEMMs into k GEMMs of ``T/k`` rows;
* 2D / 2.5D (SUMMA on d x q x q, its q steps' blocks gathered first): one GEMM
  ``(T/(d q), in, out/q)``;
* 3D (q x q x q): one GEMM ``(T/q, in/q, out/q)`` after the gathers; ``tp_overlap = k``
  splits it into k pieces;

with ``T`` the tokens of one micro-batch on this rank's context-parallel share. Backward
runs the input- and weight-gradient GEMMs, twice the forward's work. Causal attention
does ``2 b s**2 D N / (tp cp)`` flops forward per rank at the calibration's attention rate
(its backward at ``attention_backward_ratio`` of it, 2.5 times the flops; both by the length a
kernel sees where the calibration measured them by length: the sequence, or ring's ``s/cp`` blocks), both times the
calibration's ``sustained_ratio``, as GEMMs are (:meth:`Calibration.gemm_seconds`). Norms, residual
adds, activations, rotary embeddings and the activations' casts read and write the bytes
:mod:`.elementwise` counts per token from the blocks' code (under 1D tensor parallelism the
Linears reading one norm's output share its cast), at the calibration's ``elementwise_rate``: the
parts over the hidden width split over tp where the layout shards them (sequence parallelism,
2D, 3D), replicated where it does not (1D); the parts over heads and the MLP's width split
always. Sequence parallelism's gathers and reduce-scatters on the sequence dim copy their
activations around the collectives (:func:`sequence_parallel_copy_seconds`). Under autocast every micro-batch also copies each
parameter this rank holds: its fp32 weight cast to 16 bits in the forward (the executors open one
autocast context per micro-batch, and ZeRO-3 keeps no cache) and the 16-bit weight gradient cast
back to fp32 in the backward, ``CAST_BYTES`` each at HBM speed; with ``param_dtype='bf16'`` only
the gradient's copy into its fp32 chunk. Every micro-batch's gradients are then copied or added
into the gradient sync's fp32 chunks (:func:`accumulate_bytes`), at HBM speed too. Ring
attention (``cp_mode='ring'``) merges each of its ``cp`` steps' block into fp32 accumulators,
``RING_MERGE_BYTES`` per element at HBM speed: the output forward, dQ and the travelling dK/dV
backward; Ulysses copies its tensors around each all-to-all (:func:`ulysses_copy_seconds`). An MoE
layer runs its experts' GEMMs on ``T k ep / E`` rows per local expert on average, ``T`` this rank's
share of the tokens (tensor parallelism splits them over tp: :func:`.moe_bytes.token_split`), each
expert's gate and up projections as one GEMM (under bf16, one grouped call for all the local
experts: at the calibration's :meth:`~.calibration.Calibration.grouped_call_factor` of the table's
rate for the whole call's flops; else each group's GEMMs at the table's rate for their size), under
expert parallelism at the busiest rank's load (:func:`.moe_bytes.busiest_rank_load`), in ``ep_overlap``
chunks of a ``1/ep_overlap`` share each, its routing, dispatch and combine move the bytes
:func:`.moe_bytes.expert_elementwise_bytes` counts, and each extra chunk casts the experts' weights and
sums their gradients once more (:func:`ep_chunk_seconds`). Activation checkpointing adds a forward to
the backward. The first stage's backward also fills the token embedding's dense gradient
(:func:`embedding_backward_seconds`). Pure; tests/unit/test_planner_cost.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..plan import Plan
from .calibration import Calibration
from .elementwise import block_elementwise_bytes, cross_entropy_bytes, norm_bytes
from .moe_bytes import busiest_rank_load, expert_elementwise_bytes, token_split
from .params import block_local_params, weight_split
from .traffic import tp_grid
from .workload import Workload

__all__ = [
    "BlockTimes",
    "block_times",
    "head_times",
    "accumulate_bytes",
    "accumulate_seconds",
    "elementwise_seconds",
    "embedding_backward_seconds",
    "ep_chunk_seconds",
    "sequence_parallel_copy_seconds",
]

CAST_BYTES = 6
"""Bytes per parameter of one dtype-converting copy (read 4 and write 2 bytes, or the reverse)."""
RING_MERGE_BYTES = 10
"""Bytes per element of a ring-attention step's merge into its fp32 accumulator: read it (4) and
the block's 16-bit result (2), write it back (4)."""


def accumulate_bytes(plan: Plan) -> float:
    """Bytes per parameter, per micro-batch on average, that the gradient sync's hooks move after
    a parameter's gradient arrives (``parallel/zero/reduce.py``): where the step's micro-batches
    accumulate in the fp32 gradient chunk (ZeRO 0-1, and every stage under a pipeline), the first
    gradient is copied in (read 4, write 4) and later ones added in place (read 4 + 4, write 4);
    ZeRO-2/3 without a pipeline copy each micro-batch's in and add its reduced shard into the
    optimizer's (``12 / g``). bf16 parameters' 2-byte gradients read 2 where fp32 ones read 4."""
    g = (plan.dp or 1) * plan.cp
    low = 2 if plan.param_dtype == "bf16" else 0
    if plan.zero <= 1 or plan.pp > 1:
        m = plan.microbatches
        return ((8 - low) + (12 - low) * (m - 1)) / m
    return (8 - low) + 12 / g


def _cast_seconds(plan: Plan, params: float, cal: Calibration) -> tuple[float, float]:
    """(forward, backward) seconds of one micro-batch's copies of ``params`` parameters."""
    one = params * CAST_BYTES / cal.hbm_bytes_per_s
    if plan.param_dtype == "bf16":  # computes in its bf16 copies: only the gradient goes to fp32
        return 0.0, one
    if plan.precision in ("bf16", "fp16"):
        return one, one
    return 0.0, 0.0


def accumulate_seconds(plan: Plan, params: float, cal: Calibration) -> float:
    """Seconds of one micro-batch's gradients of ``params`` parameters going into the fp32 chunks
    (in the backward; the cost model adds it per stage, as it depends on the ZeRO stage and the
    micro-batches, which the per-block times do not)."""
    return params * accumulate_bytes(plan) / cal.hbm_bytes_per_s


@dataclass(frozen=True)
class BlockTimes:
    """Seconds for one micro-batch through one block on one rank."""

    forward: float
    backward: float
    gemm_forward: float
    """The GEMMs' part of ``forward`` (what over-decomposition can hide communication behind)."""
    attention_forward: float
    """Attention's part of ``forward`` (what ring attention hides its K/V shifts behind)."""
    weight_grad: float = 0.0
    """The part of ``backward`` that only the parameters' gradients need (the weight-gradient
    GEMMs and the gradients' casts): what zero-bubble's input-gradient pass (BI) skips and its
    weight-gradient pass (BW) runs after backpropagating through the block again."""
    expert_gemm_forward: float = 0.0
    """The experts' GEMMs' part of ``gemm_forward`` (what ``Plan.ep_overlap`` hides the
    expert-parallel all-to-alls behind)."""


def _linear(cal: Calibration, plan: Plan, t: float, fin: int, fout: int, role: str, eb: int) -> float:
    p, mode = plan.tp, plan.tp_mode
    if p == 1:
        return cal.gemm_seconds(t, fout, fin, eb)
    q, d = tp_grid(plan.tp, mode, plan.tp_depth)
    if mode == "1d":
        if role == "column":
            return cal.gemm_seconds(t, fout / p, fin, eb)
        k = plan.tp_overlap
        return k * cal.gemm_seconds(t / k, fout, fin / p, eb)
    if mode in ("2d", "2.5d"):
        return cal.gemm_seconds(t / (d * q), fout / q, fin, eb)
    k = plan.tp_overlap
    return k * cal.gemm_seconds(t / q / k, fout / q, fin / q, eb)


def ulysses_copy_seconds(plan: Plan, w: Workload, cal: Calibration, tokens: float) -> tuple[float, float]:
    """(forward, backward) seconds of the copies around Ulysses' all-to-alls for ``tokens`` local
    tokens (``parallel/context/ulysses.py``, ``comm.all_to_all``): forward, q/k/v concatenated
    (read and write them), each all-to-all's parts made contiguous and what arrives concatenated
    (read and write twice), for q/k/v and the output; backward, the two inverse all-to-alls."""
    s = w.shape
    qkv = 2 * (s.num_heads + 2 * s.num_kv_heads) * s.head_dim / plan.tp  # 16-bit bytes per token
    out = 2 * s.num_heads * s.head_dim / plan.tp
    return tokens * (6 * qkv + 4 * out) / cal.hbm_bytes_per_s, tokens * (4 * qkv + 4 * out) / cal.hbm_bytes_per_s


def block_times(plan: Plan, w: Workload, cal: Calibration, mbs: int) -> BlockTimes:
    """One micro-batch of ``mbs`` sequences through one block on one rank of ``plan``."""
    s = w.shape
    eb = 2 if plan.precision in ("bf16", "fp16") else 4
    t = mbs * w.seq_len / plan.cp
    h, dh = s.hidden, s.head_dim
    attn_w, kv_w = s.num_heads * dh, s.num_kv_heads * dh
    gemm = _linear(cal, plan, t, h, attn_w + 2 * kv_w, "column", eb) + _linear(cal, plan, t, attn_w, h, "row", eb)
    experts = 0.0
    if w.num_experts:
        f = w.expert_ffn_hidden or s.ffn_hidden
        # each rank runs its E/ep experts over the tokens routed to them: on average T k rows in all,
        # in ep_overlap chunks of as many rows each (parallel/expert/overlap.py); under tensor
        # parallelism the tp ranks split the tokens (parallel/expert/tokens.py): T/tp each
        # each expert's gate and up projections are one GEMM (``[rows, h] @ [h, 2f]``, the fused
        # weight of parallel/expert/grouped.py), then its down projection; under bf16 one grouped
        # call runs all the local experts' (a chunk's) at the calibration's factor of the table's
        # rate for the whole call's flops, by rows per group (the loop elsewhere: the table's rate
        # for each group's GEMMs); under ep > 1 the busiest rank's rows set the pace
        k = plan.ep_overlap
        local = w.num_experts / plan.ep
        rows = t / token_split(plan) * w.experts_top_k * plan.ep / w.num_experts / k
        up = (2 if s.gated_mlp else 1) * f
        if eb == 2 and plan.precision == "bf16":
            call = rows * local
            one = (cal.gemm_seconds(call, up, h, eb) + cal.gemm_seconds(call, h, f, eb)) / cal.grouped_call_factor(rows)
        else:
            one = local * (cal.gemm_seconds(rows, up, h, eb) + cal.gemm_seconds(rows, h, f, eb))
        experts = k * one * busiest_rank_load(plan, w)
        gemm += experts
    else:
        f = s.ffn_hidden
        gemm += (2 if s.gated_mlp else 1) * _linear(cal, plan, t, h, f, "column", eb) + _linear(
            cal, plan, t, f, h, "row", eb
        )
    flops = 2.0 * mbs * w.seq_len * w.seq_len * dh * s.num_heads / (plan.tp * plan.cp)
    # the length each attention kernel sees: the whole sequence (Ulysses gathers it), or ring's blocks
    seen = w.seq_len / plan.cp if plan.cp > 1 and plan.cp_mode == "ring" else w.seq_len
    rate, ratio = cal.attention_rate(seen)
    rate *= cal.sustained_ratio
    attn_f = flops / rate
    attn_b = 2.5 * flops / (rate * ratio)
    elem_f, elem_b = elementwise_seconds(plan, w, cal, t)
    ring_f = ring_b = 0.0
    if plan.cp > 1 and plan.cp_mode == "ring":  # each of the cp steps merges its block in fp32
        kv_share = s.num_kv_heads / s.num_heads
        rows = t * attn_w / plan.tp / cal.hbm_bytes_per_s
        ring_f = plan.cp * RING_MERGE_BYTES * rows
        ring_b = plan.cp * RING_MERGE_BYTES * rows * (1 + 2 * kv_share)
    uly_f = uly_b = 0.0
    if plan.cp > 1 and plan.cp_mode == "ulysses":
        uly_f, uly_b = ulysses_copy_seconds(plan, w, cal, t)
    sp_f, sp_b = sequence_parallel_copy_seconds(plan, w, cal, t, mbs)
    cast_f, cast_b = _cast_seconds(plan, block_local_params(plan, w), cal)
    chunk_f, chunk_b = ep_chunk_seconds(plan, w, cal)
    fwd = gemm + attn_f + elem_f + sp_f + cast_f + ring_f + uly_f + chunk_f
    bwd = 2 * gemm + attn_b + elem_b + sp_b + cast_b + ring_b + uly_b + chunk_b
    if plan.activation_checkpointing:
        bwd += fwd
    return BlockTimes(fwd, bwd, gemm, attn_f, gemm + cast_b + chunk_b, experts)


def _elementwise_scale(plan: Plan) -> float:
    """The counted (autocast) bytes' factor under ``plan``'s precision: fp32 compute moves twice."""
    return 1.0 if plan.precision in ("bf16", "fp16") else 2.0


def elementwise_seconds(plan: Plan, w: Workload, cal: Calibration, tokens: float) -> tuple[float, float]:
    """(forward, backward) seconds of one block's non-GEMM work (:mod:`.elementwise`) for
    ``tokens`` local tokens: the model-width part split over tp where the layout shards the
    tokens (sequence parallelism, 2D, 2.5D, 3D), the heads' and the MLP's part split always."""
    s = w.shape
    width = (w.expert_ffn_hidden or s.ffn_hidden) * w.experts_top_k if w.num_experts else None
    e = block_elementwise_bytes(s, mlp_width=width, shared_casts=plan.tp > 1 and plan.tp_mode == "1d")
    shard = plan.tp if (plan.tp_mode != "1d" or plan.sequence_parallel) else 1
    # the MLP's part split over tp: a dense MLP's width, or (1D) each tp rank's share of an MoE
    # block's tokens through its experts
    split_f, split_b = e.split_forward / plan.tp, e.split_backward / plan.tp
    # an MoE layer's routing, dispatch and combine: over this tp rank's share of the tokens
    moe_f, moe_b = (b / token_split(plan) for b in expert_elementwise_bytes(w))
    per = tokens * _elementwise_scale(plan) / cal.elementwise_rate
    return per * (e.hidden_forward / shard + split_f + moe_f), per * (e.hidden_backward / shard + split_b + moe_b)


def sequence_parallel_copy_seconds(
    plan: Plan, w: Workload, cal: Calibration, tokens: float, mbs: int
) -> tuple[float, float]:
    """(forward, backward) seconds of the copies around one block's sequence-parallel collectives
    per micro-batch of ``mbs`` sequences (``tokens`` local tokens), 16-bit ``[mbs, s, h]``
    activations gathered and scattered on the sequence dim (``comm.collectives``,
    ``parallel/tensor/region1d.py``): each blocking all-gather (the norms' outputs forward, the rows'
    output gradients backward) receives into a flat buffer, copies it into the ranks' parts and
    concatenates them (two copies of the gathered tensor, ``8 h`` per token); each asynchronous
    reduce-scatter (the rows' outputs forward, the columns' input gradients backward) first makes
    its input sequence-major (``4 h``), as the columns' re-gather does its shard (``4 h / tp``),
    and the weight-gradient GEMM copies that gathered, sequence-major input back (``4 h``): these
    three only where a micro-batch has more than one sequence; with ``tp_overlap = k`` pieces each row
    concatenates its pieces' shards (``4 h / tp``). A checkpointed block's recompute repeats the forward's."""
    if not (plan.sequence_parallel and plan.tp > 1 and plan.tp_mode == "1d"):
        return 0.0, 0.0
    p, k = plan.tp, plan.tp_overlap
    many = 1.0 if mbs > 1 else 0.0
    rows = 1.0 if mbs // k > 1 else 0.0  # each piece's sequences
    fwd = 2 * 8 + 2 * 4 * rows + (2 * 4 / p if k > 1 else 0.0)
    bwd = 2 * 8 + many * (2 * 4 / p + 2 * 4) + 2 * 4 * many
    per = tokens * w.shape.hidden * _elementwise_scale(plan) / cal.elementwise_rate
    return per * fwd, per * bwd


def ep_chunk_seconds(plan: Plan, w: Workload, cal: Calibration) -> tuple[float, float]:
    """(forward, backward) seconds ``Plan.ep_overlap = k`` chunks add to one MoE layer's
    micro-batch on one rank, beyond the GEMMs' smaller shapes: each chunk runs this rank's experts
    as one call (``parallel/expert/grouped.py``), which casts their weights to the GEMM dtype, so
    under autocast over fp32 parameters the k - 1 extra calls cast them again (``CAST_BYTES`` a
    parameter each) and the backward casts their k - 1 extra weight gradients back; autograd sums
    the k gradients of each weight (k - 1 additions: read two, write one, in the gradient's dtype:
    2 bytes with ``param_dtype='bf16'``, else 4)."""
    k = plan.ep_overlap
    if k == 1 or not w.num_experts:
        return 0.0, 0.0
    n = w.expert_params / plan.ep
    grad_bytes = 2 if plan.param_dtype == "bf16" else 4
    autocast = plan.precision in ("bf16", "fp16") and plan.param_dtype != "bf16"
    cast = CAST_BYTES if autocast else 0
    return (k - 1) * n * cast / cal.hbm_bytes_per_s, (k - 1) * n * (cast + 3 * grad_bytes) / cal.hbm_bytes_per_s


def embedding_backward_seconds(plan: Plan, w: Workload, cal: Calibration, mbs: int) -> float:
    """Seconds of one micro-batch's backward through the token embedding on the first stage: the
    table's dense fp32 gradient (this rank's ``V h / tp`` share) zero-filled (4 bytes an element),
    each token's gradient row added into it (read 4, read and write the row 8), and the table
    then going into the gradient sync's fp32 chunk (:func:`accumulate_bytes`), or, where the head
    shares the table (tied, its gradient already there, :func:`accumulate_seconds` in the cost
    model), added to it (read 8, write 4)."""
    s = w.shape
    t = mbs * w.seq_len / plan.cp
    table = s.vocab_size * s.hidden / weight_split(plan)
    into = 12.0 if w.tied_embeddings else accumulate_bytes(plan)
    return (table * (4 + into) + t * s.hidden * 12) / cal.hbm_bytes_per_s


def head_times(plan: Plan, w: Workload, cal: Calibration, mbs: int) -> tuple[float, float]:
    """Forward and backward seconds of the head GEMM and the cross-entropy over the vocabulary."""
    s = w.shape
    eb = 2 if plan.precision in ("bf16", "fp16") else 4
    t = mbs * w.seq_len / plan.cp
    g = _linear(cal, plan, t, s.hidden, s.vocab_size, "column", eb)
    rate = cal.elementwise_rate / _elementwise_scale(plan)
    ce_f, ce_b = cross_entropy_bytes(plan.tp > 1)
    logits = t * s.vocab_size / plan.tp
    # the final norm and the head's input cast, per token (split over tp where the layout shards tokens)
    shard = plan.tp if (plan.tp_mode != "1d" or plan.sequence_parallel) else 1
    nf, nb = norm_bytes(s)
    norm_f, norm_b = t * (nf + 6 * s.hidden) / shard / rate, t * (nb + 6 * s.hidden) / shard / rate
    cast_f, cast_b = _cast_seconds(plan, s.vocab_size * s.hidden / weight_split(plan), cal)  # the head's table
    return g + logits * ce_f / rate + norm_f + cast_f, 2 * g + logits * ce_b / rate + norm_b + cast_b

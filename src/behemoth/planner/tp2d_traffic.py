"""Per-rank bytes of 2D (Optimus) and 2.5D (Tesseract) tensor parallelism, for a model and a batch.

2D (Optimus) / 2.5D (Tesseract); behemoth.parallel.tensor.grid, tp2d, tp2p5d, styles2d. p = d q**2
on a d x q x q grid; each rank holds T/(d q) tokens and h/q hidden. Per SUMMA Linear,
forward: an all-gather of X(i, :) along the grid row and of W(:, j) down the grid column (the
blocks SUMMA's q broadcasts deliver), ``(T h_in / d + h_in h_out) / q`` elements of payload;
backward the re-gather of X (the forward's gathered W is kept) and the reduce-scatters of the dX
and dW partials: ``(3 bsh + 2 h h_o)/q`` (:func:`summa_linear_bytes`; Optimus's
``3 (bsh + h h_o)/q`` when W is gathered again, ``keep_weights=False``). 2.5D adds the all-reduce of dW over
depth. Biases and norm weights (replicated over ``tp_row``) all-reduce their gradients over
``tp_row`` (and depth); with fewer kv heads than q, the k and v projections are replicated
over ``tp_col`` and all-reduce their weight gradients over it; norms all-gather (LayerNorm:
mean, M2) or all-reduce (RMS) their
statistics over ``tp_col`` forward and all-reduce one or two sums backward. Model level: the
embedding all-gathers the int64 ids over ``tp_row``, reduce-scatters its partial lookups over
``tp_col`` and swaps with the transposed grid rank (none on the grid's diagonal) -- the same
backward --; a learned position table all-reduces its gradient over ``tp_row``; the
vocab-parallel loss all-reduces ``[T/(d q)]`` maxima and ``[2, T/(d q)]`` sums over ``tp_col``.
A mixture-of-experts block has no grid Linears in its MLP: its grid rows run it on whole rows of
their tokens (:func:`grid_experts_traffic`, 3D's too; checked against the ledger in
tests/dist/test_planner_expert_grid_ledger.py).


Units and notation: :mod:`behemoth.planner.traffic`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import partial

from ..specs import TransformerShape
from .collectives import Traffic, all_gather_bytes, all_reduce_bytes, payload, reduce_scatter_bytes


def grid_side(tp: int, depth: int = 1) -> int:
    """q of a d x q x q grid with ``tp = depth * q**2``."""
    q = math.isqrt(tp // depth) if tp % depth == 0 else 0
    if q * q * depth != tp:
        raise ValueError(f"tp={tp} is not tp_depth * q*q with tp_depth={depth}.")
    return q


def tp2d_linear_traffic(
    *,
    tokens: int,
    in_features: int,
    out_features: int,
    tp: int,
    depth: int = 1,
    bias: bool = False,
    dtype_bytes: int = 2,
    param_bytes: int = 4,
    wire: bool = True,
    keep_weights: bool = True,
) -> Traffic:
    """One SUMMA Linear (2D; 2.5D with ``depth`` > 1; ``behemoth.parallel.tensor.tp2d.Linear2D``),
    forward + backward, per rank. ``tokens``: B*S of the tp group. The forward gathers the q
    X blocks ``tokens/(d q) * in/q`` of its grid row and the q W blocks ``in/q * out/q`` of its
    grid column; the backward re-gathers X (W too when not ``keep_weights``: the layer's
    ``keep_gathered_weight``) and reduce-scatters partials of the same sizes:
    ``(3 tokens*in/d + 2 in*out) / q`` elements of payload (``3 (tokens*in/d + in*out) / q``
    re-gathering W), in ``dtype_bytes`` (the autocast dtype), of which a ring sends ``(q-1)/q``. Tesseract adds the all-reduce of dW over depth,
    ``in*out/q**2``; a bias the all-reduce of its gradient over ``tp_row`` (and depth), ``out/q``
    each; both in ``param_bytes``. ``wire=False`` counts payload (the ledger's ``bytes``)
    instead of ring wire bytes."""
    q = grid_side(tp, depth)
    if tp == 1:
        return Traffic()
    reduce = all_reduce_bytes if wire else payload
    ring = (q - 1) / q if wire else 1.0  # a ring all-gather or reduce-scatter sends (q-1)/q of its payload
    act = tokens * in_features / depth / q * dtype_bytes * ring
    wgt = in_features * out_features / q * dtype_bytes * ring
    fwd = act + wgt
    bwd = 2 * act + (1 if keep_weights else 2) * wgt + reduce(in_features * out_features / q**2 * param_bytes, depth)
    if bias:
        b = out_features / q * param_bytes
        bwd += reduce(b, q) + reduce(b, depth)
    return Traffic(fwd, bwd)


def summa_linear_bytes(
    tokens: int,
    in_features: int,
    out_features: int,
    q: int,
    *,
    depth: int = 1,
    bias: bool = False,
    element_size: int = 4,
    keep_weights: bool = True,
) -> int:
    """Payload bytes one rank moves for one SUMMA Linear, forward + backward, as the ledger's
    ``bytes`` counts them: :func:`tp2d_linear_traffic` with ``wire=False`` and one element size.
    d = 1 is Optimus (``(3 tokens*in + 2 in*out) / q`` elements keeping the gathered weight for
    the backward, ``3 (tokens*in + in*out) / q`` re-gathering it), d > 1 Tesseract."""
    t = tp2d_linear_traffic(
        tokens=tokens,
        in_features=in_features,
        out_features=out_features,
        tp=depth * q * q,
        depth=depth,
        bias=bias,
        dtype_bytes=element_size,
        param_bytes=element_size,
        wire=False,
        keep_weights=keep_weights,
    )
    return round(t.total)


def _kv_replicated2d(
    tokens: int,
    hidden: int,
    shape: TransformerShape,
    tp: int,
    depth: int,
    dtype_bytes: int,
    param_bytes: int,
    keep_weights: bool = True,
) -> Traffic:
    """A k or v projection with K < q kv heads (tp2d.KVReplicatedLinear2D): SUMMA with a
    ``[D, h/q]`` weight block, then all-reduces of the ``[K D, h/q]`` weight gradient over
    ``tp_col`` and depth (and of a bias over the whole grid)."""
    q, k, d = grid_side(tp, depth), shape.num_kv_heads, shape.head_dim
    act = tokens * hidden / (depth * q) * (q - 1) / q * dtype_bytes  # ring gathers
    wgt = d * hidden * (q - 1) / q * dtype_bytes
    fwd = act + wgt
    grad = k * d * hidden / q * param_bytes
    bwd = 2 * act + (1 if keep_weights else 2) * wgt + all_reduce_bytes(grad, q) + all_reduce_bytes(grad, depth)
    if shape.linear_bias:
        bwd += all_reduce_bytes(k * d * param_bytes, tp)
    return Traffic(fwd, bwd)


def norm2d(shape: TransformerShape, tokens_local: float, q: int, depth: int, param_bytes: int) -> Traffic:
    stat = 4  # statistics in (at least) float32
    if shape.rms_norm:
        fwd, bwd = all_reduce_bytes(tokens_local * stat, q), all_reduce_bytes(tokens_local * stat, q)
    else:
        fwd, bwd = all_gather_bytes(q * 2 * tokens_local * stat, q), all_reduce_bytes(2 * tokens_local * stat, q)
    vec = shape.norm_params / q * param_bytes  # weight (and bias) blocks, replicated over tp_row
    return Traffic(fwd, bwd + all_reduce_bytes(vec, q) + all_reduce_bytes(vec, depth))


def grid_linears_traffic(
    shape: TransformerShape, lin, kv_projection: Traffic | None = None, *, mlp: bool = True
) -> Traffic:
    """The Linears of one block under a grid mode (2D, 2.5D, 3D), where every Linear gathers its
    own input: ``lin(in_features=, out_features=)`` (the mode's Linear formula with the tokens,
    degree and dtypes bound) summed over fused qkv, or q, k and v
    (``kv_projection``: one k or v projection's traffic where it is not ``lin(h, K D)``); the
    attention output; and unless ``mlp`` is False (a mixture-of-experts block, which has no grid
    Linears: :func:`grid_experts_traffic`) fc, or gate and up, and proj, or down. Norms are the
    caller's."""
    h, f = shape.hidden, shape.ffn_hidden
    attn, kv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim

    def one(fin: int, fout: int) -> Traffic:
        return lin(in_features=fin, out_features=fout)

    if shape.fused_qkv:
        out = one(h, attn + 2 * kv)
    else:
        out = one(h, attn) + 2 * (one(h, kv) if kv_projection is None else kv_projection)
    out += one(attn, h)
    return out + ((2 if shape.gated_mlp else 1) * one(h, f) + one(f, h) if mlp else Traffic())


GRID_STATISTICS_AXES = {
    "2d": ("tp_col", ("tp_row",)),
    "2.5d": ("tp_col", ("tp_depth", "tp_row")),
    "3d": ("tp_row", ("tp_depth", "tp_col")),
}
"""Per grid mode, the axis an MoE block's router-loss shares are summed over and the grid's other
axes its counts are summed over too (``parallel/expert/tokens.py``'s ``grid_axes``; a test holds
them equal)."""


def grid_experts_traffic(
    *,
    tokens: float,
    hidden: int,
    q: int,
    depth: int,
    mode: str,
    experts: int,
    stream_bytes: int,
) -> Traffic:
    """One mixture-of-experts block under a grid (``parallel/expert/tokens.py``, ``style.py``), per
    rank: its ``tokens`` (its batch block's, T / (tp / q)) in hidden blocks of ``hidden / q``; the q
    ranks of its grid row (``tp_col``) trade them for whole rows of a 1/q share each in one
    all-to-all, and the outputs back in another (``[ceil(tokens / q) q, hidden / q]`` in the
    residual stream's dtype, the tokens padded to a multiple of q where the sequence does not
    divide; ``(q-1)/q`` of it leaves the rank), the gradients the inverse pair backward. Forward, the
    balancing statistics' shares (``3E + 2`` float64: counts, drops, tokens, probability sums,
    z-loss) all-reduced over the loss axis, then the counts, drops and tokens (``2E + 1``) over each
    other axis of the grid (:data:`GRID_STATISTICS_AXES`; ``tp_depth`` has ``depth`` ranks: 2.5D's d,
    3D's q).
    The block's parameter gradients (its router's and experts': they saw its share of the tokens
    only) are summed over the whole grid by the step's gradient sync, with the data axis
    (``axis_traffic.step_traffic``), not here."""
    rows = -(-tokens // q) * q
    a2a = 2 * all_gather_bytes(rows * hidden / q * stream_bytes, q)  # an all-to-all sends (q-1)/q of it
    sizes = {"tp_row": q, "tp_col": q, "tp_depth": depth}
    loss, others = GRID_STATISTICS_AXES[mode]
    stats = all_reduce_bytes((3 * experts + 2) * 8, sizes[loss])
    stats += sum(all_reduce_bytes((2 * experts + 1) * 8, sizes[a]) for a in others)
    return Traffic(a2a + stats, a2a)


def tp2d_block_traffic(
    shape: TransformerShape,
    *,
    batch: int,
    seq: int,
    tp: int,
    depth: int = 1,
    dtype_bytes: int = 2,
    param_bytes: int = 4,
    keep_weights: bool = True,
    stream_bytes: int | None = None,
    experts: int = 0,
) -> Traffic:
    """One transformer block (2 norms; q/k/v or fused qkv, out; fc and proj, or gate, up and
    down), forward + backward, per rank; attention itself is local. With ``experts`` (E > 0) the
    MLP is a mixture of E experts the grid rows run on whole rows of their tokens
    (:func:`grid_experts_traffic`; ``stream_bytes``: the residual stream's element size, default ``param_bytes``)."""
    q = grid_side(tp, depth)
    if tp == 1:
        return Traffic()
    t = batch * seq
    lin = partial(
        tp2d_linear_traffic,
        tokens=t,
        tp=tp,
        depth=depth,
        bias=shape.linear_bias,
        dtype_bytes=dtype_bytes,
        param_bytes=param_bytes,
        keep_weights=keep_weights,
    )
    kv = None
    if not shape.fused_qkv and shape.num_kv_heads < q and shape.num_kv_heads != shape.num_heads:  # replicated
        kv = _kv_replicated2d(t, shape.hidden, shape, tp, depth, dtype_bytes, param_bytes, keep_weights)
    out = grid_linears_traffic(shape, lin, kv, mlp=not experts) + 2 * norm2d(
        shape, t / (depth * q), q, depth, param_bytes
    )
    if experts:
        out += grid_experts_traffic(
            tokens=t / (depth * q),
            hidden=shape.hidden,
            q=q,
            depth=depth,
            mode="2.5d" if depth > 1 else "2d",
            experts=experts,
            stream_bytes=param_bytes if stream_bytes is None else stream_bytes,
        )
    return out


def tp2d_model_traffic(
    shape: TransformerShape,
    *,
    batch: int,
    seq: int,
    tp: int,
    depth: int = 1,
    dtype_bytes: int = 2,
    stream_bytes: int | None = None,
    param_bytes: int = 4,
    diagonal: bool = False,
    keep_weights: bool = True,
    experts: int = 0,
) -> Traffic:
    """A whole forward + backward: embedding, every block, final norm, head and loss, for a
    rank off the grid's diagonal (``diagonal=True``: a rank (i, i), which skips the
    embedding's transpose swap). ``stream_bytes``: the residual stream's element size (the
    embedding output's gradient). ``keep_weights``: the Linears keep their gathered weights for
    the backward (``Linear2D.keep_gathered_weight``, the default)."""
    q = grid_side(tp, depth)
    if tp == 1:
        return Traffic()
    stream = param_bytes if stream_bytes is None else stream_bytes
    h, v, t = shape.hidden, shape.vocab_size, batch * seq
    local = t / (depth * q)
    out = shape.num_layers * tp2d_block_traffic(
        shape,
        batch=batch,
        seq=seq,
        tp=tp,
        depth=depth,
        dtype_bytes=dtype_bytes,
        param_bytes=param_bytes,
        keep_weights=keep_weights,
        stream_bytes=stream,
        experts=experts,
    )
    swap = 0.0 if diagonal else local * h / q
    out += Traffic(
        all_gather_bytes(q * local * 8, q)  # ids (int64)
        + reduce_scatter_bytes(t / depth * h / q * param_bytes, q)
        + swap * param_bytes,
        swap * stream
        + all_gather_bytes(t / depth * h / q * stream, q)
        + all_reduce_bytes(v / q * h / q * param_bytes, depth),
    )  # table grad over depth
    if shape.max_positions:
        pos = shape.max_positions * h / q * param_bytes
        out += Traffic(0.0, all_reduce_bytes(pos, q) + all_reduce_bytes(pos, depth))
    out += norm2d(shape, local, q, depth, param_bytes)  # final norm
    out += tp2d_linear_traffic(
        tokens=t,
        in_features=h,
        out_features=v,
        tp=tp,
        depth=depth,
        dtype_bytes=dtype_bytes,
        param_bytes=param_bytes,
        keep_weights=keep_weights,
    )  # head
    out += Traffic(all_reduce_bytes(local * 4, q) + all_reduce_bytes(2 * local * 4, q), 0.0)  # loss
    return out


def tp2p5d_linear_traffic(*, depth: int, **kwargs) -> Traffic:
    """2.5D (Tesseract, d x q x q): 2D on d batch slabs plus the depth all-reduce of dW."""
    return tp2d_linear_traffic(depth=depth, **kwargs)


def tp2p5d_block_traffic(shape: TransformerShape, *, depth: int, **kwargs) -> Traffic:
    return tp2d_block_traffic(shape, depth=depth, **kwargs)


def tp2p5d_model_traffic(shape: TransformerShape, *, depth: int, **kwargs) -> Traffic:
    return tp2d_model_traffic(shape, depth=depth, **kwargs)


GRID_GRAD_LEAD = 6
"""Layers ahead of a grid layer (in the forward) its gradients' landing node is made:
``behemoth.parallel.tensor.deferred_grads.DeferredGrads.lead`` (a test holds them equal)."""


def grid_deferred_layers(
    shape: TransformerShape, q: int, blocks: int, *, last_stage: bool = True, experts: bool = False
) -> list[bool]:
    """The layers a 2D / 2.5D pass defers the gradient reductions of, in forward order (each
    block's norm, q/k/v (fused, or three but replicated k and v projections), output, norm, MLP
    Linears (none in a mixture-of-experts block, ``experts``: its parameters sum over the grid in
    its own backward); on the last pipeline stage the final norm and the head): True where the
    layer hands vectors to the buckets (a norm with a weight, a Linear with a bias)."""
    norm, bias = shape.norm_params > 0, shape.linear_bias
    replicated_kv = not shape.fused_qkv and shape.num_kv_heads < q and shape.num_kv_heads != shape.num_heads
    qkv = [bias] if shape.fused_qkv or replicated_kv else [bias] * 3
    block = [norm, *qkv, bias, norm] + [bias] * (0 if experts else 3 if shape.gated_mlp else 2)
    return block * blocks + ([norm, False] if last_stage else [])


def grid_vector_flushes(layers: Sequence[bool], lead: int = GRID_GRAD_LEAD) -> int:
    """Bucket all-reduces of one pass over ``layers`` (:func:`grid_deferred_layers`), as
    ``deferred_grads.GradPass`` issues them: the backward runs the layers last to first, each
    handing its vectors to the bucket; layer k's landing node, made at layer ``k - lead``'s
    forward (the first layer's and the ``lead`` after it at the first layer's), runs right after
    that layer's backward and flushes the bucket if its own vectors are still in it."""
    n, pending, flushes = len(layers), set(), 0
    for t in range(n - 1, -1, -1):
        if layers[t]:
            pending.add(t)
        for k in [t + lead] if t > 0 else range(min(lead, n - 1), -1, -1):
            if k in pending:
                pending.clear()
                flushes += 1
    return flushes

"""Per-rank communication volume of tensor parallelism, for a model and a batch.

Pure functions of shapes (no torch, no process group): the formulas ``tests/dist`` checks
the comm ledger against and the planner's cost model uses. Units: bytes *this rank puts on
the wire* for a bandwidth-optimal (ring) algorithm -- the ledger's ``wire_bytes``:

* all-reduce of n bytes over p ranks: ``2 (p-1)/p n``;
* all-gather to, or reduce-scatter from, a full tensor of n bytes: ``(p-1)/p n``.

Notation: T tokens on this rank's tensor-parallel group (batch x sequence of one dp rank),
h hidden, f FFN hidden, V vocabulary, N / K query / key-value heads, p = tp degree.

1D (Megatron; behemoth.parallel.tensor.tp1d). Per column/row pair, forward + backward:
``f`` = all-reduce of dX [T, h] backward and ``g`` = all-reduce of Y [T, h] forward, i.e.
``4 (p-1)/p T h`` elements; with sequence parallelism all-gather + reduce-scatter of the
same volume plus a second all-gather of X backward (Megatron's: the column layers keep only
X's sequence shard and re-gather it, overlapped with the dX GEMM), and the all-reduce of the
gradients of the norm weights and row biases (which see only this rank's tokens). Two pairs per block (attention, MLP); q/k/v (and
gate/up) share one ``f``. GQA with K < p replicates the k/v projections and all-reduces
their weight gradients. Model level: vocab-parallel embedding (all-reduce of [T, h] forward),
head (``f``), vocab-parallel cross-entropy (all-reduce of [T] maxima and of [2, T] sums,
fp32), and with sequence parallelism the scatter/gather of the sequence around the blocks.

Dtypes: ``dtype_bytes`` is the element size of the Linears' inputs and outputs (2 under
bf16 autocast; ``f`` acts on the column input already cast, as Megatron's does),
``stream_bytes`` that of the residual stream (4 under autocast; where the sequence-parallel
scatter/gather around the blocks acts), ``param_bytes`` that of parameters and their
gradients (and of the embedding output).

2D (Optimus) / 2.5D (Tesseract); behemoth.parallel.tensor.grid, tp2d, tp2p5d, styles2d. p = d q**2
on a d x q x q grid; each rank holds T/(d q) tokens and h/q hidden. A broadcast or a reduce
books the block's bytes on every member (as the ledger does: a pipelined broadcast/reduce
moves about that much through each member). Per SUMMA Linear, forward: q broadcasts of an
X block and of a W block, ``(T h_in / d + h_in h_out) / q`` elements; backward twice that
(re-broadcasts plus reduces of the dX and dW partials): Optimus's ``3 (bsh + h h_o)/q``
(:func:`summa_linear_bytes`). 2.5D adds the all-reduce of dW over
depth. Biases and norm weights (replicated over ``tp_row``) all-reduce their gradients over
``tp_row`` (and depth); with fewer kv heads than q, the k and v projections are replicated
over ``tp_col`` and all-reduce their weight gradients over it; norms all-gather (LayerNorm:
mean, M2) or all-reduce (RMS) their
statistics over ``tp_col`` forward and all-reduce one or two sums backward. Model level: the
embedding all-gathers the int64 ids over ``tp_row``, reduce-scatters its partial lookups over
``tp_col`` and swaps with the transposed grid rank (none on the grid's diagonal) -- the same
backward --; a learned position table all-reduces its gradient over ``tp_row``; the
vocab-parallel loss all-reduces ``[T/(d q)]`` maxima and ``[2, T/(d q)]`` sums over ``tp_col``.

3D (Bian et al. / Colossal-AI 3D with Tensor3D over-decomposition; behemoth.parallel.tensor.tp3d,
styles3d). p = q**3 on a q x q x q cube; each rank holds ``T/q**2`` tokens and ``h/q`` hidden. Per
Linear, forward: all-gather X over the input axis, W over tp_depth, reduce-scatter Y over the
output axis; backward: all-gather dY, re-gather X and W (only shards are saved), reduce-scatter
dX and dW -- ``(3 T h_in + 3 h_in h_out + 2 T h_out) / q**2`` elements of payload
(:func:`linear3d_bytes`), ``(q-1)/q`` of it on the wire; a bias all-reduces its gradient
over the output axis and depth. Over-decomposition (``tp_overlap``) overlaps the same bytes
with compute. Every Linear gathers its own input (q, k and v each gather X). Norms as 2D (over
the layout's hidden axis), their parameters replicated over tp_row and tp_depth. Model level:
the embedding all-gathers the int64 ids of the rank's input block over tp_col and tp_depth
and reduce-scatters its partial lookups over tp_depth then tp_row (all-gathers backward); a
learned position table all-gathers its position ids over tp_col and all-reduces its gradient
over tp_row and tp_depth; the head is a 3D Linear; the loss all-reduces ``[T/q**2]`` maxima
and ``[2, T/q**2]`` sums over tp_row. Checked against the ledger in tests/dist/test_tp3d.py.

Context parallelism's bytes are in :mod:`behemoth.planner.context_traffic`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..specs import TransformerShape


@dataclass(frozen=True)
class Traffic:
    """Bytes one rank sends in the forward and in the backward pass."""

    forward: float = 0.0
    backward: float = 0.0

    @property
    def total(self) -> float:
        return self.forward + self.backward

    def __add__(self, other: Traffic) -> Traffic:
        return Traffic(self.forward + other.forward, self.backward + other.backward)

    def __mul__(self, k: float) -> Traffic:
        return Traffic(self.forward * k, self.backward * k)

    __rmul__ = __mul__


def all_reduce_bytes(nbytes: float, p: int) -> float:
    return 2 * (p - 1) / p * nbytes


def all_gather_bytes(full_nbytes: float, p: int) -> float:
    """All-gather into (or reduce-scatter from) a full tensor of ``full_nbytes``."""
    return (p - 1) / p * full_nbytes


reduce_scatter_bytes = all_gather_bytes


def _payload(nbytes: float, p: int) -> float:
    """An all-reduce's payload as the ledger's ``bytes`` counts it (nothing on a trivial axis)."""
    return nbytes if p > 1 else 0.0


# ----------------------------------------------------------------------------- 1D
def tp1d_linear_traffic(
    *,
    tokens: int,
    in_features: int,
    out_features: int,
    tp: int,
    orientation: str,
    sequence_parallel: bool = False,
    bias: bool = False,
    dtype_bytes: int = 2,
    stream_bytes: int | None = None,
    param_bytes: int = 4,
) -> Traffic:
    """One 1D Linear, forward + backward. ``orientation='column'`` counts its ``f`` (which
    Linears reading the same input share: count it once per input; sequence parallel: the
    forward gather, the backward re-gather and reduce-scatter); ``'row'`` its ``g``.
    ``stream_bytes`` is accepted for symmetry with the model-level functions and unused: the
    column input is cast to ``dtype_bytes`` before it travels."""
    p = tp
    if p == 1:
        return Traffic()
    if orientation == "column":
        x = tokens * in_features * dtype_bytes
        if sequence_parallel:
            return Traffic(all_gather_bytes(x, p), all_gather_bytes(x, p) + reduce_scatter_bytes(x, p))
        return Traffic(0.0, all_reduce_bytes(x, p))
    if orientation == "row":
        y = tokens * out_features * dtype_bytes
        if sequence_parallel:
            b = all_reduce_bytes(out_features * param_bytes, p) if bias else 0.0
            return Traffic(reduce_scatter_bytes(y, p), all_gather_bytes(y, p) + b)
        return Traffic(all_reduce_bytes(y, p), 0.0)
    raise ValueError(f"orientation={orientation!r}: 'column' or 'row'.")


def tp1d_block_traffic(
    shape: TransformerShape,
    *,
    batch: int,
    seq: int,
    tp: int,
    sequence_parallel: bool = False,
    dtype_bytes: int = 2,
    stream_bytes: int | None = None,
    param_bytes: int = 4,
) -> Traffic:
    """One transformer block (attention pair + MLP pair), forward + backward, per rank."""
    p, h, t = tp, shape.hidden, batch * seq
    if p == 1:
        return Traffic()
    kw = dict(
        tokens=t,
        tp=p,
        sequence_parallel=sequence_parallel,
        dtype_bytes=dtype_bytes,
        stream_bytes=stream_bytes,
        param_bytes=param_bytes,
        bias=shape.linear_bias,
    )
    attn_width = shape.num_heads * shape.head_dim
    out = (
        tp1d_linear_traffic(in_features=h, out_features=attn_width, orientation="column", **kw)
        + tp1d_linear_traffic(in_features=attn_width, out_features=h, orientation="row", **kw)
        + tp1d_linear_traffic(in_features=h, out_features=shape.ffn_hidden, orientation="column", **kw)
        + tp1d_linear_traffic(in_features=shape.ffn_hidden, out_features=h, orientation="row", **kw)
    )
    k = shape.num_kv_heads
    if k < p and k < shape.num_heads:  # replicated k and v projections: their weight gradients are summed
        kv = k * shape.head_dim * (h + (1 if shape.linear_bias else 0))
        out += Traffic(0.0, 2 * all_reduce_bytes(kv * param_bytes, p))
    if sequence_parallel:  # the two norms' parameters see only this rank's tokens
        out += Traffic(0.0, 2 * all_reduce_bytes(shape.norm_params * param_bytes, p))
    return out


def tp1d_model_traffic(
    shape: TransformerShape,
    *,
    batch: int,
    seq: int,
    tp: int,
    sequence_parallel: bool = False,
    dtype_bytes: int = 2,
    stream_bytes: int | None = None,
    param_bytes: int = 4,
) -> Traffic:
    """A whole forward + backward: embedding, every block, head and vocab-parallel loss."""
    p, h, t = tp, shape.hidden, batch * seq
    if p == 1:
        return Traffic()
    stream = dtype_bytes if stream_bytes is None else stream_bytes
    out = shape.num_layers * tp1d_block_traffic(
        shape,
        batch=batch,
        seq=seq,
        tp=tp,
        sequence_parallel=sequence_parallel,
        dtype_bytes=dtype_bytes,
        stream_bytes=stream_bytes,
        param_bytes=param_bytes,
    )
    out += Traffic(all_reduce_bytes(t * h * param_bytes, p), 0.0)  # vocab-parallel embedding
    out += Traffic(0.0, all_reduce_bytes(t * h * dtype_bytes, p))  # head's f (cast input)
    out += Traffic(all_reduce_bytes(t * 4, p) + all_reduce_bytes(2 * t * 4, p), 0.0)  # loss: max, [target, sumexp]
    if sequence_parallel:  # scatter at the first block (all-gather backward), gather after the last
        out += Traffic(all_gather_bytes(t * h * stream, p), all_gather_bytes(t * h * stream, p))
    return out


# ----------------------------------------------------------------------------- 2D, 2.5D
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
) -> Traffic:
    """One SUMMA Linear (2D; 2.5D with ``depth`` > 1; ``behemoth.parallel.tensor.tp2d.Linear2D``),
    forward + backward, per rank. ``tokens``: B*S of the tp group. Each of the q steps
    broadcasts an X block ``tokens/(d q) * in/q`` and a W block ``in/q * out/q``; forward once,
    backward twice (re-broadcast + reduce of the partials): ``3 (tokens*in/d + in*out) / q``
    elements, in ``dtype_bytes`` (the autocast dtype). Tesseract adds the all-reduce of dW over
    depth, ``in*out/q**2``; a bias the all-reduce of its gradient over ``tp_row`` (and depth),
    ``out/q`` each; both in ``param_bytes``. A broadcast or reduce books the block on every
    member in payload and wire alike; ``wire=False`` counts an all-reduce's payload (the
    ledger's ``bytes``) instead of its ring wire bytes."""
    q = grid_side(tp, depth)
    if tp == 1:
        return Traffic()
    reduce = all_reduce_bytes if wire else _payload
    fwd = (tokens * in_features / depth + in_features * out_features) / q * dtype_bytes
    bwd = 2 * fwd + reduce(in_features * out_features / q**2 * param_bytes, depth)
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
) -> int:
    """Payload bytes one rank moves for one SUMMA Linear, forward + backward, as the ledger's
    ``bytes`` counts them: :func:`tp2d_linear_traffic` with ``wire=False`` and one element size.
    d = 1 is Optimus (``3 (tokens*in + in*out) / q`` elements), d > 1 Tesseract."""
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
    )
    return round(t.total)


def _kv_replicated2d(
    tokens: int, hidden: int, shape: TransformerShape, tp: int, depth: int, dtype_bytes: int, param_bytes: int
) -> Traffic:
    """A k or v projection with K < q kv heads (tp2d.KVReplicatedLinear2D): SUMMA with a
    ``[D, h/q]`` weight block, then all-reduces of the ``[K D, h/q]`` weight gradient over
    ``tp_col`` and depth (and of a bias over the whole grid)."""
    q, k, d = grid_side(tp, depth), shape.num_kv_heads, shape.head_dim
    fwd = (tokens * hidden / (depth * q) + d * hidden) * dtype_bytes
    grad = k * d * hidden / q * param_bytes
    bwd = 2 * fwd + all_reduce_bytes(grad, q) + all_reduce_bytes(grad, depth)
    if shape.linear_bias:
        bwd += all_reduce_bytes(k * d * param_bytes, tp)
    return Traffic(fwd, bwd)


def _norm2d(shape: TransformerShape, tokens_local: float, q: int, depth: int, param_bytes: int) -> Traffic:
    stat = 4  # statistics in (at least) float32
    if shape.rms_norm:
        fwd, bwd = all_reduce_bytes(tokens_local * stat, q), all_reduce_bytes(tokens_local * stat, q)
    else:
        fwd, bwd = all_gather_bytes(q * 2 * tokens_local * stat, q), all_reduce_bytes(2 * tokens_local * stat, q)
    vec = shape.norm_params / q * param_bytes  # weight (and bias) blocks, replicated over tp_row
    return Traffic(fwd, bwd + all_reduce_bytes(vec, q) + all_reduce_bytes(vec, depth))


def tp2d_block_traffic(
    shape: TransformerShape,
    *,
    batch: int,
    seq: int,
    tp: int,
    depth: int = 1,
    dtype_bytes: int = 2,
    param_bytes: int = 4,
) -> Traffic:
    """One transformer block (2 norms; q/k/v or fused qkv, out; fc and proj, or gate, up and
    down), forward + backward, per rank; attention itself is local."""
    q = grid_side(tp, depth)
    if tp == 1:
        return Traffic()
    h, f, t = shape.hidden, shape.ffn_hidden, batch * seq

    def lin(fin, fout):
        return tp2d_linear_traffic(
            tokens=t,
            in_features=fin,
            out_features=fout,
            tp=tp,
            depth=depth,
            bias=shape.linear_bias,
            dtype_bytes=dtype_bytes,
            param_bytes=param_bytes,
        )

    attn, kv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    if shape.fused_qkv:
        out = lin(h, attn + 2 * kv)
    elif shape.num_kv_heads < q and shape.num_kv_heads != shape.num_heads:  # replicated kv heads
        out = lin(h, attn) + 2 * _kv_replicated2d(t, h, shape, tp, depth, dtype_bytes, param_bytes)
    else:
        out = lin(h, attn) + 2 * lin(h, kv)
    out += lin(attn, h) + (2 if shape.gated_mlp else 1) * lin(h, f) + lin(f, h)
    return out + 2 * _norm2d(shape, t / (depth * q), q, depth, param_bytes)


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
) -> Traffic:
    """A whole forward + backward: embedding, every block, final norm, head and loss, for a
    rank off the grid's diagonal (``diagonal=True``: a rank (i, i), which skips the
    embedding's transpose swap). ``stream_bytes``: the residual stream's element size (the
    embedding output's gradient)."""
    q = grid_side(tp, depth)
    if tp == 1:
        return Traffic()
    stream = param_bytes if stream_bytes is None else stream_bytes
    h, v, t = shape.hidden, shape.vocab_size, batch * seq
    local = t / (depth * q)
    out = shape.num_layers * tp2d_block_traffic(
        shape, batch=batch, seq=seq, tp=tp, depth=depth, dtype_bytes=dtype_bytes, param_bytes=param_bytes
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
    out += _norm2d(shape, local, q, depth, param_bytes)  # final norm
    out += tp2d_linear_traffic(
        tokens=t, in_features=h, out_features=v, tp=tp, depth=depth, dtype_bytes=dtype_bytes, param_bytes=param_bytes
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


# ----------------------------------------------------------------------------- 3D
def cube_side(tp: int) -> int:
    """q of a q x q x q cube with ``tp = q**3``."""
    q = round(tp ** (1 / 3))
    if q**3 != tp:
        raise ValueError(f"tp={tp} is not a cube q**3 (1, 8, 27, 64, ...); tp_mode='3d' needs one.")
    return q


def tp3d_linear_traffic(
    *,
    tokens: int,
    in_features: int,
    out_features: int,
    tp: int,
    bias: bool = False,
    input_grad: bool = True,
    dtype_bytes: int = 2,
    param_bytes: int = 4,
    wire: bool = True,
) -> Traffic:
    """One 3D Linear (behemoth.parallel.tensor.tp3d.Linear3D), forward + backward, per rank;
    ``tokens``: B*S of the tp group (T). Forward: all-gather X over the input axis (``T K/q**2``
    gathered), W over tp_depth (``K N/q**2``), reduce-scatter Y over the output axis
    (``T N/q**2``); backward: all-gather dY, re-gather X, reduce-scatter dW, and with
    ``input_grad`` re-gather W and reduce-scatter dX -- ``(3 T K + 3 K N + 2 T N) / q**2``
    elements of payload in all, ``(q-1)/q`` of it on the wire, in ``dtype_bytes`` (shards are
    cast before they travel). A bias all-reduces its ``N/q`` gradient over the output axis and
    tp_depth, in ``param_bytes``. Over-decomposition (``tp_overlap``) moves the same bytes.
    ``wire=False``: the payload (the ledger's ``bytes``) instead of the wire bytes."""
    q = cube_side(tp)
    if q == 1:
        return Traffic()
    t, k, n = tokens, in_features, out_features
    ring = ((q - 1) / q if wire else 1.0) / q**2
    fwd = (t * k + k * n + t * n) * ring * dtype_bytes
    bwd = (t * n + t * k + k * n + ((t * k + k * n) if input_grad else 0)) * ring * dtype_bytes
    if bias:
        bwd += 2 * (all_reduce_bytes if wire else _payload)(n / q * param_bytes, q)
    return Traffic(fwd, bwd)


def linear3d_bytes(
    tokens: int,
    in_features: int,
    out_features: int,
    q: int,
    *,
    bias: bool = False,
    input_grad: bool = True,
    element_size: int = 4,
    wire: bool = False,
) -> float:
    """Bytes one rank moves for one 3D Linear, forward + backward, in one element size: the
    payload as the ledger's ``bytes`` counts it (an int), or with ``wire=True`` its
    ``wire_bytes``; :func:`tp3d_linear_traffic`. q = 1 moves nothing."""
    t = tp3d_linear_traffic(
        tokens=tokens,
        in_features=in_features,
        out_features=out_features,
        tp=q**3,
        bias=bias,
        input_grad=input_grad,
        dtype_bytes=element_size,
        param_bytes=element_size,
        wire=wire,
    )
    return t.total if wire else round(t.total)


def tp3d_block_traffic(
    shape: TransformerShape, *, batch: int, seq: int, tp: int, dtype_bytes: int = 2, param_bytes: int = 4
) -> Traffic:
    """One transformer block on the cube (2 norms; q/k/v or fused qkv, out; fc and proj, or
    gate, up and down), forward + backward, per rank; attention itself is local. Every Linear
    gathers its own input (no sharing between q, k and v). Norms: statistics over the hidden
    axis (as 2D), weight (and bias) gradients all-reduced over tp_row and tp_depth."""
    q = cube_side(tp)
    if q == 1:
        return Traffic()
    h, f, t = shape.hidden, shape.ffn_hidden, batch * seq

    def lin(fin, fout):
        return tp3d_linear_traffic(
            tokens=t,
            in_features=fin,
            out_features=fout,
            tp=tp,
            bias=shape.linear_bias,
            dtype_bytes=dtype_bytes,
            param_bytes=param_bytes,
        )

    attn, kv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    out = lin(h, attn + 2 * kv) if shape.fused_qkv else lin(h, attn) + 2 * lin(h, kv)
    out += lin(attn, h) + (2 if shape.gated_mlp else 1) * lin(h, f) + lin(f, h)
    return out + 2 * _norm2d(shape, t / q**2, q, q, param_bytes)


def tp3d_model_traffic(
    shape: TransformerShape,
    *,
    batch: int,
    seq: int,
    tp: int,
    dtype_bytes: int = 2,
    stream_bytes: int | None = None,
    param_bytes: int = 4,
    position_rows: int = 1,
) -> Traffic:
    """A whole forward + backward on the cube: embedding, every block, final norm, head and
    loss. The embedding all-gathers the int64 ids of this rank's input block over tp_col and
    tp_depth, reduce-scatters its partial lookups ``[T, h/q]`` over tp_depth then tp_row
    (the same all-gathers backward, in ``stream_bytes``); a learned position table
    all-gathers ``position_rows`` rows of positions over tp_col (1: the models' default
    ``[1, S]``) and all-reduces its gradient over tp_row and tp_depth; the head is a 3D
    Linear; the vocab-parallel loss all-reduces ``[T/q**2]`` maxima and ``[2, T/q**2]`` sums
    over tp_row."""
    q = cube_side(tp)
    if q == 1:
        return Traffic()
    stream = param_bytes if stream_bytes is None else stream_bytes
    h, v, t = shape.hidden, shape.vocab_size, batch * seq
    local = t / q**2
    out = shape.num_layers * tp3d_block_traffic(
        shape, batch=batch, seq=seq, tp=tp, dtype_bytes=dtype_bytes, param_bytes=param_bytes
    )
    ids = all_gather_bytes(q * local * 8, q) + all_gather_bytes(q * q * local * 8, q)
    lookup = reduce_scatter_bytes(t * h / q, q) + reduce_scatter_bytes(t * h / q**2, q)
    out += Traffic(ids + lookup * param_bytes, lookup * stream)
    if shape.max_positions:
        pos = shape.max_positions * h / q * param_bytes
        out += Traffic(all_gather_bytes(q * position_rows * seq * 8, q), 2 * all_reduce_bytes(pos, q))
    out += _norm2d(shape, local, q, q, param_bytes)  # final norm
    out += tp3d_linear_traffic(
        tokens=t, in_features=h, out_features=v, tp=tp, dtype_bytes=dtype_bytes, param_bytes=param_bytes
    )  # head
    out += Traffic(all_reduce_bytes(local * 4, q) + all_reduce_bytes(2 * local * 4, q), 0.0)  # loss
    return out


_LINEAR = {
    "1d": tp1d_linear_traffic,
    "2d": tp2d_linear_traffic,
    "2.5d": tp2p5d_linear_traffic,
    "3d": tp3d_linear_traffic,
}
_BLOCK = {"1d": tp1d_block_traffic, "2d": tp2d_block_traffic, "2.5d": tp2p5d_block_traffic, "3d": tp3d_block_traffic}


def linear_traffic(mode: str, **kwargs) -> Traffic:
    """Per-rank bytes of one Linear, forward + backward, for ``tp_mode`` ``mode``."""
    return _LINEAR[mode](**kwargs)


def block_traffic(mode: str, shape: TransformerShape, **kwargs) -> Traffic:
    """Per-rank bytes of one transformer block, forward + backward, for ``tp_mode`` ``mode``."""
    return _BLOCK[mode](shape, **kwargs)


def model_traffic(mode: str, shape: TransformerShape, **kwargs) -> Traffic:
    """Per-rank bytes of a whole model's forward + backward, for ``tp_mode`` ``mode``."""
    if mode == "1d":
        return tp1d_model_traffic(shape, **kwargs)
    if mode in ("2d", "2.5d"):
        return tp2d_model_traffic(shape, **kwargs)
    if mode == "3d":
        return tp3d_model_traffic(shape, **kwargs)
    raise ValueError(f"tp_mode={mode!r}: one of '1d', '2d', '2.5d', '3d'.")

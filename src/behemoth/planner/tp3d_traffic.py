"""Per-rank bytes of 3D tensor parallelism, for a model and a batch.

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


Units and notation: :mod:`behemoth.planner.traffic`.
"""

from __future__ import annotations

from functools import partial

from ..specs import TransformerShape
from .collectives import Traffic, all_gather_bytes, all_reduce_bytes, payload, reduce_scatter_bytes
from .tp2d_traffic import grid_experts_traffic, grid_linears_traffic, norm2d


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
        bwd += 2 * (all_reduce_bytes if wire else payload)(n / q * param_bytes, q)
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


def linear3d_no_grad_bytes(
    tokens: int,
    in_features: int,
    out_features: int,
    q: int,
    *,
    stationary: bool | None = None,
    element_size: int = 2,
    wire: bool = False,
) -> float:
    """Bytes one rank moves for one 3D Linear's forward without autograd (generation: a decode
    step's ``tokens`` = rows of the tp group), as the ledger counts them (payload, or with
    ``wire=True`` its ``wire_bytes``). Per rank ``rows = T/q**2`` tokens, ``n_in = K/q``,
    ``n_out = N/q**2`` (the weight block). The training form (``Linear3D.forward``'s): all-gather
    X over the input axis and W over tp_depth, reduce-scatter Y over the output axis -- payload
    ``q rows n_in + q n_in n_out + q**2 rows n_out`` = ``(T K + K N + T N) / q**2``. The
    weight-stationary form (``tp3d.stationary_linear``): all-gather X over the input axis then
    tp_depth, reduce-scatter the partials over the output axis, all-to-all over tp_depth --
    payload ``q (q+1) rows (n_in + n_out)``, no weight element. Wire: ``(q-1)/q`` of the payload
    in both. ``stationary=None``: the form ``Linear3D.forward_no_grad`` picks
    (``tp3d.stationary_is_cheaper``: fewer wire bytes). A bias adds nothing; q = 1 moves nothing."""
    if q == 1:
        return 0
    rows, n_in, n_out = tokens // q**2, in_features // q, out_features // q**2
    if stationary is None:
        stationary = rows * (q * n_in + n_out) < n_in * n_out
    if stationary:
        elements = q * (q + 1) * rows * (n_in + n_out)
    else:
        elements = q * rows * n_in + q * n_in * n_out + q * q * rows * n_out
    return elements * element_size * ((q - 1) / q if wire else 1)


def tp3d_block_traffic(
    shape: TransformerShape,
    *,
    batch: int,
    seq: int,
    tp: int,
    dtype_bytes: int = 2,
    param_bytes: int = 4,
    stream_bytes: int | None = None,
    experts: int = 0,
) -> Traffic:
    """One transformer block on the cube (2 norms; q/k/v or fused qkv, out; fc and proj, or
    gate, up and down), forward + backward, per rank; attention itself is local. Every Linear
    gathers its own input (no sharing between q, k and v). Norms: statistics over the hidden
    axis (as 2D), weight (and bias) gradients all-reduced over tp_row and tp_depth. With
    ``experts`` (E > 0) the MLP is a mixture of experts the cube's rows (``tp_col``) run on whole
    rows of their ``T/q**2`` tokens (:func:`~.tp2d_traffic.grid_experts_traffic`)."""
    q = cube_side(tp)
    if q == 1:
        return Traffic()
    t = batch * seq
    lin = partial(
        tp3d_linear_traffic, tokens=t, tp=tp, bias=shape.linear_bias, dtype_bytes=dtype_bytes, param_bytes=param_bytes
    )
    out = grid_linears_traffic(shape, lin, mlp=not experts) + 2 * norm2d(shape, t / q**2, q, q, param_bytes)
    if experts:
        out += grid_experts_traffic(
            tokens=t / q**2,
            hidden=shape.hidden,
            q=q,
            depth=q,
            mode="3d",
            experts=experts,
            stream_bytes=param_bytes if stream_bytes is None else stream_bytes,
        )
    return out


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
    experts: int = 0,
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
        shape,
        batch=batch,
        seq=seq,
        tp=tp,
        dtype_bytes=dtype_bytes,
        param_bytes=param_bytes,
        stream_bytes=stream,
        experts=experts,
    )
    ids = all_gather_bytes(q * local * 8, q) + all_gather_bytes(q * q * local * 8, q)
    lookup = reduce_scatter_bytes(t * h / q, q) + reduce_scatter_bytes(t * h / q**2, q)
    out += Traffic(ids + lookup * param_bytes, lookup * stream)
    if shape.max_positions:
        pos = shape.max_positions * h / q * param_bytes
        out += Traffic(all_gather_bytes(q * position_rows * seq * 8, q), 2 * all_reduce_bytes(pos, q))
    out += norm2d(shape, local, q, q, param_bytes)  # final norm
    out += tp3d_linear_traffic(
        tokens=t, in_features=h, out_features=v, tp=tp, dtype_bytes=dtype_bytes, param_bytes=param_bytes
    )  # head
    out += Traffic(all_reduce_bytes(local * 4, q) + all_reduce_bytes(2 * local * 4, q), 0.0)  # loss
    return out

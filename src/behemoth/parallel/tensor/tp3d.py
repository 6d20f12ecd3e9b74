"""3D tensor parallelism (Bian et al., "Maximizing Parallelism in Distributed Training for
Huge Neural Networks", arXiv 2105.14450, Colossal-AI's 3D) with Tensor3D / AxoNN's
over-decomposition (Singh et al., arXiv 2305.13525): p = q**3 ranks on a q x q x q cube.

Cube. Rank (d, r, c) has ``d = mesh.coord("tp_depth")``, ``r = mesh.coord("tp_row")``, ``c =
mesh.coord("tp_col")``; tp rank ``(d*q + r)*q + c``. Every collective runs over one of the
three axes (q members each).

Activation layouts (``[B, S, H]`` of the tp group -> ``[B/q**2, S, H/q]`` per rank):

==========  ===============================  =================  ==========================
layout      batch block (of q**2)            hidden block (q)   where
==========  ===============================  =================  ==========================
canonical   ``d*q + r`` (tp_depth, tp_row)   ``c`` (tp_col)     residual stream, norms,
                                                                embedding output
swapped     ``d*q + c`` (tp_depth, tp_col)   ``r`` (tp_row)     between the Linears of a
                                                                pair (attention heads, MLP)
==========  ===============================  =================  ==========================

Linear. ``Y = X W`` (W = ``weight.T``) over three roles: the *input* axis I (the inner batch
axis of the input layout), the *output* axis O (the hidden axis of the input layout) and the
*weight* axis W = tp_depth. Rank (i, w, o) holds X block ``[M(w, i), K(o)]`` and W block
``[K(o), N(i, w)]`` (``in/q x out/q**2``; no two ranks hold the same weight block). Forward:
all-gather X over I (-> ``[M(w), K(o)]``), all-gather W over W (-> ``[K(o), N(i)]``), GEMM,
reduce-scatter the partial sums over O (-> ``[M(w, o), N(i)]``), which is the other layout:
``Linear3D(swapped=False)`` reads canonical and writes swapped, ``swapped=True`` the reverse,
so a pair (QKV -> attention -> out, fc1 -> act -> fc2) returns to canonical with no
redistribution. Backward: all-gather dY over O, re-gather W and X (only the shards are
saved, so saved activations are ``B S H / p``), reduce-scatter dX over I and dW over W.
Biases: block N(i), replicated over (W, O); their gradients are all-reduced there.

Per rank, one Linear forward + backward moves ``(3 T K + 3 K N + 2 T N) / q**2`` elements
(T = B*S of the tp group; ``behemoth.planner.tp3d_traffic.linear3d_bytes``).

Without autograd (generation, :func:`.base.no_grad_forward`) a Linear runs weight-stationary
while that moves fewer elements (:func:`stationary_is_cheaper`, shapes alone: every rank picks
alike): the training forward's weight gather over W, ``(q-1) K N / q**3`` elements a rank whatever
the tokens, dominates a decode step, so instead the tokens come to the weights. The weight blocks
of in-block o sit on the (I, W) plane of the ranks with O coordinate o, which also holds every
token's in-block o: all-gather X over I and W (every token, ``[T, K/q]``), one GEMM with the
rank's own block, reduce-scatter the partials over O, all-to-all over W into the training
forward's output layout (:func:`stationary_linear`); ``(q**2-1) (T/q**2) (K/q + N/q**2)``
elements received a rank, no weight element (``planner.tp3d_traffic.linear3d_no_grad_bytes``).
It wins while ``(T/q**2) (K + N/q**2) < K N / q**3``: a decode step's few rows, not a prompt's.
``Linear3D.weight_stationary = False`` keeps the training form; no over-decomposition there.

Over-decomposition (``overlap=k``): the rank's tokens are cut into k pieces; piece p+1's
gathers are in flight while piece p's GEMM runs, and piece p's reduce-scatter while piece
p+1 computes (asynchronous collectives, ``comm.all_gather_async`` / ``reduce_scatter_async``).
Any equal split of the local rows is consistent with the layouts, so the result equals k = 1
(up to the summation order of dW) and the bytes are the same.

Norms (:mod:`.norms3d`) all-reduce their statistics over the hidden axis of their layout. The embeddings, head
and loss live in :mod:`.embed3d`: the token embedding
and LM head share one table layout (vocab block ``r*q + d`` of q**2, hidden block c) so they
can be tied; the embedding reduce-scatters its partial lookups over tp_depth then tp_row, the
cross-entropy all-reduces max, target logit and sum-exp over the vocab axis (tp_row for the
head's swapped logits); no rank ever holds full logits.

Model level (:mod:`.styles3d`): the engine gives each rank the rows of
its *swapped*-layout batch block, ``d*q + c`` (:data:`INPUT_BATCH_AXES` = tp_depth, tp_col), of
every input tensor -- the rows its attention and its logits hold, so model-derived masks,
position ids and RoPE tables line up with the heads, and the labels with the logits, with no
communication. ``local_ids`` (Embedding3D) all-gathers those int64 ids into the tp group's;
``local_positions`` (PositionEmbedding3D) re-indexes per-row positions onto the canonical rows
of the residual stream; ``local_labels`` (the head) takes the labels block as it is.

Modules: this one (cube, layouts, Linear3D), :mod:`.norms3d` (LayerNorm, RMSNorm), :mod:`.embed3d`
(embeddings, LM head, vocab-parallel loss), :mod:`.styles3d` (one style per role and the model-level checks).

Tested in tests/dist/test_tp3d_layers.py (world 8, q = 2) against the serial layers in float64,
and whole models in tests/dist/test_tp3d.py.

Shape legend: B, S, H, V of the tp group; lower case is this rank's block (b = B/q**2,
h = H/q, v = V/q); M tokens, K in-features, N out-features.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ... import comm
from ...comm import Axis
from .base import require_mode
from .functional import autocast_dtype, replicated
from .layout import DimShard, ShardSpec, check_block_width, check_divisible, check_linear_blocks, set_spec, shard_tensor
from .serial import linear_from_serial
from .stationary import cube_stationary_is_cheaper as stationary_is_cheaper

__all__ = [
    "Cube",
    "Layout",
    "cube_of",
    "activation_spec_3d",
    "split_batch_3d",
    "split_activation_3d",
    "gather_batch_3d",
    "gather_activation_3d",
    "Linear3D",
    "stationary_is_cheaper",
    "stationary_linear",
    "layout_name",
    "INPUT_BATCH_AXES",
]

MODE = "3d"
INPUT_BATCH_AXES = ("tp_depth", "tp_col")
"""The mesh axes (outermost first) whose coordinates give the batch block of a model's inputs
on this rank (``d*q + c``: the swapped layout, that of attention and of the logits)."""


# --------------------------------------------------------------------------- cube (pure)
@dataclass(frozen=True)
class Layout:
    """Where a tp-group activation ``[B, S, H]`` sits: batch block ``depth*q + inner``, hidden
    block ``hidden``; each axis carries its coordinate (``.rank``) and name."""

    depth: Axis
    inner: Axis
    hidden: Axis

    @property
    def q(self) -> int:
        return self.hidden.size

    @property
    def batch_index(self) -> int:
        return self.depth.rank * self.q + self.inner.rank


@dataclass(frozen=True)
class Cube:
    """This rank's axes of the q x q x q cube."""

    q: int
    depth: Axis
    row: Axis
    col: Axis

    def layout(self, swapped: bool) -> Layout:
        """Canonical: batch over (tp_depth, tp_row), hidden over tp_col; swapped: row <-> col."""
        return Layout(self.depth, self.col, self.row) if swapped else Layout(self.depth, self.row, self.col)


def cube_of(mesh, who: str) -> Cube:
    """The :class:`Cube` of a tp_mode='3d' mesh (``who`` is named in the error otherwise)."""
    require_mode(mesh, MODE, who)
    row = mesh.axis("tp_row")
    return Cube(row.size, mesh.axis("tp_depth"), row, mesh.axis("tp_col"))


def weight_spec(lay: Layout, out_f: int, in_f: int, fused: int, in_out: bool) -> ShardSpec:
    """Weight of a Linear reading layout ``lay``: out block ``i*q + w`` of q**2 over (I, W) =
    (lay.inner, tp_depth), in block ``o`` of q over O = lay.hidden. ``fused`` views the out
    dim as ``(fused, out/fused)`` and blocks the per-part dim; ``in_out`` is Conv1D's [in, out]."""
    q = lay.q
    if in_out:
        full, view = (in_f, out_f), ((in_f, fused, out_f // fused) if fused > 1 else None)
        o_dim, i_dim = (2 if fused > 1 else 1), 0
    else:
        full, view = (out_f, in_f), ((fused, out_f // fused, in_f) if fused > 1 else None)
        o_dim, i_dim = (1, 2) if fused > 1 else (0, 1)
    dims = (
        DimShard(o_dim, q * q, lay.inner.rank * q + lay.depth.rank, (lay.inner.name, lay.depth.name)),
        DimShard(i_dim, q, lay.hidden.rank, (lay.hidden.name,)),
    )
    return ShardSpec(full, dims, (), view, fused_dim=1 if in_out else 0)


# --------------------------------------------------------------------------- activation layout
def activation_spec(full_shape, lay: Layout, hidden: bool) -> ShardSpec:
    full_shape, q = tuple(full_shape), lay.q
    check_divisible("batch size", full_shape[0], q * q, MODE)
    dims = [DimShard(0, q * q, lay.batch_index, (lay.depth.name, lay.inner.name))]
    if hidden:
        check_divisible("hidden size", full_shape[-1], q, MODE)
        dims.append(DimShard(len(full_shape) - 1, q, lay.hidden.rank, (lay.hidden.name,)))
    return ShardSpec(full_shape, tuple(dims), (lay.hidden.name,) if not hidden and q > 1 else ())


def activation_spec_3d(full_shape, mesh, *, hidden: bool = True, swapped: bool = False) -> ShardSpec:
    """ShardSpec of a tp-group activation ``[B, ..., H]``: batch block ``d*q + r`` over
    (tp_depth, tp_row) and hidden block c over tp_col; ``swapped`` exchanges tp_row and tp_col.
    Without ``hidden`` (ids, labels, per-token losses) the block is replicated over the hidden axis."""
    return activation_spec(full_shape, cube_of(mesh, "activation_spec_3d").layout(swapped), hidden)


def split_batch_3d(x_B: torch.Tensor, mesh, *, swapped: bool = False) -> torch.Tensor:
    """This rank's batch block ``[B/q**2, ...]`` of a tp-group tensor. No communication."""
    return shard_tensor(x_B, activation_spec_3d(x_B.shape, mesh, hidden=False, swapped=swapped))


def split_activation_3d(x_BSH: torch.Tensor, mesh, *, swapped: bool = False) -> torch.Tensor:
    """``[B, S, H] -> [B/q**2, S, H/q]`` in the canonical (or swapped) layout. No communication."""
    return shard_tensor(x_BSH, activation_spec_3d(x_BSH.shape, mesh, swapped=swapped))


def gather_batch(x: torch.Tensor, lay: Layout) -> torch.Tensor:
    return comm.GatherFromAxis.apply(comm.GatherFromAxis.apply(x, lay.inner, 0), lay.depth, 0)


def gather_activation(x: torch.Tensor, lay: Layout) -> torch.Tensor:
    return gather_batch(comm.GatherFromAxis.apply(x, lay.hidden, x.dim() - 1), lay)


def gather_batch_3d(x_b: torch.Tensor, mesh, *, swapped: bool = False) -> torch.Tensor:
    """Inverse of :func:`split_batch_3d`: all-gather over the inner batch axis, then tp_depth;
    backward keeps this rank's slice of the gradient."""
    return gather_batch(x_b, cube_of(mesh, "gather_batch_3d").layout(swapped))


def gather_activation_3d(x_bSh: torch.Tensor, mesh, *, swapped: bool = False) -> torch.Tensor:
    """Inverse of :func:`split_activation_3d`: ``[B/q**2, S, H/q] -> [B, S, H]`` on every rank
    (all-gather over the hidden axis, the inner batch axis, tp_depth); slice backward."""
    return gather_activation(x_bSh, cube_of(mesh, "gather_activation_3d").layout(swapped))


# --------------------------------------------------------------------------- the 3D matmul
def _gather_weight(w: torch.Tensor, axis: Axis, fused: int) -> comm.AsyncCollective:
    """Start the all-gather of ``w [N/q**2, K/q]`` over the weight axis along the out dim,
    fused parts kept apart (``[f, n/q**2, K/q] -> [f, n/q, K/q]``)."""
    return comm.all_gather_async(w.reshape(fused, -1, w.shape[-1]), axis, 1)


def gathered_linear(x: torch.Tensor, w: torch.Tensor, axes, fused: int, k: int = 1) -> torch.Tensor:
    """The training forward of a 3D Linear, no autograd (:class:`_Linear3DFn`'s, and the no-grad
    forward's for many tokens): ``x [m, K/q]`` (batch block (w, i)), ``w [N/q**2, K/q]`` ->
    ``y [m, N/q]`` (batch block (w, o)); ``axes`` = (I, W, O). All-gather w over W; for each of
    the ``k`` pieces of x: all-gather over I (piece p+1's issued before piece p's GEMM), GEMM,
    reduce-scatter over O (in flight while the next piece computes)."""
    I, W, O = axes
    w_h = _gather_weight(w, W, fused)
    xs = x.chunk(k, 0)
    nxt = comm.all_gather_async(xs[0], I, 0)
    wg = w_h.wait().reshape(-1, w.shape[-1])
    ys = []
    for p in range(k):
        xg = nxt.wait()
        if p + 1 < k:
            nxt = comm.all_gather_async(xs[p + 1], I, 0)
        ys.append(comm.reduce_scatter_async(xg @ wg.t(), O, 0))
    return torch.cat([h.wait() for h in ys], 0)


class _Linear3DFn(torch.autograd.Function):
    """``y = x @ w.T`` on the cube. ``x [m, K/q]``: this rank's tokens (batch block (w, i));
    ``w [N/q**2, K/q]``; ``y [m, N/q]`` (batch block (w, o)). ``axes`` = (I, W, O).

    Forward: all-gather w over W; for each of the ``k`` pieces of x: all-gather over I (piece
    p+1's issued before piece p's GEMM), GEMM, reduce-scatter over O (in flight while the next
    piece computes). Backward: all-gather w over W (for dX); for each piece: all-gather dy
    over O and x over I, reduce-scatter ``dy @ w`` over I, accumulate ``dy.T @ x``; finally
    reduce-scatter dW over W. Only the shards x and w are saved (``save_for_backward``)."""

    @staticmethod
    def forward(ctx, x, w, axes, fused: int, k: int):
        ctx.axes, ctx.fused, ctx.k = axes, fused, k
        ctx.save_for_backward(x, w)
        return gathered_linear(x, w, axes, fused, k)

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        (I, W, O), k = ctx.axes, ctx.k
        need_dx, need_dw = ctx.needs_input_grad[:2]
        w_h = _gather_weight(w, W, ctx.fused) if need_dx else None
        dys, xs = dy.contiguous().chunk(k, 0), x.chunk(k, 0)

        def start(p):
            return comm.all_gather_async(dys[p], O, 0), (comm.all_gather_async(xs[p], I, 0) if need_dw else None)

        nxt = start(0)
        wg = w_h.wait().reshape(-1, w.shape[-1]) if need_dx else None
        dxs, dw = [], None
        for p in range(k):
            dyg, xg = nxt[0].wait(), (nxt[1].wait() if need_dw else None)
            if p + 1 < k:
                nxt = start(p + 1)
            if need_dx:
                dxs.append(comm.reduce_scatter_async(dyg @ wg, I, 0))
            if need_dw:
                part = dyg.t() @ xg
                dw = part if dw is None else dw.add_(part)
        dw_h = comm.reduce_scatter_async(dw.view(ctx.fused, -1, dw.shape[-1]), W, 1) if need_dw else None
        dx = torch.cat([h.wait() for h in dxs], 0) if need_dx else None
        dw = dw_h.wait().reshape(w.shape) if need_dw else None
        return dx, dw, None, None, None


# --------------------------------------------------------------------------- without autograd
def stationary_linear(x: torch.Tensor, w: torch.Tensor, axes, fused: int) -> torch.Tensor:
    """``y = x @ w.T`` with every weight block left where it is: ``x [m, K/q]`` (batch block (w, i),
    in-block o), ``w [N/q**2, K/q]`` (out block (i, w), in-block o) -> ``y [m, N/q]`` in the
    layout :func:`gathered_linear` writes (batch block (w, o), out block i); ``axes`` = (I, W, O).

    The weight blocks of in-block o (every out block) sit on the (I, W) plane of the ranks with
    O coordinate o, which also holds every token's in-block o: all-gather x over I, then W (every
    batch block, in block order ``w*q + i``), one GEMM with the rank's own block (the partial
    ``X[:, K(o)] W[K(o), N(i, w)]`` of every token), reduce-scatter over O summing the in-blocks
    (the rank keeps batch blocks ``(w', o)`` of every w'), and an all-to-all over W that sends
    block ``(w', o)`` to depth w' and brings back, from every depth, its own block's columns
    ``N(i, w')`` -- concatenated in depth order (per fused part), the out block N(i). Four
    collectives, ``(q**2-1) m (K/q + N/q**2)`` elements received per rank, no weight element.
    No autograd."""
    I, W, O = axes
    q, m = O.size, x.shape[0]
    xs = comm.all_gather(comm.all_gather(x, I, 0), W, 0)  # [q*q*m, K/q]: batch blocks w*q + i
    part = (xs @ w.t()).view(q, q, m, -1).transpose(0, 1).reshape(q * q * m, -1)  # blocks i*q + w
    part = comm.reduce_scatter(part, O, 0)  # [q*m, N/q**2]: blocks (w', o) of every w', summed
    y = comm.all_to_all_rows(part, W, [m] * q, [m] * q)  # from depth w': [m, N(i, w')]
    return y.view(q, m, fused, -1).permute(1, 2, 0, 3).reshape(m, -1)


def layout_name(swapped: bool) -> str:
    return (
        "swapped [B/q^2 over (tp_depth, tp_col), S, H/q over tp_row]"
        if swapped
        else "canonical [B/q^2 over (tp_depth, tp_row), S, H/q over tp_col]"
    )


class Linear3D(nn.Module):
    """``y = x W^T + b`` on the q x q x q cube.

    ``swapped=False``: input in the canonical layout, output in the swapped one (I = tp_row,
    O = tp_col); ``swapped=True`` the reverse (I = tp_col, O = tp_row); W = tp_depth always.
    Chain them alternately (QKV / fc1 with ``False``, out-proj / fc2 with ``True``).
    Weight ``[out, in]``: out block ``i*q + w`` of q**2 (over I, tp_depth), in block o of q
    (over O). ``fused=3``: a fused QKV (``[q|k|v]`` rows) viewed as ``[3, out/3, in]`` and
    blocked on the middle dim, so the local output is ``[q_i | k_i | v_i]`` of heads block i.
    ``weight_layout="in_out"``: a transformers Conv1D weight ``[in, out]`` in its own orientation.
    ``overlap=k``: Tensor3D over-decomposition of the rank's tokens into k pieces.
    Build with :meth:`from_serial`; ``__init__`` zero-fills the shards.
    """

    weight_stationary: bool = True
    """Without autograd, run weight-stationary while that moves fewer elements than the training
    forward (:meth:`forward_no_grad`, :func:`stationary_is_cheaper`; set False, on the class or
    an instance, for the training form always)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        mesh,
        *,
        bias: bool = True,
        swapped: bool = False,
        fused: int = 1,
        overlap: int = 1,
        weight_layout: str = "out_in",
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        name = type(self).__name__
        cube = self.cube = cube_of(mesh, name)
        q = cube.q
        check_linear_blocks(name, in_features, out_features, fused, weight_layout, q, q * q, MODE)
        if not isinstance(overlap, int) or isinstance(overlap, bool) or overlap < 1:
            raise ValueError(f"{name}: overlap={overlap!r} must be an integer >= 1 (1 = no over-decomposition).")
        self.in_features, self.out_features, self.fused, self.overlap = in_features, out_features, fused, overlap
        self.swapped, self.weight_layout = swapped, weight_layout
        lay = self.in_layout = cube.layout(swapped)
        self.out_layout = cube.layout(not swapped)
        kw = dict(device=device, dtype=dtype)
        wspec = weight_spec(lay, out_features, in_features, fused, weight_layout == "in_out")
        self.weight = set_spec(nn.Parameter(torch.zeros(wspec.local_shape(), **kw)), wspec)
        if bias:
            bspec = ShardSpec(
                (out_features,),
                (DimShard(int(fused > 1), q, lay.inner.rank, (lay.inner.name,)),),
                (lay.depth.name, lay.hidden.name) if q > 1 else (),
                (fused, out_features // fused) if fused > 1 else None,
            )
            self.bias = set_spec(nn.Parameter(torch.zeros(bspec.local_shape(), **kw)), bspec)
        else:
            self.register_parameter("bias", None)

    from_serial = classmethod(linear_from_serial)
    """``from_serial(module, mesh, *, swapped=False, fused=1, overlap=1)``: shard an ``nn.Linear``
    (or a transformers ``Conv1D``)."""

    def _check_input(self, x: torch.Tensor) -> int:
        q, layout = self.cube.q, layout_name(self.swapped)
        return check_block_width(type(self).__name__, x, self.in_features, q, "the hidden block in_features", layout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lay, name, n_in = self.in_layout, type(self).__name__, self._check_input(x)
        rows = x.numel() // n_in
        if rows % self.overlap:
            raise ValueError(
                f"{name}: tokens per rank (local batch x sequence) = {rows} is not divisible by "
                f"overlap = {self.overlap}; choose an overlap that divides it."
            )
        w = self.weight.t() if self.weight_layout == "in_out" else self.weight
        dt = autocast_dtype(x)
        if dt is not None:  # cast the shards before they travel: half the bytes
            x, w = x.to(dt), w.to(dt)
        y = _Linear3DFn.apply(x.reshape(-1, n_in), w, (lay.inner, lay.depth, lay.hidden), self.fused, self.overlap)
        y = y.view(*x.shape[:-1], y.shape[-1])
        if self.bias is not None:
            y = y + replicated(self.bias, lay.hidden, lay.depth).to(y.dtype)
        return y

    def forward_no_grad(self, x: torch.Tensor) -> torch.Tensor:
        """The forward without autograd (:func:`~.base.no_grad_forward`): the same numbers up to
        the order of the in-block sums, in the same output layout; weight-stationary for a few
        tokens (:func:`stationary_linear`: a decode step moves activations, not the weight
        blocks the training forward gathers over tp_depth), the training form for many
        (:func:`stationary_is_cheaper`; no over-decomposition either way)."""
        lay, n_in, q = self.in_layout, self._check_input(x), self.cube.q
        w = self.weight.t() if self.weight_layout == "in_out" else self.weight
        dt = autocast_dtype(x)
        if dt is not None:
            x, w = x.to(dt), w.to(dt)
        x2, axes = x.reshape(-1, n_in), (lay.inner, lay.depth, lay.hidden)
        stationary = self.weight_stationary and q > 1 and stationary_is_cheaper(x2.shape[0], n_in, w.shape[0], q)
        y = stationary_linear(x2, w, axes, self.fused) if stationary else gathered_linear(x2, w, axes, self.fused)
        y = y.view(*x.shape[:-1], y.shape[-1])
        return y if self.bias is None else y.add_(self.bias.to(y.dtype))

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features}, out={self.out_features}, q={self.cube.q}, swapped={self.swapped}, "
            f"fused={self.fused}, overlap={self.overlap}, bias={self.bias is not None}"
        )

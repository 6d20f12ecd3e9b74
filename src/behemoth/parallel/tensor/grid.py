"""The q x q grid that 2D (Optimus, arXiv 2104.05343) and 2.5D (Tesseract, arXiv 2105.14500)
tensor parallelism share: this rank's place on it, the activation layout, and SUMMA.

Grid. The tp group is a (d x) q x q grid (p = d q**2; 2D is d = 1); rank (depth, i, j) has
``depth = mesh.coord("tp_depth")``, ``i = mesh.coord("tp_row")``, ``j = mesh.coord("tp_col")``,
tp rank ``(depth*q + i)*q + j``. The mesh axis ``"tp_col"`` is *my grid row* (members share i,
vary j); ``"tp_row"`` is *my grid column* (members share j, vary i).

* Activations ``x_bSh``: batch split over (depth, grid rows), hidden over grid columns -- rank
  (depth, i, j) holds batch block ``depth*q + i`` and hidden block j, ``[b/(d q), s, h/q]``
  (:func:`activation_spec`).
* SUMMA (:class:`SummaFn`): ``y = x W^T`` with x block (i, k) and W block (k, j): the blocks
  SUMMA's q steps broadcast along the grid row and down the grid column, gathered by one
  all-gather each, then one GEMM; backward re-gathers X (W is kept from the forward) and
  reduce-scatters the partials. Per device ``(3 bsh/d + 2 h h_o) / q`` elements per Linear
  (``behemoth.planner.tp2d_traffic``).
* Parameters replicated over ``tp_row`` (biases, norm weights) or ``tp_depth`` (every weight
  under Tesseract) go through :func:`replicate_on`, so their gradients are summed there.

The layers built on this are :mod:`.tp2d` / :mod:`.embed2d` (2D) and :mod:`.tp2p5d` (2.5D,
the same layers with a depth axis). Tested in tests/dist/test_tp2d_layers.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ... import comm
from ...comm import Axis
from ...comm.traced import regather
from .base import require_mode
from .layout import DimShard, ShardSpec, check_divisible
from .stationary import grid_stationary_is_cheaper as stationary_is_cheaper


# --------------------------------------------------------------------------- grid (pure)
@dataclass(frozen=True)
class Grid:
    """This rank's place on the (d x) q x q grid and the axes it talks over."""

    mode: str
    q: int
    depth_size: int
    row: int
    """i: my batch block within the depth slab; the in-block of the weight I hold."""
    col: int
    """j: my hidden block; the out-block of the weight I hold."""
    depth: int
    row_axis: Axis
    """mesh axis "tp_row": my grid column (members share j, vary i)."""
    col_axis: Axis
    """mesh axis "tp_col": my grid row (members share i, vary j)."""
    depth_axis: Axis
    tp_axis: Axis

    @property
    def batch_parts(self) -> int:
        return self.depth_size * self.q

    @property
    def batch_index(self) -> int:
        return self.depth * self.q + self.row

    @property
    def batch_axes(self) -> tuple[str, ...]:
        return ("tp_depth", "tp_row") if self.depth_size > 1 else ("tp_row",)

    @property
    def weight_replicas(self) -> tuple[str, ...]:
        """Axes over which a weight shard is identical (Tesseract replicates over depth)."""
        return ("tp_depth",) if self.depth_size > 1 else ()

    @property
    def transpose_peer(self) -> int:
        """tp index of the rank at the transposed grid position (depth, j, i)."""
        return (self.depth * self.q + self.col) * self.q + self.row


def grid_of(mesh, mode: str, who: str) -> Grid:
    """The :class:`Grid` of ``mesh``; ``who`` (a class name) is named in the error when the
    mesh's tp_mode is not ``mode``."""
    require_mode(mesh, mode, who)
    row, col, depth = mesh.axis("tp_row"), mesh.axis("tp_col"), mesh.axis("tp_depth")
    return Grid(mode, row.size, depth.size, row.rank, col.rank, depth.rank, row, col, depth, mesh.axis("tp"))


# --------------------------------------------------------------------------- activation layout
def activation_spec(full_shape, g: Grid, hidden: bool) -> ShardSpec:
    """ShardSpec of a tp-group activation on grid ``g``: dim 0 (batch) block ``depth*q + i`` over
    (tp_depth, tp_row), and with ``hidden`` the last dim block j over ``tp_col``; without, the
    block is replicated over ``tp_col``."""
    full_shape = tuple(full_shape)
    check_divisible("batch size", full_shape[0], g.batch_parts, g.mode)
    dims = [DimShard(0, g.batch_parts, g.batch_index, g.batch_axes)]
    if hidden:
        check_divisible("hidden size", full_shape[-1], g.q, g.mode)
        dims.append(DimShard(len(full_shape) - 1, g.q, g.col, ("tp_col",)))
    return ShardSpec(full_shape, tuple(dims), ("tp_col",) if not hidden and g.q > 1 else ())


def gather_batch(x: torch.Tensor, g: Grid) -> torch.Tensor:
    """All-gather this rank's batch block over ``tp_row`` then ``tp_depth``; slice backward."""
    x = comm.GatherFromAxis.apply(x, g.row_axis, 0)
    return x if g.depth_axis.trivial else comm.GatherFromAxis.apply(x, g.depth_axis, 0)


def gather_activation(x: torch.Tensor, g: Grid) -> torch.Tensor:
    """All-gather this rank's (batch, hidden) block over ``tp_col``, ``tp_row`` and ``tp_depth``."""
    return gather_batch(comm.GatherFromAxis.apply(x, g.col_axis, x.dim() - 1), g)


# --------------------------------------------------------------------------- SUMMA
def summa_linear(x: torch.Tensor, w: torch.Tensor, b, g: Grid, in_out: bool, w_col=None):
    """SUMMA's forward, ``(Y(i, j), W(:, j))``: ``Y(i, j) = X(i, :) W(:, j)`` (+ bias block j) from
    the row's gathered input and the column's gathered weight (both gathers in flight at once;
    ``w`` cast to x's dtype before it travels). ``w_col``: the column gathered ahead
    (:mod:`.weight_prefetch`, in x's dtype). No autograd: :class:`SummaFn`'s forward, and the
    no-grad forward's for many tokens."""
    hx = comm.all_gather_async(x.t(), g.col_axis)  # X(i, :)^T, [in, m]
    if w_col is None:
        wx = w if w.dtype == x.dtype else w.to(x.dtype)
        w_col = comm.all_gather_async(wx if in_out else wx.t(), g.row_axis).wait()  # W(:, j) as [in, out/q]
    y = hx.wait().t() @ w_col
    return (y if b is None else y.add_(b.to(y.dtype))), w_col


class SummaFn(torch.autograd.Function):
    """``y = x @ w.T + b`` (``in_out``: ``y = x @ w + b``, a Conv1D weight kept in its own
    orientation) with x block (i, k) on rank (i, k), w block (k, j) on rank (k, j) and the bias
    block j replicated down the grid column.

    SUMMA's q steps, each a broadcast of X(i, k) along the grid row and of W(k, j) down the
    grid column, deliver exactly the blocks an all-gather does: so the forward all-gathers X(i, :)
    over ``tp_col`` and W(:, j) over ``tp_row`` (both in flight at once) and runs one GEMM,
    ``Y(i, j) = X(i, :) W(:, j)``. Backward: re-gather X (and W, unless ``keep_w``); ``dy @
    W(:, j)`` holds this rank's part of dX(i, k) for every k and is reduce-scattered over
    ``tp_col`` (rank (i, j) keeps dX(i, j)); ``X(i, :).T @ dy`` holds its part of dW(k, j) for
    every k and is reduce-scattered over ``tp_row``; the bias gradient is all-reduced over
    ``tp_row``, launched first so it runs beside the GEMMs. With ``keep_w`` the dX GEMM starts
    while X is being re-gathered.

    Bytes per rank: SUMMA's ``3 (bsh + h h_o) / q`` elements a Linear re-gathering W, ``(3 bsh +
    2 h h_o) / q`` with ``keep_w``; collectives and GEMMs are q times fewer and the GEMMs q times
    larger. Of the activations only the shard x is saved, so they stay ``bsh/p`` (compiled too:
    the backward's re-gather goes through :func:`~behemoth.comm.traced.regather`, so the compiler
    cannot replace it by keeping the forward's gathered block). ``keep_w`` keeps the gathered
    W(:, j) (``q`` weight shards, in the compute dtype) from forward to backward: in eager mode
    on ``ctx``, outside the saved-tensor hooks (it is a weight copy, not an activation: activation
    checkpointing does not drop it), in compiled code as a saved tensor.

    ``defer`` (``(GradPass, weight index, bias index, node)``, :mod:`.deferred_grads`): the dW
    reduce-scatter is issued as above but handed to the pass unwaited, the bias gradient handed
    to the pass's bucket unsummed, and zero placeholders returned for ``w`` and ``b`` (then
    ``w`` may come uncast: it is cast to x's dtype before it travels)."""

    @staticmethod
    def forward(ctx, x, w, b, g: Grid, in_out: bool, keep_w: bool = False, w_col=None, prefetch=None, defer=None):
        ctx.g, ctx.in_out, ctx.b_dtype, ctx.w_dtype = g, in_out, None if b is None else b.dtype, w.dtype
        ctx.defer = defer
        y, w_col = summa_linear(x, w, b, g, in_out, w_col)
        ctx.w_col = None
        if not keep_w:
            ctx.save_for_backward(x, w)  # x itself: often saved already by the op that made it
        elif torch.compiler.is_compiling():
            ctx.save_for_backward(x, w_col)
        else:  # a copy of the weights, not an activation: held on ctx, out of saved-tensor hooks
            ctx.save_for_backward(x)
            ctx.w_col = w_col
        ctx.keep_w, ctx.prefetch = keep_w, prefetch
        return y

    @staticmethod
    def backward(ctx, dy):
        g, dy, in_out = ctx.g, dy.contiguous(), ctx.in_out
        if ctx.prefetch is not None:
            ctx.prefetch.drop()
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if not ctx.keep_w:
            x, w = ctx.saved_tensors
        elif ctx.w_col is None:
            x, w_col = ctx.saved_tensors
        else:
            (x,), w_col = ctx.saved_tensors, ctx.w_col
        db = hb = hw = None
        w_dtype = ctx.w_dtype
        defer = None if ctx.defer is None else ctx.defer[0].active(ctx.defer)  # (GradPass, w index, b index, node)
        if ctx.b_dtype is not None and ctx.needs_input_grad[2]:
            if defer is not None:  # summed in the pass's bucket, landed later (deferred_grads)
                defer[0].add(defer[2], dy.sum(0, dtype=ctx.b_dtype), g.row_axis)
                db = defer[0].placeholder(defer[2])
            else:
                hb = comm.all_reduce(dy.sum(0, dtype=ctx.b_dtype), g.row_axis, async_op=True)
        if need_x and not ctx.keep_w:
            wx = w if w.dtype == x.dtype else w.to(x.dtype)
            hw = comm.all_gather_async(regather(wx if in_out else wx.t()), g.row_axis)
        hx = comm.all_gather_async(regather(x.t()), g.col_axis) if need_w else None
        dx = dw = hdx = hdw = None
        if need_x:  # dX(i, :)^T partial = W(:, j) dy^T, summed along the grid row
            hdx = comm.reduce_scatter_async((w_col if hw is None else hw.wait()) @ dy.t(), g.col_axis)
        if need_w:  # dW(:, j)^T partial = X(i, :)^T dy, summed down the grid column
            hdw = comm.reduce_scatter_async(hx.wait() @ dy, g.row_axis)
            if defer is not None:
                defer[0].put((defer[1],), hdw, lambda s: ((s if in_out else s.t().contiguous()).to(w_dtype),))
                hdw, dw = None, defer[0].placeholder(defer[1])
        if hdx is not None:
            dx = hdx.wait().t().contiguous()
        if hdw is not None:
            dw = hdw.wait()
            dw = (dw if in_out else dw.t().contiguous()).to(w_dtype)
        if hb is not None:
            db = hb.wait()
        return dx, dw, db, None, None, None, None, None, None


def replicate_on(p: torch.Tensor, g: Grid, *, rows: bool) -> torch.Tensor:
    """Route a parameter through CopyToAxis so its gradient is summed over the axes where
    it is replicated (tp_row when ``rows``; tp_depth always -- absent in 2D). An axis of size
    1 is skipped: no autograd node, no gradient copy."""
    if rows and not g.row_axis.trivial:
        p = comm.CopyToAxis.apply(p, g.row_axis)
    return p if g.depth_axis.trivial else comm.CopyToAxis.apply(p, g.depth_axis)


# --------------------------------------------------------------------------- without autograd
def stationary_linear(x: torch.Tensor, w: torch.Tensor, b, g: Grid, in_out: bool) -> torch.Tensor:
    """``Y(i, j) = sum_k X(i, k) W(k, j)`` (+ bias block j) with every weight block left where
    it is (the 2D weight-stationary layout of inference): one all-to-all over the grid brings
    rank (k, j) the input column X(:, k) (each rank (i, k) sends its block to the q ranks of grid
    row k), it multiplies by its own W(k, j), and the partials ``X(:, k) W(k, j)`` are
    reduce-scattered down the grid column, rank (i, j) keeping batch block i. Within each depth
    slab under 2.5D. Two collectives, as SUMMA's forward. No autograd."""
    rows, q = x.shape[0], g.q
    slab = range(g.depth * q * q, (g.depth + 1) * q * q)  # tp index (depth*q + i)*q + j
    send = [rows if t in slab and t // q % q == g.col else 0 for t in range(g.tp_axis.size)]
    recv = [rows if t in slab and t % q == g.row else 0 for t in range(g.tp_axis.size)]
    xs = comm.all_to_all_rows(x.repeat(q, 1), g.tp_axis, send, recv)  # X(:, k), batch order
    y = comm.reduce_scatter(xs @ (w if in_out else w.t()), g.row_axis, 0)
    return y if b is None else y.add_(b.to(y.dtype))


def linear_no_grad(x: torch.Tensor, w: torch.Tensor, b, g: Grid, in_out: bool, stationary: bool = True) -> torch.Tensor:
    """A grid Linear's forward without autograd (generation, evaluation): weight-stationary
    while the tokens are few (:func:`stationary_is_cheaper`) unless ``stationary`` is False, else
    SUMMA's. ``x`` is ``[rows, in/q]``, ``w`` the local weight block (``[out/q, in/q]``,
    ``in_out``: ``[in/q, out/q]``)."""
    n_out = w.shape[1] if in_out else w.shape[0]
    cheaper = stationary and not g.row_axis.trivial and stationary_is_cheaper(x.shape[0], x.shape[1], n_out, g.q)
    return stationary_linear(x, w, b, g, in_out) if cheaper else summa_linear(x, w, b, g, in_out)[0]

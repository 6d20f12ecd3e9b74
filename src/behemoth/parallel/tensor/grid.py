"""The q x q grid that 2D (Optimus, arXiv 2104.05343) and 2.5D (Tesseract, arXiv 2105.14500)
tensor parallelism share: this rank's place on it, the activation layout, and SUMMA.

Grid. The tp group is a (d x) q x q grid (p = d q**2; 2D is d = 1); rank (depth, i, j) has
``depth = mesh.coord("tp_depth")``, ``i = mesh.coord("tp_row")``, ``j = mesh.coord("tp_col")``,
tp rank ``(depth*q + i)*q + j``. The mesh axis ``"tp_col"`` is *my grid row* (members share i,
vary j); ``"tp_row"`` is *my grid column* (members share j, vary i).

* Activations ``x_bSh``: batch split over (depth, grid rows), hidden over grid columns -- rank
  (depth, i, j) holds batch block ``depth*q + i`` and hidden block j, ``[b/(d q), s, h/q]``
  (:func:`activation_spec`).
* SUMMA (:class:`SummaFn`): ``y = x W^T`` with x block (i, k) and W block (k, j) by q steps
  of broadcasts along the grid row and down the grid column; backward by broadcasts and
  reduces. Per device ``3 (bsh/d + h h_o) / q`` elements per Linear (``behemoth.planner.tp2d_traffic``).
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
from .base import require_mode
from .layout import DimShard, ShardSpec, check_divisible


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
    return comm.GatherFromAxis.apply(x, g.depth_axis, 0)


def gather_activation(x: torch.Tensor, g: Grid) -> torch.Tensor:
    """All-gather this rank's (batch, hidden) block over ``tp_col``, ``tp_row`` and ``tp_depth``."""
    return gather_batch(comm.GatherFromAxis.apply(x, g.col_axis, x.dim() - 1), g)


# --------------------------------------------------------------------------- SUMMA
def _bcast(t: torch.Tensor, axis: Axis, src: int) -> comm.AsyncCollective:
    """Start broadcasting ``t`` from member ``src`` of ``axis`` (this rank's own ``t`` when it is
    the source); ``wait()`` returns it."""
    buf = t if axis.rank == src else torch.empty_like(t)
    return comm.broadcast(buf, axis, src, async_op=True)


class SummaFn(torch.autograd.Function):
    """``y = x @ w.T`` (``in_out``: ``y = x @ w``, a Conv1D weight kept in its own
    orientation, so no transposed copy is made or saved) with x block (i, k) and w block
    (k, j) on rank (i, k) / (k, j).

    Forward: for k in 0..q-1, broadcast X(i, k) along the grid row (tp_col) and W(k, j) down
    the grid column (tp_row); accumulate the product. Backward: for each k, re-broadcast
    W(k, j) down the column and reduce ``dy @ W(k, j)`` along the row onto (i, k) (that is
    dX(i, k)); re-broadcast X(i, k) along the row and reduce ``dy.T @ X(i, k)`` down the
    column onto (k, j) (that is dW(k, j)). Only the local shards are saved.

    Overlap: step k+1's broadcasts are started before step k's GEMM (on GPU they run on the
    communicators' streams beside it: a collective waits only for work issued before it), and
    backward's reduces are waited at most two steps later, so at most two steps' blocks are
    in flight. Every rank issues the same collectives in the same order."""

    @staticmethod
    def forward(ctx, x, w, g: Grid, in_out: bool):
        x, w = x.contiguous(), w.contiguous()
        ctx.g, ctx.in_out = g, in_out
        ctx.save_for_backward(x, w)
        y = None
        nxt = (_bcast(x, g.col_axis, 0), _bcast(w, g.row_axis, 0))
        for k in range(g.q):
            cur = nxt
            if k + 1 < g.q:
                nxt = (_bcast(x, g.col_axis, k + 1), _bcast(w, g.row_axis, k + 1))
            xk, wk = cur[0].wait(), cur[1].wait()
            part = xk @ (wk if in_out else wk.t())
            y = part if y is None else y.add_(part)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        g, dy, in_out = ctx.g, dy.contiguous(), ctx.in_out
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]

        def fetch(k):  # the blocks step k multiplies by
            return (_bcast(w, g.row_axis, k) if need_x else None, _bcast(x, g.col_axis, k) if need_w else None)

        dx = dw = None
        reduces: list[tuple[int, str, comm.AsyncCollective]] = []

        def settle(keep: int) -> None:
            nonlocal dx, dw
            while len(reduces) > keep:
                k, which, h = reduces.pop(0)
                part = h.wait()
                if which == "x" and g.col == k:
                    dx = part
                elif which == "w" and g.row == k:
                    dw = part

        nxt = fetch(0)
        for k in range(g.q):
            cur = nxt
            if k + 1 < g.q:
                nxt = fetch(k + 1)
            if need_x:
                wk = cur[0].wait()
                reduces.append((k, "x", comm.reduce(dy @ (wk.t() if in_out else wk), g.col_axis, k, async_op=True)))
            if need_w:
                xk = cur[1].wait()
                part = (xk.t() @ dy) if in_out else (dy.t() @ xk)
                reduces.append((k, "w", comm.reduce(part, g.row_axis, k, async_op=True)))
            settle(4)  # two steps' reduces in flight
        settle(0)
        return dx, dw, None, None


def replicate_on(p: torch.Tensor, g: Grid, *, rows: bool) -> torch.Tensor:
    """Route a parameter through CopyToAxis so its gradient is summed over the axes where
    it is replicated (tp_row when ``rows``; tp_depth always -- a no-op in 2D)."""
    if rows:
        p = comm.CopyToAxis.apply(p, g.row_axis)
    return comm.CopyToAxis.apply(p, g.depth_axis)

"""2D tensor parallelism (Optimus, arXiv 2104.05343): SUMMA on a q x q grid, activations
partitioned rather than replicated.

Grid and layouts. The tp group is a q x q grid (p = q**2); rank (i, j) has ``i =
mesh.coord("tp_row")`` and ``j = mesh.coord("tp_col")``, tp rank ``i*q + j``. The mesh axis
``"tp_col"`` is *my grid row* (members share i, vary j); ``"tp_row"`` is *my grid column*
(members share j, vary i).

* Activations ``x_bSh``: batch split over grid rows, hidden over grid columns -- rank (i, j)
  holds batch block i and hidden block j, ``[b/q, s, h/q]``. Every layer here takes and
  returns this layout, so layers chain with no redistribution; heads are split by q with
  the hidden dim, so attention between a QKV and an output Linear2D is local.
* Weights (``nn.Linear``'s ``[out, in]``): rank (k, j) holds ``[out/q, in/q]``, out block j
  (over ``tp_col``) and in block k (over ``tp_row``). The token embedding and the LM head
  share this layout (vocab over ``tp_col``), so tied embeddings are one Parameter.
* Biases and norm weights: hidden block j, replicated over ``tp_row``; their gradients are
  all-reduced over ``tp_row`` inside the layer (``comm.CopyToAxis``).

Communication per layer (all through ``comm``): a Linear is q SUMMA steps -- forward
broadcasts X(i, k) along the grid row and W(k, j) down the grid column; backward re-broadcasts
them and reduces dX partials along the row and dW partials down the column. Per device that
is ``3 (bsh + h h_o) / q`` elements (:func:`summa_linear_bytes`). Norms all-gather their
per-shard statistics over ``tp_col`` forward and all-reduce two sums backward. The
embeddings, head and loss live in :mod:`.embed2d`: the embedding looks up its vocab block for the tp group's batch, reduce-scatters over
``tp_col`` and swaps with the transposed grid rank; the cross-entropy all-reduces max,
target logit and sum-exp over ``tp_col``: no rank ever holds full logits.

The 2.5D layers (``tp2p5d``, Tesseract) are these same classes with a depth axis: the batch
is split by ``d*q`` (block ``depth*q + i``), weights are replicated over ``tp_depth`` and
their gradients all-reduced over it. Here the depth axis has size 1, so it moves nothing.

Modules: this one (grid, activation layouts, SUMMA Linear2D, norms), :mod:`.embed2d` (token
and position embeddings, LM head, vocab-parallel cross-entropy), :mod:`.apply2d` (the model
rewrite).

Tested in tests/dist/test_tp2d_layers.py against the serial layers (outputs, input and
parameter gradients, ledger bytes).

Shape legend: B batch of the tp group, S sequence, H hidden, V vocab; lower case is this
rank's block (b = B/(d*q), h = H/q, v = V/q).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ... import comm
from ...comm import Axis
from .layout import DimShard, ShardSpec, check_divisible, set_spec, shard_tensor

__all__ = [
    "Grid",
    "grid_of",
    "summa_linear_bytes",
    "activation_spec_2d",
    "split_batch_2d",
    "split_activation_2d",
    "gather_batch_2d",
    "gather_activation_2d",
    "Linear2D",
    "LayerNorm2D",
    "RMSNorm2D",
    "parallelize",
]


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
    if mesh.plan.tp_mode != mode:
        other = {"1d": "tp1d", "2d": "tp2d", "2.5d": "tp2p5d", "3d": "tp3d"}.get(mesh.plan.tp_mode, "?")
        raise ValueError(
            f"{who} needs a mesh with tp_mode={mode!r}; got tp_mode={mesh.plan.tp_mode!r}. "
            f"Use the layers of behemoth.parallel.tensor.{other} for that mesh."
        )
    row, col, depth = mesh.axis("tp_row"), mesh.axis("tp_col"), mesh.axis("tp_depth")
    return Grid(mode, row.size, depth.size, row.rank, col.rank, depth.rank, row, col, depth, mesh.axis("tp"))


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
    """Payload bytes one rank moves for one SUMMA Linear, forward + backward, as the ledger
    counts them (every member of a broadcast or reduce books the block's size).

    ``tokens`` = B*S of the whole tp group. Each of the q steps broadcasts an X block
    ``tokens/(d q) * in/q`` and a W block ``in/q * out/q``; forward once, backward twice
    (re-broadcast + reduce of the partials): ``3 (tokens*in/d + in*out) / q``. Tesseract
    (depth d > 1) adds the all-reduce of dW over depth, ``in*out/q**2``; a bias adds its
    gradient's all-reduce over ``tp_row`` (and depth), ``out/q`` each. d = 1 is Optimus.
    """
    act = tokens * in_features // depth
    w = in_features * out_features
    n = 3 * (act + w) // q
    if depth > 1:
        n += w // q**2
    if bias:
        n += out_features // q * (2 if depth > 1 else 1)
    return n * element_size


# --------------------------------------------------------------------------- activation layout
def _activation_spec(full_shape, g: Grid, hidden: bool) -> ShardSpec:
    full_shape = tuple(full_shape)
    check_divisible("batch size", full_shape[0], g.batch_parts, g.mode)
    dims = [DimShard(0, g.batch_parts, g.batch_index, g.batch_axes)]
    if hidden:
        check_divisible("hidden size", full_shape[-1], g.q, g.mode)
        dims.append(DimShard(len(full_shape) - 1, g.q, g.col, ("tp_col",)))
    return ShardSpec(full_shape, tuple(dims), ("tp_col",) if not hidden and g.q > 1 else ())


def activation_spec_2d(full_shape, mesh, *, hidden: bool = True) -> ShardSpec:
    """ShardSpec of a tp-group activation: dim 0 (batch) split over ``tp_row``, and with
    ``hidden`` the last dim over ``tp_col``; without, the block is replicated over ``tp_col``."""
    return _activation_spec(full_shape, grid_of(mesh, "2d", "activation_spec_2d"), hidden)


def split_batch_2d(x_B: torch.Tensor, mesh) -> torch.Tensor:
    """This rank's batch block of a tp-group tensor (ids, labels): ``[B, ...] -> [B/q, ...]``.
    Local slicing, no communication."""
    return shard_tensor(x_B, _activation_spec(x_B.shape, grid_of(mesh, "2d", "split_batch_2d"), False))


def split_activation_2d(x_BSH: torch.Tensor, mesh) -> torch.Tensor:
    """``[B, S, H] -> [B/q, S, H/q]`` (batch block i, hidden block j). No communication."""
    return shard_tensor(x_BSH, _activation_spec(x_BSH.shape, grid_of(mesh, "2d", "split_activation_2d"), True))


def _gather_batch(x: torch.Tensor, g: Grid) -> torch.Tensor:
    x = comm.GatherFromAxis.apply(x, g.row_axis, 0)
    return comm.GatherFromAxis.apply(x, g.depth_axis, 0)


def gather_batch_2d(x_b: torch.Tensor, mesh) -> torch.Tensor:
    """Inverse of :func:`split_batch_2d`: all-gather over ``tp_row`` (and depth); backward
    keeps this rank's slice of the gradient."""
    return _gather_batch(x_b, grid_of(mesh, "2d", "gather_batch_2d"))


def _gather_activation(x: torch.Tensor, g: Grid) -> torch.Tensor:
    return _gather_batch(comm.GatherFromAxis.apply(x, g.col_axis, x.dim() - 1), g)


def gather_activation_2d(x_bSh: torch.Tensor, mesh) -> torch.Tensor:
    """Inverse of :func:`split_activation_2d`: ``[B/q, S, H/q] -> [B, S, H]`` on every rank
    (all-gather over ``tp_col``, then ``tp_row``); backward keeps this rank's slice."""
    return _gather_activation(x_bSh, grid_of(mesh, "2d", "gather_activation_2d"))


# --------------------------------------------------------------------------- SUMMA
def _bcast(t: torch.Tensor, axis: Axis, src: int) -> comm.AsyncCollective:
    """Start broadcasting ``t`` from member ``src`` of ``axis`` (this rank's own ``t`` when it is
    the source); ``wait()`` returns it."""
    buf = t if axis.rank == src else torch.empty_like(t)
    return comm.broadcast(buf, axis, src, async_op=True)


class _Summa(torch.autograd.Function):
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


def _autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    t = x.device.type
    return torch.get_autocast_dtype(t) if torch.is_autocast_enabled(t) else None


def _replicate_on(p: torch.Tensor, g: Grid, *, rows: bool) -> torch.Tensor:
    """Route a parameter through CopyToAxis so its gradient is summed over the axes where
    it is replicated (tp_row when ``rows``; tp_depth always -- a no-op in 2D)."""
    if rows:
        p = comm.CopyToAxis.apply(p, g.row_axis)
    return comm.CopyToAxis.apply(p, g.depth_axis)


class Linear2D(nn.Module):
    """``y = x W^T + b`` by SUMMA. Input ``[..., in/q]`` (batch block i, in block j), output
    ``[..., out/q]`` (batch block i, out block j).

    ``fused=3`` is a fused QKV (``[q|k|v]`` rows): the weight is viewed as ``[3, out/3, in]``
    and blocked on the middle dim, so out block j holds matching q, k and v rows of heads
    block j, and the local output is ``[q_j | k_j | v_j]``. ``weight_layout="in_out"`` holds
    a transformers ``Conv1D`` weight (``[in, out]``) in its own orientation.
    Build with :meth:`from_serial`; ``__init__`` zero-fills the shards.
    """

    MODE = "2d"

    def __init__(
        self,
        in_features: int,
        out_features: int,
        mesh,
        *,
        bias: bool = True,
        fused: int = 1,
        weight_layout: str = "out_in",
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        g = self.grid = grid_of(mesh, self.MODE, type(self).__name__)
        if weight_layout not in ("out_in", "in_out"):
            raise ValueError(
                f"{type(self).__name__}: weight_layout={weight_layout!r} must be 'out_in' "
                f"(nn.Linear) or 'in_out' (transformers Conv1D)."
            )
        name = type(self).__name__
        check_divisible(f"{name} in_features", in_features, g.q, g.mode)
        check_divisible(f"{name} out_features", out_features, fused, g.mode)
        part = f"{name} out_features/{fused} (per fused part)" if fused > 1 else f"{name} out_features"
        check_divisible(part, out_features // fused, g.q, g.mode)
        self.in_features, self.out_features, self.fused, self.weight_layout = (
            in_features,
            out_features,
            fused,
            weight_layout,
        )
        kw = dict(device=device, dtype=dtype)
        in_io = weight_layout == "in_out"
        o, i_ = (1, 0) if in_io else (0, 1)  # serial dims of out and in
        full = (in_features, out_features) if in_io else (out_features, in_features)
        if fused == 1:
            dims = (DimShard(o, g.q, g.col, ("tp_col",)), DimShard(i_, g.q, g.row, ("tp_row",)))
            view = None
        else:  # the view splits the out dim into (fused, out/fused); block the per-part dim
            view = (in_features, fused, out_features // fused) if in_io else (fused, out_features // fused, in_features)
            dims = (
                (DimShard(2, g.q, g.col, ("tp_col",)), DimShard(0, g.q, g.row, ("tp_row",)))
                if in_io
                else (DimShard(1, g.q, g.col, ("tp_col",)), DimShard(2, g.q, g.row, ("tp_row",)))
            )
        wspec = ShardSpec(full, dims, g.weight_replicas, view, fused_dim=o)
        self.weight = set_spec(nn.Parameter(torch.zeros(wspec.local_shape(), **kw)), wspec)
        if bias:
            bview = (fused, out_features // fused) if fused > 1 else None
            bspec = ShardSpec(
                (out_features,),
                (DimShard(1 if fused > 1 else 0, g.q, g.col, ("tp_col",)),),
                ("tp_row",) * (g.q > 1) + g.weight_replicas,
                bview,
            )
            self.bias = set_spec(nn.Parameter(torch.zeros(bspec.local_shape(), **kw)), bspec)
        else:
            self.register_parameter("bias", None)

    @classmethod
    def from_serial(cls, module: nn.Module, mesh, *, fused: int = 1):
        """Shard an ``nn.Linear`` (or a transformers ``Conv1D``, weight ``[in, out]``)."""
        if isinstance(module, nn.Linear):
            out_f, in_f, layout = module.out_features, module.in_features, "out_in"
        elif hasattr(module, "nf") and module.weight.dim() == 2 and module.weight.shape[1] == module.nf:
            in_f, out_f, layout = module.weight.shape[0], module.nf, "in_out"
        else:
            raise TypeError(f"{cls.__name__}.from_serial: expected nn.Linear or Conv1D, got {type(module).__name__}")
        w = module.weight
        layer = cls(
            in_f,
            out_f,
            mesh,
            bias=module.bias is not None,
            fused=fused,
            weight_layout=layout,
            device=w.device,
            dtype=w.dtype,
        )
        _copy_shards(layer, module)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, n_in = self.grid, self.in_features // self.grid.q
        if x.shape[-1] != n_in:
            raise ValueError(
                f"{type(self).__name__}: input's last dim is {x.shape[-1]}; expected the hidden "
                f"block in_features/q = {self.in_features}/{g.q} = {n_in} (layout [b/q, s, h/q])."
            )
        w = _replicate_on(self.weight, g, rows=False)
        dt = _autocast_dtype(x)
        if dt is not None:  # cast the shards before they travel: half the bytes
            x, w = x.to(dt), w.to(dt)
        y = _Summa.apply(x.reshape(-1, n_in), w, g, self.weight_layout == "in_out")
        y = y.view(*x.shape[:-1], y.shape[-1])
        if self.bias is not None:
            y = y + _replicate_on(self.bias, g, rows=True).to(y.dtype)
        return y

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features}, out={self.out_features}, q={self.grid.q}, depth={self.grid.depth_size}, "
            f"fused={self.fused}, bias={self.bias is not None}"
        )


@torch.no_grad()
def _copy_shards(layer: nn.Module, serial: nn.Module) -> None:
    """Fill every parameter of ``layer`` with its ShardSpec's block of ``serial``'s."""
    for name, p in layer.named_parameters(recurse=False):
        p.copy_(shard_tensor(getattr(serial, name).detach(), p._bh_shard))


# --------------------------------------------------------------------------- norms
def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


class _LayerNorm2DFn(torch.autograd.Function):
    """LayerNorm over a hidden dim split across ``axis`` (tp_col). Forward: all-gather each
    shard's (mean, M2) and combine them (Chan et al.), one collective. Backward: all-reduce
    ``sum(g)`` and ``sum(g * xhat)`` (with rms: only the latter). ``weight``/``bias`` grads
    are local; the caller sums them over the grid column."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps, axis: Axis, hidden: int, rms: bool):
        xc = x.to(_compute_dtype(x))
        if rms:
            ms = comm.all_reduce(xc.pow(2).sum(-1), axis) / hidden
            mean, rstd = None, torch.rsqrt(ms + eps)
            xhat = xc * rstd[..., None]
        else:
            m = xc.mean(-1)
            stats = torch.stack([m, (xc - m[..., None]).pow(2).sum(-1)])
            stats = comm.all_gather(stats, axis, 0).view(axis.size, 2, *m.shape)
            mean = stats[:, 0].mean(0)
            m2 = stats[:, 1].sum(0) + xc.shape[-1] * (stats[:, 0] - mean).pow(2).sum(0)
            rstd = torch.rsqrt(m2 / hidden + eps)
            xhat = (xc - mean[..., None]) * rstd[..., None]
        y = xhat if weight is None else xhat * weight
        if bias is not None:
            y = y + bias
        ctx.axis, ctx.hidden, ctx.rms = axis, hidden, rms
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.save_for_backward(x, weight, mean, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, mean, rstd = ctx.saved_tensors
        xc = x.to(rstd.dtype)
        xhat = (xc if ctx.rms else xc - mean[..., None]) * rstd[..., None]
        dy = dy.to(rstd.dtype)
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            g = dy if weight is None else dy * weight
            if ctx.rms:
                s = comm.all_reduce((g * xhat).sum(-1), ctx.axis)[..., None] / ctx.hidden
                dx = (g - xhat * s) * rstd[..., None]
            else:
                s = comm.all_reduce(torch.stack([g.sum(-1), (g * xhat).sum(-1)]), ctx.axis) / ctx.hidden
                dx = (g - s[0][..., None] - xhat * s[1][..., None]) * rstd[..., None]
            dx = dx.to(x.dtype)
        n = xhat.shape[-1]
        if weight is not None and ctx.needs_input_grad[1]:
            dw = (dy * xhat).reshape(-1, n).sum(0).to(weight.dtype)
        if ctx.needs_input_grad[2]:
            db = dy.reshape(-1, n).sum(0).to(ctx.bias_dtype)
        return dx, dw, db, None, None, None, None


class _Norm2D(nn.Module):
    MODE = "2d"
    RMS = False

    def __init__(
        self,
        hidden: int,
        mesh,
        *,
        eps: float | None = 1e-5,
        weight: bool = True,
        bias: bool = True,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        g = self.grid = grid_of(mesh, self.MODE, type(self).__name__)
        check_divisible(f"{type(self).__name__} hidden size", hidden, g.q, g.mode)
        self.hidden, self.eps = hidden, eps
        spec = ShardSpec(
            (hidden,), (DimShard(0, g.q, g.col, ("tp_col",)),), ("tp_row",) * (g.q > 1) + g.weight_replicas
        )
        kw = dict(device=device, dtype=dtype)
        self.weight = set_spec(nn.Parameter(torch.ones(hidden // g.q, **kw)), spec) if weight else None
        self.bias = set_spec(nn.Parameter(torch.zeros(hidden // g.q, **kw)), spec) if bias else None

    def forward(self, x_bSh: torch.Tensor) -> torch.Tensor:
        g = self.grid
        if x_bSh.shape[-1] != self.hidden // g.q:
            raise ValueError(
                f"{type(self).__name__}: input's last dim is {x_bSh.shape[-1]}; expected "
                f"hidden/q = {self.hidden}/{g.q} = {self.hidden // g.q}."
            )
        w = None if self.weight is None else _replicate_on(self.weight, g, rows=True)
        b = None if self.bias is None else _replicate_on(self.bias, g, rows=True)
        eps = self.eps if self.eps is not None else torch.finfo(x_bSh.dtype).eps
        y = _LayerNorm2DFn.apply(x_bSh, w, b, eps, g.col_axis, self.hidden, self.RMS)
        keep_fp32 = not self.RMS and _autocast_dtype(x_bSh) is not None  # as nn.LayerNorm under autocast
        return y if keep_fp32 else y.to(x_bSh.dtype)

    def extra_repr(self) -> str:
        return f"hidden={self.hidden}, q={self.grid.q}, eps={self.eps}"


class LayerNorm2D(_Norm2D):
    """LayerNorm of ``[b/q, s, h/q]`` over the full hidden dim (statistics over ``tp_col``).
    Weight and bias: hidden block j, replicated over ``tp_row``."""

    @classmethod
    def from_serial(cls, module: nn.LayerNorm, mesh):
        if len(module.normalized_shape) != 1:
            raise ValueError(
                f"{cls.__name__}: only a 1-D normalized_shape is supported; got {module.normalized_shape}."
            )
        p = next(module.parameters(), None)
        kw = dict(device=p.device, dtype=p.dtype) if p is not None else {}
        layer = cls(
            module.normalized_shape[0],
            mesh,
            eps=module.eps,
            weight=module.weight is not None,
            bias=module.bias is not None,
            **kw,
        )
        _copy_shards(layer, module)
        return layer


class RMSNorm2D(_Norm2D):
    """RMSNorm of ``[b/q, s, h/q]``: ``x / sqrt(mean(x^2) + eps) * weight``, the mean over the
    full hidden dim (one all-reduce over ``tp_col``), computed in at least float32."""

    RMS = True

    def __init__(self, hidden: int, mesh, *, eps: float | None = 1e-5, device=None, dtype=None) -> None:
        super().__init__(hidden, mesh, eps=eps, weight=True, bias=False, device=device, dtype=dtype)

    @classmethod
    def from_serial(cls, module: nn.Module, mesh):
        """``nn.RMSNorm``, behemoth's Llama ``RMSNorm`` or transformers' ``LlamaRMSNorm``."""
        eps = getattr(module, "eps", getattr(module, "variance_epsilon", None))
        w = module.weight
        layer = cls(w.shape[0], mesh, eps=eps, device=w.device, dtype=w.dtype)
        _copy_shards(layer, module)
        return layer


def parallelize(model: nn.Module, mesh, plan, roles: dict[str, str]):
    """Rewrite ``model`` in place for 2D tensor parallelism; see :mod:`.apply2d`."""
    from .apply2d import parallelize_grid

    return parallelize_grid(model, mesh, plan, roles)

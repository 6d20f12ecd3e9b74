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
  all-reduced over ``tp_row`` inside the layer.
* Under ``bh.parallelize`` the layers' parameter-gradient reductions (dW, biases, norms) are
  issued where they are computed but waited for at the end of the backward
  (:mod:`.deferred_grads`): they are off the backward's critical path.

Communication per layer (all through ``comm``): a Linear is SUMMA -- forward gathers X(i, :)
along the grid row and W(:, j) down the grid column (the blocks SUMMA's q steps would broadcast)
for one GEMM; backward re-gathers X (the gathered W is kept, ``Linear2D.keep_gathered_weight``)
and reduce-scatters the dX partials along the row and the dW partials down the column. Per
device that is ``(3 bsh + 2 h h_o) / q`` elements (``3 (bsh + h h_o) / q`` re-gathering W;
``behemoth.planner.tp2d_traffic.summa_linear_bytes``). Norms
all-gather their per-shard statistics over ``tp_col`` forward and all-reduce two sums
backward. The embeddings, head and loss live in :mod:`.embed2d`: the embedding looks up its
vocab block for the tp group's batch, reduce-scatters over
``tp_col`` and swaps with the transposed grid rank; the cross-entropy all-reduces max,
target logit and sum-exp over ``tp_col``: no rank ever holds full logits.

The 2.5D layers (``tp2p5d``, Tesseract) are these same classes with a depth axis: the batch
is split by ``d*q`` (block ``depth*q + i``), weights are replicated over ``tp_depth`` and
their gradients all-reduced over it. Here the depth axis has size 1, so it moves nothing.

Compiled blocks (``Plan(compile=True)``): inside ``torch.compile``'d code every collective of
these layers, forward and backward, is a traced functional collective (:mod:`behemoth.comm.traced`),
so a transformer block is one graph with no break, booked in the ledger as in eager mode
(tests/dist/test_tp2d_compile.py, torch 2.13 on CPU, and with torch 2.11's refusal to trace the
layout helper of an all-gather along a non-zero dim emulated: a training step makes no such
gather; generation's did, and :func:`behemoth.comm.traced.all_gather` now gathers along dim 0 and
lays the shards out itself). A torch 2.11 GPU profile of training showed the layers' autograd
Functions run eagerly between compiled pieces: not explained yet.

Modules: :mod:`.grid` (the grid, activation layouts and SUMMA, shared with 2.5D), this one
(Linear2D, norms, the replicated-kv projection), :mod:`.embed2d` (token and position
embeddings, LM head, vocab-parallel loss), :mod:`.styles2d` (one style per role and the
model-level checks).

Tested in tests/dist/test_tp2d_layers.py against the serial layers (outputs, input and
parameter gradients, ledger bytes).

Shape legend: B batch of the tp group, S sequence, H hidden, V vocab; lower case is this
rank's block (b = B/(d*q), h = H/q, v = V/q).
"""

from __future__ import annotations

import torch
from torch import nn

from ... import comm
from .deferred_grads import deferred_pass
from .functional import autocast_dtype
from .grid import (
    SummaFn,
    activation_spec,
    gather_activation,
    gather_batch,
    grid_of,
    linear_no_grad,
    replicate_on,
)
from .layout import DimShard, ShardSpec, check_block_width, check_divisible, check_linear_blocks, set_spec, shard_tensor
from .serial import layer_norm_from_serial, linear_from_serial, rms_norm_from_serial
from .sharded_norm import ShardedNorm
from .weight_prefetch import may_prefetch, prefetch_of, prefetching_pass

__all__ = [
    "activation_spec_2d",
    "split_batch_2d",
    "split_activation_2d",
    "gather_batch_2d",
    "gather_activation_2d",
    "Linear2D",
    "LayerNorm2D",
    "RMSNorm2D",
    "KVReplicatedLinear2D",
]


# --------------------------------------------------------------------------- activation layout (2D)
def activation_spec_2d(full_shape, mesh, *, hidden: bool = True) -> ShardSpec:
    """ShardSpec of a tp-group activation: dim 0 (batch) split over ``tp_row``, and with
    ``hidden`` the last dim over ``tp_col``; without, the block is replicated over ``tp_col``."""
    return activation_spec(full_shape, grid_of(mesh, "2d", "activation_spec_2d"), hidden)


def split_batch_2d(x_B: torch.Tensor, mesh) -> torch.Tensor:
    """This rank's batch block of a tp-group tensor (ids, labels): ``[B, ...] -> [B/q, ...]``.
    Local slicing, no communication."""
    return shard_tensor(x_B, activation_spec(x_B.shape, grid_of(mesh, "2d", "split_batch_2d"), False))


def split_activation_2d(x_BSH: torch.Tensor, mesh) -> torch.Tensor:
    """``[B, S, H] -> [B/q, S, H/q]`` (batch block i, hidden block j). No communication."""
    return shard_tensor(x_BSH, activation_spec(x_BSH.shape, grid_of(mesh, "2d", "split_activation_2d"), True))


def gather_batch_2d(x_b: torch.Tensor, mesh) -> torch.Tensor:
    """Inverse of :func:`split_batch_2d`: all-gather over ``tp_row`` (and depth); backward
    keeps this rank's slice of the gradient."""
    return gather_batch(x_b, grid_of(mesh, "2d", "gather_batch_2d"))


def gather_activation_2d(x_bSh: torch.Tensor, mesh) -> torch.Tensor:
    """Inverse of :func:`split_activation_2d`: ``[B/q, S, H/q] -> [B, S, H]`` on every rank
    (all-gather over ``tp_col``, then ``tp_row``); backward keeps this rank's slice."""
    return gather_activation(x_bSh, grid_of(mesh, "2d", "gather_activation_2d"))


# --------------------------------------------------------------------------- Linear
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
    keep_gathered_weight: bool = True
    """Keep the forward's gathered weight column W(:, j) (in the compute dtype) for the backward
    instead of gathering it again: one all-gather fewer per Linear and step, for ``q`` times a
    weight shard's elements held from forward to backward (set False, on the class or an
    instance, to re-gather)."""
    prefetch_weight: bool = True
    """Gather the weight column ahead, when the pass starts (:mod:`.weight_prefetch`; only while
    ``keep_gathered_weight``)."""
    weight_stationary: bool = True
    """Without autograd, run weight-stationary while that moves fewer elements than SUMMA
    (:func:`~.grid.linear_no_grad`; set False, on the class or an instance, for SUMMA's forward
    always)."""

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
        check_linear_blocks(type(self).__name__, in_features, out_features, fused, weight_layout, g.q, g.q, g.mode)
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

    from_serial = classmethod(linear_from_serial)
    """``from_serial(module, mesh, *, fused=1)``: shard an ``nn.Linear`` (or a transformers ``Conv1D``)."""

    def _check_input(self, x: torch.Tensor) -> int:
        return check_block_width(
            type(self).__name__, x, self.in_features, self.grid.q, "the hidden block in_features", "[b/q, s, h/q]"
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, n_in = self.grid, self._check_input(x)
        deferred = deferred_pass(self, self.weight, self.bias)
        dt = autocast_dtype(x)
        w_col = pf = defer = None
        if not g.row_axis.trivial and prefetching_pass() and may_prefetch(self):
            pf = prefetch_of(self)
            w_col = pf.take(self, dt)
        if deferred is not None:  # the pass sums the gradients (tp_row, tp_depth); SummaFn casts w
            gp, (w, b) = deferred
            node = next(t.grad_fn for t in (w, b) if t is not None and t.grad_fn is not None)
            defer = (gp, gp.index.get(id(self.weight)), gp.index.get(id(self.bias)), node)
            x = x if dt is None else x.to(dt)
        else:
            w = replicate_on(self.weight, g, rows=False)
            if dt is not None:  # cast the shards before they travel: half the bytes
                x = x.to(dt)
                w = w if w_col is not None else w.to(dt)
            b = None if self.bias is None else replicate_on(self.bias, g, rows=False)  # SummaFn sums it over tp_row
        y = SummaFn.apply(
            x.reshape(-1, n_in), w, b, g, self.weight_layout == "in_out", self.keep_gathered_weight, w_col, pf, defer
        )
        return y.view(*x.shape[:-1], y.shape[-1])

    def forward_no_grad(self, x: torch.Tensor) -> torch.Tensor:
        """The forward without autograd (:func:`~.base.no_grad_forward`): the same numbers up to
        the order of the in-block sums, weight-stationary for a few tokens (a decode step moves
        activations only, not the weight column SUMMA gathers), SUMMA's for many
        (:func:`~.grid.linear_no_grad`)."""
        n_in, dt = self._check_input(x), autocast_dtype(x)
        w = self.weight
        if dt is not None:
            x, w = x.to(dt), w.to(dt)
        in_out = self.weight_layout == "in_out"
        y = linear_no_grad(x.reshape(-1, n_in), w, self.bias, self.grid, in_out, self.weight_stationary)
        return y.view(*x.shape[:-1], y.shape[-1])

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features}, out={self.out_features}, q={self.grid.q}, depth={self.grid.depth_size}, "
            f"fused={self.fused}, bias={self.bias is not None}"
        )


class KVReplicatedLinear2D(nn.Module):
    """A k or v projection with K kv heads < q grid columns (q % K == 0), for grouped-query
    attention: grid column j needs kv head ``c = j // (q/K)`` whole. Rank (k, j) holds in-block
    k of *every* output row (``[K*D, in/q]``, replicated over ``tp_col``) and runs SUMMA with
    the D rows of head c: input ``[b, S, in/q]`` -> output ``[b, S, D]`` (one local kv head).
    Communication: a Linear2D's with a ``[D, in/q]`` weight block; backward adds the
    all-reduce of the weight gradient over ``tp_col`` (each column contributes its head's
    rows). A bias is replicated over the whole grid (gradient all-reduced over ``tp``).
    ``keep_gathered_weight``, ``weight_stationary``: as :class:`Linear2D`'s."""

    keep_gathered_weight: bool = True
    weight_stationary: bool = True

    def __init__(self, module: nn.Linear, mesh, mode: str, kv_heads: int, head_dim: int) -> None:
        super().__init__()
        g = self.grid = grid_of(mesh, mode, type(self).__name__)
        self.in_features, self.out_features = module.in_features, module.out_features
        c = g.col // (g.q // kv_heads)
        self.rows = (c * head_dim, (c + 1) * head_dim)
        spec = ShardSpec(
            tuple(module.weight.shape), (DimShard(1, g.q, g.row, ("tp_row",)),), ("tp_col",) + g.weight_replicas
        )
        self.weight = set_spec(nn.Parameter(shard_tensor(module.weight.detach(), spec)), spec)
        if module.bias is not None:
            self.bias = set_spec(
                nn.Parameter(module.bias.detach().clone()), ShardSpec(tuple(module.bias.shape), (), ("tp",))
            )
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, (lo, hi) = self.grid, self.rows
        w = comm.CopyToAxis.apply(replicate_on(self.weight, g, rows=False), g.col_axis)[lo:hi]
        dt = autocast_dtype(x)
        if dt is not None:
            x, w = x.to(dt), w.to(dt)
        y = SummaFn.apply(x.reshape(-1, x.shape[-1]), w, None, g, False, self.keep_gathered_weight)
        y = y.view(*x.shape[:-1], hi - lo)
        if self.bias is not None:
            y = y + comm.CopyToAxis.apply(self.bias, g.tp_axis)[lo:hi].to(y.dtype)
        return y

    def forward_no_grad(self, x: torch.Tensor) -> torch.Tensor:
        """The forward without autograd, as :meth:`Linear2D.forward_no_grad`."""
        (lo, hi), dt = self.rows, autocast_dtype(x)
        w = self.weight[lo:hi]
        if dt is not None:
            x, w = x.to(dt), w.to(dt)
        y = linear_no_grad(x.reshape(-1, x.shape[-1]), w, None, self.grid, False, self.weight_stationary)
        y = y.view(*x.shape[:-1], hi - lo)
        return y if self.bias is None else y + self.bias[lo:hi].to(y.dtype)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, rows={self.rows}, q={self.grid.q}"


# --------------------------------------------------------------------------- norms
class Norm2D(ShardedNorm):
    """The grid norms' common part: :class:`LayerNorm2D`, :class:`RMSNorm2D`."""

    MODE = "2d"

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
        g = grid_of(mesh, self.MODE, type(self).__name__)
        check_divisible(f"{type(self).__name__} hidden size", hidden, g.q, g.mode)
        spec = ShardSpec(
            (hidden,), (DimShard(0, g.q, g.col, ("tp_col",)),), ("tp_row",) * (g.q > 1) + g.weight_replicas
        )
        super().__init__(hidden, spec, eps=eps, weight=weight, bias=bias, device=device, dtype=dtype)
        self.grid = g

    def forward(self, x_bSh: torch.Tensor) -> torch.Tensor:
        g = self.grid
        check_block_width(type(self).__name__, x_bSh, self.hidden, g.q, "hidden", "[b/q, s, h/q]")
        # weight and bias are replicated over tp_row: ShardedNormFn sums their gradients there
        deferred = deferred_pass(self, self.weight, self.bias)
        defer = None
        if deferred is not None:  # ... and the pass waits for the sum (and adds tp_depth's)
            gp, (w, b) = deferred
            node = next(t.grad_fn for t in (w, b) if t is not None and t.grad_fn is not None)
            defer = (gp, gp.index.get(id(self.weight)), gp.index.get(id(self.bias)), node)
        else:
            w = None if self.weight is None else replicate_on(self.weight, g, rows=False)
            b = None if self.bias is None else replicate_on(self.bias, g, rows=False)
        return self.normalize(x_bSh, w, b, g.col_axis, g.row_axis, defer)

    def extra_repr(self) -> str:
        return f"hidden={self.hidden}, q={self.grid.q}, eps={self.eps}"


class LayerNorm2D(Norm2D):
    """LayerNorm of ``[b/q, s, h/q]`` over the full hidden dim (statistics over ``tp_col``).
    Weight and bias: hidden block j, replicated over ``tp_row``."""

    from_serial = classmethod(layer_norm_from_serial)


class RMSNorm2D(Norm2D):
    """RMSNorm of ``[b/q, s, h/q]``: ``x / sqrt(mean(x^2) + eps) * weight``, the mean over the
    full hidden dim (one all-reduce over ``tp_col``), computed in at least float32."""

    RMS = True

    def __init__(self, hidden: int, mesh, *, eps: float | None = 1e-5, device=None, dtype=None) -> None:
        super().__init__(hidden, mesh, eps=eps, weight=True, bias=False, device=device, dtype=dtype)

    from_serial = classmethod(rms_norm_from_serial)

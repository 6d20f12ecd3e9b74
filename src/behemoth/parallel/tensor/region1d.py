"""Megatron's ``f`` and ``g`` for 1D tensor parallelism, overlapped with compute.

The column-parallel layers of :mod:`.tp1d` (and its vocabulary-parallel head) share a
:class:`ParallelRegion` per model: column layers that read the same tensor in one forward
(q, k and v; gate and up) share one :class:`ColumnInput`, so backward communicates their
summed dX once. :class:`ColumnParallelLinearFn` is Megatron's
LinearWithGradAccumulationAndAsyncCommunication extended to such shared inputs: the last
layer of a group to run backward launches the all-reduce (sequence parallel: reduce-scatter)
of dX asynchronously and computes its weight gradient while it is in flight; with sequence
parallelism only the input's sequence shard is saved and re-gathered asynchronously during
the dX GEMM. All collectives go through :mod:`behemoth.comm` (asynchronous handles; NCCL runs
them on its own stream, so the GEMMs proceed; ``wait()`` precedes every use of a result).
:class:`RowParallelLinearFn` is ``g``: the row layer's all-reduce (reduce-scatter) fused in,
and with ``Plan.tp_overlap`` > 1 its GEMM cut into batch pieces whose collectives overlap the
next piece's GEMM.

Test: tests/dist/test_tp1d.py (``test_column_backward_overlaps_...`` reads the ledger's trace).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ... import comm
from ...comm import Axis
from .functional import autocast_dtype, cast_to

MODE = "1d"
SEQ_DIM = 1


class ColumnInput:
    """Backward state of the column-parallel layers that read one input tensor in one
    forward (q, k and v; gate and up; or a lone layer): Megatron's ``f``, shared and
    overlapped. Each layer's backward adds its dX partial here; the *last* one to run
    launches the collective on the sum asynchronously (all-reduce, or with sequence
    parallelism reduce-scatter on the sequence) and computes its weight gradient while it
    is in flight. With sequence parallelism the first one to run re-gathers the input's
    sequence shard asynchronously while it computes its dX (the gathered input is not kept
    from forward). Holds no tensor between forward and backward."""

    def __init__(self, axis: Axis, sequence_parallel: bool) -> None:
        self.axis, self.sequence_parallel = axis, sequence_parallel
        self.names: list[str] = []
        self.remaining: int | None = None
        self.grad: torch.Tensor | None = None
        self.gathered: comm.AsyncCollective | None = None

    def begin_backward(self) -> None:
        if self.remaining is None:
            self.remaining = len(self.names)
            # Autograd runs a layer's backward only if its output reaches the loss; a layer
            # that never runs would leave the sum uncommunicated. Say so instead.
            torch.autograd.Variable._execution_engine.queue_callback(self._check_complete)

    def _check_complete(self) -> None:
        if self.remaining is not None:
            left, self.remaining, self.grad, self.gathered = self.remaining, None, None, None
            raise RuntimeError(
                f"tensor parallelism ({MODE}): the column-parallel layers {', '.join(self.names)} read one input, "
                f"but the backward pass reached only {len(self.names) - left} of them (an output the loss does "
                f"not use?), so the input's gradient was never summed over tp. Use every output in the loss, or "
                f"give the unused layer no tensor-parallel role."
            )


class ParallelRegion:
    """Where activations enter the tensor-parallel region (Megatron's ``f``), shared by all
    the 1D layers of one model: column layers that read the *same* tensor (q, k, v; gate,
    up) share one :class:`ColumnInput`, so backward communicates dX once. A sequence-parallel
    norm registers its gathered output (and the shard it came from) as already inside. Row
    layers and the head close it. Holds tensors only during forward.

    ``sequence_parallel_paused``: while True (:func:`.tp1d.sequence_parallel_paused`), the
    sequence-parallel layers of the model run as plain 1D ones (a one-token decode step cannot
    be split on the sequence); the weights and their layout are the same either way."""

    def __init__(self, axis: Axis) -> None:
        self.axis = axis
        self.sequence_parallel_paused = False
        self.clear()

    def enter(
        self, x: torch.Tensor, name: str, expect_gathered: bool
    ) -> tuple[ColumnInput, torch.Tensor, torch.Tensor | None]:
        """``(group, source, gathered)`` for a column layer reading ``x``: ``source`` is the
        tensor its gradient flows to (``x`` itself, or with sequence parallelism the norm's
        sequence shard), cast once for the group under autocast; ``gathered`` the
        full-sequence input as data (sequence parallelism) or None."""
        if self._x is not x:
            if expect_gathered and not self.sequence_parallel_paused:
                raise ValueError(
                    f"sequence parallelism: column-parallel {name} got a sequence-sharded input that no norm "
                    f"gathered. Sequence parallelism needs pre-norm blocks (each column-parallel layer reads a "
                    f"norm's output, as in GPT and Llama); use Plan(sequence_parallel=False) for this model."
                )
            self._x, self._source, self._gathered = x, x, None
            self._group, self._cast = ColumnInput(self.axis, False), {}
        dtype = autocast_dtype(x)
        if dtype not in self._cast:
            self._cast[dtype] = (cast_to(self._source, dtype), cast_to(self._gathered, dtype))
        self._group.names.append(name or "?")
        return (self._group,) + self._cast[dtype]

    def gathered(self, full: torch.Tensor, shard: torch.Tensor) -> None:
        """``full`` (returned to the model) is ``shard`` all-gathered on the sequence."""
        self._x, self._source, self._gathered = full, shard, full.detach()
        self._group, self._cast = ColumnInput(self.axis, True), {}

    def clear(self) -> None:
        self._x = self._source = self._gathered = self._group = None
        self._cast: dict = {}


class ColumnParallelLinearFn(torch.autograd.Function):
    """``Y = X W^T + b`` for a column-parallel layer, with ``f`` fused in and overlapped
    (Megatron's LinearWithGradAccumulationAndAsyncCommunication, extended to inputs shared
    by several layers through :class:`ColumnInput`).

    Forward: no communication (with sequence parallelism X is the norm's already-gathered
    output, passed as data; only the sequence shard ``source`` is saved). Backward:
    dX = dY W (overlapping the asynchronous re-gather of X under sequence parallelism);
    the group's last layer launches the all-reduce (reduce-scatter) of the summed dX
    asynchronously, computes dW = dY^T X and db while it is in flight, then waits and
    returns the result as the gradient of ``source``; the others return none for it."""

    @staticmethod
    def forward(ctx, source, weight, bias, gathered, group: ColumnInput):
        ctx.group, ctx.has_bias = group, bias is not None
        ctx.save_for_backward(source, weight)
        return F.linear(source if gathered is None else gathered, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        source, weight = ctx.saved_tensors
        g = ctx.group
        need_dx, need_dw, need_db = (_will_run(ctx, i) for i in range(3))
        if g.sequence_parallel and need_dw and g.gathered is None:
            g.gathered = comm.all_gather_async(source, g.axis, SEQ_DIM)  # overlaps dX below
        handle = None
        if need_dx:
            g.begin_backward()
            dx = dy.matmul(weight)
            g.grad = dx if g.grad is None else g.grad.add_(dx)
            g.remaining -= 1
            if g.remaining == 0:
                if g.sequence_parallel:
                    handle = comm.reduce_scatter_async(g.grad, g.axis, SEQ_DIM)
                else:
                    handle = comm.all_reduce(g.grad, g.axis, async_op=True)
        dw = db = None
        if need_dw or need_db:
            dy2 = dy.reshape(-1, dy.shape[-1])
            if need_dw:
                x = g.gathered.wait() if g.sequence_parallel else source
                dw = dy2.t().matmul(x.reshape(-1, x.shape[-1]))
            if need_db:
                db = dy2.sum(0)
        dsource = None
        if handle is not None:  # the last layer of the group: collect the communicated dX, reset
            if g.sequence_parallel:
                dsource = handle.wait()
            else:
                handle.wait()  # in place
                dsource = g.grad
            g.remaining, g.grad, g.gathered = None, None, None
        return dsource, dw, db, None, None


class RowParallelLinearFn(torch.autograd.Function):
    """``Y = sum_r X_r W_r^T`` for a row-parallel layer, with Megatron's ``g`` fused in: the
    all-reduce of the partial products over tp (sequence parallel: their reduce-scatter on
    the sequence). With ``pieces`` = k > 1 (``Plan.tp_overlap``, Tensor3D's
    over-decomposition applied to 1D) the GEMM is cut into k pieces along the batch and
    piece i's collective is in flight while piece i+1's GEMM computes, so only the last
    piece's collective is exposed; the same bytes move and every element sums the same
    terms (equal to k = 1 up to the rounding of the GEMM kernel chosen for each shape).

    Backward: no collective (sequence parallel: all-gather of dY on the sequence), then
    dX = dY W and dW = dY^T X, each only if this backward pass wants it."""

    @staticmethod
    def forward(ctx, x, weight, axis: Axis, sequence_parallel: bool, pieces: int):
        ctx.axis, ctx.sequence_parallel = axis, sequence_parallel
        ctx.save_for_backward(x, weight)
        parts = x.tensor_split(pieces, 0)
        if sequence_parallel:  # each piece's rows reduce-scattered on the sequence, then stacked
            pending = [comm.reduce_scatter_async(F.linear(xp, weight), axis, SEQ_DIM) for xp in parts]
            outs = [h.wait() for h in pending]
            return outs[0] if len(outs) == 1 else torch.cat(outs, 0)
        y = x.new_empty(x.shape[:-1] + (weight.shape[0],))
        handles = []
        for xp, yp in zip(parts, y.tensor_split(pieces, 0)):  # row blocks of a contiguous y: in place
            torch.matmul(xp, weight.t(), out=yp)
            handles.append(comm.all_reduce(yp, axis, async_op=True))
        for h in handles:
            h.wait()
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        if ctx.sequence_parallel:
            dy = comm.all_gather(dy.contiguous(), ctx.axis, SEQ_DIM)
        dx = dy.matmul(weight) if _will_run(ctx, 0) else None
        dw = None
        if _will_run(ctx, 1):
            dw = dy.reshape(-1, dy.shape[-1]).t().matmul(x.reshape(-1, x.shape[-1]))
        return dx, dw, None, None, None


def row_parallel_linear(
    x: torch.Tensor, weight: torch.Tensor, axis: Axis, sequence_parallel: bool, pieces: int, name: str = ""
) -> torch.Tensor:
    """Apply :class:`RowParallelLinearFn` (eager inside a compiled block: it launches and
    waits on collectives). ``pieces`` larger than the batch is an error, raised alike on
    every tp rank (they hold the same batch) before any collective."""
    if pieces > 1 and x.dim() >= 2 and x.shape[0] < pieces:
        raise ValueError(
            f"tensor parallelism ({MODE}): Plan.tp_overlap={pieces} cuts each rank's micro-batch into {pieces} "
            f"pieces along the batch, but row-parallel {name or '?'} got a batch of {x.shape[0]} rows "
            f"(input shape {tuple(x.shape)}); use a tp_overlap of at most {x.shape[0]}, or a larger micro-batch."
        )
    return _apply_row(x, _not_leaf(weight), axis, sequence_parallel, pieces)


@torch.compiler.disable
def _apply_row(x, weight, axis, sequence_parallel, pieces):
    return RowParallelLinearFn.apply(x, weight, axis, sequence_parallel, pieces)


def _will_run(ctx, i: int) -> bool:
    """Whether this backward pass wants the gradient of input ``i``: it requires grad and the
    engine will run the node it flows to (``autograd.grad(y, x)`` or ``backward(inputs=params)``,
    as zero-bubble pipelines split backward, want only one side; the same on every rank)."""
    if not ctx.needs_input_grad[i]:
        return False
    node = ctx.next_functions[i][0]
    if node is None:
        return False
    try:
        return _WILL_EXECUTE(node)
    except RuntimeError:  # a leaf's node under autograd.grad (unsupported): assume it is wanted
        return True


_WILL_EXECUTE = getattr(torch._C, "_will_engine_execute_node", lambda node: True)


def _not_leaf(t: torch.Tensor | None) -> torch.Tensor | None:
    """A view of a leaf that requires grad (so that :func:`_will_run` can ask about it even
    under ``autograd.grad``, which cannot answer for leaves); anything else as it is."""
    return t.view_as(t) if t is not None and t.is_leaf and t.requires_grad else t


def column_parallel_linear(
    source: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    gathered: torch.Tensor | None,
    group: ColumnInput,
) -> torch.Tensor:
    """Apply :class:`ColumnParallelLinearFn` (eager even inside a compiled block: its
    backward launches and waits on collectives)."""
    return _apply_column(source, _not_leaf(weight), _not_leaf(bias), gathered, group)


@torch.compiler.disable
def _apply_column(source, weight, bias, gathered, group):
    return ColumnParallelLinearFn.apply(source, weight, bias, gathered, group)

"""The only home of collectives in behemoth.

Every collective goes through an :class:`Axis` (one mesh axis's process group, seen from
this rank) and is booked in that axis's :class:`~behemoth.ledger.Ledger` when it is issued:
calls, payload bytes, wire bytes (what a bandwidth-optimal ring algorithm sends per rank)
and blocking time. ``engine.comm_stats()`` reports the ledger, and the tests compare it
with the traffic formulas of :mod:`behemoth.planner.traffic`.

The module, by kind of operation:

* :class:`Axis`, and :class:`AsyncCollective`: the one handle every asynchronous call
  returns (``wait()`` blocks, books the blocked time, returns the result);
* collectives as plain functions, for engine-level work (gradient buckets, ZeRO chunks,
  SUMMA's steps): :func:`all_reduce`, :func:`all_gather`, :func:`reduce_scatter`,
  :func:`broadcast`, :func:`reduce`, :func:`all_to_all`, :func:`all_to_all_single` (uneven
  splits), :func:`all_gather_into`, and
  :func:`all_gather_async`, :func:`reduce_scatter_async` that return a handle;
* scalar helpers: :func:`all_reduce_scalars`, :func:`all_agree`;
* named autograd Functions for model-level communication, each docstring stating the
  forward and the backward operation (Megatron's f/g mappings and their relatives);
* point-to-point: :func:`exchange` (and its autograd Function :class:`ExchangeWithPeer`),
  :func:`ring_shift_async`, :func:`send_async`, :func:`recv_async`.

An axis of size 1 short-circuits every call: one code path for 1 rank and for N.
Collectives run eagerly even inside ``torch.compile``'d blocks: the ledger's clock readings
would otherwise become graph guards and force a recompile on every call.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .ledger import AxisTraffic, Ledger

__all__ = [
    "AxisTraffic",
    "Ledger",
    "Axis",  # the ledger classes live in ledger.py, re-exported here
    "AsyncCollective",
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "broadcast",
    "reduce",
    "all_to_all",
    "all_to_all_single",
    "all_gather_into",
    "all_gather_async",
    "reduce_scatter_async",
    "all_reduce_scalars",
    "all_agree",
    "CopyToAxis",
    "ReduceFromAxis",
    "GatherFromAxis",
    "ScatterToAxis",
    "AllGatherToAxis",
    "ReduceScatterToAxis",
    "AllToAllAxis",
    "AllToAllSingleAxis",
    "ExchangeWithPeer",
    "exchange",
    "ring_shift_async",
    "send_async",
    "recv_async",
]

_eager = torch.compiler.disable

# torch 2.13 renamed the tensor-in/tensor-out collectives (the old names warn); older torch has only those.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# --------------------------------------------------------------------------- axis and handle
@dataclass(frozen=True)
class Axis:
    """One mesh axis as seen from this rank: its group, size, this rank's index in it."""

    name: str
    size: int
    rank: int
    ranks: tuple[int, ...]
    """Global ranks of this rank's group, in axis order."""
    group: object | None
    ledger: Ledger

    @property
    def trivial(self) -> bool:
        return self.size == 1


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class AsyncCollective:
    """An in-flight collective or point-to-point transfer: issue it, compute something else,
    then ``wait()``. ``wait()`` blocks until every request in ``work`` (one request, a list of
    them, or None for a call that moved nothing) is done, books the blocked time in the axis's
    ledger (the bytes were booked when the call was issued), and returns ``finish()``: the
    output tensor, or the tensor worked on in place. Later calls return the same result. The
    handle keeps ``keep`` (the buffers in flight) alive until then."""

    def __init__(self, work, axis: Axis | None, finish, *keep) -> None:
        self._works = [] if work is None else list(work) if isinstance(work, (list, tuple)) else [work]
        self._axis, self._finish, self._keep = axis, finish, keep
        self._result = None

    def wait(self) -> torch.Tensor:
        if self._finish is not None:
            if self._works:
                t0 = time.perf_counter()
                for w in self._works:
                    w.wait()
                self._axis.ledger.add_time(self._axis.name, time.perf_counter() - t0)
            self._result, self._works, self._finish, self._keep = self._finish(), [], None, ()
        return self._result


# --------------------------------------------------------------------------- collectives
@_eager
def all_reduce(t: torch.Tensor, axis: Axis, op=dist.ReduceOp.SUM, async_op: bool = False):
    """In-place all-reduce of ``t`` over ``axis``. Returns a handle with ``wait()`` when async."""
    if axis.trivial:
        return AsyncCollective(None, axis, lambda: t) if async_op else t
    n = axis.size
    t0 = time.perf_counter()
    work = dist.all_reduce(t, op=op, group=axis.group, async_op=async_op)
    axis.ledger.record(
        axis.name, "all_reduce", _nbytes(t), 2 * (n - 1) / n * _nbytes(t), 0.0 if async_op else time.perf_counter() - t0
    )
    return AsyncCollective(work, axis, lambda: t, t) if async_op else t


@_eager
def all_gather(t: torch.Tensor, axis: Axis, dim: int = 0) -> torch.Tensor:
    """Concatenate every rank's ``t`` along ``dim`` (all ranks' shapes must match)."""
    if axis.trivial:
        return t
    n = axis.size
    t = t.contiguous()
    out = torch.empty((n * t.shape[0],) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device) if dim == 0 else None
    t0 = time.perf_counter()
    if dim == 0:
        dist.all_gather_into_tensor(out, t, group=axis.group)
    else:
        parts = [torch.empty_like(t) for _ in range(n)]
        dist.all_gather(parts, t, group=axis.group)
        out = torch.cat(parts, dim=dim)
    axis.ledger.record(axis.name, "all_gather", _nbytes(out), (n - 1) * _nbytes(t), time.perf_counter() - t0)
    return out


@_eager
def reduce_scatter(t: torch.Tensor, axis: Axis, dim: int = 0) -> torch.Tensor:
    """Sum ``t`` over the axis and return this rank's ``1/size`` slice along ``dim``."""
    if axis.trivial:
        return t
    n = axis.size
    if t.shape[dim] % n:
        raise ValueError(
            f"reduce_scatter over axis {axis.name!r}: dim {dim} of size {t.shape[dim]} "
            f"is not divisible by the axis size {n}."
        )
    t0 = time.perf_counter()
    inp = t.movedim(dim, 0).contiguous()
    out = torch.empty((inp.shape[0] // n,) + tuple(inp.shape[1:]), dtype=t.dtype, device=t.device)
    if dist.get_backend(axis.group) == "gloo":
        # gloo has no reduce-scatter: all-reduce a copy (never the caller's tensor), then keep
        # our slice (same result, more bytes moved).
        inp = inp.clone()
        dist.all_reduce(inp, group=axis.group)
        out.copy_(inp.chunk(n, 0)[axis.rank])
    else:
        dist.reduce_scatter_tensor(out, inp, group=axis.group)
    axis.ledger.record(axis.name, "reduce_scatter", _nbytes(t), (n - 1) / n * _nbytes(t), time.perf_counter() - t0)
    return out.movedim(0, dim)


@_eager
def broadcast(t: torch.Tensor, axis: Axis, src_index: int = 0, async_op: bool = False):
    """In-place broadcast of ``t`` from the axis member ``src_index``; ``async_op``: returns an
    :class:`AsyncCollective` whose ``wait()`` returns ``t`` (SUMMA prefetches the next step's)."""
    if axis.trivial:
        return AsyncCollective(None, axis, lambda: t) if async_op else t
    t0 = time.perf_counter()
    work = dist.broadcast(t, src=axis.ranks[src_index], group=axis.group, async_op=async_op)
    axis.ledger.record(axis.name, "broadcast", _nbytes(t), _nbytes(t), 0.0 if async_op else time.perf_counter() - t0)
    return AsyncCollective(work, axis, lambda: t, t) if async_op else t


@_eager
def reduce(t: torch.Tensor, axis: Axis, dst_index: int, op=dist.ReduceOp.SUM, async_op: bool = False):
    """In-place reduce (sum) of ``t`` over ``axis`` onto the member ``dst_index``; ``t`` holds
    the result only there (other members' ``t`` is left unspecified). SUMMA's backward
    step. ``async_op``: returns an :class:`AsyncCollective` whose ``wait()`` returns ``t``.
    Ledger: payload = ``t``'s bytes on every member, wire = the same (each sends once)."""
    if axis.trivial:
        return AsyncCollective(None, axis, lambda: t) if async_op else t
    t0 = time.perf_counter()
    work = dist.reduce(t, dst=axis.ranks[dst_index], op=op, group=axis.group, async_op=async_op)
    axis.ledger.record(axis.name, "reduce", _nbytes(t), _nbytes(t), 0.0 if async_op else time.perf_counter() - t0)
    return AsyncCollective(work, axis, lambda: t, t) if async_op else t


@_eager
def all_to_all(t: torch.Tensor, axis: Axis, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Split ``t`` along ``scatter_dim`` into ``size`` parts, send part i to member i, and
    concatenate what arrives along ``gather_dim``."""
    if axis.trivial:
        return t
    n = axis.size
    parts = [p.contiguous() for p in t.chunk(n, dim=scatter_dim)]
    outs = [torch.empty_like(parts[0]) for _ in range(n)]
    t0 = time.perf_counter()
    dist.all_to_all(outs, parts, group=axis.group)
    axis.ledger.record(axis.name, "all_to_all", _nbytes(t), (n - 1) / n * _nbytes(t), time.perf_counter() - t0)
    return torch.cat(outs, dim=gather_dim)


@_eager
def all_to_all_single(t: torch.Tensor, axis: Axis, send_sizes: list[int], recv_sizes: list[int]) -> torch.Tensor:
    """Uneven all-to-all along dim 0: the first ``send_sizes[0]`` rows of ``t`` go to member 0,
    the next ``send_sizes[1]`` to member 1, ...; what arrives is concatenated in member order,
    ``recv_sizes[i]`` rows from member i (the sizes must match the senders'; exchange them
    first). Any size may be 0. Ledger: payload = the bytes sent, wire = those leaving this rank."""
    if axis.trivial:
        return t
    out = t.new_empty((sum(recv_sizes), *t.shape[1:]))
    row = t.element_size() * math.prod(t.shape[1:])
    t0 = time.perf_counter()
    dist.all_to_all_single(
        out, t.contiguous(), output_split_sizes=list(recv_sizes), input_split_sizes=list(send_sizes), group=axis.group
    )
    sent = sum(send_sizes) * row
    axis.ledger.record(axis.name, "all_to_all", sent, sent - send_sizes[axis.rank] * row, time.perf_counter() - t0)
    return out


@_eager
def all_gather_into(out: torch.Tensor, shard: torch.Tensor, axis: Axis, async_op: bool = False):
    """Gather every member's 1-D ``shard`` into ``out`` (member ``i``'s at ``[i*n, (i+1)*n)``).
    ``shard`` may be ``out``'s own slot (in place, as ZeRO stages 1-2 gather updated shards).
    Returns a handle with ``wait()`` when ``async_op``. Ledger: payload = ``out``, wire =
    ``(size-1)`` shards."""
    if axis.trivial:
        if shard.data_ptr() != out.data_ptr():
            out.copy_(shard)
        return AsyncCollective(None, axis, lambda: out) if async_op else out
    n = axis.size
    if out.numel() != n * shard.numel():
        raise ValueError(
            f"all_gather_into over {axis.name!r}: out has {out.numel()} elements, expected {n} x {shard.numel()}."
        )
    if dist.get_backend(axis.group) == "gloo" and out.data_ptr() <= shard.data_ptr() < out.data_ptr() + _nbytes(out):
        shard = shard.clone()  # gloo does not promise aliasing-safe all-gather
    t0 = time.perf_counter()
    work = _all_gather_single(out, shard, group=axis.group, async_op=async_op)
    axis.ledger.record(
        axis.name, "all_gather", _nbytes(out), (n - 1) * _nbytes(shard), 0.0 if async_op else time.perf_counter() - t0
    )
    return AsyncCollective(work, axis, lambda: out, out, shard) if async_op else out


@_eager
def all_gather_async(t: torch.Tensor, axis: Axis, dim: int = 0) -> AsyncCollective:
    """Start :func:`all_gather` (concatenate every member's ``t`` along ``dim``); the handle's
    ``wait()`` returns the result. Ledger as :func:`all_gather`: payload = the gathered
    tensor, wire = ``(size-1)`` local shards."""
    if axis.trivial:
        return AsyncCollective(None, axis, lambda: t)
    n = axis.size
    src = t.movedim(dim, 0).contiguous()
    out = torch.empty((n * src.shape[0],) + tuple(src.shape[1:]), dtype=t.dtype, device=t.device)
    work = _all_gather_single(out, src, group=axis.group, async_op=True)
    axis.ledger.record(axis.name, "all_gather", _nbytes(out), (n - 1) * _nbytes(src))
    return AsyncCollective(work, axis, lambda: out.movedim(0, dim), src)


@_eager
def reduce_scatter_async(t: torch.Tensor, axis: Axis, dim: int = 0) -> AsyncCollective:
    """Start :func:`reduce_scatter` (sum over the axis, keep this member's ``1/size`` slice
    along ``dim``); the handle's ``wait()`` returns the slice. ``t`` is never modified.
    Ledger as :func:`reduce_scatter`: payload = ``t``, wire = ``(size-1)/size`` of it."""
    if axis.trivial:
        return AsyncCollective(None, axis, lambda: t)
    n = axis.size
    if t.shape[dim] % n:
        raise ValueError(
            f"reduce_scatter over axis {axis.name!r}: dim {dim} of size {t.shape[dim]} "
            f"is not divisible by the axis size {n}."
        )
    inp = t.movedim(dim, 0).contiguous()
    if dist.get_backend(axis.group) == "gloo":
        # gloo has no reduce-scatter: all-reduce a private copy, keep our slice when done.
        inp = inp.clone() if inp.data_ptr() == t.data_ptr() else inp
        work = dist.all_reduce(inp, group=axis.group, async_op=True)
        finish = lambda: inp.chunk(n, 0)[axis.rank].movedim(0, dim)  # noqa: E731
        out = inp
    else:
        out = torch.empty((inp.shape[0] // n,) + tuple(inp.shape[1:]), dtype=t.dtype, device=t.device)
        work = _reduce_scatter_single(out, inp, group=axis.group, async_op=True)
        finish = lambda: out.movedim(0, dim)  # noqa: E731
    axis.ledger.record(axis.name, "reduce_scatter", _nbytes(t), (n - 1) / n * _nbytes(t))
    return AsyncCollective(work, axis, finish, inp, out)


# --------------------------------------------------------------------------- scalars
def _scalar_device(axis: Axis) -> torch.device:
    """Where a small tensor must live to travel over ``axis`` (NCCL moves only GPU memory)."""
    if not axis.trivial and dist.get_backend(axis.group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_scalars(values: list[float], axis: Axis) -> list[float]:
    """Sum a few Python numbers over the axis in one collective (float64)."""
    t = torch.tensor(values, dtype=torch.float64, device=_scalar_device(axis))
    all_reduce(t, axis)
    return t.tolist()


def all_agree(flag: bool, axis: Axis) -> bool:
    """True on every rank iff ``flag`` is true on every rank (one tiny all-reduce)."""
    t = torch.tensor([0.0 if flag else 1.0], dtype=torch.float64, device=_scalar_device(axis))
    all_reduce(t, axis)
    return t.item() == 0.0


# --------------------------------------------------------------------------- autograd Functions
class CopyToAxis(torch.autograd.Function):
    """Identity forward; all-reduce (sum) of the gradient backward. Megatron's ``f``."""

    @staticmethod
    def forward(ctx, x, axis: Axis):
        ctx.axis = axis
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return all_reduce(g.contiguous().clone(), ctx.axis), None


class ReduceFromAxis(torch.autograd.Function):
    """All-reduce (sum) forward; identity backward. Megatron's ``g``."""

    @staticmethod
    def forward(ctx, x, axis: Axis):
        return all_reduce(x.contiguous().clone(), axis)

    @staticmethod
    def backward(ctx, g):
        return g, None


class GatherFromAxis(torch.autograd.Function):
    """All-gather along ``dim`` forward; keep this rank's slice of the gradient backward."""

    @staticmethod
    def forward(ctx, x, axis: Axis, dim: int):
        ctx.axis, ctx.dim = axis, dim
        return all_gather(x, axis, dim)

    @staticmethod
    def backward(ctx, g):
        return g.chunk(ctx.axis.size, dim=ctx.dim)[ctx.axis.rank].contiguous(), None, None


class ScatterToAxis(torch.autograd.Function):
    """Keep this rank's slice along ``dim`` forward; all-gather the gradient backward."""

    @staticmethod
    def forward(ctx, x, axis: Axis, dim: int):
        ctx.axis, ctx.dim = axis, dim
        if x.shape[dim] % axis.size:
            raise ValueError(
                f"ScatterToAxis over {axis.name!r}: dim {dim} of size {x.shape[dim]} is not divisible by {axis.size}."
            )
        return x.chunk(axis.size, dim=dim)[axis.rank].contiguous()

    @staticmethod
    def backward(ctx, g):
        return all_gather(g, ctx.axis, ctx.dim), None, None


class AllGatherToAxis(torch.autograd.Function):
    """All-gather along ``dim`` forward; reduce-scatter of the gradient backward
    (the input is a shard of an activation every rank then uses in full)."""

    @staticmethod
    def forward(ctx, x, axis: Axis, dim: int):
        ctx.axis, ctx.dim = axis, dim
        return all_gather(x, axis, dim)

    @staticmethod
    def backward(ctx, g):
        return reduce_scatter(g, ctx.axis, ctx.dim), None, None


class ReduceScatterToAxis(torch.autograd.Function):
    """Reduce-scatter along ``dim`` forward; all-gather of the gradient backward."""

    @staticmethod
    def forward(ctx, x, axis: Axis, dim: int):
        ctx.axis, ctx.dim = axis, dim
        return reduce_scatter(x, axis, dim)

    @staticmethod
    def backward(ctx, g):
        return all_gather(g.contiguous(), ctx.axis, ctx.dim), None, None


class AllToAllAxis(torch.autograd.Function):
    """All-to-all (scatter ``scatter_dim``, gather ``gather_dim``) forward; the inverse
    all-to-all (scatter ``gather_dim``, gather ``scatter_dim``) backward. Ulysses' exchange."""

    @staticmethod
    def forward(ctx, x, axis: Axis, scatter_dim: int, gather_dim: int):
        ctx.axis, ctx.dims = axis, (scatter_dim, gather_dim)
        return all_to_all(x, axis, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, g):
        s, gd = ctx.dims
        return all_to_all(g, ctx.axis, gd, s), None, None, None


class AllToAllSingleAxis(torch.autograd.Function):
    """Uneven all-to-all of rows forward (``send_sizes`` out, ``recv_sizes`` in, see
    :func:`all_to_all_single`); the reverse all-to-all of the gradient backward (``recv_sizes``
    out, ``send_sizes`` in). Expert parallelism's dispatch and combine."""

    @staticmethod
    def forward(ctx, x, axis: Axis, send_sizes: list[int], recv_sizes: list[int]):
        ctx.axis, ctx.sizes = axis, (send_sizes, recv_sizes)
        return all_to_all_single(x, axis, send_sizes, recv_sizes)

    @staticmethod
    def backward(ctx, g):
        send_sizes, recv_sizes = ctx.sizes
        return all_to_all_single(g.contiguous(), ctx.axis, recv_sizes, send_sizes), None, None, None


class ExchangeWithPeer(torch.autograd.Function):
    """Point-to-point swap with the axis member ``peer_index`` forward; the same swap of the
    gradient backward (the pairing is symmetric, so the swap is its own inverse). 2D's
    grid transpose: member (i, j) of a q x q grid swaps with (j, i)."""

    @staticmethod
    def forward(ctx, x, axis: Axis, peer_index: int):
        ctx.axis, ctx.peer = axis, peer_index
        return exchange(x, axis, peer_index)

    @staticmethod
    def backward(ctx, g):
        return exchange(g, ctx.axis, ctx.peer), None, None


# --------------------------------------------------------------------------- point-to-point
@_eager
def exchange(t: torch.Tensor, axis: Axis, peer_index: int) -> torch.Tensor:
    """Send ``t`` to the axis member ``peer_index`` and return the same-shaped tensor it sends
    back (point-to-point). The pairing must be symmetric: ``peer_index``'s peer is this rank.
    A rank paired with itself returns ``t`` and moves nothing."""
    if axis.trivial or peer_index == axis.rank:
        return t
    t = t.contiguous()
    out = torch.empty_like(t)
    peer = axis.ranks[peer_index]
    t0 = time.perf_counter()
    # Plain send/recv, lower member first: no batched-P2P rule that every member of the group
    # must join the first call (members paired with themselves do not), and no deadlock.
    if axis.rank < peer_index:
        dist.send(t, peer, group=axis.group)
        dist.recv(out, peer, group=axis.group)
    else:
        dist.recv(out, peer, group=axis.group)
        dist.send(t, peer, group=axis.group)
    axis.ledger.record(axis.name, "exchange", _nbytes(t), _nbytes(t), time.perf_counter() - t0)
    return out


@_eager
def ring_shift_async(t: torch.Tensor, axis: Axis, shift: int = 1) -> AsyncCollective:
    """Start a ring rotation over ``axis``: send ``t`` to member ``(rank + shift) % size`` and
    receive the same-shaped tensor that member ``(rank - shift) % size`` sends; the handle's
    ``wait()`` returns what arrived. Ring attention's K/V (and dK/dV) rotation: issue the
    next block's shift, compute on the current one, then wait.

    Every member must call it with the same shape and dtype, in the same order (one batched
    isend/irecv pair per member, so NCCL coalesces it and no member waits on another's send;
    on gloo the two requests are independent). ``t`` must not be modified until ``wait()``;
    the handle keeps it alive. A trivial axis (or a shift that is a multiple of the size)
    returns ``t`` itself and moves nothing. Not differentiable (callers own the backward).
    Ledger: op ``ring_shift``, payload = wire = ``t``'s bytes (each member sends one copy)."""
    n = axis.size
    if axis.trivial or shift % n == 0:
        return AsyncCollective(None, axis, lambda: t)
    src = t.contiguous()
    out = torch.empty_like(src)
    ops = [
        dist.P2POp(dist.isend, src, axis.ranks[(axis.rank + shift) % n], axis.group),
        dist.P2POp(dist.irecv, out, axis.ranks[(axis.rank - shift) % n], axis.group),
    ]
    works = dist.batch_isend_irecv(ops)
    axis.ledger.record(axis.name, "ring_shift", _nbytes(src), _nbytes(src))
    return AsyncCollective(works, axis, lambda: out, src, out)


@_eager
def send_async(t: torch.Tensor, axis: Axis, peer_index: int, tag: int = 0) -> AsyncCollective:
    """Start sending ``t`` to the axis member ``peer_index`` (``isend``); never blocks.

    The handle keeps ``t`` alive; ``wait()`` (at the end of a pipeline step, never mid-step:
    a sender that waits can deadlock against a receiver that has not posted yet) returns
    ``t``. The receiver must post a :func:`recv_async` of the same shape, dtype and ``tag``.
    Messages between one pair of members with one tag arrive in send order (NCCL ignores
    tags, so a runtime must not rely on them to reorder). ``t`` must not be modified until
    ``wait()``. Not differentiable (the pipeline runtime owns the backward).
    Ledger: op ``send``, payload = wire = ``t``'s bytes."""
    if axis.trivial or peer_index == axis.rank:
        raise ValueError(
            f"send_async over axis {axis.name!r}: peer_index={peer_index} is this member "
            f"(rank {axis.rank} of {axis.size}); hand the tensor over locally instead."
        )
    src = t.detach().contiguous()
    work = dist.isend(src, axis.ranks[peer_index], group=axis.group, tag=tag)
    axis.ledger.record(axis.name, "send", _nbytes(src), _nbytes(src))
    return AsyncCollective(work, axis, lambda: src, src)


@_eager
def recv_async(
    shape, dtype: torch.dtype, axis: Axis, peer_index: int, tag: int = 0, device: torch.device | str | None = None
) -> AsyncCollective:
    """Post a receive of a ``shape``/``dtype`` tensor from the axis member ``peer_index``
    (``irecv``); the handle's ``wait()`` returns it. Shapes are agreed in advance (no
    handshake): both sides derive them from the micro-batch shape.
    Ledger: op ``recv``, payload = the tensor's bytes, wire = 0 (the sender books them)."""
    if axis.trivial or peer_index == axis.rank:
        raise ValueError(
            f"recv_async over axis {axis.name!r}: peer_index={peer_index} is this member "
            f"(rank {axis.rank} of {axis.size}); hand the tensor over locally instead."
        )
    out = torch.empty(tuple(shape), dtype=dtype, device=device if device is not None else _scalar_device(axis))
    work = dist.irecv(out, axis.ranks[peer_index], group=axis.group, tag=tag)
    axis.ledger.record(axis.name, "recv", _nbytes(out), 0)
    return AsyncCollective(work, axis, lambda: out, out)

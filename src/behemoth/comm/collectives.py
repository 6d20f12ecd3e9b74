"""Collectives as plain functions, for engine-level work (gradient buckets, ZeRO chunks,
SUMMA's steps), and the scalar votes built on them.

Each call is booked in its axis's ledger when it is issued: payload bytes, wire bytes (what a
bandwidth-optimal ring algorithm sends per rank) and blocking time. An axis of size 1
short-circuits every call. The ``*_async`` forms (and ``async_op=True``) return an
:class:`~behemoth.comm.axis.AsyncCollective`.

Test: ``pytest tests/dist/test_comm.py``.
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist

from . import traced
from .axis import AsyncCollective, Axis, check_scatter, device_for, eager, nbytes

# torch 2.13 renamed the tensor-in/tensor-out collectives (the old names warn); older torch has only those.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
"""The reductions the collectives' ``op`` names."""


# --------------------------------------------------------------------------- collectives
def all_reduce(t: torch.Tensor, axis: Axis, op: str = "sum", async_op: bool = False):
    """In-place all-reduce of ``t`` over ``axis``; ``op``: "sum", "max" or "min" (a string, not a
    ``dist.ReduceOp``: hashing one inside compiled code is a graph break under some torch
    versions). Returns a handle with ``wait()`` when async. Inside compiled code:
    :func:`.traced.all_reduce` (a new tensor; use the return value)."""
    if torch.compiler.is_compiling():
        out = traced.all_reduce(t, axis, op)
        return traced.Ready(out) if async_op else out
    return _all_reduce(t, axis, op, async_op)


@eager
def _all_reduce(t: torch.Tensor, axis: Axis, op, async_op: bool):
    if axis.trivial:
        return AsyncCollective(None, axis, lambda: t) if async_op else t
    n = axis.size
    t0 = time.perf_counter()
    work = dist.all_reduce(t, op=REDUCE_OPS[op], group=axis.group, async_op=async_op)
    axis.ledger.record(
        axis.name, "all_reduce", nbytes(t), 2 * (n - 1) / n * nbytes(t), 0.0 if async_op else time.perf_counter() - t0
    )
    return AsyncCollective(work, axis, lambda: t, t) if async_op else t


def all_gather(t: torch.Tensor, axis: Axis, dim: int = 0) -> torch.Tensor:
    """Concatenate every rank's ``t`` along ``dim`` (all ranks' shapes must match)."""
    if torch.compiler.is_compiling():
        return traced.all_gather(t, axis, dim)
    return _all_gather(t, axis, dim)


@eager
def _all_gather(t: torch.Tensor, axis: Axis, dim: int) -> torch.Tensor:
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
    axis.ledger.record(axis.name, "all_gather", nbytes(out), (n - 1) * nbytes(t), time.perf_counter() - t0)
    return out


def reduce_scatter(t: torch.Tensor, axis: Axis, dim: int = 0) -> torch.Tensor:
    """Sum ``t`` over the axis and return this rank's ``1/size`` slice along ``dim``."""
    if torch.compiler.is_compiling():
        return traced.reduce_scatter(t, axis, dim)
    return _reduce_scatter(t, axis, dim)


@eager
def _reduce_scatter(t: torch.Tensor, axis: Axis, dim: int) -> torch.Tensor:
    if axis.trivial:
        return t
    n = check_scatter(t, axis, dim)
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
    axis.ledger.record(axis.name, "reduce_scatter", nbytes(t), (n - 1) / n * nbytes(t), time.perf_counter() - t0)
    return out.movedim(0, dim)


@eager
def broadcast(t: torch.Tensor, axis: Axis, src_index: int = 0, async_op: bool = False):
    """In-place broadcast of ``t`` from the axis member ``src_index``; ``async_op``: returns an
    :class:`AsyncCollective` whose ``wait()`` returns ``t`` (SUMMA prefetches the next step's)."""
    if axis.trivial:
        return AsyncCollective(None, axis, lambda: t) if async_op else t
    t0 = time.perf_counter()
    work = dist.broadcast(t, src=axis.ranks[src_index], group=axis.group, async_op=async_op)
    axis.ledger.record(axis.name, "broadcast", nbytes(t), nbytes(t), 0.0 if async_op else time.perf_counter() - t0)
    return AsyncCollective(work, axis, lambda: t, t) if async_op else t


@eager
def reduce(t: torch.Tensor, axis: Axis, dst_index: int, op: str = "sum", async_op: bool = False):
    """In-place reduce (sum) of ``t`` over ``axis`` onto the member ``dst_index``; ``t`` holds
    the result only there (other members' ``t`` is left unspecified). SUMMA's backward
    step. ``async_op``: returns an :class:`AsyncCollective` whose ``wait()`` returns ``t``.
    Ledger: payload = ``t``'s bytes on every member, wire = the same (each sends once)."""
    if axis.trivial:
        return AsyncCollective(None, axis, lambda: t) if async_op else t
    t0 = time.perf_counter()
    work = dist.reduce(t, dst=axis.ranks[dst_index], op=REDUCE_OPS[op], group=axis.group, async_op=async_op)
    axis.ledger.record(axis.name, "reduce", nbytes(t), nbytes(t), 0.0 if async_op else time.perf_counter() - t0)
    return AsyncCollective(work, axis, lambda: t, t) if async_op else t


@eager
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
    axis.ledger.record(axis.name, "all_to_all", nbytes(t), (n - 1) / n * nbytes(t), time.perf_counter() - t0)
    return torch.cat(outs, dim=gather_dim)


def all_to_all_rows(t: torch.Tensor, axis: Axis, send_sizes: list[int], recv_sizes: list[int]) -> torch.Tensor:
    """:func:`all_to_all_single` for split sizes fixed by shapes, not by data (a grid's
    redistribution of activation blocks): inside compiled code :func:`.traced.all_to_all_single`,
    so the compiler traces it (the expert exchange's data-dependent sizes stay eager)."""
    if torch.compiler.is_compiling():
        return traced.all_to_all_single(t, axis, send_sizes, recv_sizes)
    return all_to_all_single(t, axis, send_sizes, recv_sizes)


@eager
def all_to_all_single(
    t: torch.Tensor, axis: Axis, send_sizes: list[int], recv_sizes: list[int], out: torch.Tensor | None = None
) -> torch.Tensor:
    """Uneven all-to-all along dim 0: the first ``send_sizes[0]`` rows of ``t`` go to member 0,
    the next ``send_sizes[1]`` to member 1, ...; what arrives is concatenated in member order,
    ``recv_sizes[i]`` rows from member i (the sizes must match the senders'; exchange them
    first). Any size may be 0. ``out``: a contiguous tensor of the rows received to write them
    into (a new one when None; on a trivial axis ``t`` is copied into it). Ledger: payload = the
    bytes sent, wire = those leaving this rank."""
    if axis.trivial:
        return t if out is None else out.copy_(t)
    if out is None:
        out = t.new_empty((sum(recv_sizes), *t.shape[1:]))
    row = t.element_size() * math.prod(t.shape[1:])
    t0 = time.perf_counter()
    dist.all_to_all_single(
        out, t.contiguous(), output_split_sizes=list(recv_sizes), input_split_sizes=list(send_sizes), group=axis.group
    )
    sent = sum(send_sizes) * row
    axis.ledger.record(axis.name, "all_to_all", sent, sent - send_sizes[axis.rank] * row, time.perf_counter() - t0)
    return out


@eager
def all_to_all_single_async(
    t: torch.Tensor, axis: Axis, send_sizes: list[int], recv_sizes: list[int], out: torch.Tensor | None = None
) -> AsyncCollective:
    """Start :func:`all_to_all_single` (uneven rows out and in along dim 0) into ``out`` (a new
    tensor when None; its rows are defined once waited for); the handle's ``wait()`` returns
    the rows received. ``t`` must not change until then. Ledger as :func:`all_to_all_single`
    (booked when issued; the wait books the blocked time)."""
    if axis.trivial:
        if out is not None:
            out.copy_(t)
        return AsyncCollective(None, axis, lambda: t if out is None else out)
    src = t.contiguous()
    if out is None:
        out = src.new_empty((sum(recv_sizes), *src.shape[1:]))
    row = src.element_size() * math.prod(src.shape[1:])
    work = dist.all_to_all_single(
        out,
        src,
        output_split_sizes=list(recv_sizes),
        input_split_sizes=list(send_sizes),
        group=axis.group,
        async_op=True,
    )
    sent = sum(send_sizes) * row
    axis.ledger.record(axis.name, "all_to_all", sent, sent - send_sizes[axis.rank] * row)
    return AsyncCollective(work, axis, lambda: out, src, out)


@eager
def all_gather_into(out: torch.Tensor, shard: torch.Tensor, axis: Axis, async_op: bool = False):
    """Gather every member's 1-D ``shard`` into ``out`` (member ``i``'s at ``[i*n, (i+1)*n)``).
    ``shard`` may be ``out``'s own slot (in place, as ZeRO stages 1-2 gather updated shards).
    Returns a handle with ``wait()`` when ``async_op``. Ledger: payload = ``out``, wire =
    ``(size-1)`` shards."""
    if axis.trivial:  # a copy, in stream order (from pinned host memory too: ZeRO-3's offloaded shards)
        if shard.data_ptr() != out.data_ptr():
            out.copy_(shard, non_blocking=True)
        return AsyncCollective(None, axis, lambda: out) if async_op else out
    n = axis.size
    if out.numel() != n * shard.numel():
        raise ValueError(
            f"all_gather_into over {axis.name!r}: out has {out.numel()} elements, expected {n} x {shard.numel()}."
        )
    if dist.get_backend(axis.group) == "gloo" and out.data_ptr() <= shard.data_ptr() < out.data_ptr() + nbytes(out):
        shard = shard.clone()  # gloo does not promise aliasing-safe all-gather
    t0 = time.perf_counter()
    work = _all_gather_single(out, shard, group=axis.group, async_op=async_op)
    axis.ledger.record(
        axis.name, "all_gather", nbytes(out), (n - 1) * nbytes(shard), 0.0 if async_op else time.perf_counter() - t0
    )
    return AsyncCollective(work, axis, lambda: out, out, shard) if async_op else out


def all_gather_async(t: torch.Tensor, axis: Axis, dim: int = 0) -> AsyncCollective:
    """Start :func:`all_gather` (concatenate every member's ``t`` along ``dim``); the handle's
    ``wait()`` returns the result. Ledger as :func:`all_gather`: payload = the gathered
    tensor, wire = ``(size-1)`` local shards. Inside compiled code: a :class:`.traced.Ready`
    handle on :func:`.traced.all_gather`."""
    if torch.compiler.is_compiling():
        return traced.Ready(traced.all_gather(t, axis, dim))
    return _all_gather_async(t, axis, dim)


@eager
def _all_gather_async(t: torch.Tensor, axis: Axis, dim: int) -> AsyncCollective:
    if axis.trivial:
        return AsyncCollective(None, axis, lambda: t)
    n = axis.size
    src = (t if dim == 0 else t.movedim(dim, 0)).contiguous()
    out = torch.empty((n * src.shape[0],) + tuple(src.shape[1:]), dtype=t.dtype, device=t.device)
    work = _all_gather_single(out, src, group=axis.group, async_op=True)
    axis.ledger.record(axis.name, "all_gather", nbytes(out), (n - 1) * nbytes(src))
    return AsyncCollective(work, axis, (lambda: out) if dim == 0 else (lambda: out.movedim(0, dim)), src)


def reduce_scatter_async(t: torch.Tensor, axis: Axis, dim: int = 0) -> AsyncCollective:
    """Start :func:`reduce_scatter` (sum over the axis, keep this member's ``1/size`` slice
    along ``dim``); the handle's ``wait()`` returns the slice. ``t`` is never modified.
    Ledger as :func:`reduce_scatter`: payload = ``t``, wire = ``(size-1)/size`` of it.
    Inside compiled code: a :class:`.traced.Ready` handle on :func:`.traced.reduce_scatter`."""
    if torch.compiler.is_compiling():
        return traced.Ready(traced.reduce_scatter(t, axis, dim))
    return _reduce_scatter_async(t, axis, dim)


@eager
def _reduce_scatter_async(t: torch.Tensor, axis: Axis, dim: int) -> AsyncCollective:
    if axis.trivial:
        return AsyncCollective(None, axis, lambda: t)
    n = check_scatter(t, axis, dim)
    inp = (t if dim == 0 else t.movedim(dim, 0)).contiguous()
    if dist.get_backend(axis.group) == "gloo":
        # gloo has no reduce-scatter: all-reduce a private copy, keep our slice when done.
        inp = inp.clone() if inp.data_ptr() == t.data_ptr() else inp
        work = dist.all_reduce(inp, group=axis.group, async_op=True)
        rows = inp.shape[0] // n
        finish = lambda: inp[axis.rank * rows : (axis.rank + 1) * rows].movedim(0, dim)  # noqa: E731
        out = inp
    else:
        out = torch.empty((inp.shape[0] // n,) + tuple(inp.shape[1:]), dtype=t.dtype, device=t.device)
        work = _reduce_scatter_single(out, inp, group=axis.group, async_op=True)
        finish = (lambda: out) if dim == 0 else (lambda: out.movedim(0, dim))
    axis.ledger.record(axis.name, "reduce_scatter", nbytes(t), (n - 1) / n * nbytes(t))
    return AsyncCollective(work, axis, finish, inp, out)


# --------------------------------------------------------------------------- scalars
def all_reduce_scalars(values: list[float], axis: Axis, op: str = "sum") -> list[float]:
    """Reduce a few Python numbers over the axis in one collective (float64); ``op`` as in
    :func:`all_reduce`."""
    t = torch.tensor(values, dtype=torch.float64, device=device_for(axis))
    all_reduce(t, axis, op)
    return t.tolist()


def all_agree(flag: bool, axis: Axis) -> bool:
    """True on every rank iff ``flag`` is true on every rank (one tiny all-reduce)."""
    t = torch.tensor([0.0 if flag else 1.0], dtype=torch.float64, device=device_for(axis))
    all_reduce(t, axis)
    return t.item() == 0.0

"""Point-to-point transfers over an axis: a symmetric swap with a peer, a ring rotation, and the
asynchronous sends and receives of pipeline stages. Each is booked in the axis's ledger.

Test: ``pytest tests/dist/test_comm.py tests/dist/test_context_attention.py``.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from . import traced
from .axis import AsyncCollective, Axis, device_for, eager, nbytes


def exchange(t: torch.Tensor, axis: Axis, peer_index: int) -> torch.Tensor:
    """Send ``t`` to the axis member ``peer_index`` and return the same-shaped tensor it sends
    back (point-to-point). The pairing must be symmetric: ``peer_index``'s peer is this rank.
    A rank paired with itself returns ``t`` and moves nothing. Inside compiled code:
    :func:`.traced.exchange` (every member of the axis must call it then, a rank paired with
    itself included)."""
    if axis.trivial:
        return t
    if torch.compiler.is_compiling():
        return traced.exchange(t, axis, peer_index)
    return _exchange(t, axis, peer_index)


@eager
def _exchange(t: torch.Tensor, axis: Axis, peer_index: int) -> torch.Tensor:
    if peer_index == axis.rank:
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
    axis.ledger.record(axis.name, "exchange", nbytes(t), nbytes(t), time.perf_counter() - t0)
    return out


@eager
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
    axis.ledger.record(axis.name, "ring_shift", nbytes(src), nbytes(src))
    return AsyncCollective(works, axis, lambda: out, src, out)


@eager
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
    axis.ledger.record(axis.name, "send", nbytes(src), nbytes(src))
    return AsyncCollective(work, axis, lambda: src, src)


@eager
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
    out = torch.empty(tuple(shape), dtype=dtype, device=device if device is not None else device_for(axis))
    work = dist.irecv(out, axis.ranks[peer_index], group=axis.group, tag=tag)
    axis.ledger.record(axis.name, "recv", nbytes(out), 0)
    return AsyncCollective(work, axis, lambda: out, out)

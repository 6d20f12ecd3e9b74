"""Collectives inside ``torch.compile``'d code: the functional collectives of
``torch.distributed._functional_collectives`` (all-gather, reduce-scatter, all-reduce, and the
point-to-point swap as an all-to-all; each
result waited on with ``wait_tensor`` where it is used), over the same process groups and
booked in the same ledger as the eager collectives of :mod:`.collectives`.

Eager collectives are plain c10d calls with work handles and clock readings, which
``torch.compile`` cannot trace (each is a graph break). Inside compiled code
(``torch.compiler.is_compiling()``) :func:`.collectives.all_reduce`, :func:`.all_gather`,
:func:`.reduce_scatter` and the ``*_async`` forms route here instead, so a block whose layers
communicate (2D's SUMMA Linears and sharded norms, in their autograd Functions' forward and
backward) compiles into one graph. Differences from the eager forms: the result is always a
new tensor (``all_reduce`` is not in place: use its return value), the asynchronous forms
return a :class:`Ready` handle (the compiler places the waits), and the ledger books calls
and bytes but no blocking time (waits happen inside the compiled code).

Booking: each call adds a ``behemoth::book`` op to the graph, an op with no result that is
marked side-effectful so no compiler pass removes it; it runs every time the compiled code
runs (forward and backward), and records the call in the ledger named by its key, exactly as
the eager collective would (op name, payload and wire bytes).

Activation checkpointing: torch's partitioner never recomputes a collective, so a compiled
checkpointed block keeps what its forward gathered for the backward instead of gathering it
again (more saved memory than the eager checkpointed block; the ledger books the calls that
run, fewer than eager's).

Test: ``pytest tests/dist/test_tp2d_compile.py``.
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol

from ..ledger import Ledger
from .axis import Axis, check_scatter, nbytes


@torch.library.custom_op("behemoth::book", mutates_args=())
def book(t: torch.Tensor, ledger: int, axis: str, op: str, payload: int, wire: float) -> None:
    """Record one collective over ``axis`` in the ledger whose key is ``ledger``. ``t`` (the
    tensor sent) only orders the op after the data it books."""
    Ledger.of_key(ledger).record(axis, op, payload, wire)


@book.register_fake
def _book_fake(t, ledger, axis, op, payload, wire) -> None:
    return None


torch.library._register_effectful_op(torch.ops.behemoth.book.default, torch._library.effects.EffectType.ORDERED)


def _book(t: torch.Tensor, axis: Axis, op: str, payload: int, wire: float) -> None:
    torch.ops.behemoth.book(t, axis.ledger.key, axis.name, op, int(payload), float(wire))


class Ready:
    """The handle a traced ``*_async`` collective returns: ``wait()`` returns its result (the
    compiled code waits where the result is used)."""

    def __init__(self, result: torch.Tensor) -> None:
        self.result = result

    def wait(self) -> torch.Tensor:
        return self.result


def all_reduce(t: torch.Tensor, axis: Axis, op: str = "sum") -> torch.Tensor:
    """The all-reduce of ``t`` over ``axis`` (a new tensor); ``op``: "sum", "max" or "min".
    Ledger as the eager form."""
    if axis.trivial:
        return t
    n = axis.size
    _book(t, axis, "all_reduce", nbytes(t), 2 * (n - 1) / n * nbytes(t))
    return funcol.wait_tensor(funcol.all_reduce(t, op, axis.group))


def all_gather(t: torch.Tensor, axis: Axis, dim: int = 0) -> torch.Tensor:
    """Every member's ``t`` concatenated along ``dim``. Ledger: payload = the gathered tensor,
    wire = ``(size-1)`` local shards."""
    if axis.trivial:
        return t
    n = axis.size
    t = t.contiguous()
    _book(t, axis, "all_gather", n * nbytes(t), (n - 1) * nbytes(t))
    out = funcol.wait_tensor(funcol.all_gather_tensor(t, 0, axis.group))
    # Gathered along dim 0, then the members' shards laid side by side here: torch 2.11's
    # all_gather_tensor does that step for another dim in a helper its compiler will not trace
    # (a graph break wherever a grid layer gathers along its last dim: a 2D decode step did).
    dim %= t.dim()
    return out if dim == 0 else torch.cat(out.chunk(n, 0), dim)


def reduce_scatter(t: torch.Tensor, axis: Axis, dim: int = 0) -> torch.Tensor:
    """The sum of ``t`` over ``axis``, this member's ``1/size`` slice along ``dim``. Ledger:
    payload = ``t``, wire = ``(size-1)/size`` of it."""
    if axis.trivial:
        return t
    n = check_scatter(t, axis, dim)
    t = t.contiguous()
    _book(t, axis, "reduce_scatter", nbytes(t), (n - 1) / n * nbytes(t))
    return funcol.wait_tensor(funcol.reduce_scatter_tensor(t, "sum", dim % t.dim(), axis.group))


def exchange(t: torch.Tensor, axis: Axis, peer_index: int) -> torch.Tensor:
    """The swap of :func:`.p2p.exchange` (the pairing symmetric) as one uneven all-to-all over
    ``axis``: this member's whole ``t`` to ``peer_index``, nothing to the others. Every member
    takes part, one paired with itself too (it sends ``t`` to itself; the eager form skips it).
    Ledger as the eager form: nothing booked for a member paired with itself."""
    t = t.contiguous()
    sizes = [int(i == peer_index) for i in range(axis.size)]
    if peer_index != axis.rank:
        _book(t, axis, "exchange", nbytes(t), nbytes(t))
    return _all_to_all_rows(t.reshape(1, -1), axis, sizes, sizes).reshape(t.shape)


def all_to_all_single(t: torch.Tensor, axis: Axis, send_sizes: list[int], recv_sizes: list[int]) -> torch.Tensor:
    """:func:`.collectives.all_to_all_single` (uneven rows along dim 0, sizes fixed by shapes
    rather than by data) as a functional all-to-all. Ledger as the eager form."""
    if axis.trivial:
        return t
    row = nbytes(t) // max(1, t.shape[0])
    sent = sum(send_sizes) * row
    _book(t, axis, "all_to_all", sent, sent - send_sizes[axis.rank] * row)
    return _all_to_all_rows(t.contiguous(), axis, send_sizes, recv_sizes)


def _all_to_all_rows(t: torch.Tensor, axis: Axis, send_sizes: list[int], recv_sizes: list[int]) -> torch.Tensor:
    return funcol.wait_tensor(funcol.all_to_all_single(t, list(recv_sizes), list(send_sizes), axis.group))


def regather(t: torch.Tensor) -> torch.Tensor:
    """``t`` to be gathered again in a backward whose forward gathered it: inside compiled code
    an ``aten.alias`` view, so the compiler's common-subexpression pass cannot merge the two
    gathers (which would keep the gathered tensor alive from forward to backward instead of
    the shard); ``t`` itself elsewhere."""
    return torch.ops.aten.alias.default(t) if torch.compiler.is_compiling() else t

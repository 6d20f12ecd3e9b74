"""The axis every collective runs over, and the handle every asynchronous call returns.

An :class:`Axis` is one mesh axis's process group seen from this rank, with the
:class:`~behemoth.ledger.Ledger` its calls are booked in; an :class:`AsyncCollective` is an
in-flight call whose ``wait()`` books the time it blocked. The collectives built on them are
in :mod:`behemoth.comm`.

Test: ``pytest tests/dist/test_comm.py``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..ledger import Ledger

# Collectives run eagerly even inside ``torch.compile``'d blocks: the ledger's clock readings
# would otherwise become graph guards and force a recompile on every call. (all_reduce,
# all_gather, reduce_scatter and their async forms trace functional collectives instead: traced.py.)
eager = torch.compiler.disable


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


def nbytes(t: torch.Tensor) -> int:
    """Payload bytes of ``t``, as the ledger books them."""
    return t.numel() * t.element_size()


def check_scatter(t: torch.Tensor, axis: Axis, dim: int) -> int:
    """``axis.size``, once it divides ``t``'s ``dim`` (a reduce-scatter's slices), else ValueError."""
    n = axis.size
    if t.shape[dim] % n:
        raise ValueError(
            f"reduce_scatter over axis {axis.name!r}: dim {dim} of size {t.shape[dim]} "
            f"is not divisible by the axis size {n}."
        )
    return n


def device_for(axis: Axis) -> torch.device:
    """Where a small tensor must live to travel over ``axis`` (NCCL moves only GPU memory)."""
    if not axis.trivial and dist.get_backend(axis.group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


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

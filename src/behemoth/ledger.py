"""Per-rank traffic counters of the collectives: one :class:`AxisTraffic` per mesh axis, kept by a
:class:`Ledger` that every :class:`behemoth.comm.Axis` of a mesh shares.

``behemoth.comm`` books each collective when it is issued (calls, payload bytes, the wire bytes a
bandwidth-optimal ring algorithm sends per rank) and adds the time a rank spends blocked on it;
``engine.comm_stats()`` reports :meth:`Ledger.stats`. Pure bookkeeping: no torch, no process
group. The byte formulas are the ring algorithms' (Patarasuk & Yuan's ring all-reduce moves
``2(n-1)/n`` of the payload per rank); tests compare the ledger with them, e.g.
``pytest tests/dist/test_comm.py tests/dist/test_sequence_parallel.py``.
"""

from __future__ import annotations

import itertools
import weakref
from collections import defaultdict
from dataclasses import dataclass, field

__all__ = ["AxisTraffic", "Ledger"]


@dataclass
class AxisTraffic:
    """What one mesh axis carried on this rank since the last reset."""

    calls: int = 0
    bytes: int = 0
    """Payload bytes: the size of the tensor each call reduces, gathers or sends."""
    wire_bytes: float = 0.0
    """Bytes this rank puts on the wire for a bandwidth-optimal (ring) algorithm."""
    seconds: float = 0.0
    """Time spent blocked in (or waiting on) the call on this rank."""
    by_op: dict = field(default_factory=lambda: defaultdict(int))
    """Calls per operation name (``all_reduce``, ``send``, ...)."""


class Ledger:
    """Per-axis traffic counters for one rank."""

    _by_key: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
    _keys = itertools.count()

    def __init__(self) -> None:
        self.axes: dict[str, AxisTraffic] = defaultdict(AxisTraffic)
        self.key = next(Ledger._keys)
        """A process-unique int naming this ledger where only plain values can travel (the
        booking op of collectives inside compiled code, :mod:`behemoth.comm.traced`)."""
        Ledger._by_key[self.key] = self
        self.trace: list | None = None
        """Set to a list to log, in order, ``("call", axis, op)`` when a collective is issued
        and ``("wait", axis)`` when an asynchronous one is waited on (tests read it to see
        what overlapped with what; anything else may append its own events)."""

    def record(self, axis: str, op: str, nbytes: int, wire: float, seconds: float = 0.0) -> None:
        t = self.axes[axis]
        t.calls += 1
        t.bytes += int(nbytes)
        t.wire_bytes += wire
        t.seconds += seconds
        t.by_op[op] += 1
        if self.trace is not None:
            self.trace.append(("call", axis, op))

    @staticmethod
    def of_key(key: int) -> Ledger:
        """The live ledger whose :attr:`key` is ``key``."""
        return Ledger._by_key[key]

    def add_time(self, axis: str, seconds: float) -> None:
        self.axes[axis].seconds += seconds
        if self.trace is not None:
            self.trace.append(("wait", axis))

    def reset(self) -> None:
        self.axes.clear()

    def stats(self) -> dict[str, dict]:
        return {
            name: {
                "calls": t.calls,
                "bytes": t.bytes,
                "wire_bytes": int(t.wire_bytes),
                "seconds": round(t.seconds, 6),
                "ops": dict(t.by_op),
            }
            for name, t in sorted(self.axes.items())
        }

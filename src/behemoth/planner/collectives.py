"""Per-rank bytes of one collective, as the comm ledger counts them, and :class:`Traffic`, a
forward/backward pair of byte counts that the per-mode formulas add up.

Bytes *this rank puts on the wire* for a bandwidth-optimal (ring) algorithm -- the ledger's
``wire_bytes``:

* all-reduce of n bytes over p ranks: ``2 (p-1)/p n``;
* all-gather to, or reduce-scatter from, a full tensor of n bytes: ``(p-1)/p n``.

Pure (no torch, no process group); tested in tests/unit/test_traffic.py.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Traffic:
    """Bytes one rank sends in the forward and in the backward pass."""

    forward: float = 0.0
    backward: float = 0.0

    @property
    def total(self) -> float:
        return self.forward + self.backward

    def __add__(self, other: Traffic) -> Traffic:
        return Traffic(self.forward + other.forward, self.backward + other.backward)

    def __mul__(self, k: float) -> Traffic:
        return Traffic(self.forward * k, self.backward * k)

    __rmul__ = __mul__


def all_reduce_bytes(nbytes: float, p: int) -> float:
    return 2 * (p - 1) / p * nbytes


def all_gather_bytes(full_nbytes: float, p: int) -> float:
    """All-gather into (or reduce-scatter from) a full tensor of ``full_nbytes``."""
    return (p - 1) / p * full_nbytes


reduce_scatter_bytes = all_gather_bytes


def payload(nbytes: float, p: int) -> float:
    """An all-reduce's payload as the ledger's ``bytes`` counts it (nothing on a trivial axis)."""
    return nbytes if p > 1 else 0.0

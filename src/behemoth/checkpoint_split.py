"""Which rank copies and writes a tensor that several ranks hold alike.

Data-parallel replicas hold the same tensors (weights, optimizer state; under tensor
parallelism the same shard rectangles). A checkpoint needs each once. DCP's plan keeps one
copy of each, but only after every rank has handed it all of its tensors -- a background
save would copy them all to host memory first (GPT-1.3B with AdamW: 15.6 GB on every rank of
dp = 2, for 7.8 GB written by each). :class:`ReplicaSplit` decides before the copy: every rank
tells the others what it holds (its tensors' names, dtypes and rectangles of the serial
tensor, metadata only), and every rank computes the same assignment -- a tensor one rank holds
stays there, a replicated one goes to the holder with the fewest bytes so far, the largest
first -- and keeps only its own. The union of what the ranks keep is every tensor, once; the
host copy, its page-locked memory and the write shrink by the replica count.

The assignment is computed once per layout: a save first all-gathers a 64-bit digest of each
rank's holdings and reuses the assignment while no digest changed.

Tested in tests/unit/test_checkpoint_split.py (the assignment) and
tests/dist/test_checkpoint_write.py, tests/dist/test_async_checkpoint.py (the checkpoints).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import torch
import torch.distributed as dist

from .parallel.tensor import is_sharded, shard_rectangles
from .parallel.tensor.layout import get_spec

__all__ = ["ReplicaSplit", "assign_writers", "holding"]

Item = tuple  # (dtype name, serial shape, rectangles or None)


def holding(tensors: Mapping[str, torch.Tensor]) -> dict[str, tuple[Item, int]]:
    """``{name: (item, bytes)}``: what a rank holds of each tensor -- its dtype and its rectangles of
    the serial tensor (ranks that hold the same item of a name hold the same bytes) -- and its size."""
    out = {}
    for k, t in tensors.items():
        spec = get_spec(t)
        if is_sharded(spec):
            rects = tuple((tuple(off), tuple(size)) for _, off, size in shard_rectangles(spec))
            item = (str(t.dtype), tuple(spec.full_shape), rects)
        else:
            item = (str(t.dtype), tuple(t.shape), None)
        out[k] = (item, t.numel() * t.element_size())
    return out


def assign_writers(everyone: list[Mapping[str, tuple[Item, int]]]) -> list[set[str]]:
    """The names each rank writes, given every rank's :func:`holding`: the same answer on every rank.
    A (name, item) one rank holds is its own; one several ranks hold goes to the holder with the
    fewest bytes assigned so far (ties: the lowest rank), the largest first."""
    holders: dict[tuple[str, Item], list[int]] = {}
    size: dict[tuple[str, Item], int] = {}
    for rank, held in enumerate(everyone):
        for name, (item, nbytes) in held.items():
            holders.setdefault((name, item), []).append(rank)
            size[(name, item)] = nbytes
    load = [0] * len(everyone)
    out: list[set[str]] = [set() for _ in everyone]
    shared = []
    for key, ranks in holders.items():
        if len(ranks) == 1:
            load[ranks[0]] += size[key]
            out[ranks[0]].add(key[0])
        else:
            shared.append(key)
    for key in sorted(shared, key=lambda k: (-size[k], k[0], repr(k[1]))):
        rank = min(holders[key], key=lambda r: (load[r], r))
        load[rank] += size[key]
        out[rank].add(key[0])
    return out


def _digest(held: Mapping[str, tuple[Item, int]]) -> int:
    text = repr(sorted(held.items())).encode()
    return int.from_bytes(hashlib.sha1(text).digest()[:8], "little", signed=True)


class ReplicaSplit:
    """Keeps, of a rank's tensors, those it writes (see the module docstring); collective."""

    def __init__(self) -> None:
        self._digests: tuple[int, ...] | None = None
        self._mine: set[str] = set()

    def select(self, tensors: Mapping[str, torch.Tensor], group=None) -> dict[str, torch.Tensor]:
        """The tensors of ``tensors`` this rank writes. Collective over ``group`` (every rank, in the
        same order): one all-gather of a digest, and of the holdings when a digest changed."""
        held = holding(tensors)
        world = dist.get_world_size(group)
        digest = torch.tensor([_digest(held)], dtype=torch.int64)
        digests = [torch.zeros_like(digest) for _ in range(world)]
        dist.all_gather(digests, digest, group=group)
        key = tuple(int(d) for d in digests)
        if key != self._digests:
            everyone: list = [None] * world
            dist.all_gather_object(everyone, held, group=group)
            self._mine = assign_writers(everyone)[dist.get_rank(group)]
            self._digests = key
        return {k: t for k, t in tensors.items() if k in self._mine}

"""Which rank writes a tensor several ranks hold alike (behemoth.checkpoint_split.assign_writers):
every tensor once, a rank's own tensors stay with it, replicas share the bytes evenly, and the
same answer whatever order the ranks list their tensors in."""

from __future__ import annotations

import torch

from behemoth.checkpoint_shards import with_spec
from behemoth.checkpoint_split import assign_writers, holding
from behemoth.parallel.tensor.layout import DimShard, ShardSpec


def _held(sizes: dict[str, int]) -> dict:
    return holding({k: torch.zeros(n) for k, n in sizes.items()})


def test_replicas_are_written_once_and_the_bytes_are_shared():
    sizes = {f"w{i}": n for i, n in enumerate([100, 90, 80, 70, 60, 50, 40, 30, 20, 10])}
    out = assign_writers([_held(sizes), _held(sizes)])
    assert out[0] | out[1] == set(sizes) and not out[0] & out[1]
    load = [sum(sizes[k] for k in mine) * 4 for mine in out]
    assert abs(load[0] - load[1]) <= 10 * 4, load  # at most the smallest tensor apart here (largest first)
    assert assign_writers([_held(dict(reversed(sizes.items()))), _held(sizes)]) == out  # order does not matter


def test_a_rank_keeps_what_only_it_holds_and_takes_fewer_replicas():
    only0 = {"big": 1000}
    shared = {"a": 300, "b": 300, "c": 300, "d": 100}
    out = assign_writers([_held({**only0, **shared}), _held(shared), _held(shared)])
    assert "big" in out[0] and not (out[0] - {"big"})  # rank 0 already writes 4000 bytes: replicas go elsewhere
    assert out[1] | out[2] == set(shared) and not out[1] & out[2]


def test_tensor_parallel_shards_are_different_tensors_and_their_replicas_alike():
    def shard(index: int):
        spec = ShardSpec(full_shape=(4, 3), dims=(DimShard(dim=0, parts=2, index=index, axes=("tp",)),))
        return with_spec(torch.zeros(2, 3), spec)

    # 4 ranks: tp = 2 (shard index = rank % 2) times dp = 2
    everyone = [holding({"w": shard(r % 2), "b": torch.zeros(3)}) for r in range(4)]
    out = assign_writers(everyone)
    writers_of_w = [r for r in range(4) if "w" in out[r]]
    assert sorted(r % 2 for r in writers_of_w) == [0, 1]  # each shard once, by one of its dp replicas
    assert sum("b" in mine for mine in out) == 1

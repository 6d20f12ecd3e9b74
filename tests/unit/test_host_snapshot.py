"""The host copy a background save writes from (behemoth.async_checkpoint.HostSnapshot): values of
the moment of the copy whatever happens to the sources afterwards, buffers reused from one save to
the next, tensor-parallel ShardSpecs kept."""

from __future__ import annotations

import torch

from behemoth.async_checkpoint import HostSnapshot
from behemoth.checkpoint_shards import with_spec
from behemoth.parallel.tensor.layout import get_spec


def _state():
    return {
        "w": torch.arange(6.0).reshape(2, 3),
        "step": torch.tensor(3.0),  # 0-dim, as AdamW's step
        "ids": torch.arange(4),
        "half": torch.ones(5, dtype=torch.bfloat16),
    }


def test_the_copy_keeps_the_values_of_its_moment():
    state = _state()
    want = {k: v.clone() for k, v in state.items()}
    snap = HostSnapshot()
    copies, fence = snap.copy(state)
    assert fence is None  # on the CPU the copy is complete on return
    for v in state.values():
        v.add_(1)  # the optimizer's next update
    for k, v in want.items():
        assert copies[k].dtype == v.dtype and copies[k].shape == v.shape, k
        assert torch.equal(copies[k], v), k


def test_buffers_are_reused_and_grow_when_needed():
    snap = HostSnapshot()
    state = _state()
    assert snap.new_bytes(state) == 6 * 4 + 4 + 4 * 8 + 5 * 2
    snap.copy(state)
    ptrs = {d: b.data_ptr() for d, b in snap._buffers.items()}
    assert snap.new_bytes(state) == 0
    copies, _ = snap.copy({k: v + 1 for k, v in state.items()})
    assert {d: b.data_ptr() for d, b in snap._buffers.items()} == ptrs
    assert torch.equal(copies["w"], state["w"] + 1)
    bigger = {**state, "w2": torch.zeros(10)}
    assert snap.new_bytes(bigger) == (6 + 1 + 10) * 4  # the float32 buffer grows, the others fit


def test_a_shard_spec_travels_with_the_copy():
    from behemoth.parallel.tensor.layout import DimShard, ShardSpec

    spec = ShardSpec(full_shape=(4, 3), dims=(DimShard(dim=0, parts=2, index=1, axes=("tp",)),))
    shard = with_spec(torch.ones(2, 3), spec)
    copies, _ = HostSnapshot().copy({"w": shard, "b": torch.zeros(3)})
    assert get_spec(copies["w"]) == spec and get_spec(copies["b"]) is None


def test_each_copy_owns_exactly_its_bytes_of_the_buffer():
    # the checkpoint writer writes a tensor's whole storage, and copies a view into a larger one
    # first: a copy that is a storage of its own, in the buffer's memory, is written as it is
    snap = HostSnapshot()
    state = _state()
    copies, _ = snap.copy(state)
    for k, v in copies.items():
        buf = snap._buffers[v.dtype]
        assert v.untyped_storage().nbytes() == v.numel() * v.element_size(), k
        assert buf.data_ptr() <= v.data_ptr() < buf.data_ptr() + buf.numel() * buf.element_size(), k
        v.zero_()  # the same memory: the buffer sees it
    assert all(int(b.count_nonzero()) == 0 for b in snap._buffers.values())
    empty, _ = snap.copy({"e": torch.zeros(0, 3)})
    assert empty["e"].shape == (0, 3)


def test_reserved_buffers_are_the_ones_the_copy_uses():
    snap = HostSnapshot()
    state = _state()
    snap.reserve({torch.float32: 6 + 1, torch.int64: 4, torch.bfloat16: 5}, on_gpu=False)
    assert snap.new_bytes(state) == 0
    ptrs = {d: b.data_ptr() for d, b in snap._buffers.items()}
    copies, _ = snap.copy(state)
    assert {d: b.data_ptr() for d, b in snap._buffers.items()} == ptrs
    assert torch.equal(copies["w"], state["w"])
    snap.reserve({torch.float32: 3}, on_gpu=False)  # fits already: nothing new
    assert {d: b.data_ptr() for d, b in snap._buffers.items()} == ptrs

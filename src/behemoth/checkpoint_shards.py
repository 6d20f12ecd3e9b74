"""Tensor-parallel shards as a checkpoint sees them: rectangles of the serial tensor.

A parameter with a ShardSpec (``parallel.tensor.layout.get_spec``), and its optimizer state,
goes to DCP as a :class:`ShardChunks` view: the serial tensor's name and shape, and this rank's
shard as one or more rectangles with their real offsets in the serial tensor (a fused QKV shard
is three). Replicas (dp ranks, replicated tp ranks) write identical chunks, which DCP keeps
once. A plain tensor and a chunked one of the same name are the same serial tensor to DCP, so
a checkpoint saved under dp=2 loads under tp=2 and vice versa, each rank reading only its
rectangles. The view serves DCP's chunk protocol and nothing else: any tensor operation on it
raises.

:func:`with_spec` marks a tensor that is not a parameter (optimizer state, a host copy) as the
shard of a serial tensor, so the checkpoint writes it the same way.

Tested through the checkpoints that use it: tests/dist/test_checkpoint.py (tp/dp reshards,
fused QKV), tests/dist/test_pipeline_checkpoint.py.
"""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from .parallel.tensor import is_sharded, shard_rectangles
from .parallel.tensor.layout import ShardSpec, get_spec

__all__ = ["ShardChunks", "dcp_view", "serial_shape", "with_spec"]


class ShardChunks(torch.Tensor):
    """A local shard as DCP sees it: a tensor of the *serial* shape whose data is this rank's
    rectangles of it (from the ShardSpec), views into ``local`` -- so a load writes straight
    into the parameter or optimizer state. It implements DCP's chunk protocol (the
    ``__create_write_items__`` / ``__create_chunk_list__`` / ``__get_tensor_shard__`` methods
    DTensor uses) and nothing else: any tensor operation on it raises."""

    @staticmethod
    def __new__(cls, local: torch.Tensor, spec: ShardSpec):
        self = torch.Tensor._make_wrapper_subclass(cls, spec.full_shape, dtype=local.dtype, device=local.device)
        view = local.reshape(spec.local_view_shape())
        if view.data_ptr() != local.data_ptr():
            raise AssertionError("a shard must be contiguous to be checkpointed in place")
        self._chunks = [(torch.Size(off), torch.Size(size), view[index]) for index, off, size in shard_rectangles(spec)]
        return self

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(
            f"ShardChunks is a checkpoint view of a tensor-parallel shard; {func} on it is not supported."
        )

    def __create_write_items__(self, fqn: str, obj) -> list[WriteItem]:
        return [
            WriteItem(
                index=MetadataIndex(fqn, off),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=off, sizes=size),
                    properties=TensorProperties.create_from_tensor(data),
                    size=self.size(),
                ),
            )
            for off, size, data in self._chunks
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=off, sizes=size) for off, size, _ in self._chunks]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        for off, _, data in self._chunks:
            if off == index.offset:
                return data
        raise ValueError(f"no shard of {index.fqn} at offset {tuple(index.offset or ())} on this rank")


def dcp_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` as DCP should see it: a :class:`ShardChunks` view for a tensor-parallel shard (its
    ShardSpec), the tensor itself otherwise; detached either way."""
    spec = get_spec(t)
    return ShardChunks(t.detach(), spec) if is_sharded(spec) else t.detach()


def serial_shape(t: torch.Tensor) -> tuple[int, ...]:
    """The shape of the serial tensor ``t`` is a shard of (its own shape when it is no shard)."""
    spec = get_spec(t)
    return spec.full_shape if is_sharded(spec) else tuple(t.shape)


def with_spec(t: torch.Tensor, spec: ShardSpec | None) -> torch.Tensor:
    """An alias of ``t`` (same storage) that a checkpoint writes and reads as the shard ``spec`` of
    the serial tensor (optimizer state shaped like a tensor-parallel parameter)."""
    alias = t.detach()
    if is_sharded(spec):
        alias._bh_shard = spec
    return alias

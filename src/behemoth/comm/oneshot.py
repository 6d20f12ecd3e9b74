"""A one-shot all-reduce over symmetric memory, for the small all-reduces of decode steps.

A decode step all-reduces a few KiB per layer (``[rows, 1, hidden]`` after each row-parallel
Linear): NCCL's latency, not bandwidth, bounds it. In a one-shot all-reduce every rank copies its
tensor into a buffer that every rank of the group can read over NVLink (symmetric memory,
``torch.distributed._symmetric_memory``), meets the others at a barrier, and sums all the
buffers itself; a second barrier keeps a buffer until everyone has read it. It needs no NVLink
multicast (the machines run with ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``): it is PyTorch's
``symm_mem.one_shot_all_reduce_copy``, with one buffer per group and dtype allocated once and
kept (so a recorded CUDA graph finds it at the same address), behind the custom op
``behemoth::one_shot_all_reduce`` (opaque to ``torch.compile``: a compiled decode step keeps it
inside its graph and CUDA graph, and replays run no Python).

:func:`one_shot_all_reduce` switches it on for an axis for the duration, when every rank of the
axis can run it (CUDA, NCCL, one host, PyTorch's symm_mem ops; decided together, before any
buffer is shared); :func:`~.functional.all_reduce_functional` then sends each tensor that
:func:`eligible` accepts (at most ``max_bytes``, bf16 or fp32, a multiple of 16 bytes) through it
and everything else through the usual all-reduce, booking both in the ledger alike. Elsewhere
(CPU, gloo, several hosts) nothing changes.

Every rank sums the ranks' tensors in rank order, so all ranks get the same numbers; with two
ranks they are NCCL's too (one addition), with more they may round differently from NCCL's ring.

Test: tests/unit/test_comm_oneshot.py (the selection rule), tests/dist/test_generate_decode.py
(the fallback under gloo: switched on, generation's tokens and ledger are unchanged).
"""

from __future__ import annotations

import contextlib
import socket

import torch
import torch.distributed as dist

from .axis import Axis

__all__ = ["ONE_SHOT_MAX_BYTES", "OneShotAllReduce", "eligible", "one_shot_all_reduce", "one_shot_for"]

ONE_SHOT_MAX_BYTES = 128 * 1024
"""Largest tensor sent through the one-shot all-reduce by default (PyTorch's inductor uses the
same bound for its own one-shot lowering): a decode step's all-reduces at batch 1-8."""

_DTYPES = (torch.bfloat16, torch.float32)  # what the symm_mem kernel sums
_ALIGN = 16  # bytes: the kernel's widest vector, and the alignment it requires of both buffers


def eligible(nbytes: int, dtype: torch.dtype, device_type: str, max_bytes: int) -> bool:
    """Whether a tensor of ``nbytes`` bytes of ``dtype`` on ``device_type`` goes through the
    one-shot all-reduce: CUDA, bf16 or fp32, non-empty, at most ``max_bytes``, a multiple of 16
    bytes (the kernel's alignment). Pure."""
    return device_type == "cuda" and dtype in _DTYPES and 0 < nbytes <= max_bytes and nbytes % _ALIGN == 0


class OneShotAllReduce:
    """The symmetric buffers of one process group (one per dtype, ``max_bytes`` each, shared
    with every rank of the group at construction: a collective) and the all-reduce over them."""

    def __init__(self, group, max_bytes: int, device: torch.device) -> None:
        import warnings

        import torch.distributed._symmetric_memory as symm_mem

        self.group_name: str = group.group_name
        self.max_bytes = max_bytes
        self.buffers: dict[torch.dtype, torch.Tensor] = {}
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is not None:  # needed before a rendezvous by older releases, a deprecated no-op by newer ones
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                enable(self.group_name)
        for dtype in _DTYPES:
            buf = symm_mem.empty(max_bytes // (torch.finfo(dtype).bits // 8), dtype=dtype, device=device)
            symm_mem.rendezvous(buf, self.group_name)
            self.buffers[dtype] = buf

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the group into a new tensor (``t`` is not modified)."""
        return torch.ops.behemoth.one_shot_all_reduce(t.contiguous(), self.group_name)


_KEPT: dict[str, OneShotAllReduce] = {}  # group name -> buffers, allocated once per process
_ACTIVE: dict[str, OneShotAllReduce] = {}  # group name -> switched on (one_shot_all_reduce)


def one_shot_for(axis: Axis, t: torch.Tensor) -> OneShotAllReduce | None:
    """The one-shot all-reduce that ``t`` goes through over ``axis``, or None (the usual one)."""
    if not _ACTIVE or axis.group is None:
        return None
    impl = _ACTIVE.get(axis.group.group_name)
    if impl is None or not eligible(t.numel() * t.element_size(), t.dtype, t.device.type, impl.max_bytes):
        return None
    return impl


@contextlib.contextmanager
def one_shot_all_reduce(axis: Axis, *, max_bytes: int = ONE_SHOT_MAX_BYTES):
    """Switch the one-shot all-reduce on for ``axis`` for the duration, where every rank of it
    can run it; yields the :class:`OneShotAllReduce` in use, or None (the usual all-reduce
    stays). Every rank of ``axis`` must enter together (the first time, it is a collective)."""
    if max_bytes <= 0 or max_bytes % _ALIGN:
        raise ValueError(f"max_bytes={max_bytes!r}: must be a positive multiple of {_ALIGN}.")
    impl = _enable(axis, max_bytes)
    if impl is None:
        yield None
        return
    name = impl.group_name
    before = _ACTIVE.get(name)
    _ACTIVE[name] = impl
    try:
        yield impl
    finally:
        if before is None:
            _ACTIVE.pop(name, None)
        else:
            _ACTIVE[name] = before


def _enable(axis: Axis, max_bytes: int) -> OneShotAllReduce | None:
    if axis.trivial:
        return None
    name = axis.group.group_name
    kept = _KEPT.get(name)
    if kept is not None and kept.max_bytes >= max_bytes:
        return kept
    # Every rank decides from every rank's answer, so all of them share buffers or none does.
    local = _local_support(axis)
    answers: list = [None] * axis.size
    dist.all_gather_object(answers, local, group=axis.group)
    if not all(ok for ok, _ in answers) or len({host for _, host in answers}) != 1:
        return None
    device = torch.device("cuda", torch.cuda.current_device())
    _KEPT.pop(name, None)
    _KEPT[name] = OneShotAllReduce(axis.group, max_bytes, device)
    return _KEPT[name]


def _local_support(axis: Axis) -> tuple[bool, str]:
    """(this rank can run the one-shot all-reduce over ``axis``, its host name)."""
    ok = torch.cuda.is_available() and dist.get_backend(axis.group) == "nccl"
    if ok:
        try:
            import importlib

            importlib.import_module("torch.distributed._symmetric_memory")
            ok = hasattr(torch.ops.symm_mem, "one_shot_all_reduce_copy")
        except (ImportError, AttributeError, RuntimeError):
            ok = False
    return ok, socket.gethostname()


@torch.library.custom_op("behemoth::one_shot_all_reduce", mutates_args=())
def _one_shot_op(t: torch.Tensor, group_name: str) -> torch.Tensor:
    if not t.is_contiguous() or t.storage_offset() * t.element_size() % _ALIGN:
        t = t.clone(memory_format=torch.contiguous_format)  # the kernel wants both buffers dense, 16-byte aligned
    buf = _KEPT[group_name].buffers[t.dtype]
    return torch.ops.symm_mem.one_shot_all_reduce_copy(buf[: t.numel()].view(t.shape), t, "sum", group_name)


@_one_shot_op.register_fake
def _(t: torch.Tensor, group_name: str) -> torch.Tensor:
    return torch.empty_like(t)

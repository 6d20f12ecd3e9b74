"""Page-locked host memory of exactly the size asked for.

torch's pinned allocator (``pin_memory=True``) rounds every allocation up to the next power of
two: an offloaded chunk shard of 1.002 GiB pins 2 GiB, and a host that holds the offloaded chunks
on paper runs out (GPT-6.9B with 18 chunks' optimizer state offloaded was killed on a 125 GiB
host so). Offloaded chunks are few, large and live for the whole run, so behemoth allocates them
as anonymous memory maps of their size, page-locks them with ``cudaHostRegister`` and unlocks
them when the last tensor on them is freed. Small buffers, and a registration the driver refuses,
go to torch's pinned allocator; without a GPU nothing is pinned."""

from __future__ import annotations

import mmap
import threading
from collections.abc import Callable

import torch

__all__ = ["empty", "zeros", "ExactPinned"]

MIN_BYTES = 64 * 2**20  # below this the power-of-two rounding wastes little: torch's allocator
locked_bytes = 0  # bytes locked by this module now (diagnostics; benchmarks/gpu_check.py)
_count_lock = threading.Lock()


def _count(delta: int) -> None:
    global locked_bytes
    with _count_lock:
        locked_bytes += delta


def _register(ptr: int, nbytes: int) -> bool:
    return int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)) == 0


def _unregister(ptr: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(ptr)


class ExactPinned(mmap.mmap):
    """An anonymous memory map (zero-filled), page-locked from :meth:`lock` until it is freed --
    that is, until the last tensor made on it by ``torch.frombuffer`` is freed."""

    unregister: Callable[[int], None] = staticmethod(_unregister)

    def lock(self, register: Callable[[int, int], bool], ptr: int) -> bool:
        self._locked_at = ptr if register(ptr, len(self)) else None
        if self._locked_at is not None:
            _count(len(self))
        return self._locked_at is not None

    def __del__(self) -> None:
        ptr, self._locked_at = getattr(self, "_locked_at", None), None
        if ptr is not None:
            try:
                type(self).unregister(ptr)
                _count(-len(self))
            except Exception:  # interpreter shutdown: the process's pages go with it
                pass


def _exact(n: int, dtype: torch.dtype, register: Callable[[int, int], bool]) -> torch.Tensor | None:
    """A zero-filled tensor on a locked :class:`ExactPinned` map, or None: too small to be worth
    it, or the driver refused the registration."""
    nbytes = n * dtype.itemsize
    if nbytes < MIN_BYTES:
        return None
    buf = ExactPinned(-1, nbytes)
    t = torch.frombuffer(buf, dtype=dtype)  # the tensor's storage keeps ``buf`` alive
    return t if buf.lock(register, t.data_ptr()) else None


def _host(n: int, dtype: torch.dtype, pin: bool, zero: bool, register: Callable[[int, int], bool]) -> torch.Tensor:
    if pin:
        t = _exact(n, dtype, register)  # a memory map is zero-filled already
        if t is not None:
            return t
        return _torch_pinned(n, dtype, zero)
    return (torch.zeros if zero else torch.empty)(n, dtype=dtype)


def empty(n: int, dtype: torch.dtype, pin: bool, *, register: Callable[[int, int], bool] = _register) -> torch.Tensor:
    """``n`` elements of ``dtype`` in host memory, page-locked when ``pin`` (exactly their bytes:
    see the module docstring)."""
    return _host(n, dtype, pin, False, register)


def zeros(n: int, dtype: torch.dtype, pin: bool, *, register: Callable[[int, int], bool] = _register) -> torch.Tensor:
    """:func:`empty`, zero-filled."""
    return _host(n, dtype, pin, True, register)


def _torch_pinned(n: int, dtype: torch.dtype, zero: bool) -> torch.Tensor:
    return (torch.zeros if zero else torch.empty)(n, dtype=dtype, pin_memory=True)

"""Checkpoints written in the background: a save costs training only a copy of its state.

:class:`AsyncSaver` splits :func:`behemoth.checkpoint.save_checkpoint` in two.

* On the caller's thread, :meth:`AsyncSaver.save` first waits for the save before it (at most one
  is in flight), then takes a **snapshot**: the components' tensors that this rank writes (a tensor
  that dp replicas hold alike is copied and written by one of them,
  :mod:`behemoth.checkpoint_split`) copied into host buffers that the saver keeps from one save
  to the next (page-locked when a tensor is on a GPU), their JSON values and the caller's
  ``extra`` copied too, this rank's RNG state read. Nothing training does afterwards can change
  the snapshot. Then it returns.
* A writer thread writes the snapshot with :func:`behemoth.checkpoint.write_checkpoint`: the same
  files, the same ``step-N.partial`` directory and the same commit (rank 0 writes ``meta.json``
  and renames the directory only after every rank's files are written), so a save killed at any
  point leaves the previous checkpoint the newest complete one, as a synchronous save does.
  ``on_commit(path)`` runs on rank 0 after the rename (keep-last pruning belongs there).

The writer's collectives (the barriers around the files, DCP's plan exchange and final gather)
run on a gloo group of the saver's own, made by the first save on the caller's thread (every
rank makes it in the same order), never on a group training uses: they cannot interleave with
training's collectives, and on GPUs they take no NCCL stream.

On a GPU the copy runs on a side stream and the caller does not wait for it: the snapshot holds
an event, the writer waits for it before writing, and :meth:`AsyncSaver.fence` makes the current
stream wait for it -- the engine fences before the next optimizer update (the first write to the
tensors copied), or at once when what was copied may change sooner or is a temporary (ZeRO-3's
gathered parameters, ``param_dtype``'s fp32 copies, offload's updates during the backward).

The first save allocates the host buffers (page-locking a GPU's state takes seconds);
:meth:`AsyncSaver.reserve`, called once the state exists (the engine's ``reserve_save_buffers``, the
trainer after its first step), allocates them in a thread of their own while training goes on.

Host memory: the snapshot is one more copy of this rank's share of the state in host memory. Where the buffers it would
allocate exceed half the host's available memory (over the host's processes, ``LOCAL_WORLD_SIZE``),
every rank agrees to write that save synchronously instead, with one warning.

Errors of the writer are raised on the caller's thread by the next :meth:`save` or :meth:`wait`.
The writer is not a daemon: a process that returns from its main function with a save in flight
finishes the save before it exits (call :meth:`wait` before ``destroy_process_group``).

Tested in tests/dist/test_async_checkpoint.py (bit-exact with a synchronous save, a kill during
the write keeps the previous checkpoint) and tests/e2e/test_lifecycle.py (restarts, SIGTERM).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from .checkpoint import Stateful, check_extra, check_threads, collect, write_checkpoint
from .checkpoint_shards import with_spec
from .checkpoint_split import ReplicaSplit
from .distributed import default_timeout
from .parallel.tensor.layout import get_spec
from .parallel.zero import pinned
from .parallel.zero.measure import host_available

__all__ = ["AsyncSaver", "HostSnapshot"]


class HostSnapshot:
    """Host copies of tensors in flat per-dtype buffers kept between snapshots (so a save after
    the first allocates nothing); page-locked when a source is on a GPU, where the copy runs on a
    side stream. A snapshot's tensors stay valid until the next :meth:`copy`.

    Each copy is handed out as a tensor whose storage is exactly its own bytes of the buffer (same
    memory, no copy): the checkpoint writer writes it as it is, where a view into the whole buffer
    would be copied once more first (DCP writes a tensor's whole storage)."""

    def __init__(self) -> None:
        self._buffers: dict[torch.dtype, torch.Tensor] = {}
        self._raw: dict[torch.dtype, Any] = {}  # each buffer's bytes as a numpy array, for torch.frombuffer
        self._pinned: set[torch.dtype] = set()
        self._stream = None
        self.bytes = 0

    def new_bytes(self, tensors: Mapping[str, torch.Tensor]) -> int:
        """Host bytes :meth:`copy` of ``tensors`` would allocate (0 once the buffers fit)."""
        on_gpu = any(t.is_cuda for t in tensors.values())
        return sum(n * dtype.itemsize for dtype, n in self._missing(_numel_by_dtype(tensors), on_gpu).items())

    def _missing(self, need: Mapping[torch.dtype, int], on_gpu: bool) -> dict[torch.dtype, int]:
        out = {}
        for dtype, n in need.items():
            buf = self._buffers.get(dtype)
            if buf is None or buf.numel() < n or (on_gpu and dtype not in self._pinned):
                out[dtype] = n
        return out

    def reserve(self, need: Mapping[torch.dtype, int], on_gpu: bool) -> None:
        """Allocate now the buffers a :meth:`copy` of ``need`` elements per dtype will use (page-locked
        when ``on_gpu``; otherwise written once, so the pages exist), so that the copy allocates nothing."""
        for dtype, n in self._missing(need, on_gpu).items():
            buf = pinned.empty(n, dtype, pin=on_gpu)
            if not on_gpu:
                buf.zero_()  # fault the pages in here rather than in the copy
            self._set(dtype, buf, on_gpu)

    def _set(self, dtype: torch.dtype, buf: torch.Tensor, on_gpu: bool) -> None:
        self._buffers[dtype] = buf
        self._raw.pop(dtype, None)
        if on_gpu:
            self._pinned.add(dtype)
        self.bytes = sum(b.numel() * b.element_size() for b in self._buffers.values())

    def copy(self, tensors: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], Any]:
        """``(copies, fence)``: each tensor copied to the host (keeping its tensor-parallel ShardSpec),
        and ``(CUDA event, device)`` after which the copies are complete (None: complete on return)."""
        need = _numel_by_dtype(tensors)
        on_gpu = any(t.is_cuda for t in tensors.values())
        for dtype, n in self._missing(need, on_gpu).items():
            self._set(dtype, pinned.empty(n, dtype, pin=on_gpu), on_gpu)
        self.bytes = sum(b.numel() * b.element_size() for b in self._buffers.values())
        stream = None
        if on_gpu:
            device = next(t.device for t in tensors.values() if t.is_cuda)
            if self._stream is None:
                self._stream = torch.cuda.Stream(device)
            stream = self._stream
            stream.wait_stream(torch.cuda.current_stream(device))
        offsets = dict.fromkeys(need, 0)
        out = {}
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for key, t in tensors.items():
                off, n = offsets[t.dtype], t.numel()
                offsets[t.dtype] = off + n
                dst = self._buffers[t.dtype][off : off + n].view(t.shape)
                src = t.detach()
                dst.copy_(src, non_blocking=src.is_cuda)
                if src.is_cuda:
                    src.record_stream(stream)  # its memory is not reused before the copy is done
                out[key] = with_spec(self._own(t.dtype, off, n).view(t.shape), get_spec(t))
        return out, (stream.record_event(), stream.device) if stream is not None else None

    def _own(self, dtype: torch.dtype, off: int, n: int) -> torch.Tensor:
        """Elements ``off : off + n`` of the ``dtype`` buffer as a flat tensor whose storage is just them."""
        if n == 0:
            return torch.empty(0, dtype=dtype)
        raw = self._raw.get(dtype)
        if raw is None:
            raw = self._raw[dtype] = self._buffers[dtype].view(-1).view(torch.uint8).numpy()
        return torch.frombuffer(raw, dtype=dtype, count=n, offset=off * dtype.itemsize)


def _numel_by_dtype(tensors: Mapping[str, torch.Tensor]) -> dict[torch.dtype, int]:
    need: dict[torch.dtype, int] = {}
    for t in tensors.values():
        need[t.dtype] = need.get(t.dtype, 0) + t.numel()
    return need


HOST_MEMORY_FRACTION = 0.5
"""A background save's host copy may take at most this share of the host's available memory (summed
over the host's processes); a larger one is written synchronously instead."""


def available_host_bytes() -> int | None:
    """``MemAvailable`` of /proc/meminfo (None where there is none)."""
    return host_available()


def _all_agree(flag: bool, group) -> bool:
    """True on every rank iff ``flag`` is on every rank (one all-reduce on the saver's gloo group)."""
    t = torch.tensor([0 if flag else 1], dtype=torch.int64)
    dist.all_reduce(t, group=group)
    return int(t.item()) == 0


class AsyncSaver:
    """At most one checkpoint save in flight; see the module docstring."""

    def __init__(self) -> None:
        self._snapshot = HostSnapshot()
        self._split = ReplicaSplit()
        self._group = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._warned = False
        self._path: str | None = None
        self._event = None
        self._reserving: threading.Thread | None = None
        self._available: int | None = None
        self.last_stall_seconds = 0.0
        self.last_write_seconds = 0.0
        self.last_reserve_seconds = 0.0

    @property
    def in_flight(self) -> bool:
        return self._thread is not None

    def save(
        self,
        path: str,
        state: Mapping[str, Stateful],
        *,
        extra: dict,
        rank_state: Mapping[str, Stateful] | None = None,
        on_commit: Callable[[str], None] | None = None,
        threads: int | None = None,
    ) -> None:
        """Snapshot ``state`` (collective where a component's ``state_dict()`` is: every rank) and
        write it to checkpoint ``path`` in the background, with ``threads`` writer threads per rank
        (None: :func:`behemoth.checkpoint.writer_threads`)."""
        self.wait()
        t0 = time.perf_counter()
        check_extra(extra)
        check_threads(threads)
        self._join_reserve()
        if self._group is None:
            self._group = dist.new_group(backend="gloo", timeout=default_timeout())
        tensors, meta = collect(state)
        tensors = self._split.select(tensors, self._group)  # a replicated tensor: copied and written by one rank
        rank_files = {
            name: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in c.state_dict().items()}
            for name, c in (rank_state or {}).items()
        }
        need = self._snapshot.new_bytes(tensors) * int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        if not self._host_has_room(need):
            if dist.get_rank() == 0 and not self._warned:
                print(
                    f"behemoth: a background save needs {need / 2**30:.1f} GiB of host memory on this host for its "
                    f"copy of the state, more than {HOST_MEMORY_FRACTION:.0%} of the "
                    f"{(self._available or 0) / 2**30:.1f} GiB available: the save is written synchronously (set "
                    f"train.async_checkpoint=false to say so, or free host memory).",
                    file=sys.stderr,
                    flush=True,
                )
                self._warned = True
            write_checkpoint(path, tensors, meta, rank_files, extra=extra, threads=threads)
            if on_commit is not None and dist.get_rank() == 0:
                on_commit(path)
            self.last_stall_seconds = time.perf_counter() - t0
            return
        copies, self._event = self._snapshot.copy(tensors)
        meta = json.loads(json.dumps(meta))  # values, not references to what training changes
        extra = json.loads(json.dumps(extra))
        self._path = path
        self._thread = threading.Thread(
            target=self._write,
            args=(path, copies, meta, rank_files, extra, self._event, on_commit, threads),
            name="behemoth-checkpoint-writer",
        )
        self.last_stall_seconds = time.perf_counter() - t0
        self._thread.start()

    def _host_has_room(self, need: int) -> bool:
        """Whether every rank's host has room for ``need`` more bytes (collective on the saver's group);
        ``self._available`` keeps what this host had, for the warning."""
        self._available = available = available_host_bytes()
        return _all_agree(available is None or need <= HOST_MEMORY_FRACTION * available, self._group)

    def reserve(self, state: Mapping[str, Stateful]) -> None:
        """Allocate the host buffers the next :meth:`save` of ``state`` copies into, in a thread of its
        own, so that the first save does not wait for them (page-locking a GPU's state takes seconds):
        training goes on meanwhile, and the save waits for the thread only if it has not finished.
        Collective (every rank: a component's ``state_dict()`` may be, and the host-memory vote is).
        Allocates nothing where a save would be written synchronously for want of host memory."""
        self.wait()
        self._join_reserve()
        if self._group is None:
            self._group = dist.new_group(backend="gloo", timeout=default_timeout())
        tensors = self._split.select(collect(state)[0], self._group)
        need = _numel_by_dtype(tensors)
        device = next((t.device for t in tensors.values() if t.is_cuda), None)
        new = self._snapshot.new_bytes(tensors) * int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        del tensors  # sizes only: nothing of the state is held while the buffers are allocated
        if not self._host_has_room(new):
            return  # the save says so, and writes synchronously

        def allocate() -> None:
            t0 = time.perf_counter()
            try:  # page-locked for the sources' GPU: this thread's current device is its own
                with torch.cuda.device(device) if device is not None else contextlib.nullcontext():
                    self._snapshot.reserve(need, on_gpu=device is not None)
            except Exception:  # out of host memory: the save allocates again and reports it
                pass
            self.last_reserve_seconds = time.perf_counter() - t0

        self._reserving = threading.Thread(target=allocate, name="behemoth-checkpoint-buffers", daemon=True)
        self._reserving.start()

    def _join_reserve(self) -> None:
        if self._reserving is not None:
            self._reserving.join()
            self._reserving = None

    def _write(self, path, copies, meta, rank_files, extra, event, on_commit, threads) -> None:
        t0 = time.perf_counter()
        try:
            if event is not None:
                event[0].synchronize()
            write_checkpoint(path, copies, meta, rank_files, extra=extra, group=self._group, threads=threads)
            if on_commit is not None and dist.get_rank() == 0:
                on_commit(path)
        except BaseException as e:  # re-raised on the caller's thread by wait()
            self._error = e
        self.last_write_seconds = time.perf_counter() - t0

    def fence(self) -> None:
        """Make the current CUDA stream wait for the snapshot's copy (nothing on the CPU)."""
        if self._event is not None:
            event, device = self._event
            torch.cuda.current_stream(device).wait_event(event)
            self._event = None

    def wait(self) -> str | None:
        """Block until the save in flight is committed on every rank; returns its path (None when
        there was none). Raises the writer's error, naming the checkpoint."""
        thread, path = self._thread, self._path
        if thread is None:
            return None
        thread.join()
        self._thread, self._path, self._event = None, None, None
        error, self._error = self._error, None
        if error is not None:
            raise RuntimeError(
                f"the background save of checkpoint {path!r} failed: {type(error).__name__}: {error}. The previous "
                f"checkpoint is still the newest complete one; fix the cause (disk space, permissions) and resume."
            ) from error
        return path

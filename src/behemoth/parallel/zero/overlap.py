"""The CPU update of offloaded chunks, overlapped with the backward.

When a step needs nothing global before its update -- no gradient clipping, no fp16 loss
scale -- each offloaded chunk is updated on the host by a worker thread as soon as its reduced
gradient of the step's last micro-batch has landed there (the store calls :meth:`submit` from the
backward, in the steps it was armed for), then uploaded to the device copies the model reads (on a side stream on a GPU); the
chunk's part of the gradient norm is read there too where the store has not read it already
(a gradient summed over micro-batches on the host). The CPU optimizer, the norm and the upload run
beside the rest of the backward. :meth:`wait` (from the
ZeRO optimizer's ``step()``) waits for them; the optimizer then updates the remaining masters.

Each chunk gets the same element-wise kernel, state and hyper-parameters as in the full step
(the worker steps a one-chunk optimizer that shares the full optimizer's state), so the result
is identical. The worker issues no collective: the order of collectives stays the same on every
rank. Tested in tests/dist/test_zero.py (bit-identical to the update after the backward);
benchmarks/gpu_check.py checks the GPU streams.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from .store import ChunkState

__all__ = ["HostUpdate"]


class HostUpdate:
    """Updates of offloaded chunks during the backward, by the optimizer class ``cls`` built with
    ``defaults``; ``upload(chunk)`` copies an updated master into the copies the model reads (the
    chunk store's :meth:`~.store.ChunkStore.upload`)."""

    def __init__(
        self,
        upload: Callable[[ChunkState], None],
        device: torch.device,
        cls,
        defaults: dict,
        norm_sq: Callable[[ChunkState, torch.Tensor], torch.Tensor],
    ) -> None:
        self.upload, self.device, self.cls, self.defaults = upload, device, cls, defaults
        self.norm_sq = norm_sq  # a chunk's part of the squared gradient norm
        self.count = 0  # chunks updated during a backward, in all
        self.busy_s = self.waited_s = 0.0  # worker's time updating, step()'s time waiting: in all
        self._optimizer: torch.optim.Optimizer | None = None
        self._group_of: dict[int, dict] = {}
        self._pending: list[tuple[ChunkState, Future]] = []
        self._pool: ThreadPoolExecutor | None = None
        self._h2d: torch.cuda.Stream | None = None  # the worker's uploads (GPU)

    def arm(self, optimizer: torch.optim.Optimizer | None) -> None:
        """Before a step's forward-backward: update offloaded chunks with ``optimizer``'s state and
        hyper-parameters (read from its param groups now, as set for this step) as their gradients
        arrive (``None``: not this step)."""
        self._optimizer = optimizer
        self._group_of = {} if optimizer is None else {id(p): g for g in optimizer.param_groups for p in g["params"]}

    def submit(self, st: ChunkState) -> None:
        """Chunk ``st``'s gradient of the step is final (called by the store): update it now if armed
        and offloaded."""
        if self._optimizer is None or st.optim_on_gpu or st.grad_acc is None or st.master.device.type != "cpu":
            return
        event = st.host_grad_ready  # the end of the gradient's device->host copy (GPU)
        hyper = {k: v for k, v in self._group_of[id(st.master)].items() if k != "params"}
        if self._h2d is None and self.device.type == "cuda":
            self._h2d = torch.cuda.Stream(self.device)
        if self._pool is None:
            # A new thread starts with OpenMP's default thread count: give it this thread's. The same
            # count, so the process-wide pools it also sets (MKL, pthreadpool) keep their size.
            self._pool = ThreadPoolExecutor(
                1,
                thread_name_prefix="behemoth-cpu-update",
                initializer=torch.set_num_threads,
                initargs=(torch.get_num_threads(),),
            )
        self._pending.append((st, self._pool.submit(self._update, st, event, hyper, self._optimizer.state)))

    def _update(self, st: ChunkState, event, hyper: dict, state) -> None:
        if event is not None:
            event.synchronize()
        t0 = time.perf_counter()
        if st.norm_sq is None:  # a gradient summed over micro-batches on the host: its norm, here
            st.norm_sq = self.norm_sq(st, st.grad_acc)  # rather than in step(), after the backward
        one = self.cls([{**hyper, "params": [st.master]}], **self.defaults)
        one.state = state  # the same state entry the full optimizer would update
        st.master.grad = st.grad_acc
        try:
            one.step()
        finally:
            st.master.grad = None
        # Upload it now: the chunk's gradients are final, so no kernel still to run in this backward
        # reads its parameters (on a GPU every kernel queued before the gradient's copy has run:
        # ``event`` followed them). wait() makes the compute stream wait for these copies.
        if self._h2d is None:
            self.upload(st)
        else:
            with torch.cuda.stream(self._h2d):
                self.upload(st)
        self.busy_s += time.perf_counter() - t0

    def wait(self) -> list[ChunkState]:
        """Wait for this step's updates; returns the chunks they updated. Also the way out of a
        failed forward-backward (disarms, re-raises a worker's error)."""
        self.arm(None)
        pending, self._pending = self._pending, []
        t0 = time.perf_counter()
        for _, fut in pending:
            fut.result()
        self.waited_s += time.perf_counter() - t0
        if pending and self._h2d is not None:  # the next forward reads what the worker uploaded
            torch.cuda.current_stream(self.device).wait_stream(self._h2d)
        self.count += len(pending)
        return [st for st, _ in pending]

"""Data parallelism: bucketed gradient all-reduce overlapped with backward.

Parameters are packed, in reverse registration order (roughly the order backward
produces their gradients), into flat fp32 buckets of about ``bucket_mb`` MiB. Each
parameter's ``.grad`` is a view into its bucket, so autograd accumulates straight into
the buffer that is reduced (no flatten/unflatten copies), and gradient accumulation over
micro-batches is free.

On the last micro-batch, a post-accumulate-grad hook counts each bucket's arrivals;
when a bucket is complete, it and every complete bucket before it are launched as
asynchronous all-reduces, *while backward goes on* (the DDP/Megatron scheme). Buckets are
launched strictly in index order so every rank issues the same collectives in the same
order. ``finish()`` launches what is left (parameters that got no gradient this step)
and waits.

Communication: one all-reduce (sum) per bucket per step over the ``dp`` axis. The loss
is pre-scaled by the engine to ``sum / global_tokens``, so the sum *is* the global mean.
"""

from __future__ import annotations

import weakref

import torch

from .. import comm
from ..comm import Axis


def post_accumulate_hooks(params, method) -> list:
    """Register the bound ``method`` as every parameter's post-accumulate-grad hook through a weak
    reference to its object. Autograd holds these hooks in C++ state that Python's garbage
    collector cannot walk: a strong reference would make parameter -> hook -> owner -> parameter
    an uncollectable cycle, and every dropped engine would keep its model, gradient buffers and
    chunks alive for the life of the process."""
    ref = weakref.WeakMethod(method)

    def hook(p: torch.Tensor) -> None:
        bound = ref()
        if bound is not None:
            bound(p)

    return [p.register_post_accumulate_grad_hook(hook) for p in params]


class GradBuckets:
    """Flat gradient buckets over ``params`` with overlapped all-reduce on ``axis``."""

    def __init__(self, params: list[torch.nn.Parameter], axis: Axis, bucket_mb: float) -> None:
        self.axis = axis
        self.params = [p for p in params if p.requires_grad]
        cap = max(1, int(bucket_mb * 2**20 // 4))
        self.buckets: list[list[torch.nn.Parameter]] = []
        cur, size = [], 0
        for p in reversed(self.params):
            if cur and size + p.numel() > cap:
                self.buckets.append(cur)
                cur, size = [], 0
            cur.append(p)
            size += p.numel()
        if cur:
            self.buckets.append(cur)
        self.buffers: list[torch.Tensor] = []
        self._where: dict[int, tuple[int, int]] = {}  # id(param) -> (bucket, offset)
        for b, ps in enumerate(self.buckets):
            dev = ps[0].device
            buf = torch.zeros(sum(p.numel() for p in ps), dtype=torch.float32, device=dev)
            off = 0
            for p in ps:
                self._where[id(p)] = (b, off)
                off += p.numel()
            self.buffers.append(buf)
        self.attach_grads()
        self._hooks = post_accumulate_hooks(self.params, self._on_grad)
        self._sync = False
        self._fresh: set[int] = set()
        self._ready = [0] * len(self.buckets)
        self._next = 0
        self._pending: list = []
        # Observability for tests and logs: how many gradient hooks had fired when
        # each bucket's collective was launched.
        self.hooks_fired = 0
        self.launch_log: list[tuple[int, int]] = []

    # ---------------------------------------------------------------- grads as views
    def grad_view(self, p: torch.nn.Parameter) -> torch.Tensor:
        b, off = self._where[id(p)]
        return self.buffers[b][off : off + p.numel()].view_as(p)

    def attach_grads(self) -> None:
        """(Re)point every ``p.grad`` at its bucket slice (after anything set it to None)."""
        for p in self.params:
            view = self.grad_view(p)
            if p.grad is None or p.grad.data_ptr() != view.data_ptr():
                if p.dtype != torch.float32:
                    raise ValueError(
                        f"data-parallel buckets hold fp32 master gradients; a parameter has "
                        f"dtype {p.dtype}. Keep parameters in fp32 and use Plan(precision='bf16')."
                    )
                p.grad = view

    def start_step(self) -> None:
        """Begin a step: gradients start empty. The first gradient of each parameter is
        produced by autograd into a fresh tensor and *copied* into its bucket slice by the
        hook (one copy instead of a memset of the bucket plus an in-place add); later
        micro-batches accumulate in place into the slice."""
        for p in self.params:
            p.grad = None
        self._fresh = {id(p) for p in self.params}

    # ---------------------------------------------------------------- reduction
    def begin(self, sync: bool) -> None:
        """Call before each micro-batch's backward; ``sync`` marks the last micro-batch."""
        self._sync = sync
        if sync:
            self._ready = [0] * len(self.buckets)
            self._next = 0
            self._pending = []
            self.hooks_fired = 0
            self.launch_log = []

    def _on_grad(self, p: torch.nn.Parameter) -> None:
        if id(p) in self._fresh:
            view = self.grad_view(p)
            view.copy_(p.grad)
            p.grad = view
            self._fresh.discard(id(p))
        if not self._sync:
            return
        self.hooks_fired += 1
        b, _ = self._where[id(p)]
        self._ready[b] += 1
        self._launch_ready()

    def _launch_ready(self, force: bool = False) -> None:
        while self._next < len(self.buckets) and (force or self._ready[self._next] == len(self.buckets[self._next])):
            self.launch_log.append((self._next, self.hooks_fired))
            self._pending.append(comm.all_reduce(self.buffers[self._next], self.axis, async_op=True))
            self._next += 1

    def finish(self) -> None:
        """Launch any bucket still waiting (unused parameters) and wait for all of them."""
        if not self._sync:
            return
        for p in self.params:  # parameters that got no gradient this step: zero, not stale
            if id(p) in self._fresh:
                self.grad_view(p).zero_()
                p.grad = self.grad_view(p)
        self._fresh.clear()
        self._launch_ready(force=True)
        for h in self._pending:
            h.wait()
        self._pending = []
        self._sync = False

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()

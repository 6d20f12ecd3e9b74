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

import contextlib
import weakref

import torch

from .. import comm
from ..comm import Axis
from .tensor import global_grad_norm
from .zero.measure import memory_report
from .zero.state import state_to


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


class DataParallelSync:
    """The gradient sync of plain data parallelism (see :mod:`.zero.sync`): :class:`GradBuckets`
    over the model's trainable parameters, the optimizer over the full parameters."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        axis: Axis,
        mesh,
        bucket_mb: float,
        *,
        names: dict[int, str],
    ) -> None:
        self.buckets = GradBuckets(list(model.parameters()), axis, bucket_mb)
        self.params = self.buckets.params
        self.optimizer, self.axis, self.mesh, self.names = optimizer, axis, mesh, names
        self.tp = mesh.axis("tp")
        self._norm_axes: list[Axis] = []
        self._norm_params = self.params

    # the bucket protocol
    def start_step(self) -> None:
        self.buckets.start_step()

    def begin(self, sync: bool) -> None:
        self.buckets.begin(sync)

    def finish(self) -> None:
        self.buckets.finish()

    def ensure_grad(self, p: torch.nn.Parameter) -> torch.Tensor:
        if p.grad is None:
            p.grad = self.buckets.grad_view(p).zero_()
        return p.grad

    def attach_grads(self) -> None:
        self.buckets.attach_grads()

    @property
    def buffers(self) -> list[torch.Tensor]:
        return self.buckets.buffers

    @property
    def launch_log(self) -> list[tuple[int, int]]:
        return self.buckets.launch_log

    def configure_norm(self, extra_axes: list[Axis], skip: list[torch.nn.Parameter]) -> None:
        self._norm_axes = [a for a in extra_axes if not a.trivial]
        skipped = {id(p) for p in skip}
        self._norm_params = [p for p in self.params if id(p) not in skipped]

    # the step
    def run(self, forward_backward, max_grad_norm, scaler) -> float:
        self.start_step()
        return forward_backward()

    def grad_norm(self) -> torch.Tensor:
        norm = global_grad_norm(self._norm_params, self.mesh)
        if not self._norm_axes:
            return norm
        sq = norm.float().square().reshape(1)
        for ax in self._norm_axes:
            comm.all_reduce(sq, ax)
        return sq.sqrt()[0]

    def step(self, max_grad_norm, scaler):
        params = self.params
        if scaler is not None:
            tp = self.tp
            if not tp.trivial and not comm.all_agree(all(bool(torch.isfinite(p.grad).all()) for p in params), tp):
                params[0].grad.fill_(float("inf"))  # one overflow skips the step on every tp rank
            if not scaler.unscale_and_check(params):  # grads are identical on every dp rank
                return float("inf")
        norm = None  # read on demand from the gradients still held (a collective only over tp/pp)
        if max_grad_norm is not None:
            norm = self.grad_norm()
            torch.nn.utils.clip_grads_with_norm_(params, max_grad_norm, norm, foreach=True)
        elif not self.tp.trivial or self._norm_axes:
            norm = self.grad_norm()  # a collective: every rank, now
        self.optimizer.step()
        return norm

    # state
    def gathered(self, writable: bool = False):
        return contextlib.nullcontext()

    def memory_report(self) -> dict[str, dict[str, int]]:
        def model_bytes(dev: str) -> dict[str, int]:
            return {
                "params": sum(p.numel() * p.element_size() for p in self.params if p.device.type == dev),
                "grads": sum(b.numel() * b.element_size() for b in self.buffers if b.device.type == dev),
                "masters": 0,
            }

        return memory_report(model_bytes, self.optimizer)

    def state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        return {self.names[id(p)]: dict(st) for p, st in self.optimizer.state.items()}

    def load_state_dict(self, state) -> None:
        self.optimizer.state.clear()
        for p in (p for g in self.optimizer.param_groups for p in g["params"]):
            for key, v in state.get(self.names[id(p)], {}).items():
                self.optimizer.state[p][key] = state_to(v, p.device, self.optimizer)
        self.buckets.attach_grads()

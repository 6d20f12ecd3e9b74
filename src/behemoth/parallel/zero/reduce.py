"""Gradients of a chunk store's chunks: hooks, and reductions launched during the backward.

Every parameter's post-accumulate-grad hook copies its gradient into its chunk's ``E``-element
gradient chunk (stages 0-1: the parameter's ``.grad`` then stays a view into it, and later
micro-batches accumulate in place); when a chunk's gradients are complete its reduction over the
data axis is launched at once, while the backward goes on, in one fixed order on every rank
(reverse chunk order, the order backward finishes chunks):

* stage 0 (plain data parallelism, DDP's scheme): an all-reduce of the gradient chunk, in place,
  on the last micro-batch only; waited for in :meth:`GradReducer.finish`;
* stage 1: a reduce-scatter of the gradient chunk (persistent), on the last micro-batch only;
* stages 2-3: a reduce-scatter every micro-batch, added into the ``s``-element shard accumulator
  (``grad_acc``, beside the master: on the host for an offloaded chunk, copied down on a side
  stream), the gradient chunk freed as soon as its reduction is issued; at most 2 in flight (a
  chunk of one replica, which reduces nothing, is summed at once: three whole fp32 gradient chunks
  held beside the shards took a Llama-8B step on one H200 past its memory);
* stages 2-3 with ``reduce_once`` (pipelines, whose schedules interleave one stage's micro-batch
  backwards with other work and sum tied copies after the last one): as stage 1 -- the step's
  micro-batches accumulate in the gradient chunk, reduce-scattered once, on the last micro-batch --
  but the gradient chunk is freed as soon as its reduction is issued. Between steps a stage holds
  only its gradient shards, freed on the device when the next step starts; during the step's
  backwards, its whole gradient and no shard (one reduction per chunk per step instead of one per
  micro-batch).

A chunk whose replica axis has one member (one data rank; experts at ``ep`` = the world) reduces
nothing: its gradient chunk becomes the shard's gradient the optimizer reads (``grad_acc``) as it
is, not a copy of it (fp32, 4 bytes a parameter less, and one copy of the chunk a step fewer).

Callbacks, given at construction: ``norm_of(chunk, gradient shard)`` reads a chunk's part of the
squared gradient norm where its reduced gradient lands (stages 1-3), ``on_final(chunk)`` is called
once a chunk's gradient of the step is final (the CPU update during the backward, :mod:`.overlap`).

Collectives (axis ``data_axis``): one reduce-scatter (stage 0: all-reduce) per chunk per reduced
micro-batch. Tested in tests/dist/test_data_parallel.py and tests/dist/test_zero.py (launch order,
overlap with the backward, gradients as views).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch

from ... import comm
from .store import ChunkState, ChunkStore

__all__ = ["GradReducer", "post_accumulate_hooks"]


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


class GradReducer:
    """The gradient hooks and reductions of ``store``'s chunks over its data axis (see the module
    docstring)."""

    def __init__(
        self,
        store: ChunkStore,
        *,
        norm_of: Callable[[ChunkState, torch.Tensor], torch.Tensor] | None = None,
        on_final: Callable[[ChunkState], None] | None = None,
        reduce_once: bool = False,
    ) -> None:
        self.store, self.axis, self.stage, self.device = store, store.axis, store.stage, store.device
        self._fresh: set[int] = set()
        # stages 0-1 (and 2-3 with ``reduce_once``) accumulate the step's micro-batches in the gradient
        # chunk and reduce it once, on the last micro-batch
        self.reduce_once = reduce_once or store.stage <= 1
        # autograd accumulates in place into the fp32 gradient chunk; bf16 parameters (param_dtype)
        # need bf16 gradients, which are added into it instead
        self._in_place = self.reduce_once and store.param_dtype is None
        self._sync = self._open = False
        self._order: list[ChunkState] = list(reversed(store.chunks))  # reduction order
        self._next = 0
        self._inflight: list[tuple[ChunkState, object, bool]] = []  # (chunk, handle, of the last micro-batch)
        self.hooks_fired = 0
        self.launch_log: list[tuple[int, int]] = []  # (chunk, hooks fired when its reduction was launched)
        self.on_final = on_final  # called with a chunk once its reduced gradient of the step is in grad_acc
        # (chunk, gradient shard) -> the chunk's part of the squared gradient norm (the ZeRO optimizer's)
        self.norm_of = norm_of
        # GPU, offloaded chunks: the gradients' copies down (and adds), the accumulators' copies up,
        # the staging buffer those land in, and the event of its last reader
        self._d2h: torch.cuda.Stream | None = None
        self._h2d: torch.cuda.Stream | None = None
        self._staging: torch.Tensor | None = None
        self._staging_free: torch.cuda.Event | None = None
        self._hooks = post_accumulate_hooks([p for st in store.chunks for p in st.params], self._on_grad)

    def start_step(self) -> None:
        for st in self.store.chunks:
            st.reduced_once, st.norm_sq = False, None
            for p in st.params:
                p.grad = None
            if (
                self.reduce_once
                and self.stage >= 2
                and st.grad_acc is not None
                and st.grad_acc.device.type == self.device.type
            ):
                # a pipeline stage fills its whole gradient chunks before it reduces them: the last step's
                # shards on the device would sit beside them (at one data rank, a second whole gradient)
                st.grad_acc = st.master.grad = None
        self._fresh = {id(p) for st in self.store.chunks for p in st.params}

    def begin(self, sync: bool) -> None:
        """Before each micro-batch's backward; ``sync`` marks the last one (stages 0-1, and 2-3 with
        ``reduce_once``, reduce only then; else stages 2-3 reduce every micro-batch, so the previous
        one is flushed first)."""
        if self._open:
            self._flush()
        self._sync, self._open = sync, sync or not self.reduce_once
        if self._open:
            for st in self.store.chunks:
                st.ready = 0
            self._next = 0
            self.hooks_fired = 0
            self.launch_log = []
        if not self.reduce_once:
            self._fresh = {id(p) for st in self.store.chunks for p in st.params}

    def _grad_chunk(self, st: ChunkState) -> torch.Tensor:
        """The chunk's gradient buffer. Only the padding is zeroed here: every parameter's slice is
        written by its first gradient of the micro-batch, or zeroed by :meth:`_flush` if none came."""
        if st.grad_full is None:
            st.grad_full = torch.empty(st.size, dtype=torch.float32, device=self.device)
            st.grad_full[st.used :].zero_()
        return st.grad_full

    def _on_grad(self, p: torch.nn.Parameter) -> None:
        st = self.store.chunk_of[id(p)]
        off = self.store.offsets[id(p)]
        view = self._grad_chunk(st)[off : off + p.numel()]
        if id(p) in self._fresh:
            view.copy_(p.grad.reshape(-1))
            self._fresh.discard(id(p))
        elif not self._in_place:  # reduce_once with param_dtype: a later micro-batch's gradient (else:
            view.add_(p.grad.reshape(-1))  # a second gradient in one micro-batch, which one backward never gives)
        # in place: after the first copy the grad is a view of the chunk: autograd accumulates in place
        p.grad = view.view(p.shape) if self._in_place else None
        if self.reduce_once and not self._sync:
            return
        self.hooks_fired += 1
        st.ready += 1
        self._launch_ready()

    def _launch_ready(self, force: bool = False) -> None:
        while self._next < len(self._order) and (
            force or self._order[self._next].ready == len(self._order[self._next].params)
        ):
            st = self._order[self._next]
            self.launch_log.append((st.index, self.hooks_fired))
            if st.grad_full is None:  # no parameter of the chunk got a gradient: reduce zeros
                self._grad_chunk(st).zero_()
            self._next += 1
            if self.stage == 0:  # the gradient chunk itself, summed in place; waited for in finish()
                handle = comm.all_reduce(st.grad_full, self.store.replica_axis(st), async_op=True)
                self._inflight.append((st, handle, False))
                continue
            handle = comm.reduce_scatter_async(st.grad_full, self.store.replica_axis(st))
            self._inflight.append((st, handle, self._sync))
            if self.stage >= 2:
                st.grad_full = None  # the handle keeps the buffer alive until the reduce is done
                if self._in_place:  # nor do the parameters' views keep it
                    for p in st.params:
                        p.grad = None
                if self.stage == 3 and st.pending is None:
                    self.store.release(st)  # its gradients are complete: backward needs it no more
            if self.store.replica_axis(st).trivial:  # nothing to wait for: summed into its shard's
                self._complete(*self._inflight.pop())  # gradient now, and the gradient chunk freed
            while len(self._inflight) > 2:  # bound memory: at most 2 chunk reductions in flight
                self._complete(*self._inflight.pop(0))

    def _complete(self, st: ChunkState, handle, final: bool) -> None:
        if self.stage == 0:
            handle.wait()
            return
        reduced = handle.wait()
        if final and not st.reduced_once and self.norm_of is not None:
            # The step's whole gradient (no earlier micro-batch to add): its norm is read here, where
            # it lies -- on a GPU, before the copy to the host (vector_norm ran at ~12 GB/s on a 16-core host).
            st.norm_sq = self.norm_of(st, reduced)
        # one replica (the chunk's replica axis is this rank alone): the reduction is the gradient
        # chunk itself, on the master's device, kept as the shard's gradient without a copy
        own = self.store.replica_axis(st).trivial and reduced.device == st.master.device
        if st.grad_acc is None and not own:
            st.grad_acc = self.store.grad_buffer(st)
        if not own and st.grad_acc.device.type == "cpu" and reduced.device.type == "cuda":
            self._to_host(st, reduced, final)
        elif st.reduced_once:
            self._wait_host_grad(st)
            st.grad_acc.add_(reduced.to(st.grad_acc.device))
        elif own:
            st.grad_acc = reduced
        else:
            st.grad_acc.copy_(reduced, non_blocking=True)
        st.reduced_once = True
        if final and self.on_final is not None:  # reduced in the step's last micro-batch: the gradient is final
            self.on_final(st)

    def _to_host(self, st: ChunkState, reduced: torch.Tensor, final: bool) -> None:
        """A reduced gradient into its chunk's accumulator in pinned host memory, after all that is
        queued on the compute stream (the backward's next kernels do not queue behind it): copied
        down the first micro-batch; later ones add on the device -- the accumulator up into a staging
        buffer on one side stream, the add and the sum down on another, so the two copy directions
        run beside each other (chunk i's sum goes down while chunk i+1's accumulator comes up), where
        a blocking copy to pageable memory and the host's add took 37 s of a 41 s step (Llama-8B,
        four micro-batches, half its optimizer offloaded, one H200). The step's summed gradient has
        its norm read on the device too, before it goes down (the host read 4 GB chunks at ~12 GB/s).
        The down stream orders each chunk's copies; ``host_grad_ready`` marks the last one."""
        dev = reduced.device
        if self._d2h is None:
            self._d2h, self._h2d = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
        self._d2h.wait_stream(torch.cuda.current_stream(dev))
        if st.reduced_once:
            n = reduced.numel()
            if self._staging is None or self._staging.numel() < n:
                if self._staging is not None:  # freed once the side streams' queued work has read it
                    self._staging.record_stream(self._h2d)
                    self._staging.record_stream(self._d2h)
                self._staging = torch.empty(n, dtype=torch.float32, device=dev)
                # memory the compute stream freed: its last reader there runs before the copy up writes
                self._h2d.wait_stream(torch.cuda.current_stream(dev))
            up = self._staging[:n]
            # the staging buffer is free once the previous add has read it, the accumulator once its
            # last copy down has landed
            for event in (self._staging_free, st.host_grad_ready):
                if event is not None:
                    self._h2d.wait_event(event)
            with torch.cuda.stream(self._h2d):
                up.copy_(st.grad_acc, non_blocking=True)
            self._d2h.wait_stream(self._h2d)
            with torch.cuda.stream(self._d2h):
                reduced.add_(up)
                if final and self.norm_of is not None:
                    st.norm_sq = self.norm_of(st, reduced)
            self._staging_free = torch.cuda.Event()
            self._staging_free.record(self._d2h)
        with torch.cuda.stream(self._d2h):
            st.grad_acc.copy_(reduced, non_blocking=True)
        reduced.record_stream(self._d2h)  # not reused before the copy has read it
        st.host_grad_ready = torch.cuda.Event()
        st.host_grad_ready.record(self._d2h)

    def _flush(self) -> None:
        """Close the current micro-batch: parameters that got no gradient count as zeros, every
        chunk not yet reduced is issued (same order on every rank)."""
        for st in self.store.chunks:
            for p, off in zip(st.params, st.offsets):
                if id(p) in self._fresh:
                    view = self._grad_chunk(st)[off : off + p.numel()]
                    view.zero_()
                    p.grad = view.view(p.shape) if self._in_place else None
        self._fresh.clear()
        self._launch_ready(force=True)
        self._open = False

    def finish(self) -> None:
        """After the step's last backward: reduce what is left and wait for every reduction."""
        if self._open:
            self._flush()
        while self._inflight:
            self._complete(*self._inflight.pop(0))
        if self.stage == 3:
            self.store.release_all()
        if self.stage and self.device.type == "cuda":
            torch.cuda.current_stream().synchronize()  # host gradient copies are complete
        for st in self.store.chunks:
            self._wait_host_grad(st)
        self._staging = self._staging_free = None  # its readers ran before the last copies down
        self._sync = False

    def abandon(self) -> None:
        """After a forward or backward that raised: wait for the reductions and gathers in flight,
        drop this step's gradients and release the gathered chunks (stage 3), so the step can run
        again from the start."""
        for _, handle, _ in self._inflight:
            handle.wait()
        self._inflight.clear()
        for st in self.store.chunks:
            self._wait_host_grad(st)
            st.grad_full = st.grad_acc = None
            st.ready, st.reduced_once = 0, False
            for p in st.params:
                p.grad = None
        self._staging = self._staging_free = None
        self._fresh.clear()
        self._sync = self._open = False
        if self.stage == 3:
            self.store.release_all()

    @staticmethod
    def _wait_host_grad(st: ChunkState) -> None:
        if st.host_grad_ready is not None:
            st.host_grad_ready.synchronize()
            st.host_grad_ready = None

    def ensure_grad(self, p: torch.nn.Parameter) -> torch.Tensor:
        """Stages 0-1 (2-3 with ``reduce_once``): ``p``'s fp32 gradient as it will be reduced, a view of
        its gradient chunk (zeros if no gradient arrived yet), so a caller may add into it in place
        before the reduction (pipelines sum tied copies). ``p.grad`` is that view too, but under
        bf16 parameters (their ``.grad`` is bf16)."""
        st, off = self.store.chunk_of[id(p)], self.store.offsets[id(p)]
        view = self._grad_chunk(st)[off : off + p.numel()].view(p.shape)
        if id(p) in self._fresh:
            view.zero_()
            self._fresh.discard(id(p))
        if self._in_place:
            p.grad = view
        return view

    def grads(self) -> list[torch.Tensor]:
        """This rank's reduced gradients, one tensor per chunk: the gradient chunks at stage 0 (the
        parameters' ``.grad`` are views into them), else the gradient shards (None where none came)."""
        return [st.grad_full if self.stage == 0 else st.grad_acc for st in self.store.chunks]

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()

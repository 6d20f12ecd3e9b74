"""The chunk store: ZeRO's runtime memory of parameters and gradients (Gemini / Elixir), and the
buffers of plain data parallelism (ZeRO stage 0). The gradient hooks and reductions over these
chunks: :mod:`.reduce`.

Parameters, in execution order, are packed by :func:`.chunks.pack_chunks` into fixed-size
fp32 chunks; every parameter's ``.data`` is a view into its chunk's ``full`` buffer, so a
chunk is gathered, released and reduced as one contiguous tensor. Rank ``r`` of the data
axis owns elements ``[r*n, (r+1)*n)`` of every chunk (its *shard*).

Per ZeRO stage (``s`` = shard elements, ``E`` = chunk elements):

* stage 0 (plain data parallelism): chunks are unsharded buckets of about ``Plan.bucket_mb``
  (:func:`.chunks.pack_buckets`), ``full`` persistent and updated in place by the optimizer (the
  parameters are its views); gradients are views into a persistent ``E``-element gradient chunk
  (accumulated over micro-batches in place) all-reduced on the last micro-batch, as DDP does;
* stage 1: ``full`` persistent; gradients are views into a persistent ``E``-element gradient
  chunk (accumulated over micro-batches in place) reduce-scattered on the last micro-batch;
* stage 2: ``full`` persistent; a gradient chunk lives only from a chunk's first gradient
  of a micro-batch until its reduce-scatter has been issued: every micro-batch's gradients
  are reduce-scattered and added into the ``s``-element shard accumulator (a pipeline stage
  keeps its gradient chunks over the step's micro-batches and reduce-scatters them once,
  after the last: :mod:`.reduce`'s ``reduce_once``);
* stage 3: as 2, and ``full``'s storage is freed when the chunk is not in use and
  re-gathered (all-gather of the shards) before a module that owns its parameters runs
  forward or backward (module hooks in :mod:`.hooks`); the next chunks of the previous
  step's gather order are prefetched asynchronously.

Low-precision parameters (``param_dtype``, every stage): ``full`` is a bf16 buffer and every
parameter a bf16 view into it; the all-gather's source is a bf16 copy of the fp32 master
shard, refreshed after each optimizer step: ``low`` on the device for a chunk whose
parameters stay there, ``low_host`` (pinned) for an offloaded one (stage 3), so a fetch moves
half the bytes; an fp32 ``shard`` is kept on the device only where the master itself is.
Stages 1-2 keep ``full`` allocated, ``low`` is this rank's slot of it, and ``full`` is
all-gathered in place after each step. A host master reaches its device ``low`` through
pinned staging (:mod:`.staging`: converted on the host, half the bytes uploaded). Gradients
arrive in bf16 and are copied (stage 1: added, over micro-batches) into the fp32 gradient
chunk, so reduction, masters and optimizer state stay fp32. :meth:`ChunkStore.gather` with
``exact=True`` (checkpoints, ``full_state_dict``) gathers the fp32 masters instead, into a
temporary buffer the parameters view until release.

Where the shard lives (``placement``): ``param_on_gpu[c]`` (stage 3 only: else the shard is
fetched from the host copy for every gather) and ``optim_on_gpu[c]`` (the fp32 master and the
optimizer state; else both sit in pinned host memory, the reduced gradient is copied to the
host as soon as it is ready and the optimizer runs on the CPU). On a CPU-only run "host" and
"device" are both the CPU: the same code path runs (that is how the tests exercise it).

Collectives (axis ``data_axis``): one all-gather per chunk after the optimizer step (stages 1-2)
or per use (stage 3); the reductions are :mod:`.reduce`'s.
"""

from __future__ import annotations

import torch

from ... import comm
from ...comm import Axis
from . import pinned
from .chunks import ChunkLayout
from .staging import PinnedStaging

__all__ = ["ChunkState", "ChunkStore"]


def _free(t: torch.Tensor) -> None:
    t.untyped_storage().resize_(0)


def _alloc(t: torch.Tensor) -> None:
    n = t.numel() * t.element_size()
    if t.untyped_storage().size() != n:
        t.untyped_storage().resize_(n)


class ChunkState:
    """One chunk on this rank: its buffers and where each lives."""

    def __init__(
        self,
        index: int,
        group: int,
        size: int,
        start: int,
        shard_size: int,
        params: list[torch.nn.Parameter],
        offsets: list[int],
    ) -> None:
        self.index, self.group, self.size = index, group, size
        self.start, self.shard_size = start, shard_size
        self.params, self.offsets = params, offsets
        self.used = max((off + p.numel() for p, off in zip(params, offsets)), default=0)  # then padding
        self.full: torch.Tensor | None = None  # E elements on the device (storage freed when released)
        self.low: torch.Tensor | None = None  # s-element low-precision shard (param_dtype; stages 1-2: in full)
        self.low_host: torch.Tensor | None = None  # the same in pinned host memory (offloaded parameters)
        self.low_full: torch.Tensor | None = None  # the low-precision ``full`` while an exact gather is out
        self.shard: torch.Tensor | None = None  # s elements gathered from (device), None if host-only
        self.master: torch.Tensor | None = None  # s elements the optimizer updates (device or pinned host)
        self.grad_full: torch.Tensor | None = None  # E-element gradient chunk (stage 1 persistent)
        self.grad_acc: torch.Tensor | None = None  # s-element reduced gradient, on the master's device
        self.param_on_gpu = True
        self.optim_on_gpu = True
        self.resident = True  # ``full`` holds the current parameters
        self.pending = None  # in-flight gather handle (stage 3 prefetch)
        self.ready = 0  # gradients arrived in this micro-batch
        self.reduced_once = False  # grad_acc holds this step's first reduction
        self.host_grad_ready = None  # CUDA event: grad_acc's copy to the host is done
        self.norm_sq = None  # this step's part of the squared gradient norm, once read


class ChunkStore:
    """Chunks of ``params`` over ``axis`` for ZeRO ``stage`` (0: unsharded buckets); see the module
    docstring. Their gradients: :class:`.reduce.GradReducer`."""

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        layout: ChunkLayout,
        axis: Axis,
        stage: int,
        device: torch.device,
        *,
        param_on_gpu: list[bool],
        optim_on_gpu: list[bool],
        param_dtype: torch.dtype | None = None,
        replica_axes: list[Axis] | None = None,
    ) -> None:
        self.axis, self.stage, self.device, self.layout = axis, stage, device, layout
        self.replica_axes = replica_axes  # per chunk, the axis its parameters are replicated over (sharded over)
        self.param_dtype = param_dtype
        self.host = torch.device("cpu")
        self.pin = device.type == "cuda"
        self.chunks: list[ChunkState] = []
        self.chunk_of: dict[int, ChunkState] = {}  # id(parameter) -> its chunk, and its offset in it:
        self.offsets: dict[int, int] = {}
        for ch in layout.chunks:
            start, shard_size = ch.shard(self._axis_of(ch.index).rank if stage else 0)
            ps = [params[i] for i in ch.params]
            st = ChunkState(
                ch.index, ch.group, ch.size, start, shard_size, ps, [layout.params[i].offset for i in ch.params]
            )
            self.chunks.append(st)
            for p, off in zip(ps, st.offsets):
                self.chunk_of[id(p)] = st
                self.offsets[id(p)] = off
        with torch.no_grad():
            for st in self.chunks:
                self._build(st, param_on_gpu[st.index], optim_on_gpu[st.index])
        # a host master into its bf16 device copy: converted on the host, half the bytes uploaded
        self._staging = PinnedStaging(max((st.shard_size for st in self.chunks), default=0))

    # ------------------------------------------------------------------ set-up
    def _host_tensor(self, n: int) -> torch.Tensor:
        return pinned.zeros(n, torch.float32, self.pin)

    def grad_buffer(self, st: ChunkState) -> torch.Tensor:
        """A zeroed fp32 gradient shard beside the master (page-locked on the host: copied into)."""
        if st.master.device.type == "cpu":
            return self._host_tensor(st.shard_size)
        return torch.zeros(st.shard_size, dtype=torch.float32, device=st.master.device)

    def _build(self, st: ChunkState, param_on_gpu: bool, optim_on_gpu: bool) -> None:
        full = torch.zeros(st.size, dtype=torch.float32, device=self.device)
        for p, off in zip(st.params, st.offsets):
            if p.dtype != torch.float32:
                raise ValueError(
                    f"{'data-parallel buckets' if self.stage == 0 else 'ZeRO chunks'} hold fp32 master parameters; "
                    f"a parameter has dtype {p.dtype}. Keep parameters in fp32 and use Plan(precision='bf16')."
                )
            full[off : off + p.numel()].copy_(p.data.reshape(-1))
            p.data = full[off : off + p.numel()].view(p.shape)  # frees the original (host) storage
            p.grad = None
        comm.broadcast(full, self.replica_axis(st), 0)  # every replica starts from data rank 0's weights
        st.full = full
        if self.param_dtype is not None:  # the model's parameters become low-precision views
            st.full = full.to(self.param_dtype)
            self._point(st)
        self.place(st, param_on_gpu or self.stage < 3, optim_on_gpu, full[st.start : st.start + st.shard_size])
        if self.stage == 3:
            self.release(st)  # (not a chunk that is its own shard)

    def replica_axis(self, st: ChunkState) -> Axis:
        """The axis chunk ``st``'s parameters are replicated over, and at stages 1-3 sharded over: the
        data axis, or the one given for it (``replica_axes``: experts are replicated over ``ep_dp``
        only, so their chunks are gathered and reduced there)."""
        return self._axis_of(st.index)

    def _axis_of(self, index: int) -> Axis:
        return self.axis if self.replica_axes is None else self.replica_axes[index]

    @staticmethod
    def own_slot(st: ChunkState) -> torch.Tensor:
        """This rank's shard-sized slot of ``st.full`` (stages 1-2 all-gather ``full`` in place)."""
        return st.full[st.start : st.start + st.shard_size]

    def _point(self, st: ChunkState) -> None:
        """Make every parameter of ``st`` a view into ``st.full`` (allocated)."""
        for p, off in zip(st.params, st.offsets):
            p.data = st.full[off : off + p.numel()].view(p.shape)

    def place(
        self, st: ChunkState, param_on_gpu: bool, optim_on_gpu: bool, current: torch.Tensor | None = None
    ) -> None:
        """(Re)place the shard: on the device (``param_on_gpu``) and/or as a host master. Only
        before the optimizer has state for it (the engine re-plans after its warm-up step)."""
        if current is None:
            current = st.master if st.master is not None else st.shard
        current = current.detach()
        if optim_on_gpu and not param_on_gpu:
            raise ValueError("optimizer state on the GPU needs the chunk's parameters there too.")
        st.param_on_gpu, st.optim_on_gpu = param_on_gpu, optim_on_gpu
        if self.param_dtype is None and (self.stage < 3 or (self.replica_axis(st).trivial and param_on_gpu)):
            # Gathered in place; on one rank a ZeRO-3 chunk kept on the GPU *is* its shard: nothing to
            # gather or release (one code path, no copies).
            _alloc(st.full)
            st.shard = self.own_slot(st)
            if current.data_ptr() != st.shard.data_ptr():
                st.shard.copy_(current)
            st.resident, st.pending = True, None
        elif param_on_gpu:
            st.shard = current.to(self.device, copy=True)  # ``full`` is freed between uses
        else:
            st.shard = None
        if optim_on_gpu:
            st.master = st.shard
        else:
            st.master = self._host_tensor(st.shard_size)
            st.master.copy_(current)
        if self.param_dtype is not None:  # gathers read a low-precision copy; fp32 on the device only as master
            if self.stage < 3:  # gathered in place: the bf16 shard is this rank's slot of ``full``
                st.low = self.own_slot(st)
                st.low.copy_(current)
            else:
                st.low = current.to(self.device, self.param_dtype, copy=True) if param_on_gpu else None
            st.low_host = None
            if not param_on_gpu:
                st.low_host = pinned.empty(st.shard_size, self.param_dtype, self.pin)
                st.low_host.copy_(current)
            if not optim_on_gpu:
                st.shard = None
        if st.grad_acc is not None and st.grad_acc.device != st.master.device:
            # a re-plan between backward and the optimizer step keeps the gradient
            old, st.grad_acc = st.grad_acc, self.grad_buffer(st)
            st.grad_acc.copy_(old)

    # ------------------------------------------------------------------ gather / release (stage 3)
    def gather(self, st: ChunkState, async_op: bool = False, exact: bool = False) -> None:
        """Make ``st.full`` hold the current parameters (all-gather of the shards). ``exact``: the
        fp32 masters even under ``param_dtype`` (until :meth:`release`)."""
        if exact and self.param_dtype is not None and st.low_full is None:
            self.release(st)
            st.low_full, st.full = st.full, torch.empty(st.size, dtype=torch.float32, device=self.device)
            src = st.shard if st.shard is not None else st.master.to(self.device)
            comm.all_gather_into(st.full, src, self.replica_axis(st))
            self._point(st)
            st.resident = True
            return
        if st.resident:
            return
        if st.pending is not None:
            if not async_op:
                st.pending.wait()
                st.pending = None
                st.resident = True
            return
        _alloc(st.full)
        axis = self.replica_axis(st)
        src = (
            st.low
            if st.low is not None
            else st.low_host
            if st.low_host is not None
            else st.shard
            if st.shard is not None
            else st.master
        )
        if src.device != st.full.device and not axis.trivial:  # one replica: the host's shard is the whole
            src = src.to(self.device, non_blocking=True)  # chunk, copied straight into it (no device copy beside)
        handle = comm.all_gather_into(st.full, src, axis, async_op=async_op)
        if async_op:
            st.pending = handle
        else:
            st.resident = True

    def release(self, st: ChunkState) -> None:
        if st.low_full is not None:  # end of an exact gather: the masters may have been reloaded
            st.full, st.low_full = st.low_full, None
            self._refresh_low(st)
            _alloc(st.full)
            self._point(st)
            if self.stage < 3:  # stages 1-2 keep every chunk gathered: refresh it from the masters
                comm.all_gather_into(st.full, st.low, self.replica_axis(st))
                return
            _free(st.full)
            st.resident = False
            return
        if self.stage < 3 or not st.resident and st.pending is None or self._persistent(st):
            return
        if st.pending is not None:
            st.pending.wait()
            st.pending = None
        _free(st.full)
        st.resident = False

    def _persistent(self, st: ChunkState) -> bool:
        return (
            st.shard is not None and st.shard.data_ptr() == st.full.data_ptr() and st.full.untyped_storage().size() > 0
        )

    def release_all(self) -> None:
        for st in self.chunks:
            self.release(st)

    # ------------------------------------------------------------------ after the optimizer step
    def upload(self, st: ChunkState) -> None:
        """The chunk's updated master into the copies the model reads: its device shard and the
        low-precision gather sources (copies queued on the current stream)."""
        if st.shard is not None and st.master.data_ptr() != st.shard.data_ptr():
            st.shard.copy_(st.master, non_blocking=True)
        self._refresh_low(st)

    def publish(self, uploaded: frozenset[int] = frozenset()) -> None:
        """Make the updated masters visible to the model: upload every chunk but ``uploaded`` (indices
        of chunks the CPU-update worker uploaded), then (stages 1-2) all-gather every chunk in place.
        Nothing at stage 0: the optimizer updated the parameters themselves."""
        if self.stage == 0:
            return
        handles = []
        for st in self.chunks:
            if st.index not in uploaded:
                self.upload(st)
            if self.stage < 3:
                src = st.low if self.param_dtype is not None else st.shard
                handles.append(comm.all_gather_into(st.full, src, self.replica_axis(st), async_op=True))
        for h in handles:
            h.wait()

    def _refresh_low(self, st: ChunkState) -> None:
        """The low-precision gather sources from the (updated or reloaded) fp32 master."""
        src = st.shard if st.shard is not None else st.master
        if st.low is not None and src.device.type == "cpu" and st.low.device.type == "cuda":
            self._staging.upload(st.low, src)
        elif st.low is not None:
            st.low.copy_(src, non_blocking=True)
        if st.low_host is not None:
            st.low_host.copy_(st.master)

    def bytes_on(self, device_type: str) -> dict[str, int]:
        """Parameter and gradient bytes this rank holds on ``device_type`` now (the memory tracer;
        the optimizer adds its state)."""
        out = {"params": 0, "grads": 0, "masters": 0}
        for st in self.chunks:
            if self.device.type == device_type and st.full.untyped_storage().size():
                out["params"] += st.size * st.full.element_size()
            if (
                (self.stage == 3 or self.param_dtype is not None)
                and st.shard is not None
                and st.shard.device.type == device_type
                and not self._persistent(st)
            ):
                out["params"] += st.shard_size * 4
            for low in (st.low if self.stage == 3 else None, st.low_host):  # stages 1-2: a slot of ``full``
                if low is not None and low.device.type == device_type:
                    out["params"] += low.numel() * low.element_size()
            if st.master.device.type == device_type and (
                st.shard is None or st.master.data_ptr() != st.shard.data_ptr()
            ):
                out["masters"] += st.shard_size * 4
            if st.grad_full is not None and self.device.type == device_type:
                out["grads"] += st.size * 4
            aliased = (
                st.grad_full is not None
                and st.grad_acc is not None
                and st.grad_acc.data_ptr() == st.grad_full.data_ptr()
            )
            if st.grad_acc is not None and st.grad_acc.device.type == device_type and not aliased:
                out["grads"] += st.shard_size * 4
        return out

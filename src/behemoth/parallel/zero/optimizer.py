"""The ZeRO optimizer: a standard optimizer over this rank's chunk shards (stages 1-3, offload).

Wraps the user's optimizer class and hyper-parameters (STYLE #7): the rebuilt optimizer's
parameters are the fp32 *master shards* of the chunks, one flat tensor per chunk, in the
chunk's parameter group. Element-wise optimizers (SGD, Adam, AdamW, ...) update a flat shard
exactly as they would update each parameter, so ZeRO changes where the arithmetic happens,
not its result; an optimizer that is not element-wise is refused. At world size 1 without
offload every chunk is one shard on the device and the step is the plain optimizer's.

``step()`` (after the store has reduced the gradients into the shards):

1. fp16: one agreement over the data axis (and tp) whether any shard overflowed, then unscale;
2. the global gradient norm: squared shard norms, each parameter piece weighted 1/(its copies
   over tp), summed over the data axis and tp -- the serial model's norm; clip with it;
3. ``optimizer.step()`` (masters on the host run PyTorch's fused CPU kernel: Adam, AdamW,
   SGD, Adagrad, vectorised, nothing compiled at install time);
4. publish: host masters copied to the device, stages 1-2 all-gather the chunks.

Offloaded chunks may be updated on the host during the backward instead, when the update needs
nothing global first (:mod:`.overlap`); step 3 then updates the remaining masters.

``offload="auto"``: :func:`.placement.static_split` chooses which chunks keep their shard and
optimizer state on the GPU for a budget: ``Plan.offload_budget_gb``, or, when not given, a first
guess (60% of the device) for the warm-up step, whose measured peak of non-model memory then
gives the real budget: before the first optimizer step the chunks are re-placed.
``explain()`` says what was chosen and why.
"""

from __future__ import annotations

import contextlib
import inspect

import torch

from ... import comm
from ...comm import Axis
from ..tensor import get_spec, is_sharded, shard_copies
from .chunks import pack_chunks, search_chunk_size
from .hooks import GatherHooks
from .measure import OtherPeak, cpu_update_rate, host_available, host_bandwidth, memory_report, optimizer_state_bytes
from .overlap import HostUpdate
from .placement import StaticSplit, split_costs, static_split
from .state import load_param_states, param_states, reload_from_params, state_to
from .store import ChunkStore

__all__ = ["ZeroOptimizer", "ELEMENTWISE_OPTIMIZERS"]

ELEMENTWISE_OPTIMIZERS = ("SGD", "Adam", "AdamW", "Adagrad", "Adamax", "NAdam", "RAdam", "RMSprop", "Rprop")
_FUSED_CPU = ("SGD", "Adam", "AdamW", "Adagrad")
_STATE_BYTES = {
    "SGD": 4,
    "Adam": 8,
    "AdamW": 8,
    "Adagrad": 4,
    "Adamax": 8,
    "NAdam": 8,
    "RAdam": 8,
    "RMSprop": 8,
    "Rprop": 8,
}
"""Optimizer-state bytes per element (momentum buffers and moments), for the placement search."""


def _check_optimizer(optimizer: torch.optim.Optimizer, stage: int) -> None:
    name = type(optimizer).__name__
    if name not in ELEMENTWISE_OPTIMIZERS or type(optimizer).__module__.split(".")[:2] != ["torch", "optim"]:
        raise ValueError(
            f"Plan.zero={stage}: ZeRO updates flat shards of several parameters at once, which is exact only "
            f"for element-wise optimizers (torch.optim {', '.join(ELEMENTWISE_OPTIMIZERS)}); got {name} from "
            f"{type(optimizer).__module__}. Use one of those, or zero=0."
        )


class ZeroOptimizer:
    """ZeRO over ``axis`` for the trainable parameters of ``model`` held by ``optimizer``."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        axis: Axis,
        tp: Axis,
        *,
        stage: int,
        offload: str | None,
        device: torch.device,
        chunk_mb: float | None = None,
        budget_bytes: int | None = None,
        prefetch: int = 2,
        world: Axis | None = None,
        param_dtype: torch.dtype | None = None,
        names: dict[int, str] | None = None,
    ) -> None:
        _check_optimizer(optimizer, stage)
        self.names = dict(names) if names is not None else {id(p): n for n, p in model.named_parameters()}
        self.stage, self.offload, self.axis, self.tp, self.device = stage, offload, axis, tp, device
        self.budget_bytes = budget_bytes
        # Device bytes per element of a chunk's parameters: a bf16 copy under param_dtype (its fp32
        # master then counts with the optimizer state), else the fp32 shard that is the master.
        self.param_bytes = 2 if param_dtype is not None and stage == 3 else 4
        self.cls, self.name = type(optimizer), type(optimizer).__name__
        group_of = {id(p): g for g, group in enumerate(optimizer.param_groups) for p in group["params"]}
        params = [p for p in model.parameters() if p.requires_grad]
        for p in params:
            if id(p) not in group_of:
                raise ValueError(
                    f"Plan.zero={stage}: a trainable parameter of shape {tuple(p.shape)} is not in the "
                    f"optimizer; ZeRO shards every trainable parameter. Add it to the optimizer or "
                    f"set requires_grad=False on it before bh.boost."
                )
        self.params = params
        self.hyper = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        accepted = inspect.signature(self.cls.__init__).parameters
        self.defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
        sizes = [p.numel() for p in params]
        groups = [group_of[id(p)] for p in params]
        if chunk_mb is None:  # least padding among 256 sizes from the largest parameter up to 1/32 of the
            # model (or twice the largest): fine enough to place a model between GPU and host, to prefetch
            # and to overlap reductions (GPT-13B: 41 chunks, 0.5% padding)
            lo = max(max(sizes, default=1), 1)
            hi = max(2 * lo, sum(sizes) // 32)
            cands = sorted({lo + (hi - lo) * i // 255 for i in range(256)})
            self.chunk_elems, self.chunk_table = search_chunk_size(sizes, axis.size, groups=groups, candidates=cands)
        else:
            self.chunk_elems, self.chunk_table = max(1, int(chunk_mb * 2**20 // 4)), []
        largest = max(sizes, default=0)
        _raise_everywhere(
            world,
            None
            if self.chunk_elems >= largest
            else ValueError(
                f"Plan.chunk_mb={chunk_mb!r} holds {self.chunk_elems} fp32 elements, but a parameter has {largest} and a "
                f"parameter is never split across chunks: set chunk_mb >= {largest * 4 / 2**20:.4g}, or None to search "
                f"the size with the least padding."
            ),
            "Plan.chunk_mb",
        )
        self.layout = pack_chunks(sizes, self.chunk_elems, axis.size, groups=groups)
        n = self.layout.num_chunks
        largest_shard = 4 * max(c.shard_size for c in self.layout.chunks)
        _raise_everywhere(
            world,
            None
            if not (offload == "auto" and budget_bytes is not None and budget_bytes < largest_shard)
            else ValueError(
                f"Plan.offload_budget_gb={(budget_bytes or 0) / 2**30:.3g} cannot hold the largest chunk's shard "
                f"({largest_shard} bytes), which must be on the GPU while it is used: raise it to >= "
                f"{largest_shard / 2**30:.3g} GiB, or set a smaller chunk_mb."
            ),
            "Plan.offload_budget_gb",
        )
        self.split: StaticSplit | None = None
        self._stage12_split: tuple[int, int, int] | None = None
        self.bandwidth = host_bandwidth(device) if offload == "auto" else 0.0
        self.cpu_rate = cpu_update_rate(self.cls, self.defaults, _FUSED_CPU) if offload == "auto" else 0.0
        self._guess = 0  # the budget an out-of-memory retry halves: the first guess, then the measured one
        if offload == "auto":  # placed once here (no double host allocation), re-placed after warm-up
            self._guess = self._auto_budget(measured=False)
            keep_p, keep_o = self._decide(self._guess)
        else:
            keep_p, keep_o = n, (n if offload is None else 0)
        self._check_host_memory(keep_p, keep_o)
        self.store = ChunkStore(
            params,
            self.layout,
            axis,
            stage,
            device,
            param_on_gpu=[k < keep_p or stage < 3 for k in range(n)],
            optim_on_gpu=[k < keep_o for k in range(n)],
            param_dtype=param_dtype,
        )
        self.hooks = GatherHooks(model, self.store, prefetch) if stage == 3 else None
        self._norm_axes: list[Axis] = [] if tp.trivial else [tp]
        self._norm_skip: set[int] = set()
        self._weights = self._norm_weights() if not tp.trivial else None
        self._warmup = offload == "auto" and budget_bytes is None  # measure, then re-place, at step 1
        # The warm-up step's peak of non-model device memory: read between the gather hooks at
        # stage 3; stages 1-2 have no hooks, so one segment: the step's peak less the model data
        # at its start (gradients counted as other data: on the safe side).
        self._other = None
        self.warmup_other_peak: int | None = None  # set by offload="auto"'s warm-up step
        if self._warmup and device.type == "cuda":
            self._other = OtherPeak(
                lambda: sum(self.store.bytes_on("cuda").values()),
                lambda: torch.cuda.max_memory_allocated(device),
                lambda: torch.cuda.reset_peak_memory_stats(device),
            )
            if self.hooks is not None:
                self.hooks.probe = self._other.sample
        self.oom_retries = 0  # warm-up steps run again with less model data on the device
        self._probation = False  # the first step after the re-placement: retried too, no early update
        self.store.norm_of = self.norm_sq
        self.host_update = HostUpdate(self.store, device, self.cls, self.defaults, self.norm_sq)
        self.optimizer = self._build_optimizer()

    # ------------------------------------------------------------------ set-up
    def _build_optimizer(self) -> torch.optim.Optimizer:
        groups = [{**h, "params": []} for h in self.hyper]
        for st in self.store.chunks:
            groups[st.group]["params"].append(st.master)
        groups = [g for g in groups if g["params"]]
        self._group_index = [i for i, h in enumerate(self.hyper) if any(st.group == i for st in self.store.chunks)]
        host = any(not st.optim_on_gpu for st in self.store.chunks) and self.offload is not None
        if host and self.name in _FUSED_CPU:
            for g in groups:
                if not g.get("foreach"):
                    g["fused"], g["foreach"] = True, False
        return self.cls(groups, **self.defaults)

    def _norm_weights(self) -> list[list[tuple[int, int, float]]]:
        """Per chunk, runs ``(shard offset, length, weight)`` of parameter pieces in this rank's shard,
        weighted 1/(copies of that piece over tp) so a sum over tp counts each element once; a
        parameter counted elsewhere (:meth:`configure_norm`) weighs 0."""
        out = []
        for st in self.store.chunks:
            runs = []
            for sl in self.layout.shard_slices(st.index, self.axis.rank):
                p = self.params[sl.param]
                spec = get_spec(p)
                w = 1.0 / (shard_copies(spec, self.tp.size) if is_sharded(spec) else self.tp.size)
                runs.append((sl.shard_offset, sl.length, 0.0 if id(p) in self._norm_skip else w))
            out.append(runs)
        return out

    def configure_norm(self, extra_axes: list[Axis], skip: list[torch.nn.Parameter]) -> None:
        """The serial model's norm when this rank holds only part of the model: also sum over
        ``extra_axes`` (pipeline stages), and leave out ``skip`` (a tied copy counted elsewhere)."""
        self._norm_axes += [a for a in extra_axes if not a.trivial]
        self._norm_skip = {id(p) for p in skip}
        self._weights = self._norm_weights()

    # ------------------------------------------------------------------ the engine's gradient protocol
    def start_step(self) -> None:
        self.store.start_step()
        if self.hooks is not None:
            self.hooks.new_step()

    def begin(self, sync: bool) -> None:
        self.store.begin(sync)

    # ------------------------------------------------------------------ CPU update during the backward
    def arm_early_update(self, max_grad_norm: float | None, scaler) -> None:
        """Before a step's forward-backward (``engine.step``): let offloaded chunks be updated on the
        host during the backward when the update needs nothing global (:mod:`.overlap`). Not in
        offload='auto''s warm-up step, which re-places the chunks before its update, nor in the step
        after it, which may run again after an out-of-memory error (an update made during the
        failed attempt would then be made twice)."""
        ok = (
            self.offload is not None
            and max_grad_norm is None
            and scaler is None
            and not self._warmup
            and not self._probation
        )
        self.host_update.arm(self.optimizer if ok else None)
        if self._warmup and self._other is not None:
            self._other.start()

    def run(self, forward_backward, max_grad_norm: float | None, scaler) -> float:
        """One step's forward and backward (see :class:`.sync.GradSync`): offloaded chunks may be updated
        on the host while the backward runs; offload='auto''s warm-up step (and the step after its
        re-placement), out of device memory in a single-process job, runs again with half the model
        data on the device (its first guess cannot know the activations)."""
        self.start_step()
        while True:
            self.arm_early_update(max_grad_norm, scaler)
            try:
                return forward_backward()
            except torch.OutOfMemoryError as exc:
                self.wait_early()
                if not self.may_retry():
                    raise self.out_of_memory(exc) from exc
            except BaseException:
                self.wait_early()
                raise
            # out of the except block: the failed attempt's frames (and their tensors) are gone
            self.shrink_for_retry()
            self.start_step()

    def wait_early(self) -> list:
        """Wait for the updates made during this step's backward; the chunks they updated."""
        return self.host_update.wait()

    def may_retry(self) -> bool:
        """After an out-of-memory error in offload='auto''s warm-up step, or in the first step after
        the re-placement it measured for (its budget rests on that measurement): whether the step may
        run again with half the model data on the device. Only in a single-process job (another rank
        would be left inside a collective the failed one never joins), at most 4 times, while halving
        still moves a chunk."""
        single = not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1
        if not ((self._warmup or self._probation) and self.oom_retries < 4 and single):
            return False
        keep_p, keep_o, _ = self._split_for(self._guess // 2)
        return self._moves(keep_p, keep_o)

    def shrink_for_retry(self) -> None:
        """Drop what the failed attempt left (reductions in flight, gradients, gathered chunks), move
        half the device's model data to the host, and measure the next attempt's peak afresh."""
        self.store.abandon()
        self.oom_retries += 1
        self._guess //= 2
        self._place(self._guess)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)

    def out_of_memory(self, exc: BaseException) -> BaseException:
        """The error to raise for a step that ran out of device memory: under offload='auto', one
        that says how much model data the GPU kept and which setting makes room (the placement
        only knows a step's other data once a step has run)."""
        if self.offload != "auto":
            return exc
        kept = sum(v for k, v in self.memory_report()[self.device.type].items() if k != "other") / 2**30
        source = (
            "a first guess for the warm-up step, which measures the rest"
            if self._warmup
            else "Plan.offload_budget_gb"
            if self.budget_bytes is not None
            else "measured in the warm-up step"
        )
        return type(exc)(
            f"{exc}\n\nbehemoth: offload='auto' kept {kept:.2f} GiB of model data on the device ({source}), and this "
            f"step's other data (activations, gathered chunks, the loss) did not fit beside it. Set "
            f"Plan.offload_budget_gb below {kept:.1f} (for example {kept / 2:.1f}) to offload more, or lower the "
            f"micro-batch size, or enable activation_checkpointing."
        )

    @property
    def early_updates(self) -> int:
        """Chunks updated during a backward, in all."""
        return self.host_update.count

    def finish(self) -> None:
        self.store.finish()

    def attach_grads(self) -> None:
        """Nothing to re-attach: ZeRO gradients live in the chunk store."""

    def ensure_grad(self, p: torch.nn.Parameter) -> torch.Tensor:
        return self.store.ensure_grad(p)

    # ------------------------------------------------------------------ the step
    def _masters(self) -> list[torch.Tensor]:
        out = []
        for st in self.store.chunks:
            if st.grad_acc is None:
                st.grad_acc = torch.zeros_like(st.master)
            st.master.grad = st.grad_acc
            out.append(st.master)
        return out

    def grad_norm(self) -> torch.Tensor:
        """The serial model's gradient 2-norm (a collective over the data axis and tp)."""
        sq = torch.zeros(1, dtype=torch.float32, device=self.device)
        for st in self.store.chunks:  # parts read as the reductions landed (store) or by the CPU-update worker
            if st.grad_acc is not None:
                sq += (st.norm_sq if st.norm_sq is not None else self.norm_sq(st, st.grad_acc)).to(self.device)
        comm.all_reduce(sq, self.axis)
        for ax in self._norm_axes:
            comm.all_reduce(sq, ax)
        return sq[0].sqrt()

    def norm_sq(self, st, g: torch.Tensor) -> torch.Tensor:
        """This rank's part of the squared gradient norm in ``g``, chunk ``st``'s gradient shard (0-d,
        on ``g``'s device)."""
        # vector_norm reads the shard once; square().sum() would write a shard-sized temporary
        # (on the host: fresh pages to fault in for every offloaded chunk, every step).
        if self._weights is None:
            return torch.linalg.vector_norm(g).square()
        return sum(
            (torch.linalg.vector_norm(g.narrow(0, off, n)).square() * w for off, n, w in self._weights[st.index]),
            torch.zeros((), device=g.device),
        )

    def _all_finite(self, masters: list[torch.Tensor]) -> bool:
        local = all(bool(torch.isfinite(m.grad).all()) for m in masters)
        finite = comm.all_agree(local, self.axis)  # every rank calls every vote (no short-circuit)
        for ax in self._norm_axes:
            finite = comm.all_agree(finite, ax)
        return finite

    def step(self, max_grad_norm: float | None, scaler=None) -> torch.Tensor | float:
        """Unscale (fp16), clip, update the shards and publish them; returns the grad norm."""
        early = {st.index for st in self.wait_early()}
        self._probation = False  # this step's forward-backward fitted
        if self._warmup:
            self._place_after_warmup()
        masters = self._masters()
        if scaler is not None:
            inv = 1.0 / scaler.scale
            if not scaler.update(self._all_finite(masters)):
                for m in masters:
                    m.grad = None
                return float("inf")
            for dev in {m.device for m in masters}:
                torch._foreach_mul_([m.grad for m in masters if m.device == dev], inv)
            for st in self.store.chunks:  # norms read before the unscaling are stale
                st.norm_sq = None
        norm = self.grad_norm()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grads_with_norm_(masters, max_grad_norm, norm, foreach=True)
        for st in self.store.chunks:
            if st.index in early:  # updated during the backward: the optimizer skips a master without grad
                st.master.grad = None
        self.optimizer.step()
        for m in masters:
            m.grad = None
        self.store.publish(frozenset(early))
        return norm

    # ------------------------------------------------------------------ offload="auto"
    def _auto_budget(self, measured: bool, other_peak: int | None = None) -> int:
        """Bytes of model data (this rank's shards, gradients, optimizer state) the GPU may hold.
        ``measured``: after the warm-up step, from its peak of other data (``other_peak``, read
        by :class:`.measure.OtherPeak`); else a first guess (60% of the device, more when the
        host could not hold the rest). A CPU run has no GPU to fit: its "device" keeps half the
        model data, so the mixed placement runs (and is tested) there too."""
        if self.budget_bytes is not None:
            return self.budget_bytes
        shards = [c.shard_size * 4 for c in self.layout.chunks]
        if self.device.type != "cuda":
            return sum(shards) * (4 + _STATE_BYTES[self.name]) // 8
        free, total = torch.cuda.mem_get_info(self.device)
        if not measured:  # 60% of the device, or more (up to 85%) if the host could not hold the rest
            model = sum(shards) * (8 + _STATE_BYTES[self.name]) // 4  # parameter + gradient + state
            host = self._host_room()
            squeeze = model - int(0.75 * host) if host is not None else 0
            return max(int(total * 0.6), min(int(total * 0.85), squeeze))
        if other_peak is None:  # a warm-up step not measured by OtherPeak (not started through arm_early_update)
            model_now = sum(self.store.bytes_on("cuda").values())
            other_peak = max(0, torch.cuda.max_memory_allocated(self.device) - model_now)
        # 8% of the device and 2 GiB are left for the allocator's fragmentation and the optimizer's
        # temporaries; the warm-up peak of activations and gathered chunks repeats every step.
        return int(total * 0.92) - other_peak - 2 * 2**30

    def _decide(self, budget: int) -> tuple[int, int]:
        """:meth:`_split_for` ``budget``, kept for :meth:`explain`."""
        keep_p, keep_o, why = self._split_for(budget)
        if isinstance(why, StaticSplit):
            self.split = why
        else:
            self._stage12_split = why
        return keep_p, keep_o

    def _moves(self, keep_p: int, keep_o: int) -> bool:
        """Whether keeping ``keep_p`` chunks' parameters and ``keep_o`` chunks' optimizer state on the
        GPU differs from where the chunks are now."""
        chunks = self.store.chunks
        return ([st.param_on_gpu for st in chunks], [st.optim_on_gpu for st in chunks]) != (
            [k < keep_p or self.stage < 3 for k in range(len(chunks))],
            [k < keep_o for k in range(len(chunks))],
        )

    def _split_for(self, budget: int) -> tuple[int, int, StaticSplit | tuple[int, int, int]]:
        """How many chunks (a prefix, in execution order) keep their parameters and how many also their
        optimizer state on the GPU, for ``budget`` bytes (the static split of Elixir), and why."""
        shard_bytes, ratio, host_bytes = split_costs(
            [c.shard_size for c in self.layout.chunks], _STATE_BYTES[self.name], self.param_bytes
        )
        n = len(shard_bytes)
        bw = self.bandwidth or 25e9
        if self.stage == 3:
            host = self._host_room()
            try:
                split = static_split(
                    shard_bytes,
                    ratio,
                    max(budget, max(shard_bytes)),
                    h2d_bandwidth=bw,
                    d2h_bandwidth=bw,
                    host_bytes=host_bytes,
                    cpu_update_bandwidth=self.cpu_rate or None,
                    host_budget_bytes=None if host is None or self.device.type != "cuda" else int(0.9 * host),
                )
            except ValueError as e:
                raise MemoryError(f"Plan(zero=3, offload={self.offload!r}): {e}.") from None
            return split.num_param_chunks, split.num_optim_chunks, split
        # Stages 1-2 keep every chunk's parameters on the device: only the optimizer state is placed.
        opt = [int(b * ratio) for b in shard_bytes]
        keep_o, used = 0, 0
        while keep_o < n and used + opt[keep_o] <= budget:
            used += opt[keep_o]
            keep_o += 1
        return n, keep_o, (keep_o, n, budget)

    def _check_host_memory(self, keep_p: int, keep_o: int) -> None:
        """Offloaded chunks need pinned host memory for the fp32 master, the gradient and the
        optimizer state: refuse, before allocating, a placement the host cannot hold."""
        if self.offload is None or self.device.type != "cuda":
            return
        need = sum(c.shard_size * (8 + _STATE_BYTES[self.name]) for c in self.layout.chunks[keep_o:])
        need += sum(c.shard_size * (4 - self.param_bytes) for c in self.layout.chunks[keep_p:])  # bf16 host copies
        avail = self._host_room()
        if avail is not None and need > 0.9 * avail:
            raise MemoryError(
                f"Plan(zero={self.stage}, offload={self.offload!r}) needs {need / 2**30:.1f} GiB of host memory for the "
                f"offloaded chunks (fp32 master, gradient and {self.name} state, {8 + _STATE_BYTES[self.name]} B per "
                f"element) but this host has {avail / 2**30:.1f} GiB available (per rank: divide by the ranks on a "
                f"host). Use more GPUs (a larger dp shards it further), a smaller model, or a host with more memory."
            )

    def _host_room(self) -> int | None:
        """Host bytes available to offloaded chunks: MemAvailable, plus the parameters still on the
        host (freed as their chunks move to the GPU)."""
        avail = host_available()
        if avail is not None:
            avail += sum(p.numel() * p.element_size() for p in self.params if p.device.type == "cpu")
            if getattr(self, "store", None) is not None:  # re-placing: what we hold on the host is ours to move
                avail += sum(self.store.bytes_on("cpu").values())
                avail += optimizer_state_bytes(self.optimizer, "cpu")
        return avail

    def _place(self, budget: int) -> None:
        """Choose and apply what stays on the GPU; the optimizer is rebuilt over the masters and keeps
        any state it had (moved with its master)."""
        keep_p, keep_o = self._decide(budget)
        chunks = self.store.chunks
        if not self._moves(keep_p, keep_o):
            return
        self._check_host_memory(keep_p, keep_o)
        old_state = {st.index: self.optimizer.state.get(st.master) for st in chunks}
        for k, st in enumerate(chunks):
            self.store.place(st, k < keep_p or self.stage < 3, k < keep_o)
        # The rebuilt optimizer keeps the hyper-parameters set on the old one since bh.boost (the
        # trainer's lr for this very step, a loaded checkpoint's); fused/foreach follow the new placement.
        for i, g in zip(self._group_index, self.optimizer.param_groups):
            self.hyper[i].update({k: v for k, v in g.items() if k not in ("params", "fused", "foreach")})
        self.optimizer = self._build_optimizer()
        for st in chunks:
            if old_state.get(st.index):
                self.optimizer.state[st.master] = {
                    k: state_to(v, st.master.device, self.optimizer) for k, v in old_state[st.index].items()
                }
        if hasattr(torch._C, "_host_emptyCache"):  # freed pinned blocks go back to the OS
            torch._C._host_emptyCache()

    def _place_after_warmup(self) -> None:
        self._warmup = False
        other_peak = self._other.finish() if self._other is not None else None
        self.warmup_other_peak = other_peak
        if self.hooks is not None:
            self.hooks.probe = None
        self._guess = self._auto_budget(measured=True, other_peak=other_peak)  # what a retry halves
        self._place(self._guess)
        self._probation = True

    def explain(self) -> str:
        """What ``offload='auto'`` chose and why (empty before the first step)."""
        if self.split is not None:
            return self.split.explain()
        if self._stage12_split is not None:
            o, n, budget = self._stage12_split
            return (
                f"ZeRO-{self.stage}: parameters stay on the GPU; optimizer state of {o}/{n} chunks kept on the "
                f"GPU within a budget of {budget / 2**30:.2f} GiB, the rest updated on the CPU."
            )
        return ""

    # ------------------------------------------------------------------ state (checkpoints: see .state)
    @contextlib.contextmanager
    def gathered(self, writable: bool = False):
        """Every chunk gathered (stage 3) for the duration, parameters holding the fp32 masters
        (with ``param_dtype``, fp32 copies, at every stage: a checkpoint is never rounded to bf16):
        full_state_dict, checkpoints. ``writable``: what was written into the parameters becomes
        this rank's shards and masters on exit."""
        if self.stage < 3 and self.store.param_dtype is None:
            yield
            if writable:
                reload_from_params(self.store)
            return
        for st in self.store.chunks:
            self.store.gather(st, exact=True)
        try:
            yield
            if writable:
                reload_from_params(self.store)
        finally:
            self.store.release_all()

    def state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        """The optimizer state per parameter name, gathered from the shards (see :mod:`.state`)."""
        return {self.names[id(p)]: st for p, st in param_states(self).items()}

    def load_state_dict(self, state) -> None:
        by_name = {self.names[id(p)]: p for p in self.params}
        load_param_states(self, {by_name[n]: dict(v) for n, v in state.items() if n in by_name})

    def memory_report(self) -> dict[str, dict[str, int]]:
        """Model data (parameters, gradients, masters, optimizer state) per device type, and on the GPU
        the other data: see :func:`memory_report`."""
        return memory_report(self.store.bytes_on, self.optimizer)

    def remove(self) -> None:
        self.store.remove()
        if self.hooks is not None:
            self.hooks.remove()


def _raise_everywhere(world: Axis | None, error: Exception | None, field: str) -> None:
    """Raise ``error`` here and an error on every other rank of ``world`` too (pipeline stages hold
    different parameters, so only some ranks may find a problem): nobody is left waiting."""
    if world is not None and not comm.all_agree(error is None, world) and error is None:
        raise ValueError(
            f"{field}: another rank (a pipeline stage with other parameters) rejected it; its error "
            f"names the value and the fix."
        )
    if error is not None:
        raise error

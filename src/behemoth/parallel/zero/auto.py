"""Where each chunk's shard and optimizer state live, and how ``offload='auto'`` chooses it.

``offload=None`` keeps everything on the device, ``offload='cpu'`` every chunk's fp32 master and
optimizer state on the host. ``offload='auto'``: :func:`.placement.static_split` chooses which
chunks keep their shard and optimizer state on the GPU for a budget -- ``Plan.offload_budget_gb``,
or, when not given, a first guess (60% of the device) for the warm-up step, whose measured peak of
non-model memory (:class:`.measure.OtherPeak`) then gives the real budget: before the first
optimizer step the chunks are re-placed. A warm-up step out of device memory in a single-process
job runs again with half the model data on the device (so may the first step after the
re-placement, whose budget rests on the warm-up's measurement). :meth:`ChunkPlacement.explain`
says what was chosen and why.

:class:`ChunkPlacement` decides; the ZeRO optimizer (:mod:`.optimizer`) moves the chunks. A
decision is ``(keep_p, keep_o)``: chunks ``[0, keep_p)`` keep their parameters on the GPU (stage
3; stages 1-2 keep every chunk's), chunks ``[0, keep_o)`` also their master and optimizer state.

Tested in tests/dist/test_zero.py (the warm-up, its out-of-memory retry and the re-placement on
CPU, where the "device" keeps half the model data) and tests/unit/test_zero_placement.py.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ... import comm
from ...comm import Axis
from .chunks import ChunkLayout
from .measure import OFFLOAD_HOST_SHARE, OtherPeak, cpu_update_rate, host_available, host_bandwidth
from .placement import StaticSplit, chunk_split, explain_split, measured_budget

__all__ = ["ChunkPlacement", "FUSED_CPU", "STATE_BYTES", "raise_everywhere"]

FUSED_CPU = ("SGD", "Adam", "AdamW", "Adagrad")
"""Optimizers with a fused (vectorised) CPU kernel in PyTorch."""
STATE_BYTES = {
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


def raise_everywhere(world: Axis | None, error: Exception | None, field: str) -> None:
    """Raise ``error`` here and an error on every other rank of ``world`` too (pipeline stages hold
    different parameters, so only some ranks may find a problem): nobody is left waiting."""
    if world is not None and not comm.all_agree(error is None, world) and error is None:
        raise ValueError(
            f"{field}: another rank (a pipeline stage with other parameters) rejected it; its error "
            f"names the value and the fix."
        )
    if error is not None:
        raise error


class ChunkPlacement:
    """The GPU/host placement of ``layout``'s chunks (this rank's shards) under ``offload``.

    ``host_held()`` is the host memory the caller's parameters and (once built) chunks and
    optimizer state hold, which a (re-)placement may reuse; ``device_model_bytes()`` the model
    data on the device now (the warm-up's measurement subtracts it)."""

    def __init__(
        self,
        layout: ChunkLayout,
        *,
        stage: int,
        offload: str | None,
        device: torch.device,
        optimizer_cls: type,
        defaults: dict,
        param_bytes: int,
        budget_bytes: int | None,
        host_held: Callable[[], int],
        device_model_bytes: Callable[[], int],
        world: Axis | None = None,
    ) -> None:
        self.layout, self.stage, self.offload, self.device = layout, stage, offload, device
        self.name, self.param_bytes, self.budget_bytes = optimizer_cls.__name__, param_bytes, budget_bytes
        self.host_held, self.device_model_bytes = host_held, device_model_bytes
        largest_shard = 4 * max((c.shard_size for c in layout.chunks), default=0)
        raise_everywhere(
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
        auto = offload == "auto"
        self.split: StaticSplit | None = None
        self._stage12_split: tuple[int, int, int] | None = None
        self.bandwidth = host_bandwidth(device) if auto else 0.0
        self.cpu_rate = cpu_update_rate(optimizer_cls, defaults, FUSED_CPU) if auto else 0.0
        n = layout.num_chunks
        self.guess = 0  # the budget an out-of-memory retry halves: the first guess, then the measured one
        if auto:  # placed once here (no double host allocation), re-placed after warm-up
            self.guess = self._auto_budget(measured=False)
            self.keep = self._decide(self.guess)
        else:
            self.keep = (n, n if offload is None else 0)
        self.check_host_memory(*self.keep)
        self.warmup = auto and budget_bytes is None  # measure, then re-place, at step 1
        # The warm-up step's peak of non-model device memory: read between the gather hooks at
        # stage 3; stages 1-2 have no hooks, so one segment: the step's peak less the model data
        # at its start (gradients counted as other data: on the safe side).
        self.other: OtherPeak | None = None
        if self.warmup and device.type == "cuda":
            self.other = OtherPeak(
                device_model_bytes,
                lambda: torch.cuda.max_memory_allocated(device),
                lambda: torch.cuda.reset_peak_memory_stats(device),
            )
        self.warmup_other_peak: int | None = None  # set by the warm-up step
        self.oom_retries = 0  # warm-up steps run again with less model data on the device
        self.probation = False  # the first step after the re-placement: retried too, no early update

    # ------------------------------------------------------------------ decisions
    def flags(self, keep: tuple[int, int]) -> tuple[list[bool], list[bool]]:
        """Per chunk: parameters on the GPU, master and optimizer state on the GPU."""
        keep_p, keep_o = keep
        n = self.layout.num_chunks
        return [k < keep_p or self.stage < 3 for k in range(n)], [k < keep_o for k in range(n)]

    def _moves(self, keep: tuple[int, int]) -> bool:
        return self.flags(keep) != self.flags(self.keep)

    def _target(self, budget: int) -> tuple[int, int] | None:
        """The placement for ``budget``, or None where it moves nothing; becomes the current one."""
        keep = self._decide(budget)
        if not self._moves(keep):
            return None
        self.check_host_memory(*keep)
        self.keep = keep
        return keep

    def _auto_budget(self, measured: bool, other_peak: int | None = None) -> int:
        """Bytes of model data (this rank's shards, gradients, optimizer state) the GPU may hold.
        ``measured``: after the warm-up step, from its peak of other data (``other_peak``, read
        by :class:`.measure.OtherPeak`); else a first guess (60% of the device, more when the
        host could not hold the rest). A CPU run has no GPU to fit: its "device" keeps half the
        model data, so the mixed placement runs (and is tested) there too."""
        if self.budget_bytes is not None:
            return self.budget_bytes
        shards = [c.shard_size * 4 for c in self.layout.chunks]
        if self.device.type != "cuda":  # stages 1-2: every chunk's parameters, and half the optimizer sides
            return sum(shards) * (4 + STATE_BYTES[self.name]) // 8 + self._resident()
        free, total = torch.cuda.mem_get_info(self.device)
        if not measured:  # 60% of the device, or more (up to 85%) if the host could not hold the rest
            model = sum(shards) * (8 + STATE_BYTES[self.name]) // 4  # parameter + gradient + state
            host = self._host_room()
            squeeze = model - int(0.75 * host) if host is not None else 0
            return max(int(total * 0.6), min(int(total * 0.85), squeeze))
        if other_peak is None:  # a warm-up step not measured by OtherPeak (not started through ``start``)
            other_peak = max(0, torch.cuda.max_memory_allocated(self.device) - self.device_model_bytes())
        # the warm-up peak of activations and gathered chunks repeats every step
        return measured_budget(total, other_peak)

    def _decide(self, budget: int) -> tuple[int, int]:
        """:meth:`_split_for` ``budget``, kept for :meth:`explain`."""
        keep_p, keep_o, why = self._split_for(budget)
        if isinstance(why, StaticSplit):
            self.split = why
        else:
            self._stage12_split = why
        return keep_p, keep_o

    def _split_for(self, budget: int) -> tuple[int, int, StaticSplit | tuple[int, int, int]]:
        """How many chunks (a prefix, in execution order) keep their parameters and how many also their
        optimizer state on the GPU, for ``budget`` bytes (the static split of Elixir), and why
        (:func:`.placement.chunk_split`)."""
        host = self._host_room() if self.stage == 3 else None
        try:
            return chunk_split(
                self.stage,
                [c.shard_size for c in self.layout.chunks],
                STATE_BYTES[self.name],
                self.param_bytes,
                budget,
                bandwidth=self.bandwidth or 25e9,
                cpu_update_bandwidth=self.cpu_rate or None,
                host_budget_bytes=None
                if host is None or self.device.type != "cuda"
                else int(OFFLOAD_HOST_SHARE * host),
                resident_bytes=self._resident(),
            )
        except ValueError as e:
            raise MemoryError(f"Plan(zero=3, offload={self.offload!r}): {e}.") from None

    def _resident(self) -> int:
        """Model data on the device whatever the placement: at stages 1-2 every chunk's whole
        parameters (the budget holds them beside the optimizer state it keeps); none at stage 3."""
        return sum(c.size for c in self.layout.chunks) * self.param_bytes if self.stage < 3 else 0

    def check_host_memory(self, keep_p: int, keep_o: int) -> None:
        """Offloaded chunks need pinned host memory for the fp32 master, the gradient and the
        optimizer state: refuse, before allocating, a placement the host cannot hold."""
        if self.offload is None or self.device.type != "cuda":
            return
        state = STATE_BYTES[self.name]
        need = sum(c.shard_size * (8 + state) for c in self.layout.chunks[keep_o:])
        need += sum(c.shard_size * (4 - self.param_bytes) for c in self.layout.chunks[keep_p:])  # bf16 host copies
        avail = self._host_room()
        if avail is not None and need > OFFLOAD_HOST_SHARE * avail:
            raise MemoryError(
                f"Plan(zero={self.stage}, offload={self.offload!r}) needs {need / 2**30:.1f} GiB of host memory for the "
                f"offloaded chunks (fp32 master, gradient and {self.name} state, {8 + state} B per "
                f"element) but this host has {avail / 2**30:.1f} GiB available (per rank: divide by the ranks on a "
                f"host). Use more GPUs (a larger dp shards it further), a smaller model, or a host with more memory."
            )

    def _host_room(self) -> int | None:
        """Host bytes available to offloaded chunks: MemAvailable, plus what the caller holds on the
        host (parameters freed as their chunks move to the GPU; chunks and state being re-placed)."""
        avail = host_available()
        return None if avail is None else avail + self.host_held()

    # ------------------------------------------------------------------ the warm-up and its retries
    @property
    def may_update_early(self) -> bool:
        """Whether offloaded chunks may be updated during this step's backward: not in the warm-up
        step, which re-places the chunks before its update, nor in the step after it, which may run
        again after an out-of-memory error (an update made during the failed attempt would then be
        made twice)."""
        return not (self.warmup or self.probation)

    def start(self) -> None:
        """Before each attempt of a step's forward-backward: the warm-up measures afresh."""
        if self.warmup and self.other is not None:
            self.other.start()

    def sample(self) -> None:
        """At every gather hook of the warm-up step (ZeRO-3): one segment of the measurement."""
        if self.warmup and self.other is not None:
            self.other.sample()

    def fitted(self) -> tuple[int, int] | None:
        """A step's forward-backward fitted: after the warm-up, the placement its measurement gives
        (None where nothing moves)."""
        self.probation = False
        if not self.warmup:
            return None
        self.warmup = False
        other_peak = self.other.finish() if self.other is not None else None
        self.warmup_other_peak = other_peak
        self.guess = self._auto_budget(measured=True, other_peak=other_peak)  # what a retry halves
        self.probation = True
        return self._target(self.guess)

    def may_retry(self) -> bool:
        """After an out-of-memory error in the warm-up step, or in the first step after the
        re-placement it measured for (its budget rests on that measurement): whether the step may
        run again with half the model data on the device. Only in a single-process job (another rank
        would be left inside a collective the failed one never joins), at most 4 times, while halving
        still moves a chunk."""
        single = not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1
        if not ((self.warmup or self.probation) and self.oom_retries < 4 and single):
            return False
        return self._moves(self._split_for(self.guess // 2)[:2])

    def shrink(self) -> tuple[int, int] | None:
        """The placement for the retry: half the budget."""
        self.oom_retries += 1
        self.guess //= 2
        return self._target(self.guess)

    def out_of_memory(self, exc: BaseException, kept_bytes: int) -> BaseException:
        """The error to raise for a step that ran out of device memory under offload='auto': one that
        says how much model data the GPU kept (``kept_bytes``) and which setting makes room (the
        placement only knows a step's other data once a step has run)."""
        kept = kept_bytes / 2**30
        source = (
            "a first guess for the warm-up step, which measures the rest"
            if self.warmup
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

    def explain(self) -> str:
        """What ``offload='auto'`` chose and why (empty before the first step)."""
        why = self.split if self.split is not None else self._stage12_split
        return "" if why is None else explain_split(self.stage, why)

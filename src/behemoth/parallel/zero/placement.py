"""Placement of chunks between GPU and CPU memory: OPT eviction and Elixir's static split.

Two pure planners (no torch, no devices), both fed by a warm-up step's trace:

* :func:`plan_placement` -- Gemini's dynamic policy with Belady's OPT eviction: replay the
  order chunks are used in one step against a GPU budget; on a miss with a full budget,
  evict the resident chunk whose next use is furthest in the future (never-used-again first).
  For equal-size chunks OPT is optimal in misses (Belady, 1966); for mixed sizes it is the
  standard heuristic. Returns per-access actions and bytes moved, so the runtime can replay
  the plan instead of deciding online.
* :func:`static_split` -- the Elixir pre-run search (Huang et al., 2022, sec. 5): how many
  chunks keep their parameters, and how many also their optimizer state, on the GPU for the
  budget, minimising predicted transfer seconds per step.

Sizes are bytes of what one rank holds (under ZeRO-3, one rank's shards). Transfer times
add host->device and device->host seconds (no duplex overlap assumed: a conservative model).

Tested in tests/unit/test_zero_placement.py.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

__all__ = [
    "Access",
    "PlacementPlan",
    "plan_placement",
    "StaticSplit",
    "static_split",
    "split_costs",
    "chunk_split",
    "explain_split",
    "measured_budget",
]

_NEVER = float("inf")


@dataclass(frozen=True)
class Access:
    """What happens at one access of the trace."""

    step: int
    chunk: int
    hit: bool
    """The chunk was already on the GPU; otherwise it is loaded (host->device)."""
    evict: tuple[int, ...] = ()
    """Chunks evicted (device->host) to make room, before the load."""


@dataclass(frozen=True)
class PlacementPlan:
    actions: tuple[Access, ...]
    h2d_bytes: int
    d2h_bytes: int
    peak_resident_bytes: int
    budget_bytes: int
    resident_at_end: tuple[int, ...]

    @property
    def misses(self) -> int:
        return sum(not a.hit for a in self.actions)

    @property
    def hits(self) -> int:
        return sum(a.hit for a in self.actions)


def _size_of(chunk_bytes: Sequence[int] | Mapping[int, int], c: int) -> int:
    try:
        return chunk_bytes[c]
    except (KeyError, IndexError):
        raise ValueError(
            f"chunk {c} appears in access_order but chunk_bytes has no size for it; "
            f"pass chunk_bytes covering every chunk id in the trace"
        ) from None


def plan_placement(
    access_order: Sequence[int],
    chunk_bytes: Sequence[int] | Mapping[int, int],
    budget_bytes: int,
    *,
    evict_writes_back: bool = True,
    resident: Sequence[int] = (),
) -> PlacementPlan:
    """Replay ``access_order`` under a GPU budget with Belady/OPT eviction.

    ``chunk_bytes`` maps chunk id -> bytes (list or dict). All chunks start on the host,
    except ``resident`` (e.g. the previous step's ``resident_at_end``). Every miss moves the
    chunk host->device; every eviction moves it device->host when ``evict_writes_back``
    (pass False for chunks known clean, e.g. parameters in a forward-only trace).
    Raises ValueError when the budget cannot hold the largest chunk of the trace.
    """
    order = list(access_order)
    used = set(order) | set(resident)
    largest = max((_size_of(chunk_bytes, c) for c in used), default=0)
    if largest > budget_bytes:
        big = max(used, key=lambda c: _size_of(chunk_bytes, c))
        raise ValueError(
            f"budget_bytes={budget_bytes} cannot hold chunk {big} of {largest} bytes; every chunk "
            f"must fit on the GPU when used: raise the budget to >= {largest} bytes, or repack "
            f"with a smaller chunk_size"
        )
    # next_use[i] = index of the next access of order[i]'s chunk after i (inf if none).
    next_use: list[float] = [_NEVER] * len(order)
    last_seen: dict[int, int] = {}
    for i in range(len(order) - 1, -1, -1):
        next_use[i] = last_seen.get(order[i], _NEVER)
        last_seen[order[i]] = i
    nxt: dict[int, float] = {c: last_seen.get(c, _NEVER) for c in resident}  # chunk -> its next use
    load = sum(_size_of(chunk_bytes, c) for c in nxt)
    if load > budget_bytes:
        raise ValueError(
            f"resident chunks {sorted(nxt)} take {load} bytes, over budget_bytes={budget_bytes}; "
            f"pass fewer resident chunks or a larger budget"
        )
    peak, h2d, d2h, actions = load, 0, 0, []
    for i, c in enumerate(order):
        if c in nxt:
            nxt[c] = next_use[i]
            actions.append(Access(i, c, True))
            continue
        size = _size_of(chunk_bytes, c)
        evicted = []
        while load + size > budget_bytes:
            victim = max(nxt, key=lambda r: (nxt[r], r))  # furthest next use; ties: highest id
            del nxt[victim]
            vb = _size_of(chunk_bytes, victim)
            load -= vb
            d2h += vb if evict_writes_back else 0
            evicted.append(victim)
        nxt[c] = next_use[i]
        load += size
        h2d += size
        peak = max(peak, load)
        actions.append(Access(i, c, False, tuple(evicted)))
    return PlacementPlan(tuple(actions), h2d, d2h, peak, budget_bytes, tuple(sorted(nxt)))


@dataclass(frozen=True)
class StaticSplit:
    """The result of :func:`static_split`: chunks ``[0, num_param_chunks)`` keep their parameters
    (and gradients) on the GPU, chunks ``[0, num_optim_chunks)`` also their optimizer state."""

    num_param_chunks: int
    num_optim_chunks: int
    gpu_bytes: int
    """Parameters and optimizer state kept, plus the fetch buffer if anything is offloaded."""
    buffer_bytes: int
    h2d_bytes: int
    """Per step."""
    d2h_bytes: int
    predicted_seconds: float
    budget_bytes: int
    num_chunks: int
    total_param_bytes: int
    total_optim_bytes: int
    h2d_bandwidth: float
    d2h_bandwidth: float
    alternatives: tuple[tuple[int, int, float], ...] = field(default=(), repr=False)
    """``(num_param_chunks, num_optim_chunks, seconds)`` of every feasible choice with the most
    optimizer chunks for its parameter count, for the explanation."""

    def explain(self) -> str:
        """A human-readable account of the choice (what ``behemoth plan --memory`` prints)."""
        gib = 2.0**30
        n, p, o = self.num_chunks, self.num_param_chunks, self.num_optim_chunks
        lines = [
            f"GPU budget for model data: {self.budget_bytes / gib:.2f} GiB; {n} chunks, parameters "
            f"{self.total_param_bytes / gib:.2f} GiB, optimizer state {self.total_optim_bytes / gib:.2f} GiB.",
            f"Kept on GPU: parameters of {p}/{n} chunks, optimizer state of {o}/{n} chunks "
            f"({self.gpu_bytes / gib:.2f} GiB used, fetch buffer {self.buffer_bytes / gib:.2f} GiB).",
        ]
        if p == n and o == n:
            lines.append("Everything fits: nothing is offloaded, no transfer per step, the optimizer runs on GPU.")
        else:
            off = []
            if p < n:
                off.append(
                    f"parameters of {n - p} chunks (fetched host->device for forward and for backward, "
                    f"gradients sent device->host)"
                )
            off.append(f"optimizer state of {n - o} chunks (updated on CPU by CPU Adam)")
            lines.append("Offloaded: " + ", ".join(off) + ".")
            transfer = self.h2d_bytes / self.h2d_bandwidth + self.d2h_bytes / self.d2h_bandwidth
            cpu = self.predicted_seconds - transfer
            lines.append(
                f"Predicted transfer per step: {self.h2d_bytes / gib:.2f} GiB host->device at "
                f"{self.h2d_bandwidth / 1e9:.1f} GB/s + {self.d2h_bytes / gib:.2f} GiB device->host at "
                f"{self.d2h_bandwidth / 1e9:.1f} GB/s = {transfer:.3f} s"
                + (
                    f", plus {cpu:.3f} s of CPU optimizer update: {self.predicted_seconds:.3f} s."
                    if cpu > 1e-9
                    else "."
                )
            )
            lines.append(
                "Why: each chunk kept with its parameters saves 2 fetches and 1 gradient copy; "
                "keeping its optimizer state too saves the gradient copy, the updated-parameter "
                "upload and its CPU update, but costs the optimizer state's bytes."
            )
            chosen = (p, o)
            runner = sorted((a for a in self.alternatives if a[:2] != chosen), key=lambda a: a[2])[:3]
            if runner:
                lines.append(
                    "Next best (param chunks, optim chunks, seconds): "
                    + ", ".join(f"({a}, {b}, {s:.3f})" for a, b, s in runner)
                )
        return "\n".join(lines)


def static_split(
    chunk_bytes: Sequence[int],
    optim_state_bytes: Sequence[int] | float,
    budget_bytes: int,
    *,
    h2d_bandwidth: float,
    d2h_bandwidth: float,
    buffer_chunks: int = 1,
    host_bytes: Sequence[int] | None = None,
    host_budget_bytes: int | None = None,
    cpu_update_bandwidth: float | None = None,
) -> StaticSplit:
    """Choose how many chunks keep parameters, and how many optimizer state, on the GPU.

    ``chunk_bytes[i]``: parameter bytes of chunk ``i`` (gradients have the same size and live
    where the parameters do); ``optim_state_bytes``: per-chunk optimizer-state bytes (master
    weights + moments), or one float, the ratio to ``chunk_bytes`` (e.g. 12 / 2 = 6 for fp32
    master + Adam over bf16 parameters). Bandwidths in bytes/second. Chunks are kept as a prefix
    of the given order; optimizer state only with its parameters (the GPU update needs both).

    Per step, for chunk ``i`` of ``c`` bytes:

    * parameters and optimizer on GPU: nothing moves;
    * parameters on GPU, optimizer on CPU: gradient down (``c`` d2h), updated parameters up (``c`` h2d);
    * both on CPU: parameters up for forward and for backward (``2c`` h2d), gradient down
      (``c`` d2h); the CPU update writes the host copy in place.

    ``seconds = h2d / h2d_bandwidth + d2h / d2h_bandwidth``. If any parameters are offloaded,
    ``buffer_chunks`` times the largest offloaded chunk is reserved to receive fetches.
    Ties go to keeping more on the GPU. Raises ValueError when the budget cannot hold the
    largest chunk (nothing could run).

    ``cpu_update_bandwidth`` (parameter bytes per second the CPU optimizer updates) adds the CPU
    update of every chunk whose optimizer state is offloaded to the predicted seconds (the CPU step
    is not overlapped with the GPU's work).

    ``host_bytes[i]`` (host memory chunk ``i`` needs when its optimizer state is offloaded: master,
    gradient and state) with ``host_budget_bytes``: a choice whose offloaded chunks need more host
    memory than that is infeasible; ValueError if every choice is.
    """
    sizes = list(chunk_bytes)
    n = len(sizes)
    if isinstance(optim_state_bytes, (int, float)) and not isinstance(optim_state_bytes, bool):
        opt = [int(round(s * optim_state_bytes)) for s in sizes]
    else:
        opt = list(optim_state_bytes)
        if len(opt) != n:
            raise ValueError(
                f"optim_state_bytes has {len(opt)} entries for {n} chunks; pass one per chunk "
                f"or a single ratio to chunk_bytes"
            )
    if h2d_bandwidth <= 0 or d2h_bandwidth <= 0:
        raise ValueError(
            f"h2d_bandwidth={h2d_bandwidth}, d2h_bandwidth={d2h_bandwidth}: bandwidths must be "
            f"positive bytes/second (pinned PCIe 4 x16 is ~25e9)"
        )
    largest = max(sizes, default=0)
    if largest > budget_bytes:
        raise ValueError(
            f"budget_bytes={budget_bytes} cannot hold the largest chunk ({largest} bytes); a chunk "
            f"must be on the GPU while used: raise the budget to >= {largest} bytes, or repack with "
            f"a smaller chunk_size"
        )
    # Prefix sums and suffix maxima (largest offloaded chunk when the first p are kept).
    pre_c, pre_o = [0], [0]
    for s, o in zip(sizes, opt):
        pre_c.append(pre_c[-1] + s)
        pre_o.append(pre_o[-1] + o)
    suf_max = [0] * (n + 1)
    for i in range(n - 1, -1, -1):
        suf_max[i] = max(sizes[i], suf_max[i + 1])

    def cost(p: int, o: int) -> tuple[int, int, float]:
        # chunks [0, o): nothing; [o, p): c down + c up; [p, n): 2c up + c down
        mid = pre_c[p] - pre_c[o]
        rest = pre_c[n] - pre_c[p]
        h2d, d2h = mid + 2 * rest, mid + rest
        cpu = (pre_c[n] - pre_c[o]) / cpu_update_bandwidth if cpu_update_bandwidth else 0.0
        return h2d, d2h, h2d / h2d_bandwidth + d2h / d2h_bandwidth + cpu

    best = None
    alternatives = []
    for p in range(n + 1):
        buf = buffer_chunks * suf_max[p]
        room = budget_bytes - buf - pre_c[p]
        if room < 0:
            continue  # with buffer_chunks > 1 a larger p can fit again (its buffer shrinks)
        # Most optimizer chunks that fit: pre_o is non-decreasing, so scan down from p.
        o = p
        while o > 0 and pre_o[o] > room:
            o -= 1
        if host_budget_bytes is not None and host_bytes is not None and sum(host_bytes[o:]) > host_budget_bytes:
            continue  # the host cannot hold what this choice offloads
        h2d, d2h, sec = cost(p, o)
        alternatives.append((p, o, sec))
        key = (sec, -p, -o)
        if best is None or key < best[0]:
            best = (key, p, o, h2d, d2h, sec, buf)
    if best is None and host_budget_bytes is not None and alternatives == []:
        raise ValueError(
            f"no split fits both budgets: the GPU's {budget_bytes} bytes and the host's "
            f"{host_budget_bytes} bytes cannot hold the model data ({pre_c[n] + pre_o[n]} bytes); "
            f"use more devices, a smaller model or more memory"
        )
    if best is None:  # p = 0 needs only the buffer, which the largest-chunk check allows for buffer_chunks=1
        raise ValueError(
            f"budget_bytes={budget_bytes} cannot hold {buffer_chunks} fetch buffers of {largest} "
            f"bytes; raise the budget to >= {buffer_chunks * largest} bytes or pass buffer_chunks=1"
        )
    _, p, o, h2d, d2h, sec, buf = best
    return StaticSplit(
        p,
        o,
        pre_c[p] + pre_o[o] + buf,
        buf,
        h2d,
        d2h,
        sec,
        budget_bytes,
        n,
        pre_c[n],
        pre_o[n],
        h2d_bandwidth,
        d2h_bandwidth,
        tuple(alternatives),
    )


def split_costs(
    shard_sizes: Sequence[int], optim_state_bytes: int, param_bytes: int = 4
) -> tuple[list[int], float, list[int]]:
    """The inputs of :func:`static_split` for chunk shards of ``shard_sizes`` elements:
    ``(device bytes of each chunk's parameters, device bytes of its optimizer side per
    parameter byte, host bytes of an offloaded chunk)``. fp32 parameters (``param_bytes=4``)
    are their own masters: the optimizer side is the gradient and the state. bf16 parameters
    (``param_bytes=2``, ZeRO-3 ``param_dtype``) are a copy: the fp32 master joins the optimizer
    side, and an offloaded chunk keeps a bf16 host copy beside master, gradient and state."""
    if param_bytes not in (2, 4):
        raise ValueError(f"param_bytes={param_bytes!r}: 4 (fp32 parameters) or 2 (bf16 copies).")
    copy = param_bytes != 4
    ratio = (4 + optim_state_bytes + (4 if copy else 0)) / param_bytes
    return (
        [n * param_bytes for n in shard_sizes],
        ratio,
        [n * (8 + optim_state_bytes + (param_bytes if copy else 0)) for n in shard_sizes],
    )


def measured_budget(device_total: int, other_peak: int) -> int:
    """Bytes of model data (shards, gradients, optimizer state) ``offload='auto'`` lets the device
    hold once a warm-up step has measured ``other_peak``, its peak of everything else (activations,
    gathered chunks, the loss): 92% of the device's ``device_total`` less that peak and 2 GiB, the
    8% and the 2 GiB left for the allocator's fragmentation and the optimizer's temporaries. The
    runtime (:class:`.auto.ChunkPlacement`) and the planner read this one rule."""
    return int(device_total * 0.92) - other_peak - 2 * 2**30


def chunk_split(
    stage: int,
    shard_sizes: Sequence[int],
    optim_state_bytes: int,
    param_bytes: int,
    budget_bytes: int,
    *,
    bandwidth: float,
    cpu_update_bandwidth: float | None = None,
    host_budget_bytes: int | None = None,
    resident_bytes: int = 0,
) -> tuple[int, int, StaticSplit | tuple[int, int, int]]:
    """``(keep_p, keep_o, why)`` for chunks of ``shard_sizes`` elements (this rank's shards, in
    execution order) under a device budget of ``budget_bytes`` for model data: chunks ``[0,
    keep_p)`` keep their parameters on the device, ``[0, keep_o)`` also their master and optimizer
    state. Stage 3 places both by :func:`static_split` (``why`` is its result; ValueError where
    nothing fits); stages 1-2 keep every chunk's whole parameters (``resident_bytes`` of the budget)
    and place only the optimizer side, the longest prefix the rest holds (``why``: ``(keep_o,
    chunks, that rest)``). What ``offload='auto'`` runs and the planner predicts with."""
    shard_bytes, ratio, host_bytes = split_costs(shard_sizes, optim_state_bytes, param_bytes)
    n = len(shard_bytes)
    if stage == 3:
        split = static_split(
            shard_bytes,
            ratio,
            max(budget_bytes, max(shard_bytes, default=0)),
            h2d_bandwidth=bandwidth,
            d2h_bandwidth=bandwidth,
            host_bytes=host_bytes,
            cpu_update_bandwidth=cpu_update_bandwidth,
            host_budget_bytes=host_budget_bytes,
        )
        return split.num_param_chunks, split.num_optim_chunks, split
    opt = [int(b * ratio) for b in shard_bytes]
    room = budget_bytes - resident_bytes
    keep_o, used = 0, 0
    while keep_o < n and used + opt[keep_o] <= room:
        used += opt[keep_o]
        keep_o += 1
    return n, keep_o, (keep_o, n, room)


def explain_split(stage: int, why: StaticSplit | tuple[int, int, int]) -> str:
    """What :func:`chunk_split` chose and why, from its ``why``."""
    if isinstance(why, StaticSplit):
        return why.explain()
    o, n, room = why
    return (
        f"ZeRO-{stage}: parameters stay on the GPU; optimizer state of {o}/{n} chunks kept on the "
        f"GPU within the {room / 2**30:.2f} GiB the budget leaves beside them, the rest updated on the CPU."
    )

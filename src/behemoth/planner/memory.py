"""The ZeRO / offload memory plan, as a pure function (what ``behemoth plan --memory`` prints).

Given parameter sizes, the data-parallel degree, the ZeRO stage and the memory of one device
and its host, it runs the same pieces the runtime runs before training -- the chunk-size
search (:func:`~behemoth.parallel.zero.chunks.search_chunk_size`), the per-stage accounting
(:func:`~behemoth.parallel.zero.chunks.zero_memory_bytes`) and, for ``offload='auto'``, the
split of the chunks between GPU and host (:func:`~behemoth.parallel.zero.placement.chunk_split`) -- and says
what it chose and why. No process group, no device: a laptop can plan a cluster's run.

The runtime measures two things this plan has to assume: the activation memory (the warm-up
step's peak; pass ``activation_bytes``) and the host link and CPU-optimizer speeds.

Tested in tests/unit/test_memory_plan.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from ..parallel.zero.chunks import chunk_candidates, least_padding, pack_chunks, search_chunk_size, zero_memory_bytes
from ..parallel.zero.placement import StaticSplit, chunk_split, explain_split

__all__ = ["MemoryPlan", "memory_plan", "packed_layout", "zero_chunk_elements"]

GIB = 2.0**30


@dataclass(frozen=True)
class MemoryPlan:
    chunk_elements: int
    num_chunks: int
    padding_pct: float
    per_stage_gib: dict[int, float]
    """ZeRO stage -> per-rank GiB of fp32 parameters, gradients and optimizer state (no offload)."""
    split: StaticSplit | None
    fits_without_offload: bool
    text: str


def memory_plan(
    param_sizes: Sequence[int],
    *,
    dp: int,
    stage: int,
    gpu_bytes: int,
    host_bytes: int,
    activation_bytes: int = 0,
    optim_state_bytes: int = 8,
    h2d_bandwidth: float = 25e9,
    cpu_update_bandwidth: float = 10e9,
    param_bytes: int = 4,
) -> MemoryPlan:
    """Plan ZeRO ``stage`` at ``dp`` ranks for a model of ``param_sizes`` on devices of
    ``gpu_bytes`` with ``host_bytes`` per rank. ``optim_state_bytes`` per element (AdamW: 8);
    ``param_bytes`` 2 for bf16 parameter copies (``Plan.param_dtype='bf16'``): the parameters count 2
    bytes per element and their fp32 masters, sharded from stage 1, 4 more."""
    if stage not in (1, 2, 3):
        raise ValueError(f"stage={stage!r}: plan ZeRO stage 1, 2 or 3.")
    if dp < 1:
        raise ValueError(f"dp={dp!r}: must be >= 1.")
    sizes = tuple(param_sizes)
    chunk = zero_chunk_elements(sizes, dp)
    layout = packed_layout(sizes, chunk, dp)
    masters = 4 if param_bytes != 4 else 0  # fp32 parameters are their own masters
    per_stage = {
        s: zero_memory_bytes(
            layout, s, param_bytes=param_bytes, grad_bytes=4, master_bytes=masters, optim_state_bytes=optim_state_bytes
        ).total
        / GIB
        for s in (0, 1, 2, 3)
    }
    room = gpu_bytes - activation_bytes
    fits = per_stage[stage] * GIB <= room
    lines = [
        f"{sum(sizes):,} parameters in {layout.num_chunks} chunks of {chunk / 1e6:.1f}M elements "
        f"({100 * layout.padding_fraction:.2f}% padding), dp={dp}.",
        "Per-rank model data ("
        + ("bf16 parameters + fp32 masters" if masters else "fp32 parameters")
        + " + fp32 gradients + optimizer state): "
        + ", ".join(f"zero={s}: {g:.1f} GiB" for s, g in per_stage.items())
        + ".",
        f"GPU {gpu_bytes / GIB:.1f} GiB - activations {activation_bytes / GIB:.1f} GiB = {room / GIB:.1f} GiB "
        f"for model data; host {host_bytes / GIB:.1f} GiB.",
    ]
    split = None
    if fits:
        lines.append(
            f"zero={stage} fits on the GPU: offload='auto' keeps everything there (no transfer, GPU optimizer)."
        )
    else:
        try:
            _, _, why = chunk_split(
                stage,
                [c.shard_size for c in layout.chunks],
                optim_state_bytes,
                param_bytes,
                max(room, 0),
                bandwidth=h2d_bandwidth,
                cpu_update_bandwidth=cpu_update_bandwidth,
                host_budget_bytes=int(0.9 * host_bytes),
                resident_bytes=sum(c.size for c in layout.chunks) * param_bytes if stage < 3 else 0,
            )
            split = why if isinstance(why, StaticSplit) else None
            lines.append(f"zero={stage} does not fit on the GPU; with offload='auto':")
            lines.append(explain_split(stage, why))
        except ValueError as e:
            lines.append(f"Does not fit even with offload: {e}.")
    return MemoryPlan(chunk, layout.num_chunks, 100 * layout.padding_fraction, per_stage, split, fits, "\n".join(lines))


@lru_cache(maxsize=1024)
def packed_layout(param_sizes: tuple[int, ...], chunk: int, dp: int):
    """:func:`~behemoth.parallel.zero.chunks.pack_chunks`, packed once per model, chunk size and
    dp (a search asks again for every layout that shares them)."""
    return pack_chunks(param_sizes, chunk, dp)


@lru_cache(maxsize=1024)
def zero_chunk_elements(param_sizes: tuple[int, ...], dp: int) -> int:
    """The chunk size (elements) ZeRO picks for parameters of ``param_sizes`` sharded over ``dp``
    ranks when ``Plan.chunk_mb`` is None: the least padding among
    :func:`~behemoth.parallel.zero.chunks.chunk_candidates` (``ZeroOptimizer._pack`` in
    ``parallel/zero/optimizer.py``)."""
    cands = chunk_candidates(param_sizes)
    if not param_sizes or min(param_sizes) < 0 or dp < 1:  # search_chunk_size's checks and errors
        return search_chunk_size(list(param_sizes), dp, candidates=cands)[0]
    return least_padding(param_sizes, (0,) * len(param_sizes), {0: dp}, cands)[0]

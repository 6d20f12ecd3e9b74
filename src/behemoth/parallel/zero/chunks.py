"""Chunk packing for ZeRO: parameters in fixed-size chunks, chunks in data-parallel shards.

Implements the chunk layout of Colossal-AI's Gemini / the Elixir paper (Huang et al., 2022):
parameters, in execution order, are packed greedily into fixed-size chunks so a chunk can be
gathered, reduce-scattered, moved between GPU and CPU and evicted as one contiguous buffer.
Pure functions of ints (no torch, no process group; numpy counts the search's candidates at once):

* :func:`pack_chunks` -- the layout: per parameter its chunk and offset, per chunk its size,
  used elements and padding, per rank its shard ``(offset, length)`` of every chunk;
* :func:`pack_buckets` -- the layout of plain data parallelism (ZeRO stage 0): unsharded chunks
  of about a bucket size each, exactly as large as their parameters (no padding);
* :func:`search_chunk_size` -- the pre-run search: the chunk size with the least padding
  (:func:`least_padding`: the search itself, every candidate at once; :func:`chunk_candidates`:
  the sizes ``ZeroOptimizer`` searches);
* :func:`zero_memory_bytes` -- per-rank bytes of parameters, gradients, master weights and
  optimizer state under ZeRO stage 0-3, padding included.

Rules of the layout:

* a parameter is never split across chunks; one larger than the chunk size is an error;
* packing is next-fit in execution order within each group: a parameter goes into its group's
  open chunk if it fits, else opens a new chunk. Chunks are numbered in the order they are
  opened, so chunk order follows first use (what prefetching and eviction want);
* a group is a process-group class (e.g. dense parameters vs MoE experts, which Elixir shards
  over a different group than ZeRO-3 does in DeepSpeed). Chunks never mix groups and each
  group has its own data-parallel size ``dp[g]``; the group's chunk size is the requested size
  rounded *up* to a multiple of ``dp[g]`` so every chunk splits into ``dp[g]`` equal shards;
* rank ``r`` of group ``g`` owns elements ``[r * size / dp, (r + 1) * size / dp)`` of each of
  the group's chunks (the layout of ``reduce_scatter_tensor`` / ``all_gather_into_tensor``).

Tested in tests/unit/test_zero_chunks.py.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

__all__ = [
    "Chunk",
    "ParamSlot",
    "ShardSlice",
    "ChunkLayout",
    "pack_buckets",
    "pack_chunks",
    "search_chunk_size",
    "least_padding",
    "chunk_candidates",
    "ChunkSizeRow",
    "ZeroMemory",
    "zero_memory_bytes",
    "round_up",
]

DEFAULT_MIN_CHUNKS = 4
"""Default search keeps chunks small enough that the model spans at least this many chunks
(one chunk for the whole model would have no padding but nothing to prefetch or evict)."""


def round_up(n: int, multiple: int) -> int:
    """The least multiple of ``multiple`` that is ``>= n``."""
    return -(-n // multiple) * multiple


@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter lives: ``chunk``'s elements ``[offset, offset + numel)``."""

    chunk: int
    offset: int
    numel: int


@dataclass(frozen=True)
class ShardSlice:
    """The part of one parameter inside one rank's shard of a chunk."""

    param: int
    """Parameter index (execution order)."""
    param_offset: int
    """First element of the parameter (flattened) that lies in the shard."""
    shard_offset: int
    """Where that element sits inside the shard."""
    length: int


@dataclass(frozen=True)
class Chunk:
    """One fixed-size buffer of one group's parameters."""

    index: int
    group: int
    size: int
    """Elements, a multiple of ``dp``."""
    dp: int
    """Data-parallel size of the group: the chunk is split into this many shards."""
    params: tuple[int, ...]
    """Parameter indices in the chunk, in execution order (= offset order)."""
    used: int
    """Elements holding parameters; the rest is padding at the end."""

    @property
    def padding(self) -> int:
        return self.size - self.used

    @property
    def shard_size(self) -> int:
        return self.size // self.dp

    def shard(self, rank: int) -> tuple[int, int]:
        """``(offset, length)`` of ``rank``'s shard of this chunk."""
        if not 0 <= rank < self.dp:
            raise ValueError(
                f"rank {rank} is outside group {self.group}'s dp size {self.dp}; pass a rank in [0, {self.dp})"
            )
        return rank * self.shard_size, self.shard_size


@dataclass(frozen=True)
class ChunkLayout:
    """The result of :func:`pack_chunks`."""

    chunks: tuple[Chunk, ...]
    params: tuple[ParamSlot, ...]
    """One slot per parameter, in the order the sizes were given."""
    chunk_size: int
    """The requested chunk size (before rounding to each group's dp)."""
    dp: Mapping[int, int]
    """Data-parallel size of each group."""
    groups: tuple[int, ...]
    """Group of each parameter."""

    @property
    def num_chunks(self) -> int:
        return len(self.chunks)

    @property
    def param_elements(self) -> int:
        return sum(p.numel for p in self.params)

    @property
    def total_elements(self) -> int:
        """Elements of all chunks, padding included."""
        return sum(c.size for c in self.chunks)

    @property
    def padding_elements(self) -> int:
        return sum(c.padding for c in self.chunks)

    @property
    def padding_fraction(self) -> float:
        """Padding elements / chunk elements (0.0 for an empty layout)."""
        total = self.total_elements
        return self.padding_elements / total if total else 0.0

    def group_chunks(self, group: int) -> tuple[Chunk, ...]:
        return tuple(c for c in self.chunks if c.group == group)

    def shard_range(self, chunk: int, rank: int) -> tuple[int, int]:
        """``(offset, length)`` of ``rank``'s shard of chunk ``chunk``."""
        return self.chunks[chunk].shard(rank)

    def rank_elements(self, rank: int, group: int) -> int:
        """Elements rank ``rank`` of ``group`` owns over all the group's chunks (padding included)."""
        return sum(c.shard(rank)[1] for c in self.group_chunks(group))

    def shard_slices(self, chunk: int, rank: int) -> tuple[ShardSlice, ...]:
        """The parameter pieces inside ``rank``'s shard of ``chunk`` (what its optimizer updates).

        Padding is not listed; a parameter that straddles a shard boundary appears in both shards.
        """
        c = self.chunks[chunk]
        lo, n = c.shard(rank)
        hi = lo + n
        out = []
        for p in c.params:
            slot = self.params[p]
            start, end = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
            if start < end:
                out.append(ShardSlice(p, start - slot.offset, start - lo, end - start))
        return tuple(out)


def _resolve_dp(dp: int | Mapping[int, int], groups: Sequence[int]) -> dict[int, int]:
    names = sorted(set(groups))
    if isinstance(dp, Mapping):
        missing = [g for g in names if g not in dp]
        if missing:
            raise ValueError(
                f"dp={dict(dp)} has no size for group(s) {missing}; every group in `groups` "
                f"needs one: pass dp={{group: size, ...}} covering {names}"
            )
        sizes = {g: dp[g] for g in names}
    else:
        sizes = {g: dp for g in names}
    for g, d in sizes.items():
        if not isinstance(d, int) or isinstance(d, bool) or d < 1:
            raise ValueError(f"dp={d!r} for group {g} is not a positive int; pass the group's data-parallel size")
    return sizes


def pack_chunks(
    param_sizes: Sequence[int], chunk_size: int, dp: int | Mapping[int, int], *, groups: Sequence[int] | None = None
) -> ChunkLayout:
    """Pack parameters (numel, in execution order) into chunks of ``chunk_size`` elements.

    ``dp`` is the data-parallel size, or a dict ``group -> size`` when ``groups`` (one int per
    parameter) puts parameters in different process-group classes. Each group's chunks have
    ``round_up(chunk_size, dp[g])`` elements. Raises ValueError, naming the parameter and the
    smallest chunk size that works, when a parameter does not fit in one chunk.
    """
    sizes = list(param_sizes)
    for i, n in enumerate(sizes):
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"param_sizes[{i}]={n!r} is not a non-negative int; pass each parameter's numel")
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size!r} must be a positive int (elements per chunk)")
    grp = [0] * len(sizes) if groups is None else list(groups)
    if len(grp) != len(sizes):
        raise ValueError(
            f"groups has {len(grp)} entries but param_sizes has {len(sizes)}; pass one group per parameter"
        )
    dps = _resolve_dp(dp, grp if (grp or isinstance(dp, Mapping)) else [0])
    group_size = {g: round_up(chunk_size, d) for g, d in dps.items()}

    for i, (n, g) in enumerate(zip(sizes, grp)):
        if n > group_size[g]:
            need = round_up(max(m for m, h in zip(sizes, grp) if h == g), dps[g])
            raise ValueError(
                f"parameter {i} has {n} elements, more than chunk_size={chunk_size} (rounded to "
                f"{group_size[g]} for group {g}, dp={dps[g]}); a parameter is never split across chunks: "
                f"pass chunk_size >= {need} (the largest parameter of group {g} rounded up to dp)"
            )

    chunks: list[dict] = []
    open_chunk: dict[int, int] = {}
    slots: list[ParamSlot] = []
    for i, (n, g) in enumerate(zip(sizes, grp)):
        c = open_chunk.get(g)
        if c is None or chunks[c]["used"] + n > group_size[g]:
            c = len(chunks)
            chunks.append({"group": g, "params": [], "used": 0})
            open_chunk[g] = c
        slots.append(ParamSlot(c, chunks[c]["used"], n))
        chunks[c]["params"].append(i)
        chunks[c]["used"] += n
    out = tuple(
        Chunk(k, c["group"], group_size[c["group"]], dps[c["group"]], tuple(c["params"]), c["used"])
        for k, c in enumerate(chunks)
    )
    return ChunkLayout(out, tuple(slots), chunk_size, dict(dps), tuple(grp))


def pack_buckets(param_sizes: Sequence[int], bucket_size: int, kinds: Sequence[int] | None = None) -> ChunkLayout:
    """The chunks of plain data parallelism: parameters (numel, in execution order) in unsharded
    chunks (``dp=1``) that all-reduce as one bucket each. Packed from the *last* parameter back
    (the order backward produces gradients, as DDP packs its buckets): a chunk is closed when the
    next parameter would take it past ``bucket_size`` elements; a parameter larger than that gets a
    chunk of its own. Each chunk is exactly as large as its parameters (no padding). Chunks are
    numbered in execution order, so the chunk reduced first is the last one. ``kinds`` (one int per
    parameter) keeps parameters of different kinds in different chunks (a chunk is also closed where
    the kind changes): experts, reduced over another axis than the dense parameters."""
    sizes = list(param_sizes)
    for i, n in enumerate(sizes):
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"param_sizes[{i}]={n!r} is not a non-negative int; pass each parameter's numel")
    if not isinstance(bucket_size, int) or bucket_size < 1:
        raise ValueError(f"bucket_size={bucket_size!r} must be a positive int (elements per bucket)")
    groups: list[list[int]] = []
    used = 0
    for i in reversed(range(len(sizes))):
        new_kind = kinds is not None and groups and groups[-1] and kinds[i] != kinds[groups[-1][-1]]
        if not groups or (groups[-1] and used + sizes[i] > bucket_size) or new_kind:
            groups.append([])
            used = 0
        groups[-1].append(i)
        used += sizes[i]
    chunks, slots = [], [ParamSlot(0, 0, 0)] * len(sizes)
    for k, members in enumerate(reversed(groups)):
        members.reverse()
        off = 0
        for i in members:
            slots[i] = ParamSlot(k, off, sizes[i])
            off += sizes[i]
        chunks.append(Chunk(k, 0, off, 1, tuple(members), off))
    return ChunkLayout(tuple(chunks), tuple(slots), bucket_size, {0: 1}, (0,) * len(sizes))


@dataclass(frozen=True)
class ChunkSizeRow:
    """One candidate of :func:`search_chunk_size`."""

    size: int
    """The requested chunk size (groups round it up to their dp)."""
    num_chunks: int
    padding_elements: int
    padding_pct: float


def search_chunk_size(
    param_sizes: Sequence[int],
    dp: int | Mapping[int, int],
    *,
    groups: Sequence[int] | None = None,
    candidates: Sequence[int] | None = None,
    min_size: int | None = None,
    max_size: int | None = None,
) -> tuple[int, list[ChunkSizeRow]]:
    """Pick the chunk size with the least padding waste; ties go to the larger size (fewer collectives).

    Candidates default to the powers of two and the multiples of the largest parameter in
    ``[min_size, max_size]``; ``min_size`` defaults to the largest parameter (no smaller size
    is valid), ``max_size`` to ``total / DEFAULT_MIN_CHUNKS`` (so the model spans several chunks
    to prefetch and evict). Candidates below the largest parameter are skipped. Returns
    ``(best_size, table)``, the table sorted by size.
    """
    sizes = list(param_sizes)
    if not sizes:
        raise ValueError("param_sizes is empty; pass the numel of every parameter")
    largest = max(sizes)
    lo = max(largest, 1) if min_size is None else max(min_size, largest, 1)
    hi = max(lo, sum(sizes) // DEFAULT_MIN_CHUNKS) if max_size is None else max_size
    if hi < lo:
        raise ValueError(
            f"max_size={max_size} is below the smallest valid chunk size {lo} (the largest "
            f"parameter, or min_size); pass max_size >= {lo}"
        )
    if candidates is None:
        cand = {lo, hi}
        p = 1 << max(lo - 1, 0).bit_length()
        while p <= hi:
            cand.add(p)
            p <<= 1
        first = max(1, -(-lo // max(largest, 1)))
        for k in range(first, first + 64):  # at most 64 multiples: the table stays readable
            if not largest or k * largest > hi:
                break
            cand.add(k * largest)
    else:
        cand = {c for c in candidates if c >= max(largest, 1)}
        if not cand:
            raise ValueError(
                f"no candidate in {list(candidates)} holds the largest parameter ({largest} "
                f"elements); pass candidates >= {largest}"
            )
    grp = [0] * len(sizes) if groups is None else list(groups)
    pack_chunks(sizes, min(cand), dp, groups=groups)  # the arguments' checks, once
    dps = _resolve_dp(dp, grp if (grp or isinstance(dp, Mapping)) else [0])
    cand = sorted(cand)
    best, num_chunks, elements = least_padding(sizes, grp, dps, cand)
    params = sum(sizes)
    table = [
        ChunkSizeRow(size, n, total - params, 100.0 * (total - params) / total if total else 0.0)
        for size, n, total in zip(cand, num_chunks.tolist(), elements.tolist())
    ]
    return best, table


def least_padding(
    param_sizes: Sequence[int], groups: Sequence[int], dp: Mapping[int, int], candidates: Sequence[int]
) -> tuple[int, np.ndarray, np.ndarray]:
    """The search of :func:`search_chunk_size` without its checks, every candidate at once: ``(best,
    chunks, elements)``, per candidate the number of chunks and their elements (padding included) of
    :func:`pack_chunks`'s layout, counted without building it, and the candidate with the least
    padding, ties to the larger. The caller guarantees what :func:`search_chunk_size` checks:
    non-negative sizes, a size in ``dp`` for every group in ``groups`` (one per parameter), every
    candidate at least the largest parameter.

    Groups pack apart, so each group is counted alone: over its parameters' prefix sums, a chunk
    that opens at parameter ``i`` takes every parameter up to the last ``j`` with
    ``prefix[j] - prefix[i] <= cap`` (next fit: the first that does not fit opens the next chunk),
    one ``searchsorted`` for all candidates per chunk opened."""
    cands = np.asarray(candidates, dtype=np.int64)
    chunks, elements = np.zeros_like(cands), np.zeros_like(cands)
    for g, d in dp.items():
        prefix = np.cumsum([0] + [n for n, k in zip(param_sizes, groups) if k == g], dtype=np.int64)
        cap = -(-cands // d) * d  # the group's chunk size: the candidate rounded up to its shard count
        end, start = len(prefix) - 1, np.zeros_like(cands)  # start: the parameters before the open chunk
        count = np.zeros_like(cands)
        while True:
            opened = start < end
            if not opened.any():
                break
            count += opened
            nxt = np.searchsorted(prefix, prefix[start] + cap, side="right") - 1
            if (opened & (nxt <= start)).any():  # a parameter over a candidate: it would never advance
                raise ValueError(f"least_padding: a candidate chunk size is below a parameter of group {g}")
            start = nxt
        chunks += count
        elements += count * cap
    return int(cands[np.lexsort((-cands, elements))[0]]), chunks, elements


def chunk_candidates(param_sizes: Sequence[int]) -> list[int]:
    """The sizes ``ZeroOptimizer`` searches when ``Plan.chunk_mb`` is None: 256 from the largest
    parameter up to 1/32 of the model (or twice the largest), sorted, without repeats."""
    lo = max(max(param_sizes, default=1), 1)
    hi = max(2 * lo, sum(param_sizes) // 32)
    return sorted({lo + (hi - lo) * i // 255 for i in range(256)})


@dataclass(frozen=True)
class ZeroMemory:
    """Per-rank bytes of model data under one ZeRO stage (padding included)."""

    params: int
    grads: int
    master: int
    optim_states: int
    padding: int
    """Of the total, the bytes that hold chunk padding."""

    @property
    def total(self) -> int:
        return self.params + self.grads + self.master + self.optim_states


def zero_memory_bytes(
    layout: ChunkLayout,
    stage: int,
    dp: int | Mapping[int, int] | None = None,
    *,
    param_bytes: int = 2,
    grad_bytes: int = 2,
    master_bytes: int = 4,
    optim_state_bytes: int = 8,
) -> ZeroMemory:
    """Per-rank model-data bytes under ZeRO ``stage`` for ``layout`` (every rank holds the same bytes).

    Every quantity is stored in chunks, so counts are padded chunk elements ``E_g`` per group.
    With ``s_g = E_g / dp_g`` (one rank's shard):
    params ``= param_bytes * (s_g if stage == 3 else E_g)``;
    grads ``= grad_bytes * (s_g if stage >= 2 else E_g)``;
    master ``= master_bytes * (s_g if stage >= 1 else E_g)``, optimizer state likewise with
    ``optim_state_bytes`` (8 = Adam's two fp32 moments). Summed over groups. ``dp``, if given,
    must match the layout's (the shards are fixed when packing).
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(
            f"stage={stage!r} is not a ZeRO stage; pass 0 (replicated), 1 (optimizer state), "
            f"2 (+ gradients) or 3 (+ parameters)"
        )
    if dp is not None:
        want = _resolve_dp(dp, list(layout.dp))
        if want != dict(layout.dp):
            raise ValueError(
                f"dp={dp!r} does not match the layout's dp={dict(layout.dp)}; shards are fixed by "
                f"pack_chunks: repack with the dp you want, or pass dp=None"
            )
    tot = {"params": 0, "grads": 0, "master": 0, "optim_states": 0, "padding": 0}
    for g, d in layout.dp.items():
        cs = layout.group_chunks(g)
        full = sum(c.size for c in cs)
        pad = sum(c.padding for c in cs)
        shard = full // d
        # Padding sits at each chunk's end, i.e. in its last shards: charge the worst rank's share.
        shard_pad = sum(min(c.padding, c.shard_size) for c in cs)
        for key, nbytes, sharded in (
            ("params", param_bytes, stage >= 3),
            ("grads", grad_bytes, stage >= 2),
            ("master", master_bytes, stage >= 1),
            ("optim_states", optim_state_bytes, stage >= 1),
        ):
            tot[key] += nbytes * (shard if sharded else full)
            tot["padding"] += nbytes * (shard_pad if sharded else pad)
    return ZeroMemory(**tot)

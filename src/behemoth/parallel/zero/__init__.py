"""Data parallelism and ZeRO (stages 0-3) with chunked, heterogeneous (GPU + CPU) memory, after
Gemini / Elixir. Plain data parallelism is stage 0: the same chunks, all-reduced.

* :mod:`.sync` -- the gradient-sync protocol every engine drives, and its factory;
* :mod:`.optimizer` -- the step over this rank's chunks (vote, norm, clip, update, publish);
* :mod:`.norm` -- the serial model's gradient norm from this rank's chunk shards;
* :mod:`.auto` -- where chunks live, and how ``offload='auto'`` chooses it (warm-up, retries);
* :mod:`.store` -- the chunks' buffers, gradient hooks and reductions; :mod:`.hooks` -- ZeRO-3's
  gather/release module hooks; :mod:`.overlap` -- the CPU update during the backward;
* pure foundations, re-exported here: :mod:`.chunks` (packing, chunk-size search, memory
  accounting) and :mod:`.placement` (OPT eviction, the static GPU/CPU split).
"""

from behemoth.parallel.zero.chunks import (
    Chunk,
    ChunkLayout,
    ChunkSizeRow,
    ParamSlot,
    ShardSlice,
    ZeroMemory,
    pack_chunks,
    search_chunk_size,
    zero_memory_bytes,
)
from behemoth.parallel.zero.placement import Access, PlacementPlan, StaticSplit, plan_placement, static_split

__all__ = [
    "Chunk",
    "ChunkLayout",
    "ChunkSizeRow",
    "ParamSlot",
    "ShardSlice",
    "ZeroMemory",
    "pack_chunks",
    "search_chunk_size",
    "zero_memory_bytes",
    "Access",
    "PlacementPlan",
    "StaticSplit",
    "plan_placement",
    "static_split",
]

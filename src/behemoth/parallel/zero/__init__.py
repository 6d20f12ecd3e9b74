"""ZeRO (stages 1-3) with chunked, heterogeneous (GPU + CPU) memory, after Gemini / Elixir.

Pure foundations so far: :mod:`.chunks` (packing, chunk-size search, memory accounting) and
:mod:`.placement` (OPT eviction, the static GPU/CPU split). The runtime builds on them.
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

"""The KV cache's size per rank under each tensor-parallel mode: pure arithmetic (no torch), read
by :mod:`.cache` and by the planner's generation model.

Tested in tests/dist/test_generate.py (bytes per rank against the allocated cache).
"""

from __future__ import annotations

import math

__all__ = ["kv_cache_bytes"]


def kv_cache_bytes(
    *,
    num_layers: int,
    rows: int,
    num_kv_heads: int,
    head_dim: int,
    length: int,
    dtype_bytes: int,
    tp: int = 1,
    tp_mode: str = "1d",
    tp_depth: int = 1,
) -> int:
    """K/V bytes per rank: ``2 * layers * b * K_local * L * D * bytes``, with ``rows`` = b the
    rows this rank's attention holds (the tp group's rows divided by the batch split: 1 in 1D,
    ``q * depth`` in 2D / 2.5D, ``q**2`` in 3D) and ``K_local`` the kv heads it holds: 1D
    ``K / tp`` (1 when K < tp: a replicated kv head), 2D / 2.5D ``K / q`` with ``q**2 * depth = tp``,
    3D ``K / q`` with ``q**3 = tp``."""
    if tp_mode == "1d" or tp == 1:
        k_local = num_kv_heads // tp if num_kv_heads >= tp else 1
    elif tp_mode in ("2d", "2.5d"):
        q = math.isqrt(tp // tp_depth)
        k_local = num_kv_heads // q if num_kv_heads >= q else 1
    elif tp_mode == "3d":
        q = round(tp ** (1 / 3))
        k_local = num_kv_heads // q
    else:
        raise ValueError(f"tp_mode={tp_mode!r}: must be '1d', '2d', '2.5d' or '3d'.")
    return 2 * num_layers * rows * k_local * length * head_dim * dtype_bytes

"""Per-rank communication volume of tensor parallelism, for a model and a batch.

Pure functions of shapes (no torch, no process group): the formulas ``tests/dist`` checks
the comm ledger against and the planner's cost model uses. Units: bytes *this rank puts on
the wire* for a bandwidth-optimal (ring) algorithm -- the ledger's ``wire_bytes``:

* all-reduce of n bytes over p ranks: ``2 (p-1)/p n``;
* all-gather to, or reduce-scatter from, a full tensor of n bytes: ``(p-1)/p n``.

Notation: T tokens on this rank's tensor-parallel group (batch x sequence of one dp rank),
h hidden, f FFN hidden, V vocabulary, N / K query / key-value heads, p = tp degree.

The formulas live one module per tensor-parallel mode: :mod:`.tp1d_traffic` (Megatron),
:mod:`.tp2d_traffic` (Optimus 2D, Tesseract 2.5D), :mod:`.tp3d_traffic` (3D); the collectives'
byte counts and :class:`~.collectives.Traffic` in :mod:`.collectives`. This module picks the
formula for a ``tp_mode``. Context parallelism's bytes are in :mod:`.context_traffic`.
"""

from __future__ import annotations

from ..specs import TransformerShape
from .collectives import Traffic
from .tp1d_traffic import tp1d_block_traffic, tp1d_linear_traffic, tp1d_model_traffic
from .tp2d_traffic import (
    grid_side,
    tp2d_block_traffic,
    tp2d_linear_traffic,
    tp2d_model_traffic,
    tp2p5d_block_traffic,
    tp2p5d_linear_traffic,
)
from .tp3d_traffic import cube_side, tp3d_block_traffic, tp3d_linear_traffic, tp3d_model_traffic

_LINEAR = {
    "1d": tp1d_linear_traffic,
    "2d": tp2d_linear_traffic,
    "2.5d": tp2p5d_linear_traffic,
    "3d": tp3d_linear_traffic,
}
_BLOCK = {"1d": tp1d_block_traffic, "2d": tp2d_block_traffic, "2.5d": tp2p5d_block_traffic, "3d": tp3d_block_traffic}


def tp_grid(tp: int, tp_mode: str = "1d", tp_depth: int = 1) -> tuple[int, int]:
    """``(q, d)`` of a tensor-parallel layout: 1D ``(tp, 1)``; 2D ``(q, 1)`` and 2.5D ``(q, d)`` with
    ``tp = d q**2``; 3D ``(q, q)`` with ``tp = q**3`` (its cube's depth axis is another side)."""
    if tp == 1 or tp_mode == "1d":
        return tp, 1
    if tp_mode in ("2d", "2.5d"):
        return grid_side(tp, tp_depth), tp_depth
    if tp_mode == "3d":
        q = cube_side(tp)
        return q, q
    raise ValueError(f"tp_mode={tp_mode!r}: one of '1d', '2d', '2.5d', '3d'.")


def linear_traffic(mode: str, **kwargs) -> Traffic:
    """Per-rank bytes of one Linear, forward + backward, for ``tp_mode`` ``mode``."""
    return _LINEAR[mode](**kwargs)


def block_traffic(mode: str, shape: TransformerShape, **kwargs) -> Traffic:
    """Per-rank bytes of one transformer block, forward + backward, for ``tp_mode`` ``mode``."""
    return _BLOCK[mode](shape, **kwargs)


def model_traffic(mode: str, shape: TransformerShape, **kwargs) -> Traffic:
    """Per-rank bytes of a whole model's forward + backward, for ``tp_mode`` ``mode``."""
    if mode == "1d":
        return tp1d_model_traffic(shape, **kwargs)
    if mode in ("2d", "2.5d"):
        return tp2d_model_traffic(shape, **kwargs)
    if mode == "3d":
        return tp3d_model_traffic(shape, **kwargs)
    raise ValueError(f"tp_mode={mode!r}: one of '1d', '2d', '2.5d', '3d'.")

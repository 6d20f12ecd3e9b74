"""2.5D tensor parallelism (Tesseract, arXiv 2105.14500): d layers of Optimus's q x q SUMMA
grid, p = d * q**2.

Grid and layouts. Rank (depth, i, j) has ``depth = mesh.coord("tp_depth")``, ``i =
mesh.coord("tp_row")``, ``j = mesh.coord("tp_col")``; tp rank ``(depth*q + i)*q + j``.

* Activations ``[b, s, h]`` with ``b = B/(d q)``: rank (depth, i, j) holds batch block
  ``depth*q + i`` (the batch is cut into d slabs, each slab over the rows of one grid) and
  hidden block j.
* Weights: each depth layer holds the full 2D-sharded weight (block (k, j) on (depth, k, j)),
  so shards are replicated over ``tp_depth`` (``ShardSpec.replicated_on``) and their gradients
  are all-reduced over ``tp_depth`` inside the layer (the one collective Tesseract adds to
  Optimus: ``in*out/q**2`` per Linear). Biases and norm weights are also replicated over
  ``tp_row``.
* Inputs of the tp group (token ids, labels) are ``[B, S]``; the embedding takes its depth
  slab itself, :func:`split_batch_25d` gives this rank's labels.

Every SUMMA step, norm statistic and vocab-parallel reduction runs inside one depth layer,
exactly as in :mod:`.tp2d` (the grid code both share is :mod:`.grid`); this module is those
layers with a depth axis (with d = 1 a
Tesseract layer is exactly the Optimus layer, bit for bit). Per Linear per device, forward +
backward: ``3 (B S h_in / d + h_in h_out) / q + h_in h_out / q**2`` elements
(``behemoth.planner.tp2d_traffic.summa_linear_bytes`` with ``depth``).

Tested in tests/dist/test_tp2d_layers.py (tp=8 with depth 2 against the serial layers; depth 1
against the 2D layers).
"""

from __future__ import annotations

import torch

from . import tp2d
from .embed2d import Embedding2D, PositionEmbedding2D, VocabParallelHead2D, grid_cross_entropy
from .grid import activation_spec, gather_activation, gather_batch, grid_of
from .layout import ShardSpec, shard_tensor

__all__ = [
    "activation_spec_25d",
    "split_batch_25d",
    "split_activation_25d",
    "gather_batch_25d",
    "gather_activation_25d",
    "Linear25D",
    "LayerNorm25D",
    "RMSNorm25D",
    "Embedding25D",
    "PositionEmbedding25D",
    "VocabParallelHead25D",
    "vocab_parallel_cross_entropy_25d",
]

MODE = "2.5d"


def activation_spec_25d(full_shape, mesh, *, hidden: bool = True) -> ShardSpec:
    """ShardSpec of a tp-group activation: batch over (``tp_depth``, ``tp_row``), index
    ``depth*q + i``; with ``hidden``, the last dim over ``tp_col``."""
    return activation_spec(full_shape, grid_of(mesh, MODE, "activation_spec_25d"), hidden)


def split_batch_25d(x_B: torch.Tensor, mesh) -> torch.Tensor:
    """This rank's batch block ``[B/(d q), ...]`` of a tp-group tensor. No communication."""
    return shard_tensor(x_B, activation_spec_25d(x_B.shape, mesh, hidden=False))


def split_activation_25d(x_BSH: torch.Tensor, mesh) -> torch.Tensor:
    """``[B, S, H] -> [B/(d q), S, H/q]``. No communication."""
    return shard_tensor(x_BSH, activation_spec_25d(x_BSH.shape, mesh))


def gather_batch_25d(x_b: torch.Tensor, mesh) -> torch.Tensor:
    """Inverse of :func:`split_batch_25d`: all-gather over ``tp_row`` then ``tp_depth``."""
    return gather_batch(x_b, grid_of(mesh, MODE, "gather_batch_25d"))


def gather_activation_25d(x_bSh: torch.Tensor, mesh) -> torch.Tensor:
    """Inverse of :func:`split_activation_25d`: all-gather over ``tp_col``, ``tp_row``, ``tp_depth``."""
    return gather_activation(x_bSh, grid_of(mesh, MODE, "gather_activation_25d"))


class Linear25D(tp2d.Linear2D):
    """Tesseract Linear: SUMMA inside each depth layer, dW all-reduced over ``tp_depth``.
    Same arguments, ``fused`` QKV and ``weight_layout`` as :class:`.tp2d.Linear2D`."""

    MODE = MODE


class LayerNorm25D(tp2d.LayerNorm2D):
    """LayerNorm of ``[b, s, h]``; statistics over ``tp_col``, weight grads over ``tp_row`` and ``tp_depth``."""

    MODE = MODE


class RMSNorm25D(tp2d.RMSNorm2D):
    """RMSNorm of ``[b, s, h]``; statistics over ``tp_col``, weight grad over ``tp_row`` and ``tp_depth``."""

    MODE = MODE


class Embedding25D(Embedding2D):
    """Vocab-parallel embedding: ids ``[B, S]`` of the tp group; each depth layer embeds its
    slab as :class:`.embed2d.Embedding2D` does; the table's gradient is summed over ``tp_depth``."""

    MODE = MODE


class PositionEmbedding25D(PositionEmbedding2D):
    """Position table split on hidden over ``tp_col``, replicated over ``tp_row`` and ``tp_depth``."""

    MODE = MODE


class VocabParallelHead25D(VocabParallelHead2D):
    """LM head with the :class:`Embedding25D` table layout (tie by ``from_serial(..., tied=emb)``)."""

    MODE = MODE


def vocab_parallel_cross_entropy_25d(
    logits_bSv: torch.Tensor, labels_bS: torch.Tensor, mesh, *, ignore_index: int = -100, reduction: str = "sum"
) -> torch.Tensor:
    """As :func:`.embed2d.vocab_parallel_cross_entropy_2d`; the tp group's total loss is the sum
    over ``tp_row`` and ``tp_depth`` of the per-rank sums."""
    g = grid_of(mesh, MODE, "vocab_parallel_cross_entropy_25d")
    return grid_cross_entropy(
        logits_bSv, labels_bS, g, logits_bSv.shape[-1] * g.q, ignore_index=ignore_index, reduction=reduction
    )

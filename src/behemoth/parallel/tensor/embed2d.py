"""2D (Optimus) model edges: the token and position embeddings, the vocabulary-parallel LM
head and its loss, in :mod:`.grid`'s layouts (2.5D subclasses them with a depth axis).

The token embedding and the head share the Linear2D weight layout (vocab over ``tp_col``),
so tied embeddings are one Parameter. The embedding looks up its vocab block for the tp
group's batch, reduce-scatters over ``tp_col`` and swaps with the transposed grid rank; the
cross-entropy all-reduces max, target logit and sum-exp over ``tp_col``: no rank ever holds
full logits.

Tested in tests/dist/test_tp2d_layers.py against the serial layers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ... import comm
from .functional import vocab_parallel_cross_entropy
from .grid import Grid, activation_spec, gather_activation, grid_of, replicate_on
from .layout import DimShard, ShardSpec, check_divisible, set_spec, shard_tensor
from .serial import copy_shards, embedding_from_serial
from .tp2d import Linear2D
from .vocab_blocks import VocabHeadMixin, local_vocab_ids

__all__ = [
    "Embedding2D",
    "PositionEmbedding2D",
    "VocabParallelHead2D",
    "grid_cross_entropy",
    "vocab_parallel_cross_entropy_2d",
]


# --------------------------------------------------------------------------- embeddings
class Embedding2D(nn.Module):
    """Vocab-parallel token embedding: ids ``[B, S]`` of the whole tp group (the same on every
    tp rank) -> ``[b, s, h]`` in the 2D layout.

    Table layout = the LM head's (``[V, H]``: vocab block over ``tp_col``, hidden block over
    ``tp_row``), so a tied head shares the Parameter. Rank (k, c) looks up its vocab block
    for the tokens of its depth slab (hidden block k), reduce-scatters the partial sums over
    ``tp_col`` along the batch (now batch block c, hidden k) and swaps with the transposed rank
    (c, k). Backward: the swap, an all-gather over ``tp_col``, a local scatter-add.

    ``local_ids=True`` (what model-level ``parallelize`` sets, the engine having split the
    batch): ids are this rank's batch block ``[b, S]`` instead; they are all-gathered (int64,
    no gradient) over ``tp_row`` into the depth slab first -- ``2q/h`` of the bytes the
    lookup's reduce-scatter then moves (fp32).
    """

    MODE = "2d"

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        mesh,
        *,
        padding_idx: int | None = None,
        local_ids: bool = False,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        g = self.grid = grid_of(mesh, self.MODE, type(self).__name__)
        check_divisible(f"{type(self).__name__} vocabulary size", num_embeddings, g.q, g.mode)
        check_divisible(f"{type(self).__name__} embedding dim", embedding_dim, g.q, g.mode)
        self.num_embeddings, self.embedding_dim, self.padding_idx = num_embeddings, embedding_dim, padding_idx
        self.local_ids = local_ids
        self.vocab_start = g.col * (num_embeddings // g.q)
        spec = ShardSpec(
            (num_embeddings, embedding_dim),
            (DimShard(0, g.q, g.col, ("tp_col",)), DimShard(1, g.q, g.row, ("tp_row",))),
            g.weight_replicas,
        )
        self.weight = set_spec(nn.Parameter(torch.zeros(spec.local_shape(), device=device, dtype=dtype)), spec)

    from_serial = classmethod(embedding_from_serial)

    def forward(self, ids_BS: torch.Tensor) -> torch.Tensor:
        g, v = self.grid, self.num_embeddings // self.grid.q
        if self.local_ids:  # this rank's batch block -> the depth slab's ids
            ids = comm.all_gather(ids_BS.contiguous(), g.row_axis, 0)
        else:
            check_divisible(
                f"{type(self).__name__} batch size (rows of the tp group's ids)", ids_BS.shape[0], g.batch_parts, g.mode
            )
            ids = ids_BS.chunk(g.depth_size, 0)[g.depth]
        local, outside, pad = local_vocab_ids(ids, self.vocab_start, v, self.padding_idx)
        e = F.embedding(local, replicate_on(self.weight, g, rows=False), padding_idx=pad)
        e = e.masked_fill(outside[..., None], 0.0)
        e = comm.ReduceScatterToAxis.apply(e, g.col_axis, 0)  # batch block c, hidden block k
        return comm.ExchangeWithPeer.apply(e, g.tp_axis, g.transpose_peer)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, q={self.grid.q}, depth={self.grid.depth_size}"


class PositionEmbedding2D(nn.Module):
    """Learned position table ``[P, H]``: hidden block j, replicated over ``tp_row`` (it is
    small and every batch block uses every row). ``forward(pos)`` -> ``pos.shape + [h/q]``,
    which broadcasts onto ``[b, s, h]``; no forward communication, the gradient is summed
    over ``tp_row``."""

    MODE = "2d"

    def __init__(self, num_embeddings: int, embedding_dim: int, mesh, *, device=None, dtype=None) -> None:
        super().__init__()
        g = self.grid = grid_of(mesh, self.MODE, type(self).__name__)
        check_divisible(f"{type(self).__name__} embedding dim", embedding_dim, g.q, g.mode)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        spec = ShardSpec(
            (num_embeddings, embedding_dim),
            (DimShard(1, g.q, g.col, ("tp_col",)),),
            ("tp_row",) * (g.q > 1) + g.weight_replicas,
        )
        self.weight = set_spec(nn.Parameter(torch.zeros(spec.local_shape(), device=device, dtype=dtype)), spec)

    @classmethod
    def from_serial(cls, module: nn.Embedding, mesh):
        w = module.weight
        layer = cls(module.num_embeddings, module.embedding_dim, mesh, device=w.device, dtype=w.dtype)
        copy_shards(layer, module)
        return layer

    def forward(self, pos: torch.Tensor) -> torch.Tensor:
        return F.embedding(pos, replicate_on(self.weight, self.grid, rows=True))


# --------------------------------------------------------------------------- LM head + loss
class VocabParallelHead2D(VocabHeadMixin, Linear2D):
    """LM head: ``[b, s, h] -> logits [b, s, v]`` (batch block i, vocab block j), a SUMMA
    Linear whose weight ``[V, H]`` has the :class:`Embedding2D` table layout (tie it by
    ``from_serial(..., tied=embedding)``). Pair it with :func:`vocab_parallel_cross_entropy_2d`;
    full logits never exist on any rank. Engine protocol: :class:`~.vocab_blocks.VocabHeadMixin`'s
    (the gathered logits: all-gather over ``tp_col``, ``tp_row``, ``tp_depth``); with
    ``local_labels`` the engine sums the loss over the batch axes."""

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        return gather_activation(logits, self.grid)

    def vocab_parallel_loss_sum(self, logits: torch.Tensor, labels_BS: torch.Tensor) -> torch.Tensor:
        """Sum of the cross-entropy over every labelled token of the tp group's ``labels_BS``,
        the same on every tp rank: this rank's block's sum, all-reduced over ``tp_row`` and
        ``tp_depth`` (``ReduceFromAxis``: identity backward, so each rank's logits get the
        gradient of the total). With ``local_labels``, ``labels_BS`` is this rank's block
        ``[b, S]`` and the sum is over it alone (the same on every rank of a grid row)."""
        g = self.grid
        if self.gather_output:
            return F.cross_entropy(logits.float().flatten(0, -2), labels_BS.flatten(), reduction="sum")
        if self.local_labels:
            return grid_cross_entropy(logits, labels_BS, g, self.out_features)
        local = grid_cross_entropy(
            logits, shard_tensor(labels_BS, activation_spec(labels_BS.shape, g, False)), g, self.out_features
        )
        return comm.ReduceFromAxis.apply(comm.ReduceFromAxis.apply(local, g.row_axis), g.depth_axis)

    def cross_entropy(self, logits_bSv: torch.Tensor, labels_bS: torch.Tensor, **kw) -> torch.Tensor:
        return grid_cross_entropy(logits_bSv, labels_bS, self.grid, self.out_features, **kw)


def grid_cross_entropy(
    logits, labels, g: Grid, vocab: int, *, ignore_index: int = -100, reduction: str = "sum"
) -> torch.Tensor:
    """Cross-entropy of grid logits ``[b, s, V/q]`` (vocab over ``tp_col``) against this rank's
    labels block; ``reduction`` ``"sum"`` (this block's sum) or ``"none"`` (per token)."""
    if labels.shape != logits.shape[:-1]:
        raise ValueError(
            f"vocab-parallel cross-entropy ({g.mode}): labels {tuple(labels.shape)} must be this rank's "
            f"batch block, matching logits {tuple(logits.shape[:-1])}; use split_batch."
        )
    if logits.shape[-1] * g.q != vocab:
        raise ValueError(
            f"vocab-parallel cross-entropy ({g.mode}): logits' last dim {logits.shape[-1]} is not "
            f"vocab/q = {vocab}/{g.q}."
        )
    loss = vocab_parallel_cross_entropy(logits, labels, g.col_axis, g.col * (vocab // g.q), ignore_index)
    if reduction == "none":
        return loss
    if reduction != "sum":
        raise ValueError(f"reduction={reduction!r}: must be 'sum' or 'none'.")
    return loss.sum()


def vocab_parallel_cross_entropy_2d(
    logits_bSv: torch.Tensor, labels_bS: torch.Tensor, mesh, *, ignore_index: int = -100, reduction: str = "sum"
) -> torch.Tensor:
    """Cross-entropy of logits ``[b, s, V/q]`` (vocab over ``tp_col``) against this rank's
    labels ``[b, s]`` (:func:`split_batch_2d` of the group's labels); ``ignore_index`` tokens
    count 0. ``reduction="sum"``: the sum over this rank's batch block -- the same value on
    every rank of a grid row, to be backpropagated once per rank; the tp group's total is
    the sum over ``tp_row`` (and depth). ``"none"``: per-token losses ``[b, s]``."""
    g = grid_of(mesh, "2d", "vocab_parallel_cross_entropy_2d")
    return grid_cross_entropy(
        logits_bSv, labels_bS, g, logits_bSv.shape[-1] * g.q, ignore_index=ignore_index, reduction=reduction
    )

"""3D model edges: the token and position embeddings, the vocabulary-parallel LM head and
cross-entropy, in :mod:`.tp3d`'s cube layouts.

The token embedding and the head share one table layout (vocab block ``r*q + d`` of q**2,
hidden block c) so they can be tied; the embedding reduce-scatters its partial lookups over
tp_depth then tp_row, the cross-entropy all-reduces max, target logit and sum-exp over the
vocab axis (tp_row for the head's swapped logits); no rank ever holds full logits.
``local_ids`` / ``local_positions`` / ``local_labels`` map the engine's per-rank input rows
(:data:`.tp3d.INPUT_BATCH_AXES`) onto these layers' layouts.

Tested in tests/dist/test_tp3d_layers.py (world 8, q = 2) against the serial layers in float64.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ... import comm
from .functional import replicated, vocab_parallel_cross_entropy
from .layout import DimShard, ShardSpec, check_divisible, set_spec, shard_tensor
from .serial import copy_shards, embedding_from_serial
from .tp3d import MODE, Layout, Linear3D, activation_spec, cube_of, gather_activation, weight_spec
from .vocab_blocks import VocabHeadMixin, local_vocab_ids

__all__ = ["Embedding3D", "PositionEmbedding3D", "VocabParallelHead3D", "vocab_parallel_cross_entropy_3d"]


# --------------------------------------------------------------------------- embeddings
class Embedding3D(nn.Module):
    """Vocab-parallel token embedding: ids ``[B, S]`` of the whole tp group (the same on every
    tp rank) -> ``[b, s, h]`` in the canonical layout.

    Table ``[V, H]`` with the LM head's layout (vocab block ``r*q + d`` of q**2, hidden block
    c), so a tied head shares the Parameter; no two ranks hold the same block. Rank (d, r, c)
    looks up its vocab rows for every token, reduce-scatters the partial sums over tp_depth
    and then tp_row along the batch (-> batch block ``d*q + r``). Backward: the two
    all-gathers, a local scatter-add.

    ``local_ids=True`` (set by model-level ``parallelize``; the engine has split the batch):
    ids are this rank's input block ``[B/q**2, S]`` (batch block ``d*q + c``); they are
    all-gathered (int64, no gradient) over tp_col, then tp_depth, into the tp group's ids first
    -- ``8 B S (1/q + 1)`` payload bytes, a small fraction of the activations the lookup moves."""

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
        name = type(self).__name__
        cube = self.cube = cube_of(mesh, name)
        check_divisible(f"{name} vocabulary size", num_embeddings, cube.q**2, MODE)
        check_divisible(f"{name} embedding dim", embedding_dim, cube.q, MODE)
        self.num_embeddings, self.embedding_dim, self.padding_idx = num_embeddings, embedding_dim, padding_idx
        self.local_ids = local_ids
        self.layout = cube.layout(False)
        spec = weight_spec(self.layout, num_embeddings, embedding_dim, 1, False)
        self.vocab_start = spec.dims[0].index * (num_embeddings // cube.q**2)
        self.weight = set_spec(nn.Parameter(torch.zeros(spec.local_shape(), device=device, dtype=dtype)), spec)

    from_serial = classmethod(embedding_from_serial)

    def forward(self, ids_BS: torch.Tensor) -> torch.Tensor:
        lay, q, v = self.layout, self.cube.q, self.weight.shape[0]
        if self.local_ids:  # this rank's input block -> the tp group's ids (block order d*q + c)
            ids_BS = comm.all_gather(comm.all_gather(ids_BS.contiguous(), self.cube.col, 0), self.cube.depth, 0)
        check_divisible(f"{type(self).__name__} batch size (rows of the tp group's ids)", ids_BS.shape[0], q * q, MODE)
        local, outside, pad = local_vocab_ids(ids_BS, self.vocab_start, v, self.padding_idx)
        e = F.embedding(local, self.weight, padding_idx=pad).masked_fill(outside[..., None], 0.0)
        e = comm.ReduceScatterToAxis.apply(e, lay.depth, 0)
        return comm.ReduceScatterToAxis.apply(e, lay.inner, 0)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, q={self.cube.q}"


class PositionEmbedding3D(nn.Module):
    """Learned position table ``[P, H]``: the layout's hidden block, replicated over the other
    two axes (small, and every batch block uses every row). ``forward(pos)`` -> ``pos.shape +
    [h]``, which broadcasts onto ``[b, s, h]``; no forward communication, the gradient is
    summed over the replicas.

    ``local_positions=True`` (model-level ``parallelize``; canonical layout only): ``pos`` with
    a batch dim (``[b, S]`` or ``[1, S]``) holds the rows of this rank's *input* block
    ``d*q + c``, but the output joins the residual stream's canonical block ``d*q + r``: the
    positions are all-gathered over tp_col (int64, ``8 q b S`` bytes) and block r kept. This is
    right for per-row positions and for a broadcast ``[1, S]`` alike (the ranks of tp_col then
    hold the same row); 1-D positions need nothing."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        mesh,
        *,
        swapped: bool = False,
        local_positions: bool = False,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        cube = self.cube = cube_of(mesh, type(self).__name__)
        check_divisible(f"{type(self).__name__} embedding dim", embedding_dim, cube.q, MODE)
        if local_positions and swapped:
            raise ValueError(
                f"{type(self).__name__}: local_positions re-indexes input rows onto the canonical "
                f"layout; a swapped table already sees the input rows (use local_positions=False)."
            )
        self.num_embeddings, self.embedding_dim, self.local_positions = num_embeddings, embedding_dim, local_positions
        lay = self.layout = cube.layout(swapped)
        spec = ShardSpec(
            (num_embeddings, embedding_dim),
            (DimShard(1, cube.q, lay.hidden.rank, (lay.hidden.name,)),),
            (lay.depth.name, lay.inner.name) if cube.q > 1 else (),
        )
        self.weight = set_spec(nn.Parameter(torch.zeros(spec.local_shape(), device=device, dtype=dtype)), spec)

    @classmethod
    def from_serial(cls, module: nn.Embedding, mesh, *, swapped: bool = False):
        w = module.weight
        layer = cls(module.num_embeddings, module.embedding_dim, mesh, swapped=swapped, device=w.device, dtype=w.dtype)
        copy_shards(layer, module)
        return layer

    def forward(self, pos: torch.Tensor) -> torch.Tensor:
        if self.local_positions and pos.dim() >= 2:  # input rows (d*q + c) -> residual rows (d*q + r)
            cube = self.cube
            pos = comm.all_gather(pos.contiguous(), cube.col, 0).chunk(cube.q, 0)[cube.row.rank]
        return F.embedding(pos, replicated(self.weight, self.layout.inner, self.layout.depth))


# --------------------------------------------------------------------------- LM head + loss
class VocabParallelHead3D(VocabHeadMixin, Linear3D):
    """LM head: canonical ``[b, s, h]`` -> logits ``[b, s, V/q]`` in the swapped layout (batch
    block ``d*q + c``, vocab block r), a :class:`Linear3D` whose weight ``[V, H]`` has the
    :class:`Embedding3D` table layout (tie it by ``from_serial(..., tied=embedding)``). Pair it
    with :func:`vocab_parallel_cross_entropy_3d` (vocab reductions over tp_row); full logits
    never exist on any rank. Engine protocol: :class:`~.vocab_blocks.VocabHeadMixin`'s (the
    gathered logits: all-gather over the three axes of the swapped layout); with
    ``local_labels`` the labels block ``[b, S]`` is block ``d*q + c``, the logits' own, and the
    engine sums the loss over :data:`INPUT_BATCH_AXES`."""

    tie_rule = " (a tied head must have swapped=False)"

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        return gather_activation(logits, self.out_layout)

    def vocab_parallel_loss_sum(self, logits: torch.Tensor, labels_BS: torch.Tensor) -> torch.Tensor:
        """Sum of the cross-entropy over every labelled token of the tp group's ``labels_BS``
        ``[B, S]``, the same on every tp rank: this rank's batch block's sum, all-reduced over
        the two batch axes (``ReduceFromAxis``: identity backward). With ``local_labels``,
        ``labels_BS`` is this rank's block ``[b, S]`` and the sum is over it alone (the same on
        every rank of tp_row, the logits' vocab axis)."""
        if self.gather_output:
            z = logits.to(torch.promote_types(logits.dtype, torch.float32))
            return F.cross_entropy(z.flatten(0, -2), labels_BS.flatten(), reduction="sum")
        lay = self.out_layout
        if self.local_labels:
            return cube_cross_entropy(logits, labels_BS, lay, self.out_features)
        labels = shard_tensor(labels_BS, activation_spec(labels_BS.shape, lay, False))
        local = cube_cross_entropy(logits, labels, lay, self.out_features)
        return comm.ReduceFromAxis.apply(comm.ReduceFromAxis.apply(local, lay.inner), lay.depth)

    def cross_entropy(self, logits_bSv: torch.Tensor, labels_bS: torch.Tensor, **kw) -> torch.Tensor:
        return cube_cross_entropy(logits_bSv, labels_bS, self.out_layout, self.out_features, **kw)


def cube_cross_entropy(
    logits, labels, lay: Layout, vocab: int, *, ignore_index: int = -100, reduction: str = "sum"
) -> torch.Tensor:
    """Cross-entropy of logits ``[b, s, V/q]`` in layout ``lay`` (vocab over its hidden axis)
    against this rank's labels block; ``reduction`` ``"sum"`` or ``"none"``."""
    if labels.shape != logits.shape[:-1]:
        raise ValueError(
            f"vocab-parallel cross-entropy (3d): labels {tuple(labels.shape)} must be this rank's batch "
            f"block, matching logits {tuple(logits.shape[:-1])}; use split_batch_3d(..., swapped=True)."
        )
    if logits.shape[-1] * lay.q != vocab:
        raise ValueError(
            f"vocab-parallel cross-entropy (3d): logits' last dim {logits.shape[-1]} is not vocab/q = {vocab}/{lay.q}."
        )
    if reduction not in ("sum", "none"):
        raise ValueError(f"reduction={reduction!r}: must be 'sum' or 'none'.")
    loss = vocab_parallel_cross_entropy(logits, labels, lay.hidden, lay.hidden.rank * (vocab // lay.q), ignore_index)
    return loss.sum() if reduction == "sum" else loss


def vocab_parallel_cross_entropy_3d(
    logits_bSv: torch.Tensor,
    labels_bS: torch.Tensor,
    mesh,
    *,
    swapped: bool = True,
    ignore_index: int = -100,
    reduction: str = "sum",
) -> torch.Tensor:
    """Cross-entropy of logits ``[b, s, V/q]`` against this rank's labels ``[b, s]``, both in
    the swapped layout by default (what :class:`VocabParallelHead3D` produces: vocab over
    tp_row; labels from ``split_batch_3d(labels, mesh, swapped=True)``); ``ignore_index``
    tokens count 0. ``reduction="sum"``: this rank's batch block's sum, the same on every rank
    of the vocab axis; the tp group's total is its sum over the two batch axes. ``"none"``:
    per-token losses ``[b, s]``."""
    lay = cube_of(mesh, "vocab_parallel_cross_entropy_3d").layout(swapped)
    return cube_cross_entropy(
        logits_bSv, labels_bS, lay, logits_bSv.shape[-1] * lay.q, ignore_index=ignore_index, reduction=reduction
    )

"""Vocabulary-parallel embedding and output head for 1D tensor parallelism.

Megatron's (Shoeybi et al. 2019): the vocabulary rows are split over tp; the embedding looks
up its rows and all-reduces, the head produces this rank's ``[.., V/p]`` logits (its ``f``
overlapped with its weight gradient, :mod:`.region1d`), and the loss
(:class:`.functional.VocabParallelCrossEntropy`) needs only two small all-reduces per token
row, so no rank materialises the full logits.

Test: tests/dist/test_tp1d.py (layers against serial in float64, whole models).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ... import comm
from ...comm import Axis
from .functional import IGNORE_INDEX, autocast_dtype, cast_to, vocab_parallel_cross_entropy
from .region1d import ParallelRegion, column_parallel_linear


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the vocabulary split over tp: ids outside this rank's rows
    ``[vocab_start, vocab_start + V/p)`` look up zeros, then ``g`` (all-reduce forward,
    identity backward) sums the ranks' partial embeddings. ids [B, S] -> [B, S, H] complete."""

    def __init__(
        self, weight: nn.Parameter, *, axis: Axis, vocab_start: int, vocab_size: int, padding_idx: int | None = None
    ) -> None:
        super().__init__()
        self.weight = weight
        self.axis, self.vocab_start = axis, vocab_start
        self.num_embeddings, self.embedding_dim = vocab_size, weight.shape[1]
        local = None if padding_idx is None else padding_idx - vocab_start
        self.local_padding_idx = local if local is not None and 0 <= local < weight.shape[0] else None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.vocab_start
        inside = (local >= 0) & (local < self.weight.shape[0])
        out = F.embedding(local.masked_fill(~inside, 0), self.weight, padding_idx=self.local_padding_idx)
        out = out.masked_fill(~inside.unsqueeze(-1), 0.0)
        return comm.ReduceFromAxis.apply(out, self.axis)

    def forward_no_grad(self, ids: torch.Tensor) -> torch.Tensor:
        """:meth:`forward` without autograd (``base.no_grad_forward``): the all-reduce is a
        functional one, traceable by ``torch.compile``."""
        local = ids - self.vocab_start
        inside = (local >= 0) & (local < self.weight.shape[0])
        out = F.embedding(local.masked_fill(~inside, 0), self.weight, padding_idx=self.local_padding_idx)
        return comm.all_reduce_functional(out.masked_fill(~inside.unsqueeze(-1), 0.0), self.axis)


class VocabParallelHead(nn.Module):
    """Output projection with the vocabulary split over tp: X [B, S, H] (complete) ->
    logits [B, S, V/p] for this rank's vocabulary rows; ``f`` on X (all-reduce of dX
    backward). The loss comes from :meth:`vocab_parallel_loss_sum`, so no rank builds the
    full logits; ``gather_output=True`` (set by the engine for a user ``loss_fn``) all-gathers
    them on the vocabulary instead (GatherFromAxis: slice backward)."""

    def __init__(
        self,
        weight: nn.Parameter,
        bias: nn.Parameter | None,
        *,
        axis: Axis,
        region: ParallelRegion,
        vocab_start: int,
        vocab_size: int,
        name: str = "",
    ) -> None:
        super().__init__()
        self.weight = weight
        self.register_parameter("bias", bias)
        self.axis, self.region, self.name = axis, region, name
        self.vocab_start, self.vocab_size = vocab_start, vocab_size
        self.in_features, self.out_features = weight.shape[1], vocab_size
        self.gather_output = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        group, source, _ = self.region.enter(x, self.name, False)
        dtype = autocast_dtype(x)
        logits = column_parallel_linear(source, cast_to(self.weight, dtype), cast_to(self.bias, dtype), None, group)
        self.region.clear()
        if self.gather_output:
            logits = comm.GatherFromAxis.apply(logits, self.axis, -1)
        return logits

    def forward_no_grad(self, x: torch.Tensor) -> torch.Tensor:
        """:meth:`forward` without autograd (``base.no_grad_forward``): a plain Linear and,
        with ``gather_output``, a functional all-gather; traceable by ``torch.compile``."""
        logits = F.linear(x, self.weight, self.bias)
        return comm.all_gather_functional(logits, self.axis, -1) if self.gather_output else logits

    def vocab_parallel_loss_sum(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Sum of next-token cross-entropy over the labelled positions (fp32), the same on
        every tp rank; ``logits`` are this head's output, ``labels`` the serial ``[B, S]``."""
        if self.gather_output:
            return F.cross_entropy(
                logits.float().flatten(0, -2), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
            )
        return vocab_parallel_cross_entropy(
            logits.float().flatten(0, -2), labels.flatten(), self.axis, self.vocab_start
        ).sum()

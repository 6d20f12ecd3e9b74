"""Vocabulary-parallel embedding, output head and cross-entropy for 1D tensor parallelism.

Megatron's (Shoeybi et al. 2019): the vocabulary rows are split over tp; the embedding looks
up its rows and all-reduces, the head produces this rank's ``[.., V/p]`` logits (its ``f``
overlapped with its weight gradient, :mod:`.region1d`), and the loss needs only two small
all-reduces per token row, so no rank materialises the full logits.

Test: tests/dist/test_tp1d.py (layers against serial in float64, whole models).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ... import comm
from ...comm import Axis
from .region1d import ParallelRegion, autocast_dtype, cast_to, column_parallel_linear

IGNORE_INDEX = -100


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


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy of vocabulary-sharded logits ``[N, V/p]`` (fp32), complete on
    every tp rank. Forward: all-reduce (max) of the row maxima ``[N]``, then one all-reduce
    (sum) of ``[target logit, sum of exp]`` ``[2, N]``. Backward: no communication --
    ``(softmax - one_hot) * grad`` on this rank's vocabulary slice."""

    @staticmethod
    def forward(ctx, logits, target, axis: Axis, vocab_start: int, ignore_index: int):
        row_max = logits.max(dim=-1).values
        comm.all_reduce(row_max, axis, op=torch.distributed.ReduceOp.MAX)
        shifted = logits - row_max.unsqueeze(-1)
        local = target - vocab_start
        hit = (local >= 0) & (local < logits.shape[-1])
        local = local.masked_fill(~hit, 0)
        target_logit = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(~hit, 0.0)
        exp = shifted.exp_()
        sums = torch.stack([target_logit, exp.sum(-1)])
        comm.all_reduce(sums, axis)
        valid = target != ignore_index
        loss = (sums[1].log() - sums[0]).masked_fill(~valid, 0.0)
        softmax = exp.div_(sums[1].unsqueeze(-1))
        ctx.save_for_backward(softmax, local, hit & valid, valid)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local, hit, valid = ctx.saved_tensors
        grad = softmax.clone()
        grad.scatter_add_(-1, local.unsqueeze(-1), -hit.to(grad.dtype).unsqueeze(-1))
        grad.mul_((grad_loss * valid).unsqueeze(-1))
        return grad, None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, axis: Axis, vocab_start: int, ignore_index: int = IGNORE_INDEX
) -> torch.Tensor:
    """Per-token losses ``[N]`` (0 where ``target == ignore_index``) of logits ``[N, V/p]``
    holding vocabulary rows ``[vocab_start, vocab_start + V/p)``; see VocabParallelCrossEntropy."""
    return VocabParallelCrossEntropy.apply(logits, target, axis, vocab_start, ignore_index)

"""What the grid's (2D, 2.5D: :mod:`.embed2d`) and the cube's (3D: :mod:`.embed3d`) model
edges share, each rank holding a block of the vocabulary rows of one ``[V, H]`` table:

* :func:`local_vocab_ids`: the token embedding's ids in its own rows (ids elsewhere look up
  zeros, the partial sums the mode's reduce-scatters add up);
* :class:`VocabHeadMixin`: the LM head's engine protocol on top of the mode's Linear
  (``gather_output``, ``local_labels``, tying to the embedding's Parameter).

No communication of its own: the gather of the logits and the loss's reductions are the mode's.
Tested in tests/dist/test_tp2d_layers.py and tests/dist/test_tp3d_layers.py against the serial
layers.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

__all__ = ["VocabHeadMixin", "local_vocab_ids"]


def local_vocab_ids(
    ids: torch.Tensor, vocab_start: int, rows: int, padding_idx: int | None
) -> tuple[torch.Tensor, torch.Tensor, int | None]:
    """``(local, outside, pad)`` for a lookup in vocabulary rows ``[vocab_start, vocab_start +
    rows)``: ``ids`` as row indices of the block (0 where ``outside``, whose looked-up rows the
    caller zeroes), and the serial ``padding_idx`` as a row of the block, or None when it is not
    one of them."""
    local = ids - vocab_start
    outside = (local < 0) | (local >= rows)
    local = local.masked_fill(outside, 0)
    pad = padding_idx - vocab_start if padding_idx is not None and 0 <= padding_idx - vocab_start < rows else None
    return local, outside, pad


class VocabHeadMixin:
    """The engine protocol of a vocabulary-parallel LM head (as tp1d's head), mixed in before a
    grid or cube Linear whose weight ``[V, H]`` has the token embedding's table layout:
    :meth:`vocab_parallel_loss_sum` (the mode's), and ``gather_output`` which, when set (for a
    user's loss_fn), makes ``forward`` all-gather the full logits ``[B, S, V]`` on every rank
    (:meth:`gather_logits`, the mode's: slice backward). ``local_labels`` (set by model-level
    ``parallelize``, whose engine splits the batch): the loss takes this rank's labels block and
    sums over it alone."""

    tie_rule: ClassVar[str] = ""
    """What a tied head must be, said when the embedding's shard does not match."""

    def __init__(self, in_features: int, vocab_size: int, mesh, *, bias: bool = False, **kw) -> None:
        super().__init__(in_features, vocab_size, mesh, bias=bias, **kw)
        self.gather_output = False
        self.local_labels = False

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """This rank's logits block -> the full logits ``[B, S, V]`` (slice backward)."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = super().forward(x)
        return self.gather_logits(logits) if self.gather_output else logits

    def forward_no_grad(self, x: torch.Tensor) -> torch.Tensor:
        """:meth:`forward` without autograd (the Linear's weight-stationary form for few tokens:
        a decode step moves no vocab block of the table)."""
        logits = super().forward_no_grad(x)
        return self.gather_logits(logits) if self.gather_output else logits

    @classmethod
    def from_serial(cls, module: nn.Linear, mesh, *, tied: nn.Module | None = None, **kw):
        """The Linear's ``from_serial(module, mesh, **kw)``; ``tied``: the sharded token embedding
        whose Parameter this head shares."""
        layer = super().from_serial(module, mesh, **kw)
        if tied is not None:
            if tied.weight._bh_shard != layer.weight._bh_shard:
                raise ValueError(
                    f"{cls.__name__}: tied embedding's shard {tied.weight._bh_shard} does not match "
                    f"the head's {layer.weight._bh_shard}{cls.tie_rule}."
                )
            layer.weight = tied.weight
        return layer

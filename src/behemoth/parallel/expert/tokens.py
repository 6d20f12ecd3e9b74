"""Each 1D tensor-parallel rank's share of an MoE block's tokens ("expert tensor parallelism"
of one, as Megatron's parallel folding runs experts beside split attention): the tp ranks of a
block split its tokens, so each routes and runs the experts on 1/tp of them instead of all of
them.

:class:`TokenShare` says, for one forward, which tokens this tp rank takes and how the block's
output goes back to the layout the 1D region expects around it:

=======================  ==============================  =====================================
block input              this rank's share               output
=======================  ==============================  =====================================
sequence parallelism:    its shard of the sequence       the share itself (the rank's shard
the norm's gathered      (plain slicing: the gather's    of the output, as the region
sequence ``[B, S, H]``   backward reduce-scatter sums    expects after the block)
                         its gradient, zero elsewhere)
whole (no sequence       ``ScatterToAxis`` on the        ``GatherFromAxis`` on the sequence
parallelism), ``S``      sequence (the gradient          (the output's gradient: this
divisible by tp          all-gathered: whole again)      rank's share kept)
whole, ``S`` not         the same on the ``B*S`` tokens  the same on the tokens
divisible by tp          padded to a multiple of tp,
                         padding dropped (rank r: rows
                         ``r*m .. r*m + m - 1`` of the
                         ``m = ceil(B*S / tp)`` each)
=======================  ==============================  =====================================

Every share is contiguous, so the whole tokens are the shares in tp order: :meth:`rows`
gives a capacity (per whole sequence) the gather of a per-token tensor over tp and the
rank's share of a verdict back, as context parallelism's capacity path takes them.
All communication goes through :mod:`behemoth.comm`'s autograd Functions.

Tested in tests/dist/test_expert_tokens.py against serial training.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ... import comm
from ...comm import Axis

__all__ = ["TokenShare"]


class TokenShare:
    """This tp rank's share of the tokens of an MoE block's input of shape ``[B, S, H]``
    (``sequence_parallel``: the input is the sequence gathered over ``tp`` and the output is
    this rank's shard of it). See the module docstring."""

    def __init__(self, tp: Axis, shape: torch.Size, sequence_parallel: bool) -> None:
        self.tp, self.sequence_parallel = tp, sequence_parallel
        self.B, self.S = shape[0], shape[1]
        self.on_sequence = sequence_parallel or self.S % tp.size == 0
        if sequence_parallel and self.S % tp.size:  # the gather made S a multiple of tp
            raise ValueError(f"sequence parallelism: an MoE block got S={self.S} positions, not divisible by tp.")
        T = self.B * self.S
        self.m = -(-T // tp.size)  # rows of each rank's padded share (token split)
        self.lo = min(T, tp.rank * self.m)
        self.n = min(T, self.lo + self.m) - self.lo

    def take(self, x_BSH: torch.Tensor) -> torch.Tensor:
        """This rank's share of ``x_BSH``: ``[B, S/tp, H]`` on the sequence, else ``[1, n, H]``."""
        tp = self.tp
        if self.sequence_parallel:
            s = self.S // tp.size
            return x_BSH[:, tp.rank * s : (tp.rank + 1) * s]
        if self.on_sequence:
            return comm.ScatterToAxis.apply(x_BSH, tp, 1)
        x_TH = x_BSH.reshape(-1, x_BSH.shape[-1])
        padded = F.pad(x_TH, (0, 0, 0, self.m * tp.size - x_TH.shape[0]))
        return comm.ScatterToAxis.apply(padded, tp, 0)[: self.n].unsqueeze(0)

    def give(self, y: torch.Tensor) -> torch.Tensor:
        """The block's output from this rank's share of it (:meth:`take`'s shape)."""
        tp = self.tp
        if self.sequence_parallel:
            return y
        if self.on_sequence:
            return comm.GatherFromAxis.apply(y.contiguous(), tp, 1)
        y_nH = F.pad(y.reshape(self.n, y.shape[-1]), (0, 0, 0, self.m - self.n))
        return comm.GatherFromAxis.apply(y_nH, tp, 0)[: self.B * self.S].view(self.B, self.S, -1)

    def rows(self):
        """``(gather, take)`` over tp for a capacity: ``gather(t)`` all-gathers a per-token tensor
        of this share (``[*, s, K]`` as :meth:`take` shapes it) into the block's ``[B, S, K]``;
        ``take(t_BSK)`` returns this share of one."""
        tp = self.tp

        def gather(t: torch.Tensor) -> torch.Tensor:
            if self.on_sequence:
                return comm.all_gather(t.contiguous(), tp, 1)
            t_nK = F.pad(t.reshape(self.n, -1), (0, 0, 0, self.m - self.n))
            return comm.all_gather(t_nK, tp, 0)[: self.B * self.S].view(self.B, self.S, -1)

        def take(t: torch.Tensor) -> torch.Tensor:
            if self.on_sequence:
                return t.chunk(tp.size, dim=1)[tp.rank]
            return t.reshape(self.B * self.S, -1)[self.lo : self.lo + self.n].unsqueeze(0)

        return gather, take

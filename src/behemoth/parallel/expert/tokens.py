"""Each tensor-parallel rank's share of an MoE block's tokens ("expert tensor parallelism" of
one, as Megatron's parallel folding runs experts beside split attention): the tp ranks of a
block split its tokens, so each routes and runs the experts on 1/tp of them instead of all of
them (1D: the ranks of ``tp`` split the data rank's tokens; the 2D, 2.5D and 3D grids: the
ranks of a grid row ``tp_col`` split the tokens of the batch block they hold, whose hidden
blocks they hold between them).

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

Under the 2D, 2.5D and 3D grids (``hidden``) the block's input is this rank's batch block with
its hidden block ``[b, S, H/q]`` (3D: its canonical layout): the q ranks of its grid row
(``tp_col``) hold the same tokens' other hidden blocks. The share is then taken by one
all-to-all over ``tp_col`` (each rank sends every peer that peer's tokens of its hidden block:
``[b, S/q, H]``, whole rows; the gradient the inverse all-to-all), and the output goes back the
same way (its tokens' hidden block j from every peer: ``[b, S, H/q]``), on the sequence or on
the padded tokens as above.

Every share is contiguous, so the whole tokens are the shares in tp order: :meth:`rows`
gives a capacity (per whole sequence) the gather of a per-token tensor over tp and the
rank's share of a verdict back, as context parallelism's capacity path takes them.
All communication goes through :mod:`behemoth.comm`'s autograd Functions.

Having seen its share only, a rank's router and experts hold a part of their gradients: the
gradient sync sums them over the whole tp group (1D's ``tp``, every rank of a grid) with their data
axis, once per step (``style.expert_param_axes``), and the balancing statistics are summed in the
forward (:func:`sum_shares`:
the counts over the whole tp group, the probability sums over the axis :func:`grid_axes` names;
:class:`TokenSplit` holds the axes), so the router losses are the serial model's.

Tested in tests/dist/test_expert_tokens.py (1D) and tests/dist/test_expert_grid.py (2D, 2.5D,
3D) against serial training.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ... import comm
from ...comm import Axis

__all__ = ["TokenShare", "TokenSplit", "grid_axes", "sum_shares", "token_axis"]


class TokenShare:
    """This tp rank's share of the tokens of an MoE block's input of shape ``[B, S, H]``
    (``sequence_parallel``: the input is the sequence gathered over ``tp`` and the output is
    this rank's shard of it; ``hidden``: the input and output are this rank's hidden block of
    ``[B, S, H]``, the other blocks on the members of ``tp``, a grid row). See the module
    docstring."""

    def __init__(self, tp: Axis, shape: torch.Size, sequence_parallel: bool, hidden: bool = False) -> None:
        self.tp, self.sequence_parallel, self.hidden = tp, sequence_parallel, hidden
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
            if self.hidden:  # [b, S, H/q] -> [b, S/q, H]
                return comm.AllToAllAxis.apply(x_BSH.contiguous(), tp, 1, 2)
            return comm.ScatterToAxis.apply(x_BSH, tp, 1)
        x_TH = x_BSH.reshape(-1, x_BSH.shape[-1])
        padded = F.pad(x_TH, (0, 0, 0, self.m * tp.size - x_TH.shape[0]))
        if self.hidden:  # [m*q, H/q] -> [m, H]
            return comm.AllToAllAxis.apply(padded, tp, 0, 1)[: self.n].unsqueeze(0)
        return comm.ScatterToAxis.apply(padded, tp, 0)[: self.n].unsqueeze(0)

    def give(self, y: torch.Tensor) -> torch.Tensor:
        """The block's output from this rank's share of it (:meth:`take`'s shape)."""
        tp = self.tp
        if self.sequence_parallel:
            return y
        if self.on_sequence:
            if self.hidden:  # [b, S/q, H] -> [b, S, H/q]
                return comm.AllToAllAxis.apply(y.contiguous(), tp, 2, 1)
            return comm.GatherFromAxis.apply(y.contiguous(), tp, 1)
        y_nH = F.pad(y.reshape(self.n, y.shape[-1]), (0, 0, 0, self.m - self.n))
        if self.hidden:  # [m, H] -> [m*q, H/q]
            y_TH = comm.AllToAllAxis.apply(y_nH, tp, 1, 0)
        else:
            y_TH = comm.GatherFromAxis.apply(y_nH, tp, 0)
        return y_TH[: self.B * self.S].view(self.B, self.S, -1)

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


@dataclass(frozen=True)
class TokenSplit:
    """How the block's tokens are split over tensor parallelism: ``tp`` (the axis whose ranks take
    shares of the same tokens), the 1D ``region`` under sequence parallelism (else None),
    ``hidden`` (a grid: the input is this rank's hidden block), ``loss`` (the axis the router
    losses' shares are summed over: ``tp`` under 1D) and ``rows`` (a grid's other axes, whose
    ranks hold the data rank's other tokens; empty under 1D)."""

    tp: Axis
    region: object
    hidden: bool
    loss: Axis
    rows: tuple[Axis, ...]


def sum_shares(local: torch.Tensor, prob_sums_E: torch.Tensor, z_sum, tp: Axis):
    """The shares of ``tp``'s ranks added up, in one all-reduce over ``tp`` (1D: the tp axis; a
    grid: :func:`grid_axes`'s loss axis): ``local`` (counts, drops, tokens) summed; ``prob_sums_E``
    and ``z_sum`` (in the graph) keep this rank's gradient and take the sum's value, so this rank's
    router loss reads as the whole share of the rows it holds (the step's reported loss, summed
    over the data axis and the grid's input batch axes, is the serial one) while its gradient stays
    this rank's part (the router's gradient is summed over the whole of tp)."""
    z = z_sum.detach().double().reshape(1) if z_sum is not None else local.new_zeros(1)  # one form for both
    summed = comm.all_reduce(torch.cat([local, prob_sums_E.detach().double(), z]), tp)
    n, E = local.numel(), prob_sums_E.numel()
    prob_sums_E = prob_sums_E + (summed[n : n + E].to(prob_sums_E.dtype) - prob_sums_E).detach()
    if z_sum is not None:
        z_sum = z_sum + (summed[-1].to(z_sum.dtype) - z_sum).detach()
    return summed[:n], prob_sums_E, z_sum


def token_axis(plan) -> str | None:
    """The tensor-parallel axis whose ranks split an MoE block's tokens: ``tp`` under 1D; under
    the grids ``tp_col``, whose ranks hold one batch block's hidden blocks (the residual stream's
    layout: 2D and 2.5D's, 3D's canonical one)."""
    if plan.tp == 1:
        return None
    return "tp" if plan.tp_mode == "1d" else "tp_col"


def grid_axes(plan) -> tuple[str, tuple[str, ...]] | None:
    """Off 1D, ``(loss axis, other axes)`` of the grid: the engine sums each rank's reported loss
    over the grid's input batch axes (2D: tp_row; 2.5D: tp_depth, tp_row; 3D's swapped layout:
    tp_depth, tp_col), so a rank's router-loss share is summed over the remaining axis, the one
    whose ranks hold the same rows of the input; the counts over all of them. None off a grid."""
    if plan.tp == 1 or plan.tp_mode == "1d":
        return None
    return {
        "2d": ("tp_col", ("tp_row",)),
        "2.5d": ("tp_col", ("tp_depth", "tp_row")),
        "3d": ("tp_row", ("tp_depth", "tp_col")),
    }[plan.tp_mode]

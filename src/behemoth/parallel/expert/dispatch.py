"""Token dispatch and combine for expert parallelism: tokens travel to their experts' ranks and back.

The E experts are sharded over the ``ep`` axis in contiguous blocks (member r holds experts
``r*E/n ... (r+1)*E/n - 1``). A forward through the experts is

1. **sort**: the T*K (token, slot) assignments sorted by expert (stable), so the rows for
   member r are one contiguous run;
2. **split sizes**: every member's per-expert counts exchanged with one even all-to-all of
   ``E`` integers (each member learns how many rows it receives, from whom, for which of its
   experts);
3. **dispatch**: the rows exchanged with one uneven ``all_to_all_single``
   (:class:`~behemoth.comm.AllToAllSingleAxis`), then regrouped by local expert (each group
   padded with zero rows to a multiple of ``align`` where the grouped GEMMs want it);
4. the local experts (:func:`~.grouped.grouped_swiglu`);
5. **combine**: the inverse regrouping, the reverse all-to-all, and each token's k outputs
   summed with its routing weights.

Each backward runs the reverse all-to-alls, on every member, even one that received no rows
(its empty output stays in the autograd graph), so an expert with no tokens cannot hang a step.
The permutation math (:func:`sort_by_expert`, :func:`local_order`) is pure and unit-tested.

Communication per forward per MoE layer: all-to-all of ``E`` int64 (sizes), then of the
``T*K`` rows of width H out and back (and the same two in backward), in the experts' GEMM dtype
(bf16 under bf16 autocast, both ways); fewer rows when a capacity drops assignments (an
assignment to expert ``E`` is dropped: never sent).
:func:`behemoth.parallel.expert.traffic.ep_all_to_all_bytes` is the formula.

Tested in tests/unit/test_expert_dispatch.py and tests/dist/test_expert_parallel.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ... import comm
from ...comm import Axis
from .grouped import gemm_dtype, pad_groups, padded_rows

__all__ = ["CastRows", "Routed", "combine", "dispatch", "local_order", "sort_by_expert"]


def sort_by_expert(experts_TK: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(order_A, counts_E)``: the flat (token, slot) indices ``t*K + k`` sorted by expert
    (stable, so token order is kept within an expert) and the assignments per expert. An
    assignment to expert ``num_experts`` (dropped by a capacity) is left out of both."""
    flat_A = experts_TK.reshape(-1)
    counts = torch.bincount(flat_A, minlength=num_experts + 1)
    kept = flat_A.numel() - int(counts[num_experts])
    return torch.argsort(flat_A, stable=True)[:kept], counts[:num_experts]


def local_order(recv_counts_RL: torch.Tensor) -> torch.Tensor:
    """The rows received from members ``0..R-1`` (each in local-expert order, ``recv_counts_RL[r,
    l]`` rows for local expert l) regrouped by local expert: the permutation ``perm`` such that
    ``received[perm]`` lists local expert 0's rows (from every member, in member order) first."""
    num_local = recv_counts_RL.shape[1]
    expert_of_row = torch.arange(num_local, device=recv_counts_RL.device).repeat(recv_counts_RL.shape[0])
    expert_of_row = torch.repeat_interleave(expert_of_row, recv_counts_RL.reshape(-1))
    return torch.argsort(expert_of_row, stable=True)


class CastRows(torch.autograd.Function):
    """``x_TH.to(dtype)[token_A]`` forward: a token's rows cast once, then gathered (one per
    (token, slot) assignment). Backward: the rows' gradients cast back to ``x_TH``'s dtype and
    summed per token in it (index_put with accumulate, as the backward of
    ``x_TH[token_A].to(dtype)`` sums them), so where the cast happens changes no bit of either
    direction. Local, no communication."""

    @staticmethod
    def forward(ctx, x_TH: torch.Tensor, token_A: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        ctx.save_for_backward(token_A)
        ctx.shape, ctx.dtype = x_TH.shape, x_TH.dtype
        return x_TH.to(dtype)[token_A]

    @staticmethod
    def backward(ctx, grad_AH: torch.Tensor):
        (token_A,) = ctx.saved_tensors
        grad_TH = grad_AH.new_zeros(ctx.shape, dtype=ctx.dtype)
        return grad_TH.index_put_((token_A,), grad_AH.to(ctx.dtype), accumulate=True), None, None


@dataclass
class Routed:
    """What :func:`combine` needs from :func:`dispatch`."""

    axis: Axis
    order_A: torch.Tensor
    """Flat (token, slot) indices in the order their rows were sent."""
    send_sizes: list[int]
    recv_sizes: list[int]
    slot: torch.Tensor
    """Where each received row sits in the experts' rows (grouped by local expert, padded where
    :func:`dispatch` was asked to align the groups)."""
    dtype: torch.dtype
    """The dispatched tokens' dtype (the residual stream's): :func:`combine` returns it."""


def dispatch(x_TH: torch.Tensor, experts_TK: torch.Tensor, num_experts: int, axis: Axis, *, align: int = 1):
    """``(x_NH, local_counts, routed)``: the rows this member's experts must process, grouped
    by local expert (``local_counts[l]`` rows for local expert l), and the record for
    :func:`combine`. Collective over ``axis``: the split sizes, then the rows.

    The rows travel in the dtype the experts' GEMMs read them in (:func:`~.grouped.gemm_dtype`:
    autocast's under autocast, where the residual stream stays float32): cast before the
    exchange, bit for bit what a cast after it gives, for half the bytes (:class:`CastRows`).

    ``align`` > 1: each local expert's group is padded with zero rows to a multiple of ``align``
    rows, at least ``align`` (:func:`~.grouped.pad_groups`; ``local_counts`` then count the
    padding, which :func:`combine` drops): the layout the grouped GEMMs want
    (:func:`~.grouped.group_alignment`), made in the permutation the rows take anyway."""
    n = axis.size
    num_local = num_experts // n
    order_A, counts_E = sort_by_expert(experts_TK, num_experts)
    recv_counts = comm.all_to_all_single(counts_E, axis, [num_local] * n, [num_local] * n).view(n, num_local)
    send_sizes = counts_E.view(n, num_local).sum(1).tolist()
    recv_sizes = recv_counts.sum(1).tolist()
    token_A, wire = order_A // experts_TK.shape[-1], gemm_dtype(x_TH)
    x_AH = x_TH[token_A] if wire == x_TH.dtype else CastRows.apply(x_TH, token_A, wire)
    x_recv = comm.AllToAllSingleAxis.apply(x_AH, axis, send_sizes, recv_sizes)
    perm = local_order(recv_counts)
    local_counts = recv_counts.sum(0).tolist()
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.numel(), device=perm.device)
    padded, shift = pad_groups(local_counts, align) if align > 1 else (local_counts, None)
    if padded == local_counts:  # nothing to pad
        return x_recv[perm], local_counts, Routed(axis, order_A, send_sizes, recv_sizes, inverse, x_TH.dtype)
    slot = padded_rows(local_counts, shift, x_recv.device)[inverse]
    x_NH = x_recv.new_zeros(sum(padded), x_recv.shape[-1]).index_copy(0, slot, x_recv)
    return x_NH, padded, Routed(axis, order_A, send_sizes, recv_sizes, slot, x_TH.dtype)


def combine(y_NH: torch.Tensor, weights_TK: torch.Tensor, routed: Routed) -> torch.Tensor:
    """``y_TH``: the experts' outputs (rows as :func:`dispatch` returned them) sent back to their
    tokens' members and summed over each token's k experts with its routing weights. The rows
    travel in ``y_NH``'s dtype; each is weighted and the k summed in the product's dtype (float32
    for float32 weights, as the serial layer weighs its experts' bf16 rows under autocast), and
    the sum returned in the dispatched tokens' dtype (the residual stream's: float32 under
    autocast, as the serial layer returns it). Collective over the axis of :func:`dispatch`."""
    y_AH = comm.AllToAllSingleAxis.apply(y_NH[routed.slot], routed.axis, routed.recv_sizes, routed.send_sizes)
    num_tokens, top_k = weights_TK.shape
    token_A = routed.order_A // top_k
    weighted_AH = y_AH * weights_TK.reshape(-1)[routed.order_A, None]
    y_TH = weighted_AH.new_zeros((num_tokens, y_NH.shape[-1])).index_add(0, token_A, weighted_AH)
    return y_TH.to(routed.dtype)

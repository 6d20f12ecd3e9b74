"""An MoE layer's tokens through its experts when this rank holds every expert (a trivial ``ep``
axis: a pipeline, tensor parallelism, data parallelism at ep = 1, one device), the capacity drops
nothing and the grouped GEMMs run: the routes made on the device alone, so the host never waits
for the device.

:class:`~.dispatch.Routes` reads each expert's row count to the host once per layer and forward:
the all-to-all's split sizes need them, and so does the loop over experts. Without an exchange,
and with ``torch._grouped_mm`` reading the groups' ends from the device, nothing does. The rows
are laid out in a number of rows the host knows without looking, ``N = ceil(T*K / a) * a + E * a``
(``a`` = :data:`~.grouped.GROUP_ROWS`): each expert's group padded to a multiple of ``a`` rows (at
least ``a``), the last group taking the rows left over. The padding rows are a copy of token 0's
row (any finite row does): their outputs are never read, and their gradient is exactly zero, so
they add nothing to the weights' gradients.

1. :func:`layout`: one stable sort of the (token, slot) assignments by expert and the count per
   expert (a scatter-add), and from them each assignment's row in the layout (``slot_A``, indexed
   by ``t*K + k``) and the groups' ends, all on the device;
2. :class:`GatherRows`: the layout's rows gathered from the tokens in one gather (cast to the
   GEMMs' dtype first, as :class:`~.rows.SendRows` casts); backward, each slot's gradient
   gathered token-major and the k summed in the tokens' dtype;
3. the experts (:class:`~.grouped.GroupEnds` through ``run_experts``: a transformers block's
   ``experts`` module is called, so its hooks fire);
4. :class:`TokenRows`: each assignment's output row gathered token-major ``[T, K, H]``, then
   weighed and summed over k in the product's dtype (float32 for float32 weights) and returned in
   the tokens' dtype, as :func:`~.dispatch.combine` returns it; backward, the gradient put back in
   the layout (zero at the padding).

No collective, no host read, no atomic accumulation (each backward is the adjoint gather or
scatter over the same index). Nothing here needs the host, so a compiled block traces it whole:
the layout, the gathers and the experts' GEMMs (:func:`~.grouped.grouped_mm`, an opaque operator)
are in the block's one graph, forward and backward. Tested in tests/unit/test_expert_local.py
against the serial layer and the routed path (forced on the CPU, where ``torch._grouped_mm`` runs
a loop of its own), and compiled whole against itself eager.
"""

from __future__ import annotations

import torch

from .dispatch import count_experts
from .grouped import GROUP_ROWS, GroupEnds, gemm_dtype, group_alignment

__all__ = ["GatherRows", "TokenRows", "layout", "local_exchange", "local_ready", "num_layout_rows"]


def local_ready(x_TH: torch.Tensor, block, routing) -> bool:
    """Whether :func:`local_exchange` runs an MoE block's tokens (``block``: its
    :class:`~.blocks.ExpertBlock`, ``routing``: their :class:`~behemoth.models.moe.Routing`) on a
    rank holding every expert: the grouped GEMMs' fast kernel for ``x_TH`` (device, build, bf16
    GEMMs), expert widths it takes, no assignment dropped by a capacity, and some tokens."""
    if not (block.grouped_widths and routing.experts_TK is routing.chosen_TK and x_TH.shape[0]):
        return False
    return group_alignment(x_TH) == GROUP_ROWS


def num_layout_rows(num_assignments: int, num_experts: int, align: int = GROUP_ROWS) -> int:
    """Rows of the layout: enough for every expert's group padded to a multiple of ``align`` (at
    least ``align``) whatever the routing, a multiple of ``align`` itself. Pure."""
    return -(-num_assignments // align) * align + num_experts * align


def layout(experts_TK: torch.Tensor, num_experts: int, align: int = GROUP_ROWS):
    """``(slot_A, ends_E, num_rows)``: the row of the layout each assignment ``t*K + k`` goes to
    (int64, on ``experts_TK``'s device), the groups' int32 ends (the last: ``num_rows``) and the
    layout's rows (:func:`num_layout_rows`). Expert e's assignments fill the first rows of its
    group in (token, slot) order, as the routed path's stable sort orders them. No host read."""
    T, K = experts_TK.shape
    A, device = T * K, experts_TK.device
    num_rows = num_layout_rows(A, num_experts, align)
    flat_A = experts_TK.reshape(-1)
    narrow = torch.int16 if num_experts < 2**15 else torch.int32
    order_A = torch.argsort(flat_A.to(narrow), stable=True)
    counts_E = count_experts(flat_A, num_experts)
    padded_E = torch.clamp_min((counts_E + (align - 1)) // align * align, align)
    ends_E = torch.cumsum(padded_E, 0)
    shift_E = (ends_E - padded_E) - (torch.cumsum(counts_E, 0) - counts_E)  # group start less run start
    sorted_slot_A = torch.arange(A, device=device) + shift_E.index_select(0, flat_A.index_select(0, order_A))
    slot_A = torch.empty_like(sorted_slot_A).index_copy_(0, order_A, sorted_slot_A)
    # the last group takes the rows left over (a device fill: assigning a Python number to an
    # element copies it from the host, which waits for the device)
    ends_E[-1:].fill_(num_rows)
    return slot_A, ends_E.to(torch.int32), num_rows


class GatherRows(torch.autograd.Function):
    """The layout's rows from the tokens, local: forward ``x_TH.to(dtype)[source]``, ``source[n]``
    the token of the assignment at row n (token 0 at a padding row). Backward: the slots' rows
    of the gradient gathered token-major (``grad[slot_A]`` as ``[T, K, H]``) and the k summed in
    ``x_TH``'s dtype, as the backward of ``x_TH[token].to(dtype)`` sums them."""

    @staticmethod
    def forward(ctx, x_TH, slot_A, num_rows: int, top_k: int, dtype: torch.dtype):
        token_A = torch.arange(slot_A.numel(), device=slot_A.device) // top_k
        source_N = slot_A.new_zeros(num_rows).index_copy_(0, slot_A, token_A)
        ctx.save_for_backward(slot_A)
        ctx.shape, ctx.dtype, ctx.top_k = x_TH.shape, x_TH.dtype, top_k
        return x_TH.to(dtype).index_select(0, source_N)

    @staticmethod
    def backward(ctx, grad_NH):
        (slot_A,) = ctx.saved_tensors
        (T, H), K = ctx.shape, ctx.top_k
        grad_TKH = grad_NH.index_select(0, slot_A).view(T, K, H)
        return grad_TKH.sum(1, dtype=ctx.dtype), None, None, None, None


class TokenRows(torch.autograd.Function):
    """Each assignment's row of the layout, token-major, local: forward ``y_NH[slot_A]`` as
    ``[T, K, H]``; backward the gradient put back at ``slot_A`` in the layout's rows (zero at the
    padding, so the padding adds nothing to the weights' gradients)."""

    @staticmethod
    def forward(ctx, y_NH, slot_A, top_k: int):
        ctx.save_for_backward(slot_A)
        ctx.num_rows = y_NH.shape[0]
        return y_NH.index_select(0, slot_A).view(-1, top_k, y_NH.shape[-1])

    @staticmethod
    def backward(ctx, grad_TKH):
        (slot_A,) = ctx.saved_tensors
        H = grad_TKH.shape[-1]
        grad_NH = grad_TKH.new_zeros((ctx.num_rows, H)).index_copy_(0, slot_A, grad_TKH.reshape(-1, H))
        return grad_NH, None, None


def local_exchange(
    x_TH: torch.Tensor, weights_TK: torch.Tensor, experts_TK: torch.Tensor, num_experts: int, run_experts, shared=None
) -> torch.Tensor:
    """``y_TH``: each token's rows through its k experts (``run_experts(x_NH, GroupEnds)``, every
    expert on this rank), weighted by ``weights_TK`` and summed (in the product's dtype), returned
    in ``x_TH``'s dtype, plus ``shared(x_TH)`` where it returns a tensor (see the module docstring). Local; no
    host read. ``experts_TK`` must name experts in ``[0, num_experts)`` (nothing dropped) and
    ``x_TH`` hold at least one token."""
    top_k = experts_TK.shape[1]
    slot_A, ends_E, num_rows = layout(experts_TK, num_experts)
    x_NH = GatherRows.apply(x_TH, slot_A, num_rows, top_k, gemm_dtype(x_TH))
    y_TKH = TokenRows.apply(run_experts(x_NH, GroupEnds(ends_E)), slot_A, top_k)
    y_TH = (y_TKH * weights_TK.unsqueeze(-1)).sum(1).to(x_TH.dtype)
    shared_TH = None if shared is None else shared(x_TH)
    return y_TH if shared_TH is None else y_TH + shared_TH

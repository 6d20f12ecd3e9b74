"""The rows of a dispatch and a combine on one member: the local autograd Functions that move them.

No communication: each Function gathers, scatters or weighs the rows this member holds, and
:mod:`.dispatch` runs them around its all-to-alls (their order in a forward: :mod:`.dispatch`'s
steps 3 and 5).

* :class:`SendRows` -- the rows a dispatch sends: each token's row cast to the experts' GEMM dtype
  once, then gathered once per kept (token, slot) assignment, in expert order;
* :class:`PlaceRows` -- received rows into the experts' layout (grouped by local expert, each group
  padded with zero rows where the grouped GEMMs want it) in one scatter;
* :class:`TakeRows` -- its adjoint: the experts' output rows in the order they arrived;
* :class:`WeighRows` -- the combine's weighted sum: each token's k rows weighted by its routing
  weights and summed in one ``index_add``, one autograd node for the weights' gather, the product
  and the sum.

:class:`~.dispatch.DispatchRows` and :class:`~.dispatch.CombineRows` run the same ops, one node per
step, through the helpers here (:func:`sum_slots`, :func:`scatter_rows`, :func:`weigh_forward`,
:func:`weigh_backward`); :mod:`.overlap` runs the Functions one by one.

Every permutation's backward is the adjoint gather or scatter over the same index (no sort and no
atomic accumulation: each is a permutation, and a token's k row gradients are summed as one
``[T, K, H]`` reduction). Each op is a kernel launch on the host-bound path :mod:`.dispatch`
describes: a scatter writes each row once (no full memset), and rows are sliced only where a
capacity dropped some.

Tested in tests/unit/test_expert_dispatch.py (:class:`WeighRows` bit for bit against the plain ops
it replaces; the op counts of a member's dispatch, combine and their backward),
tests/dist/test_expert_parallel.py and tests/dist/test_expert_overlap.py.
"""

from __future__ import annotations

import torch

__all__ = [
    "PlaceRows",
    "SendRows",
    "TakeRows",
    "WeighRows",
    "scatter_rows",
    "sum_slots",
    "weigh_backward",
    "weigh_forward",
]


class SendRows(torch.autograd.Function):
    """The rows a dispatch sends, local: forward ``x_TH.to(dtype)[token_A[:kept]]`` with ``token_A
    = order_A // K`` (a token's row cast once, then gathered once per kept assignment, in expert
    order; the gather is queued before the host waits for the split sizes, ``kept()``, which say
    how many are kept). Backward:
    each row's gradient put back at its (token, slot) position (zero for a dropped one) and a
    token's K summed in ``x_TH``'s dtype, as the backward of ``x_TH[token].to(dtype)`` sums them."""

    @staticmethod
    def forward(ctx, x_TH, order_A, token_A, top_k: int, dtype: torch.dtype, kept):
        rows_AH = x_TH.to(dtype).index_select(0, token_A)
        kept = kept()
        if kept < order_A.numel():  # a capacity dropped some (else no slicing)
            order_A, rows_AH = order_A[:kept], rows_AH[:kept]
        ctx.save_for_backward(order_A)
        ctx.shape, ctx.dtype, ctx.top_k = x_TH.shape, x_TH.dtype, top_k
        return rows_AH

    @staticmethod
    def backward(ctx, grad_AH: torch.Tensor):
        (order_A,) = ctx.saved_tensors
        return sum_slots(grad_AH, order_A, ctx.shape, ctx.top_k, ctx.dtype), None, None, None, None, None


def sum_slots(grad_AH: torch.Tensor, order_A: torch.Tensor, shape, top_k: int, dtype: torch.dtype) -> torch.Tensor:
    """:class:`SendRows`'s backward (and :class:`~.dispatch.DispatchRows`'): each row's gradient put back at its (token, slot) position
    ``order_A`` (zero at a dropped one) and a token's k summed in ``dtype``."""
    (T, H), K = shape, top_k
    make = grad_AH.new_empty if order_A.numel() == T * K else grad_AH.new_zeros  # every slot written
    grad_TKH = make((T * K, H)).index_copy_(0, order_A, grad_AH.contiguous()).view(T, K, H)
    return grad_TKH.sum(1, dtype=dtype)


def scatter_rows(rows_NH: torch.Tensor, slot: torch.Tensor, pad: torch.Tensor | None, num_rows: int) -> torch.Tensor:
    """``out[slot[i]] = rows_NH[i]`` in ``num_rows`` rows, the rows ``pad`` lists (all the others)
    zero: written once each, no full memset."""
    out = rows_NH.new_empty((num_rows, *rows_NH.shape[1:])).index_copy_(0, slot, rows_NH.contiguous())
    return out if pad is None else out.index_fill_(0, pad, 0)


class PlaceRows(torch.autograd.Function):
    """Received rows into the experts' layout, local: forward ``out[slot[i]] = rows[i]`` in
    ``num_rows`` rows (the rows ``pad`` lists, the groups' padding, zero); backward ``grad[slot]``
    (the adjoint gather)."""

    @staticmethod
    def forward(ctx, rows_NH, slot, pad, num_rows: int):
        ctx.save_for_backward(slot)
        return scatter_rows(rows_NH, slot, pad, num_rows)

    @staticmethod
    def backward(ctx, grad):
        (slot,) = ctx.saved_tensors
        return grad.index_select(0, slot), None, None, None


class TakeRows(torch.autograd.Function):
    """The adjoint of :class:`PlaceRows`, local: forward ``rows[slot]``; backward the gradient put
    back at ``slot`` in ``num_rows`` rows (zero at the rows ``pad`` lists)."""

    @staticmethod
    def forward(ctx, rows_NH, slot, pad, num_rows: int):
        ctx.save_for_backward(slot, *(() if pad is None else (pad,)))
        ctx.num_rows = num_rows
        return rows_NH.index_select(0, slot)

    @staticmethod
    def backward(ctx, grad):
        slot, *pad = ctx.saved_tensors
        return scatter_rows(grad, slot, pad[0] if pad else None, ctx.num_rows), None, None, None


class WeighRows(torch.autograd.Function):
    """The combine's weighted sum, local: forward ``y_TH[token_A[i]] += y_AH[i] * w_A[i]`` with
    ``w_A = weights_TK.flatten()[order_A]``, in the product's dtype (``index_add_`` into zeros),
    returned in ``dtype``. Backward, what autograd derives for those ops, without its graph of
    them: the gradient in the product's dtype gathered per row (``g_AH = grad[token_A]``), the
    rows' ``g_AH * w_A`` in ``y_AH``'s dtype, the weights' ``(g_AH * y_AH).sum(-1)`` put back at
    ``order_A`` (zero at a dropped slot) in ``weights_TK``'s dtype."""

    @staticmethod
    def forward(ctx, y_AH, weights_TK, order_A, token_A, dtype: torch.dtype):
        y_TH, w_A1 = weigh_forward(ctx, y_AH, weights_TK, order_A, token_A, dtype)
        ctx.save_for_backward(y_AH, w_A1, order_A, token_A)
        return y_TH

    @staticmethod
    def backward(ctx, grad_TH):
        y_AH, w_A1, order_A, token_A = ctx.saved_tensors
        grad_y, grad_w = weigh_backward(ctx, grad_TH, y_AH, w_A1, order_A, token_A, *ctx.needs_input_grad[:2])
        return grad_y, grad_w, None, None, None


def weigh_forward(ctx, y_AH, weights_TK, order_A, token_A, dtype: torch.dtype):
    """:class:`WeighRows`'s forward (and :class:`~.dispatch.CombineRows`'): ``(y_TH, w_A1)``; what its backward needs of the weights kept
    on ``ctx``."""
    w_A1 = torch.take(weights_TK, order_A).unsqueeze(1)
    weighted_AH = y_AH * w_A1
    y_TH = weighted_AH.new_zeros((weights_TK.shape[0], y_AH.shape[-1])).index_add_(0, token_A, weighted_AH)
    ctx.wshape, ctx.wdtype, ctx.acc = weights_TK.shape, weights_TK.dtype, weighted_AH.dtype
    return y_TH.to(dtype), w_A1


def weigh_backward(ctx, grad_TH, y_AH, w_A1, order_A, token_A, rows: bool, weights: bool):
    """:class:`WeighRows`'s backward (and :class:`~.dispatch.CombineRows`'): the gradients of the rows and of the weights (each None
    unless asked for)."""
    g_AH = grad_TH.to(ctx.acc).index_select(0, token_A)
    grad_y = grad_w = None
    if rows:
        grad_y = (g_AH * w_A1).to(y_AH.dtype)
    if weights:
        grad_A = (g_AH * y_AH).sum(1)
        make = grad_A.new_empty if order_A.numel() == ctx.wshape.numel() else grad_A.new_zeros  # every slot put
        grad_w = make(ctx.wshape).put_(order_A, grad_A).to(ctx.wdtype)
    return grad_y, grad_w

"""Token exchange for expert parallelism that sends each token once per member holding any of its
experts (DeepEP's and Tutel's dispatch), instead of once per (token, expert) assignment.

With fine-grained experts a token's k experts often sit on few members (OLMoE's top-8 of 64 at
ep = 2: every token reaches both members, 2 rows instead of 8), so :mod:`.dispatch` sends the
same row to a member several times. Here, per MoE layer and forward:

1. **routes** (:class:`MemberRoutes`, made once per layer and forward, replayed by a
   checkpointed block's recompute, :mod:`.replay`, with the weights and slots received): the unique (member, token) pairs, in member
   then token order (one stable sort of ``ep * T`` one-bit keys); the split sizes -- for each
   member the assignments to each of its local experts and the pairs it gets -- exchanged with
   one even all-to-all of ``E + ep`` int64 per member, then read to the host **once**
   (:class:`~.dispatch.HostSizes`);
2. **dispatch**: each pair's row (cast to the experts' GEMM dtype, :class:`SendPairs`) in one
   uneven all-to-all, beside each pair's routing weights and the token's slots as the receiver's
   local experts (``L`` where another member holds the slot's expert) in a second, float32
   (:class:`SendMeta`: the weights' gradient travels back through it);
3. the receiver expands each received row to its local experts, grouped by local expert (one
   stable sort of the received slots, made once per routes) and padded for the grouped GEMMs as
   :func:`~.dispatch.dispatch` pads them (:class:`ExpandRows`): the experts see the rows
   :func:`~.dispatch.dispatch` gives them, in the same order;
4. **combine**: the receiver weighs each local expert's output by its routing weight and sums a
   received row's local experts in the product's dtype (float32 for float32 weights), sends that
   row back in the experts' output dtype in one all-to-all, and the sender sums a token's rows
   from the members in the product's dtype (:class:`SumMembers`), returned in the dispatched
   tokens' dtype.

The sender's permutations and their backwards are gathers and dense sums over a ``[ep, T, ...]``
layout (no atomic accumulation); the receiver's sums over a row's local experts (the expansion's
backward and the weighted sum) are ``index_add_`` in the accumulation dtype, as
:func:`~.dispatch.combine` sums a token's k rows. The sums add in another order than
:func:`~.dispatch.combine` (a member's local experts, then the members), so outputs and input
gradients agree with it up to rounding; the experts' inputs and their parameters' gradients are
the same. Under 16-bit GEMMs a member's partial sum travels back rounded to the GEMMs' dtype.

Used by :class:`~.style.ExpertParallel` where :func:`dedup_applies` (``Plan.ep_dedup``; ep > 1,
top-k > 1, more than one expert per member, dropless, one chunk). Bytes:
:func:`~.traffic.ep_all_to_all_bytes` with ``pairs``. Tested in tests/dist/test_expert_dedup.py
against :func:`~.dispatch.dispatch` / :func:`~.dispatch.combine` and serial training.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ... import comm
from ...comm import Axis
from .dispatch import HostSizes, TakeRows, count_experts, padding_rows
from .grouped import gemm_dtype, pad_groups, to_device

__all__ = [
    "ExpandRows",
    "MemberRoutes",
    "SendMeta",
    "SendPairs",
    "SumMembers",
    "dedup_applies",
    "exchange_members",
    "meta_dtype",
]


def dedup_applies(*, ep: int, num_experts: int, top_k: int, chunks: int, dropless: bool) -> bool:
    """Whether :func:`exchange_members` sends fewer rows than the per-assignment exchange, from
    static facts: more than one member, more than one expert a token and a member (else every
    slot of a token is on another member), dropless (a capacity's drops are the per-assignment
    routes' to make) and one chunk (``Plan.ep_overlap`` runs the per-assignment routes). Pure."""
    return ep > 1 and top_k > 1 and num_experts // ep > 1 and chunks == 1 and dropless


def meta_dtype(weights: torch.Tensor) -> torch.dtype:
    """The dtype the routing weights and slots travel in: float32 (slot numbers are exact below
    2**24), float64 for float64 weights."""
    return torch.promote_types(weights.dtype, torch.float32)


@dataclass
class _Sizes:
    send: list[int]
    """Pairs this member sends to each member."""
    recv: list[int]
    """Pairs this member receives from each member."""
    local_counts: list[int]
    """Assignments to each local expert, received from every member."""


@dataclass
class _Sender:
    pair_P: torch.Tensor
    """The pairs ``member * T + token`` in member, then token order."""
    token_P: torch.Tensor
    local_PK: torch.Tensor
    """Each pair's slots as the member's local experts (``L``: another member's)."""


@dataclass
class _Layout:
    row_J: torch.Tensor
    """The received row of each local assignment, grouped by local expert (rows in arrival order)."""
    flat_J: torch.Tensor
    """Their ``row * K + slot``."""
    slot_J: torch.Tensor | None
    """Where each sits in the experts' padded layout (None: at its own index, no padding)."""
    pad: torch.Tensor | None
    num_rows: int
    counts: list[int]
    """Rows of each local expert in the layout (its padding included)."""


class MemberRoutes:
    """One MoE layer's member routes for one forward (see the module docstring): made by
    :meth:`build`; the pairs, and on the receiving side the local layout, computed once."""

    def __init__(self, axis: Axis, num_experts: int, experts_TK, order, recv, pending: HostSizes, align: int):
        self.axis, self.num_experts, self.align = axis, num_experts, align
        self.experts_TK = experts_TK
        self.order, self.recv, self.pending = order, recv, pending
        self._sizes: _Sizes | None = None
        self._sender: _Sender | None = None
        self._layout: _Layout | None = None
        self.received: torch.Tensor | None = None
        """The weights and slots received (:class:`SendMeta`), kept for a recompute."""

    @property
    def chunks(self) -> int:
        return 1

    @staticmethod
    def build(experts_TK: torch.Tensor, num_experts: int, axis: Axis, *, align: int = 1) -> MemberRoutes:
        """The member routes of ``experts_TK`` (``[T, K]``, every expert in ``[0, E)``) over
        ``axis``. Collective over ``axis``: the split sizes' even all-to-all; their host read is
        started, not waited for."""
        n = axis.size
        num_local = num_experts // n
        T = experts_TK.shape[0]
        device = experts_TK.device
        member_TK = experts_TK.long() // num_local
        hit = torch.zeros(n * T, dtype=torch.int16, device=device)
        hit.scatter_(0, (member_TK * T + torch.arange(T, device=device)[:, None]).reshape(-1), 1)
        pairs_N = hit.view(n, T).sum(1, dtype=torch.int64)
        counts_E = count_experts(experts_TK.reshape(-1), num_experts)
        send = torch.cat([counts_E.view(n, num_local), pairs_N[:, None]], 1).reshape(-1)
        block = [num_local + 1] * n
        recv = comm.all_to_all_single(send, axis, block, block)
        pending = HostSizes(torch.cat([pairs_N, recv]))
        order = torch.argsort(1 - hit, stable=True)  # the pairs first, in (member, token) order
        return MemberRoutes(axis, num_experts, experts_TK, order, recv, pending, align)

    def sizes(self) -> _Sizes:
        """The split sizes (the first call waits for their host read)."""
        if self._sizes is None:
            n, num_local = self.axis.size, self.num_experts // self.axis.size
            v = self.pending.wait()
            recv_RL = [v[n + r * (num_local + 1) : n + (r + 1) * (num_local + 1)] for r in range(n)]
            local = [sum(row[l] for row in recv_RL) for l in range(num_local)]
            self._sizes = _Sizes(v[:n], [row[-1] for row in recv_RL], local)
        return self._sizes

    def sender(self) -> _Sender:
        if self._sender is None:
            T = self.experts_TK.shape[0]
            num_local = self.num_experts // self.axis.size
            pair_P = self.order[: sum(self.sizes().send)]
            token_P = pair_P % T if T else pair_P
            local_PK = self.experts_TK.long().index_select(0, token_P) - (pair_P // max(T, 1) * num_local)[:, None]
            local_PK = local_PK.masked_fill((local_PK < 0) | (local_PK >= num_local), num_local)
            self._sender = _Sender(pair_P, token_P, local_PK)
        return self._sender

    def layout(self, local_QK: torch.Tensor) -> _Layout:
        """The received rows' local assignments grouped by local expert, from the slots received
        (``local_QK``); made on the first call and kept (a recompute receives the same slots)."""
        if self._layout is None:
            sizes, K = self.sizes(), local_QK.shape[1]
            counts = sizes.local_counts
            narrow = torch.int16 if len(counts) < 2**15 else torch.int32
            flat_J = torch.argsort(local_QK.reshape(-1).to(narrow), stable=True)[: sum(counts)]
            padded = pad_groups(counts, self.align)[0] if self.align > 1 else counts
            slot_J = pad = None
            if padded != counts:
                shift = pad_groups(counts, self.align)[1]
                device, total = local_QK.device, sum(counts)
                shift_L, counts_L = to_device(shift + counts, device).split([len(shift), len(counts)])
                slot_J = torch.arange(total, device=device) + torch.repeat_interleave(
                    shift_L, counts_L, output_size=total
                )
                rows = padding_rows(counts, padded)
                pad = to_device(rows, device) if rows else None
            self._layout = _Layout(flat_J // K, flat_J, slot_J, pad, sum(padded), list(padded))
        return self._layout


class SendPairs(torch.autograd.Function):
    """The rows a member dispatch sends, local: forward ``x_TH.to(dtype)[token_P]`` (a token's row
    cast once, gathered once per member it goes to). Backward: each pair's gradient put at
    ``pair_P`` of an ``[ep * T, H]`` layout and summed over the members in ``x_TH``'s dtype (a
    token's rows in member order; no atomics)."""

    @staticmethod
    def forward(ctx, x_TH, pair_P, token_P, members: int, dtype: torch.dtype):
        ctx.save_for_backward(pair_P)
        ctx.shape, ctx.dtype, ctx.members = x_TH.shape, x_TH.dtype, members
        return x_TH.to(dtype).index_select(0, token_P)

    @staticmethod
    def backward(ctx, grad_PH):
        (pair_P,) = ctx.saved_tensors
        (T, H), n = ctx.shape, ctx.members
        make = grad_PH.new_empty if pair_P.numel() == n * T else grad_PH.new_zeros
        grad = make((n * T, H)).index_copy_(0, pair_P, grad_PH.contiguous())
        return grad.view(n, T, H).sum(0, dtype=ctx.dtype), None, None, None, None


class SendMeta(torch.autograd.Function):
    """What a receiver needs of each pair besides its row, exchanged over ``axis``: forward the
    pair's k routing weights and its slots as the receiver's local experts (``local_PK``), one
    ``[P, 2K]`` all-to-all in :func:`meta_dtype`; returns the received ``(weights_QK, local_QK)``
    (the slots as int64, not differentiable). Backward: the weights' gradient sent back (``[Q,
    2K]``, the slots' half zero: each member sends back what it received, so the bytes a member
    books do not depend on which way its pairs went), put at ``pair_P`` of an ``[ep * T, K]`` layout and summed over the members (a slot's
    gradient comes from the one member holding its expert: the sum is exact). What a member
    received is kept in ``routes`` (:class:`MemberRoutes`): a checkpointed block's recompute,
    which replays the routes and routes the same weights, takes it from there without the
    exchange (its backward still sends the gradient back)."""

    @staticmethod
    def forward(ctx, weights_TK, pair_P, token_P, local_PK, axis: Axis, send: list[int], recv: list[int], routes):
        K = weights_TK.shape[1]
        got = routes.received
        if got is None:
            dtype = meta_dtype(weights_TK)
            meta = torch.cat([weights_TK.index_select(0, token_P).to(dtype), local_PK.to(dtype)], 1)
            got = routes.received = comm.all_to_all_single(meta, axis, send, recv)
        ctx.save_for_backward(pair_P)
        ctx.axis, ctx.send, ctx.recv, ctx.shape, ctx.dtype = axis, send, recv, weights_TK.shape, weights_TK.dtype
        local_QK = got[:, K:].long()
        ctx.mark_non_differentiable(local_QK)
        return got[:, :K].contiguous(), local_QK

    @staticmethod
    def backward(ctx, grad_QK, _):
        (pair_P,) = ctx.saved_tensors
        (T, K), n = ctx.shape, ctx.axis.size
        # the slots' place stays in the message (zero): as many bytes back as out, from each member
        grad_Q2K = torch.cat([grad_QK, torch.zeros_like(grad_QK)], 1)
        back = comm.all_to_all_single(grad_Q2K, ctx.axis, ctx.recv, ctx.send)[:, :K]
        grad = back.new_zeros((n * T, K)).index_copy_(0, pair_P, back)
        return grad.view(n, T, K).sum(0).to(ctx.dtype), None, None, None, None, None, None, None


class ExpandRows(torch.autograd.Function):
    """The received rows into the experts' layout, local: forward row ``row_J[j]`` at ``slot_J[j]``
    (at ``j`` where ``slot_J`` is None) of ``num_rows`` rows, the rows ``pad`` lists zero.
    Backward: each layout row's gradient added to its received row (a row's local experts
    summed, ``index_add_`` in float32 or wider), returned in the rows' dtype."""

    @staticmethod
    def forward(ctx, x_QH, row_J, slot_J, pad, num_rows: int):
        ctx.save_for_backward(row_J, *(() if slot_J is None else (slot_J,)))
        ctx.num_in = x_QH.shape[0]
        rows = x_QH.index_select(0, row_J)
        if slot_J is None:
            return rows
        out = rows.new_empty((num_rows, x_QH.shape[1])).index_copy_(0, slot_J, rows)
        return out if pad is None else out.index_fill_(0, pad, 0)

    @staticmethod
    def backward(ctx, grad_NH):
        row_J, *slot = ctx.saved_tensors
        grad_JH = grad_NH.index_select(0, slot[0]) if slot else grad_NH
        acc = torch.promote_types(grad_NH.dtype, torch.float32)
        grad = grad_NH.new_zeros((ctx.num_in, grad_NH.shape[1]), dtype=acc).index_add_(0, row_J, grad_JH.to(acc))
        return grad.to(grad_NH.dtype), None, None, None, None


class SumMembers(torch.autograd.Function):
    """A token's rows back from the members summed, local: forward each pair's row put at
    ``pair_P`` of an ``[ep * T, H]`` layout (zero elsewhere), summed over the members in ``acc``
    and returned in ``dtype``; backward the token's gradient gathered for each of its pairs."""

    @staticmethod
    def forward(ctx, rows_PH, pair_P, token_P, num_tokens: int, members: int, acc, dtype):
        ctx.save_for_backward(token_P)
        ctx.dtype = rows_PH.dtype
        n, T, H = members, num_tokens, rows_PH.shape[1]
        make = rows_PH.new_empty if pair_P.numel() == n * T else rows_PH.new_zeros
        laid = make((n * T, H)).index_copy_(0, pair_P, rows_PH)
        return laid.view(n, T, H).sum(0, dtype=acc).to(dtype)

    @staticmethod
    def backward(ctx, grad_TH):
        (token_P,) = ctx.saved_tensors
        return grad_TH.index_select(0, token_P).to(ctx.dtype), None, None, None, None, None, None


@torch.compiler.disable  # eager in compiled blocks: a host read sizes the exchange
def exchange_members(x_TH: torch.Tensor, weights_TK: torch.Tensor, routes: MemberRoutes, run_experts, shared=None):
    """``y_TH``: each token's row sent once to every member holding one of its experts, through
    those experts (``run_experts(x_NH, local_counts)``), weighted, summed per member and back, the
    members' sums added (see the module docstring); plus ``shared(x_TH)`` where given. Collective
    over the routes' axis: three all-to-alls forward (rows, weights and slots, rows back; two in
    a recompute, which keeps the weights and slots the forward received) and three backward; the
    routes' one host read."""
    axis, n, T = routes.axis, routes.axis.size, x_TH.shape[0]
    sizes = routes.sizes()
    s = routes.sender()
    rows_PH = SendPairs.apply(x_TH, s.pair_P, s.token_P, n, gemm_dtype(x_TH))
    x_QH = comm.AllToAllSingleAxis.apply(rows_PH, axis, sizes.send, sizes.recv)
    meta = (s.pair_P, s.token_P, s.local_PK, axis, sizes.send, sizes.recv, routes)
    w_QK, local_QK = SendMeta.apply(weights_TK, *meta)
    lay = routes.layout(local_QK)
    x_NH = ExpandRows.apply(x_QH, lay.row_J, lay.slot_J, lay.pad, lay.num_rows)
    y_NH = run_experts(x_NH, lay.counts)
    y_JH = y_NH if lay.slot_J is None else TakeRows.apply(y_NH, lay.slot_J, lay.pad, lay.num_rows)
    w_J = w_QK.to(weights_TK.dtype).reshape(-1).index_select(0, lay.flat_J)
    weighted_JH = y_JH * w_J[:, None]
    acc = weighted_JH.dtype
    partial_QH = weighted_JH.new_zeros((x_QH.shape[0], y_NH.shape[-1])).index_add_(0, lay.row_J, weighted_JH)
    back_PH = comm.AllToAllSingleAxis.apply(partial_QH.to(y_NH.dtype), axis, sizes.recv, sizes.send)
    y_TH = SumMembers.apply(back_PH, s.pair_P, s.token_P, T, n, acc, x_TH.dtype)
    shared_TH = None if shared is None else shared(x_TH)
    return y_TH if shared_TH is None else y_TH + shared_TH

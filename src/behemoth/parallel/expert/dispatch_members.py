"""Token exchange for expert parallelism that sends each token once per member holding any of its
experts (DeepEP's and Tutel's dispatch), instead of once per (token, expert) assignment.

With fine-grained experts a token's k experts often sit on few members (OLMoE's top-8 of 64 at
ep = 2: every token reaches both members, 2 rows instead of 8), so :mod:`.dispatch` sends the
same row to a member several times. Here, per MoE layer and forward:

1. **routes** (:class:`MemberRoutes`, made once per layer and forward, replayed by a
   checkpointed block's recompute, :mod:`.replay`): the unique (member, token) pairs, in member
   then token order (one stable sort of ``ep * T`` one-bit keys); the split sizes -- for each
   member the assignments to each of its local experts and the pairs it gets -- exchanged with
   one even all-to-all of ``E + ep`` int64 per member, received beside the pair counts, and
   read to the host **once** (:class:`~.dispatch.HostSizes`);
2. **dispatch**: each pair's row, cast to the experts' GEMM dtype, with the pair's k routing
   weights (float32) and the token's slots as the receiver's local experts (int16; ``L`` where
   another member holds the slot's expert) packed as bytes after it, in one uneven all-to-all
   (:class:`SendPairs`: the weights' gradient travels back with the rows'; a recompute sends the
   rows alone, the weights and slots kept from its forward);
3. the receiver gathers each received row once per local expert into the experts' layout,
   grouped by local expert (one stable sort of the received slots, made once per routes) and
   padded for the grouped GEMMs as :func:`~.dispatch.dispatch` pads them (:class:`ExpandRows`):
   the experts see the rows :func:`~.dispatch.dispatch` gives them, in the same order;
4. **combine**: the receiver weighs each layout row by its routing weight (zero for padding)
   and sums a received row's local experts in the product's dtype (float32 for float32
   weights), sends that row back in the experts' output dtype in one all-to-all, and the sender
   sums a token's rows from the members in the product's dtype (:class:`SumMembers`), returned
   in the dispatched tokens' dtype.

The sender's permutations and their backwards are gathers and dense sums over a ``[ep, T, ...]``
layout (no atomic accumulation); the receiver's sums over a row's local experts (the expansion's
backward and the weighted sum) are ``index_add_`` in the accumulation dtype, as
:func:`~.dispatch.combine` sums a token's k rows. The sums add in another order than
:func:`~.dispatch.combine` (a member's local experts, then the members), so outputs and input
gradients agree with it up to rounding; the experts' inputs and their parameters' gradients are
the same. Under 16-bit GEMMs a member's partial sum travels back rounded to the GEMMs' dtype.

Used by :class:`~.style.ExpertParallel` where :func:`dedup_applies` (``Plan.ep_dedup``, off by
default; ep > 1, top-k > 1, more than one expert per member, dropless, one chunk). Bytes:
:func:`~.traffic.ep_all_to_all_bytes` with ``pairs``. Tested in tests/dist/test_expert_dedup.py
against :func:`~.dispatch.dispatch` / :func:`~.dispatch.combine` and serial training.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ... import comm
from ...comm import Axis
from .dispatch import HostSizes, count_experts
from .grouped import gemm_dtype, pad_groups, to_device

__all__ = [
    "ExpandRows",
    "MemberRoutes",
    "SendPairs",
    "SumMembers",
    "dedup_applies",
    "exchange_members",
    "meta_columns",
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
    src_N: torch.Tensor
    """The received row each row of the experts' layout holds (grouped by local expert, rows in
    arrival order, each group padded; a padding row: the last received row)."""
    dst_N: torch.Tensor
    """The same, a padding row ``Q`` (one past the received rows): where the weighted sum adds it."""
    weight_N: torch.Tensor
    """Each layout row's ``row * K + slot`` (a padding row: ``Q * K``, a zero weight)."""
    counts: list[int]
    """Rows of each local expert in the layout (its padding included)."""


class MemberRoutes:
    """One MoE layer's member routes for one forward (see the module docstring): made by
    :meth:`build`; the pairs, and on the receiving side the local layout, computed once."""

    def __init__(self, axis: Axis, num_experts: int, local_CK, order, recv, pending: HostSizes, align: int):
        self.axis, self.num_experts, self.align = axis, num_experts, align
        self.local_CK = local_CK
        """Each candidate pair ``member * T + token``'s slots as the member's local experts."""
        self.order, self.recv, self.pending = order, recv, pending
        self._sizes: _Sizes | None = None
        self._sender: _Sender | None = None
        self._layout: _Layout | None = None
        self.received: tuple[torch.Tensor, torch.Tensor] | None = None
        """The routing weights and slots received (:class:`SendPairs`), kept for a recompute."""

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
        T, K = experts_TK.shape
        device = experts_TK.device
        member_TK = experts_TK.long() // num_local
        hit = torch.zeros(n * T, dtype=torch.int16, device=device)
        hit.scatter_(0, (member_TK * T + torch.arange(T, device=device)[:, None]).reshape(-1), 1)
        # the pairs per member, then the split sizes received, in one buffer: the host reads it whole
        both = torch.empty(n * (num_local + 2), dtype=torch.int64, device=device)
        pairs_N, recv = both.split_with_sizes([n, n * (num_local + 1)])
        torch.sum(hit.view(n, T), 1, dtype=torch.int64, out=pairs_N)
        counts_E = count_experts(experts_TK.reshape(-1), num_experts)
        send = torch.cat([counts_E.view(n, num_local), pairs_N[:, None]], 1).reshape(-1)
        block = [num_local + 1] * n
        comm.all_to_all_single(send, axis, block, block, out=recv)
        pending = HostSizes(both)
        order = torch.argsort(hit, descending=True, stable=True)  # the pairs first, in (member, token) order
        # each candidate pair's slots as that member's local experts (L: another member's)
        members = torch.arange(n, device=device)[:, None, None]
        local_NTK = torch.where(member_TK == members, experts_TK % num_local, num_local)
        return MemberRoutes(axis, num_experts, local_NTK.view(n * T, K), order, recv, pending, align)

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
            T = self.local_CK.shape[0] // self.axis.size
            pair_P = self.order[: sum(self.sizes().send)]
            token_P = pair_P % T if T else pair_P
            self._sender = _Sender(pair_P, token_P, self.local_CK.index_select(0, pair_P))
        return self._sender

    def layout(self, local_QK: torch.Tensor) -> _Layout:
        """The received rows' local assignments grouped by local expert, from the slots received
        (``local_QK``); made on the first call and kept (a recompute receives the same slots)."""
        if self._layout is None:
            counts, (Q, K) = self.sizes().local_counts, local_QK.shape
            narrow = torch.int16 if len(counts) < 2**15 else torch.int32
            flat_J = torch.argsort(local_QK.reshape(-1).to(narrow), stable=True)[: sum(counts)]
            padded, shift = pad_groups(counts, self.align) if self.align > 1 else (counts, None)
            if padded == counts:
                row_J = flat_J // K
                self._layout = _Layout(row_J, row_J, flat_J, list(counts))
            else:
                device, total, rows = local_QK.device, sum(counts), sum(padded)
                shift_L, counts_L = to_device(shift + counts, device).split([len(shift), len(counts)])
                slot_J = torch.arange(total, device=device) + torch.repeat_interleave(
                    shift_L, counts_L, output_size=total
                )
                weight_N = flat_J.new_full((rows,), Q * K).index_copy_(0, slot_J, flat_J)
                dst_N = weight_N // K  # a padding row: Q
                self._layout = _Layout(dst_N.clamp(max=max(Q - 1, 0)), dst_N, weight_N, list(padded))
        return self._layout


def meta_columns(top_k: int, weight_bytes: int, elem_bytes: int) -> int:
    """Columns of a row (``elem_bytes`` each) that carry its pair's k routing weights
    (``weight_bytes`` each) and k int16 slots. Pure."""
    return -(-top_k * (weight_bytes + 2) // elem_bytes)


def _bytes_as(bytes_NB: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Columns of bytes (a view into wider rows) copied out dense and read as ``dtype``."""
    return bytes_NB.new_empty(bytes_NB.shape).copy_(bytes_NB).view(dtype)


class SendPairs(torch.autograd.Function):
    """A member dispatch, collective over ``axis``: each pair's row (``x_TH.to(dtype)[token_P]``: a
    token's row cast once, gathered once per member it goes to) with its k routing weights (in
    :func:`meta_dtype`) and its slots as the receiver's local experts (``local_PK``, int16) packed
    after it (:func:`meta_columns`, their bytes), in one uneven all-to-all. Returns the received
    ``(x_QH, weights_QK, local_QK)`` (the slots int64, not differentiable). Backward: the rows'
    and weights' gradients packed alike and sent back (as wide as they came, so a member's bytes
    do not depend on which way its pairs went), each put at ``pair_P`` of an ``[ep * T, ...]``
    layout and summed over the members (the rows in ``x_TH``'s dtype; a slot's weight gradient
    comes from the one member holding its expert, so that sum is exact; no atomics). What a member
    received is kept in ``routes`` (:class:`MemberRoutes`): a checkpointed block's recompute, which
    replays the routes and routes the same weights, sends the rows alone and takes the weights and
    slots from there (its backward sends the weights' gradient back all the same)."""

    @staticmethod
    def forward(ctx, x_TH, weights_TK, pair_P, token_P, local_PK, axis: Axis, send, recv, dtype, routes):
        (T, H), K = x_TH.shape, weights_TK.shape[1]
        wdt = meta_dtype(weights_TK)
        ws, m = wdt.itemsize, meta_columns(K, wdt.itemsize, dtype.itemsize)
        if routes.received is not None:  # a recompute: the weights and slots its forward received
            got = comm.all_to_all_single(x_TH.to(dtype).index_select(0, token_P), axis, send, recv)
            weights_QK, local_QK = (t.clone() for t in routes.received)
        else:
            wide = x_TH.new_empty((T, H + m), dtype=dtype)
            wide[:, :H] = x_TH
            packed = wide.index_select(0, token_P)
            meta = packed[:, H:].view(torch.uint8)
            meta[:, : K * ws] = weights_TK.index_select(0, token_P).to(wdt).view(torch.uint8)
            meta[:, K * ws : K * (ws + 2)] = local_PK.to(torch.int16).view(torch.uint8)
            got = comm.all_to_all_single(packed, axis, send, recv)
            got_meta = got[:, H:].view(torch.uint8)
            weights_QK = _bytes_as(got_meta[:, : K * ws], wdt)
            local_QK = _bytes_as(got_meta[:, K * ws : K * (ws + 2)], torch.int16).long()
            routes.received = (weights_QK.detach(), local_QK)
        ctx.save_for_backward(pair_P)
        ctx.axis, ctx.send, ctx.recv, ctx.m, ctx.wdt = axis, send, recv, m, wdt
        ctx.shape, ctx.dtype, ctx.wshape, ctx.wdtype = x_TH.shape, x_TH.dtype, weights_TK.shape, weights_TK.dtype
        ctx.mark_non_differentiable(local_QK)
        return got[:, :H], weights_QK, local_QK

    @staticmethod
    def backward(ctx, grad_QH, grad_QK, _):
        (pair_P,) = ctx.saved_tensors
        (T, H), K, n, wdt = ctx.shape, ctx.wshape[1], ctx.axis.size, ctx.wdt
        ws = wdt.itemsize
        buf = grad_QH.new_empty((grad_QH.shape[0], H + ctx.m))
        buf[:, :H] = grad_QH
        if grad_QK is None:
            grad_QK = grad_QH.new_zeros((grad_QH.shape[0], K), dtype=wdt)
        buf[:, H:].view(torch.uint8)[:, : K * ws] = grad_QK.to(wdt).contiguous().view(torch.uint8)
        back = comm.all_to_all_single(buf, ctx.axis, ctx.recv, ctx.send)
        full = pair_P.numel() == n * T
        rows = (back.new_empty if full else back.new_zeros)((n * T, H)).index_copy_(0, pair_P, back[:, :H])
        w_PK = _bytes_as(back[:, H:].view(torch.uint8)[:, : K * ws], wdt)
        w = w_PK.new_zeros((n * T, K)).index_copy_(0, pair_P, w_PK)
        grad_x = rows.view(n, T, H).sum(0, dtype=ctx.dtype)
        return grad_x, w.view(n, T, K).sum(0).to(ctx.wdtype), None, None, None, None, None, None, None, None


class ExpandRows(torch.autograd.Function):
    """The received rows into the experts' layout, local: forward ``x_QH[src_N]`` (a padding row
    a copy of a received row: any finite row does, its output is weighed by zero and its gradient is
    exactly zero; all zero where nothing was received). Backward: each layout row's gradient
    added to its received row (a row's local experts summed, ``index_add_`` in float32 or wider),
    returned in the rows' dtype."""

    @staticmethod
    def forward(ctx, x_QH, src_N):
        ctx.save_for_backward(src_N)
        ctx.num_in = x_QH.shape[0]
        if not ctx.num_in:
            return x_QH.new_zeros((src_N.numel(), x_QH.shape[1]))
        return x_QH.index_select(0, src_N)

    @staticmethod
    def backward(ctx, grad_NH):
        (src_N,) = ctx.saved_tensors
        acc = torch.promote_types(grad_NH.dtype, torch.float32)
        grad = grad_NH.new_zeros((ctx.num_in, grad_NH.shape[1]), dtype=acc)
        if ctx.num_in:
            grad.index_add_(0, src_N, grad_NH.to(acc))
        return grad.to(grad_NH.dtype), None


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
    over the routes' axis: two all-to-alls forward (the rows with their weights and slots, the
    rows back) and two backward; the routes' one host read."""
    axis, n, T = routes.axis, routes.axis.size, x_TH.shape[0]
    sizes, s = routes.sizes(), routes.sender()
    pairs = (s.pair_P, s.token_P, s.local_PK, axis, sizes.send, sizes.recv, gemm_dtype(x_TH), routes)
    x_QH, w_QK, local_QK = SendPairs.apply(x_TH, weights_TK, *pairs)
    lay = routes.layout(local_QK)
    y_NH = run_experts(ExpandRows.apply(x_QH, lay.src_N), lay.counts)
    w_flat = w_QK.to(weights_TK.dtype).reshape(-1)
    w_N = torch.cat([w_flat, w_flat.new_zeros(1)]).index_select(0, lay.weight_N)  # zero at the padding
    weighted_NH = y_NH * w_N[:, None]  # in the product's dtype, as combine weighs
    Q = x_QH.shape[0]
    partial_QH = weighted_NH.new_zeros((Q + 1, y_NH.shape[-1])).index_add_(0, lay.dst_N, weighted_NH)[:Q]
    back_PH = comm.AllToAllSingleAxis.apply(partial_QH.to(y_NH.dtype), axis, sizes.recv, sizes.send)
    y_TH = SumMembers.apply(back_PH, s.pair_P, s.token_P, T, n, weighted_NH.dtype, x_TH.dtype)
    shared_TH = None if shared is None else shared(x_TH)
    return y_TH if shared_TH is None else y_TH + shared_TH

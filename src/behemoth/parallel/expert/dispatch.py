"""Token dispatch and combine for expert parallelism: tokens travel to their experts' ranks and back.

The E experts are sharded over the ``ep`` axis in contiguous blocks (member r holds experts
``r*E/n ... (r+1)*E/n - 1``). A forward through the experts is

1. **routes** (:class:`Routes`, made once per layer and forward): the T*K (token, slot)
   assignments sorted by (chunk, expert) in one stable argsort, which the combine and both
   backwards reuse (the tokens are split into ``chunks`` contiguous runs, :func:`chunk_sizes`:
   one unless the exchange is overlapped with the experts' GEMMs, :mod:`.overlap`), so the rows
   of one chunk for member r are one contiguous run; the assignments per chunk and expert
   counted on the device (no host read);
2. **split sizes**: every member's per-chunk, per-expert counts exchanged with one even
   all-to-all of ``chunks * E`` integers, received into the buffer the counts were made in, and
   that buffer read to the host **once** (:class:`HostSizes`: started right after the exchange,
   into pinned memory, while the device goes on gathering the rows): the only wait of the host
   per layer and step -- the backward reads nothing, and a recompute under activation
   checkpointing replays the routes (:mod:`.replay`);
3. **dispatch**: each chunk's rows gathered in expert order (cast to the GEMM dtype first,
   :class:`~.rows.SendRows`), exchanged with one uneven ``all_to_all_single``
   (:class:`~behemoth.comm.AllToAllSingleAxis`), then placed by local expert in one scatter
   (:class:`~.rows.PlaceRows`; each group padded with zero rows to a multiple of ``align``
   where the grouped GEMMs want it; where each row goes, :func:`placement`, is made on the host
   from the split sizes and copied to the device in one copy) -- skipped where they arrive in
   that layout already (one member, or one expert per member, unpadded);
4. the local experts (:func:`~.grouped.grouped_swiglu`);
5. **combine**: the rows taken back in the order they arrived (:class:`~.rows.TakeRows`), the
   reverse all-to-all, and each token's k outputs weighted and summed in one ``index_add``
   (:class:`~.rows.WeighRows`, one autograd node for the weights' gather, the product and the
   sum).

The rows' local Functions are :mod:`.rows`'. :func:`dispatch` and :func:`combine` run steps 3
and 5 as one autograd node each (:class:`DispatchRows`, :class:`CombineRows`: the same ops as
the three Functions of each step, one node instead of three); :mod:`.overlap`, which starts and
waits for each all-to-all apart, runs the steps' Functions one by one (:func:`place_rows`,
:func:`take_rows`, :func:`weigh_rows` along a :class:`Routed`).

The path is host-bound on a GPU (each ATen op is a kernel launch and some µs of the host's
time; the rows' kernels are short), so it runs as few ops as it can: no slicing where a capacity
dropped nothing, no concatenation for the host read, no device kernels for the placement but its
copy, no permutation where the rows arrive in the experts' layout, index tensors made once per
routes and reused by the combine and both backwards. tests/unit/test_expert_dispatch.py pins
the op counts of a member's dispatch, combine and their backward; ``benchmarks/bench_moe.py
--host-only`` measures their host time.

Every permutation's backward is its adjoint gather or scatter over the same index (:mod:`.rows`);
the all-to-alls' backwards reuse the forward's split sizes. Each backward runs the reverse
all-to-alls on every member, even one that received no rows (its empty output stays in the
autograd graph), so an expert with no tokens cannot hang a step.

The bookkeeping (:func:`count_experts`, :func:`block_shifts`, :func:`padding_rows`,
:func:`placement`, :func:`chunk_sizes`) is :mod:`.sizes`' (pure, unit-tested), re-exported here.

Communication per forward per MoE layer: all-to-all of ``chunks * E`` int64 (sizes), then of the
``T*K`` rows of width H out and back (and the same two in backward), in the experts' GEMM dtype
(bf16 under bf16 autocast, both ways), one call per chunk each way; fewer rows when a capacity
drops assignments (an assignment to expert ``E`` is dropped: never sent).
:func:`behemoth.parallel.expert.traffic.ep_all_to_all_bytes` is the formula.

Tested in tests/unit/test_expert_dispatch.py (the host reads per layer pinned too),
tests/dist/test_expert_autocast.py, tests/dist/test_expert_parallel.py and
tests/dist/test_expert_overlap.py and tests/unit/test_expert_routes.py (chunks).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ... import comm
from ...comm import Axis
from .grouped import gemm_dtype, pad_groups, to_device
from .rows import PlaceRows, SendRows, TakeRows, WeighRows, scatter_rows, sum_slots, weigh_backward, weigh_forward
from .sizes import block_shifts, chunk_sizes, count_experts, padding_rows, placement

__all__ = [
    "HostSizes",
    "CombineRows",
    "DispatchRows",
    "Routed",
    "Routes",
    "block_shifts",
    "chunk_sizes",
    "combine",
    "count_experts",
    "dispatch",
    "padding_rows",
    "placement",
]


class HostSizes:
    """One device-to-host read of a small int64 tensor, started at construction (into pinned
    memory, without waiting, on a CUDA device) and waited for by :meth:`wait`: the host can queue
    more device work in between. On the CPU the tensor is read as it is."""

    def __init__(self, sizes: torch.Tensor) -> None:
        self.event = None
        if sizes.is_cuda:
            # a non-blocking copy to the host lands in pinned memory; queued on sizes' device's current stream
            self.host = sizes.to("cpu", non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record(torch.cuda.current_stream(sizes.device))
        else:
            self.host = sizes.to("cpu")

    def wait(self) -> list[int]:
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()


@dataclass
class Routed:
    """One chunk's routes, what :func:`combine` needs from :func:`dispatch`."""

    axis: Axis
    order_A: torch.Tensor
    """Flat (token, slot) indices ``t*K + k`` of the chunk's tokens in the order their rows were
    sent (the kept ones)."""
    token_A: torch.Tensor
    """Their tokens: ``order_A // K``."""
    send_sizes: list[int]
    recv_sizes: list[int]
    slot: torch.Tensor | None
    """Where each received row sits in the experts' rows (grouped by local expert, padded where
    :func:`dispatch` was asked to align the groups); None where they arrive in that layout."""
    pad: torch.Tensor | None
    """The experts' rows that are padding (None: none)."""
    num_rows: int
    """Rows of the experts' layout (the padding included)."""
    dtype: torch.dtype
    """The dispatched tokens' dtype (the residual stream's): :func:`combine` returns it."""
    counts: list[int] | None = None
    """Rows of each local expert in the experts' layout (its padding included)."""


class _Pending:
    """The split sizes of one layer's routes, read once (:class:`HostSizes`): for each chunk the
    assignments per expert and dropped (``chunks * (E + 1)``), then for each member, chunk and
    local expert the rows that member sends (``chunks * E``)."""

    def __init__(self, sizes: HostSizes, num_experts: int, members: int, chunks: int) -> None:
        self.sizes, self.num_experts, self.members, self.chunks = sizes, num_experts, members, chunks
        self.values: list[int] | None = None

    def read(self, chunk: int) -> tuple[list[int], int, list[list[int]]]:
        """``(counts_E, dropped, recv_counts_RL)`` of ``chunk``."""
        if self.values is None:
            self.values = self.sizes.wait()
        E, n, C = self.num_experts, self.members, self.chunks
        v, L = self.values, E // n
        at = chunk * (E + 1)
        recv = C * (E + 1)  # where the received counts start: member r, chunk c at recv + (r*C + c)*L
        rows = [v[recv + (r * C + chunk) * L : recv + (r * C + chunk + 1) * L] for r in range(n)]
        return v[at : at + E], v[at + E], rows

    def kept(self, chunk: int, assignments: int) -> int:
        """Assignments of ``chunk`` (``assignments`` of them) its capacity kept."""
        return assignments - self.read(chunk)[1]


class Routes:
    """One MoE layer's routes for one forward: the tokens split into ``chunks`` contiguous runs
    (:func:`chunk_sizes`), each run's (token, slot) assignments sorted by expert, and -- once the
    split sizes are on the host -- each chunk's :class:`Routed`. Made by :meth:`build` (the one
    sort, the split-size exchange and its one host read); a recompute of the layer under
    activation checkpointing reuses the forward's (:mod:`.replay`), so it sorts and reads nothing.
    ``align``: see :func:`dispatch`."""

    def __init__(self, axis: Axis, num_experts: int, top_k: int, token_sizes: list[int], order_A, recv, pending, align):
        self.axis, self.num_experts, self.top_k, self.align = axis, num_experts, top_k, align
        self.token_sizes = token_sizes
        """Tokens in each chunk."""
        self.recv = recv
        """The received split sizes on the device (member, chunk, local expert)."""
        self.pending: _Pending = pending
        self.orders, self.tokens = [], []  # each chunk's assignments in expert order (its dropped ones last)
        at = 0
        for size in token_sizes:
            block = order_A if len(token_sizes) == 1 else order_A[at : at + size * top_k]
            block = block - at if at else block  # flat indices within the chunk
            self.orders.append(block)
            self.tokens.append(block // top_k if top_k > 1 else block)
            at += size * top_k
        self._routed: dict[int, Routed] = {}
        self._moves: dict[int, tuple[list[int], list[int], list[int]] | None] = {}

    @property
    def chunks(self) -> int:
        return len(self.token_sizes)

    @staticmethod
    def build(experts_TK: torch.Tensor, num_experts: int, axis: Axis, *, chunks: int = 1, align: int = 1) -> Routes:
        """The routes of ``experts_TK`` (``[T, K]``; expert ``num_experts``: dropped by a
        capacity) over ``axis``. Collective over ``axis``: the split sizes' even all-to-all; their
        host read is started, not waited for (the first chunk's rows wait for it)."""
        n = axis.size
        num_local = num_experts // n
        T, top_k = experts_TK.shape
        sizes = chunk_sizes(T, chunks)
        bins = num_experts + 1  # the last: assignments a capacity dropped
        key_A = experts_TK.reshape(-1)
        if chunks > 1:  # the chunk first, then the expert
            runs = to_device([s * top_k for s in sizes], key_A.device)
            chunk_A = torch.repeat_interleave(torch.arange(chunks, device=key_A.device), runs, output_size=T * top_k)
            key_A = key_A + bins * chunk_A
        # the counts, then the split sizes received, in one buffer: the host reads it whole
        both = key_A.new_zeros(chunks * (bins + num_experts), dtype=torch.int64)
        counts, recv = both.split_with_sizes([chunks * bins, chunks * num_experts])
        count_experts(key_A, chunks * bins, out=counts)
        send = counts[:num_experts]
        if chunks > 1:  # member r gets, chunk by chunk, the counts of its local experts
            send = counts.view(chunks, bins)[:, :num_experts].reshape(chunks, n, num_local).transpose(0, 1).reshape(-1)
        block = [chunks * num_local] * n
        comm.all_to_all_single(send, axis, block, block, out=recv)
        pending = _Pending(HostSizes(both), num_experts, n, chunks)
        # the one sort, of narrow keys (fewer radix passes on a GPU); each chunk's dropped assignments last
        narrow = torch.int16 if chunks * bins <= 2**15 else torch.int32
        order_A = torch.argsort(key_A.to(narrow), stable=True)
        return Routes(axis, num_experts, top_k, sizes, order_A, recv, pending, align)

    def send_rows(self, x_TH: torch.Tensor, chunk: int) -> torch.Tensor:
        """The rows chunk ``chunk`` (its ``token_sizes[chunk]`` tokens, ``x_TH``) sends, in expert
        order, in the experts' GEMM dtype (:class:`~.rows.SendRows`). The first call waits for the split
        sizes."""
        order, token = self.orders[chunk], self.tokens[chunk]
        kept = lambda: self.pending.kept(chunk, order.numel())  # noqa: E731
        return SendRows.apply(x_TH, order, token, self.top_k, gemm_dtype(x_TH), kept)

    def routed(self, chunk: int, dtype: torch.dtype) -> Routed:
        """Chunk ``chunk``'s :class:`Routed`, its sizes only -- host arithmetic on the split sizes
        (read by then), no device work, so the chunk's all-to-all can start at once; where its
        rows go in the experts' layout is :meth:`lay_out`'s. Made once."""
        if chunk in self._routed:
            return self._routed[chunk]
        n, num_local = self.axis.size, self.num_experts // self.axis.size
        counts_E, dropped, recv_RL = self.pending.read(chunk)
        kept = self.orders[chunk].numel() - dropped
        send_sizes = [sum(counts_E[r * num_local : (r + 1) * num_local]) for r in range(n)]
        recv_sizes = [sum(row) for row in recv_RL]
        local_counts = [sum(row[l] for row in recv_RL) for l in range(num_local)]
        padded = pad_groups(local_counts, self.align)[0] if self.align > 1 else local_counts
        order, token = self.orders[chunk], self.tokens[chunk]
        if kept < order.numel():  # a capacity dropped some (else no slicing)
            order, token = order[:kept], token[:kept]
        routed = Routed(self.axis, order, token, send_sizes, recv_sizes, None, None, sum(padded), dtype, padded)
        shifts, pad_rows = block_shifts(recv_RL, padded), padding_rows(local_counts, padded)
        self._routed[chunk] = routed
        counts = [c for row in recv_RL for c in row]
        self._moves[chunk] = (shifts, counts, pad_rows) if any(shifts) or pad_rows else None
        return routed

    def lay_out(self, chunk: int) -> Routed:
        """:meth:`routed` of ``chunk`` with ``slot`` and ``pad`` (where its received rows go in
        the experts' layout, and the padding) on the device. Made once."""
        routed = self._routed[chunk]
        moves = self._moves.pop(chunk, None)
        if moves is not None:
            shifts, counts, pad_rows = moves
            device = routed.order_A.device
            rows = placement(shifts, counts, pad_rows, pinned=device.type == "cuda")
            if device.type != "cpu":  # one copy for both, without waiting
                rows = rows.to(device, non_blocking=True)
            routed.slot, routed.pad = rows.split_with_sizes([sum(counts), len(pad_rows)]) if pad_rows else (rows, None)
        return routed


def place_rows(x_recv: torch.Tensor, routed: Routed) -> torch.Tensor:
    """The received rows in the experts' layout (:class:`~.rows.PlaceRows`; as they are where they
    arrive in it)."""
    if routed.slot is None:
        return x_recv
    return PlaceRows.apply(x_recv, routed.slot, routed.pad, routed.num_rows)


def take_rows(y_NH: torch.Tensor, routed: Routed) -> torch.Tensor:
    """The experts' output rows in the order their inputs arrived (:class:`~.rows.TakeRows`)."""
    if routed.slot is None:
        return y_NH
    return TakeRows.apply(y_NH, routed.slot, routed.pad, routed.num_rows)


def weigh_rows(y_AH: torch.Tensor, weights_TK: torch.Tensor, routed: Routed) -> torch.Tensor:
    """``y_TH``: the rows back at their tokens, each token's k weighted by ``weights_TK`` and
    summed (in the product's dtype), returned in the dispatched tokens' dtype (:class:`~.rows.WeighRows`).
    Local."""
    return WeighRows.apply(y_AH, weights_TK, routed.order_A, routed.token_A, routed.dtype)


class DispatchRows(torch.autograd.Function):
    """:func:`dispatch_routes` as one autograd node, collective over the routes' axis: forward
    :class:`~.rows.SendRows` (the wait for the split sizes after its gather), the uneven all-to-all of
    the rows and :class:`~.rows.PlaceRows` where the rows do not arrive in the experts' layout; backward
    theirs in reverse (the gather at ``slot``, the reverse all-to-all, the rows put back at their
    slots and a token's k summed). The same ops as the three apart, one node instead of three."""

    @staticmethod
    def forward(ctx, x_TH, routes: Routes, dtype: torch.dtype):
        order = routes.orders[0]
        rows_AH = x_TH.to(dtype).index_select(0, routes.tokens[0])
        routed = routes.routed(0, x_TH.dtype)  # waits for the split sizes
        if routed.order_A.numel() < order.numel():
            rows_AH = rows_AH[: routed.order_A.numel()]
        x_recv = comm.all_to_all_single(rows_AH, routes.axis, routed.send_sizes, routed.recv_sizes)
        slot = routes.lay_out(0).slot
        ctx.save_for_backward(routed.order_A, *(() if slot is None else (slot,)))
        ctx.routed, ctx.shape, ctx.dtype, ctx.top_k = routed, x_TH.shape, x_TH.dtype, routes.top_k
        return x_recv if slot is None else scatter_rows(x_recv, slot, routed.pad, routed.num_rows)

    @staticmethod
    def backward(ctx, grad_NH):
        order_A, *slot = ctx.saved_tensors
        r = ctx.routed
        grad = grad_NH.index_select(0, slot[0]) if slot else grad_NH.contiguous()
        grad_AH = comm.all_to_all_single(grad, r.axis, r.recv_sizes, r.send_sizes)
        return sum_slots(grad_AH, order_A, ctx.shape, ctx.top_k, ctx.dtype), None, None


class CombineRows(torch.autograd.Function):
    """:func:`combine` as one autograd node, collective over the routed axis: forward
    :class:`~.rows.TakeRows` where the rows are not in arrival order, the reverse all-to-all and
    :class:`~.rows.WeighRows`; backward theirs in reverse (the weighing's, the all-to-all of the rows'
    gradient, put back at ``slot``). The same ops as the three apart, one node instead of three."""

    @staticmethod
    def forward(ctx, y_NH, weights_TK, routed: Routed):
        slot = routed.slot
        rows_NH = y_NH if slot is None else y_NH.index_select(0, slot)
        y_AH = comm.all_to_all_single(rows_NH, routed.axis, routed.recv_sizes, routed.send_sizes)
        y_TH, w_A1 = weigh_forward(ctx, y_AH, weights_TK, routed.order_A, routed.token_A, routed.dtype)
        ctx.save_for_backward(y_AH, w_A1, routed.order_A, routed.token_A)
        ctx.routed = routed
        return y_TH

    @staticmethod
    def backward(ctx, grad_TH):
        y_AH, w_A1, order_A, token_A = ctx.saved_tensors
        r = ctx.routed
        grad_y, grad_w = weigh_backward(ctx, grad_TH, y_AH, w_A1, order_A, token_A, *ctx.needs_input_grad[:2])
        if grad_y is not None:
            grad_y = comm.all_to_all_single(grad_y, r.axis, r.send_sizes, r.recv_sizes)
            grad_y = grad_y if r.slot is None else scatter_rows(grad_y, r.slot, r.pad, r.num_rows)
        return grad_y, grad_w, None


@torch.compiler.disable  # eager in compiled blocks: a host read sizes the exchange
def dispatch(x_TH: torch.Tensor, experts_TK: torch.Tensor, num_experts: int, axis: Axis, *, align: int = 1):
    """``(x_NH, local_counts, routed)``: the rows this member's experts must process, grouped
    by local expert (``local_counts[l]`` rows for local expert l), and the record for
    :func:`combine`. Collective over ``axis``: the split sizes, then the rows. One host read
    (:class:`HostSizes`), no other. :func:`dispatch_routes` with routes of one chunk made here.

    The rows travel in the dtype the experts' GEMMs read them in (:func:`~.grouped.gemm_dtype`:
    autocast's under autocast, where the residual stream stays float32): cast before the
    exchange, bit for bit what a cast after it gives, for half the bytes (:class:`~.rows.SendRows`).

    ``align`` > 1: each local expert's group is padded with zero rows to a multiple of ``align``
    rows, at least ``align`` (:func:`~.grouped.pad_groups`; ``local_counts`` then count the
    padding, which :func:`combine` drops): the layout the grouped GEMMs want
    (:func:`~.grouped.group_alignment`), made in the scatter the rows take anyway."""
    return _dispatch_routes(x_TH, Routes.build(experts_TK, num_experts, axis, align=align))


@torch.compiler.disable  # eager in compiled blocks, as dispatch
def dispatch_routes(x_TH: torch.Tensor, routes: Routes):
    """:func:`dispatch` along ``routes`` (of one chunk): ``(x_NH, local_counts, routed)``.
    Collective over the routes' axis: the rows (:class:`DispatchRows`)."""
    return _dispatch_routes(x_TH, routes)


def _dispatch_routes(x_TH: torch.Tensor, routes: Routes):
    if routes.chunks != 1:
        raise ValueError(f"dispatch_routes: routes of {routes.chunks} chunks; overlap.exchange runs those.")
    x_NH = DispatchRows.apply(x_TH, routes, gemm_dtype(x_TH))
    routed = routes.routed(0, x_TH.dtype)  # made by DispatchRows
    return x_NH, routed.counts, routed


@torch.compiler.disable  # eager in compiled blocks, as dispatch
def combine(y_NH: torch.Tensor, weights_TK: torch.Tensor, routed: Routed) -> torch.Tensor:
    """``y_TH``: the experts' outputs (rows as :func:`dispatch` returned them) sent back to their
    tokens' members and summed over each token's k experts with its routing weights. The rows
    travel in ``y_NH``'s dtype; each is weighted and the k summed in the product's dtype (float32
    for float32 weights, as the serial layer weighs its experts' bf16 rows under autocast), and
    the sum returned in the dispatched tokens' dtype (the residual stream's: float32 under
    autocast, as the serial layer returns it). Collective over the axis of :func:`dispatch`;
    no host read."""
    return CombineRows.apply(y_NH, weights_TK, routed)

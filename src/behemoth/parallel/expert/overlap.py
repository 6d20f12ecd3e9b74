"""An MoE layer's exchange with its experts, the all-to-alls overlapped with the experts' GEMMs.

The layer's tokens are split into ``chunks`` contiguous runs (:class:`~.dispatch.Routes`: one
sort and one host read for all of them). Every chunk's dispatch all-to-all is started at once,
without waiting; then chunk by chunk the rows are waited for, run through the local experts,
and sent back with a combine all-to-all that is started, not waited for; the combines are
waited for last. So chunk i+1's dispatch travels while chunk i's experts compute, and chunk
i's combine while chunk i+1's do (the over-decomposition Tensor3D and Megatron's MoE overlap
use). On a GPU the collectives run on the communication stream beside the compute stream; on
gloo in gloo's threads.

The backward overlaps the same way: each all-to-all is two autograd nodes (:class:`StartExchange`,
:class:`WaitExchange`), the reverse all-to-all started by the later node's backward and waited for
by the earlier's, so a chunk's reverse combine travels while another chunk's experts run their
backward. Every rank builds the same graph, so its backward issues the reverse all-to-alls in the
same order (autograd runs the ready node created last first).

One chunk runs the same way (its layout's indices computed while its rows travel, a shared
expert while they travel back); on a trivial axis, where nothing travels, it is
:func:`~.dispatch.dispatch` -> experts -> :func:`~.dispatch.combine`. Either way the rows and the bytes are those of one
exchange (the ledger books one call per chunk each way, and ``chunks * E`` split sizes:
:func:`~.traffic.ep_all_to_all_bytes`).

Tested in tests/dist/test_expert_overlap.py (chunks 2 and 3 against serial training, the
ledger's bytes and calls, and the order of starts and waits) and tests/unit/test_expert_routes.py
(one rank).
"""

from __future__ import annotations

import torch

from ... import comm
from ...comm import Axis
from .dispatch import Routed, Routes, combine, dispatch_routes, place_rows, take_rows, weigh_rows
from .dispatch_members import MemberRoutes, exchange_members

__all__ = ["Exchange", "StartExchange", "WaitExchange", "exchange"]


class Exchange:
    """One uneven all-to-all of rows in flight: what :class:`StartExchange` and
    :class:`WaitExchange` share (the forward's handle, and the backward's reverse exchange)."""

    def __init__(self, axis: Axis, send_sizes: list[int], recv_sizes: list[int]) -> None:
        self.axis, self.send_sizes, self.recv_sizes = axis, send_sizes, recv_sizes
        self.forward: comm.AsyncCollective | None = None
        self.backward: comm.AsyncCollective | None = None


class StartExchange(torch.autograd.Function):
    """Forward: start the all-to-all of ``x`` (``send_sizes`` out, ``recv_sizes`` in) and return
    its receive buffer -- not yet filled: only :class:`WaitExchange` reads it. Backward: wait
    for the reverse all-to-all :class:`WaitExchange`'s backward started, return what arrived."""

    @staticmethod
    def forward(ctx, x_NH, exchange: Exchange):
        ctx.exchange = exchange
        if exchange.axis.trivial:
            return x_NH.view_as(x_NH)
        buffer = x_NH.new_empty((sum(exchange.recv_sizes), *x_NH.shape[1:]))
        exchange.forward = comm.all_to_all_single_async(
            x_NH, exchange.axis, exchange.send_sizes, exchange.recv_sizes, out=buffer
        )
        return buffer

    @staticmethod
    def backward(ctx, stand_in):
        e = ctx.exchange
        if e.axis.trivial:
            return stand_in, None
        grad, e.backward = e.backward.wait(), None
        return grad, None


class WaitExchange(torch.autograd.Function):
    """Forward: wait for the all-to-all :class:`StartExchange` started; the rows received.
    Backward: start the reverse all-to-all of the gradient (``recv_sizes`` out, ``send_sizes``
    in), which :class:`StartExchange`'s backward waits for (the gradient itself is handed on
    meanwhile, a stand-in nothing reads)."""

    @staticmethod
    def forward(ctx, buffer_NH, exchange: Exchange):
        ctx.exchange = exchange
        if exchange.forward is not None:
            exchange.forward.wait()
            exchange.forward = None
        return buffer_NH.view_as(buffer_NH)

    @staticmethod
    def backward(ctx, grad):
        e = ctx.exchange
        if e.axis.trivial:
            return grad, None
        e.backward = comm.all_to_all_single_async(grad, e.axis, e.recv_sizes, e.send_sizes)
        return grad, None  # stands in for the gradient in flight, which StartExchange's backward waits for


def start(x_NH: torch.Tensor, axis: Axis, send_sizes: list[int], recv_sizes: list[int]):
    """``(buffer, exchange)``: the all-to-all of ``x_NH`` started (:class:`StartExchange`)."""
    e = Exchange(axis, send_sizes, recv_sizes)
    return StartExchange.apply(x_NH, e), e


def wait(buffer: torch.Tensor, e: Exchange) -> torch.Tensor:
    """The rows the exchange ``e`` received (:class:`WaitExchange`)."""
    return WaitExchange.apply(buffer, e)


def exchange(x_TH: torch.Tensor, weights_TK: torch.Tensor, routes: Routes, run_experts, shared=None) -> torch.Tensor:
    """``y_TH``: each token's rows through its experts (``run_experts(x_NH, local_counts)``, this
    member's experts on their rows) and back, weighted and summed (as :func:`~.dispatch.combine`
    sums them), along ``routes`` -- each all-to-all started and waited for apart, chunk by chunk
    overlapped with another chunk's experts where the routes have several (see the module
    docstring) -- plus ``shared(x_TH)`` where given (a shared expert, computed while the last
    combines travel). Collective over the routes' axis. Member routes
    (:class:`~.dispatch_members.MemberRoutes`) run :func:`~.dispatch_members.exchange_members`."""
    if isinstance(routes, MemberRoutes):
        return exchange_members(x_TH, weights_TK, routes, run_experts, shared)
    if routes.chunks == 1 and routes.axis.trivial:  # nothing travels
        x_NH, local_counts, routed = dispatch_routes(x_TH, routes)
        y_TH = combine(run_experts(x_NH, local_counts), weights_TK, routed)
        shared_TH = None if shared is None else shared(x_TH)
        return y_TH if shared_TH is None else y_TH + shared_TH
    return _exchange_chunks(x_TH, weights_TK, routes, run_experts, shared)


@torch.compiler.disable  # eager in compiled blocks: the chunks' collectives interleave with the experts
def _exchange_chunks(x_TH: torch.Tensor, weights_TK: torch.Tensor, routes: Routes, run_experts, shared):
    xs, ws = x_TH.split(routes.token_sizes), weights_TK.split(routes.token_sizes)
    chunks: list[Routed] = []
    sent = []
    for c, x in enumerate(xs):
        x_AH = routes.send_rows(x, c)  # the first waits for the split sizes
        chunks.append(routes.routed(c, x_TH.dtype))
        sent.append(start(x_AH, routes.axis, chunks[c].send_sizes, chunks[c].recv_sizes))
    back = []
    for c, ((buffer, e), r) in enumerate(zip(sent, chunks)):
        laid = routes.lay_out(c)  # where the rows go, computed while they travel
        x_NH = place_rows(wait(buffer, e), laid)
        y_NH = run_experts(x_NH, r.counts)
        back.append(start(take_rows(y_NH, r), routes.axis, r.recv_sizes, r.send_sizes))
    shared_TH = None if shared is None else shared(x_TH)
    parts = [weigh_rows(wait(buffer, e), w, r) for (buffer, e), w, r in zip(back, ws, chunks)]
    y_TH = torch.cat(parts) if len(parts) > 1 else parts[0]
    return y_TH if shared_TH is None else y_TH + shared_TH

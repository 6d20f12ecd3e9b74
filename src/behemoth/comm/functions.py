"""Named autograd Functions for model-level communication, each docstring stating the forward
and the backward operation (Megatron's f/g mappings and their relatives).

Test: ``pytest tests/dist/test_comm.py`` (forward and backward against the serial formula).
"""

from __future__ import annotations

import torch

from .axis import Axis
from .collectives import all_gather, all_reduce, all_to_all, all_to_all_single, reduce_scatter
from .p2p import exchange


class CopyToAxis(torch.autograd.Function):
    """Identity forward; all-reduce (sum) of the gradient backward. Megatron's ``f``."""

    @staticmethod
    def forward(ctx, x, axis: Axis):
        ctx.axis = axis
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return all_reduce(g.contiguous().clone(), ctx.axis), None


class ReduceFromAxis(torch.autograd.Function):
    """All-reduce (sum) forward; identity backward. Megatron's ``g``."""

    @staticmethod
    def forward(ctx, x, axis: Axis):
        return all_reduce(x.contiguous().clone(), axis)

    @staticmethod
    def backward(ctx, g):
        return g, None


class GatherFromAxis(torch.autograd.Function):
    """All-gather along ``dim`` forward; keep this rank's slice of the gradient backward."""

    @staticmethod
    def forward(ctx, x, axis: Axis, dim: int):
        ctx.axis, ctx.dim = axis, dim
        return all_gather(x, axis, dim)

    @staticmethod
    def backward(ctx, g):
        return g.chunk(ctx.axis.size, dim=ctx.dim)[ctx.axis.rank].contiguous(), None, None


class ScatterToAxis(torch.autograd.Function):
    """Keep this rank's slice along ``dim`` forward; all-gather the gradient backward."""

    @staticmethod
    def forward(ctx, x, axis: Axis, dim: int):
        ctx.axis, ctx.dim = axis, dim
        if x.shape[dim] % axis.size:
            raise ValueError(
                f"ScatterToAxis over {axis.name!r}: dim {dim} of size {x.shape[dim]} is not divisible by {axis.size}."
            )
        return x.chunk(axis.size, dim=dim)[axis.rank].contiguous()

    @staticmethod
    def backward(ctx, g):
        return all_gather(g, ctx.axis, ctx.dim), None, None


class AllGatherToAxis(torch.autograd.Function):
    """All-gather along ``dim`` forward; reduce-scatter of the gradient backward
    (the input is a shard of an activation every rank then uses in full)."""

    @staticmethod
    def forward(ctx, x, axis: Axis, dim: int):
        ctx.axis, ctx.dim = axis, dim
        return all_gather(x, axis, dim)

    @staticmethod
    def backward(ctx, g):
        return reduce_scatter(g, ctx.axis, ctx.dim), None, None


class ReduceScatterToAxis(torch.autograd.Function):
    """Reduce-scatter along ``dim`` forward; all-gather of the gradient backward."""

    @staticmethod
    def forward(ctx, x, axis: Axis, dim: int):
        ctx.axis, ctx.dim = axis, dim
        return reduce_scatter(x, axis, dim)

    @staticmethod
    def backward(ctx, g):
        return all_gather(g.contiguous(), ctx.axis, ctx.dim), None, None


class AllToAllAxis(torch.autograd.Function):
    """All-to-all (scatter ``scatter_dim``, gather ``gather_dim``) forward; the inverse
    all-to-all (scatter ``gather_dim``, gather ``scatter_dim``) backward. Ulysses' exchange."""

    @staticmethod
    def forward(ctx, x, axis: Axis, scatter_dim: int, gather_dim: int):
        ctx.axis, ctx.dims = axis, (scatter_dim, gather_dim)
        return all_to_all(x, axis, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, g):
        s, gd = ctx.dims
        return all_to_all(g, ctx.axis, gd, s), None, None, None


class AllToAllSingleAxis(torch.autograd.Function):
    """Uneven all-to-all of rows forward (``send_sizes`` out, ``recv_sizes`` in, see
    :func:`all_to_all_single`); the reverse all-to-all of the gradient backward (``recv_sizes``
    out, ``send_sizes`` in). Expert parallelism's dispatch and combine."""

    @staticmethod
    def forward(ctx, x, axis: Axis, send_sizes: list[int], recv_sizes: list[int]):
        ctx.axis, ctx.sizes = axis, (send_sizes, recv_sizes)
        return all_to_all_single(x, axis, send_sizes, recv_sizes)

    @staticmethod
    def backward(ctx, g):
        send_sizes, recv_sizes = ctx.sizes
        return all_to_all_single(g.contiguous(), ctx.axis, recv_sizes, send_sizes), None, None, None


class ExchangeWithPeer(torch.autograd.Function):
    """Point-to-point swap with the axis member ``peer_index`` forward; the same swap of the
    gradient backward (the pairing is symmetric, so the swap is its own inverse). 2D's
    grid transpose: member (i, j) of a q x q grid swaps with (j, i)."""

    @staticmethod
    def forward(ctx, x, axis: Axis, peer_index: int):
        ctx.axis, ctx.peer = axis, peer_index
        return exchange(x, axis, peer_index)

    @staticmethod
    def backward(ctx, g):
        return exchange(g, ctx.axis, ctx.peer), None, None

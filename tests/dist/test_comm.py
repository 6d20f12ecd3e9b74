"""Every named collective in behemoth.comm: forward and backward against the serial formula,
and the ledger's byte counts."""

from __future__ import annotations

import torch

import behemoth as bh
from behemoth import comm
from behemoth.mesh import ParallelMesh


def _data(rank, world, shape, seed):
    g = torch.Generator().manual_seed(seed)
    full = [torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(world)]
    return full[rank], full


def _comm_world(rank, world):
    mesh = ParallelMesh(bh.Plan(dp=world), rank, world)
    ax = mesh.axis("dp")
    close = torch.testing.assert_close

    # CopyToAxis: identity forward, all-reduce backward.
    x, _ = _data(0, world, (3, 4), 1)
    _, ws = _data(rank, world, (3, 4), 2)
    x = x.clone().requires_grad_()
    y = comm.CopyToAxis.apply(x, ax)
    close(y, x.detach())
    (y * ws[rank]).sum().backward()
    close(x.grad, sum(ws))

    # ReduceFromAxis: all-reduce forward, identity backward.
    xr, xs = _data(rank, world, (3, 4), 3)
    xr = xr.clone().requires_grad_()
    y = comm.ReduceFromAxis.apply(xr, ax)
    close(y, sum(xs))
    (y * 2).sum().backward()
    close(xr.grad, torch.full_like(xr, 2.0))

    # GatherFromAxis: all-gather forward, slice backward.
    xr, xs = _data(rank, world, (2, 3), 4)
    xr = xr.clone().requires_grad_()
    W, _ = _data(0, world, (2, 3 * world), 5)
    y = comm.GatherFromAxis.apply(xr, ax, 1)
    close(y, torch.cat(xs, 1))
    (y * W).sum().backward()
    close(xr.grad, W.chunk(world, 1)[rank])

    # ScatterToAxis: slice forward, all-gather backward.
    x, _ = _data(0, world, (4 * world, 2), 6)
    _, ws = _data(rank, world, (4, 2), 7)
    x = x.clone().requires_grad_()
    y = comm.ScatterToAxis.apply(x, ax, 0)
    close(y, x.detach().chunk(world, 0)[rank])
    (y * ws[rank]).sum().backward()
    close(x.grad, torch.cat(ws, 0))

    # AllGatherToAxis: all-gather forward, reduce-scatter backward.
    xr, xs = _data(rank, world, (2, 5), 8)
    _, Ws = _data(rank, world, (2 * world, 5), 9)
    xr = xr.clone().requires_grad_()
    y = comm.AllGatherToAxis.apply(xr, ax, 0)
    close(y, torch.cat(xs, 0))
    (y * Ws[rank]).sum().backward()
    close(xr.grad, sum(Ws).chunk(world, 0)[rank])

    # ReduceScatterToAxis: reduce-scatter forward, all-gather backward.
    xr, xs = _data(rank, world, (2 * world, 3), 10)
    _, ws = _data(rank, world, (2, 3), 11)
    xr = xr.clone().requires_grad_()
    y = comm.ReduceScatterToAxis.apply(xr, ax, 0)
    close(y, sum(xs).chunk(world, 0)[rank])
    (y * ws[rank]).sum().backward()
    close(xr.grad, torch.cat(ws, 0))

    # AllToAllAxis: rank r's part i goes to rank i; backward is the inverse exchange.
    xr, xs = _data(rank, world, (world * 2, 3 * world), 12)
    xr = xr.clone().requires_grad_()
    y = comm.AllToAllAxis.apply(xr, ax, 1, 0)  # scatter columns, gather rows
    close(y, torch.cat([xs[i].chunk(world, 1)[rank] for i in range(world)], 0))
    _, ws = _data(rank, world, tuple(y.shape), 13)
    (y * ws[rank]).sum().backward()
    close(xr.grad, torch.cat([ws[i].chunk(world, 0)[rank] for i in range(world)], 1))

    # broadcast / reduce, blocking and asynchronous (SUMMA's): the same results and ledger bytes.
    _, xs = _data(rank, world, (3, 5), 14)
    for src in range(world):
        mesh.ledger.reset()
        a = comm.broadcast(xs[rank].clone(), ax, src)
        h = comm.broadcast(xs[rank].clone(), ax, src, async_op=True)
        close(a, xs[src])
        close(h.wait(), xs[src])
        r = comm.reduce(xs[rank].clone(), ax, src)
        hr = comm.reduce(xs[rank].clone(), ax, src, async_op=True)
        got = hr.wait()
        if rank == src:
            close(r, sum(xs))
            close(got, sum(xs))
        st = mesh.ledger.stats()["dp"]
        assert st["ops"] == {"broadcast": 2, "reduce": 2}, st
        assert st["bytes"] == 4 * xs[0].numel() * xs[0].element_size(), st

    # Ledger: payload and ring wire bytes of an all-reduce.
    mesh.ledger.reset()
    t = torch.zeros(1000, dtype=torch.float32)
    comm.all_reduce(t, ax)
    st = mesh.ledger.stats()["dp"]
    assert st["calls"] == 1 and st["bytes"] == 4000
    assert st["wire_bytes"] == int(2 * (world - 1) / world * 4000)


def test_named_collectives_forward_and_backward():
    bh.spawn(_comm_world, 2, timeout=120)
    bh.spawn(_comm_world, 4, timeout=120)

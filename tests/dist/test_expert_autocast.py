"""Experts under bf16 autocast (``Plan(precision="bf16")``: float32 parameters and residual
stream), at ep = 2:

* dispatch sends the rows in bf16: bit for bit the rows a float32 dispatch delivers once cast,
  and the same float32 input gradient (the k copies of a token summed in float32); combine
  weighs and sums in float32 and returns the float32 stream, bit for bit as after a float32
  dispatch; also with a rank that has no tokens, and with the groups padded for the grouped
  GEMMs (``align``: the same outputs and gradients); the host reads device values once for all of
  it (the split sizes);
* training at dp = 2 x ep = 2 under ``Plan(precision="bf16")`` books exactly
  ``ep_all_to_all_bytes(elem_bytes=2)`` on the ep axis (every row exchange in bf16) and follows
  serial autocast training.
"""

from __future__ import annotations

import torch
from common import SEQ, assert_grad_norms_close, assert_losses_close, assert_state_close, global_batches, train_steps
from host_reads import HostReads
from test_expert_parallel import build_moe, optimizer_for, serial_moe_run

import behemoth as bh
from behemoth.mesh import ParallelMesh
from behemoth.parallel.expert.dispatch import combine, dispatch
from behemoth.parallel.expert.traffic import ep_all_to_all_bytes

STEPS, BATCH = 3, 8
H, E, K = 16, 4, 2


def _exchange(x_TH, experts_TK, weights_TK, dy_TH, scale_H, ep, *, autocast: bool, align: int = 1):
    """dispatch -> a stand-in for the experts (bf16 rows out, as autocast's GEMMs give) -> combine,
    forward and backward: the rows received, the output and the input gradients."""
    x_TH = x_TH.clone().requires_grad_()
    weights_TK = weights_TK.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        rows_NH, counts, routed = dispatch(x_TH, experts_TK, E, ep, align=align)
        y_TH = combine(rows_NH.to(torch.bfloat16) * scale_H, weights_TK, routed)
    y_TH.backward(dy_TH)
    return rows_NH.detach(), counts, y_TH.detach(), x_TH.grad, weights_TK.grad


def _dispatch_world(rank: int, world: int) -> None:
    ep = ParallelMesh(bh.Plan(dp=world, ep=world), rank, world).axis("ep")
    for tokens in (13, 0 if rank == 1 else 11):
        what = f"rank {rank} with {tokens} tokens"
        g = torch.Generator().manual_seed(100 + rank)
        x_TH = torch.randn(tokens, H, generator=g)
        experts_TK = torch.rand(tokens, E, generator=g).argsort(dim=-1)[:, :K]  # k distinct experts a token
        weights_TK = torch.rand(tokens, K, generator=g)
        dy_TH = torch.randn(tokens, H, generator=g)
        scale_H = torch.randn(H, generator=g).to(torch.bfloat16)
        args = (x_TH, experts_TK, weights_TK, dy_TH, scale_H, ep)
        want = _exchange(*args, autocast=False)  # float32 rows exchanged, cast after
        before = ep.ledger.axes["ep"].bytes
        got = _exchange(*args, autocast=True)
        booked = torch.tensor([float(ep.ledger.axes["ep"].bytes - before)], dtype=torch.float64)
        torch.distributed.all_reduce(booked)
        total = torch.tensor([float(tokens * K)], dtype=torch.float64)
        torch.distributed.all_reduce(total)
        wire = ep_all_to_all_bytes(rows=int(total.item()), num_experts=E, ep=world, hidden=H, elem_bytes=2)
        assert booked.item() == wire, (what, booked.item(), wire)  # every row exchange in bf16
        assert want[0].dtype == torch.float32 and got[0].dtype == torch.bfloat16, what
        assert torch.equal(got[0], want[0].to(torch.bfloat16)), what
        assert got[1] == want[1], what
        for name, a, b in zip(("y", "x.grad", "weights.grad"), got[2:], want[2:]):
            assert a.dtype == b.dtype == torch.float32, (what, name, a.dtype, b.dtype)
            assert torch.equal(a, b), (what, name, (a - b).abs().max())
        with HostReads() as reads:  # dispatch -> combine -> backward at ep = 2: the split sizes, read once
            _exchange(*args, autocast=True, align=16)
        assert dict(reads.counts) == {"tolist": 1}, (what, reads.counts)
        padded = _exchange(*args, autocast=True, align=16)
        assert all(n % 16 == 0 and n > 0 for n in padded[1]), (what, padded[1])
        for name, a, b in zip(("y", "x.grad", "weights.grad"), padded[2:], got[2:]):
            assert torch.equal(a, b), (what, "padded", name)


def test_dispatch_under_autocast_equals_casting_after_the_exchange():
    bh.spawn(_dispatch_world, 2, timeout=600)


def _train_world(rank: int, world: int) -> None:
    batches = global_batches(STEPS, BATCH)
    what = f"dp={world} ep=2 precision=bf16"
    want = serial_moe_run(batches, clip=1.0, world=world, dtype=torch.bfloat16, opt_name="sgd")
    model = build_moe()
    plan = bh.Plan(dp=world, ep=2, precision="bf16")
    engine = bh.boost(model, optimizer_for(model, "sgd"), plan, max_grad_norm=1.0)
    losses, norms = train_steps(engine, batches)
    # the ep axis: per layer and step the split sizes and four all-to-alls of bf16 rows, plus the
    # gradient norm's one float32 all-reduce per step
    layers, top_k, hidden = 2, 2, 32
    sent = torch.tensor([float(engine.comm_stats()["ep"]["bytes"])], dtype=torch.float64)
    torch.distributed.all_reduce(sent)
    rows = BATCH * SEQ * top_k
    per_layer = ep_all_to_all_bytes(rows=rows, num_experts=E, ep=2, hidden=hidden, elem_bytes=2)
    assert sent.item() == STEPS * (layers * per_layer + world * 4), (what, sent.item())
    assert_losses_close(losses, want[0], what=what, rtol=2e-2)
    assert_grad_norms_close(norms, want[2], what=what, rtol=2e-2)
    assert_state_close(engine.full_state_dict(), want[1], what=what, rtol=2e-2, atol=2e-3)


def test_autocast_training_books_bf16_rows():
    bh.spawn(_train_world, 2, timeout=900)

"""The member exchange (``Plan.ep_dedup``, behemoth.parallel.expert.dispatch_members): each token
sent once per ep member holding any of its experts.

* against the per-assignment exchange (``dispatch`` -> the experts -> ``combine``) on 2 and 4
  gloo ranks, float32: the experts' parameter gradients and the routing weights' gradients bit
  for bit (the experts see the same rows in the same order), the output and the input gradient
  to 1e-6 (the sums add a member's local experts, then the members: another order); with an
  expert no token chose, a member receiving nothing, one expert in every token's k, a rank with
  no tokens, the groups padded for the grouped GEMMs on both paths, and under
  bf16 autocast (float32 stream, bf16 rows; a member's partial sum and its gradient travel in
  bf16, one rounding more than the per-assignment combine: every result within 1e-2 of it in
  norm); the pairs sent, counted on a routing built for it, and the ledger's bytes
  (``ep_all_to_all_bytes(pairs=...)``); one host read;
* training at dp = 2 x ep = 2 with ``ep_dedup=True`` follows serial training (losses, grad norms,
  ``full_state_dict()``; under bf16 autocast to 2e-2, as tests/dist/test_expert_autocast.py), also
  with micro-batches and activation checkpointing (the recompute replays the member routes: no
  second split-size exchange, and its rows travel without their weights and slots, in the
  ledger's calls and bytes).
"""

from __future__ import annotations

import torch
from common import assert_grad_norms_close, assert_losses_close, assert_state_close, global_batches, train_steps
from host_reads import HostReads
from test_expert_parallel import build_moe, optimizer_for, serial_moe_run

import behemoth as bh
from behemoth.mesh import ParallelMesh
from behemoth.parallel.expert.dispatch import combine, dispatch
from behemoth.parallel.expert.dispatch_members import MemberRoutes, dedup_applies, exchange_members
from behemoth.parallel.expert.grouped import grouped_swiglu
from behemoth.parallel.expert.traffic import ep_all_to_all_bytes

H, I, E = 16, 8, 8


def _experts(num_local: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(num_local, 2 * I, H, generator=g) * 0.3, torch.randn(num_local, H, I, generator=g) * 0.3


def _run(x_TH, weights_TK, experts_TK, dy_TH, params, ep, *, members: bool, align=1, autocast=False):
    """One exchange forward and backward: ``(y, x.grad, weights.grad, gate_up.grad, down.grad)``."""
    x_TH = x_TH.clone().requires_grad_()
    weights_TK = weights_TK.clone().requires_grad_()
    gate_up, down = (p.clone().requires_grad_() for p in params)

    def run_experts(x_NH, counts):
        return grouped_swiglu(x_NH, counts, gate_up, down)

    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        if members:
            routes = MemberRoutes.build(experts_TK, E, ep, align=align)
            y_TH = exchange_members(x_TH, weights_TK, routes, run_experts)
        else:
            x_NH, counts, routed = dispatch(x_TH, experts_TK, E, ep, align=align)
            y_TH = combine(run_experts(x_NH, counts), weights_TK, routed)
    y_TH.backward(dy_TH)
    return y_TH.detach(), x_TH.grad, weights_TK.grad, gate_up.grad, down.grad


def _routing(case: str, tokens: int, K: int, world: int, g):
    """``experts_TK`` for one adversarial case (k distinct experts a token)."""
    if case == "random":
        return torch.rand(tokens, E, generator=g).argsort(dim=-1)[:, :K]
    if case == "empty expert":  # expert 1 is never chosen
        choice = torch.tensor([e for e in range(E) if e != 1])
        return choice[torch.rand(tokens, E - 1, generator=g).argsort(dim=-1)[:, :K]]
    if case == "idle member":  # only member 0's experts: the others receive nothing
        return torch.rand(tokens, E // world, generator=g).argsort(dim=-1)[:, :K]
    if case == "hot expert":  # expert 0 in every token's k
        rest = 1 + torch.rand(tokens, E - 1, generator=g).argsort(dim=-1)[:, : K - 1]
        return torch.cat([torch.zeros(tokens, 1, dtype=torch.long), rest], 1)
    raise ValueError(case)


def _parity_world(rank: int, world: int) -> None:
    ep = ParallelMesh(bh.Plan(dp=world, ep=world), rank, world).axis("ep")
    num_local = E // world
    params = _experts(num_local, 7 + rank)
    for case in ("random", "empty expert", "idle member", "hot expert"):
        for K in (2, 3):
            if K > num_local and case == "idle member":
                continue
            for tokens in (13, 0 if rank == 1 else 9):
                what = f"rank {rank}/{world} {case} k={K} tokens={tokens}"
                g = torch.Generator().manual_seed(100 * rank + tokens + K)
                experts_TK = _routing(case, tokens, K, world, g)
                x_TH, weights_TK = torch.randn(tokens, H, generator=g), torch.rand(tokens, K, generator=g)
                dy_TH = torch.randn(tokens, H, generator=g)
                args = (x_TH, weights_TK, experts_TK, dy_TH, params, ep)
                for align in (1, 16):  # 16: the groups padded for the grouped GEMMs, on both paths
                    want = _run(*args, members=False, align=align)
                    before = ep.ledger.axes["ep"].bytes
                    got = _run(*args, members=True, align=align)
                    booked = float(ep.ledger.axes["ep"].bytes - before)
                    for name, a, b in zip(("y", "x.grad"), got[:2], want[:2]):
                        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=lambda m: f"{what} {name}: {m}")
                    for name, a, b in zip(("weights.grad", "gate_up.grad", "down.grad"), got[2:], want[2:]):
                        assert torch.equal(a, b), (what, align, name, (a - b).abs().max())
                # the ledger: the pairs every member sent, the formula's bytes
                pairs = len({(int(t), int(e) // num_local) for t, row in enumerate(experts_TK) for e in row})
                total = torch.tensor([booked, float(pairs), float(tokens * K)], dtype=torch.float64)
                torch.distributed.all_reduce(total)
                wire = ep_all_to_all_bytes(rows=0, num_experts=E, ep=world, hidden=H, pairs=int(total[1]), top_k=K)
                assert total[0].item() == wire, (what, total.tolist(), wire)
                assert total[1] <= total[2], what
                with HostReads() as reads:  # the split sizes, read once
                    _run(*args, members=True, align=16)
                assert dict(reads.counts) == {"tolist": 1}, (what, reads.counts)
                # bf16 autocast: the rows in bf16 both ways; float32 weighing and stream
                want16 = _run(*args, members=False, autocast=True)
                got16 = _run(*args, members=True, autocast=True)
                for name, a, b in zip(("y", "x.grad", "weights.grad", "gate_up.grad", "down.grad"), got16, want16):
                    assert a.dtype == b.dtype, (what, name)
                    err = float((a - b).norm() / b.norm().clamp_min(1e-30)) if b.numel() else 0.0
                    assert err < 1e-2, (what, "bf16", name, err)  # bf16's rounding is 2**-9 a value


def test_member_exchange_equals_the_assignment_exchange_on_2_ranks():
    bh.spawn(_parity_world, 2, timeout=600)


def test_member_exchange_equals_the_assignment_exchange_on_4_ranks():
    bh.spawn(_parity_world, 4, timeout=900)


def _count_world(rank: int, world: int) -> None:
    """A routing built for a known count: at ep = 2 (experts 0-3 on member 0, 4-7 on member 1),
    top-2, token t of 12 chooses (0, 1) (one member), (0, 5) (two) or (4, 6) (one) by t % 3:
    16 pairs for 12 tokens' 24 assignments."""
    ep = ParallelMesh(bh.Plan(dp=world, ep=world), rank, world).axis("ep")
    pick = torch.tensor([[0, 1], [0, 5], [4, 6]])
    experts_TK = pick[torch.arange(12) % 3]
    routes = MemberRoutes.build(experts_TK, E, ep)
    sent = routes.sizes().send
    assert sent == [8, 8], sent  # to member 0: the tokens choosing (0, 1) or (0, 5); to member 1: (0, 5) or (4, 6)
    assert experts_TK.numel() - sum(sent) == 8  # one row fewer for each token whose two experts share a member
    assert dedup_applies(ep=2, num_experts=E, top_k=2, chunks=1, dropless=True)
    assert not dedup_applies(ep=4, num_experts=4, top_k=2, chunks=1, dropless=True)  # one expert a member
    assert not dedup_applies(ep=2, num_experts=E, top_k=2, chunks=2, dropless=True)
    assert not dedup_applies(ep=2, num_experts=E, top_k=2, chunks=1, dropless=False)
    assert not dedup_applies(ep=2, num_experts=E, top_k=1, chunks=1, dropless=True)


def test_member_exchange_sends_one_row_per_token_and_member():
    bh.spawn(_count_world, 2, timeout=300)


STEPS, BATCH = 3, 8


def _train_world(rank: int, world: int) -> None:
    batches = global_batches(STEPS, BATCH)
    pairs = _count_pairs()
    for micro, ckpt, precision in ((1, False, "fp32"), (2, True, "fp32"), (1, False, "bf16")):
        what = f"dp={world} ep=2 ep_dedup micro={micro} ckpt={ckpt} {precision}"
        bf16 = precision == "bf16"
        opt = "sgd" if bf16 else "adamw"  # SGD: linear in the gradient, bf16 rounding stays rounding
        dtype = torch.bfloat16 if bf16 else None
        want = serial_moe_run(batches, clip=1.0, world=world, micro=micro, dtype=dtype, opt_name=opt)
        model = build_moe()
        plan = bh.Plan(
            dp=world, ep=2, ep_dedup=True, microbatches=micro, activation_checkpointing=ckpt, precision=precision
        )
        engine = bh.boost(model, optimizer_for(model, opt), plan, max_grad_norm=1.0)
        pairs.clear()
        losses, norms = train_steps(engine, batches)
        ep = engine.comm_stats()["ep"]
        # per layer and micro-batch: splits, the rows (their weights and slots packed in) and the rows
        # back, their reverse pair; a recompute's pair again; the gradient norm's all-reduce per step
        calls = STEPS * 2 * micro * (1 + 2 + 2 + (2 if ckpt else 0))
        assert ep["ops"] == {"all_to_all": calls, "all_reduce": STEPS}, (what, ep)
        sent = torch.tensor([float(ep["bytes"]), float(sum(pairs))], dtype=torch.float64)
        torch.distributed.all_reduce(sent)
        group = dict(rows=0, num_experts=4, ep=2, hidden=32, top_k=2, recompute=ckpt, elem_bytes=2 if bf16 else 4)
        want_bytes = sum(ep_all_to_all_bytes(**group, pairs=p) for p in _summed(pairs))
        assert sent[0].item() == want_bytes + STEPS * world * 4, (what, sent.tolist(), want_bytes)
        tol = dict(rtol=2e-2) if bf16 else {}
        assert_losses_close(losses, want[0], what=what, **tol)
        assert_grad_norms_close(norms, want[2], what=what, **tol)
        assert_state_close(engine.full_state_dict(), want[1], what=what, **(dict(rtol=2e-2, atol=2e-3) if bf16 else {}))


def _count_pairs() -> list[int]:
    """Every MoE layer's pairs sent by this rank, per forward (not a recompute's: it replays the
    forward's routes), appended to the returned list as the layers run."""
    from behemoth.parallel.expert import dispatch_members

    seen: list[int] = []
    sizes = dispatch_members.MemberRoutes.sizes

    def counted(self):
        first = self._sizes is None
        out = sizes(self)
        if first:
            seen.append(sum(out.send))
        return out

    dispatch_members.MemberRoutes.sizes = counted
    return seen


def _summed(pairs: list[int]) -> list[int]:
    """The group's pairs per layer forward: every rank's count at the same position summed."""
    t = torch.tensor(pairs, dtype=torch.float64)
    torch.distributed.all_reduce(t)
    return [int(v) for v in t.tolist()]


def test_member_exchange_trains_as_serial():
    bh.spawn(_train_world, 2, timeout=900)

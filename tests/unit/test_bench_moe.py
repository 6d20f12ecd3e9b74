"""benchmarks/moe_routing.py, the routings of bench_moe.py's layer benchmark: the router input and
weight it builds make behemoth's own router (MoEFeedForward.route_tokens) choose what each routing
promises -- exactly T*k/E assignments per expert when balanced, Zipf's probabilities for the first
choice, the popularity order dealt to the ep members for zipf-spread."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from behemoth.models.moe import MoEFeedForward

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import moe_routing  # noqa: E402


def chosen(kind: str, T: int, E: int, K: int, ep: int = 2, s: float = 1.2, seed: int = 0):
    H = 2 * E
    x_TH, router_EH = moe_routing.routing_input(kind, T, H, E, K, ep, s, torch.Generator().manual_seed(seed))
    moe = MoEFeedForward(H, 4, E, K)
    with torch.no_grad():
        moe.router.weight.copy_(router_EH)
    return moe.route_tokens(x_TH[None]).chosen_TK, router_EH


@pytest.mark.parametrize("E,K", [(8, 2), (8, 1), (16, 4), (6, 4)])
def test_balanced_gives_every_expert_exactly_its_share(E, K):
    T = 96
    experts_TK, _ = chosen("balanced", T, E, K)
    assert torch.bincount(experts_TK.flatten(), minlength=E).tolist() == [T * K // E] * E
    assert all(len(set(row)) == K for row in experts_TK.tolist())  # k distinct experts per token


def test_zipf_first_choice_follows_zipf():
    E, T, s = 8, 40000, 1.2
    experts_TK, _ = chosen("zipf", T, E, 1, s=s)
    p = torch.arange(1, E + 1, dtype=torch.float64) ** -s
    share = torch.bincount(experts_TK.flatten(), minlength=E).double() / T
    torch.testing.assert_close(share, p / p.sum(), atol=0.012, rtol=0)  # 5 standard deviations at p = 0.43


def test_uniform_is_zipf_with_exponent_zero():
    E, T = 8, 40000
    share = torch.bincount(chosen("uniform", T, E, 1)[0].flatten(), minlength=E).double() / T
    torch.testing.assert_close(share, torch.full((E,), 1 / E, dtype=torch.float64), atol=0.01, rtol=0)


def test_zipf_spread_deals_popularity_ranks_to_the_ep_members_in_turn():
    E, s = 8, 1.2
    log_p = -s * torch.log(torch.arange(1, E + 1, dtype=torch.float32))
    _, sorted_EH = chosen("zipf", 8, E, 2)
    _, spread_EH = chosen("zipf-spread", 8, E, 2, ep=2)
    assert sorted_EH[:, E].tolist() == log_p.tolist()
    # ep = 2, 4 experts each: popularity ranks 0, 2, 4, 6 on member 0 (experts 0-3), 1, 3, 5, 7 on member 1
    assert spread_EH[:, E].tolist() == log_p[[0, 2, 4, 6, 1, 3, 5, 7]].tolist()


def test_unknown_routing_and_narrow_hidden_are_refused():
    g = torch.Generator()
    with pytest.raises(ValueError, match="must be one of"):
        moe_routing.routing_input("hot", 8, 16, 8, 2, 2, 1.2, g)
    with pytest.raises(ValueError, match="must exceed experts"):
        moe_routing.routing_input("zipf", 8, 8, 8, 2, 2, 1.2, g)


def test_plan_texts_parse_without_evaluation():
    import bench_moe

    assert bench_moe.parse_plan("pp=2,microbatches=8,schedule=gpipe") == dict(pp=2, microbatches=8, schedule="gpipe")
    described = "Plan(dp=1, tp=2, tp_overlap=2, microbatches=4, zero=3, precision='bf16')"
    assert bench_moe.parse_plan(described) == dict(dp=1, tp=2, tp_overlap=2, microbatches=4, zero=3, precision="bf16")
    with pytest.raises(ValueError, match="not Plan fields"):
        bench_moe.parse_plan("pp=2,stages=4")
    with pytest.raises(ValueError, match="is not key=value"):
        bench_moe.parse_plan("__import__('os')")


def test_host_reads_counts_each_read_of_a_device_value():
    import step_profile

    x = torch.arange(6.0)

    def step():
        torch.where(x > 2)  # nonzero
        x.sum().item()
        x.tolist()
        torch.repeat_interleave(torch.tensor([1, 2]))  # the output's size read from the repeats
        torch.repeat_interleave(torch.tensor([1, 2]), output_size=3)  # told: no read
        x[x > 4]  # a boolean mask

    got = step_profile.count_host_reads(step)
    assert got["host_reads"] == {
        "bool-mask aten.index(cpu)": 1,
        "item(cpu)": 1,
        "nonzero(cpu)": 1,
        "repeat_interleave without output_size(cpu)": 1,
        "tolist(cpu)": 1,
    }
    assert got["aten_ops"] > 5


@pytest.mark.parametrize("drop", [False, True])
def test_token_major_combine_equals_the_librarys(drop):
    """bench_moe.py --combine token-major weighs the rows as the library's combine does: the same
    outputs and gradients (top-2: the same two terms, bit for bit), a capacity's drops included."""
    import bench_moe
    from test_expert_grouped import OneRankMesh

    from behemoth.parallel.expert.dispatch import dispatch, weigh_rows

    g = torch.Generator().manual_seed(3)
    T, H, E, K = 12, 8, 4, 2
    experts_TK = torch.rand(T, E, generator=g).argsort(-1)[:, :K]
    if drop:
        experts_TK[::3, 1] = E  # dropped by a capacity: never sent
    x_TH = torch.randn(T, H, generator=g)
    _, _, routed = dispatch(x_TH, experts_TK, E, OneRankMesh().axis("ep"))
    y = torch.randn(routed.order_A.numel(), H, generator=g, dtype=torch.float64)
    w = torch.rand(T, K, generator=g, dtype=torch.float64)
    dy = torch.randn(T, H, generator=g, dtype=torch.float64)
    outs = []
    for fn in (weigh_rows, bench_moe.token_major_weigh_rows):
        y_, w_ = y.clone().requires_grad_(), w.clone().requires_grad_()
        out = fn(y_, w_, routed)
        out.backward(dy)
        outs.append((out, y_.grad, w_.grad))
    for a, b in zip(*outs):
        assert torch.equal(a, b)

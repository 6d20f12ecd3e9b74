"""The planner's member exchange (``Plan.ep_dedup``): the (token, member) pairs a token sends on
average, against an enumeration of every choice of k experts; the ep bytes of a step, against
``ep_all_to_all_bytes(pairs=...)``; where it applies."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

import behemoth as bh
from behemoth.parallel.expert.dispatch_members import dedup_applies
from behemoth.parallel.expert.traffic import ep_all_to_all_bytes
from behemoth.planner.axis_traffic import member_exchange, members_per_token, step_traffic
from behemoth.planner.host_calls import ep_block_calls
from behemoth.planner.workload import workload_for


def _olmoe(**kw):
    return dataclasses.replace(workload_for("olmoe-1b-7b", seq_len=2048, global_batch=16), **kw)


@pytest.mark.parametrize(("experts", "k", "ep"), [(8, 2, 2), (8, 3, 2), (8, 3, 4), (12, 4, 3)])
def test_members_per_token_is_the_mean_over_every_choice(experts, k, ep):
    w = dataclasses.replace(_olmoe(), num_experts=experts, experts_top_k=k)
    plan = bh.Plan(ep=ep, ep_dedup=True).resolve(ep)
    local = experts // ep
    choices = list(itertools.combinations(range(experts), k))
    mean = sum(len({e // local for e in c}) for c in choices) / len(choices)
    assert members_per_token(plan, w) == pytest.approx(mean, rel=1e-12)
    assert members_per_token(plan, dataclasses.replace(w, expert_spread=1.0)) == 1.0


def test_olmoe_at_ep_2_sends_about_a_quarter_of_the_rows():
    w = _olmoe()
    assert (w.num_experts, w.experts_top_k) == (64, 8)
    for ckpt in (False, True):
        plan = bh.Plan(ep=2, ep_dedup=True, precision="bf16", activation_checkpointing=ckpt).resolve(2)
        per = bh.Plan(ep=2, precision="bf16", activation_checkpointing=ckpt).resolve(2)
        assert member_exchange(plan, w) and not member_exchange(per, w)
        pairs_per_token = members_per_token(plan, w)
        assert 1.99 < pairs_per_token < 2.0
        mbs = w.global_batch // plan.dp
        pairs = plan.ep * mbs * w.seq_len * pairs_per_token  # over the group
        group = ep_all_to_all_bytes(
            rows=0, num_experts=64, ep=2, hidden=w.shape.hidden, elem_bytes=2, pairs=pairs, top_k=8, recompute=ckpt
        )
        want = (plan.ep - 1) / plan.ep * group / plan.ep * w.shape.num_layers + 2 * (plan.ep - 1) / plan.ep * 4
        assert step_traffic(plan, w)["ep"] == pytest.approx(want, rel=1e-12)
        ratio = step_traffic(plan, w)["ep"] / step_traffic(per, w)["ep"]
        assert 0.25 < ratio < 0.26, ratio  # 2 rows instead of 8, 24 bytes wider out and back
        f, b, again = ep_block_calls(plan, w)
        # split sizes, rows (their weights and slots packed in), rows back, the balancing statistics
        # (dp = 2); the reverse pair; a recompute's pair and the statistics
        assert (f, b, again) == (4.0, 2.0, 3.0)


def test_member_exchange_applies_where_the_runtime_takes_it():
    w = _olmoe()
    for ep, k, overlap, dedup in itertools.product((1, 2, 4, 64), (1, 8), (1, 2), (False, True)):
        if overlap > 1 and ep == 1:
            continue
        plan = bh.Plan(ep=ep, ep_overlap=overlap, ep_dedup=dedup).resolve(ep)
        wk = dataclasses.replace(w, experts_top_k=k)
        runtime = dedup and dedup_applies(ep=ep, num_experts=64, top_k=k, chunks=overlap, dropless=True)
        assert member_exchange(plan, wk) == runtime, plan

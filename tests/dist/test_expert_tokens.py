"""Under 1D tensor parallelism each tp rank routes and runs the experts on its own share of an MoE
block's tokens (behemoth.parallel.expert.tokens): every router sees exactly B*S/tp of the data
rank's tokens per forward (B*S padded to a multiple of tp, then split, where S does not divide),
and training matches serial training (losses, every step's gradient norm, ``full_state_dict()``,
rtol 1e-4, fp32): tp=2 without sequence parallelism (S divisible, and S = 15 by the token split),
tp=2 with sequence parallelism under ZeRO-3 (behemoth's MoE Llama), transformers' Qwen3-MoE at
tp=2, and tp=2 x ep=2 on 4 ranks (behemoth's MoE Llama under ZeRO-3, and Mixtral with sequence
parallelism, whose tp bytes ep_overlap=2 leaves unchanged: each expert's gradient is summed over
tp once per forward, not once per chunk). A capacity router (sigmoid scores, aux-free bias, a
shared expert) through the token split, and under cp=2 (ring) x tp=2, drops what serial drops.
Greedy generation of one row at tp=2 (its one-token decode steps leave one tp rank an empty
share) equals serial."""

from __future__ import annotations

from common import (
    SEQ,
    assert_grad_norms_close,
    assert_losses_close,
    assert_state_close,
    global_batches,
    train_steps,
    train_steps_dropping_as_serial,
)
from test_expert_families import adamw, build_hf_moe, serial_hf_run
from test_expert_parallel import BATCH, STEPS, build_moe, optimizer_for, serial_moe_run
from test_expert_routing import adamw as routed_adamw
from test_expert_routing import build as build_routed
from test_expert_routing import serial_run as serial_routed_run

import behemoth as bh
from behemoth.models.moe import MoEFeedForward
from behemoth.parallel.expert import moe_layers


def _router_rows(model) -> list[int]:
    """A list that each MoE block's router appends its forward's token count to."""
    seen: list[int] = []
    for block in moe_layers(model).values():
        router = block.router if isinstance(block, MoEFeedForward) else block.gate
        router.register_forward_pre_hook(lambda mod, args: seen.append(args[0].numel() // args[0].shape[-1]))
    return seen


def _check(engine, batches, want, seen, tokens, what):
    losses, norms = train_steps(engine, batches)
    assert seen == [tokens] * (len(moe_layers(engine.model)) * len(batches)), (what, seen[:4], tokens)
    assert_losses_close(losses, want[0], what=what)
    assert_grad_norms_close(norms, want[2], what=what)
    assert_state_close(engine.full_state_dict(), want[1], what=what)


def _two_ranks(rank: int, world: int) -> None:
    batches = global_batches(STEPS, BATCH)
    want = serial_moe_run(batches, clip=1.0)
    for plan in (bh.Plan(tp=2), bh.Plan(tp=2, sequence_parallel=True, zero=3)):
        model = build_moe()
        engine = bh.boost(model, optimizer_for(model), plan, max_grad_norm=1.0)
        seen = _router_rows(engine.model)
        _check(engine, batches, want, seen, BATCH * SEQ // 2, plan.describe())

    odd = [{k: v[:, : SEQ - 1].contiguous() for k, v in b.items()} for b in batches]  # S = 15: the token split
    want = serial_moe_run(odd, clip=1.0)
    model = build_moe()
    engine = bh.boost(model, optimizer_for(model), bh.Plan(tp=2), max_grad_norm=1.0)
    seen = _router_rows(engine.model)
    rows = -(-BATCH * (SEQ - 1) // 2)
    _check(engine, odd, want, seen, rows if rank == 0 else BATCH * (SEQ - 1) - rows, "tp=2 S=15")

    # a capacity (per whole sequence: the tp peers' choices gathered), a shared expert and the aux-free
    # bias, through the token split (S = 15): every rank drops what serial drops
    name = "sigmoid-bias-shared-capacity"
    want = serial_routed_run(name, odd, 1, 1)
    model = build_routed(name)
    engine = bh.boost(model, routed_adamw(model), bh.Plan(tp=2), max_grad_norm=1.0)
    losses, norms = train_steps_dropping_as_serial(engine, odd, want[3], name)
    assert any(sum(d) > 0 for step in want[3] for _, d in step), name  # the capacity dropped some
    assert_losses_close(losses, want[0], what=name)
    assert_grad_norms_close(norms, want[2], what=name)
    assert_state_close(engine.full_state_dict(), want[1], what=name)

    # greedy generation of one row: a prefill of 3 tokens and one-token decode steps (rank 1's share empty)
    rows = [[3, 5, 7]]
    want_tokens = bh.generate(build_moe().eval(), rows, max_new_tokens=5)
    model = bh.parallelize(build_moe().eval(), bh.Plan(tp=2))
    assert bh.generate(model, rows, max_new_tokens=5) == want_tokens, "tp=2 generation"

    want = serial_hf_run("qwen3-moe", batches)
    model = build_hf_moe("qwen3-moe")
    engine = bh.boost(model, adamw(model), bh.Plan(tp=2), max_grad_norm=1.0)
    seen = _router_rows(engine.model)
    _check(engine, batches, want, seen, BATCH * SEQ // 2, "transformers Qwen3-MoE tp=2")


def test_each_tp_rank_routes_its_share_and_matches_serial():
    bh.spawn(_two_ranks, 2, timeout=900)


def _four_ranks(rank: int, world: int) -> None:
    batches = global_batches(STEPS, BATCH)
    want = serial_moe_run(batches, clip=1.0)
    model = build_moe()
    engine = bh.boost(model, optimizer_for(model), bh.Plan(tp=2, ep=2, zero=3), max_grad_norm=1.0)
    seen = _router_rows(engine.model)
    _check(engine, batches, want, seen, BATCH // 2 * SEQ // 2, "dp=2 tp=2 ep=2 zero=3")

    want = serial_hf_run("mixtral", batches)
    tp_bytes = []
    for chunks in (1, 2):  # ep_overlap=2 calls the experts module once per chunk: one gradient sum all the same
        model = build_hf_moe("mixtral")
        plan = bh.Plan(tp=2, ep=2, sequence_parallel=True, ep_overlap=chunks)
        engine = bh.boost(model, adamw(model), plan, max_grad_norm=1.0)
        seen = _router_rows(engine.model)
        _check(engine, batches, want, seen, BATCH // 2 * SEQ // 2, f"transformers Mixtral {plan.describe()}")
        tp_bytes.append(engine.comm_stats()["tp"]["wire_bytes"])
    assert tp_bytes[0] == tp_bytes[1] > 0, tp_bytes

    # a capacity under cp=2 (ring's layout) x tp=2: the tp share inside the cp shard, the choices gathered
    # over tp then cp, the verdict taken back in the same order
    name = "sigmoid-bias-shared-capacity"
    want = serial_routed_run(name, batches, 1, 1)
    model = build_routed(name)
    engine = bh.boost(model, routed_adamw(model), bh.Plan(cp=2, cp_mode="ring", tp=2), max_grad_norm=1.0)
    seen = _router_rows(engine.model)
    losses, norms = train_steps_dropping_as_serial(engine, batches, want[3], name)
    assert seen == [BATCH * SEQ // 4] * (len(moe_layers(engine.model)) * STEPS), (name, seen[:4])
    assert_losses_close(losses, want[0], what=f"{name} cp=2 tp=2")
    assert_grad_norms_close(norms, want[2], what=f"{name} cp=2 tp=2")
    assert_state_close(engine.full_state_dict(), want[1], what=f"{name} cp=2 tp=2")


def test_tp_and_ep_route_their_share_and_match_serial():
    bh.spawn(_four_ranks, 4, timeout=1200)

"""Experts under context parallelism: attention over sequence shards (Ulysses, ring), experts
sharded over ep and replicated over ep_dp x cp (their gradients summed there), the router losses
over every token of the global batch -- against serial training (losses, every step's gradient
norm, ``full_state_dict()``, rtol 1e-4, fp32) on dp=2 x cp=2 with ep=2, plain and under ZeRO-2.
A capacity per sequence (with a sigmoid router, its auxiliary-loss-free bias and a shared expert)
drops, under Ulysses' and ring's layouts of the sequence, exactly the assignments the serial model
drops: the per-expert token and drop counts of every step equal serial's."""

from __future__ import annotations

from common import (
    assert_grad_norms_close,
    assert_losses_close,
    assert_state_close,
    global_batches,
    train_steps,
    train_steps_dropping_as_serial,
)
from test_expert_parallel import BATCH, STEPS, build_moe, optimizer_for, serial_moe_run
from test_expert_routing import adamw
from test_expert_routing import build as build_routed
from test_expert_routing import serial_run as serial_routed_run

import behemoth as bh


def _context_world(rank: int, world: int) -> None:
    batches = global_batches(STEPS, BATCH)
    want = serial_moe_run(batches, clip=1.0)
    for mode, zero in (("ulysses", 0), ("ring", 2)):
        what = f"dp=2 cp=2 ({mode}) ep=2 zero={zero}"
        model = build_moe()
        plan = bh.Plan(dp=2, cp=2, cp_mode=mode, ep=2, zero=zero)
        engine = bh.boost(model, optimizer_for(model), plan, max_grad_norm=1.0)
        experts = engine.model.layers[0].mlp.gate_up_proj
        assert experts.shape[0] == 2 and experts._behemoth_expert_shard.data_axis == "ep_dp_cp", what
        losses, norms = train_steps(engine, batches)
        assert_losses_close(losses, want[0], what=what)
        assert_grad_norms_close(norms, want[2], what=what)
        assert_state_close(engine.full_state_dict(), want[1], what=what)
        counts = engine.expert_token_counts()["layers.0.mlp"]
        assert counts == want[3][0], (what, counts)  # over every token of the global batch
    name = "sigmoid-bias-shared-capacity"
    want = serial_routed_run(name, batches, 2, 1)
    assert any(sum(d) > 0 for step in want[3] for _, d in step), "the capacity drops some assignments"
    for mode in ("ulysses", "ring"):
        what = f"{name} dp=2 cp=2 ({mode}) ep=2"
        model = build_routed(name)
        engine = bh.boost(model, adamw(model), bh.Plan(dp=2, cp=2, cp_mode=mode, ep=2), max_grad_norm=1.0)
        losses, norms = train_steps_dropping_as_serial(engine, batches, want[3], what)
        assert_losses_close(losses, want[0], what=what)
        assert_grad_norms_close(norms, want[2], what=what)
        assert_state_close(engine.full_state_dict(), want[1], what=what)


def test_experts_with_context_parallel_match_serial():
    bh.spawn(_context_world, 4, timeout=1200)

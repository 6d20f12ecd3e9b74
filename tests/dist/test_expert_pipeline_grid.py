"""Experts inside pipeline stages on 8 ranks, against serial training (losses, every step's gradient
norm, ``full_state_dict()``, rtol 1e-4, fp32) of behemoth's MoE Llama (a balancing loss and a z-loss
per layer), 1F1B with two micro-batches:

* pp=2 x dp=4 with ep=2, so expert-data-parallel ep_dp=2: each stage's experts are sharded over ep
  and their gradients summed over ep_dp only, the dense part's over the stage's whole dp;
* pp=2 x dp=2 x 1D tp=2 with ep=2: attention split over tp inside each stage, the experts sharded
  over ep and whole on every tp rank.

Every layer's tokens per expert in the last micro-batch equal serial's on every rank.
"""

from __future__ import annotations

from common import assert_grad_norms_close, assert_losses_close, assert_state_close, global_batches, train_steps
from test_expert_parallel import BATCH, STEPS, build_moe, optimizer_for, serial_moe_run

import behemoth as bh

MICRO = 2


def _grid_world(rank: int, world: int) -> None:
    batches = global_batches(STEPS, BATCH)
    for plan in (bh.Plan(dp=4, pp=2, ep=2, microbatches=MICRO), bh.Plan(dp=2, pp=2, tp=2, ep=2, microbatches=MICRO)):
        what = plan.describe()
        want = serial_moe_run(batches, clip=1.0, world=plan.dp, micro=MICRO)
        model = build_moe()
        engine = bh.boost(model, optimizer_for(model), plan, max_grad_norm=1.0)
        assert engine.mesh.axis("ep_dp").size == plan.dp // 2, what
        layer = next(iter(engine.parallel.experts.layers.values()))  # this stage's MoE layer
        assert layer.gate_up_proj.shape[0] == 2, what  # E/ep experts, whole over tp
        losses, norms = train_steps(engine, batches)
        assert_losses_close(losses, want[0], what=what)
        assert_grad_norms_close(norms, want[2], what=what)
        assert_state_close(engine.full_state_dict(), want[1], what=what)
        assert engine.expert_token_counts() == {f"layers.{i}.mlp": c for i, c in enumerate(want[3])}, what


def test_experts_in_pipeline_stages_with_ep_dp_and_tp_match_serial():
    bh.spawn(_grid_world, 8, timeout=1500)

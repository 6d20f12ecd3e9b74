"""Pipeline checkpoints: each stage saves its own parameters and optimizer state under the
serial model's names (a tied embedding copy on the last stage under the embedding's name),
so a pp = 2 checkpoint resumes under pp = 2 and under pp = 1 (dp = 2), and a pp = 1
checkpoint resumes under pp = 2; with ZeRO-1 inside the pipeline likewise -- each matching
serial training over all four steps."""

from __future__ import annotations

import os

import torch
from common import assert_losses_close, assert_state_close, build, global_batches, make_optimizer, serial_train, shard

import behemoth as bh

BATCH, LAYERS = 8, 4


def _engine(plan):
    model = build("gpt", num_layers=LAYERS)
    return bh.boost(model, make_optimizer("adamw", model), plan, max_grad_norm=1.0)


def _train(engine, batches):
    return [engine.step(shard(b, engine.dp_rank, engine.dp_size)) for b in batches]


def _world(rank: int, world: int, root: str) -> None:
    batches = global_batches(4, BATCH)
    want_losses, want_state = serial_train("gpt", "adamw", batches, max_grad_norm=1.0, num_layers=LAYERS)
    pp_plan = bh.Plan(pp=2, microbatches=2, schedule="1f1b")
    dp_plan = bh.Plan(dp=2, microbatches=2)
    pp_zero = bh.Plan(pp=2, microbatches=2, schedule="1f1b", zero=1, chunk_mb=0.05)
    for save_plan, load_plans in (
        (pp_plan, (pp_plan, dp_plan, bh.Plan(pp=2, microbatches=4, schedule="zero-bubble"))),
        (dp_plan, (pp_plan, pp_zero)),
        (pp_zero, (dp_plan, pp_zero)),
    ):
        path = os.path.join(root, f"pp{save_plan.pp}-zero{save_plan.zero}")
        first = _engine(save_plan)
        assert_losses_close(_train(first, batches[:2]), want_losses[:2], what="before save")
        first.save(path, extra={"pos": 2})
        for plan in load_plans:
            what = f"saved under {save_plan.describe()}, loaded under {plan.describe()}"
            engine = _engine(plan)
            assert engine.load(path) == {"pos": 2}
            assert engine.step_count == 2
            assert_losses_close(_train(engine, batches[2:]), want_losses[2:], what=what)
            assert_state_close(engine.full_state_dict(), want_state, what=what)
            t = torch.tensor([engine.last_grad_norm], dtype=torch.float64)
            ref = t.clone()
            torch.distributed.broadcast(ref, 0)
            assert torch.equal(t, ref), what


def test_pipeline_checkpoints_reshard(tmp_path):
    bh.spawn(_world, 2, str(tmp_path), timeout=300)

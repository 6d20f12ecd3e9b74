"""Compositions of parallel dimensions that meet inside one model match serial training (the
parity law): pipelines with 2.5D and 3D tensor parallelism.

* pp = 2 x 3D tp = 8 and pp = 2 x 2.5D tp = 8 (depth 2, q = 2) on 16 ranks, for behemoth's GPT
  and Llama and transformers' GPT2LMHeadModel (tied embeddings split across the first and last
  stage) and LlamaForCausalLM, under 1F1B, GPipe, interleaved and zero-bubble schedules: losses
  (the same float on every rank), ``full_state_dict()`` and every step's global gradient norm
  (before clipping) against plain PyTorch, AdamW with clipping; the activations between stages
  are the grid's row blocks of the hidden state (shape headers: one per channel, first step);
* a checkpoint saved under pp = 2 x 3D loads under pp = 2 x 2.5D and under dp = 2 x 3D and keeps
  matching serial training.

One spawned world of 16 ranks runs every scenario (spawning costs seconds on two cores).
"""
from __future__ import annotations

import os

import torch

import behemoth as bh
from common import (assert_grad_norms_close, assert_losses_close, assert_state_close, build, global_batches,
                    make_optimizer, serial_run, shard, train_steps)

STEPS, BATCH, LAYERS = 2, 8, 4
_SERIAL: dict = {}


def _serial(family, layers, steps=STEPS):
    key = (family, layers, steps)
    if key not in _SERIAL:
        _SERIAL[key] = serial_run(family, "adamw", global_batches(steps, BATCH), max_grad_norm=1.0,
                                  num_layers=layers)
    return _SERIAL[key]


def _agree(values, what):
    t = torch.tensor(values, dtype=torch.float64)
    ref = t.clone()
    torch.distributed.broadcast(ref, 0)
    assert torch.equal(t, ref), f"{what}: ranks disagree: {values} vs {ref.tolist()}"


def _check(family, plan, layers=LAYERS, what=""):
    model = build(family, num_layers=layers)
    engine = bh.boost(model, make_optimizer("adamw", model), plan, max_grad_norm=1.0)
    engine.reset_comm_stats()
    losses, norms = train_steps(engine, global_batches(STEPS, BATCH))
    want = _serial(family, layers)
    what = f"{what}{engine.plan.describe()} {family}"
    assert_losses_close(losses, want.losses, what=what)
    assert_state_close(engine.full_state_dict(), want.state, what=what)
    assert_grad_norms_close(norms, want.grad_norms, what=what)
    _agree(losses, what)
    return engine


def _check_pipeline_traffic(engine, m):
    """Per step each stage boundary carries m activations and m gradients (plus one shape header
    per activation channel on the first step): the grid's row blocks, nothing else, over pp."""
    pp, v = engine.plan.pp, engine.plan.virtual_stages
    ops, last = engine.comm_stats()["pp"]["ops"], pp * v - 1
    stages = [c * pp + engine.mesh.axis("pp").rank for c in range(v)]
    sends = sum((s < last) * (m * STEPS + 1) + (s > 0) * m * STEPS for s in stages)
    recvs = sum((s > 0) * (m * STEPS + 1) + (s < last) * m * STEPS for s in stages)
    assert (ops["send"], ops["recv"]) == (sends, recvs), (engine.plan.describe(), ops)


def _pipeline_grid():
    grid_3d = dict(tp=8, tp_mode="3d")
    grid_25d = dict(tp=8, tp_mode="2.5d", tp_depth=2)
    for family, plan in (
        ("gpt", bh.Plan(pp=2, microbatches=2, **grid_3d)),
        ("hf-gpt2", bh.Plan(pp=2, microbatches=2, schedule="zero-bubble", **grid_3d)),
        ("llama", bh.Plan(pp=2, microbatches=2, schedule="interleaved", virtual_stages=2, **grid_3d)),
        ("hf-llama", bh.Plan(pp=2, microbatches=2, schedule="gpipe", tp_overlap=2, **grid_3d)),
        ("gpt", bh.Plan(pp=2, microbatches=2, schedule="interleaved", virtual_stages=2, **grid_25d)),
        ("hf-gpt2", bh.Plan(pp=2, microbatches=2, **grid_25d)),
        ("llama", bh.Plan(pp=2, microbatches=2, schedule="zero-bubble", **grid_25d)),
        ("hf-llama", bh.Plan(pp=2, microbatches=2, schedule="gpipe", **grid_25d)),
    ):
        engine = _check(family, plan)
        if family == "gpt":
            _check_pipeline_traffic(engine, 2)


def _pipeline_grid_checkpoint(root):
    """Two steps under pp 2 x 3D, saved; loaded under pp 2 x 2.5D and dp 2 x 3D, two more steps."""
    batches = global_batches(4, BATCH)
    want = _serial("hf-gpt2", LAYERS, steps=4)
    path = os.path.join(root, "pp2-3d")
    save_plan = bh.Plan(pp=2, tp=8, tp_mode="3d", microbatches=2)
    for plan in (save_plan, bh.Plan(pp=2, tp=8, tp_mode="2.5d", tp_depth=2), bh.Plan(dp=2, tp=8, tp_mode="3d")):
        model = build("hf-gpt2", num_layers=LAYERS)
        engine = bh.boost(model, make_optimizer("adamw", model), plan, max_grad_norm=1.0)
        what = f"saved under {save_plan.describe()}, resumed under {engine.plan.describe()}"
        if plan is save_plan:
            losses = [engine.step(shard(b, engine.dp_rank, engine.dp_size)) for b in batches[:2]]
            assert_losses_close(losses, want.losses[:2], what="before saving")
            engine.save(path)
            continue
        engine.load(path)
        losses = [engine.step(shard(b, engine.dp_rank, engine.dp_size)) for b in batches[2:]]
        assert_losses_close(losses, want.losses[2:], what=what)
        assert_state_close(engine.full_state_dict(), want.state, what=what)


def _world16(rank, world, root):
    torch.manual_seed(rank)   # per-rank RNG differs: every rank must start from one model
    _pipeline_grid()
    _pipeline_grid_checkpoint(root)


def test_compositions_on_16_ranks_match_serial(tmp_path):
    bh.spawn(_world16, 16, str(tmp_path), timeout=900)

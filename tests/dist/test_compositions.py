"""Compositions of parallel dimensions that meet inside one model match serial training (the
parity law): pipelines with 2.5D and 3D tensor parallelism, context parallelism with 2D, 2.5D
and 3D tensor parallelism, and pipelines with context parallelism.

* pp = 2 x 3D tp = 8 and pp = 2 x 2.5D tp = 8 (depth 2, q = 2) on 16 ranks, for behemoth's GPT
  and Llama and transformers' GPT2LMHeadModel (tied embeddings split across the first and last
  stage) and LlamaForCausalLM, under 1F1B, GPipe, interleaved and zero-bubble schedules, 3D with
  over-decomposition: losses
  (the same float on every rank), ``full_state_dict()`` and every step's global gradient norm
  (before clipping) against plain PyTorch, AdamW with clipping; the activations between stages
  are the grid's row blocks of the hidden state (shape headers: one per channel, first step);
* a checkpoint saved under pp = 2 x 3D loads under pp = 2 x 2.5D and keeps matching serial
  training;
* cp = 2 (Ulysses and ring) x 2D tp = 4 on 8 ranks, every family, and cp = 2 x 3D tp = 8 and
  x 2.5D tp = 8 on 16 ranks: the grid splits the batch and the heads, context parallelism
  the sequence of each grid position's heads; the same parity checks, the cp collectives per
  step, and the ledger's ``cp`` bytes (payload and wire) against
  ``behemoth.planner.context_traffic.cp_model_traffic`` with the grid's split of heads and rows;
* the planner's predicted wire bytes (``behemoth.planner.axis_traffic.step_traffic``) equal the
  ledger's: ``cp`` under the grid modes, ``pp`` under pp x 2.5D / 3D and pp x cp;
* pp = 2 x cp = 2 with dp = 2 and with 1D tp = 2 on 8 ranks (every family, both modes, every
  schedule, activation checkpointing), and pp = 2 x cp = 2 x 2D tp = 4 on 16 ranks: each stage
  runs its share of the sequence with its global position ids; parity and the cp collectives
  of this rank's stages; ``bh.parallelize`` alone under pp x cp returns the serial logits of the
  rank's tokens on the last stage;
* with ZeRO on 8 ranks: dp 2 x pp 2 x cp 2 with ZeRO-1, cp 2 x 2D tp 4 with ZeRO-3, dp 2 x cp 2 x
  2.5D (depth 2) with ZeRO-2;
* a checkpoint saved under cp = 2 x 2D tp = 4 loads under pp = 2 x cp = 2 x 1D tp = 2.

Two spawned worlds (8 and 16 ranks) run every scenario (spawning costs seconds on two cores;
the 16-rank world keeps to one or two scenarios per composition).
"""

from __future__ import annotations

import os

import torch
from common import (
    SEQ,
    assert_grad_norms_close,
    assert_losses_close,
    assert_pipeline_p2p_ops,
    assert_ranks_agree,
    assert_state_close,
    build,
    global_batches,
    make_optimizer,
    serial_run,
    shard,
    train_steps,
)

import behemoth as bh
from behemoth.planner.axis_traffic import Dtypes, step_traffic
from behemoth.planner.context_traffic import cp_model_traffic
from behemoth.planner.workload import workload_for
from behemoth.specs import shape_of

STEPS, BATCH, LAYERS = 2, 8, 4
_SERIAL: dict = {}


def _serial(family, layers, steps=STEPS):
    key = (family, layers, steps)
    if key not in _SERIAL:
        _SERIAL[key] = serial_run(family, "adamw", global_batches(steps, BATCH), max_grad_norm=1.0, num_layers=layers)
    return _SERIAL[key]


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
    assert_ranks_agree(losses, what)
    return engine


def _check_planner_bytes(engine, family, layers, axes):
    """The planner's predicted wire bytes per axis (``behemoth.planner.axis_traffic.step_traffic``)
    for one forward + backward equal the ledger's, on ``axes``."""
    engine.reset_comm_stats()
    engine._forward_backward(shard(global_batches(1, BATCH)[0], engine.dp_rank, engine.dp_size))
    got = engine.comm_stats()
    w = workload_for(build(family, num_layers=layers), seq_len=SEQ, global_batch=BATCH)
    stage = engine.mesh.coord("pp") if engine.plan.pp > 1 else 0
    want = step_traffic(engine.plan, w, stage=stage, dt=Dtypes(compute=4, stream=4, param=4))
    for axis in axes:
        assert got[axis]["wire_bytes"] == int(want[axis]), (
            f"{engine.plan.describe()} {family} stage {stage}: {axis} ledger {got[axis]['wire_bytes']} vs "
            f"planner {want[axis]}"
        )


def _pipeline_grid():
    grid_3d = dict(tp=8, tp_mode="3d")
    grid_25d = dict(tp=8, tp_mode="2.5d", tp_depth=2)
    for family, plan in (
        ("hf-gpt2", bh.Plan(pp=2, microbatches=2, schedule="zero-bubble", tp_overlap=2, **grid_3d)),
        ("llama", bh.Plan(pp=2, microbatches=2, schedule="interleaved", virtual_stages=2, **grid_3d)),
        ("gpt", bh.Plan(pp=2, microbatches=2, **grid_25d)),
        ("hf-llama", bh.Plan(pp=2, microbatches=2, schedule="gpipe", **grid_25d)),
    ):
        engine = _check(family, plan)
        assert_pipeline_p2p_ops(engine, 2, STEPS)  # the grid's row blocks, nothing else, over pp
        _check_planner_bytes(engine, family, LAYERS, ("pp",))


def _pipeline_grid_checkpoint(root):
    """Two steps under pp 2 x 3D, saved; loaded under pp 2 x 2.5D, two more steps."""
    batches = global_batches(4, BATCH)
    want = _serial("hf-gpt2", LAYERS, steps=4)
    path = os.path.join(root, "pp2-3d")
    save_plan = bh.Plan(pp=2, tp=8, tp_mode="3d", microbatches=2)
    for plan in (save_plan, bh.Plan(pp=2, tp=8, tp_mode="2.5d", tp_depth=2, schedule="zero-bubble")):
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


def _check_context(family, plan, layers=2, traffic=False):
    """Parity (``_check``), and the collectives on ``cp`` per step: per attention layer of this
    rank's stages and micro-batch, Ulysses' two all-to-alls each way, or the ring's cp - 1 K/V
    shifts forward and cp - 1 K/V plus cp dK/dV shifts backward (activation checkpointing
    repeats the forward's; zero-bubble's weight pass backpropagates through attention again). ``traffic``: then the ledger's ``cp`` bytes of one more forward +
    backward (payload and wire) against the formula with the grid's split of heads and rows."""
    engine = _check(family, plan, layers=layers)
    here = layers if plan.pp == 1 else sum(e - s for s, e in engine.stage_ranges[engine.mesh.axis("pp").rank])
    cp, recompute = plan.cp, int(plan.activation_checkpointing)
    fwd, bwd = (2, 2) if plan.cp_mode == "ulysses" else (cp - 1, 2 * cp - 1)
    if plan.schedule == "zero-bubble" and engine.mesh.axis("pp").rank > 0:
        bwd *= 2  # BI (input gradient, but stage 0's) and BW each backpropagate through attention
    op = "all_to_all" if plan.cp_mode == "ulysses" else "ring_shift"
    stats = engine.comm_stats()["cp"]
    assert stats["ops"] == {op: STEPS * plan.microbatches * here * (fwd * (1 + recompute) + bwd)}, (
        engine.plan.describe(),
        family,
        here,
        stats,
    )
    if not traffic:
        return engine
    assert plan.pp == 1 and plan.microbatches == 1 and not plan.activation_checkpointing
    batch = shard(global_batches(1, BATCH)[0], engine.dp_rank, engine.dp_size)
    engine.reset_comm_stats()
    engine._forward_backward(batch)
    got = engine.comm_stats()["cp"]
    kw = dict(
        batch=batch["input_ids"].shape[0],
        seq=SEQ,
        cp=cp,
        mode=plan.cp_mode,
        tp=plan.tp,
        tp_mode=plan.tp_mode,
        tp_depth=plan.tp_depth,
        dtype_bytes=4,
    )
    for key, wire in (("bytes", False), ("wire_bytes", True)):
        want = cp_model_traffic(shape_of(engine.model.config), wire=wire, **kw).total
        assert want > 0 and got[key] == want, f"{engine.plan.describe()} {family}: ledger {key} {got[key]} vs {want}"
    _check_planner_bytes(engine, family, layers, ("cp",))
    return engine


def _context_checkpoint(root):
    """Two steps under cp 2 x 2D tp 4, saved; loaded under pp 2 x cp 2 x 1D tp 2 (ring), two more."""
    batches = global_batches(4, BATCH)
    want = _serial("llama", 2, steps=4)
    path = os.path.join(root, "cp2-2d")
    save_plan = bh.Plan(cp=2, tp=4, tp_mode="2d")
    for plan in (save_plan, bh.Plan(pp=2, cp=2, tp=2, cp_mode="ring", microbatches=2)):
        model = build("llama", num_layers=2)
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


def _pipelined_forward_with_context():
    """``bh.parallelize`` alone under pp 2 x cp 2 x dp 2: the model called outside a schedule on
    this rank's share of the sequence (``context.split``) runs the pipeline forward, and the last
    stage returns the serial logits of those tokens."""
    from behemoth.parallel.context import split_sequence

    ids = global_batches(1, BATCH)[0]["input_ids"]
    for family, mode in (("hf-llama", "ulysses"), ("gpt", "ring")):
        serial = build(family).eval()
        model = bh.parallelize(build(family).eval(), bh.Plan(dp=2, pp=2, cp=2, cp_mode=mode))
        par = bh.parallelization(model)
        local, kwargs = par.context.split({"input_ids": ids})
        with torch.no_grad():
            want = split_sequence(
                serial(ids) if family == "gpt" else serial(ids).logits, 1, 2, par.context.axis.rank, mode
            )
            out = model(local["input_ids"], **kwargs)
        if par.pipeline.rank == 0:
            assert out is None, (family, mode)
            continue
        got = out if family == "gpt" else out.logits
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=lambda m: f"{family} {mode}: {m}")


def _world8(rank, world, root):
    torch.manual_seed(rank)
    grid_2d = dict(tp=4, tp_mode="2d")
    for family, mode, traffic in (
        ("gpt", "ulysses", True),
        ("llama", "ring", False),
        ("hf-gpt2", "ring", False),
        ("hf-llama", "ulysses", True),
        ("llama", "ulysses", True),
    ):
        _check_context(family, bh.Plan(cp=2, cp_mode=mode, **grid_2d), traffic=traffic)
    _check_context("gpt", bh.Plan(cp=2, cp_mode="ring", microbatches=2, activation_checkpointing=True, **grid_2d))
    # pipelines with context parallelism: every stage runs its share of the sequence
    for family, plan in (
        ("gpt", bh.Plan(dp=2, pp=2, cp=2, cp_mode="ulysses", microbatches=2)),
        (
            "hf-gpt2",
            bh.Plan(dp=2, pp=2, cp=2, cp_mode="ring", microbatches=2, schedule="interleaved", virtual_stages=2),
        ),
        ("llama", bh.Plan(pp=2, cp=2, tp=2, cp_mode="ring", microbatches=2, schedule="zero-bubble")),
        (
            "hf-llama",
            bh.Plan(
                pp=2, cp=2, tp=2, cp_mode="ulysses", microbatches=2, schedule="gpipe", activation_checkpointing=True
            ),
        ),
    ):
        engine = _check_context(family, plan, layers=LAYERS)
        _check_planner_bytes(engine, family, LAYERS, ("pp",))
    # with ZeRO: gradients reduced (and ZeRO-3 parameters gathered) over dp x cp
    _check("gpt", bh.Plan(dp=2, pp=2, cp=2, zero=1, chunk_mb=0.02, microbatches=2))
    _check("llama", bh.Plan(cp=2, cp_mode="ring", tp=4, tp_mode="2d", zero=3, chunk_mb=0.02), layers=2)
    _check("hf-gpt2", bh.Plan(dp=2, cp=2, tp=2, tp_mode="2.5d", tp_depth=2, zero=2), layers=2)
    _pipelined_forward_with_context()
    _context_checkpoint(root)


def _world16(rank, world, root):
    torch.manual_seed(rank)  # per-rank RNG differs: every rank must start from one model
    _pipeline_grid()
    _pipeline_grid_checkpoint(root)
    _check_context("gpt", bh.Plan(cp=2, cp_mode="ulysses", tp=8, tp_mode="3d"), traffic=True)
    _check_context("hf-llama", bh.Plan(cp=2, cp_mode="ring", tp=8, tp_mode="3d"))
    _check_context("llama", bh.Plan(cp=2, cp_mode="ring", tp=8, tp_mode="2.5d", tp_depth=2), traffic=True)
    _check_context("hf-gpt2", bh.Plan(pp=2, cp=2, cp_mode="ulysses", tp=4, tp_mode="2d", microbatches=2), layers=LAYERS)


def test_compositions_on_8_ranks_match_serial(tmp_path):
    bh.spawn(_world8, 8, str(tmp_path), timeout=500)


def test_compositions_on_16_ranks_match_serial(tmp_path):
    bh.spawn(_world16, 16, str(tmp_path), timeout=550)

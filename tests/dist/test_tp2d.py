"""2D (Optimus) and 2.5D (Tesseract) tensor parallelism on whole models matches serial
training (the parity law), through the same ``engine.step(batch)`` as every plan.

* behemoth's GPT and Llama, transformers' GPT2LMHeadModel (fused Conv1D QKV, tied
  embeddings) and LlamaForCausalLM (GQA; also one kv head, fewer than q) at 2D tp=4 (AdamW
  and SGD, clipping, micro-batches, a user loss_fn); dp=2 x 2D tp=4; 2.5D tp=8 (depth 2):
  losses, ``full_state_dict()`` and the clipped gradient norm (replicated shards counted
  once) within rtol 1e-4 of serial;
* the comm ledger's tp bytes against behemoth.planner.tp2d_traffic (2D and 2.5D);
* per-rank saved activation bytes of one transformer block within 1.02x of serial / tp;
* checkpoints: 2D tp=4 -> dp=2 x 1D tp=2, dp=4, 2.5D tp=8 and dp=2 x 2D; dp=4 -> 2D;
* clear errors, on every rank, for heads / kv heads / hidden / vocab / batch that the grid
  does not divide, and for parameters or roles the 2D rewrite cannot place.

Two spawned worlds (4 and 8 ranks) run every scenario (spawning costs seconds on two cores).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from common import (
    SEQ,
    TINY_POLICY,
    VOCAB,
    TinyLM,
    assert_grad_norms_close,
    assert_losses_close,
    assert_ranks_agree,
    assert_state_close,
    block_saved_bytes,
    build,
    expect_error,
    global_batches,
    load_and_continue,
    make_optimizer,
    serial_reference,
    shard,
    train_and_save,
    train_steps,
)

import behemoth as bh
from behemoth.parallel.tensor import tp2d, tp2p5d
from behemoth.planner.tp2d_traffic import tp2d_model_traffic
from behemoth.specs import shape_of

STEPS, BATCH = 3, 8
TP_AXES = ("tp", "tp_row", "tp_col", "tp_depth")


def _check_plan(family, plan, *, opt="adamw", clip=1.0, loss_fn=None, what=""):
    batches = global_batches(STEPS, BATCH)
    model = build(family)
    engine = bh.boost(model, make_optimizer(opt, model), plan, max_grad_norm=clip, loss_fn=loss_fn)
    losses, norms = train_steps(engine, batches)
    want = serial_reference(family, opt, STEPS, BATCH, clip, plan.precision)
    what = f"{what or engine.plan.describe()} {family}/{opt}/clip={clip}"
    rtol = 1e-4 if plan.precision == "fp32" else 2e-2  # low-precision GEMMs of other splits round differently
    assert_losses_close(losses, want.losses, rtol=rtol, what=what)
    assert_state_close(engine.full_state_dict(), want.state, rtol=rtol, atol=1e-5 if rtol == 1e-4 else 2e-3, what=what)
    assert_ranks_agree(losses, f"{what} loss")
    # every step's norm is the serial one: shards replicated on tp_row / tp_depth count once
    assert_grad_norms_close(norms, want.grad_norms, rtol=rtol, what=what)
    if plan.tp_mode == "2d" and family == "hf-gpt2":  # tied embeddings stay one Parameter
        assert engine.model.lm_head.weight is engine.model.transformer.wte.weight
    return engine


def _loss_fn(out, b):
    return F.cross_entropy(out.logits.flatten(0, 1), b["labels"].flatten(), ignore_index=-100)


# ----------------------------------------------------------------------------- traffic
def _check_traffic(family, plan):
    model = build(family)
    shape = shape_of(model.config)
    engine = bh.boost(model, make_optimizer("sgd", model), plan)
    batch = shard(global_batches(1, BATCH)[0], engine.dp_rank, engine.dp_size)
    engine.reset_comm_stats()
    engine._forward_backward(batch)
    stats = engine.comm_stats()
    got = sum(stats.get(a, {}).get("wire_bytes", 0) for a in TP_AXES)
    mesh = engine.mesh
    want = tp2d_model_traffic(
        shape,
        batch=batch["input_ids"].shape[0],
        seq=SEQ,
        tp=plan.tp,
        depth=plan.tp_depth,
        dtype_bytes=4,
        param_bytes=4,
        diagonal=mesh.coord("tp_row") == mesh.coord("tp_col"),
    ).total
    # and the engine's report of the loss: its float64 sum all-reduced over each batch axis
    want += sum(2 * (ax.size - 1) * 8 / ax.size for ax in engine.parallel.batch_axes)
    assert got == want, f"{plan.describe()} {family}: ledger {got} B vs formula {want:.0f} B"


# ----------------------------------------------------------------------------- memory
def _check_memory(family, plan):
    """2D / 2.5D: each rank saves at most 1.02x serial / tp; 1D (with or without SP) is reported
    beside them (the block's input is whole; SP's hook scatters it)."""
    split = {"2d": tp2d.split_activation_2d, "2.5d": tp2p5d.split_activation_25d}.get(plan.tp_mode)
    return block_saved_bytes(family, plan, split, BATCH)


# ----------------------------------------------------------------------------- errors
def _boost(model, plan, **kw):
    return bh.boost(model, make_optimizer("sgd", model), plan, **kw)


def _errors(world):
    from behemoth.models import GPT, GPTConfig, Llama, LlamaConfig

    plan = bh.Plan(tp=4, tp_mode="2d")
    gpt = dict(vocab_size=VOCAB, seq_len=SEQ, num_layers=1, num_heads=4, hidden=32)
    expect_error(
        lambda: _boost(GPT(GPTConfig(**{**gpt, "num_heads": 3, "hidden": 24})), plan),
        "attention heads (num_heads of blocks.0.attn) = 3",
        "by 2",
    )
    expect_error(
        lambda: _boost(Llama(LlamaConfig(**{**gpt, "num_heads": 6, "hidden": 48}, num_kv_heads=3)), plan),
        "key/value heads (num_kv_heads of layers.0.attn) = 3",
        "neither a multiple nor a divisor of q = 2",
    )
    expect_error(
        lambda: _boost(GPT(GPTConfig(**{**gpt, "vocab_size": 95})), plan), "vocab_size (rows of wte) = 95", "by 2"
    )
    expect_error(lambda: _boost(GPT(GPTConfig(**gpt, ffn_hidden=33)), plan), "out features of blocks.0.mlp.fc", "= 33")
    expect_error(lambda: _boost(TinyLM(15), plan, tp_policy=TINY_POLICY), "hidden (embedding dim of tok) = 15")
    expect_error(lambda: _boost(TinyLM(16), plan, tp_policy=TINY_POLICY), "parameter gate has no tensor-parallel role")
    expect_error(
        lambda: _boost(TinyLM(16), plan, tp_policy={"up": "colwise", "down": "rowwise"}),
        "'embedding' role",
        "'head' role",
    )
    engine = _boost(build("gpt"), plan)
    odd = {k: v[:5] for k, v in global_batches(1, BATCH)[0].items()}
    expect_error(lambda: engine.step(odd), "batch size = 5", "not divisible by 2", "tp_row=2")
    engine = _boost(build("gpt"), bh.Plan(tp=4, tp_mode="2d", microbatches=2))
    six = {k: v[:6] for k, v in global_batches(1, BATCH)[0].items()}
    expect_error(lambda: engine.step(six), "2 micro-batch(es) of 3", "multiple of microbatches * 2 = 4")
    # Every rank got here without a collective hanging; prove all are alive.
    t = torch.ones(1)
    torch.distributed.all_reduce(t)
    assert t.item() == world


def test_plan_accepts_2d_and_25d():  # 3D: tests/dist/test_tp3d.py
    bh.Plan(tp=4, tp_mode="2d").check_supported()
    bh.Plan(dp=2, tp=8, tp_mode="2.5d", tp_depth=2).check_supported()


# ----------------------------------------------------------------------------- checkpoints
CKPT_FAMILIES = ("hf-gpt2", "llama")  # tied + fused Conv1D; GQA without ties
PLAN_2D = bh.Plan(tp=4, tp_mode="2d")


def _save_2d(root):
    for family in CKPT_FAMILIES:
        train_and_save(family, PLAN_2D, os.path.join(root, family, "2d-tp4", "step-2"), BATCH)


# ----------------------------------------------------------------------------- worlds
def _world_4(rank, world, root):
    _check_plan("gpt", PLAN_2D)
    _check_plan("llama", bh.Plan(tp=4, tp_mode="2d", microbatches=2), opt="sgd", clip=None)
    _check_plan("hf-gpt2", bh.Plan(tp=4, tp_mode="2d", microbatches=2))
    _check_plan("hf-llama", PLAN_2D, opt="sgd")
    _check_plan("hf-gpt2", PLAN_2D, what="loss_fn", loss_fn=_loss_fn, clip=None)  # full logits, gathered
    _check_plan("hf-llama-kv1", PLAN_2D)  # 1 kv head < q = 2: each grid column computes it
    _check_plan("gpt", bh.Plan(tp=4, tp_mode="2d", precision="bf16", activation_checkpointing=True), opt="sgd")
    for family in ("gpt", "hf-llama", "hf-llama-kv1"):
        _check_traffic(family, PLAN_2D)
    for family in ("gpt", "llama"):
        _check_memory(family, PLAN_2D)
    _errors(world)
    _save_2d(root)
    for family in CKPT_FAMILIES:
        train_and_save(family, bh.Plan(dp=4), os.path.join(root, family, "dp4", "step-2"), BATCH)
        load_and_continue(family, bh.Plan(dp=2, tp=2), os.path.join(root, family, "2d-tp4", "step-2"), BATCH)
        load_and_continue(family, bh.Plan(dp=4), os.path.join(root, family, "2d-tp4", "step-2"), BATCH)
        load_and_continue(family, PLAN_2D, os.path.join(root, family, "dp4", "step-2"), BATCH)


def _world_8(rank, world, root):
    plan_25d = bh.Plan(tp=8, tp_mode="2.5d", tp_depth=2)
    _check_plan("gpt", bh.Plan(dp=2, tp=4, tp_mode="2d", microbatches=2))
    _check_plan("gpt", plan_25d)
    _check_plan("hf-llama", plan_25d, opt="sgd")
    _check_plan("hf-llama-kv1", plan_25d, opt="sgd", clip=None)
    _check_traffic("llama", plan_25d)
    _check_memory("gpt", plan_25d)
    for family in CKPT_FAMILIES:
        load_and_continue(family, plan_25d, os.path.join(root, family, "2d-tp4", "step-2"), BATCH)
    load_and_continue(
        "hf-gpt2", bh.Plan(dp=2, tp=4, tp_mode="2d"), os.path.join(root, "hf-gpt2", "2d-tp4", "step-2"), BATCH
    )


def _save_world(rank, world, root):
    _save_2d(root)


@pytest.fixture(scope="module")
def ckpt_root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tp2d-ckpt"))


def test_2d_models_traffic_memory_errors_checkpoints(ckpt_root):
    bh.spawn(_world_4, 4, ckpt_root, timeout=400)


def test_dp2_2d_and_25d_models_and_resharded_checkpoints(ckpt_root):
    if not os.path.isdir(os.path.join(ckpt_root, "llama", "2d-tp4")):
        bh.spawn(_save_world, 4, ckpt_root, timeout=300)
    bh.spawn(_world_8, 8, ckpt_root, timeout=500)

"""3D tensor parallelism (Colossal-AI 3D with Tensor3D over-decomposition) on whole models
matches serial training (the parity law), through the same ``engine.step(batch)``.

* behemoth's GPT and Llama, transformers' GPT2LMHeadModel (fused Conv1D QKV, tied
  embeddings) and LlamaForCausalLM (GQA) at 3D tp=8 (AdamW and SGD, clipping, micro-batches):
  losses, ``full_state_dict()`` and the clipped gradient norm (replicated shards counted once)
  within rtol 1e-4 of serial; the same with ``tp_overlap=2``, which also equals
  ``tp_overlap=1`` (losses and states, up to the summation order of dW);
* bf16 autocast with activation checkpointing and ``tp_overlap=2`` (rtol 2e-2);
* per-row position ids (GPT's learned table in the residual stream, Llama's RoPE inside
  attention) and a user loss_fn on the gathered logits;
* the comm ledger's tp bytes against behemoth.planner.tp3d_traffic (within 10%);
* per-rank saved activation bytes of one transformer block within 1.02x of serial / tp;
* checkpoints: 3D tp=8 -> dp=8 and -> dp=2 x 1D tp=4; dp=8 -> 3D with tp_overlap=2;
* clear errors, on every rank, for heads / kv heads / hidden / vocab / batch / overlap that
  the cube does not divide, and for parameters the rewrite cannot place.

One spawned world of 8 ranks (q = 2) runs every scenario (spawning costs seconds on two cores).
"""

from __future__ import annotations

import os

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
    train_and_save,
    train_steps,
)

import behemoth as bh
from behemoth.parallel.tensor import tp3d
from behemoth.planner.tp3d_traffic import tp3d_model_traffic
from behemoth.specs import shape_of

STEPS, BATCH = 3, 8  # q = 2: 8 rows -> 2 per rank (1 per rank with 2 micro-batches)
TP_AXES = ("tp", "tp_row", "tp_col", "tp_depth")
PLAN_3D = bh.Plan(tp=8, tp_mode="3d")
PLAN_3D_K2 = bh.Plan(tp=8, tp_mode="3d", tp_overlap=2)


def _logits(out):
    return out if isinstance(out, torch.Tensor) else out.logits


def _check_plan(family, plan, *, opt="adamw", clip=1.0):
    """Train 3 steps under ``plan``; compare with serial. Returns (losses, full state)."""
    batches = global_batches(STEPS, BATCH)
    model = build(family)
    engine = bh.boost(model, make_optimizer(opt, model), plan, max_grad_norm=clip)
    losses, norms = train_steps(engine, batches)
    want = serial_reference(family, opt, STEPS, BATCH, clip, plan.precision)
    what = f"{engine.plan.describe()} {family}/{opt}/clip={clip}"
    state = engine.full_state_dict()
    rtol = 1e-4 if plan.precision == "fp32" else 2e-2  # low-precision GEMMs of other splits round differently
    assert_losses_close(losses, want.losses, rtol=rtol, what=what)
    assert_state_close(state, want.state, rtol=rtol, atol=1e-5 if rtol == 1e-4 else 2e-3, what=what)
    assert_ranks_agree(losses, f"{what} loss")
    # every step's norm is the serial one: shards replicated over tp_row / tp_depth / tp_col count once
    assert_grad_norms_close(norms, want.grad_norms, rtol=rtol, what=what)
    if family in ("gpt", "hf-gpt2"):  # tied embeddings stay one Parameter
        m = engine.model
        emb, head = (m.wte, m.lm_head) if family == "gpt" else (m.transformer.wte, m.lm_head)
        assert head.weight is emb.weight, f"{what}: the tied head and embedding hold different Parameters"
    return losses, state


def _check_overlap(family, opt, clip, microbatches=1):
    """tp_overlap=2 matches serial, and tp_overlap=1 to summation order (tighter than serial)."""
    kw = dict(tp=8, tp_mode="3d", microbatches=microbatches)
    l1, s1 = _check_plan(family, bh.Plan(**kw), opt=opt, clip=clip)
    l2, s2 = _check_plan(family, bh.Plan(**kw, tp_overlap=2), opt=opt, clip=clip)
    what = f"{family}: tp_overlap=2 vs 1"
    assert_losses_close(l2, l1, rtol=1e-6, what=what)
    assert_state_close(s2, s1, rtol=1e-5, atol=1e-6, what=what)


# ----------------------------------------------------------------------------- positions, loss_fn
def _position_batches():
    """Tuple batches (ids, per-row position ids): each row its own positions, so a row block
    that reached the wrong rows (of the residual stream, or of attention) would show."""
    out = []
    for b in global_batches(STEPS, BATCH, seed=77):
        rows = torch.arange(BATCH)[:, None]
        pos = (torch.arange(SEQ)[None] * (rows % 3 + 1) + rows) % SEQ
        out.append((b["input_ids"], pos))
    return out


def _next_token_loss(out, batch):
    logits, ids = _logits(out), batch[0]
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def _check_positions(family):
    batches = _position_batches()
    serial = build(family)
    opt = make_optimizer("sgd", serial)
    want = []
    for b in batches:
        loss = _next_token_loss(serial(*b), b)
        loss.backward()
        opt.step()
        opt.zero_grad()
        want.append(loss.item())
    model = build(family)
    engine = bh.boost(model, make_optimizer("sgd", model), PLAN_3D, loss_fn=_next_token_loss)
    got = [engine.step(b) for b in batches]
    what = f"3d {family}: per-row position ids + loss_fn"
    assert_losses_close(got, want, what=what)
    assert_state_close(engine.full_state_dict(), serial.state_dict(), what=what)


# ----------------------------------------------------------------------------- traffic
def _check_traffic(family, plan):
    model = build(family)
    shape = shape_of(model.config)
    engine = bh.boost(model, make_optimizer("sgd", model), plan)
    batch = global_batches(1, BATCH)[0]
    engine.reset_comm_stats()
    engine._forward_backward(batch)
    stats = engine.comm_stats()
    got = sum(stats.get(a, {}).get("wire_bytes", 0) for a in TP_AXES)
    want = tp3d_model_traffic(shape, batch=BATCH, seq=SEQ, tp=plan.tp, dtype_bytes=4, param_bytes=4).total
    # and the engine's report of the loss: its float64 sum all-reduced over each batch axis
    want += sum(2 * (ax.size - 1) * 8 / ax.size for ax in engine.parallel.batch_axes)
    assert got == want, f"{plan.describe()} {family}: ledger {got} B vs formula {want:.0f} B"
    return got, want


# ----------------------------------------------------------------------------- memory
def _check_memory(family, plan):
    """Each rank saves at most 1.02x serial / tp (activations are partitioned; Linear3D saves
    its input shard and re-gathers in backward)."""
    return block_saved_bytes(family, plan, tp3d.split_activation_3d, BATCH)


# ----------------------------------------------------------------------------- errors
def _boost(model, plan=PLAN_3D, **kw):
    return bh.boost(model, make_optimizer("sgd", model), plan, **kw)


def _errors(world):
    from behemoth.models import GPT, GPTConfig, Llama, LlamaConfig

    gpt = dict(vocab_size=VOCAB, seq_len=SEQ, num_layers=1, num_heads=4, hidden=32)
    expect_error(
        lambda: _boost(GPT(GPTConfig(**{**gpt, "num_heads": 3, "hidden": 24}))),
        "attention heads (num_heads of blocks.0.attn) = 3",
        "by 2",
    )
    expect_error(
        lambda: _boost(Llama(LlamaConfig(**gpt, num_kv_heads=1))),
        "key/value heads (num_kv_heads of layers.0.attn) = 1",
        "not divisible by q = 2",
    )
    expect_error(lambda: _boost(GPT(GPTConfig(**{**gpt, "vocab_size": 98}))), "vocab_size (rows of wte", "= 98", "by 4")
    expect_error(
        lambda: _boost(GPT(GPTConfig(**gpt, ffn_hidden=34))), "out features of blocks.0.mlp.fc", "= 34", "by 4"
    )
    expect_error(lambda: _boost(TinyLM(15), tp_policy=TINY_POLICY), "hidden (embedding dim of tok) = 15")
    expect_error(lambda: _boost(TinyLM(16), tp_policy=TINY_POLICY), "parameter gate has no tensor-parallel role")
    expect_error(
        lambda: _boost(TinyLM(16), tp_policy={"up": "colwise", "down": "rowwise"}), "'embedding' role", "'head' role"
    )
    six = {k: v[:6] for k, v in global_batches(1, BATCH)[0].items()}
    engine = _boost(build("gpt"))
    expect_error(lambda: engine.step(six), "batch size = 6", "not divisible by 4", "tp_depth=2 x tp_col=2")
    engine = _boost(build("gpt"), bh.Plan(tp=8, tp_mode="3d", tp_overlap=3))
    expect_error(lambda: engine.step(global_batches(1, BATCH)[0]), "tp_overlap=3", "= 32 tokens")
    # Every rank got here without a collective hanging; prove all are alive.
    t = torch.ones(1)
    torch.distributed.all_reduce(t)
    assert t.item() == world


# ----------------------------------------------------------------------------- checkpoints
def _checkpoints(root):
    for family in ("hf-gpt2", "llama"):  # tied + fused Conv1D; GQA without ties
        train_and_save(family, PLAN_3D, os.path.join(root, family, "3d-tp8", "step-2"), BATCH)
        load_and_continue(family, bh.Plan(dp=8), os.path.join(root, family, "3d-tp8", "step-2"), BATCH)
    load_and_continue("llama", bh.Plan(dp=2, tp=4), os.path.join(root, "llama", "3d-tp8", "step-2"), BATCH)
    train_and_save("hf-gpt2", bh.Plan(dp=8), os.path.join(root, "hf-gpt2", "dp8", "step-2"), BATCH)
    load_and_continue("hf-gpt2", PLAN_3D_K2, os.path.join(root, "hf-gpt2", "dp8", "step-2"), BATCH)


# ----------------------------------------------------------------------------- the world
def _world(rank, world, root):
    _check_overlap("gpt", "adamw", 1.0)
    _check_overlap("llama", "sgd", None, microbatches=2)
    _check_overlap("hf-gpt2", "adamw", 1.0)
    _check_overlap("hf-llama", "sgd", 1.0)
    _check_plan(
        "gpt", bh.Plan(tp=8, tp_mode="3d", tp_overlap=2, precision="bf16", activation_checkpointing=True), opt="sgd"
    )
    _check_positions("gpt")  # learned table: positions re-indexed onto the residual rows
    _check_positions("llama")  # RoPE: positions follow the batch split into attention
    for family, plan in (("gpt", PLAN_3D), ("hf-llama", PLAN_3D_K2)):
        _check_traffic(family, plan)
    for family in ("gpt", "llama"):
        _check_memory(family, PLAN_3D)
    _errors(world)
    _checkpoints(root)


def test_plan_accepts_3d_and_overlap():
    bh.Plan(tp=8, tp_mode="3d").check_supported()
    bh.Plan(dp=2, tp=8, tp_mode="3d", tp_overlap=2).check_supported()


def test_3d_models_overlap_traffic_memory_errors_checkpoints(tmp_path):
    bh.spawn(_world, 8, str(tmp_path), timeout=500)

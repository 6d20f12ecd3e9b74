"""Experts inside pipeline stages (pp=2 x dp=2, ep=2 and ep=1): each stage's MoE layers exchange
tokens over the stage's ep group, and their router losses reach the objective exactly as serially,
per global micro-batch (weight 1/microbatches) -- against serial training (losses, every step's
gradient norm, ``full_state_dict()``, rtol 1e-4, fp32):

* behemoth's MoE Llama (a balancing loss and a z-loss per layer) under 1F1B, ep=2 and ep=1, and
  under ZeRO-2; a checkpoint saved at pp=2 x ep=2 loads at ep=1;
* its sigmoid router with the auxiliary-loss-free bias (moved once per step from the counts of
  every micro-batch), a shared expert and a capacity, under zero-bubble with activation
  checkpointing: the token and drop counts of every layer equal serial's on every rank; and with
  the sequence split inside the stages (cp=2 ring, and 1D tp=2 with sequence parallelism);
* transformers' Mixtral, Qwen3-MoE (whose first layer is dense: a stage without an MoE block) and
  OLMoE (8 experts, top-4), whose one balancing loss pools every layer's counts and probabilities:
  each stage's share needs the totals of the layers on the other stage, which ride with
  activations and gradients (also between the chunks of the interleaved schedule).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from common import assert_grad_norms_close, assert_losses_close, assert_state_close, global_batches, shard, train_steps
from test_expert_families import adamw, build_hf_moe
from test_expert_parallel import BATCH, STEPS, build_moe, optimizer_for, serial_moe_run
from test_expert_routing import build as build_routed
from test_expert_routing import serial_run as serial_routed_run

import behemoth as bh

DP, MICRO = 2, 2


def serial_hf_micro_run(family: str, batches, world: int, micro: int, clip=1.0, layers=2):
    """Serial transformers over global micro-batches (micro-batch i of every data rank together):
    each one's token-loss sum over the step's token count plus ``router_aux_loss_coef *
    outputs.aux_loss / micro`` (transformers' balancing loss of that micro-batch)."""
    model = build_hf_moe(family, layers=layers)
    opt = adamw(model)
    coef = model.config.router_aux_loss_coef
    losses, norms = [], []
    for b in batches:
        n = (b["labels"] != -100).sum()
        loss = 0.0
        for i in range(micro):
            g = {k: torch.cat([shard(b, r, world)[k].chunk(micro)[i] for r in range(world)]) for k in b}
            out = model(g["input_ids"])
            ce = F.cross_entropy(
                out.logits.float().flatten(0, 1), g["labels"].flatten(), ignore_index=-100, reduction="sum"
            )
            part = ce / n + coef * out.aux_loss / micro
            part.backward()
            loss += part.item()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, norms


def _check(engine, batches, want, what) -> None:
    losses, norms = train_steps(engine, batches)
    assert_losses_close(losses, want[0], what=what)
    assert_grad_norms_close(norms, want[2], what=what)
    assert_state_close(engine.full_state_dict(), want[1], what=what)


def _pipeline_world(rank: int, world: int, path: str) -> None:
    batches = global_batches(STEPS, BATCH)
    want = serial_moe_run(batches, clip=1.0, world=DP, micro=MICRO)
    for ep, zero in ((2, 0), (1, 0), (2, 2)):
        what = f"behemoth MoE pp=2 dp={DP} ep={ep} zero={zero} 1f1b"
        model = build_moe()
        plan = bh.Plan(dp=DP, pp=2, ep=ep, microbatches=MICRO, zero=zero, chunk_mb=0.02 if zero else None)
        engine = bh.boost(model, optimizer_for(model), plan, max_grad_norm=1.0)
        assert len(engine.parallel.experts) == 1, what  # this stage's MoE layer only
        _check(engine, batches, want, what)
        # every layer's tokens per expert in the last micro-batch, on every rank (a collective over pp)
        assert engine.expert_token_counts() == {f"layers.{i}.mlp": c for i, c in enumerate(want[3])}, what

    # a checkpoint saved after two steps at pp=2 x ep=2 loads at pp=2 x ep=1 and keeps matching serial
    model = build_moe()
    engine = bh.boost(model, optimizer_for(model), bh.Plan(dp=DP, pp=2, ep=2, microbatches=MICRO), max_grad_norm=1.0)
    train_steps(engine, batches[:2])
    engine.save(path)
    fresh = build_moe(seed=5)
    engine = bh.boost(fresh, optimizer_for(fresh), bh.Plan(dp=DP, pp=2, ep=1, microbatches=MICRO), max_grad_norm=1.0)
    engine.load(path)
    _check(engine, batches[2:], (want[0][2:], want[1], want[2][2:]), "saved at pp=2 ep=2, loaded at pp=2 ep=1")

    name = "sigmoid-bias-shared-capacity"
    what = f"{name} pp=2 dp={DP} ep=2 zero-bubble ckpt"
    want = serial_routed_run(name, batches, DP, MICRO)
    model = build_routed(name)
    plan = bh.Plan(dp=DP, pp=2, ep=2, microbatches=MICRO, schedule="zero-bubble", activation_checkpointing=True)
    engine = bh.boost(model, adamw(model), plan, max_grad_norm=1.0)
    losses, norms = [], []
    for step, b in enumerate(batches):
        losses.append(engine.step(shard(b, engine.dp_rank, engine.dp_size)))
        norms.append(engine.last_grad_norm)
        counts = engine.expert_token_counts()
        assert counts == {f"layers.{i}.mlp": c for i, (c, _) in enumerate(want[3][step])}, (what, step, counts)
        layer = next(iter(engine.parallel.experts.layers.values()))
        index = engine.mesh.axis("pp").rank
        assert layer.dropped_counts.tolist() == want[3][step][index][1], (what, step)  # serial's drops
    assert_losses_close(losses, want[0], what=what)
    assert_grad_norms_close(norms, want[2], what=what)
    state = engine.full_state_dict()
    assert_state_close(state, want[1], what=what)
    assert all(state[f"layers.{i}.mlp.expert_bias"].abs().sum() > 0 for i in range(2)), what  # the biases moved

    # pipelines with the sequence split inside each stage (ep=1, dp=1: the style still runs the blocks):
    # a capacity over ring's zigzag shares of the sequence, and 1D sequence parallelism
    want = serial_routed_run(name, batches, 1, MICRO)
    for plan in (
        bh.Plan(dp=1, pp=2, cp=2, cp_mode="ring", microbatches=MICRO),
        bh.Plan(dp=1, pp=2, tp=2, sequence_parallel=True, microbatches=MICRO),
    ):
        what = f"{name} {plan.describe()}"
        model = build_routed(name)
        _check(bh.boost(model, adamw(model), plan, max_grad_norm=1.0), batches, want, what)

    for family, zero in (("mixtral", 1), ("qwen3-moe", 0), ("olmoe", 0)):
        what = f"transformers {family} pp=2 dp={DP} ep=2 zero={zero}"
        want = serial_hf_micro_run(family, batches, DP, MICRO)
        model = build_hf_moe(family)
        plan = bh.Plan(dp=DP, pp=2, ep=2, microbatches=MICRO, zero=zero, chunk_mb=0.02 if zero else None)
        engine = bh.boost(model, adamw(model), plan, max_grad_norm=1.0)
        holds = len(engine.parallel.experts)
        assert holds == (0 if family == "qwen3-moe" and engine.mesh.axis("pp").rank == 0 else 1), (what, holds)
        _check(engine, batches, want, what)

    # interleaved: 4 stages over 2 ranks, the totals passing rank 1 -> rank 0 between chunks
    what = f"transformers mixtral pp=2 x 2 chunks dp={DP} ep=2 interleaved"
    want = serial_hf_micro_run("mixtral", batches, DP, 4, layers=4)
    model = build_hf_moe("mixtral", layers=4)
    plan = bh.Plan(dp=DP, pp=2, ep=2, microbatches=4, schedule="interleaved", virtual_stages=2)
    engine = bh.boost(model, adamw(model), plan, max_grad_norm=1.0)
    _check(engine, batches, want, what)


def test_experts_in_pipeline_stages_match_serial(tmp_path):
    bh.spawn(_pipeline_world, 4, str(tmp_path / "ckpt"), timeout=1500)

"""Per-operator plans with tensor parallelism: attention (and dense MLPs) split over 1D tp, experts
sharded over ep and whole on every tp rank, in one model -- against serial training (losses, every
step's gradient norm, ``full_state_dict()``, rtol 1e-4, fp32) on dp=2 x tp=2 with ep=2: behemoth's
MoE Llama, the same under ZeRO-2, and a transformers Mixtral; with sequence parallelism too (the MoE
Llama, its capacity router with the aux-free bias under micro-batches and activation checkpointing,
dropping what serial drops, and Mixtral; greedy generation, which pauses sequence parallelism,
equal to serial; and tp=2 with sequence parallelism alone, dp = ep = 1). What does not compose is refused on every rank before any
collective: 2D tp. (OLMoE and Qwen3-MoE, whose q / k norms follow the split heads, under tp and ep:
tests/dist/test_tp_qk_norms.py.)"""

from __future__ import annotations

import torch
from common import (
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


def _tensor_world(rank: int, world: int) -> None:
    batches = global_batches(STEPS, BATCH)
    want = serial_moe_run(batches, clip=1.0)
    for zero in (0, 2):
        what = f"dp=2 tp=2 ep=2 zero={zero}"
        model = build_moe()
        engine = bh.boost(model, optimizer_for(model), bh.Plan(dp=2, tp=2, ep=2, zero=zero), max_grad_norm=1.0)
        attn = engine.model.layers[0].attn
        assert attn.q.weight.shape[0] == 32 // 2, (what, attn.q.weight.shape)  # attention split over tp
        assert engine.model.layers[0].mlp.gate_up_proj.shape[0] == 2, what  # experts over ep, whole over tp
        losses, norms = train_steps(engine, batches)
        assert_losses_close(losses, want[0], what=what)
        assert_grad_norms_close(norms, want[2], what=what)
        assert_state_close(engine.full_state_dict(), want[1], what=what)

    what = "transformers Mixtral dp=2 tp=2 ep=2"
    want = serial_hf_run("mixtral", batches)
    model = build_hf_moe("mixtral")
    engine = bh.boost(model, adamw(model), bh.Plan(dp=2, tp=2, ep=2), max_grad_norm=1.0)
    losses, norms = train_steps(engine, batches)
    assert_losses_close(losses, want[0], what=what)
    assert_grad_norms_close(norms, want[2], what=what)
    assert_state_close(engine.full_state_dict(), want[1], what=what)

    # sequence parallelism: each MoE block reads the gathered sequence and returns its tp rank's shard
    what = "dp=2 tp=2 ep=2 sequence_parallel"
    want = serial_moe_run(batches, clip=1.0)
    model = build_moe()
    engine = bh.boost(model, optimizer_for(model), bh.Plan(dp=2, tp=2, ep=2, sequence_parallel=True), max_grad_norm=1.0)
    losses, norms = train_steps(engine, batches)
    assert_losses_close(losses, want[0], what=what)
    assert_grad_norms_close(norms, want[2], what=what)
    assert_state_close(engine.full_state_dict(), want[1], what=what)

    # generation pauses sequence parallelism (one token per step): the blocks then take and return it whole
    rows = [[3, 5, 7], [11, 2], [9, 9, 4, 1], [14]]
    want_tokens = bh.generate(build_moe().eval(), rows, max_new_tokens=6)
    model = bh.parallelize(build_moe().eval(), bh.Plan(dp=2, tp=2, ep=2, sequence_parallel=True))
    assert bh.generate(model, rows, max_new_tokens=6) == want_tokens, what

    name = "sigmoid-bias-shared-capacity"
    what = f"{name} dp=2 tp=2 ep=2 sequence_parallel micro=2 ckpt"
    want = serial_routed_run(name, batches, 2, 2)
    model = build_routed(name)
    plan = bh.Plan(dp=2, tp=2, ep=2, sequence_parallel=True, microbatches=2, activation_checkpointing=True)
    engine = bh.boost(model, routed_adamw(model), plan, max_grad_norm=1.0)
    losses, norms = train_steps_dropping_as_serial(engine, batches, want[3], what)
    assert_losses_close(losses, want[0], what=what)
    assert_grad_norms_close(norms, want[2], what=what)
    assert_state_close(engine.full_state_dict(), want[1], what=what)

    what = "transformers Mixtral dp=2 tp=2 ep=2 sequence_parallel"
    want = serial_hf_run("mixtral", batches)
    model = build_hf_moe("mixtral")
    engine = bh.boost(model, adamw(model), bh.Plan(dp=2, tp=2, ep=2, sequence_parallel=True), max_grad_norm=1.0)
    losses, norms = train_steps(engine, batches)
    assert_losses_close(losses, want[0], what=what)
    assert_grad_norms_close(norms, want[2], what=what)
    assert_state_close(engine.full_state_dict(), want[1], what=what)

    t = torch.ones(1)
    torch.distributed.all_reduce(t)  # every rank got here: nothing hung
    assert t.item() == world


def test_experts_with_1d_tensor_parallel_match_serial():
    bh.spawn(_tensor_world, 4, timeout=1200)


def _sp_alone_world(rank: int, world: int) -> None:
    """tp=2 with sequence parallelism and nothing else (dp = ep = 1): behemoth's MoE blocks still
    take the gathered sequence and return this rank's shard."""
    batches = global_batches(STEPS, BATCH)
    want = serial_moe_run(batches, clip=1.0)
    model = build_moe()
    engine = bh.boost(model, optimizer_for(model), bh.Plan(tp=2, sequence_parallel=True), max_grad_norm=1.0)
    losses, norms = train_steps(engine, batches)
    what = "dp=1 tp=2 ep=1 sequence_parallel"
    assert_losses_close(losses, want[0], what=what)
    assert_grad_norms_close(norms, want[2], what=what)
    assert_state_close(engine.full_state_dict(), want[1], what=what)


def test_experts_with_sequence_parallel_alone_match_serial():
    bh.spawn(_sp_alone_world, 2, timeout=600)

"""Mixture-of-experts models under the grid tensor-parallel modes (behemoth.parallel.expert.tokens):
each MoE block's input is a rank's batch block with its hidden block; the ranks of its grid row
(``tp_col``) exchange them (one all-to-all) so that each routes and runs the experts on whole rows
of its 1/q share of that batch block's tokens, and exchange the outputs back. Every router then
sees exactly B*S/tp of the data rank's tokens per forward, and training matches serial training
(losses with the router losses, every step's gradient norm, ``full_state_dict()``, rtol 1e-4,
fp32), and each rank's router losses summed as the engine sums the reported loss are serial's
(rtol 1e-6): behemoth's MoE Llama and transformers' Mixtral under tp=4 2D on 4 ranks, behemoth's
MoE Llama with S = 15 (the padded token split) and a capacity router that drops what serial
drops; on 8 ranks tp=8 2.5D (depth 2), tp=8 3D, dp=2 x ep=2 x 2D, and the same under ZeRO-3 with
two micro-batches, ``ep_overlap=2`` and activation checkpointing; on 16 ranks dp=2 x ep=2 x 2.5D
and x 3D."""

from __future__ import annotations

import torch
from common import (
    SEQ,
    assert_grad_norms_close,
    assert_losses_close,
    assert_state_close,
    global_batches,
    shard,
    train_steps,
    train_steps_dropping_as_serial,
)
from test_expert_families import adamw, build_hf_moe, serial_hf_run
from test_expert_parallel import BATCH, STEPS, build_moe, optimizer_for, serial_moe_run
from test_expert_routing import adamw as routed_adamw
from test_expert_routing import build as build_routed
from test_expert_routing import serial_run as serial_routed_run
from test_expert_tokens import _check, _router_rows

import behemoth as bh
from behemoth import comm
from behemoth.batch import row_block


def _router_losses_as_serial(engine, batch, what):
    """Each rank's router losses of one forward, summed as the engine sums the reported loss (over
    the data axis and the grid's input batch axes), are the serial model's on the global batch."""
    serial = build_moe()
    serial(batch["input_ids"])
    want = serial.aux_loss().item()
    par = engine.parallel
    local = row_block(shard(batch, engine.dp_rank, engine.dp_size), par.batch_parts, par.batch_index)
    engine.model(local["input_ids"])
    got = par.experts.aux_loss().detach().double().reshape(1)
    for ax in (engine.data_axis, *par.batch_axes):
        got = comm.all_reduce(got, ax)
    assert torch.isclose(got, torch.tensor([want], dtype=got.dtype), rtol=1e-6, atol=0).item(), (what, got, want)


def _grid_2d(rank: int, world: int) -> None:
    batches = global_batches(STEPS, BATCH)
    want = serial_moe_run(batches, clip=1.0)
    plan = bh.Plan(tp=4, tp_mode="2d")
    model = build_moe()
    engine = bh.boost(model, optimizer_for(model), plan, max_grad_norm=1.0)
    _router_losses_as_serial(engine, batches[0], "MoE Llama tp=4 2d")
    seen = _router_rows(engine.model)
    _check(engine, batches, want, seen, BATCH * SEQ // 4, "MoE Llama tp=4 2d")

    want = serial_hf_run("mixtral", batches)
    model = build_hf_moe("mixtral")
    engine = bh.boost(model, adamw(model), plan, max_grad_norm=1.0)
    seen = _router_rows(engine.model)
    _check(engine, batches, want, seen, BATCH * SEQ // 4, "transformers Mixtral tp=4 2d")

    odd = [{k: v[:, : SEQ - 1].contiguous() for k, v in b.items()} for b in batches]  # S = 15: the token split
    want = serial_moe_run(odd, clip=1.0)
    model = build_moe()
    engine = bh.boost(model, optimizer_for(model), plan, max_grad_norm=1.0)
    seen = _router_rows(engine.model)
    rows = -(-BATCH // 2 * (SEQ - 1) // 2)  # a batch block's tokens, padded to a multiple of q = 2
    col = engine.mesh.axis("tp_col").rank
    _check(engine, odd, want, seen, rows if col == 0 else BATCH // 2 * (SEQ - 1) - rows, "MoE Llama tp=4 2d S=15")

    # a capacity (per whole sequence: the grid row's choices gathered), a shared expert and the aux-free
    # bias, through the grid's token split (S = 15): every rank drops what serial drops
    name = "sigmoid-bias-shared-capacity"
    want = serial_routed_run(name, odd, 1, 1)
    model = build_routed(name)
    engine = bh.boost(model, routed_adamw(model), plan, max_grad_norm=1.0)
    losses, norms = train_steps_dropping_as_serial(engine, odd, want[3], name)
    assert any(sum(d) > 0 for step in want[3] for _, d in step), name  # the capacity dropped some
    assert_losses_close(losses, want[0], what=f"{name} tp=4 2d")
    assert_grad_norms_close(norms, want[2], what=f"{name} tp=4 2d")
    assert_state_close(engine.full_state_dict(), want[1], what=f"{name} tp=4 2d")


def test_moe_under_2d_matches_serial():
    bh.spawn(_grid_2d, 4, timeout=600)


def _eight_ranks(rank: int, world: int) -> None:
    batches = global_batches(STEPS, BATCH)
    want = serial_moe_run(batches, clip=1.0)
    plans = {
        bh.Plan(tp=8, tp_mode="2.5d", tp_depth=2): BATCH * SEQ // 8,
        bh.Plan(tp=8, tp_mode="3d"): BATCH * SEQ // 8,
        bh.Plan(dp=2, ep=2, tp=4, tp_mode="2d"): BATCH // 2 * SEQ // 4,
    }
    for plan, tokens in plans.items():
        model = build_moe()
        engine = bh.boost(model, optimizer_for(model), plan, max_grad_norm=1.0)
        _router_losses_as_serial(engine, batches[0], plan.describe())
        seen = _router_rows(engine.model)
        _check(engine, batches, want, seen, tokens, f"MoE Llama {plan.describe()}")

    # ZeRO-3, two micro-batches, overlapped chunks and checkpointed blocks (whose recompute replays the
    # forward's routes) through the grid's token split
    plan = bh.Plan(dp=2, ep=2, tp=4, tp_mode="2d", zero=3, microbatches=2, ep_overlap=2, activation_checkpointing=True)
    want = serial_moe_run(batches, clip=1.0, world=2, micro=2)
    model = build_moe()
    engine = bh.boost(model, optimizer_for(model), plan, max_grad_norm=1.0)
    losses, norms = train_steps(engine, batches)
    assert_losses_close(losses, want[0], what=plan.describe())
    assert_grad_norms_close(norms, want[2], what=plan.describe())
    assert_state_close(engine.full_state_dict(), want[1], what=plan.describe())


def test_moe_under_25d_3d_and_ep_2d_matches_serial():
    bh.spawn(_eight_ranks, 8, timeout=900)


def _sixteen_ranks(rank: int, world: int) -> None:
    batches = global_batches(STEPS, BATCH)
    want = serial_moe_run(batches, clip=1.0)
    for plan in (bh.Plan(dp=2, ep=2, tp=8, tp_mode="2.5d", tp_depth=2), bh.Plan(dp=2, ep=2, tp=8, tp_mode="3d")):
        model = build_moe()
        engine = bh.boost(model, optimizer_for(model), plan, max_grad_norm=1.0)
        _router_losses_as_serial(engine, batches[0], plan.describe())
        seen = _router_rows(engine.model)
        _check(engine, batches, want, seen, BATCH // 2 * SEQ // 8, f"MoE Llama {plan.describe()}")


def test_ep_under_25d_and_3d_matches_serial():
    bh.spawn(_sixteen_ranks, 16, timeout=900)

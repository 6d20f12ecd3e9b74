"""Expert parallelism with the all-to-alls overlapped with the experts' GEMMs (``Plan.ep_overlap``,
behemoth.parallel.expert.overlap) matches serial training at dp=2 x ep=2: losses, every step's
gradient norm, ``full_state_dict()`` and the per-expert token counts, rtol 1e-4 in fp32 -- with 2
chunks; with 3 chunks, micro-batches and activation checkpointing (the recompute replays the
forward's routes: no second split-size exchange in the ledger); and with a rank whose batch is
empty (every chunk of it empty); with sigmoid scores, the balancing bias, a capacity that drops
(the serial drops) and a shared expert (computed while the last combines travel); and
transformers' Mixtral under ZeRO-3 with activation
checkpointing (its experts module called once per chunk, each call gathering through ZeRO-3's
hooks, in the forward and the recompute). The ep axis's ledger equals the formula exactly (the same rows
as one exchange, one call per chunk each way), and the order in which the all-to-alls are
started and waited for is the overlapped one, forward and backward."""

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
from test_expert_parallel import build_moe, optimizer_for, serial_moe_run
from test_expert_routing import adamw as routing_adamw
from test_expert_routing import build as build_routing
from test_expert_routing import serial_run as serial_routing_run

import behemoth as bh
from behemoth.parallel.expert.traffic import ep_all_to_all_bytes

STEPS, BATCH, LAYERS, EXPERTS, TOP_K, HIDDEN = 3, 8, 2, 4, 2, 32


def check_ledger(engine, rows_per_layer: int, chunks: int, micro: int, recompute: bool, what: str) -> None:
    """The ep axis's calls and bytes (summed over its ranks): per layer and micro-batch, the split
    sizes once and 2 row all-to-alls per chunk forward (twice with a recompute) and backward, plus
    the gradient norm's one fp32 all-reduce per step."""
    ep = engine.comm_stats()["ep"]
    row_calls = 2 * chunks * (3 if recompute else 2)
    assert ep["ops"] == {"all_to_all": STEPS * micro * LAYERS * (1 + row_calls), "all_reduce": STEPS}, (what, ep)
    sent = torch.tensor([float(ep["bytes"])], dtype=torch.float64)
    torch.distributed.all_reduce(sent)
    layer = ep_all_to_all_bytes(
        rows=rows_per_layer, num_experts=EXPERTS, ep=2, hidden=HIDDEN, recompute=recompute, chunks=chunks
    )
    want = STEPS * (micro * LAYERS * layer + 2 * 4)
    assert sent.item() == want, (what, sent.item(), want)


def check_overlap_order(engine, batch, what: str) -> None:
    """One step's ep all-to-alls at 2 chunks, per layer: forward, the split sizes, both chunks'
    dispatch started before the first is waited for, chunk 0's combine started before chunk 1's
    dispatch is waited for, the combines waited for last; backward, both reverse combines started
    before either is waited for, and each reverse dispatch started before the other chunk's
    reverse combine (or dispatch) is waited for."""
    ledger = engine.mesh.axis("ep").ledger
    ledger.trace = []
    engine.step(batch)
    events = ["call" if e[0] == "call" else "wait" for e in ledger.trace if e[1] == "ep"]
    ledger.trace = None
    forward = ["call"] + ["call", "call", "wait", "call", "wait", "call", "wait", "wait"]
    backward = ["call", "call", "wait", "call", "wait", "call", "wait", "wait"]
    want = forward * LAYERS + backward * LAYERS + ["call"]  # the gradient norm's all-reduce last
    assert events == want, (what, events)


def _overlap_world(rank: int, world: int) -> None:
    batches = global_batches(STEPS, BATCH)
    rows = BATCH * SEQ * TOP_K
    for chunks, micro, ckpt in ((2, 1, False), (3, 2, True)):
        what = f"dp={world} ep=2 ep_overlap={chunks} micro={micro} ckpt={ckpt}"
        want = serial_moe_run(batches, clip=1.0, world=world, micro=micro)
        model = build_moe()
        plan = bh.Plan(dp=world, ep=2, ep_overlap=chunks, microbatches=micro, activation_checkpointing=ckpt)
        engine = bh.boost(model, optimizer_for(model), plan, max_grad_norm=1.0)
        losses, norms = train_steps(engine, batches)
        check_ledger(engine, rows // micro, chunks, micro, ckpt, what)
        assert [layer.mlp.token_counts.tolist() for layer in engine.model.layers] == want[3], what
        assert_losses_close(losses, want[0], what=what)
        assert_grad_norms_close(norms, want[2], what=what)
        assert_state_close(engine.full_state_dict(), want[1], what=what)
        if chunks == 2:
            check_overlap_order(engine, shard(batches[0], engine.dp_rank, engine.dp_size), what)

    # an empty rank: rank 0 holds the whole global batch, rank 1 none of it (every chunk empty)
    what = f"empty batch on rank 1, dp={world} ep=2 ep_overlap=2"
    want = serial_moe_run(batches, clip=1.0)
    model = build_moe()
    engine = bh.boost(model, optimizer_for(model), bh.Plan(dp=world, ep=2, ep_overlap=2), max_grad_norm=1.0)
    losses, norms = [], []
    for b in batches:
        mine = b if engine.dp_rank == 0 else {k: v[:0] for k, v in b.items()}
        losses.append(engine.step(mine))
        norms.append(engine.last_grad_norm)
    check_ledger(engine, rows, 2, 1, False, what)
    assert_losses_close(losses, want[0], what=what)
    assert_grad_norms_close(norms, want[2], what=what)
    assert_state_close(engine.full_state_dict(), want[1], what=what)

    name = "sigmoid-bias-shared-capacity"
    what = f"{name} dp={world} ep=2 ep_overlap=2"
    want = serial_routing_run(name, batches, world, 1)
    model = build_routing(name)
    engine = bh.boost(model, routing_adamw(model), bh.Plan(dp=world, ep=2, ep_overlap=2), max_grad_norm=1.0)
    losses, norms = train_steps_dropping_as_serial(engine, batches, want[3], what)
    assert any(sum(d) > 0 for step in want[3] for _, d in step), what  # the capacity dropped some
    assert_losses_close(losses, want[0], what=what)
    assert_grad_norms_close(norms, want[2], what=what)
    assert_state_close(engine.full_state_dict(), want[1], what=what)

    what = f"transformers Mixtral dp={world} ep=2 ep_overlap=2 zero=3 ckpt"
    want = serial_hf_run("mixtral", batches)
    model = build_hf_moe("mixtral")
    plan = bh.Plan(dp=world, ep=2, ep_overlap=2, zero=3, activation_checkpointing=True)
    engine = bh.boost(model, adamw(model), plan, max_grad_norm=1.0)
    losses, norms = train_steps(engine, batches)
    assert_losses_close(losses, want[0], what=what)
    assert_grad_norms_close(norms, want[2], what=what)
    assert_state_close(engine.full_state_dict(), want[1], what=what)


def test_overlapped_expert_exchange_matches_serial():
    bh.spawn(_overlap_world, 2, timeout=600)


def test_ep_overlap_needs_expert_parallelism():
    import pytest

    with pytest.raises(ValueError, match="ep_overlap=2 overlaps expert-parallel all-to-alls"):
        bh.Plan(dp=2, ep_overlap=2)

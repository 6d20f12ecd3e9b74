"""The planner's predicted bytes per axis equal the comm ledger's, for layouts the search emits.

For a tiny GPT on 2 and 4 gloo ranks, the search (fp32, every layout) is run in the parent;
one layout of each kind it emits is picked (plain dp, 1D tp with and without sequence
parallelism and over-decomposition, 2D tp, Ulysses and ring context parallelism, every pipeline
schedule, dp x tp) and run for one forward + backward in one spawned world per size; the
ledger's ``wire_bytes`` per axis must equal ``behemoth.planner.axis_traffic.step_traffic``
exactly (tp summed over its sub-axes). Exact where the formula is: tensor and context
parallelism at pp = 1, pipelines at tp = 1 (a transfer's bytes), data parallelism (ZeRO 0)
at tp = cp = 1. The MoE Llama's tp bytes under 1D tp, with and without sequence parallelism,
equal the ledger's too, and so do its ep bytes for the expert-parallel layouts the search emits
on 2 ranks (``ep_overlap`` 1 and 2, and checkpointed), under a routing every rank shares (see
:func:`_experts_ep_world`). And ``bh.boost(..., plan="auto")`` trains the planner's choice to the
serial losses.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from common import SEQ, assert_losses_close, build, global_batches, make_optimizer, serial_run, shard

import behemoth as bh
from behemoth.planner.axis_traffic import Dtypes, step_traffic
from behemoth.planner.cluster import Cluster
from behemoth.planner.search import Limits, search
from behemoth.planner.workload import workload_for

LAYERS, BATCH = 4, 8
FP32 = Dtypes(compute=4, stream=4, param=4)


def _workload(model):
    return workload_for(model, seq_len=SEQ, global_batch=BATCH)


def _kind(plan) -> tuple:
    return (
        plan.dp > 1,
        plan.tp_mode if plan.tp > 1 else None,
        plan.sequence_parallel,
        plan.tp_overlap,
        plan.cp_mode if plan.cp > 1 else None,
        plan.schedule if plan.pp > 1 else None,
        plan.zero,
    )


def emitted_layouts(world: int, limit: int) -> list:
    """One plan of each kind the search emits for the tiny GPT on ``world`` ranks (fastest first)."""
    w = _workload(build("gpt", num_layers=LAYERS))
    limits = Limits(
        precision="fp32",
        offloads=(None,),
        activation_checkpointing=(False,),
        zero_stages=(0,),
        micro_batch_sizes=(1, 2, 4, 8),
        top=100000,
    )
    res = search(w, Cluster(num_gpus=world), limits)
    cands, seen = [], set()
    for p in res.ranked:
        plan = p.plan
        if (plan.pp == 1 or plan.tp == 1) and plan.ep == 1 and _kind(plan) not in seen:
            seen.add(_kind(plan))
            cands.append(plan)
    out, covered = [], set()
    while cands and len(out) < limit:  # greedy: the plan that shows the most features not yet covered
        best = max(cands, key=lambda pl: len(_features(pl) - covered))
        if not _features(best) - covered:
            break
        covered |= _features(best)
        out.append(best)
        cands.remove(best)
    return out


def _features(plan) -> set:
    f = {("dp", plan.dp > 1), ("schedule", plan.schedule if plan.pp > 1 else None)}
    if plan.tp > 1:
        f |= {
            ("tp", plan.tp_mode, plan.tp),
            ("sp", plan.sequence_parallel),
            ("overlap", plan.tp_mode, plan.tp_overlap),
            ("dp x tp", plan.dp > 1),
        }
    if plan.cp > 1:
        f |= {("cp", plan.cp_mode, plan.cp)}
    if plan.pp > 1:
        f |= {("pp", plan.pp, plan.virtual_stages)}
    return f


def second_step_bytes(engine) -> dict[str, int]:
    """The wire bytes per axis the ledger books for a whole step, the second of two (the first
    makes the pipeline's shape headers and ZeRO-3's gather trace)."""
    batches = global_batches(2, BATCH)
    engine.step(shard(batches[0], engine.dp_rank, engine.dp_size))
    engine.reset_comm_stats()
    engine.step(shard(batches[1], engine.dp_rank, engine.dp_size))
    return {axis: s["wire_bytes"] for axis, s in engine.comm_stats().items() if s["wire_bytes"]}


def _ledger(engine) -> dict[str, float]:
    stats = engine.comm_stats()
    got: dict[str, float] = {}
    for axis, s in stats.items():
        key = "tp" if axis.startswith("tp") else axis
        got[key] = got.get(key, 0) + s["wire_bytes"]
    return got


def _check(plan, rank):
    model = build("gpt", num_layers=LAYERS)
    w = _workload(model)
    engine = bh.boost(model, make_optimizer("sgd", model), plan)
    batches = global_batches(2, BATCH)
    engine.step(shard(batches[0], engine.dp_rank, engine.dp_size))  # the pipeline's shape headers
    engine.reset_comm_stats()
    engine._forward_backward(shard(batches[1], engine.dp_rank, engine.dp_size))
    got = _ledger(engine)
    stage = engine.mesh.coord("pp") if plan.pp > 1 else 0
    mesh = engine.mesh
    diagonal = plan.tp_mode in ("2d", "2.5d") and plan.tp > 1 and mesh.coord("tp_row") == mesh.coord("tp_col")
    want = step_traffic(engine.plan, w, stage=stage, dt=FP32, diagonal=diagonal)
    what = f"{engine.plan.describe()} rank {rank}"
    for axis in ("tp", "cp", "pp"):
        if axis in want:
            assert got.get(axis, 0) == int(want[axis]), f"{what}: {axis} ledger {got.get(axis)} vs planner {want[axis]}"
    if plan.tp == plan.cp == 1 and plan.dp > 1:
        # the step's gradient all-reduce and its two scalars, booked in step() by the gradient sync
        engine.reset_comm_stats()
        engine.step(shard(batches[1], engine.dp_rank, engine.dp_size))
        dp = engine.comm_stats()["dp"]["wire_bytes"]
        assert dp == int(want["dp"]), f"{what}: dp ledger {dp} vs planner {want['dp']}"
    return sorted(want)


def _world(rank, world, plans):
    axes = set()
    for plan in plans:
        axes.update(_check(plan, rank))
    if world == 2:
        _auto(rank, world)
    return axes


def _auto(rank, world):
    """plan='auto' on gloo: the planner's fp32 choice for 8 sequences per rank trains to serial."""
    from behemoth.planner.auto import auto_plan

    model = build("gpt", num_layers=LAYERS)
    engine = bh.boost(model, make_optimizer("sgd", model), "auto")
    want_plan = auto_plan(build("gpt", num_layers=LAYERS), world, limits=Limits(precision="fp32"))
    assert engine.plan == want_plan.resolve(world), (engine.plan, want_plan)
    # the host memory it plans offloaded chunks with: the runtime's share of MemAvailable over the
    # host's ranks, the least any rank read, the same on every rank
    from behemoth.parallel.zero.measure import agreed_offload_host_budget, offload_host_budget

    budget, mine = agreed_offload_host_budget(world), offload_host_budget(world)
    every = [None] * world
    torch.distributed.all_gather_object(every, (budget, mine))
    # every rank the same figure; MemAvailable moves between the two reads, hence the tolerance
    assert len({b for b, _ in every}) == 1 and budget == pytest.approx(min(m for _, m in every), rel=0.05), every
    batches = global_batches(2, 8 * world)
    losses = [engine.step(shard(b, engine.dp_rank, engine.dp_size)) for b in batches]
    assert_losses_close(
        losses,
        serial_run("gpt", "sgd", batches, num_layers=LAYERS).losses,
        what=f"plan='auto' {engine.plan.describe()}",
    )


@pytest.mark.parametrize("world, limit", [(2, 8), (4, 8)])
def test_predicted_bytes_per_axis_equal_the_ledger(world, limit):
    plans = emitted_layouts(world, limit)
    kinds = {_kind(p) for p in plans}
    assert len(plans) >= 5 and any(p.tp > 1 for p in plans) and any(p.pp > 1 for p in plans), plans
    assert any(p.cp > 1 for p in plans) and len(kinds) == len(plans)
    bh.spawn(_world, world, plans, timeout=500)


def _repeats_world(rank, world):
    """Activation checkpointing's recomputed forward and zero-bubble's second backward (BW) run
    their blocks' collectives again; the planner counts them as the ledger books them (a
    pipeline's last stage exactly; the others hold no head, an upper bound there)."""
    for plan in (
        bh.Plan(tp=2, pp=2, microbatches=2, schedule="zero-bubble"),
        bh.Plan(tp=2, cp=2, activation_checkpointing=True),
        bh.Plan(dp=2, tp=2, sequence_parallel=True, activation_checkpointing=True),
    ):
        model = build("gpt", num_layers=LAYERS)
        w = _workload(model)
        engine = bh.boost(model, make_optimizer("sgd", model), plan)
        batches = global_batches(2, BATCH)
        engine.step(shard(batches[0], engine.dp_rank, engine.dp_size))
        engine.reset_comm_stats()
        engine._forward_backward(shard(batches[1], engine.dp_rank, engine.dp_size))
        got = _ledger(engine)
        stage = engine.mesh.coord("pp") if plan.pp > 1 else 0
        want = step_traffic(engine.plan, w, stage=stage, dt=FP32)
        what = f"{engine.plan.describe()} rank {rank} stage {stage}"
        for axis in ("tp", "cp"):
            if axis not in want:
                continue
            if stage == plan.pp - 1:
                assert got.get(axis, 0) == int(want[axis]), f"{what}: {axis} ledger {got.get(axis)} vs {want[axis]}"
            else:
                assert got.get(axis, 0) <= int(want[axis]), f"{what}: {axis} ledger {got.get(axis)} vs {want[axis]}"


def test_recompute_and_zero_bubble_bytes_equal_the_ledger():
    bh.spawn(_repeats_world, 4, timeout=500)


if __name__ == "__main__":
    for w in (2, 4):
        for p in emitted_layouts(w, 8):
            print(w, p.describe())
    torch.manual_seed(0)


def _experts_world(rank, world):
    from common import VOCAB

    from behemoth.models import build_model

    for fields in (dict(tp=2), dict(tp=2, sequence_parallel=True)):
        model = build_model("llama-moe-tiny", vocab_size=VOCAB, seq_len=SEQ, num_layers=LAYERS)
        w = _workload(model)
        engine = bh.boost(model, make_optimizer("sgd", model), bh.Plan(precision="fp32", **fields))
        batches = global_batches(2, BATCH)
        engine.step(shard(batches[0], engine.dp_rank, engine.dp_size))
        engine.reset_comm_stats()
        engine._forward_backward(shard(batches[1], engine.dp_rank, engine.dp_size))
        got, want = _ledger(engine)["tp"], step_traffic(engine.plan, w, dt=FP32)["tp"]
        assert got == int(want), f"{engine.plan.describe()} rank {rank}: tp ledger {got} vs planner {want}"


def test_experts_tp_bytes_equal_the_ledger():
    """A mixture-of-experts model under 1D tp: its experts are whole on every tp rank (no MLP
    collectives), and under sequence parallelism its blocks read the gathered sequence and return
    their shard; the planner's tp bytes equal the ledger's."""
    bh.spawn(_experts_world, 2, timeout=300)


def _moe(layers: int = LAYERS):
    """The tiny MoE Llama with its routers zeroed and frozen: every token scores the experts alike, so every
    rank routes the same share of its rows to each member -- where the planner's even-routing rows
    (each rank sends (ep-1)/ep of its rows, and gets as many back) are each rank's exact bytes."""
    from common import VOCAB

    from behemoth.models import build_model

    model = build_model("llama-moe-tiny", vocab_size=VOCAB, seq_len=SEQ, num_layers=layers)
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "router"):  # and frozen: the step before the measured one keeps them zero
                m.router.weight.zero_()
                m.router.weight.requires_grad_(False)
    return model


def emitted_expert_layouts(world: int) -> list:
    """One plan per (ep_overlap, micro-batches) the search emits for the MoE Llama on ``world``
    ranks with ep > 1, and each again checkpointed."""
    limits = Limits(precision="fp32", offloads=(None,), zero_stages=(0,), max_pp=1, max_cp=1, max_tp=1, top=100000)
    res = search(_workload(_moe()), Cluster(num_gpus=world), limits)
    out, seen = [], set()
    for p in res.ranked:
        plan = p.plan
        kind = (plan.ep_overlap, plan.microbatches)
        if plan.ep > 1 and kind not in seen:
            seen.add(kind)
            out += [plan, dataclasses.replace(plan, activation_checkpointing=True)]
    return out


def _experts_ep_world(rank, world, plans):
    for plan in plans:
        model = _moe()
        w = _workload(model)
        engine = bh.boost(model, make_optimizer("sgd", model), plan)
        batches = global_batches(2, BATCH)
        engine.step(shard(batches[0], engine.dp_rank, engine.dp_size))
        engine.reset_comm_stats()
        engine.step(shard(batches[1], engine.dp_rank, engine.dp_size))  # the step's gradient norm sums over ep
        got, want = _ledger(engine)["ep"], step_traffic(engine.plan, w, dt=FP32)["ep"]
        assert got == int(want), f"{engine.plan.describe()} rank {rank}: ep ledger {got} vs planner {want}"


def test_expert_parallel_bytes_equal_the_ledger():
    """The split sizes once per chunk, each chunk's dispatch and combine and their reverse pair,
    a recompute's pairs again (not its split sizes): ep_overlap 1 and 2 as the search emits them."""
    plans = emitted_expert_layouts(2)
    assert {p.ep_overlap for p in plans} == {1, 2} and any(p.activation_checkpointing for p in plans), plans
    bh.spawn(_experts_ep_world, 2, plans, timeout=400)

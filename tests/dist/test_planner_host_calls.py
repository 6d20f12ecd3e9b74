"""The planner's collective calls per block (behemoth.planner.host.tp_block_calls) against a
run's: the process group's record functions (``gloo:*``) of one forward + backward of a tiny
GPT and a tiny Llama (separate q/k/v, gated MLP, RMSNorm, replicated kv heads under 1D tp 4)
with 4 blocks less those of the same model with 2, halved, under 1D, 1D with sequence
parallelism and 2D tensor parallelism on 4 gloo ranks, and 2.5D (depth 2) and 3D (with and
without over-decomposition) on 8; context parallelism's (Ulysses, ring) on 2."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from common import SEQ, build, global_batches, make_optimizer, shard
from torch.profiler import ProfilerActivity, profile

import behemoth as bh
from behemoth.planner.host import block_calls, tp_block_calls
from behemoth.planner.workload import workload_for

PLANS = (bh.Plan(tp=4), bh.Plan(tp=4, sequence_parallel=True), bh.Plan(tp=4, tp_mode="2d"))


def _calls(family, plan, layers: int) -> int:
    model = build(family, num_layers=layers)
    engine = bh.boost(model, make_optimizer("sgd", model), plan)
    batch = shard(global_batches(1, 8)[0], engine.dp_rank, engine.dp_size)
    engine.step(batch)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        engine._forward_backward(batch)
    # a ring shift's coalesced send and receive are one call (its send counted)
    return sum(Counter(e.name for e in prof.events() if e.name.startswith("gloo:") and e.name != "gloo:recv").values())


def _world(rank, world):
    for family in ("gpt", "llama"):
        for plan in PLANS:
            got = (_calls(family, plan, 4) - _calls(family, plan, 2)) / 2
            w = workload_for(build(family, num_layers=2), seq_len=SEQ, global_batch=8)
            want = sum(tp_block_calls(plan.resolve(world), w))
            assert got == want, f"{family} {plan.describe()}: {got} calls per block, planner {want}"


def test_collective_calls_per_block_are_the_runs():
    torch.manual_seed(0)
    bh.spawn(_world, 4, timeout=500)


RINGS = (bh.Plan(cp=2), bh.Plan(cp=2, cp_mode="ring"), bh.Plan(cp=2, activation_checkpointing=True))


def _cp_world(rank, world):
    for plan in RINGS:
        got = (_calls("gpt", plan, 4) - _calls("gpt", plan, 2)) / 2
        w = workload_for(build("gpt", num_layers=2), seq_len=SEQ, global_batch=8)
        want = sum(block_calls(plan.resolve(world), w))
        assert got == want, f"{plan.describe()}: {got} calls per block, planner {want}"


def test_context_parallel_calls_per_block_are_the_runs():
    """Ulysses' all-to-alls (again in a recomputed forward), ring attention's shifts."""
    bh.spawn(_cp_world, 2, timeout=300)


CUBES = (
    bh.Plan(tp=8, tp_mode="3d"),
    bh.Plan(tp=8, tp_mode="3d", tp_overlap=2),
    bh.Plan(tp=8, tp_mode="2.5d", tp_depth=2),
)


def _cube_world(rank, world):
    for family in ("gpt", "llama"):
        for plan in CUBES:
            got = (_calls(family, plan, 4) - _calls(family, plan, 2)) / 2
            w = workload_for(build(family, num_layers=2), seq_len=SEQ, global_batch=8)
            want = sum(tp_block_calls(plan.resolve(world), w))
            assert got == pytest.approx(want), f"{family} {plan.describe()}: {got} calls per block, planner {want}"


def test_2p5d_and_3d_collective_calls_per_block_are_the_runs():
    bh.spawn(_cube_world, 8, timeout=600)

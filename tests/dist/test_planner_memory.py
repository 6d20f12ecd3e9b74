"""The planner's parameters per rank equal what ``bh.parallelize`` leaves on each rank.

On 8 gloo ranks, for every tensor-parallel layout (1D with whole and replicated k/v
projections, 2D, 2.5D with depth 2, 3D), experts over ``ep``, and pipeline stages over 1D and
2D: the parameters each rank holds, summed tensor by tensor, equal
``behemoth.planner.params.local_params`` for its stage exactly, and without a pipeline the
predicted parameter bytes (``plan_memory(...).params``, ZeRO 0) equal the bytes the rank holds.
The parameter storages still allocated in the process (every ``nn.Parameter`` Python has not
freed, reachable or not, before any cycle collection) equal the planner's parameters too: a
pipeline rank keeps no other stage's blocks (mixture-of-experts blocks sit in reference cycles,
their forward bound to them, which only a cycle collection frees).
For layouts with data parallelism the gradient all-reduce the ledger books over ``dp`` in one
step equals ``step_traffic``'s (the same per-rank count, in fp32 gradients).
"""

from __future__ import annotations

import gc

import torch
from common import SEQ, VOCAB, build, global_batches, make_optimizer, shard

import behemoth as bh
from behemoth.models import build_model
from behemoth.parallelize import parallelization
from behemoth.planner.axis_traffic import Dtypes, step_traffic
from behemoth.planner.cluster import Cluster
from behemoth.planner.footprint import plan_memory
from behemoth.planner.params import local_params
from behemoth.planner.workload import workload_for

WORLD, LAYERS, BATCH = 8, 4, 8
FP32 = Dtypes(compute=4, stream=4, param=4)

LAYOUTS = [  # (family, plan fields, check the dp ledger)
    ("gpt", dict(tp=8, tp_mode="2.5d", tp_depth=2), False),
    ("llama", dict(tp=8, tp_mode="2.5d", tp_depth=2), False),
    ("gpt", dict(tp=8, tp_mode="3d"), False),
    ("llama", dict(tp=8, tp_mode="3d"), False),
    ("gpt", dict(tp=4, tp_mode="2d"), True),
    ("llama", dict(tp=4, tp_mode="2d"), False),
    ("gpt", dict(tp=2), True),
    ("llama", dict(tp=4), True),  # 2 kv heads < tp: k and v replicated
    ("llama", dict(tp=2, sequence_parallel=True), False),
    ("moe", dict(tp=2, ep=2), False),
    ("gpt", dict(tp=2, pp=2), False),
    ("llama", dict(tp=4, tp_mode="2d", pp=2), False),
]


def _model(family: str):
    if family == "moe":
        return build_model("llama-moe-tiny", vocab_size=VOCAB, seq_len=SEQ, num_layers=LAYERS)
    return build(family, num_layers=LAYERS)


def _check(rank: int, family: str, fields: dict, ledger: bool) -> None:
    model = _model(family)
    w = workload_for(model, seq_len=SEQ, global_batch=BATCH)
    plan = bh.Plan(precision="fp32", **fields).resolve(WORLD)
    what = f"{family} {plan.describe()} rank {rank}"
    if ledger:
        engine = bh.boost(model, make_optimizer("sgd", model), plan)
        model = engine.model
    else:
        model = bh.parallelize(model, plan)
    held = list(model.parameters())
    stage = parallelization(model).mesh.coord("pp") if plan.pp > 1 else None
    want = local_params(plan, w, stage=stage)
    got = sum(p.numel() for p in held)
    assert got == want, f"{what}: holds {got} parameters, the planner counts {want}"
    if plan.pp == 1:
        predicted = plan_memory(plan, w, Cluster(num_gpus=WORLD)).params
        assert sum(p.numel() * p.element_size() for p in held) == predicted, what
    if ledger:
        batch = shard(global_batches(1, BATCH)[0], engine.dp_rank, engine.dp_size)
        engine.reset_comm_stats()
        engine.step(batch)
        dp = engine.comm_stats()["dp"]["wire_bytes"]
        assert dp == int(step_traffic(plan, w, dt=FP32)["dp"]), f"{what}: dp ledger {dp}"


def _world(rank, world):
    for family, fields, ledger in LAYOUTS:
        _check(rank, family, fields, ledger)


def test_parameters_per_rank_are_the_planners():
    bh.spawn(_world, WORLD, timeout=500)


def _allocated_parameter_bytes() -> int:
    """Bytes of the distinct storages of every ``nn.Parameter`` object the process still has,
    whether or not anything reaches it (no cycle collection first)."""
    storages = {}
    for o in gc.get_objects():
        if isinstance(o, torch.nn.Parameter) and not o.is_meta:
            s = o.untyped_storage()
            storages[s.data_ptr()] = s.nbytes()
    return sum(storages.values())


PIPELINES = [dict(pp=2), dict(pp=4), dict(tp=2, pp=2), dict(ep=2, pp=2)]


def _held_world(rank, world):
    for fields in PIPELINES:
        gc.collect()  # the layouts before this one
        model = build_model("llama-moe-tiny", vocab_size=VOCAB, seq_len=SEQ, num_layers=LAYERS)
        w = workload_for(model, seq_len=SEQ, global_batch=BATCH)
        plan = bh.Plan(precision="fp32", **fields).resolve(world)
        gc.collect()  # nothing but the serial model's parameters allocated
        model = bh.parallelize(model, plan)
        stage = parallelization(model).mesh.coord("pp")
        want = 4 * local_params(plan, w, stage=stage)
        got = _allocated_parameter_bytes()
        assert got == want, f"{plan.describe()} rank {rank}: {got} parameter bytes allocated, the planner counts {want}"
        del model


def test_a_pipeline_rank_frees_the_other_stages_experts():
    """The MoE Llama cut into pipeline stages (with tp and ep too) on 4 gloo ranks: the parameter
    bytes each rank still has allocated after ``bh.parallelize`` are the planner's for its stage."""
    bh.spawn(_held_world, 4, timeout=300)

"""Pipelines with 1D sequence parallelism inside every stage (pp = 2 x tp = 2 on 4 ranks) match
serial training: losses, every step's gradient norm and ``full_state_dict()`` (rtol 1e-4, fp32).

The activation between stages is each tp rank's sequence shard ``[b, s/tp, h]``; a stage that does
not hold the embedding still runs the model's own code before its first block on the whole
sequence length (transformers' rotary tables, causal masks and position ids are built from it),
and its first block takes the received shard again. Covered: transformers' LlamaForCausalLM and
GPT2LMHeadModel, behemoth's Llama and GPT, and transformers' OLMoE and Qwen3-MoE (a pooled
balancing loss whose totals ride with the activations), under 1F1B, interleaved (2 chunks per
rank) and zero-bubble, and with activation checkpointing. The pipeline's bytes per step equal the
planner's (``step_traffic``): shards, not whole sequences; its tp bytes stay within the planner's
(which counts the embedding, head and sequence boundary on every stage). The pipelined forward
outside a schedule (evaluation) gives the serial model's logits. On 8 ranks: with context
parallelism (ring and Ulysses) and with ZeRO-2/3 over dp = 2. And with compiled blocks.
"""

from __future__ import annotations

import dataclasses

from common import (
    SEQ,
    assert_grad_norms_close,
    assert_losses_close,
    assert_state_close,
    build,
    global_batches,
    make_optimizer,
    serial_run,
    shard,
    train_steps,
)
from test_expert_families import adamw, build_hf_moe
from test_expert_pipeline import serial_hf_micro_run
from test_parallelize import _check as check_forward

import behemoth as bh
from behemoth.planner.axis_traffic import Dtypes, step_traffic
from behemoth.planner.workload import workload_for

STEPS, BATCH, LAYERS = 2, 8, 4
SCHEDULES = (("1f1b", 1, 2), ("interleaved", 2, 4), ("zero-bubble", 1, 2))  # (schedule, chunks, micro-batches)


def _plan(schedule: str, v: int, m: int) -> bh.Plan:
    return bh.Plan(pp=2, tp=2, sequence_parallel=True, microbatches=m, schedule=schedule, virtual_stages=v)


def _check(engine, batches, want, what: str) -> None:
    losses, norms = train_steps(engine, batches)
    assert_losses_close(losses, want[0], what=what)
    assert_grad_norms_close(norms, want[2], what=what)
    assert_state_close(engine.full_state_dict(), want[1], what=what)


def _dense_world(rank: int, world: int) -> None:
    batches = global_batches(STEPS, BATCH)
    for family in ("hf-llama", "hf-gpt2"):  # the forward outside a schedule
        check_forward(family, _plan("1f1b", 1, 2), layers=LAYERS)
        check_forward(family, _plan("interleaved", 2, 4), layers=LAYERS)
    for family in ("hf-llama", "hf-gpt2", "llama", "gpt"):
        ref = serial_run(family, "adamw", batches, max_grad_norm=1.0, num_layers=LAYERS)
        want = (ref.losses, ref.state, ref.grad_norms)
        for schedule, v, m in SCHEDULES:
            if family == "gpt" and schedule != "interleaved":
                continue
            plan = _plan(schedule, v, m)
            model = build(family, num_layers=LAYERS)
            engine = bh.boost(model, make_optimizer("adamw", model), plan, max_grad_norm=1.0)
            what = f"{family} {plan.describe()}"
            _check(engine, batches, want, what)
            if family == "hf-llama":
                _check_bytes(engine, model, batches, what)
    ref = serial_run("hf-llama", "adamw", batches, max_grad_norm=1.0, num_layers=LAYERS)
    plan = dataclasses.replace(_plan("1f1b", 1, 2), activation_checkpointing=True)
    model = build("hf-llama", num_layers=LAYERS)
    engine = bh.boost(model, make_optimizer("adamw", model), plan, max_grad_norm=1.0)
    _check(engine, batches, (ref.losses, ref.state, ref.grad_norms), f"hf-llama {plan.describe()}")


def _check_bytes(engine, model, batches, what: str) -> None:
    """One more forward + backward: the bytes this rank sends over pp equal the planner's
    prediction (each stage boundary carries this tp rank's sequence shard, both ways), and those
    over tp are at most the planner's."""
    engine.reset_comm_stats()
    engine._forward_backward(shard(batches[0], engine.dp_rank, engine.dp_size))
    got: dict[str, int] = {}
    for axis, s in engine.comm_stats().items():
        key = "tp" if axis.startswith("tp") else axis
        got[key] = got.get(key, 0) + s["wire_bytes"]
    w = workload_for(model, seq_len=SEQ, global_batch=BATCH)
    stage = engine.mesh.coord("pp")
    want = step_traffic(engine.plan, w, stage=stage, dt=Dtypes(compute=4, stream=4, param=4))
    assert got["pp"] == int(want["pp"]), f"{what} stage {stage}: pp ledger {got['pp']} vs planner {want['pp']}"
    assert 0 < got["tp"] <= int(want["tp"]), f"{what} stage {stage}: tp ledger {got['tp']} vs planner {want['tp']}"


def test_pipeline_with_sequence_parallel_matches_serial():
    bh.spawn(_dense_world, 4, timeout=1500)


def _moe_world(rank: int, world: int) -> None:
    batches = global_batches(STEPS, BATCH)
    for family, (schedule, v, m) in [("olmoe", s) for s in SCHEDULES] + [("qwen3-moe", SCHEDULES[0])]:
        want = serial_hf_micro_run(family, batches, 1, m, layers=LAYERS)
        plan = _plan(schedule, v, m)
        model = build_hf_moe(family, layers=LAYERS)
        engine = bh.boost(model, adamw(model), plan, max_grad_norm=1.0)
        _check(engine, batches, want, f"transformers {family} {plan.describe()}")


def test_pipeline_with_sequence_parallel_moe_matches_serial():
    bh.spawn(_moe_world, 4, timeout=1500)


def _composed_world(rank: int, world: int) -> None:
    """With context parallelism (each stage's share of the sequence split again over tp) and with
    ZeRO-2/3 over dp = 2, on 8 ranks."""
    batches = global_batches(STEPS, BATCH)
    ref = serial_run("hf-llama", "adamw", batches, max_grad_norm=1.0, num_layers=LAYERS)
    sp = dict(pp=2, tp=2, sequence_parallel=True)
    for plan in (
        bh.Plan(**sp, cp=2, cp_mode="ring", microbatches=2),
        bh.Plan(**sp, cp=2, cp_mode="ulysses", microbatches=4, schedule="interleaved", virtual_stages=2),
        bh.Plan(**sp, dp=2, microbatches=2, zero=3, chunk_mb=0.02),
        bh.Plan(**sp, dp=2, microbatches=4, zero=2, chunk_mb=0.02, schedule="zero-bubble"),
    ):
        model = build("hf-llama", num_layers=LAYERS)
        engine = bh.boost(model, make_optimizer("adamw", model), plan, max_grad_norm=1.0)
        _check(engine, batches, (ref.losses, ref.state, ref.grad_norms), f"hf-llama {plan.describe()}")


def test_pipeline_with_sequence_parallel_composed_matches_serial():
    bh.spawn(_composed_world, 8, timeout=1500)


def _compiled_world(rank: int, world: int) -> None:
    """Compiled blocks: the sequence-parallel hooks of a chunk's first and last block run inside
    the block's compiled call, and fire only while that chunk is the active one."""
    batches = global_batches(STEPS, BATCH)
    ref = serial_run("llama", "adamw", batches, max_grad_norm=1.0, num_layers=LAYERS)
    plan = dataclasses.replace(_plan("interleaved", 2, 4), compile=True)
    model = build("llama", num_layers=LAYERS)
    engine = bh.boost(model, make_optimizer("adamw", model), plan, max_grad_norm=1.0)
    _check(engine, batches, (ref.losses, ref.state, ref.grad_norms), f"llama {plan.describe()}")


def test_pipeline_with_sequence_parallel_compiled_matches_serial():
    bh.spawn(_compiled_world, 4, timeout=1500)

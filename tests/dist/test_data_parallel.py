"""Data parallelism matches serial training (the parity law), for behemoth's
models and transformers' models, with accumulation, clipping, AdamW and SGD, and a user
loss_fn: losses, weights and every step's gradient norm; the ledger's bytes exactly; the
bucketed all-reduce really overlaps backward; bad plans fail on every rank."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from common import (
    assert_grad_norms_close,
    assert_losses_close,
    assert_state_close,
    build,
    full_label_batches,
    global_batches,
    make_optimizer,
    serial_run,
    serial_train,
    shard,
    train_steps,
)

import behemoth as bh

STEPS, BATCH = 3, 16

# (family, optimizer, microbatches, max_grad_norm, precision, activation checkpointing)
SCENARIOS = [
    ("gpt", "adamw", 2, 1.0, "fp32", False),
    ("gpt", "sgd", 1, None, "fp32", True),
    ("llama", "adamw", 2, 0.05, "fp32", False),
    ("llama", "sgd", 4, None, "fp32", False),
    ("hf-gpt2", "adamw", 2, 0.5, "fp32", False),
    ("hf-llama", "sgd", 1, 1.0, "fp32", True),
    # Low precision: SGD, whose update is linear in the gradient, so bf16/fp16 rounding is
    # compared as rounding (Adam would blow it up to lr-sized steps on near-zero gradients).
    ("gpt", "sgd", 2, 1.0, "bf16", False),
    ("llama", "sgd", 1, None, "fp16", False),
]


def _parity_world(rank: int, world: int, scenarios) -> None:
    torch.manual_seed(rank)  # per-rank global RNG differs: the engine must not depend on it
    batches = global_batches(STEPS, BATCH)
    for family, opt_name, micro, clip, precision, ckpt in scenarios:
        what = f"dp={world} {family}/{opt_name}/micro={micro}/clip={clip}/{precision}/ckpt={ckpt}"
        model = build(family)
        engine = bh.boost(
            model,
            make_optimizer(opt_name, model),
            bh.Plan(dp=world, microbatches=micro, precision=precision, activation_checkpointing=ckpt, bucket_mb=0.01),
            max_grad_norm=clip,
        )
        losses, norms = train_steps(engine, batches)
        want = serial_run(family, opt_name, batches, max_grad_norm=clip, precision=precision)
        if precision != "fp32":  # low-precision matmuls on differently split batches round differently
            assert_losses_close(losses, want.losses, rtol=2e-2, what=what)
            assert_state_close(engine.full_state_dict(), want.state, rtol=2e-2, atol=2e-3, what=what)
            assert_grad_norms_close(norms, want.grad_norms, rtol=2e-2, what=what)
        else:
            assert_losses_close(losses, want.losses, what=what)
            assert_state_close(engine.full_state_dict(), want.state, what=what)
            assert_grad_norms_close(norms, want.grad_norms, what=what)
        # The loss is the same float on every rank.
        t = torch.tensor(losses, dtype=torch.float64)
        ref = t.clone()
        torch.distributed.broadcast(ref, 0)
        assert torch.equal(t, ref), f"{what}: ranks disagree on the loss"
        # Ledger: rank 0's parameters and buffers broadcast once at boost, one call per bucket of
        # trainable parameters and one per other tensor; per step
        # one all-reduce per bucket (fp32 gradients) plus two float64 scalars (the global token
        # count and the loss sum).
        if world > 1:
            dp = engine.comm_stats()["dp"]
            nb, params = engine.grad_sync.layout.num_chunks, engine.grad_sync.params  # plain dp = ZeRO stage 0
            synced = list(engine.model.parameters()) + list(engine.model.buffers())
            calls = nb + len(synced) - len(params)  # a bucket of trainable parameters is one call
            assert dp["ops"] == {"broadcast": calls, "all_reduce": STEPS * (nb + 2)}, (what, dp, nb)
            sync_bytes = sum(t.numel() * t.element_size() for t in synced)
            grad_bytes = 4 * sum(p.numel() for p in params)
            assert dp["bytes"] == sync_bytes + STEPS * (grad_bytes + 2 * 8), (what, dp, sync_bytes, grad_bytes)
    _check_loss_fn(world)


def _mean_ce(out, b):
    """A user loss: the mean cross-entropy of its micro-batch."""
    logits = out if isinstance(out, torch.Tensor) else out.logits
    return F.cross_entropy(logits.flatten(0, 1), b["labels"].flatten())


def _check_loss_fn(world):
    """A user loss_fn returns its micro-batch's mean; the engine averages those over micro-batches
    and data-parallel ranks. With every label counted and equal micro-batches that is the
    serial mean: losses, gradient norms (SGD without clipping: a gradient off by the dp factor
    moves every weight by it) and weights match serial training."""
    batches = full_label_batches(STEPS, BATCH)
    for family, opt_name, micro, clip in (("gpt", "sgd", 2, None), ("hf-gpt2", "adamw", 1, 1.0)):
        what = f"dp={world} loss_fn {family}/{opt_name}/micro={micro}/clip={clip}"
        model = build(family)
        engine = bh.boost(
            model,
            make_optimizer(opt_name, model),
            bh.Plan(dp=world, microbatches=micro),
            loss_fn=_mean_ce,
            max_grad_norm=clip,
        )
        losses, norms = train_steps(engine, batches)
        want = serial_run(family, opt_name, batches, max_grad_norm=clip)
        assert_losses_close(losses, want.losses, what=what)
        assert_grad_norms_close(norms, want.grad_norms, what=what)
        assert_state_close(engine.full_state_dict(), want.state, what=what)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_dp_matches_serial(world):
    bh.spawn(_parity_world, world, SCENARIOS, timeout=600)


def _overlap_world(rank: int, world: int) -> None:
    model = build("gpt")
    engine = bh.boost(model, make_optimizer("adamw", model), bh.Plan(dp=world, bucket_mb=0.005))
    store = engine.grad_sync.store  # plain dp = ZeRO stage 0: buckets are unsharded chunks
    nparams = len(engine.grad_sync.params)
    assert len(store.chunks) > 2
    engine.step(shard(global_batches(1, 4)[0], engine.dp_rank, engine.dp_size))
    log = engine.grad_sync.reducer.launch_log  # the fixed order: the last chunk (the last parameters' gradients) first
    assert [b for b, _ in log] == list(reversed(range(len(store.chunks)))), log
    first_bucket, hooks_when_launched = log[0]
    # The first bucket's collective started while backward still had gradients to produce.
    assert hooks_when_launched < nparams, (log, nparams)
    # Gradients live inside the reduced buffers (no copies): .grad is a view of a bucket.
    ptrs = {p.grad.data_ptr() for p in engine.grad_sync.params}
    inside = [
        any(buf.data_ptr() <= ptr < buf.data_ptr() + buf.numel() * 4 for buf in engine.grad_sync.reducer.grads())
        for ptr in ptrs
    ]
    assert all(inside)


def test_bucketed_reduction_overlaps_backward():
    bh.spawn(_overlap_world, 2, timeout=300)


def _bad_plan_world(rank: int, world: int, out_dir: str) -> None:
    model = build("gpt")
    opt = make_optimizer("sgd", model)
    errors = []
    for plan in (bh.Plan(dp=3), bh.Plan(dp=1)):
        try:
            bh.boost(model, opt, plan)
        except ValueError as e:
            errors.append(str(e))
    try:
        bh.boost(model, opt, bh.Plan(dp=2, schedule="interleaved", virtual_stages=2))
    except ValueError as e:  # interleaving without a pipeline: an invalid plan
        errors.append(str(e))
    assert len(errors) == 3, errors
    assert "must equal the world size 2" in errors[0] and "dp*pp*tp*cp = 3*1*1*1 = 3" in errors[0]
    assert "virtual_stages=2" in errors[2] and "pp >= 2" in errors[2]
    # Every rank got here without a collective hanging; prove both are alive.
    t = torch.ones(1)
    torch.distributed.all_reduce(t)
    assert t.item() == world


def test_bad_plan_fails_on_every_rank(tmp_path):
    bh.spawn(_bad_plan_world, 2, str(tmp_path), timeout=300)


def _dead_rank_world(rank: int, world: int, out_path: str) -> None:
    import time

    model = build("gpt")
    engine = bh.boost(model, make_optimizer("sgd", model), bh.Plan(dp=world))
    batch = shard(global_batches(1, 4)[0], engine.dp_rank, engine.dp_size)
    engine.step(batch)
    if rank == 1:
        import os

        os._exit(0)  # vanish without a word (exit 0, so spawn does not kill the survivor)
    t0 = time.monotonic()
    try:
        engine.step(batch)
        engine.step(batch)
        outcome = "no error"
    except Exception as e:  # the survivor must get an error, not hang
        outcome = type(e).__name__
    with open(out_path, "w") as f:
        f.write(f"{outcome} {time.monotonic() - t0:.1f}")


def test_dead_rank_makes_survivor_fail_within_timeout(tmp_path, monkeypatch):
    monkeypatch.setenv("BEHEMOTH_TIMEOUT", "20")
    out = tmp_path / "outcome"
    bh.spawn(_dead_rank_world, 2, str(out), timeout=120)
    outcome, seconds = out.read_text().split()
    assert outcome != "no error"
    assert float(seconds) < 30


def _failing_child(rank: int, world: int) -> None:
    if rank == 1:
        raise RuntimeError("boom from rank 1")
    torch.distributed.barrier()  # would hang forever without spawn's failure handling


def test_spawn_propagates_child_failure_without_hanging():
    with pytest.raises(RuntimeError, match="boom from rank 1"):
        bh.spawn(_failing_child, 2, timeout=120)


def _compile_world(rank: int, world: int) -> None:
    batches = global_batches(2, BATCH)
    model = build("gpt")
    engine = bh.boost(
        model, make_optimizer("adamw", model), bh.Plan(dp=world, compile=True, bucket_mb=0.01), max_grad_norm=1.0
    )
    losses = [engine.step(shard(b, engine.dp_rank, engine.dp_size)) for b in batches]
    want_losses, want_state = serial_train("gpt", "adamw", batches, max_grad_norm=1.0)
    assert_losses_close(losses, want_losses, what="compile")
    assert_state_close(engine.full_state_dict(), want_state, what="compile")


def test_compiled_blocks_match_serial():
    bh.spawn(_compile_world, 2, timeout=600)

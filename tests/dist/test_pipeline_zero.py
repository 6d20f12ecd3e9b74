"""Pipelines with ZeRO-2 and ZeRO-3, offload, bf16 parameters, fp16 and compiled blocks (dp 2 x
pp 2) match serial training (the parity law).

* every schedule and the four model families, AdamW with clipping and SGD: losses (the same
  float on every rank), ``full_state_dict()`` and every step's gradient norm (summed over the
  stages and the dp shards) against plain PyTorch's;
* each stage's parameters are chunked over its own dp group; a stage's gradients are
  reduce-scattered once per step (one reduce-scatter per chunk per step, not per micro-batch),
  after its last micro-batch's backward; tied copies (transformers' GPT-2: embedding on the
  first stage, head on the last) are summed before it;
* ZeRO-3 re-gathers a stage's chunks for every micro-batch's forward and backward and holds
  no gathered chunk and no gradient chunk between steps (only its shards);
* bf16 parameters over fp32 masters (``param_dtype='bf16'``, ZeRO 1-3; GPT-2's tied copies summed
  in fp32) match serial training with a bf16 copy of fp32 masters, and hold fp32 masters in
  ``full_state_dict``; fp16 with dynamic loss scaling (ZeRO 0, 2, 3) matches serial fp16
  training; an overflow on one rank of one stage skips the step on every rank of every stage
  (the vote over dp and pp: weights unchanged, the loss scale halved everywhere);
* ZeRO-2/3 with context parallelism inside the stages (pp 2 x cp 2: chunks over dp x cp);
* offload='cpu' and 'auto' inside each stage: every stage places its own chunks for its own
  budget (measured in its own warm-up step on a GPU), offloaded chunks update on the host during
  the stage's last backward when nothing global comes first;
* a checkpoint written under pp 2 x dp 2 x ZeRO-3 resumes under dp 4 (no pipeline, no ZeRO),
  and one written under dp 4 resumes under pp 2 x dp 2 x ZeRO-3, both matching serial
  training over all four steps.

* compiled blocks (``Plan(compile=True)``) inside the stages, with ZeRO 1-3, zero-bubble's split
  backward and interleaving.

One 4-rank world runs every scenario but the compiled ones, which get their own (spawning costs
seconds on two cores).
"""

from __future__ import annotations

import os

import torch
from common import (
    assert_grad_norms_close,
    assert_losses_close,
    assert_ranks_agree,
    assert_state_close,
    bf16_param_reference,
    build,
    global_batches,
    make_optimizer,
    serial_run,
    train_steps,
)

import behemoth as bh

STEPS, BATCH, LAYERS = 2, 8, 4
CHUNK_MB = 0.02  # several chunks per stage of the tiny models

# (family, zero, offload, schedule, virtual stages, optimizer, max_grad_norm[, cp, activation checkpointing])
SCENARIOS = [
    ("gpt", 2, None, "1f1b", 1, "adamw", 1.0),
    ("hf-gpt2", 2, None, "zero-bubble", 1, "adamw", 1.0),
    ("llama", 2, None, "interleaved", 2, "sgd", None),
    ("hf-llama", 2, None, "gpipe", 1, "adamw", 0.5),
    ("gpt", 3, None, "zero-bubble", 1, "adamw", 0.5),
    ("hf-gpt2", 3, None, "interleaved", 2, "sgd", 1.0),
    ("llama", 3, None, "1f1b", 1, "adamw", 1.0),
    ("hf-llama", 3, None, "gpipe", 1, "sgd", None),
    # offload: each stage places its own chunks (on CPU, 'auto' keeps half of each stage's model
    # data on the "device"); without clipping, offloaded chunks update on the host during the backward
    ("gpt", 3, "auto", "1f1b", 1, "adamw", None),
    ("hf-gpt2", 2, "cpu", "zero-bubble", 1, "sgd", None),
    ("llama", 1, "cpu", "interleaved", 2, "adamw", 1.0),
    ("hf-llama", 3, "auto", "gpipe", 1, "adamw", 0.5),
    ("gpt", 3, "cpu", "interleaved", 2, "adamw", None),
    # context parallelism inside the stages: each stage's chunks sharded over dp x cp
    ("llama", 3, None, "1f1b", 1, "adamw", 1.0, 2),
    ("hf-gpt2", 2, None, "zero-bubble", 1, "sgd", None, 2),
    # activation checkpointing: ZeRO-3 gathers again for the recomputation (zero-bubble: inside BI)
    ("gpt", 3, None, "zero-bubble", 1, "adamw", 1.0, 1, True),
    ("hf-llama", 3, None, "interleaved", 2, "adamw", 1.0, 1, True),
]


def _engine(family, plan, opt="adamw", clip=1.0):
    model = build(family, num_layers=LAYERS)
    return bh.boost(model, make_optimizer(opt, model), plan, max_grad_norm=clip)


def _parity(family, zero, offload, schedule, v, opt, clip, cp=1, ac=False):
    plan = bh.Plan(
        dp=2 // cp,
        pp=2,
        cp=cp,
        microbatches=4,
        schedule=schedule,
        virtual_stages=v,
        zero=zero,
        chunk_mb=CHUNK_MB,
        offload=offload,
        activation_checkpointing=ac,
    )
    engine = _engine(family, plan, opt, clip)
    engine.reset_comm_stats()
    losses, norms = train_steps(engine, global_batches(STEPS, BATCH))
    want = serial_run(family, opt, global_batches(STEPS, BATCH), max_grad_norm=clip, num_layers=LAYERS)
    what = f"{plan.describe()} {family}/{opt}"
    sync = engine.grad_sync
    # between steps: ZeRO-2/3 hold no gradient chunk, only the reduced shards (ZeRO-3: no gathered chunk)
    assert zero == 1 or all(st.grad_full is None for st in sync.store.chunks), what
    if zero == 3:
        assert not any(st.resident for st in sync.store.chunks), what
    n = sync.layout.num_chunks
    if offload == "auto":  # this stage's own placement: some of its chunks kept, some offloaded
        assert 0 < sync.placement.keep[1] < n, (what, sync.placement.keep)
    if offload == "cpu":
        assert sync.placement.keep[1] == 0, what
        assert sync.early_updates == (STEPS * n if clip is None else 0), (what, sync.early_updates)
    dp = engine.comm_stats()["dp_cp" if cp > 1 else "dp"]["ops"]
    assert sync.stage == zero and sync.layout.num_chunks >= 2, what
    assert dp["reduce_scatter"] == STEPS * sync.layout.num_chunks, (what, dp)  # once per step, not per micro-batch
    assert_losses_close(losses, want.losses, what=what)
    assert_grad_norms_close(norms, want.grad_norms, what=what)
    assert_state_close(engine.full_state_dict(), want.state, what=what)
    assert_ranks_agree(losses, what)
    if zero >= 2:  # the next step fills its whole gradient chunks beside no shard of the last step's
        sync.start_step()
        assert all(st.grad_acc is None and st.master.grad is None for st in sync.store.chunks), what


def _low_precision():
    batches = global_batches(STEPS, BATCH)
    # SGD: its update is linear in the gradient, so bf16/fp16 rounding of differently split sums
    # is not amplified as AdamW's would be (the serial low-precision tests do the same)
    for family, zero, offload, schedule in (
        ("hf-gpt2", 3, None, "1f1b"),
        ("llama", 1, None, "zero-bubble"),
        ("gpt", 2, None, "gpipe"),
        ("gpt", 3, "auto", "1f1b"),
    ):
        plan = bh.Plan(
            dp=2,
            pp=2,
            microbatches=4,
            schedule=schedule,
            zero=zero,
            chunk_mb=CHUNK_MB,
            precision="bf16",
            param_dtype="bf16",
            offload=offload,
        )
        what = f"{plan.describe()} {family}/sgd"
        engine = _engine(family, plan, "sgd", 1.0)
        assert all(p.dtype == torch.bfloat16 for p in engine.model.parameters()), what
        losses, _ = train_steps(engine, batches)
        want_losses, want_state = bf16_param_reference(family, "sgd", batches, 1.0, num_layers=LAYERS)
        assert_losses_close(losses, want_losses, rtol=2e-2, what=what)
        state = engine.full_state_dict()
        assert_state_close(state, want_state, rtol=2e-2, atol=3e-3, what=what)
        assert all(v.dtype == torch.float32 for v in state.values() if v.is_floating_point()), what
        assert_ranks_agree(losses, what)
    for family, zero, schedule, v in (
        ("gpt", 2, "interleaved", 2),
        ("hf-llama", 0, "gpipe", 1),
        ("hf-gpt2", 3, "zero-bubble", 1),
    ):
        plan = bh.Plan(
            dp=2,
            pp=2,
            microbatches=4,
            schedule=schedule,
            virtual_stages=v,
            zero=zero,
            chunk_mb=CHUNK_MB if zero else None,
            precision="fp16",
        )
        what = f"{plan.describe()} {family}/sgd"
        engine = _engine(family, plan, "sgd", 1.0)
        losses, norms = train_steps(engine, batches)
        want = serial_run(family, "sgd", batches, max_grad_norm=1.0, precision="fp16", num_layers=LAYERS)
        assert engine.scaler.skipped_steps == 0, what
        assert_losses_close(losses, want.losses, rtol=2e-2, what=what)
        assert_grad_norms_close(norms, want.grad_norms, rtol=2e-2, what=what)
        assert_state_close(engine.full_state_dict(), want.state, rtol=2e-2, atol=2e-3, what=what)
        assert_ranks_agree(losses, what)
    _overflow_vote(batches)


def _overflow_vote(batches):
    """An inf gradient on one rank of the first stage: every rank of both stages skips the step."""
    plan = bh.Plan(dp=2, pp=2, microbatches=2, zero=3, chunk_mb=CHUNK_MB, precision="fp16")
    engine = _engine("gpt", plan, "sgd", 1.0)
    train_steps(engine, batches[:1])
    before, scale = engine.full_state_dict(), engine.scaler.scale
    handle = None
    if engine.mesh.axis("pp").rank == 0 and engine.dp_rank == 0:
        handle = next(engine.model.parameters()).register_hook(lambda g: torch.full_like(g, float("inf")))
    _, norms = train_steps(engine, batches[1:2])
    if handle is not None:
        handle.remove()
    assert norms == [float("inf")] and engine.scaler.scale == scale / 2 and engine.scaler.skipped_steps == 1
    assert_state_close(engine.full_state_dict(), before, rtol=0, atol=0, what="skipped step")
    train_steps(engine, batches[1:2])  # the same batch again: as serial's second step
    want = serial_run("gpt", "sgd", batches, max_grad_norm=1.0, precision="fp16", num_layers=LAYERS)
    assert_state_close(engine.full_state_dict(), want.state, rtol=2e-2, atol=2e-3, what="after a skipped step")


def _checkpoints(root):
    batches = global_batches(4, BATCH)
    want = serial_run("gpt", "adamw", batches, max_grad_norm=1.0, num_layers=LAYERS)
    pp_zero3 = bh.Plan(dp=2, pp=2, microbatches=2, zero=3, chunk_mb=CHUNK_MB)
    dp_only = bh.Plan(dp=4, microbatches=2)
    for save_plan, load_plan in ((pp_zero3, dp_only), (dp_only, pp_zero3)):
        path = os.path.join(root, f"pp{save_plan.pp}-zero{save_plan.zero}")
        first = _engine("gpt", save_plan)
        assert_losses_close(train_steps(first, batches[:2])[0], want.losses[:2], what="before save")
        first.save(path, extra={"pos": 2})
        what = f"saved under {save_plan.describe()}, loaded under {load_plan.describe()}"
        engine = _engine("gpt", load_plan)
        assert engine.load(path) == {"pos": 2} and engine.step_count == 2, what
        losses, norms = train_steps(engine, batches[2:])
        assert_losses_close(losses, want.losses[2:], what=what)
        assert_grad_norms_close(norms, want.grad_norms[2:], what=what)
        assert_state_close(engine.full_state_dict(), want.state, what=what)


def _world(rank: int, world: int, root: str) -> None:
    torch.manual_seed(rank)  # per-rank RNG differs: every stage gets rank 0's initial weights
    for scenario in SCENARIOS:
        _parity(*scenario)
    _low_precision()
    _checkpoints(root)


def test_pipeline_with_zero_bf16_params_and_fp16_matches_serial(tmp_path):
    bh.spawn(_world, 4, str(tmp_path), timeout=600)


# (family, zero, schedule, virtual stages): compiled blocks (the default inductor backend, as the
# other compile tests) with ZeRO-3's gather hooks, zero-bubble's twice-run compiled backward and
# tied copies, and interleaving's pass-through of the inactive chunk inside compiled code
COMPILED = [("gpt", 3, "1f1b", 1), ("hf-gpt2", 2, "zero-bubble", 1), ("llama", 1, "interleaved", 2)]


def _compile_world(rank: int, world: int) -> None:
    import torch._dynamo

    torch.manual_seed(rank)
    for family, zero, schedule, v in COMPILED:
        torch._dynamo.reset()
        plan = bh.Plan(
            dp=2, pp=2, microbatches=4, schedule=schedule, virtual_stages=v, zero=zero, chunk_mb=CHUNK_MB, compile=True
        )
        engine = _engine(family, plan)
        losses, norms = train_steps(engine, global_batches(STEPS, BATCH))
        want = serial_run(family, "adamw", global_batches(STEPS, BATCH), max_grad_norm=1.0, num_layers=LAYERS)
        what = f"{plan.describe()} {family}/adamw"
        assert_losses_close(losses, want.losses, what=what)
        assert_grad_norms_close(norms, want.grad_norms, what=what)
        assert_state_close(engine.full_state_dict(), want.state, what=what)


def test_pipeline_with_compiled_blocks_matches_serial():
    bh.spawn(_compile_world, 4, timeout=900)

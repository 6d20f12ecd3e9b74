"""Pipeline parallelism through ``bh.Plan(pp=...)`` matches serial training (the parity law).

* every schedule (GPipe, 1F1B, interleaved with 2 chunks per rank, zero-bubble ZB-H1) at
  pp = 2 and pp = 4, with 4 and 8 micro-batches, for behemoth's GPT and Llama and
  transformers' GPT2LMHeadModel (tied embeddings split across the first and last stage)
  and LlamaForCausalLM: losses (the same float on every rank), ``full_state_dict()`` and
  every step's global gradient norm (before clipping) against plain PyTorch's
  ``clip_grad_norm_``, AdamW with clipping;
* fewer micro-batches than stages (m = 1 at pp = 2, m = 2 at pp = 4), a user's stage split,
  activation checkpointing, bf16, SGD, a custom loss_fn;
* point-to-point traffic: m activations and m gradients per stage boundary per step, shape
  headers only on the first step;
* dp 2 x pp 2 x 1D tp 2 and pp 2 x 2D tp 4 on 8 ranks.

Each world runs many scenarios (spawning costs seconds on two cores).
"""

from __future__ import annotations

import torch
from common import (
    assert_grad_norms_close,
    assert_losses_close,
    assert_pipeline_p2p_ops,
    assert_ranks_agree,
    assert_state_close,
    build,
    global_batches,
    make_optimizer,
    serial_run,
    shard,
    train_steps,
)

import behemoth as bh

STEPS, BATCH = 2, 8
FAMILIES = ("gpt", "llama", "hf-gpt2", "hf-llama")
SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zero-bubble", 1))
_SERIAL: dict = {}


def _serial(family, layers, opt="adamw", clip=1.0, precision="fp32"):
    key = (family, layers, opt, clip, precision)
    if key not in _SERIAL:
        _SERIAL[key] = serial_run(
            family, opt, global_batches(STEPS, BATCH), max_grad_norm=clip, precision=precision, num_layers=layers
        )
    return _SERIAL[key]


def _check(family, plan, layers, *, opt="adamw", clip=1.0, stages=None, loss_fn=None, what=""):
    model = build(family, num_layers=layers)
    engine = bh.boost(model, make_optimizer(opt, model), plan, max_grad_norm=clip, stages=stages, loss_fn=loss_fn)
    engine.reset_comm_stats()
    losses, norms = train_steps(engine, global_batches(STEPS, BATCH))
    want = _serial(family, layers, opt, clip, plan.precision)
    what = f"{what}{engine.plan.describe()} {family}/{opt}"
    if plan.precision == "bf16":  # bf16 matmuls on differently split operands round differently
        assert_losses_close(losses, want.losses, rtol=2e-2, what=what)
        assert_state_close(engine.full_state_dict(), want.state, rtol=2e-2, atol=2e-3, what=what)
        assert_grad_norms_close(norms, want.grad_norms, rtol=2e-2, what=what)
    else:
        assert_losses_close(losses, want.losses, what=what)
        assert_state_close(engine.full_state_dict(), want.state, what=what)
        assert_grad_norms_close(norms, want.grad_norms, what=what)
    assert_ranks_agree(losses, what)
    return engine


def _pp_world(rank: int, world: int) -> None:
    torch.manual_seed(rank)  # per-rank RNG differs: stages get rank 0's initial weights
    layers = 2 * world  # interleaving needs pp * 2 blocks
    for family in FAMILIES:
        for schedule, v in SCHEDULES:
            for m in (4, 8):
                plan = bh.Plan(pp=world, microbatches=m, schedule=schedule, virtual_stages=v)
                engine = _check(family, plan, layers)
                if m == 4 and family == "gpt":
                    assert_pipeline_p2p_ops(engine, m, STEPS)
    # Fewer micro-batches than stages: runs (and matches) rather than hangs.
    for schedule, v in SCHEDULES:
        _check(
            "gpt",
            bh.Plan(pp=world, microbatches=world // 2, schedule=schedule, virtual_stages=v),
            layers,
            what="m < pp: ",
        )
    if world != 2:
        return
    # A user's stage split instead of the balance by cost.
    eng = _check("llama", bh.Plan(pp=2, microbatches=4), 4, stages=[(0, 1), (1, 4)])
    assert eng.stage_ranges == [[(0, 1)], [(1, 4)]]
    # this rank holds exactly its stage of the serial model: the embedding and block 0, or
    # blocks 1-3, the final norm and the head
    first = eng.mesh.axis("pp").rank == 0
    mine = ("embed.", "layers.0.") if first else ("layers.1.", "layers.2.", "layers.3.", "norm.", "lm_head.")
    serial = build("llama", num_layers=4)
    want = sum(p.numel() for n, p in serial.named_parameters() if n.startswith(mine))
    assert sum(p.numel() for p in eng.model.parameters()) == want, (first, want)
    # Activation checkpointing (also under zero-bubble's split backward), SGD, no clipping.
    _check("gpt", bh.Plan(pp=2, microbatches=4, schedule="zero-bubble", activation_checkpointing=True), 4)
    _check("hf-llama", bh.Plan(pp=2, microbatches=4, activation_checkpointing=True), 4, opt="sgd", clip=None)
    # bf16 autocast with fp32 master weights; SGD, whose update is linear in the gradient, so
    # rounding differences of micro-batched bf16 matmuls are not amplified as AdamW does.
    _check("hf-gpt2", bh.Plan(pp=2, microbatches=4, precision="bf16"), 4, opt="sgd")
    _check(
        "llama", bh.Plan(pp=2, microbatches=4, schedule="interleaved", virtual_stages=2, precision="bf16"), 4, opt="sgd"
    )

    # A custom loss_fn (mean per micro-batch) on the last stage.
    def mean_ce(out, batch):
        return torch.nn.functional.cross_entropy(out.flatten(0, 1), batch["labels"].flatten())

    model = build("gpt", num_layers=4)
    eng = bh.boost(model, make_optimizer("sgd", model), bh.Plan(pp=2, microbatches=2), loss_fn=mean_ce)
    ref = build("gpt", num_layers=4)
    opt = make_optimizer("sgd", ref)
    for b in global_batches(STEPS, BATCH):
        want = sum(mean_ce(ref(h["input_ids"]), h) for h in [shard(b, i, 2) for i in range(2)]) / 2
        want.backward()
        opt.step()
        opt.zero_grad()
        assert abs(eng.step(b) - want.item()) < 1e-5
    assert_state_close(eng.full_state_dict(), ref.state_dict(), what="loss_fn")


def test_pipeline_pp2_matches_serial():
    bh.spawn(_pp_world, 2, timeout=300)


def test_pipeline_pp4_matches_serial():
    bh.spawn(_pp_world, 4, timeout=400)


def _hybrid_world(rank: int, world: int) -> None:
    for family, plan in (
        ("gpt", bh.Plan(dp=2, pp=2, tp=2, microbatches=2)),
        ("hf-gpt2", bh.Plan(dp=2, pp=2, tp=2, microbatches=2, schedule="zero-bubble")),
        ("llama", bh.Plan(pp=2, tp=4, tp_mode="2d", microbatches=4, schedule="interleaved", virtual_stages=2)),
        ("hf-llama", bh.Plan(pp=2, tp=4, tp_mode="2d", microbatches=4, schedule="gpipe")),
    ):
        _check(family, plan, 4)


def test_pipeline_dp_tp_8_ranks_match_serial():
    bh.spawn(_hybrid_world, 8, timeout=400)


def _zero_world(rank: int, world: int) -> None:
    """ZeRO-1 under pipelines (dp 2 x pp 2): optimizer state sharded over dp within each stage,
    tied copies summed before the reduce-scatter, the norm summed over stages once."""
    torch.manual_seed(rank)
    for family, schedule, v, opt in (
        ("gpt", "1f1b", 1, "adamw"),
        ("hf-gpt2", "zero-bubble", 1, "adamw"),
        ("hf-gpt2", "interleaved", 2, "sgd"),
        ("llama", "gpipe", 1, "adamw"),
    ):
        plan = bh.Plan(dp=2, pp=2, microbatches=4, schedule=schedule, virtual_stages=v, zero=1, chunk_mb=0.02)
        engine = _check(family, plan, 4, opt=opt)
        assert engine.grad_sync.stage == 1 and engine.grad_sync.layout.num_chunks >= 2
        dp = engine.comm_stats()["dp"]["ops"]
        assert dp["reduce_scatter"] == STEPS * engine.grad_sync.layout.num_chunks, dp


def test_pipeline_with_zero1_matches_serial():
    bh.spawn(_zero_world, 4, timeout=400)

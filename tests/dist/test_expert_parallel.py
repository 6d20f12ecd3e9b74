"""Expert parallelism (Plan.ep) matches serial training of a mixture-of-experts Llama, the router
losses (load balancing over the global batch, z-loss) included: losses, every step's gradient
norm and ``full_state_dict()`` (experts reassembled to the serial ``[E, ...]`` shapes), for
dp=4 x ep=2 (ep_dp=2), ep=4, ep=1 under dp=4, and ep=2 alone (also with micro-batches and
activation checkpointing, with bf16 autocast under SGD, and with fp16 and its loss scaling, whose
overflow vote covers every ep rank's experts); the ep axis's ledger bytes exactly; a step in which one ep rank's
experts get no token does not hang and still matches; what does not compose yet is refused on
every rank before any collective; a checkpoint saved at ep=2 loads at ep=1 and ep=2."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from common import (
    SEQ,
    assert_grad_norms_close,
    assert_losses_close,
    assert_state_close,
    expect_error,
    global_batches,
    moe_llama_config,
    shard,
    train_steps,
)

import behemoth as bh
from behemoth.models import Llama

STEPS, BATCH = 3, 8


def build_moe(seed: int = 0, frozen_router: bool = False) -> Llama:
    model = Llama(moe_llama_config(router_aux_loss_coef=0.05, router_z_loss_coef=0.01, seed=seed))
    if frozen_router:  # every router scores the experts equally: every token goes to the same two experts
        for layer in model.layers:
            layer.mlp.router.weight.data.zero_()
            layer.mlp.router.weight.requires_grad_(False)
    return model


def optimizer_for(model, name="adamw"):
    params = [p for p in model.parameters() if p.requires_grad]
    if name == "sgd":  # linear in the gradient: bf16 rounding stays rounding (see test_data_parallel.py)
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.1, eps=1e-5)


def serial_moe_run(batches, clip, frozen_router=False, world=1, micro=1, dtype=None, opt_name="adamw"):
    """Plain PyTorch: the token loss's global mean plus the router losses. With ``micro`` > 1 the
    router losses are those of each global micro-batch (micro-batch i of every data rank), averaged,
    and the gradients accumulate."""
    model = build_moe(frozen_router=frozen_router)
    opt = optimizer_for(model, opt_name)
    losses, norms = [], []
    for b in batches:
        n = (b["labels"] != -100).sum()
        loss = 0.0
        for i in range(micro):
            g = {k: torch.cat([shard(b, r, world)[k].chunk(micro)[i] for r in range(world)]) for k in b}
            with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
                logits = model(g["input_ids"])
            ce = F.cross_entropy(
                logits.float().flatten(0, 1), g["labels"].flatten(), ignore_index=-100, reduction="sum"
            )
            part = ce / n + model.aux_loss() / micro
            part.backward()
            loss += part.item()
        params = [p for p in model.parameters() if p.requires_grad]
        norms.append(torch.nn.utils.clip_grad_norm_(params, clip).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss)
    counts = [layer.mlp.token_counts.tolist() for layer in model.layers]
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, norms, counts


def check_ep_ledger(engine, world, what) -> None:
    """The ep axis's traffic, exactly: per MoE layer and step, the split sizes (E int64 from every
    rank) and four all-to-alls of T*K rows of H fp32 over all ranks (dispatch and combine, forward
    and backward; which rank sends how many rows depends on the routing, their sum does not),
    plus the gradient norm's one fp32 all-reduce per step."""
    layers, experts, top_k, hidden = 2, 4, 2, 32
    ep = engine.comm_stats()["ep"]
    assert ep["ops"] == {"all_to_all": STEPS * layers * 5, "all_reduce": STEPS}, (what, ep)
    sent = torch.tensor([float(ep["bytes"])], dtype=torch.float64)
    torch.distributed.all_reduce(sent)
    rows = BATCH * SEQ * top_k
    want = STEPS * (layers * (world * experts * 8 + 4 * rows * hidden * 4) + world * 4)
    assert sent.item() == want, (what, sent.item(), want)


def _parity_world(rank: int, world: int, eps) -> None:
    torch.manual_seed(rank)
    batches = global_batches(STEPS, BATCH)
    want = serial_moe_run(batches, clip=1.0)
    for ep in eps:
        what = f"dp={world} ep={ep}"
        model = build_moe()
        engine = bh.boost(model, optimizer_for(model), bh.Plan(dp=world, ep=ep, bucket_mb=0.01), max_grad_norm=1.0)
        experts = engine.model.layers[0].mlp.gate_up_proj
        assert experts.shape[0] == 4 // ep, (what, experts.shape)  # this rank keeps E/ep experts
        losses, norms = train_steps(engine, batches)
        if ep > 1:
            check_ep_ledger(engine, world, what)
        # the last step's tokens per expert, over the global batch: the serial model's
        assert [layer.mlp.token_counts.tolist() for layer in engine.model.layers] == want[3], what
        assert_losses_close(losses, want[0], what=what)
        assert_grad_norms_close(norms, want[2], what=what)
        assert_state_close(engine.full_state_dict(), want[1], what=what)
    # one hot pair of experts: top-2 of equal scores is one ep rank's block of experts (CPU topk picks
    # experts 2, 3), so the other ep rank receives no token in any step
    hot = torch.topk(torch.softmax(torch.zeros(5, 4), -1), 2).indices
    assert sorted(set(hot.flatten().tolist())) in ([0, 1], [2, 3]), hot
    idle = 1 - int(hot[0, 0]) // 2
    want = serial_moe_run(batches, clip=1.0, frozen_router=True)
    model = build_moe(frozen_router=True)
    engine = bh.boost(model, optimizer_for(model), bh.Plan(dp=world, ep=2), max_grad_norm=1.0)
    losses, norms = train_steps(engine, batches)
    what = f"dp={world} ep=2 hot experts"
    assert_losses_close(losses, want[0], what=what)
    assert_grad_norms_close(norms, want[2], what=what)
    assert_state_close(engine.full_state_dict(), want[1], what=what)
    if engine.mesh.axis("ep").rank == idle:
        assert float(engine.model.layers[0].mlp.gate_up_proj.grad.abs().sum()) == 0.0


def _micro_and_bf16_world(rank: int, world: int) -> None:
    """Micro-batches (router losses per global micro-batch) with activation checkpointing (the
    recomputed blocks dispatch again, in backward), and bf16 autocast, under ep=2."""
    batches = global_batches(STEPS, BATCH)
    for micro, precision, opt_name, ckpt in ((2, "fp32", "adamw", True), (1, "bf16", "sgd", False)):
        what = f"dp={world} ep=2 micro={micro} {precision} {opt_name} ckpt={ckpt}"
        dtype = torch.bfloat16 if precision == "bf16" else None
        want = serial_moe_run(batches, clip=1.0, world=world, micro=micro, dtype=dtype, opt_name=opt_name)
        model = build_moe()
        plan = bh.Plan(dp=world, ep=2, microbatches=micro, precision=precision, activation_checkpointing=ckpt)
        engine = bh.boost(model, optimizer_for(model, opt_name), plan, max_grad_norm=1.0)
        losses, norms = train_steps(engine, batches)
        tol = dict(rtol=2e-2) if dtype else {}
        assert_losses_close(losses, want[0], what=what, **tol)
        assert_grad_norms_close(norms, want[2], what=what, **tol)
        assert_state_close(
            engine.full_state_dict(), want[1], what=what, **(dict(rtol=2e-2, atol=2e-3) if dtype else {})
        )


def _fp16_world(rank: int, world: int) -> None:
    """fp16 autocast with dynamic loss scaling under ep=2 (SGD: linear in the gradient, so fp16
    rounding stays rounding): the serial fp16 model's numbers. Then an inf gradient in one ep rank's
    experts only (the other ep rank's expert gradients are finite, and the dense gradients too): the
    overflow vote skips the step on every rank, which halves its scale and keeps its weights."""
    batches = global_batches(STEPS, BATCH)
    want = serial_moe_run(batches, clip=1.0, dtype=torch.float16, opt_name="sgd")
    for zero in (0, 1):
        what = f"dp={world} ep=2 fp16 zero={zero}"
        model = build_moe()
        plan = bh.Plan(dp=world, ep=2, precision="fp16", zero=zero, chunk_mb=0.02 if zero else None)
        engine = bh.boost(model, optimizer_for(model, "sgd"), plan, max_grad_norm=1.0)
        losses, norms = train_steps(engine, batches)
        assert engine.scaler.skipped_steps == 0, what
        assert_losses_close(losses, want[0], rtol=2e-2, what=what)
        assert_grad_norms_close(norms, want[2], rtol=2e-2, what=what)
        assert_state_close(engine.full_state_dict(), want[1], rtol=2e-2, atol=2e-3, what=what)

    what = f"dp={world} ep=2 fp16: an overflow in ep rank 1's experts"
    model = build_moe()
    engine = bh.boost(model, optimizer_for(model, "sgd"), bh.Plan(dp=world, ep=2, precision="fp16"), max_grad_norm=1.0)
    train_steps(engine, batches[:1])
    before, scale = engine.full_state_dict(), engine.scaler.scale
    handle = None
    if engine.mesh.axis("ep").rank == 1:
        experts = engine.model.layers[1].mlp.gate_up_proj
        handle = experts.register_hook(lambda g: torch.full_like(g, float("inf")))
    _, norms = train_steps(engine, batches[1:2])
    if handle is not None:
        handle.remove()
    assert norms == [float("inf")], (what, norms)
    assert engine.scaler.scale == scale / 2 and engine.scaler.skipped_steps == 1, what
    assert_state_close(engine.full_state_dict(), before, rtol=0, atol=0, what=what)
    train_steps(engine, batches[1:])  # the skipped batch again, then the rest: as serial
    assert_state_close(engine.full_state_dict(), want[1], rtol=2e-2, atol=2e-3, what=what)


def _parallelize_world(rank: int, world: int) -> None:
    """bh.parallelize alone (no optimizer): an ep=2 model's forward on this rank's rows gives the
    serial model's logits for them, and its router losses are this rank's share of the serial
    batch's (their sum over ranks is the serial value)."""
    batch = global_batches(1, BATCH)[0]
    serial = build_moe()
    with torch.no_grad():
        want_logits = serial(batch["input_ids"])
    want_aux = serial.aux_loss()
    model = bh.parallelize(build_moe(), bh.Plan(dp=world, ep=2))
    with torch.no_grad():
        logits = model(shard(batch, rank, world)["input_ids"])
    torch.testing.assert_close(logits, want_logits.chunk(world)[rank], rtol=1e-5, atol=1e-5)
    aux = model.aux_loss().reshape(1)
    torch.distributed.all_reduce(aux)
    torch.testing.assert_close(aux[0], want_aux, rtol=1e-5, atol=0)


def _refusals_world(rank: int, world: int) -> None:
    from common import build

    dense = build("llama")
    expect_error(
        lambda: bh.boost(dense, optimizer_for(dense), bh.Plan(dp=world, ep=2)),
        "Plan.ep=2",
        "no mixture-of-experts layer",
    )
    # (ZeRO 1-3 and cp with experts train now: tests/dist/test_expert_zero.py, test_expert_context.py)
    # (pipelines with experts train now: tests/dist/test_expert_pipeline.py; fp16: test_expert_parallel_fp16)
    # (1D tp with experts trains now, with sequence parallelism too: tests/dist/test_expert_tensor.py)
    stepped = build_moe()
    opt = optimizer_for(stepped)
    stepped(torch.zeros(1, 4, dtype=torch.long)).sum().backward()
    opt.step()  # state shaped like all E experts: would not fit this rank's E/ep
    expect_error(lambda: bh.boost(stepped, opt, bh.Plan(dp=world, ep=2)), "already has state", "expert")
    t = torch.ones(1)
    torch.distributed.all_reduce(t)  # every rank got here: nothing hung
    assert t.item() == world


@pytest.mark.parametrize("world,eps", [(2, (2,)), (4, (2, 4, 1))])
def test_expert_parallel_matches_serial(world, eps):
    bh.spawn(_parity_world, world, eps, timeout=600)


def test_expert_parallel_refusals():
    bh.spawn(_refusals_world, 2, timeout=300)


def _checkpoint_world(rank: int, world: int, path: str) -> None:
    """Saved after 2 steps at ep=2, loaded into a differently initialised model at ep=1 and at ep=2:
    the third step matches the serial run's (loss, grad norm, weights), the optimizer state included."""
    batches = global_batches(STEPS, BATCH)
    want = serial_moe_run(batches, clip=1.0)
    model = build_moe()
    engine = bh.boost(model, optimizer_for(model), bh.Plan(dp=world, ep=2), max_grad_norm=1.0)
    train_steps(engine, batches[:2])
    engine.save(path)
    for ep in (1, 2):
        what = f"saved at ep=2, loaded at dp={world} ep={ep}"
        fresh = build_moe(seed=5)
        engine = bh.boost(fresh, optimizer_for(fresh), bh.Plan(dp=world, ep=ep), max_grad_norm=1.0)
        engine.load(path)
        losses, norms = train_steps(engine, batches[2:])
        assert_losses_close(losses, want[0][2:], what=what)
        assert_grad_norms_close(norms, want[2][2:], what=what)
        assert_state_close(engine.full_state_dict(), want[1], what=what)


def test_expert_checkpoint_loads_under_another_ep(tmp_path):
    bh.spawn(_checkpoint_world, 2, str(tmp_path / "ckpt"), timeout=600)


def test_parallelize_experts_without_an_optimizer():
    bh.spawn(_parallelize_world, 2, timeout=300)


def test_expert_parallel_microbatches_and_bf16():
    bh.spawn(_micro_and_bf16_world, 2, timeout=600)


def test_expert_parallel_fp16():
    bh.spawn(_fp16_world, 2, timeout=600)

"""ZeRO with ``Plan(param_dtype="bf16")``: parameters held (ZeRO-1/2) or gathered (ZeRO-3) and
computed in bf16 over fp32 masters (FSDP2's param_dtype, Megatron's distributed optimizer). At one rank it is "serial training with a bf16 copy of fp32
master weights" (reference below): losses within 1e-4, weights within the bf16 rounding of
gradients that are scaled in another order (the engine sums token losses, then scales); at
dp 2 and 4 the gradient sums split differently too, so both within bf16 tolerance; the model's parameters really are bf16 and
the gathered chunks half the bytes; ``full_state_dict`` and checkpoints hold the fp32 masters,
never bf16-rounded values, and a checkpoint resumes exactly; it composes with CPU and
automatic offload (offloaded chunks gathered from bf16 host copies), 1D and 2D tp and cp;
bad plans are refused."""

from __future__ import annotations

import pytest
import torch
from common import (
    assert_losses_close,
    assert_state_close,
    bf16_param_reference,
    build,
    expect_error,
    global_batches,
    make_optimizer,
    serial_train,
    shard,
)

import behemoth as bh

STEPS, BATCH, CHUNK_MB = 3, 8, 0.02
BF16 = dict(zero=3, precision="bf16", param_dtype="bf16", chunk_mb=CHUNK_MB)


def _engine(family, plan=None, clip=1.0, seed=0, opt_name="adamw"):
    model = build(family, seed=seed)
    return bh.boost(model, make_optimizer(opt_name, model), plan or bh.Plan(**BF16), max_grad_norm=clip)


def _parity_world(rank, world, zero):
    batches = global_batches(STEPS, BATCH)
    # AdamW turns bf16 rounding noise of near-zero gradients into lr-sized steps, so the runs
    # whose gradient sums split differently (dp > 1) use SGD, as the serial bf16 tests do
    opt_name = "adamw" if world == 1 else "sgd"
    for family in ("gpt", "llama", "hf-gpt2"):
        what = f"param_dtype=bf16 zero={zero} dp={world} {family}/{opt_name}"
        engine = _engine(family, plan=bh.Plan(**{**BF16, "zero": zero}), opt_name=opt_name)
        store = engine.grad_sync.store
        assert store.layout.num_chunks >= 3, what
        assert all(p.dtype == torch.bfloat16 for p in engine.model.parameters()), what
        losses = [engine.step(shard(b, engine.dp_rank, engine.dp_size)) for b in batches]
        want_losses, want_state = bf16_param_reference(family, opt_name, batches, 1.0)
        tight = world == 1  # the same arithmetic up to the loss scaling order
        assert_losses_close(losses, want_losses, what=what, rtol=1e-4 if tight else 2e-2)
        state = engine.full_state_dict()
        assert_state_close(state, want_state, what=what, rtol=2e-2, atol=2e-4 if tight else 3e-3)
        # fp32 masters, not the bf16 parameters: trained weights are not all bf16-representable
        floats = [v for v in state.values() if v.is_floating_point()]
        assert all(v.dtype == torch.float32 for v in floats), what
        assert any((v != v.bfloat16().float()).any() for v in floats), f"{what}: full_state_dict was rounded to bf16"
        # and within bf16 tolerance of plain serial (autocast over fp32) training
        serial_losses, _ = serial_train(family, opt_name, batches, max_grad_norm=1.0, precision="bf16")
        assert_losses_close(losses, serial_losses, what=f"{what} vs serial autocast", rtol=3e-2)
        # after the step the parameters are bf16 views again (ZeRO-3: released, gathered chunks are bf16)
        assert all(p.dtype == torch.bfloat16 for p in engine.model.parameters()), what
        st = store.chunks[0]
        if zero == 3:
            assert st.full.untyped_storage().size() == 0, what
            store.gather(st)
        assert st.full.dtype == torch.bfloat16 and st.full.untyped_storage().size() == 2 * st.size, what
        # the fp32 master is this rank's shard only, apart from the bf16 parameters
        assert st.master.dtype == torch.float32 and st.master.numel() == st.shard_size < st.size or world == 1, what
        assert st.master.untyped_storage().data_ptr() != st.full.untyped_storage().data_ptr(), what
        if zero < 3:  # the bf16 shard the all-gather reads is this rank's slot of full, not a copy beside it
            assert st.low.data_ptr() == st.full[st.start :].data_ptr() and st.low.numel() == st.shard_size, what
        store.release(st)


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_zero_bf16_params_match_the_bf16_master_reference(zero):
    for world in (1, 2, 4):
        bh.spawn(_parity_world, world, zero, timeout=300)


def _accumulation_world(rank, world):
    """Micro-batches (gradient accumulation): ZeRO-1 adds each micro-batch's bf16 gradients into
    its fp32 gradient chunk (it cannot let autograd accumulate into a bf16 parameter's fp32 view)
    and reduces once; ZeRO-2 reduces every micro-batch. Both train like one big batch."""
    batches = global_batches(STEPS, BATCH)
    want_losses, want_state = bf16_param_reference("gpt", "sgd", batches, 1.0)
    for zero in (1, 2):
        what = f"param_dtype=bf16 zero={zero} microbatches=2 dp={world}"
        engine = _engine("gpt", plan=bh.Plan(**{**BF16, "zero": zero}, microbatches=2), opt_name="sgd")
        losses = [engine.step(shard(b, engine.dp_rank, engine.dp_size)) for b in batches]
        assert_losses_close(losses, want_losses, what=what, rtol=2e-2)
        assert_state_close(engine.full_state_dict(), want_state, what=what, rtol=2e-2, atol=3e-3)


def test_zero12_bf16_params_accumulate_micro_batches():
    bh.spawn(_accumulation_world, 2, timeout=300)


def _composes_world(rank, world, extra):
    """With 1D tp (dp 2 x tp 2), 2D tp (tp 4) and Ulysses cp (dp 2 x cp 2): the tensor- and
    context-parallel layers compute on bf16 parameter shards like on fp32 ones."""
    batches = global_batches(STEPS, BATCH)
    for family in ("gpt", "llama"):
        what = f"param_dtype=bf16 {extra} {family}/sgd"
        engine = _engine(family, plan=bh.Plan(**{**BF16, **extra}), opt_name="sgd")
        losses = [engine.step(shard(b, engine.dp_rank, engine.dp_size)) for b in batches]
        want_losses, want_state = bf16_param_reference(family, "sgd", batches, 1.0)
        assert_losses_close(losses, want_losses, what=what, rtol=2e-2)
        assert_state_close(engine.full_state_dict(), want_state, what=what, rtol=2e-2, atol=3e-3)


def _offload_world(rank, world):
    """offload='cpu' and 'auto' (forced to move chunks after its warm-up): masters on the host,
    offloaded chunks gathered from pinned bf16 host copies, the same training as on the device."""
    batches = global_batches(STEPS, BATCH)
    for family, offload, stage in (("gpt", "cpu", 3), ("llama", "auto", 3), ("gpt", "cpu", 2), ("llama", "auto", 1)):
        what = f"param_dtype=bf16 zero={stage} offload={offload} dp={world} {family}/sgd"
        engine = _engine(family, plan=bh.Plan(**{**BF16, "zero": stage}, offload=offload), opt_name="sgd")
        zero = engine.grad_sync
        if offload == "auto":  # on CPU the measured budget equals the guess: force a move at the warm-up
            zero.placement._auto_budget = lambda measured, other_peak=None: 0 if measured else 10**12
        losses = [engine.step(shard(b, engine.dp_rank, engine.dp_size)) for b in batches]
        chunks = zero.store.chunks
        if offload == "cpu":  # parameters stay on the device as bf16 copies, masters on the host only
            assert all(
                st.master.device.type == "cpu" and st.shard is None and st.low is not None and st.low_host is None
                for st in chunks
            ), f"{what}: placement"
        elif stage < 3:  # parameters stay on the device (bf16): only masters and state moved
            assert all(st.low is not None and st.low_host is None for st in chunks) and any(
                st.master.device.type == "cpu" and st.shard is None for st in chunks
            ), f"{what}: placement"
        else:  # the moved chunks are gathered from pinned bf16 host copies
            assert any(
                st.low_host is not None
                and st.low is None
                and st.low_host.dtype == torch.bfloat16
                and st.master.device.type == "cpu"
                for st in chunks
            ), f"{what}: no chunk left the device"
        want_losses, want_state = bf16_param_reference(family, "sgd", batches, 1.0)
        assert_losses_close(losses, want_losses, what=what, rtol=2e-2)
        assert_state_close(engine.full_state_dict(), want_state, what=what, rtol=2e-2, atol=3e-3)


def test_zero_bf16_params_with_offload():
    bh.spawn(_offload_world, 2, timeout=300)


def test_zero_bf16_params_compose_with_tensor_and_context_parallel():
    for extra in (dict(tp=2), dict(tp=4, tp_mode="2d"), dict(cp=2), dict(tp=2, zero=1), dict(tp=4, zero=2)):
        bh.spawn(_composes_world, 4, extra, timeout=300)


def _save_world(rank, world, root, zero):
    engine = _engine("gpt", plan=bh.Plan(**{**BF16, "zero": zero}))
    for b in global_batches(4, BATCH)[:2]:
        engine.step(shard(b, engine.dp_rank, engine.dp_size))
    engine.save(root)


def _resume_world(rank, world, root, zero):
    """A param_dtype checkpoint resumes under param_dtype exactly like the uninterrupted run,
    and under a plain fp32 plan from the fp32 masters."""
    batches = global_batches(4, BATCH)
    plan = bh.Plan(**{**BF16, "zero": zero})
    full = _engine("gpt", plan=plan)
    want = [full.step(shard(b, full.dp_rank, full.dp_size)) for b in batches]
    want_state = full.full_state_dict()
    engine = _engine("gpt", plan=plan, seed=7)  # different init: everything must come from the checkpoint
    engine.load(root)
    got = [engine.step(shard(b, engine.dp_rank, engine.dp_size)) for b in batches[2:]]
    assert_losses_close(got, want[2:], what=f"param_dtype zero={zero} resume", rtol=1e-5)
    assert_state_close(
        engine.full_state_dict(), want_state, what=f"param_dtype zero={zero} resume", rtol=1e-5, atol=1e-6
    )
    plain = _engine("gpt", plan=bh.Plan(), seed=7)
    plain.load(root)
    ref = _engine("gpt", plan=plan, seed=3)
    ref.load(root)
    with ref.grad_sync.gathered():  # the masters the checkpoint holds, as fp32 parameters
        masters = {k: v.detach().clone() for k, v in ref.model.state_dict().items()}
    assert_state_close(plain.full_state_dict(), masters, what="param_dtype checkpoint -> plain", rtol=0, atol=0)


@pytest.mark.parametrize("zero", [2, 3])
def test_zero_bf16_params_checkpoint_resumes_exactly(tmp_path, zero):
    bh.spawn(_save_world, 2, str(tmp_path / "ck"), zero, timeout=300)
    bh.spawn(_resume_world, 2, str(tmp_path / "ck"), zero, timeout=300)


def test_param_dtype_refusals():
    for kwargs in (
        dict(zero=0, precision="bf16", param_dtype="bf16"),
        dict(zero=3, precision="fp32", param_dtype="bf16"),
        dict(zero=1, precision="fp16", param_dtype="bf16"),
        dict(zero=3, precision="bf16", param_dtype="fp16"),
    ):
        expect_error(lambda: bh.Plan(**kwargs), "Plan.param_dtype", "zero=1, 2 or 3 and precision='bf16'")

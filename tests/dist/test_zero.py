"""ZeRO stages 1-3, with and without CPU / automatic offload, match serial training (the
parity law): behemoth's and transformers' models, AdamW and SGD, accumulation, clipping,
fp16/bf16, composed with 1D and 2D tensor parallelism; checkpoints written under ZeRO load
under any other plan; the per-chunk reduce-scatter overlaps backward; ZeRO-3 at dp=4 holds a
quarter of the serial model data plus the chunk padding; offload='auto''s re-placement keeps
the learning rate set before the step; bad input fails on every rank."""

from __future__ import annotations

import gc
import os
import weakref

import pytest
import torch
from common import (
    assert_grad_norms_close,
    assert_losses_close,
    assert_state_close,
    build,
    expect_error,
    global_batches,
    make_optimizer,
    serial_loss,
    serial_run,
    serial_train,
    shard,
    train_and_save,
    train_steps,
)

import behemoth as bh

STEPS, BATCH = 3, 8
CHUNK_MB = 0.02  # ~5k elements: the tiny models span several chunks (and one chunk straddles shards)

# (family, optimizer, stage, offload, microbatches, max_grad_norm, precision)
SCENARIOS_2 = [
    ("gpt", "adamw", 1, None, 2, 1.0, "fp32"),
    ("gpt", "sgd", 2, None, 2, None, "fp32"),
    ("gpt", "adamw", 3, None, 2, 0.5, "fp32"),
    ("llama", "adamw", 3, "cpu", 1, 1.0, "fp32"),
    ("llama", "sgd", 1, "cpu", 2, None, "fp32"),
    ("hf-gpt2", "adamw", 3, "auto", 2, 1.0, "fp32"),
    ("hf-llama", "adamw", 2, "auto", 1, 0.5, "fp32"),
    ("hf-gpt2", "sgd", 2, "cpu", 1, None, "fp32"),
    ("gpt", "sgd", 3, None, 1, 1.0, "bf16"),
    ("llama", "sgd", 2, None, 1, None, "fp16"),
]
SCENARIOS_1 = [  # one rank: the same code path (a ZeRO-3 chunk kept on the device is its own shard)
    ("gpt", "adamw", 3, None, 2, 1.0, "fp32"),
    ("hf-gpt2", "adamw", 3, "auto", 1, 0.5, "fp32"),
    ("llama", "sgd", 2, "cpu", 1, None, "fp32"),
]
SCENARIOS_4 = [
    ("gpt", "adamw", 1, None, 1, 1.0, "fp32"),
    ("llama", "sgd", 2, "cpu", 2, None, "fp32"),
    ("hf-gpt2", "adamw", 3, None, 1, 0.5, "fp32"),
    ("hf-llama", "adamw", 3, "auto", 2, None, "fp32"),
]


def _check(engine, losses, norms, family, opt_name, clip, precision, what):
    want = serial_run(family, opt_name, global_batches(STEPS, BATCH), max_grad_norm=clip, precision=precision)
    tol = {} if precision == "fp32" else {"rtol": 2e-2}
    assert_losses_close(losses, want.losses, what=what, **tol)
    assert_state_close(
        engine.full_state_dict(), want.state, what=what, **({} if precision == "fp32" else {"rtol": 2e-2, "atol": 2e-3})
    )
    assert_grad_norms_close(norms, want.grad_norms, what=what, **tol)
    t = torch.tensor(losses, dtype=torch.float64)
    ref = t.clone()
    torch.distributed.broadcast(ref, 0)
    assert torch.equal(t, ref), f"{what}: ranks disagree on the loss"


def _parity_world(rank, world, scenarios, tp=1, tp_mode="1d", cp=1, tp_depth=1, sp=False):
    torch.manual_seed(rank)
    batches = global_batches(STEPS, BATCH)
    for family, opt_name, stage, offload, micro, clip, precision in scenarios:
        what = f"dp={world // tp // cp} tp={tp}/{tp_mode}{'+sp' if sp else ''} cp={cp} zero={stage} offload={offload} {family}/{opt_name}/m{micro}/{precision}"
        model = build(family)
        plan = bh.Plan(
            tp=tp,
            tp_mode=tp_mode,
            tp_depth=tp_depth,
            cp=cp,
            sequence_parallel=sp,
            zero=stage,
            offload=offload,
            microbatches=micro,
            precision=precision,
            chunk_mb=CHUNK_MB / (tp // tp_depth),
        )  # tp shards are smaller: smaller chunks keep several
        engine = bh.boost(model, make_optimizer(opt_name, model), plan, max_grad_norm=clip)
        assert engine.grad_sync.stage == stage and engine.grad_sync.layout.num_chunks >= 3, what
        losses, norms = train_steps(engine, batches)
        _check(engine, losses, norms, family, opt_name, clip, precision, what)
        if offload == "auto":
            assert engine.grad_sync.placement.explain(), what
        if offload is not None and clip is None and precision != "fp16":  # nothing global before the
            # update: every offloaded chunk was updated on the host during the backward (under auto not
            # in the warm-up step, nor in the step after it, which may run again after out of memory)
            offloaded = sum(not st.optim_on_gpu for st in engine.grad_sync.store.chunks)
            want = STEPS * offloaded if offload == "cpu" else (STEPS - 2) * offloaded
            assert offloaded and engine.grad_sync.early_updates == want, (what, engine.grad_sync.early_updates, want)
        elif offload is not None:
            assert engine.grad_sync.early_updates == 0, what
        if offload == "cpu":  # masters and optimizer state really are the host copies
            assert all(
                st.master.device.type == "cpu" and (st.shard is None or st.master.data_ptr() != st.shard.data_ptr())
                for st in engine.grad_sync.store.chunks
            )
        if world // tp // cp > 1 and cp == 1:  # one reduce-scatter per chunk per reduced micro-batch, over dp
            dp = engine.comm_stats()["dp"]
            reduced = micro if stage >= 2 else 1
            assert dp["ops"]["reduce_scatter"] == STEPS * reduced * engine.grad_sync.layout.num_chunks, (what, dp)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_zero_matches_serial(world):
    bh.spawn(_parity_world, world, {1: SCENARIOS_1, 2: SCENARIOS_2, 4: SCENARIOS_4}[world], timeout=600)


def test_zero_with_1d_tensor_parallel():
    scen = [
        ("gpt", "adamw", 1, None, 1, 1.0, "fp32"),
        ("hf-llama", "adamw", 3, "cpu", 2, 0.5, "fp32"),
        ("hf-gpt2", "sgd", 2, None, 1, None, "fp32"),
    ]
    bh.spawn(_parity_world, 4, scen, 2, "1d", timeout=600)


def test_zero_with_1d_sequence_parallel():
    """ZeRO-3 gathers a sequence-parallel norm's chunk again before its backward, though the column
    layers after it send their gradient to its sequence shard (which the gather hook watches too)."""
    scen = [("gpt", "adamw", 3, None, 2, 1.0, "fp32"), ("llama", "sgd", 3, None, 1, None, "bf16")]
    bh.spawn(_parity_world, 4, scen, 2, "1d", 1, 1, True, timeout=600)


def test_zero_with_2d_tensor_parallel():
    scen = [("gpt", "adamw", 3, None, 1, 1.0, "fp32"), ("llama", "sgd", 2, "auto", 1, None, "fp32")]
    bh.spawn(_parity_world, 8, scen, 4, "2d", timeout=600)


@pytest.mark.parametrize("mode, depth", [("3d", 1), ("2.5d", 2)])
def test_zero_with_3d_and_2p5d_tensor_parallel(mode, depth):
    """dp = 1: ZeRO's flat shards hold 3D / 2.5D shards (2.5D replicates weights over depth); the
    clipped norm weighs each piece by its copies on tp."""
    bh.spawn(_parity_world, 8, [("gpt", "adamw", 3, None, 1, 0.5, "fp32")], 8, mode, 1, depth, timeout=600)


def test_zero_with_context_parallel():
    """Under cp the gradients are summed over dp x cp: ZeRO shards over that axis."""
    scen = [("gpt", "adamw", 3, None, 1, 1.0, "fp32"), ("hf-llama", "sgd", 2, "cpu", 2, None, "fp32")]
    bh.spawn(_parity_world, 4, scen, 1, "1d", 2, timeout=600)


# ----------------------------------------------------------------------------- overlap, memory, errors
def _overlap_memory_errors_world(rank, world):
    model = build("gpt")
    engine = bh.boost(model, make_optimizer("adamw", model), bh.Plan(zero=3, chunk_mb=CHUNK_MB))
    n_params = len(engine.grad_sync.params)
    engine.step(shard(global_batches(1, BATCH)[0], engine.dp_rank, engine.dp_size))
    log = engine.grad_sync.reducer.launch_log
    assert [c for c, _ in log] == list(reversed(range(engine.grad_sync.layout.num_chunks))), log
    assert log[0][1] < n_params, f"the first reduce-scatter waited for every gradient: {log}"
    # Between steps ZeRO-3 holds no gathered chunk.
    assert not any(st.resident for st in engine.grad_sync.store.chunks)

    # Model data at rest under ZeRO-3: parameters, gradients and AdamW state are sharded.
    serial = sum(p.numel() for p in build("gpt").parameters())
    mem = engine.memory_report()["cpu"]
    held = mem["params"] + mem["grads"] + mem["masters"] + mem["optimizer"]
    layout = engine.grad_sync.layout
    padding = 16 * (layout.total_elements - layout.param_elements) // world
    # fp32 parameter + gradient + Adam's two moments = 16 B per element, plus AdamW's 4-byte step
    # counter per shard (serial AdamW keeps one per parameter: more).
    bound = 16 * serial // world + padding + 4 * layout.num_chunks
    assert held <= bound, (mem, held, bound)
    if rank == 0:
        print(
            f"ZeRO-3 dp={world}: {held} B per rank at rest vs serial {16 * serial} B "
            f"(bound {bound}); padding {100 * layout.padding_fraction:.2f}%"
        )

    # The same tracer without ZeRO: everything replicated, 16 B per element (+ AdamW's step counters).
    m = build("gpt")
    plain = bh.boost(m, make_optimizer("adamw", m), bh.Plan())
    plain.step(shard(global_batches(1, BATCH)[0], plain.dp_rank, plain.dp_size))
    rep = plain.memory_report()["cpu"]
    n_tensors = len(list(m.parameters()))
    assert (rep["params"], rep["grads"], rep["masters"]) == (4 * serial, 4 * serial, 0), rep
    assert rep["optimizer"] == 8 * serial + 4 * n_tensors, rep

    # Bad input, on every rank.
    m = build("gpt")
    expect_error(
        lambda: bh.boost(m, torch.optim.LBFGS(m.parameters()), bh.Plan(zero=2)), "zero=2", "element-wise", "LBFGS"
    )
    m = build("gpt")
    expect_error(
        lambda: bh.boost(m, make_optimizer("adamw", m), bh.Plan(zero=1, chunk_mb=0.001)),
        "chunk_mb=0.001",
        "never split",
        "chunk_mb >=",
    )
    m = build("gpt")
    expect_error(
        lambda: bh.boost(
            m, make_optimizer("adamw", m), bh.Plan(zero=3, offload="auto", offload_budget_gb=1e-6, chunk_mb=CHUNK_MB)
        ),
        "offload_budget_gb",
        "largest chunk",
    )
    expect_error(lambda: bh.Plan(offload="cpu"), "zero=0")
    # A problem only one rank sees (pipeline stages hold different parameters) fails every rank.
    from behemoth.parallel.zero.auto import raise_everywhere

    mine = ValueError("Plan.chunk_mb=1: too small") if rank == 0 else None
    expect_error(lambda: raise_everywhere(engine.mesh.axis("world"), mine, "Plan.chunk_mb"), "Plan.chunk_mb")
    expect_error(lambda: bh.Plan(zero=1, offload_budget_gb=4), "offload='auto'")
    m = build("gpt")
    frozen = [p for n, p in m.named_parameters() if "wte" not in n]
    expect_error(lambda: bh.boost(m, torch.optim.AdamW(frozen), bh.Plan(zero=1)), "not in the optimizer")


def test_zero_overlap_memory_and_errors():
    bh.spawn(_overlap_memory_errors_world, 4, timeout=300)


# ----------------------------------------------------------------------------- checkpoints
def _save_world(rank, world, root):
    for name, plan in (
        ("z3", bh.Plan(zero=3, chunk_mb=CHUNK_MB)),
        ("z1-cpu", bh.Plan(zero=1, offload="cpu", chunk_mb=CHUNK_MB)),
        ("plain", bh.Plan()),
    ):
        train_and_save("gpt", plan, os.path.join(root, name), 8)


def _load_world(rank, world, root):
    """Every checkpoint, loaded under other plans, finishes the four steps like serial training."""
    batches = global_batches(4, 8)
    want_losses, want_state = serial_train("gpt", "adamw", batches, max_grad_norm=1.0)
    for name, plan in (
        ("z3", bh.Plan()),
        ("z3", bh.Plan(zero=2, chunk_mb=0.03)),
        ("z1-cpu", bh.Plan(zero=3, offload="auto", chunk_mb=CHUNK_MB)),
        ("plain", bh.Plan(zero=3, offload="cpu", chunk_mb=CHUNK_MB)),
    ):
        what = f"{name} -> {plan.describe()} at world {world}"
        model = build("gpt", seed=7)  # different init: everything must come from the checkpoint
        engine = bh.boost(model, make_optimizer("adamw", model), plan, max_grad_norm=1.0)
        engine.load(os.path.join(root, name))
        losses = [engine.step(shard(b, engine.dp_rank, engine.dp_size)) for b in batches[2:]]
        assert_losses_close(losses, want_losses[2:], what=what)
        assert_state_close(engine.full_state_dict(), want_state, what=what)


def test_zero_checkpoints_load_under_other_plans(tmp_path):
    bh.spawn(_save_world, 2, str(tmp_path), timeout=300)
    bh.spawn(_load_world, 4, str(tmp_path), timeout=300)


# ----------------------------------------------------------------------------- offload="auto" re-placement
def _replace_keeps_hyper_world(rank, world):
    """The re-placement after offload='auto''s warm-up re-targets the user's optimizer at the moved
    masters inside step 1 (the same object); the step must still use the learning rate set on
    ``engine.optimizer`` before it."""
    model = build("gpt")
    user = make_optimizer("adamw", model)
    engine = bh.boost(model, user, bh.Plan(zero=3, offload="auto", chunk_mb=CHUNK_MB))
    zero, old = engine.grad_sync, engine.optimizer
    assert old is user, "bh.boost replaced the user's optimizer"
    zero.placement._auto_budget = lambda measured, other_peak=None: (
        0
    )  # on CPU the measured budget is the guess: force a move
    placed = [(st.param_on_gpu, st.optim_on_gpu) for st in zero.store.chunks]
    for g in old.param_groups:
        g["lr"] = 0.0  # AdamW with lr 0 leaves the weights exactly as they are (decay is lr * wd)
    before = engine.full_state_dict()
    engine.step(shard(global_batches(1, BATCH)[0], engine.dp_rank, engine.dp_size))
    assert engine.optimizer is user and [(st.param_on_gpu, st.optim_on_gpu) for st in zero.store.chunks] != placed
    assert [g["lr"] for g in engine.optimizer.param_groups] == [0.0] * len(old.param_groups)
    after = engine.full_state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items()), (
        "the rebuilt optimizer lost the lr set before step 1"
    )


def test_zero_auto_replacement_keeps_the_learning_rate():
    bh.spawn(_replace_keeps_hyper_world, 2, timeout=120)


def _oom_after(model: torch.nn.Module, failures: int):
    """Make the first ``failures`` backwards through block 0 (after most chunks' reductions were
    launched) raise the out-of-memory error a GPU would."""
    left = [failures]

    def hook(module, grad_output):
        if left[0] > 0:
            left[0] -= 1
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 6.14 GiB.")

    return model.blocks[0].register_full_backward_pre_hook(hook)


class _ProbeLog:
    """Stands in for zero.measure.OtherPeak on CPU: records the calls."""

    def __init__(self):
        self.calls = []

    def start(self):
        self.calls.append("start")

    def sample(self):
        self.calls.append("sample")

    def finish(self):
        self.calls.append("finish")
        return None


def _warmup_oom_world(rank, world):
    """Out of device memory under offload='auto': a single-process job's warm-up step runs again
    with half the model data on the device and then trains exactly like serial; elsewhere (a later
    step, several ranks, or nothing left to move) the same error type is raised, naming the model
    data the placement kept on the device and the setting that makes room."""
    batches = global_batches(STEPS, BATCH)
    want_losses, want_state = serial_train("gpt", "adamw", batches, max_grad_norm=1.0)
    model = build("gpt")
    engine = bh.boost(
        model, make_optimizer("adamw", model), bh.Plan(zero=3, offload="auto", chunk_mb=CHUNK_MB), max_grad_norm=1.0
    )
    zero = engine.grad_sync
    handle = _oom_after(model, 1)
    kept = sum(zero.store.bytes_on("cpu").values()) / 2**30
    on_device = [(st.param_on_gpu, st.optim_on_gpu) for st in zero.store.chunks]
    if world == 1:
        # The warm-up's reading of non-model memory (a GPU's allocator peaks, so a recorder here):
        # started by each attempt, sampled at every gather hook forward and backward, finished
        # by the re-placement, then no longer called.
        probe = _ProbeLog()
        zero.placement.other = probe  # the gather hooks call placement.sample
        losses = [engine.step(shard(b, engine.dp_rank, engine.dp_size)) for b in batches]
        assert probe.calls.count("start") == 2 and probe.calls[-1] == "finish", probe.calls
        retried = probe.calls[probe.calls.index("start", 1) + 1 : -1]
        assert retried.count("sample") >= 2 * len(model.blocks) and set(retried) == {"sample"}, probe.calls
        assert zero.placement.oom_retries == 1, zero.placement.oom_retries
        assert sum(o for _, o in on_device) > 0 and zero.placement.guess > 0, "the first guess kept nothing to move"
        assert_losses_close(losses, want_losses, what="auto warm-up retried after out of memory")
        assert_state_close(engine.full_state_dict(), want_state, what="auto warm-up retried after out of memory")
        handle.remove()
        # The first step after the re-placement rests on the warm-up's measurement: out of memory
        # there, it runs again with half the measured budget (optimizer state moving too), and
        # no chunk was updated early in the failed attempt (no clipping, so early updates are on
        # in the steps after it).
        ref_losses, ref_state = serial_train("gpt", "adamw", batches)
        model2 = build("gpt")
        engine2 = bh.boost(model2, make_optimizer("adamw", model2), bh.Plan(zero=3, offload="auto", chunk_mb=CHUNK_MB))
        got = [engine2.step(batches[0])]
        z2 = engine2.grad_sync
        placed = [(st.param_on_gpu, st.optim_on_gpu) for st in z2.store.chunks]
        h2 = _oom_after(model2, 1)
        got += [engine2.step(b) for b in batches[1:]]
        h2.remove()
        # (which chunks move depends on the measured transfer and CPU-update rates, not checked here)
        now = [(st.param_on_gpu, st.optim_on_gpu) for st in z2.store.chunks]
        assert z2.placement.oom_retries == 1 and now != placed, (z2.placement.oom_retries, placed, now)
        assert z2.early_updates > 0, "the steps after the retried one updated nothing early: the test lost its point"
        assert_losses_close(got, ref_losses, what="auto: step after the re-placement retried after out of memory")
        assert_state_close(
            engine2.full_state_dict(), ref_state, what="auto: step after the re-placement retried after out of memory"
        )
        handle = _oom_after(model, 1)  # after the warm-up: no retry
    for warmup in (True, False) if world > 1 else (False,):
        zero.placement.warmup = warmup
        try:
            engine.step(shard(batches[0], engine.dp_rank, engine.dp_size))
        except torch.OutOfMemoryError as exc:
            msg = str(exc)
        else:
            raise AssertionError("the injected out-of-memory error was swallowed")
        assert msg.startswith("CUDA out of memory. Tried to allocate 6.14 GiB."), msg
        assert "GiB of model data on the device" in msg and "Plan.offload_budget_gb below" in msg, msg
        assert ("first guess" in msg) == warmup, msg
        if world > 1 and warmup:
            assert f"kept {kept:.2f} GiB" in msg and zero.placement.oom_retries == 0, msg
        handle.remove()
        handle = _oom_after(model, 1)
    handle.remove()


def test_zero_auto_out_of_memory_retries_or_names_the_budget():
    for world in (1, 2):
        bh.spawn(_warmup_oom_world, world, timeout=180)


def _compile_world(rank, world):
    batches = global_batches(STEPS, BATCH)
    want_losses, want_state = serial_train("gpt", "adamw", batches, max_grad_norm=1.0)
    model = build("gpt")
    engine = bh.boost(
        model, make_optimizer("adamw", model), bh.Plan(zero=3, compile=True, chunk_mb=CHUNK_MB), max_grad_norm=1.0
    )
    losses = [engine.step(shard(b, engine.dp_rank, engine.dp_size)) for b in batches]
    assert_losses_close(losses, want_losses, what="zero=3 compile")
    assert_state_close(engine.full_state_dict(), want_state, what="zero=3 compile")


def test_zero3_with_compiled_blocks():
    """The gather/release module hooks run around torch.compile'd blocks."""
    bh.spawn(_compile_world, 2, timeout=600)


# ----------------------------------------------------------------------------- CPU update during backward
def _early_update_world(rank, world):
    """The offloaded chunks' update during the backward (no clipping) gives bit-identical losses,
    gradient norms and states to the update after it: the same plan with a clip threshold no
    gradient reaches (factor exactly 1.0) updates after the backward."""
    batches = global_batches(STEPS, BATCH)
    bf16 = {"precision": "bf16", "param_dtype": "bf16"}  # bf16 parameter copies refreshed from the masters
    for stage, micro, opt_name, extra in (
        (3, 2, "adamw", {}),
        (3, 1, "adamw", bf16),
        (2, 1, "adamw", {}),
        (1, 2, "sgd", {}),
    ):
        runs = []
        for clip in (None, 1e30):
            model = build("gpt")
            plan = bh.Plan(zero=stage, offload="cpu", microbatches=micro, chunk_mb=CHUNK_MB, **extra)
            engine = bh.boost(model, make_optimizer(opt_name, model), plan, max_grad_norm=clip)
            losses = []
            for b in batches:  # each step's loss and gradient norm (m2: the worker reads the host sum's)
                losses += [engine.step(shard(b, engine.dp_rank, engine.dp_size)), float(engine.last_grad_norm)]
            runs.append((losses, engine.full_state_dict(), engine.grad_sync.early_updates))
        (l_early, s_early, n_early), (l_after, s_after, n_after) = runs
        what = f"zero={stage} m{micro} {opt_name} {extra}"
        assert n_early == STEPS * engine.grad_sync.layout.num_chunks and n_after == 0, (what, n_early, n_after)
        assert l_early == l_after, (what, l_early, l_after)
        for k in s_after:
            assert torch.equal(s_early[k], s_after[k]), (what, k)


def test_zero_cpu_update_during_backward_is_exact():
    bh.spawn(_early_update_world, 2, timeout=300)


# ----------------------------------------------------------------------------- lifetime
def _collected_world(rank, world):
    """A dropped engine frees its model: gradient hooks live in C++ autograd state Python's
    collector cannot walk, so they must not hold the engine (or its buffers) strongly."""
    for plan in (
        bh.Plan(),
        bh.Plan(tp=2, dp=1),
        bh.Plan(cp=2, dp=1),
        bh.Plan(pp=2, dp=1, microbatches=2),
        bh.Plan(zero=3, offload="cpu", chunk_mb=CHUNK_MB),
        bh.Plan(zero=1, precision="bf16", param_dtype="bf16", chunk_mb=CHUNK_MB),
    ):
        model = build("gpt")
        engine = bh.boost(model, make_optimizer("adamw", model), plan)
        engine.step(shard(global_batches(1, BATCH)[0], engine.dp_rank, engine.dp_size))
        refs = [weakref.ref(model), weakref.ref(engine), weakref.ref(next(model.parameters()))]
        del model, engine
        gc.collect()
        assert all(r() is None for r in refs), f"{plan.describe()}: the engine, its model or a parameter outlived it"


def test_dropped_engines_are_collected():
    bh.spawn(_collected_world, 2, timeout=180)


# ----------------------------------------------------------------------------- the user's optimizer stays the optimizer
LR_FACTORS = (1.0, 0.3, 0.0, 1.5)  # lr 0 in step 3: AdamW leaves the weights where they are


def _lr_schedule(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: LR_FACTORS[min(step, len(LR_FACTORS) - 1)])


def _scheduler_world(rank, world):
    """A learning-rate scheduler attached to the user's optimizer before bh.boost steps the learning
    rate the engine uses, exactly as in serial training with the same scheduler: ``engine.optimizer``
    is the user's object, under ZeRO-3, under offload='auto' (re-placed after its warm-up, offloaded
    chunks updated by the CPU optimizer during the backward), under offload='cpu' and under plain dp."""
    batches = global_batches(len(LR_FACTORS), BATCH)
    for plan, clip in (
        (bh.Plan(zero=3, chunk_mb=CHUNK_MB), 1.0),
        (bh.Plan(zero=3, offload="auto", chunk_mb=CHUNK_MB), None),
        (bh.Plan(zero=1, offload="cpu", chunk_mb=CHUNK_MB), None),
        (bh.Plan(bucket_mb=0.01), 1.0),
    ):
        what = f"{plan.describe()} clip={clip}"
        model = build("gpt")
        ref = build("gpt")
        ref_opt = make_optimizer("adamw", ref)
        ref_sched = _lr_schedule(ref_opt)
        want = []
        for b in batches:
            loss = serial_loss(ref, b)
            loss.backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
            ref_opt.step()
            ref_sched.step()
            ref_opt.zero_grad()
            want.append(loss.item())
        opt = make_optimizer("adamw", model)
        groups = list(opt.param_groups)
        sched = _lr_schedule(opt)
        engine = bh.boost(model, opt, plan, max_grad_norm=clip)
        if plan.offload == "auto":  # on CPU the measured budget equals the guess: force a move at the warm-up
            engine.grad_sync.placement._auto_budget = lambda measured, other_peak=None: 0 if measured else 10**12
        got = []
        for b in batches:
            got.append(engine.step(shard(b, engine.dp_rank, engine.dp_size)))
            sched.step()
            assert engine.optimizer is opt and all(g is h for g, h in zip(opt.param_groups, groups)), what
        if plan.offload is not None:  # offloaded chunks were updated by the CPU optimizer during a backward
            assert engine.grad_sync.early_updates > 0, what
        assert_losses_close(got, want, what=what)
        assert_state_close(engine.full_state_dict(), {k: v.detach() for k, v in ref.state_dict().items()}, what=what)


def test_lr_scheduler_on_the_users_optimizer_steps_the_real_learning_rate():
    bh.spawn(_scheduler_world, 2, timeout=300)

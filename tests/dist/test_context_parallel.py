"""Context parallelism end to end matches serial training (the parity law).

* whole models -- behemoth's GPT (learned positions) and Llama (RoPE, GQA), transformers'
  GPT2LMHeadModel and LlamaForCausalLM -- under ``Plan(cp=2|4, cp_mode='ulysses'|'ring')``,
  alone, with dp=2 and with 1D tp=2 (with and without Megatron context parallelism), through
  the unchanged ``engine.step(batch)`` on full sequences: losses and ``full_state_dict()``
  within rtol 1e-4, AdamW and SGD, clipping, micro-batches, activation checkpointing,
  compiled blocks, a user ``loss_fn``;
* the ring's fused-kernel seam (``ring.BLOCK_KERNEL = "flash"``: on CPU the CPU flash op)
  against full attention and in a whole model, so the GPU path's bookkeeping is checked here;
* the ledger's ``cp`` bytes against ``behemoth.planner.context_traffic.cp_model_traffic`` (and the
  issue's forward formulas: Ulysses ``4 b s h / cp`` per layer, ring ``2 (cp-1) b (s/cp) h_kv``);
* per-rank saved activation bytes of one training step at sequence 1024 within 1.02x of the
  serial model's divided by cp, both modes (they are 1.00x);
* the style ``ContextParallelAttention`` alone (``apply_styles``) and
  ``parallelize_context`` given a pattern, against the serial model's logits and gradients;
* a checkpoint saved under cp=2 loads under dp=2 and keeps matching serial;
* clear errors, on every rank and before any collective hangs.

Two spawned worlds (2 and 4 ranks) run every scenario.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from common import (
    SEQ,
    VOCAB,
    assert_grad_norms_close,
    assert_losses_close,
    assert_state_close,
    build,
    global_batches,
    make_optimizer,
    serial_run,
    serial_train,
    shard,
    train_steps,
)

import behemoth as bh
from behemoth.mesh import ParallelMesh
from behemoth.parallel.context import ring
from behemoth.planner.context_traffic import cp_model_traffic
from behemoth.specs import TransformerShape, shape_of, transformer_blocks

STEPS, BATCH = 3, 8
FAMILIES = ("gpt", "llama", "hf-gpt2", "hf-llama")
_SERIAL: dict = {}


def _serial(family, opt, clip, batches, key="parity"):
    k = (family, opt, clip, key)
    if k not in _SERIAL:
        _SERIAL[k] = serial_run(family, opt, batches, max_grad_norm=clip)
    return _SERIAL[k]


def _build_hf(family):
    model = build(family)
    if family == "hf-gpt2":  # transformers' GPT-2 default has attention dropout; build() sets 0
        assert model.config.attn_pdrop == 0.0
    return model


def _check_plan(family, plan, *, opt="adamw", clip=1.0, what=""):
    batches = global_batches(STEPS, BATCH)
    model = _build_hf(family)
    engine = bh.boost(model, make_optimizer(opt, model), plan, max_grad_norm=clip)
    losses, norms = train_steps(engine, batches)
    want = _serial(family, opt, clip, batches)
    what = f"{what or engine.plan.describe()} {family}/{opt}/clip={clip}"
    assert_losses_close(losses, want.losses, what=what)
    assert_state_close(engine.full_state_dict(), want.state, what=what)
    assert_grad_norms_close(norms, want.grad_norms, what=what)
    t = torch.tensor(losses, dtype=torch.float64)
    ref = t.clone()
    torch.distributed.broadcast(ref, 0)
    assert torch.equal(t, ref), f"{what}: ranks disagree on the loss"
    stats = engine.comm_stats()["cp"]
    assert stats["ops"] == {_cp_op(plan): STEPS * _cp_calls_per_step(plan, model)}, (what, stats)
    return engine


def _cp_op(plan):
    return "all_to_all" if plan.cp_mode == "ulysses" else "ring_shift"


def _cp_calls_per_step(plan, model):
    """Collectives on ``cp`` per step: per attention layer and micro-batch, Ulysses runs two
    all-to-alls forward and two backward; ring attention cp-1 K/V shifts forward, and backward
    cp-1 K/V shifts plus cp shifts of the dK/dV buffer. Activation checkpointing runs the
    forward's again in backward."""
    cp, recompute = plan.cp, int(plan.activation_checkpointing)
    fwd, bwd = (2, 2) if plan.cp_mode == "ulysses" else (cp - 1, 2 * cp - 1)
    layers = len(transformer_blocks(model))
    return plan.microbatches * layers * (fwd * (1 + recompute) + bwd)


# ----------------------------------------------------------------------------- traffic
def _check_traffic(family, plan):
    """Ledger bytes on ``cp`` for one forward, and for a forward + backward, against the formulas."""
    model = _build_hf(family)
    shape = shape_of(model.config)
    engine = bh.boost(model, make_optimizer("sgd", model), plan)
    batch = shard(global_batches(1, BATCH)[0], engine.dp_rank, engine.dp_size)
    b, s, cp, tp = batch["input_ids"].shape[0], SEQ, plan.cp, plan.tp
    kw = dict(batch=b, seq=s, cp=cp, mode=plan.cp_mode, tp=tp, dtype_bytes=4)
    what = f"{engine.plan.describe()} {family}"
    # forward only
    engine.reset_comm_stats()
    local, extra = engine.parallel.context.split(batch)
    with torch.no_grad():
        engine.model(local["input_ids"], **extra)
    fwd = engine.comm_stats()["cp"]
    want = cp_model_traffic(shape, wire=False, **kw).forward
    assert fwd["bytes"] == want, f"{what}: forward ledger {fwd['bytes']} B vs formula {want:.0f} B"
    # the per-layer forward formulas (fp32: 4 bytes), multi-head attention exactly
    n_loc = shape.num_heads // tp
    k_loc = shape.num_kv_heads // tp if shape.num_kv_heads >= tp else 1
    h_loc, hkv_loc = n_loc * shape.head_dim, k_loc * shape.head_dim
    if plan.cp_mode == "ulysses":
        issue = 4 * b * s * h_loc // cp * 4
        if k_loc == n_loc:
            assert fwd["bytes"] == shape.num_layers * issue, (what, fwd, issue)
    else:
        issue = 2 * (cp - 1) * b * (s // cp) * hkv_loc * 4
        assert fwd["bytes"] == shape.num_layers * issue, (what, fwd, issue)
    # forward + backward, payload and wire
    engine.reset_comm_stats()
    engine._forward_backward(batch)
    got = engine.comm_stats()["cp"]
    for key, wire in (("bytes", False), ("wire_bytes", True)):
        want = cp_model_traffic(shape, wire=wire, **kw).total
        assert got[key] == want, f"{what}: ledger {key} {got[key]} vs formula {want:.0f}"
    assert set(got["ops"]) == ({"all_to_all"} if plan.cp_mode == "ulysses" else {"ring_shift"}), (what, got)


# ----------------------------------------------------------------------------- memory
LONG = 1024


def _long_model(family):
    if family == "gpt":
        from behemoth.models import GPT, GPTConfig

        return GPT(GPTConfig(vocab_size=VOCAB, seq_len=LONG, num_layers=1, num_heads=4, hidden=32))
    from transformers import LlamaConfig as HFLlamaConfig
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(
        HFLlamaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=LONG,
        )
    )


class _SavedBytes:
    """Bytes autograd saves for backward (activations), parameters and buffers excluded."""

    def __init__(self, model):
        self.skip = {t.untyped_storage().data_ptr() for t in list(model.parameters()) + list(model.buffers())}
        self.total = 0

    def pack(self, t):
        if t.untyped_storage().data_ptr() not in self.skip:
            self.total += t.numel() * t.element_size()
        return t

    def __enter__(self):
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)


def _check_memory(family, mode, cp):
    g = torch.Generator().manual_seed(5)
    x = torch.randint(0, VOCAB, (1, LONG + 1), generator=g)
    batch = {"input_ids": x[:, :-1].contiguous(), "labels": x[:, 1:].contiguous()}
    serial = _long_model(family)
    with _SavedBytes(serial) as serial_saved:
        out = serial(batch["input_ids"])
        logits = out if isinstance(out, torch.Tensor) else out.logits
        F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="sum").backward()
    model = _long_model(family)
    engine = bh.boost(model, make_optimizer("sgd", model), bh.Plan(cp=cp, cp_mode=mode))
    with _SavedBytes(engine.model) as saved:
        engine.step(batch)
    ratio = saved.total / (serial_saved.total / cp)
    assert ratio <= 1.02, (
        f"cp={cp} {mode} {family}: {saved.total} B saved per rank vs serial "
        f"{serial_saved.total} B / cp = {serial_saved.total / cp:.0f} B (ratio {ratio:.3f})"
    )
    return ratio


# ----------------------------------------------------------------------------- the fused-kernel seam
def _fused_seam(axis):
    """Ring attention with ``BLOCK_KERNEL = "flash"`` (on CPU: aten's CPU flash op and its
    backward, fed the merged out/lse) equals full attention in float64 and bf16: the GPU
    path's bookkeeping (lse merge, global out/lse in the backward, row/column slices)."""
    import test_context_attention as core

    old = ring.BLOCK_KERNEL
    ring.BLOCK_KERNEL = "flash"
    try:
        for i, (n, k_heads, scale) in enumerate(core.CASES):
            core._parity(axis, "ring", n, k_heads, scale, seed=500 + i)
        core._low_precision_ring(axis)
        _check_plan("gpt", bh.Plan(cp=axis.size, cp_mode="ring"), what="ring, fused-kernel seam")
    finally:
        ring.BLOCK_KERNEL = old


# ----------------------------------------------------------------------------- a user loss_fn
def _check_loss_fn():
    """A user loss_fn (a mean over its micro-batch) gets this rank's share of the sequence; with
    every label counted the mean over the shares is the serial mean."""
    g = torch.Generator().manual_seed(3)
    batches = []
    for _ in range(STEPS):
        x = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
        batches.append({"input_ids": x[:, :-1].contiguous(), "labels": x[:, 1:].contiguous()})
    want_losses, want_state = serial_train("hf-gpt2", "adamw", batches, max_grad_norm=1.0)
    loss_fn = lambda out, b: F.cross_entropy(out.logits.flatten(0, 1), b["labels"].flatten())  # noqa: E731
    for plan in (bh.Plan(cp=2, cp_mode="ring"), bh.Plan(cp=2, microbatches=2)):
        model = _build_hf("hf-gpt2")
        engine = bh.boost(model, make_optimizer("adamw", model), plan, max_grad_norm=1.0, loss_fn=loss_fn)
        losses = [engine.step(b) for b in batches]
        assert_losses_close(losses, want_losses, what=f"loss_fn {plan.describe()}")
        assert_state_close(engine.full_state_dict(), want_state, what=f"loss_fn {plan.describe()}")


# ----------------------------------------------------------------------------- the style alone
def _check_style(rank, world):
    """ContextParallelAttention on its own (no engine): applied through apply_styles to the
    attention modules of GPT and transformers' GPT-2, the model run on this rank's share of
    the sequence with its global position ids gives the serial logits' share, and the
    parameter gradients summed over cp are the serial ones. Bad modes and modules are refused
    before anything changes."""
    from behemoth.parallel.context import (
        ContextParallelAttention,
        ContextSDPA,
        parallelize_context,
        position_ids_for,
        split_sequence,
    )
    from behemoth.parallel.style import apply_styles

    batch = global_batches(1, 4)[0]
    ids, labels = batch["input_ids"], batch["labels"]
    for family, pattern, kwarg in (
        ("gpt", "blocks.*.attn", "position_ids_BS"),
        ("hf-gpt2", "transformer.h.*.attn", "position_ids"),
    ):
        for mode in ("ulysses", "ring"):
            what = f"style {family}/{mode}"
            serial, model = build(family), build(family)
            out = serial(ids)
            logits = out if isinstance(out, torch.Tensor) else out.logits
            F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum").backward()
            mesh = ParallelMesh(bh.Plan(cp=world, cp_mode=mode, dp=1), rank, world)
            if family == "gpt":  # the style through the generic plan mechanism
                apply_styles(model, {pattern: ContextParallelAttention(mode)}, mesh)
                assert all(isinstance(m.attention_fn, ContextSDPA) for m in (b.attn for b in model.blocks)), what
            else:  # the function the engine calls, given the pattern
                record = parallelize_context(model, mesh, mesh.plan, attention=pattern)
                assert record.attention == ("transformer.h.0.attn", "transformer.h.1.attn"), record.attention
            positions = position_ids_for(SEQ, world, rank, mode).unsqueeze(0)
            out = model(split_sequence(ids, 1, world, rank, mode), **{kwarg: positions})
            got = out if isinstance(out, torch.Tensor) else out.logits
            torch.testing.assert_close(
                got,
                split_sequence(logits, 1, world, rank, mode),
                rtol=1e-5,
                atol=1e-5,
                msg=lambda m: f"{what} logits: {m}",
            )
            loss = F.cross_entropy(
                got.flatten(0, 1), split_sequence(labels, 1, world, rank, mode).flatten(), reduction="sum"
            )
            loss.backward()
            for (n, p), (_, q) in zip(model.named_parameters(), serial.named_parameters()):
                g = p.grad.clone()
                torch.distributed.all_reduce(g)
                torch.testing.assert_close(g, q.grad, rtol=1e-4, atol=1e-5, msg=lambda m: f"{what} grad {n}: {m}")
    _expect(ValueError, lambda: ContextParallelAttention("rings"), "mode='rings'", "ulysses")
    model = build("gpt")
    mesh = ParallelMesh(bh.Plan(cp=world, dp=1), rank, world)
    _expect(
        ValueError,
        lambda: apply_styles(model, {"blocks.*.mlp.fc": ContextParallelAttention()}, mesh),
        "Linear",
        "attention_fn",
    )
    _expect(
        ValueError,
        lambda: parallelize_context(model, mesh, mesh.plan, attention="blocks.*.atn"),
        "'blocks.*.atn'",
        "matches no module",
    )
    hf = build("hf-gpt2")
    hf.transformer.h[1].attn.is_causal = False
    _expect(
        ValueError,
        lambda: parallelize_context(hf, mesh, mesh.plan),
        "transformer.h.1.attn",
        "not causal self-attention",
    )
    assert hf.config._attn_implementation != "behemoth_context_parallel", "a refused plan changed the model"


# ----------------------------------------------------------------------------- checkpoints
def _checkpoint(root):
    batches = global_batches(4, BATCH)
    path = os.path.join(root, "cp2", "step-2")
    model = _build_hf("hf-gpt2")
    engine = bh.boost(model, make_optimizer("adamw", model), bh.Plan(cp=2, cp_mode="ring"), max_grad_norm=1.0)
    for b in batches[:2]:
        engine.step(b)
    engine.save(path)
    model = _build_hf("hf-gpt2")
    engine = bh.boost(model, make_optimizer("adamw", model), bh.Plan(dp=2), max_grad_norm=1.0)
    engine.load(path)
    losses = [engine.step(shard(b, engine.dp_rank, engine.dp_size)) for b in batches[2:]]
    want = _serial("hf-gpt2", "adamw", 1.0, batches, key="ckpt")
    want_losses, want_state = want.losses, want.state
    assert_losses_close(losses, want_losses[2:], what="cp=2 checkpoint -> dp=2")
    assert_state_close(engine.full_state_dict(), want_state, what="cp=2 checkpoint -> dp=2")


# ----------------------------------------------------------------------------- errors
def _expect(exc, fn, *needles):
    try:
        fn()
    except exc as e:
        for n in needles:
            assert n in str(e), f"{n!r} not in {e}"
        return
    raise AssertionError(f"no {exc.__name__} mentioning {needles}")


def _gpt(plan, **cfg):
    from behemoth.models import GPT, GPTConfig

    model = GPT(GPTConfig(**{**dict(vocab_size=VOCAB, seq_len=SEQ, num_layers=1, num_heads=4, hidden=32), **cfg}))
    return bh.boost(model, make_optimizer("sgd", model), plan)


def _errors(world):
    cp = world
    _expect(
        ValueError,
        lambda: _gpt(bh.Plan(cp=cp), num_heads=3, hidden=24),
        "cp_mode='ulysses'",
        "num_heads=3",
        f"cp={cp}",
        "cp_mode='ring'",
    )
    _expect(ValueError, lambda: _gpt(bh.Plan(cp=cp, cp_mode="ring"), dropout=0.1), "dropout=0.1")
    batch = global_batches(1, 2)[0]
    ring_engine = _gpt(bh.Plan(cp=cp, cp_mode="ring"))
    crop = SEQ - 2  # 14: not a multiple of 2*cp
    _expect(
        ValueError,
        lambda: ring_engine.step({k: v[:, :crop] for k, v in batch.items()}),
        f"seq_len={crop}",
        f"2*cp={2 * cp}",
    )
    uly_engine = _gpt(bh.Plan(cp=cp))
    _expect(
        ValueError,
        lambda: uly_engine.step({k: v[:, : SEQ - 1] for k, v in batch.items()}),
        f"seq_len={SEQ - 1}",
        f"cp={cp}",
    )
    long = {k: torch.cat([v, v], 1) for k, v in batch.items()}
    _expect(ValueError, lambda: uly_engine.step(long), f"sequence length {2 * SEQ}", f"{SEQ} positions")
    from transformers import GPT2Config, GPT2LMHeadModel

    hf = GPT2LMHeadModel(
        GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=1, n_head=4, bos_token_id=0, eos_token_id=0)
    )  # stock attn_pdrop=0.1
    _expect(ValueError, lambda: bh.boost(hf, make_optimizer("sgd", hf), bh.Plan(cp=cp)), "attn_pdrop=0.1")
    # the engines still train after the refused batches, and every rank is alive
    ring_engine.step(batch)
    t = torch.ones(1)
    torch.distributed.all_reduce(t)
    assert t.item() == world


def test_context_parallelism_composes_with_every_plan():
    """Pure: what bh.boost calls (Plan.check_supported) accepts cp with every tp mode and with
    pipelines (tests/dist/test_compositions.py trains them against serial training)."""
    for plan in (
        bh.Plan(cp=2, pp=2, dp=1),
        bh.Plan(cp=2, pp=2, tp=8, tp_mode="3d", schedule="interleaved", virtual_stages=2),
        bh.Plan(cp=4),
        bh.Plan(cp=2, tp=2, dp=2, cp_mode="ring"),
        bh.Plan(cp=2, tp=2, sequence_parallel=True),
        bh.Plan(cp=2, tp=4, tp_mode="2d", dp=1),
        bh.Plan(cp=2, tp=8, tp_mode="2.5d", tp_depth=2, dp=1),
        bh.Plan(cp=2, tp=8, tp_mode="3d", dp=1),
    ):
        plan.check_supported()


def test_traffic_formulas_are_the_issues():
    """Pure: per-layer forward payloads equal the published formulas (Ulysses 4bsh/cp for
    multi-head attention, ring 2(cp-1) b (s/cp) h_kv), Ulysses moves the same backward, the
    ring's backward adds the dK/dV buffer's cp shifts, and cp=1 moves nothing."""
    shape = TransformerShape(
        hidden=64,
        ffn_hidden=256,
        num_layers=3,
        num_heads=8,
        num_kv_heads=2,
        vocab_size=100,
        norm_params=64,
        linear_bias=False,
    )
    mha = TransformerShape(
        hidden=64,
        ffn_hidden=256,
        num_layers=3,
        num_heads=8,
        num_kv_heads=8,
        vocab_size=100,
        norm_params=64,
        linear_bias=False,
    )
    b, s, e = 2, 64, 2
    for cp in (2, 4):
        u = cp_model_traffic(mha, batch=b, seq=s, cp=cp, mode="ulysses", dtype_bytes=e, wire=False)
        assert u.forward == u.backward == 3 * 4 * b * s * 64 // cp * e
        assert (
            cp_model_traffic(mha, batch=b, seq=s, cp=cp, mode="ulysses", dtype_bytes=e).forward
            == u.forward * (cp - 1) / cp
        )
        r = cp_model_traffic(shape, batch=b, seq=s, cp=cp, mode="ring", dtype_bytes=e)
        kv = b * (s // cp) * 2 * 8  # h_kv = 2 kv heads x head dim 8
        assert r.forward == 3 * 2 * (cp - 1) * kv * e
        assert r.backward == 3 * (2 * (cp - 1) * kv * e + 2 * cp * kv * 4)
        # with tp=2: 4 query heads and 1 kv head per rank
        assert cp_model_traffic(shape, batch=b, seq=s, cp=cp, mode="ring", tp=2, dtype_bytes=e).forward == r.forward / 2
        # 2D tp=4 (q=2): heads split 2 ways (1 kv head per rank), the rows 2 ways; 3D tp=8: heads 2
        # ways, rows 4 ways; 2.5D tp=8 with depth 2: heads 2 ways, rows 4 ways
        assert (
            cp_model_traffic(shape, batch=b, seq=s, cp=cp, mode="ring", tp=4, tp_mode="2d", dtype_bytes=e).forward
            == r.forward / 4
        )
        b4 = 4 * b
        for grid in (dict(tp=8, tp_mode="3d"), dict(tp=8, tp_mode="2.5d", tp_depth=2)):
            assert (
                cp_model_traffic(mha, batch=b4, seq=s, cp=cp, mode="ulysses", dtype_bytes=e, **grid).forward
                == cp_model_traffic(mha, batch=b, seq=s, cp=cp, mode="ulysses", tp=2, dtype_bytes=e).forward
            )
    assert cp_model_traffic(shape, batch=b, seq=s, cp=1, mode="ring").total == 0


# ----------------------------------------------------------------------------- worlds
def _world2(rank, world, root):
    torch.manual_seed(rank)  # per-rank global RNG differs: the engine must not depend on it
    for i, family in enumerate(FAMILIES):
        for j, mode in enumerate(("ulysses", "ring")):
            opt, clip = ("adamw", 1.0) if (i + j) % 2 == 0 else ("sgd", None)
            _check_plan(family, bh.Plan(cp=2, cp_mode=mode), opt=opt, clip=clip)
    _check_plan(
        "llama",
        bh.Plan(cp=2, cp_mode="ring", microbatches=2, activation_checkpointing=True),
        what="cp=2 ring, microbatches=2, activation checkpointing",
    )
    _check_plan("hf-gpt2", bh.Plan(cp=2, microbatches=2), opt="sgd", clip=0.5, what="cp=2 ulysses, microbatches=2")
    _check_plan("gpt", bh.Plan(cp=2, cp_mode="ring", compile=True), what="cp=2 ring, compiled blocks")
    _check_loss_fn()
    for family in ("gpt", "llama", "hf-llama"):
        for mode in ("ulysses", "ring"):
            _check_traffic(family, bh.Plan(cp=2, cp_mode=mode))
    ratios = {(f, m): _check_memory(f, m, 2) for f in ("gpt", "hf-llama") for m in ("ulysses", "ring")}
    if rank == 0:
        print("saved activations per rank / (serial / cp):", {f"{f}/{m}": round(r, 3) for (f, m), r in ratios.items()})
    mesh_axis = ParallelMesh(bh.Plan(cp=2, dp=1), rank, world).axis("cp")
    _fused_seam(mesh_axis)
    _check_style(rank, world)
    _checkpoint(root)
    _errors(world)


def _world4(rank, world):
    torch.manual_seed(rank)
    for i, family in enumerate(FAMILIES):  # Llama's 2 kv heads < cp=4: Ulysses replicates them
        for j, mode in enumerate(("ulysses", "ring")):
            _check_plan(family, bh.Plan(cp=4, cp_mode=mode), opt="adamw" if (i + j) % 2 else "sgd")
    for i, family in enumerate(FAMILIES):
        mode = ("ring", "ulysses")[i % 2]
        _check_plan(family, bh.Plan(dp=2, cp=2, cp_mode=mode), opt="adamw" if i % 2 else "sgd", clip=1.0)
        _check_plan(
            family,
            bh.Plan(cp=2, tp=2, cp_mode=("ulysses", "ring")[i % 2], sequence_parallel=family.startswith("hf")),
            opt="adamw",
        )
    _check_plan(
        "gpt",
        bh.Plan(dp=2, cp=2, cp_mode="ring", microbatches=2),
        opt="adamw",
        clip=0.5,
        what="dp=2 x cp=2 ring, microbatches=2",
    )
    for family, plan in (
        ("llama", bh.Plan(cp=4, cp_mode="ulysses")),
        ("hf-gpt2", bh.Plan(cp=4, cp_mode="ring")),
        ("llama", bh.Plan(cp=2, tp=2, cp_mode="ulysses")),
        ("hf-llama", bh.Plan(cp=2, tp=2, cp_mode="ring", sequence_parallel=True)),
        ("gpt", bh.Plan(dp=2, cp=2, cp_mode="ulysses")),
    ):
        _check_traffic(family, plan)
    ratios = {m: _check_memory("gpt", m, 4) for m in ("ulysses", "ring")}
    if rank == 0:
        print("cp=4 saved activations per rank / (serial / cp):", {m: round(r, 3) for m, r in ratios.items()})
    _errors(world)


def test_cp2_models_traffic_memory_checkpoint_errors(tmp_path):
    bh.spawn(_world2, 2, str(tmp_path), timeout=240)


def test_cp4_dp2_cp2_cp2_tp2():
    bh.spawn(_world4, 4, timeout=300)

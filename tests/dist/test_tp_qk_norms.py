"""Norms of the q / k projections under tensor parallelism, which splits those projections by
heads: OLMoE's ``q_norm`` / ``k_norm`` normalise the whole projection (role ``colwise_norm``: the
weight split with the projection's features, the mean square of the whole width summed over tp
in float32), Qwen3-MoE's act per head (role ``head_norm``: the whole weight on every rank, its
gradient summed over tp).

The layer (float64, 2 ranks): :class:`~behemoth.parallel.tensor.projection_norm.ProjectionNorm` of an RMS
norm and of a LayerNorm equal to the serial norm on this rank's features -- output, input gradient,
weight and bias gradients -- and the all-reduced sum of squares in float32 for a bfloat16 input,
as the serial norm computes its variance.

Whole models against serial training (losses, every step's gradient norm, ``full_state_dict()``,
rtol 1e-4, fp32): tiny random transformers ``OlmoeForCausalLM`` at tp=2, with sequence
parallelism, under bf16 autocast (SGD, rtol 2e-2), with one kv head (replicated over tp, its k norm too), and at dp=2 x tp=2 x ep=2
under ZeRO-3 and with sequence parallelism, and at cp=2 x tp=2 (Ulysses; ring with sequence
parallelism); ``Qwen3MoeForCausalLM`` at tp=2 (its per-head norms'
gradients were one rank's heads' before the role), with sequence parallelism (refused before: its
norms and its dense first layer's MLP had no role; that MLP now split as Llama's), with every
layer an MoE one, and at dp=2 x tp=2 x ep=2 (also under ZeRO-3 with sequence parallelism); OLMoE in a pipeline of two tp=2 stages. Greedy generation of both under tp=2 (and sequence parallelism) gives serial's tokens.
A checkpoint written at tp=2 loads at tp=1 (dp=2), and one written at dp=2 loads at tp=2: the
next step matches serial.

Every tensor mode, on dense transformers models given a tp_policy: ``Olmo2ForCausalLM`` (norms over
the whole projection) at dp=2 x 1D tp=2, 2D tp=4 (also with one kv head, fewer than q: each grid
column normalises the kv head it holds), 3D tp=8 and 2.5D tp=8 (one kv head); ``Qwen3ForCausalLM``
(norms per head) at 2D, 3D and 2.5D."""

from __future__ import annotations

import torch
from common import (
    assert_grad_norms_close,
    assert_losses_close,
    assert_state_close,
    global_batches,
    train_serially,
    train_steps,
)
from common import build_hf_moe as build_hf_moe_common
from test_expert_pipeline import serial_hf_micro_run

import behemoth as bh
from behemoth.parallel.tensor import get_spec

STEPS, BATCH = 3, 8


def build(family: str, **config):
    """A tiny transformers MoE with its router loss on and weights far from zero (as
    tests/dist/test_expert_families.py builds them); ``config`` overrides its fields."""
    fields = dict(output_router_logits=True, router_aux_loss_coef=0.05, initializer_range=0.2)
    return build_hf_moe_common(family, **{**fields, **config})


def adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, eps=1e-5)


def sgd(model):  # linear in the gradient: bf16 rounding stays rounding (as tests/dist/test_expert_parallel.py)
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def serial_run(family: str, batches, dtype=None, opt=adamw, **config):
    """Serial transformers: cross-entropy over the (already shifted) labels plus
    ``router_aux_loss_coef * outputs.aux_loss``, gradients clipped at 1.0, ``opt``; the forward
    under CPU autocast to ``dtype`` if given."""
    model = build(family, **config)
    return train_serially(model, opt(model), batches, dtype=dtype, router_loss=True)


def check_parity(family: str, plan: bh.Plan, batches, want, what: str, rtol=1e-4, atol=1e-5, opt=adamw, **config):
    model = build(family, **config)
    engine = bh.boost(model, opt(model), plan, max_grad_norm=1.0)
    losses, norms = train_steps(engine, batches)
    assert_losses_close(losses, want[0], rtol=rtol, what=what)
    assert_grad_norms_close(norms, want[2], rtol=rtol, what=what)
    assert_state_close(engine.full_state_dict(), want[1], rtol=rtol, atol=atol, what=what)
    return engine


# --------------------------------------------------------------------------- the layer
def _layer_world(rank: int, world: int) -> None:
    from behemoth.mesh import ParallelMesh
    from behemoth.parallel.tensor.projection_norm import ProjectionNorm

    mesh = ParallelMesh(bh.Plan(tp=world), rank=rank, world_size=world)
    axis = mesh.axis("tp")
    width = 12
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 5, width, generator=g, dtype=torch.float64) * 3 + 1
    dy = torch.randn(2, 5, width, generator=g, dtype=torch.float64)
    blk = slice(rank * width // world, (rank + 1) * width // world)
    for serial in (torch.nn.RMSNorm(width, eps=1e-5), torch.nn.LayerNorm(width, eps=1e-5)):
        serial = serial.double()
        with torch.no_grad():
            for p in serial.parameters():
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64))
        xs = x.clone().requires_grad_(True)
        serial(xs).backward(dy)
        params = {n: torch.nn.Parameter(p.detach()[blk].clone()) for n, p in serial.named_parameters()}
        layer = ProjectionNorm(
            params["weight"],
            params.get("bias"),
            axis=axis,
            eps=1e-5,
            rms=isinstance(serial, torch.nn.RMSNorm),
        )
        xp = x[..., blk].clone().requires_grad_(True)
        y = layer(xp)
        y.backward(dy[..., blk])
        what = type(serial).__name__
        torch.testing.assert_close(y, serial(x)[..., blk], rtol=1e-12, atol=1e-12, msg=lambda m: f"{what}: {m}")
        torch.testing.assert_close(xp.grad, xs.grad[..., blk], rtol=1e-10, atol=1e-12, msg=lambda m: f"{what}: {m}")
        for n, p in serial.named_parameters():
            torch.testing.assert_close(params[n].grad, p.grad[blk], rtol=1e-10, atol=1e-12, msg=lambda m: f"{n}: {m}")

    # bfloat16 input: the sum of squares is taken in float32 and summed over tp in float32, as the
    # serial norm computes its variance (transformers' RMSNorm: x.to(float32).pow(2).mean(-1)); the
    # output is the serial one but where the order of the sum flips a bfloat16 rounding
    serial = build("olmoe").model.layers[0].self_attn.q_norm
    with torch.no_grad():
        serial.weight.copy_(torch.rand(32, generator=g) + 0.5)
    xb = torch.randn(4, 16, 32, generator=g).mul(5).to(torch.bfloat16)  # the q projection's width, 32
    want = serial(xb)[..., rank * 16 : (rank + 1) * 16]
    w = torch.nn.Parameter(serial.weight.detach()[rank * 16 : (rank + 1) * 16].clone())
    layer = ProjectionNorm(w, None, axis=axis, eps=serial.variance_epsilon, rms=True)
    got = layer(xb[..., rank * 16 : (rank + 1) * 16])
    assert got.dtype == want.dtype == torch.float32, (got.dtype, want.dtype)
    torch.testing.assert_close(got, want, rtol=2**-7, atol=0)
    same = (got == want).float().mean().item()
    assert same > 0.95, f"{same:.3f} of the bfloat16 outputs equal serial's"


def test_column_parallel_norm_matches_the_serial_norm():
    bh.spawn(_layer_world, 2, timeout=300)


# --------------------------------------------------------------------------- whole models
def _two_rank_world(rank: int, world: int, path: str) -> None:
    batches = global_batches(STEPS, BATCH)
    want = serial_run("olmoe", batches)
    engine = check_parity("olmoe", bh.Plan(tp=2), batches, want, "OLMoE tp=2")
    attn = engine.model.model.layers[0].self_attn
    assert attn.q_proj.weight.shape[0] == 32 // 2 and attn.q_norm.weight.shape == (16,), attn  # split with q
    assert get_spec(attn.q_norm.weight).dims[0].index == rank
    check_parity("olmoe", bh.Plan(tp=2, sequence_parallel=True), batches, want, "OLMoE tp=2 sequence_parallel")

    # bf16 autocast: the norms' statistics in float32 as serially (the tolerance of test_expert_parallel's bf16)
    want_bf16 = serial_run("olmoe", batches, dtype=torch.bfloat16, opt=sgd)
    plan = bh.Plan(tp=2, precision="bf16")
    check_parity("olmoe", plan, batches, want_bf16, "OLMoE tp=2 bf16 sgd", rtol=2e-2, atol=2e-3, opt=sgd)

    # one kv head, replicated over tp: every rank keeps the whole k projection and its whole k norm
    gqa = dict(num_key_value_heads=1)
    want_gqa = serial_run("olmoe", batches, **gqa)
    engine = check_parity("olmoe", bh.Plan(tp=2), batches, want_gqa, "OLMoE one kv head tp=2", **gqa)
    assert engine.model.model.layers[0].self_attn.k_norm.weight.shape == (8,)

    want_qwen = serial_run("qwen3-moe", batches)
    check_parity("qwen3-moe", bh.Plan(tp=2), batches, want_qwen, "Qwen3-MoE tp=2")
    # its dense first layer's MLP split as Llama's (refused under sequence parallelism before: no role)
    engine = check_parity("qwen3-moe", bh.Plan(tp=2, sequence_parallel=True), batches, want_qwen, "Qwen3 tp=2 SP")
    assert engine.model.model.layers[0].mlp.gate_proj.weight.shape[0] == 48 // 2
    moe_only = dict(mlp_only_layers=[])  # no dense MLP: the plan's MLP entries are dropped
    want_qwen = serial_run("qwen3-moe", batches, **moe_only)
    plan = bh.Plan(tp=2, sequence_parallel=True)
    check_parity("qwen3-moe", plan, batches, want_qwen, "Qwen3-MoE no dense layer tp=2 SP", **moe_only)

    # greedy generation (sequence parallelism paused: one token a step) gives serial's tokens
    rows = [[3, 5, 7], [11, 2], [9, 9, 4, 1], [14]]
    for family in ("olmoe", "qwen3-moe"):
        want_tokens = bh.generate(build(family, output_router_logits=False).eval(), rows, max_new_tokens=6)
        for plan in (bh.Plan(tp=2), bh.Plan(tp=2, sequence_parallel=True)):
            model = bh.parallelize(build(family, output_router_logits=False).eval(), plan)
            assert bh.generate(model, rows, max_new_tokens=6) == want_tokens, (family, plan.describe())

    # written at tp=2, read at tp=1 (dp=2) into a differently initialised model, and the other way
    # round: the third step is serial's
    for i, (saved, loaded) in enumerate(((bh.Plan(tp=2), bh.Plan(dp=2)), (bh.Plan(dp=2), bh.Plan(tp=2)))):
        where = f"{path}-{i}"
        model = build("olmoe")
        engine = bh.boost(model, adamw(model), saved, max_grad_norm=1.0)
        train_steps(engine, batches[:2])
        engine.save(where)
        fresh = build("olmoe", initializer_range=0.05)
        engine = bh.boost(fresh, adamw(fresh), loaded, max_grad_norm=1.0)
        engine.load(where)
        what = f"OLMoE saved at {saved.describe()}, loaded at {loaded.describe()}"
        losses, norms = train_steps(engine, batches[2:])
        assert_losses_close(losses, want[0][2:], what=what)
        assert_grad_norms_close(norms, want[2][2:], what=what)
        assert_state_close(engine.full_state_dict(), want[1], what=what)


def test_qk_norms_under_tp_match_serial(tmp_path):
    bh.spawn(_two_rank_world, 2, str(tmp_path / "ckpt"), timeout=900)


def _four_rank_world(rank: int, world: int) -> None:
    batches = global_batches(STEPS, BATCH)
    want = serial_run("olmoe", batches)
    check_parity("olmoe", bh.Plan(dp=2, tp=2, ep=2, zero=3), batches, want, "OLMoE dp=2 tp=2 ep=2 zero=3")
    plan = bh.Plan(dp=2, tp=2, ep=2, sequence_parallel=True)
    check_parity("olmoe", plan, batches, want, "OLMoE dp=2 tp=2 ep=2 sequence_parallel")
    check_parity("olmoe", bh.Plan(cp=2, tp=2), batches, want, "OLMoE cp=2 (ulysses) tp=2")
    plan = bh.Plan(cp=2, tp=2, cp_mode="ring", sequence_parallel=True)
    check_parity("olmoe", plan, batches, want, "OLMoE cp=2 (ring) tp=2 sequence_parallel")
    want = serial_run("qwen3-moe", batches)
    check_parity("qwen3-moe", bh.Plan(dp=2, tp=2, ep=2), batches, want, "Qwen3-MoE dp=2 tp=2 ep=2")
    plan = bh.Plan(dp=2, tp=2, ep=2, zero=3, sequence_parallel=True)
    check_parity("qwen3-moe", plan, batches, want, "Qwen3-MoE dp=2 tp=2 ep=2 zero=3 sequence_parallel")
    # a pipeline of tp=2 stages, micro-batches (transformers' balancing loss is per forward)
    want = serial_hf_micro_run("olmoe", batches, 1, 2)
    check_parity("olmoe", bh.Plan(pp=2, tp=2, microbatches=2), batches, want, "OLMoE pp=2 tp=2 micro=2")


def test_qk_norms_under_tp_and_ep_match_serial():
    bh.spawn(_four_rank_world, 4, timeout=1200)


# --------------------------------------------------------------------------- every tensor mode
def build_dense(family: str, **config):
    """A tiny dense transformers model with q / k norms: ``olmo2`` (``Olmo2ForCausalLM``, norms over
    the whole projection) or ``qwen3`` (``Qwen3ForCausalLM``, norms per head); 4 heads over 2 kv
    heads unless ``config`` says otherwise."""
    from transformers import Olmo2Config, Olmo2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    shape = dict(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=16,
        initializer_range=0.2,
        pad_token_id=0,
        bos_token_id=0,
        eos_token_id=0,
    )
    if family == "olmo2":
        return Olmo2ForCausalLM(Olmo2Config(**{**shape, **config}))
    return Qwen3ForCausalLM(Qwen3Config(**{**shape, "head_dim": 8, **config}))


def dense_policy(family: str) -> dict[str, str]:
    """Every module of :func:`build_dense`'s models with its role (the grid modes place every
    parameter): OLMo2's q / k norms ``colwise_norm``, Qwen3's ``head_norm``."""
    layer = "model.layers.*."
    norms = (
        ("post_attention_layernorm", "post_feedforward_layernorm")
        if family == "olmo2"
        else ("input_layernorm", "post_attention_layernorm")
    )
    policy = {
        "model.embed_tokens": "embedding",
        "model.norm": "norm",
        "lm_head": "head",
        layer + "self_attn": "attention",
    }
    policy.update({layer + f"self_attn.{n}_proj": "colwise" for n in "qkv"})
    policy.update({layer + "self_attn.o_proj": "rowwise", layer + "mlp.down_proj": "rowwise"})
    policy.update({layer + f"mlp.{n}_proj": "colwise" for n in ("gate", "up")})
    policy.update({layer + n: "norm" for n in norms})
    role = "colwise_norm" if family == "olmo2" else "head_norm"
    policy.update({layer + f"self_attn.{n}_norm": role for n in "qk"})
    return policy


def serial_dense_run(family: str, batches, **config):
    model = build_dense(family, **config)
    return train_serially(model, adamw(model), batches)


def check_dense(family: str, plan: bh.Plan, batches, what: str, **config):
    want = serial_dense_run(family, batches, **config)
    model = build_dense(family, **config)
    engine = bh.boost(model, adamw(model), plan, tp_policy=dense_policy(family), max_grad_norm=1.0)
    losses, norms = train_steps(engine, batches)
    assert_losses_close(losses, want[0], what=what)
    assert_grad_norms_close(norms, want[2], what=what)
    assert_state_close(engine.full_state_dict(), want[1], what=what)
    return engine


def _grid_world_4(rank: int, world: int) -> None:
    batches = global_batches(STEPS, BATCH)
    check_dense("olmo2", bh.Plan(tp=2, dp=2), batches, "OLMo2 dp=2 1D tp=2")  # post-norm: no sequence parallelism
    plan = bh.Plan(tp=4, tp_mode="2d")
    engine = check_dense("olmo2", plan, batches, "OLMo2 2D tp=4")
    q_norm = engine.model.model.layers[0].self_attn.q_norm
    assert q_norm.weight.shape == (16,), q_norm  # the grid column's feature block of the q projection
    # one kv head, fewer than q: each grid column normalises the kv head it holds, with the whole k norm
    engine = check_dense("olmo2", plan, batches, "OLMo2 one kv head 2D tp=4", num_key_value_heads=1)
    assert engine.model.model.layers[0].self_attn.k_norm.weight.shape == (8,)
    check_dense("qwen3", plan, batches, "Qwen3 2D tp=4")


def test_qk_norms_under_1d_and_2d_match_serial():
    bh.spawn(_grid_world_4, 4, timeout=900)


def _grid_world_8(rank: int, world: int) -> None:
    batches = global_batches(STEPS, BATCH)
    plan = bh.Plan(tp=8, tp_mode="3d")
    check_dense("olmo2", plan, batches, "OLMo2 3D tp=8")
    check_dense("qwen3", plan, batches, "Qwen3 3D tp=8")
    plan = bh.Plan(tp=8, tp_mode="2.5d", tp_depth=2)
    check_dense("olmo2", plan, batches, "OLMo2 one kv head 2.5D tp=8", num_key_value_heads=1)
    check_dense("qwen3", plan, batches, "Qwen3 2.5D tp=8")


def test_qk_norms_under_3d_and_25d_match_serial():
    bh.spawn(_grid_world_8, 8, timeout=1200)

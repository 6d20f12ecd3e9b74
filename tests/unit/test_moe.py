"""The serial mixture-of-experts layer (models/moe.py) and the MoE Llama: the layer against a
per-token loop over experts in float64, the balancing loss against transformers'
``load_balancing_loss_func``, the z-loss against its formula, and the MoE Llama's spec.

Shape legend: T tokens, H hidden, I expert inner width, E experts, K top-k.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from behemoth.models import Llama, LlamaConfig, MoEFeedForward, build_config, build_model
from behemoth.models.moe import route
from behemoth.specs import shape_of, spec_for, transformer_blocks

H, I, E, K = 16, 24, 6, 2


def random_moe(dtype=torch.float64, **kw) -> MoEFeedForward:
    torch.manual_seed(0)
    layer = MoEFeedForward(H, I, E, K, **kw).to(dtype)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.5)
    return layer


def per_token_reference(layer: MoEFeedForward, x_TH: torch.Tensor) -> torch.Tensor:
    """Each token alone: softmax over the router logits, its top-k, renormalised, then the
    weighted sum of those experts' SwiGLU outputs."""
    out = []
    for x_H in x_TH:
        probs_E = torch.softmax(layer.router.weight @ x_H, dim=-1)
        top, idx = torch.topk(probs_E, K)
        top = top / top.sum()
        y_H = torch.zeros_like(x_H)
        for w, e in zip(top, idx.tolist()):
            gate_up = layer.gate_up_proj[e] @ x_H
            gate, up = gate_up[:I], gate_up[I:]
            y_H = y_H + w * (layer.down_proj[e] @ (F.silu(gate) * up))
        out.append(y_H)
    return torch.stack(out)


def test_moe_layer_equals_per_token_loop_float64():
    layer = random_moe(aux_loss_coef=0.5, z_loss_coef=0.25)
    x_BSH = torch.randn(3, 5, H, dtype=torch.float64)
    y_BSH = layer(x_BSH)
    assert y_BSH.shape == x_BSH.shape and y_BSH.dtype == torch.float64
    ref_TH = per_token_reference(layer, x_BSH.reshape(-1, H))
    torch.testing.assert_close(y_BSH.reshape(-1, H), ref_TH, rtol=1e-12, atol=1e-12)
    # gradients flow to the router (through the weights) and to every used expert
    (y_BSH.square().sum() + layer.aux_loss).backward()
    assert layer.router.weight.grad.abs().sum() > 0 and layer.gate_up_proj.grad.abs().sum() > 0


def test_balancing_loss_equals_transformers():
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    layer = random_moe(torch.float32, aux_loss_coef=1.0, z_loss_coef=0.0)
    x_TH = torch.randn(40, H)
    layer(x_TH)
    logits_TE = layer.router(x_TH)
    theirs = load_balancing_loss_func((logits_TE,), num_experts=E, top_k=K)
    torch.testing.assert_close(layer.aux_loss, theirs, rtol=1e-6, atol=0)
    # random logits, larger E and k
    g = torch.Generator().manual_seed(1)
    for num_experts, top_k in ((8, 2), (16, 4), (4, 1)):
        logits = torch.randn(64, num_experts, generator=g) * 3
        probs, _, experts = route(logits, top_k)
        counts = torch.bincount(experts.reshape(-1), minlength=num_experts).float()
        mine = num_experts * (counts * probs.sum(0)).sum() / 64**2
        torch.testing.assert_close(mine, load_balancing_loss_func((logits,), num_experts, top_k), rtol=1e-6, atol=0)


def test_z_loss_and_coefficients():
    layer = random_moe(torch.float32, aux_loss_coef=0.0, z_loss_coef=0.5)
    x_TH = torch.randn(10, H)
    layer(x_TH)
    logits = layer.router(x_TH)
    expected = 0.5 * torch.logsumexp(logits, -1).square().mean()
    torch.testing.assert_close(layer.aux_loss, expected, rtol=1e-6, atol=0)


def test_moe_llama_builds_routes_and_has_a_spec():
    config = build_config("llama-moe-tiny", vocab_size=50, seq_len=8, router_z_loss_coef=0.001)
    model = Llama(config)
    assert all(isinstance(b.mlp, MoEFeedForward) for b in model.layers)
    assert model.layers[0].mlp.gate_up_proj.shape == (4, 128, 64) and model.layers[0].mlp.down_proj.shape == (4, 64, 64)
    logits = model(torch.randint(0, 50, (2, 8)))
    assert logits.shape == (2, 8, 50)
    aux = model.aux_loss()
    # two layers, each balance >= top_k (equality when balanced) times 0.01, plus z-loss
    assert aux is not None and aux.item() > 2 * 0.01 * 2 * 0.99
    assert model.aux_loss() is None  # read once
    # every second block
    every2 = Llama(LlamaConfig(**{**config.__dict__, "num_layers": 4, "moe_every": 2}))
    assert [isinstance(b.mlp, MoEFeedForward) for b in every2.layers] == [False, True, False, True]
    # the family's description still applies
    assert spec_for(model).name == "behemoth Llama"
    assert transformer_blocks(model) is model.layers
    assert shape_of(config).num_layers == 2
    # same seed, same weights; dense Llama unchanged by the new fields
    torch.testing.assert_close(Llama(config).state_dict(), model.state_dict(), rtol=0, atol=0)
    dense = build_model("llama-tiny", vocab_size=50, seq_len=8)
    assert not any(isinstance(m, MoEFeedForward) for m in dense.modules()) and dense.aux_loss() is None
    # active FLOPs: k of E experts
    expert_params = 2 * 3 * 64 * 64 * 4
    assert model.flops_per_token(8) == 6 * (model.num_params() - expert_params // 2) + 12 * 2 * 64 * 8


def test_moe_config_errors():
    with pytest.raises(ValueError, match="experts_top_k"):
        build_config("llama-moe-tiny", vocab_size=50, seq_len=8, experts_top_k=5)
    with pytest.raises(ValueError, match="moe_every"):
        build_config("llama-moe-tiny", vocab_size=50, seq_len=8, moe_every=3)


def test_olmoe_shaped_presets():
    """Fine-grained experts (OLMoE's shape): 64 narrow experts, top-8, weights not renormalised;
    the routing options reach every MoE layer."""
    big = build_config("olmoe-1b-7b", vocab_size=50304, seq_len=4096)
    assert (big.num_experts, big.experts_top_k, big.expert_ffn_hidden, big.router_norm_topk) == (64, 8, 1024, False)
    model = build_model(
        "olmoe-tiny",
        vocab_size=50,
        seq_len=8,
        router_score_func="sigmoid",
        router_bias_update_rate=0.01,
        shared_expert_ffn_hidden=16,
        expert_capacity_factor=1.5,
    )
    layer = model.layers[0].mlp
    assert (layer.num_experts, layer.top_k, layer.norm_topk, layer.score_func) == (16, 4, False, "sigmoid")
    assert layer.shared.gate_up.weight.shape == (32, 64) and layer.capacity_factor == 1.5
    assert layer.expert_bias.tolist() == [0.0] * 16  # a buffer, zero after the meta-device build
    assert "layers.0.mlp.expert_bias" in model.state_dict()
    model(torch.randint(0, 50, (2, 8)))
    assert model.aux_loss() is not None and float(layer.token_counts.sum()) == 2 * 8 * 4
    with pytest.raises(ValueError, match="router_score_func"):
        build_config("olmoe-tiny", vocab_size=50, seq_len=8, router_score_func="relu")
    with pytest.raises(ValueError, match="expert_capacity_factor"):
        build_config("olmoe-tiny", vocab_size=50, seq_len=8, expert_capacity_factor=0.0)

"""Serial models: seeded init, shapes, causality, tying, GQA, RoPE, config
errors, and equality with naive attention and with Hugging Face GPT-2 / Llama.

Shape legend: B batch, S sequence, H hidden, V vocab, N heads, D head dim.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from behemoth.models import (
    GPT,
    GPT_PRESETS,
    LLAMA_PRESETS,
    GPTConfig,
    Llama,
    LlamaConfig,
    build_config,
    build_model,
)

V, S_MAX = 97, 16


def tiny_gpt_config(**kw) -> GPTConfig:
    return GPTConfig(**{**dict(vocab_size=V, seq_len=S_MAX, num_layers=2, num_heads=4, hidden=32), **kw})


def tiny_llama_config(**kw) -> LlamaConfig:
    fields = dict(vocab_size=V, seq_len=S_MAX, num_layers=2, num_heads=4, num_kv_heads=2, hidden=32)
    return LlamaConfig(**{**fields, **kw})


BUILDERS = {
    "gpt": lambda **kw: GPT(tiny_gpt_config(**kw)),
    "llama": lambda **kw: Llama(tiny_llama_config(**kw)),
}


def ids_BS(B: int = 2, S: int = 8, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(seed))


def assert_state_equal(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


# --------------------------------------------------------------------- init


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_init_is_seeded_and_ignores_global_rng(arch):
    torch.manual_seed(1)
    rng_before = torch.get_rng_state()
    a = BUILDERS[arch]()
    assert torch.equal(torch.get_rng_state(), rng_before), "init must not consume the global RNG"
    torch.manual_seed(12345)
    b = BUILDERS[arch]()
    assert_state_equal(a, b)
    c = BUILDERS[arch](seed=1)
    assert any(not torch.equal(x, y) for x, y in zip(a.state_dict().values(), c.state_dict().values()))


def test_init_values_follow_gpt2():
    model = GPT(tiny_gpt_config(num_layers=4, hidden=64, vocab_size=4096))
    assert torch.equal(model.blocks[0].ln_1.weight, torch.ones(64))
    assert torch.equal(model.blocks[0].ln_1.bias, torch.zeros(64))
    assert torch.equal(model.blocks[0].attn.qkv.bias, torch.zeros(3 * 64))
    assert model.wte.weight.std().item() == pytest.approx(0.02, rel=0.05)
    resid = torch.cat([b.attn.proj.weight.flatten() for b in model.blocks])
    assert resid.std().item() == pytest.approx(0.02 / math.sqrt(8), rel=0.05)


def test_init_independent_of_dtype():
    a = GPT(tiny_gpt_config())
    b = GPT(tiny_gpt_config(), dtype=torch.float64)
    assert b.wte.weight.dtype == torch.float64
    for x, y in zip(a.state_dict().values(), b.state_dict().values()):
        assert torch.equal(x, y.float())


def test_meta_build_counts_params_without_memory():
    model = build_model("gpt2-small", vocab_size=50257, seq_len=1024, device="meta")
    assert model.wte.weight.is_meta
    assert model.num_params() == 124_439_808  # GPT-2 small, as nanoGPT reports it
    assert model.num_params(exclude_embeddings=True) == 124_439_808 - (50257 + 1024) * 768
    big = build_model("gpt-13b", vocab_size=50257, seq_len=2048, device="meta")
    assert 12.5e9 < big.num_params() < 13.5e9


# ------------------------------------------------------------ forward shape


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_output_shape_and_seq_len_check(arch):
    model = BUILDERS[arch]()
    assert model(ids_BS(3, 5)).shape == (3, 5, V)
    with pytest.raises(ValueError, match="seq_len"):
        model(ids_BS(1, S_MAX + 1))


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_causal(arch):
    model = BUILDERS[arch]().eval()
    x_BS = ids_BS(2, 10)
    t = 6
    y_BS = x_BS.clone()
    y_BS[:, t] = (y_BS[:, t] + 1) % V
    with torch.no_grad():
        lx, ly = model(x_BS), model(y_BS)
    torch.testing.assert_close(lx[:, :t], ly[:, :t], atol=0, rtol=0)
    assert not torch.allclose(lx[:, t:], ly[:, t:])


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_explicit_positions_equal_default(arch):
    model = BUILDERS[arch]().eval()
    x_BS = ids_BS(2, 8)
    with torch.no_grad():
        default = model(x_BS)
        explicit = model(x_BS, torch.arange(8).expand(2, 8))
        shifted = model(x_BS, torch.arange(3, 11).unsqueeze(0))
        stretched = model(x_BS, 2 * torch.arange(8).unsqueeze(0))
    torch.testing.assert_close(default, explicit, atol=0, rtol=0)
    assert not torch.allclose(default, stretched)
    if arch == "llama":  # RoPE scores depend only on relative position
        torch.testing.assert_close(default, shifted, atol=1e-5, rtol=1e-4)
    else:
        assert not torch.allclose(default, shifted)


def test_gpt_dropout_only_in_training():
    model = GPT(tiny_gpt_config(dropout=0.5))
    x_BS = ids_BS()
    model.eval()
    torch.testing.assert_close(model(x_BS), model(x_BS), atol=0, rtol=0)
    model.train()
    assert not torch.allclose(model(x_BS), model(x_BS))


# ------------------------------------------------------- names and tying


def test_module_names_for_policies():
    gpt_names = dict(GPT(tiny_gpt_config()).named_modules())
    for name in [
        "wte",
        "wpe",
        "drop",
        "blocks.1.ln_1",
        "blocks.1.attn.qkv",
        "blocks.1.attn.proj",
        "blocks.1.ln_2",
        "blocks.1.mlp.fc",
        "blocks.1.mlp.proj",
        "ln_f",
        "lm_head",
    ]:
        assert name in gpt_names, name
    assert gpt_names["blocks.0.attn"].num_heads == 4
    llama_names = dict(Llama(tiny_llama_config()).named_modules())
    for name in [
        "embed",
        "layers.1.attn_norm",
        "layers.1.attn.q",
        "layers.1.attn.k",
        "layers.1.attn.v",
        "layers.1.attn.o",
        "layers.1.mlp_norm",
        "layers.1.mlp.gate",
        "layers.1.mlp.up",
        "layers.1.mlp.down",
        "norm",
        "lm_head",
    ]:
        assert name in llama_names, name
    assert (llama_names["layers.0.attn"].num_heads, llama_names["layers.0.attn"].num_kv_heads) == (4, 2)


@pytest.mark.parametrize("arch,embed", [("gpt", "wte"), ("llama", "embed")])
def test_tied_weights_counted_once(arch, embed):
    tied = BUILDERS[arch](tie_embeddings=True)
    untied = BUILDERS[arch](tie_embeddings=False)
    assert tied.lm_head.weight is getattr(tied, embed).weight
    assert untied.lm_head.weight is not getattr(untied, embed).weight
    assert untied.num_params() - tied.num_params() == V * 32
    assert tied.num_params() == sum(p.numel() for p in set(tied.parameters()))
    h = 32
    assert tied.flops_per_token(8) == 6 * tied.num_params() + 12 * 2 * h * 8


# ----------------------------------------------------------- attention


def test_gpt_attention_matches_naive_reference():
    torch.manual_seed(0)
    attn = GPT(tiny_gpt_config()).blocks[0].attn
    with torch.no_grad():
        attn.qkv.bias.normal_()  # init leaves biases zero; exercise them
        attn.proj.bias.normal_()
    x_BSH = torch.randn(2, 7, 32)
    B, S, H, N = 2, 7, 32, 4
    D = H // N
    q, k, v = F.linear(x_BSH, attn.qkv.weight, attn.qkv.bias).split(H, dim=-1)
    q, k, v = (t.view(B, S, N, D).transpose(1, 2) for t in (q, k, v))
    scores_BNSS = q @ k.transpose(-1, -2) / math.sqrt(D)
    mask_SS = torch.ones(S, S, dtype=torch.bool).triu(1)
    probs_BNSS = scores_BNSS.masked_fill(mask_SS, float("-inf")).softmax(-1)
    y_BSH = (probs_BNSS @ v).transpose(1, 2).reshape(B, S, H)
    expected = F.linear(y_BSH, attn.proj.weight, attn.proj.bias)
    torch.testing.assert_close(attn(x_BSH), expected, atol=1e-5, rtol=1e-4)


def test_gqa_shapes_and_grouping():
    cfg = tiny_llama_config(num_heads=4, num_kv_heads=2)
    gqa = Llama(cfg).eval()
    attn = gqa.layers[0].attn
    D = cfg.head_dim
    assert attn.q.weight.shape == (4 * D, 32)
    assert attn.k.weight.shape == (2 * D, 32)
    assert attn.v.weight.shape == (2 * D, 32)
    assert attn.o.weight.shape == (32, 4 * D)
    # An MHA model whose kv head n is a copy of GQA kv head n // 2 must agree.
    mha = Llama(tiny_llama_config(num_heads=4, num_kv_heads=4)).eval()
    state = gqa.state_dict()
    for key, value in state.items():
        if key.endswith(("attn.k.weight", "attn.v.weight")):
            state[key] = value.view(2, D, 32).repeat_interleave(2, dim=0).reshape(4 * D, 32)
    mha.load_state_dict(state)
    x_BS = ids_BS()
    with torch.no_grad():
        torch.testing.assert_close(mha(x_BS), gqa(x_BS), atol=1e-5, rtol=1e-4)


def test_rope_tables_not_in_state_dict():
    model = Llama(tiny_llama_config())
    assert set(model.state_dict()) == {name for name, _ in model.named_parameters(remove_duplicate=False)}
    assert not list(model.buffers())


# ---------------------------------------------------------------- config


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: tiny_gpt_config(hidden=30), "hidden=30.*num_heads=4"),
        (lambda: tiny_gpt_config(num_layers=0), "num_layers=0"),
        (lambda: tiny_gpt_config(dropout=1.0), "dropout=1.0"),
        (lambda: tiny_gpt_config(ffn_hidden=0), "ffn_hidden=0"),
        (lambda: tiny_llama_config(num_kv_heads=3), "num_kv_heads=3"),
        (lambda: tiny_llama_config(hidden=36, num_heads=12, num_kv_heads=4), "head_dim.*odd"),
        (lambda: tiny_llama_config(hidden=30), "hidden=30"),
    ],
)
def test_config_validation(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_config_defaults_resolve():
    assert tiny_gpt_config().resolved_ffn_hidden == 128
    assert tiny_llama_config(hidden=64).resolved_ffn_hidden == 192  # int(170.67) -> 192
    assert tiny_llama_config(ffn_hidden=100).resolved_ffn_hidden == 100


def test_build_model_by_name():
    gpt = build_model("gpt-tiny", vocab_size=V, seq_len=S_MAX, dropout=0.1, num_layers=1)
    assert isinstance(gpt, GPT) and len(gpt.blocks) == 1 and gpt.config.dropout == 0.1
    llama = build_model("llama-tiny", vocab_size=V, seq_len=S_MAX, seed=3)
    assert isinstance(llama, Llama) and llama.config.seed == 3 and llama.config.num_kv_heads == 2
    assert build_config("llama-1b", vocab_size=V, seq_len=S_MAX).ffn_hidden == 8192
    assert set(GPT_PRESETS) >= {"gpt-tiny", "gpt-mini", "gpt2-small", "gpt-125m", "gpt-13b"}
    assert set(LLAMA_PRESETS) == {
        "llama-tiny",
        "llama-mini",
        "llama-1b",
        "llama-8b",
        "llama-moe-tiny",
        "mixtral-4b",
        "olmoe-tiny",
        "olmoe-1b-7b",
    }
    llama8 = build_model("llama-8b", vocab_size=128256, seq_len=8192, device="meta")
    assert sum(p.numel() for p in llama8.parameters()) == 8_030_261_248  # Meta-Llama-3-8B's count
    with pytest.raises(ValueError, match="gpt-tiny.*llama-tiny"):
        build_model("gpt-7", vocab_size=V, seq_len=S_MAX)
    with pytest.raises(ValueError, match="num_layer"):
        build_model("gpt-tiny", vocab_size=V, seq_len=S_MAX, num_layer=1)
    with pytest.raises(ValueError, match="dropout"):
        build_model("llama-tiny", vocab_size=V, seq_len=S_MAX, dropout=0.1)


# --------------------------------------------------- Hugging Face parity


def _randomize(model: torch.nn.Module) -> None:
    """Replace the init (small weights, unit norms, zero biases) with larger random
    values, so every copied tensor matters and activations reach the range where
    e.g. tanh-GELU and exact GELU differ by more than the tolerance."""
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            is_norm_weight = ("ln" in name or "norm" in name) and name.endswith("weight")
            p.copy_(1.0 + 0.1 * noise if is_norm_weight else 0.2 * noise)


def test_gpt_matches_hf_gpt2():
    transformers = pytest.importorskip("transformers")
    cfg = tiny_gpt_config(num_layers=2, num_heads=4, hidden=32)
    ours = GPT(cfg).eval()
    _randomize(ours)
    hf_cfg = transformers.GPT2Config(
        vocab_size=V,
        n_positions=S_MAX,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_inner=None,
        activation_function="gelu_new",
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        layer_norm_epsilon=cfg.norm_eps,
        tie_word_embeddings=True,
        attn_implementation="eager",
        bos_token_id=None,
        eos_token_id=None,
    )
    hf = transformers.GPT2LMHeadModel(hf_cfg).eval()
    ours_sd = ours.state_dict()
    hf_sd = {
        "transformer.wte.weight": ours_sd["wte.weight"],
        "transformer.wpe.weight": ours_sd["wpe.weight"],
        "transformer.ln_f.weight": ours_sd["ln_f.weight"],
        "transformer.ln_f.bias": ours_sd["ln_f.bias"],
        "lm_head.weight": ours_sd["lm_head.weight"],
    }
    names = {
        "ln_1": "ln_1",
        "ln_2": "ln_2",
        "attn.qkv": "attn.c_attn",
        "attn.proj": "attn.c_proj",
        "mlp.fc": "mlp.c_fc",
        "mlp.proj": "mlp.c_proj",
    }
    for i in range(cfg.num_layers):
        for ours_name, hf_name in names.items():
            w, b = ours_sd[f"blocks.{i}.{ours_name}.weight"], ours_sd[f"blocks.{i}.{ours_name}.bias"]
            conv1d = not ours_name.startswith("ln")  # HF Conv1D stores weight as (in, out)
            hf_sd[f"transformer.h.{i}.{hf_name}.weight"] = w.t().contiguous() if conv1d else w
            hf_sd[f"transformer.h.{i}.{hf_name}.bias"] = b
    missing, unexpected = hf.load_state_dict(hf_sd, strict=False)
    assert not unexpected and all("attn.bias" in k or "masked_bias" in k for k in missing), missing
    x_BS = ids_BS(2, 12)
    with torch.no_grad():
        torch.testing.assert_close(ours(x_BS), hf(x_BS).logits, atol=1e-5, rtol=1e-4)


def test_llama_matches_hf_llama():
    transformers = pytest.importorskip("transformers")
    cfg = tiny_llama_config(num_layers=2, num_heads=4, num_kv_heads=2, hidden=32, rope_theta=500.0)
    ours = Llama(cfg).eval()
    _randomize(ours)
    hf_cfg = transformers.LlamaConfig(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=cfg.resolved_ffn_hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=cfg.head_dim,
        max_position_embeddings=S_MAX,
        rms_norm_eps=cfg.norm_eps,
        rope_theta=cfg.rope_theta,
        attention_bias=False,
        mlp_bias=False,
        tie_word_embeddings=False,
        hidden_act="silu",
        attn_implementation="eager",
    )
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    names = {
        "attn_norm": "input_layernorm",
        "mlp_norm": "post_attention_layernorm",
        "attn.q": "self_attn.q_proj",
        "attn.k": "self_attn.k_proj",
        "attn.v": "self_attn.v_proj",
        "attn.o": "self_attn.o_proj",
        "mlp.gate": "mlp.gate_proj",
        "mlp.up": "mlp.up_proj",
        "mlp.down": "mlp.down_proj",
    }
    hf_sd = {}
    for key, value in ours.state_dict().items():
        if key.startswith("layers."):
            _, i, rest = key.split(".", 2)
            hf_key = f"model.layers.{i}.{names[rest.removesuffix('.weight')]}.weight"
        else:
            hf_key = {
                "embed.weight": "model.embed_tokens.weight",
                "norm.weight": "model.norm.weight",
                "lm_head.weight": "lm_head.weight",
            }[key]
        hf_sd[hf_key] = value
    hf.load_state_dict(hf_sd, strict=True)
    x_BS = ids_BS(2, 12)
    pos_BS = torch.arange(3, 15).unsqueeze(0).expand(2, 12)
    with torch.no_grad():
        torch.testing.assert_close(ours(x_BS), hf(x_BS).logits, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(ours(x_BS, pos_BS), hf(x_BS, position_ids=pos_BS).logits, atol=1e-5, rtol=1e-4)

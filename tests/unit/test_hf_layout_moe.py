"""Export to transformers of mixture-of-experts models, serial: behemoth's Llama with experts (as
``MixtralForCausalLM``) and transformers' ``MixtralForCausalLM``, ``Qwen3MoeForCausalLM`` and
``OlmoeForCausalLM`` written by behemoth.hf.export.write_hf load with
AutoModelForCausalLM.from_pretrained (no missing, unexpected or mismatched tensor) to the same
logits, with exactly the tensor names, shapes and dtypes transformers' save_pretrained writes for
the same weights (one tensor per expert). Multi-process exports (ep, ep x dp): tests/dist/test_hf_export_moe.py."""

from __future__ import annotations

import pytest
import torch

from behemoth.hf.export import write_hf
from behemoth.hf.names import layout_for

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

V, S = 96, 16
FAMILIES = ("llama-moe", "hf-mixtral", "hf-qwen3-moe", "hf-olmoe")


def build(family: str) -> torch.nn.Module:
    """A tiny model of ``family`` (the same weights on every call)."""
    torch.manual_seed(0)
    if family == "llama-moe":
        from behemoth.models import Llama, LlamaConfig

        cfg = LlamaConfig(
            vocab_size=V,
            seq_len=S,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            hidden=32,
            num_experts=4,
            experts_top_k=2,
            expert_ffn_hidden=24,
        )
        return Llama(cfg)
    common = dict(
        vocab_size=V,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=S,
        pad_token_id=0,
        bos_token_id=0,
        eos_token_id=0,
    )
    if family == "hf-mixtral":
        cfg = transformers.MixtralConfig(
            **common, intermediate_size=24, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2
        )
        return transformers.MixtralForCausalLM(cfg)
    if family == "hf-qwen3-moe":
        cfg = transformers.Qwen3MoeConfig(
            **common,
            intermediate_size=48,
            moe_intermediate_size=24,
            num_key_value_heads=2,
            head_dim=8,
            num_experts=4,
            num_experts_per_tok=2,
            mlp_only_layers=[0],
        )
        return transformers.Qwen3MoeForCausalLM(cfg)
    cfg = transformers.OlmoeConfig(
        **common, intermediate_size=16, num_key_value_heads=4, num_experts=8, num_experts_per_tok=4
    )
    return transformers.OlmoeForCausalLM(cfg)


def mixtral_of(model) -> torch.nn.Module:
    """transformers' Mixtral for behemoth's Llama with experts, configured by hand (not from the export)."""
    c = model.config
    cfg = transformers.MixtralConfig(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=c.expert_ffn_hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=S,
        num_local_experts=c.num_experts,
        num_experts_per_tok=c.experts_top_k,
        tie_word_embeddings=c.tie_embeddings,
    )
    return transformers.MixtralForCausalLM(cfg)


def tensors_of(directory: str) -> dict:
    import os

    from safetensors import safe_open

    out = {}
    for name in os.listdir(directory):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(directory, name), framework="pt") as f:
                for k in f.keys():
                    t = f.get_tensor(k)
                    out[k] = (tuple(t.shape), t.dtype)
    return out


def logits(model, x):
    with torch.no_grad():
        out = model(x)
    return out.logits if hasattr(out, "logits") else out


@pytest.mark.parametrize("family", FAMILIES)
def test_moe_export_loads_in_transformers_with_the_same_logits_and_layout(tmp_path, family):
    model = build(family).eval()
    with torch.no_grad():  # weights far from the init: every expert, and which is which, matters
        g = torch.Generator().manual_seed(1)
        for p in model.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=g))
    state = model.state_dict()
    writer = write_hf(
        str(tmp_path / "out"),
        layout=layout_for(model),
        model_config=model.config,
        stored={k: (tuple(v.shape), v.dtype) for k, v in state.items()},
        read=lambda k: state[k].clone(),
        max_shard_size="20KB",
    )
    assert len(writer.files) > 1
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched tensor
    x = torch.randint(0, V, (2, S), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(logits(hf.eval(), x), logits(model, x), atol=1e-5, rtol=1e-4)
    reference = mixtral_of(model) if family == "llama-moe" else model
    reference.save_pretrained(str(tmp_path / "ref"))
    assert tensors_of(str(tmp_path / "out")) == tensors_of(str(tmp_path / "ref"))
    assert type(hf).__name__ == ("MixtralForCausalLM" if family == "llama-moe" else type(model).__name__)

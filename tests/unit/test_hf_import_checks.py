"""Import from transformers, serial: load_hf into behemoth's GPT and Llama gives transformers'
logits; train.init_from takes a transformers directory; a checkpoint of another shape, a config
behemoth's models do not compute and a missing safetensors package are refused with the fix."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from behemoth.hf import load_hf, model_from_hf
from behemoth.hf.configs import behemoth_config
from behemoth.train.config_sections import ConfigError
from behemoth.train.run_dir import load_weights

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

V, S = 96, 16


def save(tmp_path, family: str, **kw) -> str:
    torch.manual_seed(0)
    if family == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=V, n_positions=S, n_embd=32, n_layer=2, n_head=4, **kw)
        model = transformers.GPT2LMHeadModel(cfg)
    else:
        cfg = transformers.LlamaConfig(
            vocab_size=V,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=S,
            **kw,
        )
        model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape))
    path = str(tmp_path / family)
    model.eval().save_pretrained(path, max_shard_size="40KB")
    return path


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_load_into_behemoth_model_gives_transformers_logits(tmp_path, family):
    path = save(tmp_path, family)
    ours = model_from_hf(path).eval()
    stats = load_hf(ours, path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    x = torch.randint(0, V, (2, S), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(x), hf(x).logits, atol=1e-5, rtol=1e-4)
    index = json.loads((tmp_path / family / "model.safetensors.index.json").read_text())
    assert stats["bytes_read"] == index["metadata"]["total_size"]  # serial: every byte once
    other = model_from_hf(path, seed=5)  # train.init_from with a transformers directory
    load_weights(other, path)
    for k, v in ours.state_dict().items():
        assert torch.equal(other.state_dict()[k], v), k


def test_other_shape_and_unsupported_config_are_refused(tmp_path):
    from behemoth.models import GPT, GPTConfig

    path = save(tmp_path, "gpt2")
    wrong = GPT(GPTConfig(vocab_size=V + 4, seq_len=S, num_layers=2, num_heads=4, hidden=32))
    with pytest.raises(ValueError, match=r"transformer.wte.weight: \(96, 32\) \(the model needs \(100, 32\)\)"):
        load_hf(wrong, path)
    with pytest.raises(ConfigError, match="train.init_from=.*model_from_hf.*Set the \\[model\\] section"):
        load_weights(wrong, path)
    with pytest.raises(ConfigError, match="nor a transformers checkpoint directory"):
        load_weights(wrong, str(tmp_path))
    with pytest.raises(ValueError, match="activation_function='relu'"):
        behemoth_config({"model_type": "gpt2", "activation_function": "relu", "n_embd": 8})
    with pytest.raises(ValueError, match="rope_scaling"):
        behemoth_config({"model_type": "llama", "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ValueError, match="model_type='bert'"):
        behemoth_config({"model_type": "bert"})


def test_missing_safetensors_names_the_extra(tmp_path, monkeypatch):
    path = save(tmp_path, "llama")
    monkeypatch.setitem(sys.modules, "safetensors", None)
    with pytest.raises(ImportError, match=r"pip install 'behemoth\[hf\]'"):
        load_hf(model_from_hf(path), path)

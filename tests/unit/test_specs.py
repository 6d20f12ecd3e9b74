"""Model-family descriptions (behemoth.specs): lookup by class with inheritance, the
transformers config's own tensor plan, and config shapes."""

import fnmatch

import pytest

from behemoth.models import GPT, GPTConfig, Llama, LlamaConfig
from behemoth.specs import (
    SPECS,
    TP_ROLES,
    find_spec,
    max_seq_len_of,
    shape_of,
    spec_for,
    tensor_plan,
    transformer_blocks,
    transformer_blocks_name,
)
from behemoth.specs.gpt import GPT as GPT_SPEC
from behemoth.specs.hf_llama import HF_LLAMA
from behemoth.specs.llama import LLAMA

TINY = dict(vocab_size=64, seq_len=16, num_layers=2, num_heads=2, hidden=32)


class MyGPT(GPT):
    """A user's subclass: same modules, one more method."""

    def extra(self):
        return 1


def test_subclass_gets_the_base_spec():
    model = MyGPT(GPTConfig(**TINY))
    assert spec_for(model) is GPT_SPEC
    assert tensor_plan(model) == dict(GPT_SPEC.tp_plan)
    assert transformer_blocks(model) is model.blocks
    assert transformer_blocks_name(model) == "blocks"
    assert spec_for(Llama(LlamaConfig(num_kv_heads=1, **TINY))) is LLAMA


def test_unknown_class_errors_with_the_fix():
    import torch.nn as nn

    model = nn.Sequential(nn.Linear(2, 2))
    assert find_spec(model) is None and tensor_plan(model) is None
    with pytest.raises(ValueError, match="no ModelSpec describes Sequential") as err:
        spec_for(model)
    assert "behemoth.specs.SPECS" in str(err.value) and "tp_policy" in str(err.value)
    with pytest.raises(ValueError, match="no ModelSpec reads a dict"):
        shape_of({})


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_every_spec_is_consistent(spec):
    assert all(role in TP_ROLES for role in spec.tp_plan.values())
    assert spec.pipeline.blocks == spec.blocks
    attention = [p for p, r in spec.tp_plan.items() if r == "attention"]
    assert attention == [spec.attention]


def _hf_llama():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        num_hidden_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        vocab_size=64,
        bos_token_id=0,
        eos_token_id=0,
    )
    return transformers, transformers.LlamaForCausalLM(config)


def test_transformers_llama_plan_comes_from_its_config_and_agrees_with_the_spec():
    transformers, model = _hf_llama()
    assert model.config.base_model_tp_plan  # the config carries one: it is what tensor_plan reads
    assert spec_for(model) is HF_LLAMA
    from_config = tensor_plan(model)
    assert from_config == dict(HF_LLAMA.tp_plan)

    # The config's plan is what is used: a changed config changes the plan.
    model.config.base_model_tp_plan = {"layers.*.mlp.down_proj": "rowwise"}
    changed = tensor_plan(model)
    assert changed["model.layers.*.mlp.down_proj"] == "rowwise"
    assert "model.layers.*.self_attn.q_proj" not in changed
    model.config.base_model_tp_plan = {"layers.*.mlp.gate_up_proj": "packed_colwise"}
    with pytest.raises(ValueError, match="'packed_colwise' has no behemoth"):
        tensor_plan(model)
    model.config.base_model_tp_plan = None
    assert tensor_plan(model) == dict(HF_LLAMA.tp_plan)  # fallback: the spec's explicit plan


def test_transformers_llama_plan_names_every_module_it_means():
    _, model = _hf_llama()
    names = [n for n, _ in model.named_modules()]
    for pattern in tensor_plan(model):
        assert any(fnmatch.fnmatchcase(n, pattern) for n in names), pattern
    assert [n for n in names if fnmatch.fnmatchcase(n, HF_LLAMA.attention)] == [
        "model.layers.0.self_attn",
        "model.layers.1.self_attn",
    ]


def test_shapes_of_configs_and_subclasses():
    class MyConfig(GPTConfig):
        pass

    assert shape_of(MyConfig(**TINY)) == shape_of(GPTConfig(**TINY))
    assert shape_of(GPTConfig(**TINY)).fused_qkv
    assert shape_of(LlamaConfig(num_kv_heads=1, **TINY)).num_kv_heads == 1
    _, model = _hf_llama()
    assert shape_of(model.config).num_kv_heads == 2 and shape_of(model.config).rms_norm
    assert max_seq_len_of(model.config) == model.config.max_position_embeddings
    assert max_seq_len_of(MyConfig(**TINY)) == 16 and max_seq_len_of(LlamaConfig(num_kv_heads=1, **TINY)) == 16

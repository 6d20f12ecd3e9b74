"""Import of fused expert tensors, pure (no file, no process): any rectangle of a fused
``gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]`` read from the per-expert tensors transformers'
``save_pretrained`` writes (Mixtral ``w1``/``w3``/``w2``, Qwen3-MoE and OLMoE ``gate_proj`` /
``up_proj`` / ``down_proj``) or from the fused tensor, equals that rectangle of the fused tensor --
rows across the gate/up boundary included; missing and misshapen experts named; Mixtral's
``config.json`` read into behemoth's Llama with experts, what it does not compute refused."""

from __future__ import annotations

import pytest
import torch

from behemoth.hf.configs import behemoth_config
from behemoth.hf.experts import ExpertSource
from behemoth.hf.names import layout_for_config
from behemoth.models import LlamaConfig

E, I, H = 4, 6, 8  # noqa: E741 (the expert width's usual letter)
RECTANGLES = (
    ((0, 0, 0), None),  # the whole tensor
    ((1, 0, 0), (2, None, None)),  # ep rank 1 of 2: experts 1, 2 whole
    ((1, I - 3, 2), (3, 5, 5)),  # rows across the gate/up boundary, some columns
    ((3, I, 0), (1, I, None)),  # one expert's up rows only
)


def layouts():
    yield (
        "behemoth",
        layout_for_config(
            LlamaConfig(vocab_size=16, seq_len=8, num_layers=1, num_heads=2, num_kv_heads=2, hidden=H, num_experts=E)
        ),
        "layers.0.mlp.",
    )
    transformers = pytest.importorskip("transformers")
    common = dict(vocab_size=16, hidden_size=H, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2)
    yield (
        "mixtral",
        layout_for_config(transformers.MixtralConfig(**common, num_local_experts=E)),
        ("model.layers.0.mlp.experts."),
    )
    yield (
        "qwen3-moe",
        layout_for_config(transformers.Qwen3MoeConfig(**common, num_experts=E)),
        ("model.layers.0.mlp.experts."),
    )
    yield "olmoe", layout_for_config(transformers.OlmoeConfig(**common, num_experts=E)), "model.layers.0.mlp.experts."


def fused_tensors(prefix: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        prefix + "gate_up_proj": torch.randn(E, 2 * I, H, generator=g),
        prefix + "down_proj": torch.randn(E, H, I, generator=g),
    }


def per_expert(layout, fused: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What save_pretrained writes for ``fused`` (export's own split: Layout.targets / take)."""
    out = {}
    for name, t in fused.items():
        for target in layout.targets(name, tuple(t.shape)):
            out[target.name] = target.take(t).clone()
    return out


def reader(stored: dict[str, torch.Tensor]):
    def read(name, offsets, sizes):
        return stored[name][tuple(slice(o, o + s) for o, s in zip(offsets, sizes))].clone()

    return read


@pytest.mark.parametrize("form", ["per-expert", "fused"])
def test_any_rectangle_of_a_fused_expert_tensor_reads_back(form):
    for family, layout, prefix in layouts():
        fused = fused_tensors(prefix)
        stored = per_expert(layout, fused)
        if form == "fused":
            stored = {layout.fused_source(name): t for name, t in fused.items()}
        for name, t in fused.items():
            source = ExpertSource.find(layout, name, tuple(t.shape), stored)
            assert (source.fused is not None) == (form == "fused"), (family, name)
            assert source.problems(lambda n: tuple(stored[n].shape) if n in stored else None) == []
            for offsets, sizes in RECTANGLES:
                sizes = tuple(
                    t.shape[d] - offsets[d] if sizes is None or sizes[d] is None else sizes[d] for d in range(3)
                )
                if any(o + n > d for o, n, d in zip(offsets, sizes, t.shape)):
                    continue  # down_proj is [E, H, I], not [E, 2I, H]
                view = torch.full(sizes, float("nan"))
                source.read_into(view, offsets, sizes, reader(stored))
                want = t[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
                assert torch.equal(view, want), (family, form, name, offsets, sizes)


def test_missing_and_misshapen_experts_are_named():
    for family, layout, prefix in layouts():
        fused = fused_tensors(prefix)
        stored = per_expert(layout, fused)
        name = prefix + "gate_up_proj"
        parts = layout.targets(name, (E, 2 * I, H))
        gone, short = parts[5].name, parts[2].name  # expert 2's up rows, expert 1's gate rows
        del stored[gone]
        stored[short] = stored[short][:, :3]
        source = ExpertSource.find(layout, name, (E, 2 * I, H), stored)
        problems = source.problems(lambda n: tuple(stored[n].shape) if n in stored else None)
        assert problems == [
            f"{short}: (6, 3) (expert 1 of 4; the model needs (6, 8))",
            f"{gone}: missing (expert 2 of 4; the model needs (6, 8))",
        ], (family, problems)


def test_mixtral_config_reads_into_behemoth_llama_with_experts():
    cfg = {
        "model_type": "mixtral",
        "vocab_size": 96,
        "hidden_size": 32,
        "intermediate_size": 24,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": None,
        "max_position_embeddings": 64,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_theta": 500.0, "rope_type": "default"},
        "hidden_act": "silu",
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "router_aux_loss_coef": 0.02,
        "router_jitter_noise": 0.0,
        "sliding_window": None,
        "tie_word_embeddings": False,
    }
    c = behemoth_config(cfg)
    assert (c.num_experts, c.experts_top_k, c.expert_ffn_hidden, c.moe_every) == (8, 2, 24, 1)
    assert (c.router_score_func, c.router_norm_topk, c.router_aux_loss_coef, c.rope_theta) == (
        "softmax",
        True,
        0.02,
        500.0,
    )
    for key, value in (("router_jitter_noise", 0.01), ("sliding_window", 32)):
        with pytest.raises(ValueError, match=f"{key}={value}.*transformers=True"):
            behemoth_config({**cfg, key: value})
    assert behemoth_config({**cfg, "sliding_window": 64}).num_experts == 8  # a window as long as the context
    with pytest.raises(ValueError, match="model_type='qwen3_moe'.*'mixtral' checkpoints only.*transformers=True"):
        behemoth_config({**cfg, "model_type": "qwen3_moe"})

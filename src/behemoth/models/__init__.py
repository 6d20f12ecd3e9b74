"""Serial reference models (no collectives) and a by-name builder.

``build_model("gpt-125m", vocab_size=50257, seq_len=1024)`` picks the preset
shape from ``GPT_PRESETS`` or ``LLAMA_PRESETS`` and returns a seeded,
initialised model. behemoth.specs describes how to shard them, by module name.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from behemoth.models.gpt import GPT, GPT_PRESETS, GPTBlock, GPTConfig
from behemoth.models.llama import LLAMA_PRESETS, Llama, LlamaBlock, LlamaConfig, RMSNorm
from behemoth.models.moe import MoEFeedForward, auxiliary_loss

__all__ = [
    "GPT",
    "GPTBlock",
    "GPTConfig",
    "GPT_PRESETS",
    "LLAMA_PRESETS",
    "Llama",
    "LlamaBlock",
    "LlamaConfig",
    "MODEL_PRESETS",
    "MoEFeedForward",
    "RMSNorm",
    "auxiliary_loss",
    "build_config",
    "build_model",
]

MODEL_PRESETS: dict[str, dict] = {**GPT_PRESETS, **LLAMA_PRESETS}
"""Every preset name, GPT and Llama together."""


def build_config(
    name: str,
    *,
    vocab_size: int,
    seq_len: int,
    seed: int = 0,
    dropout: float = 0.0,
    **overrides,
) -> GPTConfig | LlamaConfig:
    """The config ``build_model`` would use, without building the model.

    ``overrides`` replace preset or default config fields (e.g. ``num_layers=2``).
    Raises ValueError for an unknown name, an unknown field, or a nonzero
    ``dropout`` for Llama (which has none).
    """
    if name in GPT_PRESETS:
        config_cls, preset = GPTConfig, GPT_PRESETS[name]
        fields = dict(preset, vocab_size=vocab_size, seq_len=seq_len, seed=seed, dropout=dropout)
    elif name in LLAMA_PRESETS:
        if dropout != 0.0:
            raise ValueError(
                f"build_model({name!r}): dropout={dropout!r} but Llama models have no dropout; "
                f"pass dropout=0.0 or use a gpt-* preset."
            )
        config_cls, preset = LlamaConfig, LLAMA_PRESETS[name]
        fields = dict(preset, vocab_size=vocab_size, seq_len=seq_len, seed=seed)
    else:
        raise ValueError(
            f"build_model: unknown model name {name!r}; known names are {', '.join(sorted(MODEL_PRESETS))}."
        )
    known = {f.name for f in dataclasses.fields(config_cls)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(
            f"build_model({name!r}): unknown config field(s) {unknown} for {config_cls.__name__}; "
            f"valid fields are {', '.join(sorted(known))}."
        )
    fields.update(overrides)
    return config_cls(**fields)


def build_model(
    name: str,
    *,
    vocab_size: int,
    seq_len: int,
    seed: int = 0,
    dropout: float = 0.0,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    **overrides,
) -> nn.Module:
    """Build a preset model by name (``gpt-*``, ``gpt2-small``, ``llama-*``).

    ``device="meta"`` builds without memory or init (for counting parameters);
    ``overrides`` replace config fields. See ``build_config`` for the errors.
    """
    config = build_config(name, vocab_size=vocab_size, seq_len=seq_len, seed=seed, dropout=dropout, **overrides)
    model_cls = GPT if isinstance(config, GPTConfig) else Llama
    return model_cls(config, device=device, dtype=dtype)

"""Rewrites of a serial model into the form a plan runs, applied in one documented order:

    tensor/sequence parallel -> activation checkpointing -> compile -> pipeline split -> zero/offload

Only the steps built so far live here; each is a small ``apply_*`` function.
"""
from __future__ import annotations

import functools

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from .policies import transformer_blocks


def prepare_model(model: nn.Module, device: torch.device) -> nn.Module:
    """Move the model to this rank's device and turn off what breaks exact training
    (transformers' KV cache, which only serves generation)."""
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "use_cache"):
        config.use_cache = False
    return model.to(device)


def apply_activation_checkpointing(model: nn.Module) -> int:
    """Recompute each transformer block in backward instead of saving its activations.

    The block's ``forward`` is wrapped in place (non-reentrant checkpoint, RNG state
    preserved), so state-dict keys do not change. Returns the number of blocks wrapped.
    """
    blocks = transformer_blocks(model)
    for block in blocks:
        if getattr(block, "_behemoth_checkpointed", False):
            continue
        inner = block.forward

        @functools.wraps(inner)
        def forward(*args, _inner=inner, **kwargs):
            return checkpoint(_inner, *args, use_reentrant=False, **kwargs)

        block.forward = forward
        block._behemoth_checkpointed = True
    return len(blocks)

"""Rewrites of a serial model into the form a plan runs, applied in one documented order:

    tensor/context parallel -> experts -> activation checkpointing -> compile -> pipeline split
        -> zero/offload

Only the steps built so far live here; each is a small ``apply_*`` function.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from .parallel.context import ContextParallelized, parallelize_context
from .parallel.expert import parallelize_experts
from .parallel.tensor import Parallelized, parallelize_tensor
from .specs import transformer_blocks


def prepare_model(model: nn.Module, device: torch.device, *, keep_params: bool = False) -> nn.Module:
    """Move the model to this rank's device and turn off what breaks exact training
    (transformers' KV cache, which only serves generation). ``keep_params`` moves the buffers
    only: ZeRO-3 moves parameters chunk by chunk, so a model larger than the device can be
    built on the host."""
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "use_cache"):
        config.use_cache = False
    if not keep_params:
        return model.to(device)
    for m in model.modules():
        for name, b in m._buffers.items():
            if b is not None:
                m._buffers[name] = b.to(device)
    return model


def apply_tensor_parallel(model: nn.Module, mesh, plan, policy=None) -> Parallelized:
    """Step 1: rewrite ``model`` in place for ``plan.tp_mode`` over ``mesh.axis('tp')``;
    ``policy`` is ``{module-name pattern: role or style}`` (``None``: the model family's plan).
    See :func:`behemoth.parallel.tensor.parallelize_tensor`."""
    return parallelize_tensor(model, mesh, plan, policy)


def apply_context_parallel(model: nn.Module, mesh, plan) -> ContextParallelized | None:
    """Step 2 (after tensor parallelism, whose local head counts it sees): the style
    :class:`~behemoth.parallel.context.ContextParallelAttention` (``plan.cp_mode``, over
    ``mesh.axis('cp')``) on every attention module of ``model``; returns the
    :class:`~behemoth.parallel.context.ContextParallelized` record the engine splits batches
    with, or ``None`` when ``plan.cp == 1`` (nothing changes). Checks run on every rank before
    anything changes; no collective is issued."""
    if plan.cp == 1:
        return None
    return parallelize_context(model, mesh, plan)


def apply_expert_parallel(model: nn.Module, mesh, plan) -> dict:
    """Step 3: the style :class:`~behemoth.parallel.expert.ExpertParallel` on every MoE layer
    (this rank keeps E/ep experts; router losses over the global batch). Returns the layers
    (empty for a dense model). ``check_experts`` must have passed on every rank."""
    return parallelize_experts(model, mesh, plan)


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


def apply_compile(model: nn.Module) -> int:
    """torch.compile each transformer block in place (``nn.Module.compile``: state-dict keys
    and parameters are unchanged, so gradient hooks and checkpoints see the same tensors).
    Returns the number of blocks compiled."""
    blocks = transformer_blocks(model)
    for block in blocks:
        block.compile()
    return len(blocks)

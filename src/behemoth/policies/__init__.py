"""Which module of a known architecture plays which role.

For now: where the stack of transformer blocks lives (activation checkpointing wraps
each block; pipeline and tensor-parallel policies will extend this table). Known
architectures: behemoth's GPT (``blocks``) and Llama (``layers``), transformers'
``GPT2LMHeadModel`` (``transformer.h``) and ``LlamaForCausalLM`` (``model.layers``).
"""
from __future__ import annotations

import torch.nn as nn

BLOCK_LISTS = {
    "GPT": "blocks",
    "Llama": "layers",
    "GPT2LMHeadModel": "transformer.h",
    "LlamaForCausalLM": "model.layers",
}


def transformer_blocks(model: nn.Module) -> nn.ModuleList:
    """The ModuleList of transformer blocks of ``model``.

    Known classes use the table above; for any other model the single largest
    ``nn.ModuleList`` (by parameter count) is taken, and a model with none is an error.
    """
    path = BLOCK_LISTS.get(type(model).__name__)
    if path is not None:
        return model.get_submodule(path)
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    if not lists:
        raise ValueError(f"{type(model).__name__} has no nn.ModuleList of blocks; activation checkpointing "
                         f"needs one (or add the class to behemoth.policies.BLOCK_LISTS).")
    return max(lists, key=lambda m: sum(p.numel() for p in m.parameters()))

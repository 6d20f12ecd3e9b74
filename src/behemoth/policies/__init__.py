"""Which module of a known architecture plays which role.

Two tables, keyed by the model's class name:

* ``BLOCK_LISTS``: where the stack of transformer blocks lives (activation checkpointing
  wraps each block; sequence parallelism shards the activations between them).
* ``TP_POLICIES``: the tensor-parallel role of each module, as ``module-name pattern ->
  role``. Patterns are ``fnmatch`` globs over ``model.named_modules()`` names
  (``"blocks.*.attn.qkv"``); every pattern must match at least one module.

Known architectures: behemoth's ``GPT`` and ``Llama``, transformers' ``GPT2LMHeadModel``
(fused QKV in a ``Conv1D`` whose weight is ``[in, out]``; tied embeddings) and
``LlamaForCausalLM`` (separate q/k/v, grouped-query attention).

**Your own model**: pass a dict of the same form, ``bh.boost(model, opt, plan,
tp_policy={"layers.*.attn.wq": "colwise", ...})``. Roles (shared by every tensor-parallel
mode):

==================  ===============================================================
role                module
==================  ===============================================================
``colwise``         Linear/Conv1D whose output features are split (q, k, v, fc, gate, up)
``colwise_fused3``  one Linear/Conv1D computing ``[q; k; v]``, split per part
``rowwise``         Linear/Conv1D whose input features are split (attention out, MLP down)
``norm``            LayerNorm / RMSNorm
``embedding``       token embedding (vocabulary-parallel)
``pos_embedding``   learned position embedding
``head``            output projection to the vocabulary (vocabulary-parallel logits and loss)
``attention``       the attention module whose head counts become the local counts
==================  ===============================================================

Modules that no pattern names stay serial (replicated on every tensor-parallel rank).
"""

from __future__ import annotations

import fnmatch

import torch.nn as nn

BLOCK_LISTS = {
    "GPT": "blocks",
    "Llama": "layers",
    "GPT2LMHeadModel": "transformer.h",
    "LlamaForCausalLM": "model.layers",
}

TP_ROLES = ("colwise", "colwise_fused3", "rowwise", "norm", "embedding", "pos_embedding", "head", "attention")

TP_POLICIES: dict[str, dict[str, str]] = {
    "GPT": {
        "wte": "embedding",
        "wpe": "pos_embedding",
        "blocks.*.ln_1": "norm",
        "blocks.*.attn": "attention",
        "blocks.*.attn.qkv": "colwise_fused3",
        "blocks.*.attn.proj": "rowwise",
        "blocks.*.ln_2": "norm",
        "blocks.*.mlp.fc": "colwise",
        "blocks.*.mlp.proj": "rowwise",
        "ln_f": "norm",
        "lm_head": "head",
    },
    "Llama": {
        "embed": "embedding",
        "layers.*.attn_norm": "norm",
        "layers.*.attn": "attention",
        "layers.*.attn.q": "colwise",
        "layers.*.attn.k": "colwise",
        "layers.*.attn.v": "colwise",
        "layers.*.attn.o": "rowwise",
        "layers.*.mlp_norm": "norm",
        "layers.*.mlp.gate": "colwise",
        "layers.*.mlp.up": "colwise",
        "layers.*.mlp.down": "rowwise",
        "norm": "norm",
        "lm_head": "head",
    },
    "GPT2LMHeadModel": {
        "transformer.wte": "embedding",
        "transformer.wpe": "pos_embedding",
        "transformer.h.*.ln_1": "norm",
        "transformer.h.*.attn": "attention",
        "transformer.h.*.attn.c_attn": "colwise_fused3",
        "transformer.h.*.attn.c_proj": "rowwise",
        "transformer.h.*.ln_2": "norm",
        "transformer.h.*.mlp.c_fc": "colwise",
        "transformer.h.*.mlp.c_proj": "rowwise",
        "transformer.ln_f": "norm",
        "lm_head": "head",
    },
    "LlamaForCausalLM": {
        "model.embed_tokens": "embedding",
        "model.layers.*.input_layernorm": "norm",
        "model.layers.*.self_attn": "attention",
        "model.layers.*.self_attn.q_proj": "colwise",
        "model.layers.*.self_attn.k_proj": "colwise",
        "model.layers.*.self_attn.v_proj": "colwise",
        "model.layers.*.self_attn.o_proj": "rowwise",
        "model.layers.*.post_attention_layernorm": "norm",
        "model.layers.*.mlp.gate_proj": "colwise",
        "model.layers.*.mlp.up_proj": "colwise",
        "model.layers.*.mlp.down_proj": "rowwise",
        "model.norm": "norm",
        "lm_head": "head",
    },
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
        raise ValueError(
            f"{type(model).__name__} has no nn.ModuleList of blocks; activation checkpointing "
            f"and sequence parallelism need one (or add the class to behemoth.policies.BLOCK_LISTS)."
        )
    return max(lists, key=lambda m: sum(p.numel() for p in m.parameters()))


def transformer_blocks_name(model: nn.Module) -> str:
    """The dotted module name of :func:`transformer_blocks` (for "is this module inside a block")."""
    blocks = transformer_blocks(model)
    return next(name for name, m in model.named_modules() if m is blocks)


def resolve_tp_policy(model: nn.Module, policy: dict[str, str] | None = None) -> dict[str, str]:
    """``{module name: role}`` for ``model``, from ``policy`` or the table of its class.

    Errors (``ValueError``, raised identically on every rank, before any collective): an
    unknown model class without a policy, an unknown role, a pattern that matches no module,
    a module that two patterns give different roles.
    """
    cls = type(model).__name__
    if policy is None:
        policy = TP_POLICIES.get(cls)
        if policy is None:
            raise ValueError(
                f"tensor parallelism has no policy for {cls}; pass tp_policy={{module-name pattern: role}} to "
                f"bh.boost, e.g. {{'layers.*.attn.q': 'colwise', 'layers.*.attn.o': 'rowwise', ...}}. "
                f"Roles: {', '.join(TP_ROLES)}. Known classes: {', '.join(sorted(TP_POLICIES))}."
            )
    if not isinstance(policy, dict) or not policy:
        raise ValueError(f"tp_policy must be a non-empty dict {{module-name pattern: role}}; got {policy!r}.")
    names = [name for name, _ in model.named_modules() if name]
    roles: dict[str, str] = {}
    for pattern, role in policy.items():
        if role not in TP_ROLES:
            raise ValueError(
                f"tp_policy[{pattern!r}] = {role!r} is not a tensor-parallel role; use one of {', '.join(TP_ROLES)}."
            )
        hits = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if not hits:
            raise ValueError(
                f"tp_policy pattern {pattern!r} (role {role!r}) matches no module of {cls}; "
                f"module names look like {names[:6]}. Fix the pattern or drop it."
            )
        for n in hits:
            if roles.get(n, role) != role:
                raise ValueError(
                    f"module {n!r} of {cls} gets two tensor-parallel roles, {roles[n]!r} and "
                    f"{role!r} (pattern {pattern!r}); give each module one role."
                )
            roles[n] = role
    return roles

"""``config.json`` and ``generation_config.json`` of a transformers checkpoint, both ways.

:func:`hf_config` writes the config transformers needs to rebuild behemoth's ``GPT`` as
``GPT2LMHeadModel`` or its ``Llama`` as ``LlamaForCausalLM``, or with experts as
``MixtralForCausalLM`` (same math: GPT-2's tanh GELU is transformers' ``gelu_new``; Llama's
rotate-half RoPE with ``rope_theta``; Mixtral's softmax router, top-k weights renormalised); a transformers model's
own config is written as it is. :func:`behemoth_config` reads such a ``config.json`` back into a
behemoth ``GPTConfig`` / ``LlamaConfig`` (a Mixtral one into a ``LlamaConfig`` with experts),
refusing what behemoth's models do not compute (another activation, rope scaling, biases in
Llama, Mixtral's router jitter or a sliding window shorter than the context).

Plain dicts, no transformers import: written as transformers 4.x writes them (``torch_dtype``,
``rope_theta``), which transformers 5 reads too.
"""

from __future__ import annotations

import torch

__all__ = ["hf_config", "generation_config", "behemoth_config", "DTYPE_NAMES"]

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def hf_config(model_config, layout, *, vocab_size: int, dtype: torch.dtype, bos: int | None, eos: int | None) -> dict:
    """``config.json`` of the export of a model with ``model_config`` (behemoth's or transformers')."""
    from behemoth.models import GPTConfig, LlamaConfig

    c = model_config
    common = {
        "architectures": [layout.architecture],
        "model_type": layout.model_type,
        "vocab_size": vocab_size,
        "tie_word_embeddings": layout.tied,
        "torch_dtype": DTYPE_NAMES[dtype],
        "bos_token_id": bos,
        "eos_token_id": eos,
        "use_cache": True,
    }
    if isinstance(c, GPTConfig):
        return {
            **common,
            "n_positions": c.seq_len,
            "n_embd": c.hidden,
            "n_layer": c.num_layers,
            "n_head": c.num_heads,
            "n_inner": c.ffn_hidden,
            "activation_function": "gelu_new",
            "layer_norm_epsilon": c.norm_eps,
            "resid_pdrop": c.dropout,
            "embd_pdrop": c.dropout,
            "attn_pdrop": c.dropout,
            "initializer_range": 0.02,
        }
    if isinstance(c, LlamaConfig):
        llama = {
            **common,
            "hidden_size": c.hidden,
            "intermediate_size": c.resolved_ffn_hidden,
            "num_hidden_layers": c.num_layers,
            "num_attention_heads": c.num_heads,
            "num_key_value_heads": c.num_kv_heads,
            "head_dim": c.head_dim,
            "max_position_embeddings": c.seq_len,
            "rms_norm_eps": c.norm_eps,
            "rope_theta": c.rope_theta,
            "hidden_act": "silu",
            "attention_dropout": 0.0,
            "initializer_range": 0.02,
        }
        if not c.num_experts:
            return {**llama, "rope_scaling": None, "attention_bias": False, "mlp_bias": False}
        return {  # Mixtral: every MLP a mixture of experts of that width
            **llama,
            "intermediate_size": c.expert_ffn_hidden or c.resolved_ffn_hidden,
            "num_local_experts": c.num_experts,
            "num_experts_per_tok": c.experts_top_k,
            "router_aux_loss_coef": c.router_aux_loss_coef,
            "router_jitter_noise": 0.0,
            "output_router_logits": False,
            "sliding_window": None,
        }
    out = c.to_dict()  # a transformers config: its own fields, as its version writes them
    out.update(architectures=[layout.architecture], vocab_size=vocab_size)
    out["dtype" if "dtype" in out else "torch_dtype"] = DTYPE_NAMES[dtype]
    return out


def generation_config(bos: int | None, eos: int | None) -> dict:
    """``generation_config.json``: the special ids transformers' ``generate`` stops on."""
    return {"bos_token_id": bos, "eos_token_id": eos, "_from_model_config": True}


def _need(cfg: dict, key: str, ok, fix: str) -> None:
    if key in cfg and not ok(cfg[key]):
        raise ValueError(f"config.json has {key}={cfg[key]!r}, which behemoth's model does not compute; {fix}")


def behemoth_config(cfg: dict, *, seed: int = 0):
    """behemoth's ``GPTConfig`` / ``LlamaConfig`` for a transformers ``config.json`` (as a dict):
    GPT-2, Llama, or Mixtral (a ``LlamaConfig`` with experts in every block)."""
    from behemoth.models import GPTConfig, LlamaConfig

    kind = cfg.get("model_type")
    fix = (
        "load it into the transformers model instead (behemoth.hf.model_from_hf(path, transformers=True); bh.boost "
        "runs transformers' GPT-2, Llama, Mixtral, Qwen3-MoE and OLMoE too)."
    )
    if kind == "gpt2":
        _need(cfg, "activation_function", lambda v: v in ("gelu_new", "gelu_pytorch_tanh"), fix)
        for key in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn", "add_cross_attention"):
            _need(cfg, key, lambda v: not v, fix)
        _need(cfg, "scale_attn_weights", bool, fix)
        drop = cfg.get("resid_pdrop", 0.0)
        return GPTConfig(
            vocab_size=cfg["vocab_size"],
            seq_len=cfg["n_positions"],
            num_layers=cfg["n_layer"],
            num_heads=cfg["n_head"],
            hidden=cfg["n_embd"],
            ffn_hidden=cfg.get("n_inner"),
            dropout=drop,
            tie_embeddings=cfg.get("tie_word_embeddings", True),
            norm_eps=cfg.get("layer_norm_epsilon", 1e-5),
            seed=seed,
        )
    if kind in ("llama", "mixtral"):
        _need(cfg, "hidden_act", lambda v: v == "silu", fix)
        _need(cfg, "attention_bias", lambda v: not v, fix)
        _need(cfg, "mlp_bias", lambda v: not v, fix)
        _need(cfg, "rope_scaling", lambda v: not v or v.get("rope_type", v.get("type")) == "default", fix)
        rope = cfg.get("rope_parameters") or {}
        _need(rope, "rope_type", lambda v: v == "default", fix)
        heads = cfg["num_attention_heads"]
        _need(cfg, "head_dim", lambda v: v is None or v == cfg["hidden_size"] // heads, fix)
        experts = {}
        if kind == "mixtral":  # softmax router, top-k weights renormalised (behemoth's defaults)
            seq = cfg.get("max_position_embeddings", 2048)
            _need(cfg, "router_jitter_noise", lambda v: not v, fix)
            _need(cfg, "sliding_window", lambda v: v is None or v >= seq, fix)
            experts = dict(
                num_experts=cfg["num_local_experts"],
                experts_top_k=cfg["num_experts_per_tok"],
                expert_ffn_hidden=cfg["intermediate_size"],
                router_aux_loss_coef=float(cfg.get("router_aux_loss_coef", 0.001)),
            )
        return LlamaConfig(
            vocab_size=cfg["vocab_size"],
            seq_len=cfg.get("max_position_embeddings", 2048),
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            hidden=cfg["hidden_size"],
            ffn_hidden=cfg["intermediate_size"],
            rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
            norm_eps=cfg.get("rms_norm_eps", 1e-6),
            tie_embeddings=cfg.get("tie_word_embeddings", False),
            seed=seed,
            **experts,
        )
    raise ValueError(
        f"config.json has model_type={kind!r}; behemoth builds its own models from 'gpt2', 'llama' and 'mixtral' "
        f"checkpoints only ({fix})"
    )

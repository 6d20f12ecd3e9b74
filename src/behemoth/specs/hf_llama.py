"""transformers' Llama (``LlamaForCausalLM``): separate q/k/v with grouped-query attention,
RoPE, RMSNorm, SwiGLU MLP. Its config's ``base_model_tp_plan`` gives the colwise/rowwise
entries; the plan below names the rest and is the fallback (tests/unit/test_specs.py checks
that the two agree)."""

from __future__ import annotations

from .spec import ModelSpec, PipelineLayout, TransformerShape


def _shape(c) -> TransformerShape:
    return TransformerShape(
        hidden=c.hidden_size,
        ffn_hidden=c.intermediate_size,
        num_layers=c.num_hidden_layers,
        num_heads=c.num_attention_heads,
        num_kv_heads=getattr(c, "num_key_value_heads", None) or c.num_attention_heads,
        vocab_size=c.vocab_size,
        norm_params=c.hidden_size,
        linear_bias=bool(getattr(c, "attention_bias", False) or getattr(c, "mlp_bias", False)),
        gated_mlp=True,
        rms_norm=True,
    )


HF_LLAMA = ModelSpec(
    name="transformers Llama",
    classes=("transformers.LlamaForCausalLM",),
    config_classes=("transformers.LlamaConfig",),
    blocks="model.layers",
    tp_plan={
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
    attention="model.layers.*.self_attn",
    pipeline=PipelineLayout(
        pre=("model.embed_tokens",),
        blocks="model.layers",
        post=("model.norm", "lm_head"),
        shared=("model.rotary_emb",),
        tied=(("model.embed_tokens.weight", "lm_head.weight"),),
    ),
    shape=_shape,
    max_seq_len=lambda c: c.max_position_embeddings,
    config_tp_plan=True,
)

"""transformers' GPT-2 (``GPT2LMHeadModel``): fused QKV in a ``Conv1D`` whose weight is
``[in, out]``, learned positions, LayerNorm, tied embeddings. Its config carries no tensor plan."""

from __future__ import annotations

from .spec import ModelSpec, PipelineLayout, TransformerShape


def _shape(c) -> TransformerShape:
    return TransformerShape(
        hidden=c.n_embd,
        ffn_hidden=c.n_inner or 4 * c.n_embd,
        num_layers=c.n_layer,
        num_heads=c.n_head,
        num_kv_heads=c.n_head,
        vocab_size=c.vocab_size,
        norm_params=2 * c.n_embd,
        linear_bias=True,
        fused_qkv=True,
        max_positions=c.n_positions,
    )


HF_GPT2 = ModelSpec(
    name="transformers GPT-2",
    classes=("transformers.GPT2LMHeadModel",),
    config_classes=("transformers.GPT2Config",),
    blocks="transformer.h",
    tp_plan={
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
    attention="transformer.h.*.attn",
    pipeline=PipelineLayout(
        pre=("transformer.wte", "transformer.wpe", "transformer.drop"),
        blocks="transformer.h",
        post=("transformer.ln_f", "lm_head"),
        tied=(("transformer.wte.weight", "lm_head.weight"),),
    ),
    shape=_shape,
    max_seq_len=lambda c: c.n_positions,
)

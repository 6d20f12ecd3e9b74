"""behemoth's GPT (models/gpt.py): fused QKV, learned positions, LayerNorm, tied embeddings."""

from __future__ import annotations

from .spec import ModelSpec, PipelineLayout, TransformerShape


def _shape(c) -> TransformerShape:
    return TransformerShape(
        hidden=c.hidden,
        ffn_hidden=c.resolved_ffn_hidden,
        num_layers=c.num_layers,
        num_heads=c.num_heads,
        num_kv_heads=c.num_heads,
        vocab_size=c.vocab_size,
        norm_params=(2 if c.bias else 1) * c.hidden,
        linear_bias=bool(c.bias),
        fused_qkv=True,
        max_positions=c.seq_len,
    )


GPT = ModelSpec(
    name="behemoth GPT",
    classes=("behemoth.GPT",),
    config_classes=("behemoth.GPTConfig",),
    blocks="blocks",
    tp_plan={
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
    attention="blocks.*.attn",
    pipeline=PipelineLayout(
        pre=("wte", "wpe", "drop"), blocks="blocks", post=("ln_f", "lm_head"), tied=(("wte.weight", "lm_head.weight"),)
    ),
    shape=_shape,
    max_seq_len=lambda c: c.seq_len,
)

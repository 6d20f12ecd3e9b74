"""behemoth's Llama (models/llama.py): separate q/k/v with grouped-query attention, RoPE,
RMSNorm, SwiGLU MLP."""

from __future__ import annotations

from .spec import ModelSpec, PipelineLayout, TransformerShape


def _shape(c) -> TransformerShape:
    return TransformerShape(
        hidden=c.hidden,
        ffn_hidden=c.resolved_ffn_hidden,
        num_layers=c.num_layers,
        num_heads=c.num_heads,
        num_kv_heads=c.num_kv_heads,
        vocab_size=c.vocab_size,
        norm_params=c.hidden,
        linear_bias=False,
        gated_mlp=True,
        rms_norm=True,
    )


LLAMA = ModelSpec(
    name="behemoth Llama",
    classes=("behemoth.Llama",),
    config_classes=("behemoth.LlamaConfig",),
    blocks="layers",
    tp_plan={
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
    attention="layers.*.attn",
    pipeline=PipelineLayout(
        pre=("embed",), blocks="layers", post=("norm", "lm_head"), tied=(("embed.weight", "lm_head.weight"),)
    ),
    shape=_shape,
    max_seq_len=lambda c: c.seq_len,
)

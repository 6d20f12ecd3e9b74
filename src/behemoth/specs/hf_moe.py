"""transformers' mixture-of-experts families: ``MixtralForCausalLM``, ``Qwen3MoeForCausalLM``
and ``OlmoeForCausalLM``. Llama-shaped decoders (separate q/k/v with grouped-query attention,
RoPE, RMSNorm) whose MLP is a sparse MoE block ``model.layers.*.mlp``: a router ``gate`` and
fused experts ``experts.gate_up_proj [E, 2I, H]`` / ``experts.down_proj [E, H, I]`` (transformers
5's layout; the state-dict keys stay theirs). Expert parallelism shards those blocks
(:mod:`behemoth.parallel.expert`); Qwen3-MoE's ``mlp_only_layers`` keep a dense MLP, which the
pattern also matches and expert parallelism leaves alone.

Their configs' ``base_model_tp_plan`` shard the experts in ways behemoth has no role for, so
the plans below are the families' own (attention and embeddings; Qwen3-MoE's also has Llama's
dense-MLP entries for its ``mlp_only_layers``, which a model without such layers drops:
:func:`behemoth.parallel.expert.dense_tensor_plan`). Their attentions normalise q
and k after the projections, which 1D tensor parallelism splits by heads: Qwen3-MoE's ``q_norm`` /
``k_norm`` act per head (``head_norm``: every rank normalises its own heads with the whole weight,
whose gradient is summed over tp); OLMoE's act on the whole q / k projection (``colwise_norm``:
the weight split with the projection's features, the mean square of the whole width summed over
tp)."""

from __future__ import annotations

from .hf_llama import HF_LLAMA
from .spec import ModelSpec, PipelineLayout, TransformerShape


def _shape(expert_width: str):
    def shape(c) -> TransformerShape:
        return TransformerShape(
            hidden=c.hidden_size,
            ffn_hidden=getattr(c, expert_width),
            num_layers=c.num_hidden_layers,
            num_heads=c.num_attention_heads,
            num_kv_heads=getattr(c, "num_key_value_heads", None) or c.num_attention_heads,
            vocab_size=c.vocab_size,
            norm_params=c.hidden_size,
            linear_bias=bool(getattr(c, "attention_bias", False)),
            gated_mlp=True,
            rms_norm=True,
        )

    return shape


# transformers Llama's plan without its dense MLP: the MoE block is left to the expert style
TP_PLAN = {pattern: role for pattern, role in HF_LLAMA.tp_plan.items() if ".mlp." not in pattern}


def _family(
    name: str,
    model_class: str,
    config_class: str,
    expert_width: str,
    qk_norm: str | None = None,
    dense_mlps: bool = False,
):
    """``qk_norm``: the role of the attention's ``q_norm`` / ``k_norm`` (None: it has none);
    ``dense_mlps``: some layers may keep a dense MLP (Qwen3-MoE's ``mlp_only_layers``), split as
    Llama's."""
    norms = {f"model.layers.*.self_attn.{n}": qk_norm for n in ("q_norm", "k_norm")} if qk_norm else {}
    mlps = {p: r for p, r in HF_LLAMA.tp_plan.items() if ".mlp." in p} if dense_mlps else {}
    return ModelSpec(
        name=f"transformers {name}",
        classes=(f"transformers.{model_class}",),
        config_classes=(f"transformers.{config_class}",),
        blocks="model.layers",
        tp_plan={**TP_PLAN, **mlps, **norms},
        attention="model.layers.*.self_attn",
        pipeline=PipelineLayout(
            pre=("model.embed_tokens",),
            blocks="model.layers",
            post=("model.norm", "lm_head"),
            shared=("model.rotary_emb",),
            tied=(("model.embed_tokens.weight", "lm_head.weight"),),
        ),
        shape=_shape(expert_width),
        max_seq_len=lambda c: c.max_position_embeddings,
        experts="model.layers.*.mlp",
    )


HF_MIXTRAL = _family("Mixtral", "MixtralForCausalLM", "MixtralConfig", "intermediate_size")
HF_QWEN3_MOE = _family(
    "Qwen3-MoE", "Qwen3MoeForCausalLM", "Qwen3MoeConfig", "moe_intermediate_size", "head_norm", dense_mlps=True
)
HF_OLMOE = _family("OLMoE", "OlmoeForCausalLM", "OlmoeConfig", "intermediate_size", "colwise_norm")

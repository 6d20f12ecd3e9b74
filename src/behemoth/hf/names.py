"""Tensor names and layouts of transformers checkpoints, per model family.

A :class:`Layout` maps each tensor of a behemoth model's state dict (its serial names) to the
tensor transformers' ``save_pretrained`` writes for the same weights, and says how the two
differ:

* behemoth ``GPT`` -> ``GPT2LMHeadModel``: ``wte`` -> ``transformer.wte``, ``blocks.N`` ->
  ``transformer.h.N``, ``attn.qkv`` -> ``attn.c_attn`` ... Every Linear of a block is a
  transformers ``Conv1D`` there, whose weight is stored ``[in, out]``: the transpose of
  ``nn.Linear``'s ``[out, in]``. The fused q/k/v rows keep their order (``[q | k | v]``, each by
  head), so ``c_attn`` is exactly ``qkv``'s transpose.
* behemoth ``Llama`` -> ``LlamaForCausalLM``: renames only. behemoth's RoPE pairs channel ``i``
  with ``i + D/2`` (``models/llama.py``: the rotate-half convention), which is transformers'
  ``rotate_half``, so q and k rows need no permutation (tests/unit/test_models.py pins it).
* behemoth ``Llama`` with experts in every block (Mixtral's routing: softmax, top-k weights
  renormalised) -> ``MixtralForCausalLM``: the Llama renames, the router
  ``layers.N.mlp.router`` -> ``model.layers.N.block_sparse_moe.gate``.
* transformers' own ``GPT2LMHeadModel`` / ``LlamaForCausalLM`` trained under behemoth: their
  own names, unchanged; ``MixtralForCausalLM``, ``Qwen3MoeForCausalLM``, ``OlmoeForCausalLM``:
  their own names but for the experts (and Mixtral's ``mlp`` -> ``block_sparse_moe``).

Experts. behemoth and transformers 5 hold each MoE block's experts fused, ``gate_up_proj
[E, 2I, H]`` (gate rows, then up rows) and ``down_proj [E, H, I]``, but transformers'
``save_pretrained`` writes them one tensor per expert, as the families' published checkpoints
hold them: Mixtral ``experts.e.w1`` (gate), ``w3`` (up), ``w2`` (down); Qwen3-MoE and OLMoE
``experts.e.gate_proj``, ``up_proj``, ``down_proj``. :meth:`Layout.targets` splits a fused
tensor into those (:attr:`HFTensor.expert`, :attr:`HFTensor.chunk`); an import reads them back
(:mod:`.experts`), or the fused tensor itself where a checkpoint holds it (:meth:`Layout.fused_source`:
``model.layers.N.mlp.experts.gate_up_proj`` / ``down_proj``, the names of transformers 5's modules).

The embedding and the head have the vocabulary on dim 0, so a padded vocabulary is trimmed
there on export. With tied embeddings transformers stores the tensor once, under the
embedding's name; the head reads it back from there.

Pure: names and shapes only, no file access (tested in tests/unit/test_hf_layout.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["HFTensor", "Layout", "check_mixtral", "layout_for", "layout_for_config"]


@dataclass(frozen=True)
class HFTensor:
    """Where one behemoth tensor goes in a transformers checkpoint."""

    name: str
    """Its name in the transformers checkpoint."""
    transpose: bool = False
    """Stored as the transpose of behemoth's 2-D tensor (GPT-2's ``Conv1D`` weights)."""
    vocab_dim: int | None = None
    """The dim that indexes the vocabulary (trimmed to the exported vocabulary), or None."""
    expert: int | None = None
    """This tensor is expert ``expert`` (index on dim 0) of a fused ``[E, ...]`` tensor, or None."""
    chunk: tuple[int, int] | None = None
    """``(i, n)``: chunk i of n equal chunks of that expert's rows (gate_up: gate 0, up 1), or None."""

    def shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """Its shape, from the shape of behemoth's tensor (before any vocabulary trim)."""
        shape = tuple(shape)
        if self.expert is not None:
            shape = shape[1:]
        if self.chunk is not None:
            shape = (shape[0] // self.chunk[1],) + shape[1:]
        return tuple(reversed(shape)) if self.transpose else shape

    def take(self, t):
        """Its data, a view of behemoth's tensor ``t``."""
        if self.expert is not None:
            t = t[self.expert]
        if self.chunk is not None:
            t = t.chunk(self.chunk[1], 0)[self.chunk[0]]
        return t.t() if self.transpose else t


# (pattern over behemoth's name, template of the transformers name, transpose, vocab dim)
_GPT2_RULES = (
    (r"wte\.weight", "transformer.wte.weight", False, 0),
    (r"wpe\.weight", "transformer.wpe.weight", False, None),
    (r"blocks\.(\d+)\.(ln_1|ln_2)\.(weight|bias)", r"transformer.h.\1.\2.\3", False, None),
    (r"blocks\.(\d+)\.attn\.qkv\.weight", r"transformer.h.\1.attn.c_attn.weight", True, None),
    (r"blocks\.(\d+)\.attn\.qkv\.bias", r"transformer.h.\1.attn.c_attn.bias", False, None),
    (r"blocks\.(\d+)\.attn\.proj\.weight", r"transformer.h.\1.attn.c_proj.weight", True, None),
    (r"blocks\.(\d+)\.attn\.proj\.bias", r"transformer.h.\1.attn.c_proj.bias", False, None),
    (r"blocks\.(\d+)\.mlp\.fc\.weight", r"transformer.h.\1.mlp.c_fc.weight", True, None),
    (r"blocks\.(\d+)\.mlp\.fc\.bias", r"transformer.h.\1.mlp.c_fc.bias", False, None),
    (r"blocks\.(\d+)\.mlp\.proj\.weight", r"transformer.h.\1.mlp.c_proj.weight", True, None),
    (r"blocks\.(\d+)\.mlp\.proj\.bias", r"transformer.h.\1.mlp.c_proj.bias", False, None),
    (r"ln_f\.(weight|bias)", r"transformer.ln_f.\1", False, None),
    (r"lm_head\.weight", "lm_head.weight", False, 0),
)

_LLAMA_BLOCK = {
    "attn_norm": "input_layernorm",
    "mlp_norm": "post_attention_layernorm",
    "attn.q": "self_attn.q_proj",
    "attn.k": "self_attn.k_proj",
    "attn.v": "self_attn.v_proj",
    "attn.o": "self_attn.o_proj",
    "mlp.gate": "mlp.gate_proj",
    "mlp.up": "mlp.up_proj",
    "mlp.down": "mlp.down_proj",
}
_LLAMA_RULES = (
    (r"embed\.weight", "model.embed_tokens.weight", False, 0),
    *(
        (rf"layers\.(\d+)\.{re.escape(ours)}\.weight", rf"model.layers.\1.{theirs}.weight", False, None)
        for ours, theirs in _LLAMA_BLOCK.items()
    ),
    (r"norm\.weight", "model.norm.weight", False, None),
    (r"lm_head\.weight", "lm_head.weight", False, 0),
)
# behemoth's Llama with experts in every block, as Mixtral
_LLAMA_MOE_RULES = (
    *_LLAMA_RULES,
    (r"layers\.(\d+)\.mlp\.router\.weight", r"model.layers.\1.block_sparse_moe.gate.weight", False, None),
)
_MIXTRAL_EXPERTS = r"model.layers.\1.block_sparse_moe.experts.{e}"
_LLAMA_MOE_EXPERTS = (
    (r"layers\.(\d+)\.mlp\.gate_up_proj", (_MIXTRAL_EXPERTS + ".w1.weight", _MIXTRAL_EXPERTS + ".w3.weight")),
    (r"layers\.(\d+)\.mlp\.down_proj", (_MIXTRAL_EXPERTS + ".w2.weight",)),
)
# transformers' MoE families: their own names, but for the experts (and Mixtral's block name)
_HF_MOE_RULES = (
    (r"model\.embed_tokens\.weight", "model.embed_tokens.weight", False, 0),
    (r"lm_head\.weight", "lm_head.weight", False, 0),
    (r"(.+)", r"\1", False, None),
)
_HF_MIXTRAL_RULES = (
    (r"model\.layers\.(\d+)\.mlp\.gate\.weight", r"model.layers.\1.block_sparse_moe.gate.weight", False, None),
    *_HF_MOE_RULES,
)
_HF_MIXTRAL_EXPERTS = (
    (r"model\.layers\.(\d+)\.mlp\.experts\.gate_up_proj", _LLAMA_MOE_EXPERTS[0][1]),
    (r"model\.layers\.(\d+)\.mlp\.experts\.down_proj", _LLAMA_MOE_EXPERTS[1][1]),
)
_HF_EXPERTS = r"model.layers.\1.mlp.experts.{e}"
# names under transformers 5's own modules (experts fused, Mixtral's block as ``mlp``), where a checkpoint
# written without save_pretrained's per-expert conversion holds them (transformers' from_pretrained reads both)
_LLAMA_MOE_FUSED = (
    (r"layers\.(\d+)\.mlp\.(gate_up_proj|down_proj)", r"model.layers.\1.mlp.experts.\2"),
    (r"layers\.(\d+)\.mlp\.router\.weight", r"model.layers.\1.mlp.gate.weight"),
)
_HF_MOE_FUSED = ((r"(model\.layers\.\d+\.mlp\.(?:experts\.gate_up_proj|experts\.down_proj|gate\.weight))", r"\1"),)
_HF_MOE_EXPERTS = (  # Qwen3-MoE, OLMoE
    (
        r"model\.layers\.(\d+)\.mlp\.experts\.gate_up_proj",
        (_HF_EXPERTS + ".gate_proj.weight", _HF_EXPERTS + ".up_proj.weight"),
    ),
    (r"model\.layers\.(\d+)\.mlp\.experts\.down_proj", (_HF_EXPERTS + ".down_proj.weight",)),
)


@dataclass(frozen=True)
class Layout:
    """One family's transformers checkpoint layout (see the module docstring)."""

    architecture: str
    """transformers' class name, written to ``config.json``'s ``architectures``."""
    model_type: str
    """transformers' ``model_type`` ("gpt2", "llama")."""
    embedding: str
    """behemoth's name of the token embedding (the tied head's partner)."""
    tied: bool
    """Whether the head is the embedding (stored once, under the embedding's name)."""
    rules: tuple | None = None
    """``(pattern, template, transpose, vocab dim)`` per tensor; None: names unchanged."""
    head: str = "lm_head.weight"
    """behemoth's name of the output head's weight."""
    experts: tuple = ()
    """``(pattern, templates)`` per fused expert tensor: each expert e (``{e}`` in a template)
    becomes one tensor per template, the expert's rows cut in ``len(templates)`` chunks."""
    fused: tuple = ()
    """``(pattern, template)``: behemoth's tensor's name in a checkpoint written under transformers
    5's own module names (the experts fused ``[E, ...]`` as behemoth holds them, Mixtral's router
    as ``mlp.gate``), where it differs from what ``save_pretrained`` writes; an import reads it
    there when the checkpoint holds that name."""

    def targets(self, name: str, shape: tuple[int, ...]) -> list[HFTensor]:
        """The transformers tensors behemoth's tensor ``name`` (of ``shape``) is written as: one,
        or one per expert (and chunk) of a fused expert tensor."""
        for pattern, templates in self.experts:
            if re.fullmatch(pattern, name):
                n = len(templates)
                return [
                    HFTensor(
                        re.sub(pattern, template, name).replace("{e}", str(e)),
                        expert=e,
                        chunk=(i, n) if n > 1 else None,
                    )
                    for e in range(shape[0])
                    for i, template in enumerate(templates)
                ]
        return [self.tensor(name)]

    def is_experts(self, name: str) -> bool:
        """Whether behemoth's tensor ``name`` holds every expert of a mixture-of-experts block."""
        return any(re.fullmatch(pattern, name) for pattern, _ in self.experts)

    def fused_source(self, name: str) -> str | None:
        """behemoth's tensor ``name`` under transformers 5's module names (:attr:`fused`; a fused
        expert tensor held whole, ``[E, ...]``), or None when the family has no other name for it."""
        for pattern, template in self.fused:
            if re.fullmatch(pattern, name):
                return re.sub(pattern, template, name)
        return None

    def tensor(self, name: str) -> HFTensor:
        """Where behemoth's tensor ``name`` goes; a ValueError for a tensor the family lacks
        (or a fused expert tensor, which goes to many: :meth:`targets`)."""
        if any(re.fullmatch(pattern, name) for pattern, _ in self.experts):
            raise ValueError(
                f"tensor {name!r} holds every expert of a mixture-of-experts block, which transformers' "
                f"{self.architecture} checkpoints store one tensor per expert: Layout.targets lists them (export "
                f"writes them, behemoth.hf.experts reads them back)."
            )
        if self.rules is None:
            vocab = 0 if name in (self.embedding, self.head) else None
            return HFTensor(name, vocab_dim=vocab)
        for pattern, template, transpose, vocab in self.rules:
            if re.fullmatch(pattern, name):
                return HFTensor(re.sub(pattern, template, name), transpose, vocab)
        raise ValueError(
            f"tensor {name!r} has no place in transformers' {self.architecture} (a mixture-of-experts layer or a "
            f"module the family does not have); export supports {self.architecture}'s own tensors only."
        )

    def exported(self, names) -> list[str]:
        """behemoth's names of the tensors an export writes, in order: the tied head left out."""
        return [n for n in names if not (self.tied and n == self.head)]

    def source(self, name: str) -> HFTensor:
        """The transformers tensor an import reads for behemoth's ``name`` (a tied head reads the
        embedding, as transformers stores it once)."""
        return self.tensor(self.embedding if self.tied and name == self.head else name)


_HF_ARCHITECTURES = {
    "gpt2": "GPT2LMHeadModel",
    "llama": "LlamaForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
}
_HF_EMBEDDINGS = {
    "GPT2LMHeadModel": "transformer.wte.weight",
    **{arch: "model.embed_tokens.weight" for key, arch in _HF_ARCHITECTURES.items() if key != "gpt2"},
}


def layout_for_config(config) -> Layout:
    """The layout of a model built from ``config``: behemoth's ``GPTConfig`` / ``LlamaConfig``
    or transformers' ``GPT2Config`` / ``LlamaConfig``."""
    from behemoth.models import GPTConfig, LlamaConfig

    if isinstance(config, GPTConfig):
        if not config.bias:
            raise ValueError(
                "GPTConfig.bias=False: transformers' GPT2LMHeadModel always has biases, so this GPT has no "
                "transformers layout; train with bias=True to export it."
            )
        return Layout("GPT2LMHeadModel", "gpt2", "wte.weight", config.tie_embeddings, _GPT2_RULES)
    if isinstance(config, LlamaConfig):
        if config.num_experts:
            check_mixtral(config)
            return Layout(
                "MixtralForCausalLM",
                "mixtral",
                "embed.weight",
                config.tie_embeddings,
                _LLAMA_MOE_RULES,
                experts=_LLAMA_MOE_EXPERTS,
                fused=_LLAMA_MOE_FUSED,
            )
        return Layout("LlamaForCausalLM", "llama", "embed.weight", config.tie_embeddings, _LLAMA_RULES)
    model_type = getattr(config, "model_type", None)
    arch = _HF_ARCHITECTURES.get(model_type)
    if arch is None:
        raise ValueError(
            f"{type(config).__name__} (model_type {model_type!r}) has no transformers layout in behemoth; "
            f"supported: behemoth GPT and Llama (dense, or with Mixtral's experts), transformers GPT-2, Llama, "
            f"Mixtral, Qwen3-MoE and OLMoE."
        )
    tied = bool(getattr(config, "tie_word_embeddings", False))
    if model_type == "mixtral":
        return Layout(
            arch,
            model_type,
            _HF_EMBEDDINGS[arch],
            tied,
            _HF_MIXTRAL_RULES,
            experts=_HF_MIXTRAL_EXPERTS,
            fused=_HF_MOE_FUSED,
        )
    if model_type in ("qwen3_moe", "olmoe"):
        return Layout(
            arch, model_type, _HF_EMBEDDINGS[arch], tied, _HF_MOE_RULES, experts=_HF_MOE_EXPERTS, fused=_HF_MOE_FUSED
        )
    return Layout(arch, model_type, _HF_EMBEDDINGS[arch], tied)


def check_mixtral(config) -> None:
    """A behemoth ``LlamaConfig`` with experts computes what ``MixtralForCausalLM`` does only with
    experts in every block, softmax scores, the top-k weights renormalised, no capacity, no
    balancing bias and no shared expert; raise otherwise, naming the field."""
    rules = (
        ("moe_every", config.moe_every == 1, "1 (Mixtral has experts in every block)"),
        ("router_score_func", config.router_score_func == "softmax", "'softmax'"),
        ("router_norm_topk", config.router_norm_topk, "True (Mixtral renormalises the top-k weights)"),
        ("expert_capacity_factor", config.expert_capacity_factor is None, "None (Mixtral drops no token)"),
        ("router_bias_update_rate", config.router_bias_update_rate == 0, "0 (Mixtral has no balancing bias)"),
        ("shared_expert_ffn_hidden", config.shared_expert_ffn_hidden == 0, "0 (Mixtral has no shared expert)"),
    )
    for field, ok, need in rules:
        if not ok:
            raise ValueError(
                f"LlamaConfig.{field}={getattr(config, field)!r}: a mixture-of-experts Llama exports as "
                f"transformers' MixtralForCausalLM, which needs {need}; this model has no transformers layout."
            )


def layout_for(model) -> Layout:
    """The layout of ``model`` (serial or parallelized), read from its ``config``."""
    config = getattr(model, "config", None)
    if config is None:
        raise ValueError(
            f"{type(model).__name__} has no config; transformers export and import know behemoth's GPT and Llama "
            f"and transformers' GPT2LMHeadModel, LlamaForCausalLM and (export only) its MoE families."
        )
    return layout_for_config(config)

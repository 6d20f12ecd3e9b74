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
* transformers' own ``GPT2LMHeadModel`` / ``LlamaForCausalLM`` trained under behemoth: their
  own names, unchanged.

The embedding and the head have the vocabulary on dim 0, so a padded vocabulary is trimmed
there on export. With tied embeddings transformers stores the tensor once, under the
embedding's name; the head reads it back from there.

Pure: names and shapes only, no file access (tested in tests/unit/test_hf_layout.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["HFTensor", "Layout", "layout_for", "layout_for_config"]


@dataclass(frozen=True)
class HFTensor:
    """Where one behemoth tensor goes in a transformers checkpoint."""

    name: str
    """Its name in the transformers checkpoint."""
    transpose: bool = False
    """Stored as the transpose of behemoth's 2-D tensor (GPT-2's ``Conv1D`` weights)."""
    vocab_dim: int | None = None
    """The dim that indexes the vocabulary (trimmed to the exported vocabulary), or None."""


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

    def tensor(self, name: str) -> HFTensor:
        """Where behemoth's tensor ``name`` goes; a ValueError for a tensor the family lacks."""
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


_HF_EMBEDDINGS = {"GPT2LMHeadModel": "transformer.wte.weight", "LlamaForCausalLM": "model.embed_tokens.weight"}


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
            raise ValueError(
                f"LlamaConfig.num_experts={config.num_experts}: mixture-of-experts Llama models have no "
                f"LlamaForCausalLM layout (export supports dense GPT and Llama models)."
            )
        return Layout("LlamaForCausalLM", "llama", "embed.weight", config.tie_embeddings, _LLAMA_RULES)
    model_type = getattr(config, "model_type", None)
    arch = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM"}.get(model_type)
    if arch is None:
        raise ValueError(
            f"{type(config).__name__} (model_type {model_type!r}) has no transformers layout in behemoth; "
            f"supported: behemoth GPT and Llama, transformers GPT-2 and Llama."
        )
    tied = bool(getattr(config, "tie_word_embeddings", False))
    return Layout(arch, model_type, _HF_EMBEDDINGS[arch], tied)


def layout_for(model) -> Layout:
    """The layout of ``model`` (serial or parallelized), read from its ``config``."""
    config = getattr(model, "config", None)
    if config is None:
        raise ValueError(
            f"{type(model).__name__} has no config; transformers export and import know behemoth's GPT and Llama "
            f"and transformers' GPT2LMHeadModel and LlamaForCausalLM."
        )
    return layout_for_config(config)

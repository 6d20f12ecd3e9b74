"""One description per model family (:class:`ModelSpec`), looked up by class.

Known families, one file each: behemoth's ``GPT`` (:mod:`.gpt`) and ``Llama`` (:mod:`.llama`),
transformers' ``GPT2LMHeadModel`` (:mod:`.hf_gpt2`), ``LlamaForCausalLM`` (:mod:`.hf_llama`) and
the mixture-of-experts families ``MixtralForCausalLM``, ``Qwen3MoeForCausalLM`` and
``OlmoeForCausalLM`` (:mod:`.hf_moe`, one shared file: they differ only in names). :func:`spec_for` walks the model's MRO, so a subclass of ``GPT`` is a
GPT. **A new family** is one file defining a ``ModelSpec`` and one line in :data:`SPECS`.

**Your own model** needs no spec for data, ZeRO or context parallelism; for tensor
parallelism pass a plan of the same form, ``bh.boost(model, opt, plan,
tp_policy={"layers.*.attn.wq": "colwise", ...})``. Roles (shared by every tensor-parallel
mode; ``behemoth.parallel.tensor`` maps each to a style class per mode):

==================  ===============================================================
role                module
==================  ===============================================================
``colwise``         Linear/Conv1D whose output features are split (q, k, v, fc, gate, up)
``colwise_fused3``  one Linear/Conv1D computing ``[q; k; v]``, split per part
``rowwise``         Linear/Conv1D whose input features are split (attention out, MLP down)
``norm``            LayerNorm / RMSNorm
``colwise_norm``    a norm over the whole output of colwise projections (OLMoE's q/k norms)
``head_norm``       a norm over each head of colwise projections (Qwen3's q/k norms)
``embedding``       token embedding (vocabulary-parallel)
``pos_embedding``   learned position embedding
``head``            output projection to the vocabulary (vocabulary-parallel logits and loss)
``attention``       the attention module whose head counts become the local counts
==================  ===============================================================

Modules that no pattern names stay serial (replicated on every tensor-parallel rank).

Tested in tests/unit/test_specs.py.
"""

from __future__ import annotations

from .gpt import GPT
from .hf_gpt2 import HF_GPT2
from .hf_llama import HF_LLAMA
from .hf_moe import HF_MIXTRAL, HF_OLMOE, HF_QWEN3_MOE
from .llama import LLAMA
from .spec import ModelSpec, PipelineLayout, TransformerShape

__all__ = [
    "SPECS",
    "TP_ROLES",
    "ModelSpec",
    "PipelineLayout",
    "TransformerShape",
    "find_spec",
    "known_classes",
    "max_seq_len_of",
    "shape_of",
    "spec_for",
    "tensor_plan",
    "transformer_blocks",
    "transformer_blocks_name",
]

SPECS: tuple[ModelSpec, ...] = (GPT, LLAMA, HF_GPT2, HF_LLAMA, HF_MIXTRAL, HF_QWEN3_MOE, HF_OLMOE)
"""Every known family; :func:`find_spec` searches them."""

TP_ROLES = (
    "colwise",
    "colwise_fused3",
    "rowwise",
    "norm",
    "colwise_norm",
    "head_norm",
    "embedding",
    "pos_embedding",
    "head",
    "attention",
)

# transformers' tensor-parallel style names (``config.base_model_tp_plan``) -> behemoth roles.
_TRANSFORMERS_STYLES = {
    "colwise": "colwise",
    "local_colwise": "colwise",
    "rowwise": "rowwise",
    "local_rowwise": "rowwise",
}


def _class_key(cls: type) -> str:
    return f"{cls.__module__.partition('.')[0]}.{cls.__name__}"


def _lookup(cls: type, field: str) -> ModelSpec | None:
    for base in cls.__mro__:
        key = _class_key(base)
        for spec in SPECS:
            if key in getattr(spec, field):
                return spec
    return None


def known_classes() -> str:
    """The model classes :data:`SPECS` describes, for error messages."""
    return ", ".join(c for s in SPECS for c in s.classes)


def find_spec(model) -> ModelSpec | None:
    """The spec of ``model``'s class or of its nearest base class that has one; None if none."""
    return _lookup(type(model), "classes")


def spec_for(model) -> ModelSpec:
    """:func:`find_spec`, or a ``ValueError`` that says how to add the family."""
    spec = find_spec(model)
    if spec is None:
        raise ValueError(
            f"no ModelSpec describes {type(model).__name__} (nor any of its base classes); known: {known_classes()}. "
            f"Add a file to behemoth/specs/ defining a ModelSpec (blocks, tp_plan, attention, pipeline, shape) "
            f"and a line in behemoth.specs.SPECS, or pass tp_policy={{module-name pattern: role}} to bh.boost."
        )
    return spec


def _config_spec(config) -> ModelSpec:
    spec = _lookup(type(config), "config_classes")
    if spec is None:
        known = ", ".join(c for s in SPECS for c in s.config_classes)
        raise ValueError(
            f"no ModelSpec reads a {type(config).__name__}; known configs: {known}. Build a TransformerShape "
            f"by hand, or add the family to behemoth.specs.SPECS."
        )
    return spec


def shape_of(config) -> TransformerShape:
    """The :class:`TransformerShape` of a known family's config (behemoth's ``GPTConfig`` /
    ``LlamaConfig``, transformers' ``GPT2Config`` / ``LlamaConfig``, or a subclass)."""
    return _config_spec(config).shape(config)


def max_seq_len_of(config) -> int:
    """The longest sequence a known family's config allows (``seq_len``, ``n_positions``, ...)."""
    return _config_spec(config).max_seq_len(config)


def tensor_plan(model) -> dict[str, str] | None:
    """``{module-name pattern: role}`` for ``model``'s family, or None for an unknown class.

    For a family with ``config_tp_plan`` whose config carries ``base_model_tp_plan``,
    transformers' own colwise/rowwise entries replace the spec's (prefixed with
    ``model.base_model_prefix``); an entry whose style has no behemoth role is an error."""
    spec = find_spec(model)
    if spec is None:
        return None
    plan = dict(spec.tp_plan)
    theirs = getattr(getattr(model, "config", None), "base_model_tp_plan", None) if spec.config_tp_plan else None
    if not theirs:
        return plan
    prefix = getattr(model, "base_model_prefix", "")
    prefix = f"{prefix}." if prefix and hasattr(getattr(model, prefix, None), "named_modules") else ""
    plan = {k: v for k, v in plan.items() if v not in ("colwise", "colwise_fused3", "rowwise")}
    for pattern, style in theirs.items():
        role = _TRANSFORMERS_STYLES.get(style)
        if role is None:
            raise ValueError(
                f"{type(model).__name__}.config.base_model_tp_plan[{pattern!r}] = {style!r} has no behemoth "
                f"tensor-parallel role (known: {', '.join(sorted(_TRANSFORMERS_STYLES))}); pass "
                f"tp_policy={{module-name pattern: role}} to bh.boost instead."
            )
        plan[prefix + pattern] = role
    return plan


def transformer_blocks(model):
    """The ``nn.ModuleList`` of transformer blocks of ``model``.

    Known families use their spec; for any other model the single largest ``nn.ModuleList``
    (by parameter count) is taken, and a model with none is an error."""
    from torch import nn

    spec = find_spec(model)
    if spec is not None:
        return model.get_submodule(spec.blocks)
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    if not lists:
        raise ValueError(
            f"{type(model).__name__} has no nn.ModuleList of blocks; activation checkpointing and sequence "
            f"parallelism need one (or describe the family in behemoth/specs/ and add it to behemoth.specs.SPECS)."
        )
    return max(lists, key=lambda m: sum(p.numel() for p in m.parameters()))


def transformer_blocks_name(model) -> str:
    """The dotted module name of :func:`transformer_blocks` (for "is this module inside a block")."""
    blocks = transformer_blocks(model)
    return next(name for name, m in model.named_modules() if m is blocks)

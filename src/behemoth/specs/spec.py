"""What behemoth needs to know about a model family, written once per family.

A :class:`ModelSpec` names the modules of one architecture (its block list, its tensor plan,
its attention modules, where its parts go in a pipeline) and reads its config into a
:class:`TransformerShape` (what the cost and traffic formulas depend on). Pure data: no torch,
no process group; ``behemoth.specs`` looks a model's spec up by class.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class TransformerShape:
    """What the cost and traffic of a decoder-only transformer depend on."""

    hidden: int
    """Model width h."""
    ffn_hidden: int
    """MLP inner width f."""
    num_layers: int
    """Transformer blocks L."""
    num_heads: int
    """Query heads N."""
    num_kv_heads: int
    """Key/value heads K (K == N without grouped-query attention)."""
    vocab_size: int
    """Vocabulary V."""
    norm_params: int
    """Parameters of one norm: 2h for LayerNorm with bias, h for RMSNorm."""
    linear_bias: bool
    """Whether the block's Linears have biases (GPT-2: yes; Llama: no)."""
    fused_qkv: bool = False
    """q, k and v computed by one Linear (GPT-2) rather than three (Llama): 2D broadcasts X once."""
    gated_mlp: bool = False
    """SwiGLU MLP (Llama): gate and up Linears both read X."""
    rms_norm: bool = False
    """RMSNorm (one statistic per token) rather than LayerNorm (two)."""
    max_positions: int = 0
    """Rows of a learned position table (GPT-2); 0 for none (RoPE)."""

    @property
    def head_dim(self) -> int:
        return self.hidden // self.num_heads


@dataclass(frozen=True, kw_only=True)
class PipelineLayout:
    """Where a model's parts go in a pipeline (module names as in ``named_modules()``)."""

    pre: tuple[str, ...]
    """Modules that run before the blocks, on the first stage (embeddings, input dropout)."""
    blocks: str
    """The ``nn.ModuleList`` of transformer blocks, split across stages."""
    post: tuple[str, ...]
    """Modules that run after the blocks, on the last stage (final norm, head)."""
    shared: tuple[str, ...] = ()
    """Parameter-free helpers every stage needs (rotary embedding tables)."""
    tied: tuple[tuple[str, str], ...] = ()
    """Parameter pairs that *may* be one tensor (tied embeddings): the first on the first
    stage, the second on the last. Whether they are tied in a given model is decided by
    identity (``find_tied_parameters``); when they are and the two stages differ, each keeps a
    copy and their gradients are summed between the two ranks every step."""


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """One model family: the names of its parts and how to read its config."""

    name: str
    """What error messages call the family ("behemoth GPT", "transformers Llama")."""
    classes: tuple[str, ...]
    """Model classes it describes, as ``"<top-level package>.<class name>"``
    (``"behemoth.GPT"``, ``"transformers.LlamaForCausalLM"``); a subclass of one of them gets
    this spec too (the lookup walks the class's MRO)."""
    config_classes: tuple[str, ...]
    """Config classes :attr:`shape` reads, named the same way (``"transformers.LlamaConfig"``)."""
    blocks: str
    """Dotted name of the ``nn.ModuleList`` of transformer blocks (activation checkpointing
    wraps each one; sequence parallelism and pipeline stages cut between them)."""
    tp_plan: Mapping[str, str]
    """The tensor-parallel plan, ``{module-name pattern: role}`` (roles: ``behemoth.specs.TP_ROLES``)."""
    attention: str
    """Pattern (``fnmatch`` over ``named_modules()`` names) of the attention modules."""
    pipeline: PipelineLayout
    """Which modules go before, between and after the blocks in a pipeline."""
    shape: Callable[[object], TransformerShape]
    """The family's config (an instance of one of :attr:`config_classes`) -> its shape."""
    max_seq_len: Callable[[object], int]
    """The family's config -> the longest sequence the model takes (its default for cost estimates)."""
    experts: str | None = None
    """Pattern of the family's mixture-of-experts blocks (transformers' sparse MoE blocks, which
    expert parallelism shards); a dense module it also matches is left alone. None: no MoE
    blocks (behemoth's own MoE layers are found by class)."""
    config_tp_plan: bool = False
    """Take the plan's ``colwise`` / ``rowwise`` entries from the model's own
    ``config.base_model_tp_plan`` (transformers' styles, relative to ``model.base_model_prefix``)
    where the config carries one; :attr:`tp_plan` still gives the other roles and is the
    fallback."""

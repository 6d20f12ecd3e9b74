"""Context parallelism as a style: context-parallel attention plugged into a model's attention
modules, without rewriting its forward.

A serial decoder computes everything but attention token by token, so under context
parallelism every rank can run the model's own code on its share of the sequence
(:func:`~behemoth.parallel.context.split_sequence`) as long as two things change:

* **attention** sees the whole sequence: the model's core causal attention call is replaced
  by :func:`~behemoth.parallel.context.context_attention` over the mesh's ``cp`` axis
  (Ulysses or ring, ``Plan.cp_mode``) -- the style :class:`ContextParallelAttention`, applied
  to each attention module;
* **positions** are global: the model is given ``position_ids`` of its local tokens
  (:func:`~behemoth.parallel.context.position_ids_for`), so a learned position table
  embeds each rank's own positions and RoPE rotates by global positions -- the record
  :class:`ContextParallelized` that :func:`parallelize_context` returns splits each batch.

How the style plugs attention in, per kind of attention module (no model code is copied or
rewritten):

===========================  ===========================================================
module                       seam
===========================  ===========================================================
behemoth's GPT / Llama (or   the module's ``attention_fn`` attribute, called like
any module with an           ``F.scaled_dot_product_attention`` (its default): set, on
``attention_fn``)            the instance, to a :class:`~.attention.ContextSDPA`
transformers attention       transformers' attention-interface registry: one function,
                             ``behemoth_context_parallel``, registered in
                             ``AttentionInterface``; the module's config's
                             ``_attn_implementation`` is set to it (transformers picks the
                             function by config, so every module sharing that config
                             switches: apply the style to all of them) and the module carries
                             its :class:`~.attention.ContextSDPA` (transformers builds no mask
                             for an implementation it does not know, so the call gets none)
===========================  ===========================================================

The engine (``engine.py``) asks the returned :class:`ContextParallelized` to check each
batch (sequence length vs ``cp``, on every rank before any collective), to split each
micro-batch along dim 1, and for the model keyword that carries the position ids; it sums
loss, token counts and gradients over the ``dp_cp`` axis.

Validated by :func:`parallelize_context`, on every rank, before anything changes: the model
has attention modules and a position-ids argument, Ulysses' head split (the heads a
tensor-parallel rank holds, ``num_heads / head_parts(plan)``, divisible by ``cp``), no attention
dropout (the cores have none), no cross-attention.

Composes with every tensor-parallel mode: 1D splits the heads over tp; 2D, 2.5D and 3D split
the heads over the grid side and the rows over the other grid axes, so each rank's attention is
local to its heads and rows and the cores run over ``cp`` inside each grid position. Under
pipelines every stage runs the same share of the sequence.

Tested in ``tests/dist/test_context_parallel.py`` (whole models against serial training) and
``tests/dist/test_compositions.py`` (with 2D, 2.5D and 3D tensor parallelism and pipelines).
"""

from __future__ import annotations

import contextlib
import inspect
import math
from dataclasses import dataclass

import torch
from torch import nn

from ...comm import Axis
from ...specs import find_spec, transformer_blocks_name
from ..style import apply_styles, match_plan
from .attention import CP_ATTENTION_IMPL, ContextSDPA, transformers_context_attention
from .layout import MODES, check_sequence, position_ids_for, split_sequence

_POSITION_KWARGS = ("position_ids", "position_ids_BS")


@dataclass(frozen=True)
class ContextParallelAttention:
    """The context-parallel style of one causal self-attention module.

    ``apply(module, mesh)`` makes the module's core attention
    :func:`~behemoth.parallel.context.context_attention` over
    ``mesh.axis('cp')`` in ``mode``'s layout (``'ulysses'`` or ``'ring'``); the module then
    takes this rank's share of the sequence (``[B, S/cp, ...]``) and returns its share.
    Parameters are untouched (replicated over ``cp``). No collective is issued here; the
    attention's own are those of the mode's core. Raises ``ValueError`` for a
    module that is not causal self-attention or has no attention seam (see the module
    docstring), before changing it."""

    mode: str = "ulysses"
    """``'ulysses'`` (all-to-all over heads) or ``'ring'`` (ring attention)."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"ContextParallelAttention(mode={self.mode!r}): the mode is one of {list(MODES)}.")

    def apply(self, module: nn.Module, mesh) -> nn.Module:
        kind = check_attention_module(module)
        sdpa = ContextSDPA(mesh.axis("cp"), self.mode)
        if kind == "seam":
            module._behemoth_plain_attention = module.__dict__.get("attention_fn")  # None: the class's
            module.attention_fn = sdpa
            return module
        from transformers import AttentionInterface

        AttentionInterface.register(CP_ATTENTION_IMPL, transformers_context_attention)
        module._behemoth_context_attention = sdpa
        config = module.config
        if config._attn_implementation != CP_ATTENTION_IMPL:  # the config is shared: the first module keeps it
            config._behemoth_plain_attention = config._attn_implementation
        config._attn_implementation = CP_ATTENTION_IMPL
        return module


@contextlib.contextmanager
def context_parallel_paused(model: nn.Module, attention: tuple[str, ...]):
    """The attention modules named ``attention`` (those :class:`ContextParallelAttention` styled)
    run their own attention again for the duration -- the model's, over whatever tokens this rank
    is given (generation: whole rows, a KV cache) -- and context-parallel attention after it."""
    names = set(attention)  # a pipeline stage holds some of them only
    modules = [m for n, m in model.named_modules() if n in names]
    seams = [m for m in modules if isinstance(m.__dict__.get("attention_fn"), ContextSDPA)]
    configs = {id(m.config): m.config for m in modules if hasattr(m, "_behemoth_context_attention")}
    styled = {id(m): m.__dict__["attention_fn"] for m in seams}
    try:
        for m in seams:
            plain = m._behemoth_plain_attention
            if plain is None:
                del m.__dict__["attention_fn"]
            else:
                m.attention_fn = plain
        for config in configs.values():
            config._attn_implementation = config._behemoth_plain_attention
        yield
    finally:
        for m in seams:
            m.attention_fn = styled[id(m)]
        for config in configs.values():
            config._attn_implementation = CP_ATTENTION_IMPL


def check_attention_module(module: nn.Module, name: str = "") -> str:
    """``'seam'`` for a module with an ``attention_fn``, ``'transformers'`` for a transformers
    causal self-attention module; ``ValueError`` (naming the module and the fix) otherwise. Pure."""
    label = f"{name} ({type(module).__name__})" if name else type(module).__name__
    if hasattr(module, "attention_fn"):
        return "seam"
    if hasattr(getattr(module, "config", None), "_attn_implementation") and hasattr(module, "is_causal"):
        if not module.is_causal or getattr(module, "is_cross_attention", False):
            raise ValueError(
                f"context parallelism: {label} is not causal self-attention "
                f"(cross-attention or bidirectional); only causal decoders are supported."
            )
        return "transformers"
    raise ValueError(
        f"context parallelism cannot plug its attention into {label}: it has no `attention_fn` "
        f"attribute (called like F.scaled_dot_product_attention; behemoth's models have one) and is not a "
        f"transformers attention module. Give it an `attention_fn = staticmethod(F.scaled_dot_product_attention)` "
        f"and call it."
    )


@dataclass
class ContextParallelized:
    """What :func:`parallelize_context` did, and the per-step work it leaves to the engine."""

    axis: Axis
    """The ``cp`` axis the sequence is split over."""
    mode: str
    """``'ulysses'`` (contiguous shares) or ``'ring'`` (zigzag shares)."""
    position_kwarg: str
    """The model's forward keyword that takes position ids (``position_ids``, ``position_ids_BS``)."""
    max_positions: int | None
    """The longest sequence the model accepts (a learned position table's rows), if known."""
    attention: tuple[str, ...]
    """Names of the attention modules that now run context-parallel attention."""

    def check_batch(self, batch) -> None:
        """Raise ``ValueError`` (identically on every rank, before any collective) unless
        ``batch`` is a dict whose ``input_ids`` ``[B, S]`` can be split ``cp`` ways."""
        cp = self.axis.size
        ids = batch.get("input_ids") if isinstance(batch, dict) else None
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
            raise ValueError(
                f"context parallelism (cp={cp}) splits batch['input_ids'] ([B, S]) along the sequence; "
                f"engine.step needs a dict with input_ids [B, S] (and tensors of the same [B, S, ...] "
                f"leading shape, such as labels, are split alike)."
            )
        seq = ids.shape[1]
        check_sequence(seq, cp, self.mode)
        if self.max_positions is not None and seq > self.max_positions:
            raise ValueError(
                f"context parallelism: the batch's sequence length {seq} exceeds the model's "
                f"{self.max_positions} positions; crop the batch or build the model with more positions."
            )

    def split(self, micro: dict) -> tuple[dict, dict]:
        """This rank's share of a micro-batch and the model's extra keyword arguments.

        Every tensor whose leading ``[B, S]`` equals ``input_ids``' is cut along dim 1 with
        :func:`split_sequence` (views or one concatenation; no communication); the keyword
        arguments carry the global position ids ``[1, S/cp]`` of the local tokens."""
        ids = micro["input_ids"]
        cp, rank = self.axis.size, self.axis.rank
        lead = tuple(ids.shape)
        local = {
            k: split_sequence(v, 1, cp, rank, self.mode)
            if isinstance(v, torch.Tensor) and v.dim() >= 2 and tuple(v.shape[:2]) == lead
            else v
            for k, v in micro.items()
        }
        positions = position_ids_for(lead[1], cp, rank, self.mode).to(ids.device).unsqueeze(0)
        return local, {self.position_kwarg: positions}


# ----------------------------------------------------------------------------- discovery (pure)
def _is_transformers(model: nn.Module) -> bool:
    return hasattr(getattr(model, "config", None), "_attn_implementation")


def _position_kwarg(model: nn.Module) -> str:
    params = inspect.signature(model.forward).parameters
    for name in _POSITION_KWARGS:
        if name in params:
            return name
    other = [n for n in params if n.startswith("position_ids")]
    if other:
        return other[0]
    raise ValueError(
        f"context parallelism: {type(model).__name__}.forward takes no position ids (looked for "
        f"{', '.join(_POSITION_KWARGS)}); each rank holds part of the sequence, so the model must be "
        f"told its tokens' global positions. Add a position_ids argument to the model's forward."
    )


def _attention_modules(model: nn.Module) -> list[str]:
    """Names of the model's attention modules: those with an ``attention_fn``, else (a
    transformers model) the modules named ``*Attention`` with ``is_causal`` inside its blocks."""
    seams = [n for n, m in model.named_modules() if hasattr(m, "attention_fn")]
    if seams:
        return seams
    if _is_transformers(model):
        blocks = transformer_blocks_name(model)
        found = [
            n
            for n, m in model.named_modules()
            if n.startswith(blocks + ".") and type(m).__name__.endswith("Attention") and hasattr(m, "is_causal")
        ]
        if found:
            return found
    raise ValueError(
        f"context parallelism cannot plug its attention into {type(model).__name__}: no module has an "
        f"`attention_fn` attribute (called like F.scaled_dot_product_attention; behemoth's models have "
        f"one) and it is not a transformers model with attention modules in its blocks. Give the "
        f"attention module an `attention_fn = staticmethod(F.scaled_dot_product_attention)` and call it."
    )


def _config_int(config, *names) -> int | None:
    for n in names:
        v = getattr(config, n, None)
        if isinstance(v, int) and not isinstance(v, bool):
            return v
    return None


def head_parts(plan) -> int:
    """How many ways tensor parallelism splits the attention heads, so that each rank's attention
    is local to its heads: ``tp`` under 1D, the grid side ``q`` under 2D (``tp = q*q``), 2.5D
    (``tp = d*q*q``) and 3D (``tp = q**3``), whose other grid axes split the batch. Pure."""
    if plan.tp_mode == "1d":
        return plan.tp
    if plan.tp_mode == "3d":
        return round(plan.tp ** (1 / 3))
    return math.isqrt(plan.tp // plan.tp_depth)


def _check_model(model: nn.Module, plan) -> int | None:
    """Pure checks of the serial model's config against the plan; returns the max positions."""
    cfg = getattr(model, "config", None)
    cp, tp = plan.cp, plan.tp
    if cfg is not None:
        for name in ("attn_pdrop", "attention_dropout", "dropout"):
            p = getattr(cfg, name, None)
            if isinstance(p, float) and p > 0:
                raise ValueError(
                    f"context parallelism has no attention dropout; the model's config has {name}={p}. "
                    f"Build the model with {name}=0.0."
                )
        if getattr(cfg, "add_cross_attention", False):
            raise ValueError(
                "context parallelism supports causal decoders only; the model has cross-attention "
                "(config.add_cross_attention=True)."
            )
        n = _config_int(cfg, "num_attention_heads", "num_heads", "n_head")
        parts = head_parts(plan)
        if plan.cp_mode == "ulysses" and n is not None:
            local = n // parts if n % parts == 0 else None
            if local is not None and local % cp:
                per = f" ({local} per tensor-parallel rank with tp={tp}, tp_mode={plan.tp_mode!r})" if tp > 1 else ""
                raise ValueError(
                    f"cp_mode='ulysses' splits attention heads over cp; got num_heads={n}{per}, cp={cp} "
                    f"(remainder {local % cp}). Use a cp that divides {local}, or cp_mode='ring'."
                )
    return _config_int(cfg, "seq_len", "n_positions") if cfg is not None else None


# ----------------------------------------------------------------------------- apply
def parallelize_context(model: nn.Module, mesh, plan, *, attention: str | None = None) -> ContextParallelized:
    """Apply :class:`ContextParallelAttention` (``plan.cp_mode``, over ``mesh.axis('cp')``) to
    every attention module of ``model``, in place, and return the record the engine splits
    batches with.

    ``attention`` is the ``fnmatch`` pattern of the attention modules (``"blocks.*.attn"``);
    ``None`` takes the pattern of the model family's :class:`~behemoth.specs.ModelSpec`, and
    for a model no spec describes finds them (modules with an ``attention_fn``, or a
    transformers model's attention modules in its blocks). Runs after tensor parallelism
    (head counts are then local). Every check runs first, on every rank, before anything
    changes; no collective is issued here. State-dict keys and parameters are untouched: parameters stay
    replicated over ``cp`` (their gradients are partial sums, which the engine all-reduces
    over ``dp_cp``)."""
    axis = mesh.axis("cp")
    position_kwarg = _position_kwarg(model)
    if attention is None and (spec := find_spec(model)) is not None:
        attention = spec.attention
    names = (
        _attention_modules(model)
        if attention is None
        else list(match_plan(model, {attention: "attention"}, what="attention"))
    )
    for n in names:
        check_attention_module(model.get_submodule(n), n)
    max_positions = _check_model(model, plan)
    style = ContextParallelAttention(plan.cp_mode)
    apply_styles(model, {n: style for n in names}, mesh, what="context-parallel attention")
    for n in names:
        m = model.get_submodule(n)
        impl = getattr(getattr(m, "config", None), "_attn_implementation", CP_ATTENTION_IMPL)
        if not isinstance(getattr(m, "attention_fn", None), ContextSDPA) and impl != CP_ATTENTION_IMPL:
            raise ValueError(
                f"context parallelism: {n} still uses attn_implementation={impl!r} after "
                f"switching it to {CP_ATTENTION_IMPL!r}."
            )
    return ContextParallelized(
        axis=axis,
        mode=plan.cp_mode,
        position_kwarg=position_kwarg,
        max_positions=max_positions,
        attention=tuple(names),
    )


__all__ = [
    "ContextParallelAttention",
    "ContextParallelized",
    "check_attention_module",
    "head_parts",
    "parallelize_context",
]

"""Plugging context-parallel attention into a model, without rewriting its forward.

A serial decoder computes everything but attention token by token, so under sequence
parallelism every rank can run the model's own code on its share of the sequence
(:func:`~behemoth.parallel.context.split_sequence`) as long as two things change:

* **attention** sees the whole sequence: the model's core causal attention call is replaced
  by :func:`~behemoth.parallel.context.context_attention` over the mesh's ``cp`` axis
  (Ulysses or ring, ``Plan.cp_mode``);
* **positions** are global: the model is given ``position_ids`` of its local tokens
  (:func:`~behemoth.parallel.context.position_ids_for`), so a learned position table
  embeds each rank's own positions and RoPE rotates by global positions.

How the attention is plugged in, per kind of model (no model code is copied or rewritten):

===========================  ===========================================================
model                        seam
===========================  ===========================================================
behemoth's GPT / Llama (or   the attention module's ``attention_fn`` attribute, called like
any module with an           ``F.scaled_dot_product_attention`` (its default): set, on
``attention_fn``)            each instance, to a :class:`ContextAttention`
transformers models          transformers' attention-interface registry: one function,
                             ``behemoth_context_parallel``, registered in
                             ``AttentionInterface``; the model's ``_attn_implementation``
                             is set to it and each attention module carries its
                             :class:`ContextAttention` (transformers builds no mask for an
                             implementation it does not know, so the call gets none)
===========================  ===========================================================

The engine (``engine.py``) asks the returned :class:`ContextParallelized` to check each
batch (sequence length vs ``cp``, on every rank before any collective), to split each
micro-batch along dim 1, and for the model keyword that carries the position ids; it sums
loss, token counts and gradients over the ``dp_cp`` axis.

Validated at boost, on every rank, before any collective: the model has an attention seam
and a position-ids argument, Ulysses' head split (``num_heads / tp`` divisible by ``cp``),
no attention dropout (the cores have none), no cross-attention.

Tested in ``tests/dist/test_context_parallel.py`` (whole models against serial training).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from torch import nn

from ...comm import Axis
from . import check_sequence, context_attention, position_ids_for, split_sequence

CP_ATTENTION_IMPL = "behemoth_context_parallel"
"""The name under which behemoth's attention is registered in transformers' AttentionInterface."""

_POSITION_KWARGS = ("position_ids", "position_ids_BS")


class ContextAttention:
    """A drop-in for ``F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=...,
    enable_gqa=...)`` on this rank's share of the sequence (``[B, N, S/cp, D]``, the
    layout of ``mode``): :func:`context_attention` over ``axis``. Communication: that of
    the mode's core (Ulysses: two all-to-alls forward, two backward; ring: K/V shifts).
    Masks, non-causal attention and dropout are refused (``ValueError``). Runs eagerly inside
    ``torch.compile``'d blocks (a graph break around attention): the cores are Python loops
    of collectives and autograd Functions with their own backward."""

    def __init__(self, axis: Axis, mode: str) -> None:
        self.axis, self.mode = axis, mode

    @torch.compiler.disable
    def __call__(
        self,
        query,
        key,
        value,
        attn_mask=None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        if attn_mask is not None or not is_causal:
            raise ValueError(
                f"context parallelism ({self.mode}) computes causal attention without a mask; the "
                f"model asked for attn_mask={'a tensor' if attn_mask is not None else None}, "
                f"is_causal={is_causal}."
            )
        if dropout_p:
            raise ValueError(
                f"context parallelism ({self.mode}) has no attention dropout; the model asked for "
                f"dropout_p={dropout_p}. Set the model's attention dropout to 0."
            )
        return context_attention(query, key, value, self.axis, mode=self.mode, scale=scale)

    def __repr__(self) -> str:
        return f"ContextAttention(mode={self.mode!r}, cp={self.axis.size})"


def transformers_context_attention(
    module: nn.Module,
    query,
    key,
    value,
    attention_mask,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
):
    """The function registered as ``behemoth_context_parallel`` in transformers'
    ``AttentionInterface``: same signature and return as its ``sdpa_attention_forward``
    (``query [B, N, S/cp, D]`` -> ``([B, S/cp, N, D], None)``), computed by the module's
    :class:`ContextAttention` (set by :func:`apply_context_parallel`)."""
    seam = getattr(module, "_behemoth_context_attention", None)
    if seam is None:
        raise RuntimeError(
            f"{type(module).__name__} runs attn_implementation={CP_ATTENTION_IMPL!r} but bh.boost did "
            f"not prepare it for context parallelism; build the engine with bh.boost(model, ...)."
        )
    if attention_mask is not None:
        raise ValueError(
            "context parallelism: transformers passed an attention mask (padding or packed "
            "sequences); behemoth's context-parallel attention is plain causal attention. Pass "
            "unpadded batches (labels -100 where no loss is wanted) instead of an attention_mask."
        )
    out = seam(query, key, value, dropout_p=dropout, is_causal=True if is_causal is None else is_causal, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


@dataclass
class ContextParallelized:
    """What :func:`apply_context_parallel` did, and the per-step work it leaves to the engine."""

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


def _attention_modules(model: nn.Module) -> tuple[str, list[tuple[str, nn.Module]]]:
    """('seam', modules with attention_fn) or ('transformers', attention modules in the blocks)."""
    seams = [(n, m) for n, m in model.named_modules() if hasattr(m, "attention_fn")]
    if seams:
        return "seam", seams
    if _is_transformers(model):
        from ...specs import transformer_blocks_name

        blocks = transformer_blocks_name(model)
        found = [
            (n, m)
            for n, m in model.named_modules()
            if n.startswith(blocks + ".") and type(m).__name__.endswith("Attention") and hasattr(m, "is_causal")
        ]
        for n, m in found:
            if not m.is_causal or getattr(m, "is_cross_attention", False):
                raise ValueError(
                    f"context parallelism: {n} ({type(m).__name__}) is not causal self-attention "
                    f"(cross-attention or bidirectional); only causal decoders are supported."
                )
        if found:
            return "transformers", found
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
        if plan.cp_mode == "ulysses" and n is not None:
            local = n // tp if n % tp == 0 else None
            if local is not None and local % cp:
                per = f" ({local} per tensor-parallel rank with tp={tp})" if tp > 1 else ""
                raise ValueError(
                    f"cp_mode='ulysses' splits attention heads over cp; got num_heads={n}{per}, cp={cp} "
                    f"(remainder {local % cp}). Use a cp that divides {local}, or cp_mode='ring'."
                )
    return _config_int(cfg, "seq_len", "n_positions") if cfg is not None else None


# ----------------------------------------------------------------------------- apply
def parallelize(model: nn.Module, mesh, plan) -> ContextParallelized:
    """Plug context-parallel attention over ``mesh.axis('cp')`` into ``model``, in place.

    Runs after tensor parallelism (head counts are then local). Every check runs first, on
    every rank, before anything changes; no collective is issued here. State-dict keys and
    parameters are untouched: parameters stay replicated over ``cp`` (their gradients are
    partial sums, which the engine all-reduces over ``dp_cp``)."""
    axis = mesh.axis("cp")
    mode = plan.cp_mode
    position_kwarg = _position_kwarg(model)
    kind, modules = _attention_modules(model)
    max_positions = _check_model(model, plan)
    seam = ContextAttention(axis, mode)
    if kind == "seam":
        for _, m in modules:
            m.attention_fn = seam
    else:
        from transformers import AttentionInterface

        AttentionInterface.register(CP_ATTENTION_IMPL, transformers_context_attention)
        for _, m in modules:
            m._behemoth_context_attention = seam
        if hasattr(model, "set_attn_implementation"):
            model.set_attn_implementation(CP_ATTENTION_IMPL)
        else:
            model.config._attn_implementation = CP_ATTENTION_IMPL
        for n, m in modules:
            impl = getattr(getattr(m, "config", model.config), "_attn_implementation", None)
            if impl != CP_ATTENTION_IMPL:
                raise ValueError(
                    f"context parallelism: {n} still uses attn_implementation={impl!r} after "
                    f"switching the model to {CP_ATTENTION_IMPL!r}."
                )
    return ContextParallelized(
        axis=axis,
        mode=mode,
        position_kwarg=position_kwarg,
        max_positions=max_positions,
        attention=tuple(n for n, _ in modules),
    )

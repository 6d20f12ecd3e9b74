"""Context-parallel attention as a drop-in for the call a model already makes.

* :func:`context_attention` -- causal attention over a sequence split on a mesh axis, in the
  layout of ``mode`` (:mod:`.layout`): :func:`~.ulysses.ulysses_attention` or
  :func:`~.ring.ring_attention`.
* :class:`ContextSDPA` -- that, called like ``F.scaled_dot_product_attention``: what a
  behemoth model's ``attention_fn`` becomes.
* :func:`transformers_context_attention` -- that, called like transformers' attention
  functions: registered in ``AttentionInterface`` as :data:`CP_ATTENTION_IMPL`.

:class:`~.style.ContextParallelAttention` installs them on attention modules.
Tested in ``tests/dist/test_context_attention.py`` (the cores) and
``tests/dist/test_context_parallel.py`` (whole models).
"""

from __future__ import annotations

import torch
from torch import nn

from ...comm import Axis
from .layout import MODES
from .ring import ring_attention
from .ulysses import ulysses_attention

CP_ATTENTION_IMPL = "behemoth_context_parallel"
"""The name under which behemoth's attention is registered in transformers' AttentionInterface."""


def context_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, axis: Axis, *, mode: str, scale: float | None = None
) -> torch.Tensor:
    """Causal attention over the sequence split on ``axis`` in ``mode``'s layout; a drop-in for
    ``F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=...)``
    on this rank's share. See :func:`ulysses_attention` and :func:`ring_attention`."""
    if mode == "ulysses":
        return ulysses_attention(q, k, v, axis, scale=scale)
    if mode == "ring":
        return ring_attention(q, k, v, axis, scale=scale)
    raise ValueError(f"context-parallel mode {mode!r} is not one of {list(MODES)}.")


class ContextSDPA:
    """A drop-in for ``F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=...,
    enable_gqa=...)`` on this rank's share of the sequence (``[B, N, S/cp, D]``, the
    layout of ``mode``): :func:`context_attention` over ``axis``. Communication: that of
    the mode's core (Ulysses: two all-to-alls forward, two backward; ring: K/V shifts).
    Masks, non-causal attention and dropout are refused (``ValueError``). Runs eagerly inside
    ``torch.compile``'d blocks (a graph break around attention): the cores are Python loops
    of collectives and autograd Functions with their own backward."""

    def __init__(self, axis: Axis, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"context-parallel mode {mode!r} is not one of {list(MODES)}.")
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
        return f"ContextSDPA(mode={self.mode!r}, cp={self.axis.size})"


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
    :class:`ContextSDPA` (set by :class:`~.style.ContextParallelAttention`)."""
    sdpa = getattr(module, "_behemoth_context_attention", None)
    if sdpa is None:
        raise RuntimeError(
            f"{type(module).__name__} runs attn_implementation={CP_ATTENTION_IMPL!r} but no "
            f"ContextParallelAttention style was applied to it; parallelize the model with bh.boost or "
            f"bh.parallelize, or apply the style to every attention module that shares its config."
        )
    if attention_mask is not None:
        raise ValueError(
            "context parallelism: transformers passed an attention mask (padding or packed "
            "sequences); behemoth's context-parallel attention is plain causal attention. Pass "
            "unpadded batches (labels -100 where no loss is wanted) instead of an attention_mask."
        )
    out = sdpa(query, key, value, dropout_p=dropout, is_causal=True if is_causal is None else is_causal, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


__all__ = ["CP_ATTENTION_IMPL", "ContextSDPA", "context_attention", "transformers_context_attention"]

"""The mixture-of-experts modules expert parallelism knows, seen through one interface.

Two kinds, both storing their experts fused as ``gate_up_proj [E, 2I, H]`` (gate rows first)
and ``down_proj [E, H, I]``:

* behemoth's :class:`~behemoth.models.moe.MoEFeedForward` (its routing options, shared expert
  and capacity; a router loss per layer);
* transformers' sparse MoE blocks (``MixtralSparseMoeBlock``, ``Qwen3MoeSparseMoeBlock``,
  ``OlmoeSparseMoeBlock``, and any block of the same form): ``block.gate(x_TH)`` returns
  ``(router_logits, top_k_weights, top_k_index)`` with the family's own scoring and
  normalisation, and ``block.experts`` holds the fused weights and ``act_fn``. Their
  load-balancing loss is transformers' ``load_balancing_loss_func``: one loss over every layer's
  logits together (:class:`~.losses.ExpertLayers` adds it up across layers, ranks and stages).

:class:`ExpertBlock` gives the style what it needs of either: the routing, the expert weights,
the activation, the shared expert, and where to leave the router-loss terms. Pure: no
collective.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...models.moe import MoEFeedForward, Routing
from .grouped import grouped_swiglu

__all__ = ["ExpertBlock", "experts_forward", "is_transformers_moe_block"]


def is_transformers_moe_block(module: nn.Module) -> bool:
    """Whether ``module`` is a transformers sparse MoE block with fused 3D experts (a ``gate``
    router with ``top_k`` and ``num_experts``, ``experts.gate_up_proj`` / ``experts.down_proj``)."""
    gate, experts = getattr(module, "gate", None), getattr(module, "experts", None)
    if not isinstance(gate, nn.Module) or not isinstance(experts, nn.Module):
        return False
    fused = all(isinstance(getattr(experts, n, None), nn.Parameter) for n in ("gate_up_proj", "down_proj"))
    return fused and experts.gate_up_proj.dim() == 3 and hasattr(gate, "top_k") and hasattr(gate, "num_experts")


class ExpertBlock:
    """One MoE module as expert parallelism sees it (see the module docstring)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.native = isinstance(module, MoEFeedForward)
        if not self.native and not is_transformers_moe_block(module):
            raise TypeError(
                f"{type(module).__name__} is not a mixture-of-experts block behemoth knows: expected "
                f"behemoth.models.MoEFeedForward or a transformers sparse MoE block (gate + experts with fused "
                f"gate_up_proj [E, 2I, H] / down_proj [E, H, I])."
            )
        self.holder = module if self.native else module.experts
        """The module whose ``gate_up_proj`` / ``down_proj`` are the experts."""
        self.num_experts = module.num_experts if self.native else module.gate.num_experts
        self.top_k = module.top_k if self.native else module.gate.top_k
        self.act = F.silu if self.native else module.experts.act_fn
        self.dropless = not self.native or module.capacity_factor is None
        """Whether the block never drops an assignment (transformers' blocks have no capacity)."""
        gate_up = self.holder.gate_up_proj
        self.grouped_widths = gate_up.shape[-1] % 8 == 0 and gate_up.shape[-2] % 16 == 0
        """Whether the grouped GEMMs take these experts' widths (H and 2I: 16-byte rows), read
        when the block is wrapped (before any sharding of the parameters)."""

    def jitter(self, x_BSH: torch.Tensor) -> torch.Tensor:
        """The block's input as its experts and router see it: Mixtral's multiplicative input
        jitter in training (``router_jitter_noise``, drawn as its own forward draws it), else
        ``x_BSH`` itself."""
        noise = 0.0 if self.native else getattr(self.module, "jitter_noise", 0.0)
        if self.module.training and noise > 0:
            return x_BSH * torch.empty_like(x_BSH).uniform_(1.0 - noise, 1.0 + noise)
        return x_BSH

    def route(self, x_BSH: torch.Tensor, whole_rows=None) -> Routing:
        """The tokens' :class:`~behemoth.models.moe.Routing` (transformers: its router's choice,
        with softmax probabilities for the balancing loss, as ``load_balancing_loss_func`` reads
        them). ``whole_rows``: see :meth:`~behemoth.models.moe.MoEFeedForward.route_tokens` (a
        capacity's view of sequences split over ranks; transformers' blocks have no capacity)."""
        if self.native:
            return self.module.route_tokens(x_BSH, whole_rows)
        x_TH = x_BSH.reshape(-1, x_BSH.shape[-1])
        logits_TE, weights_TK, experts_TK = self.module.gate(x_TH)
        probs_TE = torch.softmax(logits_TE.float(), dim=-1)
        return Routing(logits_TE, probs_TE, weights_TK, experts_TK, experts_TK)

    def run_experts(self, x_NH: torch.Tensor, counts) -> torch.Tensor:
        """This rank's experts on their rows (grouped by expert, ``counts[l]`` rows for local expert
        l; or a :class:`~.grouped.GroupEnds`). A transformers block runs them as a call of its ``experts`` module (whose forward the
        style replaced by :func:`experts_forward`), so module hooks on it (ZeRO-3's gathers) fire."""
        if self.native:
            return grouped_swiglu(x_NH, counts, self.holder.gate_up_proj, self.holder.down_proj, self.act)
        return self.module.experts(x_NH, counts)

    def shared(self, x_TH: torch.Tensor) -> torch.Tensor | None:
        """The shared expert's output for every token, or None without one."""
        shared = self.module.shared if self.native else None
        return None if shared is None else shared(x_TH)


def experts_forward(self: nn.Module, x_NH: torch.Tensor, counts) -> torch.Tensor:
    """A transformers experts module's forward under expert parallelism (bound to the instance):
    rows already grouped by local expert through :func:`~.grouped.grouped_swiglu`."""
    return grouped_swiglu(x_NH, counts, self.gate_up_proj, self.down_proj, self.act_fn)

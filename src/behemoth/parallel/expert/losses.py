"""A model's mixture-of-experts blocks after :func:`~.style.parallelize_experts`: their router
losses for the objective, their token counts for the step log, their bias updates.

Two loss forms, each equal to the serial model's on the global batch:

* behemoth's :class:`~behemoth.models.moe.MoEFeedForward`: one loss per layer, left in
  ``layer.aux_loss`` by its forward (this rank's share of the global batch's under a plan);
* transformers' MoE families: ``router_aux_loss_coef * load_balancing_loss_func(all layers'
  logits)`` when ``config.output_router_logits`` is set (transformers adds it to the loss only
  then), i.e. ``E * sum_e f_e * P_e`` with ``f_e`` and ``P_e`` taken over every layer's tokens
  *together*: ``f_e = sum_l counts_le / (L*T)`` and ``P_e = sum_l prob_sums_le / (L*T)``. Each
  block leaves ``(counts_E`` over the global batch, ``prob_sums_E`` of this rank's tokens, ``T``
  global``)``; this rank's share is ``E * sum_e (sum_l counts) * (sum_l prob_sums) / (sum_l
  T)**2``, and the shares summed over the data ranks are the serial loss.

Tested in tests/dist/test_expert_families.py.
"""

from __future__ import annotations

import torch
from torch import nn

from ...models.moe import MoEFeedForward

__all__ = ["ExpertLayers"]


class ExpertLayers:
    """The MoE blocks ``{name: module}`` of ``model`` (empty for a dense model)."""

    def __init__(self, model: nn.Module, layers: dict[str, nn.Module]) -> None:
        self.layers = layers
        config = getattr(model, "config", None)
        self.transformers_coef = 0.0
        """transformers' ``router_aux_loss_coef`` when its config asks for the loss (else 0)."""
        if config is not None and getattr(config, "output_router_logits", False):
            self.transformers_coef = float(getattr(config, "router_aux_loss_coef", 0.0))

    def __bool__(self) -> bool:
        return bool(self.layers)

    def __len__(self) -> int:
        return len(self.layers)

    def aux_loss(self) -> torch.Tensor | None:
        """The router losses of the last forward (this rank's share of the global batch's), summed;
        None when there is none. Reading clears them, so no graph is kept past its backward."""
        total = None
        counts = probs = tokens = None
        num_experts = 0
        for m in self.layers.values():
            if isinstance(m, MoEFeedForward):
                if m.aux_loss is not None:
                    total = m.aux_loss if total is None else total + m.aux_loss
                    m.aux_loss = None
                continue
            terms = m.__dict__.pop("_behemoth_router_terms", None)
            if terms is None:
                continue
            c, p, t = terms
            num_experts = c.numel()
            counts, probs, tokens = (c, p, t) if counts is None else (counts + c, probs + p, tokens + t)
        if counts is not None and self.transformers_coef:
            balance = num_experts * (counts * probs).sum() / (tokens * tokens)
            loss = self.transformers_coef * balance
            total = loss if total is None else total + loss
        return total

    def token_counts(self) -> dict[str, list[float]]:
        """``{block name: assignments per expert}`` of the last forward, over the global batch
        (every rank holds the same numbers): the step log's view of the routing."""
        return {
            n: m.token_counts.tolist() for n, m in self.layers.items() if getattr(m, "token_counts", None) is not None
        }

    def update_bias(self) -> None:
        """The auxiliary-loss-free bias step of every behemoth layer that has a bias (once per
        optimizer step; the counts are global, so every rank moves its biases alike)."""
        for m in self.layers.values():
            if isinstance(m, MoEFeedForward):
                m.update_bias()

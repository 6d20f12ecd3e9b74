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

Under pipeline parallelism a rank holds some of the layers only (:meth:`ExpertLayers.held`) and
reads the losses of one stage at a time (:meth:`ExpertLayers.subset`, :meth:`ExpertLayers.take`).
behemoth's per-layer losses need nothing more. transformers' pooled loss is linear in the
probability sums, so it splits by stage too -- stage s's share is ``E * sum_e (sum_l counts) *
(its sum_l prob_sums) / (sum_l T)**2`` -- but every share needs the counts and token totals of
*every* layer: the pipeline carries them (:mod:`behemoth.parallel.pipeline.executor`).

Tested in tests/dist/test_expert_families.py and tests/dist/test_expert_pipeline.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ... import comm
from ...comm import Axis
from ...models.moe import MoEFeedForward
from .blocks import ExpertBlock

__all__ = ["ExpertLayers", "RouterTerms"]


@dataclass
class RouterTerms:
    """The terms of transformers' pooled balancing loss from some layers' forward, summed over
    those layers: ``counts_E`` (assignments per expert, global batch, no gradient), ``prob_sums_E``
    (router probabilities of this rank's tokens, in the graph) and ``tokens`` (global)."""

    counts_E: torch.Tensor
    prob_sums_E: torch.Tensor
    tokens: torch.Tensor

    def totals(self) -> torch.Tensor:
        """``[counts_E..., tokens]`` as float64 (detached): what a pipeline stage passes on."""
        return torch.cat([self.counts_E.detach().double(), self.tokens.detach().double().reshape(1)])


class ExpertLayers:
    """The MoE blocks ``{name: module}`` of ``model`` (empty for a dense model)."""

    def __init__(self, model: nn.Module, layers: dict[str, nn.Module]) -> None:
        self.layers = layers
        self.names = list(layers)
        """Every MoE block of the serial model, in module order (under a pipeline too)."""
        self.num_experts = {n: ExpertBlock(m).num_experts for n, m in layers.items()}
        config = getattr(model, "config", None)
        self.transformers_coef = 0.0
        """transformers' ``router_aux_loss_coef`` when its config asks for the loss (else 0)."""
        if config is not None and getattr(config, "output_router_logits", False):
            self.transformers_coef = float(getattr(config, "router_aux_loss_coef", 0.0))
        pooled = [self.num_experts[n] for n, m in layers.items() if not isinstance(m, MoEFeedForward)]
        self.pooled_experts = pooled[0] if pooled and self.transformers_coef else 0
        """E of transformers' pooled balancing loss when the objective has one (else 0): the same on
        every rank, whichever layers it holds."""

    def __bool__(self) -> bool:
        return bool(self.layers)

    def __len__(self) -> int:
        return len(self.layers)

    def _view(self, layers: dict[str, nn.Module]) -> ExpertLayers:
        view = object.__new__(ExpertLayers)
        view.__dict__.update(self.__dict__)
        view.layers = layers
        return view

    def held(self, model: nn.Module) -> ExpertLayers:
        """These layers less those ``model`` no longer holds (another pipeline stage's), keeping
        :attr:`names` and the loss's form: the record of one pipeline rank."""
        mine = {id(m) for m in model.modules()}
        return self._view({n: m for n, m in self.layers.items() if id(m) in mine})

    def subset(self, modules: set[int]) -> ExpertLayers:
        """The layers whose module id is in ``modules`` (one pipeline chunk's)."""
        return self._view({n: m for n, m in self.layers.items() if id(m) in modules})

    def take(self) -> tuple[torch.Tensor | None, RouterTerms | None]:
        """``(behemoth layers' losses summed, transformers blocks' RouterTerms summed)`` of the
        last forward of these layers (this rank's share of the global batch's), each None when
        there is none. Reading clears them, so no graph is kept past its backward."""
        native = None
        terms = None
        for m in self.layers.values():
            if isinstance(m, MoEFeedForward):
                if m.aux_loss is not None:
                    native = m.aux_loss if native is None else native + m.aux_loss
                    m.aux_loss = None
                continue
            got = m.__dict__.pop("_behemoth_router_terms", None)
            if got is None:
                continue
            c, p, t = got
            terms = (
                RouterTerms(c, p, t)
                if terms is None
                else RouterTerms(terms.counts_E + c, terms.prob_sums_E + p, terms.tokens + t)
            )
        return native, terms

    def pooled_loss(self, prob_sums_E: torch.Tensor, totals: torch.Tensor) -> torch.Tensor:
        """transformers' pooled balancing loss's share of ``prob_sums_E`` (some layers' router
        probabilities) given ``totals`` = ``[counts_E..., tokens]`` summed over *every* layer:
        ``coef * E * sum_e counts_e * prob_sums_e / tokens**2``."""
        totals = totals.to(prob_sums_E.dtype)
        counts, tokens = totals[:-1], totals[-1]
        return self.transformers_coef * self.pooled_experts * (counts * prob_sums_E).sum() / (tokens * tokens)

    def aux_loss(self) -> torch.Tensor | None:
        """The router losses of the last forward of every layer (this rank's share of the global
        batch's), summed; None when there is none. Reading clears them."""
        total, terms = self.take()
        if terms is not None and self.transformers_coef:
            loss = self.pooled_loss(terms.prob_sums_E, torch.cat([terms.counts_E, terms.tokens.reshape(1)]))
            total = loss if total is None else total + loss
        return total

    def token_counts(self, axis: Axis | None = None, device: torch.device | None = None) -> dict[str, list[float]]:
        """``{block name: assignments per expert}`` of the last forward, over the global batch
        (every rank holds the same numbers): the step log's view of the routing. ``axis``: the
        pipeline axis when a rank holds some of the layers only -- the counts are then summed over
        it (a collective: every rank calls it, ``device`` where the axis's collectives run) so that
        every rank reports every layer."""
        if axis is None or axis.trivial:  # every layer's counts read to the host at once
            ran = {n: m.token_counts for n, m in self.layers.items() if getattr(m, "token_counts", None) is not None}
            if not ran:
                return {}
            values = torch.cat([c.detach().reshape(-1).double() for c in ran.values()]).tolist()
            out, at = {}, 0
            for n, c in ran.items():
                out[n], at = values[at : at + c.numel()], at + c.numel()
            return out
        width = max(self.num_experts.values()) + 1  # the counts, then 1 where the layer has run
        # built where the collective runs and read to the host once, after it
        table = torch.zeros(len(self.names), width, dtype=torch.float64, device=device or "cpu")
        for i, n in enumerate(self.names):
            counts = getattr(self.layers.get(n), "token_counts", None)
            if counts is not None:
                table[i, : counts.numel()] = counts.detach().reshape(-1)
                table[i, -1:].fill_(1.0)  # on the device: no copy from the host
        table = comm.all_reduce(table, axis).cpu()
        return {n: table[i, : self.num_experts[n]].tolist() for i, n in enumerate(self.names) if table[i, -1] > 0}

    def update_bias(self) -> None:
        """The auxiliary-loss-free bias step of every behemoth layer that has a bias (once per
        optimizer step; the counts are global, so every rank moves its biases alike)."""
        for m in self.layers.values():
            if isinstance(m, MoEFeedForward):
                m.update_bias()

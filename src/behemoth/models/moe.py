"""Mixture-of-experts feed-forward layer, plain serial PyTorch.

Implements the sparsely gated MoE layer of "Outrageously Large Neural Networks" (Shazeer et
al., 2017) in the form Mixtral uses ("Mixtral of Experts", Jiang et al., 2024): a router
Linear scores every expert, each token goes to its top-k experts, whose softmax scores are
renormalised over the k and weight the experts' SwiGLU outputs. The experts are stored fused
as 3D parameters, as transformers 5 stores them: ``gate_up_proj [E, 2I, H]`` (the gate rows
first, then the up rows) and ``down_proj [E, H, I]``.

Two auxiliary losses regularise the router, both per layer:

* the load-balancing loss of the Switch Transformer (Fedus et al., 2021, eqs. 4-6),
  ``E * sum_e f_e * P_e`` with ``f_e`` the number of top-k assignments to expert e per token
  and ``P_e`` the mean router probability of e -- transformers' ``load_balancing_loss_func``
  on this layer's router logits;
* the router z-loss of ST-MoE (Zoph et al., 2022), ``mean_t logsumexp(logits_t)^2``.

After each forward, ``layer.aux_loss`` holds ``aux_loss_coef * balance + z_loss_coef * z``
(a tensor in the autograd graph); :func:`auxiliary_loss` sums it over a model's MoE layers.
The pure helpers (:func:`route`, :func:`balance_terms`, :func:`z_loss_sum`) are what a
parallel plan reuses to compute the same quantities over a batch spread across ranks.

No collectives, no process group. Tested in tests/unit/test_moe.py (the layer against a
per-token loop over experts in float64; the balancing loss against transformers').

Shape legend:
    T  tokens (batch x sequence, flattened)
    H  hidden
    I  expert inner width
    E  experts
    K  experts per token (top-k)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["MoEFeedForward", "auxiliary_loss", "balance_terms", "route", "swiglu_expert", "z_loss_sum"]


def _at_least_fp32(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.promote_types(t.dtype, torch.float32))


def route(logits_TE: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(probs_TE, weights_TK, experts_TK)``: the router's softmax (in float32, or float64 for
    float64 logits), each token's top-k experts, and their probabilities renormalised to sum to
    1 over the k."""
    probs_TE = torch.softmax(_at_least_fp32(logits_TE), dim=-1)
    top_TK, experts_TK = torch.topk(probs_TE, top_k, dim=-1)
    return probs_TE, top_TK / top_TK.sum(dim=-1, keepdim=True), experts_TK


def balance_terms(probs_TE: torch.Tensor, experts_TK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(counts_E, prob_sums_E)``: top-k assignments per expert (no gradient) and the
    router probabilities summed over tokens. The balancing loss over T tokens is
    ``E * sum(counts_E * prob_sums_E) / T**2``; both terms add up over any split of the tokens."""
    num_experts = probs_TE.shape[-1]
    counts_E = torch.bincount(experts_TK.reshape(-1), minlength=num_experts).to(probs_TE.dtype)
    return counts_E, probs_TE.sum(dim=0)


def z_loss_sum(logits_TE: torch.Tensor) -> torch.Tensor:
    """Router z-loss summed over tokens: ``sum_t logsumexp(logits_t)^2`` (at least float32)."""
    return torch.logsumexp(_at_least_fp32(logits_TE), dim=-1).square().sum()


def swiglu_expert(x_TH: torch.Tensor, gate_up_2IH: torch.Tensor, down_HI: torch.Tensor) -> torch.Tensor:
    """One expert: ``down(silu(gate(x)) * up(x))`` with the fused ``[2I, H]`` gate/up weight."""
    gate_TI, up_TI = F.linear(x_TH, gate_up_2IH).chunk(2, dim=-1)
    return F.linear(F.silu(gate_TI) * up_TI, down_HI)


class MoEFeedForward(nn.Module):
    """Top-k routed SwiGLU experts. x_BSH -> x_BSH, no communication.

    Parameters: ``router.weight [E, H]``, ``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``.
    ``aux_loss`` is set by every forward (see the module docstring), and ``token_counts``: the
    top-k assignments per expert of that forward's tokens (float, detached).
    """

    def __init__(
        self,
        hidden: int,
        ffn_hidden: int,
        num_experts: int,
        top_k: int,
        *,
        aux_loss_coef: float = 0.0,
        z_loss_coef: float = 0.0,
    ) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"MoEFeedForward: top_k={top_k} must be in [1, num_experts={num_experts}].")
        self.num_experts, self.top_k = num_experts, top_k
        self.aux_loss_coef, self.z_loss_coef = aux_loss_coef, z_loss_coef
        self.router = nn.Linear(hidden, num_experts, bias=False)
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * ffn_hidden, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, ffn_hidden))
        self.aux_loss: torch.Tensor | None = None
        self.token_counts: torch.Tensor | None = None

    def router_loss(self, counts_E, prob_sums_E, z_sum, num_tokens) -> torch.Tensor:
        """``aux_loss_coef * balance + z_loss_coef * z`` from the summed terms over
        ``num_tokens`` tokens (the terms may be partial sums of a larger batch: the result is
        then this part's share of that batch's loss, and the shares add up to it)."""
        balance = self.num_experts * (counts_E * prob_sums_E).sum() / (num_tokens * num_tokens)
        return self.aux_loss_coef * balance + self.z_loss_coef * z_sum / num_tokens

    def forward(self, x_BSH: torch.Tensor) -> torch.Tensor:
        x_TH = x_BSH.reshape(-1, x_BSH.shape[-1])
        logits_TE = self.router(x_TH)
        probs_TE, weights_TK, experts_TK = route(logits_TE, self.top_k)
        y_TH = torch.zeros_like(x_TH)
        for e in range(self.num_experts):
            token_N, slot_N = torch.where(experts_TK == e)
            if token_N.numel() == 0:
                continue
            y_NH = swiglu_expert(x_TH[token_N], self.gate_up_proj[e], self.down_proj[e])
            y_TH = y_TH.index_add(0, token_N, (y_NH * weights_TK[token_N, slot_N, None]).to(y_TH.dtype))
        counts_E, prob_sums_E = balance_terms(probs_TE, experts_TK)
        self.token_counts = counts_E.detach()
        self.aux_loss = self.router_loss(counts_E, prob_sums_E, z_loss_sum(logits_TE), x_TH.shape[0])
        return y_TH.view_as(x_BSH)


def auxiliary_loss(model: nn.Module) -> torch.Tensor | None:
    """The sum of ``aux_loss`` over ``model``'s MoE layers from their last forward (None when
    the model has none); each layer's is cleared, so a graph is not kept past its backward.
    A serial training loop adds it to the task loss: ``loss = ce + auxiliary_loss(model)``."""
    total = None
    for module in model.modules():
        if isinstance(module, MoEFeedForward) and module.aux_loss is not None:
            total = module.aux_loss if total is None else total + module.aux_loss
            module.aux_loss = None
    return total

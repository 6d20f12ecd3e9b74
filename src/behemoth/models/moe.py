"""Mixture-of-experts feed-forward layer, plain serial PyTorch.

Implements the sparsely gated MoE layer of "Outrageously Large Neural Networks" (Shazeer et
al., 2017) in the form Mixtral uses ("Mixtral of Experts", Jiang et al., 2024): a router
Linear scores every expert, each token goes to its top-k experts, whose softmax scores are
renormalised over the k and weight the experts' SwiGLU outputs. Options cover the other
families: sigmoid scores and the auxiliary-loss-free bias of DeepSeek-V3, unnormalised top-k
weights (Qwen3-MoE, OLMoE), a shared expert, and a capacity per sequence that drops
assignments past it (GShard, Switch). The experts are stored fused
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

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "MoEFeedForward",
    "Routing",
    "SCORE_FUNCS",
    "SharedExpert",
    "auxiliary_loss",
    "balance_terms",
    "capacity_keep",
    "expert_capacity",
    "route",
    "swiglu_expert",
    "update_expert_bias",
    "z_loss_sum",
]

SCORE_FUNCS = ("softmax", "sigmoid")
"""How a router turns logits into expert scores."""


def _at_least_fp32(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.promote_types(t.dtype, torch.float32))


def route(
    logits_TE: torch.Tensor,
    top_k: int,
    *,
    score_func: str = "softmax",
    norm_topk: bool = True,
    bias_E: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(probs_TE, weights_TK, experts_TK)``.

    Scores are ``softmax`` (Mixtral, Qwen3-MoE, OLMoE) or ``sigmoid`` (DeepSeek-V3) of the logits,
    in float32 (float64 for float64 logits). Each token's k experts are the top-k of
    ``scores + bias_E`` (``bias_E``: the auxiliary-loss-free balancing bias, which chooses experts
    but never weights them); their weights are their scores, divided by their sum over the k when
    ``norm_topk``. ``probs_TE`` are the scores normalised to sum to 1 per token (softmax: the
    scores themselves), what the balancing loss reads."""
    if score_func not in SCORE_FUNCS:
        raise ValueError(f"score_func={score_func!r}: must be one of {SCORE_FUNCS}.")
    logits_TE = _at_least_fp32(logits_TE)
    if score_func == "softmax":
        scores_TE = probs_TE = torch.softmax(logits_TE, dim=-1)
    else:
        scores_TE = torch.sigmoid(logits_TE)
        probs_TE = scores_TE / scores_TE.sum(dim=-1, keepdim=True)
    if bias_E is None:
        top_TK, experts_TK = torch.topk(scores_TE, top_k, dim=-1)
    else:
        experts_TK = torch.topk(scores_TE.detach() + bias_E.to(scores_TE.dtype), top_k, dim=-1).indices
        top_TK = scores_TE.gather(-1, experts_TK)
    if norm_topk:
        top_TK = top_TK / top_TK.sum(dim=-1, keepdim=True)
    return probs_TE, top_TK, experts_TK


def capacity_keep(experts_BSK: torch.Tensor, num_experts: int, capacity: int) -> torch.Tensor:
    """``keep_BSK``: which assignments fit their expert's ``capacity`` within their sequence.

    Each sequence (row) is its own group: an expert takes at most ``capacity`` of a row's
    assignments, first choices (slot 0) of every position before second choices, and within a
    slot in position order (GShard's priority). A row's drops depend on that row alone, so a
    batch split by rows over ranks drops exactly what the whole batch drops. Pure."""
    B, S, K = experts_BSK.shape
    e_BA = experts_BSK.transpose(1, 2).reshape(B, K * S)  # slot-major: slot 0 of every position first
    one_hot_BAE = F.one_hot(e_BA, num_experts)
    position_BA = (one_hot_BAE.cumsum(1) - 1).gather(-1, e_BA[..., None]).squeeze(-1)
    return (position_BA < capacity).view(B, K, S).transpose(1, 2)


def expert_capacity(capacity_factor: float, seq_len: int, top_k: int, num_experts: int) -> int:
    """Assignments an expert takes per sequence: ``ceil(capacity_factor * S * k / E)``."""
    return math.ceil(capacity_factor * seq_len * top_k / num_experts)


def balance_terms(probs_TE: torch.Tensor, experts_TK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(counts_E, prob_sums_E)``: top-k assignments per expert (no gradient) and the
    router probabilities summed over tokens. The balancing loss over T tokens is
    ``E * sum(counts_E * prob_sums_E) / T**2``; both terms add up over any split of the tokens."""
    num_experts = probs_TE.shape[-1]
    counts_E = _count(experts_TK.reshape(-1), torch.ones_like(experts_TK.reshape(-1)), num_experts)
    return counts_E.to(probs_TE.dtype), probs_TE.sum(dim=0)


def _count(index_A: torch.Tensor, weight_A: torch.Tensor, num_bins: int) -> torch.Tensor:
    """``torch.bincount(index_A, weight_A, minlength=num_bins)`` for integer weights, in int64,
    without bincount's read of the largest index to the host (a device sync on a GPU)."""
    return index_A.new_zeros(num_bins, dtype=torch.int64).scatter_add_(0, index_A.long(), weight_A.long())


def z_loss_sum(logits_TE: torch.Tensor) -> torch.Tensor:
    """Router z-loss summed over tokens: ``sum_t logsumexp(logits_t)^2`` (at least float32)."""
    return torch.logsumexp(_at_least_fp32(logits_TE), dim=-1).square().sum()


def swiglu_expert(x_TH: torch.Tensor, gate_up_2IH: torch.Tensor, down_HI: torch.Tensor) -> torch.Tensor:
    """One expert: ``down(silu(gate(x)) * up(x))`` with the fused ``[2I, H]`` gate/up weight."""
    gate_TI, up_TI = F.linear(x_TH, gate_up_2IH).chunk(2, dim=-1)
    return F.linear(F.silu(gate_TI) * up_TI, down_HI)


def _in_backward() -> bool:
    """True while the autograd engine runs a backward on this thread (a checkpointed block's
    forward being recomputed), when a forward must not count its tokens a second time."""
    return torch._C._current_graph_task_id() != -1


@dataclass
class Routing:
    """One forward's routing decisions (T tokens, K slots)."""

    logits_TE: torch.Tensor
    probs_TE: torch.Tensor
    """Scores normalised per token (what the balancing loss reads)."""
    weights_TK: torch.Tensor
    chosen_TK: torch.Tensor
    """The experts :func:`route` chose (what the balancing loss and the token counts read)."""
    experts_TK: torch.Tensor
    """The experts that run: ``chosen_TK`` with assignments dropped by the capacity set to E."""

    def dropped_counts(self) -> torch.Tensor:
        """Assignments dropped by the capacity, per expert (float, detached)."""
        num_experts = self.logits_TE.shape[-1]
        if self.experts_TK is self.chosen_TK:  # no capacity: nothing dropped
            return self.probs_TE.new_zeros(num_experts)
        dropped_A = (self.experts_TK == num_experts).reshape(-1)
        return _count(self.chosen_TK.reshape(-1), dropped_A, num_experts).to(self.probs_TE.dtype)


class SharedExpert(nn.Module):
    """A SwiGLU every token goes through, beside the routed experts (DeepSeek-V2/V3's shared
    expert): ``down(silu(gate_up[:I] x) * gate_up[I:] x)``."""

    def __init__(self, hidden: int, ffn_hidden: int) -> None:
        super().__init__()
        self.gate_up = nn.Linear(hidden, 2 * ffn_hidden, bias=False)
        self.down = nn.Linear(ffn_hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return swiglu_expert(x, self.gate_up.weight, self.down.weight)


class MoEFeedForward(nn.Module):
    """Top-k routed SwiGLU experts. x_BSH -> x_BSH, no communication.

    Parameters: ``router.weight [E, H]``, ``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``,
    and with ``shared_ffn_hidden`` a :class:`SharedExpert` ``shared``. Buffer (with
    ``bias_update_rate`` > 0): ``expert_bias [E]``. ``aux_loss`` is set by every forward (see the
    module docstring), and ``token_counts``: the top-k assignments per expert of that forward's
    tokens (float, detached; before any capacity drop); ``dropped_counts``: those of them the
    capacity dropped, per expert.

    Routing options (:func:`route`): ``score_func`` softmax or sigmoid, ``norm_topk`` (divide
    the k weights by their sum). ``capacity_factor``: each expert takes at most
    :func:`expert_capacity` assignments per sequence (:func:`capacity_keep`); a dropped
    assignment adds nothing to its token (the residual carries it). ``bias_update_rate`` > 0:
    auxiliary-loss-free balancing (DeepSeek-V3, Wang et al. 2024): experts are chosen by score
    plus ``expert_bias``, and :meth:`update_bias` (once per optimizer step,
    :func:`update_expert_bias`) moves each bias by ``rate * sign(mean load - load)`` from the
    assignments counted since the last update (a checkpointed recomputation does not count).
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
        score_func: str = "softmax",
        norm_topk: bool = True,
        capacity_factor: float | None = None,
        bias_update_rate: float = 0.0,
        shared_ffn_hidden: int = 0,
    ) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"MoEFeedForward: top_k={top_k} must be in [1, num_experts={num_experts}].")
        if score_func not in SCORE_FUNCS:
            raise ValueError(f"MoEFeedForward: score_func={score_func!r} must be one of {SCORE_FUNCS}.")
        if capacity_factor is not None and not capacity_factor > 0:
            raise ValueError(f"MoEFeedForward: capacity_factor={capacity_factor!r} must be > 0, or None (dropless).")
        if bias_update_rate < 0:
            raise ValueError(f"MoEFeedForward: bias_update_rate={bias_update_rate!r} must be >= 0 (0: no bias).")
        self.num_experts, self.top_k = num_experts, top_k
        self.aux_loss_coef, self.z_loss_coef = aux_loss_coef, z_loss_coef
        self.score_func, self.norm_topk = score_func, norm_topk
        self.capacity_factor, self.bias_update_rate = capacity_factor, bias_update_rate
        self.router = nn.Linear(hidden, num_experts, bias=False)
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * ffn_hidden, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, ffn_hidden))
        self.shared = SharedExpert(hidden, shared_ffn_hidden) if shared_ffn_hidden else None
        if bias_update_rate > 0:
            self.register_buffer("expert_bias", torch.zeros(num_experts, dtype=torch.float32))
        else:
            self.expert_bias = None
        self.load_counts: torch.Tensor | None = None
        """Assignments per expert counted since the last :meth:`update_bias` (float64)."""
        self.aux_loss: torch.Tensor | None = None
        self.token_counts: torch.Tensor | None = None
        self.dropped_counts: torch.Tensor | None = None

    def router_loss(self, counts_E, prob_sums_E, z_sum, num_tokens) -> torch.Tensor:
        """``aux_loss_coef * balance + z_loss_coef * z`` from the summed terms over
        ``num_tokens`` tokens (the terms may be partial sums of a larger batch: the result is
        then this part's share of that batch's loss, and the shares add up to it)."""
        balance = self.num_experts * (counts_E * prob_sums_E).sum() / (num_tokens * num_tokens)
        return self.aux_loss_coef * balance + self.z_loss_coef * z_sum / num_tokens

    def route_tokens(self, x_BSH: torch.Tensor, whole_rows=None) -> Routing:
        """The :class:`Routing` of the tokens of ``x_BSH``: the router's logits and :func:`route`'s
        choice, less what the capacity drops. A parallel plan routes with this too (a row's
        routing depends on that row alone). ``whole_rows``: when ``x_BSH`` holds a share of the
        positions of each row (a sequence split over ranks), ``(gather, take)``: ``gather(t_BSK)``
        returns a per-token tensor for the whole rows and ``take(t_BSK)`` this share of it back, so
        the capacity is taken per whole row, as here (the caller communicates; this stays serial)."""
        x_TH = x_BSH.reshape(-1, x_BSH.shape[-1])
        logits_TE = self.router(x_TH)
        probs_TE, weights_TK, chosen_TK = route(
            logits_TE, self.top_k, score_func=self.score_func, norm_topk=self.norm_topk, bias_E=self.expert_bias
        )
        experts_TK = chosen_TK
        if self.capacity_factor is not None:
            B, S = (x_BSH.shape[0], math.prod(x_BSH.shape[1:-1])) if x_BSH.dim() > 2 else (1, x_TH.shape[0])
            chosen_BSK = chosen_TK.view(B, S, self.top_k)
            gather, take = whole_rows if whole_rows is not None else (None, None)
            if gather is not None:
                chosen_BSK = gather(chosen_BSK)
            capacity = expert_capacity(self.capacity_factor, chosen_BSK.shape[1], self.top_k, self.num_experts)
            keep_BSK = capacity_keep(chosen_BSK, self.num_experts, capacity)
            if take is not None:
                keep_BSK = take(keep_BSK)
            keep_TK = keep_BSK.reshape(chosen_TK.shape)
            experts_TK = chosen_TK.masked_fill(~keep_TK, self.num_experts)
        return Routing(logits_TE, probs_TE, weights_TK, chosen_TK, experts_TK)

    def record_routing(self, counts_E: torch.Tensor, dropped_E: torch.Tensor) -> None:
        """Keep a forward's assignments per expert and those the capacity dropped (over the whole
        batch: a parallel plan passes them summed over its ranks) for the step log and the bias
        update."""
        self.token_counts, self.dropped_counts = counts_E.detach(), dropped_E.detach()
        if self.expert_bias is not None and torch.is_grad_enabled() and not _in_backward():
            counts = counts_E.detach().double()
            self.load_counts = counts if self.load_counts is None else self.load_counts + counts

    @torch.no_grad()
    def update_bias(self) -> None:
        """The auxiliary-loss-free step: ``expert_bias += rate * sign(mean load - load)`` over the
        assignments counted since the last call, then the count restarts. No-op without a bias or
        without counted tokens."""
        if self.expert_bias is None or self.load_counts is None:
            return
        load = self.load_counts
        self.expert_bias += (self.bias_update_rate * torch.sign(load.mean() - load)).to(self.expert_bias.dtype)
        self.load_counts = None

    def forward(self, x_BSH: torch.Tensor) -> torch.Tensor:
        x_TH = x_BSH.reshape(-1, x_BSH.shape[-1])
        r = self.route_tokens(x_BSH)
        y_TH = torch.zeros_like(x_TH)
        for e in range(self.num_experts):
            token_N, slot_N = torch.where(r.experts_TK == e)
            if token_N.numel() == 0:
                continue
            y_NH = swiglu_expert(x_TH[token_N], self.gate_up_proj[e], self.down_proj[e])
            y_TH = y_TH.index_add(0, token_N, (y_NH * r.weights_TK[token_N, slot_N, None]).to(y_TH.dtype))
        if self.shared is not None:
            y_TH = y_TH + self.shared(x_TH)
        counts_E, prob_sums_E = balance_terms(r.probs_TE, r.chosen_TK)
        self.record_routing(counts_E, r.dropped_counts())
        self.aux_loss = self.router_loss(counts_E, prob_sums_E, z_loss_sum(r.logits_TE), x_TH.shape[0])
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


def update_expert_bias(model: nn.Module) -> int:
    """:meth:`MoEFeedForward.update_bias` on every MoE layer of ``model`` (call it once per
    optimizer step, after the step's micro-batches); returns the number of layers updated."""
    layers = [m for m in model.modules() if isinstance(m, MoEFeedForward) and m.expert_bias is not None]
    for layer in layers:
        layer.update_bias()
    return len(layers)

"""Routings for bench_moe.py's layer benchmark: a layer input and router weight that make an
:class:`~behemoth.models.moe.MoEFeedForward`'s own router (``route_tokens``) choose experts as
wanted -- evenly, uniformly at random, or Zipf-skewed -- so the layer runs its real routing code.
Tested in tests/unit/test_bench_moe.py."""

from __future__ import annotations

import torch

ROUTINGS = ("balanced", "uniform", "zipf", "zipf-spread")


def routing_input(kind: str, T: int, H: int, E: int, K: int, ep_size: int, zipf_s: float, g: torch.Generator):
    """``(x_TH, router_EH)``, float32: a layer input and router weight whose top-k choice follows
    ``kind``. The router reads coordinate e of x as expert e's score (``router[e, e] = 1``) plus a
    per-expert bias (``router[e, E] = bias_e``, coordinate E of x is 1); the other coordinates are
    normal noise the router ignores. ``balanced``: token t's scores are 4 on experts
    ``(k*t + j) mod E``, j < k, and 0 elsewhere (every expert gets exactly ``T*k/E``). The other
    kinds draw Gumbel scores: the top-k of ``log p_e + Gumbel`` draws k experts without replacement
    with probabilities p (uniform; Zipf ``p ~ (r+1)^-s`` over popularity rank r, the rank r expert
    being expert r for ``zipf`` and, for ``zipf-spread``, the one that deals ranks to the ep
    members in turn)."""
    if kind not in ROUTINGS:
        raise ValueError(f"routing {kind!r}: must be one of {ROUTINGS}.")
    if H <= E:
        raise ValueError(f"hidden={H} must exceed experts={E}: the router reads E + 1 coordinates of x.")
    dev = g.device
    x_TH = torch.randn(T, H, device=dev, generator=g)
    router_EH = torch.zeros(E, H, device=dev)
    router_EH[torch.arange(E), torch.arange(E)] = 1.0
    x_TH[:, E] = 1.0
    bias_E = torch.zeros(E, device=dev)
    if kind == "balanced":
        scores_TE = torch.zeros(T, E, device=dev)
        t = torch.arange(T, device=dev)
        for j in range(K):
            scores_TE[t, (K * t + j) % E] = 4.0
    else:
        u_TE = torch.rand(T, E, device=dev, generator=g).clamp_(1e-9, 1 - 1e-9)
        scores_TE = -torch.log(-torch.log(u_TE))
        if kind.startswith("zipf"):
            log_p = -zipf_s * torch.log(torch.arange(1, E + 1, device=dev, dtype=torch.float32))
            per = E // ep_size  # popularity rank r -> expert: r itself, or dealt to the ep members in turn
            expert_of_rank = [r if kind == "zipf" else (r % ep_size) * per + r // ep_size for r in range(E)]
            bias_E[torch.tensor(expert_of_rank, device=dev)] = log_p
    x_TH[:, :E] = scores_TE
    router_EH[:, E] = bias_E
    return x_TH, router_EH

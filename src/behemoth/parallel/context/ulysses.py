"""Ulysses context parallelism (DeepSpeed-Ulysses, Jacobs et al. 2023, arXiv:2309.14509).

Each ``cp`` rank holds a contiguous sequence chunk with every head. One all-to-all trades
the sequence split for a head split (q, k and v travel in one fused exchange), each rank
runs ordinary causal attention on the whole sequence for ``N/cp`` query heads, and a
second all-to-all trades back. Exact: attention never mixes heads, and each rank sees the
full sequence of its heads.

Grouped-query attention: query head ``n`` reads kv head ``n // (N/K)``. The kv heads are
repeat-interleaved to ``K' = lcm(K, cp)`` before the exchange (``K' = K`` when ``cp``
divides ``K``), which keeps that grouping and gives every rank exactly the kv heads its
query heads read: with ``K < cp`` each kv head is replicated on the ``cp/K`` ranks of
its query group. The repeat's backward sums the replicas' gradients.

Tested in ``tests/dist/test_context_attention.py`` against full causal attention.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ... import comm
from .layout import check_sequence

# Shape legend: B batch, N query heads, K kv heads (K' after replication), S full sequence,
# L = S/cp local sequence, D head dim, P = cp; lower case n, k = N/P, K'/P heads of one rank;
# H = n + 2k, the fused q/k/v heads one rank sends to (and receives from) each member.


def ulysses_kv_heads(num_kv_heads: int, cp: int) -> int:
    """How many kv heads travel through the all-to-all: ``lcm(K, cp)`` (``K`` when cp divides it)."""
    return num_kv_heads * cp // math.gcd(num_kv_heads, cp)


def ulysses_bytes(
    b: int, s: int, n: int, k_heads: int, d: int, cp: int, element_size: int, *, wire: bool = False
) -> int:
    """Payload bytes one rank's ledger books on the ``cp`` axis for one Ulysses attention
    forward (the backward moves exactly the same: the two inverse all-to-alls).

    Forward = the fused q/k/v all-to-all of ``[B, N + 2K', S/cp, D]`` plus the output's of
    ``[B, N, S/cp, D]``: ``b*(s/cp)*d*(2n + 2K')*element_size`` with ``K' = lcm(k_heads, cp)``.
    For multi-head attention (``K = N``, ``h = N*d``) that is Ulysses' ``4*b*s*h/cp``
    elements exactly; with grouped-query attention it is ``(N + K')/(2N)`` of it. With
    ``wire=True``: the bytes a rank actually sends, ``(cp-1)/cp`` of the payload. ``cp = 1``
    moves nothing (0)."""
    if cp == 1:
        return 0
    payload = b * (s // cp) * d * (2 * n + 2 * ulysses_kv_heads(k_heads, cp)) * element_size
    return payload * (cp - 1) // cp if wire else payload


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: int) -> None:
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape:
        raise ValueError(
            f"ulysses_attention expects q [B, N, S/cp, D] and k, v [B, K, S/cp, D] of one shape; "
            f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}."
        )
    if (q.shape[0], q.shape[2], q.shape[3]) != (k.shape[0], k.shape[2], k.shape[3]):
        raise ValueError(
            f"ulysses_attention: q {tuple(q.shape)} and k {tuple(k.shape)} differ in batch, local sequence or head dim."
        )
    check_sequence(q.shape[2] * cp, cp, "ulysses", num_heads=q.shape[1], num_kv_heads=k.shape[1])


def ulysses_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, axis: comm.Axis, *, scale: float | None = None
) -> torch.Tensor:
    """Causal attention of this rank's contiguous sequence chunk against the whole sequence.

    Layout: ``q [B, N, S/cp, D]``, ``k, v [B, K, S/cp, D]`` (``K`` divides ``N``) hold rank
    ``r``'s contiguous chunk ``[r*S/cp, (r+1)*S/cp)`` with all heads (split with
    ``split_sequence(..., mode="ulysses")``); returns ``[B, N, S/cp, D]`` in the same layout,
    equal to the matching slice of ``F.scaled_dot_product_attention(q, k, v, is_causal=True,
    scale=scale, enable_gqa=True)`` on the full sequence.

    Communication over ``axis`` (via :class:`comm.AllToAllAxis`): forward, one all-to-all of
    q/k/v fused (sequence split -> head split) and one of the output (head split ->
    sequence split); backward, the two inverse all-to-alls. Bytes: :func:`ulysses_bytes`.
    Raises ``ValueError`` (on every rank, before any collective) if ``N % cp`` or ``N % K``.
    """
    P = axis.size
    _check_inputs(q, k, v, P)
    B, N, L, D = q.shape
    K = k.shape[1]
    if P == 1:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=N != K)
    Kr = ulysses_kv_heads(K, P)
    if Kr != K:  # replicate kv heads, keeping query head n -> kv head n // (N/K)
        k, v = k.repeat_interleave(Kr // K, dim=1), v.repeat_interleave(Kr // K, dim=1)
    # Group heads by destination rank, then one exchange: scatter the rank dim, gather the sequence.
    qkv_BPHLD = torch.cat(
        [q.reshape(B, P, N // P, L, D), k.reshape(B, P, Kr // P, L, D), v.reshape(B, P, Kr // P, L, D)], dim=2
    )
    qkv_B1HSD = comm.AllToAllAxis.apply(qkv_BPHLD, axis, 1, 3)
    q_BnSD, k_BkSD, v_BkSD = qkv_B1HSD.squeeze(1).split([N // P, Kr // P, Kr // P], dim=1)
    o_BnSD = F.scaled_dot_product_attention(q_BnSD, k_BkSD, v_BkSD, is_causal=True, scale=scale, enable_gqa=N != Kr)
    # Scatter the sequence back, gather the heads (in rank order = head order).
    return comm.AllToAllAxis.apply(o_BnSD, axis, 2, 1)

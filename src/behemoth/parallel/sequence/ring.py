"""Ring attention with the zigzag causal balance (Liu et al. 2023, arXiv:2310.01889; the
zigzag split of Llama 3 context parallelism and ring-flash-attention).

Each ``sp`` rank holds two of ``2*sp`` sequence chunks of length ``C``: chunk ``r`` and chunk
``2*sp-1-r`` (local positions increase). Its queries stay home; K/V blocks travel one hop
around the ring per step (``sp-1`` shifts), the next block's shift is issued before the
current block is computed, and each block's partial attention is merged into the running
output by log-sum-exp (online softmax). Against the block from rank ``src`` only one
rectangle of the ``2C x 2C`` score block is causally live (:func:`ring_step_block`), so
every step costs every rank the same ``2C^2`` scores:

==============  =================================  ========
block from      queries x keys                     mask
==============  =================================  ========
``src == r``    all ``2C`` x all ``2C``            causal
``src < r``     all ``2C`` x first chunk ``C``     none
``src > r``     second chunk ``C`` x all ``2C``    none
==============  =================================  ========

Backward (:class:`RingAttentionFunction`) runs its own ring: the K/V blocks circulate again,
each rank recomputes the block's probabilities from the saved log-sum-exp (nothing
per-block is saved) and adds the block's dK/dV into a buffer that travels with it and
arrives home after ``sp`` shifts; dQ accumulates locally. Memory per rank: the saved
``q, k, v, out, lse`` of its share (O(S/sp)), one visiting K/V block plus the next one in
flight, and one ``2C x 2C`` score block at a time; never ``S x S`` or the full K/V.

The block math is plain PyTorch (matmul + masked softmax), fp32 accumulation for 16-bit
inputs; it materialises one block's scores, ``B*N*(S/sp)^2/2`` floats. ``_block_forward``
and ``_block_backward`` are the seam for a fused kernel that returns the log-sum-exp
(flash attention's forward, and its backward fed the merged ``out`` and ``lse``). Tested in ``tests/dist/test_sequence_attention.py`` against full causal attention.
"""
from __future__ import annotations

import torch

from ... import comm
from . import check_sequence, zigzag_chunks

# Shape legend: B batch, N query heads, K kv heads, G = N/K, L = 2C local sequence, D head
# dim; ``kv_2BKLD`` is k and v stacked (one message per shift).


def ring_step_block(sp: int, rank: int, src: int, local_len: int) -> tuple[slice, slice, bool]:
    """The causally live rectangle when rank ``rank``'s queries meet the K/V block of rank
    ``src`` (zigzag layout, ``local_len = 2C`` tokens each): ``(query rows, key columns,
    causal)``, where ``causal`` means a lower-triangular mask on that (square) rectangle and
    otherwise every pair is live. Pure."""
    zigzag_chunks(sp, rank)  # range checks
    zigzag_chunks(sp, src)
    c = local_len // 2
    if src == rank:
        return slice(0, local_len), slice(0, local_len), True
    if src < rank:  # both my chunks come after its first chunk and before its second
        return slice(0, local_len), slice(0, c), False
    return slice(c, local_len), slice(0, local_len), False  # only my second chunk sees its block


def ring_bytes(b: int, s: int, k_heads: int, d: int, sp: int, element_size: int, *,
               backward: bool = False) -> int:
    """Bytes one rank sends on the ``sp`` axis (ledger payload = wire) for one ring attention.

    Forward: ``sp-1`` shifts of the local K and V, ``2*(sp-1)*b*(s/sp)*k_heads*d*element_size``:
    exactly the issue's ``2*(sp-1)*b*(s/sp)*h_kv`` with ``h_kv = k_heads*d``. With
    ``backward=True``, the backward instead: ``sp-1`` K/V shifts again plus ``sp`` shifts
    of the dK/dV buffer (its last hop brings it home), which is kept in fp32 for 16-bit
    inputs: ``2*b*(s/sp)*k_heads*d*((sp-1)*element_size + sp*max(element_size, 4))``."""
    if sp == 1:
        return 0
    kv = 2 * b * (s // sp) * k_heads * d
    if not backward:
        return (sp - 1) * kv * element_size
    return (sp - 1) * kv * element_size + sp * kv * max(element_size, 4)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _expand(x_BKLD: torch.Tensor, groups: int) -> torch.Tensor:
    """kv heads -> query heads (query head n reads kv head n // groups)."""
    return x_BKLD if groups == 1 else x_BKLD.repeat_interleave(groups, dim=1)


def _fold(g_BNLD: torch.Tensor, groups: int) -> torch.Tensor:
    """Gradient w.r.t. expanded kv heads -> kv heads (sum over each query group)."""
    if groups == 1:
        return g_BNLD
    B, N, L, D = g_BNLD.shape
    return g_BNLD.view(B, N // groups, groups, L, D).sum(2)


def _scores(q, k, scale: float, causal: bool, acc: torch.dtype) -> torch.Tensor:
    s = torch.matmul(q, k.transpose(-1, -2)).to(acc) * scale
    if causal:
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=s.device).triu_(1), float("-inf"))
    return s


def _block_forward(q, k, v, scale: float, causal: bool, acc: torch.dtype):
    """Attention of q over one K/V block: (out [.., Lq, D] in ``acc``, lse [.., Lq] in ``acc``)."""
    s = _scores(q, k, scale, causal, acc)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1))
    return torch.matmul(p.to(v.dtype), v).to(acc), lse


def _block_backward(q, k, v, dout, lse, delta, scale: float, causal: bool, acc: torch.dtype):
    """Gradients of one block (FlashAttention-2's backward): the probabilities are recomputed
    from the saved row log-sum-exp ``lse`` of the *whole* attention, so the block's share of
    dQ, dK, dV adds up exactly; ``delta = rowsum(dO * O)``. Returns (dq, dk, dv) in ``acc``."""
    p = torch.exp(_scores(q, k, scale, causal, acc) - lse.unsqueeze(-1))
    dv = torch.matmul(p.to(dout.dtype).transpose(-1, -2), dout).to(acc)
    dp = torch.matmul(dout, v.transpose(-1, -2)).to(acc)
    ds = (p * (dp - delta.unsqueeze(-1))).to(q.dtype)
    dq = torch.matmul(ds, k).to(acc) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q).to(acc) * scale
    return dq, dk, dv


def _merge(out, lse, rows: slice, out_b, lse_b) -> None:
    """Fold a block's (out_b, lse_b) into the running (out, lse) on ``rows``, in place."""
    lse_a = lse[..., rows]
    new = torch.logaddexp(lse_a, lse_b)
    out[..., rows, :] = (out[..., rows, :] * torch.exp(lse_a - new).unsqueeze(-1)
                         + out_b * torch.exp(lse_b - new).unsqueeze(-1))
    lse[..., rows] = new


class RingAttentionFunction(torch.autograd.Function):
    """Causal ring attention over ``axis`` on zigzag-split q, k, v (see :func:`ring_attention`).

    Forward: ``sp-1`` ring shifts (``comm.ring_shift_async``) of the stacked K/V block, each
    issued before the current block is computed. Backward: ``sp-1`` shifts of the K/V block
    again, and ``sp`` shifts of the dK/dV buffer that travels with it back home; dQ local.
    Saves ``q, k, v, out, lse`` only."""

    @staticmethod
    def forward(ctx, q, k, v, axis: comm.Axis, scale: float):
        B, N, L, D = q.shape
        G, P, r = N // k.shape[1], axis.size, axis.rank
        acc = _acc_dtype(q.dtype)
        out = torch.empty(B, N, L, D, dtype=acc, device=q.device)
        lse = torch.empty(B, N, L, dtype=acc, device=q.device)
        kv_2BKLD = torch.stack([k, v])
        pending = None
        for step in range(P):
            if step:
                kv_2BKLD = pending.wait()
            if step < P - 1:  # next block in flight while this one is computed
                pending = comm.ring_shift_async(kv_2BKLD, axis)
            src = (r - step) % P
            rows, cols, causal = ring_step_block(P, r, src, L)
            o_b, lse_b = _block_forward(q[..., rows, :], _expand(kv_2BKLD[0][..., cols, :], G),
                                        _expand(kv_2BKLD[1][..., cols, :], G), scale, causal, acc)
            if step == 0:  # the own block covers every row (the causal diagonal)
                out.copy_(o_b)
                lse.copy_(lse_b)
            else:
                _merge(out, lse, rows, o_b, lse_b)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.axis, ctx.scale = axis, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        axis, scale = ctx.axis, ctx.scale
        B, N, L, D = q.shape
        G, P, r = N // k.shape[1], axis.size, axis.rank
        acc = _acc_dtype(q.dtype)
        dout = dout.contiguous()
        delta = (dout.to(acc) * out.to(acc)).sum(-1)  # rowsum(dO * O), FlashAttention-2's D
        dq = torch.zeros(B, N, L, D, dtype=acc, device=q.device)
        kv_2BKLD = torch.stack([k, v])
        kv_pending = dkv_pending = None
        for step in range(P):
            if step:
                kv_2BKLD = kv_pending.wait()
            if step < P - 1:
                kv_pending = comm.ring_shift_async(kv_2BKLD, axis)
            src = (r - step) % P
            rows, cols, causal = ring_step_block(P, r, src, L)
            dq_b, dk_b, dv_b = _block_backward(
                q[..., rows, :], _expand(kv_2BKLD[0][..., cols, :], G), _expand(kv_2BKLD[1][..., cols, :], G),
                dout[..., rows, :], lse[..., rows], delta[..., rows], scale, causal, acc)
            dq[..., rows, :] += dq_b
            dkv = torch.zeros(2, B, k.shape[1], L, D, dtype=acc, device=q.device)
            dkv[0][..., cols, :] = _fold(dk_b, G)
            dkv[1][..., cols, :] = _fold(dv_b, G)
            if step:  # this block's dK/dV so far, from the ranks it visited before
                dkv += dkv_pending.wait()
            dkv_pending = comm.ring_shift_async(dkv, axis)  # last hop takes it home
        dkv = dkv_pending.wait()
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sp: int) -> None:
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape:
        raise ValueError(f"ring_attention expects q [B, N, S/sp, D] and k, v [B, K, S/sp, D] of one shape; "
                         f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}.")
    if (q.shape[0], q.shape[2], q.shape[3]) != (k.shape[0], k.shape[2], k.shape[3]):
        raise ValueError(f"ring_attention: q {tuple(q.shape)} and k {tuple(k.shape)} differ in batch, "
                         f"local sequence or head dim.")
    check_sequence(q.shape[2] * sp, sp, "ring", num_heads=q.shape[1], num_kv_heads=k.shape[1])


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, axis: comm.Axis, *,
                   scale: float | None = None) -> torch.Tensor:
    """Causal attention of this rank's zigzag share against the whole sequence.

    Layout: ``q [B, N, S/sp, D]``, ``k, v [B, K, S/sp, D]`` (``K`` divides ``N``, query head
    ``n`` reads kv head ``n // (N/K)``) hold chunks ``r`` and ``2*sp-1-r`` of ``2*sp`` (split
    with ``split_sequence(..., mode="ring")``); returns ``[B, N, S/sp, D]`` in the same
    layout, equal to the matching rows of ``F.scaled_dot_product_attention(q, k, v,
    is_causal=True, scale=scale, enable_gqa=True)`` on the full sequence. ``scale``
    defaults to ``1/sqrt(D)``; no dropout.

    Communication over ``axis``: point-to-point ring shifts only (see
    :class:`RingAttentionFunction`); bytes: :func:`ring_bytes`. Raises ``ValueError`` (on
    every rank, before any communication) for an odd local length or ``N % K``."""
    _check_inputs(q, k, v, axis.size)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return RingAttentionFunction.apply(q, k, v, axis, scale)

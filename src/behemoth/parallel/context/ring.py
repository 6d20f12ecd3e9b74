"""Ring attention with the zigzag causal balance (Liu et al. 2023, arXiv:2310.01889; the
zigzag split of Llama 3 context parallelism and ring-flash-attention).

Each ``cp`` rank holds two of ``2*cp`` sequence chunks of length ``C``: chunk ``r`` and chunk
``2*cp-1-r`` (local positions increase). Its queries stay home; K/V blocks travel one hop
around the ring per step (``cp-1`` shifts), the next block's shift is issued before the
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
arrives home after ``cp`` shifts; dQ accumulates locally. Memory per rank: the saved
``q, k, v, out, lse`` of its share (O(S/cp)), one visiting K/V block plus the next one in
flight, and one ``2C x 2C`` score block at a time; never ``S x S`` or the full K/V.

Block kernels (:data:`BLOCK_KERNEL`). Each block is computed either by

* **a fused kernel that returns the log-sum-exp** -- by default (``"auto"``) for fp16/bf16
  CUDA inputs, whichever of flash attention and cuDNN attention
  ``F.scaled_dot_product_attention`` itself would pick (cuDNN's on Hopper, where it is the
  faster one): the forward is ``aten._scaled_dot_product_flash_attention`` (or
  ``_cudnn_attention``), the backward its ``_backward`` fed the *merged* ``out`` and ``lse``
  of the whole attention (so its recomputed probabilities are the global ones and the
  blocks' dQ/dK/dV add up exactly) -- as PyTorch's own context parallelism does
  (``torch/distributed/tensor/experimental/_context_parallel``). Block outputs and
  gradients come back in the input dtype and are merged/accumulated in fp32; no score
  block is materialised. On CPU, ``"flash"`` runs the same seam with
  ``aten._scaled_dot_product_flash_attention_for_cpu`` (and its backward), which the tests
  use to check the fused path's bookkeeping without a GPU;
* **plain PyTorch** (matmul + masked softmax, fp32 accumulation for 16-bit inputs) --
  everything else, CPU and float64 included, so the CPU parity tests check the math
  itself. It materialises one block's scores, ``B*N*(S/cp)^2/2`` floats.

Tested in ``tests/dist/test_context_attention.py`` against full causal attention; the GPU
paths by ``benchmarks/bench_cp.py --check`` (ring with each kernel vs one GPU's full SDPA,
bf16, outputs and gradients, and timings).
"""

from __future__ import annotations

import torch

from ... import comm
from .layout import check_sequence, zigzag_chunks

BLOCK_KERNEL = "auto"
"""How ring attention computes each block (read at each call): ``"auto"`` (the fused kernel
SDPA itself would pick for fp16/bf16 CUDA inputs -- flash, or cuDNN's -- plain PyTorch
otherwise; see :func:`block_kernel`), ``"plain"``, ``"flash"`` (the device's flash op: CUDA's,
or the CPU one -- tests use it to check the fused bookkeeping on CPU) or ``"cudnn"``."""
KERNELS = ("auto", "plain", "flash", "cudnn")

# Shape legend: B batch, N query heads, K kv heads, G = N/K, L = 2C local sequence, D head
# dim; ``kv_2BKLD`` is k and v stacked (one message per shift).


def ring_step_block(cp: int, rank: int, src: int, local_len: int) -> tuple[slice, slice, bool]:
    """The causally live rectangle when rank ``rank``'s queries meet the K/V block of rank
    ``src`` (zigzag layout, ``local_len = 2C`` tokens each): ``(query rows, key columns,
    causal)``, where ``causal`` means a lower-triangular mask on that (square) rectangle and
    otherwise every pair is live. Pure."""
    zigzag_chunks(cp, rank)  # range checks
    zigzag_chunks(cp, src)
    c = local_len // 2
    if src == rank:
        return slice(0, local_len), slice(0, local_len), True
    if src < rank:  # both my chunks come after its first chunk and before its second
        return slice(0, local_len), slice(0, c), False
    return slice(c, local_len), slice(0, local_len), False  # only my second chunk sees its block


def ring_bytes(b: int, s: int, k_heads: int, d: int, cp: int, element_size: int, *, backward: bool = False) -> int:
    """Bytes one rank sends on the ``cp`` axis (ledger payload = wire) for one ring attention.

    Forward: ``cp-1`` shifts of the local K and V, ``2*(cp-1)*b*(s/cp)*k_heads*d*element_size``:
    exactly the ring's ``2*(cp-1)*b*(s/cp)*h_kv`` with ``h_kv = k_heads*d``. With
    ``backward=True``, the backward instead: ``cp-1`` K/V shifts again plus ``cp`` shifts
    of the dK/dV buffer (its last hop brings it home), which is kept in fp32 for 16-bit
    inputs: ``2*b*(s/cp)*k_heads*d*((cp-1)*element_size + cp*max(element_size, 4))``."""
    if cp == 1:
        return 0
    kv = 2 * b * (s // cp) * k_heads * d
    if not backward:
        return (cp - 1) * kv * element_size
    return (cp - 1) * kv * element_size + cp * kv * max(element_size, 4)


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


_SDPA_KERNELS = {1: "flash", 3: "cudnn"}  # torch.nn.attention.SDPBackend values


def block_kernel(q: torch.Tensor) -> str:
    """The kernel ring attention computes its blocks of ``q`` with: ``"plain"``, ``"flash"`` or
    ``"cudnn"`` (see :data:`BLOCK_KERNEL`). ``"auto"`` asks PyTorch which fused kernel
    ``F.scaled_dot_product_attention`` would run on CUDA for a causal block of these inputs
    (``torch._fused_sdp_choice``: flash, or cuDNN's on Hopper, honouring ``sdpa_kernel``
    contexts) and uses it when it is one of those two; plain PyTorch otherwise and on CPU."""
    if BLOCK_KERNEL not in KERNELS:
        raise ValueError(f"ring.BLOCK_KERNEL={BLOCK_KERNEL!r} is not one of {list(KERNELS)}.")
    if BLOCK_KERNEL != "auto":
        return BLOCK_KERNEL
    if not (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)):
        return "plain"
    try:  # blocks see k, v expanded to q's heads: ask with q's metadata (no data is read)
        choice = torch._fused_sdp_choice(q, q, q, is_causal=True)
    except (RuntimeError, TypeError):
        return "plain"
    return _SDPA_KERNELS.get(int(choice), "plain")


def _fused_block_forward(q, k, v, scale: float, causal: bool, kernel: str):
    """One block by a fused kernel that returns the log-sum-exp: (out [.., Lq, D] in q's dtype,
    lse [.., Lq] fp32, extras the matching backward needs (the forward's dense-mode
    placeholders: cumulative lengths, RNG seed/offset; None on CPU))."""
    if kernel == "cudnn":  # cuDNN keeps a trailing dim of 1 on the lse; wants dense operands
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        out, lse, cum_q, cum_k, _, _, seed, offset, _ = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, True, 0.0, causal, False, scale=scale
        )
        return out, lse.reshape(out.shape[:-1]), (cum_q, cum_k, seed, offset)
    if q.is_cuda:
        out, lse, cum_q, cum_k, _, _, seed, offset, _ = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal, False, scale=scale
        )
        return out, lse, (cum_q, cum_k, seed, offset)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return out, lse, None


def _fused_block_backward(q, k, v, dout, out, lse, scale: float, causal: bool, kernel: str, extras):
    """Gradients of one block by the fused kernel's backward, given the *merged* out and lse of
    the rows (so the recomputed probabilities are the global ones). (dq, dk, dv) in q's dtype."""
    lse = lse.contiguous()  # a strided lse slice gives wrong gradients (as noted in torch's CP)
    cum_q, cum_k, seed, offset = extras if extras is not None else (None, None, None, None)
    if kernel == "cudnn":
        q, k, v, dout, out = q.contiguous(), k.contiguous(), v.contiguous(), dout.contiguous(), out.contiguous()
        return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            dout,
            q,
            k,
            v,
            out,
            lse.unsqueeze(-1),
            seed,
            offset,
            None,
            cum_q,
            cum_k,
            q.shape[-2],
            k.shape[-2],
            0.0,
            causal,
            scale=scale,
        )
    if q.is_cuda:
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, cum_q, cum_k, q.shape[-2], k.shape[-2], 0.0, causal, seed, offset, scale=scale
        )
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, causal, scale=scale
    )


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
    out[..., rows, :] = out[..., rows, :] * torch.exp(lse_a - new).unsqueeze(-1) + out_b * torch.exp(
        lse_b - new
    ).unsqueeze(-1)
    lse[..., rows] = new


class RingAttentionFunction(torch.autograd.Function):
    """Causal ring attention over ``axis`` on zigzag-split q, k, v (see :func:`ring_attention`).

    Forward: ``cp-1`` ring shifts (``comm.ring_shift_async``) of the stacked K/V block, each
    issued before the current block is computed. Backward: ``cp-1`` shifts of the K/V block
    again, and ``cp`` shifts of the dK/dV buffer that travels with it back home; dQ local.
    Saves ``q, k, v, out, lse`` only."""

    @staticmethod
    def forward(ctx, q, k, v, axis: comm.Axis, scale: float):
        B, N, L, D = q.shape
        G, P, r = N // k.shape[1], axis.size, axis.rank
        acc = _acc_dtype(q.dtype)
        out = torch.empty(B, N, L, D, dtype=acc, device=q.device)
        lse = torch.empty(B, N, L, dtype=acc, device=q.device)
        kernel = block_kernel(q)
        fused = kernel != "plain"
        extras = None
        kv_2BKLD = torch.stack([k, v])
        pending = None
        for step in range(P):
            if step:
                kv_2BKLD = pending.wait()
            if step < P - 1:  # next block in flight while this one is computed
                pending = comm.ring_shift_async(kv_2BKLD, axis)
            src = (r - step) % P
            rows, cols, causal = ring_step_block(P, r, src, L)
            q_b = q[..., rows, :]
            k_b, v_b = _expand(kv_2BKLD[0][..., cols, :], G), _expand(kv_2BKLD[1][..., cols, :], G)
            if fused:  # block output in q's dtype, merged in fp32 (type promotion in _merge)
                o_b, lse_b, extras = _fused_block_forward(q_b, k_b, v_b, scale, causal, kernel)
                lse_b = lse_b.to(acc)
            else:
                o_b, lse_b = _block_forward(q_b, k_b, v_b, scale, causal, acc)
            if step == 0:  # the own block covers every row (the causal diagonal)
                out.copy_(o_b)
                lse.copy_(lse_b)
            else:
                _merge(out, lse, rows, o_b, lse_b)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.axis, ctx.scale, ctx.kernel, ctx.extras = axis, scale, kernel, extras
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        axis, scale = ctx.axis, ctx.scale
        B, N, L, D = q.shape
        G, P, r = N // k.shape[1], axis.size, axis.rank
        acc = _acc_dtype(q.dtype)
        dout = dout.contiguous()
        fused = ctx.kernel != "plain"
        # rowsum(dO * O), FlashAttention-2's D (the fused backward computes it itself)
        delta = None if fused else (dout.to(acc) * out.to(acc)).sum(-1)
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
            q_b = q[..., rows, :]
            k_b, v_b = _expand(kv_2BKLD[0][..., cols, :], G), _expand(kv_2BKLD[1][..., cols, :], G)
            if fused:  # block gradients in q's dtype, accumulated in fp32
                dq_b, dk_b, dv_b = _fused_block_backward(
                    q_b,
                    k_b,
                    v_b,
                    dout[..., rows, :],
                    out[..., rows, :],
                    lse[..., rows],
                    scale,
                    causal,
                    ctx.kernel,
                    ctx.extras,
                )
                dk_b, dv_b = dk_b.to(acc), dv_b.to(acc)
            else:
                dq_b, dk_b, dv_b = _block_backward(
                    q_b, k_b, v_b, dout[..., rows, :], lse[..., rows], delta[..., rows], scale, causal, acc
                )
            dq[..., rows, :] += dq_b
            dkv = torch.zeros(2, B, k.shape[1], L, D, dtype=acc, device=q.device)
            dkv[0][..., cols, :] = _fold(dk_b, G)
            dkv[1][..., cols, :] = _fold(dv_b, G)
            if step:  # this block's dK/dV so far, from the ranks it visited before
                dkv += dkv_pending.wait()
            dkv_pending = comm.ring_shift_async(dkv, axis)  # last hop takes it home
        dkv = dkv_pending.wait()
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: int) -> None:
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape:
        raise ValueError(
            f"ring_attention expects q [B, N, S/cp, D] and k, v [B, K, S/cp, D] of one shape; "
            f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}."
        )
    if (q.shape[0], q.shape[2], q.shape[3]) != (k.shape[0], k.shape[2], k.shape[3]):
        raise ValueError(
            f"ring_attention: q {tuple(q.shape)} and k {tuple(k.shape)} differ in batch, local sequence or head dim."
        )
    check_sequence(q.shape[2] * cp, cp, "ring", num_heads=q.shape[1], num_kv_heads=k.shape[1])


def ring_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, axis: comm.Axis, *, scale: float | None = None
) -> torch.Tensor:
    """Causal attention of this rank's zigzag share against the whole sequence.

    Layout: ``q [B, N, S/cp, D]``, ``k, v [B, K, S/cp, D]`` (``K`` divides ``N``, query head
    ``n`` reads kv head ``n // (N/K)``) hold chunks ``r`` and ``2*cp-1-r`` of ``2*cp`` (split
    with ``split_sequence(..., mode="ring")``); returns ``[B, N, S/cp, D]`` in the same
    layout, equal to the matching rows of ``F.scaled_dot_product_attention(q, k, v,
    is_causal=True, scale=scale, enable_gqa=True)`` on the full sequence. ``scale``
    defaults to ``1/sqrt(D)``; no dropout.

    Communication over ``axis``: point-to-point ring shifts only (see
    :class:`RingAttentionFunction`); bytes: :func:`ring_bytes`. Raises ``ValueError`` (on
    every rank, before any communication) for an odd local length or ``N % K``."""
    _check_inputs(q, k, v, axis.size)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    device = q.device.type
    if torch.is_autocast_enabled(device):
        # as F.scaled_dot_product_attention under autocast: the attention in autocast's dtype (the
        # kernels below are called directly, which autocast does not cast; rotary embeddings hand
        # over float32 q and k, which would otherwise be kept and attended in float32)
        dtype = torch.get_autocast_dtype(device)
        q, k, v = (t.to(dtype) if t.dtype in (torch.float32, torch.float16, torch.bfloat16) else t for t in (q, k, v))
    return RingAttentionFunction.apply(q, k, v, axis, scale)

"""Both context-parallel attention cores against full causal attention, at cp = 2 and 4.

For Ulysses (contiguous split) and ring attention (zigzag split): the output and dq, dk, dv,
gathered back to natural sequence order, equal F.scaled_dot_product_attention(is_causal=True)
on the full sequence in float64, for multi-head and grouped-query attention (kv heads split,
and replicated when there are fewer kv heads than cp ranks) and a custom scale; the ledger's
bytes equal ``ulysses_bytes`` / ``ring_bytes`` (and their ratio to the published formulas is
what the docstrings state); ring attention saves O(S/cp) per rank, not O(S^2). One spawned
world per cp degree runs every case.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import behemoth as bh
from behemoth import comm
from behemoth.distributed import device_for_rank
from behemoth.mesh import ParallelMesh
from behemoth.parallel.context import (
    gather_sequence,
    ring_attention,
    ring_bytes,
    split_sequence,
    ulysses_attention,
    ulysses_bytes,
    ulysses_kv_heads,
)

B, S, D = 2, 16, 4
# (query heads, kv heads, scale): MHA; GQA with 2 kv heads (split at cp=2, replicated at cp=4);
# 2 query heads per kv head per rank at cp=4; multi-query (replicated at every cp).
CASES = [(4, 4, None), (4, 2, 0.3), (8, 2, None), (4, 1, 0.5)]
CORES = {"ulysses": ulysses_attention, "ring": ring_attention}


def _full(n, k_heads, seed, dtype=torch.float64, s=S):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, n, s, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, k_heads, s, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, k_heads, s, D, generator=g, dtype=torch.float64)
    w = torch.randn(B, n, s, D, generator=g, dtype=torch.float64)  # upstream gradient
    return [t.to(dtype) for t in (q, k, v, w)]


def _reference(q, k, v, w, scale):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    (out * w).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def _gather(t, axis, mode):
    """Every rank's share of t (dim 2 = sequence) -> the full tensor in natural order."""
    parts = comm.all_gather(t.detach().contiguous().unsqueeze(0), axis, 0)
    return gather_sequence(list(parts.unbind(0)), 2, mode).cpu()


def _run(mode, axis, q, k, v, w, scale):
    """One forward + backward on this rank's share; returns local results and the ledger
    bytes of the forward and of the backward."""
    cp, r, dev = axis.size, axis.rank, device_for_rank()
    ql, kl, vl = (split_sequence(t, 2, cp, r, mode).to(dev, copy=True).requires_grad_() for t in (q, k, v))
    wl = split_sequence(w, 2, cp, r, mode).to(dev)
    axis.ledger.reset()
    out = CORES[mode](ql, kl, vl, axis, scale=scale)
    fwd = axis.ledger.stats().get("cp", {"bytes": 0, "ops": {}})
    axis.ledger.reset()
    (out * wl).sum().backward()
    bwd = axis.ledger.stats().get("cp", {"bytes": 0, "ops": {}})
    return out, ql.grad, kl.grad, vl.grad, fwd, bwd


def _parity(axis, mode, n, k_heads, scale, seed):
    cp = axis.size
    q, k, v, w = _full(n, k_heads, seed)
    want = _reference(q, k, v, w, scale)
    *got, fwd, bwd = _run(mode, axis, q, k, v, w, scale)
    for name, g, ref in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(
            _gather(g, axis, mode),
            ref,
            rtol=1e-10,
            atol=1e-12,
            msg=lambda m: f"{mode} cp={cp} N={n} K={k_heads} scale={scale} {name}: {m}",
        )
    e = 8
    if mode == "ulysses":
        formula = ulysses_bytes(B, S, n, k_heads, D, cp, e)
        assert fwd["bytes"] == formula and fwd["ops"] == {"all_to_all": 2}, (fwd, formula)
        assert bwd["bytes"] == formula and bwd["ops"] == {"all_to_all": 2}, (bwd, formula)
        # vs Ulysses' 4*b*s*h/cp: exact for MHA, (N + K')/(2N) with grouped-query attention.
        issue = 4 * B * S * n * D // cp * e
        assert formula / issue == (n + ulysses_kv_heads(k_heads, cp)) / (2 * n)
    else:
        formula = ring_bytes(B, S, k_heads, D, cp, e)
        assert fwd["bytes"] == formula and fwd["ops"] == {"ring_shift": cp - 1}, (fwd, formula)
        back = ring_bytes(B, S, k_heads, D, cp, e, backward=True)
        assert bwd["bytes"] == back and bwd["ops"] == {"ring_shift": 2 * cp - 1}, (bwd, back)
        # the ring's 2*(cp-1)*b*(s/cp)*h_kv, exactly.
        assert formula == 2 * (cp - 1) * B * (S // cp) * k_heads * D * e


def _low_precision_ring(axis):
    """bf16 inputs: fp32 accumulation inside, dK/dV buffers travel in fp32 (as ring_bytes says)."""
    cp = axis.size
    n, k_heads = 4, 2
    q, k, v, w = _full(n, k_heads, 99, dtype=torch.bfloat16)
    want = _reference(*(t.double() for t in (q, k, v, w)), None)
    *got, fwd, bwd = _run("ring", axis, q, k, v, w, None)
    for name, g, ref in zip(("out", "dq", "dk", "dv"), got, want):
        assert g.dtype == torch.bfloat16, name
        torch.testing.assert_close(
            _gather(g, axis, "ring").double(), ref, rtol=3e-2, atol=3e-2, msg=lambda m: f"bf16 ring cp={cp} {name}: {m}"
        )
    assert fwd["bytes"] == ring_bytes(B, S, k_heads, D, cp, 2)
    assert bwd["bytes"] == ring_bytes(B, S, k_heads, D, cp, 2, backward=True)


def _autocast_ring(axis):
    """float32 inputs under bf16 autocast (what rotary embeddings hand over) attend in bf16, as
    F.scaled_dot_product_attention does under autocast: bf16 output, float32 gradients for the
    float32 inputs, the results those of the bf16 inputs, and bf16 (not float32) saved tensors."""
    cp, r, dev = axis.size, axis.rank, device_for_rank()
    q, k, v, w = _full(4, 2, 98, dtype=torch.float32)
    want = _run("ring", axis, *(t.to(torch.bfloat16) for t in (q, k, v, w)), None)[:4]
    ql, kl, vl = (split_sequence(t, 2, cp, r, "ring").to(dev, copy=True).requires_grad_() for t in (q, k, v))
    wl = split_sequence(w, 2, cp, r, "ring").to(dev)
    with torch.autocast(dev.type, dtype=torch.bfloat16):
        out, saved = _saved_bytes(ring_attention, ql, kl, vl, axis)
    (out * wl).sum().backward()
    assert out.dtype == torch.bfloat16 and ql.grad.dtype == torch.float32
    for name, g, ref in zip(("out", "dq", "dk", "dv"), (out, ql.grad, kl.grad, vl.grad), want):
        torch.testing.assert_close(g.to(torch.bfloat16), ref, rtol=0, atol=0, msg=lambda m: f"autocast {name}: {m}")
    bf16_inputs = (t.detach().to(torch.bfloat16).requires_grad_() for t in (ql, kl, vl))
    _, bf16_saved = _saved_bytes(ring_attention, *bf16_inputs, axis)
    assert saved == bf16_saved, (saved, bf16_saved)


def _saved_bytes(fn, *args, **kwargs):
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args, **kwargs)
    return out, total


def _ring_memory(axis):
    """Saved activations of ring attention per rank are O(S/cp): within 1.25x of the serial
    saved q, k, v, out divided by cp (a saved S x S score matrix would be several times that)."""
    cp, r = axis.size, axis.rank
    s, n = 64, 2
    q, k, v, _ = _full(n, n, 7, s=s)
    ql, kl, vl = (split_sequence(t, 2, cp, r, "ring").to(device_for_rank()).requires_grad_() for t in (q, k, v))
    out, saved = _saved_bytes(ring_attention, ql, kl, vl, axis)
    serial_qkvo = sum(t.numel() * t.element_size() for t in (q, k, v, q))
    scores = B * n * s * s * 8
    assert saved <= 1.25 * serial_qkvo / cp, (saved, serial_qkvo / cp)
    assert saved < scores / cp / 2, (saved, scores / cp)
    out.sum().backward()  # still differentiable from what was saved


def _cp_world(rank, world):
    mesh = ParallelMesh(bh.Plan(cp=world, dp=1), rank, world)
    axis = mesh.axis("cp")
    assert axis.size == world
    for mode in CORES:
        for i, (n, k_heads, scale) in enumerate(CASES):
            _parity(axis, mode, n, k_heads, scale, seed=10 * world + i)
    _low_precision_ring(axis)
    _autocast_ring(axis)
    _ring_memory(axis)


def test_context_attention_cp2():
    bh.spawn(_cp_world, 2, timeout=180)


def test_context_attention_cp4():
    bh.spawn(_cp_world, 4, timeout=180)

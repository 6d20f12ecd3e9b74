"""Context parallelism's pure layout math (zigzag chunks, split/gather, position ids, the
live block of each ring step, traffic formulas) and its errors; plus both attention cores
on a one-rank axis against F.scaled_dot_product_attention. No processes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from behemoth import comm
from behemoth.parallel.context import (
    check_sequence,
    gather_sequence,
    position_ids_for,
    ring_attention,
    ring_bytes,
    ring_step_block,
    split_sequence,
    ulysses_attention,
    ulysses_bytes,
    ulysses_kv_heads,
    zigzag_chunks,
    zigzag_indices,
)


def test_zigzag_indices():
    assert zigzag_indices(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert zigzag_indices(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert zigzag_indices(16, 4, 1).tolist() == [2, 3, 12, 13]
    assert zigzag_indices(4, 1, 0).tolist() == [0, 1, 2, 3]
    assert zigzag_chunks(4, 3) == (3, 4)
    for cp in (1, 2, 3, 4):
        s = 2 * cp * 3
        idx = [zigzag_indices(s, cp, r) for r in range(cp)]
        assert torch.cat(idx).sort().values.tolist() == list(range(s))  # a partition of the sequence
        for i in idx:
            assert (i.diff() > 0).all()  # local positions increase, so the own block is plain causal


def test_position_ids_match_split():
    for mode in ("ulysses", "ring"):
        for cp in (1, 2, 4):
            s = 8 * cp
            for r in range(cp):
                got = split_sequence(torch.arange(s), 0, cp, r, mode)
                assert got.tolist() == position_ids_for(s, cp, r, mode).tolist()
    assert position_ids_for(12, 3, 1, "ulysses").tolist() == [4, 5, 6, 7]


@pytest.mark.parametrize("mode", ["ulysses", "ring"])
@pytest.mark.parametrize("dim", [0, 1, 2, -2])
def test_split_gather_roundtrip(mode, dim):
    cp = 4
    shape = [3, 4, 5, 2]
    shape[dim] = 16
    x = torch.randn(shape)
    parts = [split_sequence(x, dim, cp, r, mode) for r in range(cp)]
    assert all(p.shape[dim] == 4 for p in parts)
    assert torch.equal(gather_sequence(parts, dim, mode), x)


def test_split_is_differentiable():
    x = torch.randn(2, 8, requires_grad=True)
    split_sequence(x, 1, 2, 1, "ring").sum().backward()
    assert x.grad.tolist() == [[0, 0, 1, 1, 1, 1, 0, 0]] * 2


@pytest.mark.parametrize(
    "args, needle",
    [
        ((10, 4, "ulysses"), "seq_len=10, cp=4 (remainder 2)"),
        ((12, 4, "ring"), "divisible by 2*cp=8 (zigzag chunks); got seq_len=12, cp=4"),
        ((16, 4, "ulysses", 6, 6), "num_heads=6, cp=4"),
        ((16, 2, "ring", 6, 4), "num_heads=6, num_kv_heads=4"),
        ((16, 2, "ulysses", 6, 4), "num_heads=6, num_kv_heads=4"),
        ((16, 0, "ring"), "cp=0"),
        ((16, 2, "context"), "mode 'context' is not one of"),
    ],
)
def test_check_sequence_errors(args, needle):
    with pytest.raises(ValueError) as e:
        check_sequence(*args)
    assert needle in str(e.value)


def test_check_sequence_accepts():
    check_sequence(16, 4, "ring", 6, 3)  # heads need not divide cp for ring
    check_sequence(16, 4, "ulysses", 8, 2)  # fewer kv heads than cp: replicated
    check_sequence(16, 4, "ulysses", 4, 1)
    check_sequence(7, 1, "ulysses")


def test_layout_errors():
    with pytest.raises(ValueError, match="rank=2 is out of range for cp=2"):
        split_sequence(torch.zeros(8), 0, 2, 2, "ring")
    with pytest.raises(ValueError, match="seq_len=9, cp=2"):
        split_sequence(torch.zeros(9), 0, 2, 0, "ulysses")
    with pytest.raises(ValueError, match="must be even; got 3"):
        gather_sequence([torch.zeros(3), torch.zeros(3)], 0, "ring")


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_ring_step_block_is_the_causal_mask(cp):
    """The rectangle each ring step computes is exactly where the global causal mask is live."""
    c = 3
    s = 2 * cp * c
    for r in range(cp):
        qpos = zigzag_indices(s, cp, r)
        for src in range(cp):
            kpos = zigzag_indices(s, cp, src)
            live = qpos[:, None] >= kpos[None, :]
            rows, cols, causal = ring_step_block(cp, r, src, 2 * c)
            want = torch.zeros_like(live)
            n_rows, n_cols = rows.stop - rows.start, cols.stop - cols.start
            block = torch.ones(n_rows, n_cols, dtype=torch.bool)
            want[rows, cols] = block.tril() if causal else block
            assert torch.equal(live, want), (cp, r, src)
            assert n_rows * n_cols == (2 * c) ** 2 // (1 if src == r else 2)  # balanced work


def test_ulysses_kv_heads():
    assert ulysses_kv_heads(4, 2) == 4  # split
    assert ulysses_kv_heads(2, 4) == 4  # replicated: one per rank
    assert ulysses_kv_heads(1, 4) == 4
    assert ulysses_kv_heads(6, 4) == 12  # neither: lcm
    assert ulysses_kv_heads(3, 1) == 3


def test_traffic_formulas_against_the_issue():
    b, s, n, d, e = 2, 64, 8, 16, 4
    h = n * d
    for cp in (2, 4, 8):
        # MHA: exactly Ulysses' 4*b*s*h/cp elements per attention forward.
        assert ulysses_bytes(b, s, n, n, d, cp, e) == 4 * b * s * h // cp * e
        assert ulysses_bytes(b, s, n, n, d, cp, e, wire=True) == 4 * b * s * h // cp * e * (cp - 1) // cp
        for kh in (1, 2, 8):
            assert ring_bytes(b, s, kh, d, cp, e) == 2 * (cp - 1) * b * (s // cp) * kh * d * e
    assert ulysses_bytes(b, s, 8, 2, d, 4, e) == b * (s // 4) * d * (16 + 8) * e  # K'=4
    assert ulysses_bytes(b, s, n, n, d, 1, e) == ring_bytes(b, s, n, d, 1, e) == 0
    assert ring_bytes(b, s, 2, d, 4, 2, backward=True) == 2 * b * (s // 4) * 2 * d * (3 * 2 + 4 * 4)


@pytest.mark.parametrize("n, k_heads, scale", [(4, 4, None), (4, 2, 0.3), (6, 1, None)])
def test_one_rank_cores_equal_sdpa(n, k_heads, scale):
    """On a one-rank axis both cores are plain causal attention (ring: one block, the diagonal)."""
    axis = comm.Axis("cp", 1, 0, (0,), None, comm.Ledger())
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, n, 8, 4, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, k_heads, 8, 4, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, k_heads, 8, 4, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(2, n, 8, 4, generator=g, dtype=torch.float64)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    want = torch.autograd.grad((ref * w).sum(), (q, k, v))
    for fn in (ulysses_attention, ring_attention):
        out = fn(q, k, v, axis, scale=scale)
        torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
        for got, exp in zip(torch.autograd.grad((out * w).sum(), (q, k, v)), want):
            torch.testing.assert_close(got, exp, rtol=1e-12, atol=1e-12)


def test_cores_validate_before_communicating():
    """Shape errors are raised from shapes alone, so every rank raises before a collective."""
    axis = comm.Axis("cp", 4, 0, (0, 1, 2, 3), None, comm.Ledger())  # no group: any collective would fail
    q, kv = torch.zeros(1, 6, 4, 2), torch.zeros(1, 6, 4, 2)
    with pytest.raises(ValueError, match="num_heads=6, cp=4"):
        ulysses_attention(q, kv, kv, axis)
    with pytest.raises(ValueError, match="num_heads=6, num_kv_heads=4"):
        ring_attention(q, torch.zeros(1, 4, 4, 2), torch.zeros(1, 4, 4, 2), axis)
    with pytest.raises(ValueError, match="divisible by 2\\*cp=8"):
        ring_attention(torch.zeros(1, 2, 3, 2), torch.zeros(1, 2, 3, 2), torch.zeros(1, 2, 3, 2), axis)
    with pytest.raises(ValueError, match="of one shape"):
        ring_attention(q, kv, torch.zeros(1, 6, 4, 3), axis)

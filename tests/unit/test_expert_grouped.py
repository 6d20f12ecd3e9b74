"""The grouped expert GEMMs' two paths agree: ``torch._grouped_mm`` (it runs on CPU builds too,
through a loop of its own) against the per-expert ``F.linear`` loop, for uneven groups, experts
with no rows and no rows at all, in float32, in bf16 and under bf16 autocast over float32
weights (the cast weights' gradients arrive in float32, as autocast's do); and the padding's
bookkeeping exactly."""

from __future__ import annotations

import pytest
import torch

from behemoth.comm import Axis, Ledger
from behemoth.parallel.expert import grouped
from behemoth.parallel.expert.dispatch import combine, dispatch
from behemoth.parallel.expert.grouped import (
    GROUP_ROWS,
    grouped_swiglu,
    pad_groups,
    padded_rows,
    swiglu_grouped_mm,
    swiglu_loop,
)

H, I, E = 16, 8, 4


def test_pad_groups_and_rows():
    padded, shift = pad_groups([0, 5, 16, 17], 16)
    assert padded == [16, 16, 16, 32] and shift == [0, 16, 27, 27]
    rows = padded_rows([0, 5, 16, 17], shift, torch.device("cpu"))
    assert rows.tolist() == list(range(16, 21)) + list(range(32, 48)) + list(range(48, 65))
    assert pad_groups([32, 48], 16) == ([32, 48], [0, 0])  # aligned: nothing moves
    assert pad_groups([0, 0], 16) == ([16, 16], [0, 16])
    assert pad_groups([3, 0, 1], 1) == ([3, 1, 1], [0, 0, 1])
    assert padded_rows([0, 0], [0, 16], torch.device("cpu")).tolist() == []


def _operands(counts, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(E, 2 * I, H, generator=g).to(dtype).requires_grad_()
    down = torch.randn(E, H, I, generator=g).to(dtype).requires_grad_()
    x = torch.randn(sum(counts), H, generator=g).to(dtype).requires_grad_()
    dy = torch.randn(sum(counts), H, generator=g)
    return x, gate_up, down, dy


def _run(fn, counts, dtype, autocast_dtype=None):
    x, gate_up, down, dy = _operands(counts, dtype)
    with torch.autocast("cpu", dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
        y = fn(x, counts, gate_up, down)
    y.backward(dy.to(y.dtype))
    return y.detach(), x.grad, gate_up.grad, down.grad


CASES = {
    "fp32": (torch.float32, None, dict(rtol=1e-5, atol=1e-5)),
    "bf16": (torch.bfloat16, None, dict(rtol=1.6e-2, atol=1e-2)),
    "autocast": (torch.float32, torch.bfloat16, dict(rtol=1.6e-2, atol=1e-2)),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("counts", [[5, 0, 23, 1], [16, 32, 0, 48], [0, 0, 0, 0], [0, 7, 0, 0]])
def test_grouped_mm_equals_loop(case, counts):
    dtype, autocast_dtype, tol = CASES[case]
    got = _run(swiglu_grouped_mm, counts, dtype, autocast_dtype)
    want = _run(swiglu_loop, counts, dtype, autocast_dtype)
    out_dtype = autocast_dtype or dtype
    assert got[0].dtype == want[0].dtype == out_dtype and got[0].shape == (sum(counts), H)
    for name, a, b in zip(("y", "x.grad", "gate_up.grad", "down.grad"), got, want):
        assert a.dtype == b.dtype, name
        torch.testing.assert_close(a, b, msg=name, **tol)
    # the parameters' gradients in the parameters' dtype (float32 under autocast), none for an idle expert
    assert got[2].dtype == got[3].dtype == dtype
    for e, n in enumerate(counts):
        if n == 0:
            assert float(got[2][e].abs().sum()) == 0.0 and float(got[3][e].abs().sum()) == 0.0


def test_padding_changes_nothing():
    """Groups already a multiple of GROUP_ROWS run unpadded; the same rows in uneven groups (the
    padded path) give the same rows out, bit for bit in float32 on CPU."""
    counts = [GROUP_ROWS, 2 * GROUP_ROWS, GROUP_ROWS, 3 * GROUP_ROWS]
    x, gate_up, down, _ = _operands(counts, torch.float32)
    aligned = swiglu_grouped_mm(x, counts, gate_up, down)
    torch.testing.assert_close(aligned, swiglu_loop(x, counts, gate_up, down), rtol=1e-5, atol=1e-5)
    # drop the last row of every group: the padded path must give the remaining rows' outputs
    keep = torch.cat([torch.arange(s, s + n - 1) for s, n in zip([0, 16, 48, 64], counts)])
    uneven = swiglu_grouped_mm(x[keep], [n - 1 for n in counts], gate_up, down)
    torch.testing.assert_close(uneven, aligned[keep], rtol=0, atol=0)


def test_grouped_swiglu_takes_the_loop_on_cpu(monkeypatch):
    counts = [3, 0, 2, 1]
    x, gate_up, down, _ = _operands(counts, torch.bfloat16)
    assert not grouped.grouped_mm_available(x, gate_up, counts)  # CPU: the fast kernel is CUDA's
    torch.testing.assert_close(grouped_swiglu(x, counts, gate_up, down), swiglu_loop(x, counts, gate_up, down))
    # where it is available, grouped_swiglu takes the grouped path
    monkeypatch.setattr(grouped, "grouped_mm_available", lambda *a: True)
    calls = []
    monkeypatch.setattr(grouped, "swiglu_grouped_mm", lambda *a: calls.append(a) or swiglu_grouped_mm(*a))
    grouped.grouped_swiglu(x, counts, gate_up, down)
    assert len(calls) == 1


class OneRankMesh:
    def __init__(self) -> None:
        self.ledger = Ledger()

    def axis(self, name: str) -> Axis:
        return Axis(name, 1, 0, (0,), None, self.ledger)


def test_dispatch_pads_groups_and_combine_drops_them():
    """dispatch(align=16) lays each local expert's rows out padded with zero rows (the same rows
    as align=1 otherwise), and combine reads back exactly what it reads unpadded."""
    g = torch.Generator().manual_seed(1)
    x_TH = torch.randn(9, H, generator=g)
    experts_TK = torch.tensor([[0, 2], [2, 3], [0, 2], [3, 0], [2, 0], [0, 3], [2, 3], [0, 2], [3, 2]])
    weights_TK = torch.rand(9, 2, generator=g)
    axis = OneRankMesh().axis("ep")
    x1, counts1, r1 = dispatch(x_TH, experts_TK, E, axis)
    x16, counts16, r16 = dispatch(x_TH, experts_TK, E, axis, align=16)
    assert counts1 == [6, 0, 7, 5] and counts16 == [16, 16, 16, 16]
    starts = [0, 16, 32, 48]
    for e, n in enumerate(counts1):
        block = x16[starts[e] : starts[e] + 16]
        assert torch.equal(block[:n], x1[sum(counts1[:e]) : sum(counts1[: e + 1])])
        assert float(block[n:].abs().sum()) == 0.0
    # groups already a multiple of 16: laid out as unpadded
    even_TK = torch.arange(4 * GROUP_ROWS).remainder(E)[:, None]
    x_even = torch.randn(4 * GROUP_ROWS, H, generator=g)
    x_a, counts_a, _ = dispatch(x_even, even_TK, E, axis, align=16)
    x_b, counts_b, _ = dispatch(x_even, even_TK, E, axis)
    assert counts_a == counts_b == [GROUP_ROWS] * E and torch.equal(x_a, x_b)
    y1 = x1 * 2 + 1  # stands in for the experts (rows of padding come out non-zero: combine must drop them)
    torch.testing.assert_close(combine(x16 * 2 + 1, weights_TK, r16), combine(y1, weights_TK, r1), rtol=0, atol=0)


def test_expert_parallel_grouped_padded_equals_serial(monkeypatch):
    """The ExpertParallel layer with its groups padded by dispatch and its experts through the
    grouped path (forced on CPU) computes the serial layer's output and gradients."""
    from behemoth.models.moe import MoEFeedForward
    from behemoth.parallel.expert import ExpertParallel, style

    monkeypatch.setattr(style, "group_alignment", lambda x: GROUP_ROWS)
    monkeypatch.setattr(grouped, "grouped_mm_available", lambda *a: True)
    torch.manual_seed(0)
    serial = MoEFeedForward(H, I, E, 2)
    with torch.no_grad():
        for p in serial.parameters():
            p.normal_(0, 0.5)
    parallel = MoEFeedForward(H, I, E, 2)
    parallel.load_state_dict(serial.state_dict())
    ExpertParallel().apply(parallel, OneRankMesh())
    x = torch.randn(2, 11, H)
    y_s, y_p = serial(x), parallel(x)
    torch.testing.assert_close(y_p, y_s, rtol=1e-5, atol=1e-5)
    y_s.square().sum().backward()
    y_p.square().sum().backward()
    for (name, a), b in zip(serial.named_parameters(), parallel.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weight_layout", ["transposed", "row-major"])
def test_grouped_mm_operator_equals_torch_and_keeps_the_weights_layout(dtype, weight_layout):
    """The opaque operator compiled blocks trace: value and both gradients bit for bit those of
    ``torch._grouped_mm``'s own autograd, for a weight passed transposed (``[E, O, K]`` as
    ``[E, K, O]``, the experts' case) and one passed row-major; a transposed weight's gradient
    comes out in the weight's own layout (contiguous: no strided copy where it accumulates), and
    an operand starting off 16 bytes is copied to an aligned one first."""
    g = torch.Generator().manual_seed(3)
    K, O = 16, 24
    ends = torch.tensor([16, 48, 64], dtype=torch.int32)
    x = torch.randn(64, K, generator=g).to(dtype).requires_grad_()
    if weight_layout == "transposed":
        w = torch.randn(3, O, K, generator=g).to(dtype).requires_grad_()
        b = w.transpose(-2, -1)
    else:
        w = torch.randn(3, K, O, generator=g).to(dtype).requires_grad_()
        b = w
    dy = torch.randn(64, O, generator=g).to(dtype)
    want = torch._grouped_mm(x, b, offs=ends)
    want_grads = torch.autograd.grad(want, (x, w), dy)
    got = grouped.grouped_mm(x, b, ends)
    got_grads = torch.autograd.grad(got, (x, w), dy)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for a, c in zip(got_grads, want_grads):
        torch.testing.assert_close(a, c, rtol=0, atol=0)
    assert got_grads[1].is_contiguous()
    # an operand one element into its storage (2 or 4 bytes: off 16) gives the same product
    shifted = torch.cat([x.detach().new_zeros(1), x.detach().reshape(-1)])[1:].view(64, K)
    assert shifted.data_ptr() % 16 != 0
    torch.testing.assert_close(grouped.grouped_mm(shifted, b.detach(), ends), want.detach(), rtol=0, atol=0)
    torch.library.opcheck(grouped.grouped_mm, (x, b, ends))

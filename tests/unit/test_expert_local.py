"""behemoth.parallel.expert.local: an MoE layer on a rank holding every expert, its routes made on
the device alone. The layout exactly (each expert's assignments in (token, slot) order at the
start of its padded group, the last group taking the rows left over), and the style's local path
-- forced on the CPU, where ``torch._grouped_mm`` runs a loop of its own -- against the serial
layer and the routed path: outputs, router losses and gradients, in float32 and under bf16
autocast, with idle and hot experts; no host read and no sort in forward or backward; a capacity
keeps the routed path; the layer compiled whole (no graph break) computes what it computes eagerly."""

from __future__ import annotations

import pytest
import torch
from host_reads import HostReads
from test_expert_grouped import OneRankMesh

from behemoth.models.moe import MoEFeedForward
from behemoth.parallel.expert import ExpertParallel, grouped, local
from behemoth.parallel.expert.grouped import GROUP_ROWS
from behemoth.parallel.expert.local import layout, num_layout_rows


@pytest.mark.parametrize(
    "experts", [[[0, 2], [2, 3], [0, 2], [3, 0], [2, 0]], [[1, 0]] * 20, [[3, 1], [1, 3]], [[0, 1]] * 40]
)
def test_layout_puts_each_experts_assignments_first_in_its_padded_group(experts):
    E = 4
    experts_TK = torch.tensor(experts)
    slot_A, ends_E, num_rows = layout(experts_TK, E)
    A = experts_TK.numel()
    assert num_rows == num_layout_rows(A, E) == -(-A // GROUP_ROWS) * GROUP_ROWS + E * GROUP_ROWS
    flat = experts_TK.reshape(-1).tolist()
    counts = [flat.count(e) for e in range(E)]
    padded = [max(GROUP_ROWS, -(-n // GROUP_ROWS) * GROUP_ROWS) for n in counts]
    starts = [sum(padded[:e]) for e in range(E)]
    want = [starts[e] + flat[:f].count(e) for f, e in enumerate(flat)]
    assert slot_A.tolist() == want
    ends = [sum(padded[: e + 1]) for e in range(E)]
    assert ends_E.dtype == torch.int32 and ends_E.tolist() == ends[:-1] + [num_rows] and ends[-1] <= num_rows
    assert all(e % GROUP_ROWS == 0 for e in ends_E.tolist())


def _layer(seed=0, **kw) -> MoEFeedForward:
    torch.manual_seed(seed)
    layer = MoEFeedForward(16, 16, 4, 2, aux_loss_coef=0.1, z_loss_coef=0.01, **kw)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.5)
    return layer


def _run(layer, x, autocast: bool):
    x = x.clone().requires_grad_()
    with HostReads() as forward:
        with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            y = layer(x)
    loss = y.float().square().sum() + layer.aux_loss
    with HostReads() as backward:
        loss.backward()
    grads = [x.grad] + [p.grad for p in layer.parameters()]
    return y.detach(), layer.aux_loss.detach(), grads, forward, backward


def _forced(monkeypatch):
    """The grouped GEMMs' fast kernel claimed for bf16 GEMMs on the CPU (where the local path then runs)."""
    monkeypatch.setattr(grouped, "_fast_kernel", lambda x: grouped.gemm_dtype(x) == torch.bfloat16)


@pytest.mark.parametrize("routing", ["random", "hot", "idle"])
def test_local_path_equals_routed_path_and_serial(routing, monkeypatch):
    _forced(monkeypatch)
    calls = []
    real = local.local_exchange
    monkeypatch.setattr("behemoth.parallel.expert.style.local_exchange", lambda *a: calls.append(1) or real(*a))
    serial = _layer()
    x = torch.randn(3, 7, 16, generator=torch.Generator().manual_seed(1))
    if routing != "random":  # steer the router: every token to experts 1 and 2 (hot), or never to expert 3 (idle)
        with torch.no_grad():
            serial.router.weight.zero_()
            x[..., 0] = 1.0
            serial.router.weight[1, 0] = serial.router.weight[2, 0] = 5.0
            if routing == "idle":
                serial.router.weight[0] = torch.randn(16) * 0.3
                serial.router.weight[0, 0] = 4.9
    styled = _layer()
    styled.load_state_dict(serial.state_dict())
    ExpertParallel().apply(styled, OneRankMesh())
    routed = _layer()
    routed.load_state_dict(serial.state_dict())
    ExpertParallel().apply(routed, OneRankMesh())

    want = _run(serial, x, autocast=True)
    got = _run(styled, x, autocast=True)
    assert calls == [1]
    monkeypatch.setattr(grouped, "_fast_kernel", lambda x: False)
    via_routes = _run(routed, x, autocast=True)
    tol = dict(rtol=1.6e-2, atol=2e-2)  # bf16 GEMMs against the serial layer's
    torch.testing.assert_close(got[0], want[0], **tol)
    torch.testing.assert_close(got[1], want[1], rtol=1e-6, atol=0)  # the router's terms are float32
    for a, b in zip(got[2], want[2]):
        torch.testing.assert_close(a, b, **tol)
    torch.testing.assert_close(got[0], via_routes[0], **tol)
    # no host read, no sort in the backward, no atomic accumulation
    assert dict(got[3].counts) == {} and got[4].total() == 0, (got[3].counts, got[4].counts)
    assert got[3].ops["sort"] == 1 and not {"sort", "index_put", "index_put_", "index_add"} & set(got[4].ops)
    assert dict(via_routes[3].counts) == {"tolist": 1}  # the routed path reads the split sizes


def test_local_path_in_float32_matches_serial_closely(monkeypatch):
    """float32 GEMMs are not the fast kernel's: forced here to check the layout's arithmetic tightly."""
    monkeypatch.setattr(grouped, "_fast_kernel", lambda x: True)
    serial, styled = _layer(), _layer()
    styled.load_state_dict(serial.state_dict())
    ExpertParallel().apply(styled, OneRankMesh())
    x = torch.randn(2, 9, 16, generator=torch.Generator().manual_seed(2))
    want, got = _run(serial, x, autocast=False), _run(styled, x, autocast=False)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], want[1], rtol=1e-6, atol=0)
    for a, b in zip(got[2], want[2]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert dict(got[3].counts) == {}


def test_capacity_keeps_the_routed_path(monkeypatch):
    _forced(monkeypatch)
    monkeypatch.setattr("behemoth.parallel.expert.style.local_exchange", lambda *a: pytest.fail("local path"))
    layer = _layer(capacity_factor=1.0)
    ExpertParallel().apply(layer, OneRankMesh())
    got = _run(layer, torch.randn(2, 8, 16), autocast=True)
    assert dict(got[3].counts) == {"tolist": 1}


@pytest.mark.parametrize("routing", ["random", "hot"])
def test_local_path_compiles_whole_and_equals_eager(routing, monkeypatch):
    """The local path inside a compiled block: one graph (``fullgraph=True`` fails on any break),
    with the same outputs, router losses and gradients as the eager layer -- exactly, through
    AOT autograd's graphs run eagerly (inductor's fused kernels round bf16 differently)."""
    _forced(monkeypatch)
    calls = []
    real = local.local_exchange
    monkeypatch.setattr("behemoth.parallel.expert.style.local_exchange", lambda *a: calls.append(1) or real(*a))
    eager, compiled = _layer(), _layer()
    x = torch.randn(3, 7, 16, generator=torch.Generator().manual_seed(4))
    if routing == "hot":  # every token to experts 1 and 2: experts 0 and 3 get padding rows only
        x[..., 0] = 1.0
        for layer in (eager, compiled):
            with torch.no_grad():
                layer.router.weight.zero_()
                layer.router.weight[1, 0] = layer.router.weight[2, 0] = 5.0
    for layer in (eager, compiled):
        ExpertParallel().apply(layer, OneRankMesh())
    torch._dynamo.reset()
    whole = torch.compile(compiled, fullgraph=True, backend="aot_eager")
    want = _run(eager, x, autocast=True)
    got = _run_with(compiled, whole, x)
    assert calls == [1, 1]
    for a, b in zip(got, want[:3]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def _run_with(layer, fn, x):
    x = x.clone().requires_grad_()
    with torch.autocast("cpu", torch.bfloat16):
        y = fn(x)
    (y.float().square().sum() + layer.aux_loss).backward()
    return y.detach(), layer.aux_loss.detach(), [x.grad] + [p.grad for p in layer.parameters()]

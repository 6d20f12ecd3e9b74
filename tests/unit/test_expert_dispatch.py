"""Expert parallelism's pure parts on one process: the permutation math of dispatch, the
grouped expert GEMMs, and the ExpertParallel style on trivial axes (it must compute exactly
what the serial MoE layer computes)."""

from __future__ import annotations

import torch

from behemoth.comm import Axis, Ledger
from behemoth.models.moe import MoEFeedForward, swiglu_expert
from behemoth.parallel.expert import ExpertParallel, grouped_swiglu
from behemoth.parallel.expert.dispatch import count_experts


def sort_by_expert(experts_TK: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: ``(order_A, counts_E)``, the flat (token, slot) indices ``t*K + k`` sorted by
    expert (stable) and the assignments per expert; an assignment to expert ``num_experts``
    (dropped by a capacity) left out of both -- what dispatch's one sort and count give."""
    flat_A = experts_TK.reshape(-1)
    counts = count_experts(flat_A, num_experts + 1)
    kept = flat_A.numel() - int(counts[num_experts])
    return torch.argsort(flat_A, stable=True)[:kept], counts[:num_experts]


def local_order(recv_counts_RL: torch.Tensor) -> torch.Tensor:
    """Reference: the rows received from members ``0..R-1`` (each in local-expert order) regrouped
    by local expert, as a permutation ``perm`` (``received[perm]`` lists local expert 0's rows
    first); dispatch's scatter by :func:`block_shifts` is its inverse."""
    num_local = recv_counts_RL.shape[1]
    expert_of_row = torch.arange(num_local, device=recv_counts_RL.device).repeat(recv_counts_RL.shape[0])
    expert_of_row = torch.repeat_interleave(expert_of_row, recv_counts_RL.reshape(-1))
    return torch.argsort(expert_of_row, stable=True)


class OneRankMesh:
    def __init__(self) -> None:
        self.ledger = Ledger()

    def axis(self, name: str) -> Axis:
        return Axis(name, 1, 0, (0,), None, self.ledger)


def test_sort_by_expert_and_local_order():
    experts_TK = torch.tensor([[2, 0], [1, 2], [0, 3]])
    order, counts = sort_by_expert(experts_TK, 4)
    assert order.tolist() == [1, 4, 2, 0, 3, 5] and counts.tolist() == [2, 1, 2, 1]
    # 2 senders x 3 local experts: sender 0 sent [2, 0, 1] rows, sender 1 sent [1, 2, 0]
    perm = local_order(torch.tensor([[2, 0, 1], [1, 2, 0]]))
    # received rows 0,1 (s0,e0) 2 (s0,e2) 3 (s1,e0) 4,5 (s1,e1): grouped e0: 0,1,3; e1: 4,5; e2: 2
    assert perm.tolist() == [0, 1, 3, 4, 5, 2]
    assert local_order(torch.zeros(2, 3, dtype=torch.int64)).tolist() == []


def test_grouped_swiglu_equals_each_expert():
    g = torch.Generator().manual_seed(0)
    gate_up, down = torch.randn(3, 10, 8, generator=g), torch.randn(3, 8, 5, generator=g)
    counts = [4, 0, 3]
    x = torch.randn(7, 8, generator=g)
    expected = torch.cat([swiglu_expert(x[:4], gate_up[0], down[0]), swiglu_expert(x[4:], gate_up[2], down[2])])
    torch.testing.assert_close(grouped_swiglu(x, counts, gate_up, down), expected, rtol=0, atol=0)
    empty = torch.randn(0, 8, requires_grad=True)
    out = grouped_swiglu(empty, [0, 0, 0], gate_up, down)
    assert out.shape == (0, 8) and out.grad_fn is not None  # stays in the graph


def test_expert_parallel_on_one_rank_equals_serial():
    torch.manual_seed(0)
    serial = MoEFeedForward(16, 12, 4, 2, aux_loss_coef=0.1, z_loss_coef=0.01)
    with torch.no_grad():
        for p in serial.parameters():
            p.normal_(0, 0.5)
    parallel = MoEFeedForward(16, 12, 4, 2, aux_loss_coef=0.1, z_loss_coef=0.01)
    parallel.load_state_dict(serial.state_dict())
    assert ExpertParallel().apply(parallel, OneRankMesh()) is parallel
    x = torch.randn(2, 5, 16)
    y_s, y_p = serial(x), parallel(x)
    torch.testing.assert_close(y_p, y_s, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(parallel.aux_loss, serial.aux_loss, rtol=1e-6, atol=0)
    (y_s.square().sum() + serial.aux_loss).backward()
    (y_p.square().sum() + parallel.aux_loss).backward()
    for (name, a), b in zip(serial.named_parameters(), parallel.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_block_shifts_place_rows_as_local_order_and_padded_rows():
    """The scatter dispatch makes (row i of block b to ``i + shift[b]``) is the inverse of the
    regrouping :func:`local_order` gives, and with padding lands each row where
    :func:`~behemoth.parallel.expert.grouped.padded_rows` puts it."""
    from behemoth.parallel.expert.dispatch import block_shifts, padding_rows, placement
    from behemoth.parallel.expert.grouped import pad_groups, padded_rows

    recv = [[2, 0, 1], [1, 2, 0], [0, 3, 4]]
    local = [sum(r[l] for r in recv) for l in range(3)]
    flat = torch.tensor(sum(recv, []))
    for align in (1, 4, 16):
        padded, shift = pad_groups(local, align) if align > 1 else (local, [0, 0, 0])
        moved = torch.repeat_interleave(torch.tensor(block_shifts(recv, padded)), flat)
        slot = torch.arange(int(flat.sum())) + moved
        want = padded_rows(local, shift, torch.device("cpu"))[torch.argsort(local_order(torch.tensor(recv)))]
        assert slot.tolist() == want.tolist(), align
    assert block_shifts([[3, 1]], [3, 1]) == [0, 0]  # one member, unpadded: rows stay where they arrive
    # the padding: every row of the padded layout that no received row lands on
    padded = pad_groups(local, 4)[0]
    slot = torch.arange(int(flat.sum())) + torch.repeat_interleave(torch.tensor(block_shifts(recv, padded)), flat)
    free = sorted(set(range(sum(padded))) - set(slot.tolist()))
    assert padding_rows(local, padded) == free and len(free) == sum(padded) - sum(local)
    # the placement made on the host: those slots, then the padding rows
    got = placement(block_shifts(recv, padded), sum(recv, []), padding_rows(local, padded))
    assert got.dtype == torch.int64 and got.tolist() == slot.tolist() + free
    assert placement([0, 3], [0, 0], []).tolist() == []
    assert padding_rows([2, 0], [16, 16]) == list(range(2, 32)) and padding_rows([3], [3]) == []


def test_one_host_read_per_moe_layer():
    """An expert-parallel MoE layer's forward reads device values to the host once (the split
    sizes, one ``tolist``) and its backward never: no ``item``, no boolean mask, no ``bincount``,
    no ``repeat_interleave`` without ``output_size`` (each a device sync on a GPU); one sort in the
    forward, none in the backward. Also with a capacity, the groups padded, and bf16 autocast."""
    from host_reads import HostReads

    from behemoth.parallel.expert import style

    for capacity, align, autocast in ((None, 1, False), (1.0, 16, False), (None, 16, True)):
        what = f"capacity={capacity} align={align} autocast={autocast}"
        torch.manual_seed(0)
        layer = MoEFeedForward(16, 12, 4, 2, aux_loss_coef=0.1, z_loss_coef=0.01, capacity_factor=capacity)
        ExpertParallel().apply(layer, OneRankMesh())
        x = torch.randn(2, 5, 16, requires_grad=True)
        real = style.group_alignment
        style.group_alignment = lambda x_TH: align
        try:
            with HostReads() as forward:
                with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
                    y = layer(x)
            loss = y.float().square().sum() + layer.aux_loss
            with HostReads() as backward:
                loss.backward()
        finally:
            style.group_alignment = real
        assert dict(forward.counts) == {"tolist": 1}, (what, forward.counts)
        assert backward.total() == 0, (what, backward.counts)
        # one sort (by expert) in the forward; the backward sorts nothing (no index_put with accumulate,
        # which sorts its indices on a GPU: every permutation's backward is its adjoint gather or scatter)
        assert forward.ops["sort"] == 1, (what, forward.ops)
        assert not {"sort", "index_put", "index_put_"} & set(backward.ops), (what, backward.ops)


def test_moe_layers_take_the_expert_path_under_any_plan():
    """parallelize_experts styles behemoth's MoE layers whatever the plan -- one data rank at ep = 1
    too (a pipeline, tensor parallelism, one device) -- so a forward reads the device once (the
    split sizes), where the serial layer's loop reads it once per expert (``torch.where``), and
    computes what the serial layer computes."""
    from host_reads import HostReads

    import behemoth as bh
    from behemoth.parallel.expert import parallelize_experts

    torch.manual_seed(0)
    serial = MoEFeedForward(16, 12, 4, 2, aux_loss_coef=0.1)
    with torch.no_grad():
        for p in serial.parameters():
            p.normal_(0, 0.5)
    for plan in (bh.Plan(pp=2, microbatches=8), bh.Plan(tp=2), bh.Plan()):
        layer = MoEFeedForward(16, 12, 4, 2, aux_loss_coef=0.1)
        layer.load_state_dict(serial.state_dict())
        parallelize_experts(torch.nn.Sequential(layer), OneRankMesh(), plan)
        assert "forward" in layer.__dict__ and layer._behemoth_expert_routes, plan
    x = torch.randn(2, 5, 16)
    with HostReads() as styled:
        y = layer(x)
    with HostReads() as loop:
        want = serial(x)
    assert dict(styled.counts) == {"tolist": 1} and "nonzero" not in styled.ops
    assert loop.ops["nonzero"] == 4  # the serial layer: once per expert
    torch.testing.assert_close(y, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(layer.aux_loss, serial.aux_loss, rtol=1e-6, atol=0)


class Mirror:
    """``dist.all_to_all_single`` of an axis whose every member sends what this one sends: the rows
    received are the rows sent (the split sizes then agree), so one process runs a member's whole
    exchange -- every op of it -- with no process group."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
        self.calls += 1
        assert list(output_split_sizes) == list(input_split_sizes)
        output.copy_(input)
        assert not async_op


def mirrored_axis(monkeypatch, size: int = 2) -> tuple[Axis, Mirror]:
    import torch.distributed as dist

    mirror = Mirror()
    monkeypatch.setattr(dist, "all_to_all_single", mirror)
    return Axis("ep", size, 0, tuple(range(size)), None, Ledger()), mirror


def test_mirrored_exchange_weighs_each_tokens_rows(monkeypatch):
    """dispatch -> identity experts -> combine over a mirrored ep = 2 axis (the rows come back as
    sent): each token's output is its k routing weights times its row, its gradients those of
    that sum; a capacity's drops add nothing; the groups padded or not."""
    from behemoth.parallel.expert.dispatch import combine, dispatch

    ep, _ = mirrored_axis(monkeypatch)
    g = torch.Generator().manual_seed(5)
    T, H, E, K = 23, 6, 8, 2
    for align, drop in ((1, False), (4, False), (16, True)):
        experts_TK = torch.rand(T, E, generator=g).argsort(-1)[:, :K]
        if drop:
            experts_TK[::4, 1] = E
        kept_TK = (experts_TK < E).double()
        x = torch.randn(T, H, generator=g, dtype=torch.float64, requires_grad=True)
        w = torch.rand(T, K, generator=g, dtype=torch.float64, requires_grad=True)
        x_NH, counts, routed = dispatch(x, experts_TK, E, ep, align=align)
        assert x_NH.shape[0] == sum(counts) and all(c % align == 0 for c in counts)
        y = combine(x_NH * 1, w, routed)
        want = ((w * kept_TK).sum(1, keepdim=True) * x).detach()
        torch.testing.assert_close(y, want, rtol=1e-12, atol=1e-12)
        dy = torch.randn(T, H, generator=g, dtype=torch.float64)
        y.backward(dy)
        torch.testing.assert_close(x.grad, (w * kept_TK).sum(1, keepdim=True).detach() * dy, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(w.grad, (dy * x.detach()).sum(1, keepdim=True) * kept_TK, rtol=1e-12, atol=1e-12)


def test_weigh_rows_is_autograds_weighted_index_add_bit_for_bit():
    """:class:`WeighRows` (one autograd node) computes, forward and backward, bit for bit what
    autograd computes for the plain ops it replaces: bf16 rows with float32 weights (the product
    in float32, the sum returned in bf16), float32 rows with bf16 weights, a capacity's drops,
    and either input without a gradient."""
    from behemoth.parallel.expert.dispatch import Routed
    from behemoth.parallel.expert.rows import WeighRows

    g = torch.Generator().manual_seed(2)
    T, H, K = 9, 5, 2
    for y_dtype, w_dtype, out_dtype, drop in (
        (torch.bfloat16, torch.float32, torch.bfloat16, False),
        (torch.bfloat16, torch.float32, torch.float32, True),
        (torch.float32, torch.bfloat16, torch.float32, False),
    ):
        order = torch.randperm(T * K, generator=g)[: T * K - (5 if drop else 0)]
        y = torch.randn(order.numel(), H, generator=g).to(y_dtype)
        w = torch.rand(T, K, generator=g).to(w_dtype)
        dy = torch.randn(T, H, generator=g).to(out_dtype)
        for grads in ((True, True), (True, False), (False, True)):
            outs = []
            for fn in ("plain", "node"):
                y_, w_ = y.clone().requires_grad_(grads[0]), w.clone().requires_grad_(grads[1])
                if fn == "plain":
                    weighted = y_ * w_.reshape(-1).index_select(0, order)[:, None]
                    out = weighted.new_zeros((T, H)).index_add_(0, order // K, weighted).to(out_dtype)
                else:
                    out = WeighRows.apply(y_, w_, order, order // K, out_dtype)
                out.backward(dy)
                outs.append((out, y_.grad, w_.grad))
            for a, b in zip(*outs):
                assert (a is None) == (b is None) and (a is None or (a.dtype == b.dtype and torch.equal(a, b)))
    assert Routed.__dataclass_fields__["order_A"]  # what weigh_rows reads


def test_all_to_all_single_writes_into_out_on_a_trivial_axis():
    from behemoth.comm import all_to_all_single

    axis = OneRankMesh().axis("ep")
    t, out = torch.arange(4.0), torch.zeros(4)
    assert all_to_all_single(t, axis, [4], [4], out=out) is out and out.tolist() == t.tolist()
    assert all_to_all_single(t, axis, [4], [4]) is t


def test_dispatch_and_combine_op_counts(monkeypatch):
    """The host's work of one expert-parallel dispatch and combine, pinned: the ATen ops (each
    about one kernel and a few µs of host time on a GPU) of a member's dispatch, combine and their
    backward over a mirrored ep = 2 axis, bf16 rows with the groups padded as the grouped GEMMs
    want (``benchmarks/bench_moe.py --host-only`` measures the same), and the all-to-alls: one of
    the split sizes and one of rows each way, forward and backward."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from behemoth.parallel.expert.dispatch import combine, dispatch

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    ep, mirror = mirrored_axis(monkeypatch)
    g = torch.Generator().manual_seed(1)
    T, H, E, K = 64, 8, 8, 2
    experts_TK = torch.rand(T, E, generator=g).argsort(-1)[:, :K].contiguous()  # as the router's top-k
    x = torch.randn(T, H, generator=g, dtype=torch.bfloat16, requires_grad=True)
    w = torch.rand(T, K, generator=g, requires_grad=True)
    dispatch(x, experts_TK, E, ep, align=16)  # a first call makes what is cached
    counts, calls = {}, {}
    with Ops() as ops:
        x_NH, _, routed = dispatch(x, experts_TK, E, ep, align=16)
    counts["dispatch"], calls["dispatch"], mirror.calls = ops.ops, mirror.calls - 2, 0
    y_NH = x_NH * 1
    with Ops() as ops:
        y = combine(y_NH, w, routed)
    counts["combine"], calls["combine"], mirror.calls = ops.ops, mirror.calls, 0
    dy = torch.ones_like(y)
    with Ops() as ops:
        y.backward(dy)
    counts["backward"], calls["backward"] = ops.ops, mirror.calls
    assert calls == {"dispatch": 2, "combine": 1, "backward": 2}
    limits = {"dispatch": 18, "combine": 9, "backward": 22}  # backward: the identity experts' mul is one more
    for part, limit in limits.items():
        assert len(counts[part]) <= limit + (part == "backward"), (part, len(counts[part]), counts[part])
    assert counts["dispatch"].count("sort") == 1 and "cat" not in counts["dispatch"]

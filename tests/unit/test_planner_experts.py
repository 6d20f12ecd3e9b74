"""The planner's expert-parallel over-decomposition (``Plan.ep_overlap``): the experts' GEMMs in
chunks, the casts and kernels each extra chunk adds, the overlap rule that hides (k-1)/k of the
row all-to-alls behind the experts' GEMMs (at most their time), and the search that tries it
and labels it. Exact values from the calibration, against the formulas the docstrings state."""

from __future__ import annotations

import dataclasses
import json

import pytest

import behemoth as bh
from behemoth.planner.axis_traffic import Dtypes, step_traffic
from behemoth.planner.calibration import load_calibration
from behemoth.planner.cluster import Cluster
from behemoth.planner.compute import CAST_BYTES, block_times, ep_chunk_seconds
from behemoth.planner.cost import predict
from behemoth.planner.host import EP_CHUNK_KERNELS, EP_CHUNKED_KERNELS, ep_chunk_kernels, host_times
from behemoth.planner.report import explain, table
from behemoth.planner.search import Limits, search
from behemoth.planner.workload import workload_for

CAL = load_calibration("h100")
DEVICE = dataclasses.replace(CAL, host_kernel_s=0.0, host_call_s={})  # no host bound
MOE = workload_for("mixtral-4b", seq_len=1024, global_batch=32)


def _plan(k: int, **kw) -> bh.Plan:
    return bh.Plan(ep=8, ep_overlap=k, precision="bf16", **kw).resolve(8)


def test_expert_gemms_run_in_chunks():
    """k chunks run each local expert's GEMMs k times on 1/k of the rows (its gate and up
    projections one GEMM of twice the width, as parallel/expert/grouped.py runs them), at the busiest
    ep rank's load; the experts' part of the block's GEMMs is what the overlap hides behind."""
    s = MOE.shape
    mbs, f, h = 4, MOE.expert_ffn_hidden or s.ffn_hidden, s.hidden
    for k in (1, 2, 4):
        bt = block_times(_plan(k), MOE, DEVICE, mbs)
        rows = mbs * MOE.seq_len * MOE.experts_top_k * 8 / MOE.num_experts / k
        one = DEVICE.gemm_seconds(rows, 2 * f, h, 2) + DEVICE.gemm_seconds(rows, h, f, 2)  # gated MLP
        load = MOE.expert_load_imbalance
        assert load > 1.0
        assert bt.expert_gemm_forward == pytest.approx(k * one * MOE.num_experts / 8 * load, rel=1e-12)
        assert bt.gemm_forward > bt.expert_gemm_forward > 0
    dense = block_times(bh.Plan(precision="bf16").resolve(1), workload_for("gpt-1.3b", global_batch=8), DEVICE, 1)
    assert dense.expert_gemm_forward == 0.0


def test_each_extra_chunk_casts_the_experts_weights_again():
    """Under autocast every chunk's experts call casts the local experts' weights (forward) and
    their gradients back (backward), and autograd sums the chunks' gradients of each weight."""
    n = MOE.expert_params / 8
    hbm = DEVICE.hbm_bytes_per_s
    assert ep_chunk_seconds(_plan(1), MOE, DEVICE) == (0.0, 0.0)
    f, b = ep_chunk_seconds(_plan(3), MOE, DEVICE)
    assert f == pytest.approx(2 * n * CAST_BYTES / hbm) and b == pytest.approx(2 * n * (CAST_BYTES + 12) / hbm)
    fp32 = bh.Plan(ep=8, ep_overlap=2, precision="fp32").resolve(8)
    assert ep_chunk_seconds(fp32, MOE, DEVICE) == (0.0, pytest.approx(n * 12 / hbm))
    bf16 = bh.Plan(ep=8, ep_overlap=2, precision="bf16", zero=3, param_dtype="bf16").resolve(8)
    assert ep_chunk_seconds(bf16, MOE, DEVICE) == (0.0, pytest.approx(n * 6 / hbm))
    one, two = (block_times(_plan(k), MOE, DEVICE, 4) for k in (1, 2))
    gemm = two.gemm_forward - one.gemm_forward
    f, b = ep_chunk_seconds(_plan(2), MOE, DEVICE)
    assert two.forward - one.forward == pytest.approx(gemm + f)
    assert two.backward - one.backward == pytest.approx(2 * gemm + b)
    assert two.weight_grad - one.weight_grad == pytest.approx(gemm + b)


def test_each_extra_chunk_launches_its_kernels():
    """host.ep_chunk_kernels: per extra chunk its forward, backward and (checkpointed) recompute
    kernels, and the chunked layer's once; none at one chunk, ep 1 or without experts."""
    (f, b, r), (cf, cb, cr) = EP_CHUNK_KERNELS, EP_CHUNKED_KERNELS
    assert ep_chunk_kernels(_plan(1), MOE) == (0.0, 0.0)
    assert ep_chunk_kernels(_plan(4), MOE) == (3 * f + cf, 3 * b + cb)
    assert ep_chunk_kernels(_plan(2, activation_checkpointing=True), MOE) == (f + cf, b + cb + r + cr)
    one, two = host_times(_plan(1), MOE, CAL), host_times(_plan(2), MOE, CAL)
    # the extra chunk's kernels and its 2 more calls each way (each call's kernels too)
    calls = 2 * (CAL.kernels_per_collective * CAL.host_kernel_s + CAL.host_call_s["1d"])
    assert two.forward - one.forward == pytest.approx((f + cf) * CAL.host_kernel_s + calls)
    assert two.backward - one.backward == pytest.approx((b + cb) * CAL.host_kernel_s + calls)


def _expected_ep(plan: bh.Plan, cal, mbs: int, slow: float):
    """The overlap rule of cost._ep_times, written out: (exposed per micro-batch, comm per step)."""
    s, layers, k = MOE.shape, MOE.shape.num_layers, plan.ep_overlap
    leave = 7 / 8
    splits = k * MOE.num_experts * 8 * leave
    one = mbs * MOE.seq_len * MOE.experts_top_k * s.hidden * Dtypes.of(plan).compute * leave
    one *= MOE.expert_load_imbalance  # the busiest rank's rows
    t_splits = cal.collective_seconds("nvlink", 8, splits * layers, layers)
    pair = cal.collective_seconds("nvlink", 8, 2 * one * layers, 2 * k * layers)
    gemm = layers * block_times(plan, MOE, cal, mbs).expert_gemm_forward
    frac = (k - 1) / k
    forward = t_splits + pair - (1 - slow) * min(frac * pair, gemm)
    backward = pair - (1 - slow) * min(frac * pair, 2 * gemm)
    return forward + backward, t_splits + 2 * pair


@pytest.mark.parametrize("k", [1, 2, 4])
def test_ep_overlap_hides_the_row_all_to_alls_behind_the_experts_gemms(k):
    c = Cluster(num_gpus=8, calibration=DEVICE)
    p = predict(_plan(k), MOE, c)
    exposed, comm = _expected_ep(p.plan, DEVICE, p.micro_batch_size, DEVICE.overlap_slowdown)
    assert p.exposed["ep"] == pytest.approx(exposed, rel=1e-12) and p.comm["ep"] == pytest.approx(comm, rel=1e-12)
    if k == 1:
        assert p.exposed["ep"] == pytest.approx(p.comm["ep"])  # nothing hidden
    # slow links: the hidden part is capped by the GEMMs' time (forward's, and twice it backward)
    slow_links = dataclasses.replace(
        DEVICE, links={n: tuple((g, a, b / 1000) for g, a, b in v) for n, v in DEVICE.links.items()}
    )
    q = predict(_plan(k), MOE, Cluster(num_gpus=8, calibration=slow_links))
    gemm = MOE.shape.num_layers * block_times(q.plan, MOE, slow_links, q.micro_batch_size).expert_gemm_forward
    hidden = q.comm["ep"] - q.exposed["ep"]
    assert hidden == pytest.approx((k > 1) * 3 * gemm * (1 - slow_links.overlap_slowdown), rel=1e-9)


def test_ep_overlap_checkpointed_and_bytes():
    """A recompute runs the chunks' pairs again, hidden as the forward's; the bytes are the
    ledger formula's (step_traffic) whatever the chunks, but the split sizes' k-fold."""
    c = Cluster(num_gpus=8, calibration=DEVICE)
    base, ckpt = (predict(_plan(2, activation_checkpointing=a), MOE, c) for a in (False, True))
    exposed, comm = _expected_ep(base.plan, DEVICE, base.micro_batch_size, DEVICE.overlap_slowdown)
    gemm_b = block_times(ckpt.plan, MOE, DEVICE, ckpt.micro_batch_size).expert_gemm_forward
    assert gemm_b == pytest.approx(block_times(base.plan, MOE, DEVICE, base.micro_batch_size).expert_gemm_forward)
    layers = MOE.shape.num_layers
    one = ckpt.micro_batch_size * MOE.seq_len * MOE.experts_top_k * MOE.shape.hidden * 2 * 7 / 8
    one *= MOE.expert_load_imbalance
    pair = DEVICE.collective_seconds("nvlink", 8, 2 * one * layers, 4 * layers)
    again = pair - (1 - DEVICE.overlap_slowdown) * min(pair / 2, layers * gemm_b)
    assert ckpt.exposed["ep"] == pytest.approx(exposed + again) and ckpt.comm["ep"] == pytest.approx(comm + pair)
    b1, b2 = (step_traffic(_plan(k), MOE)["ep"] for k in (1, 2))
    assert b2 - b1 == pytest.approx(MOE.num_experts * 8 * 7 / 8 * layers)


def test_search_tries_ep_overlap_where_there_is_expert_parallelism():
    r = search(MOE, Cluster(num_gpus=8, calibration=CAL), Limits(top=100000))
    seen = {(p.plan.ep, p.plan.ep_overlap) for p in r.ranked}
    assert {(2, 1), (2, 2), (8, 1), (8, 2)} <= seen
    assert all(p.plan.ep_overlap == 1 for p in r.ranked if p.plan.ep == 1)
    limited = search(MOE, Cluster(num_gpus=8, calibration=CAL), Limits(top=100000, ep_overlaps=(1,)))
    assert {p.plan.ep_overlap for p in limited.ranked} == {1} and limited.fits < r.fits
    # the table and --explain name the chunks
    ov = [p for p in r.ranked if p.plan.ep_overlap == 2]
    r.ranked = [ov[0], next(p for p in r.ranked if p.plan.ep > 1 and p.plan.ep_overlap == 1)]
    text, why = table(r), explain(r)
    assert f"ep{ov[0].plan.ep}+ov2" in text and f"ep{ov[0].plan.ep}+ov2" in why
    assert "ep_overlap=2" in why and "ep_overlap=1" in why and "hidden behind the experts' GEMMs" in why


def test_grouped_call_factor_scales_the_bf16_expert_gemms_only():
    """``Calibration.grouped_call_vs_table``: the experts' GEMMs run through ``torch._grouped_mm``
    under bf16 (at that factor of the table's rate for the whole call's flops); under fp32 the loop
    of dense GEMMs (the table's)."""
    half = dataclasses.replace(DEVICE, grouped_call_vs_table=0.5)
    bf16 = _plan(1)
    fp32 = bh.Plan(ep=8, precision="fp32").resolve(8)
    for plan, factor in ((bf16, 2.0), (fp32, 1.0)):
        base, slow = (block_times(plan, MOE, c, 4).expert_gemm_forward for c in (DEVICE, half))
        assert slow == pytest.approx(factor * base, rel=1e-12)
    for bad in (dict(grouped_call_vs_table=0.0), dict(grouped_call_by_rows=((1024.0, 5.0),))):
        with pytest.raises(ValueError, match="grouped_call"):
            dataclasses.replace(CAL, **bad)


def test_the_grouped_call_is_costed_as_one_gemm_of_all_its_groups_rows():
    """Under bf16 one grouped call runs all of a rank's local experts: the table's time for one
    GEMM of every group's rows (gate/up and down), over the factor at the rows per group -- not the
    sum of each group's small GEMMs at the table's rate for their size (which put 64 narrow experts
    several times too slow); under fp32 the loop is that sum."""
    s = MOE.shape
    f, local = MOE.expert_ffn_hidden or s.ffn_hidden, MOE.num_experts  # ep 1: every expert on the rank
    even = dataclasses.replace(MOE, expert_load_imbalance=1.0)
    table = dataclasses.replace(DEVICE, grouped_call_by_rows=((256.0, 0.5), (4096.0, 1.0)))
    tokens = 4 * MOE.seq_len
    rows = tokens * MOE.experts_top_k / MOE.num_experts
    up = (2 if s.gated_mlp else 1) * f
    for plan in (bh.Plan(precision="bf16").resolve(1), bh.Plan(precision="fp32").resolve(1)):
        got = block_times(plan, even, table, 4).expert_gemm_forward
        if plan.precision == "bf16":
            whole = table.gemm_seconds(rows * local, up, s.hidden) + table.gemm_seconds(rows * local, s.hidden, f)
            want = whole / table.grouped_call_factor(rows)
        else:
            want = local * (table.gemm_seconds(rows, up, s.hidden, 4) + table.gemm_seconds(rows, s.hidden, f, 4))
        assert got == pytest.approx(want, rel=1e-12), plan.precision


def test_grouped_call_factor_by_rows_per_group():
    """``grouped_call_by_rows``: the factor at the expert's rows per group, interpolated in log2 of
    the rows and clamped at the measured ends; it overrides the single figure, and survives the
    JSON. An older calibration's ``grouped_gemm_vs_table`` / ``grouped_gemm_by_rows`` (against one
    group's GEMM) and ``grouped_gemm_ratio`` (against a loop of per-group calls) are kept in
    ``extra`` and not read."""
    from behemoth.planner.calibration import Calibration

    by_rows = dataclasses.replace(
        DEVICE, grouped_call_vs_table=0.3, grouped_call_by_rows=((1024.0, 1.2), (4096.0, 0.8))
    )
    assert by_rows.grouped_call_factor(1024) == pytest.approx(1.2)
    assert by_rows.grouped_call_factor(2048) == pytest.approx(1.0)
    assert by_rows.grouped_call_factor(100) == pytest.approx(1.2) and by_rows.grouped_call_factor(1e6) == 0.8
    again = Calibration.from_dict(json.loads(by_rows.to_json()))
    assert again.grouped_call_by_rows == by_rows.grouped_call_by_rows and again.grouped_call_factor(2048) == 1.0
    # the experts' rows per group here: 4 sequences of 1,024 tokens, top 2, one expert per rank
    rows = 4 * MOE.seq_len * MOE.experts_top_k * 8 / MOE.num_experts
    at = dataclasses.replace(DEVICE, grouped_call_vs_table=by_rows.grouped_call_factor(rows))
    assert block_times(_plan(1), MOE, by_rows, 4).expert_gemm_forward == pytest.approx(
        block_times(_plan(1), MOE, at, 4).expert_gemm_forward, rel=1e-12
    )
    older = {"grouped_gemm_ratio": 1.645, "grouped_gemm_vs_table": 0.5, "grouped_gemm_by_rows": [[512, 2.0]]}
    old = Calibration.from_dict({**json.loads(DEVICE.to_json()), **older})
    assert all(old.extra[k] == v for k, v in older.items()) and old.grouped_call_factor(512) == 1.0


def test_the_busiest_ep_rank_sets_the_experts_pace():
    """``Workload.expert_load_imbalance``: under expert parallelism the experts' GEMMs and the rows'
    all-to-alls take that factor of their balanced time (every layer waits for its busiest rank);
    at ep = 1 every rank runs its own tokens' assignments: no factor. The split sizes' exchange
    and the rest of the block are the balanced ones."""
    even, skewed = (dataclasses.replace(MOE, expert_load_imbalance=x) for x in (1.0, 1.3))
    c = Cluster(num_gpus=8, calibration=DEVICE)
    a, b = (block_times(_plan(1), w, DEVICE, 4) for w in (even, skewed))
    assert b.expert_gemm_forward == pytest.approx(1.3 * a.expert_gemm_forward, rel=1e-12)
    assert b.forward - a.forward == pytest.approx(0.3 * a.expert_gemm_forward, rel=1e-9)
    local = bh.Plan(pp=8, microbatches=8, precision="bf16").resolve(8)
    assert block_times(local, even, DEVICE, 4) == block_times(local, skewed, DEVICE, 4)
    pa, pb = (predict(_plan(1), w, c) for w in (even, skewed))
    mbs, layers = pa.micro_batch_size, MOE.shape.num_layers
    one = mbs * MOE.seq_len * MOE.experts_top_k * MOE.shape.hidden * 2 * 7 / 8
    splits = MOE.num_experts * 8 * 7 / 8
    t_splits = DEVICE.collective_seconds("nvlink", 8, splits * layers, layers)
    for p, x in ((pa, 1.0), (pb, 1.3)):
        pair = DEVICE.collective_seconds("nvlink", 8, 2 * one * x * layers, 2 * layers)
        assert p.comm["ep"] == pytest.approx(t_splits + 2 * pair, rel=1e-12)
    with pytest.raises(ValueError, match="expert_load_imbalance"):
        dataclasses.replace(MOE, expert_load_imbalance=0.9)


def test_the_split_sizes_read_idles_the_device_once_per_layer_forward(monkeypatch):
    """host.ep_sync_seconds: under expert parallelism each MoE layer's forward reads its split sizes
    on the host, which then issues the rows' all-to-all (its call and kernels) while the device waits; once per layer and micro-batch whatever the chunks, none at
    ep = 1 or without host figures; the cost model adds it to each layer's forward."""
    from behemoth.planner import cost
    from behemoth.planner.host import ep_sync_seconds

    one = CAL.kernels_per_collective * CAL.host_kernel_s + CAL.host_call_s["1d"]
    assert ep_sync_seconds(_plan(1), MOE, CAL) == pytest.approx(one) and one > 0
    assert ep_sync_seconds(_plan(4), MOE, CAL) == pytest.approx(one)
    assert ep_sync_seconds(bh.Plan(pp=8, microbatches=8, precision="bf16").resolve(8), MOE, CAL) == 0.0
    assert ep_sync_seconds(_plan(1), MOE, DEVICE) == 0.0
    c = Cluster(num_gpus=8, calibration=DEVICE)
    base = predict(_plan(1), MOE, c)
    monkeypatch.setattr(cost, "ep_sync_seconds", lambda plan, w, cal: 1e-3)
    waits = predict(_plan(1), MOE, c)
    assert waits.stage_times[0] - base.stage_times[0] == pytest.approx(MOE.shape.num_layers * 1e-3)
    assert waits.stage_times[1] == base.stage_times[1]
    assert waits.step - base.step == pytest.approx(base.plan.microbatches * MOE.shape.num_layers * 1e-3)


def test_routing_dispatch_and_combine_bytes_split_with_the_tokens_over_tp():
    """An MoE layer's routing, dispatch and combine (``moe_bytes.expert_elementwise_bytes``) and its
    experts' activation run over this tensor-parallel rank's share of the micro-batch's tokens
    (1D tp splits them, parallel/expert/tokens.py), at the elementwise rate."""
    from behemoth.planner.compute import elementwise_seconds
    from behemoth.planner.moe_bytes import expert_elementwise_bytes

    dense = dataclasses.replace(MOE, num_experts=0, experts_top_k=1)
    fwd, bwd = expert_elementwise_bytes(MOE)
    tokens = 4 * MOE.seq_len
    for tp in (1, 2):
        plan = bh.Plan(tp=tp, precision="bf16").resolve(tp)
        moe, ref = elementwise_seconds(plan, MOE, DEVICE, tokens), elementwise_seconds(plan, dense, DEVICE, tokens)
        # the dense model's MLP over ffn_hidden vs the experts' activation over I k, both split over tp
        width = MOE.shape.ffn_hidden
        act_f = 10 * (width * MOE.experts_top_k - width) / tp * tokens / DEVICE.elementwise_rate
        act_b = 18 * (width * MOE.experts_top_k - width) / tp * tokens / DEVICE.elementwise_rate
        assert moe[0] - ref[0] == pytest.approx(act_f + fwd / tp * tokens / DEVICE.elementwise_rate, rel=1e-9)
        assert moe[1] - ref[1] == pytest.approx(act_b + bwd / tp * tokens / DEVICE.elementwise_rate, rel=1e-9)


def test_calibrate_measures_the_grouped_call_against_the_table_the_model_reads(monkeypatch):
    """benchmarks/calibrate.py's ``grouped_call_by_rows``: the table's time for the whole call's
    GEMMs (every group's rows as one fused gate/up and one down projection, forward and both
    gradients) over the grouped kernel's, at each measured rows per group, the mean over its expert
    shapes: a kernel as fast as the model's whole-call GEMMs at the table's rate (``block_times``'
    experts under ``grouped_call_vs_table = 1``) measures 1, one taking 0.8 of that time 1.25; none
    where the kernel does not run."""
    import sys
    from pathlib import Path

    import torch

    sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
    import calibrate

    table = dataclasses.replace(CAL, sustained_ratio=1.0)

    def model(groups, rows, h, i, iters=5):  # the planner's time of these GEMMs, forward and backward
        return 3 * (table.gemm_seconds(groups * rows, 2 * i, h) + table.gemm_seconds(groups * rows, h, i))

    # what the cost model gives the experts of one rank (ep 8: one expert, 8,192 rows), balanced
    even = dataclasses.replace(MOE, expert_load_imbalance=1.0)
    f, rows = MOE.expert_ffn_hidden or MOE.shape.ffn_hidden, 4 * MOE.seq_len * MOE.experts_top_k
    experts = block_times(_plan(1), even, dataclasses.replace(table, host_kernel_s=0.0), 4).expert_gemm_forward
    assert 3 * experts == pytest.approx(model(1, rows, MOE.shape.hidden, f), rel=1e-12)
    gemm = [list(p) for p in CAL.gemm]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(torch, "_grouped_mm", getattr(torch, "_grouped_mm", None), raising=False)
    for speed in (1.0, 1.25):
        monkeypatch.setattr(calibrate, "_grouped_seconds", lambda *a, s=speed, **k: model(*a, **k) / s)
        points = calibrate.grouped_call_by_rows(gemm)
        assert [p[0] for p in points] == list(calibrate.GROUPED_ROWS)
        assert all(p[1] == pytest.approx(speed, rel=1e-9) for p in points)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    assert calibrate.grouped_call_by_rows(gemm) == []


def test_the_grid_statistics_axes_are_the_runtimes():
    """The axes the planner sums an MoE block's statistics over under each grid mode are the ones
    the expert style sums them over (``parallel/expert/tokens.py``'s ``grid_axes``)."""
    from behemoth.parallel.expert.tokens import grid_axes
    from behemoth.planner.tp2d_traffic import GRID_STATISTICS_AXES

    for mode, tp, depth in (("2d", 4, 1), ("2.5d", 8, 2), ("3d", 8, 1)):
        plan = bh.Plan(tp=tp, tp_mode=mode, tp_depth=depth)
        assert GRID_STATISTICS_AXES[mode] == grid_axes(plan), mode


def test_expert_gemm_rows_under_a_grid_are_a_tp_share():
    """Under 2D, 2.5D and 3D each rank routes and runs the experts on 1/tp of its data rank's tokens
    (a grid row's share of its batch block): a micro-batch of tp sequences gives each rank the
    expert GEMMs one sequence gives a single device."""
    one = block_times(bh.Plan(precision="bf16").resolve(1), MOE, DEVICE, 1).expert_gemm_forward
    for mode, tp, depth in (("2d", 4, 1), ("2.5d", 8, 2), ("3d", 8, 1)):
        plan = bh.Plan(tp=tp, tp_mode=mode, tp_depth=depth, precision="bf16").resolve(tp)
        assert block_times(plan, MOE, DEVICE, tp).expert_gemm_forward == pytest.approx(one, rel=1e-12), mode

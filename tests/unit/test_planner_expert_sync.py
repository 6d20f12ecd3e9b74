"""The planner's data-parallel term of a mixture-of-experts layout: the dense gradients sync over
``dp``, the experts' over ``ep_dp`` (the ranks holding the same experts), each in buckets of its own
(ZeRO 0 closes a bucket where the parameter kind changes), and each MoE layer's balancing
statistics are all-reduced over ``dp`` in every forward (a checkpointed block's recompute again),
on the forward's path. Exact values from the calibration, against the formulas the docstrings state;
the bytes against the ledger in tests/dist/test_planner_expert_ledger.py."""

from __future__ import annotations

import dataclasses
import math

import pytest

import behemoth as bh
from behemoth.mesh import atomic_dims, axis_groups, named_axes
from behemoth.planner.axis_traffic import Dtypes, balance_bytes, expert_local_params, step_traffic
from behemoth.planner.calibration import load_calibration
from behemoth.planner.cluster import Cluster, axis_strides
from behemoth.planner.collectives import all_gather_bytes, all_reduce_bytes, reduce_scatter_bytes
from behemoth.planner.cost import predict
from behemoth.planner.params import local_params
from behemoth.planner.report import table
from behemoth.planner.search import SearchResult
from behemoth.planner.workload import workload_for
from behemoth.planner.zero3_traffic import zero3_resident_params

CAL = dataclasses.replace(load_calibration("h100"), host_kernel_s=0.0, host_call_s={})  # no host bound
MOE = workload_for("mixtral-4b", seq_len=1024, global_batch=32)
CLUSTER = Cluster(num_gpus=16, calibration=CAL)


def _plan(**kw) -> bh.Plan:
    return bh.Plan(ep=4, precision="bf16", **kw).resolve(16)


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_expert_gradients_sync_over_ep_dp(zero):
    plan = _plan(zero=zero)
    layers, g, m = MOE.shape.num_layers, plan.dp, plan.microbatches
    experts = layers * MOE.expert_params / 4
    dense = local_params(plan, MOE) - experts
    assert expert_local_params(plan, MOE, layers) == experts
    b = step_traffic(plan, MOE, dt=Dtypes.of(plan))

    def sync(n, p, resident=0):
        # ZeRO-3: the chunk the forward ends in (``resident`` parameters) is gathered once, not twice
        return {
            0: all_reduce_bytes(4 * n, p),
            1: reduce_scatter_bytes(4 * n, p) + all_gather_bytes(4 * n, p),
            2: m * reduce_scatter_bytes(4 * n, p) + all_gather_bytes(4 * n, p),
            3: m * reduce_scatter_bytes(4 * n, p) + m * all_gather_bytes(4 * (2 * n - resident), p),
        }[zero]

    stats = (2 * MOE.num_experts + 1) * 8
    assert balance_bytes(plan, MOE) == all_reduce_bytes(stats, g)
    scalars = all_reduce_bytes(16, g) + all_reduce_bytes(8, g)  # loss and router losses, tokens
    scalars += all_reduce_bytes(4, g) if zero else 0.0  # the gradient norm of sharded gradients
    resident = zero3_resident_params(plan, MOE)
    assert 0 < resident < dense
    assert b["dp"] == pytest.approx(
        sync(dense, g, resident) + scalars + layers * m * all_reduce_bytes(stats, g), rel=1e-12
    )
    assert b["ep_dp"] == pytest.approx(sync(experts, g // 4), rel=1e-12)


def test_expert_axes_follow_the_mesh_layout():
    """``dp`` is ``ep_dp x ep`` (ep inside): ep_dp's groups stride over ep; its link is the node's
    while dp x cp x tp ranks fit on one."""
    s = axis_strides(dp=8, pp=1, tp=2, cp=2, ep=4)
    assert (s["ep"], s["ep_dp"], s["ep_dp_cp"]) == ((4, 4), (2, 16), (4, 8))
    assert CLUSTER.link(*s["ep"]) == "ib" and CLUSTER.link(*s["ep_dp"]) == "ib"
    assert axis_strides(dp=8, pp=1, tp=1, cp=1, ep=2)["ep_dp"] == (4, 2)
    assert "ep_dp" not in axis_strides(dp=8, pp=1, tp=1, cp=1)


@pytest.mark.parametrize("cp", [1, 2])
def test_tensor_parallel_expert_axes_span_their_mesh_groups(cp):
    """Under tensor parallelism an MoE block's gradient axes (the data axis times tp) have the
    size of the mesh's groups and a stride that spans what each group spans (at most: an
    ``ep_dp`` group skips the other ep ranks' blocks)."""
    plan = bh.Plan(dp=4, ep=2, cp=cp, tp=2, pp=2).resolve(16 * cp)
    s = axis_strides(dp=4, pp=2, tp=2, cp=cp, ep=2)
    dims, named = atomic_dims(plan), named_axes(plan)
    suffix = "_cp_tp" if cp > 1 else "_tp"
    for axis in ("dp" + suffix, "ep_dp" + suffix):
        size, stride = s[axis]
        for group in axis_groups(dims, named[axis]):
            assert len(group) == size and max(group) - min(group) < size * stride, (axis, group, s[axis])


def test_zero0_buckets_close_where_the_parameter_kind_changes():
    """The gradient sync's seconds: the dense bucket all-reduces over dp (each block's dense
    parameters a bucket apart from its experts: layers more) with the step's two scalar
    all-reduces, the experts' over ep_dp (layers - 1 more), and the balancing statistics'
    all-reduce per layer and forward on dp's account."""
    plan = _plan()
    p = predict(plan, MOE, CLUSTER)
    layers, m, bucket = MOE.shape.num_layers, plan.microbatches, plan.bucket_mb * 2**20
    experts = expert_local_params(plan, MOE, layers)
    dense = local_params(plan, MOE) - experts
    s = axis_strides(dp=16, pp=1, tp=1, cp=1, ep=4)
    stats = balance_bytes(plan, MOE) * layers
    reduce_dp = p.bytes["dp"] - stats * m
    want_dp = CLUSTER.collective_seconds(*s["dp"], reduce_dp, math.ceil(4 * dense / bucket) + layers + 2)
    balance = m * CLUSTER.collective_seconds(*s["dp"], stats, layers)
    assert p.comm["dp"] == pytest.approx(want_dp + balance, rel=1e-12)
    want_ep_dp = CLUSTER.collective_seconds(*s["ep_dp"], p.bytes["ep_dp"], math.ceil(4 * experts / bucket) + layers - 1)
    assert p.comm["ep_dp"] == pytest.approx(want_ep_dp, rel=1e-12)
    # a checkpointed block's recompute waits for its balancing all-reduce again
    q = predict(_plan(activation_checkpointing=True), MOE, CLUSTER)
    assert q.comm["dp"] - p.comm["dp"] == pytest.approx(balance, rel=1e-9)


def test_expert_sync_over_fewer_ranks_is_cheaper():
    """The experts' gradients over ep_dp: at ep = dp (one rank holds each expert) nothing of them
    travels, and a larger ep never sends more on the gradient axes."""
    one = predict(_plan(), MOE, CLUSTER)
    all_ = predict(bh.Plan(ep=16, precision="bf16").resolve(16), MOE, CLUSTER)
    assert "ep_dp" not in all_.bytes and "ep_dp" in one.bytes
    assert all_.bytes["dp"] == pytest.approx(one.bytes["dp"], rel=1e-12)
    assert all_.comm["dp"] <= one.comm["dp"] + one.comm["ep_dp"]


def test_the_table_counts_the_experts_sync_as_data_parallel():
    """The table's dp column and ``--explain``'s gradient sync hold both gradient axes."""
    p = predict(_plan(), MOE, CLUSTER)
    text = table(SearchResult(ranked=[p]))
    cols = f"/{(p.bytes['dp'] + p.bytes['ep_dp']) / 1e9:.2f}/{0.0:.2f}/{p.bytes['ep'] / 1e9:.2f}"
    assert cols in text, (cols, text)
    assert f"{(p.bytes['dp']) / 1e9:.2f}/{0.0:.2f}/" not in text


def test_moe_block_sync_under_tensor_parallelism_is_priced():
    """Under tp an MoE block's gradients sync over the data axis times tp: the routers over
    dp_tp, the experts over ep_dp_tp, each in buckets of its own (ZeRO 0), priced from the bytes
    the traffic model books there; the dense parameters' dp sync no longer carries them."""
    plan = _plan(tp=2)
    p = predict(plan, MOE, CLUSTER)
    layers, bucket = MOE.shape.num_layers, plan.bucket_mb * 2**20
    s = axis_strides(dp=plan.dp, pp=1, tp=2, cp=1, ep=plan.ep)
    experts = expert_local_params(plan, MOE, layers)
    routers = layers * MOE.shape.hidden * MOE.num_experts
    for axis, count in (("dp_tp", routers), ("ep_dp_tp", experts)):
        nb = math.ceil(4 * count / bucket) + layers - 1
        assert p.comm[axis] == pytest.approx(CLUSTER.collective_seconds(*s[axis], p.bytes[axis], nb), rel=1e-12)
        assert p.exposed[axis] >= 0.0
    # the dense sync over dp moves fewer bytes than without tensor parallelism (the blocks left it)
    assert p.bytes["dp"] < predict(_plan(), MOE, CLUSTER).bytes["dp"]

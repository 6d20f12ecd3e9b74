"""The planner's bytes per axis of a mixture-of-experts model's whole step equal the comm ledger's.

The tiny MoE Llama, its routers zeroed and kept at zero by a learning rate of 0 (every rank
routes alike: the planner's even-routing rows are exact; ``test_planner_ledger._moe``), for one
optimizer step on 4 gloo ranks, data parallelism over expert parallelism (``dp`` split
``ep_dp x ep``), with and without context parallelism, ZeRO 0, 1 and 2, with and without
activation checkpointing: every axis ``behemoth.planner.axis_traffic.step_traffic`` predicts, and every axis
the ledger books, carry exactly the same wire bytes on every rank -- the data axis its dense
gradients' sync, the step's loss and router-loss sums (the token count over dp alone) and each
MoE layer's balancing statistics (again in a checkpointed block's recompute); the expert axis
(``ep_dp``, ``ep_dp_cp`` under context parallelism) the experts' gradient sync; ep the
all-to-alls and (ZeRO 0) the step's gradient norm; under ``ep_dedup`` the member exchange's
pairs (one a token: ``Workload.expert_spread=1``), their weights and slots. Under ZeRO 1 and 2 the chunks' padding, which
the planner does not count, is taken from the run's chunk layout and added. ZeRO-3 (2 and 4
ranks, with and without micro-batches, without activation checkpointing) gathers every chunk
forward and backward but the one its forward ends in (once); its padding is added per gather. Its
routers stay in the others' param group (a group of their own packs into chunks of its own,
gathered once per layer: not the planner's layout). The gradient sync's buckets per axis are
``behemoth.planner.grad_buckets.gradient_buckets``' (ZeRO 0 closes one where the parameter kind
changes), and each block's collective calls under dp 4 x ep 2 (and x cp 2) are
``behemoth.planner.host_calls.block_calls``'.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_planner_host_calls import check_expert_calls_per_block
from test_planner_ledger import FP32, _moe, _workload, second_step_bytes

import behemoth as bh
from behemoth.planner.axis_traffic import expert_axis, step_traffic
from behemoth.planner.collectives import all_gather_bytes, reduce_scatter_bytes
from behemoth.planner.footprint import shard_elements
from behemoth.planner.grad_buckets import gradient_buckets
from behemoth.planner.zero3_traffic import chunk_shard_elements, final_norm_index

PLANS = {
    "dp4 ep2": [bh.Plan(dp=4, ep=2, precision="fp32", activation_checkpointing=c) for c in (False, True)],
    "dp2 ep2 cp2": [bh.Plan(dp=2, ep=2, cp=2, precision="fp32", activation_checkpointing=c) for c in (False, True)],
    "zero 1, 2": [
        bh.Plan(dp=4, ep=2, precision="fp32", zero=1),
        bh.Plan(dp=4, ep=2, precision="fp32", zero=2, microbatches=2, activation_checkpointing=True),
        bh.Plan(dp=2, ep=2, cp=2, precision="fp32", zero=1),
        bh.Plan(dp=4, precision="fp32", zero=2),
    ],
    "ep_dedup": [
        bh.Plan(dp=4, ep=2, precision="fp32", ep_dedup=True),
        bh.Plan(dp=4, ep=2, precision="fp32", ep_dedup=True, zero=1, microbatches=2, activation_checkpointing=True),
        bh.Plan(dp=2, ep=2, cp=2, precision="fp32", ep_dedup=True),
    ],
    "dp4 ep1, micro-batches": [
        bh.Plan(dp=4, precision="fp32"),
        bh.Plan(dp=4, ep=2, precision="fp32", microbatches=2, activation_checkpointing=True),
    ],
}


def _model_and_optimizer(one_group: bool = False):
    """The MoE Llama with its routers zeroed (every rank routes alike), trainable (their gradients
    sync, as the planner counts) but never moved: their learning rate is 0. ``one_group``: the
    routers stay in the others' param group (ZeRO-3 gathers a param group's chunks apart, so
    routers of their own would interleave with the dense chunks), their gradients zeroed before
    they accumulate (momentum SGD then never moves them) but reduced all the same."""
    model = _moe()
    routers = [m.router.weight.requires_grad_(True) for m in model.modules() if hasattr(m, "router")]
    if one_group:
        for r in routers:
            r.register_hook(torch.zeros_like)
        return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    others = [p for p in model.parameters() if all(p is not r for r in routers)]
    groups = [{"params": others}, {"params": routers, "lr": 0.0}]
    return model, torch.optim.SGD(groups, lr=0.05, momentum=0.9)


def _world(rank, world, plans):
    for plan in plans:
        model, optimizer = _model_and_optimizer(one_group=plan.zero == 3)
        w = _workload(model)
        if plan.ep_dedup:  # the zeroed routers' top-2 of 4 experts are one member's two: one pair a token
            w = dataclasses.replace(w, expert_spread=1.0)
        engine = bh.boost(model, optimizer, plan)
        got = second_step_bytes(engine)
        want = step_traffic(engine.plan, w, dt=FP32)
        store = engine.grad_sync.reducer.store
        if plan.zero == 3:  # the chunks' padding, as the run laid them out, each time the chunk moves
            # the planner's shards (padding included) are the run's: each group's chunks over its axis
            shards = {}
            for st in store.chunks:
                axis = store.replica_axis(st)
                shards[axis.name] = shards.get(axis.name, 0) + st.size // axis.size
            dense, experts = chunk_shard_elements(engine.plan, w)
            assert shards == {"dp_cp" if plan.cp > 1 else "dp": dense, expert_axis(plan): experts}, (
                shards,
                dense,
                experts,
            )
            assert shard_elements(engine.plan, w, 0, 0) == dense + experts
            zero3_padding(plan, store, model, w, want)
        elif plan.zero:  # the chunks' padding (the planner counts parameters), as the run laid them out
            for axis, pad in _padding(store).items():
                want[axis] += _chunk_bytes(engine.plan, pad, engine.mesh.axis(axis).size)
        want = {axis: int(b) for axis, b in want.items() if b}
        assert got == want, f"{engine.plan.describe()} rank {rank}: ledger {got} vs planner {want}"
        # the gradient sync's buckets per axis (a trivial axis reduces none)
        axes = [store.replica_axis(ch) for ch in store.chunks]
        buckets = {a.name: sum(1 for b in axes if b.name == a.name) for a in axes if not a.trivial}
        if plan.zero == 0:
            want_buckets = gradient_buckets(engine.plan, w, w.shape.num_layers)
            assert buckets == want_buckets, f"{engine.plan.describe()}: buckets {buckets} vs planner {want_buckets}"


def _padding(store) -> dict[str, int]:
    """Padding elements of the run's chunks, per axis they sync over."""
    out: dict[str, int] = {}
    for st in store.chunks:
        axis = store.replica_axis(st)
        if not axis.trivial:
            out[axis.name] = out.get(axis.name, 0) + st.size - st.used
    return out


def _chunk_bytes(plan, elems: int, p: int) -> float:
    """Wire bytes ZeRO 1 / 2 move for ``elems`` fp32 elements of chunks over ``p`` ranks: their
    gradients reduce-scattered (stage 2: every micro-batch), their parameters all-gathered."""
    b = 4 * elems
    return (plan.microbatches if plan.zero == 2 else 1) * reduce_scatter_bytes(b, p) + all_gather_bytes(b, p)


def zero3_padding(plan, store, model, w, want: dict) -> None:
    """Add to ``want`` ZeRO-3's bytes of the run's chunk padding: every chunk's padding
    reduce-scattered every micro-batch and gathered twice, but once in the chunks from the final
    norm's to the last (they stay gathered from the forward into the backward)."""
    params = [p for p in model.parameters() if p.requires_grad]
    tail = store.chunk_of[id(params[final_norm_index(w, len(params))])].index
    dense = store.replica_axis(store.chunks[tail]).name
    for st in store.chunks:
        axis = store.replica_axis(st)
        if not axis.trivial:
            once = st.index >= tail and axis.name == dense
            gathers = plan.microbatches * (1 if once else 2)
            want[axis.name] += _chunk3_bytes(plan, st.size - st.used, axis.size, gathers)


def _chunk3_bytes(plan, elems: int, p: int, gathers: int) -> float:
    """Wire bytes ZeRO-3 moves for ``elems`` fp32 elements of a chunk over ``p`` ranks: its
    gradients reduce-scattered every micro-batch, its parameters all-gathered ``gathers`` times."""
    b = 4 * elems
    return plan.microbatches * reduce_scatter_bytes(b, p) + gathers * all_gather_bytes(b, p)


@pytest.mark.parametrize("name", sorted(PLANS))
def test_expert_data_parallel_bytes_equal_the_ledger(name):
    bh.spawn(_world, 4, PLANS[name], timeout=500)


ZERO3 = {
    2: [bh.Plan(dp=2, ep=2, precision="fp32", zero=3), bh.Plan(dp=2, ep=2, precision="fp32", zero=3, microbatches=2)],
    4: [
        bh.Plan(dp=4, ep=2, precision="fp32", zero=3),
        bh.Plan(dp=4, ep=2, precision="fp32", zero=3, microbatches=2),
        bh.Plan(dp=4, ep=2, precision="fp32", zero=3, activation_checkpointing=True),
        bh.Plan(dp=2, ep=2, cp=2, precision="fp32", zero=3),
    ],
}


@pytest.mark.parametrize("world", sorted(ZERO3))
def test_zero3_expert_bytes_equal_the_ledger(world):
    """ZeRO-3 over dp x ep (2 ranks: ``ep_dp`` of one, the experts never gathered; 4: of two,
    and dp x ep x cp):
    every dense and expert chunk gathered forward and backward each micro-batch but the chunks
    the forward ends in (the final norm's and head's: once), as the planner counts them
    (``behemoth.planner.zero3_traffic``), its gradients reduce-scattered every micro-batch; with
    activation checkpointing the same (a block's recompute gathers what its backward keeps)."""
    bh.spawn(_world, world, ZERO3[world], timeout=500)


CALLS = (
    bh.Plan(dp=4, ep=2),
    bh.Plan(dp=4, ep=2, ep_overlap=2, activation_checkpointing=True),
    bh.Plan(dp=2, ep=2, cp=2, activation_checkpointing=True),
)


def _calls_world(rank, world):
    check_expert_calls_per_block(CALLS, world)


def test_expert_data_parallel_calls_per_block_are_the_runs():
    """dp 4 x ep 2 (and x cp 2): the statistics' all-reduce over the data axis of 4 beside the
    all-to-alls, as ``behemoth.planner.host_calls.block_calls`` counts them."""
    bh.spawn(_calls_world, 4, timeout=500)

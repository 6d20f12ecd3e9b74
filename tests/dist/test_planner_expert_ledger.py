"""The planner's bytes per axis of a mixture-of-experts model's whole step equal the comm ledger's.

The tiny MoE Llama, its routers zeroed and kept at zero by a learning rate of 0 (every rank
routes alike: the planner's even-routing rows are exact; ``test_planner_ledger._moe``), for one optimizer step on 4 gloo
ranks, data parallelism over expert parallelism (``dp`` split ``ep_dp x ep``), with and without
context parallelism, ZeRO 0, with and without activation checkpointing: every axis
``behemoth.planner.axis_traffic.step_traffic`` predicts, and every axis the ledger books, carry
exactly the same wire bytes on every rank -- the data axis its dense gradients' sync, the step's
two scalars and each MoE layer's balancing statistics (again in a checkpointed block's
recompute), the expert axis (``ep_dp``, ``ep_dp_cp`` under context parallelism) the experts'
gradient sync.
"""

from __future__ import annotations

import pytest
import torch
from common import global_batches, shard
from test_planner_ledger import BATCH, FP32, _moe, _workload

import behemoth as bh
from behemoth.planner.axis_traffic import step_traffic

PLANS = {
    "dp4 ep2": [bh.Plan(dp=4, ep=2, precision="fp32", activation_checkpointing=c) for c in (False, True)],
    "dp2 ep2 cp2": [bh.Plan(dp=2, ep=2, cp=2, precision="fp32", activation_checkpointing=c) for c in (False, True)],
    "dp4 ep1, micro-batches": [
        bh.Plan(dp=4, precision="fp32"),
        bh.Plan(dp=4, ep=2, precision="fp32", microbatches=2, activation_checkpointing=True),
    ],
}


def _model_and_optimizer():
    """The MoE Llama with its routers zeroed (every rank routes alike), trainable (their gradients
    sync, as the planner counts) but never moved: their learning rate is 0."""
    model = _moe()
    routers = [m.router.weight.requires_grad_(True) for m in model.modules() if hasattr(m, "router")]
    others = [p for p in model.parameters() if all(p is not r for r in routers)]
    groups = [{"params": others}, {"params": routers, "lr": 0.0}]
    return model, torch.optim.SGD(groups, lr=0.05, momentum=0.9)


def _world(rank, world, plans):
    for plan in plans:
        model, optimizer = _model_and_optimizer()
        w = _workload(model)
        engine = bh.boost(model, optimizer, plan)
        batches = global_batches(2, BATCH)
        engine.step(shard(batches[0], engine.dp_rank, engine.dp_size))
        engine.reset_comm_stats()
        engine.step(shard(batches[1], engine.dp_rank, engine.dp_size))
        got = {axis: s["wire_bytes"] for axis, s in engine.comm_stats().items() if s["wire_bytes"]}
        want = {axis: int(b) for axis, b in step_traffic(engine.plan, w, dt=FP32).items() if b}
        assert got == want, f"{engine.plan.describe()} rank {rank}: ledger {got} vs planner {want}"


@pytest.mark.parametrize("name", sorted(PLANS))
def test_expert_data_parallel_bytes_equal_the_ledger(name):
    bh.spawn(_world, 4, PLANS[name], timeout=500)

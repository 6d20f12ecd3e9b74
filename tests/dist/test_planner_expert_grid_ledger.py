"""The planner's bytes per axis of a mixture-of-experts model under the 2D, 2.5D and 3D grids equal
the comm ledger's.

The tiny MoE Llama with its routers zeroed (every rank routes alike: the planner's even-routing
rows are exact) and kept so by a learning rate of 0, but trainable (their gradients are summed
over the grid, as the planner counts: ``test_planner_expert_ledger._model_and_optimizer``). Each
MoE block's grid row (``tp_col``) trades its hidden blocks for whole rows of its share of the
tokens in one all-to-all and the outputs back (the inverse pair backward), sums its balancing
statistics' shares over the loss axis and the counts over the grid's other axes, and the
router's and experts' gradients over the whole grid (``parallel/expert/tokens.py``); the block
has no grid Linears of its own. One forward + backward's tensor-parallel bytes (every grid axis
and the whole grid's ``tp`` together; the step's gradient norm, summed over tp in the optimizer
step, is left out as in tests/dist/test_planner_ledger.py) and one whole step's bytes on every
other axis (dp, cp, ep, ep_dp) equal ``behemoth.planner.axis_traffic.step_traffic``'s on every rank:
tp=4 2D on 4 ranks, with and without activation checkpointing (the recompute's forward
collectives again, but not the exchange that puts the output back), and 1D tp=4 checkpointed and
dp=2 x ep=2 x 1D tp=2; on 8 ranks dp=2 x ep=2 x tp=4 2D (the experts' all-to-alls carry a grid
rank's share of the tokens), tp=8 2.5D (depth 2), tp=8 3D, cp=2 x 2D, and dp=2 x 2D under ZeRO 1
with two micro-batches (the chunks' padding, which the planner does not count, taken from the
run's chunk layout and added). And each block's collective calls (a 4-block run's less a 2-block
one's, halved; the gradient sync's own launches left out) are
``behemoth.planner.host_calls.block_calls``': the MoE Llama under tp=4 2D, checkpointed too (whose
recompute issues the forward's calls but the exchange that puts the output back, its backward's
norm gradients summed in the pass's buckets as an unchecked block's), and so the dense GPT and
Llama checkpointed under 2D; on 8 ranks the MoE Llama under 2.5D, 3D (with over-decomposition)
and dp=2 x ep=2 x 2D.
"""

from __future__ import annotations

import pytest
from common import SEQ, global_batches, shard
from test_planner_expert_ledger import _chunk_bytes, _model_and_optimizer, _padding
from test_planner_host_calls import _calls, _model
from test_planner_ledger import BATCH, FP32, _ledger, _workload, second_step_bytes

import behemoth as bh
from behemoth.planner.axis_traffic import step_traffic
from behemoth.planner.host_calls import block_calls
from behemoth.planner.workload import workload_for


def _world(rank, world, plans):
    for plan in plans:
        model, optimizer = _model_and_optimizer()
        w = _workload(model)
        engine = bh.boost(model, optimizer, plan)
        mesh = engine.mesh
        diagonal = plan.tp_mode in ("2d", "2.5d") and mesh.coord("tp_row") == mesh.coord("tp_col")
        want = step_traffic(engine.plan, w, dt=FP32, diagonal=diagonal)
        if plan.zero:  # the chunks' padding (the planner counts parameters), as the run laid them out
            for axis, pad in _padding(engine.grad_sync.reducer.store).items():
                want[axis] += _chunk_bytes(engine.plan, pad, mesh.axis(axis).size)
        what = f"{engine.plan.describe()} rank {rank}"
        steps = second_step_bytes(engine)  # a whole step: the gradient sync, the norm, the update
        others = {a: b for a, b in steps.items() if not a.startswith("tp")}
        assert others == {a: int(b) for a, b in want.items() if a != "tp" and b}, f"{what}: ledger {others} vs {want}"
        engine.reset_comm_stats()
        engine._forward_backward(shard(global_batches(1, BATCH)[0], engine.dp_rank, engine.dp_size))
        got = _ledger(engine)["tp"]
        assert got == int(want["tp"]), f"{what}: tp ledger {got} vs planner {want['tp']}"


def test_expert_grid_2d_bytes_equal_the_ledger():
    plans = [bh.Plan(tp=4, tp_mode="2d", precision="fp32", activation_checkpointing=c) for c in (False, True)]
    bh.spawn(_world, 4, plans, timeout=500)


def test_expert_1d_bytes_equal_the_ledger():
    """1D the same way: a checkpointed block's recompute without its output's all-gather; under
    expert parallelism each tp rank's all-to-alls carry its 1/tp share of the tokens."""
    plans = [
        bh.Plan(tp=4, precision="fp32", activation_checkpointing=True),
        bh.Plan(dp=2, ep=2, tp=2, precision="fp32"),
    ]
    bh.spawn(_world, 4, plans, timeout=500)


EIGHT = {
    "dp2 ep2 2d": [bh.Plan(dp=2, ep=2, tp=4, tp_mode="2d", precision="fp32")],
    "2.5d, 3d": [
        bh.Plan(tp=8, tp_mode="2.5d", tp_depth=2, precision="fp32"),
        bh.Plan(tp=8, tp_mode="3d", precision="fp32"),
    ],
    "cp2 2d, zero 1": [
        bh.Plan(tp=4, tp_mode="2d", cp=2, precision="fp32"),
        bh.Plan(dp=2, tp=4, tp_mode="2d", zero=1, microbatches=2, precision="fp32"),
    ],
}


@pytest.mark.parametrize("name", sorted(EIGHT))
def test_expert_grid_eight_ranks_bytes_equal_the_ledger(name):
    bh.spawn(_world, 8, EIGHT[name], timeout=600)


def _calls_world(rank, world, runs):
    for family, plan in runs:
        got = (_calls(family, plan, 4, gradient_sync=False) - _calls(family, plan, 2, gradient_sync=False)) / 2
        # the planner's 4-block model less its 2-block one, halved (a pass's bucket flushes depend on the depth)
        planned = {
            n: n * sum(block_calls(plan.resolve(world), workload_for(_model(family, n), seq_len=SEQ, global_batch=8)))
            for n in (2, 4)
        }
        want = (planned[4] - planned[2]) / 2
        assert got == pytest.approx(want), f"{family} {plan.describe()}: {got} calls per block, planner {want}"


def test_expert_grid_2d_calls_per_block_are_the_runs():
    runs = [("llama-moe", bh.Plan(tp=4, tp_mode="2d", activation_checkpointing=c)) for c in (False, True)]
    runs += [(family, bh.Plan(tp=4, tp_mode="2d", activation_checkpointing=True)) for family in ("gpt", "llama")]
    bh.spawn(_calls_world, 4, runs, timeout=500)


def test_expert_grid_eight_ranks_calls_per_block_are_the_runs():
    plans = (
        bh.Plan(tp=8, tp_mode="2.5d", tp_depth=2),
        bh.Plan(tp=8, tp_mode="3d", tp_overlap=2),
        bh.Plan(dp=2, ep=2, tp=4, tp_mode="2d"),
    )
    bh.spawn(_calls_world, 8, [("llama-moe", p) for p in plans], timeout=600)

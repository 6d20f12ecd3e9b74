"""The planner's collective calls per block (behemoth.planner.host_calls.tp_block_calls) against a
run's: the process group's record functions (``gloo:*``) of one forward + backward of a tiny
GPT and a tiny Llama (separate q/k/v, gated MLP, RMSNorm, replicated kv heads under 1D tp 4)
with 4 blocks less those of the same model with 2, halved (the planner's likewise: 2D's and
2.5D's bucket flushes of the biases' and norms' gradients depend on the model's depth), under 1D, 1D with sequence
parallelism and 2D tensor parallelism on 4 gloo ranks, and 2.5D (depth 2) and 3D (with and
without over-decomposition) on 8; context parallelism's (Ulysses, ring) on 2; and a mixture-of-
experts Llama's (behemoth.planner.host_calls.block_calls, ep_block_calls) on 2: the balancing
statistics' all-reduce at ep 1 and the token split's calls under 1D tp 2, the split sizes and the chunks' all-to-alls at ep 2 with
ep_overlap 1 and 2, and a checkpointed block's recompute (its forward's routes replayed); and with
a shared expert, at ep 2 and under 1D tp 2."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from common import SEQ, PhaseCounter, build, count_by_phase, global_batches, make_optimizer, shard
from torch.profiler import ProfilerActivity, profile

import behemoth as bh
from behemoth.planner.host_calls import block_calls, tp_block_calls
from behemoth.planner.workload import workload_for


def _model(family: str, layers: int):
    if family in ("llama-moe", "llama-moe-shared"):
        from common import VOCAB

        from behemoth.models import build_model

        shared = {"shared_expert_ffn_hidden": 16} if family == "llama-moe-shared" else {}
        return build_model("llama-moe-tiny", vocab_size=VOCAB, seq_len=SEQ, num_layers=layers, **shared)
    return build(family, num_layers=layers)


PLANS = (bh.Plan(tp=4), bh.Plan(tp=4, sequence_parallel=True), bh.Plan(tp=4, tp_mode="2d"))


def _calls(family, plan, layers: int, *, gradient_sync: bool = True) -> int:
    """gloo calls of one forward + backward; ``gradient_sync=False``: less the gradient sync's
    reductions (its own launch log; the cost model counts them in the data-parallel term, by
    bucket, not per block)."""
    model = _model(family, layers)
    engine = bh.boost(model, make_optimizer("sgd", model), plan)
    batch = shard(global_batches(1, 8)[0], engine.dp_rank, engine.dp_size)
    engine.step(batch)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        engine._forward_backward(batch)
    # a ring shift's coalesced send and receive are one call (its send counted)
    calls = sum(Counter(e.name for e in prof.events() if e.name.startswith("gloo:") and e.name != "gloo:recv").values())
    if not gradient_sync:
        reducer = engine.grad_sync.reducer
        store = reducer.store
        calls -= sum(1 for index, _ in reducer.launch_log if not store.replica_axis(store.chunks[index]).trivial)
    return calls


def _planned(family: str, plan, world: int) -> float:
    """The planner's calls of the 4-block model less the 2-block one's, halved: a block's calls (2D
    and 2.5D count a block's share of a pass's bucket flushes, which depend on the model's depth)."""
    calls = {n: n * sum(tp_block_calls(plan.resolve(world), _workload(family, n))) for n in (2, 4)}
    return (calls[4] - calls[2]) / 2


def _workload(family: str, layers: int):
    return workload_for(build(family, num_layers=layers), seq_len=SEQ, global_batch=8)


def _world(rank, world):
    for family in ("gpt", "llama"):
        for plan in PLANS:
            got = (_calls(family, plan, 4) - _calls(family, plan, 2)) / 2
            want = _planned(family, plan, world)
            assert got == want, f"{family} {plan.describe()}: {got} calls per block, planner {want}"


def test_collective_calls_per_block_are_the_runs():
    torch.manual_seed(0)
    bh.spawn(_world, 4, timeout=500)


class _PhaseCalls(PhaseCounter):
    """Counts the process group's calls (the c10d ops reaching the dispatcher) in the forward and,
    once the logits' gradient arrives, in the backward."""

    def counts(self, func) -> bool:
        return str(func.overloadpacket).startswith("c10d.")


def _llama_8b_shaped(layers: int):
    """Llama-3-8B's block structure, narrower: 32 heads over 8 kv heads (GQA 4:1), an MLP 3.5x
    wide, separate q/k/v and gate/up/down projections, RMSNorm, no biases."""
    from common import VOCAB

    from behemoth.models import Llama, LlamaConfig

    config = LlamaConfig(
        vocab_size=VOCAB, seq_len=SEQ, num_layers=layers, num_heads=32, num_kv_heads=8, hidden=256, ffn_hidden=896
    )
    return Llama(config)


def _phase_calls(layers: int, plan) -> Counter:
    model = _llama_8b_shaped(layers)
    engine = bh.boost(model, make_optimizer("sgd", model), plan)
    return count_by_phase(engine, shard(global_batches(1, 8)[0], engine.dp_rank, engine.dp_size), _PhaseCalls())


def _llama_8b_world(rank, world):
    plan = bh.Plan(tp=4, tp_mode="2d")
    lo, hi = _phase_calls(2, plan), _phase_calls(4, plan)
    w = {n: workload_for(_llama_8b_shaped(n), seq_len=SEQ, global_batch=8) for n in (2, 4)}
    planned = {n: tp_block_calls(plan.resolve(world), w[n]) for n in (2, 4)}
    for i, phase in enumerate(("forward", "backward")):
        got = (hi[phase] - lo[phase]) / 2
        want = (4 * planned[4][i] - 2 * planned[2][i]) / 2
        assert got == want, f"Llama-8B-shaped 2D block, {phase}: {got} calls per block, planner {want}"


def test_llama_8b_shaped_2d_calls_forward_and_backward_are_the_runs():
    """Llama-8B's block under 2D (q = 2), forward and backward apart: the SUMMA gathers of X and
    W per Linear and the norms' statistics forward (16), X's re-gather and the dX, dW
    reduce-scatters per Linear, the norms' sums and the block's share of the pass's bucket
    flushes backward."""
    bh.spawn(_llama_8b_world, 4, timeout=300)


RINGS = (bh.Plan(cp=2), bh.Plan(cp=2, cp_mode="ring"), bh.Plan(cp=2, activation_checkpointing=True))


def _cp_world(rank, world):
    for plan in RINGS:
        got = (_calls("gpt", plan, 4) - _calls("gpt", plan, 2)) / 2
        w = workload_for(build("gpt", num_layers=2), seq_len=SEQ, global_batch=8)
        want = sum(block_calls(plan.resolve(world), w))
        assert got == want, f"{plan.describe()}: {got} calls per block, planner {want}"


def test_context_parallel_calls_per_block_are_the_runs():
    """Ulysses' all-to-alls (again in a recomputed forward), ring attention's shifts."""
    bh.spawn(_cp_world, 2, timeout=300)


CUBES = (
    bh.Plan(tp=8, tp_mode="3d"),
    bh.Plan(tp=8, tp_mode="3d", tp_overlap=2),
    bh.Plan(tp=8, tp_mode="2.5d", tp_depth=2),
)


def _cube_world(rank, world):
    for family in ("gpt", "llama"):
        for plan in CUBES:
            got = (_calls(family, plan, 4) - _calls(family, plan, 2)) / 2
            want = _planned(family, plan, world)
            assert got == pytest.approx(want), f"{family} {plan.describe()}: {got} calls per block, planner {want}"


def test_2p5d_and_3d_collective_calls_per_block_are_the_runs():
    bh.spawn(_cube_world, 8, timeout=600)


EXPERTS = (
    bh.Plan(),
    bh.Plan(ep=2),
    bh.Plan(ep=2, ep_overlap=2),
    bh.Plan(ep=2, ep_overlap=2, activation_checkpointing=True),
    bh.Plan(ep=2, ep_dedup=True),
    bh.Plan(ep=2, ep_dedup=True, activation_checkpointing=True),
)


def check_expert_calls_per_block(plans, world: int, family: str = "llama-moe") -> None:
    """Each plan's collective calls per MoE block (a 4-layer run less a 2-layer one, halved)
    equal ``block_calls``. The gradient sync's own launches are left out: its buckets break at
    every MoE layer's experts (another axis reduces them)."""
    w = workload_for(_model(family, 2), seq_len=SEQ, global_batch=8)
    for plan in plans:
        got = (_calls(family, plan, 4, gradient_sync=False) - _calls(family, plan, 2, gradient_sync=False)) / 2
        want = sum(block_calls(plan.resolve(world), w))
        assert got == want, f"{plan.describe()}: {got} calls per block, planner {want}"


def _experts_world(rank, world):
    check_expert_calls_per_block(EXPERTS, world)


def test_expert_calls_per_block_are_the_runs():
    """An MoE layer: the statistics' all-reduce over dp (ep 1); with ep 2 the split sizes and
    each chunk's dispatch and combine forward, the chunks' reverse pairs backward, and in a
    recompute the chunks' pairs again, not the split sizes; the member exchange (``ep_dedup``) its
    rows' weights and slots beside them, forward, backward and recomputed."""
    bh.spawn(_experts_world, 2, timeout=400)


def _experts_tp_world(rank, world):
    check_expert_calls_per_block(
        (bh.Plan(tp=2), bh.Plan(tp=2, sequence_parallel=True, activation_checkpointing=True)), world
    )


def _shared_world(rank, world):
    plans = (bh.Plan(ep=2, activation_checkpointing=True), bh.Plan(tp=2), bh.Plan(tp=2, activation_checkpointing=True))
    check_expert_calls_per_block(plans, world, "llama-moe-shared")


def test_expert_calls_per_block_with_a_shared_expert_are_the_runs():
    """A shared expert beside the routed ones issues no collective of its own per block (its
    gradients are summed with the router's and experts' in the gradient sync): the routed layer's
    calls, at ep 2 and under 1D tp 2, checkpointed too."""
    bh.spawn(_shared_world, 2, timeout=400)


def test_expert_calls_per_block_under_1d_tp_are_the_runs():
    """An MoE layer under 1D tp 2 (the tp ranks split its tokens): the shares' statistics summed,
    the output gathered (or, with sequence parallelism, the norms' gathers and the input
    gradient's reduce-scatter), the input gradient gathered and the router's and experts' gradients
    summed over tp; a recomputed forward issues the forward's calls again."""
    bh.spawn(_experts_tp_world, 2, timeout=400)

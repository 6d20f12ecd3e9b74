"""Under 1D tensor parallelism each tp rank runs an MoE block on its own share of the tokens, so the
block's parameter gradients (router, experts) are partial over tp; they are summed once per step, in
the step's gradient reduction over the data axis times tp (``dp_tp``), not once per micro-batch.

On 2 ranks (tp=2) with gradient accumulation (2 and 4 micro-batches), ZeRO 0 and 1: training
matches serial training (losses, every step's gradient norm, ``full_state_dict()``, rtol 1e-4,
fp32); the block's parameters reduce over ``dp_tp``, whose ledger shows one step's reduction of
them (ZeRO 0: one all-reduce of their fp32 gradients; ZeRO 1: one reduce-scatter of their chunks
and one all-gather of the updated parameters) however many micro-batches the step has; and the tp
axis carries none of their gradients: its bytes in a step are those of the same plan with the
block's parameters frozen.

On 4 ranks (dp=2 x tp=2), where the larger groups shard ZeRO's chunks: ep=2 at ZeRO 2 with 2
micro-batches (the router's chunks over ``dp_tp``, 4 ranks, the experts' over ``ep_dp_tp``)
matches serial training, and its checkpoint loads at ep=1 x ZeRO-3 with offload='cpu' (the whole
block over ``dp_tp``) and at cp=2 x ep=2 x ZeRO 1 without tensor parallelism, and keeps matching
serial for a step."""

from __future__ import annotations

import torch
from common import (
    assert_grad_norms_close,
    assert_losses_close,
    assert_state_close,
    global_batches,
    shard,
    train_steps,
)
from test_expert_parallel import BATCH, STEPS, build_moe, optimizer_for, serial_moe_run

import behemoth as bh
from behemoth.parallel.expert import moe_layers
from behemoth.planner.collectives import all_gather_bytes, all_reduce_bytes, reduce_scatter_bytes


def _block_params(model) -> list[torch.nn.Parameter]:
    return [p for block in moe_layers(model).values() for p in block.parameters()]


def _first_step_stats(engine, batch) -> dict:
    engine.reset_comm_stats()
    loss = engine.step(shard(batch, engine.dp_rank, engine.dp_size))
    return loss, engine.comm_stats()


def _world(rank: int, world: int) -> None:
    batches = global_batches(STEPS, BATCH)
    for micro in (2, 4):
        want = serial_moe_run(batches, clip=1.0, micro=micro)
        for zero in (0, 1):
            plan = bh.Plan(tp=2, microbatches=micro, zero=zero)
            what = plan.describe()
            model = build_moe()
            engine = bh.boost(model, optimizer_for(model), plan, max_grad_norm=1.0)
            block = _block_params(engine.model)
            store = engine.grad_sync.reducer.store
            axes = {store.replica_axis(store.chunk_of[id(p)]).name for p in block}
            assert axes == {"dp_tp"}, (what, axes)
            loss, stats = _first_step_stats(engine, batches[0])
            chunks = {id(store.chunk_of[id(p)]): store.chunk_of[id(p)] for p in block}.values()
            if zero == 0:  # one all-reduce of the block's gradients, whatever the micro-batches
                grads = 4 * sum(p.numel() for p in block)
                assert stats["dp_tp"]["wire_bytes"] == int(all_reduce_bytes(grads, 2)), (what, stats["dp_tp"])
            else:  # their chunks reduce-scattered once, the updated parameters gathered once
                size = 4 * sum(st.size for st in chunks)
                want_bytes = reduce_scatter_bytes(size, 2) + all_gather_bytes(size, 2)
                assert stats["dp_tp"]["wire_bytes"] == int(want_bytes), (what, stats["dp_tp"])
            losses, norms = [loss], [float(engine.last_grad_norm)]
            for b in batches[1:]:
                losses.append(engine.step(shard(b, engine.dp_rank, engine.dp_size)))
                norms.append(float(engine.last_grad_norm))
            assert_losses_close(losses, want[0], what=what)
            assert_grad_norms_close(norms, want[2], what=what)
            assert_state_close(engine.full_state_dict(), want[1], what=what)

            # the tp axis carries no gradient of the block: its bytes are those of the block frozen
            frozen = build_moe()
            for p in _block_params(frozen):
                p.requires_grad_(False)
            engine_frozen = bh.boost(frozen, optimizer_for(frozen), plan, max_grad_norm=1.0)
            _, frozen_stats = _first_step_stats(engine_frozen, batches[0])
            assert stats["tp"]["wire_bytes"] == frozen_stats["tp"]["wire_bytes"], (
                what,
                stats["tp"],
                frozen_stats["tp"],
            )


def test_expert_gradients_are_summed_over_tp_once_per_step():
    bh.spawn(_world, 2, timeout=900)


def _shared_chunks(engine, what) -> None:
    """Each MoE block's chunks are sharded over the data axis times tp: a rank holds 1/(dp*tp)."""
    store = engine.grad_sync.reducer.store
    for p in _block_params(engine.model):
        st = store.chunk_of[id(p)]
        axis = store.replica_axis(st)
        assert axis.name.endswith("_tp") and st.shard_size * axis.size == st.size, (what, axis.name, st.size)


def _four_ranks(rank: int, world: int, path: str) -> None:
    batches = global_batches(STEPS, BATCH)
    want = serial_moe_run(batches, clip=1.0, world=2, micro=2)
    plan = bh.Plan(dp=2, tp=2, ep=2, zero=2, microbatches=2, chunk_mb=0.02)
    what = plan.describe()
    model = build_moe()
    engine = bh.boost(model, optimizer_for(model), plan, max_grad_norm=1.0)
    _shared_chunks(engine, what)
    losses, norms = train_steps(engine, batches)
    assert_losses_close(losses, want[0], what=what)
    assert_grad_norms_close(norms, want[2], what=what)
    assert_state_close(engine.full_state_dict(), want[1], what=what)
    engine.save(path)

    want = serial_moe_run(batches + batches[:1], clip=1.0, world=2, micro=2)
    for fields in (dict(tp=2, zero=3, offload="cpu"), dict(cp=2, ep=2, zero=1)):
        plan = bh.Plan(dp=2, microbatches=2, **fields)
        what = f"saved at {engine.plan.describe()}, loaded at {plan.describe()}"
        fresh = build_moe(seed=5)
        loaded = bh.boost(fresh, optimizer_for(fresh), plan, max_grad_norm=1.0)
        loaded.load(path)
        losses, norms = train_steps(loaded, batches[:1])
        assert_losses_close(losses, want[0][-1:], what=what)
        assert_grad_norms_close(norms, want[2][-1:], what=what)
        assert_state_close(loaded.full_state_dict(), want[1], what=what)


def test_expert_chunks_shard_over_dp_and_tp_and_checkpoints_load_across_plans(tmp_path):
    bh.spawn(_four_ranks, 4, str(tmp_path / "ckpt"), timeout=900)

"""Expert parallelism under ZeRO 1-3 (per-operator sharding): dense chunks sharded over dp, expert
chunks in chunk groups of their own sharded over ep_dp (never gathered beyond it: a rank's expert
chunk holds its ep rank's E/ep experts only), against serial training: losses, every step's
gradient norm, ``full_state_dict()``, rtol 1e-4 in fp32. dp=4 x ep=2 at ZeRO 1, 2 and 3 for
behemoth's MoE Llama (ZeRO-2 with micro-batches, ZeRO-3 with activation checkpointing, ZeRO-3 with
offload='cpu': the expert chunks' masters and Adam state on the host), and a transformers Mixtral
at ZeRO-3; a checkpoint saved at ep=2 x ZeRO-2 loads at ep=1 x ZeRO-3 and at ep=4 (one expert per
rank) and keeps matching serial. Adam's state and the gradient shards per rank equal the formula
dense / dp + experts / (ep * ep_dp) plus padding, within 5%."""

from __future__ import annotations

from common import assert_grad_norms_close, assert_losses_close, assert_state_close, global_batches, train_steps
from test_expert_families import adamw, build_hf_moe, serial_hf_run
from test_expert_parallel import BATCH, STEPS, build_moe, optimizer_for, serial_moe_run

import behemoth as bh


def check_expert_chunks(engine, ep, what) -> None:
    """Expert chunks hold only this rank's E/ep experts and are sharded over ep_dp; dense chunks
    over dp."""
    zero = engine.grad_sync
    ep_dp = engine.mesh.axis("ep_dp")
    experts = {id(p) for n, p in engine.model.named_parameters() if n.endswith(("gate_up_proj", "down_proj"))}
    kinds = set()
    for st in zero.store.chunks:
        is_expert = {id(p) in experts for p in st.params}
        assert len(is_expert) == 1, (what, "a chunk mixes experts and dense parameters")
        kind = is_expert.pop()
        kinds.add(kind)
        axis = zero.store.replica_axis(st)
        assert axis.name == ("ep_dp" if kind else "dp"), (what, axis.name)
        assert st.shard_size * axis.size == st.size, what
        if kind:
            assert st.start == ep_dp.rank * st.shard_size, what
            assert all(p.shape[0] == 4 // ep for p in st.params), what
    assert kinds == {True, False}, what


def check_memory(engine, zero, what) -> None:
    """Adam's state per rank (and at stages 2-3 the gradient shards) within 5% of the formula
    ``dense / dp + experts / (ep * ep_dp)`` elements (experts counted over all E, as the serial
    model holds them) plus each chunk's padding over its shard count."""
    model = build_moe()
    experts = sum(p.numel() for n, p in model.named_parameters() if n.endswith(("gate_up_proj", "down_proj")))
    dense = sum(p.numel() for p in model.parameters()) - experts
    dp, ep, ep_dp = engine.mesh.axis("dp").size, engine.mesh.axis("ep").size, engine.mesh.axis("ep_dp").size
    store = engine.grad_sync.store
    padding = sum((st.size - st.used) / store.replica_axis(st).size for st in store.chunks)
    elems = dense / dp + experts / (ep * ep_dp) + padding
    report = engine.memory_report()["cpu"]
    parts = [("optimizer", 2 * 4 * elems)] + ([("grads", 4 * elems)] if zero >= 2 else [])
    for key, want in parts:
        assert abs(report[key] - want) <= 0.05 * want, (what, key, report[key], want)


def _zero_world(rank: int, world: int, path: str) -> None:
    batches = global_batches(STEPS, BATCH)
    for zero, micro, ckpt, offload in (
        (1, 1, False, None),
        (2, 2, False, None),
        (3, 1, True, None),
        (3, 1, False, "cpu"),
    ):
        what = f"dp={world} ep=2 zero={zero} micro={micro} ckpt={ckpt} offload={offload}"
        want = serial_moe_run(batches, clip=1.0, world=world, micro=micro)
        model = build_moe()
        plan = bh.Plan(
            dp=world, ep=2, zero=zero, microbatches=micro, activation_checkpointing=ckpt, chunk_mb=0.02, offload=offload
        )
        engine = bh.boost(model, optimizer_for(model), plan, max_grad_norm=1.0)
        check_expert_chunks(engine, 2, what)
        losses, norms = train_steps(engine, batches)
        assert_losses_close(losses, want[0], what=what)
        assert_grad_norms_close(norms, want[2], what=what)
        assert_state_close(engine.full_state_dict(), want[1], what=what)
        if offload is None:
            check_memory(engine, zero, what)
        if zero == 2:
            engine.save(path)

    want = serial_moe_run(batches + batches[:1], clip=1.0, world=world, micro=2)
    for ep, zero in ((1, 3), (4, 0)):
        what = f"saved at ep=2 zero=2, loaded at dp={world} ep={ep} zero={zero}"
        fresh = build_moe(seed=5)
        plan = bh.Plan(dp=world, ep=ep, zero=zero, microbatches=2)
        engine = bh.boost(fresh, optimizer_for(fresh), plan, max_grad_norm=1.0)
        engine.load(path)
        losses, norms = train_steps(engine, batches[:1])
        assert_losses_close(losses, want[0][-1:], what=what)
        assert_grad_norms_close(norms, want[2][-1:], what=what)
        assert_state_close(engine.full_state_dict(), want[1], what=what)

    what = f"transformers Mixtral dp={world} ep=2 zero=3"
    want = serial_hf_run("mixtral", batches)
    model = build_hf_moe("mixtral")
    engine = bh.boost(model, adamw(model), bh.Plan(dp=world, ep=2, zero=3), max_grad_norm=1.0)
    losses, norms = train_steps(engine, batches)
    assert_losses_close(losses, want[0], what=what)
    assert_grad_norms_close(norms, want[2], what=what)
    assert_state_close(engine.full_state_dict(), want[1], what=what)


def test_expert_parallel_with_zero_matches_serial(tmp_path):
    bh.spawn(_zero_world, 4, str(tmp_path / "ckpt"), timeout=1200)

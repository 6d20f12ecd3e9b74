"""``offload='auto'`` in the planner: the runtime's own split over the runtime's own chunks, the memory
it leaves on the GPU and the host, and the offload work it leaves to the step."""

from __future__ import annotations

import dataclasses

import pytest

import behemoth as bh
from behemoth.models import build_model
from behemoth.parallel.zero.chunks import pack_chunks, search_chunk_size
from behemoth.parallel.zero.placement import chunk_split, measured_budget
from behemoth.planner.auto_offload import place_stages, shard_chunks, stage_chunks
from behemoth.planner.bubble import ranks_inflight
from behemoth.planner.calibration import load_calibration
from behemoth.planner.cluster import Cluster
from behemoth.planner.cost import predict
from behemoth.planner.footprint import footprint, plan_memory
from behemoth.planner.params import stage_layers
from behemoth.planner.search import Limits, search
from behemoth.planner.workload import workload_for

CAL = load_calibration("h100")
GIB = 2**30


@pytest.mark.parametrize("name", ("gpt-tiny", "llama-tiny", "olmoe-tiny"))
@pytest.mark.parametrize("dp", (1, 2, 3))
def test_shard_chunks_are_the_runtimes(name, dp):
    """The chunks the planner splits are those ``ZeroOptimizer._pack`` packs: the least-padding
    size among its 256 candidates, next-fit, each chunk's shard over dp."""
    model = build_model(name, vocab_size=96, seq_len=16, num_layers=5, device="meta")
    w = workload_for(model, seq_len=16, global_batch=12)
    sizes = [p.numel() for p in model.parameters()]
    lo = max(sizes)
    hi = max(2 * lo, sum(sizes) // 32)
    cands = sorted({lo + (hi - lo) * i // 255 for i in range(256)})
    chunk = search_chunk_size(sizes, dp, candidates=cands)[0]
    want = [c.shard_size for c in pack_chunks(sizes, chunk, dp).chunks]
    assert shard_chunks(bh.Plan(dp=dp, zero=3, offload="auto"), w) == want


def _gib(x):
    return x / GIB


@pytest.mark.parametrize("zero", (1, 2, 3))
@pytest.mark.parametrize("param_dtype", (None, "bf16"))
def test_auto_keeps_what_the_runtimes_split_keeps(zero, param_dtype):
    """GPT-13B on one GPU: the split is the runtime's (``chunk_split`` at ``measured_budget`` of the
    predicted other data), the GPU holds the kept chunks beside that data and stays inside the
    runtime's budget, the host what the rest needs (the runtime's 16 B an element, 2 more for a
    bf16 copy's host master at ZeRO-3)."""
    w = workload_for("gpt-13b", seq_len=2048, global_batch=8)
    c = Cluster(num_gpus=1, calibration=CAL, gpu_bytes=140 * GIB, host_bytes=400 * GIB)
    kw = dict(dp=1, zero=zero, param_dtype=param_dtype, precision="bf16", activation_checkpointing=True, microbatches=8)
    auto = plan_memory(bh.Plan(offload="auto", **kw), w, c)
    cpu = plan_memory(bh.Plan(offload="cpu", **kw), w, c)
    pb = 2 if param_dtype else 4
    other = cpu.allocated - (cpu.params if zero < 3 else 0.0)
    shards = shard_chunks(bh.Plan(offload="auto", **kw), w)
    keep_p, keep_o, _ = chunk_split(
        zero,
        shards,
        8,
        pb,
        measured_budget(int(c.memory_bytes), int(other)),
        bandwidth=CAL.h2d_bytes_per_s,
        cpu_update_bandwidth=CAL.cpu_adam_params_per_s * 4,
        host_budget_bytes=int(c.host_bytes),
        resident_bytes=sum(shards) * pb if zero < 3 else 0,  # one rank: the shards are the whole parameters
    )
    assert 0 < keep_o < len(shards)  # a real split: some chunks kept, some offloaded
    total = sum(shards)
    off_o = total - sum(shards[:keep_o])
    off_p = total - sum(shards[:keep_p]) if zero == 3 else 0
    assert auto.host_optimizer_fraction == pytest.approx(off_o / total)
    assert auto.host_param_fraction == pytest.approx(off_p / total)
    assert auto.host == pytest.approx(off_o * 16 + off_p * (4 - pb))
    assert auto.host < cpu.host and cpu.host_optimizer_fraction == 1.0
    # the model data kept is what the runtime's budget allowed; the activations are the same
    kept = auto.allocated - cpu.allocated
    assert 0 < kept <= measured_budget(int(c.memory_bytes), int(other))
    assert auto.activations == cpu.activations
    # the model data inside the runtime's budget: ZeRO 1-2's whole parameters included
    assert auto.allocated <= 0.92 * c.memory_bytes - 2 * GIB


def test_auto_is_cpu_where_nothing_fits_and_none_where_everything_does():
    w = workload_for("gpt-1.3b", seq_len=2048, global_batch=8)
    kw = dict(dp=1, zero=3, precision="bf16", activation_checkpointing=True, microbatches=8)
    roomy = Cluster(num_gpus=1, calibration=CAL, gpu_bytes=140 * GIB)
    auto = plan_memory(bh.Plan(offload="auto", **kw), w, roomy)
    assert auto.host == 0 and auto.host_optimizer_fraction == auto.host_param_fraction == 0
    none = plan_memory(bh.Plan(**kw), w, roomy)
    assert auto.optimizer == pytest.approx(none.optimizer, rel=0.03)  # the chunks' padding beside n / g
    # a device whose budget holds no chunk: everything offloaded, as 'cpu'
    tight = Cluster(num_gpus=1, calibration=CAL, gpu_bytes=3 * GIB)
    auto = plan_memory(bh.Plan(offload="auto", **kw), w, tight)
    cpu = plan_memory(bh.Plan(offload="cpu", **kw), w, tight)
    assert auto.host_optimizer_fraction == 1.0 and auto.host == pytest.approx(cpu.host, rel=0.03)


def _auto_at_most_cpu_and_faster_as_the_gpu_grows(w, kw: dict, gpus: int, sizes: tuple[int, ...]) -> Cluster:
    """'auto' against 'cpu' for ``Plan(**kw)`` on ``gpus`` GPUs of each size in ``sizes`` (GiB,
    ascending): never slower, faster as the GPU grows, no offload work on the last (where
    everything stays: the GPU's optimizer). Returns the last cluster."""
    steps = []
    for gb in sizes:
        c = Cluster(num_gpus=gpus, calibration=CAL, gpu_bytes=gb * GIB, host_bytes=400 * GIB)
        auto, cpu = predict(bh.Plan(offload="auto", **kw), w, c), predict(bh.Plan(offload="cpu", **kw), w, c)
        assert auto.step <= cpu.step * (1 + 1e-12)
        steps.append(auto.step)
    assert steps == sorted(steps, reverse=True) and steps[0] > steps[-1]
    assert predict(bh.Plan(offload="auto", **kw), w, c).offload == 0
    return c


def test_auto_time_between_none_and_cpu_and_monotone_in_memory():
    """Offloading less never predicts a slower step: 'auto' at most 'cpu', equal where it keeps
    nothing, and faster as the GPU grows."""
    w = workload_for("gpt-13b", seq_len=2048, global_batch=8)
    kw = dict(dp=1, zero=3, precision="bf16", activation_checkpointing=True, microbatches=8)
    c = _auto_at_most_cpu_and_faster_as_the_gpu_grows(w, kw, 1, (40, 60, 80, 100, 120, 140, 200, 300))
    # keeping nothing costs what 'cpu' costs
    mem = plan_memory(bh.Plan(offload="cpu", **kw), w, c)
    forced = predict(bh.Plan(offload="auto", **kw), w, c, memory=dataclasses.replace(mem))
    assert forced.step == pytest.approx(predict(bh.Plan(offload="cpu", **kw), w, c).step, rel=1e-12)


def test_search_takes_auto_before_cpu():
    """13B on one 80 GB GPU needs the host: the search offers 'auto' (part stays) and, for a layout
    where 'auto' fits, never the slower 'cpu'; with it the best is at least as fast as without."""
    w = workload_for("gpt-13b", seq_len=2048, global_batch=8)
    c = Cluster(num_gpus=1, calibration=CAL, host_bytes=512 * 2**30)
    r = search(w, c, Limits(top=1000))
    assert any(p.plan.offload == "auto" and p.memory.host_optimizer_fraction < 1 for p in r.ranked)
    layouts = {}
    for p in r.ranked:
        key = (p.plan.zero, p.plan.microbatches, p.plan.activation_checkpointing)
        layouts.setdefault(key, set()).add(p.plan.offload)
    assert all(offs != {"auto", "cpu"} for offs in layouts.values())
    only_cpu = search(w, c, Limits(top=1000, offloads=(None, "cpu")))
    assert r.best.step <= only_cpu.best.step


def _stage_sizes(model, layers, stage, ep):
    """The runtime's view of pipeline rank ``stage``'s parameters (blocks ``layers[stage]`` of a
    contiguous split): the modules it keeps in the serial order (the rest are parameter-free
    ``Skip``s), the last rank's tied head a copy of its own; experts over ``ep`` in a group of theirs."""
    named = list(model.named_parameters())
    blocks = [i for i, (n, _) in enumerate(named) if n.split(".")[0] in ("blocks", "layers")]
    first = sum(layers[:stage])
    mine = range(first, first + layers[stage])
    sizes, groups = [], []
    for i, (name, p) in enumerate(named):
        pre, post = i < blocks[0], i > blocks[-1]
        block = None if pre or post else int(name.split(".")[1])
        if (pre and stage == 0) or (post and stage == len(layers) - 1) or block in mine:
            expert = ep > 1 and name.rsplit(".", 1)[-1] in ("gate_up_proj", "down_proj")
            sizes.append(p.numel() // ep if expert else p.numel())
            groups.append(1 if expert else 0)
    tied = not any(n.startswith("lm_head") for n, _ in named)
    if stage == len(layers) - 1 and tied:
        sizes.append(named[0][1].numel())
        groups.append(0)
    return sizes, groups


@pytest.mark.parametrize("name", ("gpt-tiny", "llama-tiny", "olmoe-tiny"))
@pytest.mark.parametrize("pp,dp,ep", ((2, 1, 1), (3, 2, 1), (1, 2, 2), (2, 2, 2), (2, 4, 2)))
def test_stage_chunks_are_the_runtimes(name, pp, dp, ep):
    """Each pipeline rank packs its own parameters (``ZeroOptimizer`` over the rank's cut-down
    model): the planner's chunks of every rank are the runtime's -- the chunk size its search
    picks over the rank's parameters, and under expert parallelism the experts' chunk group over
    ``ep_dp`` beside the dense one over dp, their chunks interleaved in the order they open."""
    if ep > 1 and name != "olmoe-tiny":
        return
    model = build_model(name, vocab_size=96, seq_len=16, num_layers=5, device="meta")
    w = workload_for(model, seq_len=16, global_batch=12)
    plan = bh.Plan(dp=dp, pp=pp, ep=ep, zero=3, offload="auto")
    layers = stage_layers(plan, w)
    assert sum(layers) == 5
    for r in range(pp):
        sizes, groups = _stage_sizes(model, layers, r, ep)
        dps = {0: dp, 1: dp // ep} if ep > 1 else dp
        lo = max(sizes)
        hi = max(2 * lo, sum(sizes) // 32)
        cands = sorted({lo + (hi - lo) * i // 255 for i in range(256)})
        chunk = search_chunk_size(sizes, dps, groups=groups, candidates=cands)[0]
        want = [c.shard_size for c in pack_chunks(sizes, chunk, dps, groups=groups).chunks]
        assert shard_chunks(plan, w, r) == want


def _offloaded_stages(plan, w, c):
    """Every pipeline rank's footprint with all its chunks on the host (what each rank's warm-up
    measures its other data beside), as :func:`plan_memory` computes them."""
    mbs = w.global_batch // (plan.dp * plan.microbatches)
    inflight = ranks_inflight(plan.schedule, plan.pp, plan.microbatches, plan.virtual_stages)
    return [footprint(plan, w, mbs=mbs, inflight=inflight[r], reserved=0.0, stage=r) for r in range(plan.pp)]


@pytest.mark.parametrize("zero", (1, 2, 3))
def test_each_pipeline_rank_splits_its_own_chunks(zero):
    """GPT-13B over a 2-stage pipeline on 80 GiB GPUs: every rank's split is the runtime's
    (``chunk_split`` over the rank's chunks at ``measured_budget`` of the rank's own other data),
    every rank's model data inside its own budget; the plan's memory is the worst rank's, its host
    memory and host fractions the most any rank offloads."""
    w = workload_for("gpt-13b", seq_len=2048, global_batch=8)
    c = Cluster(num_gpus=2, calibration=CAL, gpu_bytes=80 * GIB, host_bytes=400 * GIB)
    kw = dict(pp=2, zero=zero, precision="bf16", activation_checkpointing=True, microbatches=8)
    plan = bh.Plan(offload="auto", **kw).resolve(2)
    offloaded = _offloaded_stages(plan, w, c)
    placed = place_stages(plan, w, c, range(plan.pp), offloaded)
    fractions = []
    for r, (off, got) in enumerate(zip(offloaded, placed)):
        shards = shard_chunks(plan, w, r)
        other = off.allocated - (off.params if zero < 3 else 0.0)
        budget = measured_budget(int(c.memory_bytes), int(other))
        keep_p, keep_o, _ = chunk_split(
            zero,
            shards,
            8,
            4,
            budget,
            bandwidth=CAL.h2d_bytes_per_s,
            cpu_update_bandwidth=CAL.cpu_adam_params_per_s * 4,
            host_budget_bytes=int(c.host_bytes),
            resident_bytes=sum(shards) * 4 if zero < 3 else 0,  # dp = 1: the shards are the whole parameters
        )
        assert 0 < keep_o < len(shards)  # a real split on every rank
        assert got.optimizer == pytest.approx(sum(shards[:keep_o]) * 8)
        kept_p = sum(shards[:keep_p]) if zero == 3 else 0
        assert got.params - off.params == pytest.approx(kept_p * 4)
        assert got.activations == off.activations
        assert 0 < got.allocated - off.allocated <= budget  # the kept model data: inside the rank's budget
        assert got.allocated <= 0.92 * c.memory_bytes - 2 * GIB
        total = sum(shards)
        fractions.append((1 - sum(shards[:keep_o]) / total, (1 - kept_p / total) if zero == 3 else 0.0))
    mem = plan_memory(plan, w, c)
    assert mem.allocated == pytest.approx(max(f.allocated for f in placed))
    assert (
        mem.host == pytest.approx(max(f.host for f in placed))
        and mem.host < plan_memory(bh.Plan(offload="cpu", **kw).resolve(2), w, c).host
    )
    assert mem.host_optimizer_fraction == pytest.approx(max(f for f, _ in fractions))
    assert mem.host_param_fraction == pytest.approx(max(p for _, p in fractions))
    assert mem.host_optimizer_fraction < 1


def test_pipeline_auto_time_at_most_cpu_and_monotone_in_memory():
    """Under a pipeline too: 'auto' never slower than 'cpu', equal where it keeps nothing, faster
    as the GPU grows, no offload work where everything stays."""
    w = workload_for("gpt-13b", seq_len=2048, global_batch=8)
    kw = dict(pp=2, zero=3, precision="bf16", activation_checkpointing=True, microbatches=8)
    _auto_at_most_cpu_and_faster_as_the_gpu_grows(w, kw, 2, (30, 40, 60, 80, 100, 140, 200))
    # a device whose budget holds no chunk on any rank: every rank offloads everything, as 'cpu'
    tight = Cluster(num_gpus=2, calibration=CAL, gpu_bytes=12 * GIB, host_bytes=400 * GIB)
    auto = plan_memory(bh.Plan(offload="auto", **kw).resolve(2), w, tight)
    assert auto.host_optimizer_fraction == 1.0 and auto.host_param_fraction == 1.0
    a, b = predict(bh.Plan(offload="auto", **kw), w, tight), predict(bh.Plan(offload="cpu", **kw), w, tight)
    assert a.step == pytest.approx(b.step, rel=1e-3)  # the chunks' padding beside n / g


def test_experts_split_as_one_store():
    """Under expert parallelism the experts' chunks are a chunk group of the one store: one split
    over the dense and expert chunks in the order they open, at one budget."""
    w = workload_for("mixtral-4b", seq_len=2048, global_batch=8)
    c = Cluster(num_gpus=2, calibration=CAL, gpu_bytes=24 * GIB, host_bytes=400 * GIB)
    kw = dict(dp=2, ep=2, zero=3, precision="bf16", activation_checkpointing=True, microbatches=4)
    plan = bh.Plan(offload="auto", **kw)
    layout = stage_chunks(plan, w)
    assert {ch.dp for ch in layout.chunks} == {1, 2}  # experts over ep_dp = 1, the rest over dp = 2
    cpu = plan_memory(bh.Plan(offload="cpu", **kw), w, c)
    auto = plan_memory(plan, w, c)
    shards = [ch.shard_size for ch in layout.chunks]
    keep_p, keep_o, _ = chunk_split(
        3,
        shards,
        8,
        4,
        measured_budget(int(c.memory_bytes), int(cpu.allocated)),
        bandwidth=CAL.h2d_bytes_per_s,
        cpu_update_bandwidth=CAL.cpu_adam_params_per_s * 4,
        host_budget_bytes=int(c.host_bytes),
    )
    assert 0 < keep_o < len(shards)
    total = sum(shards)
    assert auto.host_optimizer_fraction == pytest.approx(1 - sum(shards[:keep_o]) / total)
    assert auto.host_param_fraction == pytest.approx(1 - sum(shards[:keep_p]) / total)
    assert predict(plan, w, c).step <= predict(bh.Plan(offload="cpu", **kw), w, c).step


def test_search_lists_auto_under_a_pipeline_and_experts():
    """'auto' is costed, not refused, under a pipeline and under expert parallelism: GPT-13B on two
    80 GB GPUs needs the host at dp = 1, and the search lists a 2-stage pipeline that keeps part."""
    dense = workload_for("gpt-13b", seq_len=2048, global_batch=8)
    c = Cluster(num_gpus=2, calibration=CAL, host_bytes=512 * 2**30)
    r = search(dense, c, Limits(max_tp=1, max_cp=1, top=10000))
    assert not any("costed" in why for why in r.refused)  # no layout refused for 'auto'
    assert any(
        p.plan.pp == 2 and p.plan.offload == "auto" and 0 < p.memory.host_optimizer_fraction < 1 for p in r.ranked
    )
    for p in r.ranked:  # every listed pipeline plan fits its memory, 'auto' within each rank's budget
        if p.plan.pp == 2 and p.plan.offload == "auto" and p.memory.host_optimizer_fraction < 1:
            assert p.memory.allocated <= 0.92 * c.memory_bytes - 2 * GIB
    moe = workload_for("olmoe-tiny", seq_len=16, global_batch=8)
    r = search(moe, Cluster(num_gpus=2, calibration=CAL), Limits(offloads=("auto",), max_pp=1, top=10000))
    assert any(p.plan.ep == 2 and p.plan.offload == "auto" for p in r.ranked)


def test_offloaded_micro_batches_cost_their_accumulate_copies():
    """At ZeRO 2-3 each micro-batch after the first adds its offloaded gradient on the device (the
    host's accumulator up, the sum down, parallel/zero/reduce.py): with the same tokens, more
    micro-batches cost more offload work. ZeRO-1 sums in the GPU's gradient chunk, but every stage's
    CPU update waits for the step's last gradient: only the last micro-batch's backward, shorter as
    the micro-batches grow in number, hides it."""
    w = workload_for("gpt-13b", seq_len=2048, global_batch=8)
    c = Cluster(num_gpus=1, calibration=CAL, gpu_bytes=80 * GIB, host_bytes=400 * GIB)

    def work(zero, m):  # the offload work the backward does not hide
        p = predict(bh.Plan(dp=1, zero=zero, offload="cpu", microbatches=m, precision="bf16"), w, c)
        return p.offload

    for zero in (2, 3):
        assert work(zero, 1) < work(zero, 2) < work(zero, 8)
    assert work(1, 1) < work(1, 2) < work(1, 8)
    assert work(1, 8) - work(1, 1) < work(2, 8) - work(2, 1)  # ZeRO-2's copies on top


def test_auto_reads_the_plans_budget_and_chunk_size():
    """``Plan.offload_budget_gb`` is the budget the runtime splits at (no measurement), and
    ``Plan.chunk_mb`` the chunk size it packs at."""
    w = workload_for("gpt-13b", seq_len=2048, global_batch=8)
    c = Cluster(num_gpus=1, calibration=CAL, gpu_bytes=140 * GIB, host_bytes=400 * GIB)
    kw = dict(dp=1, zero=3, precision="bf16", activation_checkpointing=True, microbatches=8, offload="auto")
    auto = plan_memory(bh.Plan(offload_budget_gb=20, **kw), w, c)
    cpu = plan_memory(bh.Plan(**dict(kw, offload="cpu")), w, c)
    assert 0 < auto.allocated - cpu.allocated <= 20 * GIB
    shards = shard_chunks(bh.Plan(chunk_mb=1024, **kw), w)
    assert max(shards) <= 2**28 and len(shards) > len(shard_chunks(bh.Plan(**kw), w))


def test_bf16_parameters_add_the_hosts_cast_to_the_offloaded_update():
    """Under bf16 parameters the host casts each updated fp32 master to the bf16 copy the device
    reads: the update costs ``HOST_CAST_SHARE`` more (here a CPU so slow that the backward hides
    none of it, and the same copies either way)."""
    from behemoth.planner.cost import HOST_CAST_SHARE

    w = workload_for("gpt-125m", seq_len=256, global_batch=8)
    slow = dataclasses.replace(CAL, cpu_adam_params_per_s=1e6)
    c = Cluster(num_gpus=1, calibration=slow, gpu_bytes=80 * GIB, host_bytes=400 * GIB)
    kw = dict(dp=1, zero=2, offload="cpu", precision="bf16")
    fp32, bf16 = (predict(bh.Plan(**kw, param_dtype=d), w, c) for d in (None, "bf16"))
    update = fp32.memory.host_optimizer_fraction * w.num_params / 1e6
    assert bf16.offload - fp32.offload == pytest.approx(update * HOST_CAST_SHARE, rel=0.02)

"""behemoth.planner's cost model (pure): workload parameter counts against the models, the
calibration format, golden predictions from a fixed calibration, monotonicity, and the
pipeline closed forms against the schedule simulator."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

import behemoth as bh
from behemoth.planner.bubble import _closed, _simulated, peak_inflight, pipeline_time
from behemoth.planner.calibration import Calibration, load_calibration
from behemoth.planner.cluster import Cluster, axis_strides
from behemoth.planner.cost import predict
from behemoth.planner.workload import workload_for

GOLDEN_CAL = Path(__file__).parent / "data" / "planner_calibration.json"


def test_workload_parameter_counts_are_the_models():
    from behemoth.models import build_model

    for name in ("gpt-tiny", "llama-tiny", "llama-moe-tiny", "gpt-1.3b"):
        w = workload_for(name, seq_len=64, global_batch=8, vocab_size=96)
        model = build_model(name, vocab_size=96, seq_len=64, device="meta")
        assert w.num_params == sum(p.numel() for p in model.parameters()), name


def test_calibration_round_trip_and_interpolation():
    cal = load_calibration("h100")
    assert "estimated" in cal.source and "not measured" in cal.source
    again = Calibration.from_dict(json.loads(cal.to_json()))
    assert again == cal
    assert load_calibration("h200").hbm_bytes_per_s > cal.hbm_bytes_per_s
    # alpha-beta: latency + bytes / bus bandwidth, at a measured group size exactly
    lat, bw = cal.links["nvlink"][-1][1:]
    assert cal.collective_seconds("nvlink", 8, 1e9) == pytest.approx(lat + 1e9 / bw)
    assert cal.collective_seconds("nvlink", 1, 1e9) == 0.0
    # a GEMM never runs faster than the table's best rate, nor than memory allows
    best = max(r for _, r in cal.gemm)
    assert cal.gemm_seconds(8192, 8192, 8192) >= 2 * 8192**3 / best
    assert cal.gemm_seconds(1, 8192, 8192) >= 8192 * 8192 * 2 / cal.hbm_bytes_per_s
    with pytest.raises(FileNotFoundError, match="calibrate.py"):
        load_calibration("no-such-card")
    with pytest.raises(ValueError, match="links"):
        Calibration.from_dict({**json.loads(cal.to_json()), "links": {"nvlink": [[2, 1e-5, 1e11]]}})


def test_link_classes_follow_the_mesh_layout():
    c = Cluster(num_gpus=64, calibration=load_calibration(GOLDEN_CAL))
    s = axis_strides(dp=4, pp=2, tp=4, cp=2)
    # dp_cp_tp: an MoE block's gradient axis under tensor parallelism (the data axis times tp)
    assert s == {"tp": (4, 1), "cp": (2, 4), "dp": (4, 8), "dp_cp": (8, 4), "dp_cp_tp": (32, 1), "pp": (2, 32)}
    assert c.link(*s["tp"]) == "nvlink" and c.link(*s["cp"]) == "nvlink"
    assert c.link(*s["dp"]) == "ib" and c.link(*s["pp"]) == "ib"
    with pytest.raises(ValueError, match="whole nodes"):
        Cluster(num_gpus=12)


GOLDEN = [  # plan, 16 GPUs, GPT-1.3B, 32 x 2048 tokens: predicted step (s) and GPU memory (bytes)
    # (tensor-parallel rows: replicated norms, biases and position table counted per rank, as
    # tests/dist/test_planner_memory.py checks them against parallelized models; under autocast
    # every micro-batch casts the rank's weights and their gradients, compute.CAST_BYTES; 2D keeps
    # each Linear's gathered weight column for the backward, 1D and 3D the 16-bit copies autocast made
    # of the weights, per micro-batch in flight (footprint.py); a pipeline stage's receives are in
    # its micro-batch times (cost.py); 1D with sequence parallelism exposes the all-gathers its GEMMs
    # wait for and hides its re-gathers and reduce-scatters behind the columns' GEMMs; ZeRO-1 keeps
    # the reduced gradient shard beside the gradient chunks, the loss the head's weight copy; each
    # micro-batch's gradients are copied or added into the fp32 chunks (compute.accumulate_bytes); the
    # calibration's host figures make 2D, 3D and the zero-bubble pipeline of 1-sequence
    # micro-batches host-bound, planner/host.py (2D's biases and norms summed in bucket flushes; a layout's own
    # kernels counted from its layers' code, tp_block_kernels, not the calibration's kernels per call); its sustained_ratio 0.9 slows every GEMM; each block's
    # and the head's non-GEMM bytes as planner/elementwise.py counts them from the models' code, and
    # sequence parallelism's copies around its gathers and reduce-scatters on the sequence dim, and
    # the first stage's dense embedding gradient; ZeRO-3 gathers the chunks its forward ends in
    # once a micro-batch, with activation checkpointing too; the memory counts the allocator's slack as four
    # logits-sized blocks of one micro-batch, planner/reserve.py; a pipeline's memory is its stage needing
    # the most, each with its own blocks, parameters and in-flight micro-batches, footprint.plan_memory)
    (bh.Plan(precision="bf16", microbatches=2), 0.33196449704240205, 33175428608.0),
    (bh.Plan(tp=4, sequence_parallel=True, precision="bf16"), 0.13475935696014163, 21971598848.0),
    (bh.Plan(tp=4, tp_mode="2d", precision="bf16"), 0.2233520883490061, 22540688896.0),
    (bh.Plan(tp=8, tp_mode="3d", tp_overlap=2, precision="bf16"), 0.5511208767415731, 18987195904.0),
    (
        bh.Plan(pp=4, microbatches=8, schedule="interleaved", virtual_stages=2, precision="bf16", zero=1),
        0.14014350697341618,
        16363159040.0,
    ),
    (
        bh.Plan(cp=2, cp_mode="ring", zero=3, precision="bf16", offload="cpu", activation_checkpointing=True),
        0.4898021671843666,
        10198429184.0,
    ),
    (bh.Plan(tp=2, pp=2, microbatches=8, schedule="zero-bubble", precision="bf16"), 0.19702071076974265, 13492915712.0),
    (bh.Plan(tp=4, tp_mode="2d", microbatches=8, precision="bf16"), 1.7307740883490064, 11167309312.0),
]


@pytest.mark.parametrize("plan, step, memory", GOLDEN, ids=lambda x: x.describe() if isinstance(x, bh.Plan) else "")
def test_golden_predictions(plan, step, memory):
    w = workload_for("gpt-1.3b", seq_len=2048, global_batch=32)
    p = predict(plan, w, Cluster(num_gpus=16, calibration=load_calibration(GOLDEN_CAL)))
    assert p.step == pytest.approx(step, rel=1e-9)
    assert p.memory.gpu_total == pytest.approx(memory, rel=1e-9)
    assert p.tokens_per_s == pytest.approx(32 * 2048 / step, rel=1e-9)
    assert p.step >= p.bubble + p.optimizer + p.offload


def _scaled(cal: Calibration, *, links: float = 1.0, latency: float = 1.0, gemm: float = 1.0) -> Calibration:
    return dataclasses.replace(
        cal,
        links={k: tuple((p, a * latency, b * links) for p, a, b in v) for k, v in cal.links.items()},
        gemm=tuple((f, r * gemm) for f, r in cal.gemm),
    )


@pytest.mark.parametrize("plan", [g[0] for g in GOLDEN], ids=lambda p: p.describe())
def test_more_bandwidth_or_faster_compute_never_predicts_slower(plan):
    w = workload_for("gpt-1.3b", seq_len=2048, global_batch=32)
    cal = load_calibration(GOLDEN_CAL)
    base = predict(plan, w, Cluster(num_gpus=16, calibration=cal)).step
    for kw in (dict(links=2.0), dict(latency=0.5), dict(gemm=2.0), dict(links=1.1, latency=0.9, gemm=1.1)):
        faster = predict(plan, w, Cluster(num_gpus=16, calibration=_scaled(cal, **kw))).step
        assert faster <= base, (kw, faster, base)
    slower = predict(plan, w, Cluster(num_gpus=16, calibration=_scaled(cal, links=0.5))).step
    assert slower >= base


def test_fewer_bytes_never_predicts_slower():
    cal = load_calibration(GOLDEN_CAL)
    times = [cal.collective_seconds(link, p, b) for link in ("nvlink", "ib") for p in (2, 8, 64) for b in (1e6, 1e8)]
    for link in ("nvlink", "ib"):
        for p in (2, 3, 8, 64, 4096):
            seq = [cal.collective_seconds(link, p, b, calls) for b in (0, 1e3, 1e6, 1e9) for calls in (1,)]
            assert seq == sorted(seq), (link, p)
    assert all(t > 0 for t in times)
    # a shorter sequence (fewer tokens per micro-batch: fewer bytes on every axis) is not slower
    plan = bh.Plan(tp=4, cp=2, precision="bf16")
    c = Cluster(num_gpus=16, calibration=cal)
    long = predict(plan, workload_for("gpt-1.3b", seq_len=2048, global_batch=32), c)
    short = predict(plan, workload_for("gpt-1.3b", seq_len=1024, global_batch=32), c)
    # but the step's token count, all-reduced over dp alone (8 bytes, whatever the length)
    assert long.bytes["dp"] == short.bytes["dp"] == 8
    assert all(short.bytes[a] < long.bytes[a] for a in long.bytes if a != "dp")
    assert short.step <= long.step


@pytest.mark.parametrize("schedule, v", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zero-bubble", 1)])
def test_pipeline_closed_forms_are_the_simulator(schedule, v):
    for pp in (2, 4):
        for m in (pp, 2 * pp, 8):
            for ratio in (2.0, 3.0):
                assert _simulated(schedule, pp, m, v, ratio) == pytest.approx(_closed(schedule, pp, m, v, ratio))
            assert peak_inflight(schedule, pp, m, v) == pytest.approx(_simulated(schedule, pp, m, v, 2.0)[1])
    span, bubble, _ = pipeline_time("1f1b", 4, 8, 1, 1.0, 2.0, t_comm=0.1)
    assert span == pytest.approx((8 + 3) * 3.0 + 2 * 3 * 0.1) and bubble == pytest.approx(span - 24)


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_predicted_block_activations_against_the_memory_tracer(family):
    """One block's saved activations (autograd's saved-tensor hooks, as tests/dist/common.py
    counts them) against footprint.block_activation_bytes at tp = 1: fp32 within 3% at two
    shapes; bf16 autocast within 30% (CPU autocast picks attention kernels by shape, so the
    16-bit figures vary more there than on GPUs)."""
    import sys

    import torch

    sys.path.insert(0, str(Path(__file__).parents[1] / "dist"))
    from common import saved_activation_bytes

    from behemoth.models import GPT, GPTConfig, Llama, LlamaConfig
    from behemoth.planner.footprint import block_activation_bytes

    for hidden, ffn, seq in ((256, 1024, 128), (128, 512, 64)):
        cfg = dict(vocab_size=512, seq_len=seq, num_layers=1, num_heads=4, hidden=hidden, ffn_hidden=ffn)
        model = GPT(GPTConfig(**cfg)) if family == "gpt" else Llama(LlamaConfig(num_kv_heads=2, **cfg))
        block = (model.blocks if family == "gpt" else model.layers)[0]
        extra = () if family == "gpt" else (torch.arange(seq).unsqueeze(0),)
        w = workload_for(model, seq_len=seq, global_batch=2)
        for precision, tol in (("fp32", 0.03), ("bf16", 0.30)):
            x = torch.randn(2, seq, hidden)
            on = precision == "bf16"
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=on):
                got = saved_activation_bytes(lambda: block(x.clone().requires_grad_(), *extra), block)
            want = block_activation_bytes(bh.Plan(precision=precision).resolve(1), w, 2)[0]
            assert abs(want / got - 1) <= tol, (family, hidden, precision, got, want)


def test_overlap_slowdown_charges_the_hidden_collectives():
    """Calibration.overlap_slowdown: 0 hides the bucketed gradient all-reduce behind the backward
    but its last bucket, 1 hides none of it, and the exposed time grows with it in between."""
    w = workload_for("gpt-1.3b", seq_len=2048, global_batch=32)
    cal = load_calibration(GOLDEN_CAL)
    plan = bh.Plan(precision="bf16")
    runs = [
        predict(plan, w, Cluster(num_gpus=16, calibration=dataclasses.replace(cal, overlap_slowdown=s)))
        for s in (0, 0.5, 1)
    ]
    exposed = [p.exposed["dp"] for p in runs]
    assert exposed[0] < exposed[1] < exposed[2] == pytest.approx(runs[2].comm["dp"])
    assert exposed[1] == pytest.approx((exposed[0] + exposed[2]) / 2)  # linear in the slowdown
    assert runs[0].step < runs[1].step < runs[2].step
    with pytest.raises(ValueError, match="overlap_slowdown"):
        dataclasses.replace(cal, overlap_slowdown=1.5)


def test_autocast_weight_casts_are_counted_per_micro_batch():
    """Under autocast each micro-batch casts the block's fp32 weights to 16 bits (forward) and
    their gradients back (backward), 6 bytes per parameter each at HBM speed; bf16 parameter
    copies cast only the gradient; fp32 casts nothing; a recomputed forward casts again."""
    from behemoth.planner.compute import _cast_seconds, block_times
    from behemoth.planner.params import block_local_params

    w = workload_for("gpt-1.3b", seq_len=2048, global_batch=32)
    cal = load_calibration(GOLDEN_CAL)
    n = block_local_params(bh.Plan(), w)
    one = n * 6 / cal.hbm_bytes_per_s
    assert _cast_seconds(bh.Plan(precision="bf16"), n, cal) == (one, one)
    assert _cast_seconds(bh.Plan(precision="bf16", zero=3, param_dtype="bf16"), n, cal) == (0.0, one)
    assert _cast_seconds(bh.Plan(precision="fp32"), n, cal) == (0.0, 0.0)
    auto = block_times(bh.Plan(precision="bf16"), w, cal, 2)
    copies = block_times(bh.Plan(precision="bf16", zero=3, param_dtype="bf16"), w, cal, 2)
    assert auto.forward - copies.forward == pytest.approx(one) and auto.backward == pytest.approx(copies.backward)
    ckpt = block_times(bh.Plan(precision="bf16", activation_checkpointing=True), w, cal, 2)
    assert ckpt.backward == pytest.approx(auto.backward + auto.forward)


def test_attention_rate_by_sequence_length():
    """Calibration.attention_by_seq: the rate and backward ratio interpolated in log2(seq) between
    measured lengths (clamped at the ends), read back from JSON; ring attention's kernels see
    s / cp tokens, Ulysses' the whole sequence; without the table, the single figures."""
    cal = load_calibration(GOLDEN_CAL)
    table = dataclasses.replace(cal, attention_by_seq=((1024.0, 2e14, 0.6), (4096.0, 4e14, 0.8)))
    assert table.attention_rate(2048) == pytest.approx((3e14, 0.7))
    assert table.attention_rate(512) == (2e14, 0.6) and table.attention_rate(1 << 15) == (4e14, 0.8)
    assert cal.attention_rate(2048) == (cal.attention_flops_per_s, cal.attention_backward_ratio)
    assert Calibration.from_dict(json.loads(table.to_json())) == table
    from behemoth.planner.compute import block_times

    w = workload_for("gpt-1.3b", seq_len=4096, global_batch=8)
    fast = dataclasses.replace(table, attention_by_seq=((1024.0, 2e14, 0.6), (4096.0, 8e14, 0.8)))
    for mode, sees_whole in (("ulysses", True), ("ring", False)):
        plan = bh.Plan(cp=4, cp_mode=mode, precision="bf16").resolve(4)
        a, b = (block_times(plan, w, c, 1).attention_forward for c in (table, fast))
        assert (a == pytest.approx(2 * b)) is sees_whole and (a == pytest.approx(b)) is not sees_whole


def test_gradient_accumulation_bytes_per_micro_batch():
    """compute.accumulate_bytes: the first micro-batch's gradient copied into the fp32 chunk (read
    and write 4), later ones added in place (read 4 + 4, write 4), averaged over the step where the
    chunk accumulates the micro-batches (ZeRO 0-1, any stage under a pipeline); ZeRO-2/3 copy each
    and add the reduced 1/g shard (12 / g); bf16 parameters' gradients read 2 bytes, not 4."""
    from behemoth.planner.compute import accumulate_bytes

    assert accumulate_bytes(bh.Plan(zero=1).resolve(4)) == 8
    assert accumulate_bytes(bh.Plan(microbatches=4).resolve(1)) == (8 + 3 * 12) / 4
    assert accumulate_bytes(bh.Plan(pp=2, microbatches=8, zero=2).resolve(2)) == (8 + 7 * 12) / 8
    assert accumulate_bytes(bh.Plan(zero=2, microbatches=2).resolve(4)) == 8 + 12 / 4
    assert accumulate_bytes(bh.Plan(zero=3, param_dtype="bf16", precision="bf16").resolve(2)) == 6 + 12 / 2
    assert (
        accumulate_bytes(bh.Plan(zero=1, microbatches=3, param_dtype="bf16", precision="bf16").resolve(2))
        == (6 + 2 * 10) / 3
    )


def test_ulysses_copies_around_its_all_to_alls():
    """A Ulysses block adds, at HBM speed, q/k/v's concatenation and each all-to-all's contiguous
    parts and concatenated result (forward: 6 passes over q/k/v's bytes and 4 over the output's;
    backward: 4 and 4); ring and one rank add none of it."""
    from behemoth.planner.compute import block_times

    w = workload_for("gpt-1.3b", seq_len=2048, global_batch=8)
    cal = load_calibration(GOLDEN_CAL)
    h = w.shape.hidden
    uly, ring = (bh.Plan(cp=2, cp_mode=m, precision="bf16").resolve(2) for m in ("ulysses", "ring"))
    a, b = block_times(uly, w, cal, 1), block_times(ring, w, cal, 1)
    tokens = 2048 / 2
    fwd, bwd = tokens * (6 * 2 * 3 * h + 4 * 2 * h), tokens * (4 * 2 * 3 * h + 4 * 2 * h)
    ring_f = 2 * 10 * tokens * h / cal.hbm_bytes_per_s  # compute.RING_MERGE_BYTES, cp steps
    assert a.forward - (b.forward - ring_f) == pytest.approx(fwd / cal.hbm_bytes_per_s)
    ring_b = 2 * 10 * tokens * h * 3 / cal.hbm_bytes_per_s
    assert a.backward - (b.backward - ring_b) == pytest.approx(bwd / cal.hbm_bytes_per_s)


@pytest.mark.parametrize("gpus", [1, 4])
def test_offloaded_update_is_each_ranks_shard_at_the_host_rates(gpus):
    """ZeRO-1 ``offload="cpu"``: each rank moves its shard's fp32 gradients down and parameters up
    and updates the shard with the CPU AdamW at ``cpu_adam_params_per_s`` -- one rank's rate with
    every rank updating at once, so a shard a quarter the size takes a quarter the time -- the two
    copy directions beside each other, the update beside neither, and the backward hides at most
    its own time of it. The shard counted from the built model."""
    from behemoth.models import build_model

    w = workload_for("gpt-tiny", seq_len=64, global_batch=8, vocab_size=96)
    n = sum(p.numel() for p in build_model("gpt-tiny", vocab_size=96, seq_len=64, device="meta").parameters())
    adam, h2d, d2h = 1e5, 1e8, 2e8  # slow enough that the update outlasts the backward
    cal = dataclasses.replace(
        load_calibration("h200"), cpu_adam_params_per_s=adam, h2d_bytes_per_s=h2d, d2h_bytes_per_s=d2h
    )
    plan = bh.Plan(dp=gpus, zero=1, offload="cpu")
    p = predict(plan, w, Cluster(num_gpus=gpus, gpus_per_node=gpus, calibration=cal))
    shard = n / gpus
    work = shard / adam + max(shard * 4 / d2h, shard * 4 / h2d)
    backward = plan.resolve(gpus).microbatches * p.stage_times[1]
    assert p.optimizer == 0.0
    if gpus == 1:  # no gradient reduction: the whole backward hides its part
        assert p.offload == pytest.approx(work - backward)
    else:
        assert work - backward <= p.offload <= work
    assert p.step >= p.offload + p.compute

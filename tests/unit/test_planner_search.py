"""behemoth.planner.search (pure): every plan it returns is one Plan accepts, fits, and is
ranked by predicted step time; the 1,024-GPU search of a 96-layer model stays cheap."""

from __future__ import annotations

import time

import pytest

from behemoth.planner.calibration import load_calibration
from behemoth.planner.cluster import Cluster
from behemoth.planner.cost import predict
from behemoth.planner.footprint import plan_memory
from behemoth.planner.search import Limits, search, shape_refusal
from behemoth.planner.workload import Workload, workload_for
from behemoth.specs import TransformerShape

CAL = load_calibration("h100")


def test_search_ranks_legal_fitting_plans():
    w = workload_for("gpt-1.3b", seq_len=2048, global_batch=64)
    c = Cluster(num_gpus=8, calibration=CAL)
    r = search(w, c, Limits(top=50))
    assert len(r.ranked) == 50 and r.fits >= 50 and r.evaluated >= r.fits
    steps = [p.step for p in r.ranked]
    assert steps == sorted(steps)
    modes = set()
    for p in r.ranked:
        plan = p.plan
        assert plan.resolve(8) == plan
        plan.check_supported()
        assert not shape_refusal(plan, w, p.micro_batch_size)
        assert p.memory.gpu_total <= c.memory_bytes and p.fits
        again = predict(plan, w, c)
        assert again.step == pytest.approx(p.step) and again.memory == plan_memory(plan, w, c)
        modes.add(plan.tp_mode if plan.tp > 1 else "none")
    assert r.best is r.ranked[0]
    assert {"Plan.offload='cpu' needs ZeRO sharding; got zero=0. Set zero=1, 2 or 3."} <= set(r.refused)


def test_search_prunes_by_memory_and_reports_the_best_unfit():
    w = workload_for("gpt-13b", seq_len=2048, global_batch=8)
    small = Cluster(num_gpus=1, calibration=CAL, gpu_bytes=8 * 2**30, host_bytes=16 * 2**30)
    r = search(w, small)
    assert r.ranked == [] and r.unfit is not None and not r.unfit.fits
    with pytest.raises(ValueError, match="no plan fits"):
        _ = r.best
    big = Cluster(num_gpus=1, calibration=CAL, host_bytes=512 * 2**30)
    r = search(w, big)
    assert r.ranked and all(p.plan.offload in ("auto", "cpu") for p in r.ranked)  # 13B needs the host


def test_search_honours_limits():
    w = workload_for("gpt-1.3b", seq_len=2048, global_batch=64)
    c = Cluster(num_gpus=8, calibration=CAL)
    r = search(w, c, Limits(tp_modes=("2d",), zero_stages=(1,), offloads=(None,), max_cp=1, max_pp=1, top=1000))
    assert r.ranked and all(p.plan.tp in (1, 4) and p.plan.zero == 1 and p.plan.pp == p.plan.cp == 1 for p in r.ranked)
    assert {p.plan.tp_mode for p in r.ranked if p.plan.tp > 1} == {"2d"}


def test_moe_search_tries_expert_parallelism():
    w = workload_for("mixtral-4b", seq_len=1024, global_batch=32)
    r = search(w, Cluster(num_gpus=8, calibration=CAL), Limits(top=10000))
    eps = {p.plan.ep for p in r.ranked}
    assert eps >= {1, 2, 8} and all(p.plan.ep == 1 or p.bytes.get("ep", 0) > 0 for p in r.ranked)
    # experts under every tp mode: 1D (with sequence parallelism too) and the grids, their grid rows'
    # all-to-alls on the tp axes (parallel/expert/tokens.py)
    tps = [p.plan for p in r.ranked if p.plan.tp > 1]
    assert any(p.tp_mode == "1d" and p.sequence_parallel for p in tps)
    assert {"2d", "2.5d", "3d"} <= {p.tp_mode for p in tps}
    assert all(p.bytes.get("tp", 0) > 0 for p in r.ranked if p.plan.tp > 1)


GPT_175B = TransformerShape(
    hidden=12288,
    ffn_hidden=49152,
    num_layers=96,
    num_heads=96,
    num_kv_heads=96,
    vocab_size=51200,
    norm_params=2 * 12288,
    linear_bias=True,
    fused_qkv=True,
    max_positions=2048,
)


def test_1024_gpus_96_layers_is_a_bounded_search():
    """A block is costed once per shape, Plan's verdicts are cached, memory is checked before
    time: the search costs a bounded number of plans (counted, not timed, so load on the
    machine cannot fail it) and its CPU time (not wall time) stays under 10 s."""
    w = Workload(shape=GPT_175B, seq_len=2048, global_batch=1536)
    c = Cluster(num_gpus=1024, calibration=CAL)
    t0 = time.process_time()
    r = search(w, c)
    cpu = time.process_time() - t0
    # ~183k since pipelines compose with context parallelism and with ZeRO-2/3 (4 ZeRO stages, not 2)
    assert 1000 < r.evaluated <= 250000, r.evaluated
    assert r.fits > 100 and r.best.plan.dp * r.best.plan.pp * r.best.plan.tp * r.best.plan.cp == 1024
    assert r.best.mfu < 0.75
    assert cpu <= 10.0, f"search took {cpu:.1f} s of CPU"


def test_bf16_parameter_copies_only_when_asked_and_gather_half_the_bytes():
    w = workload_for("gpt-6.7b", seq_len=2048, global_batch=64)
    c = Cluster(num_gpus=8, calibration=CAL)
    assert all(p.plan.param_dtype is None for p in search(w, c, Limits(top=1000)).ranked)
    res = search(w, c, Limits(param_dtypes=(None, "bf16"), zero_stages=(3,), max_tp=1, max_pp=1, max_cp=1, top=1000))
    by = {(p.plan.param_dtype, p.plan.microbatches): p for p in res.ranked}
    for (dtype, m), p in by.items():
        if dtype == "bf16" and (None, m) in by:
            fp32 = by[(None, m)]
            # ZeRO-3 per micro-batch: fp32 gradients reduce-scattered, parameters gathered twice
            assert p.bytes["dp"] < fp32.bytes["dp"] and p.step <= fp32.step
    assert any(d == "bf16" for d, _ in by)


@pytest.mark.parametrize(
    "model, vocab, tied, params",
    [
        ("gpt-6.7b", 50304, False, 6_864_642_048),  # GPT-6.9B as benchmarks/bench_gpt.py builds it (untied head)
        ("llama-8b", 128256, False, 8_030_261_248),  # Llama-3-8B's shape
        ("mixtral-4b", 50304, False, None),
    ],
)
def test_the_proofs_large_models_have_a_dozen_layouts(model, vocab, tied, params):
    """benchmarks/planner_proof.py's workloads (8 sequences of 2048 tokens per GPU) on 2 and 4
    GPUs of 80 GiB: the model's exact size, and at least 12 ranked plans that Plan and the shape accept."""
    from behemoth.models import build_config, build_model

    config = build_config(model, vocab_size=vocab, seq_len=2048, tie_embeddings=tied)
    w = workload_for(config, seq_len=2048, global_batch=8)
    meta = build_model(model, vocab_size=vocab, seq_len=2048, tie_embeddings=tied, device="meta")
    assert w.num_params == sum(p.numel() for p in meta.parameters()) == (params or w.num_params)
    for n in (2, 4):
        w = workload_for(config, seq_len=2048, global_batch=8 * n)
        c = Cluster(num_gpus=n, gpus_per_node=n, gpu_bytes=80 * 2**30, calibration=CAL)
        r = search(w, c, Limits(top=5000))
        assert len({p.plan for p in r.ranked}) >= 12, (model, n, len(r.ranked))
        for p in r.ranked[:12]:
            p.plan.check_supported()
            assert not shape_refusal(p.plan, w, p.micro_batch_size) and p.memory.gpu_total <= c.memory_bytes

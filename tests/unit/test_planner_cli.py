"""`behemoth plan --search / --scale`, the report (table, explain, Chrome trace), auto_plan and
the scale sweep (pure; no process group)."""

from __future__ import annotations

import json

import pytest

import behemoth as bh
from behemoth import cli
from behemoth.planner.auto import auto_plan, auto_search
from behemoth.planner.calibration import load_calibration
from behemoth.planner.cluster import Cluster
from behemoth.planner.cost import predict
from behemoth.planner.report import chrome_trace, explain, table
from behemoth.planner.scale import overtakes, scale_sweep
from behemoth.planner.search import Limits
from behemoth.planner.workload import workload_for


def test_plan_search_prints_the_ranked_table_and_why_the_runner_up_lost(capsys, tmp_path):
    trace = tmp_path / "t.json"
    status = cli.main(["plan", "--search", "gpt-1.3b", "--gpus", "8", "--top", "3", "--explain", "--trace", str(trace)])
    out = capsys.readouterr().out
    assert status == 0
    assert "tokens/s" in out and "GiB/GPU" in out and "exposed s" in out and "bubble s" in out
    assert "winner:" in out and "runner-up:" in out and "estimated" in out
    rows = [ln for ln in out.splitlines() if ln.strip()[:2] in ("1 ", "2 ", "3 ")]
    assert len(rows) == 3
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(e["name"] == "forward+backward" for e in events)


def test_plan_search_errors_are_for_people(capsys):
    assert cli.main(["plan", "--search", "gpt-1.3b", "--gpus", "12", "--nodes", "5"]) == 2
    assert "--nodes" in capsys.readouterr().err
    assert cli.main(["plan", "--search", "gpt-9b", "--gpus", "8"]) == 2
    assert "unknown model name" in capsys.readouterr().err
    assert cli.main(["plan", "--search", "gpt-1.3b", "--calibration", "tpu"]) == 2
    assert "calibrate.py" in capsys.readouterr().err


def test_plan_search_tries_bf16_parameters_when_asked(capsys):
    """GPT-13B on one 80 GB GPU: fp32 parameters only by default; with ``--param-dtype any`` the table
    holds bf16-parameter plans too (``+bf16p``), and says which offload each row takes."""
    args = ["plan", "--search", "gpt-13b", "--gpus", "1", "--gpu-gb", "80", "--host-gb", "512", "--top", "40"]
    assert cli.main(args) == 0
    assert "bf16p" not in capsys.readouterr().out
    assert cli.main(args + ["--param-dtype", "any"]) == 0
    out = capsys.readouterr().out
    assert "+bf16p" in out and "+auto" in out
    assert cli.main(["plan", "--memory", "--model", "gpt-1.3b", "--param-dtype", "any"]) == 2
    assert "for --search" in capsys.readouterr().err


def test_plan_memory_still_works(capsys):
    assert cli.main(["plan", "--memory", "--model", "gpt-1.3b", "--dp", "8"]) == 0
    assert "chunks" in capsys.readouterr().out


def test_explain_names_the_terms_that_differ():
    res = auto_search("gpt-1.3b", 8, global_batch=64)
    text = explain(res)
    a, b = res.ranked[:2]
    assert f"{a.step:.4f}" in text and f"{b.step:.4f}" in text
    assert "spends more on" in text
    assert table(res).count("\n") >= 3


def test_auto_plan_is_the_search_winner_and_refuses_what_cannot_fit():
    res = auto_search("gpt-1.3b", 8, global_batch=64)
    plan = auto_plan("gpt-1.3b", 8, global_batch=64)
    assert plan.dp is None and plan.resolve(8) == res.best.plan
    with pytest.raises(ValueError, match="no plan fits 1 GPU"):
        auto_plan("gpt-22b", 1, gpu_bytes=8 * 2**30, host_bytes=8 * 2**30, global_batch=1)
    with pytest.raises(ValueError, match="world=0"):
        auto_plan("gpt-1.3b", 0)


def test_chrome_trace_phases_add_up_to_the_step():
    w = workload_for("gpt-1.3b", seq_len=2048, global_batch=32)
    p = predict(bh.Plan(pp=2, microbatches=8, tp=2, precision="bf16"), w, Cluster(num_gpus=8))
    trace = chrome_trace(p)
    step = [e for e in trace["traceEvents"] if e["tid"] == "step"]
    assert sum(e["dur"] for e in step) == pytest.approx(p.step * 1e6)
    assert {e["tid"] for e in trace["traceEvents"]} >= {"step", "comm tp", "comm pp", "pipeline rank 1"}
    # the simulator's timeline: 8 forwards and 8 backwards per rank, ending where the prediction's
    # pipeline ends (which adds 2 (pp - 1) hand-off latencies; the simulator places each one)
    ranks = [[e for e in trace["traceEvents"] if e["tid"] == f"pipeline rank {r}"] for r in (0, 1)]
    assert [len(r) for r in ranks] == [16, 16]
    end = max(e["ts"] + e["dur"] for r in ranks for e in r)
    t_f, t_b, t_comm = p.stage_times
    assert end == pytest.approx((8 * (t_f + t_b) + p.bubble) * 1e6, rel=0.01)
    assert end >= 8 * (t_f + t_b) * 1e6


def test_scale_sweep_compares_tensor_parallel_modes():
    cal = load_calibration("h100")
    w = workload_for("gpt-6.7b", seq_len=2048, global_batch=64)
    points = scale_sweep(w, Cluster(num_gpus=8, calibration=cal), (8, 64), limits=Limits(top=1))
    assert {(p.gpus, p.view) for p in points} == {(8, "pure"), (64, "pure"), (8, "best"), (64, "best")}
    pure64 = {p.mode: p.best for p in points if p.view == "pure" and p.gpus == 64}
    assert pure64["2d"].plan.tp == 64 and pure64["3d"].plan.tp == 64 and pure64["1d"] is None  # 32 heads
    best = {p.mode: p.best for p in points if p.view == "best" and p.gpus == 64}
    assert all(b is not None for b in best.values())
    ov = overtakes(points, "pure")
    assert set(ov) == {"2d", "2.5d", "3d"} and ov["2d"] is None  # 1D has no tp=64 plan to lose to
    # a faster inter-node fabric never makes the best plan slower
    fast = scale_sweep(w, Cluster(num_gpus=8, calibration=cal, inter_node_bytes_per_s=4e11), (64,), views=("best",))
    assert min(p.best.step for p in fast) <= min(b.step for b in best.values())


def test_plan_auto_reads_the_shipped_calibration_nearest_the_device():
    """``plan="auto"`` on an H200 plans with the calibration measured on H200s, elsewhere (an H100,
    no GPU) with the H100 estimate; each name is a shipped calibration."""
    from behemoth.planner.calibration import CALIBRATIONS, load_calibration, shipped_calibration_for

    assert shipped_calibration_for("NVIDIA H200") == "h200-measured-2gpu"
    assert shipped_calibration_for("NVIDIA H100 80GB HBM3") == "h100"
    assert shipped_calibration_for(None) == "h100"
    for name in ("NVIDIA H200", None):
        assert shipped_calibration_for(name) in CALIBRATIONS
        load_calibration(shipped_calibration_for(name))

"""The planner's model of generation (planner/generation.py, generation_bytes.py), without processes.

* a forward's collectives agree with the training formulas' forward halves where the forms are
  the same (1D's row all-reduces, with sequence parallelism its gathers and reduce-scatters;
  a grid Linear's SUMMA forward) and each 3D Linear's with ``linear3d_no_grad_bytes``;
* monotonicity: more HBM or link bandwidth, a lower latency, fewer rows or a shorter context
  never predicts a slower decode step; a compiled step is never slower than an eager one;
* the largest batch and context reported fit and one more does not;
* ``behemoth plan --generate`` prints a row per layout with the prediction's numbers.
"""

from __future__ import annotations

import dataclasses

import pytest

from behemoth.planner import generation as gen
from behemoth.planner.calibration import load_calibration
from behemoth.planner.cluster import Cluster
from behemoth.planner.generation_bytes import (
    forward_collectives,
    generation_memory,
    kv_cache_bytes,
    ledger_of,
)
from behemoth.planner.params import local_params
from behemoth.planner.reserve import device_reserve
from behemoth.planner.tp1d_traffic import tp1d_block_traffic
from behemoth.planner.tp2d_traffic import tp2d_linear_traffic
from behemoth.planner.workload import workload_for

LLAMA = workload_for("llama-8b", seq_len=4096, global_batch=1, vocab_size=128256)


def _wire(calls) -> float:
    return sum(c.wire for c in calls)


@pytest.mark.parametrize("sp", [False, True])
def test_1d_blocks_move_the_training_forward_bytes(sp):
    """Without autograd 1D's blocks issue the training forward's collectives (f is the identity
    forward): per block the wire bytes of ``tp1d_block_traffic``'s forward half."""
    shape = LLAMA.shape
    rows, seq, tp = 8, 64, 4
    calls = forward_collectives(shape, rows=rows, seq=seq, tp=tp, sequence_parallel=sp)
    blocks = calls[1 : 1 + (4 if sp else 2) * shape.num_layers]  # after the embedding's all-reduce
    want = shape.num_layers * tp1d_block_traffic(shape, batch=rows, seq=seq, tp=tp, sequence_parallel=sp).forward
    assert _wire(blocks) == pytest.approx(want, rel=1e-12)


def test_grid_summa_linear_moves_the_training_forward_bytes():
    """A grid Linear with many tokens runs SUMMA's forward: the wire bytes of
    ``tp2d_linear_traffic``'s forward half (the q, k, v of a prefill's first block)."""
    shape = LLAMA.shape
    rows, seq, tp = 8, 512, 4
    calls = forward_collectives(shape, rows=rows, seq=seq, tp=tp, mode="2d", diagonal=True)
    q_proj = [c for c in calls[:12] if c.op == "all_gather"][1:3]  # after the embedding's ids gather
    want = tp2d_linear_traffic(tokens=rows * seq, in_features=shape.hidden, out_features=shape.hidden, tp=tp).forward
    assert _wire(q_proj) == pytest.approx(want, rel=1e-12)
    decode = ledger_of(forward_collectives(shape, rows=rows, seq=1, tp=tp, mode="2d"))
    assert "all_to_all" in decode["tp"]["ops"]  # a decode step's Linears run weight-stationary


def test_3d_linears_move_linear3d_no_grad_bytes():
    """Each 3D Linear's calls (four weight-stationary, three in the training form) add up to
    ``linear3d_no_grad_bytes``: payload and wire, in a decode step and in a long prefill."""
    from behemoth.planner.generation_bytes import block_linears
    from behemoth.planner.tp3d_traffic import linear3d_no_grad_bytes

    shape, q = LLAMA.shape, 2
    for rows, seq in ((8, 1), (8, 2048)):
        calls = forward_collectives(shape, rows=rows, seq=seq, tp=q**3, mode="3d")[4:]  # after the embedding
        tokens = rows * seq
        for fin, fout in block_linears(shape):
            calls = calls[1:] if calls[0].op == "all_reduce" else calls  # a norm
            stationary = tokens // q**2 * (q * fin // q + fout // q**2) < fin // q * (fout // q**2)
            n = 4 if stationary else 3
            mine, calls = calls[:n], calls[n:]
            for wire in (False, True):
                want = linear3d_no_grad_bytes(tokens, fin, fout, q, element_size=2, wire=wire)
                got = sum(c.wire if wire else c.bytes for c in mine)
                assert got == pytest.approx(want, rel=1e-12), (rows, seq, fin, fout, wire)


def _predict(cal=None, *, layout=gen.Layout(4), batch=8, prompt=128, new=256, compiled=True, gpus=4):
    c = Cluster(num_gpus=gpus, calibration=cal or load_calibration("h200"))
    return gen.predict_generation(LLAMA, layout, c, batch=batch, prompt=prompt, new_tokens=new, compiled=compiled)


LAYOUTS = [gen.Layout(1), gen.Layout(4), gen.Layout(4, "2d"), gen.Layout(8, "2.5d", 2), gen.Layout(8, "3d")]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: x.describe())
def test_more_bandwidth_or_fewer_bytes_is_never_slower(layout):
    cal = load_calibration("h200")
    gpus = layout.tp
    base = _predict(cal, layout=layout, gpus=gpus)
    faster_hbm = dataclasses.replace(cal, hbm_bytes_per_s=2 * cal.hbm_bytes_per_s)
    links = {k: tuple((p, a, 2 * b) for p, a, b in v) for k, v in cal.links.items()}
    faster_links = dataclasses.replace(cal, links=links)
    lower_latency = dataclasses.replace(
        cal, links={k: tuple((p, a / 2, b) for p, a, b in v) for k, v in cal.links.items()}
    )
    for better in (faster_hbm, faster_links, lower_latency):
        p = _predict(better, layout=layout, gpus=gpus)
        assert p.decode_s <= base.decode_s and p.prefill_s <= base.prefill_s, (layout, better.name)
    assert _predict(cal, layout=layout, gpus=gpus, batch=2).decode_s <= base.decode_s
    assert _predict(cal, layout=layout, gpus=gpus, new=64).decode_s <= base.decode_s
    assert _predict(cal, layout=layout, gpus=gpus, prompt=64).prefill_s <= base.prefill_s
    assert base.decode_s <= _predict(cal, layout=layout, gpus=gpus, compiled=False).decode_s
    if layout.tp > 1:
        assert base.decode_comm_s > 0 and base.decode_calls == len(
            forward_collectives(LLAMA.shape, rows=8, seq=1, tp=layout.tp, mode=layout.mode, depth=layout.depth)
        )


def test_largest_batch_and_context_fit_and_one_more_does_not():
    cal = load_calibration("h200")
    for layout in (gen.Layout(4), gen.Layout(4, "2d")):
        p = _predict(cal, layout=layout, batch=16, prompt=128, new=1024)
        plan = layout.plan()
        weights = local_params(plan, LLAMA) * 2

        def total(b, length):
            return generation_memory(
                LLAMA.shape,
                weights=weights,
                batch=b,
                prompt=min(128, length),
                new_tokens=max(0, length - 128),
                tp=layout.tp,
                mode=layout.mode,
                dtype_bytes=2,
                reserve=lambda a: device_reserve(plan, cal, a),
            ).total

        assert total(p.max_batch, 1152) <= cal.gpu_bytes < total(p.max_batch + 1, 1152)
        assert total(16, p.max_context) <= cal.gpu_bytes < total(16, p.max_context + 1)
        assert p.kv_bytes == kv_cache_bytes(
            num_layers=32,
            rows=16 if layout.mode == "1d" else 8,
            num_kv_heads=8,
            head_dim=128,
            length=1152,
            dtype_bytes=2,
            tp=4,
            tp_mode=layout.mode,
        )


def test_1d_replicates_kv_heads_2d_splits_them():
    """At tp 16 with 8 kv heads 1D holds one (replicated) kv head of every row, 2D two heads of a
    quarter of the rows: half the KV cache per GPU."""
    one = _predict(layout=gen.Layout(16), gpus=16, batch=64)
    two = _predict(layout=gen.Layout(16, "2d"), gpus=16, batch=64)
    assert one.kv_bytes == 2 * two.kv_bytes


def test_scale_sweep_names_where_2d_overtakes():
    sweep = gen.scale_generation(
        LLAMA,
        Cluster(num_gpus=8, calibration=load_calibration("h200")),
        (4, 16, 64),
        batch=64,
        prompt=128,
        new_tokens=64,
    )
    for metric in ("decode_tokens_per_s", "prefill_tokens_per_s"):
        n = gen.overtakes(sweep, "2d", metric)
        for g in sorted(sweep):
            faster = getattr(sweep[g]["2d"], metric) > getattr(sweep[g]["1d"], metric)
            if n is None or g < n:
                assert not faster, (metric, g)
            elif g == n:
                assert faster, (metric, g)
    assert sweep[64]["1d"].replicas == 2 and sweep[64]["1d"].layout.tp == 32  # 32 heads: 1D tp 32 x dp 2
    text = gen.format_scale(sweep)
    assert "Optimus" in text and "overtakes" in text


def test_cli_plan_generate(capsys):
    from behemoth.cli import main

    argv = ["plan", "--generate", "llama-8b", "--vocab", "128256", "--gpus", "4", "--calibration", "h200"]
    assert main([*argv, "--batch", "8", "--prompt", "64", "--context", "320", "--sweep", "16"]) == 0
    out = capsys.readouterr().out
    w = workload_for("llama-8b", seq_len=320, global_batch=8, vocab_size=128256)
    c = Cluster(num_gpus=4, gpus_per_node=4, calibration=load_calibration("h200"))
    for layout in gen.generation_layouts(w.shape, 4):
        p = gen.predict_generation(w, layout, c, batch=8, prompt=64, new_tokens=256)
        row = next(line for line in out.splitlines() if line.startswith(layout.describe() + " "))
        cells = row[len(layout.describe()) :].split()
        assert float(cells[0]) == pytest.approx(p.decode_s * 1e3, abs=5e-4), row
        assert cells[3] == f"{p.decode_tokens_per_s:,.0f}" and cells[4] == f"{p.prefill_tokens_per_s:,.0f}", row
        assert cells[-2:] == [f"{p.max_batch:,}", f"{p.max_context:,}"], row
    assert "2D tp 4" in out and "1D tp 4" in out and "overtakes" in out

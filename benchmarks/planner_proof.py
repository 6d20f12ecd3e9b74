"""The planner's proof on GPUs: run layouts it ranks and print predicted vs measured step time
and memory, one JSON line per layout, then a summary line.

    torchrun --standalone --nproc-per-node 2 benchmarks/planner_proof.py --calibration cal.json
    torchrun --standalone --nproc-per-node 4 benchmarks/planner_proof.py --model gpt-1.3b --layouts 12

All ranks run the same (deterministic) search for ``--model`` on this many GPUs with
``--batch`` sequences of ``--seq`` tokens per step, take its top pick and then, greedily,
the layouts that show the most features not yet run (tp modes, sequence parallelism,
over-decomposition, cp modes, pipeline schedules, ZeRO stages, offload, checkpointing), up to
``--layouts``, and time each for ``--steps`` steps after two warm-up steps (median). Memory
measured is the peak allocated (and reserved) of the rank that used most; the prediction's runtime
reserve (``reserved_bytes``: CUDA context, NCCL buffers) is not in "allocated".

Summary: mean absolute step-time error, Spearman rank correlation, the measured gap of the
top pick to the best measured layout, mean memory error, and out-of-memory among layouts
predicted to fit. ``benchmarks/run_planner_proof.sh`` calibrates and runs 2 and 4 GPUs in
one device call.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time

import torch
import torch.distributed as dist

import behemoth as bh
from behemoth.models import build_model
from behemoth.planner.calibration import load_calibration
from behemoth.planner.cluster import Cluster
from behemoth.planner.search import Limits, search
from behemoth.planner.workload import workload_for


def features(plan) -> set:
    f = {("dp", plan.dp > 1), ("zero", plan.zero), ("offload", plan.offload), ("ckpt", plan.activation_checkpointing)}
    if plan.tp > 1:
        f |= {("tp", plan.tp_mode, plan.tp), ("sp", plan.sequence_parallel), ("ov", plan.tp_mode, plan.tp_overlap)}
    if plan.cp > 1:
        f |= {("cp", plan.cp_mode, plan.cp)}
    if plan.pp > 1:
        f |= {("pp", plan.pp, plan.schedule, plan.virtual_stages)}
    f.add(("mbs", plan.microbatches))
    return f


def pick(ranked, n: int) -> list:
    out, covered, cands = [ranked[0]], features(ranked[0].plan), list(ranked[1:])
    while cands and len(out) < n:
        best = max(cands, key=lambda p: (len(features(p.plan) - covered), -p.step))
        covered |= features(best.plan)
        out.append(best)
        cands.remove(best)
    return out


def spearman(a: list[float], b: list[float]) -> float:
    def ranks(x):
        order = sorted(range(len(x)), key=lambda i: x[i])
        r = [0.0] * len(x)
        for k, i in enumerate(order):
            r[i] = float(k)
        return r

    ra, rb = ranks(a), ranks(b)
    n = len(a)
    ma, mb = sum(ra) / n, sum(rb) / n
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    va = sum((x - ma) ** 2 for x in ra) ** 0.5
    vb = sum((y - mb) ** 2 for y in rb) ** 0.5
    return cov / (va * vb) if va and vb else float("nan")


def run_one(a, plan, dev, vocab: int) -> dict:
    model = build_model(a.model, vocab_size=vocab, seq_len=a.seq, device=dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=plan.offload is None)
    engine = bh.boost(model, opt, plan)
    g = torch.Generator(device=dev).manual_seed(engine.dp_rank)
    share = a.batch // engine.dp_size
    x = torch.randint(0, vocab, (share, a.seq + 1), device=dev, generator=g)
    batch = {"input_ids": x[:, :-1], "labels": x[:, 1:]}
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(2 + a.steps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        engine.step(batch)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    warm = sorted(times[2:])
    # the most any rank used (a pipeline's last stage holds the head and the logits)
    peak = torch.tensor([torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()], device=dev)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    out = dict(
        measured_step_s=warm[len(warm) // 2],
        measured_alloc_gib=peak[0].item() / 2**30,
        measured_reserved_gib=peak[1].item() / 2**30,
    )
    del engine, opt, model, batch, x
    gc.collect()
    torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gpt-1.3b")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=None, help="sequences per step (default 8 per GPU)")
    ap.add_argument("--layouts", type=int, default=12)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--calibration", default="h100", help="h100, h200 or a JSON from calibrate.py")
    ap.add_argument("--vocab", type=int, default=50304)
    a = ap.parse_args()
    bh.init()
    world, rank = dist.get_world_size(), dist.get_rank()
    dev = bh.distributed.device_for_rank()
    a.batch = a.batch or 8 * world
    cal = load_calibration(a.calibration)
    gpu = float(torch.cuda.get_device_properties(dev).total_memory)
    cluster = Cluster(num_gpus=world, gpus_per_node=world, gpu_bytes=gpu, calibration=cal)
    w = workload_for(a.model, seq_len=a.seq, global_batch=a.batch, vocab_size=a.vocab)
    res = search(w, cluster, Limits(top=5000))
    chosen = pick(res.ranked, a.layouts)
    rows = []
    for p in chosen:
        row = dict(
            gpus=world,
            model=a.model,
            card=torch.cuda.get_device_name(dev),
            calibration=cal.name,
            plan=p.plan.describe(),
            predicted_rank=res.ranked.index(p) + 1,
            predicted_step_s=round(p.step, 4),
            predicted_gib=round(p.memory.gpu_total / 2**30, 2),
            predicted_alloc_gib=round((p.memory.gpu_total - p.memory.reserved) / 2**30, 2),
        )
        try:
            row.update({k: round(v, 4) for k, v in run_one(a, p.plan, dev, a.vocab).items()})
            row["oom"] = False
            row["step_err_pct"] = round(100 * (row["predicted_step_s"] / row["measured_step_s"] - 1), 1)
            row["mem_err_pct"] = round(100 * (row["predicted_alloc_gib"] / row["measured_alloc_gib"] - 1), 1)
        except torch.cuda.OutOfMemoryError as e:  # predicted to fit: a failure of the model, reported
            row.update(oom=True, error=str(e).splitlines()[0])
            gc.collect()
            torch.cuda.empty_cache()
        except (ValueError, NotImplementedError) as e:  # refused by bh.boost on every rank: a search bug
            row.update(oom=False, refused=str(e).splitlines()[0])
            gc.collect()
            torch.cuda.empty_cache()
        rows.append(row)
        if rank == 0:
            print(json.dumps(row), flush=True)
        dist.barrier()
    ok = [r for r in rows if not r["oom"] and "refused" not in r]
    if rank == 0 and ok:
        pred = [r["predicted_step_s"] for r in ok]
        meas = [r["measured_step_s"] for r in ok]
        best = min(meas)
        top = rows[0]["measured_step_s"] if "measured_step_s" in rows[0] else float("nan")
        print(
            json.dumps(
                dict(
                    summary=True,
                    gpus=world,
                    model=a.model,
                    layouts=len(rows),
                    mean_abs_step_err_pct=round(sum(abs(r["step_err_pct"]) for r in ok) / len(ok), 1),
                    spearman=round(spearman(pred, meas), 3),
                    top_pick_vs_best_measured_pct=round(100 * (top / best - 1), 1),
                    mean_abs_mem_err_pct=round(sum(abs(r["mem_err_pct"]) for r in ok) / len(ok), 1),
                    oom_predicted_to_fit=sum(r["oom"] for r in rows),
                    refused_by_boost=sum("refused" in r for r in rows),
                )
            ),
            flush=True,
        )
    dist.destroy_process_group()
    sys.exit(0)


if __name__ == "__main__":
    main()

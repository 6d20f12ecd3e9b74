"""The planner's proof on GPUs: run layouts it ranks and print predicted vs measured step time
and memory, one JSON line per layout, then a summary line.

    torchrun --standalone --nproc-per-node 2 benchmarks/planner_proof.py --calibration cal.json
    torchrun --standalone --nproc-per-node 4 benchmarks/planner_proof.py --model gpt-1.3b --layouts 12
    torchrun --standalone --nproc-per-node 4 benchmarks/planner_proof.py --model gpt-6.7b --untied  # GPT-6.9B
    torchrun --standalone --nproc-per-node 4 benchmarks/planner_proof.py --model llama-8b   # Llama-3-8B's shape
    torchrun --standalone --nproc-per-node 2 benchmarks/planner_proof.py --model mixtral-4b  # experts (ep)
    torchrun --standalone --nproc-per-node 2 benchmarks/planner_proof.py --model gpt-tiny --seq 64 \
        --steps 1 --gpu-gb 80 --budget-s 120                  # no GPU: a smoke run on gloo

All ranks run the same (deterministic) search for ``--model`` on this many GPUs with
``--batch`` sequences of ``--seq`` tokens per step, take its top pick and then, greedily,
the layouts that show the most features not yet run (tp modes, sequence parallelism,
over-decomposition, cp modes, pipeline schedules, ZeRO stages, offload, checkpointing), up to
``--layouts``, and time each for ``--steps`` steps after two warm-up steps (median). Memory
measured is the peak allocated (and reserved) of the rank that used most; the prediction's runtime
reserve (``reserved_bytes``: CUDA context, NCCL buffers) is not in "allocated".

Each layout builds the serial model on its GPU (fp32: 27.5 GB for GPT-6.9B, 32.1 GB for the
Llama-8B shape, within an 80 GB card) and ``bh.boost`` shards it there, as ``bench_gpt.py``
does; memory is measured from after ``boost``. ``--budget-s`` starts no layout whose predicted
run (2 + ``--steps`` steps at twice its predicted step time, plus ``SETUP_S``) would end past that
many seconds (all ranks agree), so one device call ends with its summary line.

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
from behemoth.models import build_config, build_model
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


DEFAULT_VOCAB = {"llama-8b": 128256}  # Llama 3's tokenizer; the other presets use GPT-2's, padded to 50304


SHRUNK_SEQ, SHRUNK_VOCAB = 64, 512


def model_overrides(a) -> dict:
    return {} if a.untied is None else {"tie_embeddings": not a.untied}


def shrunk_overrides(config) -> dict:
    """``--shrink``: the family and its head counts (what the layouts' divisibility rules read),
    8-wide heads, 8 blocks (pipelines of up to 4 ranks x 2 virtual stages), a small MLP."""
    hidden = 8 * config.num_heads
    out = dict(num_layers=8, hidden=hidden, ffn_hidden=2 * hidden)
    if getattr(config, "num_experts", 0):
        out["expert_ffn_hidden"] = hidden
    return out


def run_one(a, plan, dev, vocab: int) -> dict:
    cuda = dev.type == "cuda"
    kw = model_overrides(a)
    if a.shrink:
        kw.update(shrunk_overrides(build_config(a.model, vocab_size=vocab, seq_len=a.seq)))
    model = build_model(a.model, vocab_size=vocab, seq_len=a.seq, device=dev, **kw)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda and plan.offload is None)
    engine = bh.boost(model, opt, plan)
    g = torch.Generator(device=dev).manual_seed(engine.dp_rank)
    share = a.batch // engine.dp_size
    x = torch.randint(0, vocab, (share, a.seq + 1), device=dev, generator=g)
    batch = {"input_ids": x[:, :-1], "labels": x[:, 1:]}
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(2 + a.steps):
        sync()
        t = time.perf_counter()
        engine.step(batch)
        sync()
        times.append(time.perf_counter() - t)
    warm = sorted(times[2:])
    # the most any rank used (a pipeline's last stage holds the head and the logits); no figure on CPU
    used = [torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()] if cuda else [float("nan")] * 2
    peak = torch.tensor(used, device=dev, dtype=torch.float64)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    out = dict(
        measured_step_s=warm[len(warm) // 2],
        measured_alloc_gib=peak[0].item() / 2**30,
        measured_reserved_gib=peak[1].item() / 2**30,
    )
    del engine, opt, model, batch, x
    free_memory()
    return out


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


SETUP_S = 20.0
"""Seconds to allow a layout for building the model, ``bh.boost`` and its process groups."""


def seconds_left(start: float, budget: float | None, dev) -> float:
    """``budget`` less what the slowest rank has spent (every rank gets the same answer)."""
    if budget is None:
        return float("inf")
    spent = torch.tensor([time.perf_counter() - start], device=dev, dtype=torch.float64)
    dist.all_reduce(spent, op=dist.ReduceOp.MAX)
    return budget - spent.item()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--model",
        default="gpt-1.3b",
        help="a preset of behemoth.models: gpt-1.3b, gpt-6.7b (with --untied: GPT-6.9B), llama-8b, mixtral-4b, ...",
    )
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=None, help="sequences per step (default 8 per GPU)")
    ap.add_argument("--layouts", type=int, default=12)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--calibration", default="h100", help="h100, h200 or a JSON from calibrate.py")
    ap.add_argument("--vocab", type=int, default=None, help="default: 128256 for llama-8b, else 50304")
    ap.add_argument(
        "--untied",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the head its own table (default: the preset's)",
    )
    ap.add_argument(
        "--no-offload", action="store_true", help="leave offload out of the search (CPU Adam steps are slow)"
    )
    ap.add_argument("--budget-s", type=float, default=None, help="start no layout after this many seconds")
    ap.add_argument("--gpu-gb", type=float, default=None, help="memory per device to plan for (default: the GPU's)")
    ap.add_argument(
        "--shrink",
        action="store_true",
        help=f"search for --model, but run each layout on a small model of its family ({SHRUNK_SEQ}-token "
        f"sequences, vocabulary {SHRUNK_VOCAB}): a CPU check that bh.boost accepts and steps every layout",
    )
    a = ap.parse_args()
    bh.init()
    world, rank = dist.get_world_size(), dist.get_rank()
    dev = bh.distributed.device_for_rank()
    start = time.perf_counter()
    a.batch = a.batch or 8 * world
    vocab = a.vocab or DEFAULT_VOCAB.get(a.model, 50304)
    cal = load_calibration(a.calibration)
    if a.gpu_gb is None and dev.type != "cuda":
        raise SystemExit("planner_proof: no GPU here; pass --gpu-gb (the memory to plan for) for a smoke run on CPU")
    gpu = a.gpu_gb * 2**30 if a.gpu_gb else float(torch.cuda.get_device_properties(dev).total_memory)
    cluster = Cluster(num_gpus=world, gpus_per_node=world, gpu_bytes=gpu, calibration=cal)
    config = build_config(a.model, vocab_size=vocab, seq_len=a.seq, **model_overrides(a))
    w = workload_for(config, seq_len=a.seq, global_batch=a.batch)
    limits = Limits(top=5000, offloads=(None,) if a.no_offload else Limits().offloads)
    res = search(w, cluster, limits)
    chosen = pick(res.ranked, 2 * a.layouts)  # the first --layouts, and stand-ins for those left out for time
    card = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    if rank == 0:
        print(
            json.dumps(
                dict(search=True, gpus=world, model=a.model, params=w.num_params, fits=res.fits, chosen=len(chosen))
            ),
            flush=True,
        )
    rows = []
    skipped = 0
    for p in chosen:
        if len(rows) == a.layouts:
            break
        # a layout whose predicted run (with room for a 2x misprediction) would end past the budget
        # is left out (the same on every rank: the prediction is deterministic), a cheaper one may fit
        if SETUP_S + 2 * (2 + a.steps) * p.step > seconds_left(start, a.budget_s, dev):
            skipped += 1
            continue
        row = dict(
            gpus=world,
            model=a.model,
            card=card,
            calibration=cal.name,
            plan=p.plan.describe(),
            predicted_rank=res.ranked.index(p) + 1,
            predicted_step_s=round(p.step, 4),
            predicted_gib=round(p.memory.gpu_total / 2**30, 2),
            predicted_alloc_gib=round((p.memory.gpu_total - p.memory.reserved) / 2**30, 2),
        )
        try:
            if a.shrink:
                small = argparse.Namespace(**{**vars(a), "seq": SHRUNK_SEQ})
                row.update(
                    shrunk=True, **{k: round(v, 4) for k, v in run_one(small, p.plan, dev, SHRUNK_VOCAB).items()}
                )
            else:
                row.update({k: round(v, 4) for k, v in run_one(a, p.plan, dev, vocab).items()})
            row["oom"] = False
            row["step_err_pct"] = round(100 * (row["predicted_step_s"] / row["measured_step_s"] - 1), 1)
            row["mem_err_pct"] = round(100 * (row["predicted_alloc_gib"] / row["measured_alloc_gib"] - 1), 1)
        except torch.cuda.OutOfMemoryError as e:  # predicted to fit: a failure of the model, reported
            row.update(oom=True, error=str(e).splitlines()[0])
            free_memory()
        except (ValueError, NotImplementedError) as e:  # refused by bh.boost on every rank: a search bug
            row.update(oom=False, refused=str(e).splitlines()[0])
            free_memory()
        rows.append(row)
        if rank == 0:
            print(json.dumps(row), flush=True)
        dist.barrier()
    ok = [r for r in rows if not r["oom"] and "refused" not in r]
    if rank == 0 and ok:
        pred = [r["predicted_step_s"] for r in ok]
        meas = [r["measured_step_s"] for r in ok]
        best = min(meas)
        first = [r for r in rows if r["predicted_rank"] == 1]
        top = first[0].get("measured_step_s", float("nan")) if first else float("nan")
        print(
            json.dumps(
                dict(
                    summary=True,
                    gpus=world,
                    model=a.model,
                    layouts=len(rows),
                    chosen=len(chosen),
                    skipped_for_time=skipped,
                    seconds=round(time.perf_counter() - start, 1),
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

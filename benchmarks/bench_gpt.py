"""GPU benchmark of behemoth's data parallelism: GPT (behemoth's model) trained with bf16
autocast, fp32 master weights and fused AdamW, one RESULT json line per run in the same
format as ``peer_baseline.py`` (the stock-PyTorch baseline run in the same call).

    torchrun --nproc-per-node 2 benchmarks/bench_gpt.py --size gpt-1.3b --mbs 8

MFU uses the PaLM convention (6*N + 12*L*h*s FLOPs per token) against the card's dense
bf16 peak (989 TFLOP/s for H100/H200 SXM).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import sys
import time

import torch

import behemoth as bh
from behemoth.models import build_model


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--size", default="gpt-1.3b")
    p.add_argument("--mbs", type=int, default=8, help="sequences per data-parallel rank per step")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--ckpt", action="store_true", help="activation checkpointing")
    p.add_argument("--compile", action="store_true", help="torch.compile each block (Plan.compile)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (1D); dp = world / tp")
    p.add_argument("--tp-mode", default="1d", choices=["1d", "2d", "2.5d", "3d"], help="Plan.tp_mode")
    p.add_argument("--tp-depth", type=int, default=1, help="Plan.tp_depth (2.5d)")
    p.add_argument("--tp-overlap", type=int, default=1, help="Plan.tp_overlap (1d: row GEMMs in pieces; 3d)")
    p.add_argument("--sp", action="store_true", help="Megatron sequence parallelism inside 1D tp")
    p.add_argument(
        "--probe-max-mbs",
        action="store_true",
        help="instead of timing, find the largest mbs (from --mbs upwards) that trains 2 steps",
    )
    p.add_argument(
        "--probe-step",
        type=int,
        default=0,
        help="with --probe-max-mbs: grow mbs by this many (default: by half, rounded to even)",
    )
    p.add_argument("--bucket-mb", type=float, default=100.0)
    p.add_argument("--peak", type=float, default=989e12)
    p.add_argument(
        "--tied",
        action="store_true",
        help="tie input/output embeddings (off by default: peer_baseline.py's model is untied)",
    )
    p.add_argument(
        "--ledger",
        action="store_true",
        help="after timing: one more step's wire bytes per axis (the comm ledger) beside "
        "planner/axis_traffic.py's prediction for this rank",
    )
    p.add_argument("--zero", type=int, default=0, help="ZeRO stage (Plan.zero)")
    p.add_argument("--offload", default=None, choices=[None, "cpu", "auto"], help="Plan.offload")
    p.add_argument("--chunk-mb", type=float, default=None, help="Plan.chunk_mb (default: searched)")
    p.add_argument("--param-dtype", default=None, choices=[None, "bf16"], help="Plan.param_dtype (ZeRO-3)")
    p.add_argument("--budget-gb", type=float, default=None, help="Plan.offload_budget_gb (default: measured)")
    p.add_argument(
        "--profile",
        type=int,
        default=0,
        help="after timing, profile this many steps and print rank 0's kernel summary (where time goes)",
    )
    p.add_argument(
        "--trace",
        default=None,
        help="with --profile: write rank 0's Chrome trace there, gzipped (open in Perfetto)",
    )
    p.add_argument(
        "--host-init",
        action="store_true",
        help="build the model on the host (ZeRO-3 moves it to the GPU chunk by chunk)",
    )
    p.add_argument(
        "--mem-snapshot",
        default=None,
        help="record CUDA allocations; on an exception, rank 0 dumps a snapshot there (torch.cuda.memory)",
    )
    p.add_argument(
        "--bind-cpus",
        action="store_true",
        help="pin each process to its own equal slice of the cores this process may use, by local rank "
        "(host-bound layouts: is the run-to-run swing the scheduler moving the issuing threads?)",
    )
    p.add_argument(
        "--inductor",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="with --compile: set torch._inductor.config.KEY (a Python literal), e.g. "
        "reorder_for_compute_comm_overlap=True; repeatable",
    )
    a = p.parse_args()
    for item in a.inductor:
        key, _, value = item.partition("=")
        import torch._inductor.config as inductor_config

        setattr(inductor_config, key, ast.literal_eval(value))
    if a.mem_snapshot:
        torch.cuda.memory._record_memory_history(max_entries=50000)
        try:
            return main_run(a)
        except Exception:
            if int(os.environ.get("RANK", 0)) == 0:
                torch.cuda.memory._dump_snapshot(a.mem_snapshot)
            raise
    return main_run(a)


def bind_cpus() -> list[int]:
    """Pin this process (and the threads it starts later) to local rank r's slice of the cores it
    may use: slices of equal size, in core order. Returns the cores."""
    cores = sorted(os.sched_getaffinity(0))
    rank, size = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    per = max(1, len(cores) // size)
    mine = cores[rank * per : (rank + 1) * per] or cores
    os.sched_setaffinity(0, mine)
    return mine


def main_run(a) -> None:
    cores = bind_cpus() if a.bind_cpus else None
    bh.init()
    world = torch.distributed.get_world_size()
    rank = torch.distributed.get_rank()
    dev = bh.distributed.device_for_rank()
    t0 = time.perf_counter()
    model = build_model(
        a.size, vocab_size=a.vocab, seq_len=a.seq, device="cpu" if a.host_init else dev, tie_embeddings=a.tied
    )
    # fused on the GPU, as the peers' (also under ZeRO without offload: its masters are flat GPU shards)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=dev.type == "cuda" and a.offload is None)
    nparam, flops_per_tok = model.num_params(), model.flops_per_token(a.seq)  # serial counts, before sharding
    plan = bh.Plan(
        dp=world // a.tp,
        tp=a.tp,
        tp_mode=a.tp_mode,
        tp_depth=a.tp_depth,
        tp_overlap=a.tp_overlap,
        sequence_parallel=a.sp,
        precision="bf16",
        activation_checkpointing=a.ckpt,
        bucket_mb=a.bucket_mb,
        compile=a.compile,
        zero=a.zero,
        offload=a.offload,
        chunk_mb=a.chunk_mb,
        offload_budget_gb=a.budget_gb,
        param_dtype=a.param_dtype,
    )
    t1 = time.perf_counter()
    engine = bh.boost(model, opt, plan)
    if rank == 0:
        print(
            f"setup: model built in {t1 - t0:.1f} s, boost in {time.perf_counter() - t1:.1f} s",
            file=sys.stderr,
            flush=True,
        )
    zero = _zero_of(engine)
    if zero is not None and rank == 0 and dev.type == "cuda":
        print(f"after boost: {torch.cuda.memory_allocated() / 2**30:.2f} GiB allocated", flush=True)
        print(_placement(zero).explain(), flush=True)
    if a.probe_max_mbs:
        return probe_max_mbs(engine, a, dev, rank)
    g = torch.Generator(device=dev).manual_seed(engine.dp_rank)  # tp ranks share their dp rank's batch
    x = torch.randint(0, a.vocab, (a.mbs, a.seq + 1), device=dev, generator=g)
    batch = {"input_ids": x[:, :-1], "labels": x[:, 1:]}
    times = []
    # (hasattr: the same script also times older checkouts of src/ in A/B runs; see RESULTS.md)
    hu = zero.host_update if zero is not None and hasattr(zero, "host_update") else None
    cpu_log = []  # (worker busy, step() waited) after each step, in all
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for _ in range(a.steps):
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        loss = engine.step(batch)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
        if hu is not None and hasattr(hu, "busy_s"):
            cpu_log.append((hu.busy_s, hu.waited_s))
        if rank == 0 and dev.type == "cuda":
            cpu = (
                f", CPU update worker busy {cpu_log[-1][0]:.2f} s, step() waited {cpu_log[-1][1]:.2f} s (in all)"
                if cpu_log
                else ""
            )
            print(
                f"step {len(times)}: {times[-1]:.3f} s, peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB{cpu}",
                file=sys.stderr,
                flush=True,
            )
            if len(times) == 1 and a.offload == "auto":  # the placement the warm-up step measured for
                held = {k: round(v / 2**30, 2) for k, v in engine.memory_report()["cuda"].items()}
                other = getattr(_placement(zero), "warmup_other_peak", None)
                other = "not measured" if other is None else f"{other / 2**30:.2f} GiB"
                print(
                    f"after step 1: {torch.cuda.memory_allocated() / 2**30:.2f} GiB allocated, model data on the "
                    f"GPU {held}, warm-up peak of other data {other}\n{_placement(zero).explain()}",
                    file=sys.stderr,
                    flush=True,
                )
    if a.profile and dev.type == "cuda":
        profile_steps(engine, batch, a.profile, rank, a.trace)
    ledger = ledger_vs_planner(engine, model, batch, a) if a.ledger else None
    warm = times[3:] or times
    dt = sorted(warm)[len(warm) // 2]
    tok_per_gpu = a.mbs * a.seq / dt / a.tp  # mbs sequences per dp rank, shared by its tp ranks
    mem = torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else 0.0
    if rank == 0:
        mode = _mode(a)
        r = dict(
            size=a.size,
            mode=mode,
            gpus=world,
            mbs=a.mbs,
            seq=a.seq,
            ckpt=a.ckpt,
            compile=a.compile,
            tp_overlap=a.tp_overlap,
            bucket_mb=a.bucket_mb,
            params_b=round(nparam / 1e9, 3),
            step_s=round(dt, 4),
            tok_s_gpu=round(tok_per_gpu),
            tflops_gpu=round(tok_per_gpu * flops_per_tok / 1e12, 1),
            mfu=round(tok_per_gpu * flops_per_tok / a.peak, 4),
            peak_mem_gib=round(mem, 1),
            loss=round(loss, 3),
            comm={k: v["seconds"] for k, v in engine.comm_stats().items()},
        )
        if ledger is not None:
            r["ledger_bytes"], r["planner_bytes"] = ledger
        if cores is not None:
            r["cores"] = f"{cores[0]}-{cores[-1]}" if cores == list(range(cores[0], cores[-1] + 1)) else len(cores)
        if zero is not None:
            gib = lambda d: {k: round(v / 2**30, 2) for k, v in d.items()}  # noqa: E731
            r["memory_gib"] = {dev_type: gib(d) for dev_type, d in engine.memory_report().items()}
            r["chunks"] = zero.layout.num_chunks
            r["padding_pct"] = round(100 * zero.layout.padding_fraction, 2)
            if hu.count and len(cpu_log) > 3:  # CPU updates during the backward: the worker's time and
                per = [(b1 - b0, w1 - w0) for (b0, w0), (b1, w1) in zip(cpu_log[2:], cpu_log[3:])]
                r["cpu_update_s"] = round(sorted(b for b, _ in per)[len(per) // 2], 3)  # step()'s wait, per
                r["cpu_wait_s"] = round(sorted(w for _, w in per)[len(per) // 2], 3)  # warm step (median)
            print(_placement(zero).explain(), flush=True)
        print("RESULT " + json.dumps(r), flush=True)
    torch.distributed.destroy_process_group()


def ledger_vs_planner(engine, model, batch, a) -> tuple[dict, dict]:
    """One step's wire bytes per axis as the comm ledger booked them on this rank (the tp axes
    summed), and what ``step_traffic`` predicts for the same rank, plan and global batch. The step
    also sums the gradient norm's square over the tensor-parallel group (one fp32 all-reduce:
    ``2 (tp - 1) / tp * 4`` bytes) that ``step_traffic``, a forward and backward's bytes, leaves out."""
    from behemoth.planner.axis_traffic import step_traffic
    from behemoth.planner.workload import workload_for

    engine.reset_comm_stats()
    engine.step(batch)
    got: dict[str, int] = {}
    for axis, st in engine.comm_stats().items():
        key = "tp" if axis.startswith("tp") else axis
        got[key] = got.get(key, 0) + int(st["wire_bytes"])
    plan, mesh = engine.plan, engine.mesh
    w = workload_for(model, seq_len=a.seq, global_batch=a.mbs * plan.dp)
    diagonal = plan.tp_mode in ("2d", "2.5d") and plan.tp > 1 and mesh.coord("tp_row") == mesh.coord("tp_col")
    want = {k: int(v) for k, v in step_traffic(plan, w, diagonal=diagonal).items()}
    return got, want


def profile_steps(engine, batch, steps: int, rank: int, trace: str | None = None) -> None:
    """``steps`` steps under torch.profiler; rank 0 prints per step: wall time, the summed
    time of NCCL kernels and of all other kernels (compute; kernels of one stream do not
    overlap, so compute / wall is the compute stream's busy share), the top kernels, and the
    timeline: each stream's busy time, the time no kernel runs on any stream, and how long the
    host took to issue the step's work (``engine.step`` returning before the device finishes;
    host issue close to wall means the step is bound by the host, not the GPU)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    issue = 0.0
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        for _ in range(steps):
            t0 = time.perf_counter()
            engine.step(batch)
            issue += time.perf_counter() - t0
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t) / steps
    if rank != 0:
        return
    timeline_summary(prof, steps, wall, issue / steps, trace)

    # Annotations on the device timeline ("Optimizer.step#...", ProcessGroupNCCL's "nccl:all_reduce")
    # span kernels that are counted themselves: left out.
    def kernel(e):
        return (
            e.device_type == torch.autograd.DeviceType.CUDA
            and not getattr(e, "is_user_annotation", False)
            and "#" not in e.key
            and not e.key.startswith("nccl:")
        )

    ev = [e for e in prof.key_averages() if kernel(e)]
    us = lambda e: getattr(e, "self_device_time_total", None) or e.self_cuda_time_total  # noqa: E731
    nccl = sum(us(e) for e in ev if "nccl" in e.key.lower()) / steps / 1e6
    other = sum(us(e) for e in ev if "nccl" not in e.key.lower()) / steps / 1e6
    print(
        f"PROFILE per step: wall {wall:.4f} s, compute kernels {other:.4f} s ({other / wall:.1%} of wall), "
        f"nccl kernels {nccl:.4f} s",
        flush=True,
    )
    kinds = {"gemm": ("gemm", "nvjet", "cutlass", "xmma"), "attention": ("flash", "attention", "fmha")}
    split = dict.fromkeys(list(kinds) + ["other"], 0.0)
    for e in ev:
        if "nccl" not in e.key.lower():
            kind = next((k for k, words in kinds.items() if any(w in e.key.lower() for w in words)), "other")
            split[kind] += us(e) / steps / 1e6
    print("PROFILE compute by kind: " + ", ".join(f"{k} {v:.4f} s" for k, v in split.items()), flush=True)
    for e in sorted(ev, key=us, reverse=True)[:14]:
        print(f"PROFILE {us(e) / steps / 1e3:9.2f} ms/step  x{e.count // steps:<5d} {e.key[:90]}", flush=True)


def timeline_summary(prof, steps: int, wall: float, issue: float, trace: str | None) -> None:
    """Per-stream busy time (union of kernel intervals) and the GPU's idle time, read from the
    profiler's Chrome trace; the trace itself is kept (gzipped) when ``trace`` names a file."""
    import gzip
    import tempfile

    from step_profile import busy  # benchmarks/ is the script's folder

    with tempfile.TemporaryDirectory() as tmp:
        raw = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(raw)
        with open(raw) as f:
            events = json.load(f)["traceEvents"]
        if trace:
            with open(raw, "rb") as f, gzip.open(trace, "wb") as g:
                g.write(f.read())
    kernels = [e for e in events if e.get("cat") == "kernel" and "dur" in e]

    by_stream: dict = {}
    for e in kernels:
        by_stream.setdefault(e.get("args", {}).get("stream"), []).append((e["ts"], e["ts"] + e["dur"]))
    spans = [s for v in by_stream.values() for s in v]
    if not spans:
        return
    span = max(b for _, b in spans) - min(a for a, _ in spans)
    any_busy = busy(spans)
    print(
        f"TIMELINE per step: wall {wall * 1e3:.1f} ms, host issue {issue * 1e3:.1f} ms, kernels span "
        f"{span / steps / 1e3:.1f} ms, some stream busy {any_busy / steps / 1e3:.1f} ms, all idle "
        f"{(span - any_busy) / steps / 1e3:.1f} ms, {len(kernels) // steps} kernels",
        flush=True,
    )
    for stream, v in sorted(by_stream.items(), key=lambda kv: -busy(kv[1])):
        print(f"TIMELINE stream {stream}: busy {busy(v) / steps / 1e3:.1f} ms, {len(v) // steps} kernels", flush=True)


def _zero_of(engine):
    """The ZeRO gradient sync of ``engine``, None without ZeRO (older source trees timed in A/B runs
    call it ``engine.zero``)."""
    if not engine.plan.zero:
        return None
    return getattr(engine, "grad_sync", None) or engine.zero


def _placement(zero):
    """What offload='auto' chose (older source trees keep it in the ZeRO optimizer itself)."""
    return getattr(zero, "placement", zero)


def _mode(a) -> str:
    mode = "behemoth-dp" if a.tp == 1 else f"behemoth-tp{a.tp}-{a.tp_mode}{'-sp' if a.sp else ''}"
    if a.zero:
        mode += (
            f"-zero{a.zero}" + (f"-{a.offload}" if a.offload else "") + (f"-{a.param_dtype}" if a.param_dtype else "")
        )
    return mode


def probe_max_mbs(engine, a, dev, rank) -> None:
    """Try mbs = a.mbs, then larger, 2 steps each; the largest that fits on every rank wins.
    (Tensor-parallel ranks hold equal shapes, so they run out of memory at the same op.)"""
    best, mbs = 0, a.mbs
    while mbs <= 256:
        ok = 1.0
        try:
            x = torch.randint(0, a.vocab, (mbs, a.seq + 1), device=dev)
            for _ in range(2):
                engine.step({"input_ids": x[:, :-1], "labels": x[:, 1:]})
            del x
        except torch.cuda.OutOfMemoryError:
            ok = 0.0
        torch.cuda.empty_cache()
        flag = torch.tensor([ok], device=dev)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
        if flag.item() == 0:
            break
        best = mbs
        if a.probe_step:
            mbs += a.probe_step
        else:
            mbs = mbs + max(1, mbs // 2)  # 8, 12, 18, 28, ... (even from 2 up: 2D/2.5D/3D split the batch)
            mbs += mbs % 2 if mbs > 1 else 0
    if rank == 0:
        mode = _mode(a)
        print(
            "RESULT "
            + json.dumps(
                dict(
                    size=a.size,
                    mode=mode,
                    seq=a.seq,
                    max_mbs_per_dp_rank=best,
                    first_failure=mbs if best < mbs else None,
                )
            ),
            flush=True,
        )
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown (torch's CPU runtime can abort there; see distributed.py)

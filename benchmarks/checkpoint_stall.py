"""What checkpoints cost a GPU run: the training stall of synchronous and background saves, and
the time from ``kill -9`` of one rank to the next completed step after the automatic restart.

One command, no launcher needed (it starts its own ``torchrun`` and ``behemoth run``), about 5
minutes on 2 GPUs::

    python3 benchmarks/checkpoint_stall.py                 # both parts, 2 GPUs
    python3 benchmarks/checkpoint_stall.py --part stall    # or --part restart
    python3 benchmarks/checkpoint_stall.py --size gpt-tiny --seq 64 --rows 4 --mbs 2 --steps 4 --every 2 \
        --restart-every 2                                  # a smoke test on CPU (gloo)

**stall** (``torchrun --nproc-per-node 2`` of this script): GPT-1.3B, seq 2048, bf16 autocast with
fp32 AdamW state, dp = 2, ``--rows`` sequences per rank per step in micro-batches of ``--mbs``.
After 3 warm-up steps, three phases of ``--steps`` steps each: no checkpoint, a synchronous
``engine.save`` every ``--every`` steps (the plain path of a run with background saves off), and
``engine.save(blocking=False)`` every ``--every`` steps. ``--no-sync`` skips the synchronous phase. Before the background phase comes its
first save, as in a run: ``engine.reserve_save_buffers()`` after a step allocates the page-locked
host buffers in the background (``--no-reserve``: the first save allocates them, as before), and
the first save follows ``--every`` steps later (``first_background_save_stall_s``: what it costs
training). A phase's time runs from its first step to the return of its last step or save call:
the background phase's second save waits for the first one's write, so a write slower than the
steps between saves shows, as in a long run; the last save's write, which a long run would
overlap with the next steps, is timed apart (``async_last_commit_wait_s``). ``stall_pct`` is a
phase's extra time over the no-checkpoint phase, in percent. ``*_write_GBps``: the checkpoint's
bytes over a save's time from start to commit (files, fsyncs, rename; ``--threads`` writer threads
per rank); ``disk_write_GBps``: every rank writing its share of the same bytes from its host
buffers with plain threaded writes and fsyncs, the most a save can reach on this disk.

**restart**: ``behemoth run --nproc 2 --max-restarts 1 train`` of GPT-1.3B (byte tokenizer, the
embedded corpus), a background checkpoint every ``--restart-every`` steps; rank 1 is SIGKILLed
(mid-step) as soon as a checkpoint's commit is logged, so the restart must resume from that
newest checkpoint (``resumed_from_newest``); the seconds from the kill to the first step line
after ``resumed from`` are the recovery time (torchrun's restart, process start, NCCL, model
build, checkpoint load and one step).

Both print ``RESULT {json}`` lines; the last line is one JSON object with both parts.
Checkpoints go under ``--dir`` (default: a temporary directory on the local disk, deleted after);
each save replaces the last (GPT-1.3B with its AdamW state is 15.6 GB; a save holds two for a moment).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


# ------------------------------------------------------------------ stall (one torchrun worker)
def stall_worker(a) -> None:
    import torch

    import behemoth as bh
    from behemoth.models import build_model

    bh.init()
    rank = torch.distributed.get_rank()
    dev = bh.distributed.device_for_rank()
    model = build_model(a.size, vocab_size=50304, seq_len=a.seq, device=dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=dev.type == "cuda")
    world = torch.distributed.get_world_size()
    plan = bh.Plan(dp=world, precision="bf16", microbatches=a.rows // a.mbs)
    engine = bh.boost(model, opt, plan, max_grad_norm=1.0)
    g = torch.Generator(device=dev).manual_seed(engine.dp_rank)
    x = torch.randint(0, 50304, (a.rows, a.seq + 1), device=dev, generator=g)
    batch = {"input_ids": x[:, :-1], "labels": x[:, 1:]}

    def say(msg: str) -> None:
        if rank == 0:
            print(msg, file=sys.stderr, flush=True)

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize()

    threads = a.threads or None
    for _ in range(3):
        engine.step(batch)

    def first_background_save() -> dict:
        """As in a run: the host buffers reserved after a step, the first background save --every steps later."""
        engine.step(batch)
        reserve_call = 0.0
        if not a.no_reserve:
            t = time.perf_counter()
            engine.reserve_save_buffers()
            reserve_call = time.perf_counter() - t
        for _ in range(max(2, a.every - 1)):
            engine.step(batch)
        t = time.perf_counter()
        engine.save(os.path.join(a.dir, "step"), blocking=False, threads=threads)
        first_stall = time.perf_counter() - t
        engine.step(batch)
        engine.wait_for_save()
        first_total = time.perf_counter() - t
        reserve_background = engine._saver.last_reserve_seconds
        say(
            f"first background save: {first_stall:.2f} s stall, {first_total:.2f} s to commit; host buffers "
            + (
                "allocated by that save"
                if a.no_reserve
                else f"reserved {a.every} steps before ({reserve_background:.2f} s in the background)"
            )
        )
        return {
            "first_background_save_stall_s": round(first_stall, 3),
            "first_background_save_commit_s": round(first_total, 3),
            "host_buffers": "allocated by the first save" if a.no_reserve else f"reserved {a.every} steps before",
            "reserve_call_s": round(reserve_call, 3),
            "reserve_background_s": round(reserve_background, 3),
            "checkpoint_bytes": _dir_bytes(os.path.join(a.dir, "step")),
        }

    def phase(mode: str) -> dict:
        stalls, step_times, writes = [], [], []
        sync()
        t0 = time.perf_counter()
        for i in range(1, a.steps + 1):
            ts = time.perf_counter()
            engine.step(batch)  # returns a float: the step is done on the device
            step_times.append(time.perf_counter() - ts)
            if mode != "none" and i % a.every == 0:
                ts = time.perf_counter()
                if mode == "async" and engine._saver.in_flight:
                    engine.wait_for_save()  # what the save call would wait for: the previous write
                    writes.append(engine._saver.last_write_seconds)
                engine.save(os.path.join(a.dir, "step"), blocking=mode == "sync", threads=threads)  # replaces the last
                stalls.append(time.perf_counter() - ts)
                if mode == "sync":
                    writes.append(stalls[-1])
        sync()
        seconds = time.perf_counter() - t0  # a background save's write of the last save is still going
        tw = time.perf_counter()
        engine.wait_for_save()
        tail = time.perf_counter() - tw
        if mode == "async":
            writes.append(engine._saver.last_write_seconds)
        say(
            f"{mode}: {seconds:.2f} s for {a.steps} steps, save calls {[round(s, 2) for s in stalls]}"
            + (f", then {tail:.2f} s until the last save committed" if mode == "async" else "")
        )
        return {
            "seconds": round(seconds, 3),
            "save_call_s": [round(s, 3) for s in stalls],
            "step_s": step_times,
            "last_commit_wait_s": round(tail, 3),
            "write_s": [round(w, 3) for w in writes],
        }

    # plain synchronous saves first: once a background save has host buffers, blocking saves use them
    results = {mode: phase(mode) for mode in ("none", "sync") if mode == "none" or not a.no_sync}
    first = first_background_save()
    results["async"] = phase("async")
    ckpt_bytes = first["checkpoint_bytes"]
    disk_s = _disk_probe(engine, a, ckpt_bytes, threads)
    base = results["none"]["seconds"]
    steps_sorted = sorted(results["none"]["step_s"])
    out = {
        "part": "stall",
        "model": a.size,
        "gpus": world,
        "plan": f"dp={world}, bf16 autocast, fp32 AdamW",
        "rows_per_rank": a.rows,
        "mbs": a.mbs,
        "seq": a.seq,
        "steps_per_phase": a.steps,
        "save_every": a.every,
        "median_step_s": round(steps_sorted[len(steps_sorted) // 2], 4),
        **first,
        "writer_threads": threads or "default (one per GiB a rank writes, up to 8)",
        "card": torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu",
    }
    for mode, r in results.items():
        out[f"{mode}_s"] = r["seconds"]
        if mode != "none":
            out[f"{mode}_save_call_s"] = r["save_call_s"]
            out[f"{mode}_stall_pct"] = round(100 * (r["seconds"] - base) / base, 2)
    out["async_last_commit_wait_s"] = results["async"]["last_commit_wait_s"]
    for mode in [
        m for m in ("sync", "async") if m in results
    ]:  # the whole save (files, fsyncs, commit) of every rank, in GB/s
        w = results[mode]["write_s"]
        out[f"{mode}_write_s"] = w
        out[f"{mode}_write_GBps"] = round(ckpt_bytes / (sum(w) / len(w)) / 1e9, 3) if w else None
    out["disk_write_s"] = round(disk_s, 3)  # the same bytes, plain threaded writes and fsyncs: the ceiling
    out["disk_write_GBps"] = round(ckpt_bytes / disk_s / 1e9, 3)
    if rank == 0:
        print("RESULT " + json.dumps(out), flush=True)
    torch.distributed.destroy_process_group()


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))


def _disk_probe(engine, a, nbytes: int, threads: int | None) -> float:
    """Seconds for every rank to write its share of ``nbytes`` from its host buffers with plain
    threaded writes and an fsync per file (the save's threads, 8 by default): what the disk allows."""
    import torch
    from checkpoint_write import raw_write_seconds

    import behemoth as bh

    world = torch.distributed.get_world_size()
    buffers = [b.view(-1).view(torch.uint8) for b in engine._saver._snapshot._buffers.values()]
    flat = max(buffers, key=lambda b: b.numel())
    share = min(nbytes // world, flat.numel())
    root = os.path.join(a.dir, "disk-probe")
    seconds = raw_write_seconds(flat[:share], root, threads or 8, bh.distributed.device_for_rank())
    torch.distributed.barrier()
    shutil.rmtree(root, ignore_errors=True)
    return seconds * nbytes / (share * world)  # scaled to the checkpoint's bytes


def run_stall(a, work: str) -> dict | None:
    cmd = (
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={a.gpus}",
            os.path.abspath(__file__),
            "--stall-worker",
            f"--dir={os.path.join(work, 'stall')}",
            f"--steps={a.steps}",
            f"--every={a.every}",
            f"--rows={a.rows}",
            f"--mbs={a.mbs}",
            f"--seq={a.seq}",
            f"--size={a.size}",
            f"--threads={a.threads}",
        ]
        + (["--no-reserve"] if a.no_reserve else [])
        + (["--no-sync"] if a.no_sync else [])
    )
    env = _env()
    t0 = time.time()
    # its own session, so a timeout takes torchrun's workers (and their GPUs) with it
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=a.timeout)
    except subprocess.TimeoutExpired:  # say how far it got
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        for text in (stdout, stderr):
            print((text or "")[-3000:], file=sys.stderr, flush=True)
        print(f"# stall part: timed out after {a.timeout} s", file=sys.stderr, flush=True)
        return None
    print(stderr[-3000:], file=sys.stderr, flush=True)
    lines = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")]
    print(f"# stall part: {time.time() - t0:.0f} s, exit {proc.returncode}", file=sys.stderr, flush=True)
    if not lines:
        print(stdout[-3000:], flush=True)
        return None
    print(lines[-1], flush=True)
    return json.loads(lines[-1][len("RESULT ") :])


# ------------------------------------------------------------------ restart (behemoth run --max-restarts 1)
def _children(pid: int) -> list[int]:
    kids = []
    for task in os.listdir(f"/proc/{pid}/task") if os.path.isdir(f"/proc/{pid}/task") else ():
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                kids += [int(x) for x in f.read().split()]
        except OSError:
            continue
    return kids


def _worker_pids(pid: int) -> dict[int, int]:
    """``{rank: pid}`` of the launcher's workers (their RANK in /proc/PID/environ)."""
    out = {}
    for child in _children(pid):
        try:
            with open(f"/proc/{child}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        except OSError:
            continue
        if b"RANK" in env:
            out[int(env[b"RANK"])] = child
    return out


def run_restart(a, work: str) -> dict | None:
    out_dir = os.path.join(work, "restart")
    steps = a.restart_every + 30  # room for the first commit; the run is stopped once the restart has stepped
    cmd = [
        sys.executable,
        "-m",
        "behemoth",
        "run",
        "--nproc",
        str(a.gpus),
        "--max-restarts",
        "1",
        "train",
        os.path.join(ROOT, "src", "behemoth", "configs", "gpt-1.3b.toml"),
        f"--model.name={a.size}",
        "--data.tokenizer=byte",
        "--model.vocab_size=50304",
        f"--model.seq_len={a.seq}",
        f"--train.global_batch_size={a.gpus * a.mbs}",
        "--plan.microbatches=1",
        "--plan.activation_checkpointing=false",
        "--optim.warmup_steps=0",
        f"--train.steps={steps}",
        f"--train.save_every={a.restart_every}",
        "--train.log_every=1",
        "--train.keep_last=1",
        f"--train.out_dir={out_dir}",
        "--data.default_corpus_bytes=2000000",
        f"--train.async_checkpoint={'false' if a.restart_sync else 'true'}",
    ]
    lines: list[tuple[float, str]] = []
    t0 = time.time()
    proc = subprocess.Popen(
        cmd, env=_env(), text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )

    def read() -> None:
        for line in proc.stdout:
            lines.append((time.monotonic(), line))
            print(line, end="", file=sys.stderr, flush=True)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    step_re = re.compile(r"^step +(\d+)/\d+ \|")
    commit_re = re.compile(r"saved checkpoint .*step-(\d+) in ")
    killed_at, kill_time, recovered, resumed_step, committed_step = None, None, None, None, None
    deadline = time.monotonic() + a.timeout
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            text = [ln for _, ln in lines]
            if killed_at is None:
                # the kill lands as soon as a background save's commit is logged (mid-step, and no newer
                # save has begun): the restart must resume from that, the newest checkpoint
                commits = [int(m.group(1)) for ln in text if (m := commit_re.search(ln))]
                done = [int(m.group(1)) for ln in text if (m := step_re.match(ln))]
                if commits and commits[-1] < steps:
                    pid = _worker_pids(proc.pid).get(1)
                    if pid is not None:
                        kill_time = time.monotonic()
                        os.kill(pid, signal.SIGKILL)
                        killed_at, committed_step = max(done or [0]), commits[-1]
                        print(
                            f"# SIGKILL of rank 1 (pid {pid}) after step {killed_at}, checkpoint step-{committed_step} "
                            f"committed",
                            file=sys.stderr,
                            flush=True,
                        )
            else:
                after = [(t, ln) for t, ln in lines if t > kill_time]
                resumed = [i for i, (_, ln) in enumerate(after) if ln.startswith("resumed from")]
                if resumed:
                    resumed_step = int(re.search(r"at step (\d+)", after[resumed[0]][1]).group(1))
                    stepped = [t for t, ln in after[resumed[0] :] if step_re.match(ln)]
                    if stepped:
                        recovered = stepped[0] - kill_time
                        break
            time.sleep(0.05)
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    after = [(t - kill_time, ln) for t, ln in lines if kill_time is not None and t > kill_time]

    def first(pattern: str) -> float | None:  # seconds from the kill to the first line matching
        return next((round(t, 2) for t, ln in after if re.search(pattern, ln)), None)

    out = {
        "part": "restart",
        "model": a.size,
        "gpus": a.gpus,
        "async_checkpoint": not a.restart_sync,
        "killed_after_step": killed_at,
        "newest_checkpoint_at_kill": committed_step,
        "resumed_from_step": resumed_step,
        "resumed_from_newest": resumed_step is not None and resumed_step == committed_step,
        "kill_to_next_step_s": None if recovered is None else round(recovered, 2),
        # where the time went: the survivor's error line, the restarted workers' first line, the resume
        "peer_lost_s": first(r"lost a peer|Connection|NCCL"),
        "restarted_s": first(r"^# behemoth train"),
        "resumed_s": first(r"^resumed from"),
        "exit_code": proc.returncode,
        "wall_s": round(time.time() - t0, 1),
    }
    print("RESULT " + json.dumps(out), flush=True)
    return out


def _env() -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1", NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.join(ROOT, "src"), env.get("PYTHONPATH")) if p)
    return env


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", choices=["both", "stall", "restart"], default="both")
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--size", default="gpt-1.3b", help="model preset (gpt-tiny for a CPU smoke test)")
    p.add_argument("--steps", type=int, default=20, help="steps per stall phase")
    p.add_argument("--every", type=int, default=10, help="save every this many steps (stall part)")
    p.add_argument(
        "--rows",
        type=int,
        default=16,
        help="sequences per rank per step (stall part; 32 is gpt-1.3b.toml's global batch on 2 GPUs, twice the time)",
    )
    p.add_argument("--mbs", type=int, default=8, help="sequences per micro-batch")
    p.add_argument(
        "--no-sync", action="store_true", help="skip the synchronous-save phase (stall part: no checkpoint, background)"
    )
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--threads", type=int, default=0, help="writer threads per rank (0: behemoth's default)")
    p.add_argument(
        "--no-reserve", action="store_true", help="let the first background save allocate its host buffers (as before)"
    )
    p.add_argument("--restart-every", type=int, default=5, help="save every this many steps (restart part)")
    p.add_argument("--restart-sync", action="store_true", help="restart part with synchronous checkpoints")
    p.add_argument("--timeout", type=int, default=300, help="seconds per part")
    p.add_argument("--dir", default=None, help="where checkpoints go (default: a temporary directory)")
    p.add_argument("--stall-worker", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.stall_worker:
        return stall_worker(a)
    work = a.dir or tempfile.mkdtemp(prefix="bh-ckpt-bench-")
    try:
        out = {}
        if a.part in ("both", "stall"):
            out["stall"] = run_stall(a, work)
            shutil.rmtree(os.path.join(work, "stall"), ignore_errors=True)
        if a.part in ("both", "restart"):
            out["restart"] = run_restart(a, work)
        print(json.dumps(out))
    finally:
        if a.dir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

"""How fast a checkpoint's bytes reach the disk: ``write_checkpoint`` of a replicated state (a
GPT's weights and AdamW state, as a data-parallel run holds it) from ``--world`` gloo processes,
after the host copy a background save writes from (``HostSnapshot``), against a plain threaded
write of the same bytes (the disk's own speed, with the same fsyncs). No GPU needed::

    python3 benchmarks/checkpoint_write.py --gb 2 --dir /tmp/bh-ckpt-write

Prints, per repeat, the seconds of the write and its GB/s (bytes of the files over the time from
the first rank's start to the last rank's return, the commit included), the CPU seconds the ranks
spent on it (user + system, every thread: the write path's own cost, steadier than the wall time
on a shared machine), the bytes each rank's files hold (a replicated tensor is written once, by
one of its ranks), the files per rank, and the staging copy's seconds, CPU seconds and bytes (each
rank copies the tensors it writes; the first copy allocates the host buffers unless ``--reserve``
did, the later ones reuse them); the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))


def gpt_like_state(total_bytes: int, hidden: int = 1024) -> dict:
    """fp32 weights and two AdamW moments of GPT blocks (width ``hidden``) and an embedding, about
    ``total_bytes`` together: large matrices and small vectors, as a real model's state."""
    import torch

    g = torch.Generator().manual_seed(0)
    block = {
        "attn.qkv.weight": (3 * hidden, hidden),
        "attn.qkv.bias": (3 * hidden,),
        "attn.proj.weight": (hidden, hidden),
        "attn.proj.bias": (hidden,),
        "mlp.fc.weight": (4 * hidden, hidden),
        "mlp.fc.bias": (4 * hidden,),
        "mlp.proj.weight": (hidden, 4 * hidden),
        "mlp.proj.bias": (hidden,),
        "ln1.weight": (hidden,),
        "ln1.bias": (hidden,),
        "ln2.weight": (hidden,),
        "ln2.bias": (hidden,),
    }
    per_block = 3 * 4 * sum(torch.Size(s).numel() for s in block.values())
    emb = (16384, hidden)
    layers = max(1, (total_bytes - 3 * 4 * emb[0] * emb[1]) // per_block)
    shapes = {"wte.weight": emb}
    for i in range(layers):
        shapes.update({f"h.{i}.{k}": s for k, s in block.items()})
    out = {}
    for part in ("model", "optim/exp_avg", "optim/exp_avg_sq"):
        for k, s in shapes.items():
            out[f"{part}/{k}"] = torch.rand(s, generator=g)
    return out


def raw_write_seconds(data, directory: str, threads: int, device=None) -> float:
    """Seconds, the slowest rank's, for every rank to write its ``data`` (a CPU uint8 tensor) into
    ``threads`` files of ``directory`` with plain threaded writes and an fsync per file: the disk's
    own speed, with a save's fsyncs. Collective over the world; ``device``: where the seconds are
    reduced (NCCL reduces device tensors only)."""
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    part = data.numel() // threads
    os.makedirs(directory, exist_ok=True)

    def write(i: int) -> None:
        view = memoryview(data[i * part : (i + 1) * part].numpy())
        fd = os.open(os.path.join(directory, f"{rank}-{i}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        try:
            done = 0
            while done < len(view):
                done += os.write(fd, view[done : done + (64 << 20)])
            os.fsync(fd)
        finally:
            os.close(fd)

    dist.barrier()
    t = time.perf_counter()
    pool = [threading.Thread(target=write, args=(i,)) for i in range(threads)]
    for p in pool:
        p.start()
    for p in pool:
        p.join()
    seconds = torch.tensor([time.perf_counter() - t], dtype=torch.float64, device=device)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return float(seconds.item())


def _cpu_seconds() -> float:
    """User and system CPU seconds of this process, all its threads (what the write costs the host,
    however busy the machine is)."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _worker(rank, world, a, results):
    import torch
    import torch.distributed as dist

    from behemoth import checkpoint as ckpt
    from behemoth.async_checkpoint import HostSnapshot

    torch.set_num_threads(1)
    state = gpt_like_state(int(a.gb * 1e9))
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    snap = HostSnapshot()
    try:  # as a background save does: each rank copies (and writes) only its share of the replicas
        from behemoth.checkpoint_split import ReplicaSplit

        split = ReplicaSplit()
    except ImportError:  # a behemoth before it: every rank copies everything
        split = None
    kwargs = {} if a.threads is None else {"threads": a.threads}
    runs = []
    if a.reserve:  # the buffers allocated ahead (as engine.reserve_save_buffers does, in a background thread)
        t = time.perf_counter()
        need: dict = {}
        for v in (split.select(state) if split is not None else state).values():
            need[v.dtype] = need.get(v.dtype, 0) + v.numel()
        snap.reserve(need, on_gpu=False)
        if rank == 0:
            print(f"reserve: {time.perf_counter() - t:.3f} s", flush=True)
    for r in range(a.repeat):
        path = os.path.join(a.dir, f"r{r}", "step-1")
        t, cpu = time.perf_counter(), _cpu_seconds()
        mine = split.select(state) if split is not None else state
        copies, _ = snap.copy(mine) if a.source == "snapshot" else (mine, None)
        staging = time.perf_counter() - t
        staging_cpu = torch.tensor([_cpu_seconds() - cpu], dtype=torch.float64)
        staged = torch.tensor([snap.bytes if a.source == "snapshot" else 0], dtype=torch.int64)
        dist.all_reduce(staging_cpu)
        dist.all_reduce(staged)
        dist.barrier()
        t, cpu = time.perf_counter(), _cpu_seconds()
        ckpt.write_checkpoint(path, copies, {}, {"rng": {"x": torch.zeros(4)}}, extra={}, **kwargs)
        dt = torch.tensor([time.perf_counter() - t], dtype=torch.float64)
        cpu = torch.tensor([_cpu_seconds() - cpu], dtype=torch.float64)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        dist.all_reduce(cpu)
        if rank == 0:
            files = [f for f in os.listdir(path) if f.endswith(".distcp")]
            per_rank: dict[int, int] = {}
            nfiles: dict[int, int] = {}
            for f in files:
                owner = int(f[2:].split("_")[0])
                per_rank[owner] = per_rank.get(owner, 0) + os.path.getsize(os.path.join(path, f))
                nfiles[owner] = nfiles.get(owner, 0) + 1
            written = sum(per_rank.values())
            run = {
                "write_s": round(float(dt), 3),
                "write_GBps": round(written / float(dt) / 1e9, 3),
                "write_cpu_s": round(float(cpu), 3),  # user + system seconds of every rank's threads
                "staging_s": round(staging, 3),
                "staging_cpu_s": round(float(staging_cpu), 3),
                "staged_bytes": int(staged),  # host copies, every rank together
                "bytes_per_rank": [per_rank.get(i, 0) for i in range(world)],
                "files_per_rank": [nfiles.get(i, 0) for i in range(world)],
            }
            runs.append(run)
            print(f"repeat {r}: {json.dumps(run)}", flush=True)
            shutil.rmtree(os.path.dirname(path))
        dist.barrier()
    if a.raw:  # the disk's own speed: this rank's share of the same bytes, plain threaded writes and fsyncs
        flat = torch.cat([t.reshape(-1) for t in state.values()]).view(torch.uint8)
        share = flat.numel() // world
        dt = raw_write_seconds(flat[rank * share : (rank + 1) * share], os.path.join(a.dir, "raw"), a.threads or 8)
        if rank == 0:
            shutil.rmtree(os.path.join(a.dir, "raw"))
            raw = {"raw_s": round(float(dt), 3), "raw_GBps": round(share * world / float(dt) / 1e9, 3)}
            print(f"raw: {json.dumps(raw)}", flush=True)
            runs.append(raw)
    if rank == 0:
        out = {"state_bytes": nbytes, "world": world, "source": a.source, "threads": a.threads, "runs": runs}
        print("RESULT " + json.dumps(out), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gb", type=float, default=2.0, help="state size in GB (weights and two AdamW moments)")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="writer threads per rank (default: behemoth's)")
    p.add_argument("--source", choices=["snapshot", "plain"], default="snapshot")
    p.add_argument("--reserve", action="store_true", help="reserve the host buffers before the first copy")
    p.add_argument("--raw", action="store_true", help="also time a plain threaded write of the same bytes")
    p.add_argument("--dir", default="/tmp/bh-ckpt-write")
    a = p.parse_args()
    import behemoth as bh

    os.makedirs(a.dir, exist_ok=True)
    try:
        bh.spawn(_worker, a.world, a, None, timeout=3600)
    finally:
        shutil.rmtree(a.dir, ignore_errors=True)


if __name__ == "__main__":
    main()

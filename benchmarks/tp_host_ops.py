"""Per-step host work of a tensor-parallel layout: the collectives (by axis and operation, from
the comm ledger and from the c10d ops that reach the dispatcher), the aten ops, the CUDA kernel
launches (on GPUs) and the host milliseconds of one training step, layout beside layout.

Tells how much a layout asks of the host and of the collective library per step, independent
of GEMM speed: 2D's SUMMA, for instance, issues many more (smaller) collectives over two
axes than 1D's all-reduces over one. Ops are counted with a ``TorchDispatchMode`` (it follows
the backward into the autograd engine's threads), so counting slows the counted steps; the
host milliseconds come from separate, uncounted steps.

    python benchmarks/tp_host_ops.py --spawn 4                          # CPU, 4 gloo ranks
    torchrun --standalone --nproc_per_node 4 benchmarks/tp_host_ops.py --size gpt-1.3b \\
        --mbs 8 --seq 2048 --layouts 1d,2d                                # GPUs, NCCL

Prints, on rank 0, one ``OPS {json}`` line per layout and a table. ``deferred``: of the
collectives, the parameter-gradient reductions the grid layouts wait for only at the end of the
backward (``behemoth.parallel.tensor.deferred_grads``), off its critical path.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import behemoth as bh  # noqa: E402
from behemoth.models import build_model  # noqa: E402


class OpCounter(TorchDispatchMode):
    """Counts every op that reaches the dispatcher: aten ops and c10d collectives."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def _record_grad_passes() -> list:
    """The deferred-gradient passes (grid layouts) opened until ``_record_grad_passes.stop()``:
    each counts the reductions its layers issued but waited for only at the end of the backward."""
    from behemoth.parallel.tensor.deferred_grads import GradPass

    passes, init = [], GradPass.__init__

    def recording(self, *args):
        init(self, *args)
        passes.append(self)

    def stop():
        GradPass.__init__ = init

    GradPass.__init__ = recording
    _record_grad_passes.stop = stop
    return passes


def _sync(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def measure(layout: str, a, dev) -> dict:
    world = torch.distributed.get_world_size()
    model = build_model(a.size, vocab_size=a.vocab, seq_len=a.seq, device=dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    precision = "bf16" if dev.type == "cuda" else "fp32"
    plan = bh.Plan(dp=world // a.tp, tp=a.tp, tp_mode=layout, precision=precision, compile=a.compile)
    engine = bh.boost(model, opt, plan)
    g = torch.Generator(device=dev).manual_seed(engine.dp_rank)
    x = torch.randint(0, a.vocab, (a.mbs, a.seq + 1), device=dev, generator=g)
    batch = {"input_ids": x[:, :-1], "labels": x[:, 1:]}
    for _ in range(2):  # warm-up (and compile)
        engine.step(batch)
    times = []
    for _ in range(a.steps):
        _sync(dev)
        t = time.perf_counter()
        engine.step(batch)
        _sync(dev)
        times.append(time.perf_counter() - t)
    engine.reset_comm_stats()
    counter = OpCounter()
    passes = _record_grad_passes()
    launches = None
    if dev.type == "cuda":
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            with counter:
                engine.step(batch)
            _sync(dev)
        launches = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    else:
        with counter:
            engine.step(batch)
    _record_grad_passes.stop()
    stats = engine.comm_stats()
    c10d = {k: v for k, v in counter.ops.items() if k.startswith("c10d") or "_c10d_functional" in k}
    aten = sum(v for k, v in counter.ops.items() if k.startswith("aten."))
    out = dict(
        layout=layout,
        size=a.size,
        mbs=a.mbs,
        seq=a.seq,
        tp=a.tp,
        compile=a.compile,
        host_ms=round(1e3 * sorted(times)[len(times) // 2], 2),
        aten_ops=aten,
        collectives=sum(s["calls"] for s in stats.values()),
        deferred=sum(gp.deferred for gp in passes),
        by_axis={ax: s["ops"] for ax, s in stats.items()},
        c10d_ops=dict(sorted(c10d.items())),
        top_aten=dict(
            collections.Counter({k: v for k, v in counter.ops.items() if k.startswith("aten.")}).most_common(12)
        ),
        gpu_kernels=launches,
    )
    del engine, model, opt
    return out


def run(rank: int, world: int, a) -> None:
    bh.init()
    dev = bh.distributed.device_for_rank()
    rows = [measure(layout, a, dev) for layout in a.layouts.split(",")]
    if torch.distributed.get_rank() == 0:
        for r in rows:
            print("OPS " + json.dumps(r), flush=True)
        print(f"\n{a.size}, mbs {a.mbs}, seq {a.seq}, tp {a.tp}, {world} ranks, per step (rank 0):")
        print(
            f"{'layout':8} {'host ms':>9} {'aten ops':>9} {'collectives':>12} {'deferred':>9} {'kernels':>8}  by axis"
        )
        for r in rows:
            axes = "; ".join(f"{ax} {dict(ops)}" for ax, ops in r["by_axis"].items())
            print(
                f"{r['layout']:8} {r['host_ms']:9.1f} {r['aten_ops']:9d} {r['collectives']:12d} {r['deferred']:9d} "
                f"{r['gpu_kernels'] if r['gpu_kernels'] is not None else '-':>8}  {axes}"
            )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="gpt-mini")
    p.add_argument("--mbs", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--tp", type=int, default=4)
    p.add_argument("--layouts", default="1d,2d", help="comma-separated Plan.tp_mode values")
    p.add_argument("--steps", type=int, default=5, help="timed steps per layout (after 2 warm-up steps)")
    p.add_argument("--compile", action="store_true", help="Plan.compile")
    p.add_argument("--spawn", type=int, default=0, help="start this many local processes (CPU: gloo)")
    a = p.parse_args()
    if a.spawn:
        bh.spawn(run, a.spawn, a)
    else:
        run(0, 1, a)


if __name__ == "__main__":
    main()

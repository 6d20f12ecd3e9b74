"""The experts' SwiGLU GEMMs on one GPU, both of behemoth's paths (forward + backward, no
communication): ``torch._grouped_mm`` (one kernel per projection for all of a rank's experts,
:func:`behemoth.parallel.expert.grouped.swiglu_grouped_mm`) against the loop of per-expert
cuBLAS GEMMs (:func:`~behemoth.parallel.expert.grouped.swiglu_loop`), over expert shapes and rows
per expert, to find where each is faster. One RESULT json line per shape and row count:

    python3 benchmarks/expert_gemms.py                      # the default sweep, about a minute
    python3 benchmarks/expert_gemms.py --shapes 4096x14336x4 --rows 2048,8192

A shape is ``HxIxL``: hidden H, expert FFN width I, L experts on the rank; every expert gets the
same ``rows`` rows (a multiple of 16, as the dispatch pads them). Parameters and input in bf16
(``--autocast``: fp32 parameters under bf16 autocast, as ``Plan(precision="bf16")`` trains).
Times: CUDA events, median of ``--iters`` calls after ``--warmup``; TFLOP/s counts
``18*rows*L*H*I`` per call (forward 6, backward 12)."""

from __future__ import annotations

import argparse
import json

import torch

from behemoth.parallel.expert import grouped

DEFAULT_SHAPES = "2048x5632x4,4096x14336x4,2048x1024x32,2048x1408x8,7168x2048x32"
DEFAULT_ROWS = "512,1024,2048,4096,8192,16384"


def time_ms(fn, iters: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def measure(hidden: int, ffn: int, experts: int, rows: int, a) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    pdtype = torch.float32 if a.autocast else torch.bfloat16
    gate_up = torch.nn.Parameter(
        torch.randn(experts, 2 * ffn, hidden, device="cuda", generator=g).mul_(0.02).to(pdtype)
    )
    down = torch.nn.Parameter(torch.randn(experts, hidden, ffn, device="cuda", generator=g).mul_(0.02).to(pdtype))
    x_NH = torch.randn(rows * experts, hidden, device="cuda", generator=g).to(pdtype).requires_grad_()
    dy_NH = torch.randn(rows * experts, hidden, device="cuda", generator=g, dtype=torch.bfloat16)
    counts = [rows] * experts
    out = dict(hidden=hidden, ffn=ffn, experts=experts, rows_per_expert=rows, autocast=a.autocast)
    for name, path in (("grouped", grouped.swiglu_grouped_mm), ("loop", grouped.swiglu_loop)):

        def step(path=path):
            gate_up.grad = down.grad = x_NH.grad = None
            with torch.autocast("cuda", torch.bfloat16, enabled=a.autocast):
                y_NH = path(x_NH, counts, gate_up, down)
            y_NH.backward(dy_NH.to(y_NH.dtype))

        ms = time_ms(step, a.iters, a.warmup)
        out[f"{name}_ms"] = round(ms, 3)
        out[f"{name}_tflops"] = round(18 * rows * experts * hidden * ffn / ms / 1e9, 1)
    out["loop_over_grouped"] = round(out["grouped_ms"] / out["loop_ms"], 3)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=DEFAULT_SHAPES, help="comma-separated HxIxL")
    p.add_argument("--rows", default=DEFAULT_ROWS, help="comma-separated rows per expert")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--autocast", action="store_true")
    a = p.parse_args(argv)
    print("GPU", torch.cuda.get_device_name(), flush=True)
    for shape in a.shapes.split(","):
        hidden, ffn, experts = (int(v) for v in shape.split("x"))
        for rows in (int(v) for v in a.rows.split(",")):
            try:
                print("RESULT " + json.dumps(measure(hidden, ffn, experts, rows, a)), flush=True)
            except torch.OutOfMemoryError:
                print(f"OOM {shape} rows {rows}", flush=True)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

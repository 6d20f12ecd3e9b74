"""``behemoth plan``: plan a job without a GPU -- the subcommand's options and its modes.

    --search MODEL --gpus N     every legal layout of MODEL, predicted, the fastest that fit
    --scale MODEL --gpus N      each tensor-parallel mode's best plan from 64 (or 8) GPUs up to N
    --generate MODEL --gpus N   generation per tensor-parallel layout (and --sweep N: 1D against 2D)
    --memory --model NAME       what ZeRO / offload='auto' would keep where, and why

Each mode calls the pure planner (:mod:`behemoth.planner`) and prints its text; nothing here opens
a process group. :func:`add_plan_parser` adds the subcommand to ``behemoth``'s parser
(:mod:`behemoth.cli`), which runs it through :func:`cmd_plan`. Tested in
tests/unit/test_planner_cli.py, tests/unit/test_memory_plan.py and
tests/unit/test_planner_generation.py.
"""

from __future__ import annotations

import argparse


def add_plan_parser(sub) -> None:
    """The ``plan`` subcommand and its options, on ``sub`` (the parser's subparsers)."""
    m = sub.add_parser(
        "plan",
        help="plan a job without a GPU: search every layout (--search), plan ZeRO memory (--memory), predict generation (--generate)",
        description="--search MODEL: enumerate every legal layout of MODEL on --gpus GPUs, predict each "
        "one's step time and memory, print the fastest that fit. --memory: the chunk layout, per-rank model "
        "data per ZeRO stage and, when the model does not fit, the GPU/host split offload='auto' would "
        "choose",
        epilog="examples:\n"
        "  behemoth plan --search gpt-1.3b --gpus 8 --explain\n"
        "  behemoth plan --search gpt-13b --gpus 64 --nodes 8 --gpu-gb 80 --batch 512\n"
        "  behemoth plan --memory --model gpt-1.3b --dp 8\n"
        "  behemoth plan --generate llama-8b --vocab 128256 --gpus 4 --batch 64 --context 4096 --sweep 1024\n"
        "  behemoth plan --memory --model gpt-13b --gpu-gb 80 --host-gb 256 --param-dtype bf16 "
        "--activations-gb 15",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    what = m.add_mutually_exclusive_group(required=True)
    what.add_argument("--search", metavar="MODEL", help="search the layouts of a preset model (e.g. gpt-1.3b)")
    what.add_argument("--memory", action="store_true", help="plan ZeRO memory and offload for --model")
    what.add_argument(
        "--scale",
        metavar="MODEL",
        help="simulate MODEL from 64 (or 8) GPUs up to --gpus, doubling: each tensor-parallel mode's best "
        "plan, where 2D/2.5D/3D overtake 1D",
    )
    what.add_argument(
        "--generate",
        metavar="MODEL",
        help="generation (inference) of MODEL on --gpus GPUs in one tensor-parallel group: per layout the decode "
        "ms a token, tokens/s, prefill tokens/s, weights and KV cache per GPU, the largest batch and context "
        "that fit; --sweep N: where 2D's decode and prefill overtake 1D's as the GPUs grow",
    )
    m.add_argument("--model", help="--memory: a preset name, e.g. gpt-13b or llama-1b (see behemoth.models)")
    m.add_argument("--gpus", type=int, default=8, help="--search: GPUs in the job (default 8)")
    m.add_argument("--nodes", type=int, default=None, help="--search: nodes they sit on (default: 8 GPUs a node)")
    m.add_argument("--batch", type=int, default=None, help="--search: sequences per step (default 8 per GPU)")
    m.add_argument("--calibration", default="h100", help="--search: h100, h200, or a JSON from calibrate.py")
    m.add_argument("--top", type=int, default=10, help="--search: rows of the table (default 10)")
    m.add_argument("--explain", action="store_true", help="--search: say why the runner-up lost")
    m.add_argument("--trace", metavar="PATH", help="--search: write the winner's step as a Chrome trace JSON")
    m.add_argument("--inter-node-gbps", type=float, default=None, help="--search: inter-node GB/s per GPU")
    m.add_argument("--inter-node-latency-us", type=float, default=None, help="--search: inter-node latency, us")
    m.add_argument("--vocab", type=int, default=50304, help="vocabulary size (default 50304)")
    m.add_argument("--seq", type=int, default=2048, help="sequence length (default 2048)")
    m.add_argument("--dp", type=int, default=1, help="data-parallel ranks ZeRO shards over")
    m.add_argument("--zero", type=int, default=3, choices=[1, 2, 3])
    m.add_argument(
        "--gpu-gb", type=float, default=None, help="memory of one GPU, GiB (default 80; --search: the calibration's)"
    )
    m.add_argument("--host-gb", type=float, default=256.0, help="host memory per rank, GiB")
    m.add_argument(
        "--param-dtype",
        default="fp32",
        choices=["fp32", "bf16", "any"],
        help="parameter copies the model runs on: fp32 (Plan.param_dtype=None, the default) or bf16 copies "
        "of the fp32 masters (Plan.param_dtype='bf16'; under zero=3, offloaded ones on the host); --search "
        "also takes 'any' (try both: bf16 copies change the numerics, so they are tried only when asked)",
    )
    m.add_argument(
        "--activations-gb",
        type=float,
        default=0.0,
        help="activation memory per rank (the runtime measures it in its warm-up step)",
    )
    m.add_argument("--prompt", type=int, default=128, help="--generate: prompt tokens a row (default 128)")
    m.add_argument(
        "--context",
        type=int,
        default=None,
        help="--generate: cache slots a row, prompt + new tokens (default prompt + 256)",
    )
    m.add_argument("--eager", action="store_true", help="--generate: an eager decode step (default: one CUDA graph)")
    m.add_argument(
        "--sweep",
        type=int,
        default=0,
        metavar="N",
        help="--generate: also sweep 1D against 2D from 4 GPUs up to N, x4 (Optimus's 64-GPU setting included)",
    )


def cmd_search(a) -> int:
    from behemoth.planner.report import chrome_trace, explain, table
    from behemoth.planner.search import Limits, search
    from behemoth.planner.workload import workload_for

    gib = 2**30
    cluster = _cluster(a, a.gpus)
    nodes = cluster.num_nodes
    w = workload_for(a.search, seq_len=a.seq, global_batch=a.batch or 8 * a.gpus, vocab_size=a.vocab)
    dtypes = {"fp32": (None,), "bf16": ("bf16",), "any": (None, "bf16")}[a.param_dtype]
    res = search(w, cluster, Limits(top=max(a.top, 2), param_dtypes=dtypes))
    cal = cluster.calibration
    print(
        f"{a.search}: {w.num_params / 1e9:.2f}B parameters, {w.global_batch} x {w.seq_len} tokens per step, "
        f"{a.gpus} GPUs on {nodes} node(s), {cluster.memory_bytes / gib:.0f} GiB each; calibration "
        f"{cal.name} ({cal.source.split(',')[0].split('(')[0].strip()})"
    )
    print(table(res, a.top))
    if a.explain:
        print(explain(res))
    if a.trace and res.ranked:
        chrome_trace(res.best, a.trace)
        print(f"trace of the winner's step: {a.trace}")
    return 0 if res.ranked else 1


def _cluster(a, gpus: int):
    from behemoth.planner.calibration import load_calibration
    from behemoth.planner.cluster import Cluster

    gib = 2**30
    nodes = a.nodes or max(1, gpus // 8)
    if gpus % nodes:
        raise ValueError(f"--gpus {gpus} is not a multiple of --nodes {nodes}; give whole nodes.")
    return Cluster(
        num_gpus=gpus,
        gpus_per_node=gpus // nodes,
        gpu_bytes=a.gpu_gb * gib if a.gpu_gb else None,
        host_bytes=a.host_gb * gib,
        calibration=load_calibration(a.calibration),
        inter_node_bytes_per_s=a.inter_node_gbps * 1e9 if a.inter_node_gbps else None,
        inter_node_latency_s=a.inter_node_latency_us * 1e-6 if a.inter_node_latency_us else None,
    )


def cmd_scale(a) -> int:
    import dataclasses

    from behemoth.planner.report import chrome_trace
    from behemoth.planner.scale import format_sweep, scale_sweep
    from behemoth.planner.workload import workload_for

    start = 64 if a.gpus >= 64 else 8
    counts = [start]
    while counts[-1] * 2 <= a.gpus:
        counts.append(counts[-1] * 2)
    cluster = dataclasses.replace(_cluster(a, start), gpus_per_node=min(8, start))
    w = workload_for(a.scale, seq_len=a.seq, global_batch=a.batch or 8 * start, vocab_size=a.vocab)
    print(
        f"{a.scale}: {w.num_params / 1e9:.2f}B parameters, {w.seq_len} tokens a sequence, {w.global_batch} "
        f"sequences per step at {start} GPUs (growing with the GPUs); NVLink islands of "
        f"{cluster.gpus_per_node}; calibration {cluster.calibration.name}"
    )
    points = scale_sweep(w, cluster, tuple(counts))
    print(format_sweep(points))
    if a.trace:
        best = [p.best for p in points if p.view == "best" and p.gpus == counts[-1] and p.best]
        if best:
            chrome_trace(min(best, key=lambda p: p.step), a.trace)
            print(f"trace of the best plan at {counts[-1]} GPUs: {a.trace}")
    return 0


def cmd_generate_plan(a) -> int:
    from behemoth.planner.generation import (
        format_generation,
        format_scale,
        generation_layouts,
        predict_generation,
        scale_generation,
    )
    from behemoth.planner.workload import workload_for

    batch = a.batch or 1
    context = a.context or a.prompt + 256
    if context <= a.prompt:
        raise ValueError(f"--context {context} must exceed --prompt {a.prompt} (slots for the new tokens).")
    cluster = _cluster(a, a.gpus)
    w = workload_for(a.generate, seq_len=context, global_batch=batch, vocab_size=a.vocab)
    cal = cluster.calibration
    kw = dict(batch=batch, prompt=a.prompt, new_tokens=context - a.prompt, compiled=not a.eager)
    print(
        f"{a.generate}: {w.num_params / 1e9:.2f}B parameters (bf16), generating: batch {batch}, prompt {a.prompt}, "
        f"context {context}; one tensor-parallel group of {a.gpus} GPUs, {cluster.memory_bytes / 2**30:.0f} GiB "
        f"each; decode step {'eager' if a.eager else 'one CUDA graph'}; calibration {cal.name}"
    )
    layouts = generation_layouts(w.shape, a.gpus)
    if not layouts:
        print(f"no tensor-parallel layout of {a.gpus} GPUs divides {a.generate}'s heads and widths")
        return 1
    print(format_generation([predict_generation(w, lay, cluster, **kw) for lay in layouts]))
    if a.sweep:
        counts = [4]
        while counts[-1] * 4 <= a.sweep:
            counts.append(counts[-1] * 4)
        island = a.gpus // a.nodes if a.nodes else 8
        print(f"\n1D against 2D as the GPUs grow (NVLink islands of {island}, batch {batch}):")
        print(format_scale(scale_generation(w, cluster, tuple(counts), gpus_per_node=island, **kw)))
    return 0


def cmd_plan(a) -> int:
    if a.generate:
        return cmd_generate_plan(a)
    if a.search:
        return cmd_search(a)
    if a.scale:
        return cmd_scale(a)
    if not a.model:
        raise ValueError("behemoth plan --memory needs --model NAME (e.g. --model gpt-1.3b).")
    if a.param_dtype == "any":
        raise ValueError(
            "behemoth plan --memory --param-dtype any: plan one dtype, fp32 or bf16 ('any' is for --search)."
        )
    from behemoth.models import build_model
    from behemoth.planner.memory import memory_plan

    model = build_model(a.model, vocab_size=a.vocab, seq_len=a.seq, device="meta")
    sizes = [p.numel() for p in model.parameters()]
    gib = 2**30
    plan = memory_plan(
        sizes,
        dp=a.dp,
        stage=a.zero,
        gpu_bytes=int((a.gpu_gb or 80.0) * gib),
        host_bytes=int(a.host_gb * gib),
        activation_bytes=int(a.activations_gb * gib),
        param_bytes=2 if a.param_dtype == "bf16" else 4,
    )
    print(plan.text)
    return 0

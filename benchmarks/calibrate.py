"""Measure one machine for the planner's cost model, in under a minute, and write its
calibration JSON (the format of ``behemoth.planner.calibration``).

    torchrun --standalone --nproc-per-node 4 benchmarks/calibrate.py --out $OUT/cal.json
    python benchmarks/calibrate.py --out cal.json          # one GPU: no collectives measured

Measures, on rank 0's GPU unless said otherwise:

* GEMM rate by size: bf16 ``[m, k] @ [k, n]`` for the shapes transformer blocks of 1-13B
  parameters make under 1-8-way tensor parallelism, as ``[flops, flops_per_s]`` points;
* causal flash attention (``scaled_dot_product_attention``), forward rate and backward ratio, and
  both by sequence length (``attention_by_seq``: longer sequences run flash attention faster);
  grouped-query attention's beside multi-head's at 2,048 tokens (``extra.attention_gqa_2048``,
  not read by the planner);
* the experts' grouped GEMMs (``torch._grouped_mm``), forward and backward, against the GEMM
  table's rate for the whole call's flops, by rows per group (``grouped_call_by_rows``, their mean
  ``grouped_call_vs_table``: :func:`grouped_call_by_rows`);
* device-memory bandwidth (a large copy), and the rate of the blocks' non-GEMM kernels
  (``elementwise_bytes_per_s``: :func:`elementwise_rate`, the bytes ``planner.elementwise`` counts
  over a GPT-6.7B and a Llama-8B block's non-GEMM kernel time);
* first, every rank: the device memory outside PyTorch's allocator (``mem_get_info`` against
  ``memory_reserved``) of the CUDA context, of one NCCL communicator's buffers after its
  collectives, and of one 2-rank point-to-point channel's (:mod:`behemoth.planner.reserve`);
* every rank: all-reduce latency (8 KiB) and bus bandwidth (256 MiB) over groups of 2, 4, ...,
  the world (NVLink inside a node; across nodes, written as the "ib" link class);
* every rank: ``overlap_slowdown``, what a 256 MiB all-reduce over the world on a side stream
  adds to four 8192**3 GEMMs it runs beside, as a fraction of the all-reduce's own time;
* pinned host <-> device copy rates;
* every rank at once: the CPU AdamW update's parameters per second of one rank, the fused CPU
  kernel that offloaded chunks run, with the threads the launch gives each rank (torchrun: 1;
  ``behemoth launch``: the cores over the ranks; ``extra.cpu_adam_threads``), the slowest rank's,
  with the device idle (and while pinned copies run both ways: ``extra.cpu_adam_with_copies_params_per_s``);
* every rank at once: ``sustained_ratio``, the rate of 8192**3 GEMMs run back to back for
  ``SUSTAIN_S`` seconds (the last part of it) over the GEMM table's rate at that size (short
  bursts), as a training step's seconds of work see clocks drop;
* every rank: the host figures of :mod:`behemoth.planner.host`, from behemoth's tiny GPT (hidden
  64, 128 tokens: kernels that take no time) at 2 and 6 blocks: per block, the seconds of one
  training step (``engine.step``), the host's issue seconds of it (from an idle device to the
  executor's return: what the host itself spends, not what it then waits for the device and the
  other ranks) and the kernels it launches (the profiler's count), serially and under 1D tensor
  parallelism over the world (2D too when the world is a square), each depth's raw step kept
  (``extra.host_blocks``): ``host_block_kernels`` and ``host_kernel_s`` (seconds per kernel)
  from the serial block's issue seconds; ``host_call_s[mode]`` (issue seconds per collective call
  beyond the serial block's kernels and those the layout's layers add, counted from the code as the
  cost model counts them) and ``kernels_per_call[mode]`` (each mode's measured extra kernels per
  collective call), the calls counted as the cost model counts them (:func:`fit_host`; ``--refit-host``
  applies it to an earlier calibration's recorded blocks);
  ``host_forward_share``, a serial block's forward (recording its graph, no backward) over its
  whole step, per block.
  The JSON is written before this part and again after it, so a failure there keeps the rest.

Link classes it cannot measure (the inter-node fabric on one node) keep the shipped
calibration's figures, and ``source`` says which figures were measured. Prints the JSON too.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from behemoth.planner.calibration import _interp, load_calibration


def _time(fn, warmup: int = 2, iters: int = 5) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters


def gemm_points() -> list[list[float]]:
    shapes = []
    for tokens in (2048, 8192, 16384):
        for h in (1024, 2048, 4096):
            for split in (1, 2, 4, 8):
                shapes += [(tokens, 3 * h // split, h), (tokens, h, 4 * h // split), (tokens, h, h // split)]
    shapes += [(256, 256, 256), (512, 512, 512), (1024, 1024, 1024), (8192, 8192, 8192)]
    by_flops: dict[float, list[float]] = {}
    for m, n, k in sorted(set(shapes)):
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
        t = _time(lambda: a @ b, iters=10 if m * n * k < 2**33 else 3)
        flops = 2.0 * m * n * k
        by_flops.setdefault(float(2 ** round(torch.log2(torch.tensor(flops)).item())), []).append(flops / t)
    return [[f, sum(r) / len(r)] for f, r in sorted(by_flops.items())]


GROUPED_SHAPES = ((4, 2048, 5632), (64, 2048, 1024))
"""(groups, hidden H, expert width I) of :func:`grouped_call_by_rows`: the mixtral-4b preset's
experts, 8 of them over 2 expert-parallel ranks (few wide groups), and the olmoe-1b-7b preset's 64
on one rank (many narrow ones)."""
GROUPED_ROWS = (128, 256, 512, 1024, 2048, 4096, 8192)
"""Rows per group :func:`grouped_call_by_rows` measures at: what 1-8 ranks' micro-batches of 1-8
sequences of 2,048 tokens give such experts (``T k ep / E``)."""


def grouped_call_by_rows(gemm: list[list[float]]) -> list[list[float]]:
    """``[[rows per group, grouped_call_vs_table], ...]``: the time the GEMM table (``gemm``, this
    run's points, short bursts as these are) gives the whole call's GEMMs -- every group's rows as
    one GEMM, the fused gate/up ``[G rows, H] @ [H, 2I]`` and the down projection ``[G rows, I] @ [I,
    H]``, each forward and its input and weight gradients -- over the time ``torch._grouped_mm``
    takes for the groups, as ``parallel/expert/grouped.py`` runs the experts' SwiGLU GEMMs, for
    :data:`GROUPED_ROWS` rows per group, the mean over :data:`GROUPED_SHAPES` (the two presets'
    experts measure within about 20% of each other at a given rows per group; against one group's
    GEMM they differ up to 4 times, which is why the whole call is the reference). The GEMMs alone:
    the cost model counts the activation between them as elementwise work, and the gradients come
    from ``torch.autograd.grad`` (no accumulation into ``.grad``). Not a loop of per-group
    ``F.linear`` calls: their launches and the concatenation are host and copy time the table's
    rates, which the cost model scales, never pay. Empty where the grouped kernel does not run (no
    ``torch._grouped_mm``, compute capability below 9.0)."""
    if not hasattr(torch, "_grouped_mm") or torch.cuda.get_device_capability() < (9, 0):
        return []
    points = [(float(f), float(r)) for f, r in gemm]

    def table(m: int, n: int, k: int) -> float:  # one GEMM, forward and both gradients (as many flops each)
        flops = 2.0 * m * n * k
        return 3 * flops / _interp(points, flops)

    out = []
    for rows in GROUPED_ROWS:
        ratios = []
        for groups, h, i in GROUPED_SHAPES:
            expected = table(groups * rows, 2 * i, h) + table(groups * rows, h, i)
            ratios.append(expected / _grouped_seconds(groups, rows, h, i, iters=10 if groups * rows < 65536 else 5))
        out.append([float(rows), min(sum(ratios) / len(ratios), 4.0)])  # the planner's bound: past it, a broken timer
    return out


def _grouped_seconds(groups: int, rows: int, h: int, i: int, device: str = "cuda", iters: int = 5) -> float:
    """Seconds of the experts' grouped GEMMs (:func:`grouped_call_by_rows`) for ``groups`` groups of
    ``rows`` rows, hidden ``h``, expert width ``i``, in bf16."""
    n = groups * rows
    kw = dict(device=device, dtype=torch.bfloat16)
    x = torch.randn(n, h, **kw, requires_grad=True)
    mid = torch.randn(n, i, **kw, requires_grad=True)
    gate_up = torch.randn(groups, 2 * i, h, **kw, requires_grad=True)  # [E, 2I, H], the library's layout
    down = torch.randn(groups, h, i, **kw, requires_grad=True)  # [E, H, I]
    g_up, g_down = torch.randn(n, 2 * i, **kw), torch.randn(n, h, **kw)
    offsets = torch.arange(1, groups + 1, device=device, dtype=torch.int32) * rows

    def grouped():
        up = torch._grouped_mm(x, gate_up.transpose(-2, -1), offs=offsets)
        torch.autograd.grad(up, (x, gate_up), g_up)
        y = torch._grouped_mm(mid, down.transpose(-2, -1), offs=offsets)
        torch.autograd.grad(y, (mid, down), g_down)

    return _time(grouped, iters=iters)


def _attention_point(b: int, n: int, s: int, d: int, kv: int | None = None) -> tuple[float, float]:
    """(forward flops/s, backward rate / forward rate) of causal SDPA on ``[b, n, s, d]`` queries
    and ``kv`` key/value heads (default ``n``; fewer: grouped-query attention, ``enable_gqa``)."""
    kv = kv or n
    q = torch.randn(b, n, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(b, kv, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    gqa = {"enable_gqa": True} if kv != n else {}
    flops = 2.0 * b * s * s * d * n  # causal: half of 4 b s^2 d n
    fwd = _time(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, **gqa))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, **gqa)
    g = torch.randn_like(out)

    def both():
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, **gqa)
        o.backward(g)

    bwd = _time(both) - fwd
    return flops / fwd, (2.5 * flops / max(bwd, 1e-9)) / (flops / fwd)


def attention() -> tuple[float, float, list[list[float]]]:
    """The forward rate and backward ratio at 2048 and 4096 tokens (their means), and by sequence
    length from 1,024 to 16,384 (32 heads of 128, 16,384 tokens a call) as ``[seq, rate, ratio]``."""
    rates, ratios = zip(*(_attention_point(b, n, s, d) for b, n, s, d in ((4, 16, 2048, 128), (2, 32, 4096, 128))))
    by_seq = [[float(s), *_attention_point(max(1, 16384 // s), 32, s, 128)] for s in (1024, 2048, 4096, 8192, 16384)]
    return sum(rates) / len(rates), sum(ratios) / len(ratios), by_seq


def hbm() -> float:
    x = torch.empty(2**28, device="cuda", dtype=torch.float32)  # 1 GiB
    y = torch.empty_like(x)
    t = _time(lambda: y.copy_(x), iters=5)
    return 2 * x.numel() * 4 / t


ELEMENTWISE_BLOCKS = ("gpt-6.7b", "llama-8b")
ELEMENTWISE_BATCHES = (2, 4)
"""The blocks and batches of 2,048-token sequences :func:`elementwise_rate` times."""
_NOT_ELEMENTWISE = ("gemm", "nvjet", "xmma", "cutlass", "splitk", "flash", "fmha", "attention", "memcpy", "memset")


def is_elementwise_kernel(name: str) -> bool:
    """A kernel the blocks' non-GEMM work launches: not a GEMM (cuBLAS's and CUTLASS's names,
    split-K's reduction), not attention (flash, fused MHA), not a copy or fill the runtime issues."""
    low = name.lower()
    return not any(k in low for k in _NOT_ELEMENTWISE)


def elementwise_rate() -> float:
    """Bytes per second of a block's non-GEMM kernels (``elementwise_bytes_per_s``): one serial
    block of each of :data:`ELEMENTWISE_BLOCKS` (bf16 autocast over fp32 parameters, as training
    runs them) forward and backward at each of :data:`ELEMENTWISE_BATCHES`; the profiler's
    durations of its kernels that are not GEMMs or attention (:func:`is_elementwise_kernel`), at
    the larger batch less the smaller, over the bytes ``planner.elementwise`` counts for the
    tokens added (the weights' casts and gradient sums, the same at both, drop out)."""
    from torch.profiler import ProfilerActivity, profile

    from behemoth.models import build_model
    from behemoth.planner.elementwise import block_elementwise_bytes
    from behemoth.planner.workload import workload_for

    seq, moved, seconds = 2048, 0.0, 0.0
    for family in ELEMENTWISE_BLOCKS:
        model = build_model(family, vocab_size=512, seq_len=seq, num_layers=1, device="cuda")
        llama = hasattr(model, "layers")
        block = (model.layers if llama else model.blocks)[0]
        e = block_elementwise_bytes(workload_for(model, global_batch=1).shape)
        per_token = e.hidden_forward + e.split_forward + e.hidden_backward + e.split_backward
        spent = []
        for batch in ELEMENTWISE_BATCHES:
            x = torch.randn(batch, seq, model.config.hidden, device="cuda", requires_grad=True)
            args = (x, torch.arange(seq, device="cuda").unsqueeze(0)) if llama else (x,)
            g = torch.randn_like(x)

            def step():
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    y = block(*args)
                y.backward(g)

            for _ in range(2):
                step()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    step()
                torch.cuda.synchronize()
            kernels = [ev for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA]
            spent.append(sum(ev.time_range.elapsed_us() for ev in kernels if is_elementwise_kernel(ev.name)) / 3e6)
        added = (ELEMENTWISE_BATCHES[1] - ELEMENTWISE_BATCHES[0]) * seq
        moved += per_token * added
        seconds += spent[1] - spent[0]
    torch.cuda.empty_cache()
    if not seconds > 0:
        raise RuntimeError(f"no elementwise kernel time measured ({seconds} s)")
    return moved / seconds


def host_rates() -> tuple[float, float]:
    """Pinned host->device and device->host copy rates (bytes/s) of one GPU."""
    n = 2**27  # 512 MiB of fp32
    host = torch.empty(n, dtype=torch.float32).pin_memory()
    dev = torch.empty(n, device="cuda", dtype=torch.float32)
    h2d = n * 4 / _time(lambda: dev.copy_(host, non_blocking=True), iters=3)
    d2h = n * 4 / _time(lambda: host.copy_(dev, non_blocking=True), iters=3)
    return h2d, d2h


def cpu_adam_rate(world: int) -> tuple[float, float]:
    """Parameters per second one rank's CPU AdamW updates while every rank of the host updates
    at once, each with the threads its launch gave it: the kernel the offloaded chunks run (the
    ZeRO optimizer gives host masters the fused CPU kernel; ``parallel/zero/measure.py``'s
    :func:`cpu_update_rate`, which ``offload='auto'`` also measures with), the slowest rank's
    rate; with the device idle (the rate the cost model reads), then while pinned copies run both
    ways between the host and the device (kept in ``extra``: on one H200 host 2.92 G parameters/s
    against 3.68 idle, yet in a Llama-8B step beside such copies the update ran at the idle rate;
    what slowed it under bf16 parameters was the host's cast of each updated chunk, which the cost
    model charges on its own: :data:`behemoth.planner.cost.HOST_CAST_SHARE`). Timed in a worker thread set up as
    ``parallel/zero/overlap.py``'s (the thread the update runs in during the backward; the H100 host
    of benchmarks/RESULTS.md ran fused AdamW at 3.61 G parameters/s there against 4.87 in the main
    thread). The ranks share the host's memory bandwidth in a step, so one rank alone (the others
    idle) would measure more than each gets; the foreach kernel, measured here before, runs several
    times slower than the fused one (the cost model read it as the fused one's rate)."""
    from concurrent.futures import ThreadPoolExecutor

    from behemoth.parallel.zero.auto import FUSED_CPU
    from behemoth.parallel.zero.measure import cpu_update_rate

    rates = []
    with ThreadPoolExecutor(1, initializer=torch.set_num_threads, initargs=(torch.get_num_threads(),)) as pool:
        for busy in (False, True):
            if world > 1:
                dist.barrier()
            if busy:  # ~1 s of copies each way on two side streams (at ~50 GB/s), queued before the update
                n = 2**28  # 1 GiB of fp32 a buffer
                host = [torch.empty(n).pin_memory() for _ in range(2)]
                dev = [torch.empty(n, device="cuda") for _ in range(2)]
                streams = [torch.cuda.Stream() for _ in range(2)]
                for _ in range(48):
                    with torch.cuda.stream(streams[0]):
                        dev[0].copy_(host[0], non_blocking=True)
                    with torch.cuda.stream(streams[1]):
                        host[1].copy_(dev[1], non_blocking=True)
            rates.append(pool.submit(cpu_update_rate, torch.optim.AdamW, {"lr": 1e-3}, FUSED_CPU).result() / 4)
            torch.cuda.synchronize()
    rate = torch.tensor(rates, device="cuda")
    if world > 1:
        dist.all_reduce(rate, op=dist.ReduceOp.MIN)
    idle, busy = rate.tolist()
    return idle, busy


def collectives(world: int, local: int) -> dict[str, list[list[float]]]:
    """[group, latency_s, bus_bytes_per_s] per link class, from all-reduces over groups of ranks
    0..g-1 (every rank takes part in creating each group)."""
    out: dict[str, list[list[float]]] = {"nvlink": [], "ib": []}
    g = 2
    while g <= world:
        group = dist.new_group(list(range(g)))
        if dist.get_rank() < g:
            small = torch.ones(2048, device="cuda")
            big = torch.ones(2**26, device="cuda")  # 256 MiB
            lat = _time(lambda: dist.all_reduce(small, group=group), warmup=5, iters=20)
            t = _time(lambda: dist.all_reduce(big, group=group), warmup=2, iters=5)
            bus = 2 * (g - 1) / g * big.numel() * 4 / t
            out["nvlink" if g <= local else "ib"].append([g, lat, bus])
        dist.barrier()
        g *= 2
    return out


def _outside(dev) -> float:
    """Device memory in use beyond what PyTorch's allocator holds (the most on any rank)."""
    torch.cuda.synchronize(dev)
    free, total = torch.cuda.mem_get_info(dev)
    t = torch.tensor([float(total - free - torch.cuda.memory_reserved(dev))], device=dev, dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _touch(group) -> None:
    """One collective of each size class NCCL picks its algorithm and protocol by, so each
    connects the buffers it uses (they are set up at first use)."""
    for n in (2048, 2**18, 2**24):
        x = torch.ones(n, device="cuda")
        dist.all_reduce(x, group=group)
        out = torch.empty(n * dist.get_world_size(group), device="cuda")
        dist.all_gather_into_tensor(out, x, group=group)
        dist.reduce_scatter_tensor(x[: n // dist.get_world_size(group)], out[:n], group=group)
    torch.cuda.synchronize()


def device_memory(world: int, dev) -> dict[str, float]:
    """What :mod:`behemoth.planner.reserve` reads: the device memory outside PyTorch's allocator
    of the CUDA context (after a GEMM: its libraries' handles too) and, on several ranks, of one
    communicator's NCCL buffers once it has run collectives (the world's; then 2-rank groups like
    a mesh axis's, every rank in one of each) and of one 2-rank point-to-point channel once it
    has carried a small and a 4 MiB message each way (as a pipeline's channels connect)."""
    a = torch.randn(256, 256, device=dev)
    (a @ a).sum().item()
    out = {"cuda_context_bytes": _outside(dev)}
    if world < 2:
        return out
    before = _outside(dev)
    _touch(None)
    out["nccl_comm_bytes"] = _outside(dev) - before
    rank, made = dist.get_rank(), []
    pairs = [[[i, i ^ 1] for i in range(0, world - world % 2, 2)]]  # neighbours
    if world >= 4:
        pairs.append([[i, i ^ 2] for i in range(world - world % 4)])  # one further
    before, n = _outside(dev), 0
    for axis in pairs:
        for members in sorted({tuple(sorted(p)) for p in axis}):
            g = dist.new_group(list(members))
            made.append(g)
            if rank in members:
                _touch(g)
                n += 1
        dist.barrier()
    per = torch.tensor([float(n)], device=dev)
    dist.all_reduce(per, op=dist.ReduceOp.MIN)
    if per.item() > 0:
        out["nccl_comm_bytes"] = max(out["nccl_comm_bytes"], (_outside(dev) - before) / per.item())
    before, n = _outside(dev), 0
    for src in range(0, world - world % 2, 2):
        for s, d in ((src, src + 1), (src + 1, src)):  # one-way channels, as a pipeline's are
            g = dist.new_group(sorted((s, d)))
            made.append(g)
            for size in (8, 1 << 20):
                if rank == s:
                    dist.send(torch.zeros(size, device=dev), d, group=g)
                elif rank == d:
                    dist.recv(torch.empty(size, device=dev), s, group=g)
            n += rank in (s, d)
            dist.barrier()
    torch.cuda.synchronize(dev)
    per = torch.tensor([float(n)], device=dev)
    dist.all_reduce(per, op=dist.ReduceOp.MIN)
    if per.item() > 0:
        out["nccl_p2p_bytes"] = (_outside(dev) - before) / per.item()
    for g in made:  # their buffers would count against the figures measured after this
        dist.destroy_process_group(g)
    return out


def overlap_slowdown() -> float:
    """(GEMMs beside an all-reduce - GEMMs alone) / the all-reduce alone, clamped to [0, 1]. Every
    rank runs the same collectives in the same order; the GEMMs outlast the all-reduce."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    buf = torch.ones(2**26, device="cuda")  # 256 MiB
    side = torch.cuda.Stream()

    def gemms():
        for _ in range(4):
            a @ b

    def reduce():
        dist.all_reduce(buf)

    def both():
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            dist.all_reduce(buf)
        gemms()
        torch.cuda.current_stream().wait_stream(side)

    t_gemm = _time(gemms, iters=5)
    t_reduce = _time(reduce, iters=5)
    t_both = _time(both, iters=5)
    return min(max((t_both - t_gemm) / t_reduce, 0.0), 1.0)


SUSTAIN_S = 3.0
"""Seconds of back-to-back GEMMs for ``sustained_ratio`` (the rate of the last two thirds)."""


def sustained_ratio(gemm_table: list[list[float]] | None) -> float:
    """The rate of 8192**3 bf16 GEMMs run back to back for ``SUSTAIN_S`` seconds (the last two
    thirds) over the GEMM table's rate at that size, clamped to [0.5, 1]. Every rank runs it at
    once (the node's power draw is a training step's); rank 0, which measured the table, answers."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    flops = 2.0 * 8192**3
    t0 = time.perf_counter()
    rates = []
    while time.perf_counter() - t0 < SUSTAIN_S:
        t = _time(lambda: a @ b, warmup=0, iters=20)
        rates.append((time.perf_counter() - t0, flops / t))
    late = [r for at, r in rates if at > SUSTAIN_S / 3] or [rates[-1][1]]
    if not gemm_table:
        return 1.0
    table = _interp([tuple(p) for p in sorted(gemm_table)], flops)
    return min(max(sum(late) / len(late) / table, 0.5), 1.0)


HOST_LAYERS = (2, 6)
HOST_STEPS = 6


def _tiny_engine(layers: int, plan, dev):
    import behemoth as bh
    from behemoth.models import build_model

    model = build_model("gpt-tiny", vocab_size=512, seq_len=128, num_layers=layers, device=dev)
    engine = bh.boost(model, torch.optim.SGD(model.parameters(), lr=1e-3), plan)
    x = torch.randint(0, 512, (2 * engine.dp_size, 129), device=dev, generator=torch.Generator(dev).manual_seed(0))
    share = x[engine.dp_rank * 2 : engine.dp_rank * 2 + 2]
    batch = {"input_ids": share[:, :-1], "labels": share[:, 1:]}
    return engine, batch


def _host_step(layers: int, plan, dev) -> tuple[float, int, int, float]:
    """(seconds per step, kernels per step, NCCL kernels per step, host issue seconds per step) of
    the tiny GPT under ``plan``. The issue seconds run from an idle device (synchronized, ranks
    aligned by a barrier) to the return of the step executor's ``run`` (every micro-batch's forward
    and backward issued, before the loss's read waits for the device): the host's own time, without
    what it then waits for -- a chain of dependent collectives, each at the device's and its peers'
    latency, which a block with almost no work cannot hide and a real model's GEMMs do."""
    from torch.profiler import ProfilerActivity, profile

    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    engine, batch = _tiny_engine(layers, plan, dev)
    for _ in range(2):
        engine.step(batch)
    sync()
    if dist.is_initialized():
        dist.barrier()
    t0 = time.perf_counter()
    for _ in range(HOST_STEPS):
        engine.step(batch)
    sync()
    seconds = (time.perf_counter() - t0) / HOST_STEPS
    issued, run = [], engine.executor.run

    def timed_run(*args, **kwargs):
        out = run(*args, **kwargs)
        issued.append(time.perf_counter())
        return out

    engine.executor.run = timed_run
    issue = 0.0
    for _ in range(HOST_STEPS):
        if dist.is_initialized():
            dist.barrier()
        sync()
        issued.clear()
        t0 = time.perf_counter()
        engine.step(batch)
        issue += issued[0] - t0
    sync()
    engine.executor.run = run
    issue /= HOST_STEPS
    cuda = dev.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        engine.step(batch)
        sync()
    events = prof.events()
    if cuda:  # the device timeline also shows each collective call's record function ("nccl:..."): not a kernel
        kernels = [e.name for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        kernels = [k for k in kernels if not k.startswith(("Memcpy", "Memset", "nccl:", "gloo:"))]
        launches = sum(e.name.startswith(("cudaLaunchKernel", "cuLaunchKernel")) for e in events)
        count = max(len(kernels), launches)  # the kernels, or their launches where the trace lacks them
    else:  # no kernels on a CPU: the leaf operators stand in (a smoke run of this code)
        kernels = [e.name for e in events if e.name.startswith("aten::") and not e.cpu_children]
        count = len(kernels)
    calls = max(sum("nccl" in k.lower() for k in kernels), sum(e.name.startswith(("nccl:", "gloo:")) for e in events))
    return seconds, count, calls, issue


def _host_forward(layers: int, plan, dev) -> float:
    """Host seconds of one forward (with the loss, recording the graph, no backward) of the tiny GPT."""
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    engine, batch = _tiny_engine(layers, plan, dev)

    def forward() -> None:
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            logits = engine.model(batch["input_ids"])
        F.cross_entropy(logits.float().flatten(0, 1), batch["labels"].flatten())

    for _ in range(2):
        forward()
    sync()
    t0 = time.perf_counter()
    for _ in range(HOST_STEPS):
        forward()
    sync()
    return (time.perf_counter() - t0) / HOST_STEPS


def host_figures(world: int, dev) -> dict:
    """The host figures of behemoth.planner.host (see the module docstring); every rank runs it."""

    plans = host_plans(world)
    per_block, steps = {}, {}
    for mode, plan in plans.items():
        lo, hi = (_host_step(n, plan, dev) for n in HOST_LAYERS)
        span = HOST_LAYERS[1] - HOST_LAYERS[0]
        per_block[mode] = [max((h - l) / span, 0.0) for h, l in zip(hi, lo)]
        # the raw steps too (seconds, kernels, NCCL kernels at each depth), so a later fit can redo the slope
        steps[mode] = {str(n): list(v) for n, v in zip(HOST_LAYERS, (lo, hi))}
    blocks = {m: dict(seconds=v[0], kernels=v[1], nccl=v[2], issue=v[3], steps=steps[m]) for m, v in per_block.items()}
    out = fit_host(blocks, world)
    lo, hi = (_host_forward(n, plans["serial"], dev) for n in HOST_LAYERS)
    forward = max(hi - lo, 0.0) / (HOST_LAYERS[1] - HOST_LAYERS[0])
    seconds = blocks["serial"]["seconds"]
    if seconds > 0 and 0 < forward < seconds:
        out["host_forward_share"] = forward / seconds
    out["host_blocks"] = blocks
    return out


def host_plans(world: int) -> dict:
    """The layouts the host figures time the tiny GPT under: serial (data parallel), 1D tensor
    parallelism over the world and, when the world is a square, 2D."""
    import behemoth as bh

    plans = {"serial": bh.Plan(dp=world, precision="bf16")}
    if world > 1:
        plans["1d"] = bh.Plan(tp=world, precision="bf16")
        q = round(world**0.5)
        if q > 1 and q * q == world:
            plans["2d"] = bh.Plan(tp=world, tp_mode="2d", precision="bf16")
    return plans


def fit_host(blocks: dict, world: int) -> dict:
    """The host figures from one block's host seconds, kernels and NCCL kernels per step
    (``blocks[mode]``, the tiny GPT's): ``host_kernel_s`` and ``host_block_kernels`` from the
    serial block; per tensor-parallel mode, ``host_call_s`` from its seconds beyond the serial
    block's kernels and the kernels its layers add (``planner.host.tp_block_kernels``, counted from
    the code, as the cost model counts them) per collective call, the calls counted as the cost
    model counts them (``planner.host_calls.tp_block_calls`` of the same model and layout), so the model
    reproduces each measured block; ``kernels_per_call`` the measured extra kernels per call (the
    cost model reads 1D's for other axes' calls; the other modes' are the measurement, kept). A
    profile that listed each call's record function beside its NCCL kernel (as this script's counts
    did before it left them out) shows more NCCL entries than calls: those are not kernels.
    ``kernels_per_collective`` (other axes' calls, modes not measured): 1D's.

    The seconds fitted are a block's host issue seconds (``issue``) where the blocks recorded them,
    else (an older calibration's) its step seconds, which also hold what the host then waited for
    at the step's end: in a block with almost no work, a chain of dependent collectives at the
    device's and the other ranks' latency, which does not grow with the host's calls (a real
    model's GEMMs hide it), so the per-call figure fitted from them is too large."""
    from behemoth.models import build_config
    from behemoth.planner.host import tp_block_kernels
    from behemoth.planner.host_calls import tp_block_calls
    from behemoth.planner.workload import workload_for

    def host_seconds(b: dict) -> float:
        return b["issue"] if b.get("issue") is not None else b["seconds"]

    serial = blocks["serial"]
    per_kernel = host_seconds(serial) / max(serial["kernels"], 1.0)
    out = {"host_block_kernels": serial["kernels"], "host_kernel_s": per_kernel, "host_call_s": {}}
    out["kernels_per_call"] = {}
    w = workload_for(build_config("gpt-tiny", vocab_size=512, seq_len=128), global_batch=1)
    plans = host_plans(world)
    for mode in ("1d", "2d"):
        if mode not in blocks:
            continue
        plan = plans[mode].resolve(world)
        calls = sum(tp_block_calls(plan, w))
        b = blocks[mode]
        kernels = b["kernels"] - max(b["nccl"] - calls, 0.0)
        counted = serial["kernels"] + sum(tp_block_kernels(plan, w))
        if calls > 0:
            out["host_call_s"][mode] = max(host_seconds(b) - counted * per_kernel, 0.0) / calls
            out["kernels_per_call"][mode] = max(kernels - serial["kernels"], 0.0) / calls
    if "1d" in out["kernels_per_call"]:
        out["kernels_per_collective"] = out["kernels_per_call"]["1d"]
    return out


def refit_host(src: str, out: str) -> None:
    """``--refit-host``: ``src``'s host figures fitted again (:func:`fit_host`) from the blocks
    it recorded; the modes it did not measure keep their figures."""
    with open(src) as f:
        d = json.load(f)
    blocks = d.get("extra", {}).get("host_blocks")
    if not blocks:
        raise SystemExit(f"calibrate: {src} recorded no host blocks (extra.host_blocks) to fit")
    host = fit_host(blocks, int(d["extra"].get("world", 1)))
    for k in ("host_call_s", "kernels_per_call"):
        host[k] = {**d.get(k, {}), **host[k]}
    d.update(host)
    write(d, out)


def write(d: dict, path: str) -> None:
    text = json.dumps(d, indent=1)
    with open(path, "w") as f:
        f.write(text + "\n")
    print(text, flush=True)
    load_calibration(path)  # the file reads back


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, help="where to write the calibration JSON")
    ap.add_argument("--base", default="h100", help="shipped calibration whose unmeasured figures are kept")
    ap.add_argument(
        "--refit-host",
        default="",
        help="a calibration JSON: fit its host figures again from the blocks it recorded (extra.host_blocks), "
        "write it to --out and stop (no GPU)",
    )
    a = ap.parse_args()
    if a.refit_host:
        return refit_host(a.refit_host, a.out)
    t_start = time.perf_counter()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    rank = dist.get_rank() if world > 1 else 0
    local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    measured = ["gemm", "attention", "hbm", "host", "cpu_adam", "gpu memory"]
    d = json.loads(load_calibration(a.base).to_json())
    try:
        mem = device_memory(world, torch.device("cuda", torch.cuda.current_device()))
    except Exception as e:  # keep the rest of the calibration: the planner falls back to reserved_bytes
        print(f"calibrate: device memory not measured ({type(e).__name__}: {e})", file=sys.stderr, flush=True)
        mem = {}
    if mem:
        d.update(mem)
        measured.append("device memory outside the allocator (" + ", ".join(mem) + ")")
    if rank == 0:
        d["gemm"] = gemm_points()
        d["attention_flops_per_s"], d["attention_backward_ratio"], d["attention_by_seq"] = attention()
        # grouped-query attention (Llama-3-8B's 32 query heads over 8 kv heads) beside the same
        # shape with every head its own (kept in extra, not read: a check of the backend GQA takes)
        gqa, mha = (_attention_point(4, 32, 2048, 128, kv) for kv in (8, 32))
        d.setdefault("extra", {})["attention_gqa_2048"] = dict(gqa=list(gqa), mha=list(mha))
        d["hbm_bytes_per_s"] = hbm()
        try:
            d["elementwise_bytes_per_s"] = elementwise_rate()
            measured.append("elementwise_bytes_per_s")
        except Exception as e:  # keep the rest: the planner falls back to hbm_bytes_per_s
            print(f"calibrate: elementwise rate not measured ({type(e).__name__}: {e})", file=sys.stderr, flush=True)
        try:
            by_rows = grouped_call_by_rows(d["gemm"])
            if by_rows:
                d["grouped_call_by_rows"] = by_rows
                d["grouped_call_vs_table"] = sum(r for _, r in by_rows) / len(by_rows)
                measured.append("grouped_call_by_rows")
        except Exception as e:  # keep the rest: the planner takes the dense GEMM table's rate
            print(f"calibrate: grouped GEMMs not measured ({type(e).__name__}: {e})", file=sys.stderr, flush=True)
        d["h2d_bytes_per_s"], d["d2h_bytes_per_s"] = host_rates()
        d["gpu_bytes"] = float(torch.cuda.get_device_properties(0).total_memory)
    adam, busy = cpu_adam_rate(world)
    if rank == 0:
        d["cpu_adam_params_per_s"] = adam
        d.setdefault("extra", {}).update(
            cpu_adam_threads=torch.get_num_threads(), cpu_adam_with_copies_params_per_s=busy
        )
    if world > 1:
        links = collectives(world, local)
        for k, pts in links.items():
            if pts:
                d["links"][k] = pts
                measured.append(f"{k} collectives")
        d["overlap_slowdown"] = overlap_slowdown()
        measured.append("overlap_slowdown")
    ratio = sustained_ratio(d["gemm"] if rank == 0 else None)
    if rank == 0:
        d["sustained_ratio"] = ratio
        measured.append("sustained_ratio")
    name = torch.cuda.get_device_name(0)

    def stamp() -> None:
        d["name"] = f"{name.lower().replace(' ', '-')}-measured"
        d["source"] = (
            f"measured by benchmarks/calibrate.py on {world} x {name} in {time.perf_counter() - t_start:.0f} s: "
            f"{', '.join(measured)}; other figures from the shipped {a.base} calibration (estimated)"
        )
        d["extra"] = {**d.get("extra", {}), "torch": torch.__version__, "world": world}

    if rank == 0:
        stamp()
        write(d, a.out)
    try:
        host = host_figures(world, torch.device("cuda", torch.cuda.current_device()))
    except Exception as e:  # keep what was measured: the file above stands
        print(f"calibrate: host figures not measured ({type(e).__name__}: {e})", file=sys.stderr, flush=True)
        host = None
    if rank == 0 and host is not None:
        d["extra"] = {**d.get("extra", {}), "host_blocks": host.pop("host_blocks")}
        for k in ("host_call_s", "kernels_per_call"):  # modes not measured: the base's
            host[k] = {**d.get(k, {}), **host[k]}
        d.update(host)
        measured.append("host issue")
        stamp()
        write(d, a.out)
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

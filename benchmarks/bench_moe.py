"""GPU benchmark of mixture-of-experts under expert parallelism, in three parts, one RESULT json
line per measurement (rank 0 prints it; times are the slowest rank's):

    torchrun --standalone --nproc-per-node 2 benchmarks/bench_moe.py --part dispatch,layer
    torchrun --standalone --nproc-per-node 2 benchmarks/bench_moe.py --part model --size mixtral-4b
    torchrun --standalone --nproc-per-node 2 benchmarks/bench_moe.py --part layer,model --chunks 1,2,4
    torchrun --standalone --nproc-per-node 2 benchmarks/bench_moe.py --part all --tiny --device cpu  # smoke, gloo

``dispatch`` (``what: moe-dispatch``): behemoth's own :func:`~behemoth.parallel.expert.dispatch.dispatch`
and :func:`~behemoth.parallel.expert.dispatch.combine` over ``ep = world`` (4,096 tokens per rank,
hidden 4,096, 8 experts, top-2, bf16, random router logits through
:func:`~behemoth.models.moe.route`): median µs of each forward (the sort by expert, the split-size
all-to-all and its host read, the row all-to-all and the permutations included), of a
dispatch -> combine -> backward round trip, and of the bare ``all_to_all_single`` of the same rows
(the communication floor). CUDA events around each call, every call after a barrier. With
``--precisions autocast`` also as ``Plan(precision="bf16")`` runs it, inside bf16 autocast: fp32
tokens of the residual stream in, sent as bf16 rows (dispatch casts them before the exchange, as
the experts' GEMMs would after it), the experts' bf16 rows combined back into fp32. Each line says
the rows' dtype on the wire (``wire_dtype``) and the padding of the experts' groups (``align``:
16 where the grouped GEMMs run, as the layer dispatches them; 1 elsewhere), and per call the ATen
ops run (``ops``: about one kernel each on a GPU) and the host syncs CUDA's sync debug mode reports
(``host_syncs``: a value read with ``item``/``tolist``, a blocking copy; null on the CPU; the
dispatch's one wait for its split sizes, an event, is not among them).

``--host-only`` (dispatch; one process, no torchrun): the host's work of the same dispatch and
combine, and of their backward, over an ep axis (``--ep``, default 2) whose all-to-alls hand
the rows sent back (:func:`part_dispatch_host`): a ``HOST`` json line per precision with the
ATen ops, the all-to-all calls and the median µs of each part (with ``--align 16``: the groups
padded as on a GPU). At small shapes (``--dispatch-tokens 512 --hidden 64``) the time is the
host's overhead, which bounds the dispatch on a GPU::

    python benchmarks/bench_moe.py --host-only --dispatch-tokens 512 --hidden 64 --align 16 --iters 500

``layer`` (``what: moe-layer``): one :class:`~behemoth.models.moe.MoEFeedForward` (hidden 4,096,
expert FFN 14,336, 8 experts, top-2) under :class:`~behemoth.parallel.expert.ExpertParallel` at
``ep = world``, 16k tokens per rank, forward + backward, against a dense SwiGLU
(:func:`~behemoth.models.moe.swiglu_expert`, width ``top_k * 14,336``) on the same GPU in the same
process. Routing is steered through the router's input (``moe_routing.py``):
``balanced`` (every expert exactly ``T*k/E`` assignments), ``uniform`` (experts drawn uniformly,
balanced in expectation), ``zipf`` (expert e drawn with probability ~ ``(e+1)^-s``, s = 1.2: the
hottest experts all on ep rank 0, the worst case for contiguous expert blocks) and
``zipf-spread`` (the same popularity, the hottest experts alternating between ep ranks).
``--precisions bf16,autocast``: bf16 parameters and input (default), or fp32 parameters and input
under bf16 autocast (what ``Plan(precision="bf16")`` trains with: the residual stream stays fp32;
the dispatch sends its rows in bf16 and the grouped GEMMs cast the fp32 expert weights once per
forward).

FLOPs (layer): the expert GEMMs only. Forward ``2*T*k*(H*2I + I*H) = 6*T*k*H*I``, backward twice
that, so ``18*T*k*H*I`` per rank per step for the MoE layer and ``18*T*H*F`` with ``F = k*I`` for
the dense FFN -- the same useful work. The router (``2*T*H*E``), softmax, top-k, SiLU, the
permutations and the all-to-alls are not counted: they are the overhead the ratio measures.
Under skewed routing a rank computes more or fewer rows than its ``T*k``; the figure is still the
nominal ``18*T*k*H*I`` over the step time (useful throughput per GPU).

``model`` (``what: moe-model``): end-to-end training of a preset (``mixtral-4b``: 16 layers,
hidden 2,048, expert FFN 5,632, 8 experts, top-2; ``olmoe-1b-7b``: 64 experts, top-8, FFN 1,024)
with ``bh.boost`` under ``Plan(dp=world, ep=--ep, precision="bf16")`` (bf16 autocast over fp32
parameters, fused AdamW): tokens/s per GPU, MFU on active FLOPs (``Llama.flops_per_token``:
``6 * N_active + 12 * L * H * S``, N_active counting k of E experts per layer, as
``peer_hf_mixtral.py`` counts; peak 989 TFLOP/s) and peak memory.

``--plan`` (model): any layout instead of ``Plan(dp=world, ep=--ep)``, as ``Plan.describe()``
prints it or as ``key=value`` pairs (``--plan "pp=2,microbatches=8,schedule=gpipe"``; bf16 unless it
says otherwise; the flags ``--zero``, ``--ckpt``, ``--offload``, ``--param-dtype`` fill in what it
leaves at its default), with ``--batch`` sequences per step over all data ranks (planner_proof.py's
8 per GPU: ``--batch 16`` on 2 GPUs; default ``--mbs`` per data rank). ``--profile N`` (model):
after the timed steps, N steps under torch.profiler, then one step counting the host's reads of
device values (``step_profile.py``): every rank prints its top CUDA kernels and CPU ops, and a
``PROFILE`` line (wall vs GPU-busy time per step, device-to-host copies and host synchronisations
per step, the host reads by op); ``--trace DIR`` keeps each rank's chrome trace. For example, on
2 GPUs::

    torchrun --standalone --nproc-per-node 2 benchmarks/bench_moe.py --part model --plan "dp=2,ep=2" \
        --mbs 4 --steps 6 --profile 3
    torchrun --standalone --nproc-per-node 2 benchmarks/bench_moe.py --part model \
        --plan "pp=2,microbatches=8,schedule=1f1b" --batch 16 --steps 6 --profile 3
    torchrun --standalone --nproc-per-node 2 benchmarks/bench_moe.py --part model \
        --plan "tp=2,tp_overlap=2,microbatches=4,zero=3" --batch 16 --steps 6 --profile 3

``--combine token-major`` (every part): the combine's weighing as a token-major scatter of the
rows and a sum over k (:func:`token_major_weigh_rows`, the same values) in place of the library's
weighted rows ``index_add_``'ed to their tokens, to measure one against the other; each line says
which (``combine``).

``--chunks 1,2,4`` (layer, model): each figure once per number of chunks the MoE layers split
their tokens into, the all-to-alls overlapped with the experts' GEMMs
(:mod:`behemoth.parallel.expert.overlap`; ``ExpertParallel(chunks=...)``, ``Plan(ep_overlap=...)``;
1 is the exchange at once), each line saying its ``chunks``. The dispatch part measures one chunk.

Every line also says which path behemoth's grouped expert GEMMs took (``paths``: calls through
``torch._grouped_mm`` and through the per-expert loop, :mod:`behemoth.parallel.expert.grouped`).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import functools
import gc
import io
import json
import os
import re
import sys
import time
import warnings

import torch
import torch.distributed as dist
from moe_routing import ROUTINGS, routing_input
from step_profile import profile_steps
from torch.utils._python_dispatch import TorchDispatchMode

import behemoth as bh
from behemoth import comm
from behemoth.mesh import ParallelMesh
from behemoth.models import build_model
from behemoth.models.moe import MoEFeedForward, route, swiglu_expert
from behemoth.parallel.expert import grouped
from behemoth.parallel.expert.dispatch import combine, dispatch
from behemoth.parallel.expert.style import ExpertParallel

PARTS = ("dispatch", "layer", "model")


# ---------------------------------------------------------------- measuring


class PathCount:
    """Calls of :func:`behemoth.parallel.expert.grouped.grouped_swiglu` by path, counted by wrapping
    the function it asks (``grouped_mm_available``); ``take()`` returns the counts and restarts."""

    def __init__(self) -> None:
        self.counts = {"grouped_mm": 0, "loop": 0}
        real = grouped.grouped_mm_available

        def spy(*args):
            ok = real(*args)
            self.counts["grouped_mm" if ok else "loop"] += 1
            return ok

        grouped.grouped_mm_available = spy

    def take(self) -> dict[str, int]:
        out, self.counts = self.counts, {"grouped_mm": 0, "loop": 0}
        return out


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def slowest(value: float, dev: torch.device) -> float:
    """The largest ``value`` over all ranks."""
    t = torch.tensor([value], dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def timed_us(fn, dev: torch.device, iters: int, warmup: int) -> float:
    """Median µs of ``fn()`` over ``iters`` calls after ``warmup`` calls, the slowest rank's. Every
    call starts after a barrier with the device idle, and is timed with CUDA events on a GPU
    (``perf_counter`` on CPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        _sync(dev)
        dist.barrier()
        _sync(dev)
        if dev.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e6)
    return slowest(sorted(times)[len(times) // 2], dev)


class OpCount(TorchDispatchMode):
    """ATen ops run inside the block (each about one kernel on a GPU; the collectives count one)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def counted(fn, dev: torch.device) -> tuple[int, int | None]:
    """``(ATen ops, host syncs)`` of one call of ``fn``: the syncs are those CUDA's sync debug mode
    reports (a value read to the host, a blocking copy), None on the CPU, where nothing syncs."""
    syncs = None
    with OpCount() as ops, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if dev.type == "cuda":
            torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            if dev.type == "cuda":
                torch.cuda.set_sync_debug_mode("default")
                syncs = sum("synchroniz" in str(w.message) for w in caught)
    return ops.ops, syncs


def _peak_gib(dev: torch.device) -> float | None:
    return round(torch.cuda.max_memory_allocated(dev) / 2**30, 2) if dev.type == "cuda" else None


def emit(result: dict) -> None:
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(result), flush=True)


# ---------------------------------------------------------------- the combine's weighing, A/B


class _TokenMajor(torch.autograd.Function):
    """``rows[i]`` to row ``order_A[i]`` of ``[T*K, H]`` (zero where a capacity dropped a slot), viewed
    ``[T, K, H]``; backward the adjoint gather."""

    @staticmethod
    def forward(ctx, rows_AH, order_A, num_tokens: int, top_k: int):
        ctx.save_for_backward(order_A)
        make = rows_AH.new_empty if order_A.numel() == num_tokens * top_k else rows_AH.new_zeros
        out = make((num_tokens * top_k, rows_AH.shape[-1])).index_copy_(0, order_A, rows_AH.contiguous())
        return out.view(num_tokens, top_k, rows_AH.shape[-1])

    @staticmethod
    def backward(ctx, grad_TKH):
        (order_A,) = ctx.saved_tensors
        return grad_TKH.reshape(-1, grad_TKH.shape[-1]).index_select(0, order_A), None, None, None


def token_major_weigh_rows(y_AH: torch.Tensor, weights_TK: torch.Tensor, routed) -> torch.Tensor:
    """``--combine token-major``: the combine's weighing as the rows put token-major by one scatter
    of the permutation, weighed and summed over k (the product's dtype, the tokens' dtype out), in
    place of the library's weighted rows index_add_'ed to their tokens; the same values (for top-2
    the same two terms), no atomics, and no fp32 product kept for the backward."""
    num_tokens, top_k = weights_TK.shape
    y_TKH = _TokenMajor.apply(y_AH, routed.order_A, num_tokens, top_k)
    return (y_TKH * weights_TK.unsqueeze(-1)).sum(1).to(routed.dtype)


def token_major_combine(y_NH: torch.Tensor, weights_TK: torch.Tensor, routed) -> torch.Tensor:
    """``--combine token-major``'s :func:`~behemoth.parallel.expert.dispatch.combine`: the rows
    taken back and sent, then :func:`token_major_weigh_rows` (the library's combine is one
    autograd node with its own weighing)."""
    from behemoth.parallel.expert.dispatch import take_rows

    rows_NH = take_rows(y_NH, routed)
    y_AH = comm.AllToAllSingleAxis.apply(rows_NH, routed.axis, routed.recv_sizes, routed.send_sizes)
    return token_major_weigh_rows(y_AH, weights_TK, routed)


def use_combine(kind: str) -> None:
    """``--combine``: ``index-add`` (the library's) or ``token-major`` (:func:`token_major_weigh_rows`,
    put in the library's place for this process: in its weighing and its combine)."""
    global combine
    if kind == "token-major":
        from behemoth.parallel.expert import dispatch as dispatch_module
        from behemoth.parallel.expert import overlap as overlap_module

        dispatch_module.weigh_rows = overlap_module.weigh_rows = token_major_weigh_rows
        combine = dispatch_module.combine = overlap_module.combine = token_major_combine


# ---------------------------------------------------------------- part 1: dispatch and combine


def part_dispatch(a, dev: torch.device, mesh: ParallelMesh, paths: PathCount) -> None:
    """One RESULT per ``--precisions`` entry: ``bf16`` rows both ways, or ``autocast`` as
    ``Plan(precision="bf16")`` runs it (inside bf16 autocast: the fp32 residual stream dispatched
    as bf16 rows, the experts' bf16 output combined into fp32), the groups padded as the layer
    pads them."""
    T, H, E, K = a.dispatch_tokens, a.hidden, a.experts, a.top_k
    ep = mesh.axis("ep")
    g = torch.Generator(device=dev).manual_seed(1000 + dist.get_rank())
    logits_TE = torch.randn(T, E, device=dev, generator=g)
    _, weights_TK, experts_TK = route(logits_TE, K)
    weights_TK.requires_grad_()  # as the router's output in a layer: combine's product is recorded
    timing = dict(dev=dev, iters=a.iters, warmup=a.warmup)
    for precision in _precisions(a):
        x_dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        x_TH = torch.randn(T, H, device=dev, generator=g).to(x_dtype).requires_grad_()
        dy_TH = torch.randn(T, H, device=dev, dtype=x_dtype, generator=g)  # the combine's output dtype
        autocast = functools.partial(torch.autocast, dev.type, torch.bfloat16, precision == "autocast")
        with autocast():
            align = grouped.group_alignment(x_TH)  # as the layer dispatches
            x_NH, _, routed = dispatch(x_TH, experts_TK, E, ep, align=align)

        def dispatch_only():
            with autocast():
                dispatch(x_TH, experts_TK, E, ep, align=align)

        dispatch_us = timed_us(dispatch_only, **timing)
        y_NH = x_NH.detach().to(torch.bfloat16).requires_grad_()  # stands in for the experts' output

        def combine_only():
            with autocast():
                combine(y_NH, weights_TK, routed)

        combine_us = timed_us(combine_only, **timing)

        def round_trip():
            x_TH.grad = weights_TK.grad = None
            with autocast():
                rows_NH, _, r = dispatch(x_TH, experts_TK, E, ep, align=align)
                y_TH = combine(rows_NH.to(torch.bfloat16), weights_TK, r)
            y_TH.backward(dy_TH)

        round_trip_us = timed_us(round_trip, **timing)
        dispatch_ops, dispatch_syncs = counted(dispatch_only, dev)
        combine_ops, combine_syncs = counted(combine_only, dev)
        round_trip_ops, round_trip_syncs = counted(round_trip, dev)
        with autocast():
            rows_NH, _, r = dispatch(x_TH, experts_TK, E, ep, align=align)
            y_TH = combine(rows_NH.to(torch.bfloat16), weights_TK, r)
        backward_ops, _ = counted(lambda: y_TH.backward(dy_TH), dev)  # the round trip's backward alone
        sorted_AH = x_TH.detach().to(x_NH.dtype)[routed.order_A // K]  # the rows dispatch sends
        a2a_us = timed_us(
            lambda: comm.all_to_all_single(sorted_AH, ep, routed.send_sizes, routed.recv_sizes),
            **timing,
        )
        row_bytes = H * x_NH.element_size()
        leaving = sum(routed.send_sizes) - routed.send_sizes[ep.rank]
        if a.profile:
            for name, fn in (("dispatch", dispatch_only), ("combine", combine_only), ("round trip", round_trip)):
                _profile_calls(a, dev, f"{precision} {name}", fn)
        emit(
            dict(
                what="moe-dispatch",
                combine=a.combine,
                experts_path=a.experts_path,
                precision=precision,
                ep=ep.size,
                tokens_per_rank=T,
                hidden=H,
                experts=E,
                top_k=K,
                wire_dtype=str(x_NH.dtype).removeprefix("torch."),
                align=align,
                iters=a.iters,
                dispatch_us=round(dispatch_us, 1),
                combine_us=round(combine_us, 1),
                round_trip_fwd_bwd_us=round(round_trip_us, 1),
                a2a_only_us=round(a2a_us, 1),
                ops=dict(dispatch=dispatch_ops, combine=combine_ops, round_trip_fwd_bwd=round_trip_ops),
                ops_backward=backward_ops,
                host_syncs=dict(dispatch=dispatch_syncs, combine=combine_syncs, round_trip_fwd_bwd=round_trip_syncs),
                dispatch_mib_sent_per_rank=round(sum(routed.send_sizes) * row_bytes / 2**20, 1),
                dispatch_mib_leaving_rank0=round(leaving * row_bytes / 2**20, 1),
                target_us=250,
                gpu=_gpu_name(dev),
            )
        )


class _Mirror:
    """``dist.all_to_all_single`` for :func:`part_dispatch_host`: the rows received are the rows
    sent (every member of the axis sends what this one sends, so the split sizes agree), copied
    on the host; no process group."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
        self.calls += 1
        output.copy_(input)
        return _Done() if async_op else None


class _Done:
    def wait(self) -> bool:
        return True


def part_dispatch_host(a) -> None:
    """``--host-only``: the host's work of the dispatch and combine on one process, no collective
    run: an ``ep`` axis (``--ep``, default 2) whose all-to-alls hand back the rows sent
    (:class:`_Mirror`), so every op, index and Python step of a member of a real exchange runs,
    and nothing waits. Small shapes (``--dispatch-tokens``, ``--hidden``) make the kernels cost
    almost nothing on the CPU: the time is the host's overhead. One ``HOST`` json line per
    precision: ATen ops and all-to-all calls of the dispatch, the combine and their backward,
    median µs of each (``perf_counter``), and of the layer's exchange (``overlap.exchange``, one
    chunk, an identity for the experts) forward and backward."""
    from behemoth.comm import Axis, Ledger
    from behemoth.parallel.expert import overlap
    from behemoth.parallel.expert.dispatch import Routes

    T, H, E, K, n = a.dispatch_tokens, a.hidden, a.experts, a.top_k, a.ep or 2
    dev = torch.device("cpu")
    mirror = _Mirror()
    dist.all_to_all_single = mirror
    ep = Axis("ep", n, 0, tuple(range(n)), None, Ledger())
    g = torch.Generator().manual_seed(1000)
    _, weights_TK, experts_TK = route(torch.randn(T, E, generator=g), K)
    weights_TK.requires_grad_()
    align = a.align if a.align else 1
    for precision in _precisions(a):
        x_dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        x_TH = torch.randn(T, H, generator=g).to(x_dtype).requires_grad_()
        dy_TH = torch.randn(T, H, generator=g, dtype=x_dtype)
        autocast = functools.partial(torch.autocast, "cpu", torch.bfloat16, precision == "autocast")
        held = {}

        def dispatch_fwd():
            with autocast():
                x_NH, _, held["routed"] = dispatch(x_TH, experts_TK, E, ep, align=align)
            held["y_NH"] = x_NH.to(torch.bfloat16)

        def combine_fwd():
            with autocast():
                held["y_TH"] = combine(held["y_NH"], weights_TK, held["routed"])

        def backward():
            held.pop("y_TH").backward(dy_TH)
            x_TH.grad = weights_TK.grad = None

        def exchange_fwd():
            with autocast():
                routes = Routes.build(experts_TK, E, ep, align=align)
                held["y_TH"] = overlap.exchange(x_TH, weights_TK, routes, lambda x_NH, counts: x_NH * 1)

        steps = (("dispatch", dispatch_fwd), ("combine", combine_fwd), ("backward", backward))
        steps += (("exchange", exchange_fwd), ("exchange_backward", backward))
        ops, calls, times = {}, {}, {k: [] for k, _ in steps}
        for i in range(a.warmup + a.iters + 1):
            for name, fn in steps:
                if i == a.warmup + a.iters:  # the last round: counted, not timed
                    before = mirror.calls
                    ops[name] = counted(fn, dev)[0]
                    calls[name] = mirror.calls - before
                    continue
                t = time.perf_counter()
                fn()
                if i >= a.warmup:
                    times[name].append((time.perf_counter() - t) * 1e6)
        line = dict(what="moe-dispatch-host", precision=precision, ep=n, tokens_per_rank=T, hidden=H, experts=E)
        line |= dict(top_k=K, align=align, iters=a.iters, ops=ops, all_to_alls=calls)
        line["host_us_median"] = {k: round(sorted(v)[len(v) // 2], 1) for k, v in times.items()}
        line["host_us_min"] = {k: round(min(v), 1) for k, v in times.items()}
        print("HOST " + json.dumps(line), flush=True)


def _precisions(a) -> list[str]:
    out = a.precisions.split(",")
    for precision in out:
        if precision not in ("bf16", "autocast"):
            raise ValueError(f"--precisions: {precision!r} must be bf16 or autocast.")
    return out


# ---------------------------------------------------------------- part 2: one layer vs dense


def _fresh_peak(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)


def time_dense(a, dev: torch.device, g: torch.Generator, pdtype: torch.dtype, autocast: bool) -> float:
    """Median µs of forward + backward of a dense SwiGLU of width ``k*I`` (the FLOPs per token of k
    experts of width I) on ``--layer-tokens`` tokens."""
    T, H, F = a.layer_tokens, a.hidden, a.top_k * a.ffn
    gate_up = torch.nn.Parameter(torch.randn(2 * F, H, device=dev, generator=g).mul_(0.02).to(pdtype))
    down = torch.nn.Parameter(torch.randn(H, F, device=dev, generator=g).mul_(0.02).to(pdtype))
    x_TH = torch.randn(T, H, device=dev, generator=g).to(pdtype).requires_grad_()
    dy_TH = torch.randn(T, H, device=dev, generator=g, dtype=torch.bfloat16)  # the output's dtype

    def step():
        gate_up.grad = down.grad = x_TH.grad = None
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=autocast):
            y_TH = swiglu_expert(x_TH, gate_up, down)
        y_TH.backward(dy_TH.to(y_TH.dtype))

    us = timed_us(step, dev, a.iters, a.warmup)
    if a.profile:
        _profile_calls(a, dev, f"dense FFN {a.precisions}", step)
    return us


def build_layer(a, dev: torch.device, mesh: ParallelMesh, g: torch.Generator, pdtype: torch.dtype, chunks: int):
    """A :class:`MoEFeedForward` under :class:`ExpertParallel` over the mesh's ep axis (this rank
    keeps its E/ep experts; ``chunks``: its exchange overlapped in that many chunks), expert
    weights normal(0, 0.02), in ``pdtype``."""
    with torch.device(dev):
        moe = MoEFeedForward(a.hidden, a.ffn, a.experts, a.top_k)
    ExpertParallel(chunks=chunks).apply(moe, mesh)
    with torch.no_grad():
        for p in (moe.gate_up_proj, moe.down_proj):
            p.normal_(0.0, 0.02, generator=g)
    return moe.to(pdtype)


def time_layer(a, dev, moe, kind: str, ep_size: int, g: torch.Generator, autocast: bool) -> float:
    """Median µs of forward + backward of ``moe`` on ``--layer-tokens`` tokens routed as ``kind``."""
    T, H, E, K = a.layer_tokens, a.hidden, a.experts, a.top_k
    x_TH, router_EH = routing_input(kind, T, H, E, K, ep_size, a.zipf_s, g)
    with torch.no_grad():
        moe.router.weight.copy_(router_EH)
    x_BSH = x_TH.to(moe.gate_up_proj.dtype)[None].requires_grad_()  # the residual stream's dtype
    dy_BSH = torch.randn(x_BSH.shape, device=dev, generator=g, dtype=torch.bfloat16)

    def step():
        moe.zero_grad(set_to_none=True)
        x_BSH.grad = None
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=autocast):
            y_BSH = moe(x_BSH)
        y_BSH.backward(dy_BSH.to(y_BSH.dtype))

    us = timed_us(step, dev, a.iters, a.warmup)
    if a.profile:
        _profile_calls(a, dev, f"MoE layer {kind}", step)
    return us


def part_layer(a, dev: torch.device, mesh: ParallelMesh, paths: PathCount) -> None:
    T, H, I, K = a.layer_tokens, a.hidden, a.ffn, a.top_k
    ep = mesh.axis("ep")
    flops = 18 * T * K * H * I
    g = torch.Generator(device=dev).manual_seed(2000 + dist.get_rank())
    for precision in _precisions(a):
        pdtype = torch.bfloat16 if precision == "bf16" else torch.float32
        autocast = precision == "autocast"
        _fresh_peak(dev)
        dense_us = time_dense(a, dev, g, pdtype, autocast)
        dense_peak = _peak_gib(dev)
        for chunks in a.chunk_counts:
            _fresh_peak(dev)
            moe = build_layer(a, dev, mesh, g, pdtype, chunks)
            for kind in a.routings.split(","):
                _layer_line(a, dev, moe, kind, ep, g, autocast, precision, chunks, flops, dense_us, dense_peak, paths)
            del moe


def _layer_line(a, dev, moe, kind, ep, g, autocast, precision, chunks, flops, dense_us, dense_peak, paths) -> None:
    """Time ``moe`` on ``kind`` routing and emit its RESULT line against the dense FFN's time."""
    T, H, I, E, K = a.layer_tokens, a.hidden, a.ffn, a.experts, a.top_k
    paths.take()
    moe_us = time_layer(a, dev, moe, kind, ep.size, g, autocast)
    calls = paths.take()
    counts_E = moe.token_counts.double()  # the last forward's, over every rank's tokens
    per_rank = counts_E.view(ep.size, -1).sum(1)
    emit(
        dict(
            what="moe-layer",
            routing=kind,
            combine=a.combine,
            experts_path=a.experts_path,
            chunks=chunks,
            precision=precision,
            ep=ep.size,
            tokens_per_rank=T,
            hidden=H,
            ffn=I,
            experts=E,
            top_k=K,
            iters=a.iters,
            moe_ms=round(moe_us / 1e3, 3),
            dense_ms=round(dense_us / 1e3, 3),
            moe_tflops_gpu=round(flops / moe_us / 1e6, 1),
            dense_tflops_gpu=round(flops / dense_us / 1e6, 1),
            ratio=round(dense_us / moe_us, 3),
            target_ratio=0.9 if kind in ("balanced", "uniform") else 0.8,
            rank_load=[round(v, 3) for v in (per_rank / per_rank.mean()).tolist()],
            expert_share=[round(v, 3) for v in (counts_E / counts_E.sum()).tolist()],
            paths={k: v // (a.iters + a.warmup) for k, v in calls.items()},
            peak_gib_dense=dense_peak,
            peak_gib_moe=_peak_gib(dev),
            gpu=_gpu_name(dev),
        )
    )


# ---------------------------------------------------------------- part 3: end-to-end training


def _init_on_device(model: torch.nn.Module, seed: int) -> None:
    """normal(0, 0.02) weights drawn on the model's device (ones for the norms): a preset's CPU
    init of billions of values would take longer than the run. The same on every rank."""
    g = None
    with torch.no_grad():
        for name, p in model.named_parameters():
            if g is None:
                g = torch.Generator(device=p.device).manual_seed(seed)
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=g)


def parse_plan(text: str) -> dict:
    """``--plan``'s keyword arguments: ``Plan(k=v, ...)`` as ``Plan.describe()`` prints it, or
    ``k=v,k=v`` pairs; values are Python literals (a bare word reads as a string). Parsed, never
    evaluated."""
    text = text.strip()
    body = text[len("Plan(") : -1] if text.startswith("Plan(") and text.endswith(")") else text
    out = {}
    for part in filter(None, (p.strip() for p in _split_top(body))):
        key, sep, value = part.partition("=")
        if not sep or not key.strip().isidentifier():
            raise ValueError(f"--plan {text!r}: {part!r} is not key=value (e.g. pp=2,microbatches=8).")
        try:
            out[key.strip()] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            out[key.strip()] = value.strip()
    fields = {f.name for f in dataclasses.fields(bh.Plan)}
    unknown = sorted(set(out) - fields)
    if unknown:
        raise ValueError(f"--plan {text!r}: {unknown} are not Plan fields; they are {sorted(fields)}.")
    return out


def _split_top(body: str) -> list[str]:
    """``body`` split at the commas outside brackets and quotes."""
    parts, depth, quote, start = [], 0, None, 0
    for i, ch in enumerate(body):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(body[start:i])
            start = i + 1
    return parts + [body[start:]]


def model_plan(a, world: int, chunks: int) -> bh.Plan:
    """The layout of the model part: ``--plan`` (bf16 unless it says otherwise; ``--zero``,
    ``--offload``, ``--param-dtype``, ``--ckpt`` where it does not say), else ``Plan(dp=world,
    ep=--ep)`` with those flags; ``chunks`` > 1 sets ``ep_overlap``."""
    given = parse_plan(a.plan) if a.plan else dict(dp=world, ep=a.ep or world)
    kw = dict(
        precision="bf16",
        zero=a.zero,
        offload=a.offload,
        param_dtype=a.param_dtype,
        activation_checkpointing=a.ckpt,
    )
    kw.update(given)
    if chunks > 1:
        kw["ep_overlap"] = chunks
    return bh.Plan(**kw)


def part_model(a, dev: torch.device, paths: PathCount) -> None:
    """One training run per ``--chunks`` entry, one after the other in this process (each model,
    engine and optimizer freed before the next is built)."""
    world = dist.get_world_size()
    for chunks in a.chunk_counts:
        plan = model_plan(a, world, chunks)
        if chunks > 1 and plan.ep == 1:
            emit(dict(what="moe-model", model=a.size, chunks=chunks, skipped="ep=1 has no all-to-all to overlap"))
            continue
        run_model(a, dev, paths, plan)
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()


def run_model(a, dev: torch.device, paths: PathCount, plan: bh.Plan) -> None:
    world, rank = dist.get_world_size(), dist.get_rank()
    ep, chunks = plan.ep, plan.ep_overlap
    overrides = dict(num_layers=a.layers) if a.layers else {}
    model = build_model(a.size, vocab_size=a.vocab, seq_len=a.seq, device="meta", **overrides)
    model.to_empty(device=dev)
    model.tie_weights()
    _init_on_device(model, seed=0)
    cfg = model.config
    total = model.num_params()
    flops_tok = model.flops_per_token(a.seq)  # serial counts, before the experts are sharded
    active = (flops_tok - 12 * cfg.num_layers * cfg.hidden * a.seq) // 6
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=dev.type == "cuda" and plan.offload is None)
    t0 = time.perf_counter()
    engine = bh.boost(model, opt, plan)
    setup_s = time.perf_counter() - t0
    g = torch.Generator(device=dev).manual_seed(engine.dp_rank)
    share = a.batch // engine.dp_size if a.batch else a.mbs  # sequences per data rank per step
    ids = torch.randint(0, a.vocab, (share, a.seq + 1), device=dev, generator=g)
    batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    times, loss = [], float("nan")
    paths.take()
    engine.reset_comm_stats()
    for i in range(a.steps):
        _sync(dev)
        t = time.perf_counter()
        loss = engine.step(batch)
        _sync(dev)
        times.append(time.perf_counter() - t)
        if rank == 0:
            print(f"step {i + 1}: {times[-1]:.3f} s, loss {loss:.3f}", file=sys.stderr, flush=True)
    calls = paths.take()
    warm = times[3:] or times
    dt = slowest(sorted(warm)[len(warm) // 2], dev)
    tok_s_gpu = share * engine.dp_size * a.seq / dt / world
    loads = []
    for counts in engine.expert_token_counts().values():
        c = torch.tensor(counts, dtype=torch.float64).view(ep, -1).sum(1)
        loads.append(float(c.max() / c.mean()))
    ep_dp = engine.dp_size // ep
    mode = f"behemoth-ep{ep}" + (f"-epdp{ep_dp}" if ep_dp > 1 else "")
    mode += f"-zero{plan.zero}" if plan.zero else ""
    mode += f"-overlap{chunks}" if chunks > 1 else ""
    mode += "" if world == engine.dp_size else f"-{plan.describe()}"
    emit(
        dict(
            what="moe-model",
            model=a.size,
            mode=mode,
            combine=a.combine,
            experts_path=a.experts_path,
            chunks=chunks,
            gpus=world,
            ep=ep,
            ep_dp=ep_dp,
            plan=plan.describe(),
            zero=plan.zero,
            param_dtype=plan.param_dtype,
            ckpt=plan.activation_checkpointing,
            layers=cfg.num_layers,
            experts=cfg.num_experts,
            top_k=cfg.experts_top_k,
            total_b=round(total / 1e9, 2),
            active_b=round(active / 1e9, 2),
            mbs=share,
            global_batch=share * engine.dp_size,
            seq=a.seq,
            vocab=a.vocab,
            setup_s=round(setup_s, 1),
            step_s=round(dt, 3),
            tok_s_gpu=round(tok_s_gpu),
            tflops_active_gpu=round(tok_s_gpu * flops_tok / 1e12, 1),
            mfu_active=round(tok_s_gpu * flops_tok / a.peak, 4),
            target_mfu=0.35 if cfg.experts_top_k <= 2 else 0.25,
            peak_gib=_peak_gib(dev),
            loss=round(loss, 3),
            rank_load_max_over_mean=round(max(loads), 3) if loads else None,
            paths={k: v // max(1, a.steps) for k, v in calls.items()},
            comm_mib_per_step={k: round(v["bytes"] / a.steps / 2**20, 1) for k, v in engine.comm_stats().items()},
            comm_s={k: round(v["seconds"], 3) for k, v in engine.comm_stats().items()},
            gpu=_gpu_name(dev),
        )
    )
    if a.profile:
        _profile(a, dev, engine, batch)


def _profile_calls(a, dev: torch.device, what: str, fn) -> None:
    """``--profile N`` of the dispatch and layer parts: N calls of ``fn`` (each after a barrier, as timed)
    under torch.profiler; every rank prints its report, one after the other."""

    def call():
        _sync(dev)
        dist.barrier()
        _sync(dev)
        fn()

    if dist.get_rank() == 0:
        print(f"\n##### {what}: {a.profile} calls (each after a barrier, which the tables include)", flush=True)
    label = what.replace(" ", "_")
    _print_in_turn(lambda: profile_steps(call, a.profile, dev, dist.get_rank(), a.trace, label=label))


def _print_in_turn(run) -> None:
    """``run()`` on every rank (collective), its printing held back and then printed rank by rank."""
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        run()
    for r in range(dist.get_world_size()):
        if r == dist.get_rank():
            print(text.getvalue(), flush=True)
        dist.barrier()


def _profile(a, dev: torch.device, engine, batch) -> None:
    """``--profile N``: every rank profiles N more steps (:func:`step_profile.profile_steps`);
    the ranks print their reports one after the other."""
    label = "model_" + re.sub(r"[^A-Za-z0-9=]+", "_", engine.plan.describe().removeprefix("Plan")).strip("_")
    _print_in_turn(
        lambda: profile_steps(lambda: engine.step(batch), a.profile, dev, dist.get_rank(), a.trace, label=label)
    )


# ---------------------------------------------------------------- main


def _gpu_name(dev: torch.device) -> str:
    return torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"


TINY = dict(dispatch_tokens=64, layer_tokens=128, hidden=64, ffn=32, iters=3, warmup=1)
"""``--tiny``: shapes small enough for a CPU smoke check of the script (gloo); measures nothing."""
TINY_MODEL = dict(seq=32, mbs=2, vocab=256, steps=4)
TINY_SIZES = {"mixtral-4b": "llama-moe-tiny", "olmoe-1b-7b": "olmoe-tiny"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", default="all", help=f"comma-separated parts of {PARTS}, or all")
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"], help="cpu: gloo")
    p.add_argument("--tiny", action="store_true", help="tiny shapes: a CPU smoke check, not a measurement")
    p.add_argument("--iters", type=int, default=30, help="timed calls per figure (dispatch, layer)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--hidden", type=int, default=4096, help="dispatch, layer: hidden H")
    p.add_argument("--experts", type=int, default=8, help="dispatch, layer: experts E")
    p.add_argument("--top-k", type=int, default=2, help="dispatch, layer: experts per token k")
    p.add_argument("--dispatch-tokens", type=int, default=4096, help="dispatch: tokens per rank")
    p.add_argument("--layer-tokens", type=int, default=16384, help="layer: tokens per rank")
    p.add_argument("--ffn", type=int, default=14336, help="layer: expert FFN width I")
    p.add_argument("--routings", default=",".join(ROUTINGS), help=f"layer: comma-separated of {ROUTINGS}")
    p.add_argument("--zipf-s", type=float, default=1.2, help="layer: Zipf exponent of the zipf routings")
    p.add_argument("--precisions", default="bf16", help="dispatch, layer: bf16 and/or autocast (fp32 under autocast)")
    p.add_argument("--size", default="mixtral-4b", help="model: a behemoth preset (mixtral-4b, olmoe-1b-7b)")
    p.add_argument("--ep", type=int, default=0, help="model: Plan.ep (default: the world size); dp = world")
    p.add_argument("--mbs", type=int, default=4, help="model: sequences per data rank per step")
    p.add_argument("--plan", default="", help='model: the layout, e.g. "pp=2,microbatches=8" or "Plan(dp=2, ep=2)"')
    p.add_argument("--batch", type=int, default=0, help="model: sequences per step over all data ranks (0: --mbs each)")
    p.add_argument(
        "--profile",
        type=int,
        default=0,
        help="model: profile this many steps after the timed ones; dispatch, layer: calls",
    )
    p.add_argument("--trace", default=None, help="with --profile: a folder for each rank's chrome trace")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--layers", type=int, default=0, help="model: fewer layers than the preset (0: the preset's)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--zero", type=int, default=0, help="model: Plan.zero")
    p.add_argument("--offload", default=None, choices=[None, "cpu", "auto"], help="model: Plan.offload")
    p.add_argument("--param-dtype", default=None, choices=[None, "bf16"], help="model: Plan.param_dtype")
    p.add_argument("--ckpt", action="store_true", help="model: activation checkpointing")
    p.add_argument(
        "--chunks",
        default="1",
        help="layer, model: comma-separated chunk counts of the overlapped expert exchange (1: at once)",
    )
    p.add_argument(
        "--host-only",
        action="store_true",
        help="dispatch: the host's work alone, one process, no collective run (part_dispatch_host); no torchrun",
    )
    p.add_argument("--align", type=int, default=0, help="--host-only: the experts' groups padded to this (0: 1)")
    p.add_argument("--peak", type=float, default=989e12, help="dense bf16 peak FLOP/s per GPU (H100/H200 SXM)")
    p.add_argument(
        "--combine",
        default="index-add",
        choices=["index-add", "token-major"],
        help="the combine's weighing: the library's index_add_, or a token-major scatter and a sum over k (A/B)",
    )
    p.add_argument(
        "--experts-path",
        default="auto",
        choices=["auto", "loop"],
        help="the experts' GEMMs: the library's choice, or the loop of per-expert GEMMs forced (A/B)",
    )
    a = p.parse_args(argv)
    a.parts = PARTS if a.part == "all" else tuple(a.part.split(","))
    try:
        a.chunk_counts = [int(c) for c in a.chunks.split(",")]
    except ValueError:
        p.error(f"--chunks {a.chunks!r}: comma-separated integers >= 1, e.g. 1,2,4.")
    if min(a.chunk_counts) < 1:
        p.error(f"--chunks {a.chunks!r}: comma-separated integers >= 1, e.g. 1,2,4.")
    unknown = [x for x in a.parts if x not in PARTS]
    if unknown:
        p.error(f"--part {a.part!r}: unknown {unknown}; choose among {PARTS} or all.")
    if a.plan:
        try:
            parse_plan(a.plan)
        except ValueError as e:
            p.error(str(e))
    if a.tiny:
        for k, v in TINY.items():
            setattr(a, k, v)
        for k, v in TINY_MODEL.items():
            setattr(a, k, v)
        a.size = TINY_SIZES.get(a.size, a.size)
    return a


def main() -> None:
    a = parse_args()
    if a.host_only:
        part_dispatch_host(a)
        return
    use_cuda = a.device == "cuda" or (a.device == "auto" and torch.cuda.is_available())
    if a.device == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: no GPU is visible (torch.cuda.is_available() is False).")
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dev = torch.device("cuda", torch.cuda.current_device())
    else:
        dev = torch.device("cpu")
    bh.init(backend="nccl" if use_cuda else "gloo")
    world = dist.get_world_size()
    if a.experts % world:
        sys.exit(f"--experts {a.experts} must be divisible by the world size {world} (ep = world).")
    use_combine(a.combine)
    if a.experts_path == "loop":
        grouped.grouped_mm_available = lambda *args: False
    paths = PathCount()  # counts the paths taken, the forced one too
    if "dispatch" in a.parts or "layer" in a.parts:
        mesh = ParallelMesh(bh.Plan(dp=world, ep=world), dist.get_rank(), world)
        if "dispatch" in a.parts:
            part_dispatch(a, dev, mesh, paths)
        if "layer" in a.parts:
            part_layer(a, dev, mesh, paths)
    if "model" in a.parts:
        part_model(a, dev, paths)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown (torch's CPU runtime can abort there; see distributed.py)

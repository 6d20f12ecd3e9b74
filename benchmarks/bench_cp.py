"""GPU benchmark of behemoth's context parallelism, one RESULT json line per run.

Two modes:

* ``--check`` -- the attention cores alone, on 2+ GPUs: ring (block kernel ``auto``: the fused
  kernel SDPA would pick, cuDNN's on Hopper; and forced ``flash``, ``cudnn``, ``plain``) and
  Ulysses against one GPU's full SDPA on the whole sequence, bf16: outputs and dq/dk/dv
  gathered back to sequence order and compared with an fp32 reference (SDPA in fp32) next to
  bf16 SDPA's own error, then timed (forward + backward, median of ``--iters``)::

      torchrun --standalone --nproc-per-node 2 benchmarks/bench_cp.py --check --seq 8192

* training (default) -- behemoth's GPT (``--size``, default gpt-1.3b) with bf16 autocast,
  fp32 master weights and fused AdamW under ``Plan(cp=--cp, cp_mode=--mode)`` (dp = world /
  cp), ``--mbs`` sequences of ``--seq`` tokens per data-parallel rank::

      torchrun --standalone --nproc-per-node 1 benchmarks/bench_cp.py --cp 1 --seq 16384
      torchrun --standalone --nproc-per-node 2 benchmarks/bench_cp.py --cp 2 --mode ring --seq 32768

  ``--probe-max-seq`` instead finds the longest sequence that trains 2 steps on every rank,
  climbing from ``--seq`` (x ``--probe-growth``, rounded to ``--seq-step``) to the first failure.

tokens/s/GPU = mbs * seq / step / cp (a cp group shares its sequences). TFLOP/s and MFU use
the PaLM convention (6*N + 12*L*h*s FLOPs per token, s the whole sequence) against
``--peak`` (989 TFLOP/s dense bf16, H100/H200 SXM), so throughput at different sequence
lengths compares at equal work through TFLOP/s/GPU.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

import behemoth as bh
from behemoth.models import build_model


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _peak_gib() -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0


def _reset_peak() -> None:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def _median_time(fn, iters: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        _sync()
        t = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


# ----------------------------------------------------------------------------- --check
def check(a) -> None:
    from behemoth import comm
    from behemoth.mesh import ParallelMesh
    from behemoth.parallel.context import context_attention, gather_sequence, ring, split_sequence

    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    dev = bh.distributed.device_for_rank()
    mesh = ParallelMesh(bh.Plan(cp=world, dp=1), rank, world)
    axis = mesh.axis("cp")
    B, N, K, S, D = a.mbs, a.heads, a.kv_heads or a.heads, a.seq, a.head_dim
    g = torch.Generator(device=dev).manual_seed(0)  # the same full tensors on every rank
    q32 = torch.randn(B, N, S, D, device=dev, generator=g)
    k32 = torch.randn(B, K, S, D, device=dev, generator=g)
    v32 = torch.randn(B, K, S, D, device=dev, generator=g)
    w32 = torch.randn(B, N, S, D, device=dev, generator=g)
    gqa = N != K

    def full(dtype):
        q, k, v = (t.to(dtype, copy=True).requires_grad_() for t in (q32, k32, v32))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        (out.float() * w32).sum().backward()
        return [out.detach().float(), q.grad.float(), k.grad.float(), v.grad.float()]

    ref = full(torch.float32)  # memory-efficient kernel in fp32: the reference
    base = full(torch.bfloat16)  # flash kernel in bf16: the error budget
    base_err = [(b - r).abs().max().item() for b, r in zip(base, ref)]

    def local(dtype, mode):
        return [split_sequence(t, 2, world, rank, mode).to(dtype).contiguous() for t in (q32, k32, v32, w32)]

    def gather(t, mode):
        parts = comm.all_gather(t.detach().float().contiguous().unsqueeze(0), axis, 0)
        return gather_sequence(list(parts.unbind(0)), 2, mode)

    results = {}
    cases = [("ring", "ring", "auto"), ("ulysses", "ulysses", "auto")]
    cases += [(f"ring-{k}", "ring", k) for k in a.ring_kernels.split(",") if k]
    for name, mode, kernel in cases:
        ring.BLOCK_KERNEL = kernel
        ql, kl, vl, wl = local(torch.bfloat16, mode)
        ql, kl, vl = (t.requires_grad_() for t in (ql, kl, vl))
        out = context_attention(ql, kl, vl, axis, mode=mode)
        (out.float() * wl.float()).sum().backward()
        got = [gather(t, mode) for t in (out, ql.grad, kl.grad, vl.grad)]
        err = [(x - r).abs().max().item() for x, r in zip(got, ref)]
        ok = all(e <= 2 * b + 2e-2 for e, b in zip(err, base_err))

        def step():
            qq, kk, vv = (t.detach().requires_grad_() for t in (ql, kl, vl))
            o = context_attention(qq, kk, vv, axis, mode=mode)
            o.backward(wl)

        ms = _median_time(step, a.iters) * 1e3
        results[name] = dict(
            max_err=dict(zip(("out", "dq", "dk", "dv"), [round(e, 5) for e in err])), ok=ok, fwd_bwd_ms=round(ms, 3)
        )
        if mode == "ring":
            results[name]["block_kernel"] = ring.block_kernel(ql)
        ql = kl = vl = out = got = None  # free before the next case (step() has run)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    ring.BLOCK_KERNEL = "auto"

    qf, kf, vf = (t.to(torch.bfloat16) for t in (q32, k32, v32))
    wf = w32.to(torch.bfloat16)

    def full_step():
        qq, kk, vv = (t.detach().requires_grad_() for t in (qf, kf, vf))
        F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, enable_gqa=gqa).backward(wf)

    full_ms = _median_time(full_step, a.iters) * 1e3
    try:
        full_kernel = {0: "math", 1: "flash", 2: "efficient", 3: "cudnn"}.get(
            int(torch._fused_sdp_choice(qf, kf, vf, is_causal=True, enable_gqa=gqa)), "other"
        )
    except (RuntimeError, TypeError):
        full_kernel = "unknown"
    flags = torch.tensor([float(all(r["ok"] for r in results.values()))], device=dev)
    torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MIN)
    if rank == 0:
        for r in results.values():  # ideal: full_ms / cp (each rank does 1/cp of the causal work)
            r["speedup_vs_one_gpu_full_sdpa"] = round(full_ms / r["fwd_bwd_ms"], 3)
        print(
            "RESULT "
            + json.dumps(
                dict(
                    check="sequence-attention",
                    gpus=world,
                    batch=B,
                    heads=N,
                    kv_heads=K,
                    seq=S,
                    head_dim=D,
                    dtype="bf16",
                    one_gpu_full_sdpa_ms=round(full_ms, 3),
                    one_gpu_sdpa_kernel=full_kernel,
                    sdpa_bf16_err=dict(zip(("out", "dq", "dk", "dv"), [round(e, 5) for e in base_err])),
                    all_ok=bool(flags.item()),
                    **results,
                )
            ),
            flush=True,
        )


# ----------------------------------------------------------------------------- training
def _engine(a, seq: int, dev):
    model = build_model(a.size, vocab_size=a.vocab, seq_len=seq, device=dev, tie_embeddings=a.tied)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=dev.type == "cuda" and not a.zero)
    counts = model.num_params(), model.flops_per_token(seq)  # serial counts
    world = torch.distributed.get_world_size()
    plan = bh.Plan(
        dp=world // a.cp, cp=a.cp, cp_mode=a.mode, precision="bf16", activation_checkpointing=a.ckpt, zero=a.zero
    )
    return bh.boost(model, opt, plan), counts


def _batch(a, seq: int, engine, dev):
    g = torch.Generator(device=dev).manual_seed(engine.dp_rank)  # cp ranks share their dp rank's batch
    x = torch.randint(0, a.vocab, (a.mbs, seq + 1), device=dev, generator=g)
    return {"input_ids": x[:, :-1], "labels": x[:, 1:]}


def _label(a) -> str:
    return ("behemoth-1gpu" if a.cp == 1 else f"behemoth-cp{a.cp}-{a.mode}") + (f"-zero{a.zero}" if a.zero else "")


def train(a) -> None:
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    dev = bh.distributed.device_for_rank()
    engine, (nparam, flops_per_tok) = _engine(a, a.seq, dev)
    batch = _batch(a, a.seq, engine, dev)
    _reset_peak()
    times = []
    for _ in range(a.steps):
        _sync()
        t = time.perf_counter()
        loss = engine.step(batch)
        _sync()
        times.append(time.perf_counter() - t)
    warm = times[3:] or times
    dt = sorted(warm)[len(warm) // 2]
    tok_per_gpu = a.mbs * a.seq / dt / a.cp
    if rank == 0:
        r = dict(
            size=a.size,
            mode=_label(a),
            gpus=world,
            cp=a.cp,
            mbs=a.mbs,
            seq=a.seq,
            ckpt=a.ckpt,
            params_b=round(nparam / 1e9, 3),
            step_s=round(dt, 4),
            tok_s_gpu=round(tok_per_gpu),
            tflops_gpu=round(tok_per_gpu * flops_per_tok / 1e12, 1),
            mfu=round(tok_per_gpu * flops_per_tok / a.peak, 4),
            peak_mem_gib=round(_peak_gib(), 1),
            loss=round(loss, 3),
            comm_s={k: v["seconds"] for k, v in engine.comm_stats().items()},
        )
        print("RESULT " + json.dumps(r), flush=True)


def _trains(a, seq: int, dev) -> tuple[bool, float]:
    """Whether two steps at ``seq`` train on every rank (a fresh model), and this rank's peak GiB."""
    ok, peak, engine, batch = 1.0, 0.0, None, None
    try:
        _reset_peak()
        engine, _ = _engine(a, seq, dev)
        batch = _batch(a, seq, engine, dev)
        for _ in range(2):
            engine.step(batch)
        _sync()
        peak = _peak_gib()
    except torch.cuda.OutOfMemoryError:
        ok = 0.0
    engine = batch = None
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    flag = torch.tensor([ok], device=dev)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
    return flag.item() == 1, peak


def probe_max_seq(a) -> None:
    """Try seq = --seq, then larger ones (x --probe-growth, at least +--seq-step, rounded up to
    --seq-step), 2 steps each, a fresh model per candidate, until one fails. No bisection
    after the failure: once a candidate has run out of memory, the process fails candidates
    that train in a fresh one (measured on H200: 45,056 trained as a first candidate, failed
    after 51,200 had run out), so the search only climbs; start near the answer and use
    --probe-growth 1 for a --seq-step resolution. cp ranks hold equal shapes, so they run
    out of memory at the same operation."""
    rank = torch.distributed.get_rank()
    dev = bh.distributed.device_for_rank()
    step = a.seq_step
    best, best_peak, seq, fail = 0, 0.0, a.seq, None
    while seq <= a.max_seq:
        ok, peak = _trains(a, seq, dev)
        if rank == 0:
            print(
                f"probe: seq {seq} {'trains' if ok else 'fails'}" + (f" (peak {peak:.1f} GiB)" if ok else ""),
                flush=True,
            )
        if not ok:
            fail = seq
            break
        best, best_peak = seq, peak
        seq = max(seq + step, -(-int(seq * a.probe_growth) // step) * step)
    if rank == 0:
        print(
            "RESULT "
            + json.dumps(
                dict(
                    size=a.size,
                    mode=_label(a),
                    cp=a.cp,
                    mbs=a.mbs,
                    ckpt=a.ckpt,
                    zero=a.zero,
                    max_seq=best,
                    peak_mem_gib=round(best_peak, 1) if best else None,
                    first_failure=fail,
                )
            ),
            flush=True,
        )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--check", action="store_true", help="check and time the attention cores instead of training")
    p.add_argument("--size", default="gpt-1.3b")
    p.add_argument("--cp", type=int, default=2, help="context-parallel degree (1 = one GPU, no cp)")
    p.add_argument("--mode", default="ring", choices=("ring", "ulysses"))
    p.add_argument("--seq", type=int, default=32768, help="tokens per sequence (the whole sequence)")
    p.add_argument("--mbs", type=int, default=1, help="sequences per data-parallel rank per step (--check: batch)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--ckpt", action="store_true", help="activation checkpointing")
    p.add_argument("--zero", type=int, default=0, help="ZeRO stage over dp x cp (frees model data for activations)")
    p.add_argument("--tied", action="store_true", help="tie input/output embeddings (peer_baseline's are untied)")
    p.add_argument(
        "--probe-max-seq",
        action="store_true",
        help="find the longest sequence (from --seq up) that trains 2 steps, instead of timing",
    )
    p.add_argument("--max-seq", type=int, default=1 << 20)
    p.add_argument("--seq-step", type=int, default=2048, help="probe candidates are multiples of this")
    p.add_argument(
        "--probe-growth",
        type=float,
        default=1.25,
        help="probe: next candidate = this x the last (at least + --seq-step); 1 climbs by --seq-step",
    )
    p.add_argument("--heads", type=int, default=16, help="--check: query heads")
    p.add_argument("--kv-heads", type=int, default=0, help="--check: kv heads (0 = heads)")
    p.add_argument("--head-dim", type=int, default=128, help="--check: head dim")
    p.add_argument("--iters", type=int, default=10, help="--check: timed iterations")
    p.add_argument(
        "--ring-kernels",
        default="flash,cudnn,plain",
        help="--check: ring block kernels to time besides 'auto' (comma-separated)",
    )
    p.add_argument("--peak", type=float, default=989e12)
    a = p.parse_args()
    bh.init()
    if a.check:
        check(a)
    elif a.probe_max_seq:
        probe_max_seq(a)
    else:
        train(a)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown (torch's CPU runtime can abort there; see distributed.py)

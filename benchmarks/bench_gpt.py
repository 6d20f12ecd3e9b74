"""GPU benchmark of behemoth's data parallelism: GPT (behemoth's model) trained with bf16
autocast, fp32 master weights and fused AdamW, one RESULT json line per run in the same
format as ``peer_baseline.py`` (the stock-PyTorch baseline run in the same call).

    torchrun --nproc-per-node 2 benchmarks/bench_gpt.py --size gpt-1.3b --mbs 8

MFU uses the PaLM convention (6*N + 12*L*h*s FLOPs per token) against the card's dense
bf16 peak (989 TFLOP/s for H100/H200 SXM).
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch

import behemoth as bh
from behemoth.models import build_model


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--size", default="gpt-1.3b")
    p.add_argument("--mbs", type=int, default=8, help="sequences per GPU per step")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--ckpt", action="store_true", help="activation checkpointing")
    p.add_argument("--compile", action="store_true", help="torch.compile each block (Plan.compile)")
    p.add_argument("--bucket-mb", type=float, default=100.0)
    p.add_argument("--peak", type=float, default=989e12)
    p.add_argument("--tied", action="store_true",
                   help="tie input/output embeddings (off by default: peer_baseline.py's model is untied)")
    a = p.parse_args()
    bh.init()
    world = torch.distributed.get_world_size()
    rank = torch.distributed.get_rank()
    dev = bh.distributed.device_for_rank()
    model = build_model(a.size, vocab_size=a.vocab, seq_len=a.seq, device=dev, tie_embeddings=a.tied)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=dev.type == "cuda")
    plan = bh.Plan(dp=world, precision="bf16", activation_checkpointing=a.ckpt, bucket_mb=a.bucket_mb,
                   compile=a.compile)
    engine = bh.boost(model, opt, plan)
    g = torch.Generator(device=dev).manual_seed(rank)
    x = torch.randint(0, a.vocab, (a.mbs, a.seq + 1), device=dev, generator=g)
    batch = {"input_ids": x[:, :-1], "labels": x[:, 1:]}
    times = []
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
    warm = times[3:] or times
    dt = sorted(warm)[len(warm) // 2]
    tok_per_gpu = a.mbs * a.seq / dt
    flops_per_tok = model.flops_per_token(a.seq)
    mem = torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else 0.0
    if rank == 0:
        r = dict(size=a.size, mode="behemoth-dp", gpus=world, mbs=a.mbs, seq=a.seq, ckpt=a.ckpt, compile=a.compile, bucket_mb=a.bucket_mb,
                 params_b=round(model.num_params() / 1e9, 3), step_s=round(dt, 4), tok_s_gpu=round(tok_per_gpu),
                 tflops_gpu=round(tok_per_gpu * flops_per_tok / 1e12, 1),
                 mfu=round(tok_per_gpu * flops_per_tok / a.peak, 4), peak_mem_gib=round(mem, 1),
                 loss=round(loss, 3), comm=engine.comm_stats().get("dp", {}).get("seconds"))
        print("RESULT " + json.dumps(r), flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()

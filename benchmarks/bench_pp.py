"""GPU benchmark of behemoth's pipeline parallelism: GPT-2.7B (behemoth's model), seq 2048,
bf16 autocast with fp32 master weights, fused AdamW, ``Plan(pp=2, microbatches=8,
schedule="1f1b")`` on 2 GPUs, against the same model's single-stage throughput measured in
the same run. One RESULT json line (format of bench_gpt.py).

    torchrun --nproc-per-node 2 benchmarks/bench_pp.py                       # the headline run
    torchrun --nproc-per-node 2 benchmarks/bench_pp.py --schedule zero-bubble
    torchrun --nproc-per-node 2 benchmarks/bench_pp.py --tiny                # CPU smoke test (gloo)

What "single-stage throughput" means here. A pipeline of p stages can at best keep every
GPU busy with its own stage's work all the time; its ideal throughput is then the whole
model's tokens per step divided by the time the *slowest stage* needs for its share of the
step (m forwards and backwards of its layers plus its optimizer step) when it never waits.
So after timing the pipeline, every rank times exactly that -- its own stage's modules on
the same micro-batches, fed a stand-in activation and a stand-in output gradient, with no
point-to-point transfer -- on its own GPU, in the same process; the slowest stage sets the
single-stage throughput ``T1 = tokens / max_r t_stage(r)``. The bound is then
``m / (m + p - 1) * T1`` (1F1B's bubble), and the measured bubble is ``1 - t_stage / t_step``.
This is fairer than a pp=1 run of half the model, which would not contain the embedding or
the head in the proportions the balanced stages do.

MFU uses the PaLM convention (6*N + 12*L*h*s FLOPs per token) against the card's dense bf16
peak (989 TFLOP/s for H100/H200 SXM), per GPU.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import sys
import time

import torch

import behemoth as bh
from behemoth.batch import model_inputs, split_microbatches
from behemoth.loss import logits_of, token_loss_sum
from behemoth.models import build_model
from behemoth.precision import autocast_context


def _sync(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def _median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


def time_pipeline(engine, batch, steps, dev):
    times, loss = [], float("nan")
    for _ in range(steps):
        _sync(dev)
        t = time.perf_counter()
        loss = engine.step(batch)
        _sync(dev)
        times.append(time.perf_counter() - t)
        print(
            f"[rank {torch.distributed.get_rank()}] pipeline step {len(times)}: {times[-1]:.3f} s, loss {loss:.4f}",
            file=sys.stderr,
            flush=True,
        )
    return _median(times[min(3, len(times) - 1) :]), loss


def time_stage_alone(engine, batch, steps, dev):
    """This rank's stage doing its share of one step with no communication: m forwards and
    backwards of its modules (a random stand-in for the received activation and the output
    gradient, shapes and dtypes as the pipeline's own), then the optimizer step."""
    split, channels = engine.parallel.pipeline, engine.parallel.channels
    micro = split_microbatches(batch, engine.plan.microbatches)
    stage, last = split.stage(0), split.num_stages - 1
    key = tuple(tuple(t.shape) for t in model_inputs(micro[0]) if isinstance(t, torch.Tensor))
    x_shape, x_dtype = channels.shapes[(stage - 1, key)] if stage > 0 else (None, None)
    params = engine.grad_sync.params
    times = []
    for _ in range(steps):
        _sync(dev)
        t = time.perf_counter()
        for p in params:
            p.grad = None
        for mb in micro:
            x = None if stage == 0 else torch.randn(x_shape, device=dev).to(x_dtype).requires_grad_()
            split.ctx.chunk, split.ctx.stash = 0, x
            with autocast_context(engine.plan.precision, dev):
                out = engine.model(*model_inputs(mb))
            split.ctx.chunk, split.ctx.stash = None, None
            if stage == last:
                (token_loss_sum(out, mb) / mb["labels"].numel()).backward()
            else:
                y = logits_of(out)
                y.backward(torch.randn_like(y))
        engine.optimizer.step()
        _sync(dev)
        times.append(time.perf_counter() - t)
    return _median(times[min(3, len(times) - 1) :])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--size", default="gpt-2.7b")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--mbs", type=int, default=1, help="sequences per micro-batch")
    p.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b", "interleaved", "zero-bubble"])
    p.add_argument("--virtual-stages", type=int, default=1)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--ckpt", action="store_true", help="activation checkpointing")
    p.add_argument("--peak", type=float, default=989e12)
    p.add_argument("--tiny", action="store_true", help="gpt-mini, seq 128, fp32, 4 steps: a CPU smoke test")
    p.add_argument(
        "--dump-after",
        type=float,
        default=0.0,
        help="print every thread's Python stack after this many seconds, then exit (hang diagnosis)",
    )
    a = p.parse_args()
    if a.dump_after > 0:
        faulthandler.dump_traceback_later(a.dump_after, exit=True)
    if a.tiny:
        a.size, a.seq, a.vocab, a.steps = "gpt-mini", 128, 512, 4
    bh.init()
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    dev = bh.distributed.device_for_rank()
    model = build_model(a.size, vocab_size=a.vocab, seq_len=a.seq, device=dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=dev.type == "cuda")
    nparam, flops_per_tok = model.num_params(), model.flops_per_token(a.seq)  # serial counts
    plan = bh.Plan(
        pp=world,
        microbatches=a.microbatches,
        schedule=a.schedule,
        virtual_stages=a.virtual_stages,
        precision="fp32" if a.tiny else "bf16",
        activation_checkpointing=a.ckpt,
    )
    engine = bh.boost(model, opt, plan)
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    g = torch.Generator(device=dev).manual_seed(0)  # every stage holds the same batch
    x = torch.randint(0, a.vocab, (a.microbatches * a.mbs, a.seq + 1), device=dev, generator=g)
    batch = {"input_ids": x[:, :-1], "labels": x[:, 1:]}
    t_step, loss = time_pipeline(engine, batch, a.steps, dev)
    mem = torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else 0.0
    t_alone = time_stage_alone(engine, batch, a.steps, dev) if plan.virtual_stages == 1 else float("nan")
    stats = torch.tensor([t_alone, t_step], dtype=torch.float64, device=dev)
    torch.distributed.all_reduce(stats, op=torch.distributed.ReduceOp.MAX)
    t_slowest_stage, t_step_max = stats.tolist()
    tokens = a.microbatches * a.mbs * a.seq
    m, pp = a.microbatches, world
    tok_s = tokens / t_step_max
    single = tokens / t_slowest_stage  # NaN with virtual stages (no stage-alone timing): reported as null
    ideal = m / (m + pp - 1) * single
    num = lambda x, nd=None: None if x != x else round(x, nd)  # noqa: E731  (NaN -> null)
    if rank == 0:
        r = dict(
            size=a.size,
            mode=f"behemoth-pp{pp}-{a.schedule}",
            gpus=world,
            microbatches=m,
            mbs=a.mbs,
            seq=a.seq,
            ckpt=a.ckpt,
            params_b=round(nparam / 1e9, 3),
            stages=engine.stage_ranges,
            step_s=round(t_step_max, 4),
            tok_s=round(tok_s),
            tok_s_gpu=round(tok_s / world),
            tflops_gpu=round(tok_s / world * flops_per_tok / 1e12, 1),
            mfu=round(tok_s / world * flops_per_tok / a.peak, 4),
            slowest_stage_alone_s=num(t_slowest_stage, 4),
            single_stage_tok_s=num(single),
            ideal_tok_s=num(ideal),
            ideal_fraction=round(m / (m + pp - 1), 4),
            vs_ideal=num(tok_s / ideal, 4),
            bubble_measured=num(1 - t_slowest_stage / t_step_max, 4),
            bubble_theory=round((pp - 1) / (m + pp - 1), 4),
            peak_mem_gib=round(mem, 1),
            loss=round(loss, 3),
            comm={k: v["seconds"] for k, v in engine.comm_stats().items()},
        )
        print("RESULT " + json.dumps(r), flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown (torch's CPU runtime can abort there; see distributed.py)

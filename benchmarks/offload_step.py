"""One GPU's step time of offloaded plans, and where it goes: for each plan, build the model on the
device, two untimed steps (an ``offload="auto"`` plan re-places its chunks after the first), then
``--steps`` timed ones, each printed with the CPU update thread's busy seconds and the seconds
``step()`` waited for it; then the peak memory, the placement's own explanation and, with
``--profile``, one step under torch.profiler (:mod:`step_profile`).

    torchrun --standalone --nproc-per-node 1 benchmarks/offload_step.py \
        --plans "Plan(microbatches=4, zero=3, offload='auto', param_dtype='bf16', precision='bf16')" --profile

``--plans``: ``Plan(...)`` texts as ``Plan.describe()`` prints them, separated by ';'. To compare
two source trees, run it once per tree with ``PYTHONPATH=<tree>/src`` (it prints the behemoth it
imported).
"""

from __future__ import annotations

import argparse
import gc
import time

import torch
import torch.distributed as dist
from planner_proof import init_on_device, parse_plan
from step_profile import profile_steps

import behemoth as bh
from behemoth.models import build_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-8b")
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=8, help="sequences per step")
    ap.add_argument("--plans", required=True)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args()
    print("behemoth from", bh.__file__, flush=True)
    bh.init()
    dev = bh.distributed.device_for_rank()
    for text in a.plans.split(";"):
        plan = parse_plan(text)
        print("====", plan.describe(), flush=True)
        model = build_model(a.model, vocab_size=a.vocab, seq_len=a.seq, device="meta")
        model.to_empty(device=dev)
        model.tie_weights()
        init_on_device(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=plan.offload is None)
        t0 = time.perf_counter()
        engine = bh.boost(model, opt, plan)
        print(f"boost {time.perf_counter() - t0:.1f} s", flush=True)
        x = torch.randint(0, a.vocab, (a.batch, a.seq + 1), device=dev)
        batch = {"input_ids": x[:, :-1], "labels": x[:, 1:]}
        update = getattr(engine.grad_sync, "host_update", None)
        times = []
        for i in range(2 + a.steps):
            before = (update.busy_s, update.waited_s) if update else (0.0, 0.0)
            torch.cuda.synchronize()
            t = time.perf_counter()
            engine.step(batch)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
            busy, waited = (update.busy_s - before[0], update.waited_s - before[1]) if update else (0.0, 0.0)
            print(f"step {i} {times[-1]:.3f} s; CPU update busy {busy:.3f} s, waited for {waited:.3f} s", flush=True)
            if i == 1:
                torch.cuda.reset_peak_memory_stats(dev)
        timed = sorted(times[2:])
        print(
            f"STEP {plan.describe()}: median {timed[len(timed) // 2]:.3f} s of {len(timed)}; "
            f"peak {torch.cuda.max_memory_allocated(dev) / 2**30:.2f} GiB allocated",
            flush=True,
        )
        placement = getattr(engine.grad_sync, "placement", None)
        if placement is not None:
            print(placement.explain(), flush=True)
        if a.profile:
            profile_steps(lambda: engine.step(batch), 1, dev, 0, top=18, label="offload")
        engine = model = opt = batch = x = placement = update = None  # freed before the next plan
        gc.collect()
        torch.cuda.empty_cache()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

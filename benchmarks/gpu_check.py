"""GPU-only paths checked on a lent GPU machine (the CPU test suite cannot reach them): ZeRO
offload's gradient copies to the host on a side stream, the CPU update during the backward and
the worker's uploads of updated chunks on another stream.

For each plan, the same training twice: without clipping (offloaded chunks updated by the
worker thread while the backward runs, after their side-stream copy) and with a clip threshold
no gradient reaches (factor exactly 1.0: updated and uploaded after the backward). The losses,
gradient norms and ``full_state_dict()`` must be bit-identical; a worker that read a gradient
before its copy landed, or a forward that read parameters before their upload, would differ. Prints one ``CHECK ok|FAIL`` line per plan; exit status 1 on any failure.

    torchrun --standalone --nproc-per-node 1 benchmarks/gpu_check.py      (also with 2 GPUs)
"""

from __future__ import annotations

import gc
import os
import sys

import torch

import behemoth as bh
from behemoth.models import build_model
from behemoth.parallel.zero import pinned

pinned.MIN_BYTES = 2**20  # this model's chunks are small: lock them exactly, as large models' are


def train(plan: bh.Plan, clip: float | None, batches: list[dict]) -> tuple[list[float], dict, int, int]:
    """Losses and gradient norms of every step, the final full_state_dict, the early-update count
    and the bytes zero/pinned.py held locked at the end."""
    torch.manual_seed(0)
    model = build_model("gpt-125m", vocab_size=8192, seq_len=256, device="cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine = bh.boost(model, opt, plan, max_grad_norm=clip)
    losses = []
    for b in batches:  # the loss and the gradient norm of every step (parts read as reductions land)
        losses += [engine.step(b), float(engine.last_grad_norm)]
    return losses, engine.full_state_dict(), engine.grad_sync.early_updates, pinned.locked_bytes


def main() -> int:
    bh.init()
    dev = bh.distributed.device_for_rank()
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    g = torch.Generator().manual_seed(1234 + rank)
    batches = []
    for _ in range(4):
        x = torch.randint(0, 8192, (4, 257), generator=g).to(dev)
        batches.append({"input_ids": x[:, :-1], "labels": x[:, 1:]})
    failed = 0
    # (stage, micro-batches, precision, param_dtype, offload): "auto" with a 0.4 GiB budget keeps the
    # bf16 parameters on the GPU and offloads most optimizer state (a device bf16 copy of a host master)
    for stage, micro, precision, low, where in (
        (3, 1, "fp32", None, "cpu"),
        (3, 2, "bf16", None, "cpu"),
        (3, 1, "bf16", "bf16", "cpu"),
        (2, 1, "bf16", None, "cpu"),
        (1, 2, "fp32", None, "cpu"),
        (2, 1, "bf16", "bf16", "cpu"),
        (1, 2, "bf16", "bf16", "cpu"),
        (3, 1, "bf16", "bf16", "auto"),
    ):
        plan = bh.Plan(
            dp=world,
            zero=stage,
            offload=where,
            microbatches=micro,
            precision=precision,
            chunk_mb=32,
            param_dtype=low,
            offload_budget_gb=0.4 if where == "auto" else None,
        )
        (l_a, s_a, n_a, k_a), (l_b, s_b, n_b, k_b) = train(plan, None, batches), train(plan, 1e30, batches)
        max_locked = max(k_a, k_b)
        same = l_a == l_b and all(torch.equal(s_a[k], s_b[k]) for k in s_b)
        gc.collect()
        # the offloaded chunks lay in exactly-locked memory, unlocked once the engines were freed
        ok = same and n_a > 0 and n_b == 0 and max_locked > 0 and pinned.locked_bytes == 0
        failed += not ok
        if rank == 0:
            print(
                f"CHECK {'ok' if ok else 'FAIL'} zero={stage} m{micro} {precision} param_dtype={low} offload={where} "
                f"world={world}: early updates {n_a}/{n_b}, losses {l_a[-2]:.6f}/{l_b[-2]:.6f}, "
                f"norms {l_a[-1]:.6f}/{l_b[-1]:.6f}, state identical {same}, locked {max_locked / 2**20:.0f} MiB "
                f"then {pinned.locked_bytes / 2**20:.0f}",
                flush=True,
            )
    torch.distributed.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)

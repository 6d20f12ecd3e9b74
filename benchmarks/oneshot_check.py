"""The one-shot all-reduce (``behemoth.comm.oneshot``) against NCCL's all-reduce on GPUs, where the
CPU suite cannot reach it: for each dtype and size, many rounds of fresh random tensors, each
summed both ways, eagerly and replayed inside a compiled CUDA graph (the way a compiled decode
step runs it). Prints one ``CHECK`` line per case with the largest difference and the number of
rounds whose results were not bit-identical; a buffer reused before every rank read it would show
up as large differences in some rounds, rounding as small ones in many.

    torchrun --standalone --nproc-per-node 2 benchmarks/oneshot_check.py
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

from behemoth.comm.axis import Axis
from behemoth.comm.oneshot import one_shot_all_reduce
from behemoth.ledger import Ledger


def main() -> None:
    rank = int(os.environ["RANK"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    world = dist.get_world_size()
    group = dist.new_group(list(range(world)))
    axis = Axis("tp", world, rank, tuple(range(world)), group, Ledger())
    rounds = 200
    with one_shot_all_reduce(axis) as impl:
        assert impl is not None, "the one-shot all-reduce is not available here"
        for dtype in (torch.bfloat16, torch.float32):
            for numel in (4096, 8 * 4096, 16384):
                if numel * torch.finfo(dtype).bits // 8 > impl.max_bytes:
                    continue
                for mode in ("eager", "cuda-graph"):
                    src = torch.empty(numel, dtype=dtype, device="cuda")
                    fn = (
                        (lambda x: impl(x) * 1)
                        if mode == "eager"
                        else torch.compile(lambda x: impl(x) * 1, mode="reduce-overhead")
                    )
                    worst, differing = 0.0, 0
                    for i in range(rounds):
                        torch.manual_seed(1000 * rank + i)
                        src.copy_(torch.randn(numel, dtype=dtype, device="cuda"))
                        mine = fn(src).clone()
                        ref = src.clone()
                        dist.all_reduce(ref, group=group)
                        d = (mine.float() - ref.float()).abs().max().item()
                        worst = max(worst, d)
                        differing += int(d > 0)
                    if rank == 0:
                        print(
                            "CHECK "
                            + json.dumps(
                                dict(
                                    dtype=str(dtype),
                                    numel=numel,
                                    mode=mode,
                                    rounds=rounds,
                                    max_abs_diff=worst,
                                    differing_rounds=differing,
                                )
                            ),
                            flush=True,
                        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

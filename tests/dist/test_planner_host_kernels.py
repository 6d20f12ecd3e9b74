"""The kernels a tensor-parallel layout adds to a block (behemoth.planner.host.tp_block_kernels)
against a dispatch-level count of a run's: the aten ops that launch a kernel (every op but views,
allocations, dtype queries and the contiguous copies ``clone`` stands for, as
tests/unit/test_planner_elementwise.py counts a serial block's; the collectives apart, priced per
call) in one forward and, once the logits' gradient arrives, one backward of a 4-block model less
a 2-block one's, halved, under bf16 autocast, less the same count of the serial model (``dp`` over
the world). A tiny GPT (LayerNorm, biases, fused q/k/v), a tiny Llama (RMSNorm, separate q/k/v,
SwiGLU, 2 kv heads: replicated under 1D tp 4) and a Llama-8B-shaped one (32 heads over 8 kv
heads); 1D with and without sequence parallelism and over-decomposition, and 2D, on 4 gloo ranks;
2.5D (depth 2) and 3D (with and without over-decomposition) on 8; and checkpointed (the backward
with its recompute, against the serial block's checkpointed too: tp_recompute_kernels) 1D with
and without sequence parallelism and over-decomposition, 2D, 2.5D and 3D. The serial block's own
recompute (host.serial_recompute_kernels: its forward but the down projection's GEMM and the
residual add) against one process's checkpointed GPT (with and without biases) and Llama blocks."""

from __future__ import annotations

from collections import Counter

import torch
from common import SEQ, VOCAB, KernelCounter, build, count_by_phase, global_batches, make_optimizer, shard

import behemoth as bh
from behemoth.planner.host import serial_recompute_kernels, tp_block_kernels, tp_recompute_kernels
from behemoth.planner.workload import workload_for

# no kernel: views (by schema), allocations, dtype queries, and ``clone`` (the contiguous copies of
# the CPU attention kernel's gradients and of gloo's reduce-scatter stand-in)
NO_KERNEL = ("_unsafe_view", "clone", "detach", "empty", "empty_like", "new_empty", "ones_like", "promote_types")


def _model(family: str, layers: int):
    if family == "llama-8b-shaped":
        from behemoth.models import Llama, LlamaConfig

        config = LlamaConfig(
            vocab_size=VOCAB, seq_len=SEQ, num_layers=layers, num_heads=32, num_kv_heads=8, hidden=256, ffn_hidden=896
        )
        return Llama(config)
    if family == "gpt-unbiased":
        from behemoth.models import GPT, GPTConfig

        return GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, num_layers=layers, num_heads=4, hidden=32, bias=False))
    return build(family, num_layers=layers)


def _kernels(family: str, plan, layers: int) -> Counter:
    model = _model(family, layers)
    engine = bh.boost(model, make_optimizer("sgd", model), plan)
    return count_by_phase(
        engine, shard(global_batches(1, 8)[0], engine.dp_rank, engine.dp_size), KernelCounter(NO_KERNEL)
    )


def _per_block(family: str, plan) -> tuple[float, float]:
    lo, hi = _kernels(family, plan, 2), _kernels(family, plan, 4)
    return tuple((hi[p] - lo[p]) / 2 for p in ("forward", "backward"))


def _counted(plan, w) -> tuple[float, float]:
    """The planner's kernels beyond the serial block's: a checkpointed block's backward with its
    recompute's, against the serial block's checkpointed too."""
    f, b = tp_block_kernels(plan, w)
    return f, b + (tp_recompute_kernels(plan, w) if plan.activation_checkpointing else 0.0)


def _check(plans, world: int) -> None:
    for family in ("gpt", "llama", "llama-8b-shaped"):
        serials = {}
        w = {n: workload_for(_model(family, n), seq_len=SEQ, global_batch=8) for n in (2, 4)}
        for plan in plans:
            ckpt = plan.activation_checkpointing
            if ckpt not in serials:
                serials[ckpt] = _per_block(family, bh.Plan(precision="bf16", activation_checkpointing=ckpt))
            got = tuple(t - s for t, s in zip(_per_block(family, plan), serials[ckpt]))
            counted = {n: _counted(plan.resolve(world), w[n]) for n in (2, 4)}
            want = tuple((4 * counted[4][i] - 2 * counted[2][i]) / 2 for i in (0, 1))
            assert got == want, f"{family} {plan.describe()}: {got} kernels beyond the serial block's, counted {want}"


def _flat_world(rank, world):
    _check(
        (
            bh.Plan(tp=4, precision="bf16"),
            bh.Plan(tp=4, tp_overlap=2, precision="bf16"),
            bh.Plan(tp=4, sequence_parallel=True, precision="bf16"),
            bh.Plan(tp=4, sequence_parallel=True, tp_overlap=2, precision="bf16"),
            bh.Plan(tp=4, tp_mode="2d", precision="bf16"),
            bh.Plan(tp=4, precision="bf16", activation_checkpointing=True),
            bh.Plan(tp=4, sequence_parallel=True, tp_overlap=2, precision="bf16", activation_checkpointing=True),
            bh.Plan(tp=4, tp_mode="2d", precision="bf16", activation_checkpointing=True),
        ),
        world,
    )


def test_1d_and_2d_block_kernels_are_the_runs():
    torch.manual_seed(0)
    bh.spawn(_flat_world, 4, timeout=600)


def _cube_world(rank, world):
    _check(
        (
            bh.Plan(tp=8, tp_mode="2.5d", tp_depth=2, precision="bf16"),
            bh.Plan(tp=8, tp_mode="3d", precision="bf16"),
            bh.Plan(tp=8, tp_mode="3d", tp_overlap=2, precision="bf16"),
            bh.Plan(tp=8, tp_mode="2.5d", tp_depth=2, precision="bf16", activation_checkpointing=True),
            bh.Plan(tp=8, tp_mode="3d", tp_overlap=2, precision="bf16", activation_checkpointing=True),
        ),
        world,
    )


def test_2p5d_and_3d_block_kernels_are_the_runs():
    torch.manual_seed(0)
    bh.spawn(_cube_world, 8, timeout=600)


def _serial_world(rank, world):
    for family in ("gpt", "gpt-unbiased", "llama", "llama-8b-shaped"):
        plain, ckpt = (_per_block(family, bh.Plan(precision="bf16", activation_checkpointing=a)) for a in (False, True))
        recompute = serial_recompute_kernels(workload_for(_model(family, 2), seq_len=SEQ, global_batch=8).shape)
        assert ckpt == (plain[0], plain[1] + recompute), (
            f"{family}: a checkpointed serial block launches {ckpt}, unchecked {plain}, its recompute counted {recompute}"
        )


def test_serial_block_recompute_kernels_are_the_runs():
    """A checkpointed serial block's backward: the unchecked block's and the recompute counted."""
    torch.manual_seed(0)
    bh.spawn(_serial_world, 1, timeout=300)

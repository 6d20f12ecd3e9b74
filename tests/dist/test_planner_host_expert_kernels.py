"""The kernels an MoE layer launches (behemoth.planner.expert_kernels) against a dispatch-level
count of a run's: the aten ops that launch a kernel (every op but views, allocations, dtype
queries and the profiler's record functions; copies and fills counted; the collectives apart,
priced per call) in one forward and, once the logits' gradient arrives, one backward of a 4-block
model less a 2-block one's, halved, under bf16 autocast -- a tiny MoE Llama (4 experts of width
24, top-2, renormalised) less the same Llama with dense MLPs under the same plan, against the
planner's MoE block less its dense block (the layer's kernels less the dense MLP's, and the
tensor-parallel layout's own kernels of each). On the CPU, with the grouped GEMMs' fast path
forced (``torch._grouped_mm`` runs a loop of its own there) so the GPU's routes run: the copies
between host and device only a CUDA device makes (``EP_DEVICE_COPIES``) are left out. On 2 gloo
ranks: ep 1 (the local route) and ep 2 (the routed one), each with and without activation
checkpointing; ep 2 in chunks (``ep_overlap``: host.ep_chunk_kernels); 1D tensor parallelism 2
(each tp rank its share of the tokens) with and without sequence parallelism, checkpointed too
(each block's layout recomputed as far as host.tp_recompute_kernels counts); a shared expert
beside the routed ones by both routes, under 1D tp with and without sequence parallelism, and
checkpointed. On 4 ranks 2D (with and without a shared expert), on 8 2.5D (depth 2) and 3D,
checkpointed too."""

from __future__ import annotations

import dataclasses

import torch
from common import SEQ, KernelCounter, count_by_phase, global_batches, make_optimizer, moe_llama_config, shard

import behemoth as bh
from behemoth.planner.expert_kernels import EP_DEVICE_COPIES, expert_route, moe_block_kernels
from behemoth.planner.host import EP_CHUNK_DEVICE_KERNELS, ep_chunk_kernels, tp_block_kernels, tp_recompute_kernels
from behemoth.planner.workload import workload_for

# no kernel: views (by schema), allocations, dtype queries and the profiler's ranges
NO_KERNEL = (
    "_unsafe_view",
    "detach",
    "empty",
    "empty_like",
    "new_empty",
    "promote_types",
    "_record_function_enter_new",
    "_record_function_exit",
)


SHARED = 16
"""The shared expert's width where a plan runs one (``LlamaConfig.shared_expert_ffn_hidden``)."""


def _config(dense: bool, layers: int, shared: int = 0):
    config = moe_llama_config(num_layers=layers, shared_expert_ffn_hidden=shared)
    return dataclasses.replace(config, num_experts=0, shared_expert_ffn_hidden=0) if dense else config


def _per_block(plan, dense: bool, copies: bool = True, shared: int = 0) -> tuple[float, float]:
    from behemoth.models import Llama

    counts = []
    for layers in (2, 4):
        model = Llama(_config(dense, layers, shared))
        engine = bh.boost(model, make_optimizer("sgd", model), plan)
        batch = shard(global_batches(1, 8)[0], engine.dp_rank, engine.dp_size)
        counts.append(count_by_phase(engine, batch, KernelCounter(NO_KERNEL, copies)))
    lo, hi = counts
    return tuple((hi[p] - lo[p]) / 2 for p in ("forward", "backward"))


def _counted(plan, world: int, shared: int = 0) -> tuple[float, float]:
    """The planner's MoE block less its dense block under ``plan``, as a CPU run launches them."""
    plan = plan.resolve(world)
    moe, dense = (workload_for(_config(d, 2, shared), seq_len=SEQ, global_batch=8) for d in (False, True))
    f, b, again = moe_block_kernels(plan, moe)
    dense_plan = dataclasses.replace(plan, ep=1, ep_overlap=1)
    (mf, mb), (df, db) = tp_block_kernels(plan, moe), tp_block_kernels(dense_plan, dense)
    f, b = f + mf - df, b + again + mb - db
    if plan.activation_checkpointing:  # the layout's own kernels in each block's recompute
        b += tp_recompute_kernels(plan, moe) - tp_recompute_kernels(dense_plan, dense)
    if expert_route(plan, moe) == "routed":
        device_f, _, device_again = EP_DEVICE_COPIES
        f, b = f - device_f, b - (device_again if plan.activation_checkpointing else 0.0)
    cf, cb = ep_chunk_kernels(plan, moe)
    if cf:  # over-decomposed: the extra chunks' kernels, less a CUDA device's own
        (df, _, dr), (cdf, _, _) = EP_CHUNK_DEVICE_KERNELS
        k = plan.ep_overlap
        f, b = f + cf - (k - 1) * df - cdf, b + cb - ((k - 1) * dr if plan.activation_checkpointing else 0.0)
    return f, b


def _force_grouped_gemms() -> None:
    from behemoth.parallel.expert import grouped

    # the grouped GEMMs' fast kernel claimed for bf16 GEMMs on the CPU, so the GPU's routes run
    grouped._fast_kernel = lambda x: grouped.gemm_dtype(x) == torch.bfloat16


def _check(plans, world: int, copies: bool = True) -> None:
    """Each ``(plan, shared expert width)``: the MoE block's kernels beyond the dense one's, run and
    counted. The dense model runs under the same plan (ep 1: it has no experts to shard; its dense
    part is the same)."""
    for plan, shared in plans:
        moe = _per_block(plan, False, copies, shared)
        dense = _per_block(dataclasses.replace(plan, ep=1, ep_overlap=1), True, copies)
        got = tuple(m - d for m, d in zip(moe, dense))
        want = _counted(plan, world, shared)
        assert got == want, (
            f"{plan.describe()}, shared expert {shared}: an MoE block launches {got} kernels beyond a dense "
            f"one's, counted {want}"
        )


def _world(rank, world):
    _force_grouped_gemms()
    plans = (
        bh.Plan(precision="bf16"),
        bh.Plan(precision="bf16", activation_checkpointing=True),
        bh.Plan(ep=2, precision="bf16"),
        bh.Plan(ep=2, precision="bf16", activation_checkpointing=True),
        bh.Plan(ep=2, ep_overlap=3, precision="bf16"),
        bh.Plan(ep=2, ep_overlap=2, precision="bf16", activation_checkpointing=True),
        bh.Plan(tp=2, precision="bf16"),
        bh.Plan(tp=2, sequence_parallel=True, precision="bf16"),
        bh.Plan(tp=2, precision="bf16", activation_checkpointing=True),
        bh.Plan(tp=2, sequence_parallel=True, precision="bf16", activation_checkpointing=True),
    )
    _check([(plan, 0) for plan in plans], world)
    # a shared expert beside the routed ones: the local route and the routed one, checkpointed, and
    # each tp rank's share with and without sequence parallelism (its input already in bf16)
    shared = (
        bh.Plan(precision="bf16"),
        bh.Plan(precision="bf16", activation_checkpointing=True),
        bh.Plan(ep=2, precision="bf16"),
        bh.Plan(ep=2, ep_overlap=2, precision="bf16", activation_checkpointing=True),
        bh.Plan(tp=2, precision="bf16"),
        bh.Plan(tp=2, sequence_parallel=True, precision="bf16", activation_checkpointing=True),
    )
    _check([(plan, SHARED) for plan in shared], world)


def test_moe_block_kernels_are_the_runs():
    torch.manual_seed(0)
    bh.spawn(_world, 2, timeout=120)


def _grid_world(rank, world):
    """Under a 2D grid the dense block's SUMMA collectives make contiguous copies of their own
    (priced per call, and gloo's differ from NCCL's) that the MoE block's MLP does not: copies are
    left out of both counts here. The MoE block's share of its grid row's tokens is counted as
    1D's without sequence parallelism; a shared expert, as 1D's without sequence parallelism."""
    _force_grouped_gemms()
    plan = bh.Plan(tp=4, tp_mode="2d", precision="bf16")
    _check([(plan, 0), (plan, SHARED)], world, copies=False)


def test_moe_block_kernels_under_a_2d_grid_are_the_runs():
    torch.manual_seed(0)
    bh.spawn(_grid_world, 4, timeout=180)


def _cube_world(rank, world):
    """2.5D (depth 2) and 3D on 8 ranks, as the 2D grid: the grid row's all-to-all each way and the
    counts summed over the grid's two other axes (in place: no kernel), checkpointed too (the
    recompute stops short of the exchange that puts the output back), a shared expert under 3D."""
    _force_grouped_gemms()
    twofive = bh.Plan(tp=8, tp_mode="2.5d", tp_depth=2, precision="bf16")
    cube = bh.Plan(tp=8, tp_mode="3d", precision="bf16")
    plans = [(twofive, 0), (cube, 0), (dataclasses.replace(cube, activation_checkpointing=True), SHARED)]
    plans.append((dataclasses.replace(twofive, activation_checkpointing=True), 0))
    _check(plans, world, copies=False)


def test_moe_block_kernels_under_2p5d_and_3d_grids_are_the_runs():
    torch.manual_seed(0)
    bh.spawn(_cube_world, 8, timeout=400)

"""Device memory a rank holds beyond what PyTorch's allocator hands out: the prediction's reserve.

A layout "fits" when its tensors at their peak (:mod:`.footprint`) plus this reserve fit the
card. Three parts, each from the calibration (``benchmarks/calibrate.py`` measures the first
two on the machine, with ``torch.cuda.mem_get_info`` against ``torch.cuda.memory_reserved``):

* the **CUDA context** and the libraries' workspaces (``Calibration.cuda_context_bytes``);
* one set of **NCCL buffers per communicator** the rank opens: the world's, one per process
  group of a mesh axis it belongs to and runs collectives on (an axis over the whole world is
  the world's group), ``Calibration.nccl_comm_bytes`` each, and a pipeline's four 2-rank
  channels (activations and gradients to and from each neighbour, ``pipeline_channels`` in
  ``parallel/pipeline/p2p.py``), ``Calibration.nccl_p2p_bytes`` each -- the groups are made in
  ``mesh.py`` (``ParallelMesh``, ``channel_axes``), one per named axis even where two axes
  have the same members;
  An all-to-all (Ulysses' context exchange, the experts' token exchange) or a ring's
  send and receive also opens NCCL's point-to-point connections to each peer it exchanges with,
  ``Calibration.nccl_p2p_bytes`` each: 4 x H200 ran ``Plan(cp=4, zero=3)`` with 2.75 GiB outside
  PyTorch's allocator (its out-of-memory report) against 1.50 GiB for the context and the world's
  communicator, the three peers' connections at 0.41 GiB each; the 2-GPU cp=2 layouts showed the
  one peer's (2.0 against 1.5 GiB).
* the **caching allocator's slack** (:func:`allocator_slack`): memory it keeps reserved beyond
  the allocated peak and cannot release, free parts of cached blocks split by requests of
  another size. It is carried by the footprint (``Footprint.slack``, which reads the loss's
  logits) beside ``Calibration.allocator_slack`` of the peak here (0 in the shipped
  calibrations: the slack does not grow with the peak, see :func:`allocator_slack`).

A calibration without ``cuda_context_bytes`` (older files) keeps its flat ``reserved_bytes``
in place of the first two. Pure; tests/unit/test_planner_reserve.py.
"""

from __future__ import annotations

import math

from ..plan import Plan
from .calibration import Calibration

__all__ = ["allocator_slack", "communicators", "device_reserve"]

GIB = 2.0**30

PIPELINE_CHANNELS = 4
"""2-rank groups a pipeline rank sends or receives on: activations from the previous stage
and to the next, gradients from the next and to the previous (the same four when pp = 2)."""


def communicators(plan: Plan, *, experts: bool = False) -> tuple[int, int]:
    """``(collective, point-to-point)`` communicators one rank of ``plan`` (resolved) opens
    beyond the world's: a group per mesh axis it runs collectives on whose size is neither 1
    nor the world's (``experts``: a mixture of experts, whose MoE blocks under tensor parallelism
    sync their gradients over the data axis times tp, and under expert parallelism over ``ep_dp``
    times tp as well); its pipeline channels, and a point-to-point connection per peer of an
    all-to-all (Ulysses over cp, the experts over ep) or of ring attention's exchange (the
    previous and the next rank)."""
    world = plan.dp * plan.pp * plan.tp * plan.cp
    sizes = []
    if plan.dp > 1:
        sizes.append(plan.dp)  # dp (data parallelism; the engine's token count under cp too)
    if plan.cp > 1:
        sizes += [plan.cp, plan.dp * plan.cp]  # cp (attention), dp_cp (the gradient sync)
    if plan.tp > 1:
        sizes.append(plan.tp)
        if plan.tp_mode != "1d":  # the grid's rows and columns (and depth)
            if plan.tp_mode == "3d":
                q = d = round(plan.tp ** (1 / 3))
            else:
                d = plan.tp_depth if plan.tp_mode == "2.5d" else 1
                q = math.isqrt(plan.tp // d)
            sizes += [q, q, d]
    if plan.ep > 1:
        sizes += [plan.ep, plan.dp // plan.ep] + ([plan.dp // plan.ep * plan.cp] if plan.cp > 1 else [])
    if experts and plan.tp > 1:
        sizes.append(plan.dp * plan.cp * plan.tp)
        if plan.ep > 1:
            sizes.append(plan.dp // plan.ep * plan.cp * plan.tp)
    if plan.pp > 1:
        sizes.append(plan.pp)
    collective = sum(1 for s in sizes if 1 < s < world)
    p2p = PIPELINE_CHANNELS if plan.pp > 1 else 0
    if plan.cp > 1:
        p2p += plan.cp - 1 if plan.cp_mode == "ulysses" else min(2, plan.cp - 1)
    if plan.ep > 1:
        p2p += plan.ep - 1
    return collective, p2p


def device_reserve(plan: Plan, cal: Calibration, allocated: float, *, experts: bool = False) -> float:
    """Bytes beyond ``allocated`` (the predicted peak of PyTorch's tensors) that one rank of
    ``plan`` (resolved; ``experts``: of a mixture of experts) holds on its device: context, NCCL
    buffers, allocator slack."""
    slack = cal.allocator_slack * allocated
    if cal.cuda_context_bytes <= 0:
        return cal.reserved_bytes + slack
    coll, p2p = communicators(plan, experts=experts)
    return cal.cuda_context_bytes + (1 + coll) * cal.nccl_comm_bytes + p2p * cal.nccl_p2p_bytes + slack


LOSS_LOGITS_BLOCKS = 4
"""Logits-sized fp32 tensors the loss allocates and frees each micro-batch (``F.cross_entropy``
over ``logits.float()``: the fp32 cast and the log-probabilities forward, their gradient and the
logits' gradient backward): the blocks :func:`allocator_slack` counts as stranded."""


def allocator_slack(logits: float) -> float:
    """Bytes the caching allocator holds reserved beyond the allocated peak that a layout needs:
    ``LOSS_LOGITS_BLOCKS * logits``, ``logits`` one micro-batch's fp32 logits on this rank.

    What it needs is not what a run shows when the card has room: when a device allocation fails,
    PyTorch's caching allocator frees every cached segment with no live tensor in it and retries
    (``release_cached_blocks`` in ``CUDACachingAllocator.cpp``), so only the free parts of segments
    that still hold a live tensor stay reserved -- what its out-of-memory report calls "reserved but
    unallocated". Those parts come from the step's largest transients freed at a change of phase:
    the loss's logits-sized fp32 tensors (:data:`LOSS_LOGITS_BLOCKS`) are freed as the backward
    starts, whose requests (a block's gradients, ZeRO's chunks) are smaller, so best-fit splits the
    cached logits blocks for them and the next micro-batch's logits need blocks of their own; each
    of the four can be stranded so. Tensors freed and requested again at the same size -- a
    checkpointed block's recomputed set by the next block's, ZeRO-3's equal chunks by the next
    gather (counted allocated by :func:`.footprint.zero3_held_bytes`) -- get their own blocks back
    and strand nothing. The out-of-memory reports of the 2 and 4 x H200 proofs: 7.52 GiB reserved
    but unallocated beside 1.96 GiB logits (Llama-8B shape, ``cp=2`` ring, ZeRO-3), 14.90 beside
    3.91 (``dp=2``, ZeRO-1, checkpointed), 10.8 beside 3.07 (GPT-6.9B, ``cp=4``, ZeRO-3): 3.5-3.8
    logits. The reserved less allocated peak of a run with room on the card (up to 42 GiB, Llama-8B
    ``tp=2`` with sequence parallelism, checkpointed) is cache the allocator would have released."""
    return LOSS_LOGITS_BLOCKS * logits

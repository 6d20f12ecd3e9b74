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
  the allocated peak, in blocks cached between uses that a later request of another size cannot
  take. It is carried by the footprint (``Footprint.slack``, which reads the layout's transient
  tensors) beside ``Calibration.allocator_slack`` of the peak here (0 in the shipped calibrations:
  the slack measured does not grow with the peak, see :func:`allocator_slack`).

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


def communicators(plan: Plan) -> tuple[int, int]:
    """``(collective, point-to-point)`` communicators one rank of ``plan`` (resolved) opens
    beyond the world's: a group per mesh axis it runs collectives on whose size is neither 1
    nor the world's; its pipeline channels, and a point-to-point connection per peer of an
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
    if plan.pp > 1:
        sizes.append(plan.pp)
    collective = sum(1 for s in sizes if 1 < s < world)
    p2p = PIPELINE_CHANNELS if plan.pp > 1 else 0
    if plan.cp > 1:
        p2p += plan.cp - 1 if plan.cp_mode == "ulysses" else min(2, plan.cp - 1)
    if plan.ep > 1:
        p2p += plan.ep - 1
    return collective, p2p


def device_reserve(plan: Plan, cal: Calibration, allocated: float) -> float:
    """Bytes beyond ``allocated`` (the predicted peak of PyTorch's tensors) that one rank of
    ``plan`` (resolved) holds on its device: context, NCCL buffers, allocator slack."""
    slack = cal.allocator_slack * allocated
    if cal.cuda_context_bytes <= 0:
        return cal.reserved_bytes + slack
    coll, p2p = communicators(plan)
    return cal.cuda_context_bytes + (1 + coll) * cal.nccl_comm_bytes + p2p * cal.nccl_p2p_bytes + slack


SLACK_FLOOR = 2.2 * GIB
SLACK_PER_LOGITS = 1.0
SLACK_PER_GATHERED = 2.1
SLACK_PER_RECOMPUTED = 5.3
SLACK_MARGIN = 2.8 * GIB
"""The allocator-slack model's terms (:func:`allocator_slack`), fitted by least squares with
non-negative coefficients to every layout the GPU proofs measured on H200 under torch 2.11
(``benchmarks/planner_proof.py``: GPT-6.9B on 4 GPUs, 9 layouts, and on 2 GPUs, 12; the
Llama-8B shape on 2 GPUs, 7), the measured peak reserved less the peak allocated, or for a
layout that ran out of memory the "reserved but unallocated" its report gave (two: 10.8 and
14.9 GiB; two Llama ``cp=2`` layouts that failed with < 1 GiB unallocated are out: their
allocated peak was mispredicted, not the slack). The residuals' root mean square, 2.8 GiB, is
the margin; the worst under-prediction of the fitted terms without it is 10.7 GiB (GPT-6.9B ``tp=2``, sequence
parallelism, ZeRO-1, checkpointing: 30.1 GiB measured with 58 GiB of the card free, where the
allocator had no reason to release its cache), then 3.4 GiB (4 GPUs, pp=2 interleaved with cp=2
ring)."""


def allocator_slack(logits: float, gathered: float, recomputed: float) -> float:
    """Bytes the caching allocator holds reserved beyond the allocated peak, as the fit rule
    counts them: ``SLACK_FLOOR + SLACK_PER_LOGITS * logits + SLACK_PER_GATHERED * gathered +
    SLACK_PER_RECOMPUTED * recomputed + SLACK_MARGIN``.

    What drives it are the large tensors a step allocates and frees again among longer-lived
    ones, whose freed blocks later requests of other sizes split or cannot use: ``logits``, one
    micro-batch's fp32 logits on this rank (the loss allocates several tensors this size: the
    out-of-memory reports of the proofs were requests of exactly this size, 3.07 and 3.91 GiB);
    ``gathered``, ZeRO-3's parameters and gradients of the blocks gathered at once over more
    than one rank (0 otherwise); ``recomputed``, under activation checkpointing one block's full
    saved set, which each block's recompute allocates and its backward frees (0 without). Fitted
    without the peak itself as a term: with it the fit gave it 0.001 per byte (GPT-6.9B's 2-GPU
    pipeline of 73 GiB held 0.9 GiB of slack, its ``tp=4`` layout of 110 GiB 3.8). The margin, the
    fit's root-mean-square residual, is added so that a layout predicted within the allocator's
    uncertainty of the card is not called a fit (``Plan(cp=4, zero=3)`` on 4 x H200, predicted
    at 127.1 GiB allocated, ran out of memory with 10.8 GiB reserved beside 124.6 allocated).
    The terms and the data: :data:`SLACK_FLOOR`."""
    return (
        SLACK_FLOOR
        + SLACK_PER_LOGITS * logits
        + SLACK_PER_GATHERED * gathered
        + SLACK_PER_RECOMPUTED * recomputed
        + SLACK_MARGIN
    )

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
* the **caching allocator's slack**: memory it keeps reserved beyond the allocated peak
  (blocks split and cached between uses), ``Calibration.allocator_slack`` of that peak.

A calibration without ``cuda_context_bytes`` (older files) keeps its flat ``reserved_bytes``
in place of the first two. Pure; tests/unit/test_planner_reserve.py.
"""

from __future__ import annotations

import math

from ..plan import Plan
from .calibration import Calibration

__all__ = ["communicators", "device_reserve"]

PIPELINE_CHANNELS = 4
"""2-rank groups a pipeline rank sends or receives on: activations from the previous stage
and to the next, gradients from the next and to the previous (the same four when pp = 2)."""


def communicators(plan: Plan) -> tuple[int, int]:
    """``(collective, point-to-point)`` communicators one rank of ``plan`` (resolved) opens
    beyond the world's: a group per mesh axis it runs collectives on whose size is neither 1
    nor the world's, and its pipeline channels."""
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
    return collective, PIPELINE_CHANNELS if plan.pp > 1 else 0


def device_reserve(plan: Plan, cal: Calibration, allocated: float) -> float:
    """Bytes beyond ``allocated`` (the predicted peak of PyTorch's tensors) that one rank of
    ``plan`` (resolved) holds on its device: context, NCCL buffers, allocator slack."""
    slack = cal.allocator_slack * allocated
    if cal.cuda_context_bytes <= 0:
        return cal.reserved_bytes + slack
    coll, p2p = communicators(plan)
    return cal.cuda_context_bytes + (1 + coll) * cal.nccl_comm_bytes + p2p * cal.nccl_p2p_bytes + slack

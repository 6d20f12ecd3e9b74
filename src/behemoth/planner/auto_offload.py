"""What ``offload='auto'`` keeps on the GPU, predicted: the runtime's own split over the planner's chunks.

The runtime (:class:`~behemoth.parallel.zero.auto.ChunkPlacement`) runs a warm-up step, measures its
peak of everything but the model data (activations, gathered chunks, the loss), gives the model data
what is left (:func:`~behemoth.parallel.zero.placement.measured_budget`) and splits the chunks there
(:func:`~behemoth.parallel.zero.placement.chunk_split`): a prefix keeps its parameters on the GPU, a
shorter one its master and optimizer state too, the rest live on the host. The planner does the same
with its predictions: the footprint of the plan with every chunk offloaded is the step's other data
(at ZeRO 1-2 less the parameters, which stay on the GPU), and the chunks are those the runtime packs
(:func:`.zero3_traffic.rank_param_sizes` at the chunk size the runtime picks: :func:`.zero3_traffic.
chunk_elements`).
The split's bandwidths are the calibration's (the runtime measures its own: a host whose copy or
CPU-update rate differs from the calibration's may split elsewhere).

The result is a :class:`~.footprint.Footprint` with the kept model data on the GPU, the offloaded
chunks' host memory by the runtime's rule, and the fractions of the shard whose optimizer runs on the
host and whose parameters are fetched from it, which the cost model charges
(:func:`.cost.predict`). Costed without a pipeline and for one chunk group (a dense model, or experts
at ``ep = 1``): :func:`auto_refusal` names the rest.

Tested in tests/unit/test_planner_auto_offload.py.
"""

from __future__ import annotations

import dataclasses

from ..parallel.zero.auto import STATE_BYTES
from ..parallel.zero.placement import chunk_split, measured_budget
from ..plan import Plan
from .cluster import Cluster
from .memory import packed_layout
from .workload import Workload
from .zero3_traffic import chunk_elements, rank_param_sizes

__all__ = ["auto_refusal", "place_auto", "shard_chunks"]

ADAM_STATE = STATE_BYTES["AdamW"]


def auto_refusal(offload: str | None, pp: int, ep: int, w: Workload) -> str:
    """Why the planner cannot cost ``offload='auto'`` for a plan of ``pp`` and ``ep`` (empty where it
    can, or where ``offload`` is not ``'auto'``)."""
    if offload != "auto":
        return ""
    if pp > 1:
        return "offload='auto' is costed without a pipeline"
    if w.num_experts and ep > 1:
        return "offload='auto' is costed for one chunk group (experts at ep 1)"
    return ""


def shard_chunks(plan: Plan, w: Workload) -> list[int]:
    """This rank's chunk shards in elements, in the order the runtime packs and places them."""
    sizes, _ = rank_param_sizes(plan, w)
    layout = packed_layout(sizes, chunk_elements(plan, w), plan.dp * plan.cp)
    return [c.shard_size for c in layout.chunks]


def place_auto(plan: Plan, w: Workload, cluster: Cluster, offloaded) -> object:
    """``offloaded`` (the footprint of ``plan`` with every chunk on the host) with the chunks the
    runtime's split keeps moved back to the GPU."""
    z, cal = plan.zero, cluster.calibration
    pb = 2 if plan.param_dtype == "bf16" else 4
    masters = 4 if pb == 2 else 0
    other = offloaded.allocated - (offloaded.params if z < 3 else 0.0)
    shards = shard_chunks(plan, w)
    total = float(sum(shards))
    try:
        keep_p, keep_o, _ = chunk_split(
            z,
            shards,
            ADAM_STATE,
            pb,
            measured_budget(int(cluster.memory_bytes), int(other)),
            bandwidth=cal.h2d_bytes_per_s,
            cpu_update_bandwidth=cal.cpu_adam_params_per_s * 4,
            host_budget_bytes=int(cluster.host_bytes),
            resident_bytes=int(total) * plan.dp * plan.cp * pb if z < 3 else 0,  # stages 1-2: whole parameters
        )
    except ValueError:  # the host cannot hold what any split offloads: everything stays offloaded
        return offloaded
    kept_p = float(sum(shards[:keep_p])) if z == 3 else 0.0
    kept_o = float(sum(shards[:keep_o]))
    host_o, host_p = total - kept_o, (total - kept_p if z == 3 else 0.0)
    # a kept chunk: its parameters (stage 3; stages 1-2 keep every chunk's), its gradient shard (stage
    # 1 at one replica: the gradient chunk itself, already counted) and its master and optimizer state
    grads = kept_o * 4 if (z >= 2 or plan.dp * plan.cp > 1) else 0.0
    return dataclasses.replace(
        offloaded,
        params=offloaded.params + kept_p * pb,
        grads=offloaded.grads + grads,
        optimizer=kept_o * (ADAM_STATE + masters),
        host=host_o * (8 + ADAM_STATE) + host_p * (4 - pb),
        host_optimizer_fraction=host_o / total if total else 0.0,
        host_param_fraction=host_p / total if total else 0.0,
    )

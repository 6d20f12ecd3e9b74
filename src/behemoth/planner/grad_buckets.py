"""The gradient sync's groups as the cost model counts them: per gradient axis, the parameters one
rank reduces over it and the buckets (ZeRO 0) or chunks (ZeRO 1-3) they reduce in.

The data axis (``dp``, x ``cp``) reduces the dense parameters; under tensor parallelism an MoE
block's router (and its experts at ``ep = 1``) reduce over the data axis times tp
(:func:`.axis_traffic.block_axis`); under expert parallelism the experts reduce over ``ep_dp``
(x cp, x tp; :func:`.axis_traffic.expert_axis`), as ``parallel/expert/style.py``'s
``expert_param_axes`` tells the runtime's gradient sync. The counts follow
``parallel/zero/chunks.py``'s packing. Pure; :func:`~.cost.predict` reads them for each axis's
collective calls and its ZeRO shard; tests/dist/test_planner_expert_ledger.py checks ZeRO 0's
buckets against the runtime's.
"""

from __future__ import annotations

import math

from ..plan import Plan
from .axis_traffic import block_axis, expert_axis, expert_local_params
from .moe_bytes import tp_summed_params
from .params import local_params
from .workload import Workload

__all__ = ["gradient_buckets", "sync_groups"]


def gradient_buckets(plan: Plan, w: Workload, layers: int, *, stage: int | None = None) -> dict[str, int]:
    """Buckets (ZeRO 0) or chunks (ZeRO 1-3) of ``bucket_mb`` each that a rank's gradients of
    ``layers`` blocks (and its stage's other parts) reduce in, per axis: the data axis's, and under
    expert parallelism (over more than one replica) the experts' axis's; under tensor parallelism
    an MoE block's router (and its experts at ``ep = 1``) over the data axis times tp
    (:func:`.axis_traffic.block_axis`), its experts under expert parallelism over ``ep_dp`` times
    tp. ZeRO 0 closes a bucket where the parameter kind changes (``parallel/zero/chunks.py``'s
    ``pack_buckets``), so each block's experts sit in buckets apart from the dense parameters
    around them: the dense parameters' ``layers + 1`` runs and the experts' ``layers`` runs each
    take at least one."""
    return {axis: nb for axis, (_, nb) in sync_groups(plan, w, layers, stage).items()}


def sync_groups(plan: Plan, w: Workload, layers: int, stage: int | None) -> dict[str, tuple[float, int]]:
    """Per gradient axis, ``(the parameters one rank syncs over it, their buckets or chunks)``
    (:func:`gradient_buckets`); an axis of one rank is left out."""
    n = local_params(plan, w, layers=layers, stage=stage)
    experts = expert_local_params(plan, w, layers)
    summed = tp_summed_params(plan, w, layers)
    bucket = plan.bucket_mb * 2**20
    runs = layers if (experts or summed) and plan.zero == 0 else 0
    g = plan.dp * plan.cp

    def buckets(count: float, extra: int) -> int:
        return max(1, math.ceil(count * 4 / bucket)) + extra

    out = {}
    if g > 1:
        dense = n - (summed or experts)
        out["dp_cp" if plan.cp > 1 else "dp"] = (dense, buckets(dense, runs))
    if summed > experts:  # the routers (and the experts at ep = 1), summed over the data axis times tp
        out[block_axis(plan)] = (summed - experts, buckets(summed - experts, max(0, runs - 1)))
    if experts and g // plan.ep * plan.tp > 1:  # the experts' replicas reduce theirs
        out[expert_axis(plan)] = (experts, buckets(experts, max(0, runs - 1)))
    return out

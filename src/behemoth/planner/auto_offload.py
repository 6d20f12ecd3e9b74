"""What ``offload='auto'`` keeps on the GPU, predicted: the runtime's own split over the planner's chunks.

The runtime (:class:`~behemoth.parallel.zero.auto.ChunkPlacement`) runs a warm-up step, measures its
peak of everything but the model data (activations, gathered chunks, the loss), gives the model data
what is left (:func:`~behemoth.parallel.zero.placement.measured_budget`; ``Plan.offload_budget_gb``
where given) and splits the chunks there
(:func:`~behemoth.parallel.zero.placement.chunk_split`): a prefix keeps its parameters on the GPU, a
shorter one its master and optimizer state too, the rest live on the host. The planner does the same
with its predictions: the footprint of the plan with every chunk offloaded is the step's other data
(at ZeRO 1-2 less the parameters, which stay on the GPU), and the chunks are those the runtime packs
(:func:`stage_chunks`: the rank's parameters, :func:`stage_params`, at the chunk size the runtime's
search picks, or ``Plan.chunk_mb``'s).
The split's bandwidths are the calibration's (the runtime measures its own: a host whose copy or
CPU-update rate differs from the calibration's may split elsewhere).

Under a pipeline each rank builds its own ZeRO optimizer over its stage's parameters -- its own
chunk store and placement, its own warm-up measurement on its own device -- so each rank splits its
own chunks at its own budget (:func:`place_stages`); the plan's memory is the worst rank's, its host
work the most any rank offloads. Under expert parallelism the experts are chunk groups of their own
(sharded over ``ep_dp``, times tp under tensor parallelism, as an MoE block's other parameters are
over the data axis times tp), but of the one store: their chunks interleave with the dense ones in
the order they open, and one split runs over them all at one budget.

The result is a :class:`~.footprint.Footprint` with the kept model data on the GPU, the offloaded
chunks' host memory by the runtime's rule, and the fractions of the shard whose optimizer runs on the
host and whose parameters are fetched from it, which the cost model charges (:func:`.cost.predict`).

Tested in tests/unit/test_planner_auto_offload.py, and against the runtime on gloo ranks (with and without a
pipeline) in tests/dist/test_planner_auto_split.py.
"""

from __future__ import annotations

import dataclasses
from functools import lru_cache

from ..parallel.zero.auto import STATE_BYTES
from ..parallel.zero.chunks import chunk_candidates, least_padding, pack_chunks
from ..parallel.zero.placement import chunk_split, measured_budget, split_costs
from ..plan import Plan
from .cluster import Cluster
from .params import stage_layers
from .workload import Workload
from .zero3_traffic import final_norm_index, rank_param_sizes

__all__ = ["auto_keep", "place_auto", "place_stages", "shard_chunks", "stage_chunks", "stage_params"]

ADAM_STATE = STATE_BYTES["AdamW"]

DENSE, EXPERT, MOE_TP = 0, 1, 2
"""Chunk groups (``ZeroOptimizer``'s: one per axis a parameter is replicated over): the dense
parameters over the data axis, the experts under expert parallelism over ``ep_dp`` (times tp under
tensor parallelism), an MoE block's other parameters under tensor parallelism (the router, and the
experts at ``ep = 1``) over the data axis times tp (``parallel/expert/style.py``'s ``expert_param_axes``)."""


def stage_params(plan: Plan, w: Workload, stage: int = 0) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(sizes, groups)``: pipeline rank ``stage``'s trainable parameters in registration order (the
    order ``ZeroOptimizer`` packs them in) and per parameter its chunk group (:data:`DENSE`,
    :data:`EXPERT`, :data:`MOE_TP`). A rank keeps the serial model's order over what it holds
    (``parallel/pipeline/stage.py`` replaces the rest by parameter-free modules): the embeddings on
    the first rank, its blocks (over all its virtual stages: :func:`.params.stage_layers`), the final
    norm and the head on the last -- a head tied to the embedding there as its own copy, registered
    where the head is. Sizes by :func:`.zero3_traffic.rank_param_sizes` (exact for behemoth's GPT and
    Llama, dense or MoE, without tensor parallelism; an estimate under it)."""
    sizes, kinds = rank_param_sizes(plan, w)
    groups = list(kinds)
    layers = w.shape.num_layers
    tail = final_norm_index(w, len(sizes))
    pre = 1 + (1 if w.shape.max_positions else 0)  # the token table, the position table
    per = (tail - pre) // layers
    if w.num_experts and plan.tp > 1:  # an MoE block (its last three: the experts, then the router) over x tp
        for b in range(layers):
            for i in range(pre + b * per + per - 3, pre + (b + 1) * per):
                groups[i] = EXPERT if groups[i] == EXPERT else MOE_TP
    if plan.pp == 1:
        return sizes, tuple(groups)
    head = 1 if w.tied_embeddings else 0  # the tied head's copy, after the final norm
    mine = stage_layers(plan, w)[stage]
    ranges = ([(0, pre)] if stage == 0 else []) + [(pre, pre + per * mine)]
    if stage == plan.pp - 1:
        ranges.append((tail, len(sizes)))
    out_s = [s for a, b in ranges for s in sizes[a:b]]
    out_g = [k for a, b in ranges for k in groups[a:b]]
    if stage == plan.pp - 1 and head:
        out_s.append(sizes[0])
        out_g.append(DENSE)
    return tuple(out_s), tuple(out_g)


def group_shards(plan: Plan) -> dict[int, int]:
    """Each chunk group's shard count: the ranks its replica axis spans."""
    g, t = plan.dp * plan.cp, plan.tp
    return {DENSE: g, EXPERT: max(g // plan.ep, 1) * t, MOE_TP: g * t}


@lru_cache(maxsize=4096)
def _layout(sizes: tuple[int, ...], groups: tuple[int, ...], shards: tuple[tuple[int, int], ...], fixed: int | None):
    """``pack_chunks`` at the size ``ZeroOptimizer._pack`` picks: ``fixed`` (``Plan.chunk_mb``'s), else
    ``search_chunk_size``'s over its candidates (the least padding summed over the groups, ties to
    the larger; :func:`~behemoth.parallel.zero.chunks.least_padding`, as the runtime's search counts
    them), packed once per parameters, groups and shard counts (a search asks again for every plan
    sharing them)."""
    dps = {k: d for k, d in shards if k in groups}
    chunk = least_padding(sizes, groups, dps, chunk_candidates(sizes))[0] if fixed is None else fixed
    return pack_chunks(list(sizes), chunk, dps, groups=list(groups))


def stage_chunks(plan: Plan, w: Workload, stage: int = 0):
    """Pipeline rank ``stage``'s chunk layout, as ``ZeroOptimizer`` packs it: every chunk group's
    chunks in the order they open (dense and expert chunks interleaved, one store)."""
    fixed = None if plan.chunk_mb is None else max(1, int(plan.chunk_mb * 2**20 // 4))
    sizes, groups = stage_params(plan, w, stage)
    return _layout(sizes, groups, tuple(group_shards(plan).items()), fixed)


def shard_chunks(plan: Plan, w: Workload, stage: int = 0) -> list[int]:
    """Rank ``stage``'s chunk shards in elements, in the order the runtime packs and places them."""
    return [c.shard_size for c in stage_chunks(plan, w, stage).chunks]


def auto_keep(plan: Plan, w: Workload, cluster: Cluster, other: float, stage: int = 0) -> tuple[int, int] | None:
    """``(keep_p, keep_o)``: how many chunks of pipeline rank ``stage`` of ``plan`` the runtime's split
    keeps with their parameters, and with their master and optimizer state, on the GPU (a prefix,
    in the order :func:`shard_chunks` gives), at ``Plan.offload_budget_gb`` or, where not given,
    :func:`~behemoth.parallel.zero.placement.measured_budget` of ``other`` (the step's other data in
    bytes). None where the host cannot hold what any split offloads (everything stays offloaded)."""
    z, cal = plan.zero, cluster.calibration
    pb = 2 if plan.param_dtype == "bf16" else 4
    chunks = stage_chunks(plan, w, stage).chunks
    shards = [c.shard_size for c in chunks]
    given = plan.offload_budget_gb
    budget = measured_budget(int(cluster.memory_bytes), int(other)) if given is None else int(given * 2**30)
    if z == 3 and len(shards) > 1 and budget <= max(shards) * pb:  # the split's one choice: nothing kept
        # (no prefix and the fetch buffer fit where the budget is the largest chunk's), if the host holds it
        if sum(split_costs(shards, ADAM_STATE, pb)[2]) > int(cluster.host_bytes):
            return None
        return 0, 0
    try:
        keep_p, keep_o, _ = chunk_split(
            z,
            shards,
            ADAM_STATE,
            pb,
            budget,
            bandwidth=cal.h2d_bytes_per_s,
            cpu_update_bandwidth=cal.cpu_adam_params_per_s * 4,
            host_budget_bytes=int(cluster.host_bytes),
            resident_bytes=sum(c.size for c in chunks) * pb if z < 3 else 0,  # stages 1-2: whole parameters
        )
    except ValueError:  # the host cannot hold what any split offloads
        return None
    return keep_p, keep_o


def place_auto(plan: Plan, w: Workload, cluster: Cluster, offloaded, stage: int = 0) -> object:
    """``offloaded`` (the footprint of pipeline rank ``stage`` of ``plan`` with every chunk on the
    host) with the chunks the runtime's split keeps (:func:`auto_keep`) moved back to the GPU."""
    other = offloaded.allocated - (offloaded.params if plan.zero < 3 else 0.0)
    keep = auto_keep(plan, w, cluster, other, stage)
    if keep is None:
        return offloaded
    return _kept(plan, offloaded, stage_chunks(plan, w, stage).chunks, *keep)


def _kept(plan: Plan, offloaded, chunks, keep_p: int, keep_o: int) -> object:
    """``offloaded`` with chunks ``[0, keep_p)`` keeping their parameters and ``[0, keep_o)`` their
    master and optimizer state on the GPU."""
    z = plan.zero
    pb = 2 if plan.param_dtype == "bf16" else 4
    masters = 4 if pb == 2 else 0
    shards = [c.shard_size for c in chunks]
    total = float(sum(shards))
    kept_p = float(sum(shards[:keep_p])) if z == 3 else 0.0
    kept_o = float(sum(shards[:keep_o]))
    host_o, host_p = total - kept_o, (total - kept_p if z == 3 else 0.0)
    # a kept chunk: its parameters (stage 3; stages 1-2 keep every chunk's), its reduced gradient shard
    # (but where the gradient chunk is that shard, already counted: a chunk of one replica at stage 1;
    # and none under a pipeline at stages 2-3, whose step frees the last one before its gradient chunks
    # fill) and its master and state
    grads = 4.0 * sum(c.shard_size for c in chunks[:keep_o] if (plan.pp == 1 if z >= 2 else c.dp > 1))
    return dataclasses.replace(
        offloaded,
        params=offloaded.params + kept_p * pb,
        grads=offloaded.grads + grads,
        optimizer=kept_o * (ADAM_STATE + masters),
        host=host_o * (8 + ADAM_STATE) + host_p * (4 - pb),
        host_optimizer_fraction=host_o / total if total else 0.0,
        host_param_fraction=host_p / total if total else 0.0,
    )


def place_stages(plan: Plan, w: Workload, cluster: Cluster, ranks, offloaded: list) -> list:
    """The footprints of pipeline ranks ``ranks`` (``offloaded``: each with every chunk on the host)
    placed as each rank places its chunks: every rank builds its own ZeRO optimizer, chunk store and
    ``ChunkPlacement`` over its stage's parameters (``parallel/zero/sync.py``'s ``build_grad_sync``
    on the rank's cut-down model) and measures its own warm-up peak of other data on its own
    device, so each splits its own chunks at its own budget (:func:`place_auto` with ``stage``).

    ``ranks`` are :func:`.footprint.plan_memory`'s, those whose memory can be the most: they also
    offload the largest share. Any other rank holds no more blocks than one of them with its
    chunks, no more in-flight micro-batches, and neither the embeddings nor the head -- less model
    data in a larger budget.

    Beside each rank's tensors, every returned footprint carries the most host memory any rank
    needs and the largest host fractions of any rank: the cost model has one offload term, over
    one rank's shard (:func:`.cost.predict`), and the step waits for the rank with the most host
    work -- every rank updates its own chunks once its last backward is done (with clipping, all
    at once after the norm's all-reduce over the stages), and the balanced split gives the ranks
    shards of about one size, so the rank that offloads the largest share is the one that ends the
    step last. The largest shares are also never above 'cpu''s, so 'auto' is never costed slower."""
    placed = [place_auto(plan, w, cluster, f, stage=r) for r, f in zip(ranks, offloaded)]
    host = max(f.host for f in placed)
    fo = max(f.host_optimizer_fraction for f in placed)
    fp = max(f.host_param_fraction for f in placed)
    return [dataclasses.replace(f, host=host, host_optimizer_fraction=fo, host_param_fraction=fp) for f in placed]

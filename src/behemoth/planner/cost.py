"""Predicted step time and memory of one plan: the cost model the search ranks by.

``step = compute + exposed communication + pipeline bubble + optimizer + exposed offload``:

* **compute** -- :mod:`.compute` (a roofline per GEMM shape, attention, elementwise work);
* **communication** -- each axis's bytes (:mod:`.axis_traffic`, the ledger's formulas) at
  the alpha-beta speed of the link class its groups cross (:class:`~.cluster.Cluster`);
* **overlap** -- the rules each style implements, each hiding at most the compute it runs
  beside, and costing that compute ``Calibration.overlap_slowdown`` of the time it hides (the
  collective's kernels share the SMs and memory bandwidth): bucketed gradient reduction (ZeRO 0-2) behind the backward, but the last bucket;
  ZeRO-1/2's parameter all-gather after the step exposed; ZeRO-3's prefetched gathers behind
  compute, but the first chunk; 1D's column backward all-reduce behind its weight-gradient
  GEMM, ``tp_overlap = k`` hiding ``(k-1)/k`` of the row collectives behind GEMMs (1D, 3D);
  with sequence parallelism the all-gathers a GEMM waits for (the norms' outputs forward, the
  rows' output gradients backward) exposed, the re-gathers and reduce-scatters hidden as above;
  ring attention's K/V shifts behind the attention blocks; 2D/2.5D SUMMA's gathers and
  reduce-scatters (one of each operand around one GEMM) and Ulysses' all-to-alls exposed;
  experts' all-to-alls in ``ep_overlap = k`` chunks hiding ``(k-1)/k`` of the rows' all-to-alls
  behind the experts' GEMMs, the split sizes' exchange exposed (:func:`_ep_times`), the rows'
  all-to-alls and the experts' GEMMs at the busiest ep rank's load (:func:`.moe_bytes.busiest_rank_load`),
  and each MoE layer's forward idle while the host issues the dispatch after reading its split
  sizes (:func:`.host.ep_sync_seconds`); under expert
  parallelism the experts' gradients reduce over ``ep_dp`` (x cp) beside the dense ones over
  ``dp`` (x cp), each axis at its own link's speed and in buckets of its own (ZeRO 0 closes a
  bucket where the parameter kind changes: each block's experts apart from the dense parameters
  around them), the two sharing the backward that hides them; each MoE layer's balancing
  statistics' all-reduce over the data axis exposed in its forward (and a recompute's);
* **repeated work** -- activation checkpointing's recompute runs a block's forward (and its
  collectives) again in the backward; zero-bubble's weight-gradient pass (BW) backpropagates
  through the stage again after its input-gradient pass (BI), so a stage with an input gradient
  runs its blocks' backward but the weight gradients twice, collectives included (the bytes of
  :mod:`.axis_traffic` count both, as the ledger books them);
* **host** -- each stage's micro-batch forward and backward take at least the host's time to
  issue their kernels and collectives (:mod:`.host`), each pipeline rank's host its own blocks',
  the busiest rank's setting the pipeline's pace where it exceeds the slowest stage's device time
  (the embedding's and the head's few kernels left out): eager layouts of many small kernels and
  collectives are host-bound;
* **bubble** -- the schedule simulator (:mod:`.bubble`) with the stage's micro-batch times
  (zero-bubble with its BI and BW times), each including its receive: the pipeline executor
  waits on a stage's activation (per chunk) and output gradient when the action starts, and
  NCCL's send/receive moves a message only once both sides posted, so each transfer is on the
  stage's path every micro-batch;
* **offload** -- gradients down, parameters up over the host link (the two directions beside each
  other) and the CPU Adam update (beside neither: it shares the host's memory with them),
  overlapped with the backward (the CPU updates run during it) but one chunk's share; ZeRO-3
  offload also fetches each chunk forward and backward.

Memory: :func:`.footprint.plan_memory` (:mod:`.footprint` of each pipeline stage that can hold the
most, and :mod:`.reserve`); the gradient sync's axes and buckets: :mod:`.grad_buckets`. Pure;
tests/unit/test_planner_cost.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..plan import Plan
from .axis_traffic import Dtypes, balance_bytes, ep_layer_bytes, step_traffic
from .bubble import pipeline_time
from .cluster import Cluster, axis_strides
from .compute import accumulate_seconds, block_times, embedding_backward_seconds, head_times
from .footprint import Footprint, plan_memory
from .grad_buckets import sync_groups
from .host import ep_sync_seconds, host_times
from .host_calls import cp_block_calls, tp_block_calls
from .moe_bytes import busiest_rank_load
from .params import block_local_params, local_params, stage_layers, weight_split
from .traffic import tp_grid
from .workload import Workload

__all__ = ["Prediction", "predict", "model_flops_per_token"]


@dataclass(frozen=True)
class Prediction:
    """What the cost model predicts for one plan on one cluster; times in seconds per step."""

    plan: Plan
    micro_batch_size: int
    step: float
    tokens_per_s: float
    mfu: float
    compute: float
    """Compute on the critical pipeline rank, all micro-batches (no bubble)."""
    bubble: float
    optimizer: float
    offload: float
    """Exposed host transfers and CPU optimizer time."""
    comm: dict[str, float]
    """Seconds each axis's collectives take, overlapped or not."""
    exposed: dict[str, float]
    """The part of ``comm`` not hidden behind compute."""
    bytes: dict[str, float]
    """Wire bytes per axis per step (the ledger's ``wire_bytes``)."""
    memory: Footprint
    fits: bool
    why_not: str = ""
    """Why it does not fit (empty when it does)."""
    phases: tuple[tuple[str, float], ...] = field(default=(), repr=False)
    """The step as consecutive phases, for a trace."""
    stage_times: tuple[float, float, float] = (0.0, 0.0, 0.0)
    """One micro-batch's forward and backward through a pipeline stage, and one hand-off's
    latency (what the schedule simulator ran with)."""
    host: float = 0.0
    """Host seconds to issue the busiest pipeline rank's kernels and collectives (its own blocks'),
    all micro-batches (:mod:`.host`); where it exceeds the device's time it sets the micro-batch's pace."""
    host_bound: bool = False
    """The host, not the device, sets the pace of the forward or the backward."""
    host_wait: float = 0.0
    """What the host bound adds to the micro-batches' time, all of them (the device waiting)."""

    @property
    def exposed_comm(self) -> float:
        return sum(self.exposed.values())


def model_flops_per_token(w: Workload) -> float:
    """6 N + 6 L h s (causal attention counted once; experts: the active ones)."""
    s = w.shape
    n = w.num_params
    if w.num_experts:
        n -= s.num_layers * w.expert_params * (1 - w.experts_top_k / w.num_experts)
    return 6 * n + 6 * s.num_layers * s.hidden * w.seq_len


HOST_CAST_SHARE = 6 / 28
"""What an offloaded chunk's update costs beside the fused CPU AdamW under bf16 parameters, as a share
of the update: the host casts the updated fp32 master to the bf16 copy the device reads (4 bytes read
and 2 written an element, ``parallel/zero/staging.py``) at the memory bandwidth the update itself
streams at (16 bytes read and 12 written an element). On one H200 host the update of a Llama-8B
step's offloaded half took 1.43 s with bf16 parameters, 1.38 s for a larger share with fp32 ones
(the fp32 rate: 3.6 G parameters/s, the idle calibration's)."""


def _hide(comm: float, cover: float, frac: float = 1.0, slowdown: float = 0.0) -> float:
    """Exposed part of ``comm`` when up to ``frac`` of it can run under ``cover`` seconds of compute,
    the part that does costing that compute ``slowdown`` of its time (``Calibration.overlap_slowdown``)."""
    return comm - (1.0 - slowdown) * min(comm * frac, max(cover, 0.0))


def _ep_times(plan: Plan, w: Workload, cluster: Cluster, bt, layers: int, mbs: int, dt: Dtypes, slow: float):
    """``(forward, backward, step)``: the exposed seconds of the stage's MoE layers' all-to-alls in
    one micro-batch's forward and backward (the recompute's and zero-bubble's BW's in the
    backward), and all their seconds in the step, hidden or not.

    The overlap rule (``parallel/expert/overlap.py``): with ``k = ep_overlap`` chunks, every
    chunk's dispatch starts at once and chunk i's experts run while chunk i+1's dispatch and
    chunk i-1's combine travel, so only the first dispatch and the last combine -- 1/k of the
    row all-to-alls' time -- must wait; (k-1)/k of it is hidden behind the experts' GEMMs, at
    most their time (the forward's behind the forward GEMMs; the backward's reverse pair behind
    the input- and weight-gradient GEMMs, twice the forward's; a recompute's as the forward's),
    each hidden second costing the GEMMs ``slow`` of it. The split sizes' exchange precedes every
    chunk (the host waits for its sizes) and stays exposed. ``k = 1`` hides nothing. The rows'
    all-to-alls wait for the busiest rank's (:func:`.moe_bytes.busiest_rank_load` of the balanced
    bytes)."""
    size, stride = plan.ep, plan.cp * plan.tp
    k, m = plan.ep_overlap, plan.microbatches
    ckpt = plan.activation_checkpointing
    twice = plan.pp > 1 and plan.schedule == "zero-bubble"
    splits, one, meta = ep_layer_bytes(plan, w, mbs, dt)
    load = busiest_rank_load(plan, w)
    one, meta = one * load, meta * load
    t_splits = cluster.collective_seconds(size, stride, splits * layers, layers)
    # all chunks' pairs (the member exchange's weights and slots packed in its rows; its recompute
    # sends the rows alone)
    pair = cluster.collective_seconds(size, stride, (2 * one + meta) * layers, 2 * k * layers)
    again = cluster.collective_seconds(size, stride, 2 * one * layers, 2 * k * layers) if meta else pair
    gemm, frac = layers * bt.expert_gemm_forward, (k - 1) / k
    e_f = t_splits + _hide(pair, gemm, frac, slow)
    e_b = _hide((1 + twice) * pair, (2 + twice) * gemm, frac, slow) + ckpt * _hide(again, gemm, frac, slow)
    return e_f, e_b, (t_splits + pair * (2 + twice) + ckpt * again) * m


def _memo(cache: dict | None, key: tuple, fn):
    if cache is None:
        return fn()
    v = cache.get(key)
    if v is None:
        v = cache[key] = fn()
    return v


def _distinct_ranks(per_rank: tuple[int, ...]) -> tuple[int, ...]:
    """The pipeline ranks whose times can differ: the first (the embedding), the last (the head)
    and between them the first of each block count (the others run what it runs)."""
    first_of: dict[int, int] = {}
    for r in range(1, len(per_rank) - 1):
        first_of.setdefault(per_rank[r], r)
    return tuple(sorted({0, len(per_rank) - 1, *first_of.values()}))


def predict(
    plan: Plan, w: Workload, cluster: Cluster, *, cache: dict | None = None, memory: Footprint | None = None
) -> Prediction:
    """Predict ``plan`` (its ``dp`` resolved for ``cluster.num_gpus``) on ``cluster``. ``cache``: a
    dict to keep per-block results in across calls for one workload and cluster (the search's);
    ``memory``: its :func:`.footprint.plan_memory`, when the caller has it already."""
    plan = plan.resolve(cluster.num_gpus)
    cal = cluster.calibration
    s, m, pp = w.shape, plan.microbatches, plan.pp
    mbs = w.global_batch // (plan.dp * m)
    if mbs < 1 or mbs * plan.dp * m != w.global_batch:
        raise ValueError(
            f"global batch {w.global_batch} must equal dp * microbatches * micro-batch size; got dp={plan.dp}, "
            f"microbatches={m}."
        )
    dt = _memo(cache, ("dtypes", plan.precision), lambda: Dtypes.of(plan))
    per_rank = _memo(cache, ("layers", pp, plan.virtual_stages), lambda: stage_layers(plan, w))
    layers = per_rank[-1]  # the last stage's blocks (it also holds the head)
    key = (
        plan.tp_mode,
        plan.tp,
        plan.tp_depth,
        plan.sequence_parallel,
        plan.tp_overlap,
        plan.cp,
        plan.cp_mode,
        plan.ep,
        plan.ep_overlap,
    )
    key += (plan.activation_checkpointing, plan.precision, plan.param_dtype, mbs)
    bt = _memo(cache, ("block",) + key, lambda: block_times(plan, w, cal, mbs))
    hf, hb = _memo(cache, ("head",) + key, lambda: head_times(plan, w, cal, mbs))
    # the pipeline runs at its slowest stage's pace; each backward's gradients then go into the
    # gradient sync's fp32 chunks (the stage's parameters, the head's table on the last)
    acc = accumulate_seconds(plan, block_local_params(plan, w), cal)
    acc_head = accumulate_seconds(plan, s.vocab_size * s.hidden / weight_split(plan), cal)
    emb = embedding_backward_seconds(plan, w, cal, mbs)  # on the first stage
    ranks = _memo(cache, ("ranks", pp, plan.virtual_stages), lambda: _distinct_ranks(per_rank))
    t_f = max(per_rank[r] * bt.forward + (hf if r == pp - 1 else 0.0) for r in ranks)
    t_b = max(
        per_rank[r] * (bt.backward + acc) + (hb + acc_head if r == pp - 1 else 0.0) + (emb if r == 0 else 0.0)
        for r in ranks
    )
    compute = m * (t_f + t_b)
    t_b_compute = t_b
    nbytes = step_traffic(plan, w, dt=dt)
    strides = axis_strides(dp=plan.dp, pp=pp, tp=plan.tp, cp=plan.cp, ep=plan.ep)
    slow = cal.overlap_slowdown
    comm: dict[str, float] = {}
    exposed: dict[str, float] = {}

    # tensor parallelism, per micro-batch; a third of the bytes forward, two thirds backward
    # what a block's backward repeats: a checkpointed block's forward, zero-bubble's BW (on a stage
    # with an input gradient: the critical, last one) its backward; the bytes count both already
    twice = pp > 1 and plan.schedule == "zero-bubble"
    ckpt = plan.activation_checkpointing
    if "tp" in nbytes:
        q, _ = tp_grid(plan.tp, plan.tp_mode, plan.tp_depth)
        group = plan.tp if plan.tp_mode == "1d" else q
        link = cluster.link(plan.tp, 1)
        cf, cb = tp_block_calls(plan, w)
        calls = (cf * (1 + ckpt) + cb * (1 + twice)) * layers
        one = cal.collective_seconds(link, group, nbytes["tp"] / m, calls)
        comm["tp"] = one * m
        gemm = layers * bt.gemm_forward
        fwd, bwd = one / 3, 2 * one / 3
        k = plan.tp_overlap
        if plan.tp_mode == "1d" and plan.sequence_parallel:
            # per block, collectives of one [T, h] activation each. Forward: the norms' all-gathers,
            # which the column GEMMs wait for, and the rows' reduce-scatters (tp_overlap pieces,
            # each behind the next piece's GEMM). Backward: the rows' output-gradient all-gathers,
            # which both their GEMMs wait for, the columns' input re-gathers (behind the dX GEMM)
            # and dX reduce-scatters (behind their weight-gradient GEMM); a recomputed forward
            # repeats its four, zero-bubble's BW the backward's
            reps = 1 + twice
            unit = one / (4 + 6 * reps + 4 * ckpt)
            e_f = 2 * unit + _hide(2 * unit, gemm, (k - 1) / k, slow)
            hid = _hide(2 * reps * unit, reps * gemm / 2, 1.0, slow)  # behind the columns' GEMMs, about half
            e_b = 2 * reps * unit + 2 * hid
            e_b += ckpt * (2 * unit + _hide(2 * unit, gemm, (k - 1) / k, slow))
        else:
            if plan.tp_mode == "1d":
                e = _hide(fwd, gemm, (k - 1) / k, slow) + _hide(bwd, gemm / 2 + gemm * (k - 1) / k, 1.0, slow)
            elif plan.tp_mode == "3d":
                e = _hide(one, 3 * gemm, (k - 1) / k, slow)
            else:  # SUMMA: the operands are gathered before the GEMM that needs them
                e = one
            e_f, e_b = e / 3, 2 * e / 3
        t_f += e_f
        t_b += e_b
        exposed["tp"] = (e_f + e_b) * m
    if "cp" in nbytes:
        size, stride = strides["cp"]
        cf, cb = cp_block_calls(plan)
        calls = (cf * (1 + ckpt) + cb * (1 + twice)) * layers
        one = cluster.collective_seconds(size, stride, nbytes["cp"] / m, calls)
        comm["cp"] = one * m
        attn = layers * bt.attention_forward * 3.5
        e = one if plan.cp_mode == "ulysses" else _hide(one, attn, (plan.cp - 1) / plan.cp, slow)
        t_f += e / 3
        t_b += 2 * e / 3
        exposed["cp"] = e * m
    if "ep" in nbytes:
        e_f, e_b, comm["ep"] = _ep_times(plan, w, cluster, bt, layers, mbs, dt, slow)
        t_f += e_f
        t_b += e_b
        exposed["ep"] = (e_f + e_b) * m
    # each MoE layer's forward under expert parallelism: the host waits for the device at its
    # split sizes' read, then the device for the host's issue of the dispatch (:func:`.host.ep_sync_seconds`)
    t_f += layers * ep_sync_seconds(plan, w, cal)
    # each MoE layer's balancing statistics: one small all-reduce over the data axis that its
    # forward (and a checkpointed block's recompute) waits for
    data_axis = "dp_cp" if plan.cp > 1 else "dp"
    balance = balance_bytes(plan, w) * layers
    if balance:
        size, stride = strides[data_axis]
        t_bal = cluster.collective_seconds(size, stride, balance, layers)
        t_f += t_bal
        t_b += ckpt * t_bal
        balance = m * (1 + ckpt) * t_bal

    # zero-bubble: a stage with an input gradient runs BI (the backward without the weight
    # gradients) and then BW, which backpropagates through the stage again into its parameters;
    # the backward's collectives run in both (the bytes above count them), half in each
    t_bi = None
    zb = twice
    if zb:
        again = layers * (bt.backward - bt.weight_grad)
        t_bi = again + (t_b - t_b_compute) / 2
        t_b += again

    # a pipeline stage receives each micro-batch's activation (each of its chunks) before the
    # forward and its output gradient before the backward: the executor posts a receive when its
    # action starts and waits on it at once, and NCCL moves a message only once both sides have
    # posted, so every hand-off's transfer is on the stage's path (also in the fill and drain)
    t_comm = 0.0
    if pp > 1:
        size, stride = strides["pp"]
        act = mbs * w.seq_len / plan.cp * s.hidden * dt.stream
        t_comm = cluster.collective_seconds(2, stride, act)
        recv = plan.virtual_stages * t_comm
        t_f, t_b = t_f + recv, t_b + recv
        if t_bi is not None:
            t_bi += recv
        comm["pp"] = cluster.collective_seconds(2, stride, nbytes.get("pp", 0.0), 0)
        exposed["pp"] = 2 * m * recv  # inside the makespan: the receives' waits

    # the host issues every kernel and collective; the device waits where it falls behind. Each
    # pipeline rank's host issues its own blocks; the schedule runs every stage at the pace of the
    # slowest (t_f, t_b: the most any stage's device takes), so the busiest rank's host bounds it
    # host_times reads these fields of the plan (host.py, host_calls.py, expert_kernels.py)
    host_key = (plan.tp, plan.tp_mode, plan.tp_depth, plan.tp_overlap, plan.sequence_parallel, plan.cp, plan.cp_mode)
    host_key += (
        plan.dp,
        plan.ep,
        plan.ep_overlap,
        pp,
        plan.schedule,
        plan.virtual_stages,
        plan.zero,
        ckpt,
        plan.compile,
    )
    ht = _memo(cache, ("host",) + host_key, lambda: host_times(plan, w, cal))
    busiest = max(per_rank)
    host_f = busiest * ht.forward + ht.pipeline / 2
    host_b = (busiest * ht.backward) * (1.5 if zb else 1.0) + ht.pipeline / 2
    host_bound = host_f > t_f or host_b > t_b
    host_wait = m * (max(0.0, host_f - t_f) + max(0.0, host_b - t_b))
    if zb and t_bi is not None and host_b > t_b:
        t_bi = t_bi * host_b / t_b
    t_f, t_b = max(t_f, host_f), max(t_b, host_b)

    # the pipeline: the simulator over the stage's micro-batch times
    makespan, bubble, _ = pipeline_time(plan.schedule, pp, m, plan.virtual_stages, t_f, t_b, 0.0, t_bi)

    # data parallelism / ZeRO over dp (x cp); under expert parallelism the experts' gradients
    # over ep_dp (x cp), in buckets and chunks of their own
    g = plan.dp * plan.cp
    # local_params and sync_groups read these fields of the plan (params.py, grad_buckets.py)
    sync_key = ("sync", plan.tp, plan.tp_mode, plan.tp_depth, plan.ep, plan.dp, plan.cp, pp, plan.virtual_stages)
    n, groups = _memo(
        cache,
        sync_key + (plan.zero, plan.bucket_mb),
        lambda: (local_params(plan, w, layers=layers, stage=pp - 1), sync_groups(plan, w, layers, pp - 1)),
    )
    # this rank's ZeRO shard: each group's parameters over its axis's ranks (the rest whole)
    shard = n - sum(c for c, _ in groups.values()) + sum(c / strides[axis][0] for axis, (c, _) in groups.items())
    e = hidden = 0.0
    if groups:
        z = plan.zero
        pb = 2 if plan.param_dtype == "bf16" else 4
        reduce, gathers, buckets = {}, {}, 0
        for axis, (count, nb) in groups.items():
            size, stride = strides[axis]
            total = nbytes[axis] - (balance_bytes(plan, w) * layers * m * (1 + ckpt) if axis == data_axis else 0.0)
            gather = (size - 1) / size * count * pb if z in (1, 2) else 0.0
            scalars = 2 if axis == data_axis else 0
            t_all = cluster.collective_seconds(size, stride, total, nb * (m if z >= 2 and pp == 1 else 1) + scalars)
            gathers[axis] = cluster.collective_seconds(size, stride, gather, nb) if gather else 0.0
            reduce[axis] = t_all - gathers[axis]
            comm[axis] = t_all + (balance if axis == data_axis else 0.0)
            buckets += nb
        # the reductions of every axis share the backward that hides them, but the last bucket
        if z == 3:
            cover, frac = compute, 1 - 1 / max(2, layers)
        else:
            cover, frac = (t_b if z < 2 else m * t_b) if pp == 1 else t_b, 1 - 1 / buckets
        reducing = sum(reduce.values())
        hidden = min(reducing * frac, cover)
        left = reducing - (1.0 - slow) * hidden
        e = left + sum(gathers.values())
        for axis in reduce:
            exposed[axis] = (left * reduce[axis] / reducing if reducing else 0.0) + gathers[axis]
        if data_axis in exposed:
            exposed[data_axis] += balance  # inside the makespan: the forward waits for it

    # the optimizer step, on the GPU or the host (offload: the share of the shard the host updates)
    mem = memory if memory is not None else plan_memory(plan, w, cluster)
    on_host = mem.host_optimizer_fraction if plan.offload is not None else 0.0
    opt = (shard if plan.zero else n) * (1.0 - on_host) * 36 / cal.hbm_bytes_per_s
    offload = 0.0
    if plan.offload is not None:
        pb = 2 if plan.param_dtype == "bf16" else 4
        # the last micro-batch: per chunk, as its gradient lands, down to the host, the CPU update, up
        # (parallel/zero/overlap.py). The two copy directions run beside each other; the CPU update,
        # memory-bound on the host, shares its memory with them and does not hide them. (Of three
        # readings -- the three summed, the slowest of them pipelined, this one -- this one was
        # nearest three one-GPU offload rows: +9%, -1%, +5% against +31%, +19%, +26% summed and
        # -8%, -18%, -13% pipelined; chosen on those rows, not yet proved blind.)
        o = shard * on_host
        update = o / cal.cpu_adam_params_per_s * (1.0 + (HOST_CAST_SHARE if pb == 2 else 0.0))
        last = update + max(o * 4 / cal.d2h_bytes_per_s, o * pb / cal.h2d_bytes_per_s)
        # before it, at stages 2-3, each micro-batch adds on the device: the host's accumulator up on
        # one side stream while the previous chunk's sum goes down on another (parallel/zero/reduce.py)
        early = (m - 1) * o * 4 / min(cal.d2h_bytes_per_s, cal.h2d_bytes_per_s) if plan.zero >= 2 and pp == 1 else 0.0
        if plan.zero == 3:  # each host chunk's parameters fetched forward and backward, every micro-batch
            early += 2 * m * n / g * mem.host_param_fraction * pb / cal.h2d_bytes_per_s
        # the backward hides what the gradient reduction left of it; the CPU update starts once a
        # chunk's gradient of the step is final, so only the last micro-batch's backward hides it
        # (Llama-8B, 4 micro-batches, one H200: the update waited for 1.1 s after the backward)
        frac, spare = 1 - 1 / max(2, layers), m * t_b - hidden
        hid = min(last * frac, t_b, max(spare, 0.0))
        offload = last - hid + _hide(early, spare - hid, frac)

    step = makespan + e + opt + offload
    why = ""
    if mem.gpu_total > cluster.memory_bytes:
        why = f"needs {mem.gpu_total / 2**30:.1f} GiB per GPU > {cluster.memory_bytes / 2**30:.1f} GiB"
    elif mem.host > cluster.host_bytes:
        why = f"needs {mem.host / 2**30:.1f} GiB of host memory per rank > {cluster.host_bytes / 2**30:.1f} GiB"
    tokens = w.tokens / step
    peak = cal.peak_flops_per_s or max(r for _, r in cal.gemm)
    mfu = tokens * model_flops_per_token(w) / (cluster.num_gpus * peak)
    phases = (
        ("forward+backward", m * (t_f + t_b)),
        ("pipeline bubble", bubble),
        ("gradient sync (exposed)", e),
        ("optimizer", opt),
        ("offload (exposed)", offload),
    )
    return Prediction(
        plan=plan,
        micro_batch_size=mbs,
        step=step,
        tokens_per_s=tokens,
        mfu=mfu,
        compute=compute,
        bubble=bubble,
        optimizer=opt,
        offload=offload,
        comm=comm,
        exposed=exposed,
        bytes=nbytes,
        memory=mem,
        fits=not why,
        why_not=why,
        phases=phases,
        stage_times=(t_f, t_b, t_comm),
        host=m * (host_f + host_b),
        host_bound=host_bound,
        host_wait=host_wait,
    )

"""The search: every legal layout of a model on a cluster, pruned by memory, ranked by step time.

``search(workload, cluster, limits)`` enumerates dp x tp (1D with and without sequence
parallelism and over-decomposition, 2D, 2.5D, 3D) x pp (schedule, virtual stages, micro-
batches) x cp (Ulysses, ring) x ep (and its over-decomposition, ``ep_overlap``) x ZeRO stage x
offload x micro-batch size x activation checkpointing, keeps the plans :class:`~behemoth.plan.Plan` itself accepts (its constructor,
``resolve`` and ``check_supported``: the rules ``bh.boost`` applies) and the model's shape
allows (heads, widths and vocabulary divisible as the styles need), predicts each one's step
time and memory (:func:`~.cost.predict`), drops those that do not fit and ranks the rest by
step time. A plan fits when its predicted device memory -- the tensors' peak, the caching
allocator's slack it cannot release under pressure (:func:`~.reserve.allocator_slack`: the
loss's logits-sized blocks of one micro-batch) and the CUDA context and NCCL buffers (:func:`~.reserve.device_reserve`) -- is at most
``Limits.memory_headroom`` of the card, and its host memory at most the host's; every term grows
with the micro-batch, so the first size that fits no layout ends its sizes. Pure: no process group, no device; 1,024 GPUs and a 96-layer model take seconds
because a block is costed once per shape and reused by every plan that runs it
(``cost.predict``'s cache), and Plan's verdict is cached per combination of fields it reads.
Tested in tests/unit/test_planner_search.py.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

from ..plan import CP_MODES, SCHEDULES, TP_MODES, Plan
from .cluster import Cluster
from .context_traffic import tp_attention_split
from .cost import Prediction, predict
from .footprint import plan_memory
from .traffic import tp_grid
from .workload import Workload

__all__ = ["Limits", "SearchResult", "search", "shape_refusal"]


@dataclass(frozen=True, kw_only=True)
class Limits:
    """What the search may choose from."""

    precision: str = "bf16"
    """Every plan's precision."""
    tp_modes: tuple[str, ...] = TP_MODES
    max_tp: int = 64
    min_tp: int = 1
    """Smallest tensor-parallel degree tried (``min_tp = max_tp = world``: pure tensor parallelism)."""
    max_cp: int = 16
    max_pp: int = 64
    cp_modes: tuple[str, ...] = CP_MODES
    schedules: tuple[str, ...] = SCHEDULES
    virtual_stages: tuple[int, ...] = (2,)
    """Chunks per rank tried with the interleaved schedule."""
    tp_overlaps: tuple[int, ...] = (1, 2)
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    param_dtypes: tuple[str | None, ...] = (None,)
    """``Plan.param_dtype`` choices: add ``"bf16"`` to try bf16 parameter copies under ZeRO (other
    numerics than the fp32 model's, so only when asked)."""
    offloads: tuple[str | None, ...] = (None, "auto", "cpu")
    """``Plan.offload`` choices, tried in this order where the ones before do not fit: ``'auto'``
    keeps on the GPU what the runtime's split keeps (:mod:`.auto_offload`), ``'cpu'`` nothing."""
    activation_checkpointing: tuple[bool, ...] = (False, True)
    micro_batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    """Sequences per micro-batch tried (those dividing each dp rank's share)."""
    max_microbatches: int = 256
    ep_degrees: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    """Expert-parallel degrees tried for a mixture-of-experts model (dividing dp and the experts)."""
    ep_overlaps: tuple[int, ...] = (1, 2)
    """``Plan.ep_overlap`` choices tried where ``ep > 1`` (chunks whose all-to-alls overlap the
    experts' GEMMs)."""
    top: int = 20
    """Plans the result keeps, best first."""
    memory_headroom: float = 1.0
    """Fraction of each GPU's memory a plan may use."""


@dataclass
class SearchResult:
    """The ranked plans and what the search saw."""

    ranked: list[Prediction]
    """Plans that fit, fastest first (``limits.top`` of them)."""
    evaluated: int = 0
    """Plans costed (legal ones): their memory predicted, and their time if they fit."""
    fits: int = 0
    """... of which fit in memory."""
    refused: Counter = field(default_factory=Counter)
    """Why candidates were dropped before costing: Plan's rule, or the model's shape."""
    unfit: Prediction | None = None
    """The fastest plan that did not fit (what more memory would buy)."""

    @property
    def best(self) -> Prediction:
        if not self.ranked:
            raise ValueError("no plan fits: " + (self.unfit.why_not if self.unfit else "no legal plan"))
        return self.ranked[0]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def shape_refusal(plan: Plan, w: Workload, mbs: int) -> str:
    """Why the model's shape cannot take ``plan`` at micro-batch size ``mbs`` ('' if it can):
    the divisibility the tensor, context, pipeline and expert styles check at ``bh.boost``."""
    s = w.shape
    tp, cp = plan.tp, plan.cp
    if plan.pp * plan.virtual_stages > s.num_layers:
        return "more pipeline stages than blocks"
    if tp > 1:
        if plan.tp_mode == "1d":
            if s.num_heads % tp or s.ffn_hidden % tp or s.vocab_size % tp:
                return "tp does not divide heads, ffn or vocabulary"
            if s.num_kv_heads % tp and tp % s.num_kv_heads:
                return "kv heads neither a multiple nor a divisor of tp"
            if plan.sequence_parallel and (w.seq_len // cp) % tp:
                return "sequence parallelism needs tp | sequence"
            if mbs % plan.tp_overlap:
                return "tp_overlap must divide the micro-batch"
        else:
            q, d = tp_grid(tp, plan.tp_mode, plan.tp_depth)
            if s.hidden % q or s.ffn_hidden % q or s.vocab_size % q or s.num_heads % q:
                return "the grid side does not divide hidden, ffn, heads or vocabulary"
            rows = mbs * w.seq_len if plan.tp_mode == "3d" else mbs
            if rows % (d * q) or (plan.tp_mode == "3d" and rows % (q * q * plan.tp_overlap)):
                return "the grid does not divide the micro-batch"
    if cp > 1:
        if w.seq_len % (2 * cp):
            return "context parallelism needs 2 cp | sequence"
        heads_split, _ = tp_attention_split(tp, plan.tp_mode, plan.tp_depth)
        if plan.cp_mode == "ulysses" and (s.num_heads // heads_split) % cp:
            return "Ulysses needs cp | heads per tp rank"
    if plan.ep > 1 and (not w.num_experts or w.num_experts % plan.ep):
        return "ep must divide the experts"
    return ""


def _tp_variants(tp: int, limits: Limits) -> list[dict]:
    if tp == 1:
        return [dict(tp=1)]
    out = []
    for mode in limits.tp_modes:
        if mode == "1d":
            for sp in (False, True):
                for k in limits.tp_overlaps:
                    out.append(dict(tp=tp, tp_mode="1d", sequence_parallel=sp, tp_overlap=k))
        elif mode == "2d" and math.isqrt(tp) ** 2 == tp:
            out.append(dict(tp=tp, tp_mode="2d"))
        elif mode == "2.5d":
            for d in _divisors(tp)[1:]:
                r = tp // d
                if math.isqrt(r) ** 2 == r and r > 1:
                    out.append(dict(tp=tp, tp_mode="2.5d", tp_depth=d))
        elif mode == "3d" and round(tp ** (1 / 3)) ** 3 == tp:
            for k in limits.tp_overlaps:
                out.append(dict(tp=tp, tp_mode="3d", tp_overlap=k))
    return out


def _pp_variants(pp: int, limits: Limits) -> list[dict]:
    if pp == 1:
        return [dict(pp=1)]
    out = []
    for sched in limits.schedules:
        for v in limits.virtual_stages if sched == "interleaved" else (1,):
            out.append(dict(pp=pp, schedule=sched, virtual_stages=v))
    return out


def _factorizations(world: int, limits: Limits, w: Workload):
    for tp in _divisors(world):
        if not limits.min_tp <= tp <= limits.max_tp:
            continue
        for cp in _divisors(world // tp):
            if cp > limits.max_cp:
                continue
            for pp in _divisors(world // (tp * cp)):
                if pp > min(limits.max_pp, w.shape.num_layers):
                    continue
                yield world // (tp * cp * pp), pp, tp, cp


def search(w: Workload, cluster: Cluster, limits: Limits | None = None) -> SearchResult:
    """Every legal plan for ``w`` on ``cluster``, costed; those that fit, fastest first."""
    limits = limits or Limits()
    res = SearchResult(ranked=[])
    verdicts: dict[tuple, str] = {}
    cache: dict = {}  # cost.predict's per-block results
    memory: dict = {}  # footprint.plan_memory's per-stage model data and per-block activations
    budget = cluster.memory_bytes * limits.memory_headroom
    fitting: list[Prediction] = []
    eps = [e for e in limits.ep_degrees if w.num_experts and w.num_experts % e == 0] or [1]
    for dp, pp, tp, cp in _factorizations(cluster.num_gpus, limits, w):
        if w.global_batch % dp:
            res.refused["dp does not divide the global batch"] += 1
            continue
        share = w.global_batch // dp
        sizes = [b for b in limits.micro_batch_sizes if share % b == 0 and share // b <= limits.max_microbatches]
        for tv in _tp_variants(tp, limits):
            for cm in limits.cp_modes if cp > 1 else ("ulysses",):
                for pv in _pp_variants(pp, limits):
                    for ep, ov in ((e, o) for e in eps for o in (limits.ep_overlaps if e > 1 else (1,))):
                        if dp % ep:
                            continue
                        for zero, pdt in ((z, d) for z in limits.zero_stages for d in limits.param_dtypes):
                            fields = dict(
                                cp=cp, cp_mode=cm, ep=ep, ep_overlap=ov, zero=zero, precision=limits.precision
                            )
                            fields["param_dtype"] = pdt
                            fields.update(tv)
                            fields.update(pv)
                            variants = []  # [offload, checkpointing, Plan's fields, the Plan], cheapest first
                            for off in limits.offloads:
                                for ac in limits.activation_checkpointing:
                                    f = dict(fields, offload=off, activation_checkpointing=ac)
                                    if _legal(f, verdicts, res):
                                        variants.append([off, ac, dict(f, dp=dp), None])
                            if not variants:
                                continue
                            for mbs in sizes:  # ascending: activations grow with the micro-batch
                                if not _costed(
                                    variants, mbs, share // mbs, w, cluster, budget, (cache, memory), res, fitting
                                ):
                                    break  # nothing fits at this size: no larger one fits either
    fitting.sort(key=lambda p: (p.step, p.memory.gpu_total))
    res.fits = len(fitting)
    res.ranked = fitting[: limits.top]
    return res


def _costed(variants, mbs, m, w, cluster, budget, caches, res, fitting) -> bool:
    """Cost one layout at one micro-batch size under each offload / activation-checkpointing
    choice, cheapest first: a choice that only saves memory (offload, recomputation) is tried
    only when every cheaper one fails to fit, since it never predicts a faster step. Memory is
    checked first; only plans that fit are timed. Returns whether one fitted (a shape refusal
    counts as fitting: a larger micro-batch may divide where this one does not)."""
    fit: dict[tuple, bool] = {}
    refused = False
    cache, memory = caches
    why = None  # the shape's verdict, one for every variant: shape_refusal reads neither offload nor checkpointing
    ahead: dict[bool, object] = {}  # 'cpu''s memory per checkpointing choice, computed for an 'auto' before it

    def at_m(variant) -> Plan:
        if variant[3] is None:  # built once per layout: its constructor checks the actual degrees
            variant[3] = Plan(**variant[2])
        plan = object.__new__(Plan)  # a copy: the micro-batch count (>= 1) changes no rule of Plan's
        plan.__dict__.update(variant[3].__dict__, microbatches=m)
        return plan

    for variant in variants:
        off, ac = variant[0], variant[1]
        if any(v for (o, a), v in fit.items() if (o is None or off is not None) and (not a or ac)):
            continue
        plan = at_m(variant)
        if why is None:
            why = shape_refusal(plan, w, mbs)
        if why:
            res.refused[why] += 1
            fit[(off, ac)] = False
            refused = True
            continue
        if off == "auto":  # 'auto' holds on the GPU what 'cpu' holds and what its split keeps: where
            # 'cpu' does not fit the GPU, neither does it (skipped uncosted; 'cpu' comes next)
            cpu = next((v for v in variants if v[0] == "cpu" and v[1] == ac), None)
            if cpu is not None:
                if ac not in ahead:
                    ahead[ac] = plan_memory(at_m(cpu), w, cluster, cache=memory)
                if ahead[ac].gpu_total > budget:
                    fit[(off, ac)] = False
                    continue
        mem = ahead.pop(ac) if off == "cpu" and ac in ahead else plan_memory(plan, w, cluster, cache=memory)
        ok = mem.gpu_total <= budget and mem.host <= cluster.host_bytes
        fit[(off, ac)] = ok
        res.evaluated += 1
        if ok:
            fitting.append(predict(plan, w, cluster, cache=cache, memory=mem))
        elif res.unfit is None or mem.gpu_total < res.unfit.memory.gpu_total:
            res.unfit = predict(plan, w, cluster, cache=cache, memory=mem)
    return refused or any(fit.values())


_AS_TWO = ("pp", "cp", "ep")


def _legal(fields: dict, verdicts: dict, res: SearchResult) -> bool:
    """Whether Plan's own rules (its constructor and ``check_supported``) accept ``fields``
    (``dp`` left to fill the world: the search keeps ``ep | dp`` itself). Verdicts are cached
    with pp, cp and ep read as "1 or more" (Plan's composition rules ask only whether they
    exceed 1): a representative with 2 for each is what Plan judges; the plan built from the
    actual fields then passes Plan's constructor, which checks every degree itself."""
    rep = dict(fields)
    for k in _AS_TWO:
        if k in rep:
            rep[k] = min(rep[k], 2)
    key = tuple(rep.items())
    why = verdicts.get(key)
    if why is None:
        try:
            Plan(**dict(key)).check_supported()
            why = ""
        except (ValueError, NotImplementedError) as e:
            why = str(e).split(":")[0]
        verdicts[key] = why
    if why:
        res.refused[why] += 1
    return not why

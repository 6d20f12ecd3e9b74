"""Predicted memory per GPU (and per rank on the host) of a plan: model data and activations.

Model data, per parameter this rank holds (:func:`~.params.local_params`), with fp32
parameters (their own masters), fp32 gradients and Adam's two fp32 moments, ZeRO sharding
over the ``g = dp x cp`` ranks that reduce gradients (as ``parallel/zero/chunks.py`` counts
them, chunk padding aside; a mixture of experts' experts over ``g / ep``, with the padding
without a pipeline or tensor parallelism: :func:`shard_elements`):

=====  ================================  ===================================
stage  GPU                                host (``offload='cpu'``)
=====  ================================  ===================================
0      4 + 4 + 8                          --
1      4 + 4 + 12/g (offload: 4 + 4)     16/g: fp32 master, gradient, Adam's 8
2      4 + 12/g     (offload: 4 + chunks) 16/g
3      16/g + two blocks gathered         16/g (18/g with bf16 parameters), the GPU keeps the gathered blocks
=====  ================================  ===================================

Under pipeline parallelism ZeRO-2/3 reduce a stage's gradients once per step: the GPU holds the
stage's full fp32 gradients (4 per parameter) during the step's backwards instead of 4/g, and no
shard of the last step's (freed as the step starts).
Without a pipeline, ZeRO-2 reduce-scatters each gradient chunk as the backward completes it,
the full fp32 chunk kept until its reduction ends, at most 2 in flight (``parallel/zero/reduce.py``)
beside the one filling, and the largest parameter's own gradient before its hook copies it in:
``3 E + the largest`` fp32 on top of the shards (:func:`gradient_chunk_elements`; dense models;
the 2 x H200 proofs measured 3.6 and 4.8 GiB more than the shards for GPT-6.9B's 1.0 GiB chunks
and at least 12.3 for the Llama-8B shape's 3.8 GiB ones).

(``param_dtype='bf16'`` keeps 2-byte copies on the GPU and 4-byte masters sharded.)
Activations saved per block and micro-batch, in bytes, in the form of Korthikanti et al.
("Reducing Activation Recomputation in Large Transformer Models", with flash attention, so no
``s**2`` term): ``T (A_rep h / r + (A_h h + A_f f) / p)`` (``ACTIVATION_BYTES``) with
``r = p`` when the layout shards norms and dropout (sequence parallelism, 2D, 3D) else 1,
``T`` tokens of the micro-batch on this context-parallel rank. A mixture of experts counts its
experts as a SwiGLU over ``f = I k`` plus what its routing, dispatch and combine keep
(:func:`.moe_bytes.expert_saved_bytes`), over this tp rank's share of the tokens (tensor
parallelism splits an MoE block's tokens over tp, ``parallel/expert/tokens.py``:
:func:`.moe_bytes.token_split`). Under 16-bit autocast (fp32
parameters) every GEMM keeps the 16-bit copy of its weight that autocast made for it until its
backward, so a block's saved set holds its weights once more in 2 bytes a parameter: once per
micro-batch in flight (a pipeline rank holding 4 micro-batches holds 4 copies; this, not the
activations, is most of what the interleaved schedule's extra in-flight micro-batches cost at
small micro-batches). 2D and 2.5D add instead each Linear's
gathered weight column (its weights / q, in the compute dtype), which SUMMA keeps from the
forward for the backward (``Linear2D.keep_gathered_weight``); with activation
checkpointing only the block input (``4 T h / r``) is kept, plus one block's full set while
it is recomputed. A pipeline rank holds its peak in-flight micro-batches of its stage's
blocks (:mod:`.bubble`); the last stage adds the fp32 logits and their gradient, and per
micro-batch it holds (one, or all of them under GPipe) the loss's fp32 log-probabilities and the
head's 16-bit weight copy. ZeRO-1 keeps the whole fp32 gradient chunks and the reduced shard the
optimizer reads (``grad_full`` and ``grad_acc`` in ``parallel/zero/reduce.py``).

Beyond the tensors, the caching allocator's slack (``Footprint.slack``, :func:`.reserve.allocator_slack`):
the loss's logits-sized blocks of one micro-batch, which the backward's smaller requests split.

A plan's memory (:func:`plan_memory`, what the cost model and the search read): the footprint of
each pipeline stage that can hold the most, and beyond the tensors :mod:`.reserve`'s device
memory (CUDA context, NCCL buffers). Pure.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..plan import Plan
from .auto_offload import place_auto, place_stages
from .bubble import ranks_inflight
from .cluster import Cluster
from .memory import zero_chunk_elements
from .moe_bytes import expert_saved_bytes, token_split, tp_summed_params
from .params import block_local_params, local_params, stage_layers, weight_split
from .reserve import allocator_slack, device_reserve
from .traffic import tp_grid
from .workload import Workload
from .zero3_traffic import chunk_shard_elements, zero3_resident_params

__all__ = ["Footprint", "footprint", "plan_memory"]

ACTIVATION_BYTES = {
    # (gated MLP, 16-bit autocast): bytes per token saved by one block, per hidden unit kept on
    # every 1D rank without sequence parallelism (norm inputs, the fp32 residual stream, the casts
    # of the norms' outputs), per hidden unit split over tp (q, k, v, attention output), per FFN
    # unit (the MLP's inner activations); read off behemoth's GPT (LayerNorm, GELU) and Llama
    # (RMSNorm, RoPE, SwiGLU) with autograd's saved-tensor hooks on the CPU (tests/unit/
    # test_planner_cost.py checks them): fp32 (16, 16, 8) and (16, 21, 16); under bf16 autocast the
    # CPU shows (12, 8, 4) and (12, 21, 8), and the 16-bit rows here carry 4 more replicated bytes
    # per hidden unit that GPUs keep (chosen among 0, 4 and 8 against the 2 and 4 x H200 proofs of
    # GPT-6.9B: tp 1-4 with and without sequence parallelism, pp 1-4, cp 2; their measured peaks
    # less the other terms here). The 16-bit weight copies the GEMMs keep are not in these rows
    # (``block_activation_bytes`` adds them).
    (False, True): (16, 8, 4),
    (True, True): (16, 21, 8),
    (False, False): (16, 16, 8),
    (True, False): (16, 21, 16),
}


@dataclass(frozen=True)
class Footprint:
    """Bytes per GPU, and per rank on the host."""

    params: float
    grads: float
    optimizer: float
    activations: float
    reserved: float
    """Device memory beyond the tensors above (CUDA context, NCCL buffers, allocator slack: :mod:`.reserve`)."""
    host: float
    slack: float = 0.0
    """What the caching allocator keeps reserved beyond the tensors' peak that it cannot release
    when a device allocation fails (:func:`.reserve.allocator_slack`)."""
    host_optimizer_fraction: float = 0.0
    """The share of the rank's shard whose master and optimizer state live on the host (updated
    there): 1 under ``offload='cpu'``, the split's under ``offload='auto'`` (:mod:`.auto_offload`)."""
    host_param_fraction: float = 0.0
    """The share whose parameters live on the host and are fetched for every use (ZeRO-3)."""

    @property
    def allocated(self) -> float:
        """The peak of PyTorch's tensors (what ``torch.cuda.max_memory_allocated`` measures)."""
        return self.params + self.grads + self.optimizer + self.activations

    @property
    def gpu_total(self) -> float:
        """All the device memory the rank needs: the tensors, the allocator's slack, the reserve."""
        return self.allocated + self.slack + self.reserved


def block_activation_bytes(plan: Plan, w: Workload, mbs: int) -> tuple[float, float]:
    """(kept between forward and backward, kept under activation checkpointing) for one block and
    one micro-batch: activations, and the 16-bit weight copies (or SUMMA's gathered weights)."""
    s = w.shape
    t = mbs * w.seq_len / plan.cp
    rep = plan.tp if (plan.tp_mode != "1d" or plan.sequence_parallel) else 1
    a_rep, a_h, a_f = ACTIVATION_BYTES[(s.gated_mlp, plan.precision in ("bf16", "fp16"))]
    if w.num_experts:  # the experts over this tp rank's share of the tokens (tp splits them)
        f = (w.expert_ffn_hidden or s.ffn_hidden) * w.experts_top_k
        experts = (a_f * f + expert_saved_bytes(plan, w)) / token_split(plan)
        full = t * (a_rep * s.hidden / rep + a_h * s.hidden / plan.tp + experts)
    else:
        full = t * (a_rep * s.hidden / rep + (a_h * s.hidden + a_f * s.ffn_hidden) / plan.tp)
    if plan.tp > 1 and plan.tp_mode in ("2d", "2.5d"):
        # SUMMA keeps each Linear's gathered weight column (q shards, compute dtype) for the backward
        q, _ = tp_grid(plan.tp, plan.tp_mode, plan.tp_depth)
        weights = w.attention_params + (0 if w.num_experts else w.mlp_params)
        full += weights / q * (2 if plan.precision in ("bf16", "fp16") else 4)
    elif autocast_copies(plan):
        # autocast casts each fp32 weight to 16 bits once per forward, and the GEMM keeps the copy
        # for its backward: one copy of the block's weights per micro-batch in flight
        full += 2 * block_local_params(plan, w)
    return full, 4 * t * s.hidden / rep


def footprint(
    plan: Plan, w: Workload, *, mbs: int, inflight: float, reserved: float, stage: int | None = None
) -> Footprint:
    """Memory of pipeline stage ``stage`` (default the last, the head's) under ``plan`` (resolved),
    holding ``inflight`` micro-batches' activations of its own blocks: its share of the blocks
    and parameters (the runtime's split, :func:`.params.stage_layers`), the loss's tensors and
    slack on the last stage only."""
    r = plan.pp - 1 if stage is None else stage
    params, grads, opt, act, host, slack, *fractions = _stage_terms(plan, w, mbs, inflight, r, _model_data(plan, w, r))
    return Footprint(params, grads, opt, act, reserved, host, slack, *fractions)


def _model_data(plan: Plan, w: Workload, r: int) -> tuple:
    """What no micro-batch changes of pipeline rank ``r``'s footprint: ``(layers, params, grads,
    optimizer, host, fractions, autocast cache, head copy)`` (:func:`footprint`'s terms)."""
    s = w.shape
    g = plan.dp * plan.cp
    layers = stage_layers(plan, w)[r]
    n = local_params(plan, w, stage=r)
    z, off = plan.zero, plan.offload is not None
    pb = 2 if plan.param_dtype == "bf16" else 4
    masters = 4 if pb == 2 else 0
    host = 0.0
    shard = shard_elements(plan, w, n, layers) if z else 0.0
    if z == 0:
        params, grads, opt = n * pb, n * 4, n * 8
    elif z == 1:  # the gradient chunks, and the reduced shard the optimizer reads (parallel/zero/reduce.py),
        # but where a chunk has one replica: its gradient chunk is that shard
        own = single_replica_elements(plan, w, n, layers)
        params, grads, opt = n * pb, n * 4 + (shard - own) * 4, shard * (8 + masters)
    elif z == 2:
        params, grads, opt = n * pb, shard * 4, shard * (8 + masters)
    else:
        per_block = block_local_params(plan, w)
        params = shard * pb + 2 * per_block * pb
        grads, opt = shard * 4 + 2 * per_block * 4, shard * (8 + masters)
        if g > 1 and plan.pp == 1 and not w.num_experts and not off:
            params, grads = zero3_held_bytes(plan, w, shard, pb)
    if off:  # the runtime's rule (parallel/zero/auto.py's check_host_memory): per offloaded element an
        # fp32 master, an fp32 gradient and the optimizer's state -- the master even where the GPU's
        # parameters are fp32 -- and, where the parameters leave the GPU too (stage 3), what a
        # 16-bit parameter's fp32 master lacks of the 4-byte host copy
        host = shard * (4 + 4 + 8) + (shard * (4 - pb) if z == 3 else 0.0)
        if z == 3:  # the gathered blocks' parameters and gradients only: each reduced gradient goes down
            # to the host's accumulator (parallel/zero/reduce.py), not to a shard on the GPU
            params, grads = 2 * per_block * pb, 2 * per_block * 4
        opt = 0.0
        if z == 1:  # the reduced shard lives on the host
            grads = n * 4
        if z == 2:  # each reduced chunk goes down to the host as the backward completes it: the GPU
            # holds only the chunks in flight (below), not the shards (a 1x H200 proof of GPT-6.9B
            # measured 48.7 GiB where 95.4 were predicted with them)
            grads = 0.0
    if z >= 2 and plan.pp > 1:  # a stage's gradients accumulate in full chunks until the step's last backward;
        # the last step's shards are freed as the step starts, and each new one replaces a chunk as it is reduced
        grads = n * 4
    elif z == 2 and not w.num_experts:  # the gradient chunks in flight and the one filling, a parameter's gradient
        # (a chunk of one replica reduces nothing: summed into its shard at once, none in flight; an
        # offloaded one lives until its copy down has read it: three kept, the count measured before)
        chunk, largest = gradient_chunk_elements(plan, w)
        grads += 4 * ((3 if g > 1 or off else 1) * chunk + largest)
    fractions = (1.0, 1.0 if z == 3 else 0.0) if off else (0.0, 0.0)
    cached = autocast_cache_bytes(plan, w, layers) if plan.activation_checkpointing else 0.0
    head_copy = 2 * s.vocab_size * s.hidden / weight_split(plan) if autocast_copies(plan) else 0.0
    return layers, params, grads, opt, host, fractions, cached, head_copy


def _stage_terms(
    plan: Plan, w: Workload, mbs: int, inflight: float, r: int, data: tuple, blocks: tuple[float, float] | None = None
) -> tuple[float, ...]:
    """:func:`footprint`'s ``(params, grads, optimizer, activations, host, slack, host optimizer
    fraction, host parameter fraction)`` of rank ``r`` from its :func:`_model_data` and (when the
    caller has it) :func:`block_activation_bytes` at ``mbs``."""
    layers, params, grads, opt, host, fractions, cached, head_copy = data
    full, ckpt = blocks if blocks is not None else block_activation_bytes(plan, w, mbs)
    per_mb = layers * (ckpt if plan.activation_checkpointing else full)
    act = inflight * per_mb + (max(full, cached) if plan.activation_checkpointing else 0.0)
    if r != plan.pp - 1:
        return params, grads, opt, act, host, 0.0, *fractions
    s = w.shape
    t = mbs * w.seq_len / plan.cp
    logits = t * s.vocab_size / plan.tp * 4
    act += 2 * logits  # fp32 logits and their gradient on the last stage
    # until its backward, each micro-batch's loss keeps its fp32 log-probabilities and (autocast)
    # the head's 16-bit weight copy; the last stage holds one such micro-batch but under GPipe,
    # which runs every forward first
    held = plan.microbatches if plan.pp > 1 and plan.schedule == "gpipe" else 1
    act += (held - 1) * t * s.vocab_size / plan.tp * 4 + held * head_copy
    slack = allocator_slack(logits)
    return params, grads, opt, act, host, slack, *fractions


def _memory_stages(layers: tuple[int, ...], inflight: tuple[float, ...]) -> list[int]:
    """The pipeline ranks whose memory can be the most: the last (the head and the loss), the
    first (the embeddings) where it holds more blocks or more in-flight micro-batches than the
    last, and between them the first rank of each block count above the first rank's -- a middle
    rank's memory grows with its blocks and its in-flight micro-batches, which no later rank has
    more of (:func:`.bubble.rank_inflight`), and holds nothing the first rank does not."""
    pp = len(layers)
    first_of: dict[int, int] = {}
    for r in range(1, pp - 1):
        if layers[r] > layers[0]:
            first_of.setdefault(layers[r], r)
    first = [0] if layers[0] > layers[-1] or inflight[0] > inflight[-1] else []
    return sorted({*first, pp - 1, *first_of.values()})


def plan_memory(plan: Plan, w: Workload, cluster: Cluster, *, cache: dict | None = None) -> Footprint:
    """Predicted memory per GPU (and host) of ``plan`` (resolved) on ``cluster``: :func:`footprint`
    of every pipeline stage, each with its own blocks, parameters and in-flight micro-batches
    (:func:`.bubble.rank_inflight`; the first stage of a balanced split holds more blocks than
    the head's and more micro-batches) -- the tensors of the stage with the most, its slack
    raised to what the stage needing the most memory needs beyond them -- and :mod:`.reserve`'s device memory beyond
    the tensors (CUDA context, NCCL buffers, the allocator's slack) as its ``reserved``.

    ``cache``: a dict the caller keeps across calls for one workload (the search's), where each
    stage's model data and a block's activations are kept per combination of the fields they read."""
    mbs = w.global_batch // (plan.dp * plan.microbatches)
    m, v = plan.microbatches, plan.virtual_stages
    if cache is None:
        cache = {}
    key = ("stages", plan.schedule, plan.pp, m, v)
    ranks = cache.get(key)
    if ranks is None:
        inflight = ranks_inflight(plan.schedule, plan.pp, m, v)
        ranks = cache[key] = [(r, inflight[r]) for r in _memory_stages(stage_layers(plan, w), inflight)]
    tp_key = (plan.tp, plan.tp_mode, plan.tp_depth, plan.ep, plan.cp, plan.precision, plan.param_dtype)
    key = ("blocks", mbs, plan.sequence_parallel) + tp_key
    blocks = cache.get(key)
    if blocks is None:
        blocks = cache[key] = block_activation_bytes(plan, w, mbs)
    # what _model_data reads of the plan
    data_key = tp_key + (plan.dp, plan.pp, v, plan.zero, plan.offload is not None, plan.activation_checkpointing)
    stages = []
    for r, inflight in ranks:
        key = ("data", r) + data_key
        data = cache.get(key)
        if data is None:
            data = cache[key] = _model_data(plan, w, r)
        stages.append(_stage_terms(plan, w, mbs, inflight, r, data, blocks))
    auto = plan.offload == "auto"
    if auto and plan.pp > 1:  # offload='auto' under a pipeline: each rank splits its own chunks at its own budget
        offloaded = [Footprint(p, g, o, a, 0.0, h, sl, *fr) for p, g, o, a, h, sl, *fr in stages]
        placed = place_stages(plan, w, cluster, [r for r, _ in ranks], offloaded)
        stages = [
            (
                f.params,
                f.grads,
                f.optimizer,
                f.activations,
                f.host,
                f.slack,
                f.host_optimizer_fraction,
                f.host_param_fraction,
            )
            for f in placed
        ]
    # the tensors of the stage with the most; the slack up to the most any stage needs with its own
    # (Footprint.allocated and .gpu_total of each stage's terms, its reserve 0)
    if len(stages) > 1:
        allocated = [params + grads + opt + act for params, grads, opt, act, *_ in stages]
        most = max(range(len(stages)), key=allocated.__getitem__)
        mem = stages[most]
        total = max(a + t[5] + 0.0 for a, t in zip(allocated, stages))
        slack = total - allocated[most]
    else:
        mem = stages[0]
        params, grads, opt, act, _, slack, *_ = mem
        total = params + grads + opt + act + slack + 0.0
    reserved = device_reserve(plan, cluster.calibration, total, experts=bool(w.num_experts))
    params, grads, opt, act, host, _, *fractions = mem
    mem = Footprint(params, grads, opt, act, reserved, host, slack, *fractions)
    # offload='auto': the runtime's split of the chunks (where the planner cannot cost it, as 'cpu')
    return place_auto(plan, w, cluster, mem) if auto and plan.pp == 1 else mem


def zero3_held_bytes(plan: Plan, w: Workload, shard: float, pb: int) -> tuple[float, float]:
    """``(parameters, gradients)`` bytes ZeRO-3 holds at the backward's start, the step's peak,
    for a dense model without a pipeline sharded over more than one rank: beside the shards, whole
    chunks (``parallel/zero/hooks.py``, ``store.py``) -- those the forward ends in, still gathered
    for the backward's first modules (the final norm's to the last: :func:`.zero3_traffic.
    zero3_resident_params`), and the two the hooks prefetch for the backward (the last blocks'),
    ``E`` elements each (:func:`gradient_chunk_elements`); the gradient chunk the head's gradient
    fills (fp32, ``E``) and that gradient itself (the largest parameter, fp32). Later in the
    backward up to three gradient chunks live, but by then each chunk's blocks have freed more
    activations than a chunk holds."""
    chunk, largest = gradient_chunk_elements(plan, w)
    params = shard * pb + (zero3_resident_params(plan, w) + 2 * chunk) * pb
    return params, shard * 4 + (chunk + largest) * 4


def shard_elements(plan: Plan, w: Workload, n: float, layers: int) -> float:
    """Elements of one rank's ZeRO shards of its ``n`` parameters (``layers`` blocks): ``n / g``
    over the ``g = dp x cp`` ranks for a dense model; a mixture of experts shards its experts over
    ``ep_dp = g / ep`` (``parallel/expert/style.py``'s ``expert_param_axes``; under tensor
    parallelism an MoE block's parameters over those times tp) and, without a
    pipeline or tensor parallelism, counts the chunks' padding as the runtime packs them
    (:func:`.zero3_traffic.chunk_shard_elements`: exact)."""
    g = plan.dp * plan.cp
    if not w.num_experts:
        return n / g
    if plan.pp == 1 and plan.tp == 1:
        return float(sum(chunk_shard_elements(plan, w)))
    experts = layers * w.expert_params / plan.ep if plan.ep > 1 else 0.0
    t = plan.tp
    if t > 1:  # an MoE block's parameters shard over the data axis times tp (tp_summed_params)
        summed = tp_summed_params(plan, w, layers)
        return (n - summed) / g + (summed - experts) / (g * t) + experts / (max(g // plan.ep, 1) * t)
    return (n - experts) / g + experts / max(g // plan.ep, 1)


def single_replica_elements(plan: Plan, w: Workload, n: float, layers: int) -> float:
    """Elements of the rank's ``n`` parameters whose ZeRO chunks have one replica (their replica
    group, as in :func:`shard_elements`, is this rank alone: the dense part at ``dp x cp = 1``, the
    experts at ``ep = dp x cp``, an MoE block's parameters under tp never), where the gradient
    chunk is the reduced shard itself (``parallel/zero/reduce.py``). Chunk padding not counted."""
    g = plan.dp * plan.cp
    if not w.num_experts:
        return n if g == 1 else 0.0
    experts = layers * w.expert_params / plan.ep if plan.ep > 1 else 0.0
    if plan.tp > 1:  # the MoE blocks' parameters replicate over the data axis times tp
        return (n - tp_summed_params(plan, w, layers)) if g == 1 else 0.0
    return (n - experts if g == 1 else 0.0) + (experts if g // plan.ep == 1 and experts else 0.0)


def autocast_cache_bytes(plan: Plan, w: Workload, layers: int) -> float:
    """Bytes of the 16-bit weight copies autocast's cache holds at the end of a forward of
    ``layers`` blocks: the executors run each forward under ``torch.autocast(cache_enabled=zero <
    3)`` (``executor.py``, ``parallel/pipeline/executor.py``), which keeps the copy of every fp32
    weight it cast until the forward ends. Without checkpointing they are the copies the GEMMs
    save anyway (in :func:`block_activation_bytes`); a checkpointed forward saves none, so at its
    end the cache holds every block's copy where the backward holds one recomputed block's set:
    the checkpointed peak is the larger of the two. 0 without autocast's copies or under ZeRO-3
    (no cache)."""
    if not autocast_copies(plan) or plan.zero >= 3:
        return 0.0
    return 2.0 * layers * block_local_params(plan, w)


def autocast_copies(plan: Plan) -> bool:
    """Whether autocast makes 16-bit copies of fp32 weights that the GEMMs keep for the backward."""
    return plan.precision in ("bf16", "fp16") and plan.param_dtype is None


def gradient_chunk_elements(plan: Plan, w: Workload) -> tuple[int, int]:
    """``(chunk, largest)``: the ZeRO chunk size in elements the runtime picks for one rank of
    ``plan`` (:func:`.memory.zero_chunk_elements` over ``dp x cp`` ranks) and the rank's largest
    parameter, for a dense model without a pipeline: its weight matrices as tensor parallelism
    splits them -- per block q, k, v, the output projection and the MLP's two or three matrices,
    then the token table (with the position table) and an untied head (norms and biases left
    out: they move the padding, not the size)."""
    s = w.shape
    ws = weight_split(plan)
    h, d = s.hidden, s.head_dim
    block = [h * s.num_heads * d // ws] + [h * s.num_kv_heads * d // ws] * 2 + [s.num_heads * d * h // ws]
    block += [h * s.ffn_hidden // ws] * (3 if s.gated_mlp else 2)
    table = s.vocab_size * h // ws
    sizes = [table] + ([s.max_positions * h] if s.max_positions else []) + block * s.num_layers
    sizes += [] if w.tied_embeddings else [table]
    return zero_chunk_elements(tuple(sizes), plan.dp * plan.cp), max(sizes)

"""Host issue time: what the CPU spends launching one step's kernels and collectives.

Eager PyTorch issues every kernel and every collective from the host, one Python call at a
time, ahead of the GPU. When a layout's blocks cut the work into many small kernels and
collectives (2D SUMMA over 2-rank groups, many micro-batches of few tokens) the host falls
behind and the GPU waits for it: the step is at least its host time. The cost model
(:func:`~.cost.predict`) takes each stage's micro-batch forward and backward as the larger of
the device time and this host time.

Per block and micro-batch, from the same structure the traffic formulas count
(:mod:`.axis_traffic`, the ledger's):

* **collective calls** per axis (:mod:`.host_calls`' :func:`~.host_calls.block_calls`): 1D tensor
  parallelism's row all-reduces forward (``tp_overlap`` pieces each) and the column layers' fused dX
  all-reduce backward; with sequence parallelism the norms' all-gathers and the rows'
  reduce-scatters forward, the re-gather, dX reduce-scatter and the rows' output-gradient
  all-gathers backward, and the norm and row-bias gradient all-reduces; replicated k/v projections'
  gradient all-reduces; 2D, 2.5D and 3D: their SUMMA gathers and reduce-scatters per Linear
  (:func:`~.host_calls.tp_block_calls`), 2D's and 2.5D's biases and norms summed in a pass's bucket
  flushes (a block's share of them, :func:`~.tp2d_traffic.grid_vector_flushes`) where their
  reductions are deferred; an MoE block under a grid has no MLP Linears but its grid row's
  all-to-all each way (the inverse pair backward), its statistics' all-reduces over the grid's axes
  and its router's and experts' gradient all-reduces over the whole grid; Ulysses' two all-to-alls
  each way, ring attention's ``cp - 1`` K/V shifts forward and ``2 cp - 1`` backward (one coalesced
  send/receive each); each MoE layer's split-size exchange and each of its ``ep_overlap`` chunks'
  dispatch and combine forward, each chunk's reverse pair backward, and its balancing statistics'
  all-reduce over the data axis (:func:`~.host_calls.ep_block_calls`); ZeRO-3's gather of the
  block's parameters forward and backward, and its gradient reduce-scatter (every micro-batch
  without a pipeline); activation checkpointing repeats the forward's calls in the backward (but an
  MoE layer's split sizes: the recompute replays its routes; and the call that puts an MoE block's
  output back from its tp share of the tokens, :func:`~.host_calls.token_split_output_calls`);
* **kernels**: ``Calibration.host_block_kernels`` (one serial block's forward and backward,
  measured on a tiny GPT, scaled to the model's block by the kernels its operators launch,
  :func:`serial_block_kernels`) plus the kernels the tensor-parallel layout's layers add to it
  (:func:`tp_block_kernels`, counted from the code for the block's shape and the plan), an MoE
  block's layer in place of the dense MLP (:func:`~.expert_kernels.moe_block_kernels`: its router,
  statistics, routes, rows and grouped GEMMs as the route the plan takes issues them, counted from
  the code) and, per call of the other axes (context, expert, ZeRO-3), 1D's ``kernels_per_call``
  (else ``kernels_per_collective``); the serial block's split between forward and backward
  measured too (``host_forward_share``, default a third), the layout's and the MoE layer's as
  they issue them; checkpointing adds a forward as far as its recompute reaches (the serial
  block's, :func:`serial_recompute_kernels`, at the calibration's forward kernels per operator;
  the layout's, :func:`tp_recompute_kernels`; an MoE layer's without what it replays or never
  reaches again);
  an MoE layer's ``ep_overlap`` chunks add the kernels each extra chunk launches
  (:func:`ep_chunk_kernels`, counted from the code);

at ``host_kernel_s`` per kernel and ``host_call_s`` per collective call (its own kernel, its
Python and bookkeeping beyond the kernels counted; per tensor-parallel mode, the layouts' own code
around them),
which ``benchmarks/calibrate.py`` measures on small models whose kernels take no time (from the
host's issue time, not the step's wall time: in a block with almost no work that also holds a chain
of dependent collectives' latency, which a real model's GEMMs hide). A
pipeline stage also sends and receives its activation and its gradient per micro-batch
(:func:`~.host_calls.pipeline_calls`). Under expert parallelism each MoE layer's forward reads its
split sizes on the host, which no work can be queued past, so the device idles while the host then
issues the dispatch (:func:`ep_sync_seconds`: on the device's path, the cost model adds it to the
forward). A calibration without host figures (all zero) predicts no host bound.
Pure; tests/unit/test_planner_host.py; the tensor-parallel counts against a run's collectives in
tests/dist/test_planner_host_calls.py (an MoE block's under the grids, and checkpointed grid blocks,
in tests/dist/test_planner_expert_grid_ledger.py); the kernels against a run's dispatched operators
in tests/dist/test_planner_host_kernels.py (a layout's) and tests/dist/test_planner_host_expert_kernels.py
(an MoE layer's).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..plan import Plan
from ..specs import TransformerShape
from .calibration import Calibration
from .expert_kernels import moe_block_kernels
from .host_calls import (
    block_calls,
    block_linears,
    grid_flushes_per_block,
    grid_grads_deferred,
    pipeline_calls,
    tp_block_calls,
)
from .workload import Workload

__all__ = [
    "HostTimes",
    "EP_CHUNK_KERNELS",
    "EP_CHUNKED_KERNELS",
    "EP_CHUNK_DEVICE_KERNELS",
    "ep_chunk_kernels",
    "ep_sync_seconds",
    "host_call_seconds",
    "host_block_kernels",
    "kernels_per_call",
    "serial_block_kernels",
    "serial_recompute_kernels",
    "tp_block_kernels",
    "tp_recompute_kernels",
    "host_times",
]


REFERENCE_SHAPE = TransformerShape(
    hidden=64,
    ffn_hidden=256,
    num_layers=2,
    num_heads=4,
    num_kv_heads=4,
    vocab_size=512,
    norm_params=128,
    linear_bias=True,
    fused_qkv=True,
    max_positions=128,
)
"""The block ``Calibration.host_block_kernels`` counts: ``benchmarks/calibrate.py``'s tiny GPT."""

EP_CHUNK_KERNELS = (19.0, 23.0, 16.0)
"""Kernels each MoE layer launches per chunk of ``Plan.ep_overlap`` beyond the first: ``(forward,
backward, recompute)``, counted from ``parallel/expert/overlap.py``, ``dispatch.py`` and
``rows.py`` on the GPU path (bf16 autocast over fp32 parameters, grouped GEMMs, groups padded in
the placement).
Forward: the chunk's assignment indices (2: offset, token), its rows cast and gathered
(``SendRows``, 2), their placement (``Routes.lay_out``: computed on the host from the split sizes
it holds, one copy to the device: 1) and the scatter (``PlaceRows``, 2), the experts
(``swiglu_grouped_mm``: 2 weight casts, the offsets' copy, 2 grouped GEMMs, SiLU and the product:
7), the gather back (``TakeRows``, 1), the weighting and sum (``WeighRows``: the weights' take, the
product, the zeros and the ``index_add_``: 4). Backward: the weighting's (the gradient's gather,
the rows' product and cast, the weights' product, sum and ``put_``: 6), the scatter back (2), the
experts' (2 grouped GEMMs each and a gradient cast each, the product and SiLU 3, the gate/up
concatenation 1: 10) with the weights' gradients summed (2), the gather's (1), ``SendRows``'s (2).
A recompute replays the routes (no indices, no ``lay_out``): the rows, the experts, the gather back
and the weighting (16). A dispatch-level count of a run checks them
(tests/dist/test_planner_host_expert_kernels.py), less :data:`EP_CHUNK_DEVICE_KERNELS` on its CPU."""
EP_CHUNKED_KERNELS = (10.0, 0.0, 1.0)
"""... and once per layer where ``ep_overlap > 1``: forward, the chunk keys (``Routes.build``: the
runs' copy, arange, ``repeat_interleave``'s 3, the key's multiply and add) and the split sizes
regrouped by member (2 copies), and the outputs' concatenation; backward none (the chunks' input
and routing-weight gradients are concatenated, as the one chunk's split is:
:func:`~.expert_kernels.moe_layer_kernels`); recompute, the outputs' concatenation."""
EP_CHUNK_DEVICE_KERNELS = ((2.0, 0.0, 1.0), (3.0, 0.0, 0.0))
"""Of :data:`EP_CHUNK_KERNELS` and :data:`EP_CHUNKED_KERNELS`, the kernels only a CUDA device
launches: per extra chunk the placement's and the offsets' copies to the device (a recompute: the
offsets' again); once, the runs' copy and two of ``repeat_interleave``'s three kernels (one
operator at the dispatcher)."""


def ep_sync_seconds(plan: Plan, w: Workload, cal: Calibration) -> float:
    """Seconds the device waits in one MoE layer's forward per micro-batch under expert
    parallelism: the host reads the layer's split sizes (``dispatch.py``'s ``HostSizes``: it waits
    for the device to finish the routing and the rows' gather, queued before the read), so no work
    is queued beyond that point; the device then idles while the host issues the rows' all-to-all
    (one collective call and its kernels, at the calibration's host figures; the sizes' few
    host-side sums before it are left out). Once per layer and micro-batch, for every
    ``ep_overlap`` chunk (one read); none in the backward or a recompute (the routes are kept or
    replayed), none at ep = 1 (``parallel/expert/local.py`` never reads the sizes on the host),
    and 0 without host figures."""
    if plan.ep == 1 or not w.num_experts or not (cal.host_kernel_s or cal.host_call_s):
        return 0.0
    mode = plan.tp_mode if plan.tp > 1 else "1d"
    return kernels_per_call(cal, mode) * cal.host_kernel_s + host_call_seconds(cal, mode)


def ep_chunk_kernels(plan: Plan, w: Workload) -> tuple[float, float]:
    """Kernels ``Plan.ep_overlap`` adds to one block per micro-batch: ``(forward, backward)``, the
    backward including a checkpointed block's recompute (:data:`EP_CHUNK_KERNELS`,
    :data:`EP_CHUNKED_KERNELS`)."""
    k = plan.ep_overlap
    if k == 1 or plan.ep == 1 or not w.num_experts:
        return 0.0, 0.0
    (f, b, r), (cf, cb, cr) = EP_CHUNK_KERNELS, EP_CHUNKED_KERNELS
    again = (k - 1) * r + cr if plan.activation_checkpointing else 0.0
    return (k - 1) * f + cf, (k - 1) * b + cb + again


def serial_block_kernels(shape) -> tuple[float, float]:
    """Kernels one serial block launches per micro-batch under bf16 autocast over fp32 parameters,
    ``(forward, backward)``, counted from the models' operators (``models/gpt.py``,
    ``models/llama.py``; a dispatch-level count checks them, tests/unit/test_planner_host.py).
    Forward: each norm (LayerNorm 1; RMSNorm as written: power, mean, ``+ eps``, ``rsqrt``, two
    products: 6), each Linear input's cast and each weight's (and bias's), the GEMMs, attention,
    the two residual adds, the activation (GELU 1; SwiGLU's SiLU and product 2) and rotary
    embeddings (the tables: 11; q's and k's two products, negation, concatenation and sum: 10;
    their casts to bf16 for attention: 2). Backward: each norm (LayerNorm 1; RMSNorm 14), the
    weights' (biases') gradient casts, the inputs' gradient casts and the two branches', two GEMMs
    per Linear, the biases' sums, the activation's (GELU 1; SwiGLU 3), attention, the residual adds
    and the extra readers' gradient sums, a fused q/k/v's concatenation, and rotary embeddings'
    (four casts, four products, two negations, two concatenations, two sums, two casts: 16)."""
    linears = block_linears(shape)
    bias = 1 if shape.linear_bias else 0
    readers = (1 if shape.fused_qkv else 3) + (2 if shape.gated_mlp else 1)
    rope = shape.max_positions == 0
    norm_f, norm_b = (6, 14) if shape.rms_norm else (1, 1)
    act_f, act_b = (2, 3) if shape.gated_mlp else (1, 1)
    fwd = 2 * norm_f + readers + linears * (1 + bias) + linears + 1 + 2 + act_f + (23 if rope else 0)
    bwd = 2 * norm_b + linears * (1 + bias) + readers + 2 + 2 * linears + linears * bias + act_b + 1 + 2
    bwd += (readers - 2) + (1 if shape.fused_qkv else 0) + (16 if rope else 0)
    return float(fwd), float(bwd)


def serial_recompute_kernels(shape) -> float:
    """Kernels a checkpointed serial block's recompute launches per micro-batch: its forward
    (:func:`serial_block_kernels`) as far as ``torch.utils.checkpoint`` runs it again. The
    recompute stops once the last tensor the block's backward saved is saved again: the MLP's down
    projection's input and weight (cast, with its bias's cast, before the GEMM), which an autograd
    op saves before it runs. So the down projection's GEMM and the residual add after it (which
    saves nothing) are never run again: 2 kernels fewer than the forward, GPT's and Llama's blocks,
    with biases or without. A dispatch-level count of checkpointed GPT and Llama blocks checks it
    (tests/dist/test_planner_host_kernels.py). An MoE block's recompute stops in its MoE layer
    instead (:func:`~.expert_kernels.moe_block_kernels`)."""
    fwd, _ = serial_block_kernels(shape)
    return fwd - 2


def tp_block_kernels(plan: Plan, w: Workload) -> tuple[float, float]:
    """Kernels a tensor-parallel layout adds to one block per micro-batch beyond the serial block
    (the same block under data parallelism in the same engine): ``(forward, backward)``, counted
    from the layers' code (``parallel/tensor/``) under bf16 autocast over fp32 parameters; the
    collectives' own kernels are not counted here (they go with each call's host seconds,
    ``host_call_s``), nor allocations (``empty``, ``new_empty``) and dtype queries. A
    dispatch-level count of GPT and Llama blocks checks it (tests/dist/test_planner_host_kernels.py).

    1D: each row layer adds its bias after the GEMM (``matmul(out=)`` then ``+ b``: 1 a biased
    row) and runs one GEMM per ``tp_overlap`` piece (``k - 1`` more a row); the column layers
    that read one input cast it once for the group (q/k/v, gate/up: ``readers - 2`` casts fewer,
    forward and backward) and sum their input gradients in place; replicated k/v projections
    slice their output's gradient back (2). Sequence parallelism: each norm's output gathered on
    the sequence (a concatenation each), with ``k > 1`` each row's pieces concatenated, each row's
    output gradient gathered backward (a concatenation each), and an RMSNorm's backward three
    casts fewer (its output leaves the norm cast, ``make_sequence_parallel_norm``, counted).

    2D and 2.5D: each norm is ``ShardedNormFn`` -- LayerNorm's forward 19 ops (the shard's mean,
    centred squares and sum, their stack; the gathered statistics' mean, sum and spread, ``rsqrt``,
    the normalisation, weight and bias) for the fused kernel's 1, backward 15 (the normalised
    input again, the weight's and bias's gradients, the two sums stacked, the input gradient) for
    1; RMSNorm's forward 7 (square, sum, divide, ``+ eps``, ``rsqrt``, two products) for the
    serial 6, backward 10 for 14; without a bias one op fewer each way -- each biased Linear adds
    its bias in place after the GEMM (1) and its gradient is summed in the bias's dtype (no cast
    back: 1 fewer); the deferred gradient pass concatenates each bucket it flushes (the block's
    share of a pass's flushes, :func:`~.tp2d_traffic.grid_vector_flushes`). 3D: the same norms
    and, per Linear, the input's gather on its hidden dim concatenated (1) forward and its
    gradient's backward (1), and per extra ``tp_overlap`` piece a GEMM forward and two GEMMs and
    an accumulation backward; its biases keep their casts.

    An MoE block counts its attention only (the MLP's Linears are the experts')."""
    if plan.tp == 1:
        return 0.0, 0.0
    s = w.shape
    k = plan.tp_overlap
    bias = 1 if s.linear_bias else 0
    moe = bool(w.num_experts)
    mlp_linears = 0 if moe else (3 if s.gated_mlp else 2)
    linears = (1 if s.fused_qkv else 3) + 1 + mlp_linears
    if plan.tp_mode == "1d":
        rows = 1 + (0 if moe else 1)
        readers = (1 if s.fused_qkv else 3) + (0 if moe else (2 if s.gated_mlp else 1))
        shared = readers - (1 if moe else 2)  # one cast per group of column layers reading one input
        replicated_kv = 2.0 if s.num_kv_heads < plan.tp and s.num_kv_heads < s.num_heads else 0.0
        fwd = rows * bias - shared + (k - 1) * rows
        bwd = -shared + replicated_kv
        if plan.sequence_parallel:
            fwd += 2 + (rows if k > 1 else 0)
            bwd += rows - (6 if s.rms_norm else 0)
        return float(fwd), float(bwd)
    norm_bias = 1 if s.norm_params > s.hidden else 0
    norm_f, norm_b = (1, -4) if s.rms_norm else (17 + norm_bias, 13 + norm_bias)
    fwd = 2 * norm_f
    bwd = 2 * norm_b
    if plan.tp_mode == "3d":
        fwd += linears * k
        bwd += linears + 3 * linears * (k - 1)
        return float(fwd + linears * bias), float(bwd)
    fwd += linears * bias
    bwd -= linears * bias
    if grid_grads_deferred(plan):
        bwd += grid_flushes_per_block(plan, w)
    return float(fwd), float(bwd)


def tp_recompute_kernels(plan: Plan, w: Workload) -> float:
    """Kernels a tensor-parallel layout adds to a checkpointed block's recompute beyond the serial
    block's recompute: :func:`tp_block_kernels`'s forward, less what the recompute never reaches.

    ``torch.utils.checkpoint`` stops a recompute once the last tensor the block's backward saved is
    saved again. In the serial block that is the last Linear's input, which an autograd op saves
    before it runs: the serial recompute stops short of the down projection's GEMM (and the residual
    add: :func:`serial_recompute_kernels`). Every layout's last Linear runs its GEMM inside an
    autograd Function (1D's ``RowParallelLinearFn``, 2D's and 2.5D's SUMMA, 3D's), which saves its
    inputs once it has run: the recompute runs the last Linear's GEMMs (the ``k - 1`` extra pieces
    are counted in the forward's already: one kernel more than the serial recompute) and its
    collectives. 1D and 3D add the bias after the Function (a cast and an add, 2 kernels the
    recompute never reaches; 2D and 2.5D add it inside). An MoE block ends in its MoE layer (whose own recompute
    :func:`~.expert_kernels.moe_layer_kernels` counts), so its attention recomputes whole."""
    fwd, _ = tp_block_kernels(plan, w)
    if plan.tp == 1 or w.num_experts:
        return fwd
    bias_after = plan.tp_mode in ("1d", "3d") and w.shape.linear_bias
    return fwd + 1 - (2 if bias_after else 0)


def host_block_kernels(cal: Calibration, shape) -> float:
    """Kernels of one serial block of ``shape`` per micro-batch: the calibration's
    ``host_block_kernels`` (``benchmarks/calibrate.py``'s tiny GPT: LayerNorm, biases, fused
    q/k/v, GELU) scaled by :func:`serial_block_kernels` of ``shape`` over that GPT block's."""
    return cal.host_block_kernels * sum(serial_block_kernels(shape)) / sum(serial_block_kernels(REFERENCE_SHAPE))


@dataclass(frozen=True)
class HostTimes:
    """Host seconds to issue one block's micro-batch forward and backward (a checkpointed
    block's recompute in the backward), and one pipeline rank's hand-offs per micro-batch."""

    forward: float
    backward: float
    pipeline: float = 0.0
    kernels: float = 0.0
    """Kernels one block launches per micro-batch."""
    calls: float = 0.0
    """Collective calls one block issues per micro-batch."""


def _by_mode(figures: dict, tp_mode: str, default: float) -> float:
    """``figures[tp_mode]``, else (2.5D, 3D) the 2D figure -- the grid layouts share their SUMMA
    machinery -- else the 1D one, else ``default``."""
    if tp_mode in figures:
        return figures[tp_mode]
    if tp_mode in ("2.5d", "3d") and "2d" in figures:
        return figures["2d"]
    return figures.get("1d", default)


def host_call_seconds(cal: Calibration, tp_mode: str) -> float:
    """Host seconds per collective call of a layout whose tensor parallelism is ``tp_mode``:
    the calibration's figure for that mode, else (2.5D, 3D) its 2D one, else its 1D one, else 0."""
    return _by_mode(cal.host_call_s, tp_mode, 0.0)


def kernels_per_call(cal: Calibration, tp_mode: str) -> float:
    """Kernels per collective call of a layout whose tensor parallelism is ``tp_mode``: the
    calibration's ``kernels_per_call`` for that mode (as :func:`host_call_seconds` falls back),
    else its ``kernels_per_collective``. :func:`host_times` reads it for "1d" only, for the calls
    of axes other than tensor parallelism (a layout's own kernels: :func:`tp_block_kernels`)."""
    return _by_mode(cal.kernels_per_call, tp_mode, cal.kernels_per_collective)


def host_times(plan: Plan, w: Workload, cal: Calibration) -> HostTimes:
    """Host seconds of one block per micro-batch under ``plan`` on ``cal``'s machine."""
    if not (cal.host_kernel_s or cal.host_call_s):
        return HostTimes(0.0, 0.0)
    f, b = block_calls(plan, w)
    mode = plan.tp_mode if plan.tp > 1 else "1d"
    one, kpc = host_call_seconds(cal, mode), kernels_per_call(cal, "1d")
    kern = host_block_kernels(cal, w.shape)
    share = cal.host_forward_share
    ef, eb = ep_chunk_kernels(plan, w)
    # the tensor-parallel layers' kernels counted (tp_block_kernels); the other axes' calls at the
    # calibration's kernels per call
    tf, tb = tp_block_kernels(plan, w)
    cf, cb = tp_block_calls(plan, w)
    # an MoE layer's own kernels in place of the dense MLP's (counted: expert_kernels)
    mf, mb, mr = moe_block_kernels(plan, w)
    again = 0.0
    if plan.activation_checkpointing:
        # the serial block's recompute, counted, at the calibration's forward kernels per operator
        serial_fwd, _ = serial_block_kernels(w.shape)
        recompute = kern * share * serial_recompute_kernels(w.shape) / serial_fwd
        again = recompute + tp_recompute_kernels(plan, w) + mr
    kf = kern * share + tf + mf + kpc * (f - cf) + ef
    kb = kern * (1 - share) + tb + mb + kpc * (b - cb - (cf if plan.activation_checkpointing else 0.0)) + again + eb
    pf, pb = pipeline_calls(plan)
    p2p = (pf + pb) * (cal.host_call_s.get("1d", one) + cal.host_kernel_s)
    return HostTimes(
        forward=kf * cal.host_kernel_s + f * one,
        backward=kb * cal.host_kernel_s + b * one,
        pipeline=p2p,
        kernels=kf + kb,
        calls=f + b,
    )

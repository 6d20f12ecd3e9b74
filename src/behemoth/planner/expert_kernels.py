"""The kernels an MoE layer launches per micro-batch, counted from its code.

behemoth's MoE layer (``models/moe.py``'s :class:`~behemoth.models.moe.MoEFeedForward`) always
runs under the expert style (``parallel/expert/style.py``, at ep = 1 too), so its kernels are the
style's, not the serial layer's loop over experts. Two routes (:func:`expert_route`):

* **local** (ep = 1, the grouped GEMMs' widths, no capacity: ``parallel/expert/local.py``): the
  routes made on the device (:func:`~behemoth.parallel.expert.local.layout`), the rows gathered,
  the grouped GEMMs, the rows taken back token-major and weighed;
* **routed** (ep > 1: ``parallel/expert/dispatch.py`` through ``overlap.py``'s exchange): the
  routes built once (:meth:`~behemoth.parallel.expert.dispatch.Routes.build`), the rows sent,
  placed, through the experts, taken back and weighed.

Counted under bf16 autocast over fp32 parameters on the GPU path (the grouped GEMMs' fast kernel,
groups padded to 16 rows), as the dispatcher sees the operators (every operator but views,
allocations and dtype queries; a fill such as ``new_zeros`` or ``ones_like`` is one), for
behemoth's layer with softmax scores, the top-k weights renormalised or not
(``Workload.experts_norm_topk``), with or without a shared expert, no capacity, no balancing
bias. The collectives' own kernels go with each call (:mod:`.host`). The count replaces the dense
MLP's (:func:`mlp_kernels`) in the block (:func:`moe_block_kernels`).

A dispatch-level count of a run checks it (tests/dist/test_planner_host_expert_kernels.py: a tiny
MoE Llama against the same model with dense MLPs, ep = 1 and 2, with and without activation
checkpointing, ep 2 in chunks, 1D tensor parallelism with and without sequence parallelism and
checkpointed, with a shared expert by both routes and under 1D tp, 2D on 4 ranks, 2.5D and 3D on 8,
checkpointed too), on the CPU with the grouped GEMMs' fast path forced: there a CUDA device's three copies
between host and device (:data:`EP_DEVICE_COPIES`) are not made. The eager path's: a compiled
block (``Plan.compile``) traces the local route whole. Pure.
"""

from __future__ import annotations

from ..plan import Plan
from .workload import Workload

__all__ = ["EP_DEVICE_COPIES", "expert_route", "mlp_kernels", "moe_block_kernels", "moe_layer_kernels"]

EP_DEVICE_COPIES = (3.0, 0.0, 1.0)
"""Kernels of the routed path (ep > 1) that only a CUDA device makes: ``(forward, backward,
recompute)``. Forward: the split sizes' read to the host (``HostSizes``: a non-blocking copy), the
placement's copy to the device (``Routes.lay_out``) and the groups' offsets' copy
(``swiglu_grouped_mm``'s ``to_device``); a recompute copies the offsets again (its routes and
placement are replayed). On a CPU these are no-ops."""


def expert_route(plan: Plan, w: Workload) -> str:
    """``"local"`` where an MoE layer's rank holds every expert and the grouped GEMMs take its
    widths (hidden a multiple of 8, the gate/up width ``2 I`` of 16: ``ExpertBlock.grouped_widths``),
    so ``local_exchange`` runs (``local_ready``; the planner's workloads drop nothing), else
    ``"routed"``."""
    f = w.expert_ffn_hidden or w.shape.ffn_hidden
    if plan.ep == 1 and w.shape.hidden % 8 == 0 and (2 * f) % 16 == 0:
        return "local"
    return "routed"


def mlp_kernels(shape) -> tuple[float, float]:
    """The dense MLP's share of :func:`~.host.serial_block_kernels`: ``(forward, backward)``.
    Forward: its readers' input casts (SwiGLU's gate and up: 2; GELU's 1), each weight's (and
    bias's) cast, a GEMM per Linear and the activation (SwiGLU's SiLU and product 2; GELU 1).
    Backward: its branch's gradient cast to bf16 (the residual add's backward), two GEMMs per
    Linear, each weight's (and bias's) gradient cast and each bias's sum, the activation's (SwiGLU
    3; GELU 1), the readers' input-gradient casts and their sum (SwiGLU: 1)."""
    linears = 3 if shape.gated_mlp else 2
    bias = 1 if shape.linear_bias else 0
    readers = 2 if shape.gated_mlp else 1
    act_f, act_b = (2, 3) if shape.gated_mlp else (1, 1)
    fwd = readers + linears * (1 + bias) + linears + act_f
    bwd = 1 + 2 * linears + linears * (1 + bias) + linears * bias + act_b + readers + (readers - 1)
    return float(fwd), float(bwd)


def moe_layer_kernels(plan: Plan, w: Workload) -> tuple[float, float, float]:
    """Kernels one MoE layer launches per micro-batch: ``(forward, backward, recompute)`` (the
    recompute: a checkpointed block's, 0 without checkpointing), counted from
    ``parallel/expert/style.py``'s forward and the route it takes (:func:`expert_route`).

    Forward, both routes: the router (its input's and weight's casts, the GEMM: 3); ``route``
    (the logits cast to fp32, softmax, top-k: 3; renormalised, the weights' sum and division: 2);
    the balancing counts (``balance_terms``: zeros, ones, ``scatter_add_``, the cast, the
    probabilities' sum: 5), the z-loss sum (a cast, ``logsumexp``, square, sum: 4), the statistics
    gathered for their all-reduce (the dropped counts' zeros, the token count, concatenation, cast
    to float64, the totals' cast back: 5), the router loss (4 products, 2 divisions, the
    product and sum of the balance term, and the sum: 9) and its sum over the model's layers (1).
    Local: ``layout`` (the narrow cast, the sort, the counts' zeros and ``scatter_add_``, the
    padding's add, floor division, product and clamp, the ends' cumulative sum, the shifts' three
    subtractions and cumulative sum, arange, two ``index_select`` and an add, the slot scatter,
    the last end's fill, the ends' cast: 20), ``GatherRows`` (arange, floor division, zeros,
    ``index_copy_``, the rows' cast and gather: 6), the experts (``swiglu_grouped_ends``: the two
    weights' casts, two grouped GEMMs, SiLU and the product: 6), ``TokenRows``' gather (1) and the
    weighting (the product and the sum over k: 2). Routed (one chunk): ``Routes.build`` (the
    buffer's zeros, ``scatter_add_``, the narrow cast, the sort, the tokens' floor division: 5),
    ``SendRows`` (the cast and the gather: 2), ``PlaceRows`` (``index_copy_``, the padding's
    ``index_fill_``: 2), the experts (``swiglu_grouped_mm``: 6), ``TakeRows`` (1) and
    ``WeighRows`` (``take``, the product, zeros, ``index_add_``: 4), plus
    :data:`EP_DEVICE_COPIES`.

    Backward, both: the router loss's (the balance term: two products by the coefficients and
    ``E``, the division, the product by the counts: 4; the z-loss: the division, the square's 3,
    ``logsumexp``'s 3, the cast back: 9 -- with the coefficient's product, 13), ``route``'s
    (top-k's zeros and scatter, the probabilities' two readers summed, the softmax's, the cast back
    and the logits' two readers summed: 6; renormalised, the division's 3, the negation, the
    product, the sum and the two paths' sum: 7), the router's (2 GEMMs, the weight's and the
    input's gradient casts: 4), the layer input's two readers summed (1), the experts' (2 grouped
    GEMMs each, the product's 2 and SiLU's, the gate/up concatenation, the two weights' gradient
    casts: 10). Local: ``TokenRows``' zeros and ``index_copy_``, ``GatherRows``' gather and sum over
    k (4), the weighting's (two products, the sum over the hidden dim, the rows' cast: 4). Routed:
    ``WeighRows``' (the gather, the rows' product and cast, the weights' product, sum and ``put_``:
    6), ``TakeRows``' scatter (``index_copy_``, ``index_fill_``: 2), ``PlaceRows``' gather (1),
    ``SendRows``' (``index_copy_`` and the sum over k: 2) and the chunk split's two
    concatenations (the tokens' and the weights' gradients: 2).

    Under 1D tensor parallelism each tp rank takes its share of the tokens (``tokens.py``): the
    shares' statistics summed (``sum_shares``: two float64 casts and a concatenation, then the
    probability sums' and the z-loss's cast, subtraction and add: 9), and without sequence
    parallelism the share's copy (``ScatterToAxis``) and the output gather's concatenation,
    backward the gradient's copy and its gather's concatenation (2); with it, forward the share's
    copy (a reshape of the sequence's slice) and the layer's input in bf16 (the norm's cast before
    its gather comes, the router's and the rows' input casts go, the output is cast back: 1),
    backward the slice's, the output cast's and the residual add's cast of the branch's gradient,
    less the router's input cast (2). The 2D, 2.5D and 3D grids' shares (an all-to-all each way,
    each concatenating what arrives: 2 forward, its inverse pair's 2 backward; the counts summed
    over the grid's one or two other axes in place, no kernel) are counted as 1D's without sequence parallelism
    (checked under 2D, 2.5D and 3D, the copies the collectives make around them left out).

    A shared expert (``Workload.shared_expert_ffn_hidden``, ``models/moe.py``'s ``SharedExpert``:
    every token of the rank's share through one SwiGLU beside the routed experts, by either route,
    its output added to theirs): forward, its input's cast (none where the layer's input is already
    in bf16: 1D with sequence parallelism), its two weights' casts, its two GEMMs, SiLU and the
    product, and the add to the routed output (7 + 1); backward, the branch's gradient cast to bf16
    (none with sequence parallelism), two GEMMs and a weight-gradient cast for each Linear, the
    product's two and SiLU's, the gate/up concatenation, the input gradient's cast back (none with
    sequence parallelism), the layer input's third reader summed, and its two parameters' gradients
    added into the gradient sync's buffers (13 + 2; the router's and experts' three take the place
    of the dense MLP's three weights'). A recompute runs it again whole.

    Recompute (activation checkpointing): the forward again, but not the layer's loss summed
    over the layers (outside the block), nor the ops that a stopping recompute does not reach
    (``torch.utils.checkpoint`` stops once it has recomputed every tensor the backward saved: the
    last is the token count the router loss's z-term is divided by, saved before the division
    runs, so neither that division nor the loss's last add runs again, nor, under 1D without
    sequence parallelism, the output gather's concatenation after them); routed, the routes
    replayed (``replay.py``: not ``Routes.build``'s 5 but a copy of the offsets,
    :data:`EP_DEVICE_COPIES`)."""
    if not w.num_experts:
        return 0.0, 0.0, 0.0
    norm = 1 if w.experts_norm_topk else 0
    # router, route, balancing statistics, the router loss and its sum over the layers
    fwd = 3 + 3 + 2 * norm + 5 + 4 + 5 + 9 + 1
    bwd = 13 + 6 + 7 * norm + 4 + 1 + 10
    built = 0
    if expert_route(plan, w) == "local":
        fwd += 20 + 6 + 6 + 1 + 2
        bwd += 4 + 4
    else:
        built = 5
        fwd += built + 2 + 2 + 6 + 1 + 4 + EP_DEVICE_COPIES[0]
        bwd += 6 + 2 + 1 + 2 + 2
    tail = 3  # the loss's sum over the layers; the z-term's division and the last add (a stopped recompute's)
    sp = plan.tp > 1 and plan.tp_mode == "1d" and plan.sequence_parallel
    if w.shared_expert_ffn_hidden:
        cast = 0 if sp else 1  # the layer's input, and its gradient, in fp32: cast for the shared GEMM
        fwd += 7 + cast
        bwd += 13 + 2 * cast
    if plan.tp > 1:
        fwd += 9 + (1 if sp else 2)
        bwd += 2
        tail += 0 if sp else 1
    again = 0.0
    if plan.activation_checkpointing:
        again = fwd - tail - built - EP_DEVICE_COPIES[0] + EP_DEVICE_COPIES[2] if built else fwd - tail
    return float(fwd), float(bwd), float(again)


def moe_block_kernels(plan: Plan, w: Workload) -> tuple[float, float, float]:
    """Kernels an MoE block launches per micro-batch beyond the same block with a dense MLP
    (:func:`~.host.serial_block_kernels`): :func:`moe_layer_kernels` less :func:`mlp_kernels`,
    ``(forward, backward, recompute)``; zeros for a dense model. The recompute: the MoE layer's less
    the dense MLP's, which a checkpointed dense block's recompute runs but for the down projection's
    GEMM (:func:`~.host.serial_recompute_kernels`); neither block's recompute reaches the residual
    add after its MLP."""
    if not w.num_experts:
        return 0.0, 0.0, 0.0
    f, b, r = moe_layer_kernels(plan, w)
    mf, mb = mlp_kernels(w.shape)
    return f - mf, b - mb, (r - (mf - 1) if plan.activation_checkpointing else 0.0)

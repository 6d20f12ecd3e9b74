"""What a mixture-of-experts layer keeps and moves per token beyond a dense MLP of the same width.

The planner counts an MoE layer as a SwiGLU over ``f = I k`` per token (each token's k experts
of width I: their GEMMs, their activation's saved set and bytes, ``ACTIVATION_BYTES`` and
:mod:`.elementwise`). The layer's routing, dispatch and combine add to that, counted here from
the code as it runs under expert parallelism (``parallel/expert/style.py``: the router of
``models/moe.py``, then ``dispatch.py``, ``grouped.py`` and ``combine``), per token with h the
hidden width, E experts, k experts a token visits, c the bytes of the GEMMs' dtype (2 under
16-bit autocast, else 4).

**Kept for the backward** (:func:`expert_saved_bytes`), beyond the experts' ``[rows, 2I]``,
``[rows, I]`` activations (the dense rows' ``8 f``):

* the dispatched rows the experts' first grouped GEMM reads, ``[T k, h]`` in the GEMMs' dtype
  (``c h k``); the experts' output rows the combine weighs (``y_AH``, ``c h k``), which its
  weighted sum (``rows.py``'s ``WeighRows``, one autograd node) keeps with the gathered
  weights, not their fp32 product;
* the router's fp32 probabilities (softmax's output) and the z-loss's fp32 copy of the logits
  (``8 E``), the log-sum-exp (4), the top-k's indices (int64, ``8 k``), the k weights and their
  sum (``4 k + 4``);
* the permutations' int64 indices: the rows' order (which the weights' gather shares), their
  slots in the experts' layout and their tokens (``24 k``), and the gathered weights (``4 k``).

A rank holding every expert (``ep = 1``: a pipeline, tensor parallelism, one device) with 16-bit
GEMMs takes ``parallel/expert/local.py`` instead (:func:`takes_local_path`): the same two
``c h k`` rows, no fp32 product (the rows are weighed token-major, the sum over k keeps
nothing) and one int64 slot per assignment (``8 k``); its layout adds ``16 E`` rows a layer and
micro-batch at most (left out, as the groups' padding is).

The serial layer (``MoEFeedForward.forward``: a loop over experts, which one data rank runs at
``ep = 1`` outside the local path) keeps the same rows and also the weighted product, ``[T k, h]``
in fp32, which its ``index_add`` keeps (its derivative reads its source's shape: ``4 h k``). The groups' padding to 16 rows (at most ``16 E / ep``
rows a layer and micro-batch) is left out. Under tensor parallelism (every mode: 1D and the 2D,
2.5D and 3D grids) the tp ranks split an MoE block's tokens (``parallel/expert/tokens.py``); the
memory and elementwise models count these bytes over this rank's share of them
(:func:`token_split`). tests/unit/test_planner_moe_bytes.py checks the count against
autograd's saved tensors of a Llama MoE block.

**Moved** (:func:`expert_elementwise_bytes`), beyond the activation over ``f`` and the two input
casts of a dense gated MLP (the router's and the dispatch's here): forward, the router's GEMM
reading its 16-bit input (``2 h``) and the routing over E (the logits' fp32 copies, softmax,
top-k, the weights' normalisation, the z-loss, the counts: ``32 E + 36 k``), the sort and the
indices (``~150 k``), the rows gathered (``4 h k``), placed (``4 h k``), taken back (``4 h k``),
weighed into fp32 (read ``2 h k``, write ``4 h k``) and added to their tokens (``index_add_``:
read ``4 h k``, read and write the token rows ``8 h k``), the output zeroed (``4 h``); backward,
the gradient gathered per row (``8 h k``), the product's two gradients each made in fp32 and
reduced or cast (``14 h k`` each), the scatter back and the gather of the placement (``4 h k``
each), the grouped GEMM's ``[rows, 2I]`` gradient assembled from its two halves (``8 I k``), the
dispatch's gradient put back per slot and summed over the k in fp32 (``6 h k + 4 h``), the router's
backward (its two GEMMs' 16-bit reads and write, ``6 h``, and the routing's, ``40 E``). Pure.
"""

from __future__ import annotations

from ..plan import Plan
from .workload import Workload

__all__ = [
    "busiest_rank_load",
    "expert_elementwise_bytes",
    "expert_saved_bytes",
    "takes_local_path",
    "token_split",
    "tp_summed_params",
]


def _compute_bytes(plan: Plan) -> int:
    return 2 if plan.precision in ("bf16", "fp16") else 4


def token_split(plan: Plan) -> int:
    """Into how many shares the tp group's tokens of an MoE block are split: tp under every mode
    (``parallel/expert/tokens.py``): 1D's tp ranks each route and run their own share; a grid's
    ranks hold a batch block of 1/q (2D), 1/(d q) (2.5D) or 1/q**2 (3D) of them and its grid row's
    q ranks split that block again, so each runs 1/tp of the tokens too."""
    return plan.tp


def busiest_rank_load(plan: Plan, w: Workload) -> float:
    """What an MoE layer's experts' GEMMs and its rows' all-to-alls take over their balanced time:
    under expert parallelism (ep > 1) every layer's all-to-alls wait for the rank whose experts
    received the most rows (``Workload.expert_load_imbalance``); with every expert on each rank
    (ep = 1) a rank runs its own tokens' assignments, as many on every rank: 1."""
    return w.expert_load_imbalance if plan.ep > 1 and w.num_experts else 1.0


def takes_local_path(plan: Plan) -> bool:
    """Whether the MoE layers of ``plan`` run as ``parallel/expert/local.py`` runs them on the
    planner's GPUs: every expert on each rank (``ep = 1``) and 16-bit GEMMs (the grouped kernel's),
    dropless."""
    return plan.ep == 1 and _compute_bytes(plan) == 2


def expert_saved_bytes(plan: Plan, w: Workload, *, local: bool | None = None) -> float:
    """Bytes per token an MoE layer keeps for its backward beyond a dense gated MLP over ``I k``
    (see the module docstring); 0 for a dense model. ``local``: whether the layer takes the
    path of a rank holding every expert (default :func:`takes_local_path`): no fp32 weighted
    product (the output rows are weighed token-major), one int64 slot per assignment for indices."""
    if not w.num_experts:
        return 0.0
    h, e, k, c = w.shape.hidden, w.num_experts, w.experts_top_k, _compute_bytes(plan)
    router = 8 * e + 4 + 8 * k + 4 * k + 4  # probs and the z-loss's logits (fp32), lse, top-k indices, weights, sum
    if takes_local_path(plan) if local is None else local:
        return float(2 * c * h * k + router + 8 * k)  # gathered rows, output rows; the slots (int64)
    # dispatched rows, the experts' output rows; the serial layer's fp32 weighted product (ep = 1)
    rows = (2 * c + (4 if plan.ep == 1 else 0)) * h * k
    indices = 24 * k + 4 * k  # order, slots, tokens (int64); the gathered weights (fp32)
    return float(rows + router + indices)


def expert_elementwise_bytes(w: Workload) -> tuple[float, float]:
    """(forward, backward) bytes per token an MoE layer's routing, dispatch and combine move
    beyond a dense gated MLP over ``I k`` (see the module docstring); (0, 0) for a dense model."""
    if not w.num_experts:
        return 0.0, 0.0
    h, e, k = w.shape.hidden, w.num_experts, w.experts_top_k
    i = w.expert_ffn_hidden or w.shape.ffn_hidden
    forward = 2 * h + 32 * e + 36 * k + 150 * k + (4 + 4 + 4 + 6 + 12) * h * k + 4 * h
    backward = (8 + 14 + 14 + 4 + 4 + 6) * h * k + 8 * i * k + 4 * h + 6 * h + 40 * e
    return float(forward), float(backward)


def tp_summed_params(plan: Plan, w: Workload, layers: int) -> float:
    """Parameters one rank holds in ``layers`` MoE blocks whose gradients are partial over tp
    (each tp rank runs its own share of the tokens, ``parallel/expert/tokens.py``): the router and
    its E/ep experts, whole on every tp rank; 0 without tensor parallelism or experts."""
    if plan.tp == 1 or not w.num_experts:
        return 0.0
    return layers * (w.expert_params / plan.ep + w.shape.hidden * w.num_experts)

"""Collective calls one block issues per micro-batch, as behemoth's layers issue them: the
tensor-parallel layout's (:func:`tp_block_calls`), context parallelism's (:func:`cp_block_calls`),
an MoE layer's (:func:`ep_block_calls`), ZeRO-3's and the recompute's (:func:`block_calls`), a
pipeline rank's point-to-point calls (:func:`pipeline_calls`). :mod:`.host` turns them, with the
kernels it counts, into the host's issue time. Pure; tests/unit/test_planner_host.py, against a
run's collectives in tests/dist/test_planner_host_calls.py and (an MoE block's under the grids,
checkpointed grid blocks) tests/dist/test_planner_expert_grid_ledger.py.
"""

from __future__ import annotations

from functools import lru_cache

from ..plan import Plan
from .params import stage_layers
from .tp2d_traffic import grid_deferred_layers, grid_side, grid_vector_flushes
from .workload import Workload

__all__ = [
    "block_calls",
    "block_linears",
    "cp_block_calls",
    "ep_block_calls",
    "grid_flushes_per_block",
    "grid_grads_deferred",
    "pipeline_calls",
    "token_split_output_calls",
    "tp_block_calls",
]


def block_linears(shape) -> int:
    """Linear layers in one block: q/k/v (one fused or three), the output projection, and the
    MLP's two (three gated)."""
    return (1 if shape.fused_qkv else 3) + 1 + (3 if shape.gated_mlp else 2)


def tp_block_calls(plan: Plan, w: Workload) -> tuple[float, float]:
    """Tensor-parallel collective calls of one block per micro-batch: ``(forward, backward)``.
    As behemoth's layers issue them: a run's record functions agree for GPT and Llama blocks
    under 1D (4 ranks), 2D (4), 2.5D and 3D (8; tests/dist/test_planner_host_calls.py)."""
    if plan.tp == 1:
        return 0.0, 0.0
    s = w.shape
    k = plan.tp_overlap
    norm_vectors = s.norm_params / s.hidden  # a norm's weight (and bias)
    if plan.tp_mode == "1d":
        replicated_kv = 2.0 if s.num_kv_heads < plan.tp and s.num_kv_heads < s.num_heads else 0.0
        if w.num_experts:
            # the attention's pair; the MoE block's tp shares of its balancing statistics summed, its
            # parameters' gradients (router, gate_up, down) summed, and its token split: the output
            # gathered and the input gradient gathered (sequence parallelism: the norms' gathers and
            # the input gradient's reduce-scatter, as a dense block's)
            if not plan.sequence_parallel:
                return 2.0 + k, 2.0 + replicated_kv
            vectors = 2 * norm_vectors + (1.0 if s.linear_bias else 0.0)
            return 3.0 + k, 3.0 + k + vectors + replicated_kv
        if not plan.sequence_parallel:
            return 2.0 * k, 2.0 + replicated_kv
        # norms' gathers + rows' reduce-scatters; re-gather + dX reduce-scatter + rows' dY gathers,
        # and the gradients of the norms' vectors and the rows' biases summed over tp
        vectors = 2 * norm_vectors + (2.0 if s.linear_bias else 0.0)
        return 2.0 + 2.0 * k, 4.0 + 2.0 * k + vectors + replicated_kv
    # an MoE block under a grid has no grid Linears in its MLP: its grid row trades the tokens' hidden
    # blocks for whole rows and back (an all-to-all each way, the inverse pair backward), sums its
    # statistics' shares over the loss axis and its counts over the grid's other axes of more than one
    # rank, and its parameters' gradients (router, gate_up, down) over the whole grid
    linears = block_linears(s) - ((3 if s.gated_mlp else 2) if w.num_experts else 0)
    deep = plan.tp_mode == "3d" or plan.tp_depth > 1
    moe_f, moe_b = (2.0 + 1.0 + (2.0 if deep else 1.0), 2.0) if w.num_experts else (0.0, 0.0)
    if plan.tp_mode == "3d":
        # 8 per Linear and 5 more per extra over-decomposition piece; each norm combines and sums
        # its statistics and, as each bias, sums its vectors' gradients over the cube's two other axes
        vectors = 2 * norm_vectors + (linears if s.linear_bias else 0)
        total = linears * (8.0 + 5.0 * (k - 1)) + 2 * 2 + 2 * vectors
        return total / 3 + moe_f, 2 * total / 3 + moe_b
    # SUMMA per Linear: gathers of X and W forward; X's re-gather (W's gathered block is kept)
    # and the dX, dW reduce-scatters backward; each norm combines its statistics forward
    # (LayerNorm gathers, RMSNorm sums) and all-reduces its sums backward
    tesseract = plan.tp_mode == "2.5d" and plan.tp_depth > 1
    if grid_grads_deferred(plan):
        # the norms' and biases' gradients summed down the grid column in buckets, the block's
        # share of a pass's flushes (and under 2.5D each flush, and each weight's gradient, over depth)
        flushes = grid_flushes_per_block(plan, w)
        bwd = 3.0 * linears + 2 + flushes + (linears + flushes if tesseract else 0)
        return 2.0 * linears + 2 + moe_f, bwd + moe_b
    # else each norm's vectors in one all-reduce and each bias's in one, down the grid column;
    # 2.5D: every parameter's gradient is also summed over the depth axis
    biases = linears if s.linear_bias else 0
    depth = linears + biases + 2 * norm_vectors if tesseract else 0
    return 2.0 * linears + 2 + moe_f, 3.0 * linears + 4 + biases + depth + moe_b


def grid_flushes_per_block(plan: Plan, w: Workload) -> float:
    """One block's share of the bucket flushes a pass sums a 2D / 2.5D grid's deferred vector
    gradients in (:func:`grid_grads_deferred`), over the last stage's blocks."""
    tesseract = plan.tp_mode == "2.5d" and plan.tp_depth > 1
    blocks = stage_layers(plan, w)[-1]
    q = grid_side(plan.tp, plan.tp_depth if tesseract else 1)
    return _flushes(w.shape, q, blocks, bool(w.num_experts)) / blocks


@lru_cache(maxsize=4096)
def _flushes(shape, q: int, blocks: int, experts: bool) -> int:
    """:func:`grid_vector_flushes` of a pass over ``blocks`` blocks (a search asks per layout)."""
    return grid_vector_flushes(grid_deferred_layers(shape, q, blocks, experts=experts))


def grid_grads_deferred(plan: Plan) -> bool:
    """Whether a 2D / 2.5D block's layers hand their gradient reductions to the pass
    (``behemoth.parallel.tensor.deferred_grads``), so its vectors are summed in buckets: in eager
    blocks (checkpointed ones too: a run's calls show a checkpointed block's backward summing them
    in the same flushes as an unchecked one's, tests/dist/test_planner_expert_grid_ledger.py),
    without ZeRO-3's hooks on the layers, and not in zero-bubble's split backward (counted as
    summed where they run)."""
    if plan.tp_mode not in ("2d", "2.5d") or plan.tp == 1:
        return False
    split = plan.pp > 1 and plan.schedule == "zero-bubble"
    return not (plan.compile or plan.zero == 3 or split)


def cp_block_calls(plan: Plan) -> tuple[float, float]:
    """Context-parallel calls of one attention layer per micro-batch: ``(forward, backward)``."""
    if plan.cp == 1:
        return 0.0, 0.0
    if plan.cp_mode == "ulysses":
        return 2.0, 2.0
    return float(plan.cp - 1), float(2 * plan.cp - 1)


def ep_block_calls(plan: Plan, w: Workload) -> tuple[float, float, float]:
    """Calls of one MoE layer per micro-batch: ``(forward, backward, recompute)``, as
    ``parallel/expert/style.py`` and ``overlap.py`` issue them. Forward: with ``ep > 1``, the
    split sizes' exchange (once, for every chunk) and each of the ``ep_overlap`` chunks' dispatch
    and combine all-to-alls; over a data axis (dp, x cp) of more than one rank, the balancing
    statistics' all-reduce (the member exchange, ``Plan.ep_dedup``, the same calls: its weights
    and slots travel in its rows). Backward: each chunk's reverse pair. A checkpointed block's recompute
    repeats the forward but the split sizes (it replays the forward's routes,
    ``parallel/expert/replay.py``)."""
    if not w.num_experts:
        return 0.0, 0.0, 0.0
    stats = 1.0 if plan.dp * plan.cp > 1 else 0.0
    if plan.ep == 1:
        return stats, 0.0, stats
    rows = 2.0 * plan.ep_overlap
    return 1.0 + rows + stats, rows, rows + stats


def block_calls(plan: Plan, w: Workload) -> tuple[float, float]:
    """Every collective call one block issues per micro-batch, over all axes: ``(forward,
    backward)``, the backward including a checkpointed block's recomputed forward."""
    f, b = tp_block_calls(plan, w)
    cf, cb = cp_block_calls(plan)
    ef, eb, again = ep_block_calls(plan, w)
    f, b = f + cf, b + cb
    if plan.zero == 3 and plan.dp * plan.cp > 1:
        f, b = f + 1, b + 1 + (1 if plan.pp == 1 else 0)
    if plan.activation_checkpointing:
        b += f + again - token_split_output_calls(plan, w)
    return f + ef, b + eb


def token_split_output_calls(plan: Plan, w: Workload) -> float:
    """The call that puts an MoE block's output back in the tensor-parallel layout from this rank's
    share of the tokens (``parallel/expert/tokens.py``'s ``give``: 1D's all-gather, a grid row's
    all-to-all; none under sequence parallelism), which a checkpointed block's recompute does not
    issue again (:func:`~.axis_traffic.token_split_output_bytes`)."""
    if plan.tp == 1 or not w.num_experts or (plan.tp_mode == "1d" and plan.sequence_parallel):
        return 0.0
    return 1.0


def pipeline_calls(plan: Plan) -> tuple[float, float]:
    """Point-to-point calls one pipeline rank issues per micro-batch: its chunks' activations
    received and sent forward, their gradients backward."""
    if plan.pp == 1:
        return 0.0, 0.0
    return 2.0 * plan.virtual_stages, 2.0 * plan.virtual_stages

"""Host issue time: what the CPU spends launching one step's kernels and collectives.

Eager PyTorch issues every kernel and every collective from the host, one Python call at a
time, ahead of the GPU. When a layout's blocks cut the work into many small kernels and
collectives (2D SUMMA over 2-rank groups, many micro-batches of few tokens) the host falls
behind and the GPU waits for it: the step is at least its host time. The cost model
(:func:`~.cost.predict`) takes each stage's micro-batch forward and backward as the larger of
the device time and this host time.

Per block and micro-batch, from the same structure the traffic formulas count
(:mod:`.axis_traffic`, the ledger's):

* **collective calls** per axis (:func:`block_calls`): 1D tensor parallelism's row all-reduces
  forward (``tp_overlap`` pieces each) and the column layers' fused dX all-reduce backward; with
  sequence parallelism the norms' all-gathers and the rows' reduce-scatters forward, the
  re-gather, dX reduce-scatter and the rows' output-gradient all-gathers backward, and the norm
  and row-bias gradient all-reduces; replicated k/v projections' gradient all-reduces; 2D, 2.5D
  and 3D: their SUMMA gathers and reduce-scatters per Linear (:func:`tp_block_calls`);
  Ulysses' two all-to-alls each way, ring attention's ``cp - 1`` K/V shifts forward and
  ``2 cp - 1`` backward (one coalesced send/receive each); each MoE layer's split-size exchange,
  dispatch and combine forward, and the reverse pair backward; ZeRO-3's gather of the block's
  parameters forward and backward, and its gradient reduce-scatter (every micro-batch without a
  pipeline); activation checkpointing repeats the forward's calls in the backward;
* **kernels**: ``Calibration.host_block_kernels`` (one serial block's forward and backward,
  measured) plus ``kernels_per_collective`` per call (the collective and the copies around it);
  the serial block's split between forward and backward measured too
  (``host_forward_share``, default a third), the collectives' as the layers issue them;
  checkpointing adds a forward;

at ``host_kernel_s`` per kernel and ``host_call_s`` per collective call (its Python and
bookkeeping beyond its kernels; per tensor-parallel mode, the layouts' own code around them),
which ``benchmarks/calibrate.py`` measures on small models whose kernels take no time. A
pipeline stage also sends and receives its activation and its gradient per micro-batch
(:func:`pipeline_calls`). A calibration without host figures (all zero) predicts no host bound.
Pure; tests/unit/test_planner_host.py; the tensor-parallel counts against a run's collectives in
tests/dist/test_planner_host_calls.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..plan import Plan
from .calibration import Calibration
from .workload import Workload

__all__ = [
    "HostTimes",
    "block_calls",
    "tp_block_calls",
    "cp_block_calls",
    "pipeline_calls",
    "host_call_seconds",
    "host_times",
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
        if not plan.sequence_parallel:
            return 2.0 * k, 2.0 + replicated_kv
        # norms' gathers + rows' reduce-scatters; re-gather + dX reduce-scatter + rows' dY gathers,
        # and the gradients of the norms' vectors and the rows' biases summed over tp
        vectors = 2 * norm_vectors + (2.0 if s.linear_bias else 0.0)
        return 2.0 + 2.0 * k, 4.0 + 2.0 * k + vectors + replicated_kv
    if plan.tp_mode == "3d":
        # 8 per Linear and 5 more per extra over-decomposition piece; each norm combines and sums
        # its statistics and, as each bias, sums its vectors' gradients over the cube's two other axes
        linears = block_linears(s)
        vectors = 2 * norm_vectors + (linears if s.linear_bias else 0)
        total = linears * (8.0 + 5.0 * (k - 1)) + 2 * 2 + 2 * vectors
        return total / 3, 2 * total / 3
    # SUMMA per Linear: gathers of X and W forward; X's re-gather (W's gathered block is kept)
    # and the dX, dW reduce-scatters backward; each norm combines its statistics forward (LayerNorm gathers, RMSNorm sums), and
    # all-reduces its sums and its vectors' gradients backward; each bias's gradient is summed
    # down the grid column
    linears = block_linears(s)
    biases = linears if s.linear_bias else 0
    # 2.5D: every parameter's gradient is also summed over the depth axis
    depth = linears + biases + 2 * norm_vectors if plan.tp_mode == "2.5d" and plan.tp_depth > 1 else 0
    return 2.0 * linears + 2, 3.0 * linears + 4 + biases + depth


def cp_block_calls(plan: Plan) -> tuple[float, float]:
    """Context-parallel calls of one attention layer per micro-batch: ``(forward, backward)``."""
    if plan.cp == 1:
        return 0.0, 0.0
    if plan.cp_mode == "ulysses":
        return 2.0, 2.0
    return float(plan.cp - 1), float(2 * plan.cp - 1)


def block_calls(plan: Plan, w: Workload) -> tuple[float, float]:
    """Every collective call one block issues per micro-batch, over all axes: ``(forward,
    backward)``, the backward including a checkpointed block's recomputed forward."""
    f, b = tp_block_calls(plan, w)
    cf, cb = cp_block_calls(plan)
    f, b = f + cf, b + cb
    if plan.ep > 1 and w.num_experts:
        f, b = f + 3, b + 2  # split sizes, dispatch, combine; the reverse pair
    if plan.zero == 3 and plan.dp * plan.cp > 1:
        f, b = f + 1, b + 1 + (1 if plan.pp == 1 else 0)
    if plan.activation_checkpointing:
        b += f
    return f, b


def pipeline_calls(plan: Plan) -> tuple[float, float]:
    """Point-to-point calls one pipeline rank issues per micro-batch: its chunks' activations
    received and sent forward, their gradients backward."""
    if plan.pp == 1:
        return 0.0, 0.0
    return 2.0 * plan.virtual_stages, 2.0 * plan.virtual_stages


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


def host_call_seconds(cal: Calibration, tp_mode: str) -> float:
    """Host seconds per collective call of a layout whose tensor parallelism is ``tp_mode``:
    the calibration's figure for that mode, else (2.5D, 3D) its 2D one -- the grid layouts share
    their SUMMA machinery -- else its 1D one, else 0."""
    calls = cal.host_call_s
    if tp_mode in calls:
        return calls[tp_mode]
    if tp_mode in ("2.5d", "3d") and "2d" in calls:
        return calls["2d"]
    return calls.get("1d", 0.0)


def host_times(plan: Plan, w: Workload, cal: Calibration) -> HostTimes:
    """Host seconds of one block per micro-batch under ``plan`` on ``cal``'s machine."""
    if not (cal.host_kernel_s or cal.host_call_s):
        return HostTimes(0.0, 0.0)
    f, b = block_calls(plan, w)
    one = host_call_seconds(cal, plan.tp_mode if plan.tp > 1 else "1d")
    kern = cal.host_block_kernels
    share = cal.host_forward_share
    kf = kern * share + cal.kernels_per_collective * f
    kb = kern * (1 - share) + cal.kernels_per_collective * b + (kern * share if plan.activation_checkpointing else 0.0)
    pf, pb = pipeline_calls(plan)
    p2p = (pf + pb) * (cal.host_call_s.get("1d", one) + cal.host_kernel_s)
    return HostTimes(
        forward=kf * cal.host_kernel_s + f * one,
        backward=kb * cal.host_kernel_s + b * one,
        pipeline=p2p,
        kernels=kf + kb,
        calls=f + b,
    )

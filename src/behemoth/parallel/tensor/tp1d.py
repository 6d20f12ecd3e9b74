"""1D (Megatron) tensor parallelism, with Megatron sequence parallelism.

Implements Shoeybi et al., "Megatron-LM" (2019): each transformer block is two pairs of a
column-parallel then a row-parallel Linear (attention: q/k/v then out; MLP: fc/gate/up then
down), heads split over the ``tp`` axis so attention is local, one all-reduce forward
(``g``) and one backward (``f``) per pair; vocabulary-parallel embedding and cross-entropy.
With ``Plan(sequence_parallel=True)``, Korthikanti et al., "Reducing Activation Recomputation
in Large Transformer Models" (2022): activations between blocks are sharded on the sequence,
norms and dropout run on the shard, and ``f``/``g`` become all-gather / reduce-scatter.

Layouts (p = tp degree, r = this rank's tp index; activations are ``[B, S, ...]``, the
sequence is ``SEQ_DIM = 1``):

=======================  ==========================  ========================================
layer                    this rank's weight          input -> output
=======================  ==========================  ========================================
ColumnParallelLinear     output rows, block r of p   X [.., in] (full) -> Y [.., out/p]
  colwise_fused3         q, k and v rows, block r    X [.., in] (full) -> [q|k|v] [.., 3h/p]
RowParallelLinear        input cols, block r of p    X [.., in/p] -> Y [.., out] (full;
                                                     SP: sequence shard [B, S/p, out])
VocabParallelEmbedding   vocab rows, block r of p    ids [B, S] -> [B, S, H] (full)
VocabParallelHead        vocab rows, block r of p    X [B, S, H] -> logits [B, S, V/p]
norms, pos. embedding    replicated                  full (SP, inside the blocks: a norm
                                                     takes [B, S/p, H], returns [B, S, H])
q / k norms (OLMoE's)    the projection's block r    [.., W/p] -> [.., W/p] (statistics of
                                                     the whole width W summed over tp;
                                                     :class:`~.projection_norm.ProjectionNorm`)
q / k norms per head     replicated                  each of this rank's heads (gradient
                         (Qwen3's)                   summed over tp; :mod:`.projection_norm`)
=======================  ==========================  ========================================

Communication per column/row pair (one forward + backward): without SP, ``f`` on the column
input (all-reduce of dX backward), *one* per input tensor however many column layers read it
(q, k and v share it through :class:`ParallelRegion`), and ``g`` on the row output
(all-reduce forward, fused into the row layer: ``RowParallelLinearFn``). With SP, the norm's
output is all-gathered on the sequence forward and dX reduce-scattered backward, and the row
output reduce-scattered (all-gather backward); norm weights and row biases, which then see only
this rank's tokens, go through CopyToAxis so their gradients are summed over tp.

Overlap (Megatron's asynchronous tensor parallelism, :class:`ColumnParallelLinearFn`): ``f``
is fused into the column layers' backward. The last layer of a group launches the
all-reduce (SP: reduce-scatter) of the summed dX asynchronously and computes its weight
gradient while it is in flight; with SP the column layers keep only the input's sequence
shard and re-gather it asynchronously during the dX GEMM (one more all-gather backward,
``(S/p)/S`` of the saved input). Under autocast the column input travels in the autocast
dtype, as Megatron's does. ``g`` forward (``RowParallelLinearFn``) is overlapped only
by splitting the GEMM: with ``Plan.tp_overlap = k`` the row layer computes k batch pieces,
each piece's all-reduce (SP: reduce-scatter) in flight during the next piece's GEMM. The sequence is scattered at the first block's input and gathered at the last
block's output (:mod:`.sequence1d`; a pipeline stage's own blocks), so model code outside the blocks
sees full sequences. The bytes each of
these moves: :mod:`behemoth.planner.tp1d_traffic`.

Grouped-query attention with fewer kv heads K than p (and p % K == 0): each rank keeps the
whole k/v projection (replicated, routed through CopyToAxis) and uses the rows of kv head
``r // (p // K)``, the one its query heads read.

Without autograd (generation), :func:`.base.no_grad_forward` swaps each layer's forward for its
``forward_no_grad``: the same numbers with no autograd Function, no region bookkeeping and
functional collectives (one all-reduce per row layer and for the embedding, one all-gather of
the logits), so a decode step costs about the serial model's Python plus one call per
collective, and ``torch.compile`` traces it into one graph.

Dropout: non-SP replicated regions need the same RNG state on every tp rank (the trainer
seeds by dp rank); parity tests run without dropout.

Modules: this one (Linear layers, sequence-parallel norms), :mod:`.region1d` (``f``, shared
by column layers and overlapped with compute), :mod:`.vocab1d` (vocabulary-parallel embedding
and head), :mod:`.styles1d` (one style per role, and the model-level checks and hooks).

Test: tests/dist/test_tp1d.py (each layer and whole models against serial training).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F

from ... import comm
from ...comm import Axis
from .functional import autocast_dtype, cast_to, replicated_parameters
from .region1d import ParallelRegion, column_parallel_linear, row_parallel_linear

MODE = "1d"
SEQ_DIM = 1


# --------------------------------------------------------------------------- layers
class ColumnParallelLinear(nn.Module):
    """``Y_local = X W_local^T + b_local``: output features split over tp.

    Input: X complete on every tp rank (or a sequence-parallel norm's gathered output);
    output: this rank's output features. Communication: ``f`` on X (identity forward,
    all-reduce of dX backward; sequence parallel: re-gather of X's shard and reduce-scatter
    of dX backward), shared through the region and overlapped with the weight-gradient GEMM
    (:class:`ColumnParallelLinearFn`). Under autocast X, W and b are cast before the call
    (as F.linear would), so ``f`` moves the autocast dtype. ``transposed``: the weight is
    stored ``[in, out]`` (transformers' Conv1D). ``rows``: replicated kv heads -- the weight
    is the whole serial one (its gradient all-reduced over tp) and this rank uses rows
    ``rows[0]:rows[1]`` of its ``[out, in]`` form."""

    def __init__(
        self,
        weight: nn.Parameter,
        bias: nn.Parameter | None,
        *,
        axis: Axis,
        region: ParallelRegion,
        transposed: bool = False,
        expect_gathered: bool = False,
        rows: tuple[int, int] | None = None,
        name: str = "",
    ) -> None:
        super().__init__()
        self.weight = weight
        self.register_parameter("bias", bias)
        self.axis, self.region, self.transposed = axis, region, transposed
        self.expect_gathered, self.rows, self.name = expect_gathered, rows, name

    @torch.compiler.disable  # region bookkeeping and collectives stay eager in compiled blocks
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        group, source, gathered = self.region.enter(x, self.name, self.expect_gathered)
        w, b = self.weight, self.bias
        if self.rows is not None:
            w = comm.CopyToAxis.apply(w, self.axis)
            b = comm.CopyToAxis.apply(b, self.axis) if b is not None else None
        if self.transposed:
            w = w.t()
        if self.rows is not None:
            lo, hi = self.rows
            w, b = w[lo:hi], (b[lo:hi] if b is not None else None)
        dtype = autocast_dtype(x)
        return column_parallel_linear(source, cast_to(w, dtype), cast_to(b, dtype), gathered, group)

    def forward_no_grad(self, x: torch.Tensor) -> torch.Tensor:
        """The forward without autograd (:func:`.base.no_grad_forward`): ``f`` is the identity
        forward, so a plain Linear, with no region bookkeeping; traceable by ``torch.compile``.
        A sequence-parallel input still goes through :meth:`forward` (it checks the gather)."""
        if self.expect_gathered and not self.region.sequence_parallel_paused:
            return type(self).forward(self, x)  # the training forward (``forward`` may be this one)
        w, b = self.weight, self.bias
        if self.transposed:
            w = w.t()
        if self.rows is not None:
            lo, hi = self.rows
            w, b = w[lo:hi], (b[lo:hi] if b is not None else None)
        return F.linear(x, w, b)


class RowParallelLinear(nn.Module):
    """``Y = sum_r X_r W_r^T + b``: input features split over tp.

    Input: this rank's input features; output: complete on every tp rank (``g``:
    all-reduce forward, identity backward), or with sequence parallelism this rank's
    sequence shard (reduce-scatter forward, all-gather backward; the bias then goes through
    CopyToAxis because it sees only this rank's tokens)."""

    def __init__(
        self,
        weight: nn.Parameter,
        bias: nn.Parameter | None,
        *,
        axis: Axis,
        region: ParallelRegion,
        transposed: bool = False,
        sequence_parallel: bool = False,
        pieces: int = 1,
        name: str = "",
    ) -> None:
        super().__init__()
        self.weight = weight
        self.register_parameter("bias", bias)
        self.axis, self.region, self.transposed = axis, region, transposed
        self.sequence_parallel, self.pieces, self.name = sequence_parallel, pieces, name

    @torch.compiler.disable  # region bookkeeping and collectives stay eager in compiled blocks
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.region.clear()
        dtype = autocast_dtype(x)
        w = self.weight.t() if self.transposed else self.weight
        sp = self.sequence_parallel and not self.region.sequence_parallel_paused
        y = row_parallel_linear(cast_to(x, dtype), cast_to(w, dtype), self.axis, sp, self.pieces, self.name)
        b = self.bias
        if b is not None and sp:
            b = comm.CopyToAxis.apply(b, self.axis)
        return y if b is None else y + b.to(y.dtype)

    def forward_no_grad(self, x: torch.Tensor) -> torch.Tensor:
        """The forward without autograd (:func:`.base.no_grad_forward`): the GEMM, then ``g`` as one
        functional all-reduce, traceable by ``torch.compile`` (a compiled decode step keeps it
        inside its graph). Sequence parallelism (not paused) goes through :meth:`forward`."""
        if self.sequence_parallel and not self.region.sequence_parallel_paused:
            return type(self).forward(self, x)  # the training forward (``forward`` may be this one)
        w = self.weight.t() if self.transposed else self.weight
        y = comm.all_reduce_functional(F.linear(x, w), self.axis)
        return y if self.bias is None else y + self.bias.to(y.dtype)


def make_sequence_parallel_norm(module: nn.Module, axis: Axis, region: ParallelRegion) -> nn.Module:
    """Make a norm (any class) run on this rank's sequence shard and hand the column layers
    after it the whole sequence: its parameters go through CopyToAxis (their gradients are
    summed over tp), and its output, cast to the autocast dtype if any, through
    AllGatherToAxis on SEQ_DIM (reduce-scatter backward). The column layers that read the
    gathered output take their gradient path through the shard instead (re-gathered in their
    backward, reduce-scattered once, overlapped; see ColumnParallelLinearFn), so only other
    readers of it reach AllGatherToAxis's backward. The module's own forward does the math,
    so LayerNorm, behemoth's RMSNorm and transformers' LlamaRMSNorm need no copies;
    state-dict keys do not change."""
    inner = module.forward

    def forward(*args, **kwargs):
        if region.sequence_parallel_paused:
            return inner(*args, **kwargs)
        with replicated_parameters(module, axis):  # each Parameter its CopyToAxis view for the call
            y = inner(*args, **kwargs)
        # Cast to the autocast dtype before the gather (the column layers would cast anyway):
        # the gather and the backward reduce-scatter then move half the bytes.
        shard = cast_to(y, autocast_dtype(y))
        y = comm.AllGatherToAxis.apply(shard, axis, SEQ_DIM)
        region.gathered(y, shard)
        # the column layers send their input gradient to the shard, not to y: a module hook that
        # must run before the norm's backward (ZeRO-3's gather of its parameters) hooks it there
        y.grad_source = shard
        return y

    module.forward = forward
    module._behemoth_sequence_parallel = True
    return module


@contextlib.contextmanager
def sequence_parallel_paused(model: nn.Module):
    """For the duration, ``model``'s 1D sequence-parallel layers run as plain 1D ones: no
    scatter at the first block, norms on the whole sequence, row layers all-reduce instead of
    reduce-scattering. Generation decodes one token per step, which cannot be split on the
    sequence; the weights do not change. A no-op for a model without 1D layers."""
    regions = {id(r): r for m in model.modules() if isinstance(r := getattr(m, "region", None), ParallelRegion)}
    before = {k: r.sequence_parallel_paused for k, r in regions.items()}
    for r in regions.values():
        r.sequence_parallel_paused = True
    try:
        yield
    finally:
        for k, r in regions.items():
            r.sequence_parallel_paused = before[k]

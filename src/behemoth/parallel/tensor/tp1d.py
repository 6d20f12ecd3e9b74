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
=======================  ==========================  ========================================

Communication per column/row pair (one forward + backward): without SP, ``f`` on the column
input (all-reduce of dX backward), *one* per input tensor however many column layers read it
(q, k and v share it through :class:`ParallelRegion`), and ``g`` = ReduceFromAxis on the row
output (all-reduce forward). With SP, the norm's output is all-gathered on the sequence
forward and dX reduce-scattered backward, and the row output reduce-scattered
(ReduceScatterToAxis, all-gather backward); norm weights and row biases, which then see only
this rank's tokens, go through CopyToAxis so their gradients are summed over tp.

Overlap (Megatron's asynchronous tensor parallelism, :class:`ColumnParallelLinearFn`): ``f``
is fused into the column layers' backward. The last layer of a group launches the
all-reduce (SP: reduce-scatter) of the summed dX asynchronously and computes its weight
gradient while it is in flight; with SP the column layers keep only the input's sequence
shard and re-gather it asynchronously during the dX GEMM (one more all-gather backward,
``(S/p)/S`` of the saved input). Under autocast the column input travels in the autocast
dtype, as Megatron's does. ``g`` forward is not overlapped (nothing to overlap without
splitting the GEMM). The sequence is scattered at the first block's input and gathered at the last
block's output, so model code outside the blocks sees full sequences. The bytes each of
these moves: :mod:`behemoth.planner.traffic`.

Grouped-query attention with fewer kv heads K than p (and p % K == 0): each rank keeps the
whole k/v projection (replicated, routed through CopyToAxis) and uses the rows of kv head
``r // (p // K)``, the one its query heads read.

Dropout: non-SP replicated regions need the same RNG state on every tp rank (the trainer
seeds by dp rank); parity tests run without dropout.

Test: tests/dist/test_tp1d.py (each layer and whole models against serial training).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ... import comm
from ...comm import Axis
from ...policies import transformer_blocks, transformer_blocks_name
from . import Parallelized, attention_heads, localize_heads
from .layout import DimShard, ShardSpec, check_divisible, get_spec, set_spec, shard_tensor

MODE = "1d"
SEQ_DIM = 1
IGNORE_INDEX = -100


# --------------------------------------------------------------------------- f, shared and overlapped
def autocast_dtype(t: torch.Tensor) -> torch.dtype | None:
    """The dtype autocast would run a Linear in on ``t``'s device, or None when it is off."""
    dev = t.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else None


def _cast(t: torch.Tensor | None, dtype: torch.dtype | None) -> torch.Tensor | None:
    return t.to(dtype) if t is not None and dtype is not None and t.is_floating_point() else t


class ColumnInput:
    """Backward state of the column-parallel layers that read one input tensor in one
    forward (q, k and v; gate and up; or a lone layer): Megatron's ``f``, shared and
    overlapped. Each layer's backward adds its dX partial here; the *last* one to run
    launches the collective on the sum asynchronously (all-reduce, or with sequence
    parallelism reduce-scatter on the sequence) and computes its weight gradient while it
    is in flight. With sequence parallelism the first one to run re-gathers the input's
    sequence shard asynchronously while it computes its dX (the gathered input is not kept
    from forward). Holds no tensor between forward and backward."""

    def __init__(self, axis: Axis, sequence_parallel: bool) -> None:
        self.axis, self.sequence_parallel = axis, sequence_parallel
        self.names: list[str] = []
        self.remaining: int | None = None
        self.grad: torch.Tensor | None = None
        self.gathered: comm.AsyncCollective | None = None

    def begin_backward(self) -> None:
        if self.remaining is None:
            self.remaining = len(self.names)
            # Autograd runs a layer's backward only if its output reaches the loss; a layer
            # that never runs would leave the sum uncommunicated. Say so instead.
            torch.autograd.Variable._execution_engine.queue_callback(self._check_complete)

    def _check_complete(self) -> None:
        if self.remaining is not None:
            left, self.remaining, self.grad, self.gathered = self.remaining, None, None, None
            raise RuntimeError(
                f"tensor parallelism ({MODE}): the column-parallel layers {', '.join(self.names)} read one input, "
                f"but the backward pass reached only {len(self.names) - left} of them (an output the loss does "
                f"not use?), so the input's gradient was never summed over tp. Use every output in the loss, or "
                f"give the unused layer no tensor-parallel role.")


class ParallelRegion:
    """Where activations enter the tensor-parallel region (Megatron's ``f``), shared by all
    the 1D layers of one model: column layers that read the *same* tensor (q, k, v; gate,
    up) share one :class:`ColumnInput`, so backward communicates dX once. A sequence-parallel
    norm registers its gathered output (and the shard it came from) as already inside. Row
    layers and the head close it. Holds tensors only during forward."""

    def __init__(self, axis: Axis) -> None:
        self.axis = axis
        self.clear()

    def enter(self, x: torch.Tensor, name: str, expect_gathered: bool
              ) -> tuple[ColumnInput, torch.Tensor, torch.Tensor | None]:
        """``(group, source, gathered)`` for a column layer reading ``x``: ``source`` is the
        tensor its gradient flows to (``x`` itself, or with sequence parallelism the norm's
        sequence shard), cast once for the group under autocast; ``gathered`` the
        full-sequence input as data (sequence parallelism) or None."""
        if self._x is not x:
            if expect_gathered:
                raise ValueError(
                    f"sequence parallelism: column-parallel {name} got a sequence-sharded input that no norm "
                    f"gathered. Sequence parallelism needs pre-norm blocks (each column-parallel layer reads a "
                    f"norm's output, as in GPT and Llama); use Plan(sequence_parallel=False) for this model.")
            self._x, self._source, self._gathered = x, x, None
            self._group, self._cast = ColumnInput(self.axis, False), {}
        dtype = autocast_dtype(x)
        if dtype not in self._cast:
            self._cast[dtype] = (_cast(self._source, dtype), _cast(self._gathered, dtype))
        self._group.names.append(name or "?")
        return (self._group,) + self._cast[dtype]

    def gathered(self, full: torch.Tensor, shard: torch.Tensor) -> None:
        """``full`` (returned to the model) is ``shard`` all-gathered on the sequence."""
        self._x, self._source, self._gathered = full, shard, full.detach()
        self._group, self._cast = ColumnInput(self.axis, True), {}

    def clear(self) -> None:
        self._x = self._source = self._gathered = self._group = None
        self._cast: dict = {}


class ColumnParallelLinearFn(torch.autograd.Function):
    """``Y = X W^T + b`` for a column-parallel layer, with ``f`` fused in and overlapped
    (Megatron's LinearWithGradAccumulationAndAsyncCommunication, extended to inputs shared
    by several layers through :class:`ColumnInput`).

    Forward: no communication (with sequence parallelism X is the norm's already-gathered
    output, passed as data; only the sequence shard ``source`` is saved). Backward:
    dX = dY W (overlapping the asynchronous re-gather of X under sequence parallelism);
    the group's last layer launches the all-reduce (reduce-scatter) of the summed dX
    asynchronously, computes dW = dY^T X and db while it is in flight, then waits and
    returns the result as the gradient of ``source``; the others return none for it."""

    @staticmethod
    def forward(ctx, source, weight, bias, gathered, group: ColumnInput):
        ctx.group, ctx.has_bias = group, bias is not None
        ctx.save_for_backward(source, weight)
        return F.linear(source if gathered is None else gathered, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        source, weight = ctx.saved_tensors
        g = ctx.group
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        if g.sequence_parallel and need_dw and g.gathered is None:
            g.gathered = comm.all_gather_async(source, g.axis, SEQ_DIM)   # overlaps dX below
        handle = None
        if need_dx:
            g.begin_backward()
            dx = dy.matmul(weight)
            g.grad = dx if g.grad is None else g.grad.add_(dx)
            g.remaining -= 1
            if g.remaining == 0:
                if g.sequence_parallel:
                    handle = comm.reduce_scatter_async(g.grad, g.axis, SEQ_DIM)
                else:
                    handle = comm.all_reduce(g.grad, g.axis, async_op=True)
        dw = db = None
        if need_dw or need_db:
            dy2 = dy.reshape(-1, dy.shape[-1])
            if need_dw:
                x = g.gathered.wait() if g.sequence_parallel else source
                dw = dy2.t().matmul(x.reshape(-1, x.shape[-1]))
            if need_db:
                db = dy2.sum(0)
        dsource = None
        if handle is not None:   # the last layer of the group: collect the communicated dX, reset
            if g.sequence_parallel:
                dsource = handle.wait()
            else:
                handle.wait()    # in place
                dsource = g.grad
            g.remaining, g.grad, g.gathered = None, None, None
        return dsource, dw, db, None, None


def column_parallel_linear(source: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                           gathered: torch.Tensor | None, group: ColumnInput) -> torch.Tensor:
    """Apply :class:`ColumnParallelLinearFn` (eager even inside a compiled block: its
    backward launches and waits on collectives)."""
    return _apply_column(source, weight, bias, gathered, group)


@torch.compiler.disable
def _apply_column(source, weight, bias, gathered, group):
    return ColumnParallelLinearFn.apply(source, weight, bias, gathered, group)


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

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, *, axis: Axis, region: ParallelRegion,
                 transposed: bool = False, expect_gathered: bool = False, rows: tuple[int, int] | None = None,
                 name: str = "") -> None:
        super().__init__()
        self.weight = weight
        self.register_parameter("bias", bias)
        self.axis, self.region, self.transposed = axis, region, transposed
        self.expect_gathered, self.rows, self.name = expect_gathered, rows, name

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
        return column_parallel_linear(source, _cast(w, dtype), _cast(b, dtype), gathered, group)


class RowParallelLinear(nn.Module):
    """``Y = sum_r X_r W_r^T + b``: input features split over tp.

    Input: this rank's input features; output: complete on every tp rank (``g``:
    all-reduce forward, identity backward), or with sequence parallelism this rank's
    sequence shard (reduce-scatter forward, all-gather backward; the bias then goes through
    CopyToAxis because it sees only this rank's tokens)."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, *, axis: Axis, region: ParallelRegion,
                 transposed: bool = False, sequence_parallel: bool = False, name: str = "") -> None:
        super().__init__()
        self.weight = weight
        self.register_parameter("bias", bias)
        self.axis, self.region, self.transposed = axis, region, transposed
        self.sequence_parallel, self.name = sequence_parallel, name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight.t() if self.transposed else self.weight)
        self.region.clear()
        b = self.bias
        if self.sequence_parallel:
            y = comm.ReduceScatterToAxis.apply(y, self.axis, SEQ_DIM)
            b = comm.CopyToAxis.apply(b, self.axis) if b is not None else None
        else:
            y = comm.ReduceFromAxis.apply(y, self.axis)
        return y if b is None else y + b.to(y.dtype)


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the vocabulary split over tp: ids outside this rank's rows
    ``[vocab_start, vocab_start + V/p)`` look up zeros, then ``g`` (all-reduce forward,
    identity backward) sums the ranks' partial embeddings. ids [B, S] -> [B, S, H] complete."""

    def __init__(self, weight: nn.Parameter, *, axis: Axis, vocab_start: int, vocab_size: int,
                 padding_idx: int | None = None) -> None:
        super().__init__()
        self.weight = weight
        self.axis, self.vocab_start = axis, vocab_start
        self.num_embeddings, self.embedding_dim = vocab_size, weight.shape[1]
        local = None if padding_idx is None else padding_idx - vocab_start
        self.local_padding_idx = local if local is not None and 0 <= local < weight.shape[0] else None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.vocab_start
        inside = (local >= 0) & (local < self.weight.shape[0])
        out = F.embedding(local.masked_fill(~inside, 0), self.weight, padding_idx=self.local_padding_idx)
        out = out.masked_fill(~inside.unsqueeze(-1), 0.0)
        return comm.ReduceFromAxis.apply(out, self.axis)


class VocabParallelHead(nn.Module):
    """Output projection with the vocabulary split over tp: X [B, S, H] (complete) ->
    logits [B, S, V/p] for this rank's vocabulary rows; ``f`` on X (all-reduce of dX
    backward). The loss comes from :meth:`vocab_parallel_loss_sum`, so no rank builds the
    full logits; ``gather_output=True`` (set by the engine for a user ``loss_fn``) all-gathers
    them on the vocabulary instead (GatherFromAxis: slice backward)."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, *, axis: Axis, region: ParallelRegion,
                 vocab_start: int, vocab_size: int, name: str = "") -> None:
        super().__init__()
        self.weight = weight
        self.register_parameter("bias", bias)
        self.axis, self.region, self.name = axis, region, name
        self.vocab_start, self.vocab_size = vocab_start, vocab_size
        self.in_features, self.out_features = weight.shape[1], vocab_size
        self.gather_output = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        group, source, _ = self.region.enter(x, self.name, False)
        dtype = autocast_dtype(x)
        logits = column_parallel_linear(source, _cast(self.weight, dtype), _cast(self.bias, dtype), None, group)
        self.region.clear()
        if self.gather_output:
            logits = comm.GatherFromAxis.apply(logits, self.axis, -1)
        return logits

    def vocab_parallel_loss_sum(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Sum of next-token cross-entropy over the labelled positions (fp32), the same on
        every tp rank; ``logits`` are this head's output, ``labels`` the serial ``[B, S]``."""
        if self.gather_output:
            return F.cross_entropy(logits.float().flatten(0, -2), labels.flatten(), ignore_index=IGNORE_INDEX,
                                   reduction="sum")
        return vocab_parallel_cross_entropy(logits.float().flatten(0, -2), labels.flatten(), self.axis,
                                            self.vocab_start).sum()


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy of vocabulary-sharded logits ``[N, V/p]`` (fp32), complete on
    every tp rank. Forward: all-reduce (max) of the row maxima ``[N]``, then one all-reduce
    (sum) of ``[target logit, sum of exp]`` ``[2, N]``. Backward: no communication --
    ``(softmax - one_hot) * grad`` on this rank's vocabulary slice."""

    @staticmethod
    def forward(ctx, logits, target, axis: Axis, vocab_start: int, ignore_index: int):
        row_max = logits.max(dim=-1).values
        comm.all_reduce(row_max, axis, op=torch.distributed.ReduceOp.MAX)
        shifted = logits - row_max.unsqueeze(-1)
        local = target - vocab_start
        hit = (local >= 0) & (local < logits.shape[-1])
        local = local.masked_fill(~hit, 0)
        target_logit = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(~hit, 0.0)
        exp = shifted.exp_()
        sums = torch.stack([target_logit, exp.sum(-1)])
        comm.all_reduce(sums, axis)
        valid = target != ignore_index
        loss = (sums[1].log() - sums[0]).masked_fill(~valid, 0.0)
        softmax = exp.div_(sums[1].unsqueeze(-1))
        ctx.save_for_backward(softmax, local, hit & valid, valid)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local, hit, valid = ctx.saved_tensors
        grad = softmax.clone()
        grad.scatter_add_(-1, local.unsqueeze(-1), -hit.to(grad.dtype).unsqueeze(-1))
        grad.mul_((grad_loss * valid).unsqueeze(-1))
        return grad, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, axis: Axis, vocab_start: int,
                                 ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Per-token losses ``[N]`` (0 where ``target == ignore_index``) of logits ``[N, V/p]``
    holding vocabulary rows ``[vocab_start, vocab_start + V/p)``; see VocabParallelCrossEntropy."""
    return VocabParallelCrossEntropy.apply(logits, target, axis, vocab_start, ignore_index)


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
        saved = {n: p for n, p in module._parameters.items() if p is not None}
        try:  # swap each Parameter for its CopyToAxis view for the duration of the call
            for n, p in saved.items():
                module._parameters[n] = comm.CopyToAxis.apply(p, axis)
            y = inner(*args, **kwargs)
        finally:
            module._parameters.update(saved)
        # Cast to the autocast dtype before the gather (the column layers would cast anyway):
        # the gather and the backward reduce-scatter then move half the bytes.
        shard = _cast(y, autocast_dtype(y))
        y = comm.AllGatherToAxis.apply(shard, axis, SEQ_DIM)
        region.gathered(y, shard)
        return y

    module.forward = forward
    module._behemoth_sequence_parallel = True
    return module


# --------------------------------------------------------------------------- apply
def _check_heads(name: str, n: int, k: int, p: int) -> None:
    check_divisible(f"attention heads (num_heads of {name})", n, p, MODE)
    if k >= p:
        check_divisible(f"key/value heads (num_kv_heads of {name})", k, p, MODE)
    elif p % k:
        raise ValueError(
            f"tensor parallelism ({MODE}): key/value heads (num_kv_heads of {name}) = {k} is smaller than tp = {p} "
            f"and does not divide it; kv heads are replicated only when tp is a multiple of num_kv_heads. "
            f"Use a tp degree that is a multiple or a divisor of {k}.")


def _linear_layout(module: nn.Module, name: str, role: str) -> tuple[bool, int, int]:
    """(transposed, in_features, out_features) of a Linear or transformers Conv1D."""
    if isinstance(module, nn.Linear):
        return False, module.in_features, module.out_features
    if type(module).__name__ == "Conv1D" and getattr(module, "weight", None) is not None:
        return True, module.weight.shape[0], module.weight.shape[1]
    raise ValueError(f"tensor-parallel role {role!r} needs an nn.Linear or a transformers Conv1D; "
                     f"{name} is a {type(module).__name__}.")


def _spec(shape, dim: int, p: int, r: int, view=None, fused_dim: int = 0) -> ShardSpec:
    return ShardSpec(tuple(shape), (DimShard(dim, p, r, ("tp",)),), view_shape=view, fused_dim=fused_dim)


def _replicated(param: nn.Parameter | None) -> None:
    if param is not None and get_spec(param) is None:
        set_spec(param, ShardSpec(tuple(param.shape), (), replicated_on=("tp",)))


def _owner(name: str, attention: dict) -> str | None:
    return next((a for a in attention if name.startswith(a + ".")), None)


def parallelize(model: nn.Module, mesh, plan, roles: dict[str, str]) -> Parallelized:
    """Rewrite ``model`` in place for 1D tensor parallelism over ``mesh.axis('tp')``.

    ``roles`` is ``{module name: role}`` (see :mod:`behemoth.policies`). Every shape is
    checked first, identically on every rank and before any collective; then the serial
    weights are broadcast from tp rank 0 (one model, however each rank was seeded) and
    each role's module is replaced by its parallel layer holding this rank's shards."""
    axis = mesh.axis("tp")
    p, r = axis.size, axis.rank
    sp = plan.sequence_parallel
    modules = dict(model.named_modules())
    blocks_name = transformer_blocks_name(model) if sp else None

    def in_blocks(name: str) -> bool:
        return sp and name.startswith(blocks_name + ".")

    # ---- 1. validate (pure)
    attention = {}
    for name, role in roles.items():
        if role == "attention":
            n, k, d = attention_heads(modules[name], name)
            _check_heads(name, n, k, p)
            attention[name] = (n, k, d)
    jobs = []
    for name, role in roles.items():
        m = modules[name]
        owner = _owner(name, attention)
        width = "attention width" if owner else "ffn hidden"
        if role in ("colwise", "colwise_fused3", "rowwise"):
            transposed, fin, fout = _linear_layout(m, name, role)
            rows = None
            if role == "colwise":
                n, k, d = attention.get(owner, (0, 0, None))
                if owner and k < p and k != n and d is not None and fout == k * d:
                    j = r // (p // k)
                    rows = (j * d, (j + 1) * d)
                else:
                    check_divisible(f"{width} (out features of {name})", fout, p, MODE)
            elif role == "colwise_fused3":
                if fout % 3:
                    raise ValueError(f"tensor parallelism ({MODE}): colwise_fused3 {name} has {fout} output "
                                     f"features, not three equal q/k/v parts.")
                check_divisible(f"hidden (each of q, k, v in {name})", fout // 3, p, MODE)
            else:
                check_divisible(f"{width} (in features of {name})", fin, p, MODE)
            jobs.append((name, role, transposed, fin, fout, rows))
        elif role in ("embedding", "head"):
            if role == "embedding" and not isinstance(m, nn.Embedding):
                raise ValueError(f"tensor-parallel role 'embedding' needs an nn.Embedding; {name} is a "
                                 f"{type(m).__name__}.")
            if role == "embedding" and (m.max_norm is not None or m.sparse):
                raise ValueError(f"vocab-parallel embedding {name}: max_norm and sparse are not supported.")
            if role == "head" and not isinstance(m, nn.Linear):
                raise ValueError(f"tensor-parallel role 'head' needs an nn.Linear; {name} is a {type(m).__name__}.")
            vocab = m.num_embeddings if role == "embedding" else m.out_features
            check_divisible(f"vocab_size (rows of {name})", vocab, p, MODE)
            jobs.append((name, role, False, 0, vocab, None))
        elif role in ("norm", "pos_embedding"):
            jobs.append((name, role, False, 0, 0, None))
    if sp:
        owned = {n for n, role in roles.items() if role != "attention"}
        for pname, _ in model.named_parameters():
            if in_blocks(pname) and pname.rsplit(".", 1)[0] not in owned:
                raise ValueError(
                    f"sequence parallelism: parameter {pname} has no tensor-parallel role; inside the blocks every "
                    f"parameter must belong to a colwise/rowwise/norm module (otherwise its gradient would see "
                    f"only this rank's tokens). Add it to tp_policy or use Plan(sequence_parallel=False).")

    # ---- 2. one model on every tp rank (rank 0's weights)
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            comm.broadcast(t.data, axis, 0)

    # ---- 3. rewrite
    region = ParallelRegion(axis)
    new: dict[int, nn.Parameter] = {}

    def shard(old, spec):
        if old is None:
            return None
        if id(old) in new:
            if get_spec(new[id(old)]) != spec:
                raise ValueError(f"a tied weight is used by two layers with different tensor-parallel layouts "
                                 f"({get_spec(new[id(old)])} and {spec}); untie it or give both the same role.")
            return new[id(old)]
        t = nn.Parameter(shard_tensor(old.detach(), spec), requires_grad=old.requires_grad)
        new[id(old)] = set_spec(t, spec)
        return t

    head = None
    for name, role, transposed, fin, fout, rows in jobs:
        m = modules[name]
        w, b = getattr(m, "weight", None), getattr(m, "bias", None)
        if role in ("colwise", "colwise_fused3"):
            if rows is not None:
                _replicated(w)
                _replicated(b)
            elif role == "colwise":
                w = shard(w, _spec(w.shape, 1 if transposed else 0, p, r))
                b = shard(b, _spec(b.shape, 0, p, r)) if b is not None else None
            else:
                h = fout // 3
                view = (fin, 3, h) if transposed else (3, h, fin)
                w = shard(w, _spec(w.shape, 2 if transposed else 1, p, r, view, 1 if transposed else 0))
                b = shard(b, _spec(b.shape, 1, p, r, (3, h), 0)) if b is not None else None
            new_m = ColumnParallelLinear(w, b, axis=axis, region=region, transposed=transposed,
                                         expect_gathered=in_blocks(name), rows=rows, name=name)
        elif role == "rowwise":
            w = shard(w, _spec(w.shape, 0 if transposed else 1, p, r))
            _replicated(b)
            new_m = RowParallelLinear(w, b, axis=axis, region=region, transposed=transposed,
                                      sequence_parallel=in_blocks(name), name=name)
        elif role == "embedding":
            w = shard(w, _spec(w.shape, 0, p, r))
            new_m = VocabParallelEmbedding(w, axis=axis, vocab_start=r * (fout // p), vocab_size=fout,
                                           padding_idx=m.padding_idx)
        elif role == "head":
            w = shard(w, _spec(w.shape, 0, p, r))
            b = shard(b, _spec(b.shape, 0, p, r)) if b is not None else None
            new_m = head = VocabParallelHead(w, b, axis=axis, region=region, vocab_start=r * (fout // p),
                                             vocab_size=fout, name=name)
        else:  # norm, pos_embedding: replicated; a norm inside sequence-parallel blocks runs on the shard
            for prm in m.parameters(recurse=False):
                _replicated(prm)
            if role == "norm" and in_blocks(name):
                make_sequence_parallel_norm(m, axis, region)
            continue
        new_m.train(m.training)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, new_m)
    for name, (n, k, d) in attention.items():
        localize_heads(modules[name], n, k, d, p)
    for pname, prm in model.named_parameters(remove_duplicate=False):
        if id(prm) in new:
            raise ValueError(f"{pname} still holds the serial weight that another layer sharded (a tied weight "
                             f"whose other user has no tensor-parallel role); give it a role in tp_policy.")
    _install_hooks(model, axis, region, sp)
    return Parallelized(replaced=new, head=head)


def _install_hooks(model: nn.Module, axis: Axis, region: ParallelRegion, sp: bool) -> None:
    """Model entry: reset the region and (SP) check the sequence length before the first
    collective. SP: scatter the sequence at the first block's input (ScatterToAxis:
    all-gather backward), gather it at the last block's output (GatherFromAxis: slice
    backward)."""
    p = axis.size

    def begin(module, args, kwargs):
        region.clear()
        if sp:
            ids = kwargs.get("input_ids", args[0] if args else None)
            if isinstance(ids, torch.Tensor) and ids.dim() >= 2:
                check_divisible("sequence length (dim 1 of the input)", ids.shape[SEQ_DIM], p,
                                f"{MODE} with sequence_parallel")
        return None

    model.register_forward_pre_hook(begin, with_kwargs=True)
    if not sp:
        return
    blocks = transformer_blocks(model)

    def scatter(module, args, kwargs):
        if args:
            return (comm.ScatterToAxis.apply(args[0], axis, SEQ_DIM),) + tuple(args[1:]), kwargs
        kwargs = dict(kwargs, hidden_states=comm.ScatterToAxis.apply(kwargs["hidden_states"], axis, SEQ_DIM))
        return args, kwargs

    def gather(module, args, output):
        if isinstance(output, torch.Tensor):
            return comm.GatherFromAxis.apply(output, axis, SEQ_DIM)
        return (comm.GatherFromAxis.apply(output[0], axis, SEQ_DIM),) + tuple(output[1:])

    blocks[0].register_forward_pre_hook(scatter, with_kwargs=True)
    blocks[-1].register_forward_hook(gather)

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
block's output, so model code outside the blocks sees full sequences. The bytes each of
these moves: :mod:`behemoth.planner.traffic`.

Grouped-query attention with fewer kv heads K than p (and p % K == 0): each rank keeps the
whole k/v projection (replicated, routed through CopyToAxis) and uses the rows of kv head
``r // (p // K)``, the one its query heads read.

Dropout: non-SP replicated regions need the same RNG state on every tp rank (the trainer
seeds by dp rank); parity tests run without dropout.

Modules: this one (Linear layers, sequence-parallel norms, ``parallelize``), :mod:`.region1d`
(``f``, shared by column layers and overlapped with compute), :mod:`.vocab1d`
(vocabulary-parallel embedding, head and cross-entropy).

Test: tests/dist/test_tp1d.py (each layer and whole models against serial training).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ... import comm
from ...comm import Axis
from ...specs import transformer_blocks, transformer_blocks_name
from . import Parallelized, attention_heads, localize_heads
from .layout import DimShard, ShardSpec, check_divisible, get_spec, set_spec, shard_tensor
from .region1d import ParallelRegion, autocast_dtype, cast_to, column_parallel_linear, row_parallel_linear
from .vocab1d import VocabParallelEmbedding, VocabParallelHead

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
        y = row_parallel_linear(
            cast_to(x, dtype), cast_to(w, dtype), self.axis, self.sequence_parallel, self.pieces, self.name
        )
        b = self.bias
        if b is not None and self.sequence_parallel:
            b = comm.CopyToAxis.apply(b, self.axis)
        return y if b is None else y + b.to(y.dtype)


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
        shard = cast_to(y, autocast_dtype(y))
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
            f"Use a tp degree that is a multiple or a divisor of {k}."
        )


def _linear_layout(module: nn.Module, name: str, role: str) -> tuple[bool, int, int]:
    """(transposed, in_features, out_features) of a Linear or transformers Conv1D."""
    if isinstance(module, nn.Linear):
        return False, module.in_features, module.out_features
    if type(module).__name__ == "Conv1D" and getattr(module, "weight", None) is not None:
        return True, module.weight.shape[0], module.weight.shape[1]
    raise ValueError(
        f"tensor-parallel role {role!r} needs an nn.Linear or a transformers Conv1D; "
        f"{name} is a {type(module).__name__}."
    )


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
                    raise ValueError(
                        f"tensor parallelism ({MODE}): colwise_fused3 {name} has {fout} output "
                        f"features, not three equal q/k/v parts."
                    )
                check_divisible(f"hidden (each of q, k, v in {name})", fout // 3, p, MODE)
            else:
                check_divisible(f"{width} (in features of {name})", fin, p, MODE)
            jobs.append((name, role, transposed, fin, fout, rows))
        elif role in ("embedding", "head"):
            if role == "embedding" and not isinstance(m, nn.Embedding):
                raise ValueError(
                    f"tensor-parallel role 'embedding' needs an nn.Embedding; {name} is a {type(m).__name__}."
                )
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
                    f"only this rank's tokens). Add it to tp_policy or use Plan(sequence_parallel=False)."
                )

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
                raise ValueError(
                    f"a tied weight is used by two layers with different tensor-parallel layouts "
                    f"({get_spec(new[id(old)])} and {spec}); untie it or give both the same role."
                )
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
            new_m = ColumnParallelLinear(
                w,
                b,
                axis=axis,
                region=region,
                transposed=transposed,
                expect_gathered=in_blocks(name),
                rows=rows,
                name=name,
            )
        elif role == "rowwise":
            w = shard(w, _spec(w.shape, 0 if transposed else 1, p, r))
            _replicated(b)
            new_m = RowParallelLinear(
                w,
                b,
                axis=axis,
                region=region,
                transposed=transposed,
                sequence_parallel=in_blocks(name),
                pieces=plan.tp_overlap,
                name=name,
            )
        elif role == "embedding":
            w = shard(w, _spec(w.shape, 0, p, r))
            new_m = VocabParallelEmbedding(
                w, axis=axis, vocab_start=r * (fout // p), vocab_size=fout, padding_idx=m.padding_idx
            )
        elif role == "head":
            w = shard(w, _spec(w.shape, 0, p, r))
            b = shard(b, _spec(b.shape, 0, p, r)) if b is not None else None
            new_m = head = VocabParallelHead(
                w, b, axis=axis, region=region, vocab_start=r * (fout // p), vocab_size=fout, name=name
            )
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
            raise ValueError(
                f"{pname} still holds the serial weight that another layer sharded (a tied weight "
                f"whose other user has no tensor-parallel role); give it a role in tp_policy."
            )
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
                check_divisible(
                    "sequence length (dim 1 of the input)", ids.shape[SEQ_DIM], p, f"{MODE} with sequence_parallel"
                )
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

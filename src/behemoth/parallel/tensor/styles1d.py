"""1D (Megatron) tensor parallelism as styles: one class per role, the layers of
:mod:`.tp1d` and :mod:`.vocab1d` built from a serial module, and the model-level checks
(:func:`prepare`) and hooks (:func:`finish`) around them.

=====================================  ==================  =================================
style                                  role                replaces the module by
=====================================  ==================  =================================
:class:`ColwiseParallel1D`             ``colwise``         ColumnParallelLinear (out split)
:class:`FusedQKVParallel1D`            ``colwise_fused3``  ColumnParallelLinear (q, k, v)
:class:`RowwiseParallel1D`             ``rowwise``         RowParallelLinear (in split)
:class:`NormParallel1D`                ``norm``            itself (SP: on the shard)
:class:`ColwiseNormParallel1D`         ``colwise_norm``    ProjectionNorm (features split)
:class:`HeadNormParallel1D`            ``head_norm``       itself (gradient summed over tp)
:class:`EmbeddingParallel1D`           ``embedding``       VocabParallelEmbedding
:class:`PositionEmbeddingParallel1D`   ``pos_embedding``   itself, replicated
:class:`HeadParallel1D`                ``head``            VocabParallelHead
:class:`AttentionParallel1D`           ``attention``       itself, with local head counts
=====================================  ==================  =================================

The column layers, the row layers, the head and the sequence-parallel norms of one model share
one :class:`~.region1d.ParallelRegion` (``region``), which :func:`prepare` creates. Layout
arguments left ``None`` come from the plan: ``Plan.sequence_parallel`` for the modules inside
the transformer blocks, ``Plan.tp_overlap`` for the row layers' pieces.

Test: tests/dist/test_tp1d.py (each layer and whole models against serial training).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn as nn

from ...comm import Axis
from ...specs import transformer_blocks, transformer_blocks_name
from .base import TensorStyle, check_fused3, check_kind, check_norm, owner_of
from .layout import DimShard, ShardSpec, check_divisible, get_spec, set_spec, shard_tensor
from .projection_norm import ProjectionNorm, make_head_norm
from .region1d import ParallelRegion
from .sequence1d import SequenceShards
from .serial import attention_heads, linear_shape, localize_heads, norm_eps
from .tp1d import MODE, SEQ_DIM, ColumnParallelLinear, RowParallelLinear, make_sequence_parallel_norm
from .vocab1d import VocabParallelEmbedding, VocabParallelHead


def _spec(shape, dim: int, p: int, r: int, view=None, fused_dim: int = 0) -> ShardSpec:
    return ShardSpec(tuple(shape), (DimShard(dim, p, r, ("tp",)),), view_shape=view, fused_dim=fused_dim)


def _shard(old: nn.Parameter | None, spec: ShardSpec) -> nn.Parameter | None:
    """A new Parameter holding this rank's shard of ``old`` under ``spec``."""
    if old is None:
        return None
    return set_spec(nn.Parameter(shard_tensor(old.detach(), spec), requires_grad=old.requires_grad), spec)


def _replicated(param: nn.Parameter | None) -> nn.Parameter | None:
    """Mark a parameter that every tp rank holds whole (it stays the same Parameter)."""
    if param is not None and get_spec(param) is None:
        set_spec(param, ShardSpec(tuple(param.shape), (), replicated_on=("tp",)))
    return param


def _output_features(w, b, axis, replicated_kv, dim: int = 0):
    """``(w, b, rows)``: this tp rank's share of a colwise output's parameters -- with
    ``replicated_kv=(K, D)`` (K kv heads of width D, fewer than tp) both whole, and ``rows`` the
    rows of the kv head the rank uses (``r // (p // K)``); else the rank's block of the weight's
    ``dim`` and of the bias, and ``rows`` None."""
    p, r = axis.size, axis.rank
    if replicated_kv is not None:
        k, d = replicated_kv
        j = r // (p // k)
        return _replicated(w), _replicated(b), (j * d, (j + 1) * d)
    w = _shard(w, _spec(w.shape, dim, p, r)) if w is not None else None
    b = _shard(b, _spec(b.shape, 0, p, r)) if b is not None else None
    return w, b, None


# --------------------------------------------------------------------------- styles
@dataclass(frozen=True, kw_only=True)
class ColwiseParallel1D(TensorStyle):
    """``nn.Linear`` / ``Conv1D`` -> :class:`~.tp1d.ColumnParallelLinear`: output features
    split over tp (block r of p). ``replicated_kv=(K, D)``: a k or v projection of an attention
    with K < p kv heads of width D -- every rank keeps the whole weight (gradient all-reduced
    over tp) and uses the rows of kv head ``r // (p // K)``. ``gathered_input``: the input is a
    sequence-parallel norm's gathered output (``None``: inside the blocks under
    ``Plan.sequence_parallel``)."""

    role = "colwise"
    mode = MODE
    replicated_kv: tuple[int, int] | None = None
    gathered_input: bool | None = None
    region: ParallelRegion | None = None
    name: str = ""

    def apply(self, module: nn.Module, mesh) -> nn.Module:
        axis = mesh.axis("tp")
        _, _, transposed = linear_shape(module, self.name, self.role)
        w, b, rows = _output_features(module.weight, module.bias, axis, self.replicated_kv, 1 if transposed else 0)
        return ColumnParallelLinear(
            w,
            b,
            axis=axis,
            region=self.region,
            transposed=transposed,
            expect_gathered=bool(self.gathered_input),
            rows=rows,
            name=self.name,
        )


@dataclass(frozen=True, kw_only=True)
class FusedQKVParallel1D(TensorStyle):
    """A fused ``[q; k; v]`` ``nn.Linear`` / ``Conv1D`` -> :class:`~.tp1d.ColumnParallelLinear`
    holding block r of each of q, k and v (the weight viewed as ``[3, h, in]``)."""

    role = "colwise_fused3"
    mode = MODE
    gathered_input: bool | None = None
    region: ParallelRegion | None = None
    name: str = ""

    def apply(self, module: nn.Module, mesh) -> nn.Module:
        axis = mesh.axis("tp")
        p, r = axis.size, axis.rank
        fin, fout, transposed = linear_shape(module, self.name, self.role)
        w, b, h = module.weight, module.bias, fout // 3
        view = (fin, 3, h) if transposed else (3, h, fin)
        w = _shard(w, _spec(w.shape, 2 if transposed else 1, p, r, view, 1 if transposed else 0))
        b = _shard(b, _spec(b.shape, 1, p, r, (3, h), 0)) if b is not None else None
        return ColumnParallelLinear(
            w,
            b,
            axis=axis,
            region=self.region,
            transposed=transposed,
            expect_gathered=bool(self.gathered_input),
            name=self.name,
        )


@dataclass(frozen=True, kw_only=True)
class RowwiseParallel1D(TensorStyle):
    """``nn.Linear`` / ``Conv1D`` -> :class:`~.tp1d.RowParallelLinear`: input features split
    over tp, output all-reduced (``sequence_parallel``: reduce-scattered on the sequence);
    ``pieces`` batch pieces overlap the collective with the GEMM (``None``: ``Plan.tp_overlap``)."""

    role = "rowwise"
    mode = MODE
    sequence_parallel: bool | None = None
    pieces: int | None = None
    region: ParallelRegion | None = None
    name: str = ""

    def apply(self, module: nn.Module, mesh) -> nn.Module:
        axis = mesh.axis("tp")
        p, r = axis.size, axis.rank
        _, _, transposed = linear_shape(module, self.name, self.role)
        w = _shard(module.weight, _spec(module.weight.shape, 0 if transposed else 1, p, r))
        return RowParallelLinear(
            w,
            _replicated(module.bias),
            axis=axis,
            region=self.region,
            transposed=transposed,
            sequence_parallel=bool(self.sequence_parallel),
            pieces=self.pieces or mesh.plan.tp_overlap,
            name=self.name,
        )


@dataclass(frozen=True, kw_only=True)
class NormParallel1D(TensorStyle):
    """A norm (any class) stays itself with replicated parameters; with ``sequence_parallel``
    it runs on this rank's sequence shard (:func:`~.tp1d.make_sequence_parallel_norm`)."""

    role = "norm"
    mode = MODE
    sequence_parallel: bool | None = None
    region: ParallelRegion | None = None

    def apply(self, module: nn.Module, mesh) -> nn.Module:
        for prm in module.parameters(recurse=False):
            _replicated(prm)
        if self.sequence_parallel:
            make_sequence_parallel_norm(module, mesh.axis("tp"), self.region)
        return module


@dataclass(frozen=True, kw_only=True)
class ColwiseNormParallel1D(TensorStyle):
    """A norm over the whole output of a ``colwise`` projection (an RMS norm or a LayerNorm over
    its last dim: OLMoE's ``q_norm`` / ``k_norm``) -> :class:`~.projection_norm.ProjectionNorm`: its
    weight (and bias) split as the projection's output features (block r of p), the statistics
    of the whole width summed over tp. ``replicated_kv=(K, D)``: the norm of a k projection with
    K < p kv heads of width D (replicated, as :class:`ColwiseParallel1D` keeps it) -- every rank
    keeps the whole weight and normalises the features of kv head ``r // (p // K)``."""

    role = "colwise_norm"
    mode = MODE
    replicated_kv: tuple[int, int] | None = None
    name: str = ""

    def apply(self, module: nn.Module, mesh) -> nn.Module:
        axis = mesh.axis("tp")
        w, b, rows = _output_features(module.weight, getattr(module, "bias", None), axis, self.replicated_kv)
        eps, rms = norm_eps(module), not isinstance(module, nn.LayerNorm)
        summed = (axis,) if rows is not None else ()  # a replicated kv head's norm: gradients summed over tp
        return ProjectionNorm(w, b, axis=axis, eps=eps, rms=rms, param_axes=summed, rows=rows, name=self.name)


@dataclass(frozen=True, kw_only=True)
class HeadNormParallel1D(TensorStyle):
    """A norm applied to each head of a ``colwise`` projection's output (a weight of one head's
    width: Qwen3's ``q_norm`` / ``k_norm``) stays itself with replicated parameters; each rank
    normalises only its own heads, so the parameters' gradients are summed over tp
    (:func:`~.projection_norm.make_head_norm`). It reads the projection's output, whole on the sequence, so
    sequence parallelism changes nothing for it."""

    role = "head_norm"
    mode = MODE

    def apply(self, module: nn.Module, mesh) -> nn.Module:
        for prm in module.parameters(recurse=False):
            _replicated(prm)
        return make_head_norm(module, mesh.axis("tp"))


@dataclass(frozen=True, kw_only=True)
class EmbeddingParallel1D(TensorStyle):
    """``nn.Embedding`` -> :class:`~.vocab1d.VocabParallelEmbedding`: vocabulary rows split
    over tp, partial lookups all-reduced."""

    role = "embedding"
    mode = MODE

    def apply(self, module: nn.Module, mesh) -> nn.Module:
        axis = mesh.axis("tp")
        p, r, vocab = axis.size, axis.rank, module.num_embeddings
        w = _shard(module.weight, _spec(module.weight.shape, 0, p, r))
        return VocabParallelEmbedding(
            w, axis=axis, vocab_start=r * (vocab // p), vocab_size=vocab, padding_idx=module.padding_idx
        )


@dataclass(frozen=True, kw_only=True)
class PositionEmbeddingParallel1D(TensorStyle):
    """A learned position table stays itself, replicated on every tp rank."""

    role = "pos_embedding"
    mode = MODE

    def apply(self, module: nn.Module, mesh) -> nn.Module:
        for prm in module.parameters(recurse=False):
            _replicated(prm)
        return module


@dataclass(frozen=True, kw_only=True)
class HeadParallel1D(TensorStyle):
    """``nn.Linear`` to the vocabulary -> :class:`~.vocab1d.VocabParallelHead`: vocabulary
    rows split over tp; the loss goes through its vocabulary-parallel cross-entropy."""

    role = "head"
    mode = MODE
    region: ParallelRegion | None = None
    name: str = ""

    def apply(self, module: nn.Module, mesh) -> nn.Module:
        axis = mesh.axis("tp")
        p, r, vocab = axis.size, axis.rank, module.out_features
        w = _shard(module.weight, _spec(module.weight.shape, 0, p, r))
        b = _shard(module.bias, _spec(module.bias.shape, 0, p, r)) if module.bias is not None else None
        return VocabParallelHead(
            w, b, axis=axis, region=self.region, vocab_start=r * (vocab // p), vocab_size=vocab, name=self.name
        )


@dataclass(frozen=True, kw_only=True)
class AttentionParallel1D(TensorStyle):
    """An attention module keeps its code and gets this rank's head counts: ``heads = (N, K,
    D)`` are its serial counts (``None``: read from the module), split over tp (fewer kv heads
    than tp: one replicated kv head)."""

    role = "attention"
    mode = MODE
    heads: tuple[int, int, int | None] | None = None

    def apply(self, module: nn.Module, mesh) -> nn.Module:
        n, k, d = self.heads or attention_heads(module, type(module).__name__)
        localize_heads(module, n, k, d, mesh.axis("tp").size)
        return module


STYLES: dict[str, type[TensorStyle]] = {
    s.role: s
    for s in (
        ColwiseParallel1D,
        FusedQKVParallel1D,
        RowwiseParallel1D,
        NormParallel1D,
        ColwiseNormParallel1D,
        HeadNormParallel1D,
        EmbeddingParallel1D,
        PositionEmbeddingParallel1D,
        HeadParallel1D,
        AttentionParallel1D,
    )
}
"""Role -> 1D style class."""


# --------------------------------------------------------------------------- model level
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


def _fill(style: TensorStyle, **derived) -> TensorStyle:
    """``style`` with every field that is still ``None`` (or empty) set from ``derived``."""
    fields = {f.name for f in dataclasses.fields(style)}
    return dataclasses.replace(
        style, **{k: v for k, v in derived.items() if k in fields and getattr(style, k) in (None, "")}
    )


def prepare(model: nn.Module, styles: dict[str, TensorStyle], mesh) -> dict[str, TensorStyle]:
    """Check every module of ``styles`` (``{module name: 1D style}``) against the tp degree,
    pure and identical on every rank, and return the styles with their model-derived layout
    filled in (one shared region, sequence parallelism inside the blocks, replicated kv
    heads, the serial head counts)."""
    axis = mesh.axis("tp")
    p = axis.size
    sp = mesh.plan.sequence_parallel
    modules = dict(model.named_modules())
    blocks_name = transformer_blocks_name(model) if sp else None

    def in_blocks(name: str) -> bool:
        return sp and name.startswith(blocks_name + ".")

    attention = {}
    for name, style in styles.items():
        if style.role == "attention":
            n, k, d = attention_heads(modules[name], name)
            _check_heads(name, n, k, p)
            attention[name] = (n, k, d)
    region = ParallelRegion(axis)
    out = {}
    for name, style in styles.items():
        m, role = modules[name], style.role
        owner = owner_of(name, attention)
        width = "attention width" if owner else "ffn hidden"
        kv = None
        if role in ("colwise", "colwise_fused3", "rowwise"):
            fin, fout, _ = linear_shape(m, name, role)
            if role == "colwise":
                n, k, d = attention.get(owner, (0, 0, None))
                if owner and k < p and k != n and d is not None and fout == k * d:
                    kv = (k, d)
                else:
                    check_divisible(f"{width} (out features of {name})", fout, p, MODE)
            elif role == "colwise_fused3":
                check_fused3(name, fout, MODE)
                check_divisible(f"hidden (each of q, k, v in {name})", fout // 3, p, MODE)
            else:
                check_divisible(f"{width} (in features of {name})", fin, p, MODE)
        elif role == "colwise_norm":
            width = check_norm(m, name, MODE)
            n, k, d = attention.get(owner, (0, 0, None))
            if owner and k < p and k != n and d is not None and width == k * d:
                kv = (k, d)
            else:
                check_divisible(f"normalised width (features of {name})", width, p, MODE)
        elif role in ("embedding", "head"):
            check_kind(m, name, role)
            vocab = m.num_embeddings if role == "embedding" else m.out_features
            check_divisible(f"vocab_size (rows of {name})", vocab, p, MODE)
        out[name] = _fill(
            style,
            replicated_kv=kv,
            gathered_input=in_blocks(name),
            sequence_parallel=in_blocks(name),
            pieces=mesh.plan.tp_overlap,
            region=region,
            name=name,
            heads=attention.get(name),
        )
    if sp:
        owned = {n for n, s in styles.items() if s.role != "attention"}
        # a module marked _behemoth_sequence_parallel takes the gathered sequence and returns this rank's
        # shard itself, its gradients whole (an MoE block under the expert style)
        handled = tuple(n + "." for n, m in model.named_modules() if getattr(m, "_behemoth_sequence_parallel", False))
        for pname, _ in model.named_parameters():
            if handled and pname.startswith(handled):
                continue
            if in_blocks(pname) and pname.rsplit(".", 1)[0] not in owned:
                raise ValueError(
                    f"sequence parallelism: parameter {pname} has no tensor-parallel role; inside the blocks every "
                    f"parameter must belong to a colwise/rowwise/norm module (otherwise its gradient would see "
                    f"only this rank's tokens). Add it to tp_policy or use Plan(sequence_parallel=False)."
                )
    return out


def finish(model: nn.Module, mesh, styles: dict[str, TensorStyle], replaced: dict[int, nn.Parameter]) -> tuple:
    """After the styles ran: refuse a serial weight left beside its shards (a tied weight whose
    other user has no role), and install the model's hooks: reset the region at every forward
    and (sequence parallel) check the sequence length, scatter the sequence at the first
    block's input (ScatterToAxis: all-gather backward) and gather it at the last block's output
    (GatherFromAxis: slice backward). 1D splits no batch: returns no batch axes."""
    for pname, prm in model.named_parameters(remove_duplicate=False):
        if id(prm) in replaced and replaced[id(prm)] is not prm:
            raise ValueError(
                f"{pname} still holds the serial weight that another layer sharded (a tied weight "
                f"whose other user has no tensor-parallel role); give it a role in tp_policy."
            )
    axis, sp = mesh.axis("tp"), mesh.plan.sequence_parallel
    regions = {id(s.region): s.region for s in styles.values() if getattr(s, "region", None) is not None}
    _install_hooks(model, axis, list(regions.values()), sp)
    return ()


def _install_hooks(model: nn.Module, axis: Axis, regions: list[ParallelRegion], sp: bool) -> None:
    p = axis.size

    def begin(module, args, kwargs):
        for region in regions:
            region.clear()
        if sp and not regions[0].sequence_parallel_paused:
            ids = kwargs.get("input_ids", args[0] if args else None)
            if isinstance(ids, torch.Tensor) and ids.dim() >= 2:
                check_divisible(
                    "sequence length (dim 1 of the input)", ids.shape[SEQ_DIM], p, f"{MODE} with sequence_parallel"
                )
        return None

    model.register_forward_pre_hook(begin, with_kwargs=True)
    if sp:  # (a pipeline stage re-hooks its own chunks' blocks: parallel/pipeline/stage.py)
        SequenceShards(axis, regions).install(model, transformer_blocks(model))

"""2D (Optimus) and 2.5D (Tesseract) tensor parallelism as styles: one class per role and
mode (``ColwiseParallel2D`` / ``ColwiseParallel25D``, ...), each building the SUMMA layers of
:mod:`.tp2d` / :mod:`.embed2d` (2D) or :mod:`.tp2p5d` (2.5D) from a serial module, and the
model-level checks (:func:`prepare`) and batch axes (:func:`finish`) around them.

What the rewritten model computes on rank (depth, i, j) of the (d x) q x q grid:

* **Inputs.** The engine gives the model this rank's batch block ``[b, S]`` of every batch
  tensor, ``b = B / (d q)``, block ``depth*q + i`` (``Parallelized.batch_axes`` names the
  axes). So everything the model's own code derives from its inputs -- causal masks,
  position ids, RoPE tables, ``view(batch, ...)`` -- sees the local batch, and needs no
  change. The token embedding all-gathers the ids over ``tp_row`` (int64: ``2q/h`` of the
  bytes its fp32 lookup then reduce-scatters) and looks up its vocab x hidden block.
* **Activations** between layers are ``[b, S, h/q]`` (hidden block j); every Linear role
  (``colwise``, ``rowwise``: in 2D both are the same SUMMA Linear; ``colwise_fused3``: q, k
  and v rows of heads block j) keeps that layout, so layers chain with no redistribution.
* **Attention** is local: heads are split by q with the hidden dim, and each attention
  module's head counts become n/q and K/q (:func:`..localize_heads`). Grouped-query
  attention with q | K: local query heads block j reads exactly kv heads block j. With
  fewer kv heads than q and K | q, the k and v projections become
  :class:`KVReplicatedLinear2D` (grid column j computes the one kv head ``j // (q/K)`` its
  query heads read); any other K is refused.
* **Norms** all-reduce statistics over ``tp_col``; LayerNorm and RMS-style norms
  (behemoth's, ``nn.RMSNorm``, transformers' ``LlamaRMSNorm``) are recognised.
* **Head and loss.** The vocab-parallel head's logits are ``[b, S, V/q]``; its loss sums
  over this rank's labels block and the engine sums over dp and the batch axes. A tied
  head shares the embedding's Parameter (both have the ``[V, H]`` SUMMA layout).

Every parameter must belong to a module with a role: a serial parameter left in the model
would see a hidden block of a batch block and silently train wrong. Every shape is checked
first, identically on every rank and before any collective.

Tested in tests/dist/test_tp2d.py (whole models against serial training).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from torch import nn

from .base import (
    GridHeadNormStyle,
    TensorStyle,
    check_enters_and_leaves,
    check_every_parameter_owned,
    check_fused3,
    check_kind,
    check_norm,
    owner_of,
    replicated_over_tp,
)
from .deferred_grads import install_deferred_grads
from .embed2d import Embedding2D, PositionEmbedding2D, VocabParallelHead2D
from .grid import grid_of
from .layout import check_divisible
from .projection_norm import ProjectionNorm
from .serial import attention_heads, linear_shape, localize_heads, norm_eps
from .tp2d import KVReplicatedLinear2D, LayerNorm2D, Linear2D, Norm2D, RMSNorm2D
from .tp2p5d import Embedding25D, LayerNorm25D, Linear25D, PositionEmbedding25D, RMSNorm25D, VocabParallelHead25D

_LINEAR_ROLES = ("colwise", "rowwise", "colwise_fused3")


# --------------------------------------------------------------------------- 2D styles
@dataclass(frozen=True, kw_only=True)
class ColwiseParallel2D(TensorStyle):
    """``nn.Linear`` / ``Conv1D`` -> a SUMMA Linear (``[b, s, in/q] -> [b, s, out/q]``).
    ``replicated_kv=(K, D)``: a k or v projection with K < q kv heads of width D ->
    :class:`~.tp2d.KVReplicatedLinear2D` (grid column j computes kv head ``j // (q/K)``)."""

    role = "colwise"
    mode = "2d"
    linear: ClassVar[type] = Linear2D
    replicated_kv: tuple[int, int] | None = None

    def apply(self, module: nn.Module, mesh) -> nn.Module:
        if self.replicated_kv is not None:
            return KVReplicatedLinear2D(module, mesh, self.mode, *self.replicated_kv)
        return self.linear.from_serial(module, mesh)


@dataclass(frozen=True, kw_only=True)
class FusedQKVParallel2D(TensorStyle):
    """A fused ``[q; k; v]`` ``nn.Linear`` / ``Conv1D`` -> a SUMMA Linear whose out block j holds
    the q, k and v rows of heads block j."""

    role = "colwise_fused3"
    mode = "2d"
    linear: ClassVar[type] = Linear2D

    def apply(self, module: nn.Module, mesh) -> nn.Module:
        return self.linear.from_serial(module, mesh, fused=3)


@dataclass(frozen=True, kw_only=True)
class RowwiseParallel2D(TensorStyle):
    """``nn.Linear`` / ``Conv1D`` -> a SUMMA Linear (on the grid, a row layer is the same layer)."""

    role = "rowwise"
    mode = "2d"
    linear: ClassVar[type] = Linear2D

    def apply(self, module: nn.Module, mesh) -> nn.Module:
        return self.linear.from_serial(module, mesh)


@dataclass(frozen=True, kw_only=True)
class NormParallel2D(TensorStyle):
    """``nn.LayerNorm`` or an RMS norm -> the grid norm (statistics over ``tp_col``)."""

    role = "norm"
    mode = "2d"
    layer_norm: ClassVar[type] = LayerNorm2D
    rms_norm: ClassVar[type] = RMSNorm2D

    def apply(self, module: nn.Module, mesh) -> nn.Module:
        return (self.layer_norm if isinstance(module, nn.LayerNorm) else self.rms_norm).from_serial(module, mesh)


@dataclass(frozen=True, kw_only=True)
class ColwiseNormParallel2D(NormParallel2D):
    """A norm over the whole output of a ``colwise`` projection (OLMoE's ``q_norm`` / ``k_norm``):
    the projection's output has the residual stream's layout (batch block i, feature block j),
    so it is the grid norm over the projection's width (statistics over ``tp_col``, weight block j
    replicated over ``tp_row``). ``replicated_kv=(K, D)``: the norm of a k projection with K < q kv
    heads of width D (:class:`~.tp2d.KVReplicatedLinear2D`: grid column j holds kv head
    ``j // (q / K)``) -> :class:`~.projection_norm.ProjectionNorm` of that head's features, the
    whole weight on every rank (its gradient summed over tp)."""

    role = "colwise_norm"
    replicated_kv: tuple[int, int] | None = None

    def apply(self, module: nn.Module, mesh) -> nn.Module:
        if self.replicated_kv is None:
            return super().apply(module, mesh)
        g = grid_of(mesh, self.mode, type(self).__name__)
        k, d = self.replicated_kv
        c = g.col // (g.q // k)
        replicated_over_tp(module)
        w, b, rms = module.weight, getattr(module, "bias", None), not isinstance(module, nn.LayerNorm)
        rows = (c * d, (c + 1) * d)
        return ProjectionNorm(w, b, axis=g.col_axis, eps=norm_eps(module), rms=rms, param_axes=(g.tp_axis,), rows=rows)


class HeadNormParallel2D(GridHeadNormStyle):
    """A per-head norm (Qwen3's ``q_norm`` / ``k_norm``) on the grid: :class:`~.base.GridHeadNormStyle`."""

    mode = "2d"


@dataclass(frozen=True, kw_only=True)
class EmbeddingParallel2D(TensorStyle):
    """``nn.Embedding`` -> the vocab-parallel grid embedding, taking this rank's ids block
    (``local_ids``: the engine split the batch)."""

    role = "embedding"
    mode = "2d"
    embedding: ClassVar[type] = Embedding2D

    def apply(self, module: nn.Module, mesh) -> nn.Module:
        layer = self.embedding.from_serial(module, mesh)
        layer.local_ids = True
        return layer


@dataclass(frozen=True, kw_only=True)
class PositionEmbeddingParallel2D(TensorStyle):
    """A learned position table -> hidden block j, replicated over ``tp_row``."""

    role = "pos_embedding"
    mode = "2d"
    embedding: ClassVar[type] = PositionEmbedding2D

    def apply(self, module: nn.Module, mesh) -> nn.Module:
        return self.embedding.from_serial(module, mesh)


@dataclass(frozen=True, kw_only=True)
class HeadParallel2D(TensorStyle):
    """``nn.Linear`` to the vocabulary -> the vocab-parallel grid head, whose loss sums over
    this rank's labels block (``local_labels``)."""

    role = "head"
    mode = "2d"
    head: ClassVar[type] = VocabParallelHead2D

    def apply(self, module: nn.Module, mesh) -> nn.Module:
        layer = self.head.from_serial(module, mesh)
        layer.local_labels = True
        return layer


@dataclass(frozen=True, kw_only=True)
class AttentionParallel2D(TensorStyle):
    """An attention module keeps its code and gets this rank's head counts, heads split by q
    with the hidden dim; ``heads = (N, K, D)`` are its serial counts (``None``: read them)."""

    role = "attention"
    mode = "2d"
    heads: tuple[int, int, int | None] | None = None

    def apply(self, module: nn.Module, mesh) -> nn.Module:
        n, k, d = self.heads or attention_heads(module, type(module).__name__)
        localize_heads(module, n, k, d, grid_of(mesh, self.mode, type(self).__name__).q)
        return module


# --------------------------------------------------------------------------- 2.5D styles
class ColwiseParallel25D(ColwiseParallel2D):
    """:class:`ColwiseParallel2D` on the Tesseract grid (weights replicated over ``tp_depth``)."""

    mode = "2.5d"
    linear = Linear25D


class FusedQKVParallel25D(FusedQKVParallel2D):
    """:class:`FusedQKVParallel2D` on the Tesseract grid."""

    mode = "2.5d"
    linear = Linear25D


class RowwiseParallel25D(RowwiseParallel2D):
    """:class:`RowwiseParallel2D` on the Tesseract grid."""

    mode = "2.5d"
    linear = Linear25D


class NormParallel25D(NormParallel2D):
    """:class:`NormParallel2D` on the Tesseract grid."""

    mode = "2.5d"
    layer_norm = LayerNorm25D
    rms_norm = RMSNorm25D


class ColwiseNormParallel25D(ColwiseNormParallel2D):
    """:class:`ColwiseNormParallel2D` on the Tesseract grid."""

    mode = "2.5d"
    layer_norm = LayerNorm25D
    rms_norm = RMSNorm25D


class HeadNormParallel25D(HeadNormParallel2D):
    """:class:`HeadNormParallel2D` on the Tesseract grid."""

    mode = "2.5d"


class EmbeddingParallel25D(EmbeddingParallel2D):
    """:class:`EmbeddingParallel2D` on the Tesseract grid (ids block over depth and rows)."""

    mode = "2.5d"
    embedding = Embedding25D


class PositionEmbeddingParallel25D(PositionEmbeddingParallel2D):
    """:class:`PositionEmbeddingParallel2D` on the Tesseract grid."""

    mode = "2.5d"
    embedding = PositionEmbedding25D


class HeadParallel25D(HeadParallel2D):
    """:class:`HeadParallel2D` on the Tesseract grid."""

    mode = "2.5d"
    head = VocabParallelHead25D


class AttentionParallel25D(AttentionParallel2D):
    """:class:`AttentionParallel2D` on the Tesseract grid."""

    mode = "2.5d"


STYLES_2D: dict[str, type[TensorStyle]] = {
    s.role: s
    for s in (
        ColwiseParallel2D,
        FusedQKVParallel2D,
        RowwiseParallel2D,
        NormParallel2D,
        ColwiseNormParallel2D,
        HeadNormParallel2D,
        EmbeddingParallel2D,
        PositionEmbeddingParallel2D,
        HeadParallel2D,
        AttentionParallel2D,
    )
}
"""Role -> 2D style class."""

STYLES_25D: dict[str, type[TensorStyle]] = {
    s.role: s
    for s in (
        ColwiseParallel25D,
        FusedQKVParallel25D,
        RowwiseParallel25D,
        NormParallel25D,
        ColwiseNormParallel25D,
        HeadNormParallel25D,
        EmbeddingParallel25D,
        PositionEmbeddingParallel25D,
        HeadParallel25D,
        AttentionParallel25D,
    )
}
"""Role -> 2.5D style class."""


# --------------------------------------------------------------------------- model level
def _replicated_kv(name: str, m: nn.Module, role: str, attention: dict, q: int) -> tuple[int, int] | None:
    """(K, D) when ``name`` is the k or v projection of an attention with K < q kv heads."""
    owner = owner_of(name, attention)
    if owner is None or role != "colwise" or not isinstance(m, nn.Linear):
        return None
    n, k, d = attention[owner]
    return (k, d) if k < q and k != n and d is not None and m.out_features == k * d else None


def _replicated_kv_norm(name: str, width: int, attention: dict, q: int) -> tuple[int, int] | None:
    """(K, D) when ``name`` is the norm of a k projection with K < q kv heads (a replicated kv head)."""
    owner = owner_of(name, attention)
    if owner is None:
        return None
    n, k, d = attention[owner]
    return (k, d) if k < q and k != n and d is not None and width == k * d else None


def _validate(model: nn.Module, modules: dict, roles: dict[str, str], q: int, mode: str) -> dict:
    """Every check, pure and identical on every rank. Returns ``{attention name: (N, K, D)}``."""

    def need(what: str, size: int) -> None:
        check_divisible(what, size, q, mode)

    check_enters_and_leaves(model, roles, mode, "grid")
    attention = {}
    for name, role in roles.items():
        if role != "attention":
            continue
        n, k, d = attention_heads(modules[name], name)
        need(f"attention heads (num_heads of {name})", n)
        if k % q and (k > q or q % k):
            raise ValueError(
                f"tensor parallelism ({mode}): key/value heads (num_kv_heads of {name}) = {k} is neither a multiple "
                f"nor a divisor of q = {q}; {mode} splits the kv heads with the query heads over the q grid "
                f"columns, or gives each column a whole kv head when there are fewer. Use a model whose "
                f"num_kv_heads is a multiple or a divisor of {q}, another tp degree, or tp_mode='1d'."
            )
        attention[name] = (n, k, d)
    for name, role in roles.items():
        m = modules[name]
        if role in _LINEAR_ROLES:
            fin, fout = linear_shape(m, name, role)[:2]
            need(f"in features of {name}", fin)
            if _replicated_kv(name, m, role, attention, q):
                continue
            if role == "colwise_fused3":
                check_fused3(name, fout, mode)
                need(f"hidden (each of q, k, v in {name})", fout // 3)
            else:
                need(f"out features of {name}", fout)
        elif role in ("embedding", "pos_embedding"):
            check_kind(m, name, role)
            if role == "embedding":
                need(f"vocab_size (rows of {name})", m.num_embeddings)
            need(f"hidden (embedding dim of {name})", m.embedding_dim)
        elif role == "head":
            check_kind(m, name, role)
            need(f"vocab_size (out features of {name})", m.out_features)
            need(f"hidden (in features of {name})", m.in_features)
        elif role == "norm":
            need(f"hidden (normalized size of {name})", check_norm(m, name, mode))
        elif role == "colwise_norm":
            width = check_norm(m, name, mode)
            if _replicated_kv_norm(name, width, attention, q) is None:
                need(f"normalised width (features of {name})", width)
    check_every_parameter_owned(model, roles, mode)
    return attention


def prepare(model: nn.Module, styles: dict[str, TensorStyle], mesh) -> dict[str, TensorStyle]:
    """Check every module of ``styles`` (``{module name: 2D or 2.5D style}``) and the model
    (an embedding and a head, every parameter owned by a style), pure and identical on every
    rank; return the styles with replicated kv projections and serial head counts filled in."""
    mode = mesh.plan.tp_mode
    g = grid_of(mesh, mode, f"tensor parallelism ({mode})")
    modules = dict(model.named_modules())
    attention = _validate(model, modules, {n: s.role for n, s in styles.items()}, g.q, mode)
    out = {}
    for name, style in styles.items():
        fields = {f.name for f in dataclasses.fields(style)}
        if "replicated_kv" in fields and style.replicated_kv is None:
            m = modules[name]
            kv = (
                _replicated_kv_norm(name, check_norm(m, name, mode), attention, g.q)
                if style.role == "colwise_norm"
                else _replicated_kv(name, m, style.role, attention, g.q)
            )
            style = dataclasses.replace(style, replicated_kv=kv)
        if "heads" in fields and style.heads is None:
            style = dataclasses.replace(style, heads=attention[name])
        out[name] = style
    return out


def finish(model: nn.Module, mesh, styles: dict[str, TensorStyle], replaced: dict) -> tuple[str, ...]:
    """Defer the grid Linears' and norms' gradient reductions to the end of each backward pass
    (:mod:`.deferred_grads`); return the mesh axes that split the batch inside the tp group:
    ``("tp_row",)`` in 2D, ``("tp_depth", "tp_row")`` in 2.5D (the engine gives each rank its block)."""
    g = grid_of(mesh, mesh.plan.tp_mode, "tensor parallelism")
    install_deferred_grads(model, g, [m for m in model.modules() if isinstance(m, (Linear2D, Norm2D))])
    return g.batch_axes

"""3D tensor parallelism as styles (Bian et al., arXiv 2105.14450, with Tensor3D's
over-decomposition, arXiv 2305.13525): one class per role (``ColwiseParallel3D``, ...), each
building the cube layers of :mod:`.tp3d` / :mod:`.embed3d` from a serial module, and the
model-level checks (:func:`prepare`) and hooks (:func:`finish`) around them.

What the rewritten model computes on rank (d, r, c) of the q x q x q cube (tp = q**3):

* **Inputs.** The engine gives the model this rank's batch block ``[b, S]`` of every batch
  tensor, ``b = B / q**2``, block ``d*q + c`` (``Parallelized.batch_axes`` =
  :data:`.tp3d.INPUT_BATCH_AXES` = (tp_depth, tp_col)). That is the block the attention heads
  and the logits hold (the *swapped* layout), so everything the model's own code derives from
  its inputs and uses inside attention -- causal masks, position ids, RoPE tables, ``view(batch,
  ...)`` -- sees the right rows and needs no change, and the labels block is the logits' block.
  The token embedding all-gathers the int64 ids over tp_col and tp_depth (a small fraction of
  the activation bytes) and looks up its vocab x hidden block.
* **Residual stream**, norms and embedding outputs: the canonical layout ``[b, S, h/q]``, batch
  block ``d*q + r``, hidden block c. A learned position table re-indexes per-row positions
  from the input rows to these (an int64 all-gather over tp_col; exact for a broadcast
  ``[1, S]`` too).
* **Linears.** ``colwise`` / ``colwise_fused3`` (q, k, v or fused qkv, fc, gate, up) read the
  canonical layout and write the swapped one (``Linear3D(swapped=False)``); ``rowwise``
  (attention out, MLP down) go back (``swapped=True``), so each pair returns to the residual
  layout with no redistribution. ``Plan.tp_overlap = k`` gives every Linear (and the head)
  Tensor3D over-decomposition into k pieces of this rank's tokens.
* **Attention** is local: heads are split by q over tp_row (the swapped layout's hidden
  axis), each attention module's head counts become N/q and K/q (:func:`..localize_heads`).
  Grouped-query attention needs q | K (local query heads block r then read exactly kv heads
  block r); fewer kv heads are refused with the numbers.
* **Head and loss.** :class:`.embed3d.VocabParallelHead3D` writes logits ``[b, S, V/q]`` in the
  swapped layout (vocab over tp_row); its loss sums over this rank's labels block and the
  engine sums over dp and the batch axes. A tied head shares the embedding's Parameter (both
  have the ``[V, H]`` table layout: vocab block ``r*q + d`` of q**2, hidden block c).

Every parameter must belong to a module with a role: a serial parameter left in the model
would see a hidden block of a batch block and silently train wrong. Every shape is checked
first, identically on every rank and before any collective; the token count against
``tp_overlap`` at the start of every forward, before the first collective.

Tested in tests/dist/test_tp3d.py (whole models against serial training).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from .base import (
    GridHeadNormStyle,
    TensorStyle,
    check_enters_and_leaves,
    check_every_parameter_owned,
    check_fused3,
    check_kind,
    check_norm,
)
from .embed3d import Embedding3D, PositionEmbedding3D, VocabParallelHead3D
from .layout import check_divisible
from .norms3d import LayerNorm3D, RMSNorm3D
from .serial import attention_heads, linear_shape, localize_heads
from .tp3d import INPUT_BATCH_AXES, MODE, Linear3D, cube_of

_LINEAR_ROLES = ("colwise", "rowwise", "colwise_fused3")


# --------------------------------------------------------------------------- styles
@dataclass(frozen=True, kw_only=True)
class ColwiseParallel3D(TensorStyle):
    """``nn.Linear`` / ``Conv1D`` -> :class:`~.tp3d.Linear3D` reading the canonical layout and
    writing the swapped one; ``overlap`` pieces of over-decomposition (``None``: ``Plan.tp_overlap``)."""

    role = "colwise"
    mode = MODE
    overlap: int | None = None

    def apply(self, module: nn.Module, mesh) -> nn.Module:
        return Linear3D.from_serial(module, mesh, swapped=False, overlap=self.overlap or mesh.plan.tp_overlap)


@dataclass(frozen=True, kw_only=True)
class FusedQKVParallel3D(TensorStyle):
    """A fused ``[q; k; v]`` ``nn.Linear`` / ``Conv1D`` -> :class:`~.tp3d.Linear3D` (canonical ->
    swapped) whose local output is ``[q_i | k_i | v_i]`` of heads block i."""

    role = "colwise_fused3"
    mode = MODE
    overlap: int | None = None

    def apply(self, module: nn.Module, mesh) -> nn.Module:
        overlap = self.overlap or mesh.plan.tp_overlap
        return Linear3D.from_serial(module, mesh, swapped=False, fused=3, overlap=overlap)


@dataclass(frozen=True, kw_only=True)
class RowwiseParallel3D(TensorStyle):
    """``nn.Linear`` / ``Conv1D`` -> :class:`~.tp3d.Linear3D` reading the swapped layout and
    writing the canonical one, so a column/row pair returns to the residual layout."""

    role = "rowwise"
    mode = MODE
    overlap: int | None = None

    def apply(self, module: nn.Module, mesh) -> nn.Module:
        return Linear3D.from_serial(module, mesh, swapped=True, overlap=self.overlap or mesh.plan.tp_overlap)


@dataclass(frozen=True, kw_only=True)
class NormParallel3D(TensorStyle):
    """``nn.LayerNorm`` or an RMS norm -> :class:`~.norms3d.LayerNorm3D` / :class:`~.norms3d.RMSNorm3D`
    on the canonical layout."""

    role = "norm"
    mode = MODE

    def apply(self, module: nn.Module, mesh) -> nn.Module:
        return (LayerNorm3D if isinstance(module, nn.LayerNorm) else RMSNorm3D).from_serial(module, mesh)


@dataclass(frozen=True, kw_only=True)
class ColwiseNormParallel3D(TensorStyle):
    """A norm over the whole output of a ``colwise`` projection (OLMoE's ``q_norm`` / ``k_norm``)
    -> :class:`~.norms3d.LayerNorm3D` / :class:`~.norms3d.RMSNorm3D` on the swapped layout the
    projection writes (feature block r: statistics over ``tp_row``, weight block r replicated over
    ``tp_depth`` and ``tp_col``)."""

    role = "colwise_norm"
    mode = MODE

    def apply(self, module: nn.Module, mesh) -> nn.Module:
        norm = LayerNorm3D if isinstance(module, nn.LayerNorm) else RMSNorm3D
        return norm.from_serial(module, mesh, swapped=True)


class HeadNormParallel3D(GridHeadNormStyle):
    """A per-head norm (Qwen3's ``q_norm`` / ``k_norm``) on the cube: :class:`~.base.GridHeadNormStyle`."""

    mode = MODE


@dataclass(frozen=True, kw_only=True)
class EmbeddingParallel3D(TensorStyle):
    """``nn.Embedding`` -> :class:`~.embed3d.Embedding3D`, taking this rank's input ids block."""

    role = "embedding"
    mode = MODE

    def apply(self, module: nn.Module, mesh) -> nn.Module:
        layer = Embedding3D.from_serial(module, mesh)
        layer.local_ids = True
        return layer


@dataclass(frozen=True, kw_only=True)
class PositionEmbeddingParallel3D(TensorStyle):
    """A learned position table -> :class:`~.embed3d.PositionEmbedding3D`, re-indexing this
    rank's input rows onto the residual stream's (``local_positions``)."""

    role = "pos_embedding"
    mode = MODE

    def apply(self, module: nn.Module, mesh) -> nn.Module:
        layer = PositionEmbedding3D.from_serial(module, mesh)
        layer.local_positions = True
        return layer


@dataclass(frozen=True, kw_only=True)
class HeadParallel3D(TensorStyle):
    """``nn.Linear`` to the vocabulary -> :class:`~.embed3d.VocabParallelHead3D` (logits in the
    swapped layout), whose loss sums over this rank's labels block (``local_labels``)."""

    role = "head"
    mode = MODE
    overlap: int | None = None

    def apply(self, module: nn.Module, mesh) -> nn.Module:
        layer = VocabParallelHead3D.from_serial(module, mesh, overlap=self.overlap or mesh.plan.tp_overlap)
        layer.local_labels = True
        return layer


@dataclass(frozen=True, kw_only=True)
class AttentionParallel3D(TensorStyle):
    """An attention module keeps its code and gets this rank's head counts, heads split by q
    over tp_row; ``heads = (N, K, D)`` are its serial counts (``None``: read them)."""

    role = "attention"
    mode = MODE
    heads: tuple[int, int, int | None] | None = None

    def apply(self, module: nn.Module, mesh) -> nn.Module:
        n, k, d = self.heads or attention_heads(module, type(module).__name__)
        localize_heads(module, n, k, d, cube_of(mesh, type(self).__name__).q)
        return module


STYLES: dict[str, type[TensorStyle]] = {
    s.role: s
    for s in (
        ColwiseParallel3D,
        FusedQKVParallel3D,
        RowwiseParallel3D,
        NormParallel3D,
        ColwiseNormParallel3D,
        HeadNormParallel3D,
        EmbeddingParallel3D,
        PositionEmbeddingParallel3D,
        HeadParallel3D,
        AttentionParallel3D,
    )
}
"""Role -> 3D style class."""


# --------------------------------------------------------------------------- model level
def _validate(model: nn.Module, modules: dict, roles: dict[str, str], q: int) -> dict:
    """Every check, pure and identical on every rank. Returns ``{attention name: (N, K, D)}``."""

    def need(what: str, size: int, parts: int = q) -> None:
        check_divisible(what, size, parts, MODE)

    qq = f"q**2 = {q * q} (tp_row x tp_depth)"
    check_enters_and_leaves(model, roles, MODE, "cube")
    attention = {}
    for name, role in roles.items():
        if role != "attention":
            continue
        n, k, d = attention_heads(modules[name], name)
        need(f"attention heads (num_heads of {name})", n)
        if k % q:
            raise ValueError(
                f"tensor parallelism ({MODE}): key/value heads (num_kv_heads of {name}) = {k} is not divisible by "
                f"q = {q}; 3d splits the kv heads with the query heads over the q members of tp_row (cube side q "
                f"= tp**(1/3)). Use a model whose num_kv_heads is a multiple of {q}, or tp_mode='2d' / '1d', "
                f"which also replicate fewer kv heads."
            )
        attention[name] = (n, k, d)
    for name, role in roles.items():
        m = modules[name]
        if role in _LINEAR_ROLES:
            fin, fout = linear_shape(m, name, role)[:2]
            need(f"in features of {name}", fin)
            if role == "colwise_fused3":
                check_fused3(name, fout, MODE)
                need(f"hidden (each of q, k, v in {name}; its weight rows are split over {qq})", fout // 3, q * q)
            else:
                need(f"out features of {name} (its weight rows are split over {qq})", fout, q * q)
        elif role in ("embedding", "pos_embedding"):
            check_kind(m, name, role)
            if role == "embedding":
                need(f"vocab_size (rows of {name}, split over {qq})", m.num_embeddings, q * q)
            need(f"hidden (embedding dim of {name})", m.embedding_dim)
        elif role == "head":
            check_kind(m, name, role)
            need(f"vocab_size (out features of {name}, split over {qq})", m.out_features, q * q)
            need(f"hidden (in features of {name})", m.in_features)
        elif role in ("norm", "colwise_norm"):
            need(f"hidden (normalized size of {name})", check_norm(m, name, MODE))
    check_every_parameter_owned(model, roles, MODE)
    return attention


def prepare(model: nn.Module, styles: dict[str, TensorStyle], mesh) -> dict[str, TensorStyle]:
    """Check every module of ``styles`` (``{module name: 3D style}``) and the model (an
    embedding and a head, every parameter owned by a style), pure and identical on every rank;
    return the styles with ``Plan.tp_overlap`` and the serial head counts filled in."""
    cube = cube_of(mesh, f"tensor parallelism ({MODE})")
    modules = dict(model.named_modules())
    attention = _validate(model, modules, {n: s.role for n, s in styles.items()}, cube.q)
    out = {}
    for name, style in styles.items():
        fields = {f.name for f in dataclasses.fields(style)}
        if "overlap" in fields and style.overlap is None:
            style = dataclasses.replace(style, overlap=mesh.plan.tp_overlap)
        if "heads" in fields and style.heads is None:
            style = dataclasses.replace(style, heads=attention[name])
        out[name] = style
    return out


def _check_tokens_hook(overlap: int):
    """A forward pre-hook: the rank's tokens (``b x S`` of the input ids) must split into
    ``overlap`` pieces. Raised identically on every rank before the first collective."""

    def check(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if isinstance(ids, torch.Tensor) and ids.dim() >= 2:
            b, s = ids.shape[0], ids.shape[1]
            if (b * s) % overlap:
                raise ValueError(
                    f"tensor parallelism ({MODE}): Plan.tp_overlap={overlap} splits each rank's tokens into "
                    f"{overlap} pieces, but a rank holds {b} rows x {s} positions = {b * s} tokens (its block of "
                    f"1/q**2 of the micro-batch); use a tp_overlap that divides {b * s}, or a larger batch."
                )
        return None

    return check


def finish(model: nn.Module, mesh, styles: dict[str, TensorStyle], replaced: dict) -> tuple[str, ...]:
    """With ``Plan.tp_overlap`` > 1, check at every forward (before the first collective) that
    the rank's tokens split into that many pieces. Returns the input batch axes,
    :data:`~.tp3d.INPUT_BATCH_AXES`."""
    overlap = mesh.plan.tp_overlap
    if overlap > 1:
        model.register_forward_pre_hook(_check_tokens_hook(overlap), with_kwargs=True)
    return INPUT_BATCH_AXES

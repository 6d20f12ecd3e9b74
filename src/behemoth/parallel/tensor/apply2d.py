"""Model-level 2D (Optimus) and 2.5D (Tesseract) tensor parallelism: rewrite a serial model,
module by role, into the SUMMA layers of :mod:`.tp2d` / :mod:`.tp2p5d`.

``tp2d.parallelize`` and ``tp2p5d.parallelize`` both land here; the mode (and so the layer
classes and the batch split) comes from ``mesh.plan.tp_mode``.

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

import types

import torch
from torch import nn

from ... import comm
from . import Parallelized, attention_heads, localize_heads, replace_modules
from .layout import DimShard, ShardSpec, check_divisible, set_spec, shard_tensor
from .tp2d import _autocast_dtype, _replicate_on, _Summa, grid_of

_LINEAR_ROLES = ("colwise", "rowwise", "colwise_fused3")


def _layers(mode: str) -> types.SimpleNamespace:
    from . import embed2d, tp2d, tp2p5d

    if mode == "2d":
        return types.SimpleNamespace(
            Linear=tp2d.Linear2D,
            LayerNorm=tp2d.LayerNorm2D,
            RMSNorm=tp2d.RMSNorm2D,
            Embedding=embed2d.Embedding2D,
            PositionEmbedding=embed2d.PositionEmbedding2D,
            Head=embed2d.VocabParallelHead2D,
        )
    return types.SimpleNamespace(
        Linear=tp2p5d.Linear25D,
        LayerNorm=tp2p5d.LayerNorm25D,
        RMSNorm=tp2p5d.RMSNorm25D,
        Embedding=tp2p5d.Embedding25D,
        PositionEmbedding=tp2p5d.PositionEmbedding25D,
        Head=tp2p5d.VocabParallelHead25D,
    )


class KVReplicatedLinear2D(nn.Module):
    """A k or v projection with K kv heads < q grid columns (q % K == 0), for grouped-query
    attention: grid column j needs kv head ``c = j // (q/K)`` whole. Rank (k, j) holds in-block
    k of *every* output row (``[K*D, in/q]``, replicated over ``tp_col``) and runs SUMMA with
    the D rows of head c: input ``[b, S, in/q]`` -> output ``[b, S, D]`` (one local kv head).
    Communication: a Linear2D's with a ``[D, in/q]`` weight block; backward adds the
    all-reduce of the weight gradient over ``tp_col`` (each column contributes its head's
    rows). A bias is replicated over the whole grid (gradient all-reduced over ``tp``)."""

    def __init__(self, module: nn.Linear, mesh, mode: str, kv_heads: int, head_dim: int) -> None:
        super().__init__()
        g = self.grid = grid_of(mesh, mode, type(self).__name__)
        self.in_features, self.out_features = module.in_features, module.out_features
        c = g.col // (g.q // kv_heads)
        self.rows = (c * head_dim, (c + 1) * head_dim)
        spec = ShardSpec(
            tuple(module.weight.shape), (DimShard(1, g.q, g.row, ("tp_row",)),), ("tp_col",) + g.weight_replicas
        )
        self.weight = set_spec(nn.Parameter(shard_tensor(module.weight.detach(), spec)), spec)
        if module.bias is not None:
            self.bias = set_spec(
                nn.Parameter(module.bias.detach().clone()), ShardSpec(tuple(module.bias.shape), (), ("tp",))
            )
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, (lo, hi) = self.grid, self.rows
        w = comm.CopyToAxis.apply(_replicate_on(self.weight, g, rows=False), g.col_axis)[lo:hi]
        dt = _autocast_dtype(x)
        if dt is not None:
            x, w = x.to(dt), w.to(dt)
        y = _Summa.apply(x.reshape(-1, x.shape[-1]), w, g, False)
        y = y.view(*x.shape[:-1], hi - lo)
        if self.bias is not None:
            y = y + comm.CopyToAxis.apply(self.bias, g.tp_axis)[lo:hi].to(y.dtype)
        return y

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, rows={self.rows}, q={self.grid.q}"


def _linear_shape(module: nn.Module, name: str, role: str) -> tuple[int, int]:
    """(in_features, out_features) of an nn.Linear or a transformers Conv1D."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    if hasattr(module, "nf") and getattr(module, "weight", None) is not None and module.weight.dim() == 2:
        return module.weight.shape[0], module.nf
    raise ValueError(
        f"tensor-parallel role {role!r} needs an nn.Linear or a transformers Conv1D; "
        f"{name} is a {type(module).__name__}."
    )


def _is_rms(module: nn.Module) -> bool:
    return (
        not isinstance(module, nn.LayerNorm)
        and isinstance(getattr(module, "weight", None), nn.Parameter)
        and getattr(module, "bias", None) is None
        and (hasattr(module, "eps") or hasattr(module, "variance_epsilon"))
    )


def _owner(name: str, attention: dict) -> str | None:
    return next((a for a in attention if name.startswith(a + ".")), None)


def _replicated_kv(name: str, m: nn.Module, role: str, attention: dict, q: int) -> tuple[int, int] | None:
    """(K, D) when ``name`` is the k or v projection of an attention with K < q kv heads."""
    owner = _owner(name, attention)
    if owner is None or role != "colwise" or not isinstance(m, nn.Linear):
        return None
    n, k, d = attention[owner]
    return (k, d) if k < q and k != n and d is not None and m.out_features == k * d else None


def _validate(model: nn.Module, modules: dict, roles: dict[str, str], q: int, mode: str) -> dict:
    """Every check, pure and identical on every rank. Returns ``{attention name: (N, K, D)}``."""

    def need(what: str, size: int) -> None:
        check_divisible(what, size, q, mode)

    present = set(roles.values())
    if "embedding" not in present or "head" not in present:
        raise ValueError(
            f"tensor parallelism ({mode}) splits the batch and the hidden dim of every activation, so the model "
            f"must enter the grid through an 'embedding' role and leave it through a 'head' role; the tp_policy "
            f"for {type(model).__name__} has {sorted(present)}. Add them, or use tp_mode='1d'."
        )
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
            fin, fout = _linear_shape(m, name, role)
            need(f"in features of {name}", fin)
            if _replicated_kv(name, m, role, attention, q):
                continue
            if role == "colwise_fused3":
                if fout % 3:
                    raise ValueError(
                        f"tensor parallelism ({mode}): colwise_fused3 {name} has {fout} output features, "
                        f"not three equal q/k/v parts."
                    )
                need(f"hidden (each of q, k, v in {name})", fout // 3)
            else:
                need(f"out features of {name}", fout)
        elif role in ("embedding", "pos_embedding"):
            if not isinstance(m, nn.Embedding):
                raise ValueError(
                    f"tensor-parallel role {role!r} needs an nn.Embedding; {name} is a {type(m).__name__}."
                )
            if role == "embedding":
                need(f"vocab_size (rows of {name})", m.num_embeddings)
            need(f"hidden (embedding dim of {name})", m.embedding_dim)
        elif role == "head":
            if not isinstance(m, nn.Linear):
                raise ValueError(f"tensor-parallel role 'head' needs an nn.Linear; {name} is a {type(m).__name__}.")
            need(f"vocab_size (out features of {name})", m.out_features)
            need(f"hidden (in features of {name})", m.in_features)
        elif role == "norm":
            if not (isinstance(m, nn.LayerNorm) or _is_rms(m)):
                raise ValueError(
                    f"tensor parallelism ({mode}): norm {name} is a {type(m).__name__}; the norm role "
                    f"supports nn.LayerNorm and RMS norms (a weight, no bias, an eps attribute)."
                )
            need(
                f"hidden (normalized size of {name})",
                m.weight.shape[0] if m.weight is not None else m.normalized_shape[0],
            )
    owned = {n for n, r in roles.items() if r != "attention"}
    for pname, _ in model.named_parameters(remove_duplicate=False):
        if pname.rpartition(".")[0] not in owned:
            raise ValueError(
                f"tensor parallelism ({mode}): parameter {pname} has no tensor-parallel role. In {mode} every "
                f"activation is a (batch block, hidden block) shard, so a serial parameter would see only part of "
                f"the data; give its module a role in tp_policy (see behemoth.policies)."
            )
    return attention


def _build(m: nn.Module, role: str, mesh, L, kv: tuple[int, int] | None) -> nn.Module:
    if kv is not None:
        return KVReplicatedLinear2D(m, mesh, mesh.plan.tp_mode, *kv)
    if role in _LINEAR_ROLES:
        return L.Linear.from_serial(m, mesh, fused=3 if role == "colwise_fused3" else 1)
    if role == "norm":
        return (L.LayerNorm if isinstance(m, nn.LayerNorm) else L.RMSNorm).from_serial(m, mesh)
    if role == "embedding":
        layer = L.Embedding.from_serial(m, mesh)
        layer.local_ids = True
        return layer
    if role == "pos_embedding":
        return L.PositionEmbedding.from_serial(m, mesh)
    layer = L.Head.from_serial(m, mesh)
    layer.local_labels = True
    return layer


def parallelize_grid(model: nn.Module, mesh, plan, roles: dict[str, str]) -> Parallelized:
    """Rewrite ``model`` in place for ``plan.tp_mode`` '2d' or '2.5d' (module docstring).

    ``roles`` is ``{module name: role}`` (:mod:`behemoth.policies`). Order: validate every
    shape (pure); broadcast the serial weights from tp rank 0 (one model, however each rank
    was seeded); replace each role's module by its SUMMA layer holding this rank's shards
    (a weight two modules share stays one Parameter); give attention modules their local
    head counts. Returns the replaced parameters, the head and the batch axes."""
    mode = plan.tp_mode
    g = grid_of(mesh, mode, f"tensor parallelism ({mode})")
    L = _layers(mode)
    modules = dict(model.named_modules())
    attention = _validate(model, modules, roles, g.q, mode)

    new, head = replace_modules(
        model,
        roles,
        lambda name, m, role: _build(m, role, mesh, L, _replicated_kv(name, m, role, attention, g.q)),
        mode,
        tp_axis=mesh.axis("tp"),
    )
    for name, (n, k, d) in attention.items():
        localize_heads(modules[name], n, k, d, g.q)
    return Parallelized(replaced=new, head=head, batch_axes=g.batch_axes)

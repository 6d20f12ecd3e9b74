"""Tensor parallelism: one module per mode (``tp1d``, ``tp2d``, ``tp2p5d``, ``tp3d``) plus the
mode-agnostic machinery here, which reads only each parameter's
:class:`~behemoth.parallel.tensor.layout.ShardSpec`:

* :func:`shard_blocks` / :func:`shard_rectangles`: where a local shard sits in the serial
  tensor (pure; the rectangles are what checkpoints write, with real offsets);
* :func:`full_state_dict`: the serial model's state dict, all-gathered over ``tp``;
* :func:`global_grad_norm`: the serial model's gradient norm (replicated parameters once,
  sharded ones summed over ``tp``, each shard counted once however often it is replicated);
* :func:`attention_heads` / :func:`localize_heads`: read an attention module's head counts
  (behemoth's, GPT-2's, HF Llama's attribute names) and set them to this rank's counts.

A mode's ``parallelize(model, mesh, plan, roles)`` returns a :class:`Parallelized`. A module
whose logits are vocabulary-sharded exposes ``vocab_parallel_loss_sum(logits, labels)`` (the
loss sum over the labels of the rows the model was given) and a ``gather_output`` flag; the
engine computes the loss through it (no rank materialises the full logits) unless the user
brings a ``loss_fn``, in which case ``gather_output`` is set. A mode that splits the batch
inside the tp group (2D, 2.5D, 3D) names the axes in ``Parallelized.batch_axes``.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import torch
from torch import nn

from ... import comm
from .layout import DimShard, ShardSpec, get_spec


@dataclass
class Parallelized:
    """What applying tensor parallelism did to a model."""

    replaced: dict[int, torch.nn.Parameter] = field(default_factory=dict)
    """``id(serial parameter) -> its tensor-parallel replacement`` (to re-target the optimizer)."""
    head: torch.nn.Module | None = None
    """The vocabulary-parallel output head, if any (has ``vocab_parallel_loss_sum``)."""
    batch_axes: tuple[str, ...] = ()
    """Mesh axes that split the batch inside the tp group, outermost first (2D: ``("tp_row",)``;
    2.5D: ``("tp_depth", "tp_row")``; 3D: ``("tp_depth", "tp_col")``, the batch block of the
    head's logits, which sit in the swapped layout; 1D: none). The engine then gives each rank block
    ``ravel(coords on these axes)`` of every micro-batch tensor, the head's loss sums over
    that block, and the engine sums the loss over dp *and* these axes."""


def is_sharded(spec: ShardSpec | None) -> bool:
    return spec is not None and len(spec.dims) > 0


# ----------------------------------------------------------------------------- pure shard math
def shard_blocks(spec: ShardSpec) -> list[tuple[int, int]]:
    """``(offset, size)`` of the local block along every dim of the (view of the) serial
    tensor; several DimShards on one dim nest, outermost first (as ``shard_tensor`` applies them)."""
    shape = list(spec.view_shape or spec.full_shape)
    blocks = [(0, s) for s in shape]
    for d in spec.dims:
        off, size = blocks[d.dim]
        if size % d.parts:
            raise ValueError(f"ShardSpec {spec}: dim {d.dim} of size {size} is not divisible by {d.parts}")
        size //= d.parts
        blocks[d.dim] = (off + d.index * size, size)
    return blocks


def shard_rectangles(spec: ShardSpec) -> list[tuple[tuple, tuple[int, ...], tuple[int, ...]]]:
    """The local shard as rectangles of the *serial* tensor: ``(local_index, offsets, sizes)``
    where ``local.reshape(spec.local_view_shape())[local_index]`` is the rectangle's data.

    Without a view the shard is one rectangle. A fused view (``view_shape``, ``fused_dim``)
    merges view dims ``fused_dim .. fused_dim+m-1`` into serial dim ``fused_dim``; the shard
    is then one rectangle per index of the merged dims but the innermost (e.g. q, k and v
    rows of a fused QKV weight: three rectangles)."""
    blocks = shard_blocks(spec)
    if spec.view_shape is None:
        return [((), tuple(o for o, _ in blocks), tuple(s for _, s in blocks))]
    view, full, f = list(spec.view_shape), list(spec.full_shape), spec.fused_dim
    m = len(view) - len(full) + 1
    merged = list(range(f, f + m))
    if m < 1 or view[:f] != full[:f] or view[f + m :] != full[f + 1 :] or math.prod(view[f : f + m]) != full[f]:
        raise ValueError(f"ShardSpec {spec}: view_shape does not split serial dim {f} of {tuple(full)}")
    rects = []
    outer = [range(blocks[d][0], blocks[d][0] + blocks[d][1]) for d in merged[:-1]]
    for idx in itertools.product(*outer):
        # Linear index, in serial dim f, of (idx..., block start of the innermost merged dim).
        lin = 0
        for d, i in zip(merged, list(idx) + [blocks[merged[-1]][0]]):
            lin = lin * view[d] + i
        offsets = [o for o, _ in blocks[:f]] + [lin] + [o for o, _ in blocks[f + m :]]
        sizes = [s for _, s in blocks[:f]] + [blocks[merged[-1]][1]] + [s for _, s in blocks[f + m :]]
        local_index = tuple(slice(None) for _ in range(f)) + tuple(i - blocks[d][0] for d, i in zip(merged, idx))
        rects.append((local_index, tuple(offsets), tuple(sizes)))
    return rects


def place_shard(full: torch.Tensor, local: torch.Tensor, spec: ShardSpec) -> None:
    """Write ``local`` (a shard under ``spec``) into the serial tensor ``full``, in place."""
    local_view = local.reshape(spec.local_view_shape())
    for local_index, offsets, sizes in shard_rectangles(spec):
        dst = full
        for dim, (o, s) in enumerate(zip(offsets, sizes)):
            dst = dst.narrow(dim, o, s)
        dst.copy_(local_view[local_index])


def _with_indices(spec: ShardSpec, indices: list[int]) -> ShardSpec:
    dims = tuple(DimShard(d.dim, d.parts, i, d.axes) for d, i in zip(spec.dims, indices))
    return ShardSpec(spec.full_shape, dims, spec.replicated_on, spec.view_shape, spec.fused_dim)


def _copies(spec: ShardSpec, tp_size: int) -> int:
    """How many tp ranks hold this same shard (tp_size / number of distinct shards)."""
    return max(1, tp_size // math.prod(d.parts for d in spec.dims))


# ----------------------------------------------------------------------------- attention heads (every mode)
_HEADS = ("num_heads", "num_attention_heads", "n_head", "n_heads")
_KV_HEADS = ("num_kv_heads", "num_key_value_heads", "n_kv_heads")
_WIDTHS = ("split_size", "embed_dim", "all_head_size", "inner_dim")


def _first_int(obj, names) -> int | None:
    for n in names:
        v = getattr(obj, n, None)
        if isinstance(v, int) and not isinstance(v, bool):
            return v
    return None


def attention_heads(module: nn.Module, name: str) -> tuple[int, int, int | None]:
    """(query heads N, kv heads K, head dim D or None) of an attention module: behemoth's
    ``num_heads``/``num_kv_heads``, GPT-2's ``num_heads``, HF Llama's config and
    ``num_key_value_groups``."""
    cfg = getattr(module, "config", None)
    n = _first_int(module, _HEADS) or (_first_int(cfg, ("num_attention_heads", "n_head")) if cfg else None)
    if n is None:
        raise ValueError(
            f"tensor parallelism: attention module {name} ({type(module).__name__}) has none of the "
            f"head-count attributes {', '.join(_HEADS)}; it cannot be given local heads."
        )
    k = _first_int(module, _KV_HEADS)
    groups = getattr(module, "num_key_value_groups", None)
    if k is None and isinstance(groups, int) and groups > 0:
        k = n // groups
    return n, k or n, _first_int(module, ("head_dim",))


def localize_heads(module: nn.Module, n: int, k: int, d: int | None, p: int) -> None:
    """Set the head-count attributes a module reshapes with to this rank's counts, for heads
    split into ``p`` parts (1D: tp; 2D: q). Fewer kv heads than ``p`` become one local kv
    head (replicated: the caller gives each rank the right one)."""
    n_loc, k_loc = n // p, (k // p if k >= p else 1)
    for attr in _HEADS:
        if _first_int(module, (attr,)) is not None:
            setattr(module, attr, n_loc)
    for attr in _KV_HEADS:
        if _first_int(module, (attr,)) is not None:
            setattr(module, attr, k_loc)
    if _first_int(module, ("num_key_value_groups",)) is not None:
        module.num_key_value_groups = n_loc // k_loc
    for attr in _WIDTHS:
        if d is not None and _first_int(module, (attr,)) == n * d:
            setattr(module, attr, n_loc * d)


# ----------------------------------------------------------------------------- collective views
def full_state_dict(model: torch.nn.Module, mesh) -> dict[str, torch.Tensor]:
    """The serial model's state dict on CPU: every sharded parameter all-gathered over ``tp``
    and reassembled from its ShardSpec (fused views and tied weights included); one
    all-gather of the shard indices, then one all-gather per sharded tensor."""
    tp = mesh.axis("tp")
    state = model.state_dict(keep_vars=True)
    sharded = {}
    for v in state.values():
        spec = get_spec(v)
        if is_sharded(spec) and id(v) not in sharded:
            sharded[id(v)] = (v, spec)
    full: dict[int, torch.Tensor] = {}
    if sharded and not tp.trivial:
        width = max(len(spec.dims) for _, spec in sharded.values())
        device = next(iter(sharded.values()))[0].device
        mine = torch.tensor(
            [[d.index for d in spec.dims] + [0] * (width - len(spec.dims)) for _, spec in sharded.values()],
            dtype=torch.int64,
            device=device,
        )
        everyone = comm.all_gather(mine.reshape(1, -1), tp).reshape(tp.size, len(sharded), width).tolist()
        for k, (key, (v, spec)) in enumerate(sharded.items()):
            parts = comm.all_gather(v.detach().reshape(1, -1), tp)
            out = torch.empty(spec.full_shape, dtype=v.dtype, device=v.device)
            for member in range(tp.size):
                place_shard(out, parts[member], _with_indices(spec, everyone[member][k][: len(spec.dims)]))
            full[key] = out
    elif sharded:  # a "sharded" tensor on a trivial axis is the whole tensor
        full = {key: v.detach().reshape(spec.full_shape) for key, (v, spec) in sharded.items()}
    return {k: full.get(id(v), v).detach().to("cpu", copy=True) for k, v in state.items()}


def global_grad_norm(params: list[torch.nn.Parameter], mesh) -> torch.Tensor:
    """The serial model's gradient 2-norm from this rank's shards (gradients already reduced
    over dp): replicated parameters count once; sharded ones are summed over ``tp`` with one
    all-reduce of a scalar, each shard weighted 1/(its number of copies on the tp axis)."""
    tp = mesh.axis("tp")
    grads = [p.grad for p in params if p.grad is not None]
    if tp.trivial:
        return torch.nn.utils.get_total_norm(grads, foreach=True)
    rep, shd, weights = [], [], []
    for p in params:
        if p.grad is None:
            continue
        spec = get_spec(p)
        if is_sharded(spec):
            shd.append(p.grad)
            weights.append(1.0 / _copies(spec, tp.size))
        else:
            rep.append(p.grad)
    device = grads[0].device if grads else torch.device("cpu")
    sq = torch.zeros(2, dtype=torch.float32, device=device)
    if rep:
        sq[0] = torch.stack(torch._foreach_norm(rep)).square().sum()
    if shd:
        w = torch.tensor(weights, dtype=torch.float32, device=device)
        sq[1] = (torch.stack(torch._foreach_norm(shd)).square() * w).sum()
    shard_sq = sq[1:].clone()
    comm.all_reduce(shard_sq, tp)
    return (sq[0] + shard_sq[0]).sqrt()


def replace_modules(
    model: torch.nn.Module, roles: dict[str, str], build, mode: str, *, tp_axis
) -> tuple[dict[int, torch.nn.Parameter], torch.nn.Module | None]:
    """The module swap every grid mode (2D, 2.5D, 3D) performs after validating shapes.

    Broadcasts the serial weights from tp rank 0 (one model, however each rank was seeded),
    then replaces each role's module by ``build(name, module, role)`` -- embeddings first,
    so a head tied to one finds its Parameter already sharded and keeps it as one Parameter
    (a tie whose two sides would be sharded differently is an error). Attention modules are
    left to the caller. Returns ``{id(serial param): new param}`` and the head layer."""
    from ... import comm
    from .layout import get_spec

    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            comm.broadcast(t.data, tp_axis, 0)
    modules = dict(model.named_modules())
    new: dict[int, torch.nn.Parameter] = {}
    head = None
    jobs = sorted((r != "embedding", name, r) for name, r in roles.items() if r != "attention")
    for _, name, role in jobs:
        m = modules[name]
        layer = build(name, m, role)
        for pname, p in list(layer.named_parameters(recurse=False)):
            old = getattr(m, pname)
            if id(old) in new:
                if get_spec(new[id(old)]) != get_spec(p):
                    raise ValueError(
                        f"tensor parallelism ({mode}): {name}.{pname} is tied to a weight another "
                        f"layer shards differently ({get_spec(new[id(old)])} vs {get_spec(p)}); "
                        f"untie it or give both the same role."
                    )
                setattr(layer, pname, new[id(old)])
            else:
                p.requires_grad_(old.requires_grad)
                new[id(old)] = p
        layer.train(m.training)
        if role == "head":
            head = layer
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, layer)
    return new, head

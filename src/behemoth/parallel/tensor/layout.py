"""Pure shard math shared by every tensor-parallel mode (1D, 2D, 2.5D, 3D): where a rank's
shard sits in the serial tensor (:func:`shard_blocks`, :func:`shard_rectangles`), how to cut it
(:func:`shard_tensor`) and put it back (:func:`place_shard`).

A sharded parameter carries a :class:`ShardSpec` (``param._bh_shard``) that says how its
local tensor sits inside the serial tensor: for each sharded dim, which mesh axes split it
(outermost first) and this rank's index along them. Everything that must see the serial
model -- ``engine.full_state_dict()``, checkpoints, the global gradient norm -- reads the
spec; nothing reads a mode's internals.

Contract for every tensor-parallel layer (all modes):
* its parameters are local shards, each with a ShardSpec (replicated ones have none or an
  empty ``dims``);
* after backward, each parameter's ``.grad`` is the *complete* gradient of its local shard
  for this rank's data (sums over tensor-parallel axes are done inside the layer, e.g. by
  routing a replicated parameter through ``comm.CopyToAxis``); the engine then only
  reduces over data parallelism;
* ``replicated_on`` lists the mesh axes over which the shard is identical on every member,
  so a global norm counts it once.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class DimShard:
    """Dim ``dim`` of the serial tensor is split into ``parts`` equal blocks; this rank holds
    block ``index``. ``axes`` names the mesh axes whose coordinates make up ``index``
    (outermost first) -- for the gather that rebuilds the serial tensor."""

    dim: int
    parts: int
    index: int
    axes: tuple[str, ...]


@dataclass(frozen=True)
class ShardSpec:
    """How a local shard sits in the serial tensor.

    ``view_shape`` (optional) is a reshape of the serial tensor applied *before* blocking,
    for fused weights: a fused QKV weight ``[3h, h_in]`` is viewed as ``[3, h, h_in]`` and
    blocked on dim 1, so every rank holds matching q, k and v rows of its heads. ``dims``
    then index the view, and the local tensor is the blocked view reshaped back to
    ``[3h/p, h_in]``.
    """

    full_shape: tuple[int, ...]
    dims: tuple[DimShard, ...] = ()
    replicated_on: tuple[str, ...] = field(default=())
    view_shape: tuple[int, ...] | None = None
    fused_dim: int = 0
    """With ``view_shape``: the serial dim the view splits (0 for nn.Linear's fused output
    rows, 1 for transformers' Conv1D, whose weight is ``[in, out]``)."""

    def local_view_shape(self) -> tuple[int, ...]:
        shape = list(self.view_shape or self.full_shape)
        for d in self.dims:
            shape[d.dim] //= d.parts
        return tuple(shape)

    def local_shape(self) -> tuple[int, ...]:
        if self.view_shape is None:
            return self.local_view_shape()
        # The view splits serial dim ``fused_dim`` into ``extra + 1`` view dims and keeps the
        # others; merge those back. (2D also blocks a non-fused dim, e.g. h_in of QKV.)
        f, extra = self.fused_dim, len(self.view_shape) - len(self.full_shape)
        local = self.local_view_shape()
        return local[:f] + (math.prod(local[f : f + extra + 1]),) + local[f + extra + 1 :]


def check_divisible(what: str, size: int, parts: int, mode: str) -> None:
    """The error every mode raises, on every rank, before any collective."""
    if size % parts:
        raise ValueError(
            f"tensor parallelism ({mode}): {what} = {size} is not divisible by {parts}; "
            f"choose a model whose {what} is a multiple of {parts}, or a smaller tp degree."
        )


def check_block_width(who: str, x: torch.Tensor, full: int, q: int, what: str, layout: str) -> int:
    """This rank's block ``full / q`` of the last dim, after checking that ``x`` has it (``who``,
    ``what`` -- the size split: ``"hidden"``, ``"the hidden block in_features"`` -- and ``layout``
    named in the error)."""
    n = full // q
    if x.shape[-1] != n:
        raise ValueError(
            f"{who}: input's last dim is {x.shape[-1]}; expected {what}/q = {full}/{q} = {n} (layout {layout})."
        )
    return n


def check_linear_blocks(
    name: str,
    in_features: int,
    out_features: int,
    fused: int,
    weight_layout: str,
    in_parts: int,
    out_parts: int,
    mode: str,
) -> None:
    """A grid or cube Linear's arguments: ``weight_layout`` is ``"out_in"`` (``nn.Linear``) or
    ``"in_out"`` (transformers ``Conv1D``); the in features split into ``in_parts`` blocks, the out
    features into ``fused`` equal parts and each part into ``out_parts`` blocks."""
    if weight_layout not in ("out_in", "in_out"):
        raise ValueError(
            f"{name}: weight_layout={weight_layout!r} must be 'out_in' (nn.Linear) or 'in_out' (transformers Conv1D)."
        )
    check_divisible(f"{name} in_features", in_features, in_parts, mode)
    check_divisible(f"{name} out_features", out_features, fused, mode)
    part = f"{name} out_features/{fused} (per fused part)" if fused > 1 else f"{name} out_features"
    check_divisible(part, out_features // fused, out_parts, mode)


def block(t: torch.Tensor, dim: int, parts: int, index: int) -> torch.Tensor:
    """Block ``index`` of ``parts`` equal blocks of ``t`` along ``dim`` (a copy)."""
    if t.shape[dim] % parts:
        raise ValueError(f"dim {dim} of size {t.shape[dim]} is not divisible by {parts}")
    return t.chunk(parts, dim=dim)[index].clone()


def shard_tensor(full: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
    """This rank's shard of a serial tensor under ``spec``."""
    out = full.reshape(spec.view_shape) if spec.view_shape else full
    for d in spec.dims:
        out = block(out, d.dim, d.parts, d.index)
    return out.reshape(spec.local_shape()).contiguous()


def set_spec(param: torch.nn.Parameter, spec: ShardSpec) -> torch.nn.Parameter:
    if tuple(param.shape) != spec.local_shape():
        raise AssertionError(f"shard of shape {tuple(param.shape)} does not match spec {spec}")
    param._bh_shard = spec
    return param


def get_spec(param: torch.Tensor) -> ShardSpec | None:
    return getattr(param, "_bh_shard", None)


def is_sharded(spec: ShardSpec | None) -> bool:
    """Whether ``spec`` splits any dim (a parameter without a spec, or with no dims, is replicated)."""
    return spec is not None and len(spec.dims) > 0


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


def with_indices(spec: ShardSpec, indices: list[int]) -> ShardSpec:
    """``spec`` as another rank holds it: the same blocking, block ``indices[i]`` along ``spec.dims[i]``."""
    dims = tuple(DimShard(d.dim, d.parts, i, d.axes) for d, i in zip(spec.dims, indices))
    return ShardSpec(spec.full_shape, dims, spec.replicated_on, spec.view_shape, spec.fused_dim)


def shard_copies(spec: ShardSpec, tp_size: int) -> int:
    """How many tp ranks hold this same shard (tp_size / number of distinct shards; a dim split
    over ``ep``, an expert shard, does not split it over tp)."""
    return max(1, tp_size // math.prod(d.parts for d in spec.dims if d.axes != ("ep",)))

"""Pure shard math shared by every tensor-parallel mode (1D, 2D, 2.5D, 3D).

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

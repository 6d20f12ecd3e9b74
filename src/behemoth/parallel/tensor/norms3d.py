"""3D tensor parallelism's norms: LayerNorm and RMSNorm of a ``[b, S, h]`` activation block of
the cube (:mod:`.tp3d`'s layouts), their statistics all-reduced over the layout's hidden axis
(tp_col canonical, tp_row swapped) and their weight and bias the hidden block, replicated over the
other two axes (gradients summed there).

Tested in tests/dist/test_tp3d_layers.py (world 8, q = 2) against the serial norms in float64.
"""

from __future__ import annotations

import torch
from torch import nn

from .functional import ShardedNormFn, autocast_dtype, replicated
from .layout import DimShard, ShardSpec, check_divisible, set_spec
from .serial import copy_shards
from .tp3d import MODE, cube_of, layout_name

__all__ = ["LayerNorm3D", "RMSNorm3D"]


class _Norm3D(nn.Module):
    RMS = False

    def __init__(
        self,
        hidden: int,
        mesh,
        *,
        eps: float | None = 1e-5,
        weight: bool = True,
        bias: bool = True,
        swapped: bool = False,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        name = type(self).__name__
        cube = self.cube = cube_of(mesh, name)
        check_divisible(f"{name} hidden size", hidden, cube.q, MODE)
        lay = self.layout = cube.layout(swapped)
        self.hidden, self.eps, self.swapped = hidden, eps, swapped
        spec = ShardSpec(
            (hidden,),
            (DimShard(0, cube.q, lay.hidden.rank, (lay.hidden.name,)),),
            (lay.depth.name, lay.inner.name) if cube.q > 1 else (),
        )
        kw = dict(device=device, dtype=dtype)
        self.weight = set_spec(nn.Parameter(torch.ones(hidden // cube.q, **kw)), spec) if weight else None
        self.bias = set_spec(nn.Parameter(torch.zeros(hidden // cube.q, **kw)), spec) if bias else None

    def forward(self, x_bSh: torch.Tensor) -> torch.Tensor:
        lay, n = self.layout, self.hidden // self.cube.q
        if x_bSh.shape[-1] != n:
            raise ValueError(
                f"{type(self).__name__}: input's last dim is {x_bSh.shape[-1]}; expected hidden/q = "
                f"{self.hidden}/{self.cube.q} = {n} (layout {layout_name(self.swapped)})."
            )
        w = None if self.weight is None else replicated(self.weight, lay.inner, lay.depth)
        b = None if self.bias is None else replicated(self.bias, lay.inner, lay.depth)
        eps = self.eps if self.eps is not None else torch.finfo(x_bSh.dtype).eps
        y = ShardedNormFn.apply(x_bSh, w, b, eps, lay.hidden, self.hidden, self.RMS)
        keep_fp32 = not self.RMS and autocast_dtype(x_bSh) is not None  # as nn.LayerNorm under autocast
        return y if keep_fp32 else y.to(x_bSh.dtype)

    def extra_repr(self) -> str:
        return f"hidden={self.hidden}, q={self.cube.q}, eps={self.eps}, swapped={self.swapped}"


class LayerNorm3D(_Norm3D):
    """LayerNorm of ``[b, s, h]`` over the full hidden dim: statistics all-gathered over the
    layout's hidden axis (tp_col; tp_row when ``swapped``), backward sums all-reduced there.
    Weight and bias: the hidden block, replicated over the other two axes (gradients summed)."""

    @classmethod
    def from_serial(cls, module: nn.LayerNorm, mesh, *, swapped: bool = False):
        if len(module.normalized_shape) != 1:
            raise ValueError(
                f"{cls.__name__}: only a 1-D normalized_shape is supported; got {module.normalized_shape}."
            )
        p = next(module.parameters(), None)
        kw = dict(device=p.device, dtype=p.dtype) if p is not None else {}
        layer = cls(
            module.normalized_shape[0],
            mesh,
            eps=module.eps,
            weight=module.weight is not None,
            bias=module.bias is not None,
            swapped=swapped,
            **kw,
        )
        copy_shards(layer, module)
        return layer


class RMSNorm3D(_Norm3D):
    """RMSNorm of ``[b, s, h]``: ``x / sqrt(mean(x^2) + eps) * weight``, the mean over the full
    hidden dim (one all-reduce over the layout's hidden axis), computed in at least float32."""

    RMS = True

    def __init__(
        self, hidden: int, mesh, *, eps: float | None = 1e-5, swapped: bool = False, device=None, dtype=None
    ) -> None:
        super().__init__(hidden, mesh, eps=eps, weight=True, bias=False, swapped=swapped, device=device, dtype=dtype)

    @classmethod
    def from_serial(cls, module: nn.Module, mesh, *, swapped: bool = False):
        """``nn.RMSNorm``, behemoth's Llama ``RMSNorm`` or transformers' ``LlamaRMSNorm``."""
        eps = getattr(module, "eps", getattr(module, "variance_epsilon", None))
        w = module.weight
        layer = cls(w.shape[0], mesh, eps=eps, swapped=swapped, device=w.device, dtype=w.dtype)
        copy_shards(layer, module)
        return layer

"""3D tensor parallelism's norms: LayerNorm and RMSNorm of a ``[b, S, h]`` activation block of
the cube (:mod:`.tp3d`'s layouts), their statistics all-reduced over the layout's hidden axis
(tp_col canonical, tp_row swapped) and their weight and bias the hidden block, replicated over the
other two axes (gradients summed there).

Tested in tests/dist/test_tp3d_layers.py (world 8, q = 2) against the serial norms in float64.
"""

from __future__ import annotations

import torch

from .functional import replicated
from .layout import DimShard, ShardSpec, check_block_width, check_divisible
from .serial import layer_norm_from_serial, rms_norm_from_serial
from .sharded_norm import ShardedNorm
from .tp3d import MODE, cube_of, layout_name

__all__ = ["LayerNorm3D", "RMSNorm3D"]


class _Norm3D(ShardedNorm):
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
        name = type(self).__name__
        cube = cube_of(mesh, name)
        check_divisible(f"{name} hidden size", hidden, cube.q, MODE)
        lay = cube.layout(swapped)
        spec = ShardSpec(
            (hidden,),
            (DimShard(0, cube.q, lay.hidden.rank, (lay.hidden.name,)),),
            (lay.depth.name, lay.inner.name) if cube.q > 1 else (),
        )
        super().__init__(hidden, spec, eps=eps, weight=weight, bias=bias, device=device, dtype=dtype)
        self.cube, self.layout, self.swapped = cube, lay, swapped

    def forward(self, x_bSh: torch.Tensor) -> torch.Tensor:
        lay = self.layout
        check_block_width(type(self).__name__, x_bSh, self.hidden, self.cube.q, "hidden", layout_name(self.swapped))
        w = None if self.weight is None else replicated(self.weight, lay.inner, lay.depth)
        b = None if self.bias is None else replicated(self.bias, lay.inner, lay.depth)
        return self.normalize(x_bSh, w, b, lay.hidden)

    def extra_repr(self) -> str:
        return f"hidden={self.hidden}, q={self.cube.q}, eps={self.eps}, swapped={self.swapped}"


class LayerNorm3D(_Norm3D):
    """LayerNorm of ``[b, s, h]`` over the full hidden dim: statistics all-gathered over the
    layout's hidden axis (tp_col; tp_row when ``swapped``), backward sums all-reduced there.
    Weight and bias: the hidden block, replicated over the other two axes (gradients summed).
    ``from_serial(module, mesh, *, swapped=False)``."""

    from_serial = classmethod(layer_norm_from_serial)


class RMSNorm3D(_Norm3D):
    """RMSNorm of ``[b, s, h]``: ``x / sqrt(mean(x^2) + eps) * weight``, the mean over the full
    hidden dim (one all-reduce over the layout's hidden axis), computed in at least float32.
    ``from_serial(module, mesh, *, swapped=False)``."""

    RMS = True

    def __init__(
        self, hidden: int, mesh, *, eps: float | None = 1e-5, swapped: bool = False, device=None, dtype=None
    ) -> None:
        super().__init__(hidden, mesh, eps=eps, weight=True, bias=False, swapped=swapped, device=device, dtype=dtype)

    from_serial = classmethod(rms_norm_from_serial)

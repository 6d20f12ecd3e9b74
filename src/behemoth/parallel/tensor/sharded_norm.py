"""What the grid's norms (2D, 2.5D: :class:`.tp2d.Norm2D`) and the cube's (3D: :mod:`.norms3d`)
share: LayerNorm or RMSNorm of an activation block whose hidden dim is split into q blocks over
one mesh axis, their weight and bias the hidden block (:class:`ShardedNorm`). Each mode places
the blocks (their ShardSpec), routes the replicated weight and bias through its own axes and
names the axis the statistics are reduced over; the statistics and the dtype rule are here, in
:class:`~.functional.ShardedNormFn` (one collective forward, one backward).

Tested in tests/dist/test_tp2d_layers.py and tests/dist/test_tp3d_layers.py against the serial
norms in float64.
"""

from __future__ import annotations

import torch
from torch import nn

from ...comm import Axis
from .functional import ShardedNormFn, autocast_dtype
from .layout import ShardSpec, set_spec

__all__ = ["ShardedNorm"]


class ShardedNorm(nn.Module):
    """The common part of a norm over a hidden dim split into q blocks: the weight (ones) and
    bias (zeros) blocks with ``spec`` and the normalisation. A subclass builds ``spec`` from its
    layout, checks its input (:func:`~.layout.check_block_width`) and calls :meth:`normalize`
    with its axes."""

    RMS = False
    """RMSNorm (True) or LayerNorm (False)."""

    def __init__(
        self, hidden: int, spec: ShardSpec, *, eps: float | None, weight: bool, bias: bool, device=None, dtype=None
    ) -> None:
        super().__init__()
        self.hidden, self.eps = hidden, eps
        n, kw = spec.local_shape()[0], dict(device=device, dtype=dtype)
        self.weight = set_spec(nn.Parameter(torch.ones(n, **kw)), spec) if weight else None
        self.bias = set_spec(nn.Parameter(torch.zeros(n, **kw)), spec) if bias else None

    def normalize(self, x: torch.Tensor, w, b, axis: Axis, param_axis: Axis | None = None, defer=None) -> torch.Tensor:
        """:class:`~.functional.ShardedNormFn` of ``x`` with statistics over ``axis`` (``param_axis``,
        ``defer``: as there), in ``x``'s dtype -- a LayerNorm's in float32 under autocast, as
        ``nn.LayerNorm``'s."""
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        y = ShardedNormFn.apply(x, w, b, eps, axis, self.hidden, self.RMS, param_axis, defer)
        keep_fp32 = not self.RMS and autocast_dtype(x) is not None  # as nn.LayerNorm under autocast
        return y if keep_fp32 else y.to(x.dtype)

"""Norms that read the output of a tensor-parallel projection (q / k norms), which every mode
splits by heads: this rank holds a block of the projection's features.

* :class:`ProjectionNorm`: a norm over the *whole* output of the projection (OLMoE's ``q_norm`` /
  ``k_norm`` normalise the whole q / k projection, every head together; role ``colwise_norm``).
  The statistics are the serial ones, this rank's sum of squares (LayerNorm: its block's mean and
  M2) in at least float32, as the serial norm computes its variance, combined over the axis that
  splits the features (:class:`~.functional.ShardedNormFn`: one all-reduce forward, one backward).
  1D builds it (the grid modes' own norms are this norm on their layouts: 2D's on the residual
  stream's, 3D's on the swapped one; 2D uses it for a replicated kv head);
* :func:`make_head_norm`: a norm over each head (Qwen3's, a weight of one head's width; role
  ``head_norm``), every mode: the module stays itself with its whole weight, and since each rank
  normalises only its own heads (and, in the grid modes, its batch block), the weight's gradient is
  summed over the whole tp group.

Tested in tests/dist/test_tp_qk_norms.py (the layer against the serial norm in float64, whole
models against serial training).
"""

from __future__ import annotations

import torch
from torch import nn

from ...comm import Axis
from .functional import ShardedNormFn, autocast_dtype, replicated, replicated_parameters


class ProjectionNorm(nn.Module):
    """An RMSNorm (``rms``) or a LayerNorm over the whole output of a projection whose features
    ``axis`` splits: input ``[..., W/p]`` (this rank's block), output the same block of the
    serial norm's output. ``weight`` / ``bias`` are this rank's block of the serial ones; their
    gradients are the block's, complete on this rank except over ``param_axes``, the axes the
    block is replicated over and split the tokens (2D: the grid column; none in 1D, where every
    rank sees every token of its features, with or without sequence parallelism), where they are
    summed. ``rows``: a replicated kv head (the k norm of an attention with fewer kv heads K than
    ``axis`` has members) -- the parameters are the whole serial ones (``param_axes`` then
    includes ``axis``: each kv head's gradient comes from the members that normalise it) and this
    rank normalises features ``rows[0]:rows[1]``; the members then hold the whole width p / K
    times over, which the mean divides out.

    RMS: ``weight * x_hat.to(x.dtype)``, as transformers' OLMoE and Llama RMSNorms compute it, so
    the output has their dtype, ``promote(x, weight)``; LayerNorm: float32 under autocast (as
    ``nn.LayerNorm``), else the input's dtype."""

    def __init__(
        self,
        weight: nn.Parameter | None,
        bias: nn.Parameter | None,
        *,
        axis: Axis,
        eps: float | None,
        rms: bool,
        param_axes: tuple[Axis, ...] = (),
        rows: tuple[int, int] | None = None,
        name: str = "",
    ) -> None:
        super().__init__()
        self.register_parameter("weight", weight)
        self.register_parameter("bias", bias)
        self.axis, self.eps, self.rms, self.param_axes, self.rows, self.name = axis, eps, rms, param_axes, rows, name

    @torch.compiler.disable  # collectives stay eager in compiled blocks
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = None if self.weight is None else replicated(self.weight, *self.param_axes)
        b = None if self.bias is None else replicated(self.bias, *self.param_axes)
        if self.rows is not None:
            lo, hi = self.rows
            w, b = (None if w is None else w[lo:hi]), (None if b is None else b[lo:hi])
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        width = x.shape[-1] * self.axis.size  # the whole width (replicated kv heads: p / K copies of it)
        if self.rms:
            y = ShardedNormFn.apply(x, None, None, eps, self.axis, width, True).to(x.dtype)
            return y if w is None else w * y
        y = ShardedNormFn.apply(x, w, b, eps, self.axis, width, False)
        return y if autocast_dtype(x) is not None else y.to(x.dtype)

    def extra_repr(self) -> str:
        kind = "rms" if self.rms else "layer"
        return f"{kind} norm over {self.axis.name} (size {self.axis.size}), eps={self.eps}, rows={self.rows}"


def make_head_norm(module: nn.Module, tp: Axis) -> nn.Module:
    """Make a norm (any class) that acts on each head of a tp-split projection sum its
    parameters' gradients over the tp group ``tp``: each rank normalises only its own heads
    (grid modes: of its batch block), so its gradient is their share. The parameters go through
    CopyToAxis for each call that records a graph (:func:`~.functional.replicated_parameters`);
    the module's own forward does the math and its state-dict keys do not change."""
    inner = module.forward

    def forward(*args, **kwargs):
        if not torch.is_grad_enabled():
            return inner(*args, **kwargs)
        with replicated_parameters(module, tp):
            return inner(*args, **kwargs)

    module.forward = forward
    return module

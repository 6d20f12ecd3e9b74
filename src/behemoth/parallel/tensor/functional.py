"""The autograd functions and dtype rules every tensor-parallel mode builds its layers from.

* :func:`autocast_dtype`, :func:`cast_to`, :func:`compute_dtype`: which dtype a layer computes
  and communicates in under autocast (shards are cast before they travel: half the bytes);
* :func:`replicated`: route a parameter replicated over some axes through ``CopyToAxis``, so
  its gradient is summed there (:func:`replicated_parameters`: every parameter of a module);
* :class:`ShardedNormFn`: LayerNorm / RMSNorm over a hidden dim split across one axis
  (2D, 2.5D, 3D);
* :class:`VocabParallelCrossEntropy`: cross-entropy of logits split on the vocabulary over
  one axis (every mode), so no rank materialises the full logits.

All communication goes through :mod:`behemoth.comm`. Tested through every mode's layer tests
(tests/dist/test_tp1d.py, test_tp2d_layers.py, test_tp3d_layers.py) against serial layers.
"""

from __future__ import annotations

import contextlib

import torch

from ... import comm
from ...comm import Axis

IGNORE_INDEX = -100


def autocast_dtype(t: torch.Tensor) -> torch.dtype | None:
    """The dtype autocast would run a Linear in on ``t``'s device, or None when it is off."""
    dev = t.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else None


def cast_to(t: torch.Tensor | None, dtype: torch.dtype | None) -> torch.Tensor | None:
    """``t`` in ``dtype`` (an autograd op) if both are given and ``t`` is floating point."""
    return t.to(dtype) if t is not None and dtype is not None and t.is_floating_point() else t


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype statistics and losses are computed in: ``x``'s, at least float32."""
    return torch.promote_types(x.dtype, torch.float32)


def replicated(p: torch.Tensor, *axes: Axis) -> torch.Tensor:
    """Route a parameter replicated over ``axes`` through CopyToAxis (identity forward,
    all-reduce of the gradient backward), so its gradient is summed there. Axes of size 1
    are skipped (no autograd node, no gradient copy)."""
    for a in axes:
        if not a.trivial:
            p = comm.CopyToAxis.apply(p, a)
    return p


@contextlib.contextmanager
def replicated_parameters(module: torch.nn.Module, *axes: Axis):
    """For the duration, each of ``module``'s own Parameters is its :func:`replicated` view over
    ``axes`` (identity forward, gradient summed there), so the module's own forward, run inside,
    sums its parameters' gradients over ``axes``; state-dict keys do not change."""
    saved = {n: p for n, p in module._parameters.items() if p is not None}
    try:
        for n, p in saved.items():
            module._parameters[n] = replicated(p, *axes)
        yield
    finally:
        module._parameters.update(saved)


class ShardedNormFn(torch.autograd.Function):
    """LayerNorm (``rms=False``) or RMSNorm (``rms=True``) over a hidden dim split across
    ``axis`` (2D, 2.5D: tp_col; 3D: the layout's hidden axis), in at least float32. Forward:
    LayerNorm all-gathers each shard's (mean, M2) and combines them (Chan et al.), RMSNorm
    all-reduces the sum of squares: one collective. Backward: all-reduce ``sum(g)`` and
    ``sum(g * xhat)`` (rms: only the latter). ``weight``/``bias`` grads are local, unless
    ``param_axis`` names the axis they are replicated over: then one all-reduce of both over it,
    started before the statistics' all-reduce and waited after it, sums them there. ``defer``
    (``(GradPass, weight index, bias index, node)``, :mod:`.deferred_grads`): instead, both
    gradients are handed to the pass's bucket unsummed and zero placeholders are returned for
    ``weight`` and ``bias``."""

    @staticmethod
    def forward(
        ctx, x, weight, bias, eps, axis: Axis, hidden: int, rms: bool, param_axis: Axis | None = None, defer=None
    ):
        xc = x.to(compute_dtype(x))
        if rms:
            ms = comm.all_reduce(xc.pow(2).sum(-1), axis) / hidden
            mean, rstd = None, torch.rsqrt(ms + eps)
            xhat = xc * rstd[..., None]
        else:
            m = xc.mean(-1)
            stats = torch.stack([m, (xc - m[..., None]).pow(2).sum(-1)])
            stats = comm.all_gather(stats, axis, 0).view(axis.size, 2, *m.shape)
            mean = stats[:, 0].mean(0)
            m2 = stats[:, 1].sum(0) + xc.shape[-1] * (stats[:, 0] - mean).pow(2).sum(0)
            rstd = torch.rsqrt(m2 / hidden + eps)
            xhat = (xc - mean[..., None]) * rstd[..., None]
        y = xhat if weight is None else xhat * weight
        if bias is not None:
            y = y + bias
        ctx.axis, ctx.hidden, ctx.rms, ctx.param_axis, ctx.defer = axis, hidden, rms, param_axis, defer
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.save_for_backward(x, weight, mean, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, mean, rstd = ctx.saved_tensors
        xc = x.to(rstd.dtype)
        xhat = (xc if ctx.rms else xc - mean[..., None]) * rstd[..., None]
        dy = dy.to(rstd.dtype)
        dx = dw = db = None
        n = xhat.shape[-1]
        if weight is not None and ctx.needs_input_grad[1]:
            dw = (dy * xhat).reshape(-1, n).sum(0).to(weight.dtype)
        if ctx.needs_input_grad[2]:
            db = dy.reshape(-1, n).sum(0).to(ctx.bias_dtype)
        grads = [t for t in (dw, db) if t is not None]
        pending = None
        if ctx.param_axis is not None and grads:  # summed where the parameters are replicated
            defer = None if ctx.defer is None else ctx.defer[0].active(ctx.defer)
            if defer is not None:  # in the pass's bucket, landed later
                gp, wi, bi, _ = defer
                for i, t in ((wi, dw), (bi, db)):
                    if t is not None:
                        gp.add(i, t, ctx.param_axis)
                dw = None if dw is None else gp.placeholder(wi)
                db = None if db is None else gp.placeholder(bi)
            else:
                pending = comm.all_reduce(
                    torch.cat(grads) if len(grads) > 1 else grads[0], ctx.param_axis, async_op=True
                )
        if ctx.needs_input_grad[0]:
            g = dy if weight is None else dy * weight
            if ctx.rms:
                s = comm.all_reduce((g * xhat).sum(-1), ctx.axis)[..., None] / ctx.hidden
                dx = (g - xhat * s) * rstd[..., None]
            else:
                s = comm.all_reduce(torch.stack([g.sum(-1), (g * xhat).sum(-1)]), ctx.axis) / ctx.hidden
                dx = (g - s[0][..., None] - xhat * s[1][..., None]) * rstd[..., None]
            dx = dx.to(x.dtype)
        if pending is not None:
            summed = pending.wait()
            if dw is not None and db is not None:
                dw, db = summed[:n].to(dw.dtype), summed[n:].to(db.dtype)
            elif dw is not None:
                dw = summed
            else:
                db = summed
        return dx, dw, db, None, None, None, None, None, None


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy of logits ``[..., V/p]`` split on the vocabulary over ``axis``
    (this rank holds vocabulary rows ``[vocab_start, vocab_start + V/p)``), computed in at
    least float32 and complete on every member of ``axis``. Forward: all-reduce (max) of the
    row maxima ``[...]``, then one all-reduce (sum) of ``[target logit, sum of exp]``
    ``[2, ...]``. Backward: no communication -- ``(softmax - one_hot) * grad`` on this rank's
    vocabulary slice. Labels equal to ``ignore_index`` count 0."""

    @staticmethod
    def forward(ctx, logits, labels, axis: Axis, vocab_start: int, ignore_index: int):
        z = logits.to(compute_dtype(logits))
        v = z.shape[-1]
        zmax = comm.all_reduce(z.max(-1).values, axis, op="max")
        z = z - zmax[..., None]
        local = labels - vocab_start
        mine = (local >= 0) & (local < v) & (labels != ignore_index)
        local = local.masked_fill(~mine, 0)
        target = z.gather(-1, local[..., None]).squeeze(-1).masked_fill(~mine, 0.0)
        probs = z.exp_()
        sums = comm.all_reduce(torch.stack([target, probs.sum(-1)]), axis)
        valid = labels != ignore_index
        loss = (sums[1].log() - sums[0]).masked_fill(~valid, 0.0)
        probs.div_(sums[1][..., None])
        ctx.save_for_backward(probs, local, mine, valid)
        ctx.in_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, dloss):
        probs, local, mine, valid = ctx.saved_tensors
        grad = probs.clone()
        grad.scatter_add_(-1, local[..., None], -mine[..., None].to(grad.dtype))
        grad.mul_((dloss * valid)[..., None].to(grad.dtype))
        return grad.to(ctx.in_dtype), None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, axis: Axis, vocab_start: int, ignore_index: int = IGNORE_INDEX
) -> torch.Tensor:
    """Per-token losses (shape of ``labels``; 0 where ``labels == ignore_index``) of logits
    whose last dim holds vocabulary rows ``[vocab_start, vocab_start + V/p)`` of ``axis``'s
    members; see :class:`VocabParallelCrossEntropy`."""
    return VocabParallelCrossEntropy.apply(logits, labels, axis, vocab_start, ignore_index)

"""Functional collectives for forwards without autograd (generation's prefill and decode steps).

Out of place, not differentiable, and traceable by ``torch.compile`` (PyTorch's
``_c10d_functional`` ops): a compiled decode step keeps its collectives inside one graph,
CUDA graphs included, where the eager collectives of :mod:`.collectives` would cut it. They
read no clock, so they add no graph guard; each call is booked in its axis's ledger when it
runs eagerly (payload and wire bytes as :mod:`.collectives` books them; no blocked time: the
wait is the stream's, not the host's), and not when it runs inside a compiled graph. An axis of
size 1 short-circuits every call.

Test: tests/dist/test_generate_decode.py (the ledger's calls per decode step under tp = 2, and a
``fullgraph`` compile of the decode step).
"""

from __future__ import annotations

import torch

from .axis import Axis, nbytes
from .oneshot import one_shot_for


def all_reduce_functional(t: torch.Tensor, axis: Axis) -> torch.Tensor:
    """Sum ``t`` over ``axis`` into a new tensor (``t`` is not modified). Ledger as
    :func:`~.collectives.all_reduce`. Inside :func:`~.oneshot.one_shot_all_reduce` for
    ``axis``, a small CUDA tensor goes through the one-shot all-reduce instead (booked alike)."""
    if axis.trivial:
        return t
    if not torch.compiler.is_compiling():
        n = axis.size
        axis.ledger.record(axis.name, "all_reduce", nbytes(t), 2 * (n - 1) / n * nbytes(t))
    one_shot = one_shot_for(axis, t)  # None unless switched on for this axis (oneshot.py) and t is small
    if one_shot is not None:
        return one_shot(t)
    out = torch.ops._c10d_functional.all_reduce(t.contiguous(), "sum", axis.group.group_name)
    return torch.ops._c10d_functional.wait_tensor(out)


def all_gather_functional(t: torch.Tensor, axis: Axis, dim: int = 0) -> torch.Tensor:
    """Concatenate every member's ``t`` along ``dim`` into a new tensor. Ledger as
    :func:`~.collectives.all_gather`."""
    if axis.trivial:
        return t
    n = axis.size
    dim = dim % t.dim()
    src = t.movedim(dim, 0).contiguous()
    if not torch.compiler.is_compiling():
        axis.ledger.record(axis.name, "all_gather", n * nbytes(src), (n - 1) * nbytes(src))
    out = torch.ops._c10d_functional.all_gather_into_tensor(src, n, axis.group.group_name)
    # member blocks stacked on the leading (moved) dim: moving it back concatenates them on ``dim``
    return torch.ops._c10d_functional.wait_tensor(out).movedim(0, dim)

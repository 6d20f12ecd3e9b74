"""The serial model's gradient norm from one rank's ZeRO chunks: the one norm of every plan.

Each rank holds pieces of the gradients: its shards of the chunks (stages 1-3), tensor-parallel
shards or copies of each parameter, one pipeline stage's parameters, expert parameters split over
``ep``. :class:`GradNorm` weighs each parameter piece in a chunk shard 1/(its copies over tp) (1 in
a chunk sharded over tp too: an MoE block's under tensor parallelism),
weighs a tied copy counted on another rank 0, and sums the squared norms over the axes the
gradients are split on (the data axis at stages 1-3, an expert chunk's own axis at stage 0, tp,
the pipeline's axes), so the result is the serial model's norm on every rank.
:class:`.optimizer.ZeroOptimizer` clips with it.

Communication: one all-reduce of one float per axis summed over (:meth:`GradNorm.total`).

Test: ``pytest tests/dist/test_zero.py`` (norms against the serial model's, under dp x tp).
"""

from __future__ import annotations

import torch

from ... import comm
from ...comm import Axis
from ..tensor import get_spec, is_sharded, shard_copies
from .chunks import ChunkLayout

__all__ = ["GradNorm"]


class GradNorm:
    """The squared gradient norm of this rank's chunk shards, weighted and summed to the serial
    model's norm. ``ranks[c]``: whose shard of chunk ``c`` this rank holds; ``batched``: read
    every unread chunk in one multi-tensor norm per accumulator (stage 0 on the device);
    ``shard_axes``: at stage 0, per chunk, the axis its parameters are sharded over, or None;
    ``split_over_tp``: at stages 1-3, per chunk, whether its shards split it over tp as well (an MoE
    block's parameters under tensor parallelism, sharded over the data axis times tp)."""

    def __init__(
        self,
        layout: ChunkLayout,
        params: list[torch.nn.Parameter],
        ranks: list[int],
        *,
        stage: int,
        axis: Axis,
        tp: Axis,
        device: torch.device,
        batched: bool,
        shard_axes: list[Axis | None] | None,
        split_over_tp: list[bool] | None = None,
    ) -> None:
        self.layout, self.params, self.ranks = layout, params, ranks
        self.split_over_tp = split_over_tp
        self.stage, self.axis, self.tp, self.device = stage, axis, tp, device
        self.batched = batched
        self.shard_axes = shard_axes
        self.axes: list[Axis] = [] if tp.trivial else [tp]
        """The axes the squared norm is summed over besides the data axis (tp, pipeline stages);
        the fp16 overflow vote is taken over the same ones."""
        self.skip: set[int] = set()
        self.weights = self._piece_weights() if not tp.trivial else None
        self._weight_cache: dict[tuple, torch.Tensor] = {}  # _norm_sq_of's piece weights, on their device

    def _piece_weights(self) -> list[list[tuple[int, int, float]]]:
        """Per chunk, runs ``(shard offset, length, weight)`` of parameter pieces in this rank's shard,
        weighted 1/(copies of that piece over tp) so a sum over tp counts each element once; a
        parameter counted elsewhere (:meth:`configure`) weighs 0; a chunk sharded over tp too
        (``split_over_tp``: its shards are distinct pieces on every tp rank) weighs 1."""
        out = []
        for ch in self.layout.chunks:
            runs = []
            whole = self.split_over_tp is not None and self.split_over_tp[ch.index]
            for sl in self.layout.shard_slices(ch.index, self.ranks[ch.index]):
                p = self.params[sl.param]
                spec = get_spec(p)
                w = 1.0 / (shard_copies(spec, self.tp.size) if is_sharded(spec) else self.tp.size)
                w = 1.0 if whole else w
                runs.append((sl.shard_offset, sl.length, 0.0 if id(p) in self.skip else w))
            out.append(runs)
        return out

    def configure(self, extra_axes: list[Axis], skip: list[torch.nn.Parameter]) -> None:
        """The serial model's norm when this rank holds only part of the model: also sum over
        ``extra_axes`` (pipeline stages), and leave out ``skip`` (a tied copy counted elsewhere)."""
        self.axes += [a for a in extra_axes if not a.trivial]
        self.skip = {id(p) for p in skip}
        self.weights = self._piece_weights()
        self._weight_cache.clear()

    def total(self, chunks, grads) -> torch.Tensor:
        """The serial model's gradient 2-norm from ``chunks`` and their reduced gradients ``grads``
        (None where a chunk has none): a collective over the sharded data axis, tp and the axes of
        :meth:`configure`."""
        sq = torch.zeros(1, dtype=torch.float32, device=self.device)
        sharded: dict[str, tuple[Axis, torch.Tensor]] = {}  # stage 0's expert chunks: summed over their axis
        for ax in self.shard_axes or ():
            if ax is not None and not ax.trivial:
                sharded.setdefault(ax.name, (ax, torch.zeros(1, dtype=torch.float32, device=self.device)))
        # Stage 0 on the device reads every chunk here: one multi-tensor norm per accumulator. Elsewhere
        # a chunk's part may be read early (as its reduction lands, by the CPU-update worker), so every
        # chunk's part is read alone, the same way, and the step's norm does not depend on where.
        unread: dict[tuple[int, torch.device], tuple[torch.Tensor, list]] = {}
        for st, g in zip(chunks, grads):
            if g is not None:  # parts read as the reductions landed (store) or by the CPU-update worker
                ax = self.shard_axes[st.index] if self.shard_axes else None
                acc = sharded[ax.name][1] if ax is not None and ax.name in sharded else sq
                if st.norm_sq is not None:
                    acc += st.norm_sq.to(self.device)
                elif self.batched:
                    unread.setdefault((id(acc), g.device), (acc, []))[1].append((st, g))
                else:
                    acc += self.norm_sq(st, g).to(self.device)
        for acc, items in unread.values():
            acc += self._norm_sq_of(items).to(self.device)
        for ax, part in sharded.values():
            sq += comm.all_reduce(part, ax)
        if self.stage:
            comm.all_reduce(sq, self.axis)
        for ax in self.axes:
            comm.all_reduce(sq, ax)
        return sq[0].sqrt()

    def norm_sq(self, st, g: torch.Tensor) -> torch.Tensor:
        """This rank's part of the squared gradient norm in ``g``, chunk ``st``'s gradient shard (0-d,
        on ``g``'s device)."""
        return self._norm_sq_of([(st, g)])

    def _norm_sq_of(self, items: list[tuple[object, torch.Tensor]]) -> torch.Tensor:
        """The weighted squared norm of the ``(chunk, gradient)`` pairs ``items`` (gradients on one
        device), 0-d on that device: one multi-tensor norm over every parameter piece and one
        weighted sum: a few kernels however many parameters the chunks hold. (A kernel per piece
        is hundreds of launches per step for a model of a billion parameters under tensor
        parallelism, issued after the backward's host sync while the device waits.)"""
        # vector_norm reads the shard once; square().sum() would write a shard-sized temporary
        # (on the host: fresh pages to fault in for every offloaded chunk, every step).
        if self.weights is None:
            norms = torch._foreach_norm([g for _, g in items])
            return torch.stack(norms).square().sum() if len(norms) > 1 else norms[0].square()
        pieces = [g.narrow(0, off, n) for st, g in items for off, n, _ in self.weights[st.index]]
        if not pieces:
            return torch.zeros((), device=items[0][1].device)
        device = items[0][1].device
        key = (device, tuple(st.index for st, _ in items))
        w = self._weight_cache.get(key)
        if w is None:
            w = torch.tensor(
                [w for st, _ in items for _, _, w in self.weights[st.index]], dtype=torch.float32, device=device
            )
            self._weight_cache[key] = w
        return (torch.stack(torch._foreach_norm(pieces)).square() * w).sum()

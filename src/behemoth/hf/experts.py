"""Import of mixture-of-experts tensors: a block of a fused expert tensor read from a transformers
checkpoint, expert by expert, touching only the experts (and rows) this rank holds.

behemoth and transformers 5 hold a MoE block's experts fused, ``gate_up_proj [E, 2I, H]`` (gate
rows, then up rows) and ``down_proj [E, H, I]``; transformers' ``save_pretrained`` writes them one
tensor per expert (Mixtral ``block_sparse_moe.experts.e.w1`` / ``w3`` / ``w2``, Qwen3-MoE and OLMoE
``mlp.experts.e.gate_proj`` / ``up_proj`` / ``down_proj``: :meth:`.names.Layout.targets`). An
:class:`ExpertSource` maps a rectangle of the fused tensor -- under expert parallelism the
experts ``first .. first + count - 1`` of ep rank r, whole -- onto those tensors: expert ``e``'s
rows ``[lo, hi)`` of ``gate_up_proj`` are rows of its gate tensor (``lo < I``) and of its up
tensor (``hi > I``), each read as an offset slice of the memory-mapped file. A checkpoint that
holds the fused tensor itself (:meth:`.names.Layout.fused_source`) is read there, its rectangle
in one slice.

Every rank checks every expert tensor's name and shape (:meth:`ExpertSource.problems`) before
anything is read. Pure but for the reads through :class:`.load.HFCheckpoint`; tested in
tests/dist/test_hf_import_moe.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .names import HFTensor, Layout

__all__ = ["ExpertSource"]


@dataclass(frozen=True)
class ExpertSource:
    """Where the fused expert tensor ``name`` of ``full_shape`` ``[E, R, C]`` is in a checkpoint:
    ``fused`` (its name, held whole) or ``parts`` (one :class:`~.names.HFTensor` per expert and
    chunk of its rows)."""

    name: str
    full_shape: tuple[int, ...]
    fused: str | None
    parts: tuple[HFTensor, ...]

    @classmethod
    def find(cls, layout: Layout, name: str, full_shape: tuple[int, ...], stored) -> ExpertSource:
        """The source of behemoth's fused tensor ``name``: the fused name when ``stored`` (a
        checkpoint's names) holds it, else the per-expert tensors."""
        fused = layout.fused_source(name)
        if fused is not None and fused not in stored:
            fused = None
        parts = () if fused is not None else tuple(layout.targets(name, full_shape))
        return cls(name, tuple(full_shape), fused, parts)

    def problems(self, shape_of) -> list[str]:
        """``"name: what is there (what the model needs)"`` for each missing or misshapen tensor
        (``shape_of(name)``: the stored shape, or None when missing)."""
        if self.fused is not None:
            got = shape_of(self.fused)
            return [] if got == self.full_shape else [f"{self.fused}: {got} (the model needs {self.full_shape})"]
        out = []
        for part in self.parts:
            want, got = part.shape(self.full_shape), shape_of(part.name)
            if got != want:
                what = "missing" if got is None else got
                out.append(
                    f"{part.name}: {what} (expert {part.expert} of {self.full_shape[0]}; the model needs {want})"
                )
        return out

    def read_into(self, view: torch.Tensor, offsets, sizes, read) -> None:
        """Fill ``view`` (the rectangle ``offsets`` / ``sizes`` of the fused tensor) from the
        checkpoint; ``read(name, offsets, sizes)`` reads one rectangle of a stored tensor."""
        if self.fused is not None:
            view.copy_(read(self.fused, offsets, sizes))
            return
        (e0, r0, c0), (ne, nr, nc) = offsets, sizes
        for part in self.parts:
            if not e0 <= part.expert < e0 + ne:
                continue
            i, n = part.chunk if part.chunk is not None else (0, 1)
            rows = self.full_shape[1] // n  # this part's rows of the expert: [i * rows, (i + 1) * rows)
            lo, hi = max(r0, i * rows), min(r0 + nr, (i + 1) * rows)
            if lo >= hi:
                continue
            block = read(part.name, (lo - i * rows, c0), (hi - lo, nc))
            view[part.expert - e0, lo - r0 : hi - r0].copy_(block)

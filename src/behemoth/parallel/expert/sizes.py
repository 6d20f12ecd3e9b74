"""The arithmetic of expert parallelism's split sizes, apart from moving any row: how many
assignments each expert gets (:func:`count_experts`, on the device without a host read), where
each block of received rows goes in the experts' grouped layout (:func:`block_shifts`,
:func:`placement`), which rows of that layout are padding (:func:`padding_rows`), and how a
layer's tokens split into chunks (:func:`chunk_sizes`). All but :func:`count_experts` are host
arithmetic on the sizes the host already read; :mod:`.dispatch` uses them to move the rows.

Pure and unit-tested (against a plain sort and regrouping) in tests/unit/test_expert_dispatch.py
and tests/unit/test_expert_routes.py.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["block_shifts", "chunk_sizes", "count_experts", "padding_rows", "placement"]


_UNIT: dict[torch.device, torch.Tensor] = {}
"""A one-element int64 one per device, expanded to count with (no kernel, no allocation)."""


def _ones(n: int, device: torch.device) -> torch.Tensor:
    unit = _UNIT.get(device)
    if unit is None:
        unit = _UNIT[device] = torch.ones(1, dtype=torch.int64, device=device)
    return unit.expand(n)


def count_experts(experts_A: torch.Tensor, num_bins: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Assignments per expert of the flat ``experts_A`` (values in ``[0, num_bins)``), int64, on
    ``experts_A``'s device: ``torch.bincount`` without its host read of the largest value.
    ``out``: ``num_bins`` zeros to add the counts to (a new tensor when None)."""
    if out is None:
        out = experts_A.new_zeros(num_bins, dtype=torch.int64)
    return out.scatter_add_(0, experts_A.long(), _ones(experts_A.numel(), experts_A.device))


def block_shifts(recv_counts_RL: list[list[int]], padded_L: list[int]) -> list[int]:
    """How far each block of received rows moves into the experts' layout: the rows arrive member
    by member, each member's in local-expert order (block ``r*L + l``: ``recv_counts_RL[r][l]``
    rows), and go to local expert l's group (``padded_L[l]`` rows, its rows from every member in
    member order, then its padding). Row i of block b lands at ``i + shift[b]``. Pure."""
    num_local = len(padded_L)
    group_start, at = [], 0
    for p in padded_L:
        group_start.append(at)
        at += p
    filled = [0] * num_local
    shifts, src = [], 0
    for row in recv_counts_RL:
        for l, c in enumerate(row):
            shifts.append(group_start[l] + filled[l] - src)
            filled[l] += c
            src += c
    return shifts


def padding_rows(counts_L: list[int], padded_L: list[int]) -> list[int]:
    """The rows of the experts' layout that are padding: group l (``padded_L[l]`` rows, after the
    groups before it) holds its ``counts_L[l]`` rows first, then its padding. Pure."""
    rows, at = [], 0
    for c, p in zip(counts_L, padded_L):
        rows.extend(range(at + c, at + p))
        at += p
    return rows


def placement(shifts: list[int], counts: list[int], pad_rows: list[int], pinned: bool = False) -> torch.Tensor:
    """The rows of the experts' layout the received rows go to -- row i of block b (``counts[b]``
    rows, the blocks in arrival order) at ``i + shifts[b]`` (:func:`block_shifts`) -- followed by
    ``pad_rows`` (:func:`padding_rows`), as one int64 host tensor (in pinned memory where
    ``pinned``, for a copy to the GPU that does not wait): made on the host, where the sizes
    are, so the device runs no kernel for it but the copy."""
    received = sum(counts)
    rows = np.empty(received + len(pad_rows), dtype=np.int64)
    np.add(np.repeat(np.asarray(shifts, dtype=np.int64), counts), np.arange(received), out=rows[:received])
    rows[received:] = pad_rows
    out = torch.from_numpy(rows)
    return out.pin_memory() if pinned else out


def chunk_sizes(num_tokens: int, chunks: int) -> list[int]:
    """Tokens in each of ``chunks`` contiguous runs of ``num_tokens`` tokens: as even as can be,
    the longer runs first (every rank makes the same number of runs, some maybe empty). Pure."""
    base, extra = divmod(num_tokens, chunks)
    return [base + (c < extra) for c in range(chunks)]

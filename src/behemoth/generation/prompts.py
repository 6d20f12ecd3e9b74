"""Prompts as generation sees them: left-padded rows, their masks and positions, and the rows
each rank holds. Pure functions of tensors and ints; no communication.

Tested in tests/unit/test_generate_sampling.py.
"""

from __future__ import annotations

import torch

__all__ = ["Prompts", "left_pad", "padded_rows", "positions"]


class Prompts:
    """A batch of prompts, left-padded: ``ids_BP`` and ``valid_BP`` (True: a real token)."""

    def __init__(self, ids_BP: torch.Tensor, valid_BP: torch.Tensor) -> None:
        self.ids_BP, self.valid_BP = ids_BP, valid_BP

    @property
    def rows(self) -> int:
        return self.ids_BP.shape[0]

    @property
    def length(self) -> int:
        return self.ids_BP.shape[1]


def left_pad(prompts, attention_mask: torch.Tensor | None, pad_token_id: int, multiple: int = 1) -> Prompts:
    """``prompts`` (a ``[B, P]`` tensor, left-padded where ``attention_mask`` is 0, or a list of
    token lists) as :class:`Prompts`, their length a multiple of ``multiple`` (more left padding)."""
    if isinstance(prompts, torch.Tensor):
        if prompts.dim() != 2 or prompts.shape[0] == 0 or prompts.shape[1] == 0:
            raise ValueError(f"input_ids of shape {tuple(prompts.shape)}: pass a [B, P] tensor with B, P >= 1.")
        ids = prompts.long()
        valid = torch.ones_like(ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        if valid.shape != ids.shape:
            raise ValueError(
                f"attention_mask {tuple(valid.shape)} must have the shape of input_ids {tuple(ids.shape)}."
            )
        # left padding: once a row's real tokens start they continue to its end
        if bool((valid[:, :-1] & ~valid[:, 1:]).any()) or not bool(valid[:, -1].all()):
            raise ValueError(
                "attention_mask must describe left padding (zeros, then ones up to the last column, in every "
                "row); pad prompts on the left, or pass them as a list of token lists."
            )
    else:
        rows = [list(map(int, p)) for p in prompts]
        if not rows or any(len(r) == 0 for r in rows):
            raise ValueError("prompts: pass a non-empty list of non-empty token lists (or a [B, P] tensor).")
        width = max(map(len, rows))
        ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
        valid = torch.zeros(len(rows), width, dtype=torch.bool)
        for i, r in enumerate(rows):
            ids[i, width - len(r) :] = torch.tensor(r, dtype=torch.long)
            valid[i, width - len(r) :] = True
    extra = -ids.shape[1] % multiple
    if extra:
        ids = torch.cat([ids.new_full((ids.shape[0], extra), pad_token_id), ids], 1)
        valid = torch.cat([valid.new_zeros((valid.shape[0], extra)), valid], 1)
    return Prompts(ids, valid)


def padded_rows(prompts: Prompts, multiple: int) -> Prompts:
    """``prompts`` with copies of its last row appended until its rows are a multiple of
    ``multiple`` (plans that split the batch need equal blocks; the copies' tokens are dropped)."""
    extra = -prompts.rows % multiple
    if not extra:
        return prompts
    ids = torch.cat([prompts.ids_BP, prompts.ids_BP[-1:].expand(extra, -1)], 0)
    valid = torch.cat([prompts.valid_BP, prompts.valid_BP[-1:].expand(extra, -1)], 0)
    return Prompts(ids, valid)


def positions(valid_BP: torch.Tensor) -> torch.Tensor:
    """Position ids of left-padded rows: the real tokens count from 0, padding reads 0."""
    return (valid_BP.long().cumsum(-1) - 1).clamp(min=0)

"""Where each token of a context-parallel sequence lives: pure layout math, no process group.

Tensors are ``[B, N, S_local, D]`` like ``F.scaled_dot_product_attention``; the engine splits
``input_ids``/``labels`` with the same helpers along dim 1:

=========  ===============================================================
mode       what rank ``r`` of ``cp`` holds of a sequence of length ``S``
=========  ===============================================================
ulysses    the contiguous chunk ``[r*S/cp, (r+1)*S/cp)``
ring       zigzag: the sequence cut into ``2*cp`` chunks of ``C = S/(2*cp)``;
           chunk ``r`` then chunk ``2*cp-1-r`` (so every rank does the same
           causal work; local positions stay increasing)
=========  ===============================================================

Unit-tested in ``tests/unit/test_context_layout.py``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

MODES = ("ulysses", "ring")


# ----------------------------------------------------------------------------- validation
def check_sequence(
    seq_len: int, cp: int, mode: str, num_heads: int | None = None, num_kv_heads: int | None = None
) -> None:
    """Raise ``ValueError`` (naming the numbers, the rule and a fix) when a sequence of
    ``seq_len`` tokens and the given head counts cannot be split ``cp`` ways in ``mode``.

    Rules: ``cp >= 1``; ulysses needs ``seq_len % cp == 0`` and ``num_heads % cp == 0``; ring
    needs ``seq_len % (2*cp) == 0``; grouped-query attention needs
    ``num_heads % num_kv_heads == 0`` in both modes. Fewer kv heads than ``cp`` is legal
    (Ulysses replicates them). Pure; call it on every rank before any collective."""
    if mode not in MODES:
        raise ValueError(f"context-parallel mode {mode!r} is not one of {list(MODES)}.")
    if not isinstance(cp, int) or isinstance(cp, bool) or cp < 1:
        raise ValueError(f"cp={cp!r}: the context-parallel degree must be an integer >= 1.")
    if seq_len < 1:
        raise ValueError(f"sequence length {seq_len} must be >= 1.")
    if mode == "ulysses" and seq_len % cp:
        raise ValueError(
            f"cp_mode='ulysses' needs the sequence length divisible by cp; got seq_len={seq_len}, "
            f"cp={cp} (remainder {seq_len % cp}). Pad or crop to a multiple of {cp}."
        )
    if mode == "ring" and seq_len % (2 * cp):
        raise ValueError(
            f"cp_mode='ring' needs the sequence length divisible by 2*cp={2 * cp} (zigzag chunks); "
            f"got seq_len={seq_len}, cp={cp} (remainder {seq_len % (2 * cp)}). "
            f"Pad or crop to a multiple of {2 * cp}."
        )
    if num_heads is not None and num_kv_heads is not None:
        if num_kv_heads < 1 or num_heads % num_kv_heads:
            raise ValueError(
                f"grouped-query attention needs num_heads divisible by num_kv_heads; got "
                f"num_heads={num_heads}, num_kv_heads={num_kv_heads}."
            )
    if mode == "ulysses" and num_heads is not None and num_heads % cp:
        raise ValueError(
            f"cp_mode='ulysses' splits attention heads over cp; got num_heads={num_heads}, cp={cp} "
            f"(remainder {num_heads % cp}). Use a cp that divides {num_heads}, or cp_mode='ring'."
        )


def _check_rank(cp: int, rank: int) -> None:
    if not 0 <= rank < cp:
        raise ValueError(f"rank={rank} is out of range for cp={cp} (0 <= rank < {cp}).")


# ----------------------------------------------------------------------------- positions
def zigzag_chunks(cp: int, rank: int) -> tuple[int, int]:
    """The two chunk indices (of ``2*cp``) that ring rank ``rank`` holds, in local order."""
    _check_rank(cp, rank)
    return rank, 2 * cp - 1 - rank


def zigzag_indices(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """Global positions (int64, increasing) of the ``seq_len/cp`` tokens ring rank ``rank`` holds:
    chunk ``rank`` then chunk ``2*cp-1-rank`` of ``2*cp`` equal chunks."""
    check_sequence(seq_len, cp, "ring")
    c = seq_len // (2 * cp)
    a, b = zigzag_chunks(cp, rank)
    return torch.cat([torch.arange(a * c, (a + 1) * c), torch.arange(b * c, (b + 1) * c)])


def position_ids_for(seq_len: int, cp: int, rank: int, mode: str) -> torch.Tensor:
    """Global positions (int64, ``[seq_len/cp]``) of this rank's local tokens in ``mode``'s layout;
    what RoPE or a learned position embedding must see instead of ``arange(S_local)``."""
    check_sequence(seq_len, cp, mode)
    _check_rank(cp, rank)
    if mode == "ring":
        return zigzag_indices(seq_len, cp, rank)
    n = seq_len // cp
    return torch.arange(rank * n, (rank + 1) * n)


# ----------------------------------------------------------------------------- split / gather
def split_sequence(x: torch.Tensor, dim: int, cp: int, rank: int, mode: str) -> torch.Tensor:
    """This rank's share of ``x`` along its sequence dim ``dim``: the contiguous chunk for
    ``"ulysses"`` (a view), chunks ``rank`` and ``2*cp-1-rank`` concatenated for ``"ring"``.
    Differentiable (slicing only); no communication."""
    s = x.shape[dim]
    check_sequence(s, cp, mode)
    _check_rank(cp, rank)
    if mode == "ulysses":
        n = s // cp
        return x.narrow(dim, rank * n, n)
    c = s // (2 * cp)
    a, b = zigzag_chunks(cp, rank)
    return torch.cat([x.narrow(dim, a * c, c), x.narrow(dim, b * c, c)], dim=dim)


def gather_sequence(parts: Sequence[torch.Tensor], dim: int, mode: str) -> torch.Tensor:
    """Inverse of :func:`split_sequence`: ``parts[r]`` is rank ``r``'s share (``cp = len(parts)``);
    returns the full sequence in natural order along ``dim``. Pure; the caller gathers the
    parts (e.g. ``comm.all_gather``) when they live on different ranks."""
    if mode not in MODES:
        raise ValueError(f"context-parallel mode {mode!r} is not one of {list(MODES)}.")
    cp = len(parts)
    if cp == 0:
        raise ValueError("gather_sequence needs at least one part.")
    if mode == "ulysses":
        return torch.cat(list(parts), dim=dim)
    s_local = parts[0].shape[dim]
    if s_local % 2:
        raise ValueError(
            f"gather_sequence(mode='ring'): each part holds two zigzag chunks, so its length "
            f"along dim {dim} must be even; got {s_local}."
        )
    chunks: list[torch.Tensor | None] = [None] * (2 * cp)
    for r, p in enumerate(parts):
        first, second = p.chunk(2, dim=dim)
        a, b = zigzag_chunks(cp, r)
        chunks[a], chunks[b] = first, second
    return torch.cat(chunks, dim=dim)


__all__ = [
    "MODES",
    "check_sequence",
    "zigzag_chunks",
    "zigzag_indices",
    "position_ids_for",
    "split_sequence",
    "gather_sequence",
]

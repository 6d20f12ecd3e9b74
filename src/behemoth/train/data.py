"""Batches of training tokens: the deterministic, resumable data-parallel sampler and labels.

Data flow: text (the embedded stdlib corpus, .txt or .jsonl files) ->
``Tokenizer`` -> one flat token stream (documents joined by the end-of-text
id) -> ``TokenDataset`` (in memory, or a nanoGPT-style raw ``.bin`` mapped
read-only; both in :mod:`behemoth.train.dataset`) -> ``BatchSampler`` ->
``{"input_ids", "labels"}`` per dp rank.

Sampling contract (what makes runs reproducible and reshardable):

* The stream of N tokens is cut into ``num_windows = (N - 1) // seq_len``
  windows; window ``i`` is ``tokens[i*seq_len : i*seq_len + seq_len + 1]``.
  Consecutive windows share one boundary token, so every token but the first
  is a label exactly once per epoch.
* Epoch ``e`` visits the windows in the order
  ``Generator(PCG64(seed + e)).permutation(num_windows)``; global step ``t``
  of the epoch takes ``perm[t*B:(t+1)*B]`` (B = global batch size). The
  incomplete last batch is dropped and the next epoch begins.
* dp rank ``r`` of ``dp_size`` takes rows ``[r*B/dp_size, (r+1)*B/dp_size)``
  of the global batch. The sampler state holds no dp quantity, so a run can
  resume on a different dp size and still see the same global batches.

Test: ``pytest tests/unit/test_data.py`` (every dp shard is compared with the
serial ``global_batch``).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from behemoth.train.dataset import (
    TokenDataset,
    check_vocab,
    default_corpus_text,
    unigram_entropy,
    write_bin,
)

__all__ = [
    "default_corpus_text",
    "write_bin",
    "TokenDataset",
    "check_vocab",
    "unigram_entropy",
    "num_windows",
    "shard_slice",
    "epoch_permutation",
    "BatchSampler",
    "shift_labels",
    "IGNORE_INDEX",
]

IGNORE_INDEX = -100
"""A label that adds no loss (the engine's and transformers' convention)."""


# ----------------------------------------------------------------------------- labels


def shift_labels(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """transformers-style labels (``labels = input_ids``, shifted inside the model's loss) as
    behemoth takes them: ``out[:, i] = labels[:, i + 1]``, the last position ``ignore_index``.

    behemoth's loss pairs ``logits[:, i]`` with ``labels[:, i]``, so the same batch trains the
    same next-token objective as transformers' ``model(input_ids, labels=input_ids)``."""
    if labels.dim() != 2:
        raise ValueError(f"labels must be [B, S], got shape {tuple(labels.shape)}")
    out = torch.full_like(labels, ignore_index)
    out[:, :-1] = labels[:, 1:]
    return out


# ----------------------------------------------------------------------------- sampling math


def num_windows(num_tokens: int, seq_len: int) -> int:
    """Number of windows of ``seq_len + 1`` tokens starting at multiples of ``seq_len``."""
    return max(0, (num_tokens - 1) // seq_len)


def shard_slice(*, global_batch_size: int, dp_rank: int, dp_size: int) -> slice:
    """Rows of the global batch that dp rank ``dp_rank`` owns (a contiguous block)."""
    local = global_batch_size // dp_size
    return slice(dp_rank * local, (dp_rank + 1) * local)


def epoch_permutation(*, num_windows: int, seed: int, epoch: int) -> np.ndarray:
    """Window visiting order of ``epoch``: ``Generator(PCG64(seed + epoch)).permutation``."""
    return np.random.Generator(np.random.PCG64(seed + epoch)).permutation(num_windows)


def _valid_batch_sizes_hint(value: int, factor: int) -> str:
    """'use global_batch_size=X' with X the nearest positive multiple of ``factor`` (ties round up)."""
    lower = (value // factor) * factor
    upper = lower + factor
    if lower == 0:
        return f"use global_batch_size={upper} (the smallest multiple of {factor})"
    best, other = (lower, upper) if value - lower < upper - value else (upper, lower)
    return f"use global_batch_size={best} (the nearest multiple of {factor}; {other} also works)"


class BatchSampler:
    """Deterministic, resumable, dp-sharded sampler of ``(input_ids, labels)`` windows.

    Args:
        dataset: the token stream.
        seq_len: tokens per sample; each sample reads ``seq_len + 1`` tokens.
        global_batch_size: samples per optimizer step summed over all dp ranks.
        dp_rank: this rank's index on the data-parallel axis.
        dp_size: number of data-parallel ranks; must divide ``global_batch_size``.
        seed: base seed; epoch ``e`` is shuffled with ``seed + e``.

    Layout: ``next_batch`` returns this rank's ``[global_batch_size // dp_size,
    seq_len]`` int64 ``input_ids`` and ``labels`` with ``labels[:, i] =
    window[i + 1]``. No communication: every rank computes the same permutation
    and takes its own rows (see the module docstring).
    """

    def __init__(
        self,
        dataset: TokenDataset,
        *,
        seq_len: int,
        global_batch_size: int,
        dp_rank: int,
        dp_size: int,
        seed: int = 0,
    ) -> None:
        if seq_len < 1:
            raise ValueError(f"seq_len={seq_len} must be >= 1")
        if global_batch_size < 1:
            raise ValueError(f"global_batch_size={global_batch_size} must be >= 1")
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank}, dp_size={dp_size}: need dp_size >= 1 and 0 <= dp_rank < dp_size")
        if global_batch_size % dp_size:
            raise ValueError(
                f"global_batch_size={global_batch_size} is not divisible by dp_size={dp_size}: every dp "
                f"rank needs the same number of samples; " + _valid_batch_sizes_hint(global_batch_size, dp_size)
            )
        if len(dataset) < seq_len + 1:
            raise ValueError(
                f"the dataset has {len(dataset)} tokens but one sample needs seq_len + 1 = {seq_len + 1}; "
                "use more data or a shorter seq_len"
            )
        n = num_windows(len(dataset), seq_len)
        if n < global_batch_size:
            raise ValueError(
                f"the dataset yields {n} windows of seq_len + 1 = {seq_len + 1} tokens, fewer than "
                f"global_batch_size={global_batch_size}, so not one full batch fits: use more data "
                f"(at least {global_batch_size * seq_len + 1} tokens), a smaller global_batch_size "
                "or a shorter seq_len"
            )
        self.dataset = dataset
        self.seq_len = seq_len
        self.global_batch_size = global_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.num_windows = n
        self.steps_per_epoch = n // global_batch_size
        self.epoch = 0
        self.step_in_epoch = 0
        self.samples_seen = 0
        self._perm_cache: tuple[int, np.ndarray] | None = None

    @property
    def local_batch_size(self) -> int:
        """Samples per step on this rank: ``global_batch_size // dp_size``."""
        return self.global_batch_size // self.dp_size

    @property
    def global_step(self) -> int:
        """Steps taken since epoch 0 began (for this batch size)."""
        return self.epoch * self.steps_per_epoch + self.step_in_epoch

    def _permutation(self, epoch: int) -> np.ndarray:
        if self._perm_cache is None or self._perm_cache[0] != epoch:
            self._perm_cache = (epoch, epoch_permutation(num_windows=self.num_windows, seed=self.seed, epoch=epoch))
        return self._perm_cache[1]

    def window_indices(self, step: int) -> np.ndarray:
        """Window ids of global step ``step`` (counted from epoch 0), all dp ranks."""
        if step < 0:
            raise ValueError(f"step={step} must be >= 0")
        epoch, t = divmod(step, self.steps_per_epoch)
        b = self.global_batch_size
        return self._permutation(epoch)[t * b : (t + 1) * b]

    def _batch(self, windows: np.ndarray) -> dict[str, torch.Tensor]:
        index = (windows.astype(np.int64) * self.seq_len)[:, None] + np.arange(self.seq_len + 1)
        chunk = torch.from_numpy(np.asarray(self.dataset.tokens[index]).astype(np.int64))
        return {"input_ids": chunk[:, :-1].contiguous(), "labels": chunk[:, 1:].contiguous()}

    def global_batch(self, step: int) -> dict[str, torch.Tensor]:
        """The whole ``[global_batch_size, seq_len]`` batch of global step ``step``.

        Pure (does not advance the sampler); the serial reference for the shards.
        """
        return self._batch(self.window_indices(step))

    def next_batch(self) -> dict[str, torch.Tensor]:
        """This rank's shard of the next global batch; advances the state."""
        rows = shard_slice(global_batch_size=self.global_batch_size, dp_rank=self.dp_rank, dp_size=self.dp_size)
        batch = self._batch(self.window_indices(self.global_step)[rows])
        self.step_in_epoch += 1
        self.samples_seen += self.global_batch_size
        if self.step_in_epoch == self.steps_per_epoch:
            self.epoch, self.step_in_epoch = self.epoch + 1, 0
        return batch

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, int]:
        """Position in the sample stream; identical on every dp rank and for every dp size."""
        return {
            "epoch": self.epoch,
            "step_in_epoch": self.step_in_epoch,
            "seed": self.seed,
            "samples_seen": self.samples_seen,
        }

    def load_state_dict(self, state: dict) -> None:
        """Resume at ``state``; the following batches equal those of the saved run.

        The saved seed replaces the constructor's, since the continuation must
        use the permutation the saved run used.
        """
        missing = {"epoch", "step_in_epoch", "seed", "samples_seen"} - set(state)
        if missing:
            raise ValueError(f"sampler state lacks keys {sorted(missing)}; pass a dict from BatchSampler.state_dict()")
        epoch, step, seed, seen = (int(state[k]) for k in ("epoch", "step_in_epoch", "seed", "samples_seen"))
        if epoch < 0 or seen < 0:
            raise ValueError(f"sampler state has epoch={epoch}, samples_seen={seen}; both must be >= 0")
        if not 0 <= step < self.steps_per_epoch:
            raise ValueError(
                f"sampler state has step_in_epoch={step} but an epoch has {self.steps_per_epoch} steps "
                f"({self.num_windows} windows // global_batch_size={self.global_batch_size}); the state "
                "was saved with another dataset, seq_len or global batch size: resume with the same ones"
            )
        self.epoch, self.step_in_epoch, self.seed, self.samples_seen = epoch, step, seed, seen
        self._perm_cache = None

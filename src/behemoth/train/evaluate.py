"""Validation loss on a held-out split (``train.eval_every``).

The token stream is cut once: the last ``data.eval_fraction`` of it (at a window boundary)
is held out and never trained on. Every ``eval_every`` steps the loss is measured on the
same ``eval_batches`` global batches of held-out windows, taken in order.

How: ``engine.full_state_dict()`` (a collective on every rank) gives the serial model's
weights whatever the plan (dp, tp, pp, ZeRO), and rank 0 evaluates a serial copy of the
model with them, in fp32, without gradients. So the number is exactly the serial model's
held-out loss under every plan; the price is one copy of the model on rank 0's device and
the evaluation time there (the other ranks wait in their next collective), which suits
models that fit one device. Test: ``pytest tests/e2e/test_lifecycle.py -k validation``.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from behemoth.train.data import IGNORE_INDEX, num_windows
from behemoth.train.dataset import TokenDataset

__all__ = ["split_held_out", "Validation"]


def split_held_out(dataset: TokenDataset, fraction: float, seq_len: int) -> tuple[TokenDataset, TokenDataset]:
    """``(train, held_out)``: the held-out part is the last ``fraction`` of the tokens, cut at a
    window boundary (a multiple of ``seq_len`` from the start), sharing no token with training."""
    n = len(dataset)
    windows = num_windows(n, seq_len)
    held = max(1, round(windows * fraction))
    if held >= windows:
        raise ValueError(
            f"data.eval_fraction={fraction} of {windows} windows leaves nothing to train on; use a smaller fraction."
        )
    cut = (windows - held) * seq_len
    vocab = dataset.vocab_size
    return (
        TokenDataset(dataset.tokens[: cut + 1], vocab_size=vocab),
        TokenDataset(dataset.tokens[cut + 1 :], vocab_size=vocab),
    )


class Validation:
    """Held-out loss of the engine's model; see the module docstring.

    ``build_model()`` returns a fresh serial model (called once, on rank 0)."""

    def __init__(
        self, held_out: TokenDataset, *, seq_len: int, batch_size: int, num_batches: int, build_model, rank: int
    ) -> None:
        windows = num_windows(len(held_out), seq_len)
        if windows < 1:
            raise ValueError(
                f"the held-out split has {len(held_out)} tokens, fewer than one window of seq_len + 1 = "
                f"{seq_len + 1}; raise data.eval_fraction or use more data."
            )
        count = min(windows, batch_size * num_batches)
        index = np.arange(count, dtype=np.int64)[:, None] * seq_len + np.arange(seq_len + 1)
        chunk = torch.from_numpy(np.asarray(held_out.tokens[index]).astype(np.int64))
        self.batches = [
            (chunk[i : i + batch_size, :-1], chunk[i : i + batch_size, 1:]) for i in range(0, count, batch_size)
        ]
        self.num_windows = count
        self.rank = rank
        self._build_model = build_model
        self._model = None

    def loss(self, engine) -> float | None:
        """The held-out mean loss per token on rank 0 (None on the others). Collective: call on every rank."""
        state = engine.full_state_dict()
        if self.rank != 0:
            return None
        if self._model is None:
            self._model = self._build_model().to(engine.device)
        model = self._model
        model.load_state_dict(state)
        model.eval()
        total, tokens = 0.0, 0
        with torch.no_grad():
            for ids, labels in self.batches:
                logits = model(ids.to(engine.device)).float()
                labels = labels.to(engine.device)
                total += F.cross_entropy(
                    logits.flatten(0, -2), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
                ).item()
                tokens += int((labels != IGNORE_INDEX).sum())
        return total / tokens

"""One forward of generation: the prefill of the padded prompts, or a one-token decode step, for
behemoth's models (their attention modules' ``kv_cache`` seam, :class:`~.cache.KVCache`) and for
transformers models (their own ``StaticCache``). Each returns the last position's fp32 logits of
the tp group's rows (the vocabulary-parallel head gathers them).

A decode step takes its token, position and slot as tensors that the decode loop advances in
place (:mod:`.decode`), so the same step runs with the same inputs every time: no Python number
changes between steps, and ``torch.compile`` traces it once.

No communication of its own (the model's layers communicate as their plan says). Tested in
tests/dist/test_generate.py and tests/dist/test_generate_decode.py.
"""

from __future__ import annotations

import contextlib
import inspect

import torch

from .cache import KVCache

__all__ = ["CachedStep", "TransformersStep"]


class CachedStep:
    """Forwards of a behemoth model with its :class:`~.cache.KVCache`."""

    def __init__(self, model, cache: KVCache) -> None:
        self.model, self.cache = model, cache

    @property
    def nbytes(self) -> int:
        return self.cache.nbytes

    def attached(self):
        return self.cache.attached()

    def __call__(self, ids_bS, pos_bS, start: int) -> torch.Tensor:
        """Logits of the last position of ``ids_bS``, written into slots ``start, start + 1, ...``."""
        self.cache.begin(torch.arange(start, start + ids_bS.shape[1], device=ids_bS.device))
        out = self.model(ids_bS, pos_bS, logits_to_keep=1)
        return _logits(out)[:, -1].float()

    def follow(self, slot_1: torch.Tensor) -> None:
        """Decode steps write into slot ``slot_1`` (advanced in place by the caller)."""
        self.cache.follow(slot_1)

    def decode(self, ids_b1, pos_b1, slot_1) -> torch.Tensor:
        """One token per row at slot ``slot_1``: the logits after it."""
        self.cache.advance()
        out = self.model(ids_b1, pos_b1, logits_to_keep=1)
        return _logits(out)[:, -1].float()


class TransformersStep:
    """Forwards of a transformers model with its own ``StaticCache``."""

    def __init__(self, model, valid_bP, length) -> None:
        from transformers import StaticCache

        self.model = model
        self.cache = StaticCache(config=model.config, max_cache_len=length)
        mask = torch.ones(valid_bP.shape[0], length, dtype=torch.long, device=valid_bP.device)
        mask[:, : valid_bP.shape[1]] = valid_bP.long()
        self.mask_bL = mask
        self.next_slot = valid_bP.shape[1]
        # transformers renamed ``past_key_values`` to ``cache``; pass the name this version reads
        params = inspect.signature(model.forward).parameters
        self.cache_arg = "cache" if "cache" in params else "past_key_values"

    @property
    def nbytes(self) -> int:
        return sum(
            t.numel() * t.element_size()
            for layer in self.cache.layers
            if getattr(layer, "is_initialized", False)
            for t in (layer.keys, layer.values)
        )

    def attached(self):
        return contextlib.nullcontext()

    def __call__(self, ids_bS, pos_bS, start: int) -> torch.Tensor:
        end = start + ids_bS.shape[1]
        return self._forward(ids_bS, pos_bS, torch.arange(start, end, device=ids_bS.device), end)

    def follow(self, slot_1: torch.Tensor) -> None:
        pass

    def decode(self, ids_b1, pos_b1, slot_1) -> torch.Tensor:
        # the attention mask's length is a Python number kept beside ``slot_1`` (reading the
        # tensor would sync the host every step)
        self.next_slot += 1
        return self._forward(ids_b1, pos_b1, slot_1, self.next_slot)

    def _forward(self, ids_bS, pos_bS, slots_S, end: int) -> torch.Tensor:
        out = self.model(
            input_ids=ids_bS,
            attention_mask=self.mask_bL[:, :end],
            position_ids=pos_bS,
            cache_position=slots_S,
            use_cache=True,
            logits_to_keep=1,
            **{self.cache_arg: self.cache},
        )
        return _logits(out)[:, -1].float()


def _logits(out) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out.logits

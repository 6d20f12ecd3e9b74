"""One forward of generation: the prefill of the padded prompts, or a one-token decode step, for
behemoth's models (their attention modules' ``kv_cache`` seam, :class:`~.cache.KVCache`) and for
transformers models (their own ``StaticCache``). Each returns the last position's fp32 logits of
the tp group's rows (the vocabulary-parallel head gathers them).

A decode step takes its token, position and slot as tensors that the decode loop advances in
place (:mod:`.decode`), so the same step runs with the same inputs every time: no Python number
changes between steps, and ``torch.compile`` traces it once.

No communication of its own (the model's layers communicate as their plan says), but under
pipeline parallelism (:class:`StageStep`: the last stage's logits broadcast over ``pp``). Tested in
tests/dist/test_generate.py and tests/dist/test_generate_decode.py.
"""

from __future__ import annotations

import contextlib
import functools
import inspect

import torch

from .. import comm
from ..comm import Axis
from .cache import KVCache

__all__ = ["CachedStep", "StageStep", "TransformersStep"]


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
        return _last(self.model(ids_bS, pos_bS, logits_to_keep=1))

    def follow(self, slot_1: torch.Tensor) -> None:
        """Decode steps write into slot ``slot_1`` (advanced in place by the caller)."""
        self.cache.follow(slot_1)

    def decode(self, ids_b1, pos_b1, slot_1) -> torch.Tensor:
        """One token per row at slot ``slot_1``: the logits after it."""
        self.cache.advance()
        return _last(self.model(ids_b1, pos_b1, logits_to_keep=1))


class TransformersStep:
    """Forwards of a transformers model with its own ``StaticCache``."""

    def __init__(self, model, valid_bP, length) -> None:
        self.model = model
        self.cache = _stage_cache(model.config, length)
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
        return _last(
            self.model(
                input_ids=ids_bS,
                attention_mask=self.mask_bL[:, :end],
                position_ids=pos_bS,
                cache_position=slots_S,
                use_cache=True,
                logits_to_keep=1,
                **{self.cache_arg: self.cache},
            )
        )


def _stage_cache(config, length: int):
    """transformers' ``StaticCache`` whose length is read from a layer this rank fills
    (:func:`_stage_cache_class`)."""
    return _stage_cache_class()(config=config, max_cache_len=length)


@functools.cache
def _stage_cache_class():
    """A ``StaticCache`` reading its length from a layer this rank fills: a pipeline stage holds
    some of the layers only, and transformers reads the cache's length (the queries' offset in
    the attention mask) from layer 0, which a later stage never fills. (transformers is imported
    here: an optional dependency.)"""
    from transformers import StaticCache

    class StageCache(StaticCache):
        def get_seq_length(self, layer_idx: int = 0) -> int:
            if not getattr(self.layers[layer_idx], "is_initialized", True):
                filled = (i for i, layer in enumerate(self.layers) if getattr(layer, "is_initialized", False))
                layer_idx = next(filled, layer_idx)
            return super().get_seq_length(layer_idx)

    return StageCache


class StageStep:
    """A step (:class:`CachedStep` or :class:`TransformersStep`) of a pipeline-split model: every
    pipeline rank runs it, the model's pipelined forward carrying the activations from stage to
    stage (each stage's attention modules fill their own part of the cache), and the logits of
    the rank holding the last stage are broadcast over ``pp``, so every pipeline rank picks the
    same tokens. One broadcast of ``[b, V]`` fp32 a step, and one of the vocabulary size a prefill."""

    def __init__(self, inner, pp: Axis, last: int) -> None:
        self.inner, self.pp, self.last = inner, pp, last
        self.shape: tuple[int, int] | None = None

    @property
    def nbytes(self) -> int:
        return self.inner.nbytes

    def attached(self):
        return self.inner.attached()

    def follow(self, slot_1: torch.Tensor) -> None:
        self.inner.follow(slot_1)

    def __call__(self, ids_bS, pos_bS, start: int) -> torch.Tensor:
        logits = self.inner(ids_bS, pos_bS, start)
        vocab = torch.tensor([logits.shape[-1] if logits is not None else 0], device=ids_bS.device)
        comm.broadcast(vocab, self.pp, self.last)
        self.shape = (ids_bS.shape[0], int(vocab.item()))
        return self._shared(logits, ids_bS.device)

    def decode(self, ids_b1, pos_b1, slot_1) -> torch.Tensor:
        return self._shared(self.inner.decode(ids_b1, pos_b1, slot_1), ids_b1.device)

    def _shared(self, logits: torch.Tensor | None, device: torch.device) -> torch.Tensor:
        logits = torch.empty(self.shape, device=device) if logits is None else logits.contiguous()
        comm.broadcast(logits, self.pp, self.last)
        return logits


def _last(out) -> torch.Tensor | None:
    """The last position's fp32 logits of a model's output (None: a pipeline rank without the last stage)."""
    if out is None:
        return None
    return (out if isinstance(out, torch.Tensor) else out.logits)[:, -1].float()

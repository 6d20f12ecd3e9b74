"""A static, preallocated key/value cache for generation, one per model and rank.

Each attention module that declares a ``kv_cache`` attribute (behemoth's ``CausalSelfAttention``
and ``LlamaAttention``) gets a :class:`LayerCache` there for the duration of a generation; its
forward calls ``update(k, v)``, which writes this forward's keys and values into their slots
and returns every slot with the mask of those each query may read. The buffers are
``[b, K, L, D]``: this rank's rows ``b`` and kv heads ``K`` as the attention module sees them
after ``bh.parallelize`` -- 1D: kv heads split over tp (one replicated kv head when they are
fewer than tp); 2D / 2.5D / 3D: rows and heads split as the training layout splits them -- so
the cache is sharded like the attention that owns it, with no code of its own per plan.

Slots. Prompts are left-padded to ``P`` tokens; slot ``l`` holds token ``l`` of the padded row,
generated tokens follow from slot ``P``. A query at slot ``s`` reads slot ``l`` when
``l <= s`` and the slot holds a real token (``valid``), and always its own slot, so a padding
query stays finite (its output is never used). :func:`kv_cache_bytes` is the size per rank.

No communication. Tested in tests/dist/test_generate.py (bytes per rank against the formula).
"""

from __future__ import annotations

import torch
from torch import nn

from .sizes import kv_cache_bytes

__all__ = ["KVCache", "LayerCache", "cached_attentions", "kv_cache_bytes"]


def cached_attentions(model: nn.Module) -> list[nn.Module]:
    """The attention modules of ``model`` that take a :class:`LayerCache` (class attribute
    ``kv_cache``), in module order."""
    return [m for m in model.modules() if "kv_cache" in dir(type(m)) and hasattr(m, "head_dim")]


def _kv_heads(module: nn.Module) -> int:
    return getattr(module, "num_kv_heads", None) or module.num_heads


class KVCache:
    """The K/V buffers of every cached attention module of one model on this rank.

    ``rows``: this rank's rows; ``length``: slots L (padded prompt + new tokens); ``valid_BP``:
    the padded prompts' mask (True: a real token) of this rank's rows. Use as a context
    manager: ``with cache.attached(): model(...)``; :meth:`begin` before each forward says
    which slots it writes."""

    def __init__(
        self,
        attentions: list[nn.Module],
        valid_BP: torch.Tensor,
        length: int,
        *,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        rows, prompt = valid_BP.shape
        self.attentions, self.length, self.prompt = attentions, length, prompt
        self.valid_B11L = torch.ones(rows, 1, 1, length, dtype=torch.bool, device=device)
        self.valid_B11L[:, 0, 0, :prompt] = valid_BP.to(device=device, dtype=torch.bool)
        self.slots_L = torch.arange(length, device=device)
        self.token_mask_B11L = torch.zeros(rows, 1, 1, length, dtype=torch.bool, device=device)
        self.layers = [
            LayerCache(self, rows, _kv_heads(m), length, m.head_dim, dtype=dtype, device=device) for m in attentions
        ]
        for t in (self.valid_B11L, self.slots_L, self.token_mask_B11L):
            _static(t)
        self.mask_B1SL: torch.Tensor | None = None
        self.position_S: torch.Tensor | None = None

    def reset(self, valid_BP: torch.Tensor) -> None:
        """Start another generation of the same shape in these buffers (their addresses, which a
        recorded CUDA graph holds, stay): every slot emptied, ``valid_BP`` the new prompts' mask."""
        self.valid_B11L.fill_(True)
        self.valid_B11L[:, 0, 0, : self.prompt].copy_(valid_BP)
        for layer in self.layers:
            layer.k.zero_()
            layer.v.zero_()
        self.mask_B1SL = self.position_S = None

    @property
    def nbytes(self) -> int:
        """Bytes of every K and V buffer on this rank."""
        return sum(t.numel() * t.element_size() for layer in self.layers for t in (layer.k, layer.v))

    def begin(self, position_S: torch.Tensor) -> None:
        """The next forward writes its S tokens into slots ``position_S`` (ascending)."""
        pos_S1 = position_S[:, None]
        causal_SL = (self.slots_L <= pos_S1)[None, None]
        own_SL = (self.slots_L == pos_S1)[None, None]
        self.mask_B1SL = (causal_SL & self.valid_B11L) | own_SL
        self.position_S = position_S

    def follow(self, slot_1: torch.Tensor) -> None:
        """Decode steps from now on write one token per row into slot ``slot_1`` (a one-element
        tensor the caller advances in place); call :meth:`advance` before each of them."""
        self.position_S, self.mask_B1SL = slot_1, self.token_mask_B11L

    def advance(self) -> None:
        """The mask of the next one-token forward, for the slot :meth:`follow` named, written in
        place (no new tensor: a compiled decode step reads the same buffer every time)."""
        slot = self.position_S
        self.token_mask_B11L.copy_(((self.slots_L <= slot) & self.valid_B11L) | (self.slots_L == slot))

    def attached(self):
        """Context manager: each attention module holds its layer's cache for the duration."""
        return _Attached(self)


class LayerCache:
    """One attention module's ``[b, K, L, D]`` keys and values; ``update`` is the model's seam."""

    def __init__(self, owner: KVCache, rows: int, heads: int, length: int, head_dim: int, *, dtype, device) -> None:
        self.owner = owner
        self.k = torch.zeros(rows, heads, length, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        _static(self.k)
        _static(self.v)

    def update(self, k_BKSD: torch.Tensor, v_BKSD: torch.Tensor):
        """Write this forward's keys and values into their slots; return every slot's keys and
        values and the mask ``[b, 1, S, L]`` of the slots each query reads."""
        pos = self.owner.position_S
        self.k.index_copy_(2, pos, k_BKSD.to(self.k.dtype))
        self.v.index_copy_(2, pos, v_BKSD.to(self.v.dtype))
        return self.k, self.v, self.owner.mask_B1SL


def _static(t: torch.Tensor) -> None:
    """Written in place between steps: a compiled decode step's CUDA graph reads it where it is
    (``mark_static_address``) instead of copying it in, and so sees every update."""
    if t.device.type == "cuda":
        torch._dynamo.mark_static_address(t)


class _Attached:
    def __init__(self, cache: KVCache) -> None:
        self.cache = cache

    def __enter__(self) -> KVCache:
        for m, layer in zip(self.cache.attentions, self.cache.layers):
            m.kv_cache = layer
        return self.cache

    def __exit__(self, *exc) -> None:
        for m in self.cache.attentions:
            m.__dict__.pop("kv_cache", None)

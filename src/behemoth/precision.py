"""Mixed precision: bf16/fp16 autocast over fp32 master weights, and dynamic loss scaling.

Parameters, gradients and optimizer state stay fp32 (the master copy); autocast runs
matmuls in the low precision. fp16 adds a dynamic loss scale: gradients are unscaled
after the data-parallel reduction, a step whose gradients overflowed is skipped and the
scale halved, and after ``growth_interval`` clean steps the scale doubles. The gradient sync
(:mod:`behemoth.parallel.zero.optimizer`) takes the overflow vote over every rank that holds
part of the gradients and reports it to :meth:`LossScaler.update`.
"""

from __future__ import annotations

import contextlib

import torch

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast_context(precision: str, device: torch.device, cache: bool = True):
    """Autocast for ``precision``. ``cache=False`` drops autocast's cache of low-precision weight
    copies, which lives for the whole forward: ZeRO-3 releases weights between uses, and the cache
    would keep a bf16 copy of every one of them."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=_DTYPES[precision], cache_enabled=cache)


class LossScaler:
    """Dynamic loss scale for fp16 (the scheme of Micikevicius et al. / torch.amp.GradScaler)."""

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        min_scale: float = 1.0,
    ) -> None:
        self.scale = init_scale
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval, self.min_scale = growth_interval, min_scale
        self._good_steps = 0
        self.skipped_steps = 0

    def update(self, finite: bool) -> bool:
        """Record one step's overflow check: back off and return False, or count a clean step."""
        if not finite:
            self.scale = max(self.min_scale, self.scale * self.backoff_factor)
            self._good_steps = 0
            self.skipped_steps += 1
            return False
        self._good_steps += 1
        if self._good_steps % self.growth_interval == 0:
            self.scale *= self.growth_factor
        return True

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self._good_steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, d: dict) -> None:
        self.scale, self._good_steps = float(d["scale"]), int(d["good_steps"])
        self.skipped_steps = int(d.get("skipped_steps", 0))

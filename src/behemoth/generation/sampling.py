"""Choosing the next token from logits: greedy, or sampling with temperature, top-k and top-p.

Sampling is the same under every plan: each step draws one uniform number per row of the
*whole* batch from a CPU ``torch.Generator`` seeded with ``seed`` (every rank draws them all and
keeps its rows), and a row's token is the first vocabulary id whose cumulative probability
exceeds its number (inverse-CDF sampling in vocabulary order). So a row's draw depends on its
index and the step, never on how rows are split over ranks, and ranks holding the same row
pick the same token without communicating.

No communication. Tested in tests/unit/test_generate_sampling.py and, across plans, in
tests/dist/test_generate.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Sampling", "Sampler"]


@dataclass(frozen=True, kw_only=True)
class Sampling:
    """How the next token is chosen."""

    do_sample: bool = False
    """False: the most likely token (greedy); True: a draw from the filtered distribution."""
    temperature: float = 1.0
    """Logits are divided by it before sampling (> 0)."""
    top_k: int | None = None
    """Keep only the k most likely tokens (None or 0: all)."""
    top_p: float | None = None
    """Keep the smallest set of most likely tokens whose probability reaches top_p (None or 1: all)."""
    seed: int = 0
    """Seed of the draws; equal seeds give equal samples under every plan."""

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(f"temperature={self.temperature!r}: must be > 0; use do_sample=False for greedy decoding.")
        if self.top_k is not None and self.top_k < 0:
            raise ValueError(f"top_k={self.top_k!r}: must be >= 0 (0 or None keeps every token).")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p!r}: must be in (0, 1] (1 or None keeps every token).")


def filter_logits(logits_BV: torch.Tensor, s: Sampling) -> torch.Tensor:
    """Temperature, then top-k, then top-p (the order of transformers' logits warpers); removed
    tokens get ``-inf``. At least the most likely token always stays."""
    z = logits_BV.float() / s.temperature
    if s.top_k:
        k = min(s.top_k, z.shape[-1])
        kth_B1 = torch.topk(z, k, dim=-1).values[:, -1:]
        z = z.masked_fill(z < kth_B1, float("-inf"))
    if s.top_p is not None and s.top_p < 1:
        sorted_BV, order_BV = torch.sort(z, dim=-1, descending=True)
        probs_BV = sorted_BV.softmax(-1)
        before_BV = probs_BV.cumsum(-1) - probs_BV  # probability of the tokens ranked above
        drop_BV = before_BV >= s.top_p
        drop_BV[:, 0] = False
        z = z.masked_fill(torch.zeros_like(drop_BV).scatter(-1, order_BV, drop_BV), float("-inf"))
    return z


class Sampler:
    """Picks each step's tokens for ``rows`` (global row indices of the batch held here) of a
    batch of ``batch`` rows; rows at or past ``batch`` (padding rows) draw nothing of their own.

    Calling it draws the next step's numbers from its generator; :meth:`draws` takes those of
    many steps at once (the same numbers: the generator's stream does not depend on how it is
    cut), so a decode loop can keep them on the device and pick with :meth:`pick`."""

    def __init__(self, sampling: Sampling, batch: int, rows: torch.Tensor) -> None:
        self.sampling, self.batch = sampling, batch
        self.rows = rows.clamp(max=batch - 1)
        self.generator = torch.Generator(device="cpu").manual_seed(sampling.seed)

    def __call__(self, logits_BV: torch.Tensor) -> torch.Tensor:
        """Token ids ``[b]`` (int64, on the logits' device) for this step."""
        if not self.sampling.do_sample:
            return logits_BV.argmax(-1)
        return self.pick(logits_BV, self.draws(1, logits_BV.device)[0])

    def draws(self, steps: int, device: torch.device) -> torch.Tensor | None:
        """The uniform numbers of the next ``steps`` steps for this rank's rows, ``[steps, b]``
        float64 on ``device`` (None for greedy decoding, which draws nothing)."""
        if not self.sampling.do_sample:
            return None
        u_TB = torch.rand(steps, self.batch, generator=self.generator, dtype=torch.float64)
        return u_TB[:, self.rows].to(device)

    def pick(self, logits_BV: torch.Tensor, u_B: torch.Tensor | None) -> torch.Tensor:
        """Token ids ``[b]`` from ``logits_BV`` and this step's numbers ``u_B`` (ignored when
        greedy). No host sync: traceable into a compiled decode step."""
        if not self.sampling.do_sample:
            return logits_BV.argmax(-1)
        probs_BV = filter_logits(logits_BV, self.sampling).softmax(-1).double()
        cdf_BV = probs_BV.cumsum(-1)
        target_B1 = (u_B * cdf_BV[:, -1])[:, None]
        token_B = torch.searchsorted(cdf_BV, target_B1, right=True)[:, 0]
        return token_B.clamp(max=logits_BV.shape[-1] - 1)

"""Grouped expert GEMMs: a batch of tokens sorted by expert through each expert's SwiGLU.

The tokens of expert e are rows ``offsets[e-1]:offsets[e]`` of ``x_NH``; the experts' fused
weights are ``gate_up [E, 2I, H]`` and ``down [E, H, I]`` (transformers 5's layout, as
:class:`behemoth.models.moe.MoEFeedForward` stores them). Two paths compute the same thing:

* ``torch._grouped_mm`` (one kernel per projection for all experts) on a CUDA build that has it,
  for bf16 operands whose groups start at 16-row boundaries and whose widths are multiples of 8
  (the kernel's alignment); the weights are passed transposed, as the kernel expects;
* a loop over experts with ``F.linear`` everywhere else (CPU, float32/float64, unaligned
  groups). An expert with no rows costs nothing and its weights get a zero gradient.

Tested in tests/unit/test_expert_dispatch.py (the loop against the serial layer's per-expert
computation).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["grouped_swiglu", "grouped_mm_available"]


def grouped_mm_available(x_NH: torch.Tensor, gate_up: torch.Tensor, counts: list[int]) -> bool:
    """Whether :func:`grouped_swiglu` may use ``torch._grouped_mm`` for these operands."""
    if not (hasattr(torch, "_grouped_mm") and x_NH.is_cuda and x_NH.dtype == torch.bfloat16):
        return False
    if gate_up.dtype != torch.bfloat16 or torch.cuda.get_device_capability(x_NH.device) < (9, 0):
        return False
    return all(c % 16 == 0 for c in counts) and x_NH.shape[-1] % 8 == 0 and gate_up.shape[1] % 16 == 0


def grouped_swiglu(
    x_NH: torch.Tensor, counts: list[int], gate_up: torch.Tensor, down: torch.Tensor, act=F.silu
) -> torch.Tensor:
    """``y_NH``: rows of expert e (the e-th run of ``counts[e]`` rows) through
    ``down[e](act(gate[e] x) * up[e] x)`` (``act``: SiLU, or a transformers model's
    ``experts.act_fn``); local compute, no communication."""
    if grouped_mm_available(x_NH, gate_up, counts):
        offsets = torch.tensor(counts, device=x_NH.device).cumsum(0).to(torch.int32)
        gate_TI, up_TI = torch._grouped_mm(x_NH, gate_up.transpose(-2, -1), offs=offsets).chunk(2, dim=-1)
        return torch._grouped_mm(act(gate_TI) * up_TI, down.transpose(-2, -1), offs=offsets)
    parts, start = [], 0
    for e, n in enumerate(counts):
        if n:
            gate_TI, up_TI = F.linear(x_NH[start : start + n], gate_up[e]).chunk(2, dim=-1)
            parts.append(F.linear(act(gate_TI) * up_TI, down[e]))
        start += n
    if not parts:
        # No rows: stay in the graph of the input (the backward must still reach the dispatch's
        # collective) and of the weights (their zero gradient arrives at the same point of the
        # backward as on a rank with rows, so gradient buckets launch in the same order everywhere).
        return x_NH * 0 + (gate_up.sum() + down.sum()) * 0
    return torch.cat(parts) if len(parts) > 1 else parts[0]

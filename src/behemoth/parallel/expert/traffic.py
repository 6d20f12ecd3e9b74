"""The bytes expert parallelism's all-to-alls carry, as a formula (what the ledger books).

One MoE layer's forward on one ep group of ``ep`` members: every member sends its ``E`` split
sizes (int64, one even all-to-all: ``ep * E * 8`` bytes over the group), then the dispatch and
the combine each move every kept (token, slot) row of width H once (``rows * H * elem_bytes``
each, summed over the group: a row sent to its own member counts too, as the ledger books the
whole send buffer). ``elem_bytes`` is the size of the experts' GEMM dtype, which the rows travel
in both ways (dispatch casts them before they leave, and the experts return it): 2 under bf16
autocast over float32 parameters and residual stream, else the stream's (4 in float32). Its
backward runs the reverse pair of row all-to-alls (the split sizes are not exchanged again). A
block recomputed by activation checkpointing runs the forward's three all-to-alls a second time. Pure arithmetic; tested against the ledger in
tests/dist/test_expert_routing.py, tests/dist/test_expert_parallel.py (float32) and
tests/dist/test_expert_autocast.py (bf16 autocast).
"""

from __future__ import annotations

__all__ = ["ep_all_to_all_bytes"]


def ep_all_to_all_bytes(
    *, rows: int, num_experts: int, ep: int, hidden: int, elem_bytes: int = 4, recompute: bool = False
) -> int:
    """Payload bytes one MoE layer's all-to-alls carry over one ep group in one forward and
    backward, summed over the group's members: ``rows`` is the number of (token, slot)
    assignments the group's members dispatch together (T*K less the capacity's drops)."""
    if ep == 1:
        return 0
    forward = ep * num_experts * 8 + 2 * rows * hidden * elem_bytes
    backward = 2 * rows * hidden * elem_bytes
    return forward * (2 if recompute else 1) + backward

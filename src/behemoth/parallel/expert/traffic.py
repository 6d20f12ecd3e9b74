"""The bytes expert parallelism's all-to-alls carry, as a formula (what the ledger books).

One MoE layer's forward on one ep group of ``ep`` members: every member sends its ``chunks * E``
split sizes (int64, one even all-to-all: ``ep * chunks * E * 8`` bytes over the group; ``chunks``:
the runs of tokens ``Plan.ep_overlap`` splits the layer's exchange into, one call each way per
run, the same rows), then the dispatch and the combine each move every kept (token, slot) row of
width H once (``rows * H * elem_bytes`` each, summed over the group: a row sent to its own member
counts too, as the ledger books the whole send buffer). ``elem_bytes`` is the size of the
experts' GEMM dtype, which the rows travel in both ways (dispatch casts them before they leave,
and the experts return it): 2 under bf16 autocast over float32 parameters and residual stream,
else the stream's (4 in float32). Its backward runs the reverse pair of row all-to-alls (the
split sizes are not exchanged again). A block recomputed by activation checkpointing runs the
forward's two row all-to-alls a second time; not the split sizes' (the recompute reuses the
forward's routes, :mod:`behemoth.parallel.expert.replay`). Pure arithmetic; tested against the
ledger in tests/dist/test_expert_routing.py, tests/dist/test_expert_parallel.py (float32),
tests/dist/test_expert_autocast.py (bf16 autocast) and tests/dist/test_expert_overlap.py
(chunks).

The member exchange (``Plan.ep_dedup``, :mod:`behemoth.parallel.expert.dispatch_members`) moves
``pairs`` rows instead: the unique (token, member) pairs of the group's tokens, each once out
and once back, the outgoing rows ``meta_columns(top_k, meta_bytes, elem_bytes)`` wider (the
pair's k float32 routing weights and k int16 slots packed after it; as wide back in the
backward); its split sizes are ``E + ep`` int64 per member (each member's local experts'
assignments and its pairs). Its recompute runs both row all-to-alls again, the rows alone (the
weights and slots kept from its forward). Tested against the ledger in
tests/dist/test_expert_dedup.py.
"""

from __future__ import annotations

__all__ = ["ep_all_to_all_bytes"]


def ep_all_to_all_bytes(
    *,
    rows: int,
    num_experts: int,
    ep: int,
    hidden: int,
    elem_bytes: int = 4,
    recompute: bool = False,
    chunks: int = 1,
    pairs: int | None = None,
    top_k: int = 1,
    meta_bytes: int = 4,
) -> int:
    """Payload bytes one MoE layer's all-to-alls carry over one ep group in one forward and
    backward, summed over the group's members: ``rows`` is the number of (token, slot)
    assignments the group's members dispatch together (T*K less the capacity's drops).
    ``pairs``: the member exchange's (token, member) pairs over the group (``rows`` then unused),
    ``top_k`` the slots a pair carries."""
    if ep == 1:
        return 0
    if pairs is not None:
        splits = ep * (num_experts + ep) * 8
        wide = hidden + -(-top_k * (meta_bytes + 2) // elem_bytes)  # dispatch_members.meta_columns
        pair = pairs * (wide + hidden) * elem_bytes  # dispatch + combine, or their reverse
        again = 2 * pairs * hidden * elem_bytes if recompute else 0  # the rows alone
        return splits + pair + again + pair
    splits = ep * chunks * num_experts * 8
    pair = 2 * rows * hidden * elem_bytes  # dispatch + combine, or their reverse
    return splits + pair * (2 if recompute else 1) + pair

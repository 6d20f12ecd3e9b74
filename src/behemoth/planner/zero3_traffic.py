"""ZeRO-3's parameter gathers in one step: which chunk stays gathered from the forward into the backward.

Stage 3 gathers a chunk before a module that owns its parameters runs forward, releases it when
the working set moves on, and gathers it again before the module's backward; the store releases a
chunk once all its gradients of the micro-batch are reduced (``parallel/zero/hooks.py``,
``parallel/zero/store.py``). Every chunk is thus gathered twice per micro-batch -- but those the
forward ends in: the final norm's and the head's (the last modules to run forward, the first two
of the backward: the two chunks of look-ahead the hooks keep) are still gathered when the
backward starts with them, so they are gathered once per micro-batch. Their parameters are what
:func:`zero3_resident_params` counts: the data axis's chunks from the one holding the final norm
to the last, when the rank's parameters are packed as ``parallel/zero/optimizer.py`` packs them (next-fit
in registration order, one chunk group per parameter kind: the dense parameters over the data
axis, the experts over ``ep_dp``; one size for every group, from the same least-padding search).

The rank's parameters in registration order (:func:`rank_param_sizes`) are exact for behemoth's
GPT and Llama (dense or MoE) without tensor parallelism and pipeline; under tensor parallelism
the matrices are split by :func:`~.params.weight_split` (norms and biases whole), an estimate.
The chunks here hold one optimizer param group: a param group of its own (e.g. the routers
alone) packs into chunks of its own, which interleave with the others' uses and are gathered
more often than this counts.
"""

from __future__ import annotations

from functools import lru_cache

from ..parallel.zero.chunks import chunk_candidates, least_padding, pack_chunks
from ..plan import Plan
from .params import weight_split
from .workload import Workload

__all__ = ["chunk_shard_elements", "final_norm_index", "rank_param_sizes", "zero3_resident_params"]


def _norm(w: Workload) -> list[int]:
    s = w.shape
    return [s.norm_params] if s.rms_norm else [s.norm_params // 2] * 2  # weight (and a LayerNorm's bias)


def _linear(w: Workload, n_in: int, n_out: int, ws: int) -> list[int]:
    return [n_in * n_out // ws] + ([n_out] if w.shape.linear_bias else [])


def rank_param_sizes(plan: Plan, w: Workload) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(sizes, kinds)``: one rank's trainable parameters in registration order (the model's
    ``parameters()``, as ZeRO packs them) without a pipeline, and per parameter its chunk group:
    0 dense (synced over the data axis), 1 an expert under expert parallelism (over ``ep_dp``)."""
    s = w.shape
    ws = weight_split(plan)
    h, d = s.hidden, s.head_dim
    sizes: list[int] = [s.vocab_size * h // ws]
    kinds: list[int] = [0]
    if s.max_positions:
        sizes.append(s.max_positions * h)
    block = _norm(w)
    if s.fused_qkv:
        block += _linear(w, h, (s.num_heads + 2 * s.num_kv_heads) * d, ws)
    else:
        for heads in (s.num_heads, s.num_kv_heads, s.num_kv_heads):
            block += _linear(w, h, heads * d, ws)
    block += _linear(w, s.num_heads * d, h, ws) + _norm(w)
    block_kinds = [0] * len(block)
    if w.num_experts:
        e = w.num_experts // plan.ep
        f = w.expert_ffn_hidden or s.ffn_hidden
        expert = 1 if plan.ep > 1 else 0
        block += [e * (2 if s.gated_mlp else 1) * f * h, e * h * f, w.num_experts * h]  # experts, then the router
        block_kinds += [expert, expert, 0]
    else:
        f = s.ffn_hidden
        mlp = (_linear(w, h, f, ws) * (2 if s.gated_mlp else 1)) + _linear(w, f, h, ws)
        block += mlp
        block_kinds += [0] * len(mlp)
    sizes += block * s.num_layers
    kinds += [0] * (len(sizes) - 1 - len(block) * s.num_layers) + block_kinds * s.num_layers
    sizes += _norm(w) + ([] if w.tied_embeddings else [s.vocab_size * h // ws])
    kinds += [0] * (len(sizes) - len(kinds))
    return tuple(sizes), tuple(kinds)


def zero3_resident_params(plan: Plan, w: Workload) -> int:
    """Parameters of the chunks ZeRO-3 keeps gathered from the forward into the backward: the data
    axis's chunks from the final norm's to the last (an untied head's), when the rank's parameters
    (:func:`rank_param_sizes`) are packed with the chunk size the runtime's search picks
    (``ZeroOptimizer._pack``: the least padding among 256 sizes from the largest parameter up
    to 1/32 of them or twice the largest). Without a pipeline."""
    sizes, kinds = rank_param_sizes(plan, w)
    g = plan.dp * plan.cp
    return _resident(sizes, kinds, g, max(g // plan.ep, 1), final_norm_index(w, len(sizes)))


def final_norm_index(w: Workload, count: int) -> int:
    """The index of the final norm's first parameter among :func:`rank_param_sizes`' ``count``."""
    return count - len(_norm(w)) - (0 if w.tied_embeddings else 1)


def chunk_shard_elements(plan: Plan, w: Workload) -> tuple[int, int]:
    """``(dense, experts)``: elements of one rank's ZeRO shards, chunk padding included -- each
    chunk group's chunks (:func:`zero3_resident_params`' packing) over its shard count: the data
    axis (``dp x cp``) for the dense group, ``ep_dp`` for the experts' (0 without expert
    parallelism). Without a pipeline."""
    sizes, kinds = rank_param_sizes(plan, w)
    g = plan.dp * plan.cp
    return _packed(sizes, kinds, g, max(g // plan.ep, 1), final_norm_index(w, len(sizes)))[1:]


def _resident(sizes: tuple[int, ...], kinds: tuple[int, ...], g: int, expert_g: int, tail: int) -> int:
    return _packed(sizes, kinds, g, expert_g, tail)[0]


@lru_cache(maxsize=4096)
def _packed(sizes: tuple[int, ...], kinds: tuple[int, ...], g: int, expert_g: int, tail: int) -> tuple[int, int, int]:
    """(the dense group's parameters in its chunks from the one holding parameter ``tail`` to the
    last, the dense shard's elements, the expert shard's): ``pack_chunks`` at the size
    ``search_chunk_size`` picks over ``ZeroOptimizer``'s candidates (least padding, ties to the
    larger; :func:`~behemoth.parallel.zero.chunks.least_padding`, as the runtime's search counts
    them)."""
    dps = {k: g if k == 0 else expert_g for k in dict.fromkeys(kinds)}
    chunk = least_padding(sizes, kinds, dps, chunk_candidates(sizes))[0]
    layout = pack_chunks(list(sizes), chunk, dps, groups=list(kinds))
    dense = layout.group_chunks(0)
    first = next(i for i, c in enumerate(dense) if tail in c.params)
    shards = {k: sum(c.size for c in layout.group_chunks(k)) // d for k, d in dps.items()}
    return sum(c.used for c in dense[first:]), shards[0], shards.get(1, 0)

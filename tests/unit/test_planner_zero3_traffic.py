"""ZeRO-3's resident chunk as the planner packs it: the rank's parameters in the models'
registration order, and the least-padding chunk size and next-fit packing the runtime runs."""

from __future__ import annotations

import pytest

import behemoth as bh
from behemoth.models import build_model
from behemoth.parallel.zero.chunks import pack_chunks, search_chunk_size
from behemoth.planner.workload import workload_for
from behemoth.planner.zero3_traffic import (
    _resident,
    chunk_shard_elements,
    final_norm_index,
    rank_param_sizes,
    zero3_resident_params,
)

PRESETS = ("gpt-tiny", "llama-tiny", "llama-moe-tiny", "olmoe-tiny")


def _model(name, **kw):
    return build_model(name, vocab_size=96, seq_len=16, device="meta", **kw)


@pytest.mark.parametrize("name", PRESETS)
def test_rank_param_sizes_are_the_models_parameters(name):
    """Without expert parallelism every parameter is the model's, in its order, dense."""
    model = _model(name)
    w = workload_for(model, seq_len=16, global_batch=8)
    sizes, kinds = rank_param_sizes(bh.Plan(dp=2), w)
    assert list(sizes) == [p.numel() for p in model.parameters()]
    assert set(kinds) == {0}


@pytest.mark.parametrize("name", ("llama-moe-tiny", "olmoe-tiny"))
def test_experts_are_split_over_ep_and_kept_apart(name):
    model = _model(name)
    w = workload_for(model, seq_len=16, global_batch=8)
    sizes, kinds = rank_param_sizes(bh.Plan(dp=4, ep=2), w)
    want = [p.numel() // (2 if p.dim() == 3 else 1) for p in model.parameters()]
    assert list(sizes) == want
    assert list(kinds) == [1 if p.dim() == 3 else 0 for p in model.parameters()]


@pytest.mark.parametrize("name", PRESETS)
@pytest.mark.parametrize("layers", (2, 5, 12))
@pytest.mark.parametrize(("dp", "ep"), ((2, 1), (4, 2), (8, 4), (3, 1)))
def test_resident_chunk_is_the_runtimes_last_dense_chunk(name, layers, dp, ep):
    """The vectorised search and packing equal ``search_chunk_size`` then ``pack_chunks`` (as
    ``ZeroOptimizer._pack`` calls them): the data axis's last chunk's parameters."""
    model = _model(name, num_layers=layers)
    w = workload_for(model, seq_len=16, global_batch=24)
    plan = bh.Plan(dp=dp, ep=ep if w.num_experts else 1)
    sizes, kinds = rank_param_sizes(plan, w)
    order = list(dict.fromkeys(kinds))
    groups = [order.index(k) for k in kinds]
    shards = {order.index(k): (dp if k == 0 else dp // plan.ep) for k in order}
    lo = max(sizes)
    hi = max(2 * lo, sum(sizes) // 32)
    cands = sorted({lo + (hi - lo) * i // 255 for i in range(256)})
    chunk = search_chunk_size(list(sizes), shards, groups=groups, candidates=cands)[0]
    layout = pack_chunks(list(sizes), chunk, shards, groups=groups)
    # the final norm's chunk to the last (the head's): what the forward ends in
    tail = final_norm_index(w, len(sizes))
    assert sizes[tail] == w.shape.norm_params // (1 if w.shape.rms_norm else 2)
    dense = layout.group_chunks(order.index(0))
    first = next(i for i, c in enumerate(dense) if tail in c.params)
    want = sum(c.used for c in dense[first:])
    assert zero3_resident_params(plan, w) == want
    assert _resident(sizes, kinds, dp, max(dp // plan.ep, 1), tail) == want
    # each group's shard: its chunks (padding included) over the group's shard count
    shard = {k: sum(c.size for c in layout.group_chunks(order.index(k))) // shards[order.index(k)] for k in order}
    assert chunk_shard_elements(plan, w) == (shard[0], shard.get(1, 0))

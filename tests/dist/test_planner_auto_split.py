"""The planner's ``offload='auto'`` split is the runtime's: on every rank, the chunk shards the planner
packs (``behemoth.planner.auto_offload.shard_chunks``) are those the rank's ``ZeroOptimizer`` packs,
and the chunks it keeps with their parameters and with their optimizer state
(``auto_offload.auto_keep``, what ``place_auto`` and ``place_stages`` place) are those the rank's
``ChunkPlacement`` keeps on the device.

behemoth's tiny GPT (a tied head: its copy on the last pipeline rank) and Llama (an untied head),
4 blocks, AdamW, under a pipeline (pp 2, ZeRO 1 and 3: each rank packs and places its own stage's
chunks) and without one (dp 2, ZeRO 3: each rank places its shards), on 2 gloo ranks. The budget is
``Plan.offload_budget_gb`` and the chunk size ``Plan.chunk_mb``, so the runtime decides at
``boost`` (no warm-up measurement) and the same way on a CPU; each budget splits every rank's
chunks (some kept, some offloaded). The planner is given the rates the runtime measured (host
bandwidth, CPU update rate), which the ZeRO-3 split weighs.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from common import SEQ, VOCAB, global_batches, shard

import behemoth as bh
from behemoth.models import build_model
from behemoth.planner.auto_offload import auto_keep, shard_chunks
from behemoth.planner.calibration import load_calibration
from behemoth.planner.cluster import Cluster
from behemoth.planner.workload import workload_for

LAYERS, BATCH, CHUNK_MB = 4, 4, 0.08  # ~21k elements: 6-7 chunks a pipeline rank, 12-13 under dp 2

PLANS = (  # each budget about half of a rank's model data
    dict(pp=2, microbatches=2, zero=1, offload_budget_gb=0.00137),
    dict(pp=2, microbatches=2, zero=3, offload_budget_gb=0.0011),
    dict(dp=2, zero=3, offload_budget_gb=0.001),
)


def _prefix(flags: list[bool]) -> int:
    """The length of ``flags``' leading run of True, which must be all of its Trues."""
    k = flags.index(False) if False in flags else len(flags)
    assert not any(flags[k:]), f"kept chunks are not a prefix: {flags}"
    return k


def _world(rank, world, name):
    failures = []
    batch = global_batches(1, BATCH)[0]
    for kw in PLANS:
        model = build_model(name, vocab_size=VOCAB, seq_len=SEQ, num_layers=LAYERS)
        w = workload_for(model, seq_len=SEQ, global_batch=BATCH)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        engine = bh.boost(model, opt, bh.Plan(offload="auto", chunk_mb=CHUNK_MB, **kw))
        engine.step(shard(batch, engine.dp_rank, engine.dp_size))
        plan, zero = engine.plan, engine.grad_sync
        stage = engine.mesh.coord("pp")
        got_shards = [c.shard_size for c in zero.layout.chunks]
        n = len(got_shards)
        chunks = zero.store.chunks
        got_keep = (_prefix([c.param_on_gpu for c in chunks]), _prefix([c.optim_on_gpu for c in chunks]))
        assert got_keep == tuple(zero.placement.keep), (got_keep, zero.placement.keep)
        what = f"{name} {plan.describe()} rank {rank} (stage {stage})"
        assert 0 < got_keep[1] < n, f"{what}: the budget does not split: keeps {got_keep} of {n} chunks"
        # the planner at the rates this rank measured (the ZeRO-3 split weighs transfers against CPU updates)
        cal = dataclasses.replace(
            load_calibration("h100"),
            h2d_bytes_per_s=zero.placement.bandwidth,
            d2h_bytes_per_s=zero.placement.bandwidth,
            cpu_adam_params_per_s=zero.placement.cpu_rate / 4,
        )
        want_shards = shard_chunks(plan, w, stage)
        want_keep = auto_keep(plan, w, Cluster(num_gpus=world, calibration=cal), 0.0, stage)
        if (got_shards, got_keep) != (want_shards, want_keep):
            failures.append(
                f"{what}: runtime shards {got_shards} keep {got_keep}; planner shards {want_shards} keep {want_keep}"
            )
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("name", ("gpt-tiny", "llama-tiny"))
def test_planner_auto_split_is_the_runtimes(name):
    bh.spawn(_world, 2, name, timeout=300)

"""bh.parallelize without an optimizer: the rewritten model's forward equals the serial model's.

Under data parallelism, 1D tensor parallelism (vocabulary-parallel head included: the
parallelized model returns the serial logits) and pipelines (plain and interleaved, tied
embeddings across the first and the last stage) every rank that holds the logits holds the
serial model's; a pipeline's other ranks return None. The weights every replica starts from are
rank 0's, however the ranks were seeded, and the serial state dict read back from the shards is
the serial model's, exactly. Refusals come before any collective.
"""

from __future__ import annotations

import pytest
import torch
from common import build, expect_error, global_batches

import behemoth as bh
from behemoth.parallelize import serial_state_dict

BATCH = 4


def _logits(out) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out.logits


def _check(family: str, plan: bh.Plan, *, layers: int = 2, seed_per_rank: bool = False) -> None:
    rank = torch.distributed.get_rank()
    what = f"{family} {plan.describe()}"
    serial = build(family, num_layers=layers).eval()
    model = build(family, seed=rank if seed_per_rank else 0, num_layers=layers).eval()
    model = bh.parallelize(model, plan)
    par = bh.parallelization(model)
    assert par.plan.pp == plan.pp and par.mesh.plan.tp == plan.tp, what
    ids = global_batches(1, BATCH)[0]["input_ids"]
    with torch.no_grad():
        want = _logits(serial(ids))
        for attempt in range(2):  # the second call reuses the pipeline's cached message shapes
            out = model(ids)
            holds = par.pipeline is None or par.pipeline.rank == plan.pp - 1
            if not holds:
                assert out is None, (what, attempt)
                continue
            got = _logits(out)
            assert got.shape == want.shape, (what, tuple(got.shape), tuple(want.shape))
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=lambda m: f"{what}: {m}")
    state, want_state = serial_state_dict(model), serial.state_dict()
    assert list(state) == list(want_state), what
    for k, v in want_state.items():
        assert torch.equal(state[k], v), (what, k)


def _world(rank, world):
    _check("gpt", bh.Plan(dp=world), seed_per_rank=True)
    _check("llama", bh.Plan(dp=world), seed_per_rank=True)
    _check("gpt", bh.Plan(tp=world))
    _check("hf-gpt2", bh.Plan(tp=world))
    _check("llama", bh.Plan(tp=world, sequence_parallel=True))
    _check("gpt", bh.Plan(pp=world))
    _check("llama", bh.Plan(pp=world, schedule="interleaved", virtual_stages=2), layers=4)
    _check("hf-llama", bh.Plan(pp=world))
    # refusals, on every rank, before any collective
    expect_error(lambda: bh.parallelize(build("gpt"), bh.Plan(), stages=[(0, 1), (1, 2)]), "Plan.pp=1")
    model = bh.parallelize(build("gpt"), bh.Plan(dp=world))
    expect_error(lambda: bh.parallelize(model, bh.Plan(dp=world)), "already parallelized")
    expect_error(lambda: bh.parallelization(build("gpt")), "was not parallelized")


def test_parallelized_forward_equals_serial():
    bh.spawn(_world, 2, timeout=300)


def test_parallelize_is_public():
    assert bh.parallelize.__module__ == "behemoth.parallelize"
    with pytest.raises(TypeError):
        bh.parallelize(build("gpt"), bh.Plan(), None, None)  # tp_policy and stages are keyword-only

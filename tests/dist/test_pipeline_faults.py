"""Pipelines never hang: plans that cannot work are refused on every rank before any
collective (with the value, the rule and the fix); a stage that raises mid-step and a rank
killed mid-step both end with an error on every rank within the group timeout.
(Fewer micro-batches than stages run, and match serial: tests/dist/test_pipeline_parity.py.)"""

from __future__ import annotations

import os
import time

import torch
from common import build, expect_error, global_batches, make_optimizer

import behemoth as bh

TIMEOUT = 10  # BEHEMOTH_TIMEOUT for these worlds: how long a peer may wait on a dead one


def _refusals_world(rank: int, world: int) -> None:
    model = build("gpt", num_layers=4)
    opt = make_optimizer("sgd", model)
    boost = bh.boost
    expect_error(
        lambda: boost(model, opt, bh.Plan(dp=2, virtual_stages=2, schedule="interleaved")),
        "virtual_stages=2",
        "pp=1",
    )
    expect_error(
        lambda: boost(model, opt, bh.Plan(pp=2), stages=[(0, 3), (2, 4)]),
        "stages=[(0, 3), (2, 4)]",
        "overlaps",
        "For example stages=[(0, 2), (2, 4)]",
    )
    expect_error(lambda: boost(model, opt, bh.Plan(dp=2), stages=[(0, 4)]), "Plan.pp=1")
    expect_error(
        lambda: boost(model, opt, bh.Plan(pp=2, schedule="interleaved", virtual_stages=4)),
        "pp*v=8 stages need at least 8 blocks",
        "the model has 4",
    )
    expect_error(
        lambda: boost(torch.nn.Sequential(torch.nn.Linear(2, 2)), opt, bh.Plan(pp=2)),
        "no pipeline layout for Sequential",
    )
    engine = boost(model, opt, bh.Plan(pp=2, microbatches=4))
    expect_error(lambda: engine.step(global_batches(1, 6)[0]), "6 rows", "multiple of 4")
    t = torch.ones(1)
    torch.distributed.all_reduce(t)  # every rank got here: nothing hung
    assert t.item() == world


def test_pipeline_refusals_on_every_rank():
    bh.spawn(_refusals_world, 2, timeout=120)


def _fault_world(rank: int, world: int, out_dir: str, fault: str) -> None:
    model = build("gpt", num_layers=4)
    engine = bh.boost(model, make_optimizer("sgd", model), bh.Plan(pp=2, microbatches=4))
    batch = global_batches(1, 8)[0]
    engine.step(batch)
    if rank == 1 and fault == "raise":  # the last stage's block fails in the next forward

        def boom(*_):
            raise RuntimeError("boom in stage 1")

        engine.model.blocks[3].register_forward_hook(boom)
    if rank == 1 and fault == "die":
        os._exit(0)  # vanish without a word (exit 0, so spawn does not kill the survivor)
    t0 = time.monotonic()
    try:
        engine.step(batch)
        engine.step(batch)
        outcome = "no-error"
    except Exception as e:
        outcome = type(e).__name__
    with open(os.path.join(out_dir, f"rank{rank}"), "w") as f:
        f.write(f"{outcome} {time.monotonic() - t0:.1f}")
    if fault == "raise" and rank == 1:  # stay alive: the peer's error must come from its timeout
        deadline = time.monotonic() + 3 * TIMEOUT
        while not os.path.exists(os.path.join(out_dir, "rank0")) and time.monotonic() < deadline:
            time.sleep(0.2)
        os._exit(0)


def test_pipeline_stage_that_raises_or_dies_fails_every_rank(tmp_path, monkeypatch):
    monkeypatch.setenv("BEHEMOTH_TIMEOUT", str(TIMEOUT))
    for fault, ranks in (("raise", (0, 1)), ("die", (0,))):
        out = tmp_path / fault
        out.mkdir()
        bh.spawn(_fault_world, 2, str(out), fault, timeout=120)
        for r in ranks:
            outcome, seconds = (out / f"rank{r}").read_text().split()
            assert outcome != "no-error", (fault, r)
            assert float(seconds) < TIMEOUT + 15, (fault, r, seconds)

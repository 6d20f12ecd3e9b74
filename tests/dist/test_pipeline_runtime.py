"""The pipeline runtime prototype (parallel/pipeline/runtime.py) matches serial training:
pp=2 with GPipe and 1F1B, 1, 2 and 4 micro-batches, SGD and AdamW, GPT with tied
embeddings split across the two stages; losses on every rank and the reassembled full
state dict compared with plain PyTorch. One spawned world of 2 runs every scenario."""
from __future__ import annotations

import torch

import behemoth as bh
from behemoth.comm import Axis, Ledger
from behemoth.mesh import ParallelMesh
from behemoth.parallel.pipeline import make_schedule
from behemoth.parallel.pipeline.runtime import PipelineStage, run_schedule
from common import assert_losses_close, assert_state_close, build, global_batches, make_optimizer, serial_train

STEPS, BATCH = 2, 8

# (schedule, micro-batches, optimizer); m=1 < pp=2 must neither hang nor lose parity.
SCENARIOS = [(s, m, o) for s in ("gpipe", "1f1b") for m in (2, 4) for o in ("sgd", "adamw")]
SCENARIOS += [("1f1b", 1, "adamw"), ("gpipe", 1, "sgd")]


def _split(batch: dict, m: int) -> list[dict]:
    return [{k: v.chunk(m, 0)[i].contiguous() for k, v in batch.items()} for i in range(m)]


def _train(stage: PipelineStage, schedule: str, m: int, opt_name: str, batches) -> list[float]:
    opt = make_optimizer(opt_name, torch.nn.ParameterList(stage.parameters()))
    actions = make_schedule(schedule, stage.pp, m)
    losses = []
    for b in batches:
        losses.append(run_schedule(stage, actions, _split(b, m)))
        opt.step()
        opt.zero_grad()
    return losses


def _world(rank: int, world: int) -> None:
    torch.manual_seed(rank)  # per-rank global RNG differs: the runtime must not depend on it
    pp_axis = ParallelMesh(bh.Plan(pp=world), rank, world).axis("pp")
    batches = global_batches(STEPS, BATCH)
    serial = {o: serial_train("gpt", o, batches) for o in ("sgd", "adamw")}
    for schedule, m, opt_name in SCENARIOS:
        what = f"pp={world} {schedule}/m={m}/{opt_name}"
        stage = PipelineStage(build("gpt"), pp_axis)
        assert stage.is_first == (rank == 0) and stage.is_last == (rank == world - 1)
        assert stage.tied == [("wte.weight", 0, "lm_head.weight", world - 1)], stage.tied
        pp_axis.ledger.reset()
        losses = _train(stage, schedule, m, opt_name, batches)
        want_losses, want_state = serial[opt_name]
        assert_losses_close(losses, want_losses, what=what)
        t = torch.tensor(losses, dtype=torch.float64)
        ref = t.clone()
        torch.distributed.broadcast(ref, 0)
        assert torch.equal(t, ref), f"{what}: ranks disagree on the loss"
        # p2p traffic per step: m activations one way, m gradients back; nothing else.
        ops = pp_axis.ledger.stats()["pp"]["ops"]
        assert ops["send"] == ops["recv"] == STEPS * m, (what, ops)
        got = stage.full_state_dict()
        assert_state_close(got, want_state, what=what)
        # The tied copies stayed identical (same gradients, same optimizer steps).
        assert torch.equal(got["wte.weight"], got["lm_head.weight"]), what
    # pp=1 degenerates to plain serial training on this rank (no communication at all).
    solo = Axis("pp", 1, 0, (rank,), None, Ledger())
    for schedule in ("gpipe", "1f1b"):
        stage = PipelineStage(build("gpt"), solo)
        assert stage.tied == []
        losses = _train(stage, schedule, 2, "adamw", batches)
        assert_losses_close(losses, serial["adamw"][0], what=f"pp=1 {schedule}")
        assert_state_close(stage.full_state_dict(), serial["adamw"][1], what=f"pp=1 {schedule}")
        assert solo.ledger.stats() == {}


def test_pipeline_runtime_matches_serial():
    bh.spawn(_world, 2, timeout=120)

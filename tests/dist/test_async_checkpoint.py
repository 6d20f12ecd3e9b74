"""Background checkpoints (engine.save(blocking=False)): the checkpoint holds the state of the call
even though training goes on while it is written -- bit-for-bit the files a synchronous save of
that state writes -- resuming from it is bit-exact, and a process killed while the files are
written leaves the previous checkpoint the newest complete one."""

from __future__ import annotations

import json
import os

import pytest
import torch
from common import (
    assert_state_close,
    build,
    check_last_complete_checkpoint,
    global_batches,
    make_optimizer,
    serial_train,
    shard,
)
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import behemoth as bh
from behemoth import checkpoint as ckpt

BATCH = 8
PLANS = {
    "dp2": dict(dp=2),
    "dp2-zero1": dict(dp=2, zero=1),
    "dp2-zero3": dict(dp=2, zero=3),
    "tp2": dict(tp=2),
    "pp2": dict(pp=2, microbatches=2),
}


def _engine(plan: dict, dropout: float = 0.1):
    model = build("gpt", dropout=dropout)
    return bh.boost(model, make_optimizer("adamw", model), bh.Plan(**plan), max_grad_norm=1.0)


def _step(eng, batch):
    return eng.step(shard(batch, eng.dp_rank, eng.dp_size))


def _files(path: str) -> dict:
    """Every tensor of checkpoint ``path`` (DCP's and each rank's), and its meta.json."""
    flat = path + ".pt"
    if not os.path.exists(flat):
        dcp_to_torch_save(path, flat)
    out = {f"dcp/{k}": v for k, v in torch.load(flat, weights_only=True).items()}
    for name in sorted(os.listdir(path)):
        if name.endswith(".pt"):
            for k, v in torch.load(os.path.join(path, name), weights_only=True).items():
                out[f"{name}/{k}"] = v
    with open(os.path.join(path, ckpt.META)) as f:
        return {"tensors": out, "meta": json.load(f)}


def _same_world(rank, world, root):
    ckpt.WRITER_BYTES_PER_THREAD = 4096  # several writer threads and files per rank, as for a large model
    batches = global_batches(5, BATCH)
    extra = {"data": {"step": 2}}
    for name, plan in PLANS.items():
        base = os.path.join(root, name)
        eng = _engine(plan)
        torch.manual_seed(100 + eng.dp_rank)  # as the trainer seeds: tp ranks share their dropout masks
        straight = [_step(eng, b) for b in batches[:2]]
        eng.save(os.path.join(base, "sync", "step-2"), extra=extra)
        straight += [_step(eng, b) for b in batches[2:]]

        eng = _engine(plan)
        torch.manual_seed(100 + eng.dp_rank)  # as the trainer seeds: tp ranks share their dropout masks
        first = [_step(eng, b) for b in batches[:2]]
        committed = []
        eng.save(os.path.join(base, "async", "step-2"), extra=extra, blocking=False, on_commit=committed.append)
        extra["data"]["step"] = 99  # the caller's objects change too: the checkpoint keeps what was saved
        after = [_step(eng, b) for b in batches[2:]]  # training changes the tensors while they are written
        assert first + after == straight, (name, first + after, straight)
        assert eng.wait_for_save() == os.path.join(base, "async", "step-2")
        assert eng.wait_for_save() is None
        assert committed == ([os.path.join(base, "async", "step-2")] if rank == 0 else []), committed
        extra["data"]["step"] = 2

        torch.manual_seed(999)  # scrambled: the load restores the RNG
        eng = _engine(plan)
        assert eng.load(os.path.join(base, "async", "step-2")) == {"data": {"step": 2}}
        resumed = first + [_step(eng, b) for b in batches[2:]]
        assert resumed == straight, (name, resumed, straight)  # bit-exact resume from the background save


def _compare(root):
    for name in PLANS:
        want = _files(os.path.join(root, name, "sync", "step-2"))
        got = _files(os.path.join(root, name, "async", "step-2"))
        assert got["meta"] == want["meta"], name
        assert sorted(got["tensors"]) == sorted(want["tensors"]), name
        for key, tensor in want["tensors"].items():
            assert torch.equal(got["tensors"][key], tensor), (name, key)
        assert sorted(os.listdir(os.path.join(root, name, "async"))) == ["step-2", "step-2.pt"], name
        files = [f for f in os.listdir(os.path.join(root, name, "async", "step-2")) if f.endswith(".distcp")]
        assert len(files) > 2, files  # each of the 2 ranks wrote with several threads


def test_background_save_equals_the_synchronous_save_bit_for_bit(tmp_path):
    bh.spawn(_same_world, 2, str(tmp_path), timeout=600)
    _compare(str(tmp_path))


def _killed_world(rank, world, root):
    eng = _engine(PLANS["dp2"], dropout=0.0)
    batches = global_batches(3, BATCH)
    _step(eng, batches[0])
    eng.save(os.path.join(root, "step-1"), blocking=False)
    _step(eng, batches[1])
    eng.save(os.path.join(root, "step-2"), blocking=False)  # waits for step-1's commit first

    def die(*args, **kwargs):  # the machine dies once every rank's files are written, before the commit
        os._exit(17)

    ckpt._commit = die
    _step(eng, batches[2])
    eng.wait_for_save()
    raise AssertionError("unreachable")


def _survivor_world(rank, world, root):
    engine = _engine(PLANS["dp2"], dropout=0.0)
    check_last_complete_checkpoint(root, engine, "step-1", global_batches(1, BATCH), "last complete checkpoint")


def test_a_kill_during_a_background_write_keeps_the_previous_checkpoint(tmp_path):
    with pytest.raises(RuntimeError, match="spawn: process"):
        bh.spawn(_killed_world, 2, str(tmp_path), timeout=300)
    names = sorted(os.listdir(tmp_path))
    assert "step-1" in names and "step-2" not in names and "step-2.partial" in names, names
    assert os.path.isfile(os.path.join(tmp_path, "step-2.partial", ".metadata"))  # the data was written
    assert not ckpt.is_complete(str(tmp_path / "step-2.partial"))
    bh.spawn(_survivor_world, 2, str(tmp_path), timeout=300)


def _short_of_memory_world(rank, world, root):
    from behemoth import async_checkpoint

    if rank == 0:  # one host short of memory: every rank writes synchronously
        async_checkpoint.available_host_bytes = lambda: 1024
    eng = _engine(PLANS["dp2"], dropout=0.0)
    batches = global_batches(2, BATCH)
    _step(eng, batches[0])
    committed = []
    eng.save(os.path.join(root, "step-1"), blocking=False, on_commit=committed.append)
    assert eng.wait_for_save() is None  # nothing in flight: the save was complete on return
    assert ckpt.is_complete(os.path.join(root, "step-1"))
    assert committed == ([os.path.join(root, "step-1")] if rank == 0 else [])
    eng.load(os.path.join(root, "step-1"))
    _, want = serial_train("gpt", "adamw", batches[:1], max_grad_norm=1.0)
    assert_state_close(eng.full_state_dict(), want, what="synchronous fallback")


def test_a_host_short_of_memory_writes_synchronously(tmp_path, capfd):
    bh.spawn(_short_of_memory_world, 2, str(tmp_path), timeout=300)
    err = capfd.readouterr().err
    assert "a background save needs" in err and "written synchronously" in err, err

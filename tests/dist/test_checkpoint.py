"""Checkpoints: bit-exact resume under the same plan, loading under another world size
(resharding), a save killed midway never corrupts the last good checkpoint, and only
safe loading."""

from __future__ import annotations

import os
import pickle

import pytest
import torch
from common import (
    assert_losses_close,
    assert_state_close,
    build,
    check_last_complete_checkpoint,
    global_batches,
    make_optimizer,
    serial_train,
    shard,
)

import behemoth as bh
from behemoth import checkpoint as ckpt

BATCH = 8


def _engine(world, family="gpt", opt="adamw", dropout=0.0, precision="fp32"):
    model = build(family, dropout=dropout) if family == "gpt" else build(family)
    return bh.boost(model, make_optimizer(opt, model), bh.Plan(dp=world, precision=precision), max_grad_norm=1.0)


def _resume_world(rank, world, root):
    """Train 4 steps straight; separately train 2, save, rebuild, load, train 2: identical bits."""
    batches = global_batches(4, BATCH)
    torch.manual_seed(100 + rank)  # dropout masks come from the global RNG, per rank
    eng = _engine(world, dropout=0.1)
    straight = [eng.step(shard(b, rank, world)) for b in batches]
    final = eng.full_state_dict()

    torch.manual_seed(100 + rank)
    eng = _engine(world, dropout=0.1)
    first = [eng.step(shard(b, rank, world)) for b in batches[:2]]
    eng.save(os.path.join(root, "step-2"), extra={"data": {"step": 2}})
    torch.manual_seed(999)  # scramble the RNG: load must restore it
    eng = _engine(world, dropout=0.1)
    extra = eng.load(ckpt.latest_checkpoint(root))
    assert extra == {"data": {"step": 2}} and eng.step_count == 2
    rest = [eng.step(shard(b, rank, world)) for b in batches[2:]]
    assert first + rest == straight, (first + rest, straight)  # bit-exact
    for k, v in eng.full_state_dict().items():
        assert torch.equal(v, final[k]), k


def test_resume_is_bit_exact(tmp_path):
    bh.spawn(_resume_world, 2, str(tmp_path), timeout=300)


OPTIMIZERS = ("adamw", "sgd")


def _save_world(rank, world, root, steps):
    for opt in OPTIMIZERS:
        eng = _engine(world, opt=opt)
        for b in global_batches(steps, BATCH):
            eng.step(shard(b, rank, world))
        eng.save(os.path.join(root, opt, f"step-{steps}"))


def _reshard_world(rank, world, root):
    """Load a dp=2 checkpoint at this world size and keep training: matches serial 2+2 steps."""
    batches = global_batches(4, BATCH)
    for opt in OPTIMIZERS:
        eng = _engine(world, opt=opt)
        eng.load(os.path.join(root, opt, "step-2"))
        losses = [eng.step(shard(b, rank, world)) for b in batches[2:]]
        want_losses, want_state = serial_train("gpt", opt, batches, max_grad_norm=1.0)
        assert_losses_close(losses, want_losses[2:], what=f"{opt} resharded to {world}")
        assert_state_close(eng.full_state_dict(), want_state, what=f"{opt} resharded to {world}")


def test_checkpoint_loads_under_another_world_size(tmp_path):
    bh.spawn(_save_world, 2, str(tmp_path), 2, timeout=300)
    for world in (1, 4):
        bh.spawn(_reshard_world, world, str(tmp_path), timeout=300)


def _killed_save_world(rank, world, root):
    eng = _engine(world)
    batches = global_batches(2, BATCH)
    eng.step(shard(batches[0], rank, world))
    eng.save(os.path.join(root, "step-1"))
    eng.step(shard(batches[1], rank, world))
    eng.save(os.path.join(root, "step-2"))
    eng.step(shard(batches[1], rank, world))

    def die(*args, **kwargs):  # the machine dies after the data is written, before the commit
        os._exit(17)

    ckpt._commit = die
    eng.save(os.path.join(root, "step-2"))  # overwriting step-2, killed midway
    raise AssertionError("unreachable")


def _check_survivor_world(rank, world, root):
    check_last_complete_checkpoint(root, _engine(world), "step-2", global_batches(2, BATCH), "last good checkpoint")


def test_killed_save_leaves_last_good_checkpoint(tmp_path):
    with pytest.raises(RuntimeError, match="exit"):
        bh.spawn(_killed_save_world, 2, str(tmp_path), timeout=300)
    names = sorted(os.listdir(tmp_path))
    assert "step-2.partial" in names and "step-1" in names and "step-2" in names, names
    assert not ckpt.is_complete(str(tmp_path / "step-2.partial"))
    with pytest.raises(ValueError, match="incomplete"):
        ckpt.read_meta(str(tmp_path / "step-2.partial"))
    bh.spawn(_check_survivor_world, 2, str(tmp_path), timeout=300)


def test_latest_checkpoint_ignores_partial_and_uses_old_during_replace(tmp_path):
    for name, complete in (("step-3", True), ("step-10.partial", False), ("step-7.old", True), ("junk", True)):
        os.makedirs(tmp_path / name)
        if complete:
            (tmp_path / name / ckpt.META).write_text("{}")
    # step-7 is mid-replace: only its .old copy exists, and it is complete.
    assert ckpt.latest_checkpoint(str(tmp_path)).endswith("step-7.old")
    os.makedirs(tmp_path / "step-7")
    (tmp_path / "step-7" / ckpt.META).write_text("{}")
    assert ckpt.latest_checkpoint(str(tmp_path)).endswith("step-7")
    assert ckpt.latest_checkpoint(str(tmp_path / "missing")) is None


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_metadata_with_code_is_refused(tmp_path):
    (tmp_path / ".metadata").write_bytes(pickle.dumps(_Evil()))
    with pytest.raises(pickle.UnpicklingError, match="posix.system|os.system|refusing"):
        ckpt.SafeFileSystemReader(str(tmp_path)).read_metadata()

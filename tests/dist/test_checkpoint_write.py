"""How a checkpoint's bytes are written: a tensor the dp replicas hold is written once, and the
replicas share the writing evenly; each rank writes with the number of threads (one file each)
asked for, synchronous or in the background (each rank copying only the tensors it writes, into
host buffers reserved ahead of the first background save, which a later blocking save uses too);
a process killed while its writer threads are
writing leaves the previous checkpoint the newest complete one."""

from __future__ import annotations

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

import behemoth as bh
from behemoth import checkpoint as ckpt

BATCH = 8


def _engine():
    model = build("gpt", num_layers=4)
    return bh.boost(model, make_optimizer("adamw", model), bh.Plan(dp=2), max_grad_norm=1.0)


def _written(path: str) -> tuple[dict[int, int], dict[int, int]]:
    """``({rank: bytes of its .distcp files}, {rank: number of them})`` of checkpoint ``path``."""
    nbytes: dict[int, int] = {}
    files: dict[int, int] = {}
    for name in os.listdir(path):
        if name.endswith(".distcp"):  # __<rank>_<file>.distcp
            rank = int(name[2:].split("_")[0])
            nbytes[rank] = nbytes.get(rank, 0) + os.path.getsize(os.path.join(path, name))
            files[rank] = files.get(rank, 0) + 1
    return nbytes, files


def _split_world(rank, world, root):
    batches = global_batches(2, BATCH)
    eng = _engine()
    eng.step(shard(batches[0], rank, world))
    tensors, _ = ckpt.collect(eng._checkpoint_parts())
    sizes = sorted(t.numel() * t.element_size() for t in tensors.values())
    eng.save(os.path.join(root, "sync"), threads=3)
    eng.reserve_save_buffers()  # the background save's host buffers, allocated ahead of it
    eng._saver._join_reserve()
    reserved = {d: b.data_ptr() for d, b in eng._saver._snapshot._buffers.items()}
    copied = torch.tensor([eng._saver._snapshot.bytes], dtype=torch.int64)
    torch.distributed.all_reduce(copied)
    assert int(copied) == sum(sizes), (int(copied), sum(sizes))  # each rank copies its share: the state once
    assert eng._saver._snapshot.bytes < 0.6 * sum(sizes)
    eng.save(os.path.join(root, "async"), threads=2, blocking=False)
    eng.wait_for_save()
    assert {d: b.data_ptr() for d, b in eng._saver._snapshot._buffers.items()} == reserved  # used, not replaced
    eng.step(shard(batches[1], rank, world))
    eng.save(os.path.join(root, "blocking"), threads=2)  # a blocking save goes through the same buffers
    assert not eng._saver.in_flight and ckpt.is_complete(os.path.join(root, "blocking"))
    assert {d: b.data_ptr() for d, b in eng._saver._snapshot._buffers.items()} == reserved
    assert _written(os.path.join(root, "blocking"))[1] == {0: 2, 1: 2}
    for name, threads in (("sync", 3), ("async", 2)):
        nbytes, files = _written(os.path.join(root, name))
        assert files == {0: threads, 1: threads}, (name, files)
        # every replicated tensor written once: the files hold one copy of the state (and a small
        # header per tensor), not two, and not the background copy's whole host buffer per tensor
        total = sum(nbytes.values())
        assert sum(sizes) < total < sum(sizes) + 2048 * len(sizes), (name, total, sum(sizes))
        # and the replicas share the writing: the ranks' bytes differ by at most the largest tensor
        assert abs(nbytes[0] - nbytes[1]) <= sizes[-1] + 2048 * len(sizes), (name, nbytes, sizes[-1])
    for name, steps in (("sync", 1), ("async", 1), ("blocking", 2)):
        eng = _engine()
        eng.load(os.path.join(root, name))
        _, want = serial_train("gpt", "adamw", batches[:steps], max_grad_norm=1.0, num_layers=4)
        assert_state_close(eng.full_state_dict(), want, what=name)
        assert eng.step_count == steps


def test_replicas_share_the_write_and_each_rank_uses_the_threads_asked_for(tmp_path):
    bh.spawn(_split_world, 2, str(tmp_path), timeout=600)


def test_writer_threads_must_be_a_positive_integer():
    ckpt.check_threads(None)
    ckpt.check_threads(4)
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="must be an integer >= 1"):
            ckpt.check_threads(bad)


def _killed_world(rank, world, root):
    from torch.distributed.checkpoint import filesystem

    eng = _engine()
    batches = global_batches(2, BATCH)
    eng.step(shard(batches[0], rank, world))
    eng.save(os.path.join(root, "step-1"), blocking=False, threads=3)
    eng.step(shard(batches[1], rank, world))
    eng.wait_for_save()

    written = []
    write_item = filesystem._write_item

    def die_midway(*args, **kwargs):  # rank 1 dies after its writer threads have written a few tensors
        if rank == 1 and len(written) >= 4:
            os._exit(17)
        written.append(1)
        return write_item(*args, **kwargs)

    filesystem._write_item = die_midway
    eng.save(os.path.join(root, "step-2"), blocking=False, threads=3)
    eng.wait_for_save()
    raise AssertionError("unreachable")


def _survivor_world(rank, world, root):
    batches = global_batches(1, BATCH)
    check_last_complete_checkpoint(root, _engine(), "step-1", batches, "last complete checkpoint", num_layers=4)


def test_a_kill_while_several_threads_write_keeps_the_previous_checkpoint(tmp_path):
    with pytest.raises(RuntimeError, match="spawn: process"):
        bh.spawn(_killed_world, 2, str(tmp_path), timeout=300)
    names = sorted(os.listdir(tmp_path))
    assert "step-1" in names and "step-2" not in names and "step-2.partial" in names, names
    assert not ckpt.is_complete(str(tmp_path / "step-2.partial"))
    assert not os.path.exists(tmp_path / "step-2.partial" / ".metadata")  # killed before the index was written
    bh.spawn(_survivor_world, 2, str(tmp_path), timeout=300)

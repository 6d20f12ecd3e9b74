"""A run's directory (behemoth.train.run_dir): a new run never lands beside an old one, pruning
sees only this run's checkpoints, a resumed run's metrics hold each step once; the step line's
counts and durations (behemoth.train.metrics)."""

from __future__ import annotations

import json
import os

import pytest

from behemoth.train.config import load_config
from behemoth.train.config_sections import ConfigError, TrainSection
from behemoth.train.metrics import format_count, format_duration, format_step
from behemoth.train.run_dir import (
    check_out_dir,
    check_resume,
    clear_run,
    previous_run,
    prune_checkpoints,
    restarted,
    rewind,
    skipped_checkpoints,
    truncate_metrics,
)


def _checkpoint(ckpt_dir, step: int, complete: bool = True) -> None:
    d = ckpt_dir / f"step-{step}"
    d.mkdir(parents=True)
    if complete:
        (d / "meta.json").write_text("{}")


def test_prune_keeps_the_newest_complete_checkpoints(tmp_path):
    for n in (1, 2, 3, 4):
        (tmp_path / f"step-{n}").mkdir()
        (tmp_path / f"step-{n}" / "meta.json").write_text("{}")
    (tmp_path / "step-5.partial").mkdir()  # an interrupted save: not ours to touch
    (tmp_path / "step-0").mkdir()  # incomplete (no meta.json): left alone
    deleted = prune_checkpoints(str(tmp_path), keep_last=2)
    assert sorted(os.path.basename(p) for p in deleted) == ["step-1", "step-2"]
    assert sorted(os.listdir(tmp_path)) == ["step-0", "step-3", "step-4", "step-5.partial"]
    assert prune_checkpoints(str(tmp_path), keep_last=0) == []


def test_prune_never_deletes_the_checkpoint_just_saved(tmp_path):
    """A later step's checkpoint is not this run's: the one just saved (step 3) survives keep_last=1."""
    for n in (3, 20, 40):
        _checkpoint(tmp_path, n)
    assert prune_checkpoints(str(tmp_path), keep_last=1, newest=3) == []
    assert sorted(os.listdir(tmp_path)) == ["step-20", "step-3", "step-40"]
    _checkpoint(tmp_path, 6)
    deleted = prune_checkpoints(str(tmp_path), keep_last=1, newest=6)
    assert [os.path.basename(p) for p in deleted] == ["step-3"]


def test_a_new_run_into_an_old_runs_directory_is_refused_with_the_fix(tmp_path):
    out = tmp_path / "run"
    fresh = TrainSection(out_dir=str(out), resume=False)
    check_out_dir(fresh)  # nothing there yet
    (out / "checkpoints").mkdir(parents=True)
    check_out_dir(fresh)  # an empty checkpoints/ is no run
    _checkpoint(out / "checkpoints", 40)
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    assert previous_run(str(out)) == ["checkpoints (newest step-40)", "metrics.jsonl"]
    with pytest.raises(ConfigError) as e:
        check_out_dir(fresh)
    msg = str(e.value)
    assert "step-40" in msg and "--train.resume=true" in msg and "--train.overwrite=true" in msg
    check_out_dir(TrainSection(out_dir=str(out), resume=True))  # continuing it is fine
    check_out_dir(TrainSection(out_dir=str(out), resume=False, overwrite=True))

    (out / "cache").mkdir()
    deleted = clear_run(str(out))
    assert sorted(os.path.basename(p) for p in deleted) == ["checkpoints", "metrics.jsonl"]
    assert os.listdir(out) == ["cache"]  # the token cache is not the run's
    check_out_dir(fresh)


def test_truncate_metrics_keeps_the_lineage_up_to_the_checkpoint(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in range(1, 8)))
    assert truncate_metrics(str(path), 7) == 0
    assert truncate_metrics(str(path), 5) == 2
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3, 4, 5]
    assert truncate_metrics(str(path), 0) == 5 and path.read_text() == ""
    assert truncate_metrics(str(tmp_path / "absent.jsonl"), 3) == 0


def test_train_section_validates_the_new_fields():
    with pytest.raises(ConfigError, match="train.overwrite"):
        TrainSection(overwrite="yes")
    with pytest.raises(ConfigError, match="train.hang_timeout"):
        TrainSection(hang_timeout=-1)
    assert TrainSection().hang_timeout == 120.0 and TrainSection().overwrite is False


def test_counts_and_durations_read_at_a_glance():
    assert format_count(840) == "840"
    assert format_count(837_888) == "0.84M"  # gpt-mini: not "0.00B"
    assert format_count(124_439_808) == "124.4M"
    assert format_count(1_315_575_808) == "1.32B"
    assert format_duration(59.6) == "1:00" and format_duration(3725) == "1:02:05" and format_duration(-1) == "0:00"
    line = format_step(
        {
            "step": 5,
            "loss": 2.0,
            "grad_norm": 1.0,
            "lr": 1e-3,
            "tokens_per_s": 1000.0,
            "memory_mib": 10.0,
            "elapsed_s": 65.0,
            "eta_s": 130.0,
        },
        10,
    )
    assert line.endswith("| 1:05 elapsed, eta 2:10"), line


def _saved_run(ckpt_dir, step: int, config) -> None:
    """A real (one-tensor) checkpoint: DCP files, an RNG archive, meta.json with the job's config."""
    import torch
    import torch.distributed.checkpoint as dcp

    d = ckpt_dir / f"step-{step}"
    dcp.save({"model/w": torch.arange(1000.0)}, storage_writer=dcp.FileSystemWriter(str(d)), no_dist=True)
    torch.save({"torch": torch.get_rng_state()}, d / "rng-rank0.pt")
    meta = {"format": 1, "step": step, "extra": {"config": config.to_dict()}}
    (d / "meta.json").write_text(json.dumps(meta))


def test_resume_refuses_changes_to_what_the_checkpoint_means_and_names_the_rest(tmp_path):
    base = load_config(None, ["--train.global_batch_size=8", "--optim.lr=1e-3"])
    _saved_run(tmp_path, 3, base)
    ckpt = str(tmp_path / "step-3")
    assert check_resume(ckpt, base) == []
    same_meaning = load_config(
        None, ["--train.global_batch_size=8", "--optim.lr=5e-4", "--plan.zero=1", "--train.out_dir=elsewhere"]
    )
    assert check_resume(ckpt, same_meaning) == ["optim.lr 0.001 -> 0.0005", "plan.zero 0 -> 1"]
    for override, change in (
        ("--train.global_batch_size=16", "train.global_batch_size 8 -> 16"),
        ("--data.source=other.bin", "data.source 'default' -> 'other.bin'"),
        ("--model.hidden=96", "model.hidden"),
    ):
        with pytest.raises(ConfigError) as e:
            check_resume(ckpt, load_config(None, ["--train.global_batch_size=8", override]))
        assert change in str(e.value) and "--train.overwrite=true" in str(e.value), str(e.value)
    shard = next(p for p in (tmp_path / "step-3").iterdir() if p.name.endswith(".distcp"))
    whole = shard.read_bytes()
    shard.write_bytes(whole[:100])
    with pytest.raises(ConfigError, match=rf"is damaged: {shard.name} is truncated \(100 bytes; its index needs"):
        check_resume(ckpt, base)
    shard.write_bytes(whole)
    rng = tmp_path / "step-3" / "rng-rank0.pt"
    rng.write_bytes(rng.read_bytes()[:40])
    with pytest.raises(ConfigError, match="is damaged: rng-rank0.pt is not a whole archive"):
        check_resume(ckpt, base)
    (tmp_path / "step-3" / ".metadata").write_bytes(b"garbage")
    with pytest.raises(ConfigError, match=r"is damaged: its tensor index .metadata cannot be read"):
        check_resume(ckpt, base)
    (tmp_path / "step-3" / ".metadata").unlink()
    with pytest.raises(ConfigError, match=r"is damaged: its tensor index .metadata is missing"):
        check_resume(ckpt, base)
    (tmp_path / "step-3" / "meta.json").write_text("{not json")
    with pytest.raises(ConfigError, match="is damaged: its meta.json cannot be read.*--train.resume_from"):
        check_resume(ckpt, base)


def test_resume_from_and_rewind(tmp_path):
    out = tmp_path / "run"
    ckpts = out / "checkpoints"
    for n in (10, 20, 30):
        _checkpoint(ckpts, n)
    (ckpts / "step-40.partial").mkdir()
    (ckpts / "step-40").mkdir()  # no meta.json: damaged, or a save interrupted between renames
    assert skipped_checkpoints(str(ckpts), str(ckpts / "step-30")) == ["step-40"]
    assert skipped_checkpoints(str(ckpts), None) == ["step-40"]
    deleted = rewind(str(ckpts), 20)
    assert sorted(os.path.basename(p) for p in deleted) == ["step-30", "step-40", "step-40.partial"]
    assert sorted(os.listdir(ckpts)) == ["step-10", "step-20"]

    # resume_from: a checkpoint of this run is fine; another run's only into an empty out_dir (or overwrite)
    check_out_dir(TrainSection(out_dir=str(out), resume_from=str(ckpts / "step-10")))
    other = tmp_path / "other"
    _checkpoint(other / "checkpoints", 5)
    with pytest.raises(ConfigError, match="already holds a run"):
        check_out_dir(TrainSection(out_dir=str(out), resume_from=str(other / "checkpoints" / "step-5")))
    check_out_dir(TrainSection(out_dir=str(out), resume_from=str(other / "checkpoints" / "step-5"), overwrite=True))
    check_out_dir(TrainSection(out_dir=str(tmp_path / "new"), resume_from=str(other / "checkpoints" / "step-5")))
    with pytest.raises(ConfigError, match="would delete train.resume_from"):
        check_out_dir(TrainSection(out_dir=str(out), resume_from=str(ckpts / "step-10"), overwrite=True))
    with pytest.raises(ConfigError, match="is not a complete checkpoint"):
        check_out_dir(TrainSection(out_dir=str(out), resume_from=str(ckpts / "step-40")))


def test_held_out_split_shares_no_token_and_eval_every_needs_it():
    import numpy as np

    from behemoth.train.data import TokenDataset
    from behemoth.train.evaluate import split_held_out

    data = TokenDataset(np.arange(101, dtype=np.uint16), vocab_size=200)  # 10 windows of 10 + 1 tokens
    train, held = split_held_out(data, 0.2, 10)
    assert train.tokens.tolist() == list(range(81)) and held.tokens.tolist() == list(range(81, 101))
    assert train.vocab_size == held.vocab_size == 200
    with pytest.raises(ValueError, match="leaves nothing to train on"):
        split_held_out(data, 1.0, 10)
    with pytest.raises(ConfigError, match="needs a held-out split; set data.eval_fraction"):
        load_config(None, ["--train.eval_every=10"])
    assert load_config(None, ["--train.eval_every=10", "--data.eval_fraction=0.05"]).train.eval_every == 10


def test_a_restarted_group_continues_its_own_run(tmp_path):
    out = tmp_path / "run"
    other = tmp_path / "other" / "checkpoints" / "step-5"
    fresh = load_config(None, [f"--train.out_dir={out}", "--train.resume=false", "--train.overwrite=true"])
    assert restarted(fresh, 0) is fresh  # the first attempt runs as configured
    again = restarted(fresh, 1).train
    assert again.resume and not again.overwrite  # no second overwrite of the first attempt's progress
    check_out_dir(again)
    from_other = load_config(None, [f"--train.out_dir={out}", f"--train.resume_from={other}"])
    assert restarted(from_other, 1).train.resume_from == str(other)  # nothing saved yet: start there again
    _checkpoint(out / "checkpoints", 10)
    assert restarted(from_other, 1).train.resume_from is None  # its own newest checkpoint now
    plain = load_config(None, [f"--train.out_dir={out}"])
    assert restarted(plain, 3) is plain


def test_the_checkpoint_loader_refuses_a_damaged_checkpoint_before_reading_tensors(tmp_path):
    from behemoth.checkpoint import damage, read_meta

    _saved_run(tmp_path, 3, load_config(None))
    ckpt = str(tmp_path / "step-3")
    assert damage(ckpt) is None and read_meta(ckpt)["step"] == 3
    rng = tmp_path / "step-3" / "rng-rank0.pt"
    rng.write_bytes(rng.read_bytes()[:40])
    with pytest.raises(ValueError, match=r"step-3' is damaged: rng-rank0.pt is not a whole archive"):
        read_meta(ckpt)


def test_build_for_checkpoint_skips_the_init_only_when_the_checkpoint_sets_every_value(tmp_path):
    """A checkpoint holding every tensor of the model: built without init, and after the load equal to the
    saved weights (tied embeddings tied again). One lacking a tensor, or of another shape: the normal,
    initialised build (bit-equal to build_model's)."""
    import torch
    import torch.distributed.checkpoint as dcp

    from behemoth.models import build_model
    from behemoth.train.run_dir import build_for_checkpoint

    def build(device):
        return build_model("gpt-tiny", vocab_size=257, seq_len=32, device=device)

    reference = build(None)
    saved = {f"model/{k}": v.detach() * 2 + 1 for k, v in reference.state_dict().items()}
    full = tmp_path / "full"
    dcp.save(saved, storage_writer=dcp.FileSystemWriter(str(full)), no_dist=True)
    model, skipped = build_for_checkpoint(build, str(full))
    assert skipped and model.lm_head.weight is model.wte.weight and model.wte.weight.device.type == "cpu"
    state = {f"model/{k}": v for k, v in model.state_dict().items()}
    dcp.load(state, storage_reader=dcp.FileSystemReader(str(full)), no_dist=True)
    for k, v in model.state_dict().items():
        assert v.equal(saved[f"model/{k}"]), k

    partial = tmp_path / "partial"
    dropped = {k: v for k, v in saved.items() if k != "model/ln_f.weight"}
    dcp.save(dropped, storage_writer=dcp.FileSystemWriter(str(partial)), no_dist=True)
    other = tmp_path / "other"
    dcp.save(
        {**saved, "model/wpe.weight": torch.zeros(8, 8)}, storage_writer=dcp.FileSystemWriter(str(other)), no_dist=True
    )
    for path in (partial, other, tmp_path / "nothing"):
        model, skipped = build_for_checkpoint(build, str(path))
        assert not skipped
        for k, v in reference.state_dict().items():
            assert v.equal(model.state_dict()[k]), (path, k)

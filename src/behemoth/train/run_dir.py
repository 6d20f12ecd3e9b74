"""A run's directory, ``train.out_dir``: what a new run finds there and what it may do with it.

Layout::

    checkpoints/step-N/   complete checkpoints (the newest ``train.keep_last`` kept)
    metrics.jsonl         one record per step of this run's lineage (resumes included)
    tensorboard/, loss.png, summary.json, wandb/ and wandb-run-id (with train.wandb_project)

A job either continues the run its ``out_dir`` holds (``train.resume``, the default; or from
a chosen checkpoint, ``train.resume_from``) or starts a new one. A resume keeps what the
saved weights and data position mean (:func:`check_resume`: the model, the data, the batch
size and the data seed), and names every other setting that changed. A new run never writes
beside another run's files, where keep-last pruning would delete its own checkpoints against
the old run's newer ones and the logs would mix: it is refused with the fix
(:func:`check_out_dir`), or, with ``train.overwrite``, the old run's files are deleted first
(:func:`clear_run`). A resumed run drops the records past its checkpoint from
``metrics.jsonl`` (:func:`truncate_metrics`), so no step appears twice.

Everything here is file-system work for rank 0 (or, for the checks, every rank); nothing
communicates. Test: ``pytest tests/unit/test_run_dir.py``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil

from behemoth.train.config import Config
from behemoth.train.config_sections import ConfigError, TrainSection

__all__ = [
    "RUN_FILES",
    "FIXED_ON_RESUME",
    "previous_run",
    "check_out_dir",
    "restarted",
    "clear_run",
    "prune_checkpoints",
    "rewind",
    "truncate_metrics",
    "skipped_checkpoints",
    "resume_changes",
    "check_files",
    "check_resume",
    "load_weights",
    "build_for_checkpoint",
]

RUN_FILES = ("checkpoints", "metrics.jsonl", "tensorboard", "loss.png", "summary.json", "wandb", "wandb-run-id")
"""What a run writes under its out_dir (the token cache is not the run's: it survives an overwrite)."""

_STEP_DIR = re.compile(r"^step-(\d+)$")


def _steps(ckpt_dir: str) -> list[int]:
    """Steps of the complete ``step-N`` checkpoints under ``ckpt_dir``, ascending."""
    if not os.path.isdir(ckpt_dir):
        return []
    return sorted(
        int(m.group(1))
        for name in os.listdir(ckpt_dir)
        if (m := _STEP_DIR.match(name)) and os.path.isfile(os.path.join(ckpt_dir, name, "meta.json"))
    )


def previous_run(out_dir: str) -> list[str]:
    """The run files ``out_dir`` already holds, for messages: e.g.
    ``["checkpoints (step-40)", "metrics.jsonl"]``. An empty ``checkpoints/`` counts as nothing."""
    found = []
    for name in RUN_FILES:
        path = os.path.join(out_dir, name)
        if name == "checkpoints":
            if os.path.isdir(path) and os.listdir(path):
                steps = _steps(path)
                found.append(f"checkpoints (newest step-{steps[-1]})" if steps else "checkpoints (incomplete)")
        elif os.path.exists(path):
            found.append(name)
    return found


def restarted(config: Config, restart_count: int | None = None) -> Config:
    """The config a group restarted by torchrun (``TORCHELASTIC_RESTART_COUNT`` > 0) runs: it
    continues its own progress from the newest checkpoint in out_dir (``resume_from`` only if
    there is none yet), with no second overwrite and no refusal of its own run's files."""
    if restart_count is None:
        restart_count = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    train = config.train
    if restart_count == 0 or (train.resume and not train.overwrite and train.resume_from is None):
        return config
    own = _steps(os.path.join(train.out_dir, "checkpoints"))
    train = dataclasses.replace(train, resume=True, overwrite=False, resume_from=None if own else train.resume_from)
    return dataclasses.replace(config, train=train)


def check_out_dir(train: TrainSection) -> None:
    """Refuse a new run (``resume = false``) into an out_dir that holds another run's files,
    unless ``overwrite`` says to delete them. Pure file-system reads: call it on every rank."""
    if train.resume_from is not None and not os.path.isfile(os.path.join(train.resume_from, "meta.json")):
        raise ConfigError(
            f"train.resume_from={train.resume_from!r} is not a complete checkpoint (no meta.json); pass a "
            f"checkpoint directory such as {os.path.join(train.out_dir, 'checkpoints', 'step-N')}."
        )
    own = os.path.abspath(os.path.join(train.out_dir, "checkpoints"))
    if (
        train.resume_from is not None
        and train.overwrite
        and os.path.abspath(train.resume_from).startswith(os.path.abspath(train.out_dir) + os.sep)
    ):
        raise ConfigError(
            f"train.overwrite=true would delete train.resume_from={train.resume_from!r}, which lies in "
            f"train.out_dir; copy the checkpoint elsewhere first, or drop one of the two."
        )
    if train.resume_from is not None and os.path.dirname(os.path.abspath(train.resume_from)) != own:
        found = [] if train.overwrite else previous_run(train.out_dir)
        if found:
            raise ConfigError(
                f"train.resume_from={train.resume_from!r} is another run's checkpoint, but "
                f"train.out_dir={train.out_dir!r} already holds a run ({', '.join(found)}). Choose another "
                "--train.out_dir, or pass --train.overwrite=true to delete that run first."
            )
        return
    if train.resume or train.overwrite:
        return
    found = previous_run(train.out_dir)
    if found:
        raise ConfigError(
            f"train.out_dir={train.out_dir!r} already holds a run ({', '.join(found)}) and "
            "train.resume=false would start a new one beside it (mixed logs; keep-last would prune against "
            "the old checkpoints). Continue that run with --train.resume=true, choose another "
            "--train.out_dir, or pass --train.overwrite=true to delete its files and start over."
        )


def clear_run(out_dir: str) -> list[str]:
    """Delete the run files (:data:`RUN_FILES`) under ``out_dir``; returns what was deleted."""
    deleted = []
    for name in RUN_FILES:
        path = os.path.join(out_dir, name)
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.remove(path)
        else:
            continue
        deleted.append(path)
    return deleted


def rewind(ckpt_dir: str, step: int) -> list[str]:
    """Delete every ``step-N`` (complete or not) past ``step``: a run resumed from an earlier
    checkpoint of its own must not find its abandoned future on a later restart."""
    if not os.path.isdir(ckpt_dir):
        return []
    doomed = [
        os.path.join(ckpt_dir, name)
        for name in sorted(os.listdir(ckpt_dir))
        if (m := re.match(r"^step-(\d+)(\.partial|\.old)?$", name)) and int(m.group(1)) > step
    ]
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return doomed


def prune_checkpoints(ckpt_dir: str, keep_last: int, *, newest: int | None = None) -> list[str]:
    """Delete complete ``step-N`` checkpoints beyond the newest ``keep_last`` (0 keeps all).

    ``newest`` (the step just saved) bounds what counts: a checkpoint of a later step is not
    this run's, and the one just saved is never deleted. Incomplete directories are left to
    the checkpoint module. Returns the deleted paths."""
    if keep_last <= 0:
        return []
    steps = [s for s in _steps(ckpt_dir) if newest is None or s <= newest]
    doomed = [os.path.join(ckpt_dir, f"step-{s}") for s in steps[:-keep_last]]
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return doomed


def truncate_metrics(path: str, last_step: int) -> int:
    """Keep only the records of ``metrics.jsonl`` at ``path`` with ``step <= last_step`` (the
    checkpoint a run resumes from), rewritten atomically. Returns how many were dropped."""
    if not os.path.isfile(path):
        return 0
    with open(path) as f:
        lines = [line for line in f if line.strip()]
    kept = [line for line in lines if json.loads(line).get("step", 0) <= last_step]
    if len(kept) == len(lines):
        return 0
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(kept)
    os.replace(tmp, path)
    return len(lines) - len(kept)


def skipped_checkpoints(ckpt_dir: str, newest: str | None) -> list[str]:
    """Directories under ``ckpt_dir`` named like a checkpoint newer than ``newest`` but not
    complete (no meta.json: an interrupted save, or a damaged checkpoint), for a warning."""
    if not os.path.isdir(ckpt_dir):
        return []
    m = _STEP_DIR.match(os.path.basename(newest)) if newest else None
    floor = int(m.group(1)) if m else -1
    return sorted(
        name
        for name in os.listdir(ckpt_dir)
        if (n := _STEP_DIR.match(name))
        and int(n.group(1)) > floor
        and not os.path.isfile(os.path.join(ckpt_dir, name, "meta.json"))
    )


FIXED_ON_RESUME = {
    "model": ("name", "vocab_size", "seq_len", "num_layers", "num_heads", "hidden"),
    "data": ("source", "tokenizer", "bin_dtype", "default_corpus_bytes", "eval_fraction"),
    "optim": ("name",),
    "train": ("global_batch_size", "seed"),
}
"""Settings a resume must keep: the saved weights and data position mean nothing under others."""

_NOT_NOTED = {("train", k) for k in ("out_dir", "resume", "overwrite", "resume_from", "init_from")} | {
    ("data", "cache_dir")
}


def resume_changes(saved: dict, current: dict) -> tuple[list[str], list[str]]:
    """``(refused, noted)``: each changed setting as ``"section.key old -> new"``, split by
    :data:`FIXED_ON_RESUME`. ``saved`` and ``current`` are ``Config.to_dict()`` forms."""
    refused, noted = [], []
    for section, values in current.items():
        for key, value in values.items():
            old = saved.get(section, {}).get(key, value)
            if old == value or (section, key) in _NOT_NOTED:
                continue
            change = f"{section}.{key} {old!r} -> {value!r}"
            (refused if key in FIXED_ON_RESUME.get(section, ()) else noted).append(change)
    return refused, noted


def _damaged(checkpoint: str, what: str) -> ConfigError:
    return ConfigError(
        f"checkpoint {checkpoint!r} is damaged: {what}. Move it away to resume from the previous checkpoint, "
        f"or pass --train.resume_from=PATH."
    )


def check_files(checkpoint: str) -> None:
    """Refuse a damaged checkpoint (``behemoth.checkpoint.damage``: a truncated shard or RNG file,
    an unreadable index) with the trainer's fix. Reads sizes and small files: call on every rank,
    so all refuse together before loading."""
    from behemoth.checkpoint import damage

    problem = damage(checkpoint)
    if problem is not None:
        raise _damaged(checkpoint, problem)


def check_resume(checkpoint: str, config: Config) -> list[str]:
    """Refuse to resume ``checkpoint`` when it is damaged (:func:`check_files`) or under a config
    that changes what its weights or data position mean; return the other changes (to log).
    Reads its files: call on every rank."""
    path = os.path.join(checkpoint, "meta.json")
    try:
        with open(path) as f:
            saved = json.load(f).get("extra", {}).get("config")
    except (OSError, ValueError, AttributeError) as e:
        raise _damaged(checkpoint, f"its meta.json cannot be read ({e})") from None
    check_files(checkpoint)
    if not isinstance(saved, dict):
        return []
    refused, noted = resume_changes(saved, config.to_dict())
    if refused:
        raise ConfigError(
            f"cannot resume {checkpoint!r}: it was trained with other settings ({'; '.join(refused)}), and "
            "its weights and data position belong to those. Resume with the checkpoint's values, or start a "
            "new run (another --train.out_dir, or --train.overwrite=true)."
        )
    return noted


def load_weights(model, checkpoint: str) -> None:
    """Load only the model weights of ``checkpoint`` (saved under any plan, or a transformers
    checkpoint directory: ``config.json`` and ``.safetensors``, read by :func:`behemoth.hf.load_hf`)
    into the serial ``model``, before it is parallelised: every rank reads the whole tensors, no
    communication. Refuses a damaged checkpoint or one of another model, naming the fix."""
    import torch.distributed.checkpoint as dcp

    from behemoth.checkpoint import SafeFileSystemReader

    if not os.path.isfile(os.path.join(checkpoint, "meta.json")) and os.path.isfile(
        os.path.join(checkpoint, "config.json")
    ):
        from behemoth.hf.load import load_hf

        try:
            load_hf(model, checkpoint)
        except ValueError as e:
            raise ConfigError(f"train.init_from={checkpoint!r}: {e} Set the [model] section to its shape.") from None
        return
    if not os.path.isfile(os.path.join(checkpoint, "meta.json")):
        raise ConfigError(
            f"train.init_from={checkpoint!r} is not a complete checkpoint (no meta.json) nor a transformers "
            f"checkpoint directory (no config.json)."
        )
    check_files(checkpoint)
    reader = SafeFileSystemReader(checkpoint)
    stored = reader.read_metadata().state_dict_metadata
    state = model.state_dict()
    wrong = [
        k for k, v in state.items() if f"model/{k}" not in stored or tuple(stored[f"model/{k}"].size) != tuple(v.shape)
    ]
    if wrong:
        raise ConfigError(
            f"train.init_from={checkpoint!r} holds another model (missing or other shapes: {wrong[:3]}"
            f"{' ...' if len(wrong) > 3 else ''}); set the [model] section it was trained with."
        )
    tensors = {f"model/{k}": v for k, v in state.items()}
    dcp.load(tensors, storage_reader=reader, no_dist=True)
    model.load_state_dict({k: tensors[f"model/{k}"] for k in state})


def build_for_checkpoint(build, checkpoint: str):
    """``(model, skipped_init)``: the model ``build(device)`` makes, with its random initialisation
    skipped when ``checkpoint`` will overwrite every value in it (a resume, or ``train.init_from``).

    The model is built on the meta device first; the init is skipped only if the checkpoint holds
    every parameter and persistent buffer under ``model/`` with its shape and the model has no
    non-persistent buffer (those are not saved, so nothing would set them). Then its tensors are
    allocated uninitialised on the default device (``to_empty``; tied weights tied again) -- the
    load writes them. Otherwise (another model, a transformers directory, an unreadable index) it is
    ``build(None)``, initialised as usual, and the load reports any mismatch. Reads the checkpoint's
    index only: call on every rank. A GPT-1.3B's random init on the CPU is what this saves."""
    import torch

    from behemoth.checkpoint import SafeFileSystemReader

    model = build(torch.device("meta"))
    state = model.state_dict()
    transient = [name for name, _ in model.named_buffers() if name not in state]
    try:
        stored = SafeFileSystemReader(checkpoint).read_metadata().state_dict_metadata
    except Exception:  # no DCP index here: the normal build, and the load names the problem
        stored = {}
    covered = all(
        f"model/{k}" in stored and tuple(stored[f"model/{k}"].size) == tuple(v.shape) for k, v in state.items()
    )
    if transient or not covered or not hasattr(model, "tie_weights"):
        return build(None), False
    model.to_empty(device=torch.get_default_device())
    model.tie_weights()
    return model, True

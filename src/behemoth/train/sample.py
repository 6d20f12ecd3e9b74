"""Text from a trained model: ``behemoth generate CHECKPOINT`` and the trainer's periodic sample
(``train.sample_every``).

A checkpoint the trainer wrote carries its run's config (``meta.json``'s ``extra.config``): the
model to build and the tokenizer to read and write text with. :func:`load_for_generation` builds
that model, reads the checkpoint's weights into it (written under any plan: every rank reads
the serial tensors) and parallelizes it under the plan asked for; :func:`complete` turns prompts
into their continuations with ``bh.generate``. Uses the public API only.

Test: tests/e2e/test_generate_cli.py.
"""

from __future__ import annotations

import json
import os

import torch

import behemoth as bh
from behemoth.checkpoint import latest_checkpoint
from behemoth.models import build_model
from behemoth.train.config import Config
from behemoth.train.config_sections import ConfigError
from behemoth.train.run_dir import load_weights
from behemoth.train.tokenizer import Tokenizer, get_tokenizer

__all__ = ["resolve_checkpoint", "read_run_config", "load_for_generation", "complete", "sample_text"]


def resolve_checkpoint(path: str) -> str:
    """``path`` itself when it is a checkpoint, else the newest complete checkpoint of the run
    whose ``out_dir`` it is."""
    if not os.path.isfile(os.path.join(path, "meta.json")):
        newest = latest_checkpoint(os.path.join(path, "checkpoints"))
        if newest is not None:
            return newest
    return path


def read_run_config(checkpoint: str) -> Config:
    """The config of the run that wrote ``checkpoint``; a checkpoint without one (written by
    ``engine.save`` outside the trainer) is refused with the fix."""
    path = os.path.join(checkpoint, "meta.json")
    if not os.path.isfile(path):
        raise ConfigError(
            f"{checkpoint!r} is not a complete checkpoint (no meta.json); pass a checkpoints/step-N directory."
        )
    with open(path) as f:
        saved = json.load(f).get("extra", {}).get("config")
    if not isinstance(saved, dict):
        raise ConfigError(
            f"checkpoint {checkpoint!r} does not say which model and tokenizer wrote it (no config in its meta.json); "
            f"generate from a checkpoint the trainer wrote (`behemoth train`), or call bh.generate yourself."
        )
    return Config.from_dict(saved)


def load_for_generation(checkpoint: str, plan: bh.Plan | None = None) -> tuple[torch.nn.Module, Tokenizer]:
    """The checkpoint's model with its weights, parallelized under ``plan`` (default: data
    parallelism over every process), and its run's tokenizer. Every rank calls it."""
    config = read_run_config(checkpoint)
    mc = config.model
    model = build_model(
        mc.name, vocab_size=mc.vocab_size, seq_len=mc.seq_len, seed=mc.seed, dropout=0.0, **mc.shape_overrides()
    )
    load_weights(model, checkpoint)
    return bh.parallelize(model, plan or bh.Plan()), get_tokenizer(config.data.tokenizer)


def complete(
    model: torch.nn.Module, tokenizer: Tokenizer, prompts: list[str], *, max_new_tokens: int, **sampling
) -> list[str]:
    """Each prompt's continuation as text (stopping at the tokenizer's end-of-text id, which is
    not printed). ``sampling``: ``do_sample``, ``temperature``, ``top_k``, ``top_p``, ``seed``."""
    if not prompts or any(not p for p in prompts):
        raise ValueError("give at least one non-empty prompt (--prompt TEXT or --prompts-file FILE).")
    ids = tokenizer.encode_batch(prompts)
    new = bh.generate(model, ids, max_new_tokens=max_new_tokens, eos_token_id=tokenizer.eot_id, **sampling)
    return [tokenizer.decode([t for t in row if t != tokenizer.eot_id]) for row in new]


def sample_text(engine: bh.Engine, tokenizer: Tokenizer, prompt: str, max_new_tokens: int) -> str:
    """``prompt`` and its greedy continuation by the engine's model, for the training log (every
    rank calls it; training continues unchanged)."""
    ids = tokenizer.encode(prompt)
    new = engine.generate([ids], max_new_tokens=max_new_tokens, eos_token_id=tokenizer.eot_id)[0]
    return prompt + tokenizer.decode([t for t in new if t != tokenizer.eot_id])

"""End to end: a tiny run writes samples to its log (``train.sample_every``), and ``behemoth
generate`` continues a prompt from its checkpoint with the run's tokenizer, the same text in
one process and under a 2-stage pipeline, and the same as the run's last sample (both
greedy from the same weights)."""

from __future__ import annotations

import ast
import re

import pytest
from test_cli import DEMO, behemoth

TINY = [
    "--model.name=gpt-tiny",
    "--model.vocab_size=258",  # even: tensor parallelism splits the vocabulary
    "--model.seq_len=64",
    "--train.global_batch_size=4",
    "--optim.lr=3e-3",
    "--optim.warmup_steps=0",
    "--optim.schedule=constant",
    "--data.default_corpus_bytes=100000",
    "--train.steps=3",
    "--train.sample_every=2",
    "--train.sample_tokens=12",
    "--train.hang_timeout=0",
]


@pytest.mark.timeout(420)
def test_generate_from_a_run(tmp_path):
    out_dir = tmp_path / "run"
    r = behemoth("train", DEMO, "--plan.dp=1", *TINY, f"--train.out_dir={out_dir}", cwd=tmp_path, timeout=200)
    assert r.returncode == 0, r.stdout + r.stderr
    samples = dict(re.findall(r"sample at step (\d+): (.*)$", r.stdout, re.M))
    assert sorted(samples) == ["2", "3"], r.stdout
    last = ast.literal_eval(samples["3"])
    assert last.startswith("def ") and len(last) > len("def "), last

    ckpt = str(out_dir / "checkpoints" / "step-3")
    one = behemoth("generate", ckpt, "--prompt", "def ", "--max-new-tokens", "12", cwd=tmp_path)
    assert one.returncode == 0, one.stdout + one.stderr
    assert one.stdout == last + "\n\n", (one.stdout, last)
    two = behemoth(
        "run", "--nproc", "2", "--", "generate", ckpt, "--prompt", "def ", "--max-new-tokens", "12", "--plan.pp=2",
        cwd=tmp_path, timeout=200,
    )  # fmt: skip
    assert two.returncode == 0, two.stdout + two.stderr
    assert last + "\n\n" in two.stdout, two.stdout
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def \nimport \n")
    both = behemoth("generate", str(out_dir), "--prompts-file", str(prompts), "--max-new-tokens", "12", cwd=tmp_path)
    assert both.returncode == 0, both.stdout + both.stderr  # a run's out_dir: its newest checkpoint
    assert both.stdout.startswith(last + "\n\nimport ") and both.stdout.endswith("\n\n"), both.stdout
    bad = behemoth("generate", ckpt, "--prompt", "x", "--train.steps=2", cwd=tmp_path)
    assert bad.returncode == 2 and "only --plan.key=value" in bad.stderr, bad.stderr


@pytest.mark.timeout(420)
def test_samples_of_a_pipelined_run_equal_a_serial_run(tmp_path):
    """The trainer's periodic sample under a 2-stage pipeline: the serial run's text (the same
    weights step for step, greedy)."""
    serial = behemoth(
        "train", DEMO, "--plan.dp=1", *TINY, f"--train.out_dir={tmp_path / 'a'}", cwd=tmp_path, timeout=200
    )
    assert serial.returncode == 0, serial.stdout + serial.stderr
    piped = behemoth(
        "run", "--nproc", "2", "--", "train", DEMO, "--plan.pp=2", *TINY, f"--train.out_dir={tmp_path / 'b'}",
        cwd=tmp_path, timeout=300,
    )  # fmt: skip
    assert piped.returncode == 0, piped.stdout + piped.stderr
    want = re.findall(r"sample at step (\d+): (.*)$", serial.stdout, re.M)
    assert [s for s, _ in want] == ["2", "3"], serial.stdout
    assert re.findall(r"sample at step (\d+): (.*)$", piped.stdout, re.M) == want, piped.stdout

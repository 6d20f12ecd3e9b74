"""End to end: the `behemoth` command launches 2 gloo ranks through torchrun, trains a tiny GPT
on the embedded corpus, checkpoints, resumes (also a ZeRO-3 + CPU-offload checkpoint under ZeRO-1),
and refuses a bad config in one line.

Each command runs in its own process group with a hard timeout, so a hang kills every
rank and fails the test instead of freezing CI.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEMO = os.path.join(REPO, "src", "behemoth", "configs", "demo.toml")
TINY = [
    "--plan.dp=2",
    "--model.name=gpt-tiny",
    "--model.seq_len=64",
    "--train.global_batch_size=8",
    "--optim.lr=3e-3",
    "--optim.warmup_steps=0",
    "--optim.schedule=constant",
    "--train.log_every=1",
    "--train.save_every=0",
    "--data.default_corpus_bytes=200000",
]


def behemoth(*args: str, cwd, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, BEHEMOTH_TIMEOUT="60", PYTHONUNBUFFERED="1")
    env.pop("BEHEMOTH_TRACEBACK", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "behemoth", *args],
        cwd=cwd,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"behemoth {' '.join(args)} did not finish in {timeout} s\nstdout:\n{out}\nstderr:\n{err}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def step_losses(stdout: str) -> dict[int, float]:
    return {int(m.group(1)): float(m.group(2)) for m in re.finditer(r"^step +(\d+)/\d+ \| loss ([\d.]+)", stdout, re.M)}


@pytest.mark.timeout(300)
def test_train_checkpoint_and_resume(tmp_path):
    out_dir = tmp_path / "run"
    r = behemoth(
        "run", "--nproc", "2", "train", DEMO, *TINY, "--train.steps=6", f"--train.out_dir={out_dir}", cwd=tmp_path
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "# fully resolved config:" in r.stdout and "dp                       = 2" in r.stdout
    assert "unigram entropy of the training tokens:" in r.stdout
    losses = step_losses(r.stdout)
    assert sorted(losses) == [1, 2, 3, 4, 5, 6], r.stdout
    assert losses[6] < losses[1] - 0.3, losses  # it learns
    assert re.search(r"^done: steps 1-6 \| loss [\d.]+ -> [\d.]+", r.stdout, re.M), r.stdout

    ckpt = out_dir / "checkpoints" / "step-6"
    assert (ckpt / "meta.json").is_file() and json.loads((ckpt / "meta.json").read_text())["step"] == 6
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    assert [rec["step"] for rec in records] == [1, 2, 3, 4, 5, 6]
    assert records[-1]["loss"] == pytest.approx(losses[6], abs=1e-4)
    summary = json.loads((out_dir / "summary.json").read_text())
    assert summary["checkpoint"].endswith("step-6") and summary["world_size"] == 2

    r2 = behemoth(
        "run", "--nproc", "2", "train", DEMO, *TINY, "--train.steps=9", f"--train.out_dir={out_dir}", cwd=tmp_path
    )
    assert r2.returncode == 0, r2.stdout + r2.stderr
    assert re.search(r"^resumed from .*step-6 at step 6$", r2.stdout, re.M), r2.stdout
    assert sorted(step_losses(r2.stdout)) == [7, 8, 9]
    assert (out_dir / "checkpoints" / "step-9" / "meta.json").is_file()
    steps = [json.loads(line)["step"] for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 10))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("command", ["run", "train"])
def test_invalid_override_is_one_line_naming_the_key(tmp_path, command):
    prefix = ["run", "--nproc", "2", "train"] if command == "run" else ["train"]
    r = behemoth(*prefix, DEMO, "--train.stpes=3", cwd=tmp_path, timeout=60)
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert "train.stpes" in lines[0] and "train.steps" in lines[0] and "Traceback" not in r.stderr
    assert not (tmp_path / "runs").exists()  # nothing was started


@pytest.mark.timeout(60)
def test_config_prints_the_resolved_config(tmp_path):
    r = behemoth("config", DEMO, "--train.steps=7", "--optim.max_grad_norm=none", cwd=tmp_path, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "steps             = 7" in r.stdout and "vocab_size = 257" in r.stdout
    assert 'max_grad_norm = "none"' in r.stdout
    (tmp_path / "resolved.toml").write_text(r.stdout)
    again = behemoth("config", str(tmp_path / "resolved.toml"), cwd=tmp_path, timeout=60)
    assert again.stdout == r.stdout  # the printout is a valid job file


@pytest.mark.timeout(300)
def test_zero3_offload_checkpoint_resumes_under_zero1(tmp_path):
    """ZeRO-3 with CPU offload trains like plain data parallelism, and its step-3 checkpoint resumed
    under ZeRO-1 with offload='auto' continues the uninterrupted run: same losses, same learning rates
    (warm-up then cosine, set on the engine's optimizer over chunk shards every step)."""
    sched = [*TINY, "--optim.warmup_steps=2", "--optim.schedule=cosine", "--train.steps=6"]

    def metrics(out_dir):
        return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]

    def assert_same(got, want):
        assert [m["step"] for m in got] == [m["step"] for m in want]
        for g, w in zip(got, want):
            assert g["loss"] == pytest.approx(w["loss"], rel=1e-5, abs=0), (got, want)
            assert g["lr"] == pytest.approx(w["lr"], rel=1e-12), (got, want)

    ref = tmp_path / "ref"  # plain dp = 2, never interrupted
    r = behemoth("run", "--nproc", "2", "train", DEMO, *sched, f"--train.out_dir={ref}", cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr

    z3 = tmp_path / "z3"
    r = behemoth(
        "run",
        "--nproc",
        "2",
        "train",
        DEMO,
        *sched,
        "--plan.zero=3",
        "--plan.offload=cpu",
        "--train.save_every=3",
        "--train.keep_last=0",
        f"--train.out_dir={z3}",
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(r"^zero += 3$", r.stdout, re.M) and re.search(r'^offload += "cpu"$', r.stdout, re.M)
    assert "Plan(dp=2, zero=3, offload='cpu')" in r.stdout, r.stdout
    assert_same(metrics(z3), metrics(ref))

    resumed = tmp_path / "resumed"  # only the step-3 checkpoint, then steps 4-6 under another plan
    shutil.copytree(z3 / "checkpoints" / "step-3", resumed / "checkpoints" / "step-3")
    r = behemoth(
        "run",
        "--nproc",
        "2",
        "train",
        DEMO,
        *sched,
        "--plan.zero=1",
        "--plan.offload=auto",
        f"--train.out_dir={resumed}",
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(r"^resumed from .*step-3 at step 3$", r.stdout, re.M), r.stdout
    assert "zero=1, offload='auto'" in r.stdout, r.stdout
    assert_same(metrics(resumed), metrics(ref)[3:])


def test_version_and_the_plan_help_examples_work(capsys):
    from behemoth import __version__
    from behemoth.cli import main

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"behemoth {__version__}"
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    examples = [
        line.split(None, 1)[1] for line in capsys.readouterr().out.splitlines() if line.startswith("  behemoth ")
    ]
    assert len(examples) == 5 and sum("--memory" in e for e in examples) == 2
    assert sum("--generate" in e for e in examples) == 1
    for example in examples:
        assert main(example.split()) == 0, example
        out = capsys.readouterr().out
        if "--memory" in example:
            assert re.match(r"^[\d,]+ parameters in \d+ chunks", out), example
        elif "--generate" in example:  # the generation table, then the 1D-against-2D sweep
            assert re.match(r"^llama-8b: [\d.]+B parameters \(bf16\), generating", out) and "decode ms" in out, example
        else:  # --search: the ranked table
            assert re.match(r"^gpt-[\d.]+b: [\d.]+B parameters", out) and "tokens/s" in out, example
    assert main(["plan", "--memory", "--model", "gpt-mini", "--vocab", "257", "--seq", "128"]) == 0
    assert capsys.readouterr().out.startswith("842,624 parameters")  # not "0.00B"


@pytest.mark.timeout(300)
def test_moe_step_log_has_tokens_per_expert(tmp_path):
    """A mixture-of-experts preset under ep=2: metrics.jsonl records every MoE block's tokens per
    expert (the last micro-batch's, over the global batch: 8 rows x 64 tokens x top-2 each)."""
    out_dir = tmp_path / "run"
    args = [a for a in TINY if not a.startswith("--model.name")] + ["--model.name=llama-moe-tiny", "--plan.ep=2"]
    r = behemoth(
        "run", "--nproc", "2", "train", DEMO, *args, "--train.steps=2", f"--train.out_dir={out_dir}", cwd=tmp_path
    )
    assert r.returncode == 0, r.stdout + r.stderr
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    for rec in records:
        counts = rec["expert_tokens"]
        assert sorted(counts) == ["layers.0.mlp", "layers.1.mlp"], counts
        assert all(len(c) == 4 and sum(c) == 8 * 64 * 2 for c in counts.values()), counts

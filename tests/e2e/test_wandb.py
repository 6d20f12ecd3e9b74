"""Weights & Biases logging (train.wandb_project): a fake ``wandb`` module, injected into
``sys.modules`` of the training process by a sitecustomize, records what the trainer logs; its
values must be metrics.jsonl's, step by step, and a resumed run must continue the same wandb run.
Configured but not importable, wandb is one line naming ``pip install wandb``. Nothing here needs
wandb installed or a network."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEMO = os.path.join(REPO, "src", "behemoth", "configs", "demo.toml")
TINY = [
    "--plan.dp=1",
    "--model.name=gpt-tiny",
    "--model.seq_len=32",
    "--train.global_batch_size=4",
    "--optim.warmup_steps=0",
    "--train.log_every=1",
    "--train.save_every=2",
    "--data.default_corpus_bytes=50000",
]

# A stand-in for wandb: every call appended to $FAKE_WANDB_LOG as one JSON line.
FAKE_WANDB = """
import json, os, sys, types

def _record(**entry):
    with open(os.environ["FAKE_WANDB_LOG"], "a") as f:
        f.write(json.dumps(entry) + "\\n")

class _Run:
    def log(self, data, step=None):
        _record(call="log", data=data, step=step)

    def finish(self):
        _record(call="finish")

def init(**kwargs):
    _record(call="init", kwargs={k: v for k, v in kwargs.items() if k != "config"}, has_config="config" in kwargs)
    return _Run()

wandb = types.ModuleType("wandb")
wandb.init = init
sys.modules["wandb"] = wandb
"""

NO_WANDB = "import sys\nsys.modules['wandb'] = None  # import wandb raises ImportError\n"


def behemoth(*args: str, cwd, hook: str, timeout: float = 240) -> subprocess.CompletedProcess:
    site = cwd / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(hook)
    env = dict(os.environ, BEHEMOTH_TIMEOUT="60", PYTHONUNBUFFERED="1", FAKE_WANDB_LOG=str(cwd / "wandb-calls.jsonl"))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), os.path.join(REPO, "src"), env.get("PYTHONPATH")) if p)
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


def _calls(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _expected(records: list[dict]) -> list[tuple[int, dict]]:
    """What wandb must get for metrics.jsonl's records: every finite number but the step, under train/."""
    return [
        (
            r["step"],
            {
                f"train/{k}": v
                for k, v in r.items()
                if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and abs(v) != float("inf")
            },
        )
        for r in records
    ]


@pytest.mark.timeout(480)
def test_wandb_gets_the_scalars_of_metrics_jsonl_and_a_resume_continues_its_run(tmp_path):
    out = tmp_path / "run"
    args = ["train", DEMO, *TINY, f"--train.out_dir={out}", "--train.wandb_project=proj", "--train.wandb_mode=offline"]
    done = behemoth(*args, "--train.steps=4", cwd=tmp_path, hook=FAKE_WANDB)
    assert done.returncode == 0, done.stdout + done.stderr
    run_id = (out / "wandb-run-id").read_text().strip()
    calls = _calls(tmp_path / "wandb-calls.jsonl")
    assert calls[0] == {
        "call": "init",
        "kwargs": {"project": "proj", "mode": "offline", "id": run_id, "resume": "allow", "dir": str(out)},
        "has_config": True,
    }, calls[0]
    assert calls[-1] == {"call": "finish"}
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    logged = [(c["step"], c["data"]) for c in calls if c["call"] == "log"]
    assert logged == _expected(records)
    assert all("train/loss" in d and "train/lr" in d for _, d in logged)

    (tmp_path / "wandb-calls.jsonl").unlink()
    done = behemoth(*args, "--train.steps=6", cwd=tmp_path, hook=FAKE_WANDB)
    assert done.returncode == 0, done.stdout + done.stderr
    calls = _calls(tmp_path / "wandb-calls.jsonl")
    assert calls[0]["kwargs"]["id"] == run_id  # the same wandb run, continued
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert [(c["step"], c["data"]) for c in calls if c["call"] == "log"] == _expected(records[4:])


@pytest.mark.timeout(120)
def test_wandb_configured_but_missing_is_one_line_naming_pip_install_wandb(tmp_path):
    done = behemoth(
        "train",
        DEMO,
        *TINY,
        f"--train.out_dir={tmp_path / 'run'}",
        "--train.wandb_project=proj",
        cwd=tmp_path,
        hook=NO_WANDB,
    )
    assert done.returncode != 0
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "train.wandb_project='proj'" in lines[0] and "pip install wandb" in lines[0], lines
    assert not (tmp_path / "run" / "metrics.jsonl").exists()

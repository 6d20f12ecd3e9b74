"""End to end: how a run starts beside an old one, and how it ends when the world around it does.

A new run into an old run's directory is refused (or overwrites it when asked); SIGKILL of
`behemoth run` takes its workers with it; Ctrl-C is one line, no traceback; SIGTERM saves a
checkpoint and exits 0; a SIGKILLed rank is named in the summary with its signal; a stopped
(SIGSTOP) rank is found by the heartbeat and named; `behemoth run` launches a user's script.

Tiny models, few steps, gloo on CPU; every process tree runs in its own session and is
killed on timeout, so a hang fails the test instead of freezing CI.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEMO = os.path.join(REPO, "src", "behemoth", "configs", "demo.toml")
TINY = [
    "--model.name=gpt-tiny",
    "--model.seq_len=32",
    "--train.global_batch_size=4",
    "--optim.warmup_steps=0",
    "--train.log_every=1",
    "--data.default_corpus_bytes=50000",
]


class Job:
    """A `python -m MODULE ...` process tree (MODULE: behemoth, or torchrun's torch.distributed.run)
    in its own session, its output collected as it comes."""

    def __init__(self, *args: str, cwd, env: dict | None = None, module: str = "behemoth") -> None:
        full_env = dict(os.environ, BEHEMOTH_TIMEOUT="60", PYTHONUNBUFFERED="1", **(env or {}))
        # this tree's behemoth, whatever the interpreter has installed
        paths = [(env or {}).get("PYTHONPATH", ""), os.path.join(REPO, "src"), os.environ.get("PYTHONPATH", "")]
        full_env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
        full_env.pop("BEHEMOTH_TRACEBACK", None)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, *args],
            cwd=cwd,
            env=full_env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        self.out: list[str] = []
        self.err: list[str] = []
        self._readers = [
            threading.Thread(target=self._read, args=(self.proc.stdout, self.out), daemon=True),
            threading.Thread(target=self._read, args=(self.proc.stderr, self.err), daemon=True),
        ]
        for t in self._readers:
            t.start()

    @staticmethod
    def _read(stream, into: list[str]) -> None:
        for line in stream:
            into.append(line)

    @property
    def text(self) -> str:
        return "".join(self.out) + "\n--- stderr:\n" + "".join(self.err)

    def wait_for(self, pattern: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if re.search(pattern, "".join(self.out), re.M):
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        self.kill()
        pytest.fail(f"no {pattern!r} within {timeout} s\n{self.text}")

    def wait(self, timeout: float) -> int:
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"did not finish within {timeout} s\n{self.text}")
        for t in self._readers:
            t.join(5)
        return rc

    def workers(self) -> dict[int, int]:
        """``{rank: pid}`` of the launcher's worker processes."""
        out = {}
        for child in _children(self.proc.pid):
            try:
                with open(f"/proc/{child}/environ", "rb") as f:
                    env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
            except OSError:
                continue
            if b"RANK" in env:
                out[int(env[b"RANK"])] = child
        return out

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _children(pid: int) -> list[int]:
    kids = []
    for task in os.listdir(f"/proc/{pid}/task") if os.path.isdir(f"/proc/{pid}/task") else ():
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                kids += [int(x) for x in f.read().split()]
        except OSError:
            continue
    return kids


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _steps(out_dir) -> list[int]:
    path = out_dir / "metrics.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.timeout(240)
def test_a_new_run_into_an_old_runs_directory_is_refused_or_overwritten(tmp_path):
    """One process (the demo's dp follows the world size): run 6 steps; a `resume=false` run into the
    same out_dir is refused in one line and changes nothing; with `overwrite=true` the old run's files
    go and the new run's step-2 checkpoint survives keep_last=1 (it was pruned against step-6 before)."""
    out = tmp_path / "run"
    common = [*TINY, f"--train.out_dir={out}", "--train.keep_last=1"]
    job = Job("train", DEMO, *common, "--train.steps=6", "--train.save_every=3", cwd=tmp_path)
    assert job.wait(120) == 0, job.text
    assert os.listdir(out / "checkpoints") == ["step-6"] and _steps(out) == [1, 2, 3, 4, 5, 6]

    job = Job("train", DEMO, *common, "--train.steps=2", "--train.resume=false", cwd=tmp_path)
    assert job.wait(60) == 2, job.text
    err = "".join(job.err).strip().splitlines()
    assert len(err) == 1 and "already holds a run" in err[0] and "--train.overwrite=true" in err[0], job.text
    assert os.listdir(out / "checkpoints") == ["step-6"] and _steps(out) == [1, 2, 3, 4, 5, 6]

    job = Job("train", DEMO, *common, "--train.steps=2", "--train.resume=false", "--train.overwrite=true", cwd=tmp_path)
    assert job.wait(120) == 0, job.text
    assert os.listdir(out / "checkpoints") == ["step-2"] and _steps(out) == [1, 2]
    assert json.loads((out / "summary.json").read_text())["checkpoint"].endswith("step-2")

    # Nothing left to do: the summary of the finished run stays (not overwritten with nulls).
    job = Job("train", DEMO, *common, "--train.steps=2", cwd=tmp_path)
    assert job.wait(120) == 0, job.text
    assert "nothing to do" in "".join(job.out)
    assert json.loads((out / "summary.json").read_text())["final_loss"] is not None


@pytest.mark.timeout(240)
def test_sigterm_saves_a_checkpoint_and_exits_0_then_resumes(tmp_path):
    out = tmp_path / "run"
    common = [*TINY, f"--train.out_dir={out}", "--train.save_every=0"]
    job = Job("run", "--nproc", "2", "train", DEMO, *common, "--train.steps=100000", cwd=tmp_path)
    job.wait_for(r"^step +3/", 150)
    sent = time.monotonic()
    job.proc.send_signal(signal.SIGTERM)
    assert job.wait(60) == 0, job.text
    assert time.monotonic() - sent < 30, job.text  # before torchrun's SIGKILL
    m = re.search(r"^stopped by SIGTERM after step (\d+) of 100000: checkpoint (\S+) saved", "".join(job.out), re.M)
    assert m, job.text
    step = int(m.group(1))
    assert "every rank saved a checkpoint at step" in "".join(job.err), job.text
    assert os.listdir(out / "checkpoints") == [f"step-{step}"] and _steps(out) == list(range(1, step + 1))

    job = Job("run", "--nproc", "2", "train", DEMO, *common, f"--train.steps={step + 2}", cwd=tmp_path)
    assert job.wait(150) == 0, job.text
    assert re.search(rf"^resumed from .*step-{step} at step {step}$", "".join(job.out), re.M), job.text
    assert _steps(out) == list(range(1, step + 3))


@pytest.mark.timeout(240)
def test_sigkill_of_the_launcher_takes_its_workers_with_it(tmp_path):
    job = Job("run", "--nproc", "2", "train", DEMO, *TINY, "--train.steps=100000", cwd=tmp_path)
    job.wait_for(r"^step +2/", 150)
    workers = job.workers()
    assert sorted(workers) == [0, 1], workers
    job.proc.send_signal(signal.SIGKILL)  # the launcher alone, not its process group
    job.wait(10)
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in workers.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    alive = [p for p in workers.values() if _alive(p)]
    job.kill()
    assert not alive, f"workers {alive} outlived their launcher"


@pytest.mark.timeout(240)
def test_ctrl_c_is_one_line_per_process_without_a_traceback(tmp_path):
    job = Job("run", "--nproc", "2", "train", DEMO, *TINY, "--train.steps=100000", cwd=tmp_path)
    job.wait_for(r"^step +2/", 150)
    os.killpg(job.proc.pid, signal.SIGINT)  # what a terminal sends to the foreground group
    assert job.wait(60) == 130, job.text
    err = "".join(job.err)
    assert "Traceback" not in err, err
    assert "behemoth run: SIGINT: stopped the 2 worker(s)" in err, err
    assert len(err.strip().splitlines()) <= 4, err


@pytest.mark.timeout(240)
def test_a_killed_rank_is_named_with_its_signal(tmp_path):
    job = Job("run", "--nproc", "2", "train", DEMO, *TINY, "--train.steps=100000", cwd=tmp_path)
    job.wait_for(r"^step +2/", 150)
    os.kill(job.workers()[1], signal.SIGKILL)
    assert job.wait(90) == 1, job.text
    err = "".join(job.err)
    assert "behemoth run: rank 1 was killed by signal SIGKILL and printed no error" in err, err


@pytest.mark.timeout(300)
def test_a_stopped_rank_is_found_by_the_heartbeat_and_named(tmp_path):
    job = Job(
        "run", "--nproc", "2", "train", DEMO, *TINY, "--train.steps=100000", "--train.hang_timeout=5", cwd=tmp_path
    )
    job.wait_for(r"^step +2/", 150)
    stopped = job.workers()[1]
    os.kill(stopped, signal.SIGSTOP)
    sent = time.monotonic()
    try:
        rc = job.wait(120)
    finally:
        try:
            os.kill(stopped, signal.SIGKILL)
        except ProcessLookupError:
            pass
    err = "".join(job.err)
    assert rc == 1, job.text
    assert "behemoth: rank 1 sent no heartbeat for" in err and "noticed by rank 0" in err, err
    assert "behemoth run: rank 1 stopped responding: no heartbeat for" in err, err
    # detection takes hang_timeout plus a beat; the watcher kills the stopped rank, so torchrun's 30 s
    # grace for it does not apply
    assert time.monotonic() - sent < 5 + 20, job.text


@pytest.mark.timeout(120)
def test_run_launches_a_users_script(tmp_path):
    script = tmp_path / "mine.py"
    script.write_text(
        "import sys, torch, torch.distributed as dist, behemoth as bh\n"
        "bh.init()\n"
        "t = torch.tensor([float(dist.get_rank() + 1)])\n"
        "dist.all_reduce(t)\n"
        "print(f'rank {dist.get_rank()} of {dist.get_world_size()}: {t.item():g} {sys.argv[1:]}', flush=True)\n"
        "dist.destroy_process_group()\n"
    )
    job = Job("run", "--nproc", "2", str(script), "--flag", "x", cwd=tmp_path)
    assert job.wait(90) == 0, job.text
    out = "".join(job.out)
    assert "rank 0 of 2: 3 ['--flag', 'x']" in out and "rank 1 of 2: 3 ['--flag', 'x']" in out, job.text


# Loaded by every worker of the faulty run (through PYTHONPATH): on the first attempt, rank 2
# SIGKILLs itself as its 23rd backward begins -- in step 23, after the forward, before any
# gradient is reduced. Restarted workers (TORCHELASTIC_RESTART_COUNT > 0) run untouched.
# Checkpoints are written in the background (train.async_checkpoint), so step-20's may still be
# in flight in step 23: rank 2 first waits (at most 50 s) for $WAIT_FOR_CHECKPOINT to be committed,
# which makes step-20 the newest complete checkpoint at the kill, as with synchronous saves.
_KILL_IN_BACKWARD = """
import os
if os.environ.get("RANK") == "2" and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
    import signal
    import time
    import torch

    _backward, _calls = torch.Tensor.backward, [0]

    def backward(self, *args, **kwargs):
        _calls[0] += 1
        if _calls[0] == 23:
            marker = os.path.join(os.environ["WAIT_FOR_CHECKPOINT"], "meta.json")
            deadline = time.monotonic() + 50
            while not os.path.exists(marker) and time.monotonic() < deadline:
                time.sleep(0.05)
            os.kill(os.getpid(), signal.SIGKILL)
        return _backward(self, *args, **kwargs)

    torch.Tensor.backward = backward
"""


def _weights(checkpoint) -> dict:
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    flat = str(checkpoint) + ".pt"
    dcp_to_torch_save(str(checkpoint), flat)
    return torch.load(flat, weights_only=True)


@pytest.mark.timeout(600)
def test_a_restart_resumes_exactly(tmp_path):
    """4 gloo ranks, 40 steps, a checkpoint every 10; rank 2 SIGKILLed in step 23's backward. Under
    `behemoth run --max-restarts 1` the group restarts, resumes from step-20, and every logged loss,
    gradient norm and learning rate and the final weights are bit-identical to an uninterrupted run."""
    job_args = [*TINY, "--optim.schedule=cosine", "--train.steps=40", "--train.save_every=10", "--train.keep_last=0"]
    ref = tmp_path / "ref"
    job = Job("run", "--nproc", "4", "train", DEMO, *job_args, f"--train.out_dir={ref}", cwd=tmp_path)
    assert job.wait(240) == 0, job.text

    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(_KILL_IN_BACKWARD)
    faulty = tmp_path / "faulty"
    job = Job(
        "run",
        "--nproc",
        "4",
        "--max-restarts",
        "1",
        "train",
        DEMO,
        *job_args,
        "--train.resume=false",  # a fresh run; its restarted group must still continue it
        f"--train.out_dir={faulty}",
        cwd=tmp_path,
        env={"PYTHONPATH": str(hook), "WAIT_FOR_CHECKPOINT": str(faulty / "checkpoints" / "step-20")},
    )
    assert job.wait(360) == 0, job.text
    out = "".join(job.out)
    assert re.search(r"^resumed from .*step-20 at step 20$", out, re.M), job.text
    assert re.search(r"^metrics.jsonl: dropped \d+ record\(s\) past step 20", out, re.M), job.text

    def records(out_dir):
        return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]

    got, want = records(faulty), records(ref)
    assert [r["step"] for r in got] == list(range(1, 41))
    for key in ("loss", "grad_norm", "lr"):
        assert [r[key] for r in got] == [r[key] for r in want], key
    got_w, want_w = _weights(faulty / "checkpoints" / "step-40"), _weights(ref / "checkpoints" / "step-40")
    assert sorted(got_w) == sorted(want_w)
    for name, tensor in want_w.items():
        assert hasattr(tensor, "equal") and tensor.equal(got_w[name]), name


@pytest.mark.timeout(300)
def test_resume_refuses_a_changed_batch_and_resume_from_rewinds_exactly(tmp_path):
    out = tmp_path / "run"
    common = [*TINY, f"--train.out_dir={out}", "--train.save_every=2", "--train.keep_last=0"]
    job = Job("train", DEMO, *common, "--train.steps=4", cwd=tmp_path)
    assert job.wait(120) == 0, job.text
    first = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]

    job = Job("train", DEMO, *common, "--train.steps=6", "--train.global_batch_size=8", cwd=tmp_path)
    assert job.wait(60) == 2, job.text
    err = "".join(job.err).strip().splitlines()
    assert len(err) == 1 and "train.global_batch_size 4 -> 8" in err[0], job.text

    step2 = out / "checkpoints" / "step-2"
    job = Job("train", DEMO, *common, "--train.steps=4", f"--train.resume_from={step2}", cwd=tmp_path)
    assert job.wait(120) == 0, job.text
    text = "".join(job.out)
    assert re.search(r"^resumed from .*step-2 at step 2$", text, re.M), job.text
    assert "rewinds the run to step 2: deleted step-4" in text, job.text
    again = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in again] == [1, 2, 3, 4]
    assert [r["loss"] for r in again] == [r["loss"] for r in first]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(400)
def test_two_nodes_on_one_machine_train_like_one_node(tmp_path):
    """Two torchrun agents (--nnodes 2, c10d rendezvous on loopback, 2 ranks each) train a dp=2 x tp=2
    plan spanning both to the same losses as one node of 4 ranks."""
    train_args = [*TINY, "--model.vocab_size=258", "--plan.dp=2", "--plan.tp=2", "--train.steps=5"]
    one = tmp_path / "one"
    job = Job("run", "--nproc", "4", "train", DEMO, *train_args, f"--train.out_dir={one}", cwd=tmp_path)
    assert job.wait(240) == 0, job.text

    two = tmp_path / "two"
    port = _free_port()
    node = ["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d"]
    node += ["--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "two-nodes"]
    command = [*node, "-m", "behemoth", "train", DEMO, *train_args, f"--train.out_dir={two}"]
    agents = [
        Job(*command, cwd=tmp_path, module="torch.distributed.run", env={"OMP_NUM_THREADS": "1"}) for _ in range(2)
    ]
    for agent in agents:
        assert agent.wait(240) == 0, agent.text

    def losses(out_dir):
        return [json.loads(line)["loss"] for line in (out_dir / "metrics.jsonl").read_text().splitlines()]

    assert len(losses(two)) == 5 and losses(two) == losses(one)


@pytest.mark.timeout(600)
def test_elastic_scale_down_continues_from_the_last_checkpoint(tmp_path):
    """Two agents (--nnodes 1:2, 2 ranks each, tp=2 and dp filling the world); one agent is SIGKILLed
    (its ranks die with it). The other restarts at world size 2 (dp=1), resumes from the last checkpoint
    with the same global batch, and every loss equals the uninterrupted 4-rank run's within 1e-5."""
    steps = 70  # at most 30 steps at the new world size: fp32 reduction order drifts ~1e-5 in 50
    train_args = [*TINY, "--model.vocab_size=258", "--plan.tp=2", f"--train.steps={steps}", "--train.save_every=20"]
    ref = tmp_path / "ref"
    job = Job("run", "--nproc", "4", "train", DEMO, *train_args, f"--train.out_dir={ref}", cwd=tmp_path)
    assert job.wait(240) == 0, job.text

    out = tmp_path / "elastic"
    node = ["--nnodes", "1:2", "--nproc-per-node", "2", "--max-restarts", "1", "--rdzv-backend", "c10d"]
    node += ["--rdzv-endpoint", f"127.0.0.1:{_free_port()}", "--rdzv-id", "scale-down"]
    command = [*node, "-m", "behemoth", "train", DEMO, *train_args, f"--train.out_dir={out}"]
    env = {"OMP_NUM_THREADS": "1"}
    host = Job(*command, cwd=tmp_path, module="torch.distributed.run", env=env)  # binds the rendezvous port
    time.sleep(3)
    leaver = Job(*command, cwd=tmp_path, module="torch.distributed.run", env=env)
    deadline = time.monotonic() + 200
    while not any(re.search(r"^step +5\d/", "".join(j.out), re.M) for j in (host, leaver)):
        if time.monotonic() > deadline or host.proc.poll() is not None:
            leaver.kill()
            host.kill()
            pytest.fail(f"no step 50 in time\n{host.text}\n{leaver.text}")
        time.sleep(0.1)
    leaver.proc.send_signal(signal.SIGKILL)  # the agent; its workers die with it
    leaver.wait(30)
    assert host.wait(300) == 0, host.text
    text = "".join(host.out)
    assert "Plan(dp=1, tp=2) on 2 process(es)" in text, host.text
    m = re.search(r"^resumed from .*step-(\d+) at step (\d+)$", text, re.M)
    assert m and int(m.group(1)) >= 40, host.text

    def records(out_dir):
        return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]

    got, want = records(out), records(ref)
    assert [r["step"] for r in got] == list(range(1, steps + 1))
    for g, w in zip(got, want):
        assert g["loss"] == pytest.approx(w["loss"], abs=1e-5, rel=0), (g["step"], g["loss"], w["loss"])


@pytest.mark.timeout(300)
def test_validation_loss_is_the_serial_models_loss_on_the_held_out_split(tmp_path):
    """2 ranks (dp=2), data.eval_fraction=0.1, eval_every=2: the logged validation loss at step 4 equals
    the loss of the step-4 weights on the last 10% of the tokens, recomputed here serially."""
    import torch

    from behemoth.models import build_model
    from behemoth.train.data import TokenDataset, default_corpus_text
    from behemoth.train.tokenizer import get_tokenizer

    out = tmp_path / "run"
    args = [*TINY, "--data.eval_fraction=0.1", "--train.eval_every=2", "--train.eval_batches=2", "--train.steps=4"]
    job = Job("run", "--nproc", "2", "train", DEMO, *args, f"--train.out_dir={out}", cwd=tmp_path)
    assert job.wait(180) == 0, job.text
    assert re.search(r"^step 4/4 \| loss [\d.]+ \(val [\d.]+\)", "".join(job.out), re.M), job.text
    records = {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}
    assert [s for s in records if "val_loss" in records[s]] == [2, 4]

    seq, batch = 32, 4
    tokens = TokenDataset.from_texts([default_corpus_text(50000)], get_tokenizer("byte")).tokens
    windows = (len(tokens) - 1) // seq
    cut = (windows - round(windows * 0.1)) * seq
    held = torch.from_numpy(tokens[cut + 1 :].astype("int64"))
    rows = torch.stack([held[i * seq : i * seq + seq + 1] for i in range(2 * batch)])
    state = {
        k[len("model/") :]: v for k, v in _weights(out / "checkpoints" / "step-4").items() if k.startswith("model/")
    }
    model = build_model("gpt-tiny", vocab_size=257, seq_len=seq)
    model.load_state_dict(state)
    model.eval()
    with torch.no_grad():
        logits = model(rows[:, :-1])
        want = torch.nn.functional.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten()).item()
    assert records[4]["val_loss"] == pytest.approx(want, rel=1e-6)
    assert json.loads((out / "summary.json").read_text())["val_loss"] == records[4]["val_loss"]


def _damage(kind: str, ckpt) -> str:
    """Damage checkpoint ``ckpt`` one way; returns what the message must name."""
    if kind == "truncated shard":
        shard = next(p for p in ckpt.iterdir() if p.name.endswith(".distcp"))
        shard.write_bytes(shard.read_bytes()[:100])
        return f"{shard.name} is truncated"
    if kind == "truncated rng":
        rng = ckpt / "rng-rank0.pt"
        rng.write_bytes(rng.read_bytes()[:50])
        return "rng-rank0.pt"
    if kind == "garbage meta":
        (ckpt / "meta.json").write_text("{\n")
        return "meta.json cannot be read"
    (ckpt / ".metadata").unlink()
    return ".metadata"


@pytest.mark.timeout(400)
def test_a_damaged_checkpoint_is_named_with_the_fix(tmp_path):
    """Each damage of the newest checkpoint (a truncated shard or RNG file, a garbage meta.json, a missing
    tensor index) is one line naming the checkpoint, the file and the fix; a step-N without meta.json is
    warned about and the previous checkpoint resumed."""
    import shutil

    run = tmp_path / "run"
    common = [*TINY, "--train.save_every=2", "--train.keep_last=0"]
    job = Job("train", DEMO, *common, "--train.steps=4", f"--train.out_dir={run}", cwd=tmp_path)
    assert job.wait(120) == 0, job.text
    for kind in ("truncated shard", "truncated rng", "garbage meta", "missing index"):
        out = tmp_path / kind.replace(" ", "-")
        shutil.copytree(run, out)
        needle = _damage(kind, out / "checkpoints" / "step-4")
        job = Job("train", DEMO, *common, "--train.steps=6", f"--train.out_dir={out}", cwd=tmp_path)
        assert job.wait(120) == 2, job.text
        err = "".join(job.err).strip().splitlines()
        assert len(err) == 1 and "Traceback" not in job.text, job.text
        assert "step-4" in err[0] and "damaged" in err[0] and needle in err[0], (kind, err[0])
        assert "--train.resume_from" in err[0] and "move it away" in err[0].lower(), err[0]

    out = tmp_path / "no-meta"
    shutil.copytree(run, out)
    (out / "checkpoints" / "step-4" / "meta.json").unlink()
    job = Job("train", DEMO, *common, "--train.steps=6", f"--train.out_dir={out}", cwd=tmp_path)
    assert job.wait(120) == 0, job.text
    text = "".join(job.out)
    assert "warning: step-4 in" in text and "has no meta.json" in text, job.text
    assert re.search(r"^resumed from .*step-2 at step 2$", text, re.M), job.text


@pytest.mark.timeout(300)
def test_init_from_starts_a_new_run_from_a_checkpoints_weights(tmp_path):
    """A 2-rank run's step-4 weights start a new one-process run (fresh optimizer, step 1, data from the
    start): its first loss is the serial loss of those weights on the first global batch."""
    import torch

    from behemoth.models import build_model
    from behemoth.train.data import BatchSampler, TokenDataset, default_corpus_text
    from behemoth.train.tokenizer import get_tokenizer

    first = tmp_path / "first"
    job = Job("run", "--nproc", "2", "train", DEMO, *TINY, "--train.steps=4", f"--train.out_dir={first}", cwd=tmp_path)
    assert job.wait(180) == 0, job.text
    step4 = first / "checkpoints" / "step-4"
    new = tmp_path / "new"
    args = [*TINY, "--train.steps=1", f"--train.init_from={step4}", f"--train.out_dir={new}"]
    job = Job("train", DEMO, *args, cwd=tmp_path)
    assert job.wait(120) == 0, job.text
    assert f"initialised the model from {step4}" in "".join(job.out), job.text
    got = json.loads((new / "metrics.jsonl").read_text().splitlines()[0])
    assert got["step"] == 1

    data = TokenDataset.from_texts([default_corpus_text(50000)], get_tokenizer("byte"))
    batch = BatchSampler(data, seq_len=32, global_batch_size=4, dp_rank=0, dp_size=1).global_batch(0)
    state = {k[len("model/") :]: v for k, v in _weights(step4).items() if k.startswith("model/")}
    model = build_model("gpt-tiny", vocab_size=257, seq_len=32)
    model.load_state_dict(state)
    with torch.no_grad():
        logits = model(batch["input_ids"])
        want = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten()).item()
    assert got["loss"] == pytest.approx(want, rel=1e-5)


# Loaded by every worker (through PYTHONPATH): on the first attempt, rank 1 dies in its 4th backward
# the way a process on a GPU does for its peers: it forks a child that keeps its sockets open (as a
# dead NCCL peer leaves the others waiting, where gloo on CPU would see the socket close and fail at
# once), then SIGKILLs itself. Rank 0 is left blocked in the gradient all-reduce when the launcher
# sends it SIGTERM. The child exits by itself after $HOLD_SOCKETS_S seconds. Rank 1 first waits for
# $WAIT_FOR_CHECKPOINT (written in the background) to be committed, as _KILL_IN_BACKWARD does.
_DIE_HOLDING_SOCKETS = """
import os
if os.environ.get("RANK") == "1" and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
    import signal
    import time
    import torch

    _backward, _calls = torch.Tensor.backward, [0]

    def backward(self, *args, **kwargs):
        _calls[0] += 1
        if _calls[0] == 4:
            marker = os.path.join(os.environ["WAIT_FOR_CHECKPOINT"], "meta.json")
            deadline = time.monotonic() + 50
            while not os.path.exists(marker) and time.monotonic() < deadline:
                time.sleep(0.05)
            with open(os.environ["DEAD_PID_FILE"], "w") as f:
                f.write(str(os.getpid()))
            if os.fork() == 0:
                time.sleep(float(os.environ["HOLD_SOCKETS_S"]))
                os._exit(0)
            os.kill(os.getpid(), signal.SIGKILL)
        return _backward(self, *args, **kwargs)

    torch.Tensor.backward = backward
"""


@pytest.mark.timeout(400)
def test_a_rank_blocked_on_a_dead_peer_exits_at_once_on_sigterm(tmp_path):
    """Rank 1 dies in step 4 with its sockets held open, so rank 0 stays blocked in the all-reduce. The
    launcher's SIGTERM finds rank 1's process gone (its pid is in the heartbeat) and rank 0 exits at once
    with one line, instead of waiting for a step boundary it cannot reach until the launcher's SIGKILL 30 s
    later; the restarted group resumes from step-2 and finishes with the uninterrupted run's losses."""
    job_args = [*TINY, "--train.steps=6", "--train.save_every=2", "--train.keep_last=0"]
    ref = tmp_path / "ref"
    job = Job("run", "--nproc", "2", "train", DEMO, *job_args, f"--train.out_dir={ref}", cwd=tmp_path)
    assert job.wait(180) == 0, job.text

    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(_DIE_HOLDING_SOCKETS)
    dead = tmp_path / "dead.pid"
    faulty = tmp_path / "faulty"
    env = {"PYTHONPATH": str(hook), "DEAD_PID_FILE": str(dead), "HOLD_SOCKETS_S": "90"}
    env["WAIT_FOR_CHECKPOINT"] = str(faulty / "checkpoints" / "step-2")
    job = Job(
        "run",
        "--nproc",
        "2",
        "--max-restarts",
        "1",
        "train",
        DEMO,
        *job_args,
        f"--train.out_dir={faulty}",
        cwd=tmp_path,
        env=env,
    )
    deadline = time.monotonic() + 200
    while not dead.exists() or not dead.read_text():
        if time.monotonic() > deadline or job.proc.poll() is not None:
            job.kill()
            pytest.fail(f"rank 1 did not die\n{job.text}")
        time.sleep(0.05)
    killed = time.monotonic()
    first = dict(job.workers())
    while True:  # the restart: a new worker for every rank
        now = dict(job.workers())
        if len(now) == 2 and not set(now.values()) & set(first.values()) - {None}:
            break
        if time.monotonic() - killed > 120 or job.proc.poll() is not None:
            job.kill()
            pytest.fail(f"no restart within 120 s\n{job.text}")
        time.sleep(0.05)
    restart_s = time.monotonic() - killed
    print(f"kill -> restarted workers: {restart_s:.1f} s")
    assert job.wait(240) == 0, job.text
    err = "".join(job.err)
    assert "behemoth: rank 0: SIGTERM while a peer is lost (rank 1 (pid " in err, job.text
    assert re.search(r"^resumed from .*step-2 at step 2$", "".join(job.out), re.M), job.text
    assert restart_s < 25, job.text  # the launcher's SIGKILL grace alone is 30 s

    def records(out_dir):
        return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]

    got, want = records(faulty), records(ref)
    assert [r["step"] for r in got] == list(range(1, 7))
    assert [r["loss"] for r in got] == [r["loss"] for r in want]

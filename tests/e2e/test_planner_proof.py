"""End to end: benchmarks/planner_proof.py on 2 gloo ranks (a tiny GPT) survives a layout that
runs out of memory -- the next layouts start with no process group and no memory left over from
it, and the run ends with its final summary -- and a run whose processes die inside a layout is
finished by ``--resume``: the layouts done are not run again, the one it died in counts as
failed, and the final summary covers every layout.

Each command runs in its own process group with a hard timeout, so a hang kills every rank.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SEARCH = ["--model", "gpt-tiny", "--seq", "64", "--steps", "1", "--warmup", "0", "--gpu-gb", "80", "--layouts", "4"]
PP2 = "Plan(dp=1, pp=2, microbatches=8, zero=3, precision='bf16')"  # its stage channels: 4 process groups
TP2 = "Plan(dp=1, tp=2, microbatches=2, precision='bf16')"


def proof(*args: str, timeout: float = 180) -> tuple[int, list[dict]]:
    env = dict(os.environ, BEHEMOTH_TIMEOUT="60", PYTHONUNBUFFERED="1", PYTHONPATH=os.path.join(REPO, "src"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += [os.path.join(REPO, "benchmarks", "planner_proof.py"), *SEARCH, *args]
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"planner_proof.py did not finish in {timeout} s\nstdout:\n{out}\nstderr:\n{err}")
    return proc.returncode, [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def test_proof_survives_an_out_of_memory_layout_and_resumes_after_a_crash(tmp_path):
    rc, lines = proof("--include", PP2, "--inject-oom", PP2)
    assert rc == 0
    rows = [r for r in lines if "plan" in r and not r.get("started")]
    assert rows[0]["plan"] == PP2 and rows[0]["oom"] and "injected" in rows[0]["error"]
    assert len(rows) == 4 and all("measured_step_s" in r for r in rows[1:])
    # what the failed pipeline held is gone before the next layout starts: its groups, its memory
    assert [r["leftover_groups"] for r in rows] == [0] * 4
    assert [r["leftover_gib"] for r in rows] == [0.0] * 4
    final = [r for r in lines if r.get("final")]
    assert len(final) == 1 and final[0]["layouts"] == 4 and final[0]["oom_predicted_to_fit"] == 1

    log = tmp_path / "rows.jsonl"
    rc, lines = proof("--include", f"{PP2};{TP2}", "--inject-crash", TP2)
    assert rc != 0 and not any(r.get("final") for r in lines)
    log.write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert [r["plan"] for r in lines if "plan" in r and not r.get("started")] == [PP2]
    rc, again = proof("--include", f"{PP2};{TP2}", "--resume", str(log))
    assert rc == 0
    ran = [r["plan"] for r in again if "plan" in r and not r.get("started")]
    assert len(ran) == 2 and not set(ran) & {PP2, TP2}
    final = [r for r in again if r.get("final")]
    assert len(final) == 1 and final[0]["layouts"] == 4 and final[0]["crashed"] == 1

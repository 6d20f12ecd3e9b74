"""End to end: benchmarks/planner_proof.py on 2 gloo ranks (a tiny GPT) survives a layout that
runs out of memory -- the next layouts start with no process group and no memory left over from
it, and the run ends with its final summary -- and a run whose processes die inside a layout is
finished by ``--resume``: the layouts done are not run again, the one it died in counts as
failed, and the final summary covers every layout. A layout that fails on one rank only, the
other blocked in the layout's collectives, ends the run within seconds with the layout reported
as failed, and ``--resume`` carries on from there.

Each command runs in its own process group with a hard timeout, so a hang kills every rank.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SEARCH = ["--model", "gpt-tiny", "--seq", "64", "--steps", "1", "--warmup", "0", "--gpu-gb", "80", "--layouts", "4"]
PP2 = "Plan(dp=1, pp=2, microbatches=8, zero=3, precision='bf16')"  # its stage channels: 4 process groups
TP2 = "Plan(dp=1, tp=2, microbatches=2, precision='bf16')"


def proof(*args: str, timeout: float = 180) -> tuple[int, list[dict]]:
    rc, lines, _ = timed_proof(*args, timeout=timeout)
    return rc, lines


def timed_proof(*args: str, timeout: float = 180) -> tuple[int, list[dict], float]:
    env = dict(os.environ, BEHEMOTH_TIMEOUT="60", PYTHONUNBUFFERED="1", PYTHONPATH=os.path.join(REPO, "src"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += [os.path.join(REPO, "benchmarks", "planner_proof.py"), *SEARCH, *args]
    start = time.monotonic()
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"planner_proof.py did not finish in {timeout} s\nstdout:\n{out}\nstderr:\n{err}")
    lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return proc.returncode, lines, time.monotonic() - start


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


def test_a_layout_failing_on_one_rank_ends_the_run_quickly_and_resume_carries_on(tmp_path):
    """Rank 1 runs out of memory on its first step of TP2 while rank 0 waits in TP2's first
    collective: rank 1 learns through the store that rank 0 never ends the layout, prints TP2's
    row with its error and ends the run in --agree-s seconds, well before the collectives' own
    timeout (BEHEMOTH_TIMEOUT, 60 s here); --resume keeps TP2 as failed and runs the rest."""
    rc, lines, seconds = timed_proof(
        "--include", f"{TP2};{PP2}", "--inject-oom", TP2, "--inject-rank", "1", "--agree-s", "5", timeout=120
    )
    assert rc != 0 and not any(r.get("final") for r in lines)
    assert seconds < 60
    done = [r for r in lines if "plan" in r and not r.get("started")]
    assert [r["plan"] for r in done] == [TP2]
    assert done[0]["oom"] and done[0]["stuck_ranks"] == [0] and done[0]["error"].startswith("rank 1: injected")
    log = tmp_path / "rows.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in lines))
    rc, again = proof("--include", f"{TP2};{PP2}", "--resume", str(log), "--agree-s", "5", timeout=120)
    assert rc == 0
    ran = [r["plan"] for r in again if "plan" in r and not r.get("started")]
    assert len(ran) == 3 and TP2 not in ran and ran[0] == PP2
    final = [r for r in again if r.get("final")]
    assert len(final) == 1 and final[0]["layouts"] == 4
    assert final[0]["oom_predicted_to_fit"] == 1 and final[0]["crashed"] == 0

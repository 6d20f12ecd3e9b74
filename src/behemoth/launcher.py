"""``behemoth run``: N local workers through torchrun's elastic agent, and an exact account of
how they ended.

The launcher runs torchrun's agent in this process (``--standalone``, ``--max-restarts``) on
``python -m behemoth train|config ...`` or on a user's own script. Each worker that ends
abnormally leaves a status record (:func:`write_status`, a small JSON file named by its pid in
the directory ``BEHEMOTH_STATUS_DIR`` the launcher creates), saying what happened from the
inside: an error (and its first line), a lost peer (a communication error caused by another
rank), a stop on SIGTERM, a hung peer noticed by the watchdog. Together with the exit codes in
the order the agent saw them, :func:`summarize` names the rank that failed *first* and how:
by a signal (it printed nothing), by an error (printed above), or by not answering.

Signals to the launcher: SIGINT (Ctrl-C) stops the workers and prints one line; SIGTERM
(preemption) is passed on, each worker saves a checkpoint at its next step boundary and exits
0, and the launcher exits 0 once all of them did. Workers die with the launcher even when it
is SIGKILLed (``behemoth.distributed.die_with_parent``).

Test: ``pytest tests/unit/test_launcher.py tests/e2e/test_lifecycle.py``.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import time

__all__ = ["STATUS_ENV", "write_status", "read_status", "is_comm_error", "summarize", "run"]

STATUS_ENV = "BEHEMOTH_STATUS_DIR"
_COMM_MARKERS = (
    "Connection reset",
    "Connection closed",
    "Connection refused",
    "Broken pipe",
    "connection lost",
    "NCCL",
    "Gloo",
    "gloo",
    "timed out",
    "Timed out",
    "Socket Timeout",
)


# ------------------------------------------------------------------ worker side
def write_status(kind: str, **info) -> None:
    """Record, for the launcher, why this worker is ending (``kind``: "error", "comm_error",
    "interrupted", "stopped", "peer_hung",
    "peer_lost"). A no-op outside ``behemoth run``; never raises."""
    directory = os.environ.get(STATUS_ENV)
    if not directory:
        return
    record = {"kind": kind, "time": time.time(), "rank": int(os.environ.get("RANK", "0")), **info}
    path = os.path.join(directory, f"pid-{os.getpid()}.json")
    try:
        with open(path + ".tmp", "w") as f:
            json.dump(record, f)
        os.replace(path + ".tmp", path)
    except OSError:
        pass


def is_comm_error(e: BaseException) -> bool:
    """Whether ``e`` is a collective or store failing because a peer went away (a consequence
    of another rank's failure, not a cause)."""
    import torch.distributed as dist

    if isinstance(e, getattr(dist, "DistError", ())):
        return True
    text = f"{type(e).__name__}: {e}"
    return any(marker in text for marker in _COMM_MARKERS)


def first_line(e: BaseException, limit: int = 200) -> str:
    """``Type: first line of the message``, at most ``limit`` characters."""
    text = str(e).strip().splitlines()
    line = f"{type(e).__name__}: {text[0] if text else ''}".rstrip(": ")
    return line if len(line) <= limit else line[: limit - 3] + "..."


# ------------------------------------------------------------------ launcher side
def read_status(directory: str) -> dict[int, dict]:
    """Every record in ``directory``, keyed by the worker's pid."""
    out = {}
    for name in os.listdir(directory) if os.path.isdir(directory) else ():
        if name.startswith("pid-") and name.endswith(".json"):
            try:
                with open(os.path.join(directory, name)) as f:
                    out[int(name[4:-5])] = json.load(f)
            except (OSError, ValueError):
                continue
    return out


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def summarize(failures: list[tuple[int, int, int]], records: dict[int, dict], nproc: int) -> tuple[str, int]:
    """The launcher's account of a failed worker group, and its exit status.

    ``failures``: ``(rank, pid, exit code)`` of each failed worker in the order the agent saw
    them fail (the survivors it then stopped come last); ``records``: :func:`read_status`.
    The cause is, in this order: a rank the watchdog found hung; the first rank (in the
    agent's order) that raised an error of its own, died by a signal other than the agent's
    SIGTERM, or exited non-zero without a record; else the earliest lost-peer error."""
    info = {rank: (code, records.get(pid, {})) for rank, pid, code in failures}
    hung = [rec for _, rec in info.values() if rec.get("kind") == "peer_hung"]
    n = len(failures)
    if hung:
        rec = min(hung, key=lambda r: r["time"])
        return (
            f"behemoth run: rank {rec['hung_rank']} stopped responding: no heartbeat for {rec['seconds']:.0f} s "
            f"(train.hang_timeout={rec['timeout']:g}; noticed by rank {rec['rank']}); it is stopped (SIGSTOP), "
            f"hung in native code or its host is gone. The job was stopped ({n} of {nproc} processes).",
            1,
        )

    def primary(item) -> bool:
        rank, pid, code = item
        kind = records.get(pid, {}).get("kind")
        if kind == "error":
            return True
        if kind is None:
            return code > 0 or code not in (-signal.SIGTERM, -signal.SIGINT)
        return False

    causes = [f for f in failures if primary(f)]
    if not causes:  # only consequences: the earliest lost peer, else the first seen
        comm = sorted((records[pid]["time"], rank, pid, code) for rank, pid, code in failures if pid in records)
        causes = [(r, p, c) for _, r, p, c in comm] or list(failures)
    rank, pid, code = causes[0]
    rec = records.get(pid, {})
    if code < 0 and not rec:
        how = f"was killed by signal {_signal_name(code)} and printed no error"
    elif rec.get("kind") in ("error", "comm_error"):
        how = f"failed with exit code {code} ({rec.get('message', '')}); its error is printed above"
    else:
        how = f"exited with code {code}" + (f" ({_signal_name(code)})" if code < 0 else "")
    others = n - 1
    tail = f"; {others} other process(es) failed or were stopped after it" if others else ""
    return f"behemoth run: rank {rank} {how}{tail} ({n} of {nproc} processes failed).", code if code > 0 else 1


def _check_args(nproc: int, args: list[str]) -> list[str]:
    """The worker's command line (``-m behemoth ...`` or a script), checked before starting N processes."""
    if nproc < 1:
        raise ValueError(f"--nproc {nproc}: must be >= 1.")
    if args and args[0].endswith(".py"):
        if not os.path.isfile(args[0]):
            raise FileNotFoundError(f"script {args[0]!r} does not exist; pass the path of your training script.")
        return args
    if len(args) < 2 or args[0] not in ("train", "config", "generate"):
        raise ValueError(
            f"behemoth run needs a command to launch: `behemoth run --nproc {nproc} train CONFIG [...]`, "
            f"`behemoth run --nproc {nproc} generate CHECKPOINT [...]` or "
            f"`behemoth run --nproc {nproc} SCRIPT.py [ARGS...]`; got {' '.join(args) or 'nothing'!r}."
        )
    return ["--module", "behemoth", *args]


def run(nproc: int, args: list[str], *, max_restarts: int = 0) -> int:
    """Launch ``nproc`` local workers running ``args`` and return the exit status to report."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args
    from torch.distributed.run import run as torchrun

    if max_restarts < 0:
        raise ValueError(f"--max-restarts {max_restarts}: must be >= 0.")
    worker = _check_args(nproc, args)
    # N ranks share this machine's cores; torchrun would otherwise set 1 thread (with a warning).
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    # The agent's per-process lines ("closing signal", "failed (exitcode...)") are replaced by
    # the summary below; its restart notices stay.
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    status_dir = tempfile.mkdtemp(prefix="behemoth-run-")
    os.environ[STATUS_ENV] = status_dir
    torchrun_args = parse_args(["--standalone", f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}", *worker])
    try:
        torchrun(torchrun_args)
        return 0
    except ChildFailedError as e:
        failures = [(rank, f.pid, f.exitcode) for rank, f in e.failures.items()]
        text, status = summarize(failures, read_status(status_dir), nproc)
        print(text, file=sys.stderr, flush=True)
        return status
    except SignalException as e:
        records = read_status(status_dir).values()
        stopped = [r for r in records if r.get("kind") == "stopped"]
        if e.sigval == signal.SIGTERM and len(stopped) == nproc:
            step = max(r.get("step", 0) for r in stopped)
            print(
                f"behemoth run: SIGTERM: every rank saved a checkpoint at step {step} and stopped; run the "
                f"same command again to resume.",
                file=sys.stderr,
                flush=True,
            )
            return 0
        name = signal.Signals(e.sigval).name
        saved = f" ({len(stopped)} of {nproc} saved and stopped)" if stopped else ""
        print(f"behemoth run: {name}: stopped the {nproc} worker(s){saved}.", file=sys.stderr, flush=True)
        return 128 + int(e.sigval)
    finally:
        shutil.rmtree(status_dir, ignore_errors=True)

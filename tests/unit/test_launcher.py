"""behemoth run's account of a failed worker group (behemoth.launcher.summarize): the rank that
failed first and how, never the lowest rank or a peer that only lost its connection."""

from __future__ import annotations

import signal

from behemoth.launcher import is_comm_error, summarize

KILL, TERM = -int(signal.SIGKILL), -int(signal.SIGTERM)


def test_a_killed_rank_is_named_with_its_signal_not_the_stopped_rank_0():
    # rank 1 SIGKILLed; the agent then stopped rank 0 (SIGTERM) after it printed a lost-peer error.
    records = {100: {"kind": "comm_error", "time": 5.0, "rank": 0, "message": "RuntimeError: Connection reset"}}
    text, status = summarize([(1, 101, KILL), (0, 100, TERM)], records, nproc=2)
    assert text.startswith("behemoth run: rank 1 was killed by signal SIGKILL and printed no error"), text
    assert "printed above" not in text and status == 1


def test_a_killed_rank_wins_even_when_a_lost_peer_was_seen_in_the_same_poll():
    records = {100: {"kind": "comm_error", "time": 5.0, "rank": 0, "message": "RuntimeError: Connection reset"}}
    text, _ = summarize([(0, 100, 1), (2, 102, KILL), (1, 101, TERM)], records, nproc=4)
    assert "rank 2 was killed by signal SIGKILL" in text, text


def test_an_error_is_said_to_be_printed_above_with_its_first_line():
    records = {
        103: {"kind": "error", "time": 2.0, "rank": 3, "message": "ValueError: bad batch"},
        100: {"kind": "comm_error", "time": 3.0, "rank": 0, "message": "RuntimeError: Connection closed by peer"},
    }
    text, status = summarize([(0, 100, 1), (3, 103, 1), (1, 101, TERM), (2, 102, TERM)], records, nproc=4)
    assert "rank 3 failed with exit code 1 (ValueError: bad batch); its error is printed above" in text, text
    assert status == 1


def test_only_consequences_name_the_earliest_lost_peer():
    records = {
        101: {"kind": "comm_error", "time": 9.0, "rank": 1, "message": "RuntimeError: Connection reset"},
        102: {"kind": "comm_error", "time": 4.0, "rank": 2, "message": "RuntimeError: Connection reset"},
    }
    text, _ = summarize([(1, 101, 1), (2, 102, 1)], records, nproc=2)
    assert "rank 2 failed" in text, text


def test_a_hung_rank_found_by_the_watchdog_is_the_cause():
    records = {100: {"kind": "peer_hung", "time": 1.0, "rank": 0, "hung_rank": 1, "seconds": 12.3, "timeout": 10.0}}
    text, status = summarize([(0, 100, 3), (1, 101, KILL)], records, nproc=2)
    assert text.startswith("behemoth run: rank 1 stopped responding: no heartbeat for 12 s"), text
    assert "train.hang_timeout=10" in text and "noticed by rank 0" in text and status == 1


def test_comm_errors_are_recognised():
    assert is_comm_error(RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1"))
    assert not is_comm_error(ValueError("labels must be [B, S]"))


def test_the_watchdog_names_a_peer_that_never_beat_again_and_spares_one_that_left():
    """No processes: a HashStore stands in for the agent store, rank 1's beats are written by hand."""
    import socket
    import time

    import torch.distributed as dist

    from behemoth.train.lifecycle import Watchdog

    def watch(value: str | None, seconds: float = 1.2):
        store = dist.HashStore()
        if value is not None:
            store.set("1", value)
        dog = Watchdog(store, rank=0, world_size=2, timeout=0.5)
        found = []
        dog._hung = lambda rank, secs, beat: (found.append((rank, beat)), dog._stop.set())
        dog.start()
        time.sleep(seconds)
        dog.stop()
        return found, store.get("0")

    host = socket.gethostname()
    found, mine = watch(f"0:{host}:0")  # stopped right after its first (start) beat
    assert found == [(1, f"0:{host}:0".encode())] and mine == b"done"
    assert watch(None)[0] == [(1, None)]  # never beat at all
    assert watch("done")[0] == []  # left on purpose


def test_dead_peers_finds_a_gone_process_and_a_stale_beat_and_spares_live_ones():
    """No processes of the job: a HashStore stands in for the agent store. Rank 1's pid is a finished
    child of this test (gone), rank 2 beats from another host and never moves, rank 3 is this process
    (alive, beating by hand), rank 4 left on purpose."""
    import os
    import socket
    import subprocess
    import sys
    import threading
    import time

    import torch.distributed as dist

    from behemoth.train.lifecycle import Watchdog

    host = socket.gethostname()
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # reaped: the pid no longer exists
    store = dist.HashStore()
    dog = Watchdog(store, rank=0, world_size=5, timeout=1.0)  # interval 0.2 s
    store.set("3", f"1:{host}:{os.getpid()}")
    store.set("4", "done")
    store.set("2", "7:elsewhere:1")

    store.set("1", f"3:{host}:{gone.pid}")
    assert dog.dead_peers() == [(1, f"(pid {gone.pid}) is dead")]  # at once, without waiting a beat

    store.set("1", f"3:{host}:{os.getpid()}")
    beating = threading.Event()

    def beat():
        n = 1
        while not beating.wait(0.05):
            n += 1
            store.set("3", f"{n}:{host}:{os.getpid()}")
            store.set("1", f"{n}:{host}:{os.getpid()}")

    t = threading.Thread(target=beat)
    t.start()
    try:
        t0 = time.monotonic()
        assert dog.dead_peers() == [(2, "sent no heartbeat for 0.5 s")]
        assert time.monotonic() - t0 < 2.0
        store.set("2", "done")
        assert dog.dead_peers() == []
    finally:
        beating.set()
        t.join()


_STOP_SCRIPT = """
import os, signal, sys, time, types
from behemoth.train.lifecycle import StopRequest

stop = StopRequest().install()
world = types.SimpleNamespace(size=1)
stop.agreed(world)
time.sleep(0.1)
stop.agreed(world)
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(float(sys.argv[1]))  # the step (or a collective that never returns)
print("boundary", stop.agreed(world), flush=True)
stop.restore()
"""


def test_without_a_watchdog_a_sigterm_far_from_a_step_boundary_exits_at_once():
    """Steps of 0.1 s: a SIGTERM whose step does not reach the boundary within 2 s (the floor) exits with
    EXIT_PEER_LOST and one line; one reached in 0.5 s stops there as before (no exit)."""
    import os
    import subprocess
    import sys
    import time

    from behemoth.train.lifecycle import EXIT_PEER_LOST

    src = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "src")
    env = dict(os.environ, PYTHONPATH=src)

    def run(seconds):
        t0 = time.monotonic()
        p = subprocess.run([sys.executable, "-c", _STOP_SCRIPT, str(seconds)], env=env, capture_output=True, text=True)
        return p, time.monotonic() - t0

    p, took = run(0.5)
    assert p.returncode == 0 and p.stdout == "boundary True\n", p.stderr
    p, took = run(30)
    assert p.returncode == EXIT_PEER_LOST, p.stderr
    assert p.stderr.startswith("behemoth: rank 0: SIGTERM while a peer is lost (no step boundary within 2.0 s")
    assert len(p.stderr.strip().splitlines()) == 1 and took < 20, (p.stderr, took)

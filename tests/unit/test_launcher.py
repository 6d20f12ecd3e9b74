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

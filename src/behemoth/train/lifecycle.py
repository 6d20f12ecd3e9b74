"""How a training run ends when the world around it does: preemption and hung ranks.

* :class:`StopRequest` -- SIGTERM (what schedulers send before they take a machine back)
  sets a flag; at the next step boundary the ranks agree (one tiny all-reduce) and every
  rank saves a checkpoint and returns normally, so the process exits 0. torchrun (and
  ``behemoth run``) wait 30 s after forwarding SIGTERM before they SIGKILL, so a step plus
  a save must fit in that.

  A SIGTERM that comes because a peer died (torchrun stops the rest of the group, then
  restarts it) cannot reach a step boundary: the ranks are blocked in a collective that needs
  the dead peer. A thread woken by the signal itself (through the signal wakeup fd: the main
  thread may be inside native code) tells the two apart. A peer whose process on this host is
  gone (its pid is in its heartbeat), or whose heartbeat did not move for :data:`STALE_BEATS`
  beat intervals, or -- without a watchdog -- no step boundary within ``max(2 s, 3 x the
  slowest step-to-step time seen)``, makes the rank print one line, leave a "peer_lost" status
  record and exit at once with :data:`EXIT_PEER_LOST` (no checkpoint: it could not complete;
  a restart resumes from the last complete one), instead of waiting out the launcher's 30 s.
* :class:`Watchdog` -- every rank's thread beats a counter in torchelastic's agent store and
  watches the next rank's (a ring, so the store sees O(world) traffic). A counter that has not
  moved for ``train.hang_timeout`` seconds means that process is stopped (SIGSTOP), hung in
  native code holding the interpreter, or gone with its host: the watcher prints one line
  naming it, leaves a status record for the launcher and exits, and the agent stops the rest.
  A hung process on the watcher's own host is SIGKILLed first (each beat carries host and pid):
  a stopped process would otherwise hold up the agent's shutdown (and a restart) by 30 s.
  A slow step is not a hang (the beating thread runs during it); a rank that waits forever
  in a collective is caught by the collective timeout (``BEHEMOTH_TIMEOUT``) instead.

Test: ``pytest tests/e2e/test_lifecycle.py``.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from datetime import timedelta

from behemoth import comm
from behemoth.launcher import write_status

__all__ = ["StopRequest", "Watchdog", "EXIT_PEER_HUNG", "EXIT_PEER_LOST"]

EXIT_PEER_HUNG = 3
"""Exit status of the rank that found a peer hung."""
EXIT_PEER_LOST = 4
"""Exit status of a rank that got SIGTERM while a peer was dead (no checkpoint could be saved)."""
STALE_BEATS = 2.5
"""Beat intervals without a beat that, on SIGTERM, mean a peer on another host is gone (a live peer
beats every interval, even while its main thread waits in a collective)."""
MIN_BOUNDARY_WAIT = 2.0
"""Without a watchdog: seconds a SIGTERMed rank waits at least for a step boundary."""


class StopRequest:
    """A SIGTERM caught and turned into a stop at the next step boundary (on every rank), or
    into an immediate exit when a peer is dead (see the module docstring)."""

    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM,)) -> None:
        self.signum: int | None = None
        self._signals = signals
        self._previous: dict[int, object] = {}
        self._wakeup: tuple[int, int] | None = None
        self._previous_wakeup = -1
        self._thread: threading.Thread | None = None
        self._boundary = threading.Event()  # set each time the ranks agree at a step boundary
        self._last_boundary: float | None = None
        self._slowest = 0.0  # the longest time between two boundaries so far
        self.watchdog: Watchdog | None = None  # set by the trainer: knows the peers

    def install(self) -> StopRequest:
        if threading.current_thread() is not threading.main_thread():  # signal handlers live there only
            return self
        for s in self._signals:
            self._previous[s] = signal.signal(s, self._handle)
        # The interpreter writes each signal's number to the wakeup fd from its C handler, at once,
        # even while the main thread is blocked in a collective: a thread reading it acts then.
        r, w = os.pipe()
        os.set_blocking(w, False)
        previous = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        if previous != -1:  # someone else's (an event loop): leave it, and the fast path off
            signal.set_wakeup_fd(previous)
            os.close(r), os.close(w)
            return self
        self._wakeup = (r, w)
        self._thread = threading.Thread(target=self._watch, name="behemoth-sigterm", daemon=True)
        self._thread.start()
        return self

    def _handle(self, signum, frame) -> None:
        self.signum = signum

    def restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()
        if self._wakeup is not None:
            signal.set_wakeup_fd(-1)
            os.write(self._wakeup[1], b"\0")  # wakes the thread: 0 is no signal
            self._thread.join(0.5)
            if not self._thread.is_alive():  # else it is still checking the peers: a daemon, it ends with us
                for fd in self._wakeup:
                    os.close(fd)
            self._wakeup = None

    def agreed(self, world: comm.Axis) -> bool:
        """True on every rank iff some rank has been asked to stop (collective when world > 1)."""
        if world.size == 1:
            result = self.signum is not None
        else:
            result = not comm.all_agree(self.signum is None, world)
        now = time.monotonic()
        if self._last_boundary is not None:
            self._slowest = max(self._slowest, now - self._last_boundary)
        self._last_boundary = now
        self._boundary.set()
        return result

    def _watch(self) -> None:
        while True:
            data = os.read(self._wakeup[0], 64)
            if not data or 0 in data:
                return
            if any(b in self._signals for b in data):
                self._boundary.clear()
                self._check_peers()

    def _check_peers(self) -> None:
        """On SIGTERM: exit now if a peer is dead, else let the main thread stop at the boundary."""
        if self.watchdog is not None:
            lost = self.watchdog.dead_peers()
            if lost:
                self._exit(lost)
            return
        if self._last_boundary is None:  # still starting up: no step time to judge by
            return
        bound = max(MIN_BOUNDARY_WAIT, 3 * self._slowest)
        if not self._boundary.wait(bound - (time.monotonic() - self._last_boundary)):
            self._exit([], waited=bound)

    def _exit(self, lost: list[tuple[int, str]], waited: float = 0.0) -> None:
        rank = os.environ.get("RANK", "0")
        if lost:
            why = "; ".join(f"rank {r} {how}" for r, how in lost)
        else:
            why = f"no step boundary within {waited:.1f} s: blocked in a collective whose peer is gone"
        print(
            f"behemoth: rank {rank}: SIGTERM while a peer is lost ({why}); a collective cannot complete "
            f"without it, so exiting at once without a checkpoint (a restart resumes from the last complete one).",
            file=sys.stderr,
            flush=True,
        )
        write_status("peer_lost", lost_ranks=[r for r, _ in lost])
        sys.stdout.flush()
        os._exit(EXIT_PEER_LOST)


class Watchdog:
    """Heartbeats through torchelastic's agent store; see the module docstring.

    ``store`` is any ``torch.distributed.Store`` every rank reaches (keys: the ranks);
    :meth:`for_torchelastic` builds one from torchrun's environment, or returns None when
    the job was not launched by torchrun / ``behemoth run`` or ``timeout`` is 0."""

    def __init__(self, store, *, rank: int, world_size: int, timeout: float) -> None:
        self.store, self.rank, self.world_size, self.timeout = store, rank, world_size, float(timeout)
        self.interval = min(5.0, max(0.2, self.timeout / 10))
        self._me = f"{socket.gethostname()}:{os.getpid()}"  # where a hung beat comes from
        self._stop = threading.Event()
        self._lock = threading.Lock()  # the store client is shared with dead_peers()
        self._thread = threading.Thread(target=self._run, name="behemoth-watchdog", daemon=True)

    @classmethod
    def for_torchelastic(cls, *, rank: int, world_size: int, timeout: float) -> Watchdog | None:
        import torch.distributed as dist

        from behemoth.distributed import attempt_prefix

        prefix = attempt_prefix()
        if not timeout or world_size < 2 or prefix is None:
            return None
        try:
            client = dist.TCPStore(
                os.environ["MASTER_ADDR"],
                int(os.environ["MASTER_PORT"]),
                world_size,
                is_master=False,
                timeout=timedelta(seconds=max(30.0, timeout)),
            )
        except (RuntimeError, ValueError, KeyError) as e:  # the job runs on; only the hang check is lost
            print(f"behemoth: warning: no heartbeat watchdog ({e}); a hung rank is caught by BEHEMOTH_TIMEOUT only.")
            return None
        return cls(dist.PrefixStore(prefix + "/heartbeat", client), rank=rank, world_size=world_size, timeout=timeout)

    def start(self) -> Watchdog:
        self.store.set(str(self.rank), f"0:{self._me}")
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop beating and tell the watcher this rank left on purpose."""
        self._stop.set()
        self._thread.join(timeout=self.interval + 5)
        try:
            self.store.set(str(self.rank), "done")
        except Exception:  # the agent (and its store) may already be gone; nothing to tell
            pass

    def _run(self) -> None:
        watched = str((self.rank + 1) % self.world_size)
        beat, last, since = 0, None, time.monotonic()
        try:
            while not self._stop.wait(self.interval):
                beat += 1
                with self._lock:
                    self.store.set(str(self.rank), f"{beat}:{self._me}")
                    value = self.store.get(watched) if self.store.check([watched]) else None
                now = time.monotonic()
                if value == b"done" or value != last:
                    last, since = value, now
                elif now - since > self.timeout:
                    self._hung(int(watched), now - since, value)
        except Exception:  # the store went away with the agent: the launcher handles that
            return

    def _beats(self) -> dict[int, bytes]:
        keys = [str(r) for r in range(self.world_size) if r != self.rank]
        with self._lock:
            return {int(k): self.store.get(k) for k in keys if self.store.check([k])}

    def dead_peers(self) -> list[tuple[int, str]]:
        """``(rank, how)`` of each peer that is gone: its process on this host no longer exists, or
        its beat did not move for :data:`STALE_BEATS` beat intervals (another host's). Empty when all are alive,
        or when the store cannot be read."""
        try:
            first = self._beats()
            lost = []
            for rank, value in first.items():
                parts = value.decode(errors="replace").split(":")
                if len(parts) == 3 and parts[1] == socket.gethostname() and parts[2].isdigit():
                    if not _process_alive(int(parts[2])):
                        lost.append((rank, f"(pid {parts[2]}) is dead"))
            if lost:
                return lost
            time.sleep(STALE_BEATS * self.interval)
            again = self._beats()
        except Exception:  # the agent (and its store) may be gone: the launcher handles that
            return []
        return [
            (rank, f"sent no heartbeat for {STALE_BEATS * self.interval:.1f} s")
            for rank, value in first.items()
            if value != b"done" and again.get(rank) == value
        ]

    def _hung(self, rank: int, seconds: float, beat: bytes | None) -> None:
        parts = (beat or b"").decode(errors="replace").split(":")
        if len(parts) == 3 and parts[1] == socket.gethostname() and parts[2].isdigit():
            try:
                os.kill(int(parts[2]), signal.SIGKILL)
            except OSError:  # already gone, or not ours to kill
                pass
        print(
            f"behemoth: rank {rank} sent no heartbeat for {seconds:.0f} s (train.hang_timeout={self.timeout:g}): "
            f"it is stopped (SIGSTOP), hung in native code, or its host is gone; stopping the job "
            f"(noticed by rank {self.rank}).",
            file=sys.stderr,
            flush=True,
        )
        write_status("peer_hung", hung_rank=rank, seconds=seconds, timeout=self.timeout)
        sys.stdout.flush()
        os._exit(EXIT_PEER_HUNG)


def _process_alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (dead, not yet reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

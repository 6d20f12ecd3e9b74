"""How a training run ends when the world around it does: preemption and hung ranks.

* :class:`StopRequest` -- SIGTERM (what schedulers send before they take a machine back)
  sets a flag; at the next step boundary the ranks agree (one tiny all-reduce) and every
  rank saves a checkpoint and returns normally, so the process exits 0. torchrun (and
  ``behemoth run``) wait 30 s after forwarding SIGTERM before they SIGKILL, so a step plus
  a save must fit in that.
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

__all__ = ["StopRequest", "Watchdog", "EXIT_PEER_HUNG"]

EXIT_PEER_HUNG = 3
"""Exit status of the rank that found a peer hung."""


class StopRequest:
    """A SIGTERM caught and turned into a stop at the next step boundary (on every rank)."""

    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM,)) -> None:
        self.signum: int | None = None
        self._signals = signals
        self._previous: dict[int, object] = {}

    def install(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():  # signal handlers live there only
            for s in self._signals:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        self.signum = signum

    def restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()

    def agreed(self, world: comm.Axis) -> bool:
        """True on every rank iff some rank has been asked to stop (collective when world > 1)."""
        if world.size == 1:
            return self.signum is not None
        return not comm.all_agree(self.signum is None, world)


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
                self.store.set(str(self.rank), f"{beat}:{self._me}")
                value = self.store.get(watched) if self.store.check([watched]) else None
                now = time.monotonic()
                if value == b"done" or value != last:
                    last, since = value, now
                elif now - since > self.timeout:
                    self._hung(int(watched), now - since, value)
        except Exception:  # the store went away with the agent: the launcher handles that
            return

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

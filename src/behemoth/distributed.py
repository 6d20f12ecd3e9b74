"""Process start-up: ``bh.init()`` (torchrun's environment, or a lone process) and
``bh.spawn(fn, world_size, *args)`` (N local processes with the default group ready).

Backend: NCCL when CUDA is available, gloo otherwise. Every group gets a bounded
timeout (``BEHEMOTH_TIMEOUT`` seconds, default 300) so a dead peer turns into an error,
never a hang; ``spawn`` additionally kills the survivors as soon as one child fails.

Under torchrun (or ``behemoth run``) a worker dies with its agent (``PR_SET_PDEATHSIG``), so
killing the launcher never leaves ranks training. After an elastic restart the new workers
meet in the same agent store the dead ones used; torch keys the process group's bootstrap
(gloo peer addresses, the NCCL unique id) by group name only, so a new worker could read a
dead one's address and fail with "Connection refused". ``init`` therefore keys every
attempt apart (:func:`attempt_prefix`).
"""

from __future__ import annotations

import ctypes
import datetime
import faulthandler
import os
import signal
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def default_timeout() -> datetime.timedelta:
    return datetime.timedelta(seconds=float(os.environ.get("BEHEMOTH_TIMEOUT", "300")))


def device_for_rank() -> torch.device:
    """This process's device: ``cuda:LOCAL_RANK`` when GPUs exist, else CPU."""
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
        return torch.device("cuda", local)
    return torch.device("cpu")


def attempt_prefix(env: dict | None = None) -> str | None:
    """The store prefix that keeps one torchelastic worker group's bootstrap keys apart from
    the previous attempts' (None outside torchelastic's agent store).

    The agent's store outlives its workers; a restart (``TORCHELASTIC_RESTART_COUNT``) or a
    membership change (a new ``WORLD_SIZE``) starts a new group in it."""
    env = os.environ if env is None else env
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    return f"behemoth/attempt-{env.get('TORCHELASTIC_RESTART_COUNT', '0')}/world-{env['WORLD_SIZE']}"


def die_with_parent() -> None:
    """Have the kernel SIGKILL this process when its parent (torchrun's agent) dies, so killing
    the launcher, even with SIGKILL, stops every rank (Linux; a no-op elsewhere)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):  # no prctl: nothing to arm
        return
    if os.getppid() == 1:  # the agent died before the request was armed
        os._exit(1)


def init(backend: str | None = None) -> None:
    """Initialise the default process group once (idempotent).

    Reads torchrun's ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``; with none of
    them set, a lone process becomes a world of one, so the same code runs everywhere.
    Under torchrun the process also dies with its agent (:func:`die_with_parent`), and an
    elastic restart's group bootstraps under its own store prefix (:func:`attempt_prefix`).
    """
    if dist.is_initialized():
        return
    dev = device_for_rank()
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    backend = backend or ("nccl" if dev.type == "cuda" else "gloo")
    if "WORLD_SIZE" in os.environ and "RANK" in os.environ:
        if "TORCHELASTIC_RUN_ID" in os.environ:
            die_with_parent()
        kwargs = {}
        if backend == "nccl":
            kwargs["device_id"] = dev
        prefix = attempt_prefix()
        if prefix is not None:
            rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            agent_store = dist.TCPStore(
                os.environ["MASTER_ADDR"],
                int(os.environ["MASTER_PORT"]),
                world_size,
                is_master=False,
                timeout=default_timeout(),
            )
            kwargs.update(store=dist.PrefixStore(prefix, agent_store), rank=rank, world_size=world_size)
        dist.init_process_group(backend, timeout=default_timeout(), **kwargs)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=default_timeout())


def _child(index: int, fn, world_size: int, store_path: str, args) -> None:
    faulthandler.enable()  # a hard crash (abort, segfault) still prints the Python stack
    os.environ.update(
        RANK=str(index), LOCAL_RANK=str(index), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size)
    )
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    dev = device_for_rank()
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    backend = "nccl" if dev.type == "cuda" else "gloo"
    dist.init_process_group(
        backend, init_method=f"file://{store_path}", rank=index, world_size=world_size, timeout=default_timeout()
    )
    try:
        fn(index, world_size, *args)
    except BaseException as e:
        # Record when and what, so spawn can name the rank that failed *first* (the cause)
        # rather than whichever peer's broken collective it happened to notice first.
        with open(os.path.join(os.path.dirname(store_path), f"error-{index}.txt"), "w") as f:
            f.write(f"{time.time():.6f}\n{format_exception(e)}")
        raise
    finally:
        try:
            dist.destroy_process_group()
        except Exception:  # a failed peer can leave the group unusable; nothing left to free
            pass
    # Success: leave without running C++ static destructors. At interpreter exit, torch
    # 2.13's CPU runtime intermittently aborts ("terminate called without an active
    # exception") after all work is done, which would turn a passed run into a failure.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(fn, world_size: int, *args, timeout: float | None = None) -> None:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` fresh processes, each with the
    default process group initialised (gloo on CPU, NCCL on GPUs), like
    ``torch.multiprocessing.spawn``.

    A child that raises or dies makes this call raise (with the child's traceback) after
    the other children are killed; ``timeout`` seconds (default ``BEHEMOTH_SPAWN_TIMEOUT``
    or 900) bound the whole run, so it never hangs.
    """
    if world_size < 1:
        raise ValueError(f"spawn: world_size={world_size} must be >= 1")
    timeout = float(timeout if timeout is not None else os.environ.get("BEHEMOTH_SPAWN_TIMEOUT", "900"))
    with tempfile.TemporaryDirectory(prefix="behemoth-spawn-") as tmp:
        store = os.path.join(tmp, "store")
        ctx = mp.start_processes(
            _child, args=(fn, world_size, store, args), nprocs=world_size, join=False, start_method="spawn"
        )
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=0.2):
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"spawn: {world_size} processes running {getattr(fn, '__name__', fn)} "
                        f"did not finish within {timeout:.0f} s; killed them."
                    )
        except mp.ProcessExitedException as e:
            how = f"died with exit code {e.exit_code}" + (f" (signal {e.signal_name})" if e.signal_name else "")
            raise RuntimeError(f"spawn: process {e.error_index} {how}" + _child_errors(tmp)) from None
        except mp.ProcessRaisedException as e:
            errors = _child_errors(tmp)
            raise RuntimeError(f"spawn: process {e.error_index} raised" + (errors or f":\n{e.msg}")) from None
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            for p in ctx.processes:
                p.join(5)


def _child_errors(tmp: str) -> str:
    """Every child's recorded exception, earliest first (the first is usually the cause)."""
    found = []
    for name in os.listdir(tmp):
        if name.startswith("error-") and name.endswith(".txt"):
            with open(os.path.join(tmp, name)) as f:
                stamp, _, text = f.read().partition("\n")
            found.append((float(stamp or 0), int(name[6:-4]), text))
    return "".join(
        f"\n--- rank {rank} raised{' first' if i == 0 else ''}:\n{text}"
        for i, (_, rank, text) in enumerate(sorted(found))
    )


def format_exception(e: BaseException) -> str:
    return "".join(traceback.format_exception(type(e), e, e.__traceback__))

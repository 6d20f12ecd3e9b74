"""Checkpoints that lose nothing: sharded (torch.distributed.checkpoint), atomic, safe to load.

A checkpoint knows only a state-dict interface (:class:`Stateful`, as DCP's): whatever holds
state -- the model's shards, the gradient sync's optimizer state, the engine's step counter and
loss scaler, this process's RNG -- is handed in as a named component with ``state_dict()`` and
``load_state_dict()``. A component's tensors go to DCP as ``<component>/<key>``; its other values
(JSON) go to ``meta.json`` under their own keys. A tensor carrying a tensor-parallel ShardSpec
(``parallel.tensor.layout.get_spec``) is written as its rectangles of the serial tensor
(:mod:`behemoth.checkpoint_shards`), so a checkpoint saved under dp=2 loads under tp=2 and vice
versa, each rank reading only its rectangles.

Layout of one checkpoint directory ``step-N/``::

    .metadata, __*_*.distcp    DCP: model tensors and optimizer-state tensors, keyed by the
                               serial model's parameter names (so any plan can load them)
    rng-rank{R}.pt             this rank's RNG states (tensors only; loaded weights_only)
    meta.json                  written last: step, plan, world size, optimizer hyper-parameters,
                               loss-scaler state and the caller's ``extra`` (data position...)

Background saves (:mod:`behemoth.async_checkpoint`) write the same files through
:func:`write_checkpoint`, from a host copy of the state, with the same commit. A rank writes with
``threads`` threads, each to its own file (default: one per GiB of its tensors, up to 8); a tensor
held by several ranks (dp replicas) is written once, by the rank that has the fewest bytes to
write so far (DCP's plan), so replicas share the writing evenly.

Atomicity: everything is written into ``step-N.partial/``, each file fsynced by the rank
that wrote it; only after every rank has finished does rank 0 write ``meta.json`` (fsynced),
fsync the directory and rename it to ``step-N`` (an atomic rename). A save killed at any
point leaves at most a ``.partial`` directory, which :func:`latest_checkpoint` ignores and
the next save replaces.

Safety: DCP's own loader unpickles its metadata file and non-tensor items; behemoth stores
only tensors in DCP and reads the metadata with a restricted unpickler that admits only
DCP's metadata classes, so a crafted checkpoint cannot run code.

Pipeline stages: each rank's model holds only its stage's tensors, under the serial names,
so each stage writes (and reads) just those; the tensors of all stages together are the
serial model's. A tied embedding held by the last stage as the head's weight keeps its
optimizer state under the serial model's first name, so pp = 2 checkpoints load under
pp = 1 and the reverse.

Tested in tests/dist/test_checkpoint.py and tests/dist/test_pipeline_checkpoint.py.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import random
import re
import shutil
import zipfile
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemReader

from .checkpoint_shards import dcp_view, serial_shape

META = "meta.json"
_STEP_RE = re.compile(r"^step-(\d+)(\.old)?$")
FORMAT_VERSION = 1


# ------------------------------------------------------------------ safe metadata reading
_SAFE_MODULE_PREFIXES = ("torch.distributed.checkpoint.",)
_SAFE_GLOBALS = {
    ("collections", "OrderedDict"),
    ("torch", "Size"),
    ("torch._utils", "_rebuild_tensor_v2"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "slice"),
    ("builtins", "tuple"),
    ("builtins", "list"),
    ("builtins", "dict"),
    ("torch", "float32"),
    ("torch", "float64"),
    ("torch", "float16"),
    ("torch", "bfloat16"),
    ("torch", "int64"),
    ("torch", "int32"),
    ("torch", "int16"),
    ("torch", "int8"),
    ("torch", "uint8"),
    ("torch", "bool"),
    ("torch", "strided"),
    ("torch", "contiguous_format"),
    ("torch", "preserve_format"),
    ("torch", "channels_last"),
    ("torch", "complex64"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
}


class _SafeUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if module.startswith(_SAFE_MODULE_PREFIXES) or (module, name) in _SAFE_GLOBALS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(
            f"checkpoint metadata refers to {module}.{name}, which behemoth does "
            f"not load (only DCP metadata classes are allowed): refusing to unpickle."
        )


class SafeFileSystemReader(FileSystemReader):
    """DCP reader whose metadata is read with a restricted unpickler."""

    def read_metadata(self, *args, **kwargs):
        rank = kwargs.get("rank")
        path = self._get_metadata_path(rank)
        with self.fs.create_stream(path, "rb") as f:
            metadata = _SafeUnpickler(io.BytesIO(f.read())).load()
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


# ------------------------------------------------------------------ discovery
def is_complete(path: str) -> bool:
    return os.path.isfile(os.path.join(path, META))


def latest_checkpoint(directory: str) -> str | None:
    """The newest complete ``step-N`` checkpoint under ``directory``, or None.

    A save that replaces an existing ``step-N`` moves it to ``step-N.old`` for the instant
    between two renames; if that is where a crash struck, the ``.old`` copy is used."""
    if not os.path.isdir(directory):
        return None
    found = []
    for name in os.listdir(directory):
        m = _STEP_RE.match(name)
        if m and is_complete(os.path.join(directory, name)):
            found.append((int(m.group(1)), m.group(2) is None, name))  # prefer step-N over step-N.old
    return os.path.join(directory, max(found)[2]) if found else None


# ------------------------------------------------------------------ the component interface
@runtime_checkable
class Stateful(Protocol):
    """A part of a job that holds state (DCP's ``Stateful``). ``state_dict()`` returns tensors
    (written to DCP; a load reads into those same tensors in place) and JSON values (``meta.json``);
    ``load_state_dict(state)`` gets back its tensors, as read, and every value of ``meta.json``."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


@runtime_checkable
class LazyStateful(Stateful, Protocol):
    """A :class:`Stateful` whose tensors may not exist before a load (optimizer state is created by
    the first step): it says where to read what the checkpoint holds of it."""

    def load_targets(self, stored: Mapping[str, Any], meta: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """The tensors to read, by key, for the checkpoint's tensors of this component ``stored``
        (``key -> DCP TensorStorageMetadata``: ``size``, ``properties.dtype``). Raises ValueError,
        before anything is read, for a checkpoint this component cannot load."""
        ...


class RNGState:
    """This process's RNG states (torch, Python, NumPy, CUDA): a per-rank component."""

    def state_dict(self) -> dict[str, torch.Tensor]:
        return _rng_state()

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        _set_rng_state(dict(state))


def _rng_state() -> dict:
    st = {
        "torch": torch.get_rng_state(),
        "python": torch.tensor(random.getstate()[1], dtype=torch.int64),
        "python_pos": torch.tensor(random.getstate()[2] is not None),
    }
    np_state = np.random.get_state()
    st["numpy"] = torch.from_numpy(np_state[1].astype(np.int64))
    st["numpy_pos"] = torch.tensor([np_state[2], np_state[3]], dtype=torch.float64)
    st["numpy_gauss"] = torch.tensor(np_state[4], dtype=torch.float64)
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state()
    return st


def _set_rng_state(st: dict) -> None:
    torch.set_rng_state(st["torch"])
    random.setstate((3, tuple(int(x) for x in st["python"].tolist()), None))
    pos = st["numpy_pos"].tolist()
    np.random.set_state(
        ("MT19937", st["numpy"].numpy().astype(np.uint32), int(pos[0]), int(pos[1]), float(st["numpy_gauss"]))
    )
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state(st["cuda"])


# ------------------------------------------------------------------ save
def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json_atomic(path: str, data: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _commit(partial: str, final: str, meta: dict) -> None:
    """Rank 0's last act of a save: the marker, then the atomic rename."""
    _write_json_atomic(os.path.join(partial, META), meta)
    _fsync_dir(partial)
    old = final + ".old"
    if os.path.exists(final):
        if os.path.exists(old):
            shutil.rmtree(old)
        os.rename(final, old)
    os.rename(partial, final)
    _fsync_dir(os.path.dirname(os.path.abspath(final)))
    if os.path.exists(old):
        shutil.rmtree(old)


def check_extra(extra: dict) -> None:
    """``extra`` must be JSON (it goes to meta.json): checked on every rank before any collective."""
    try:
        json.dumps(extra)
    except TypeError as e:
        raise ValueError(f"engine.save(extra=...) must be JSON-serialisable: {e}") from None


def collect(state: Mapping[str, Stateful]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Every component's tensors as ``<component>/<key>`` (the components' own tensors, not copies)
    and their JSON values (for meta.json). Collective where a component's ``state_dict()`` is (ZeRO
    gathers its optimizer state): every rank, in the same order."""
    tensors, meta = {}, {}
    for name, component in state.items():
        for k, v in component.state_dict().items():
            if isinstance(v, torch.Tensor):
                tensors[f"{name}/{k}"] = v
            else:
                meta[k] = v
    return tensors, meta


def save_checkpoint(
    path: str,
    state: Mapping[str, Stateful],
    *,
    extra: dict,
    rank_state: Mapping[str, Stateful] | None = None,
    threads: int | None = None,
) -> None:
    """Save every component of ``state`` (and this rank's ``rank_state``, one file per rank) to
    directory ``path`` atomically, with the caller's JSON ``extra`` (collective over all ranks).
    ``threads``: writer threads per rank (None: :func:`writer_threads`)."""
    check_extra(extra)
    check_threads(threads)
    tensors, meta = collect(state)
    rank_files = {name: component.state_dict() for name, component in (rank_state or {}).items()}
    write_checkpoint(path, tensors, meta, rank_files, extra=extra, threads=threads)


WRITER_BYTES_PER_THREAD = 2**30
MAX_WRITER_THREADS = 8


def writer_threads(tensors) -> int:
    """Threads (and files) a rank writes its tensors with by default: one per GiB it holds, at most 8 --
    a 1.3B-parameter model's 15.6 GB of weights and AdamW state goes out in parallel streams, a small
    one in one file."""
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    return max(1, min(MAX_WRITER_THREADS, nbytes // WRITER_BYTES_PER_THREAD))


def check_threads(threads: int | None) -> None:
    """``threads`` is None or an integer >= 1: checked on every rank before any collective."""
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ValueError(
            f"checkpoint writer threads={threads!r}: must be an integer >= 1 (or None: one per GiB a rank "
            f"writes, up to {MAX_WRITER_THREADS})."
        )


def _save_fsynced(obj, path: str) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def write_checkpoint(
    path: str,
    tensors: Mapping[str, torch.Tensor],
    meta: dict,
    rank_files: Mapping[str, dict],
    *,
    extra: dict,
    group=None,
    threads: int | None = None,
) -> None:
    """Write what :func:`collect` gathered (and this rank's ``rank_files``, ``{name: state dict}``,
    to ``<name>-rank<R>.pt``) into ``path + ".partial"``, then commit it as ``path``: collective
    over ``group`` (default: the world), whose barriers order the steps -- rank 0 makes the
    directory, every rank writes (with ``threads`` threads, default :func:`writer_threads`) and
    fsyncs its files, and only once every rank has written does rank 0 commit.

    A CPU tensor is written from its own memory: one that owns exactly its bytes (the host copies
    of :class:`behemoth.async_checkpoint.HostSnapshot`) is not copied again; a view into a larger
    storage is copied first (DCP writes a tensor's whole storage)."""
    check_threads(threads)
    path = os.path.abspath(path.rstrip("/"))
    partial = path + ".partial"
    rank = dist.get_rank()
    if rank == 0:
        if os.path.exists(partial):
            shutil.rmtree(partial)
        os.makedirs(partial)
    dist.barrier(group=group)
    dcp.save(
        {k: dcp_view(v) for k, v in tensors.items()},
        storage_writer=dcp.FileSystemWriter(partial, thread_count=threads or writer_threads(tensors.values())),
        planner=DefaultSavePlanner(dedup_save_to_lowest_rank=False),  # a replica goes to the least-loaded rank
        process_group=group,
    )
    for name, state_dict in rank_files.items():
        _save_fsynced(state_dict, os.path.join(partial, f"{name}-rank{rank}.pt"))
    dist.barrier(group=group)
    if rank == 0:
        meta = {**meta, "format": FORMAT_VERSION, "world_size": dist.get_world_size(), "extra": extra}
        _commit(partial, path, meta)
    dist.barrier(group=group)


# ------------------------------------------------------------------ load
def damage(path: str) -> str | None:
    """What is wrong with the files a load of complete checkpoint ``path`` reads, or None when
    they are whole: meta.json parses, the tensor index (.metadata) unpickles (safely), each shard
    file is as long as the index says, each rng-rank*.pt is a whole archive. Reads sizes and
    small files only, so every rank can check before any collective."""
    try:
        with open(os.path.join(path, META)) as f:
            json.load(f)
    except (OSError, ValueError) as e:
        return f"its {META} cannot be read ({e})"
    if not os.path.isfile(os.path.join(path, ".metadata")):
        return "its tensor index .metadata is missing"
    try:
        index = SafeFileSystemReader(path).read_metadata()
    except Exception as e:  # whatever the unpickler raised, the index is unreadable
        return f"its tensor index .metadata cannot be read ({type(e).__name__}: {e})"
    need: dict[str, int] = {}
    for info in (getattr(index, "storage_data", None) or {}).values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(need.items()):
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            return f"{name} is missing"
        if os.path.getsize(file) < size:
            return f"{name} is truncated ({os.path.getsize(file):,} bytes; its index needs {size:,})"
    for name in sorted(os.listdir(path)):
        if name.startswith("rng-rank") and name.endswith(".pt"):
            try:
                with zipfile.ZipFile(os.path.join(path, name)) as z:
                    bad = z.testzip()
            except (zipfile.BadZipFile, OSError) as e:
                bad = str(e)
            if bad is not None:
                return f"{name} is not a whole archive ({bad})"
    return None


def read_meta(path: str) -> dict:
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint {path!r} does not exist.")
    if not is_complete(path):
        raise ValueError(
            f"checkpoint {path!r} is incomplete (no {META}): its save was interrupted. "
            f"Load the newest complete one instead (behemoth.checkpoint.latest_checkpoint)."
        )
    problem = damage(path)
    if problem is not None:
        raise ValueError(
            f"checkpoint {path!r} is damaged: {problem}. Load another one (behemoth.checkpoint.latest_checkpoint "
            f"finds the newest complete one once this one is moved away)."
        )
    with open(os.path.join(path, META)) as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT_VERSION:
        raise ValueError(
            f"checkpoint {path!r} has format {meta.get('format')!r}; this behemoth reads {FORMAT_VERSION}."
        )
    return meta


def load_checkpoint(
    path: str, state: Mapping[str, Stateful], *, rank_state: Mapping[str, Stateful] | None = None
) -> dict:
    """Load every component of ``state`` from checkpoint ``path`` (saved under any plan), and
    ``rank_state`` when the world size is the one it was saved at. Returns the ``extra`` given at
    save time. Every check runs before anything is read."""
    path = os.path.abspath(path.rstrip("/"))
    meta = read_meta(path)
    reader = SafeFileSystemReader(path)
    stored = reader.read_metadata().state_dict_metadata
    targets: dict[str, dict[str, torch.Tensor]] = {}
    for name, component in state.items():
        prefix = name + "/"
        if isinstance(component, LazyStateful):
            mine = {k[len(prefix) :]: md for k, md in stored.items() if k.startswith(prefix)}
            targets[name] = component.load_targets(mine, meta)
            continue
        want = {k: v for k, v in component.state_dict().items() if isinstance(v, torch.Tensor)}
        missing = [prefix + k for k in want if prefix + k not in stored]
        if missing:
            raise ValueError(
                f"checkpoint {path!r} lacks {name} tensors {missing[:5]}"
                f"{' ...' if len(missing) > 5 else ''}: it was saved from a different model."
            )
        for k, v in want.items():
            shape = tuple(stored[prefix + k].size)
            if shape != serial_shape(v):
                raise ValueError(f"checkpoint tensor {prefix}{k} has shape {shape}, the model's is {serial_shape(v)}.")
        targets[name] = want
    reads = {f"{name}/{k}": dcp_view(v) for name, ts in targets.items() for k, v in ts.items()}
    dcp.load(reads, storage_reader=reader)
    values = {k: v for k, v in meta.items() if k not in ("format", "world_size", "extra")}
    for name, component in state.items():
        component.load_state_dict({**values, **targets[name]})
    if meta["world_size"] == dist.get_world_size():
        for name, component in (rank_state or {}).items():
            rank_file = os.path.join(path, f"{name}-rank{dist.get_rank()}.pt")
            if os.path.exists(rank_file):
                component.load_state_dict(torch.load(rank_file, weights_only=True))
    return meta["extra"]

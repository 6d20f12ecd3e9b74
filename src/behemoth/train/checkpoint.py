"""Checkpoints that lose nothing: sharded (torch.distributed.checkpoint), atomic, safe to load.

Layout of one checkpoint directory ``step-N/``::

    .metadata, __*_*.distcp    DCP: model tensors and optimizer-state tensors, keyed by the
                               serial model's parameter names (so any plan can load them)
    rng-rank{R}.pt             this rank's RNG states (tensors only; loaded weights_only)
    meta.json                  written last: step, plan, world size, optimizer hyper-parameters,
                               loss-scaler state and the caller's ``extra`` (data position...)

Atomicity: everything is written into ``step-N.partial/``; only after every rank has
finished does rank 0 write ``meta.json`` (fsynced) and rename the directory to
``step-N`` (an atomic rename). A save killed at any point leaves at most a ``.partial``
directory, which :func:`latest_checkpoint` ignores and the next save replaces.

Safety: DCP's own loader unpickles its metadata file and non-tensor items; behemoth stores
only tensors in DCP and reads the metadata with a restricted unpickler that admits only
DCP's metadata classes, so a crafted checkpoint cannot run code.

Tensor-parallel shards: a parameter with a ShardSpec (and its optimizer state) goes to DCP
as a :class:`ShardChunks` view: the serial tensor's name and shape, and this rank's shard as
one or more rectangles with their real offsets in the serial tensor (a fused QKV shard is
three). Replicas (dp ranks, replicated tp ranks) write identical chunks, which DCP keeps
once. A plain tensor and a chunked one of the same name are the same serial tensor to DCP,
so a checkpoint saved under dp=2 loads under tp=2 and vice versa, each rank reading only
its rectangles.

Pipeline stages: each rank's model holds only its stage's tensors, under the serial names,
so each stage writes (and reads) just those; the tensors of all stages together are the
serial model's. A tied embedding held by the last stage as the head's weight keeps its
optimizer state under the serial model's first name (``engine.serial_param_names``), so
pp = 2 checkpoints load under pp = 1 and the reverse.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import random
import re
import shutil

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from ..parallel.tensor import is_sharded, shard_rectangles
from ..parallel.tensor.layout import ShardSpec, get_spec

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


# ------------------------------------------------------------------ tensor-parallel shards
class ShardChunks(torch.Tensor):
    """A local shard as DCP sees it: a tensor of the *serial* shape whose data is this rank's
    rectangles of it (from the ShardSpec), views into ``local`` -- so a load writes straight
    into the parameter or optimizer state. It implements DCP's chunk protocol (the
    ``__create_write_items__`` / ``__create_chunk_list__`` / ``__get_tensor_shard__`` methods
    DTensor uses) and nothing else: any tensor operation on it raises."""

    @staticmethod
    def __new__(cls, local: torch.Tensor, spec: ShardSpec):
        self = torch.Tensor._make_wrapper_subclass(cls, spec.full_shape, dtype=local.dtype, device=local.device)
        view = local.reshape(spec.local_view_shape())
        if view.data_ptr() != local.data_ptr():
            raise AssertionError("a shard must be contiguous to be checkpointed in place")
        self._chunks = [(torch.Size(off), torch.Size(size), view[index]) for index, off, size in shard_rectangles(spec)]
        return self

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(
            f"ShardChunks is a checkpoint view of a tensor-parallel shard; {func} on it is not supported."
        )

    def __create_write_items__(self, fqn: str, obj) -> list[WriteItem]:
        return [
            WriteItem(
                index=MetadataIndex(fqn, off),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=off, sizes=size),
                    properties=TensorProperties.create_from_tensor(data),
                    size=self.size(),
                ),
            )
            for off, size, data in self._chunks
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=off, sizes=size) for off, size, _ in self._chunks]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        for off, _, data in self._chunks:
            if off == index.offset:
                return data
        raise ValueError(f"no shard of {index.fqn} at offset {tuple(index.offset or ())} on this rank")


def _for_dcp(t: torch.Tensor, spec: ShardSpec | None):
    """``t`` as DCP should see it: chunked for a tensor-parallel shard, plain otherwise."""
    return ShardChunks(t.detach(), spec) if is_sharded(spec) else t.detach()


def _full_shape(t: torch.Tensor) -> tuple[int, ...]:
    spec = get_spec(t)
    return spec.full_shape if is_sharded(spec) else tuple(t.shape)


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


# ------------------------------------------------------------------ state <-> flat tensors
def _param_names(model: torch.nn.Module, aliases: dict[str, str] | None = None) -> dict[int, str]:
    """``id(param) -> name`` keying its optimizer state. ``aliases`` renames a parameter to the
    serial model's name for it (a pipeline's last stage holds a copy of a tied embedding under
    the head's name; it is saved and loaded as the serial model's first name, so any plan loads it)."""
    names = {}
    for name, p in model.named_parameters():  # tied weights: first name wins
        names.setdefault(id(p), name)
    aliases = aliases or {}
    return {i: aliases.get(n, n) for i, n in names.items()}


def _held_params(engine) -> dict[str, torch.nn.Parameter]:
    """``checkpoint name -> parameter`` of the parameters whose optimizer state this rank holds."""
    names = _param_names(engine.model, getattr(engine, "serial_param_names", None))
    return {names[id(p)]: p for p in engine.grad_sync.params}


def _to_checkpoint_names(engine) -> dict[str, str]:
    """The gradient sync's parameter names (the model's) -> the checkpoint's (the serial model's)."""
    aliases = getattr(engine, "serial_param_names", None) or {}
    return {n: aliases.get(n, n) for n in _param_names(engine.model).values()}


def optimizer_tensors(engine) -> dict[str, torch.Tensor]:
    """Optimizer state as flat ``optim/<param name>/<key>`` tensors (scalars become 0-d tensors);
    state shaped like a tensor-parallel shard is chunked like its parameter."""
    rename, params = _to_checkpoint_names(engine), _held_params(engine)
    out = {}
    # ZeRO: the state of the chunk shards, gathered and cut back into per-parameter tensors.
    for name, state in engine.grad_sync.state_dict().items():
        name = rename[name]
        p = params[name]
        spec = get_spec(p)
        for k, v in state.items():
            v = v if isinstance(v, torch.Tensor) else torch.tensor(v)
            out[f"optim/{name}/{k}"] = _for_dcp(v, spec if v.shape == p.shape else None)
    return out


def _hyper_params(optimizer) -> list[dict]:
    groups = []
    for g in optimizer.param_groups:
        d = {}
        for k, v in g.items():
            if k == "params":
                continue
            if isinstance(v, torch.Tensor):
                v = v.item()
            if isinstance(v, tuple):
                v = list(v)
            if isinstance(v, (int, float, bool, str, list)) or v is None:
                d[k] = v
        groups.append(d)
    return groups


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


def save_checkpoint(engine, path: str, extra: dict) -> None:
    """Save ``engine`` to directory ``path`` atomically (collective over all ranks)."""
    path = os.path.abspath(path.rstrip("/"))
    partial = path + ".partial"
    rank = dist.get_rank()
    try:
        json.dumps(extra)
    except TypeError as e:
        raise ValueError(f"engine.save(extra=...) must be JSON-serialisable: {e}") from None
    if rank == 0:
        if os.path.exists(partial):
            shutil.rmtree(partial)
        os.makedirs(partial)
    dist.barrier()
    with engine.grad_sync.gathered():
        state = {f"model/{k}": _for_dcp(v, get_spec(v)) for k, v in engine.model.state_dict(keep_vars=True).items()}
        state.update(optimizer_tensors(engine))
        dcp.save(state, storage_writer=dcp.FileSystemWriter(partial))
    torch.save(_rng_state(), os.path.join(partial, f"rng-rank{rank}.pt"))
    dist.barrier()
    if rank == 0:
        meta = {
            "format": FORMAT_VERSION,
            "step": engine.step_count,
            "world_size": dist.get_world_size(),
            "plan": repr(engine.plan),
            "optimizer": type(engine.optimizer).__name__,
            "param_groups": _hyper_params(engine.optimizer),
            "scaler": engine.scaler.state_dict() if engine.scaler else None,
            "extra": extra,
        }
        _commit(partial, path, meta)
    dist.barrier()


# ------------------------------------------------------------------ load
def read_meta(path: str) -> dict:
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint {path!r} does not exist.")
    if not is_complete(path):
        raise ValueError(
            f"checkpoint {path!r} is incomplete (no {META}): its save was interrupted. "
            f"Load the newest complete one instead (behemoth.train.checkpoint.latest_checkpoint)."
        )
    with open(os.path.join(path, META)) as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT_VERSION:
        raise ValueError(
            f"checkpoint {path!r} has format {meta.get('format')!r}; this behemoth reads {FORMAT_VERSION}."
        )
    return meta


def load_checkpoint(engine, path: str) -> dict:
    """Load model, optimizer state, step, scaler and (same world size) RNG states into ``engine``.
    Returns the ``extra`` dict given at save time."""
    path = os.path.abspath(path.rstrip("/"))
    meta = read_meta(path)
    reader = SafeFileSystemReader(path)
    stored = reader.read_metadata().state_dict_metadata
    model_sd = engine.model.state_dict(keep_vars=True)
    missing = [f"model/{k}" for k in model_sd if f"model/{k}" not in stored]
    if missing:
        raise ValueError(
            f"checkpoint {path!r} lacks model tensors {missing[:5]}"
            f"{' ...' if len(missing) > 5 else ''}: it was saved from a different model."
        )
    for k, v in model_sd.items():
        shape = tuple(stored[f"model/{k}"].size)
        if shape != _full_shape(v):
            raise ValueError(f"checkpoint tensor model/{k} has shape {shape}, the model's is {_full_shape(v)}.")
    if meta["optimizer"] != type(engine.optimizer).__name__:
        raise ValueError(
            f"checkpoint {path!r} holds {meta['optimizer']} state; the engine's optimizer is "
            f"{type(engine.optimizer).__name__}. Build the same optimizer class to resume."
        )
    # Optimizer state: allocate what the checkpoint holds, for the parameters we hold.
    params = _held_params(engine)
    optim, reads = {}, {}
    for k, md in stored.items():
        if not k.startswith("optim/"):
            continue
        pname, key = k[len("optim/") :].rsplit("/", 1)
        if pname in params:
            spec = get_spec(params[pname])
            if is_sharded(spec) and tuple(md.size) == spec.full_shape:  # state shaped like the shard
                optim[k] = torch.empty(spec.local_shape(), dtype=md.properties.dtype, device=params[pname].device)
            else:
                optim[k] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
                spec = None
            reads[k] = _for_dcp(optim[k], spec)
    # the loaded parameters become the shards and masters (gradient sync) as the gather ends
    with engine.grad_sync.gathered(writable=True):
        # Read inside the gather: a gathered parameter may be another tensor (ZeRO-3 param_dtype's fp32 copies).
        want = {f"model/{k}": _for_dcp(v, get_spec(v)) for k, v in engine.model.state_dict(keep_vars=True).items()}
        dcp.load({**want, **reads}, storage_reader=reader)
    from_checkpoint_name = {c: n for n, c in _to_checkpoint_names(engine).items()}
    states: dict = {}
    for k, v in optim.items():
        pname, key = k[len("optim/") :].rsplit("/", 1)
        states.setdefault(from_checkpoint_name[pname], {})[key] = v
    engine.grad_sync.load_state_dict(states)
    for g, hyper in zip(engine.optimizer.param_groups, meta["param_groups"]):
        for k, v in hyper.items():
            if k in g:
                g[k] = tuple(v) if isinstance(g[k], tuple) else v
    engine.step_count = int(meta["step"])
    if engine.scaler is not None and meta.get("scaler"):
        engine.scaler.load_state_dict(meta["scaler"])
    rng_file = os.path.join(path, f"rng-rank{dist.get_rank()}.pt")
    if meta["world_size"] == dist.get_world_size() and os.path.exists(rng_file):
        _set_rng_state(torch.load(rng_file, weights_only=True))
    return meta["extra"]

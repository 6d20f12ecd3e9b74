"""A streaming writer of sharded ``.safetensors`` files and their index.

The safetensors format is an 8-byte little-endian header length, a JSON header (each tensor's
dtype, shape and byte range, plus ``__metadata__``), then the tensors' bytes back to back. All
shapes and dtypes are known before any tensor is read, so :class:`ShardedWriter` plans the shards
(``model-0000i-of-0000N.safetensors``, each at most ``max_shard_size`` bytes unless one tensor
alone is larger, as transformers' ``save_pretrained`` splits them), writes each header up front
and then takes the tensors one at a time, in plan order, writing each straight to its file: it
holds no tensor after :meth:`write` returns. ``model.safetensors.index.json`` maps every name
to its file, as transformers writes it.

Needs no safetensors package (reading the files back does: tests/unit/test_hf_writer.py).
"""

from __future__ import annotations

import json
import os
import re

import torch

__all__ = ["ShardedWriter", "parse_size", "plan_shards", "INDEX_NAME"]

INDEX_NAME = "model.safetensors.index.json"
_WEIGHT_FILE = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors")
_BLOCK_BYTES = 1 << 20  # rows of a non-contiguous or cast tensor made contiguous at a time

_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(size: int | str) -> int:
    """Bytes of ``size``: an int, or a string like ``"5GB"``, ``"500MB"``, ``"20KiB"`` (as transformers')."""
    if isinstance(size, int) and not isinstance(size, bool):
        if size <= 0:
            raise ValueError(f"max_shard_size={size}: must be > 0 bytes, e.g. '5GB'.")
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]I?B|B)?\s*", str(size).upper())
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"max_shard_size={size!r}: write a positive size such as '5GB', '500MB' or 20000000.")
    return int(float(m.group(1)) * _UNITS[m.group(2) or ""])


def plan_shards(entries: list[tuple[str, int]], max_bytes: int) -> list[list[str]]:
    """Consecutive groups of ``(name, nbytes)`` whose sizes add up to at most ``max_bytes`` (a
    tensor larger than that is a shard of its own)."""
    shards: list[list[str]] = []
    used = 0
    for name, nbytes in entries:
        if not shards or (used and nbytes and used + nbytes > max_bytes):
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += nbytes
    return shards


class ShardedWriter:
    """Writes the tensors ``specs`` (``{name: (shape, dtype)}``, in order) into directory ``out``.

    Call :meth:`write` once per tensor, in the order of :attr:`order`, then :meth:`close`. A
    tensor may be a non-contiguous view (a transpose) or of another float dtype: it is written a
    block of rows at a time. ``peak_bytes`` is the largest tensor it was handed (it keeps none
    after a write returns)."""

    def __init__(self, out: str, specs: dict[str, tuple[tuple[int, ...], torch.dtype]], max_shard_size) -> None:
        for name, (_, dtype) in specs.items():
            if dtype not in _DTYPES:
                raise ValueError(f"tensor {name!r} has dtype {dtype}, which safetensors cannot store.")
        self.out, self.specs = out, dict(specs)
        sizes = [(n, _nbytes(shape, dtype)) for n, (shape, dtype) in self.specs.items()]
        groups = plan_shards(sizes, parse_size(max_shard_size))
        total = len(groups)
        self.files = [f"model-{i + 1:05d}-of-{total:05d}.safetensors" for i in range(total)]
        self.weight_map = {n: self.files[i] for i, g in enumerate(groups) for n in g}
        self._order = [n for g in groups for n in g]
        self._next, self._file, self._file_index = 0, None, -1
        self.total_size = sum(s for _, s in sizes)
        self.total_params = sum(_numel(shape) for shape, _ in self.specs.values())
        self.peak_bytes = 0
        os.makedirs(out, exist_ok=True)
        for stale in os.listdir(out):  # an earlier export's shards would outlive a smaller plan, as in save_pretrained
            if _WEIGHT_FILE.fullmatch(stale) and stale not in self.files:
                os.remove(os.path.join(out, stale))

    @property
    def order(self) -> list[str]:
        """The names in the order :meth:`write` takes them (shard by shard)."""
        return list(self._order)

    def _open(self, index: int) -> None:
        if self._file is not None:
            self._file.close()
        self._file_index = index
        names = [n for n in self._order if self.weight_map[n] == self.files[index]]
        header, offset = {}, 0
        for n in names:
            shape, dtype = self.specs[n]
            size = _nbytes(shape, dtype)
            header[n] = {"dtype": _DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
            offset += size
        header["__metadata__"] = {"format": "pt"}
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
        self._file = open(os.path.join(self.out, self.files[index]), "wb")
        self._file.write(len(raw).to_bytes(8, "little"))
        self._file.write(raw)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Append ``name``'s data (its shape and dtype as declared; the next name in order)."""
        expected = self._order[self._next] if self._next < len(self._order) else None
        if name != expected:
            raise ValueError(f"ShardedWriter.write({name!r}): the next tensor in the shard plan is {expected!r}.")
        shape, dtype = self.specs[name]
        castable = tensor.dtype == dtype or (tensor.dtype.is_floating_point and dtype.is_floating_point)
        if tuple(tensor.shape) != tuple(shape) or not castable:
            raise ValueError(
                f"tensor {name!r} is {tuple(tensor.shape)} {tensor.dtype}; its declared layout is {tuple(shape)} {dtype}."
            )
        index = self.files.index(self.weight_map[name])
        if index != self._file_index:
            self._open(index)
        data = tensor.detach().to("cpu")
        self.peak_bytes = max(self.peak_bytes, _nbytes(shape, dtype))
        if data.numel():
            # A transposed view or a cast is made contiguous a block of rows at a time, so writing
            # never holds a second copy of a large tensor.
            rows = max(1, _BLOCK_BYTES // max(1, _nbytes(shape[1:], dtype))) if data.dim() > 1 else data.numel()
            for start in range(0, data.shape[0] if data.dim() else 1, rows):
                block = data[start : start + rows] if data.dim() else data
                block = block.to(dtype).contiguous()
                self._file.write(memoryview(block.view(torch.uint8).reshape(-1).numpy()))
        self._next += 1

    def close(self) -> None:
        """Finish the last file and write ``model.safetensors.index.json``."""
        if self._next != len(self._order):
            raise ValueError(f"ShardedWriter.close: {len(self._order) - self._next} tensor(s) were never written.")
        if self._file is not None:
            self._file.close()
            self._file = None
        index = {
            "metadata": {"total_size": self.total_size, "total_parameters": self.total_params},
            "weight_map": dict(sorted(self.weight_map.items())),
        }
        with open(os.path.join(self.out, INDEX_NAME), "w") as f:
            json.dump(index, f, indent=2)
            f.write("\n")


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _nbytes(shape, dtype: torch.dtype) -> int:
    return _numel(shape) * torch.empty((), dtype=dtype).element_size()

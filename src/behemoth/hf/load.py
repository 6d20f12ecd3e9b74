"""Import a transformers checkpoint into a model under any plan, each rank reading only its slices.

``load_hf(engine_or_model, DIR)`` reads ``DIR``'s ``.safetensors`` (one ``model.safetensors`` or
shards with ``model.safetensors.index.json``) into a model built with the matching shape, after
``bh.boost`` / ``bh.parallelize`` has sharded it: every tensor this rank holds -- a
tensor-parallel shard as its rectangles of the serial tensor (its ShardSpec, as checkpoints read
them), a pipeline stage's tensors only -- is read with ``safe_open(...).get_slice(name)[...]``,
an offset read of the memory-mapped file that touches only those bytes. Ranks that hold the same
tensors (the data axis: dp, dp x cp) split them, each reading about 1/dp of them and
broadcasting what it read, so every rank reads about model/world bytes. Under ZeRO the engine's
``gathered(writable=True)`` makes what is read the shards and fp32 masters (as ``engine.load``).

behemoth's own GPT and Llama read transformers' GPT-2 and Llama names and layouts
(:mod:`.names`: GPT-2's ``Conv1D`` weights transposed; a tied head read from the embedding);
transformers models read their own names. ``model_from_hf(DIR)`` builds the serial behemoth
model (or, with ``transformers=True``, transformers' model) whose shape the checkpoint has.

Needs ``safetensors`` (``pip install 'behemoth[hf]'``). Tested in tests/dist/test_hf_import.py.
"""

from __future__ import annotations

import contextlib
import json
import os

import torch
from torch import nn

from .names import layout_for
from .writer import INDEX_NAME

__all__ = ["HFCheckpoint", "load_hf", "model_from_hf", "require_safetensors"]

_INSTALL = "pip install 'behemoth[hf]'"


def require_safetensors():
    """The ``safetensors.safe_open`` function, or an ImportError naming the extra."""
    try:
        from safetensors import safe_open
    except ImportError as e:
        raise ImportError(
            f"reading transformers checkpoints needs the package 'safetensors' ({e}); install it with {_INSTALL}."
        ) from None
    return safe_open


class HFCheckpoint:
    """A transformers checkpoint directory: its config and tensors, read by slices.

    ``bytes_read`` counts the bytes of every slice read (the data this process took from the files)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._safe_open = require_safetensors()
        config_file = os.path.join(path, "config.json")
        if not os.path.isfile(config_file):
            raise FileNotFoundError(f"{path!r} has no config.json: it is not a transformers checkpoint directory.")
        with open(config_file) as f:
            self.config = json.load(f)
        index = os.path.join(path, INDEX_NAME)
        single = os.path.join(path, "model.safetensors")
        if os.path.isfile(index):
            with open(index) as f:
                self.weight_map = dict(json.load(f)["weight_map"])
        elif os.path.isfile(single):
            with self._safe_open(single, framework="pt") as f:
                self.weight_map = dict.fromkeys(f.keys(), "model.safetensors")
        else:
            raise FileNotFoundError(
                f"{path!r} has no model.safetensors nor {INDEX_NAME}; re-save the model with transformers' "
                f"save_pretrained (safetensors is its default format)."
            )
        self._files: dict[str, object] = {}
        self.bytes_read = 0

    def _file(self, name: str):
        fname = self.weight_map[name]
        if fname not in self._files:
            self._files[fname] = self._safe_open(os.path.join(self.path, fname), framework="pt")
        return self._files[fname]

    def shape(self, name: str) -> tuple[int, ...] | None:
        """The stored shape of ``name``, or None when the checkpoint lacks it."""
        if name not in self.weight_map:
            return None
        return tuple(self._file(name).get_slice(name).get_shape())

    def read(self, name: str, offsets, sizes, transpose: bool = False) -> torch.Tensor:
        """The rectangle ``offsets``/``sizes`` of the serial tensor whose stored form is ``name``
        (``transpose``: stored transposed, so the rectangle is read transposed and turned back)."""
        index = tuple(slice(o, o + s) for o, s in zip(offsets, sizes))
        part = self._file(name).get_slice(name)
        t = part[index[::-1]].t() if transpose else part[index]
        self.bytes_read += t.numel() * t.element_size()
        return t


def _rectangles(t: torch.Tensor):
    """``(view, offsets, sizes)``: where this rank's tensor ``t`` sits in the serial tensor (its
    ShardSpec is an attribute of ``t`` itself, not of ``t.data``)."""
    from behemoth.parallel.tensor import is_sharded, shard_rectangles
    from behemoth.parallel.tensor.layout import get_spec

    spec, t = get_spec(t), t.detach()
    if not is_sharded(spec):
        return [(t, (0,) * t.dim(), tuple(t.shape))]
    view = t.reshape(spec.local_view_shape())
    if view.data_ptr() != t.data_ptr():
        raise AssertionError("a tensor-parallel shard must be contiguous to be loaded in place")
    return [(view[index], off, size) for index, off, size in shard_rectangles(spec)]


def _full_shape(t: torch.Tensor) -> tuple[int, ...]:
    from behemoth.parallel.tensor import is_sharded
    from behemoth.parallel.tensor.layout import get_spec

    spec = get_spec(t)
    return tuple(spec.full_shape) if is_sharded(spec) else tuple(t.shape)


def _owners(tensors: dict[str, torch.Tensor], size: int) -> dict[str, int]:
    """Which member of a data axis of ``size`` reads each tensor: the largest first, each to
    the member with the fewest bytes so far (every member computes the same answer)."""
    load = [0] * size
    owners = {}
    for name in sorted(tensors, key=lambda n: (-tensors[n].numel() * tensors[n].element_size(), n)):
        member = load.index(min(load))
        owners[name] = member
        load[member] += tensors[name].numel() * tensors[name].element_size()
    return owners


def load_hf(target, path: str) -> dict:
    """Read the transformers checkpoint in directory ``path`` into ``target``: an Engine
    (``bh.boost``), a model parallelized by ``bh.parallelize``, or a serial model. A collective
    when ``target`` is parallelized: every rank calls it. Returns ``{"bytes_read", "tensors"}``
    of this rank.

    Every rank checks every name and shape before anything is read (a ValueError names the
    first mismatches: another model, another vocabulary)."""
    from behemoth import comm

    engine = target if hasattr(target, "grad_sync") and hasattr(target, "model") else None
    model: nn.Module = engine.model if engine is not None else target
    layout = layout_for(model)
    ckpt = HFCheckpoint(path)
    record = model.__dict__.get("_behemoth_parallelization")
    state = model.state_dict(keep_vars=True)
    problems = []
    for name, t in state.items():
        source = layout.source(name)
        want = _full_shape(t)
        want = tuple(reversed(want)) if source.transpose else want
        got = ckpt.shape(source.name)
        if got != want:
            problems.append(f"{source.name}: {'missing' if got is None else got} (the model needs {want})")
    if problems:
        raise ValueError(
            f"transformers checkpoint {path!r} does not fit this {type(model).__name__}: "
            f"{'; '.join(problems[:3])}{' ...' if len(problems) > 3 else ''}. Build the model with the checkpoint's "
            f"shape (behemoth.hf.model_from_hf(path) builds it)."
        )
    axis = record.data_axis if record is not None else None
    gathered = engine.grad_sync.gathered(writable=True) if engine is not None else contextlib.nullcontext()
    with gathered, torch.no_grad():
        state = model.state_dict(keep_vars=True)  # under ZeRO-3: the gathered parameters
        unique: dict[str, torch.Tensor] = {}
        seen = set()
        for name, t in state.items():
            if id(t) not in seen:
                seen.add(id(t))
                unique[name] = t
        owners = _owners(unique, axis.size) if axis is not None and axis.size > 1 else {}
        for name, t in unique.items():
            source = layout.source(name)
            if owners.get(name, 0) == (axis.rank if owners else 0):
                for view, off, size in _rectangles(t):
                    view.copy_(ckpt.read(source.name, off, size, source.transpose))
            if owners:
                data = t.data if t.data.is_contiguous() else t.data.contiguous()
                comm.broadcast(data, axis, src_index=owners[name])
                if data is not t.data:
                    t.data.copy_(data)
    return {"bytes_read": ckpt.bytes_read, "tensors": len(unique)}


def model_from_hf(path: str, *, transformers: bool = False, seed: int = 0) -> nn.Module:
    """The serial model whose shape the checkpoint in ``path`` has, with its init weights (read the
    checkpoint's with :func:`load_hf`, before or after ``bh.boost``): behemoth's ``GPT`` for a
    GPT-2 checkpoint and its ``Llama`` for a Llama one, or with ``transformers=True``
    transformers' own class (``AutoModelForCausalLM.from_config``)."""
    from .configs import behemoth_config

    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        raise FileNotFoundError(f"{path!r} has no config.json: it is not a transformers checkpoint directory.")
    with open(config_file) as f:
        config = json.load(f)
    if transformers:
        try:
            from transformers import AutoConfig, AutoModelForCausalLM
        except ImportError as e:
            raise ImportError(
                f"transformers=True needs the package 'transformers' ({e}); install {_INSTALL}."
            ) from None
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    from behemoth.models import GPT, GPTConfig, Llama

    cfg = behemoth_config(config, seed=seed)
    return GPT(cfg) if isinstance(cfg, GPTConfig) else Llama(cfg)

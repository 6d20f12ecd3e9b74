"""Import a transformers checkpoint into a model under any plan, each rank reading only its slices.

``load_hf(engine_or_model, DIR)`` reads ``DIR``'s ``.safetensors`` (one ``model.safetensors`` or
shards with ``model.safetensors.index.json``) into a model built with the matching shape, after
``bh.boost`` / ``bh.parallelize`` has sharded it: every tensor this rank holds -- a
tensor-parallel shard as its rectangles of the serial tensor (its ShardSpec, as checkpoints read
them), a pipeline stage's tensors only -- is read with ``safe_open(...).get_slice(name)[...]``,
an offset read of the memory-mapped file that touches only those bytes. Ranks that hold the same
tensors (the data axis: dp, dp x cp; under 1D tensor parallelism tp too for what tp does not
split) split them, each reading its share and broadcasting what it read, so every rank reads
about model/world bytes. Under ZeRO the engine's ``gathered(writable=True)`` makes what is read
the shards and fp32 masters (as ``engine.load``).

Mixture-of-experts blocks (Mixtral, Qwen3-MoE, OLMoE; behemoth's Llama with experts as Mixtral)
hold their experts fused, ``[E, ...]``, and the checkpoint one tensor per expert (or fused, under
transformers 5's module names): :mod:`.experts` reads a block of experts from those. Under
expert parallelism each ep rank reads only its own experts, split with the ranks that hold the
same ones (``ep_dp``, and ``tp``) piece by piece of whole experts.

behemoth's own GPT and Llama read transformers' GPT-2 and Llama names and layouts
(:mod:`.names`: GPT-2's ``Conv1D`` weights transposed; a tied head read from the embedding);
transformers models read their own names. ``model_from_hf(DIR)`` builds the serial behemoth
model (or, with ``transformers=True``, transformers' model) whose shape the checkpoint has.

Needs ``safetensors`` (``pip install 'behemoth[hf]'``). Tested in tests/dist/test_hf_import.py
and, for experts, tests/dist/test_hf_import_moe.py.
"""

from __future__ import annotations

import contextlib
import json
import math
import os

import torch
from torch import nn

from ..checkpoint_shards import serial_shape
from .experts import ExpertSource
from .names import HFTensor, layout_for
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


def _replicas(t: torch.Tensor, record) -> tuple:
    """The axes over which ``t``'s copies are equal, outermost first: the data axis for a dense
    tensor, the replica axis (``ep_dp``) of a sharded expert tensor; and under 1D tensor
    parallelism ``tp`` too for a tensor tp does not split (norms, routers, the experts: whole on
    every tp rank, behemoth.parallel.expert.style). A grid mode's tensors keep the data axis alone
    (its norms are split over some grid axes)."""
    from behemoth.parallel.expert import expert_shard
    from behemoth.parallel.tensor import is_sharded
    from behemoth.parallel.tensor.layout import get_spec

    if record is None:
        return ()
    shard, mesh = expert_shard(t), record.mesh
    axes = (record.data_axis,) if shard is None else (mesh.axis(shard.data_axis),)
    if record.plan.tp_mode == "1d" and (shard is not None or not is_sharded(get_spec(t))):
        axes += (mesh.axis("tp"),)
    return tuple(a for a in axes if not a.trivial)


def _problems(layout, ckpt: HFCheckpoint, state: dict[str, torch.Tensor]) -> tuple[dict, list[str]]:
    """``({name: its source}, problems)``: each tensor's :class:`~.names.HFTensor` (or, for a fused
    expert tensor, :class:`~.experts.ExpertSource`), and a line per missing or misshapen one."""
    sources, problems = {}, []
    for name, t in state.items():
        want = tuple(serial_shape(t))
        if layout.is_experts(name):
            source = ExpertSource.find(layout, name, want, ckpt.weight_map)
            problems += source.problems(ckpt.shape)
        else:
            source = layout.source(name)
            fused = layout.fused_source(name)
            if source.name not in ckpt.weight_map and fused in ckpt.weight_map:
                source = HFTensor(fused)
            want = tuple(reversed(want)) if source.transpose else want
            got = ckpt.shape(source.name)
            if got != want:
                problems.append(f"{source.name}: {'missing' if got is None else got} (the model needs {want})")
        sources[name] = source
    return sources, problems


def _plan_reads(unique: dict[str, torch.Tensor], record) -> dict[tuple, tuple[int, ...]]:
    """``{(name, lo, hi): the coordinates of its reader on the tensor's replica axes}``: the
    tensors replicated over the same axes are split among those axes' members, the largest first
    (:func:`_owners`); an expert tensor in pieces of whole experts (rows ``lo:hi`` of its dim 0),
    one per member where it holds enough experts, so the experts' bytes split evenly; any other
    tensor whole (``lo = hi = None``). Every rank computes the same answer."""
    groups: dict[tuple, dict[tuple, torch.Tensor]] = {}
    for name, t in unique.items():
        axes = _replicas(t, record)
        members = math.prod(a.size for a in axes)
        group = groups.setdefault(tuple(a.name for a in axes), {})
        if members > 1 and _is_expert(t):
            n = min(members, t.shape[0])
            for i in range(n):
                lo, hi = t.shape[0] * i // n, t.shape[0] * (i + 1) // n
                group[(name, lo, hi)] = t[lo:hi]
        else:
            group[(name, None, None)] = t
    owners = {}
    for pieces in groups.values():
        sizes = [a.size for a in _replicas(unique[next(iter(pieces))[0]], record)]
        for key, member in _owners(pieces, math.prod(sizes)).items():
            owners[key] = _unravel(member, sizes)
    position = {name: i for i, name in enumerate(unique)}  # the same order on every rank
    return dict(sorted(owners.items(), key=lambda kv: (position[kv[0][0]], kv[0][1] or 0)))


def _is_expert(t: torch.Tensor) -> bool:
    from behemoth.parallel.expert import expert_shard

    return expert_shard(t) is not None


def _read(ckpt: HFCheckpoint, source, t: torch.Tensor, lo: int | None = None, hi: int | None = None) -> None:
    """Read this rank's rectangles of ``t`` (of its rows ``lo:hi`` on dim 0, with ``lo``) from the
    checkpoint."""
    for view, off, size in _rectangles(t):
        if lo is not None:  # an expert tensor: one rectangle, whole on dim 0 (the experts)
            assert size[0] == t.shape[0], (size, t.shape)
            view, off, size = view[lo:hi], (off[0] + lo, *off[1:]), (hi - lo, *size[1:])
        if isinstance(source, ExpertSource):
            source.read_into(view, off, size, ckpt.read)
        else:
            view.copy_(ckpt.read(source.name, off, size, source.transpose))


def load_hf(target, path: str) -> dict:
    """Read the transformers checkpoint in directory ``path`` into ``target``: an Engine
    (``bh.boost``), a model parallelized by ``bh.parallelize``, or a serial model. A collective
    when ``target`` is parallelized: every rank calls it. Returns ``{"bytes_read", "tensors"}``
    of this rank.

    Every rank checks every name and shape before anything is read (a ValueError names the
    first mismatches: another model, another vocabulary, a missing expert), and the ranks agree
    on it before any other collective. Mixture-of-experts blocks read their fused experts from
    the checkpoint's per-expert tensors (:mod:`.experts`), each expert-parallel rank only its own
    experts; the ranks holding the same experts (``ep_dp``, and ``tp`` under 1D tensor
    parallelism) split them as the data axis splits the dense tensors."""
    from behemoth import comm

    engine = target if hasattr(target, "grad_sync") and hasattr(target, "model") else None
    model: nn.Module = engine.model if engine is not None else target
    layout = layout_for(model)
    ckpt = HFCheckpoint(path)
    record = model.__dict__.get("_behemoth_parallelization")
    sources, problems = _problems(layout, ckpt, model.state_dict(keep_vars=True))
    if record is not None and not comm.all_agree(not problems, record.mesh.axis("world")) and not problems:
        raise ValueError(
            f"transformers checkpoint {path!r} does not fit this {type(model).__name__}: another rank (another "
            f"pipeline stage's tensors) found missing or misshapen tensors; its error names them."
        )
    if problems:
        raise ValueError(
            f"transformers checkpoint {path!r} does not fit this {type(model).__name__}: "
            f"{'; '.join(problems[:3])}{' ...' if len(problems) > 3 else ''}. Each tensor must be there with the "
            f"shape the model has: build the model with the checkpoint's shape (behemoth.hf.model_from_hf(path) "
            f"builds it), or, for a tensor missing from a checkpoint whose config promises it, copy the checkpoint "
            f"again or re-save it with transformers' save_pretrained."
        )
    gathered = engine.grad_sync.gathered(writable=True) if engine is not None else contextlib.nullcontext()
    with gathered, torch.no_grad():
        state = model.state_dict(keep_vars=True)  # under ZeRO-3: the gathered parameters
        unique: dict[str, torch.Tensor] = {}
        seen = set()
        for name, t in state.items():
            if id(t) not in seen:
                seen.add(id(t))
                unique[name] = t
        owners = _plan_reads(unique, record)
        for (name, lo, hi), owner in owners.items():
            t, axes = unique[name], _replicas(unique[name], record)
            if all(a.rank == i for a, i in zip(axes, owner)):
                _read(ckpt, sources[name], t, lo, hi)
            if axes:
                part = t.data if lo is None else t.data[lo:hi]
                data = part if part.is_contiguous() else part.contiguous()
                for a, i in reversed(list(zip(axes, owner))):  # innermost first: then every copy has it
                    comm.broadcast(data, a, src_index=i)
                if data is not part:
                    part.copy_(data)
    return {"bytes_read": ckpt.bytes_read, "tensors": len(unique)}


def _unravel(index: int, sizes: list[int]) -> tuple[int, ...]:
    coords = []
    for n in reversed(sizes):
        coords.append(index % n)
        index //= n
    return tuple(reversed(coords))


def model_from_hf(path: str, *, transformers: bool = False, seed: int = 0) -> nn.Module:
    """The serial model whose shape the checkpoint in ``path`` has, with its init weights (read the
    checkpoint's with :func:`load_hf`, before or after ``bh.boost``): behemoth's ``GPT`` for a
    GPT-2 checkpoint, its ``Llama`` for a Llama one and its ``Llama`` with experts for a Mixtral
    one, or with ``transformers=True`` transformers' own class (``AutoModelForCausalLM.from_config``;
    the only choice for Qwen3-MoE and OLMoE)."""
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

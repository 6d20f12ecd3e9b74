"""Export to a transformers checkpoint directory, streaming from a behemoth checkpoint.

``export_checkpoint(CHECKPOINT, OUT)`` (``behemoth export``) turns a checkpoint of any plan into
what ``AutoModelForCausalLM.from_pretrained(OUT)`` loads: ``config.json``,
``generation_config.json``, ``model-0000i-of-0000N.safetensors`` with
``model.safetensors.index.json``, and the run's tokenizer files when its tokenizer has a
transformers form (:mod:`.tokenizer_files`). Tensor names, shapes and dtypes are those transformers'
``save_pretrained`` writes for the same weights (:mod:`.names`; a mixture-of-experts block's
fused experts one tensor per expert); a vocabulary padded past the tokenizer's is trimmed.

Streaming: the checkpoint's tensor index gives every shape up front, so the shards are planned
before anything is read; then each tensor is read alone (a DCP load of that one key, which
reads only its byte ranges), transformed (transposed, trimmed, cut into its experts, cast) and
written to its shard file at once (:class:`.writer.ShardedWriter`). Host memory holds one tensor
and its transform, never a shard or the model (tests/e2e/test_hf_export_cli.py measures the process's peak).

``save_engine_hf(engine, OUT)`` (``engine.save_hf``) is the same from a live engine under any
plan: every rank writes its shards as a model-only checkpoint in ``OUT/.behemoth-model`` (as
``engine.save`` does: tensor-parallel rectangles, pipeline stages, ZeRO-3 gathered), then rank
0 streams the export from it and deletes it.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from collections.abc import Callable

import torch

from .configs import DTYPE_NAMES, generation_config, hf_config
from .names import Layout, layout_for, layout_for_config
from .tokenizer_files import write_tokenizer
from .writer import ShardedWriter, parse_size

__all__ = ["export_checkpoint", "save_engine_hf", "write_hf", "CheckpointTensors"]

_STAGING = ".behemoth-model"
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_dtype(dtype) -> torch.dtype | None:
    """``None`` (keep the checkpoint's), a torch float dtype, or "fp32" / "bf16" / "fp16"."""
    if dtype is None or dtype in DTYPE_NAMES:
        return dtype
    if isinstance(dtype, str) and dtype.lower() in _DTYPES:
        return _DTYPES[dtype.lower()]
    raise ValueError(f"dtype={dtype!r}: export writes fp32, bf16 or fp16 (or None: the checkpoint's own dtype).")


class CheckpointTensors:
    """The model tensors of a behemoth checkpoint, by serial name, read one at a time."""

    def __init__(self, path: str) -> None:
        from behemoth.checkpoint import SafeFileSystemReader, read_meta

        self.path = os.path.abspath(path)
        self.meta = read_meta(self.path)  # refuses an incomplete or damaged checkpoint
        stored = SafeFileSystemReader(self.path).read_metadata().state_dict_metadata
        self.layout: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
            k[len("model/") :]: (tuple(md.size), md.properties.dtype)
            for k, md in stored.items()
            if k.startswith("model/") and hasattr(md, "size")
        }

    def read(self, name: str) -> torch.Tensor:
        """The whole serial tensor ``name`` (only its bytes are read from the checkpoint files)."""
        import torch.distributed.checkpoint as dcp

        from behemoth.checkpoint import SafeFileSystemReader

        shape, dtype = self.layout[name]
        t = torch.empty(shape, dtype=dtype)
        with warnings.catch_warnings():  # DCP warns that no_dist reads in this process alone: as meant
            warnings.simplefilter("ignore", UserWarning)
            dcp.load({f"model/{name}": t}, storage_reader=SafeFileSystemReader(self.path), no_dist=True)
        return t


def write_hf(
    out: str,
    *,
    layout: Layout,
    model_config,
    stored: dict[str, tuple[tuple[int, ...], torch.dtype]],
    read: Callable[[str], torch.Tensor],
    vocab_size: int | None = None,
    dtype: torch.dtype | None = None,
    max_shard_size: int | str = "5GB",
    bos: int | None = None,
    eos: int | None = None,
) -> ShardedWriter:
    """Write the transformers checkpoint of the tensors ``stored`` (``{behemoth name: (shape,
    dtype)}``, each read by ``read(name)``) into ``out``; returns the closed writer (its
    ``weight_map``, ``peak_bytes``)."""
    names = layout.exported(stored)
    if layout.embedding not in stored:
        raise ValueError(f"the checkpoint has no {layout.embedding!r}: it does not hold a {layout.architecture}.")
    full_vocab = stored[layout.embedding][0][0]
    vocab = full_vocab if vocab_size is None else vocab_size
    if not 0 < vocab <= full_vocab:
        raise ValueError(f"vocab_size={vocab_size}: must be in [1, {full_vocab}] (the model's vocabulary).")
    # {transformers name: (behemoth name, target, shape, dtype)}, a fused expert tensor's pieces together
    plan: dict[str, tuple] = {}
    for name in names:
        shape, src_dtype = stored[name]
        out_dtype = dtype if dtype is not None and src_dtype.is_floating_point else src_dtype
        for target in layout.targets(name, shape):
            out_shape = list(target.shape(shape))
            if target.vocab_dim is not None:
                out_shape[target.vocab_dim] = vocab
            plan[target.name] = (name, target, tuple(out_shape), out_dtype)
    first_dtype = next(iter(plan.values()))[3]
    writer = ShardedWriter(out, {n: (s, d) for n, (_, _, s, d) in plan.items()}, max_shard_size)
    source_name, source = None, None
    for hf_name in writer.order:
        name, target, _, _ = plan[hf_name]
        if name != source_name:  # a fused tensor's pieces follow each other: it is read once
            source = None  # the previous tensor freed before the next is read
            source, source_name = read(name), name
        t = target.take(source)
        if target.vocab_dim is not None:
            t = t.narrow(target.vocab_dim, 0, vocab)
        writer.write(hf_name, t)  # cast and made contiguous by blocks of rows
        del t
    del source
    writer.close()
    config = hf_config(model_config, layout, vocab_size=vocab, dtype=dtype or first_dtype, bos=bos, eos=eos)
    _write_json(os.path.join(out, "config.json"), config)
    _write_json(os.path.join(out, "generation_config.json"), generation_config(bos, eos))
    return writer


def _write_json(path: str, data: dict) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")


# ------------------------------------------------------------------ from a checkpoint
def _run_config(meta: dict, path: str):
    from behemoth.train.config import Config

    saved = (meta.get("extra") or {}).get("config")
    if not isinstance(saved, dict):
        raise ValueError(
            f"checkpoint {path!r} holds no run config (it was not written by `behemoth train`), so its model is "
            f"unknown; export it from the engine that trained it with engine.save_hf(OUT)."
        )
    return Config.from_dict(saved).resolved()


def export_checkpoint(
    checkpoint: str,
    out: str,
    *,
    max_shard_size: int | str = "5GB",
    dtype=None,
    vocab_size: int | None = None,
) -> dict:
    """Export the behemoth checkpoint ``checkpoint`` (written by ``behemoth train`` under any
    plan; or a run directory: its newest checkpoint) as a transformers checkpoint in ``out``.

    ``vocab_size`` (default: the run tokenizer's) trims a padded vocabulary; ``dtype`` casts
    ("bf16", ...; default: as stored). Returns ``{"checkpoint", "out", "files", "tokenizer",
    "vocab_size", "peak_bytes"}``."""
    from behemoth.checkpoint import latest_checkpoint
    from behemoth.models import build_config
    from behemoth.train.config_sections import TOKENIZER_VOCAB

    if not os.path.isfile(os.path.join(checkpoint, "meta.json")):
        newest = latest_checkpoint(os.path.join(checkpoint, "checkpoints"))
        if newest is None:
            raise FileNotFoundError(
                f"{checkpoint!r} is neither a complete checkpoint (no meta.json) nor a run directory with one under "
                f"checkpoints/; pass a directory such as runs/demo/checkpoints/step-200."
            )
        checkpoint = newest
    dtype = resolve_dtype(dtype)
    parse_size(max_shard_size)
    source = CheckpointTensors(checkpoint)
    config = _run_config(source.meta, checkpoint)
    mc = config.model
    model_config = build_config(mc.name, vocab_size=mc.vocab_size, seq_len=mc.seq_len, **mc.shape_overrides())
    layout = layout_for_config(model_config)
    tokenizer = config.data.tokenizer
    vocab = vocab_size if vocab_size is not None else min(TOKENIZER_VOCAB[tokenizer], mc.vocab_size)
    eot = TOKENIZER_VOCAB[tokenizer] - 1  # both tokenizers' end-of-text id is their last
    eot = eot if eot < vocab else None
    writer = write_hf(
        out,
        layout=layout,
        model_config=model_config,
        stored=source.layout,
        read=source.read,
        vocab_size=vocab,
        dtype=dtype,
        max_shard_size=max_shard_size,
        bos=eot,
        eos=eot,
    )
    files = write_tokenizer(out, tokenizer, mc.seq_len)
    return {
        "checkpoint": checkpoint,
        "out": out,
        "files": writer.files,
        "tokenizer": files,
        "vocab_size": vocab,
        "peak_bytes": writer.peak_bytes,
    }


# ------------------------------------------------------------------ from a live engine
def save_engine_hf(
    engine,
    out: str,
    *,
    max_shard_size: int | str = "5GB",
    dtype=None,
    vocab_size: int | None = None,
    tokenizer: str | None = None,
    bos_token_id: int | None = None,
    eos_token_id: int | None = None,
) -> None:
    """``engine.save_hf``: see the module docstring. A collective: every rank calls it; rank 0 writes."""
    import torch.distributed as dist

    from behemoth import comm
    from behemoth.checkpoint import save_checkpoint
    from behemoth.engine_state import ModelState

    model = engine.model
    layout = layout_for(model)  # every rank refuses a model with no transformers layout, before any collective
    dtype = resolve_dtype(dtype)
    parse_size(max_shard_size)
    if tokenizer not in (None, "byte", "gpt2"):
        raise ValueError(f"tokenizer={tokenizer!r}: must be 'gpt2', 'byte' or None (no tokenizer files).")
    if tokenizer is not None and eos_token_id is None:
        from behemoth.train.config_sections import TOKENIZER_VOCAB

        eos_token_id = TOKENIZER_VOCAB[tokenizer] - 1  # both tokenizers' end-of-text id is their last
    if bos_token_id is None:
        bos_token_id = eos_token_id
    staging = os.path.join(os.path.abspath(out), _STAGING)
    engine.wait_for_save()  # a background engine.save in flight commits first
    with engine.grad_sync.gathered():
        save_checkpoint(staging, {"model": ModelState(model)}, extra={})
    world = engine.mesh.axis("world")
    error = None
    if dist.get_rank() == 0:
        try:
            source = CheckpointTensors(staging)
            write_hf(
                out,
                layout=layout,
                model_config=model.config,
                stored=source.layout,
                read=source.read,
                vocab_size=vocab_size,
                dtype=dtype,
                max_shard_size=max_shard_size,
                bos=bos_token_id,
                eos=eos_token_id,
            )
            write_tokenizer(out, tokenizer, _max_positions(model.config))
        except Exception as e:  # re-raised below, once the other ranks know
            error = e
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    ok = comm.all_agree(error is None, world)
    if error is not None:
        raise error
    if not ok:
        raise RuntimeError("rank 0 failed to write the transformers checkpoint; its error is raised there.")


def _max_positions(config) -> int:
    for key in ("seq_len", "n_positions", "max_position_embeddings"):
        if getattr(config, key, None):
            return int(getattr(config, key))
    return 1024

"""Reading the serial modules a tensor-parallel style replaces, the same way in every mode.

* :func:`linear_layout` / :func:`linear_shape`: ``(in_features, out_features, transposed)`` of an
  ``nn.Linear`` or a transformers ``Conv1D`` (GPT-2's, whose weight is ``[in, out]``);
* :func:`is_rms_norm`: an RMS-style norm (a weight, no bias, an eps attribute);
* :func:`attention_heads` / :func:`localize_heads`: an attention module's head counts
  (behemoth's, GPT-2's, transformers Llama's attribute names), and setting them to a rank's;
* :func:`norm_eps`: a serial norm's epsilon;
* :func:`copy_shards`, and :func:`linear_from_serial`, :func:`layer_norm_from_serial`,
  :func:`rms_norm_from_serial`, :func:`embedding_from_serial` (a layer class's ``from_serial``,
  every mode that shards them alike): fill a sharded layer from a serial one.

No communication. Tested through every mode's tests (tests/dist/test_tp*.py).
"""

from __future__ import annotations

import torch
from torch import nn

from .layout import get_spec, shard_tensor


def linear_layout(module: nn.Module) -> tuple[int, int, bool] | None:
    """``(in_features, out_features, transposed)`` of an ``nn.Linear`` (``transposed=False``:
    weight ``[out, in]``) or a transformers ``Conv1D`` (``transposed=True``: weight ``[in, out]``,
    ``nf`` output features); None for anything else. The one place a Conv1D is recognised."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features, False
    w = getattr(module, "weight", None)
    if hasattr(module, "nf") and isinstance(w, torch.Tensor) and w.dim() == 2 and w.shape[1] == module.nf:
        return w.shape[0], module.nf, True
    return None


def linear_shape(module: nn.Module, name: str, role: str) -> tuple[int, int, bool]:
    """:func:`linear_layout`, or a ``ValueError`` naming ``name`` and the plan ``role``."""
    shape = linear_layout(module)
    if shape is not None:
        return shape
    raise ValueError(
        f"tensor-parallel role {role!r} needs an nn.Linear or a transformers Conv1D; "
        f"{name} is a {type(module).__name__}."
    )


def is_rms_norm(module: nn.Module) -> bool:
    """An RMS-style norm: ``nn.RMSNorm``, behemoth's ``RMSNorm``, transformers' ``LlamaRMSNorm``."""
    return (
        not isinstance(module, nn.LayerNorm)
        and isinstance(getattr(module, "weight", None), nn.Parameter)
        and getattr(module, "bias", None) is None
        and (hasattr(module, "eps") or hasattr(module, "variance_epsilon"))
    )


_HEADS = ("num_heads", "num_attention_heads", "n_head", "n_heads")
_KV_HEADS = ("num_kv_heads", "num_key_value_heads", "n_kv_heads")
_WIDTHS = ("split_size", "embed_dim", "all_head_size", "inner_dim")


def _first_int(obj, names) -> int | None:
    for n in names:
        v = getattr(obj, n, None)
        if isinstance(v, int) and not isinstance(v, bool):
            return v
    return None


def attention_heads(module: nn.Module, name: str) -> tuple[int, int, int | None]:
    """(query heads N, kv heads K, head dim D or None) of an attention module: behemoth's
    ``num_heads``/``num_kv_heads``, GPT-2's ``num_heads``, HF Llama's config and
    ``num_key_value_groups``."""
    cfg = getattr(module, "config", None)
    n = _first_int(module, _HEADS) or (_first_int(cfg, ("num_attention_heads", "n_head")) if cfg else None)
    if n is None:
        raise ValueError(
            f"tensor parallelism: attention module {name} ({type(module).__name__}) has none of the "
            f"head-count attributes {', '.join(_HEADS)}; it cannot be given local heads."
        )
    k = _first_int(module, _KV_HEADS)
    groups = getattr(module, "num_key_value_groups", None)
    if k is None and isinstance(groups, int) and groups > 0:
        k = n // groups
    return n, k or n, _first_int(module, ("head_dim",))


def localize_heads(module: nn.Module, n: int, k: int, d: int | None, p: int) -> None:
    """Set the head-count attributes a module reshapes with to this rank's counts, for heads
    split into ``p`` parts (1D: tp; 2D: q). Fewer kv heads than ``p`` become one local kv
    head (replicated: the caller gives each rank the right one)."""
    n_loc, k_loc = n // p, (k // p if k >= p else 1)
    for attr in _HEADS:
        if _first_int(module, (attr,)) is not None:
            setattr(module, attr, n_loc)
    for attr in _KV_HEADS:
        if _first_int(module, (attr,)) is not None:
            setattr(module, attr, k_loc)
    if _first_int(module, ("num_key_value_groups",)) is not None:
        module.num_key_value_groups = n_loc // k_loc
    for attr in _WIDTHS:
        if d is not None and _first_int(module, (attr,)) == n * d:
            setattr(module, attr, n_loc * d)


def norm_eps(module: nn.Module) -> float | None:
    """A serial norm's epsilon (``eps``, or transformers' ``variance_epsilon``); None: the dtype's."""
    return getattr(module, "eps", getattr(module, "variance_epsilon", None))


@torch.no_grad()
def copy_shards(layer: nn.Module, serial: nn.Module) -> None:
    """Fill every parameter of ``layer`` with its ShardSpec's block of ``serial``'s."""
    for name, p in layer.named_parameters(recurse=False):
        p.copy_(shard_tensor(getattr(serial, name).detach(), get_spec(p)))


def embedding_from_serial(cls, module: nn.Embedding, mesh):
    """``cls(...)`` (a 2D, 2.5D or 3D vocab-parallel embedding) holding this rank's shard of ``module``."""
    if module.max_norm is not None or module.scale_grad_by_freq or module.sparse:
        raise ValueError(f"{cls.__name__}: max_norm, scale_grad_by_freq and sparse are not supported.")
    w = module.weight
    layer = cls(
        module.num_embeddings,
        module.embedding_dim,
        mesh,
        padding_idx=module.padding_idx,
        device=w.device,
        dtype=w.dtype,
    )
    copy_shards(layer, module)
    return layer


def linear_from_serial(cls, module: nn.Module, mesh, **kw):
    """``cls(...)`` (a 2D, 2.5D or 3D Linear; ``kw``: its layout arguments, ``fused``, ...)
    holding this rank's shard of an ``nn.Linear`` or a transformers ``Conv1D`` (weight ``[in, out]``)."""
    shape = linear_layout(module)
    if shape is None:
        raise TypeError(f"{cls.__name__}.from_serial: expected nn.Linear or Conv1D, got {type(module).__name__}")
    in_f, out_f, transposed = shape
    w = module.weight
    layer = cls(
        in_f,
        out_f,
        mesh,
        bias=module.bias is not None,
        weight_layout="in_out" if transposed else "out_in",
        device=w.device,
        dtype=w.dtype,
        **kw,
    )
    copy_shards(layer, module)
    return layer


def layer_norm_from_serial(cls, module: nn.LayerNorm, mesh, **kw):
    """``cls(...)`` (a 2D, 2.5D or 3D LayerNorm; ``kw``: its layout arguments) holding this
    rank's shard of ``module``, over a 1-D ``normalized_shape``."""
    if len(module.normalized_shape) != 1:
        raise ValueError(f"{cls.__name__}: only a 1-D normalized_shape is supported; got {module.normalized_shape}.")
    p = next(module.parameters(), None)
    dev = dict(device=p.device, dtype=p.dtype) if p is not None else {}
    layer = cls(
        module.normalized_shape[0],
        mesh,
        eps=module.eps,
        weight=module.weight is not None,
        bias=module.bias is not None,
        **dev,
        **kw,
    )
    copy_shards(layer, module)
    return layer


def rms_norm_from_serial(cls, module: nn.Module, mesh, **kw):
    """``cls(...)`` (a 2D, 2.5D or 3D RMSNorm; ``kw``: its layout arguments) holding this rank's
    shard of ``nn.RMSNorm``, behemoth's Llama ``RMSNorm`` or transformers' ``LlamaRMSNorm``."""
    w = module.weight
    layer = cls(w.shape[0], mesh, eps=norm_eps(module), device=w.device, dtype=w.dtype, **kw)
    copy_shards(layer, module)
    return layer

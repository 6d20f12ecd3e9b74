"""What every tensor-parallel style shares: :class:`TensorStyle`, the base of the style
classes of each mode (:mod:`.styles1d`, :mod:`.styles2d`, :mod:`.styles3d`).

A tensor style is a :class:`~behemoth.parallel.style.ParallelStyle`: ``apply(module, mesh)``
returns the module's tensor-parallel replacement (or the module itself, changed in place),
holding this rank's shards of the serial weights. Its class names the ``role`` it plays
(``behemoth.specs.TP_ROLES``) and the ``mode`` (``Plan.tp_mode``) it is built for; its layout
is its constructor arguments. Arguments left ``None`` are filled from the plan and the model
by the mode's ``prepare`` (:func:`behemoth.parallel.tensor.parallelize_tensor` calls it),
which also runs every check, on every rank, before any collective.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from torch import nn

from .layout import ShardSpec, get_spec, set_spec
from .projection_norm import make_head_norm

if TYPE_CHECKING:
    from ...mesh import ParallelMesh


@dataclass(frozen=True, kw_only=True)
class TensorStyle:
    """Base of the tensor-parallel styles: one role of one mode."""

    role: ClassVar[str]
    """The plan role this style implements (``"colwise"``, ``"head"``, ...)."""
    mode: ClassVar[str]
    """The ``Plan.tp_mode`` it is built for."""

    def apply(self, module: nn.Module, mesh: ParallelMesh) -> nn.Module:
        raise NotImplementedError


@dataclass(frozen=True, kw_only=True)
class GridHeadNormStyle(TensorStyle):
    """The ``head_norm`` role of the grid and cube modes (2D, 2.5D, 3D): a norm over each head
    of a ``colwise`` projection (Qwen3's ``q_norm`` / ``k_norm``) stays itself with its whole
    weight on every rank; each rank normalises its heads of its batch block, so the weight's
    gradient is summed over tp (:func:`~.projection_norm.make_head_norm`). A mode's class names
    its ``mode``."""

    role = "head_norm"

    def apply(self, module: nn.Module, mesh: ParallelMesh) -> nn.Module:
        replicated_over_tp(module)
        return make_head_norm(module, mesh.axis("tp"))


def owner_of(name: str, attention) -> str | None:
    """The attention module (a key of ``attention``) that module ``name`` sits in, or None."""
    return next((a for a in attention if name.startswith(a + ".")), None)


def require_mode(mesh, mode: str, who: str) -> None:
    """Raise unless ``mesh`` was built for ``tp_mode == mode`` (``who`` is named in the error)."""
    if mesh.plan.tp_mode != mode:
        other = {"1d": "tp1d", "2d": "tp2d", "2.5d": "tp2p5d", "3d": "tp3d"}.get(mesh.plan.tp_mode, "?")
        raise ValueError(
            f"{who} needs a mesh with tp_mode={mode!r}; got tp_mode={mesh.plan.tp_mode!r}. "
            f"Use the layers of behemoth.parallel.tensor.{other} for that mesh."
        )


# --------------------------------------------------------------------------- checks every mode shares
def check_fused3(name: str, out_features: int, mode: str) -> None:
    """A ``colwise_fused3`` module must compute three equal q, k, v parts."""
    if out_features % 3:
        raise ValueError(
            f"tensor parallelism ({mode}): colwise_fused3 {name} has {out_features} output "
            f"features, not three equal q/k/v parts."
        )


def check_norm(module: nn.Module, name: str, mode: str) -> int:
    """A ``norm`` module of a mode that shards the hidden dim must be a LayerNorm over the last
    dim or an RMS norm; returns its hidden size."""
    from .serial import is_rms_norm

    if not (isinstance(module, nn.LayerNorm) or is_rms_norm(module)):
        raise ValueError(
            f"tensor parallelism ({mode}): norm {name} is a {type(module).__name__}; the norm role "
            f"supports nn.LayerNorm and RMS norms (a weight, no bias, an eps attribute)."
        )
    if isinstance(module, nn.LayerNorm) and len(module.normalized_shape) != 1:
        raise ValueError(
            f"tensor parallelism ({mode}): norm {name} normalizes over {module.normalized_shape}; "
            f"only the last (hidden) dim is supported."
        )
    return module.weight.shape[0] if module.weight is not None else module.normalized_shape[0]


def check_enters_and_leaves(model: nn.Module, roles: dict[str, str], mode: str, where: str) -> None:
    """For a mode that splits the batch and the hidden dim of every activation (2D, 2.5D, 3D):
    the model enters ``where`` (the grid, the cube) through an ``embedding`` and leaves through
    a ``head``."""
    present = set(roles.values())
    if "embedding" not in present or "head" not in present:
        raise ValueError(
            f"tensor parallelism ({mode}) splits the batch and the hidden dim of every activation, so the model "
            f"must enter the {where} through an 'embedding' role and leave it through a 'head' role; the tp_policy "
            f"for {type(model).__name__} has {sorted(present)}. Add them, or use tp_mode='1d'."
        )


def check_every_parameter_owned(model: nn.Module, roles: dict[str, str], mode: str) -> None:
    """For 2D, 2.5D, 3D: every parameter belongs to a module with a role (a serial one would see
    a hidden block of a batch block and silently train wrong), or lies inside a module marked
    ``_behemoth_grid_rows`` (an MoE block, which the expert style runs on whole rows of its
    tokens: behemoth.parallel.expert.tokens)."""
    owned = {n for n, r in roles.items() if r != "attention"}
    whole = [n for n, m in model.named_modules() if getattr(m, "_behemoth_grid_rows", False)]
    for pname, _ in model.named_parameters(remove_duplicate=False):
        if any(pname.startswith(n + ".") for n in whole):
            continue
        if pname.rpartition(".")[0] not in owned:
            raise ValueError(
                f"tensor parallelism ({mode}): parameter {pname} has no tensor-parallel role. In {mode} every "
                f"activation is a (batch block, hidden block) shard, so a serial parameter would see only part of "
                f"the data; give its module a role in tp_policy (see behemoth.specs)."
            )


def check_kind(module: nn.Module, name: str, role: str) -> None:
    """The module class a role needs, in every mode: ``embedding`` and ``pos_embedding`` an
    ``nn.Embedding`` (a vocab-parallel one without ``max_norm``, ``scale_grad_by_freq`` or
    ``sparse``), ``head`` an ``nn.Linear``. Other roles are checked where their shapes are read."""
    if role in ("embedding", "pos_embedding") and not isinstance(module, nn.Embedding):
        raise ValueError(f"tensor-parallel role {role!r} needs an nn.Embedding; {name} is a {type(module).__name__}.")
    if role == "embedding" and (module.max_norm is not None or module.scale_grad_by_freq or module.sparse):
        raise ValueError(f"vocab-parallel embedding {name}: max_norm, scale_grad_by_freq and sparse are not supported.")
    if role == "head" and not isinstance(module, nn.Linear):
        raise ValueError(f"tensor-parallel role 'head' needs an nn.Linear; {name} is a {type(module).__name__}.")


def replicated_over_tp(module: nn.Module) -> None:
    """Mark ``module``'s own parameters as held whole by every rank of the tp group (a head
    norm's weight in every mode), unless a style already gave them a ShardSpec."""
    for prm in module.parameters(recurse=False):
        if get_spec(prm) is None:
            set_spec(prm, ShardSpec(tuple(prm.shape), (), replicated_on=("tp",)))


# --------------------------------------------------------------------------- without autograd
@contextlib.contextmanager
def no_grad_forward(model: nn.Module):
    """For the duration (under ``torch.no_grad``), every tensor-parallel layer of ``model`` whose
    class has a ``forward_no_grad`` runs it instead of its ``forward``: the same numbers with no
    autograd Functions and no bookkeeping for a backward. 1D's (:mod:`.tp1d`, :mod:`.vocab1d`):
    functional collectives, so a decode step costs about the serial model's Python plus one call
    per collective and ``torch.compile`` traces it into one graph (CUDA graphs included); the
    grid Linears' (:mod:`.tp2d`, 2.5D's too) and the cube's (:mod:`.tp3d`): weight-stationary for
    a few tokens (:func:`.grid.linear_no_grad`, :meth:`.tp3d.Linear3D.forward_no_grad`). The
    training ``forward`` stays as it is (it launches the backward's collectives), so it is
    swapped rather than changed. A no-op for a model without such layers."""
    layers = [m for m in model.modules() if hasattr(type(m), "forward_no_grad")]
    for m in layers:
        m.forward = m.forward_no_grad
    try:
        yield
    finally:
        for m in layers:
            m.__dict__.pop("forward", None)

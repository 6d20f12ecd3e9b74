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

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from torch import nn

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

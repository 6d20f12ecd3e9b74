"""The one extension point: a parallel style rewrites a module for a mesh.

A style is any object with one method, ``apply(module, mesh) -> module`` (PyTorch's
``ParallelStyle`` is the model). Its layout is a constructor argument (which tensor-parallel
mode, which attention mode, which axis); ``apply`` rewrites ``module`` in place or returns a
replacement, and issues no collective that could hang on a rank where validation failed.

A plan for a model is ``{module-name pattern: style}``: patterns are ``fnmatch`` globs over
``model.named_modules()`` names (``"blocks.*.attn.qkv"``). :func:`apply_styles` applies one
such plan: every pattern must match at least one module, and no module may get two styles.

Tested in tests/unit/test_styles.py.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from torch import nn

if TYPE_CHECKING:
    from ..mesh import ParallelMesh


@runtime_checkable
class ParallelStyle(Protocol):
    """Rewrites one module for a mesh; returns the module to use in its place."""

    def apply(self, module: nn.Module, mesh: ParallelMesh) -> nn.Module: ...


def match_plan(model: nn.Module, plan: Mapping[str, object], *, what: str = "plan") -> dict[str, object]:
    """``{module name: value}`` for every module a pattern of ``plan`` matches, in module order.

    Raises ``ValueError`` (the same on every rank, before any collective) for a pattern that
    matches no module and for a module that two patterns give different values; ``what`` names
    the plan in the message (``"tp_plan"``)."""
    if not isinstance(plan, Mapping) or not plan:
        raise ValueError(f"{what} must be a non-empty dict {{module-name pattern: style}}; got {plan!r}.")
    cls = type(model).__name__
    names = [name for name, _ in model.named_modules() if name]
    chosen: dict[str, object] = {}
    for pattern, value in plan.items():
        hits = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if not hits:
            raise ValueError(
                f"{what} pattern {pattern!r} ({value!r}) matches no module of {cls}; module names look like "
                f"{names[:6]}. Fix the pattern or drop it."
            )
        for n in hits:
            if n in chosen and chosen[n] != value:
                raise ValueError(
                    f"module {n!r} of {cls} gets two entries of {what}, {chosen[n]!r} and {value!r} (pattern "
                    f"{pattern!r}); give each module one."
                )
            chosen[n] = value
    order = {n: i for i, n in enumerate(names)}
    return dict(sorted(chosen.items(), key=lambda kv: order[kv[0]]))


def apply_styles(model: nn.Module, plan: Mapping[str, ParallelStyle], mesh: ParallelMesh, *, what: str = "plan"):
    """Apply ``plan`` (``{module-name pattern: style}``) to ``model``'s modules, in module order;
    a style that returns another module replaces the original under the same name. Returns
    ``model``. Every pattern is matched before any style runs, so a bad plan changes nothing."""
    for name, style in match_plan(model, plan, what=what).items():
        if not isinstance(style, ParallelStyle):
            raise TypeError(
                f"{what}[{name!r}] = {style!r} is not a parallel style (an object with apply(module, mesh))."
            )
    for name, style in match_plan(model, plan, what=what).items():
        module = model.get_submodule(name)
        new = style.apply(module, mesh)
        if new is not module:
            model.set_submodule(name, new)
    return model

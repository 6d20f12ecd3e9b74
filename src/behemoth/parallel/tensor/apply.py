"""Apply a tensor-parallel plan to a model: the one entry point of ``behemoth.parallel.tensor``.

:func:`parallelize_tensor` takes ``{module-name pattern: role or style}`` (the user's
``tp_policy``, or the model family's plan from :mod:`behemoth.specs`), turns each role string
into the style class of ``Plan.tp_mode`` (:data:`MODE_STYLES`), and then, in this order:

1. checks everything, pure and identical on every rank (patterns, roles, shapes against the
   degrees: the mode's ``prepare``), and fills each style's model-derived layout;
2. broadcasts the serial weights from tp rank 0 (one model, however each rank was seeded);
3. applies the styles -- embeddings first, attention modules last -- replacing each module by
   what its style returns; a weight two modules share (tied embeddings) stays one Parameter;
4. runs the mode's ``finish`` (hooks, the axes that split the batch inside the tp group).

Tested through every mode's model tests (tests/dist/test_tp1d.py, test_tp2d.py, test_tp3d.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import nn

from ... import comm
from ...specs import TP_ROLES, known_classes, tensor_plan
from ..style import match_plan
from . import styles1d, styles2d, styles3d
from .base import TensorStyle
from .layout import get_spec


@dataclass
class Parallelized:
    """What applying tensor parallelism did to a model."""

    replaced: dict[int, torch.nn.Parameter] = field(default_factory=dict)
    """``id(serial parameter) -> its tensor-parallel replacement`` (to re-target the optimizer)."""
    head: torch.nn.Module | None = None
    """The vocabulary-parallel output head, if any (has ``vocab_parallel_loss_sum``)."""
    batch_axes: tuple[str, ...] = ()
    """Mesh axes that split the batch inside the tp group, outermost first (2D: ``("tp_row",)``;
    2.5D: ``("tp_depth", "tp_row")``; 3D: ``("tp_depth", "tp_col")``, the batch block of the
    head's logits, which sit in the swapped layout; 1D: none). The engine then gives each rank block
    ``ravel(coords on these axes)`` of every micro-batch tensor, the head's loss sums over
    that block, and the engine sums the loss over dp *and* these axes."""


class ModeStyles(NamedTuple):
    """One tensor-parallel mode: its style class per role and its model-level steps."""

    styles: Mapping[str, type[TensorStyle]]
    """Role -> style class."""
    prepare: Callable
    """``prepare(model, {name: style}, mesh) -> {name: style}``: every check, pure; fills layouts."""
    finish: Callable
    """``finish(model, mesh, {name: style}, replaced) -> batch axes``: hooks after the rewrite."""


MODE_STYLES: dict[str, ModeStyles] = {
    "1d": ModeStyles(styles1d.STYLES, styles1d.prepare, styles1d.finish),
    "2d": ModeStyles(styles2d.STYLES_2D, styles2d.prepare, styles2d.finish),
    "2.5d": ModeStyles(styles2d.STYLES_25D, styles2d.prepare, styles2d.finish),
    "3d": ModeStyles(styles3d.STYLES, styles3d.prepare, styles3d.finish),
}
"""``Plan.tp_mode`` -> its styles."""


def _style_of(pattern: str, value, mode: str) -> TensorStyle:
    """The style a plan entry names: a role string -> the mode's class, built with defaults; a
    style object -> itself, if it is built for ``mode``."""
    table = MODE_STYLES[mode].styles
    if isinstance(value, str):
        if value not in TP_ROLES:
            raise ValueError(
                f"tp_policy[{pattern!r}] = {value!r} is not a tensor-parallel role; use one of {', '.join(TP_ROLES)}."
            )
        return table[value]()
    if not isinstance(value, TensorStyle):
        raise ValueError(
            f"tp_policy[{pattern!r}] = {value!r} is neither a tensor-parallel role ({', '.join(TP_ROLES)}) nor a "
            f"tensor-parallel style (behemoth.parallel.tensor: ColwiseParallel1D, RowwiseParallel2D, ...)."
        )
    if value.mode != mode:
        raise ValueError(
            f"tp_policy[{pattern!r}] = {value!r} is a tp_mode={value.mode!r} style, but the plan has "
            f"tp_mode={mode!r}; use {table[value.role].__name__} or the role string {value.role!r}."
        )
    return value


def parallelize_tensor(
    model: nn.Module, mesh, plan, tp_plan: Mapping[str, str | TensorStyle] | None = None
) -> Parallelized:
    """Rewrite ``model`` in place for ``plan.tp_mode`` over the tp axes of ``mesh``.

    ``tp_plan`` is ``{module-name pattern: role or style}`` (roles: ``behemoth.specs.TP_ROLES``;
    styles: this package's ``*Parallel1D`` / ``2D`` / ``25D`` / ``3D`` classes); ``None`` uses
    the plan of the model's family (``behemoth.specs.tensor_plan``). Every check runs on every
    rank before any collective. Returns what changed (replaced parameters, the vocab-parallel
    head, the batch axes); with ``plan.tp == 1`` nothing changes and the record is empty."""
    if plan.tp == 1:
        return Parallelized()
    if tp_plan is None:
        tp_plan = tensor_plan(model)
        if tp_plan is None:
            raise ValueError(
                f"tensor parallelism has no policy for {type(model).__name__}; pass tp_policy={{module-name pattern: "
                f"role}} to bh.boost, e.g. {{'layers.*.attn.q': 'colwise', 'layers.*.attn.o': 'rowwise', ...}}. "
                f"Roles: {', '.join(TP_ROLES)}. Known classes: {known_classes()}."
            )
    if not isinstance(tp_plan, Mapping) or not tp_plan:
        raise ValueError(f"tp_policy must be a non-empty dict {{module-name pattern: role}}; got {tp_plan!r}.")
    mode = MODE_STYLES[plan.tp_mode]
    chosen = {pattern: _style_of(pattern, value, plan.tp_mode) for pattern, value in tp_plan.items()}
    styles = mode.prepare(model, match_plan(model, chosen, what="tp_policy"), mesh)
    replaced, head = replace_modules(model, styles, mesh, plan.tp_mode)
    batch_axes = mode.finish(model, mesh, styles, replaced)
    return Parallelized(replaced=replaced, head=head, batch_axes=tuple(batch_axes))


def replace_modules(
    model: nn.Module, styles: Mapping[str, TensorStyle], mesh, mode: str
) -> tuple[dict[int, nn.Parameter], nn.Module | None]:
    """Broadcast the serial weights from tp rank 0, then apply each style to its module and put
    the result in its place: embeddings first, so a head tied to one finds its Parameter
    already sharded and keeps it as one Parameter (a tie whose two sides would be sharded
    differently is an error); attention modules last, after the layers inside them. Returns
    ``{id(serial param): new param}`` (parameters a style kept are not listed) and the head."""
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            comm.broadcast(t.data, mesh.axis("tp"), 0)
    modules = dict(model.named_modules())
    new: dict[int, nn.Parameter] = {}
    head = None
    order = sorted(styles.items(), key=lambda kv: (kv[1].role == "attention", kv[1].role != "embedding"))
    for name, style in order:
        m = modules[name]
        layer = style.apply(m, mesh)
        if layer is not m:
            for pname, p in list(layer.named_parameters(recurse=False)):
                old = getattr(m, pname, None)
                if old is None or p is old:
                    continue
                if id(old) in new:
                    if get_spec(new[id(old)]) != get_spec(p):
                        raise ValueError(
                            f"tensor parallelism ({mode}): {name}.{pname} is tied to a weight another "
                            f"layer shards differently ({get_spec(new[id(old)])} vs {get_spec(p)}); "
                            f"untie it or give both the same role."
                        )
                    setattr(layer, pname, new[id(old)])
                else:
                    p.requires_grad_(old.requires_grad)
                    new[id(old)] = p
            layer.train(m.training)
            model.set_submodule(name, layer)
        if style.role == "head":
            head = layer
    return new, head

"""Resolve a tensor-parallel plan (``{module-name pattern: role}``, roles in
:mod:`behemoth.specs`) to ``{module name: role}`` for one model.
"""

from __future__ import annotations

import fnmatch

import torch.nn as nn

from ..specs import SPECS, TP_ROLES, tensor_plan


def resolve_tp_policy(model: nn.Module, policy: dict[str, str] | None = None) -> dict[str, str]:
    """``{module name: role}`` for ``model``, from ``policy`` or the table of its class.

    Errors (``ValueError``, raised identically on every rank, before any collective): an
    unknown model class without a policy, an unknown role, a pattern that matches no module,
    a module that two patterns give different roles.
    """
    cls = type(model).__name__
    if policy is None:
        policy = tensor_plan(model)
        if policy is None:
            raise ValueError(
                f"tensor parallelism has no policy for {cls}; pass tp_policy={{module-name pattern: role}} to "
                f"bh.boost, e.g. {{'layers.*.attn.q': 'colwise', 'layers.*.attn.o': 'rowwise', ...}}. "
                f"Roles: {', '.join(TP_ROLES)}. Known classes: {', '.join(c for s in SPECS for c in s.classes)}."
            )
    if not isinstance(policy, dict) or not policy:
        raise ValueError(f"tp_policy must be a non-empty dict {{module-name pattern: role}}; got {policy!r}.")
    names = [name for name, _ in model.named_modules() if name]
    roles: dict[str, str] = {}
    for pattern, role in policy.items():
        if role not in TP_ROLES:
            raise ValueError(
                f"tp_policy[{pattern!r}] = {role!r} is not a tensor-parallel role; use one of {', '.join(TP_ROLES)}."
            )
        hits = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if not hits:
            raise ValueError(
                f"tp_policy pattern {pattern!r} (role {role!r}) matches no module of {cls}; "
                f"module names look like {names[:6]}. Fix the pattern or drop it."
            )
        for n in hits:
            if roles.get(n, role) != role:
                raise ValueError(
                    f"module {n!r} of {cls} gets two tensor-parallel roles, {roles[n]!r} and "
                    f"{role!r} (pattern {pattern!r}); give each module one role."
                )
            roles[n] = role
    return roles

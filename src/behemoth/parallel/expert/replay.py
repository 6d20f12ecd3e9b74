"""The MoE layers' routes kept from a checkpointed block's forward for its recompute.

Activation checkpointing (``torch.utils.checkpoint``) runs a block's forward again in the
backward. Its MoE layers route the same tokens to the same experts the second time (the same
inputs, the same random state), so the routes the forward made -- the sort by expert, the split
sizes read to the host, the permutations (:class:`~.dispatch.Routes`) -- are kept and used again:
the recompute neither sorts nor waits for the host, nor exchanges the split sizes again; it
gathers, exchanges and computes the rows as the forward did. The member routes of
:mod:`.dispatch_members` are kept the same way, their receiving side's layout with them.

:func:`recorded` wraps the function one checkpointed call runs: its first run records each
MoE layer's routes in call order, every later run (the recompute, or two of them where the
zero-bubble schedule runs the backward of the input and of the weights apart) replays them from
the first. :func:`routes` is what an MoE layer calls for its routes. ``recorded`` keeps the routes
as long as the checkpoint keeps the function (until the block's backward is done).

Tested in tests/unit/test_expert_routes.py (the host reads and sorts of a checkpointed model's
forward and backward) and the checkpointed runs of tests/dist/test_expert_routing.py and
tests/dist/test_expert_overlap.py (their ledgers count no second split-size exchange).
"""

from __future__ import annotations

import functools
import threading

import torch
from torch import nn

from ...comm import Axis
from .dispatch import Routes
from .dispatch_members import MemberRoutes

__all__ = ["RoutingReplay", "recorded", "replays_routing", "routes"]

_active = threading.local()  # the recompute may run on autograd's device thread


class RoutingReplay:
    """The routes of one checkpointed call's MoE layers, in call order: recorded on the first
    run (``with replay:``), replayed from the first on every later one."""

    def __init__(self) -> None:
        self.records: list[Routes] = []
        self.runs = 0
        self.at = 0

    def __enter__(self) -> RoutingReplay:
        self.runs += 1
        self.at = 0
        self._outer = getattr(_active, "replay", None)
        _active.replay = self
        return self

    def __exit__(self, *exc) -> None:
        _active.replay = self._outer

    def routes(self, build) -> Routes:
        """The next layer's routes: ``build()``'s, recorded, on the first run; the recorded
        ones on a later run."""
        if self.runs == 1:
            made = build()
            self.records.append(made)
            return made
        made = self.records[self.at]
        self.at += 1
        return made


def recorded(fn):
    """``fn`` for one checkpointed call: its MoE layers' routes recorded on the first run and
    replayed on every later one (a new record for each call of ``recorded``)."""
    replay = RoutingReplay()

    @functools.wraps(fn)
    def run(*args, **kwargs):
        with replay:
            return fn(*args, **kwargs)

    return run


def replays_routing(block: nn.Module) -> bool:
    """Whether ``block`` holds an MoE layer whose routes :func:`recorded` would keep (one the
    expert style runs)."""
    return any(getattr(m, "_behemoth_expert_routes", False) for m in block.modules())


@torch.compiler.disable  # eager in compiled blocks: a host read sizes the exchange
def routes(
    experts_TK: torch.Tensor, num_experts: int, axis: Axis, *, chunks: int = 1, align: int = 1, members: bool = False
) -> Routes | MemberRoutes:
    """The routes of an MoE layer (:meth:`~.dispatch.Routes.build`; ``members``: the member
    routes of :meth:`~.dispatch_members.MemberRoutes.build`, one chunk), or, in the recompute of a
    :func:`recorded` call, the ones its forward made."""
    replay = getattr(_active, "replay", None)
    if members:
        build = functools.partial(MemberRoutes.build, experts_TK, num_experts, axis, align=align)
    else:
        build = functools.partial(Routes.build, experts_TK, num_experts, axis, chunks=chunks, align=align)
    return build() if replay is None else replay.routes(build)

"""ParallelMesh: the one object that names every axis of a job and owns its process groups.

Rank layout, outermost to innermost: ``pp, dp, cp, tp`` (tp innermost so its heavy
traffic stays inside a node). ``dp`` is split into ``ep_dp x ep`` (experts are
sharded over the inner ``ep`` part), and ``tp`` into sub-axes by its mode:

=========  ====================================
tp_mode    tp sub-axes (outer -> inner)
=========  ====================================
1d         tp
2d         tp_row x tp_col            (q x q)
2.5d       tp_depth x tp_row x tp_col (d x q x q)
3d         tp_depth x tp_row x tp_col (q x q x q)
=========  ====================================

All coordinate math is pure (:func:`unravel`, :func:`ravel`, :func:`axis_groups`) and
unit-tested without processes. :class:`ParallelMesh` then creates every group of every
non-trivial axis, in the same order on every rank, once. It is passed, never global.
"""

from __future__ import annotations

import itertools
import math

import torch.distributed as dist

from .comm import Axis, Ledger
from .distributed import default_timeout
from .plan import Plan


def atomic_dims(plan: Plan) -> list[tuple[str, int]]:
    """The finest decomposition of the world, outermost first, as (name, size) pairs."""
    assert plan.dp is not None, "resolve the plan for a world size first"
    dims = [("pp", plan.pp), ("ep_dp", plan.dp // plan.ep), ("ep", plan.ep), ("cp", plan.cp)]
    q = plan.tp
    if plan.tp_mode == "1d":
        dims.append(("tp", plan.tp))
    elif plan.tp_mode == "2d":
        q = math.isqrt(plan.tp)
        dims += [("tp_depth", 1), ("tp_row", q), ("tp_col", q)]
    elif plan.tp_mode == "2.5d":
        q = math.isqrt(plan.tp // plan.tp_depth)
        dims += [("tp_depth", plan.tp_depth), ("tp_row", q), ("tp_col", q)]
    else:  # 3d
        q = round(plan.tp ** (1 / 3))
        dims += [("tp_depth", q), ("tp_row", q), ("tp_col", q)]
    return dims


# Named axes as sets of atomic dims.
def named_axes(plan: Plan) -> dict[str, tuple[str, ...]]:
    tp_parts = ("tp",) if plan.tp_mode == "1d" else ("tp_depth", "tp_row", "tp_col")
    axes = {
        "pp": ("pp",),
        "dp": ("ep_dp", "ep"),
        "ep": ("ep",),
        "ep_dp": ("ep_dp",),
        "cp": ("cp",),
        "tp": tp_parts,
        "dp_cp": ("ep_dp", "ep", "cp"),
        "world": ("pp", "ep_dp", "ep", "cp") + tp_parts,
    }
    if plan.tp_mode != "1d":
        axes.update({"tp_depth": ("tp_depth",), "tp_row": ("tp_row",), "tp_col": ("tp_col",)})
    if plan.ep > 1 and plan.cp > 1:  # experts' replicas under context parallelism (their gradients' axis)
        axes["ep_dp_cp"] = ("ep_dp", "cp")
    if plan.tp > 1:
        # an MoE block's parameters under tensor parallelism: whole on every tp rank, each of which runs
        # the block on its own share of the tokens, so their gradients are summed over the data axis
        # and tp together, once per step (and sharded there by ZeRO): parallel/expert/style.py
        cp = ("cp",) if plan.cp > 1 else ()
        axes["dp_cp_tp" if cp else "dp_tp"] = ("ep_dp", "ep", *cp, *tp_parts)
        if plan.ep > 1:
            axes["ep_dp_cp_tp" if cp else "ep_dp_tp"] = ("ep_dp", *cp, *tp_parts)
    return axes


def unravel(rank: int, sizes: list[int]) -> tuple[int, ...]:
    """Row-major coordinates of ``rank`` in a grid of ``sizes`` (first size outermost)."""
    coords = []
    for s in reversed(sizes):
        coords.append(rank % s)
        rank //= s
    if rank:
        raise ValueError(f"rank out of range for grid {sizes}")
    return tuple(reversed(coords))


def ravel(coords: tuple[int, ...], sizes: list[int]) -> int:
    """Inverse of :func:`unravel`."""
    r = 0
    for c, s in zip(coords, sizes):
        if not 0 <= c < s:
            raise ValueError(f"coordinate {coords} out of range for grid {sizes}")
        r = r * s + c
    return r


def axis_groups(dims: list[tuple[str, int]], members: tuple[str, ...]) -> list[list[int]]:
    """Every group of the axis made of atomic dims ``members``: lists of global ranks that
    differ only in those dims, each ordered by the axis's own (row-major) coordinate.
    Groups are listed in a fixed order, identical on every rank."""
    names = [n for n, _ in dims]
    sizes = [s for _, s in dims]
    idx = [names.index(m) for m in members]
    other = [i for i in range(len(dims)) if i not in idx]
    groups = []
    for oc in itertools.product(*(range(sizes[i]) for i in other)):
        group = []
        for mc in itertools.product(*(range(sizes[i]) for i in idx)):
            coords = [0] * len(dims)
            for i, c in zip(other, oc):
                coords[i] = c
            for i, c in zip(idx, mc):
                coords[i] = c
            group.append(ravel(tuple(coords), sizes))
        groups.append(group)
    return groups


class ParallelMesh:
    """Every axis of a plan, with one process group per axis group, created collectively.

    ``mesh.axis("dp")`` returns this rank's :class:`~behemoth.comm.Axis` for dp, with the
    group, its size and this rank's index; ``mesh.coord("pp")`` this rank's coordinate.
    """

    def __init__(self, plan: Plan, rank: int, world_size: int, *, create_groups: bool = True) -> None:
        self.plan = plan.resolve(world_size)
        self.rank, self.world_size = rank, world_size
        self.dims = atomic_dims(self.plan)
        self.ledger = Ledger()
        sizes = [s for _, s in self.dims]
        self._coords = dict(zip([n for n, _ in self.dims], unravel(rank, sizes)))
        self._axes: dict[str, Axis] = {}
        for name, members in named_axes(self.plan).items():
            groups = axis_groups(self.dims, members)
            mine = next(g for g in groups if rank in g)
            pg = None
            if len(mine) > 1 and create_groups:
                if len(mine) == world_size:
                    pg = dist.group.WORLD
                else:
                    for g in groups:  # every rank creates every group, in the same order
                        h = dist.new_group(g, timeout=default_timeout())  # BEHEMOTH_TIMEOUT, as the world's
                        if g is mine:
                            pg = h
            self._axes[name] = Axis(name, len(mine), mine.index(rank), tuple(mine), pg, self.ledger)

    def channel_axes(self, name: str, pairs) -> dict[tuple, Axis]:
        """One new 2-rank process group per ``(i, j, *tag)`` in ``pairs`` (member indices of
        axis ``name``) for every group of that axis, created collectively (every rank calls
        this with the same ``pairs``). Returns this rank's, keyed by the pair, in creation
        order, as axes named ``name`` (one ledger line) with ``ranks = (g[i], g[j])``: index
        0 is member ``i``. Pipelines use them as one-way channels (pipeline/p2p.py)."""
        members = named_axes(self.plan)[name]
        out: dict[tuple, Axis] = {}
        for g in axis_groups(self.dims, members):
            for key in pairs:
                i, j = key[0], key[1]
                ranks = (g[i], g[j])
                h = dist.new_group(sorted(ranks), timeout=default_timeout()) if dist.is_initialized() else None
                if self.rank in ranks:
                    out[key] = Axis(name, 2, ranks.index(self.rank), ranks, h, self.ledger)
        return out

    def axis(self, name: str) -> Axis:
        try:
            return self._axes[name]
        except KeyError:
            raise KeyError(f"mesh has no axis {name!r}; axes: {sorted(self._axes)}") from None

    def coord(self, dim: str) -> int:
        """This rank's coordinate on an atomic dim (pp, ep_dp, ep, cp, tp, tp_row, ...)."""
        return self._coords[dim]

    @property
    def dp_rank(self) -> int:
        return self.axis("dp").rank

    @property
    def dp_size(self) -> int:
        return self.axis("dp").size

    def __repr__(self) -> str:
        shape = " x ".join(f"{n}={s}" for n, s in self.dims if s > 1) or "1 rank"
        return f"ParallelMesh({shape}, rank={self.rank})"

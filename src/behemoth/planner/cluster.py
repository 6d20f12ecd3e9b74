"""The cluster the planner plans for: how many GPUs, how they are grouped into nodes, their
memory, and which link class each mesh axis's groups cross.

Ranks are laid out as ``behemoth.mesh`` lays them out, outermost to innermost
``pp, dp (ep_dp x ep), cp, tp`` (tp innermost, so its traffic stays inside a node). A group
of ``size`` ranks whose members are ``stride`` ranks apart stays on one node's NVLink when
``size * stride <= gpus_per_node``; otherwise its ring crosses the inter-node fabric and runs
at that fabric's speed (the slowest hop of a ring sets its pace). Pure; no process group.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .calibration import Calibration, load_calibration

__all__ = ["Cluster", "axis_strides"]

GIB = 2.0**30


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """GPUs, their nodes, their memory and their calibration."""

    num_gpus: int
    """GPUs in the job (the world size)."""
    gpus_per_node: int = 8
    """GPUs that share one NVLink island."""
    gpu_bytes: float | None = None
    """Memory of one GPU in bytes; None takes the calibration's."""
    host_bytes: float = 256 * GIB
    """Host memory available to each rank, in bytes (what offload may use)."""
    calibration: Calibration = dataclasses.field(default_factory=lambda: load_calibration("h100"))
    """Rates of compute, memory and links (``behemoth.planner.calibration``)."""
    inter_node_bytes_per_s: float | None = None
    """Overrides the calibration's inter-node ("ib") bus bandwidth per GPU, bytes/s."""
    inter_node_latency_s: float | None = None
    """Overrides the calibration's inter-node latency per collective, seconds."""

    def __post_init__(self) -> None:
        for name in ("num_gpus", "gpus_per_node"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"Cluster.{name}={v!r}: must be an integer >= 1.")
        if self.num_gpus > self.gpus_per_node and self.num_gpus % self.gpus_per_node:
            raise ValueError(
                f"Cluster.num_gpus={self.num_gpus} spans several nodes of {self.gpus_per_node} GPUs but is not a "
                f"multiple of gpus_per_node; use whole nodes (num_gpus={self.num_gpus // self.gpus_per_node * self.gpus_per_node})."
            )
        if self.inter_node_bytes_per_s is not None or self.inter_node_latency_s is not None:
            cal = self.calibration
            ib = tuple(
                (
                    p,
                    self.inter_node_latency_s if self.inter_node_latency_s is not None else a,
                    self.inter_node_bytes_per_s if self.inter_node_bytes_per_s is not None else b,
                )
                for p, a, b in cal.links["ib"]
            )
            object.__setattr__(self, "calibration", dataclasses.replace(cal, links={**cal.links, "ib": ib}))

    @property
    def memory_bytes(self) -> float:
        return self.calibration.gpu_bytes if self.gpu_bytes is None else self.gpu_bytes

    @property
    def num_nodes(self) -> int:
        return max(1, self.num_gpus // self.gpus_per_node)

    def link(self, size: int, stride: int) -> str:
        """The link class a group of ``size`` ranks ``stride`` apart runs on: 'nvlink' or 'ib'."""
        return "nvlink" if size * stride <= self.gpus_per_node else "ib"

    def collective_seconds(self, size: int, stride: int, wire_bytes: float, calls: float = 1.0) -> float:
        return self.calibration.collective_seconds(self.link(size, stride), size, wire_bytes, calls)


def axis_strides(*, dp: int, pp: int, tp: int, cp: int, ep: int = 1) -> dict[str, tuple[int, int]]:
    """``axis -> (size, stride)`` for the mesh's layout ``pp, dp (ep_dp x ep), cp, tp`` (tp
    innermost); ``dp_cp`` (the gradient axis under context parallelism) is dp x cp, strided by tp;
    ``ep`` strided by cp x tp; ``ep_dp`` (the experts' gradient axis) strided by ep x cp x tp, and
    ``ep_dp_cp`` (``ep_dp`` x ``cp``) given the stride that spans what its groups span (a group
    stays on one node when the dp x cp x tp ranks it spreads over do); the expert axes only with
    ``ep > 1``; with ``tp > 1`` an MoE block's gradient axes ``dp_tp`` (``dp_cp_tp``), contiguous,
    and ``ep_dp_tp`` (``ep_dp_cp_tp``), strided by ep."""
    out = {"tp": (tp, 1), "cp": (cp, tp), "dp": (dp, cp * tp), "dp_cp": (dp * cp, tp), "pp": (pp, dp * cp * tp)}
    if ep > 1:
        out.update(ep=(ep, cp * tp), ep_dp=(dp // ep, ep * cp * tp), ep_dp_cp=(dp // ep * cp, ep * tp))
    if tp > 1:  # an MoE block's gradient axes under tensor parallelism: the data axis's times tp
        out["dp_cp_tp" if cp > 1 else "dp_tp"] = (dp * cp * tp, 1)
        if ep > 1:
            out["ep_dp_cp_tp" if cp > 1 else "ep_dp_tp"] = (dp // ep * cp * tp, ep)
    return out

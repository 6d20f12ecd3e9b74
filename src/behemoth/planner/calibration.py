"""Calibration: how fast one kind of machine computes and communicates, as the cost model reads it.

A calibration is a JSON file (``benchmarks/calibrate.py`` measures one in under a minute;
``calibrations/h100.json`` and ``calibrations/h200.json`` ship with the package, *estimated from
datasheet numbers, not measured*, as their ``source`` field says; ``h200-measured-2gpu.json`` is
that script's measurement of a 2x H200 host, its ``source`` naming the figures it could not
measure there)::

    {
      "name": "h100-sxm", "source": "estimated from datasheet numbers (not measured)",
      "gemm": [[flops, flops_per_s], ...],          # achieved bf16 GEMM rate by GEMM size (2mnk)
      "attention_flops_per_s": 3.5e14,               # causal flash attention, forward
      "attention_backward_ratio": 0.8,              # backward rate / forward rate
      "attention_by_seq": [[seq, flops_per_s, backward_ratio], ...],  # ... by sequence length
      "hbm_bytes_per_s": 2.8e12,                     # achieved device-memory bandwidth
      "elementwise_bytes_per_s": 2.4e12,             # ... of the blocks' non-GEMM kernels (0: hbm's)
      "links": {"nvlink": [[group, latency_s, bus_bytes_per_s], ...],
                "ib":     [[group, latency_s, bus_bytes_per_s], ...]},
      "h2d_bytes_per_s": 2.5e10, "d2h_bytes_per_s": 2.5e10,
      "cpu_adam_params_per_s": 1e9,                  # one rank's CPU optimizer update
      "gpu_bytes": 85e9, "reserved_bytes": 3e9,      # device memory, and what the runtime keeps
      "cuda_context_bytes": 5.4e8,                   # ... or, in its place: the CUDA context,
      "nccl_comm_bytes": 7e8, "nccl_p2p_bytes": 4e8, # one communicator's NCCL buffers (planner/reserve.py)
      "allocator_slack": 0.0,                        # the caching allocator's reserve, x its peak
      "peak_flops_per_s": 9.89e14,                   # dense bf16 peak, for MFU
      "overlap_slowdown": 0.45,                      # what a collective beside compute still costs it
      "sustained_ratio": 0.9,                        # GEMM rate over seconds of back-to-back work / burst
      "host_kernel_s": 1.2e-05,                      # host seconds per kernel an eager op launches
      "host_call_s": {"1d": 6e-05, "2d": 2.5e-04},  # ... per collective call, by tensor-parallel mode
      "host_block_kernels": 90,                      # kernels of one block's forward + backward
      "kernels_per_collective": 2.5,                 # kernels a collective call launches (itself, copies)
      "kernels_per_call": {"1d": 1.5, "2d": 4.2},    # ... as measured by mode (other axes' calls: "1d")
      "host_forward_share": 0.33,                    # the forward's share of a block's host time
      "grouped_call_vs_table": 1.0,                  # experts' grouped GEMM call's rate / the table's (1: not measured)
      "grouped_call_by_rows": [[rows, ratio], ...]   # ... by rows per group, where measured
    }

``cpu_adam_params_per_s`` is one rank's rate with every rank of its host updating at once (they
share the host's memory bandwidth) and with the threads its launch gives it, of the kernel the
offloaded chunks run: the fused CPU AdamW (``parallel/zero/optimizer.py`` gives host masters
``fused=True``); the cost model divides each rank's offloaded parameters by it. A rate of the
foreach kernel (several times slower on the same cores) is not that quantity: an older
calibration's is kept in ``extra`` (``cpu_adamw_foreach_params_per_s``) and not read.

The host figures feed :mod:`.host` (the step is at least its host issue time); all zero (the
default) predicts no host bound. ``sustained_ratio`` scales the GEMM table and the attention
rate (a short burst runs at boost clocks that a step's seconds of work do not hold); default 1.

The experts' grouped GEMMs (``torch._grouped_mm``) run all of a rank's local experts in one call:
it runs at ``grouped_call_vs_table`` of the table's rate for **the whole call's** flops (every
group's rows as one GEMM), by the rows per group where the calibration measured them
(``grouped_call_by_rows``, :meth:`Calibration.grouped_call_factor`; few rows per group waste the
kernel's tiles). The whole call, not one group's GEMM: 64 groups of 512 rows (OLMoE's experts) fill
the GPU as one large GEMM does (0.79 of its rate on an H200), not as one 512-row GEMM (4.6 times
that GEMM's rate); 4 groups of Mixtral's wider experts measure 1.02 at the same rows. An older
calibration's ``grouped_gemm_vs_table`` / ``grouped_gemm_by_rows`` (against the table's rate for
one group's GEMM, which put OLMoE's experts 1.3-4.6 times too slow) and its ``grouped_gemm_ratio``
(against a Python loop of per-group ``F.linear`` calls) are not that quantity: they are kept in
``extra`` and not read.

A collective over ``p`` ranks on a link class takes ``latency(p) + wire_bytes / bus_bw(p)``
(the alpha-beta model, with ``wire_bytes`` the ledger's ring bytes per rank, so the bus
bandwidth is NCCL's "busbw"); both are read from the nearest measured group sizes,
interpolated in log2(p). A GEMM of ``2mnk`` flops runs at the table's rate for its size
(interpolated in log space, clamped at the ends), never faster than memory allows.
Tested in tests/unit/test_planner_cost.py.
"""

from __future__ import annotations

import bisect
import json
import math
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path

__all__ = ["Calibration", "load_calibration", "CALIBRATIONS", "shipped_calibration_for"]

HERE = Path(__file__).resolve().parent / "calibrations"
CALIBRATIONS = ("h100", "h200", "h200-measured-2gpu")
"""The calibrations shipped with the package (``load_calibration("h100")``)."""


def _interp(points: list[tuple[float, float]], x: float) -> float:
    """Piecewise-linear interpolation of ``points`` (sorted by x) in log2(x); clamped at the ends."""
    xs = [p[0] for p in points]
    if x <= xs[0]:
        return points[0][1]
    if x >= xs[-1]:
        return points[-1][1]
    i = bisect.bisect_right(xs, x)
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    w = (math.log2(x) - math.log2(x0)) / (math.log2(x1) - math.log2(x0))
    return y0 + w * (y1 - y0)


@lru_cache(maxsize=4096)
def _link_figures(points: tuple[tuple[int, float, float], ...], group: int) -> tuple[float, float]:
    """(latency, bus bandwidth) of a collective over ``group`` ranks, from one link class's points."""
    return _interp([(p, a) for p, a, _ in points], group), _interp([(p, b) for p, _, b in points], group)


@dataclass(frozen=True)
class Calibration:
    """One machine kind's measured (or estimated) rates; see the module docstring for the JSON."""

    name: str
    source: str
    gemm: tuple[tuple[float, float], ...]
    attention_flops_per_s: float
    hbm_bytes_per_s: float
    links: dict[str, tuple[tuple[int, float, float], ...]]
    h2d_bytes_per_s: float
    d2h_bytes_per_s: float
    cpu_adam_params_per_s: float
    """Parameters per second one rank's fused CPU AdamW updates, all ranks of a host at once."""
    gpu_bytes: float
    reserved_bytes: float = 3e9
    attention_backward_ratio: float = 0.8
    attention_by_seq: tuple[tuple[float, float, float], ...] = ()
    """``(sequence length, forward flops/s, backward ratio)`` points of causal attention: its rate
    grows with the length a kernel sees; empty: ``attention_flops_per_s`` and
    ``attention_backward_ratio`` at every length."""
    peak_flops_per_s: float = 0.0
    """The card's dense peak (what MFU divides by); 0 takes the GEMM table's best rate."""
    overlap_slowdown: float = 0.0
    """The fraction of a collective's time that the compute it overlaps still loses (its kernels
    take SMs and memory bandwidth from the GEMMs beside them): 0 hides it whole, 1 not at all."""
    sustained_ratio: float = 1.0
    """Compute rate over seconds of back-to-back GEMMs / the burst rate the GEMM table and the
    attention rate were measured at (clocks drop under sustained power)."""
    host_kernel_s: float = 0.0
    """Host seconds per kernel an eager op launches (Python, dispatch, autograd, the launch)."""
    host_call_s: dict = field(default_factory=dict)
    """Host seconds per collective call beyond the kernels counted around it, by tensor-parallel
    mode ("1d" also serves the other axes' calls): for a tensor-parallel layout's own calls, beyond
    the kernels its layers add to the block (:func:`.host.tp_block_kernels`, counted from the
    code), so the call's own kernel and the layers' Python around it; see :mod:`.host`."""
    host_block_kernels: float = 0.0
    """Kernels one serial transformer block launches per micro-batch, forward and backward."""
    kernels_per_collective: float = 0.0
    """Kernels per collective call (its own and the copies around it)."""
    kernels_per_call: dict = field(default_factory=dict)
    """... by tensor-parallel mode, where measured: the measured block's extra kernels over its
    calls. The cost model reads only "1d" (else ``kernels_per_collective``) for the calls of axes
    other than tensor parallelism (context, expert, ZeRO-3); a layout's own tensor-parallel
    kernels are counted (:func:`.host.tp_block_kernels`), so "2d" is kept as the measurement only."""
    host_forward_share: float = 1 / 3
    """The forward's share of a serial block's host time per micro-batch (forward and backward)."""
    cuda_context_bytes: float = 0.0
    """Device memory a process holds outside PyTorch's allocator before any communicator (the
    CUDA context, library workspaces); 0: ``reserved_bytes`` stands for it and the NCCL buffers."""
    nccl_comm_bytes: float = 0.0
    """Device memory one NCCL communicator holds once it has run collectives (its buffers)."""
    nccl_p2p_bytes: float = 0.0
    """Device memory one 2-rank NCCL communicator holds once it has sent and received."""
    allocator_slack: float = 0.0
    """Memory the caching allocator keeps reserved beyond the allocated peak, as a fraction of it,
    on top of the slack the footprint predicts from the loss's logits-sized blocks
    (``planner/reserve.py``'s ``allocator_slack``); 0 in the shipped calibrations."""
    elementwise_bytes_per_s: float = 0.0
    """Bytes per second the blocks' non-GEMM operators (norms, activations, rotary embeddings,
    casts: :mod:`.elementwise`) move; 0: ``hbm_bytes_per_s`` (a large copy's rate)."""
    grouped_call_vs_table: float = 1.0
    """The experts' grouped GEMM call's rate (``torch._grouped_mm``, ``parallel/expert/grouped.py``:
    the gate/up and down projections of all of a rank's local experts, forward and backward) over
    the GEMM table's rate at the whole call's flops (every group's rows as one GEMM), both short
    bursts (``sustained_ratio`` scales both), as ``benchmarks/calibrate.py`` measures it (the mean
    of its ``grouped_call_by_rows``); 1 (the default, where not measured) takes the table's rate."""
    grouped_call_by_rows: tuple[tuple[float, float], ...] = ()
    """``(rows per group, grouped_call_vs_table)`` points: few rows per group waste the kernel's
    tiles (0.5 of the whole call's table rate at 128 rows on an H200, 0.8-1.0 from 512); empty:
    ``grouped_call_vs_table`` at every size."""
    extra: dict = field(default_factory=dict)
    """Anything else the calibration run recorded (kept, not read)."""

    def __post_init__(self) -> None:
        if not self.gemm:
            raise ValueError(f"calibration {self.name!r}: 'gemm' needs at least one [flops, flops_per_s] point.")
        for name in ("nvlink", "ib"):
            if not self.links.get(name):
                raise ValueError(
                    f"calibration {self.name!r}: links[{name!r}] needs [group, latency_s, bus_bytes_per_s] points."
                )
        if any(not (p[0] > 0 and p[1] > 0 and p[2] > 0) for p in self.attention_by_seq):
            raise ValueError(
                f"calibration {self.name!r}: attention_by_seq needs [seq, flops_per_s, backward_ratio] points > 0."
            )
        for k in ("attention_flops_per_s", "hbm_bytes_per_s", "h2d_bytes_per_s", "d2h_bytes_per_s"):
            if not getattr(self, k) > 0:
                raise ValueError(f"calibration {self.name!r}: {k}={getattr(self, k)!r} must be > 0.")
        if not 0.0 < self.sustained_ratio <= 1.5:
            raise ValueError(
                f"calibration {self.name!r}: sustained_ratio={self.sustained_ratio!r} must be in (0, 1.5]."
            )
        if not 0.0 < self.host_forward_share < 1.0:
            raise ValueError(
                f"calibration {self.name!r}: host_forward_share={self.host_forward_share!r} must be in (0, 1)."
            )
        ratios = (self.grouped_call_vs_table, *(r for _, r in self.grouped_call_by_rows))
        if not all(0.0 < r <= 4.0 for r in ratios) or any(n <= 0 for n, _ in self.grouped_call_by_rows):
            raise ValueError(
                f"calibration {self.name!r}: grouped_call_vs_table={self.grouped_call_vs_table!r} and "
                f"grouped_call_by_rows={self.grouped_call_by_rows!r} need ratios in (0, 4] (and rows > 0)."
            )
        if not 0.0 <= self.allocator_slack <= 1.0:
            raise ValueError(f"calibration {self.name!r}: allocator_slack={self.allocator_slack!r} must be in [0, 1].")
        for k in (
            "host_kernel_s",
            "host_block_kernels",
            "kernels_per_collective",
            "cuda_context_bytes",
            "nccl_comm_bytes",
            "nccl_p2p_bytes",
            "elementwise_bytes_per_s",
        ):
            if not getattr(self, k) >= 0:
                raise ValueError(f"calibration {self.name!r}: {k}={getattr(self, k)!r} must be >= 0.")
        if any(not (v >= 0) for v in (*self.host_call_s.values(), *self.kernels_per_call.values())):
            raise ValueError(
                f"calibration {self.name!r}: host_call_s={self.host_call_s!r} and kernels_per_call="
                f"{self.kernels_per_call!r} need values >= 0."
            )
        if not 0.0 <= self.overlap_slowdown <= 1.0:
            raise ValueError(
                f"calibration {self.name!r}: overlap_slowdown={self.overlap_slowdown!r} must be in [0, 1]."
            )

    # -- rates -------------------------------------------------------------------------
    @property
    def elementwise_rate(self) -> float:
        """Bytes per second of the blocks' non-GEMM operators (``elementwise_bytes_per_s``, else
        ``hbm_bytes_per_s``)."""
        return self.elementwise_bytes_per_s or self.hbm_bytes_per_s

    def attention_rate(self, seq: float) -> tuple[float, float]:
        """(forward flops/s, backward rate / forward rate) of causal attention over ``seq`` tokens,
        interpolated in log2(seq) between the measured lengths (clamped at the ends)."""
        pts = self.attention_by_seq
        if not pts:
            return self.attention_flops_per_s, self.attention_backward_ratio
        return _interp([(p[0], p[1]) for p in pts], seq), _interp([(p[0], p[2]) for p in pts], seq)

    def grouped_call_factor(self, rows: float) -> float:
        """The experts' grouped GEMM call's rate over the table's at the whole call's flops, with
        ``rows`` rows per group: ``grouped_call_by_rows`` interpolated in log2(rows) (clamped at the
        ends), else ``grouped_call_vs_table``."""
        if self.grouped_call_by_rows and rows > 0:
            return _interp(list(self.grouped_call_by_rows), rows)
        return self.grouped_call_vs_table

    def gemm_seconds(self, m: float, n: float, k: float, element_bytes: int = 2) -> float:
        """One GEMM ``[m, k] @ [k, n]``: its flops at the table's rate, or its bytes at HBM speed."""
        if m <= 0 or n <= 0 or k <= 0:
            return 0.0
        flops = 2.0 * m * n * k
        rate = _interp(list(self.gemm), flops) * self.sustained_ratio
        memory = (m * k + k * n + m * n) * element_bytes / self.hbm_bytes_per_s
        return max(flops / rate, memory)

    def collective_seconds(self, link: str, group: int, wire_bytes: float, calls: float = 1.0) -> float:
        """``calls`` collectives over ``group`` ranks on ``link`` moving ``wire_bytes`` per rank in all."""
        if group <= 1 or (wire_bytes <= 0 and calls <= 0):
            return 0.0
        lat, bw = _link_figures(self.links[link], group)
        return calls * lat + wire_bytes / bw

    def p2p_seconds(self, link: str, nbytes: float) -> float:
        """One point-to-point message (the group-of-2 figures)."""
        return self.collective_seconds(link, 2, nbytes)

    # -- JSON --------------------------------------------------------------------------
    def to_json(self) -> str:
        d = asdict(self)
        d["gemm"] = [list(p) for p in self.gemm]
        d["links"] = {k: [list(p) for p in v] for k, v in self.links.items()}
        d["attention_by_seq"] = [list(p) for p in self.attention_by_seq]
        d["grouped_call_by_rows"] = [list(p) for p in self.grouped_call_by_rows]
        return json.dumps(d, indent=1)

    @classmethod
    def from_dict(cls, d: dict) -> Calibration:
        d = dict(d)
        known = set(cls.__dataclass_fields__)
        extra = {k: d.pop(k) for k in list(d) if k not in known}
        d["gemm"] = tuple(sorted((float(a), float(b)) for a, b in d["gemm"]))
        d["links"] = {k: tuple(sorted((int(p), float(a), float(b)) for p, a, b in v)) for k, v in d["links"].items()}
        d["attention_by_seq"] = tuple(
            sorted((float(s), float(r), float(b)) for s, r, b in d.get("attention_by_seq", ()))
        )
        d["grouped_call_by_rows"] = tuple(sorted((float(n), float(r)) for n, r in d.get("grouped_call_by_rows", ())))
        d["extra"] = {**d.get("extra", {}), **extra}
        return cls(**d)


def shipped_calibration_for(device_name: str | None) -> str:
    """The shipped calibration nearest a device (``torch.cuda.get_device_name``): an H200 the one
    measured on 2 x H200, anything else (an H100, no GPU) the H100 datasheet estimate."""
    return "h200-measured-2gpu" if device_name and "H200" in device_name.upper() else "h100"


def load_calibration(name_or_path: str | Path) -> Calibration:
    """A shipped calibration by name (``"h100"``, ``"h200"``) or a JSON file written by
    ``benchmarks/calibrate.py``."""
    p = Path(name_or_path)
    if str(name_or_path) in CALIBRATIONS:
        p = HERE / f"{name_or_path}.json"
    if not p.is_file():
        raise FileNotFoundError(
            f"calibration {str(name_or_path)!r}: no such file; use one of {list(CALIBRATIONS)} or the JSON that "
            f"benchmarks/calibrate.py writes."
        )
    return Calibration.from_dict(json.loads(p.read_text()))

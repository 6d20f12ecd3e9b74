"""The Plan: every parallel degree and mode of a training job, in one frozen dataclass.

Validation here is pure (no torch.distributed), so every rank raises the same
``ValueError`` before any process group or collective exists, and the planner can
enumerate and check plans for a cluster it is not running on.

A field whose implementation has not landed yet is accepted by ``Plan`` (the
planner may reason about it) but refused by :func:`Plan.check_supported`, which
``bh.boost`` calls, with a ``NotImplementedError`` naming the missing capability.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

TP_MODES = ("1d", "2d", "2.5d", "3d")
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero-bubble")
CP_MODES = ("ulysses", "ring")
OFFLOADS = (None, "cpu", "auto")
PRECISIONS = ("fp32", "bf16", "fp16")


def _is_square(n: int) -> bool:
    r = math.isqrt(n)
    return r * r == n


def _icbrt(n: int) -> int:
    r = round(n ** (1 / 3))
    for c in (r - 1, r, r + 1):
        if c >= 0 and c**3 == n:
            return c
    return -1


@dataclass(frozen=True, kw_only=True)
class Plan:
    """How one training job is parallelised. Degrees multiply to the world size:
    ``dp * pp * tp * cp == world_size`` (``ep`` subdivides ``dp``).

    All fields are keyword-only; ``dp=None`` means "whatever the world size leaves".
    """

    dp: int | None = None
    """Data-parallel degree: replicas that each see a different share of the batch."""
    tp: int = 1
    """Tensor-parallel degree: devices that split every layer's weights."""
    tp_mode: str = "1d"
    """'1d' (Megatron), '2d' (Optimus, tp=q*q), '2.5d' (Tesseract, tp=tp_depth*q*q), '3d' (tp=q**3)."""
    tp_depth: int = 1
    """Depth d of 2.5D tensor parallelism; tp_depth=1 is exactly 2D."""
    tp_overlap: int = 1
    """Over-decomposition to overlap communication with compute. 3D (Tensor3D): every Linear
    splits the rank's tokens into this many pieces. 1D: every row-parallel Linear splits its
    batch into this many pieces, each piece's all-reduce (sequence parallel: reduce-scatter)
    running during the next piece's GEMM. The same sums as 1, up to GEMM rounding."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism inside 1D tp (norms and dropout sharded on the sequence)."""
    pp: int = 1
    """Pipeline-parallel degree: number of stages."""
    microbatches: int = 1
    """Micro-batches per step: pipeline micro-batches, or gradient-accumulation steps when pp == 1."""
    schedule: str = "1f1b"
    """Pipeline schedule: 'gpipe', '1f1b', 'interleaved', 'zero-bubble'."""
    virtual_stages: int = 1
    """Model chunks per pipeline rank for the interleaved schedule."""
    cp: int = 1
    """Context-parallel degree: devices that split every sequence (Ulysses or ring attention)."""
    cp_mode: str = "ulysses"
    """'ulysses' (all-to-all over heads) or 'ring' (ring attention)."""
    ep: int = 1
    """Expert-parallel degree, a subdivision of the data-parallel axis."""
    ep_overlap: int = 1
    """Over-decomposition of expert parallelism: every MoE layer splits its tokens into this many
    chunks, chunk i+1's dispatch all-to-all running during chunk i's expert GEMMs and chunk i's
    combine during chunk i+1's (backward likewise). The same sums as 1, up to GEMM rounding."""
    ep_dedup: bool = False
    """Expert parallelism sends each token once per ep rank holding any of its experts, which
    runs them and sends back their weighted sum (``parallel/expert/dispatch_members.py``), instead
    of once per (token, expert): fewer all-to-all bytes where a token's experts share ranks
    (top-k > 1, several experts per rank). Dropless layers with ep_overlap=1 only; the others
    keep the per-assignment exchange. The same sums up to rounding."""
    zero: int = 0
    """ZeRO stage: 0 none, 1 optimizer state, 2 + gradients, 3 + parameters."""
    offload: str | None = None
    """None, 'cpu' (shards and optimizer state in pinned host memory, CPU optimizer step) or 'auto'
    (a warm-up step measures memory, a search keeps on the GPU what fits the budget)."""
    chunk_mb: float | None = None
    """ZeRO chunk size in MiB of fp32; None searches the size with the least padding."""
    offload_budget_gb: float | None = None
    """GPU memory for model data under offload='auto', in GiB; None measures it (device memory
    minus the warm-up step's peak of other data)."""
    param_dtype: str | None = None
    """'bf16': the model's parameters are bf16 copies of fp32 master weights that ZeRO shards and
    updates, and the model runs in bf16 without autocast (FSDP2's ``param_dtype``, DeepSpeed's bf16,
    Megatron's bf16 with its distributed optimizer: norms, softmax and the residual stream in
    bf16 too). ZeRO-3 gathers the bf16 copies (half the gather traffic, gathered memory and host
    fetches under offload); ZeRO-1/2 all-gather the updated bf16 parameters after each step. No
    per-use casts; masters, optimizer state and the gradient reduction stay fp32. Needs zero >= 1
    and precision='bf16'. None keeps fp32 parameters under autocast (the serial model's
    numerics)."""
    precision: str = "fp32"
    """'fp32', 'bf16' (autocast, fp32 master weights) or 'fp16' (autocast + dynamic loss scaling)."""
    activation_checkpointing: bool = False
    """Recompute each transformer block's activations in backward instead of saving them."""
    bucket_mb: float = 100.0
    """Size of the data-parallel gradient buckets, in MiB."""
    compile: bool = False
    """Compile each transformer block with torch.compile (after activation checkpointing)."""

    def __post_init__(self) -> None:
        for name in ("tp", "tp_depth", "tp_overlap", "pp", "microbatches", "virtual_stages", "cp", "ep", "ep_overlap"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"Plan.{name}={v!r}: must be an integer >= 1; set {name}=1 to disable it.")
        if self.dp is not None and (not isinstance(self.dp, int) or isinstance(self.dp, bool) or self.dp < 1):
            raise ValueError(f"Plan.dp={self.dp!r}: must be an integer >= 1, or None to fill the world size.")
        _choice("tp_mode", self.tp_mode, TP_MODES)
        _choice("schedule", self.schedule, SCHEDULES)
        _choice("cp_mode", self.cp_mode, CP_MODES)
        _choice("offload", self.offload, OFFLOADS)
        _choice("precision", self.precision, PRECISIONS)
        if self.zero not in (0, 1, 2, 3) or isinstance(self.zero, bool):
            raise ValueError(f"Plan.zero={self.zero!r}: the ZeRO stage must be 0, 1, 2 or 3.")
        if not self.bucket_mb > 0:
            raise ValueError(f"Plan.bucket_mb={self.bucket_mb!r}: must be > 0 (100 is a good default).")
        self._check_tp_shape()
        if self.ep_overlap > 1 and self.ep == 1:
            raise ValueError(
                f"Plan.ep_overlap={self.ep_overlap} overlaps expert-parallel all-to-alls; there is none "
                f"with ep=1. Set ep > 1 or ep_overlap=1."
            )
        if self.sequence_parallel and (self.tp_mode != "1d" or self.tp == 1):
            raise ValueError(
                f"Plan.sequence_parallel=True needs 1D tensor parallelism with tp > 1; got tp={self.tp}, "
                f"tp_mode={self.tp_mode!r}. Use tp_mode='1d' with tp >= 2, or cp=... for context parallelism."
            )
        if self.virtual_stages > 1 and self.schedule != "interleaved":
            raise ValueError(
                f"Plan.virtual_stages={self.virtual_stages} only applies to schedule='interleaved'; "
                f"got schedule={self.schedule!r}. Set schedule='interleaved' or virtual_stages=1."
            )
        for name in ("chunk_mb", "offload_budget_gb"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0):
                raise ValueError(f"Plan.{name}={v!r}: must be a positive number, or None for the automatic choice.")
        if self.chunk_mb is not None and self.zero == 0:
            raise ValueError(
                f"Plan.chunk_mb={self.chunk_mb!r} sizes ZeRO chunks; got zero=0. Set zero=1, 2 or 3, or chunk_mb=None."
            )
        if self.offload_budget_gb is not None and self.offload != "auto":
            raise ValueError(
                f"Plan.offload_budget_gb={self.offload_budget_gb!r} is the budget of offload='auto'; "
                f"got offload={self.offload!r}. Set offload='auto', or offload_budget_gb=None."
            )
        if self.param_dtype is not None and (self.param_dtype != "bf16" or self.zero == 0 or self.precision != "bf16"):
            raise ValueError(
                f"Plan.param_dtype={self.param_dtype!r} (with zero={self.zero}, "
                f"precision={self.precision!r}): bf16 parameters need fp32 masters that ZeRO keeps, under "
                "precision='bf16'. Use param_dtype='bf16' with zero=1, 2 or 3 and precision='bf16', or "
                "param_dtype=None."
            )
        if self.offload is not None and self.zero == 0:
            raise ValueError(f"Plan.offload={self.offload!r} needs ZeRO sharding; got zero=0. Set zero=1, 2 or 3.")
        if self.dp is not None and self.dp % self.ep:
            raise ValueError(
                f"Plan.ep={self.ep} must divide dp={self.dp} (experts are sharded inside the data-parallel axis)."
            )

    def _check_tp_shape(self) -> None:
        tp, mode = self.tp, self.tp_mode
        if self.tp_depth > 1 and mode != "2.5d":
            raise ValueError(f"Plan.tp_depth={self.tp_depth} only applies to tp_mode='2.5d'; got {mode!r}.")
        if mode == "2d" and not _is_square(tp):
            q = math.isqrt(tp)
            raise ValueError(
                f"tp_mode='2d' needs a square tp degree (q*q); got tp={tp}. Use tp={q * q} or tp={(q + 1) ** 2}."
            )
        if mode == "3d" and _icbrt(tp) < 0:
            raise ValueError(f"tp_mode='3d' needs a cubic tp degree (q**3: 1, 8, 27, 64); got tp={tp}.")
        if mode == "2.5d":
            d = self.tp_depth
            if tp % d or not _is_square(tp // d):
                raise ValueError(
                    f"tp_mode='2.5d' needs tp = tp_depth * q*q; got tp={tp}, tp_depth={d} "
                    f"(tp/tp_depth={tp / d:g} is not a square integer). For example tp=8 with tp_depth=2."
                )
        if self.tp_overlap > 1 and tp == 1:
            raise ValueError(
                f"Plan.tp_overlap={self.tp_overlap} overlaps tensor-parallel communication; there is "
                f"none with tp=1. Set tp > 1 or tp_overlap=1."
            )
        if self.tp_overlap > 1 and mode not in ("1d", "3d"):
            raise ValueError(
                f"Plan.tp_overlap={self.tp_overlap} (over-decomposition to overlap communication) is "
                f"built for tp_mode '1d' and '3d', not {mode!r}; use tp_overlap=1 with tp_mode={mode!r}."
            )

    # -- degrees -----------------------------------------------------------------------
    @property
    def model_parallel_size(self) -> int:
        """Ranks that hold one replica of the model: pp * tp * cp."""
        return self.pp * self.tp * self.cp

    def resolve(self, world_size: int) -> Plan:
        """Return this plan with ``dp`` filled in for ``world_size``; check the degrees multiply to it."""
        if world_size < 1:
            raise ValueError(f"world_size={world_size}: must be >= 1.")
        mp = self.model_parallel_size
        if self.dp is None:
            if world_size % mp:
                raise ValueError(
                    f"world size {world_size} is not divisible by pp*tp*cp = {self.pp}*{self.tp}*{self.cp} "
                    f"= {mp}; launch a multiple of {mp} processes or lower those degrees."
                )
            return dataclasses.replace(self, dp=world_size // mp)
        if self.dp * mp != world_size:
            raise ValueError(
                f"Plan degrees dp*pp*tp*cp = {self.dp}*{self.pp}*{self.tp}*{self.cp} = {self.dp * mp} must "
                f"equal the world size {world_size}; set "
                f"dp={world_size // mp if world_size % mp == 0 else 'None'} or launch {self.dp * mp} "
                "processes."
            )
        return self

    def check_supported(self) -> None:
        """Raise NotImplementedError for a field whose capability has not been built yet, and
        ValueError for a combination of fields that breaks a composition rule."""
        self._check_pipeline_composes()

    def _check_pipeline_composes(self) -> None:
        """Pipeline parallelism composes with dp, ZeRO 0-3 and offload (each stage chunked over its own
        dp group, placed for its own memory), every tp mode, cp, activation checkpointing, compiled
        blocks, bf16 (autocast or ``param_dtype``) and fp16 (the overflow vote spans the stages);
        micro-batches < pp run correctly. Only interleaving without a pipeline is refused: an
        invalid plan (ValueError), since there are no stages to interleave."""
        if self.pp == 1 and self.virtual_stages > 1:
            raise ValueError(
                f"Plan.virtual_stages={self.virtual_stages} interleaves pipeline stages, but pp=1: interleaving "
                "needs a pipeline of 2 or more stages; set pp >= 2, or virtual_stages=1."
            )

    def describe(self) -> str:
        """One line naming every non-default degree, for logs."""
        parts = [f"dp={self.dp}"]
        defaults = Plan()
        for f in dataclasses.fields(self):
            if f.name == "dp":
                continue
            v = getattr(self, f.name)
            if v != getattr(defaults, f.name):
                parts.append(f"{f.name}={v!r}")
        return "Plan(" + ", ".join(parts) + ")"


def _choice(name: str, value, options) -> None:
    if value not in options:
        raise ValueError(f"Plan.{name}={value!r} is not one of {list(options)}.")

"""Generation (inference) predicted per tensor-parallel layout: decode latency a token, prefill
throughput, memory per GPU and the largest batch x context that fits, and where 2D's decode
overtakes 1D's as the GPUs grow.

**Decode step** (one token a row): ``max(device, host) + collectives``, serial (a decode step
has nothing to hide a collective behind):

* device: each Linear's GEMM of this rank's shapes at the calibration's rate, never faster than
  reading its weight block and activations at HBM speed (``Calibration.gemm_seconds``; a
  decode step's GEMMs are matrix-vector products, so this is the weights' read time), plus the
  KV cache read whole (the static cache's attention reads every slot of ``[b, K, L, D]`` a
  step) at HBM speed;
* host: zero when the step is compiled and replayed as one CUDA graph (``compiled=True``, the
  library's ``generate(compile=True)`` on GPUs); eager, the kernels it launches
  (``host_block_kernels * host_forward_share`` a block, as :mod:`.host` counts a block's
  forward) and each collective call's ``host_call_s`` and ``kernels_per_call`` (:mod:`.host`'s
  figures, by mode);
* collectives: each call of :func:`~.generation_bytes.forward_collectives` as it issues them,
  ``latency(group) + wire_bytes / bus_bw(group)`` on the link its axis runs on (``tp`` and
  ``tp_col`` contiguous, ``tp_row`` strided by q, ``tp_depth`` by q**2: NVLink within a node,
  the inter-node link across).

**Prefill**: the same sums over the prompt's tokens, with causal attention's flops against the
cache (``4 b H P L D``) at the calibration's attention rate.

**Memory**: :func:`~.generation_bytes.generation_memory` with the weights of
:func:`.params.local_params` and :func:`.reserve.device_reserve`.

What it leaves out (and so predicts faster than a run): the norms', rotary's and sampling's
elementwise kernels, and the gaps between a CUDA graph's kernels. Pure; tested in
tests/unit/test_planner_generation.py and, the bytes and memory, tests/dist/test_planner_generation_ledger.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..plan import Plan
from .calibration import Calibration
from .cluster import Cluster
from .generation_bytes import (
    Call,
    batch_parts,
    block_linears,
    forward_collectives,
    generation_memory,
    padded_rows,
    stationary_is_cheaper,
)
from .params import local_params
from .reserve import device_reserve
from .traffic import tp_grid
from .workload import Workload

__all__ = [
    "GenerationPrediction",
    "Layout",
    "overtakes",
    "format_generation",
    "format_scale",
    "generation_layouts",
    "predict_generation",
    "scale_generation",
]

GIB = 2.0**30


@dataclass(frozen=True)
class Layout:
    """A tensor-parallel layout of one tp group."""

    tp: int
    mode: str = "1d"
    depth: int = 1
    sequence_parallel: bool = False

    def plan(self) -> Plan:
        return Plan(
            tp=self.tp,
            tp_mode=self.mode if self.tp > 1 else "1d",
            tp_depth=self.depth,
            sequence_parallel=self.sequence_parallel,
        ).resolve(self.tp)

    def describe(self) -> str:
        if self.tp == 1:
            return "tp 1"
        name = {"1d": "1D", "2d": "2D", "2.5d": f"2.5D d{self.depth}", "3d": "3D"}[self.mode]
        return f"{name} tp {self.tp}" + (" +SP" if self.sequence_parallel else "")

    def axes(self) -> dict[str, tuple[int, int]]:
        """``axis -> (size, stride)`` in the tp group (``mesh.py``: tp_depth x tp_row x tp_col, tp_col innermost)."""
        q, d = tp_grid(self.tp, self.mode, self.depth)
        if self.tp == 1 or self.mode == "1d":
            return {"tp": (self.tp, 1)}
        return {"tp": (self.tp, 1), "tp_col": (q, 1), "tp_row": (q, q), "tp_depth": (d, q * q)}


def generation_layouts(shape, gpus: int) -> list[Layout]:
    """Every tensor-parallel layout of ``gpus`` ranks in one tp group that the shape divides:
    1D (± sequence parallelism, which only the prefill uses), 2D, each 2.5D depth, 3D."""
    out = []
    if gpus == 1:
        return [Layout(1)]

    def divides(n: int) -> bool:
        return shape.num_heads % n == 0 and shape.hidden % n == 0 and shape.ffn_hidden % n == 0

    def kv_ok(n: int) -> bool:
        return shape.num_kv_heads % n == 0 or n % shape.num_kv_heads == 0

    if divides(gpus) and kv_ok(gpus):
        out += [Layout(gpus, "1d"), Layout(gpus, "1d", sequence_parallel=True)]
    for mode in ("2d", "2.5d", "3d"):
        for d in range(1, gpus + 1) if mode == "2.5d" else (1,):
            try:
                q, _ = tp_grid(gpus, mode, d)
            except ValueError:
                continue
            if (mode == "2.5d" and (d == 1 or q == 1)) or not divides(q) or shape.vocab_size % q:
                continue
            if mode == "3d" and shape.num_kv_heads % q:
                continue
            if mode != "3d" and not kv_ok(q):
                continue
            out.append(Layout(gpus, mode, d))
    return out


@dataclass(frozen=True)
class GenerationPrediction:
    layout: Layout
    batch: int
    """Rows of all the data-parallel copies."""
    replicas: int
    """Data-parallel copies of the tp group."""
    prompt: int
    new_tokens: int
    decode_s: float
    """Seconds of one decode step (one token for each row)."""
    decode_device_s: float
    decode_host_s: float
    decode_comm_s: float
    decode_calls: int
    prefill_s: float
    prefill_comm_s: float
    weights_bytes: float
    kv_bytes: float
    memory_bytes: float
    fits: bool
    max_batch: int
    """Rows that fit in one tp group at this context (prompt + new tokens)."""
    max_context: int
    """Slots (prompt + new tokens) that fit at this batch."""

    @property
    def decode_tokens_per_s(self) -> float:
        return self.batch / self.decode_s

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.batch * self.prompt / self.prefill_s


def _calls_seconds(calls: list[Call], layout: Layout, cluster: Cluster) -> float:
    axes = layout.axes()
    total = 0.0
    for c in calls:
        size, stride = axes[c.axis]
        if c.op == "exchange":
            total += cluster.calibration.p2p_seconds(cluster.link(2, stride * size), c.wire)
        else:
            total += cluster.collective_seconds(size, stride, c.wire)
    return total


def _gemms(shape, layout: Layout, rows: int, seq: int, cal: Calibration, eb: int) -> float:
    """Seconds of one forward's GEMMs on a rank: every block's Linears and the head (last
    position only), in this rank's shapes and the form the layout's no-grad Linear takes."""
    tp, mode = layout.tp, layout.mode
    q, d = tp_grid(tp, mode, layout.depth)
    kv_rep = shape.num_kv_heads < (tp if mode == "1d" else q) and shape.num_kv_heads != shape.num_heads

    def one(tokens: int, fin: int, fout: int, kv: bool = False) -> float:
        if tp == 1:
            return cal.gemm_seconds(tokens, fout, fin, eb)
        if mode == "1d":
            # column: out/tp; row: in/tp; replicated k/v projections whole on every rank
            if kv and kv_rep:
                return cal.gemm_seconds(tokens, fout, fin, eb)
            row = fin != shape.hidden
            return cal.gemm_seconds(tokens, fout // (1 if row else tp), fin // (tp if row else 1), eb)
        if mode == "3d":
            r, n_in, n_out = tokens // q**2, fin // q, fout // q**2
            stationary = r * (q * n_in + n_out) < n_in * n_out
            # stationary: the input gathered over the input axis and depth, times the weight block;
            # SUMMA-like: the gathered input block times the gathered weight
            if stationary:
                return cal.gemm_seconds(q * q * r, n_out, n_in, eb)
            return cal.gemm_seconds(q * r, fout // q, n_in, eb)
        b = tokens // (q * d)
        n_in, n_out = fin // q, (shape.head_dim if kv and kv_rep else fout // q)
        if q > 1 and stationary_is_cheaper(b, n_in, n_out, q):
            return cal.gemm_seconds(q * b, n_out, n_in, eb)
        return cal.gemm_seconds(b, n_out, fin, eb)

    block = 0.0
    for i, (fin, fout) in enumerate(block_linears(shape)):
        block += one(rows * seq, fin, fout, kv=(not shape.fused_qkv and i in (1, 2)))
    return shape.num_layers * block + one(rows, shape.hidden, shape.vocab_size)


def _host_seconds(shape, calls: list[Call], layout: Layout, cal: Calibration) -> float:
    """Eager host issue time of one forward (:mod:`.host`'s figures)."""
    mode = layout.mode if layout.tp > 1 else "1d"
    kernels = shape.num_layers * cal.host_block_kernels * cal.host_forward_share
    per_call = cal.host_call_s.get(mode, cal.host_call_s.get("1d", 0.0))
    k_call = cal.kernels_per_call.get(mode, cal.kernels_per_collective)
    return kernels * cal.host_kernel_s + len(calls) * (per_call + k_call * cal.host_kernel_s)


def predict_generation(
    w: Workload,
    layout: Layout,
    cluster: Cluster,
    *,
    batch: int,
    prompt: int,
    new_tokens: int,
    dtype_bytes: int = 2,
    compiled: bool = True,
    replicas: int = 1,
) -> GenerationPrediction:
    """Predict generating ``new_tokens`` after a ``prompt``-token prompt for ``batch`` rows on
    ``replicas`` data-parallel copies of one tp group of ``layout`` (each taking ``batch /
    replicas`` rows, rounded up; the decode step at the last slot: its KV read is the whole static
    cache from the first step). Tokens/s count the ``batch`` rows of all the copies."""
    total_batch, batch = batch, -(-batch // replicas)
    shape, cal = w.shape, cluster.calibration
    tp, mode, depth = layout.tp, layout.mode, layout.depth
    rows = padded_rows(batch, tp, mode, depth)
    kw = dict(rows=rows, tp=tp, mode=mode, depth=depth, dtype_bytes=dtype_bytes)
    dec_calls = forward_collectives(w.shape, seq=1, **kw)
    pre_calls = forward_collectives(w.shape, seq=prompt, sequence_parallel=layout.sequence_parallel, **kw)
    plan = layout.plan()
    weights = local_params(plan, w) * dtype_bytes

    def memory(b: int, length: int):
        return generation_memory(
            shape,
            weights=weights,
            batch=b,
            prompt=min(prompt, length),
            new_tokens=max(0, length - prompt),
            tp=tp,
            mode=mode,
            depth=depth,
            dtype_bytes=dtype_bytes,
            reserve=lambda allocated: device_reserve(plan, cal, allocated),
        )

    mem = memory(batch, prompt + new_tokens)
    kv_read = mem.kv_cache / cal.hbm_bytes_per_s
    device = _gemms(shape, layout, rows, 1, cal, dtype_bytes) + kv_read
    host = 0.0 if compiled else _host_seconds(shape, dec_calls, layout, cal)
    comm = _calls_seconds(dec_calls, layout, cluster)
    decode = max(device, host) + comm

    q, d = tp_grid(tp, mode, depth)
    local_rows = rows // batch_parts(tp, mode, depth)
    heads = shape.num_heads // (tp if mode == "1d" else q)
    length = prompt + new_tokens
    attn_flops = 4 * local_rows * heads * prompt * length * shape.head_dim * shape.num_layers
    pre_device = _gemms(shape, layout, rows, prompt, cal, dtype_bytes) + attn_flops / cal.attention_rate(prompt)[0]
    pre_host = 0.0 if compiled else _host_seconds(shape, pre_calls, layout, cal)
    pre_comm = _calls_seconds(pre_calls, layout, cluster)
    prefill = max(pre_device, pre_host) + pre_comm

    cap = cluster.memory_bytes
    max_batch = _largest(lambda b: memory(b, length).total <= cap)
    max_context = _largest(lambda n: memory(batch, n).total <= cap)
    return GenerationPrediction(
        layout=layout,
        batch=total_batch,
        replicas=replicas,
        prompt=prompt,
        new_tokens=new_tokens,
        decode_s=decode,
        decode_device_s=device,
        decode_host_s=host,
        decode_comm_s=comm,
        decode_calls=len(dec_calls),
        prefill_s=prefill,
        prefill_comm_s=pre_comm,
        weights_bytes=weights,
        kv_bytes=mem.kv_cache,
        memory_bytes=mem.total,
        fits=mem.total <= cap,
        max_batch=max_batch,
        max_context=max_context,
    )


def _largest(ok, limit: int = 1 << 24) -> int:
    """The largest n >= 1 with ``ok(n)`` (monotone), 0 if none, up to ``limit``."""
    if not ok(1):
        return 0
    lo, hi = 1, 2
    while hi <= limit and ok(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def format_generation(preds: list[GenerationPrediction]) -> str:
    """One row per layout: decode ms a token, tokens/s, prefill tokens/s, GiB per GPU, what fits."""
    head = (
        f"{'layout':<16} {'decode ms':>10} {'(device/host/comm)':>22} {'calls':>6} {'decode tok/s':>13} "
        f"{'prefill tok/s':>14} {'weights GiB':>12} {'KV GiB':>8} {'total GiB':>10} {'fits':>5} "
        f"{'max batch':>10} {'max context':>12}"
    )
    lines = [head]
    for p in preds:
        split = f"{p.decode_device_s * 1e3:.2f}/{p.decode_host_s * 1e3:.2f}/{p.decode_comm_s * 1e3:.2f}"
        lines.append(
            f"{p.layout.describe():<16} {p.decode_s * 1e3:>10.3f} {split:>22} {p.decode_calls:>6} "
            f"{p.decode_tokens_per_s:>13,.0f} {p.prefill_tokens_per_s:>14,.0f} {p.weights_bytes / GIB:>12.2f} "
            f"{p.kv_bytes / GIB:>8.2f} {p.memory_bytes / GIB:>10.2f} {'yes' if p.fits else 'no':>5} "
            f"{p.max_batch:>10,} {p.max_context:>12,}"
        )
    return "\n".join(lines)


def scale_generation(
    w: Workload,
    cluster: Cluster,
    gpu_counts=(4, 16, 64, 256, 1024),
    *,
    batch: int,
    prompt: int,
    new_tokens: int,
    modes=("1d", "2d"),
    dtype_bytes: int = 2,
    compiled: bool = True,
    gpus_per_node: int = 8,
) -> dict[int, dict[str, GenerationPrediction | None]]:
    """Per GPU count (one tp group over all of them, on NVLink islands of ``gpus_per_node``;
    ``cluster``'s memory and calibration, its inter-node figures) and mode, the
    prediction (1D without sequence parallelism; beyond the model's heads, the widest 1D group
    that divides them, copied over data parallelism as Megatron would run it; None where the
    mode has no layout there)."""
    out: dict[int, dict[str, GenerationPrediction | None]] = {}
    for n in gpu_counts:
        c = Cluster(
            num_gpus=n,
            gpus_per_node=min(gpus_per_node, n),
            gpu_bytes=cluster.gpu_bytes,
            host_bytes=cluster.host_bytes,
            calibration=cluster.calibration,
        )
        layouts = {lay.mode: (lay, 1) for lay in generation_layouts(w.shape, n) if not lay.sequence_parallel}
        if "1d" not in layouts:  # 1D beyond the heads: the widest tp group that divides, copied over dp
            fits = [t for t in range(1, n + 1) if n % t == 0 and Layout(t) in generation_layouts(w.shape, t)]
            layouts["1d"] = (Layout(fits[-1]), n // fits[-1])
        out[n] = {
            m: predict_generation(
                w,
                layouts[m][0],
                c,
                batch=batch,
                prompt=prompt,
                new_tokens=new_tokens,
                dtype_bytes=dtype_bytes,
                compiled=compiled,
                replicas=layouts[m][1],
            )
            if m in layouts
            else None
            for m in modes
        }
    return out


def overtakes(
    sweep: dict[int, dict[str, GenerationPrediction | None]], mode: str = "2d", metric: str = "decode_tokens_per_s"
) -> int | None:
    """The smallest GPU count of ``sweep`` at which ``mode`` predicts more ``metric``
    (``decode_tokens_per_s`` or ``prefill_tokens_per_s``) than 1D (None: never in the sweep; a
    count where either has no layout compares nothing)."""
    for n in sorted(sweep):
        a, b = sweep[n].get(mode), sweep[n].get("1d")
        if a is not None and b is not None and getattr(a, metric) > getattr(b, metric):
            return n
    return None


def format_scale(sweep: dict[int, dict[str, GenerationPrediction | None]], optimus_gpus: int = 64) -> str:
    """The sweep as a table (decode ms, prefill tokens/s, 2D / 1D speed-ups), where 2D's decode
    overtakes 1D's, and the reading at Optimus's GPU count (their claim: 1.78x 1D's inference)."""
    lines = [
        f"{'GPUs':>6} {'1D layout':>20} {'1D decode ms':>13} {'2D decode ms':>13} {'2D/1D decode':>13} "
        f"{'1D prefill tok/s':>17} {'2D prefill tok/s':>17} {'2D/1D prefill':>14}"
    ]

    def f(p, attr, scale=1.0, fmt="{:>13.3f}"):
        return fmt.format(getattr(p, attr) * scale) if p is not None else f"{'-':>{len(fmt.format(0.0))}}"

    for n in sorted(sweep):
        a, b = sweep[n].get("1d"), sweep[n].get("2d")
        dec = f"{b.decode_tokens_per_s / a.decode_tokens_per_s:>12.2f}x" if a and b else f"{'-':>13}"
        pre = f"{b.prefill_tokens_per_s / a.prefill_tokens_per_s:>13.2f}x" if a and b else f"{'-':>14}"
        lay = f"{a.layout.describe()}" + (f" x{a.replicas} (dp)" if a and a.replicas > 1 else "") if a else "-"
        lines.append(
            f"{n:>6} {lay:>20} {f(a, 'decode_s', 1e3)} {f(b, 'decode_s', 1e3)} {dec} "
            f"{f(a, 'prefill_tokens_per_s', 1.0, '{:>17,.0f}')} {f(b, 'prefill_tokens_per_s', 1.0, '{:>17,.0f}')} {pre}"
        )
    for metric, what in (("decode_tokens_per_s", "decode"), ("prefill_tokens_per_s", "prefill")):
        g = overtakes(sweep, "2d", metric)
        lines.append(
            f"2D's {what} overtakes 1D's " + (f"from {g} GPUs" if g else "nowhere in this sweep") + " (predicted)"
        )
    row = sweep.get(optimus_gpus, {})
    a, b = row.get("1d"), row.get("2d")
    if a and b:
        pre = b.prefill_tokens_per_s / a.prefill_tokens_per_s
        dec = b.decode_tokens_per_s / a.decode_tokens_per_s
        verdict = "agrees with" if pre > 1.0 else "does not reproduce"
        lines.append(
            f"at {optimus_gpus} GPUs (Optimus's setting; their claim: 2D 1.78x Megatron's 1D in inference, a "
            f"full forward): predicted 2D/1D {pre:.2f}x in a prefill (a full forward of the prompts), "
            f"{dec:.2f}x in a decode step -- the prefill {verdict} the claim's direction"
        )
    return "\n".join(lines)

"""Where a training step's time goes, for any ``step()`` callable: torch.profiler over N steps, and
the host's waits for the device counted op by op over one step.

:func:`profile_steps` prints, for this rank, one ``PROFILE {json}`` line and two tables:

* the top CUDA kernels by total time (count, total ms, share of the device-busy time), the
  top CPU ops by self time (count, self ms), and the ranges the code annotates
  (``record_function``: an MoE layer's ``behemoth::moe_route``, ``behemoth::moe_exchange``,
  ``behemoth::moe_balance``), host and GPU time;
* per step: the wall time, the device's busy time (the union of every kernel's and copy's
  interval on this rank's GPU, NCCL's included; wall less busy is the time the GPU waited, for the
  host or for a peer), the NCCL kernels' summed time, the device-to-host copies
  (``Memcpy DtoH``) and the host's synchronisations the CUDA runtime records
  (``cudaStreamSynchronize``, ``cudaEventSynchronize``, ``cudaDeviceSynchronize``, a blocking
  ``cudaMemcpy``);
* ``host_reads``: the same step's reads of device values to the host as the code asks for them
  (:class:`HostReads`: ``item``/``tolist``/``nonzero``/``bincount``/``repeat_interleave``
  without ``output_size``/a copy to the CPU ...), by op and device -- on the CPU too, where
  nothing waits but the count is the same code's: the places that would wait on a GPU.

Used by bench_moe.py ``--profile N``; the chrome trace is kept with ``--trace DIR``.
"""

from __future__ import annotations

import collections
import gzip
import json
import os
import shutil
import tempfile
import time
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

RUNTIME_SYNCS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize", "cudaMemcpy")
"""CUDA runtime calls that block the host until the device has caught up (``cudaMemcpy``: the
blocking form, not ``cudaMemcpyAsync``)."""

_WAITING_OPS = {
    "aten._local_scalar_dense": "item",
    "aten.nonzero": "nonzero",
    "aten.masked_select": "masked_select",
    "aten.bincount": "bincount",
    "aten._unique2": "unique",
    "aten.unique_dim": "unique",
    "aten.unique_consecutive": "unique",
    "aten.index_put_": None,  # waits only with a boolean mask (checked below)
    "aten.index.Tensor": None,  # the same
}


class HostReads(TorchDispatchMode):
    """Counts, while active, the ops that read a device value to the host (each a wait for the
    device on a GPU) by name and device, and every ATen op (``ops``). ``Tensor.tolist`` (which
    reaches the dispatcher only for a device tensor) is counted by wrapping it. Follows the
    backward into autograd's threads (dispatch modes are part of the thread-local state)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.reads: collections.Counter = collections.Counter()
        self.sites: collections.Counter = collections.Counter()
        """The same reads by where behemoth's code asked for them (its innermost frame)."""
        self._tolist = None
        self._inside_tolist = False

    def _read(self, kind: str) -> None:
        self.reads[kind] += 1
        site = "?"
        for frame in reversed(traceback.extract_stack()[:-2]):
            if f"{os.sep}behemoth{os.sep}" in frame.filename:
                site = f"{frame.filename.split(os.sep + 'behemoth' + os.sep)[-1]}:{frame.lineno}"
                break
        self.sites[f"{kind} @ {site}"] += 1

    def __enter__(self):
        real = torch.Tensor.tolist

        def tolist(t, *args, **kwargs):
            self._read(f"tolist({t.device.type})")
            self._inside_tolist = True  # its copy to the host is this read, not another
            try:
                return real(t, *args, **kwargs)
            finally:
                self._inside_tolist = False

        self._tolist = real
        torch.Tensor.tolist = tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops += 1
        packet = str(func.overloadpacket).replace("::", ".")
        name = f"{packet}.{func._overloadname}" if packet == "aten.index" else packet
        kind = _WAITING_OPS.get(name, _WAITING_OPS.get(packet, "-"))
        dev = next((a.device.type for a in args if isinstance(a, torch.Tensor)), "?")
        if kind is None:  # indexing with a boolean mask: a nonzero inside
            indices = args[1] if len(args) > 1 else ()
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ()):
                self._read(f"bool-mask {packet}({dev})")
        elif kind != "-":
            self._read(f"{kind}({dev})")
        elif (
            packet == "aten.repeat_interleave" and func._overloadname == "Tensor" and kwargs.get("output_size") is None
        ):
            self._read(f"repeat_interleave without output_size({dev})")
        elif packet in ("aten._to_copy", "aten.copy_") and not self._inside_tolist:
            copy = packet == "aten.copy_"
            src = args[1] if copy else args[0]
            dst = args[0].device if copy else kwargs.get("device") or src.device
            if isinstance(src, torch.Tensor) and src.device.type != "cpu" and torch.device(dst).type == "cpu":
                non_blocking = (args[2] if len(args) > 2 else kwargs.get("non_blocking", False)) if copy else None
                non_blocking = kwargs.get("non_blocking", False) if non_blocking is None else non_blocking
                self._read("device-to-host copy" + (" (non-blocking)" if non_blocking else ""))
        return func(*args, **kwargs)


def count_host_reads(step) -> dict:
    """``{"aten_ops": n, "host_reads": {kind: n}, "host_read_sites": {"kind @ file:line": n}}``
    of one call of ``step()`` (the sites: behemoth's innermost frame asking)."""
    with HostReads() as counter:
        step()
    return {
        "aten_ops": counter.ops,
        "host_reads": dict(sorted(counter.reads.items())),
        "host_read_sites": dict(sorted(counter.sites.items())),
    }


def busy(spans) -> float:
    """Length of the union of ``[start, end)`` spans."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def _device_event(e) -> bool:
    """A kernel, copy or memset on the GPU (not an annotation spanning them: "ProfilerStep#",
    ProcessGroupNCCL's "nccl:all_reduce")."""
    return (
        e.device_type == torch.autograd.DeviceType.CUDA
        and not getattr(e, "is_user_annotation", False)
        and "#" not in e.key
        and not e.key.startswith("nccl:")
    )


def _table(title: str, rows: list[tuple[str, int, float]], total_ms: float | None) -> str:
    lines = [title, f"{'ms':>10} {'share':>6} {'count':>7}  name"]
    for name, count, ms in rows:
        share = f"{100 * ms / total_ms:5.1f}%" if total_ms else "     -"
        lines.append(f"{ms:10.2f} {share:>6} {count:7d}  {name[:110]}")
    return "\n".join(lines)


def _ranges(ranges: dict, wall_ms: float, cuda: bool) -> str:
    """The table of the ranges code annotated (``record_function``: behemoth's MoE layers name
    their routing, exchange and balancing statistics), host and GPU time (the span from the range's
    first kernel to its last, idle gaps included) against the profiled wall time."""
    lines = ["annotated ranges (host ms: the time the host spent inside; GPU span ms: first to last kernel)"]
    lines.append(f"{'host ms':>10} {'share':>6} {'GPU ms':>10} {'count':>7}  name")
    for name, (count, host, gpu) in sorted(ranges.items(), key=lambda kv: -kv[1][1]):
        gpu_text = f"{gpu:10.2f}" if cuda else f"{'-':>10}"
        lines.append(f"{host:10.2f} {100 * host / wall_ms:5.1f}% {gpu_text} {count:7d}  {name[:100]}")
    return "\n".join(lines)


def profile_steps(
    step, steps: int, dev: torch.device, rank: int, trace_dir: str | None = None, top: int = 15, label: str = "trace"
):
    """Run ``step()`` ``steps`` times under torch.profiler (CPU and, on a GPU, CUDA activity), then
    once more under :class:`HostReads`; print this rank's tables and ``PROFILE`` line (see the
    module docstring) and return the line's dict. Every rank of a job calls it (``step`` is
    collective); each prints its own (the ranks of a pipeline differ). ``trace_dir``: where each
    rank's chrome trace goes (``{label}_rank{rank}.json.gz``)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = dev.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync()
    issue = 0.0
    with profile(activities=activities) as prof:
        t = time.perf_counter()
        for _ in range(steps):
            t0 = time.perf_counter()
            step()
            issue += time.perf_counter() - t0
        sync()
        wall = time.perf_counter() - t
    counted = count_host_reads(step)
    sync()
    events = prof.events()
    kernels: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
    cpu_ops: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
    spans, nccl_us, d2h, runtime = [], 0.0, 0, collections.Counter()
    ranges: dict[str, list] = collections.defaultdict(lambda: [0, 0.0, 0.0])  # count, host ms, GPU span ms
    for e in events:
        if getattr(e, "is_user_annotation", False) and "#" not in e.key:
            r = ranges[e.key]
            if e.device_type == torch.autograd.DeviceType.CUDA:
                r[2] += e.time_range.elapsed_us() / 1e3
            else:
                r[0], r[1] = r[0] + 1, r[1] + e.time_range.elapsed_us() / 1e3
            continue
        if _device_event(e):
            dur = e.time_range.elapsed_us()
            spans.append((e.time_range.start, e.time_range.end))
            k = kernels[e.key]
            k[0], k[1] = k[0] + 1, k[1] + dur
            if "nccl" in e.key.lower():
                nccl_us += dur
            if e.key.startswith("Memcpy DtoH"):
                d2h += 1
        elif e.device_type == torch.autograd.DeviceType.CPU:
            if e.key in RUNTIME_SYNCS:
                runtime[e.key] += 1
            c = cpu_ops[e.key]
            c[0], c[1] = c[0] + 1, c[1] + e.self_cpu_time_total
    busy_ms = busy(spans) / 1e3
    top_kernels = sorted(((n, c, us / 1e3) for n, (c, us) in kernels.items()), key=lambda r: -r[2])[:top]
    top_cpu = sorted(((n, c, us / 1e3) for n, (c, us) in cpu_ops.items()), key=lambda r: -r[2])[:top]
    per_step = 1.0 / steps
    line = dict(
        what="profile",
        rank=rank,
        steps=steps,
        step_wall_ms=round(wall * 1e3 * per_step, 2),
        host_issue_ms=round(issue * 1e3 * per_step, 2),
        gpu_busy_ms=round(busy_ms * per_step, 2) if cuda else None,
        gpu_busy_share=round(busy_ms / (wall * 1e3), 3) if cuda else None,
        nccl_kernel_ms=round(nccl_us / 1e3 * per_step, 2) if cuda else None,
        kernels_per_step=round(sum(c for c, _ in kernels.values()) * per_step, 1) if cuda else None,
        d2h_copies_per_step=round(d2h * per_step, 1) if cuda else None,
        runtime_syncs_per_step={k: round(v * per_step, 1) for k, v in sorted(runtime.items())} if cuda else None,
        **counted,
    )
    print(
        f"\n=== rank {rank}: {steps} profiled steps on {dev} (the tables: totals over them) ===\n"
        + (_table(f"top {top} CUDA kernels by total time", top_kernels, busy_ms) + "\n" if cuda else "")
        + _table(f"top {top} CPU ops by self time", top_cpu, wall * 1e3)
        + "\n"
        + _ranges(ranges, wall * 1e3, cuda)
        + "\nPROFILE "
        + json.dumps(line),
        flush=True,
    )
    if trace_dir:
        os.makedirs(trace_dir, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            raw = os.path.join(tmp, "trace.json")
            prof.export_chrome_trace(raw)
            with open(raw, "rb") as f, gzip.open(os.path.join(trace_dir, f"{label}_rank{rank}.json.gz"), "wb") as g:
                shutil.copyfileobj(f, g)
    return line

"""The speed guard: behemoth's headline GPU runs and their stock-PyTorch peers in one device call.

Each run is one ``torchrun --standalone`` of a benchmark script of this directory that prints a
``RESULT {json}`` line. ``--trees`` names one or more source trees (a directory holding ``src/``
and ``benchmarks/``, e.g. this checkout and an older commit unpacked with ``git archive``): every
behemoth run is made once per tree, back to back, with that tree's own scripts and ``src/`` (so an
API change between the trees does not matter); peers run once. The table printed last gives each
figure, its ratio to the first tree's, and its ratio to its peer; ``benchmarks/baseline.json``
holds the last recorded figure of each run, and a ratio to the peer that fell by more than 5%
against the recorded one is flagged. After recording new figures there, ``python3
benchmarks/report.py`` regenerates the tables in README.md and RESULTS.md and the chart from it
(tests/unit/test_perf_report.py fails until it has).

    python3 benchmarks/guard.py --runs dp2,zero3bf16_2,fsdp2 --trees . baseline
    python3 benchmarks/guard.py --list

Results: the table on stdout and ``$OUT/guard.json`` (every RESULT line) when ``OUT`` is set.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))


@dataclass(frozen=True, kw_only=True)
class Run:
    """One headline run."""

    name: str
    """Short key, used by ``--runs`` and in baseline.json."""
    gpus: int
    """Processes (one GPU each)."""
    script: str
    """Script under the tree's benchmarks/ directory."""
    args: tuple[str, ...]
    """Its arguments."""
    metric: str = "tflops_gpu"
    """The RESULT field compared (higher is better)."""
    peer: str | None = None
    """The run (a peer) this one is compared with."""
    is_peer: bool = False
    """A stock-PyTorch peer: run once, from the first tree."""
    env: dict[str, str] = field(default_factory=dict)


G13 = ("--size", "gpt-1.3b", "--mbs", "8")
CP13 = ("--size", "gpt-1.3b", "--mbs", "1")  # one sequence of --seq tokens per cp group


def cp_run(cp: int, mode: str, seq: int) -> Run:
    """GPT-1.3B's context parallelism over ``cp`` GPUs (``mode``: ulysses or ring) at ``seq`` tokens,
    beside the stock 16k run."""
    return Run(
        name=f"cp{cp}_{mode}",
        gpus=cp,
        script="bench_cp.py",
        args=(*CP13, "--cp", str(cp), "--mode", mode, "--seq", str(seq)),
        peer="stock_16k",
    )


RUNS = [
    Run(name="fsdp2_2", gpus=2, script="peer_baseline.py", args=("--size", "1.3b", "--mode", "fsdp"), is_peer=True),
    Run(name="fsdp2_4", gpus=4, script="peer_baseline.py", args=("--size", "1.3b", "--mode", "fsdp"), is_peer=True),
    Run(name="single", gpus=1, script="bench_gpt.py", args=G13),
    Run(name="dp2", gpus=2, script="bench_gpt.py", args=G13, peer="fsdp2_2"),
    Run(
        name="zero3bf16_2",
        gpus=2,
        script="bench_gpt.py",
        args=(*G13, "--zero", "3", "--param-dtype", "bf16"),
        peer="fsdp2_2",
    ),
    Run(
        name="tp2_overlap_compiled",
        gpus=2,
        script="bench_gpt.py",
        args=("--size", "gpt-1.3b", "--mbs", "16", "--tp", "2", "--tp-overlap", "2", "--compile"),
        peer="fsdp2_2",
    ),
    Run(
        name="zero3bf16_4",
        gpus=4,
        script="bench_gpt.py",
        args=(*G13, "--zero", "3", "--param-dtype", "bf16"),
        peer="fsdp2_4",
    ),
    Run(name="tp2_1d", gpus=2, script="bench_gpt.py", args=(*G13, "--tp", "2"), peer="fsdp2_2"),
    Run(name="tp4_1d", gpus=4, script="bench_gpt.py", args=(*G13, "--tp", "4"), peer="fsdp2_4"),
    Run(name="tp4_2d", gpus=4, script="bench_gpt.py", args=(*G13, "--tp", "4", "--tp-mode", "2d"), peer="fsdp2_4"),
    Run(
        name="tp4_2d_compiled",
        gpus=4,
        script="bench_gpt.py",
        args=(*G13, "--tp", "4", "--tp-mode", "2d", "--compile"),
        peer="fsdp2_4",
    ),
    Run(
        name="stock_16k",
        gpus=1,
        script="peer_baseline.py",
        args=("--size", "1.3b", "--mode", "ddp", "--mbs", "1", "--seq", "16384"),
        is_peer=True,
    ),
    Run(name="single_16k", gpus=1, script="bench_cp.py", args=(*CP13, "--cp", "1", "--seq", "16384"), peer="stock_16k"),
    cp_run(2, "ulysses", 32768),
    cp_run(4, "ring", 65536),
    cp_run(4, "ulysses", 65536),
    Run(
        name="offload_6.9b",
        gpus=1,
        script="bench_gpt.py",
        args=(
            "--size",
            "gpt-6.7b",
            "--mbs",
            "8",
            "--zero",
            "3",
            "--offload",
            "auto",
            "--param-dtype",
            "bf16",
            "--ckpt",
            "--host-init",
        ),
    ),
    Run(
        name="pp4_1f1b",
        gpus=4,
        script="bench_pp.py",
        args=("--size", "gpt-2.7b", "--schedule", "1f1b"),
        metric="vs_ideal",
    ),
]
BY_NAME = {r.name: r for r in RUNS}


def launch(run: Run, tree: str, timeout: int) -> dict | None:
    """One torchrun of ``run`` with ``tree``'s scripts and sources; its RESULT dict, or None."""
    env = {
        **os.environ,
        "PYTHONPATH": os.path.join(os.path.abspath(tree), "src"),
        "PYTHONUNBUFFERED": "1",
        "NCCL_NVLS_ENABLE": "0",
        "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
        **run.env,
    }
    script = os.path.join(os.path.abspath(tree), "benchmarks", run.script)
    cmd = ["torchrun", "--standalone", "--nproc-per-node", str(run.gpus), script, *run.args]
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        out = proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        out += f"\nTIMEOUT after {timeout} s"
    lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    print(f"# {run.name} [{tree}] {time.time() - t0:.0f} s", flush=True)
    if not lines:
        print("\n".join(out.splitlines()[-15:]), flush=True)
        return None
    return json.loads(lines[-1][len("RESULT ") :])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", default=",".join(r.name for r in RUNS), help="comma-separated run names")
    p.add_argument("--trees", nargs="+", default=["."], help="source trees (each with src/ and benchmarks/)")
    p.add_argument("--timeout", type=int, default=240, help="seconds per run")
    p.add_argument("--list", action="store_true", help="print the runs and exit")
    a = p.parse_args()
    if a.list:
        for r in RUNS:
            print(f"{r.name:24s} {r.gpus} GPU  {r.script} {' '.join(r.args)}")
        return
    names = [n for n in a.runs.split(",") if n]
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        sys.exit(f"unknown run(s) {unknown}; --list shows them")
    import torch  # only to count the cards

    have = torch.cuda.device_count()
    results: dict[str, dict[str, dict | None]] = {}
    for n in names:
        run = BY_NAME[n]
        if run.gpus > have:
            print(f"# {n}: needs {run.gpus} GPUs, {have} here: skipped", flush=True)
            continue
        trees = a.trees[:1] if run.is_peer else a.trees
        results[n] = {t: launch(run, t, a.timeout) for t in trees}
    baseline_path = os.path.join(HERE, "baseline.json")
    recorded = json.load(open(baseline_path)) if os.path.exists(baseline_path) else {}
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "guard.json"), "w") as f:
            json.dump(results, f, indent=1)
    card = torch.cuda.get_device_name(0) if have else "no GPU"
    print(f"\n{card} x{have}")
    head = " | ".join(a.trees)
    print(f"| run | GPUs | metric | {head} | vs first tree | vs peer | recorded vs peer | flag |")
    print("|---|---|---|" + "---|" * len(a.trees) + "---|---|---|---|")
    for n, per_tree in results.items():
        run = BY_NAME[n]
        vals = [(per_tree.get(t) or {}).get(run.metric) for t in a.trees]
        first = vals[0]
        rel = " / ".join(f"{v / first:.3f}" if v and first else "-" for v in vals[1:]) or "-"
        peer_val = None
        if run.peer and run.peer in results:
            peer_val = (next(iter(results[run.peer].values())) or {}).get(run.metric)
        vs_peer = [v / peer_val if v and peer_val else None for v in vals]
        rec = recorded.get(n, {}).get("vs_peer")
        flag = ""
        if rec and vs_peer[-1] and vs_peer[-1] < 0.95 * rec:
            flag = f"SLOWER by {100 * (1 - vs_peer[-1] / rec):.1f}%"
        cells = " | ".join("-" if v is None else str(v) for v in vals)
        peer_cells = " / ".join(f"{x:.3f}" if x else "-" for x in vs_peer)
        print(f"| {n} | {run.gpus} | {run.metric} | {cells} | {rel} | {peer_cells} | {rec or '-'} | {flag} |")


if __name__ == "__main__":
    main()

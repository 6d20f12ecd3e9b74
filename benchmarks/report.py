"""The performance table, generated from the speed guard's record (``benchmarks/baseline.json``).

``baseline.json`` holds the last recorded figure of each headline run of ``benchmarks/guard.py``
(``metric``, ``value``, ``vs_peer`` where the run has a stock-PyTorch peer, and ``card``: the
cards, torch and the date). This script turns it into

* the table between ``<!-- perf-table:start -->`` and ``<!-- perf-table:end -->`` in README.md's
  performance section (with a link to the chart),
* the same table between the same markers at the top of benchmarks/RESULTS.md (the current
  figure per run; the dated history below it is left as it is),
* ``benchmarks/perf.png``: each run's TFLOP/s per GPU beside its peer's (needs matplotlib,
  ``pip install 'behemoth[logging]'``; without it the tables are still written).

Run it after recording new figures in baseline.json::

    python3 benchmarks/report.py            # rewrite both tables and the chart
    python3 benchmarks/report.py --check    # exit 1 if a table does not match baseline.json

The run descriptions come from guard.py's own list (its benchmark arguments), so a run added
there is described without editing this file. Test: tests/unit/test_perf_report.py.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from guard import BY_NAME, RUNS, Run  # noqa: E402  (a script beside this one)

START, END = "<!-- perf-table:start -->", "<!-- perf-table:end -->"
METRICS = {
    "tflops_gpu": "TFLOP/s per GPU",
    "vs_ideal": "fraction of the ideal pipeline throughput",
    "tokens_s": "tokens/s",
}
PEER_NAMES = {"fsdp": "stock FSDP2", "ddp": "stock DDP"}
_DATE = re.compile(r"\d{4}-\d{2}-\d{2}")
UNTIED_NAMES = {"gpt-6.7b": "GPT-6.9B"}
"""bench_gpt.py's models keep their own head table unless ``--tied``: the 6.7B preset is GPT-6.9B."""


def describe(run: Run) -> str:
    """A run as people read it, from its benchmark arguments: e.g. ``GPT-1.3B, 2 GPUs, ZeRO-3,
    param_dtype bf16, mbs 8``."""
    args = dict(zip(run.args[::2], run.args[1::2]))
    flags = {a for a in run.args if a.startswith("--") and args.get(a) is None}
    size = args.get("--size", "")
    model = size.replace("gpt-", "GPT-").replace("b", "B") if size.startswith("gpt-") else f"GPT-{size.upper()}"
    if run.script == "bench_gpt.py" and "--tied" not in flags:
        model = UNTIED_NAMES.get(size, model)
    parts = [model, f"{run.gpus} GPU" + ("s" if run.gpus > 1 else "")]
    if run.is_peer:
        parts.insert(0, PEER_NAMES.get(args.get("--mode", ""), f"stock {args.get('--mode', 'PyTorch')}"))
    tp = int(args.get("--tp", 1))
    if tp > 1:
        parts.append(f"{args.get('--tp-mode', '1d').upper()} tp {tp}")
        if int(args.get("--tp-overlap", 1)) > 1:
            parts.append(f"tp_overlap {args['--tp-overlap']}")
    elif int(args.get("--cp", 1)) > 1:
        parts.append(f"cp {args['--cp']} {args.get('--mode', 'ring')}")
    elif "--offload" in args:
        parts.append(f"ZeRO-{args.get('--zero', 0)} offload {args['--offload']}")
    elif run.gpus > 1 and not run.is_peer and "--schedule" not in args:
        parts.append(f"dp {run.gpus}" if int(args.get("--zero", 0)) == 0 else f"ZeRO-{args['--zero']}")
    if "--param-dtype" in args:
        parts.append(f"param_dtype {args['--param-dtype']}")
    if "--schedule" in args:
        parts.append(f"pp {run.gpus} {args['--schedule'].upper()}")
    if "--seq" in args:
        parts.append(f"seq {int(args['--seq']) // 1024}k")
    if "--ckpt" in flags:
        parts.append("activation checkpointing")
    if "--compile" in flags:
        parts.append("compiled")
    if "--mbs" in args:
        parts.append(f"mbs {args['--mbs']}")
    return ", ".join(parts)


def _card_and_date(card: str) -> tuple[str, str]:
    """``"4x NVIDIA H200 (143771 MiB), torch 2.11, 2026-11-27"`` -> ``("4x NVIDIA H200", "2026-11-27")``."""
    fields = [f.strip() for f in card.split(",")]
    date = next((f for f in reversed(fields) if _DATE.fullmatch(f)), "")
    name = re.sub(r"\s*\(.*?\)", "", fields[0]) if fields else ""
    return name.replace("NVIDIA ", ""), date


def rows(baseline: dict) -> list[dict]:
    """One row per run of baseline.json, in guard.py's order (runs guard.py no longer has last):
    ``run``, ``name`` (its key), ``card``, ``metric``, ``value``, ``peer``, ``peer_value``, ``ratio``, ``date``."""
    order = [r.name for r in RUNS if r.name in baseline] + sorted(k for k in baseline if k not in BY_NAME)
    out = []
    for key in order:
        rec = baseline[key]
        run = BY_NAME.get(key)
        card, date = _card_and_date(rec.get("card", ""))
        peer = run.peer if run is not None else None
        peer_value = baseline.get(peer, {}).get("value") if peer else None
        ratio = rec.get("vs_peer")  # only a ratio from one call: none when the peer did not run beside it
        out.append(
            {
                "run": describe(run) if run is not None else key,
                "name": key,
                "card": card,
                "metric": rec["metric"],
                "value": rec["value"],
                "peer": describe(BY_NAME[peer]) if peer in BY_NAME else peer,
                "peer_value": peer_value,
                "ratio": ratio,
                "date": date,
            }
        )
    return out


def _num(v) -> str:
    if v is None:
        return "-"
    return f"{v:.3f}" if abs(v) < 10 else f"{v:,.1f}"


def table(baseline: dict, *, chart: str | None = None) -> str:
    """The markdown table (and the chart's link when ``chart`` is a relative path)."""
    lines = [
        START,
        "<!-- generated by benchmarks/report.py from benchmarks/baseline.json; edit those, not this table -->",
        "",
        "| run | card | figure | peer | peer's figure | ratio to peer | date |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows(baseline):
        unit = METRICS.get(r["metric"], r["metric"])
        lines.append(
            f"| {r['run']} (`{r['name']}`) | {r['card']} | {_num(r['value'])} {unit} | {r['peer'] or '-'} | "
            f"{_num(r['peer_value'])} | {_num(r['ratio'])} | {r['date']} |"
        )
    lines.append("")
    if chart:
        lines += [f"![TFLOP/s per GPU of each headline run beside its stock-PyTorch peer]({chart})", ""]
    lines.append(END)
    return "\n".join(lines)


def replace_between_markers(text: str, block: str, *, where: str) -> str:
    """``text`` with what lies between the markers (markers included) replaced by ``block``."""
    if text.count(START) != 1 or text.count(END) != 1 or text.index(START) > text.index(END):
        raise SystemExit(f"{where} must hold {START} and then {END} once each; add them where the table goes.")
    return text[: text.index(START)] + block + text[text.index(END) + len(END) :]


def chart(baseline: dict, path: str) -> str | None:
    """A bar per TFLOP/s run, its peer's figure beside it; the PNG's path, or None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        print(f"report.py: no chart ({e}); pip install 'behemoth[logging]'", file=sys.stderr)
        return None
    data = [r for r in rows(baseline) if r["metric"] == "tflops_gpu" and BY_NAME.get(r["name"], None) is not None]
    data = [r for r in data if not BY_NAME[r["name"]].is_peer]
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(data) + 1.6), dpi=110)
    ys = range(len(data))
    ax.barh([y + 0.2 for y in ys], [r["value"] for r in data], height=0.4, label="behemoth")
    ax.barh(
        [y - 0.2 for y in ys],
        [r["peer_value"] or 0 for r in data],
        height=0.4,
        color="tab:gray",
        label="stock-PyTorch peer",
    )
    for y, r in zip(ys, data):
        ax.text(r["value"] + 5, y + 0.2, f"{r['value']:.0f}", va="center", fontsize=8)
    ax.set_yticks(list(ys), [f"{r['run']} [{r['card']}]" for r in data], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("TFLOP/s per GPU (bf16, PaLM count)")
    ax.set_title("headline runs, last recorded (baseline.json)", fontsize=10)
    ax.set_xlim(0, 1.12 * max(max(r["value"], r["peer_value"] or 0) for r in data))
    ax.grid(axis="x", alpha=0.3)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2, fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path, metadata={"Software": None})
    plt.close(fig)
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 if README.md or RESULTS.md is stale; write nothing")
    p.add_argument("--no-chart", action="store_true", help="leave benchmarks/perf.png as it is")
    a = p.parse_args()
    with open(os.path.join(HERE, "baseline.json")) as f:
        baseline = json.load(f)
    targets = {
        os.path.join(ROOT, "README.md"): table(baseline, chart="benchmarks/perf.png"),
        os.path.join(HERE, "RESULTS.md"): table(baseline, chart="perf.png"),
    }
    stale = []
    for path, block in targets.items():
        with open(path) as f:
            text = f.read()
        new = replace_between_markers(text, block, where=os.path.relpath(path, ROOT))
        if new != text:
            stale.append(os.path.relpath(path, ROOT))
            if not a.check:
                with open(path, "w") as f:
                    f.write(new)
    if a.check:
        if stale:
            sys.exit(f"stale performance table in {', '.join(stale)}: run python3 benchmarks/report.py")
        return
    if not a.no_chart:
        chart(baseline, os.path.join(HERE, "perf.png"))
    print(f"updated: {', '.join(stale) or 'nothing (tables current)'}")


if __name__ == "__main__":
    main()

"""benchmarks/report.py: the performance tables in README.md and benchmarks/RESULTS.md are
generated from benchmarks/baseline.json and match it, row by row."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import report  # noqa: E402


def _baseline() -> dict:
    return json.loads((ROOT / "benchmarks" / "baseline.json").read_text())


def _marked_rows(path: Path) -> list[list[str]]:
    text = path.read_text()
    block = text[text.index(report.START) : text.index(report.END)]
    return [
        [c.strip() for c in line.strip("|").split("|")]
        for line in block.splitlines()
        if line.startswith("| ") and not line.startswith("| run |")
    ]


@pytest.mark.parametrize("path", ["README.md", "benchmarks/RESULTS.md"])
def test_the_tables_in_the_docs_match_baseline_json(path):
    baseline = _baseline()
    rows = _marked_rows(ROOT / path)
    assert [re.search(r"\(`([\w.]+)`\)$", r[0]).group(1) for r in rows] == [r["name"] for r in report.rows(baseline)]
    assert sorted(re.search(r"\(`([\w.]+)`\)$", r[0]).group(1) for r in rows) == sorted(baseline)
    for cells in rows:
        key = re.search(r"\(`([\w.]+)`\)$", cells[0]).group(1)
        rec = baseline[key]
        assert float(cells[2].split()[0].replace(",", "")) == pytest.approx(rec["value"], abs=0.05), key
        assert cells[6] == rec["card"].split(",")[-1].strip(), key  # the date
        assert cells[1] == rec["card"].split(" (")[0].replace("NVIDIA ", ""), key
        if "vs_peer" in rec:
            assert float(cells[5]) == pytest.approx(rec["vs_peer"], abs=5e-4), key
            peer = report.BY_NAME[key].peer
            assert float(cells[4].replace(",", "")) == pytest.approx(baseline[peer]["value"], abs=0.05), key
        else:
            assert cells[5] == "-", key
    text = (ROOT / path).read_text()
    block = report.table(baseline, chart="benchmarks/perf.png" if path == "README.md" else "perf.png")
    assert report.replace_between_markers(text, block, where=path) == text, "stale: run python3 benchmarks/report.py"


def test_rows_follow_guard_order_and_take_ratios_only_from_one_call():
    baseline = {
        "dp2": {"metric": "tflops_gpu", "value": 500.0, "card": "2x NVIDIA H100 (81559 MiB), torch 2.11, 2026-12-01"},
        "fsdp2_2": {"metric": "tflops_gpu", "value": 400.0, "card": "2x NVIDIA H100, 2026-12-01"},
        "mystery": {"metric": "tokens_s", "value": 12345.0, "card": "1x NVIDIA H100, 2026-12-02"},
    }
    rows = report.rows(baseline)
    assert [r["name"] for r in rows] == ["fsdp2_2", "dp2", "mystery"]
    dp2 = rows[1]
    # no vs_peer recorded: the peer did not run in the same call, so no ratio is made up from two calls
    assert (dp2["card"], dp2["date"], dp2["peer_value"], dp2["ratio"]) == ("2x H100", "2026-12-01", 400.0, None)
    assert dp2["run"] == "GPT-1.3B, 2 GPUs, dp 2, mbs 8"
    assert rows[0]["run"] == "stock FSDP2, GPT-1.3B, 2 GPUs" and rows[0]["ratio"] is None
    assert rows[2]["run"] == "mystery" and rows[2]["peer"] is None
    assert "| 12,345.0 tokens/s |" in report.table(baseline)


def test_missing_markers_are_named():
    with pytest.raises(SystemExit, match="perf-table:start"):
        report.replace_between_markers("no markers here", "x", where="README.md")

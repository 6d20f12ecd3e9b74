"""The planner's model of generation against real runs of bh.generate (gloo, CPU).

For a tiny grouped-query Llama (4 heads, 1 kv head: fewer kv heads than tp, so 1D replicates
them and 2D runs its replicated k/v projections) under 1D tp 2, 1D tp 4 with and without
sequence parallelism and 2D tp 4, on 3 prompts (2D pads them to 4 rows), and (2 kv heads: the
cube needs q | K) 3D tp 8 and 2.5D tp 8 (depth 2):

* the collectives of the prefill (``max_new_tokens=1``) and of one decode step (the ledger of
  ``max_new_tokens=2`` less the prefill's) equal ``planner.generation_bytes.forward_collectives``
  on every rank, axis by axis: calls, ops, payload bytes exactly, wire bytes to float rounding;
* the KV cache's bytes on every rank equal ``kv_cache_bytes``'s;
* the parameters' bytes on every rank equal ``params.local_params`` times the element size.
"""

from __future__ import annotations

import torch

import behemoth as bh
from behemoth.planner.generation_bytes import forward_collectives, kv_cache_bytes, ledger_of, padded_rows
from behemoth.planner.params import local_params
from behemoth.planner.workload import workload_for

VOCAB, SEQ = 96, 64
ROWS = [[5, 6, 7, 8, 9], [3, 4], [11]]


def build(kv_heads: int) -> torch.nn.Module:
    from behemoth.models import Llama, LlamaConfig

    cfg = LlamaConfig(vocab_size=VOCAB, seq_len=SEQ, num_layers=2, num_heads=4, num_kv_heads=kv_heads, hidden=32)
    return Llama(cfg).eval()


def _strip(stats: dict) -> dict:
    return {a: {k: v for k, v in s.items() if k != "seconds"} for a, s in stats.items()}


def _minus(after: dict, before: dict) -> dict:
    out = {}
    for axis, s in after.items():
        b = before.get(axis, {"calls": 0, "bytes": 0, "wire_bytes": 0, "ops": {}})
        ops = {op: n - b["ops"].get(op, 0) for op, n in s["ops"].items() if n - b["ops"].get(op, 0)}
        if s["calls"] - b["calls"]:
            out[axis] = {
                "calls": s["calls"] - b["calls"],
                "bytes": s["bytes"] - b["bytes"],
                "wire_bytes": s["wire_bytes"] - b["wire_bytes"],
                "ops": ops,
            }
    return out


def _same(got: dict, want: dict, what: str) -> None:
    assert set(got) == set(want), (what, got, want)
    for axis in want:
        g, w = got[axis], want[axis]
        assert (g["calls"], g["ops"], g["bytes"]) == (w["calls"], w["ops"], w["bytes"]), (what, axis, g, w)
        assert abs(g["wire_bytes"] - w["wire_bytes"]) <= 1e-9 * max(1.0, w["wire_bytes"]), (what, axis, g, w)


def _check(plan: bh.Plan, kv_heads: int) -> None:
    what = f"{plan.describe()} kv {kv_heads}"
    model = bh.parallelize(build(kv_heads), plan)
    par = bh.parallelization(model)
    mesh = par.mesh
    ledger = mesh.ledger
    w = workload_for(model, global_batch=len(ROWS))
    shape = w.shape
    stats = {}
    for new in (1, 2):
        ledger.reset()
        out = bh.generate(model, ROWS, max_new_tokens=new, return_logits=True)
        stats[new] = _strip(ledger.stats())
    rows = padded_rows(len(ROWS), plan.tp, plan.tp_mode, plan.tp_depth)
    diagonal = plan.tp_mode != "1d" and mesh.axis("tp_row").rank == mesh.axis("tp_col").rank
    prompt = max(map(len, ROWS))
    kw = dict(rows=rows, tp=plan.tp, mode=plan.tp_mode, depth=plan.tp_depth, dtype_bytes=4, diagonal=diagonal)
    prefill = ledger_of(forward_collectives(shape, seq=prompt, sequence_parallel=plan.sequence_parallel, **kw))
    decode = ledger_of(forward_collectives(shape, seq=1, **kw))
    _same(stats[1], prefill, f"{what}: prefill")
    _same(_minus(stats[2], stats[1]), decode, f"{what}: decode step")

    width = prompt + (-prompt % plan.tp if plan.sequence_parallel else 0)
    local = rows // (par.batch_parts or 1)
    want_kv = kv_cache_bytes(
        num_layers=shape.num_layers,
        rows=local,
        num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        length=width + 2,
        dtype_bytes=4,
        tp=plan.tp,
        tp_mode=plan.tp_mode,
        tp_depth=plan.tp_depth,
    )
    assert out.cache_bytes == want_kv, (what, out.cache_bytes, want_kv)
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    assert held == local_params(par.plan, w) * 4, (what, held, local_params(par.plan, w) * 4)


def _world2(rank, world):
    _check(bh.Plan(tp=2), kv_heads=1)


def _world4(rank, world):
    _check(bh.Plan(tp=4), kv_heads=1)
    _check(bh.Plan(tp=4, sequence_parallel=True), kv_heads=2)
    _check(bh.Plan(tp=4, tp_mode="2d"), kv_heads=1)
    _check(bh.Plan(tp=4, tp_mode="2d"), kv_heads=2)


def _world8(rank, world):
    _check(bh.Plan(tp=8, tp_mode="3d"), kv_heads=2)
    _check(bh.Plan(tp=8, tp_mode="2.5d", tp_depth=2), kv_heads=2)


def test_generation_bytes_tp2():
    bh.spawn(_world2, 2, timeout=120)


def test_generation_bytes_tp4():
    bh.spawn(_world4, 4, timeout=180)


def test_generation_bytes_3d_and_2p5d():
    bh.spawn(_world8, 8, timeout=180)

"""Pipeline schedules (GPipe, 1F1B, interleaved, ZB-H1) as data, checked by the pure simulator
and by independent counting here: every schedule is a valid dependency order with no deadlock
(fewer micro-batches than stages included), has the expected peak of in-flight micro-batches,
and the bubble the formulas in schedules.py's docstring state. No processes."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

from behemoth.parallel.pipeline import schedules as S
from behemoth.parallel.pipeline.schedules import (
    BI,
    BW,
    Action,
    B,
    F,
    check_schedule,
    get_schedule,
    gpipe,
    interleaved,
    make_schedule,
    one_f_one_b,
    stage_of,
    transfers,
    zero_bubble,
)
from behemoth.parallel.pipeline.simulate import render, simulate
from behemoth.plan import SCHEDULES as PLAN_SCHEDULES

NAMES = ("gpipe", "1f1b", "interleaved", "zero-bubble")
PPS, MS = (1, 2, 4), (1, 2, 3, 4, 8)


def build(name: str, pp: int, m: int, v: int = 2) -> list[list[Action]]:
    return make_schedule(name, pp, m, v if name == "interleaved" else 1)


def chunks(name: str, v: int = 2) -> int:
    return v if name == "interleaved" else 1


def assert_dependency_order(res, pp: int, v: int, t_comm: float = 0.0) -> None:
    """Independent of the simulator's bookkeeping: in its timeline every action starts after
    what it depends on ended (plus the message latency across ranks), and no rank overlaps."""
    end: dict[tuple[str, int, int], float] = {}
    starts = []
    for r, tl in enumerate(res.timeline):
        prev = 0.0
        for a, s, e in tl:
            assert s >= prev - 1e-12, f"rank {r} overlaps at {a}"
            prev = e
            st = stage_of(r, a.chunk, pp)
            end[(a.kind, a.microbatch, st)] = e
            starts.append((r, a, st, s))
    last = pp * v - 1

    def grad(mb: int, st: int) -> float:
        return end.get((B, mb, st), end.get((BI, mb, st)))

    for r, a, st, s in starts:
        lat = lambda other_stage: t_comm if other_stage % pp != r else 0.0  # noqa: E731
        if a.kind == F and st > 0:
            assert s >= end[(F, a.microbatch, st - 1)] + lat(st - 1) - 1e-9, (r, a)
        if a.kind in (B, BI):
            assert s >= end[(F, a.microbatch, st)] - 1e-9, (r, a)
            if st < last:
                assert s >= grad(a.microbatch, st + 1) + lat(st + 1) - 1e-9, (r, a)
        if a.kind == BW:
            assert s >= end[(BI, a.microbatch, st)] - 1e-9, (r, a)


@pytest.mark.parametrize("name", NAMES)
def test_every_schedule_is_complete_and_valid(name):
    for pp, m in itertools.product(PPS, MS):
        v = chunks(name)
        acts = build(name, pp, m)
        assert len(acts) == pp
        assert check_schedule(acts, pp) == (m, v)
        # exactly one F and one B (or one BI + one BW) per (micro-batch, stage)
        count = Counter((a.kind, a.microbatch, stage_of(r, a.chunk, pp)) for r, ra in enumerate(acts) for a in ra)
        for mb, st in itertools.product(range(m), range(pp * v)):
            assert count[(F, mb, st)] == 1
            split = (count[(BI, mb, st)], count[(BW, mb, st)])
            assert (count[(B, mb, st)], split) in ((1, (0, 0)), (0, (1, 1))), (name, pp, m, mb, st)
        assert sum(count.values()) == sum(len(ra) for ra in acts)
        for t_comm in (0.0, 0.25):
            res = simulate(acts, pp, t_comm=t_comm)
            assert_dependency_order(res, pp, v, t_comm)


@pytest.mark.parametrize("name", NAMES)
def test_fewer_microbatches_than_stages_never_deadlock(name):
    for pp in (2, 3, 4, 8):
        for m in range(1, pp + 1):
            for v in (1, 2, 3) if name == "interleaved" else (1,):
                res = simulate(make_schedule(name, pp, m, v), pp)
                assert res.makespan > 0


def test_wide_sweep_has_no_deadlock_and_fifo_channels():
    """Every (pp, m, v) the engine may see: the simulator (and check_schedule's FIFO rule:
    the receiver consumes each (sender, receiver, kind) channel in send order) accepts all."""
    for pp, m in itertools.product(range(1, 7), range(1, 13)):
        for name in NAMES:
            for v in (2, 3, 4) if name == "interleaved" else (1,):
                simulate(make_schedule(name, pp, m, v), pp)


def test_per_stage_work_runs_in_microbatch_order():
    """So every schedule accumulates weight gradients in the same (micro-batch) order."""
    for name, pp, m in itertools.product(NAMES, PPS, MS):
        acts = build(name, pp, m)
        for r, ra in enumerate(acts):
            for kind in (F, B, BI, BW):
                for c in range(chunks(name)):
                    mbs = [a.microbatch for a in ra if a.kind == kind and a.chunk == c]
                    assert mbs == sorted(mbs), (name, pp, m, r, kind, c)


def test_peak_inflight():
    for pp, m in itertools.product(PPS, MS):
        g = simulate(gpipe(pp, m), pp)
        o = simulate(one_f_one_b(pp, m), pp)
        z = simulate(zero_bubble(pp, m), pp)
        assert g.peak_inflight == (m,) * pp
        assert o.peak_inflight == tuple(min(pp - r, m) for r in range(pp))
        assert max(o.peak_inflight) <= pp
        assert o.peak_held == o.peak_inflight  # full backwards free everything at once
        assert all(zi <= oi for zi, oi in zip(z.peak_inflight, o.peak_inflight))
        assert max(z.peak_held) <= max(o.peak_inflight) == min(pp, m)  # ZB-H1: same peak as 1F1B
        for v in (2, 3):
            i = simulate(interleaved(pp, m, v), pp)
            grp = m if m <= pp else pp + m % pp  # largest group: the remainder joins the last one
            assert i.peak_inflight == tuple(min(2 * (pp - r - 1) + (v - 1) * grp + 1, m * v) for r in range(pp))


def test_one_f_one_b_and_gpipe_bubble_is_exact():
    """Free communication: makespan (m + p - 1)(t_f + t_b), so bubble (p-1)/(m+p-1), any times."""
    for pp, m in itertools.product((1, 2, 3, 4, 8), (1, 2, 3, 4, 5, 8, 16)):
        for t_f, t_b in ((1.0, 2.0), (1.0, 1.0), (1.0, 3.0), (2.0, 1.0)):
            for fn in (gpipe, one_f_one_b):
                res = simulate(fn(pp, m), pp, t_f=t_f, t_b=t_b)
                assert res.makespan == pytest.approx((m + pp - 1) * (t_f + t_b))
                assert res.bubble_fraction == pytest.approx((pp - 1) / (m + pp - 1))
                assert res.idle == pytest.approx([(pp - 1) * (t_f + t_b)] * pp)


def test_bubble_with_message_latency():
    """GPipe pays 2(p-1) latencies in all; 1F1B also one round trip per micro-batch in steady state."""
    tc = 0.1
    for pp, m in itertools.product((2, 3, 4, 5), (1, 2, 3, 4, 7, 8, 11)):
        g = simulate(gpipe(pp, m), pp, t_comm=tc)
        assert g.makespan == pytest.approx((m + pp - 1) * 3 + 2 * (pp - 1) * tc)
        o = simulate(one_f_one_b(pp, m), pp, t_comm=tc)
        hops = 2 * ((pp - 1) + (m - 1) * (pp - 1) // pp)
        assert o.makespan == pytest.approx((m + pp - 1) * 3 + hops * tc)


def test_interleaved_divides_idle_time_by_v():
    for pp, m, v in itertools.product((2, 3, 4), (4, 5, 6, 8, 12), (2, 3, 4)):
        if m < pp:
            continue
        for t_f, t_b in ((1.0, 2.0), (1.0, 1.0), (2.0, 1.0)):
            i = simulate(interleaved(pp, m, v), pp, t_f=t_f, t_b=t_b)
            o = simulate(one_f_one_b(pp, m), pp, t_f=t_f, t_b=t_b)
            assert i.idle == pytest.approx([x / v for x in o.idle])
            assert i.bubble_fraction == pytest.approx((pp - 1) / (v * m + pp - 1))
    for pp in (2, 4, 8):  # fewer micro-batches than stages: still no worse than 1F1B
        for m in range(1, pp):
            assert simulate(interleaved(pp, m, 2), pp).makespan <= simulate(one_f_one_b(pp, m), pp).makespan
    assert interleaved(4, 8, 1) == one_f_one_b(4, 8)


def test_zero_bubble_beats_one_f_one_b():
    for pp, m in itertools.product((2, 3, 4, 8), (1, 2, 3, 4, 8, 16)):
        for t_f, t_bi, t_bw in ((1.0, 1.0, 1.0), (1.0, 1.5, 0.5), (2.0, 1.0, 1.0), (1.0, 1.0, 2.0)):
            z = simulate(zero_bubble(pp, m), pp, t_f=t_f, t_bi=t_bi, t_bw=t_bw)
            o = simulate(one_f_one_b(pp, m), pp, t_f=t_f, t_b=t_bi + t_bw)
            assert z.makespan < o.makespan
            assert z.bubble_fraction < o.bubble_fraction
            if m >= pp and t_bw <= min(t_f, t_bi):  # ZB-H1's formula
                assert z.idle == pytest.approx([(pp - 1) * (t_f + t_bi - t_bw)] * pp)
    assert zero_bubble(1, 3) == [
        [
            Action(F, 0),
            Action(BI, 0),
            Action(BW, 0),
            Action(F, 1),
            Action(BI, 1),
            Action(BW, 1),
            Action(F, 2),
            Action(BI, 2),
            Action(BW, 2),
        ]
    ]


# Bubble fraction (idle / (pp * makespan)) at t_f=1, t_b=2 (t_bi = t_bw = 1), no comm; interleaved v=2.
BUBBLE_TABLE = {
    (2, 4): (0.2000, 0.2000, 0.1111, 0.0769),
    (2, 8): (0.1111, 0.1111, 0.0588, 0.0400),
    (4, 4): (0.4286, 0.4286, 0.2727, 0.2000),
    (4, 8): (0.2727, 0.2727, 0.1579, 0.1111),
}


def test_bubble_table_matches_docstring():
    lines = []
    for (pp, m), expected in BUBBLE_TABLE.items():
        got = tuple(simulate(build(name, pp, m), pp).bubble_fraction for name in NAMES)
        assert got == pytest.approx(expected, abs=5e-5)
        row = f"{pp:4d}  {m:2d}  " + "  ".join(f"{x:.4f}".ljust(w) for x, w in zip(got, (7, 7, 11, 11)))
        assert row.rstrip() in S.__doc__, row
        lines.append(row)
        assert got[1] == pytest.approx((pp - 1) / (m + pp - 1))
        assert got[2] == pytest.approx((pp - 1) / (2 * m + pp - 1))
        assert got[3] == pytest.approx((pp - 1) / (3 * m + pp - 1))  # idle (pp-1)(t_f + t_bi - t_bw) = pp-1
    print("\n  pp   m  gpipe    1f1b     interleaved  zero-bubble\n" + "\n".join(lines))


def test_transfers():
    pp, v = 4, 2
    assert transfers(Action(F, 5, 0), 0, pp, v) == (None, S.Transfer("act", 5, 0, 1, 0, 1))
    recv, send = transfers(Action(F, 1, 0), 3, pp, v)  # stage 3 -> stage 4 wraps to rank 0, chunk 1
    assert recv == S.Transfer("act", 1, 2, 3, 2, 3) and send == S.Transfer("act", 1, 3, 4, 3, 0)
    assert transfers(Action(F, 0, 1), 3, pp, v) == (S.Transfer("act", 0, 6, 7, 2, 3), None)  # last stage
    assert transfers(Action(B, 0, 1), 3, pp, v) == (None, S.Transfer("grad", 0, 7, 6, 3, 2))
    assert transfers(Action(BI, 2, 1), 0, pp, v) == (
        S.Transfer("grad", 2, 5, 4, 1, 0),
        S.Transfer("grad", 2, 4, 3, 0, 3),
    )
    assert transfers(Action(B, 0, 0), 0, pp, v)[1] is None  # first stage: nothing to send back
    assert transfers(Action(BW, 0, 0), 2, pp, v) == (None, None)
    assert transfers(Action(F, 0, 1), 0, 1, 2)[0].dst_rank == 0  # pp=1, v=2: a local hand-off


def test_names_match_the_plan():
    assert set(S.SCHEDULES) == set(PLAN_SCHEDULES)
    assert get_schedule("1f1b") is one_f_one_b and get_schedule("zero-bubble") is zero_bubble
    with pytest.raises(ValueError, match="unknown pipeline schedule 'pipedream'"):
        get_schedule("pipedream")
    with pytest.raises(ValueError, match="one model chunk per rank; got v=2"):
        make_schedule("1f1b", 2, 4, 2)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="must be an integer >= 1"):
            one_f_one_b(2, bad)
    with pytest.raises(ValueError, match=r"interleaved: v=0"):
        interleaved(2, 4, 0)


def test_broken_schedules_are_refused_with_the_reason():
    with pytest.raises(
        ValueError,
        match=r"schedule deadlocks: rank 0 at step 1 \(B0, stage 0\) waits for input "
        r"gradient of micro-batch 0 at stage 1 \(rank 1\); rank 1 at step 1 \(F1, "
        r"stage 1\) waits for F of micro-batch 1 at stage 0 \(rank 0\)",
    ):
        # rank 0 waits in B0 for a gradient that rank 1 computes only after F1, which needs rank 0's F1
        simulate(
            [
                [Action(F, 0), Action(B, 0), Action(F, 1), Action(B, 1)],
                [Action(F, 0), Action(F, 1), Action(B, 0), Action(B, 1)],
            ],
            2,
        )
    with pytest.raises(ValueError, match=r"channel rank 0 -> rank 1 \(act\)"):
        # no deadlock with asynchronous sends, but a runtime matching messages in order would swap them
        simulate(
            [
                [Action(F, 0), Action(F, 1), Action(B, 0), Action(B, 1)],
                [Action(F, 1), Action(F, 0), Action(B, 0), Action(B, 1)],
            ],
            2,
        )
    with pytest.raises(ValueError, match="before its forward"):
        simulate([[Action(B, 0), Action(F, 0)]], 1)
    with pytest.raises(ValueError, match="BW .* before BI"):
        simulate([[Action(F, 0), Action(BW, 0), Action(BI, 0)]], 1)
    with pytest.raises(ValueError, match="micro-batch 1 at stage 1 .* has no F"):
        simulate([[Action(F, 0), Action(F, 1), Action(B, 0), Action(B, 1)], [Action(F, 0), Action(B, 0)]], 2)
    with pytest.raises(ValueError, match=r"has backward actions \['B', 'BW'\]"):
        simulate([[Action(F, 0), Action(B, 0), Action(BW, 0)]], 1)
    with pytest.raises(ValueError, match="appears twice"):
        simulate([[Action(F, 0), Action(F, 0), Action(B, 0)]], 1)
    with pytest.raises(ValueError, match="2 rank lists but pp=3"):
        simulate(one_f_one_b(2, 2), 3)
    with pytest.raises(ValueError, match="t_comm=-1 must be a time >= 0"):
        simulate(gpipe(2, 2), 2, t_comm=-1)
    with pytest.raises(ValueError, match="not a valid action"):
        simulate([[Action("X", 0)]], 1)


def test_render():
    out = render(simulate(one_f_one_b(2, 2), 2))
    assert out.splitlines() == ["rank 0: 01..AA.BB", "rank 1: .0AA1BB.."]
    assert "a*" in render(simulate(zero_bubble(2, 2), 2))


def test_every_transfer_rides_one_of_the_runtimes_one_way_channels():
    """The runtime gives each (sender, receiver, kind) channel of pipeline_channels its own process
    group (one NCCL stream each, one direction each): every transfer of every schedule must lie on
    one of them, and a pipeline of pp >= 3 needs 2 pp channels, of 2 four."""
    from behemoth.parallel.pipeline.p2p import ACT_TAG, GRAD_TAG, pipeline_channels

    for pp in (1, 2, 3, 4, 8):
        chans = pipeline_channels(pp)
        assert len(chans) == (0 if pp == 1 else 4 if pp == 2 else 2 * pp) == len(set(chans)), pp
        for name in NAMES:
            for v in (1, 2, 3) if name == "interleaved" else (1,):
                for m in (1, pp, 2 * pp + 1):
                    for r, acts in enumerate(make_schedule(name, pp, m, v)):
                        for a in acts:
                            for t in S.transfers(a, r, pp, v):
                                if t is not None and t.src_rank != t.dst_rank:
                                    tag = ACT_TAG if t.kind == "act" else GRAD_TAG
                                    assert (t.src_rank, t.dst_rank, tag) in chans, (name, pp, v, m, t)

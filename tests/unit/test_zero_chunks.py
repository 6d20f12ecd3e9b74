"""ZeRO chunk packing: no split parameters, contiguous offsets, shards covering each chunk
exactly, exact padding on hand-computed cases, group separation with different dp sizes,
errors that name the fix, chunk-size search, and per-rank memory accounting. No processes."""

from __future__ import annotations

import random

import pytest

from behemoth.parallel.zero import pack_chunks, search_chunk_size, zero_memory_bytes
from behemoth.parallel.zero.chunks import least_padding


def check_invariants(layout, sizes):
    assert len(layout.params) == len(sizes)
    for i, (slot, n) in enumerate(zip(layout.params, sizes)):
        assert slot.numel == n
        c = layout.chunks[slot.chunk]
        assert i in c.params
        assert 0 <= slot.offset and slot.offset + n <= c.used <= c.size  # never split, never in padding
    for c in layout.chunks:
        assert c.size % c.dp == 0
        assert all(layout.groups[p] == c.group for p in c.params)  # chunks never mix groups
        assert list(c.params) == sorted(c.params)  # execution order inside a chunk
        off = 0
        for p in c.params:  # offsets contiguous from 0
            assert layout.params[p].offset == off
            off += sizes[p]
        assert off == c.used
        covered = 0
        for r in range(c.dp):  # shards tile the chunk exactly
            o, n = c.shard(r)
            assert o == covered and n == c.size // c.dp
            covered += n
        assert covered == c.size
        # the shard slices of all ranks cover every parameter element exactly once
        seen = {p: 0 for p in c.params}
        for r in range(c.dp):
            for s in layout.shard_slices(c.index, r):
                assert s.param_offset == seen[s.param]
                assert layout.params[s.param].offset + s.param_offset == c.shard(r)[0] + s.shard_offset
                seen[s.param] += s.length
        assert all(seen[p] == sizes[p] for p in c.params)
    assert layout.padding_elements == layout.total_elements - sum(sizes)


def test_hand_computed_case():
    # chunk 10, dp 2: [4, 4] | [3, 6] | [10] | [1]  -> padding 2 + 1 + 0 + 9 = 12 of 40
    sizes = [4, 4, 3, 6, 10, 1]
    lay = pack_chunks(sizes, 10, 2)
    assert [c.params for c in lay.chunks] == [(0, 1), (2, 3), (4,), (5,)]
    assert [(s.chunk, s.offset) for s in lay.params] == [(0, 0), (0, 4), (1, 0), (1, 3), (2, 0), (3, 0)]
    assert lay.padding_elements == 12 and lay.total_elements == 40
    assert lay.padding_fraction == pytest.approx(0.3)
    assert lay.shard_range(1, 1) == (5, 5)
    check_invariants(lay, sizes)


def test_chunk_size_rounds_up_to_dp():
    lay = pack_chunks([5, 5, 5], 10, 4)  # 10 -> 12: [5, 5] | [5]
    assert [c.size for c in lay.chunks] == [12, 12]
    assert lay.padding_elements == 2 + 7
    assert lay.chunks[0].shard(3) == (9, 3)
    check_invariants(lay, [5, 5, 5])


def test_random_layouts_hold_invariants():
    rng = random.Random(0)
    for _ in range(200):
        sizes = [rng.randint(0, 50) for _ in range(rng.randint(1, 30))]
        dp = rng.choice([1, 2, 3, 4, 8])
        lay = pack_chunks(sizes, max(sizes) + rng.randint(0, 60), dp)
        check_invariants(lay, sizes)


def test_parameter_larger_than_chunk_names_it_and_the_fix():
    with pytest.raises(ValueError, match=r"parameter 1 has 13 elements.*chunk_size >= 16"):
        pack_chunks([3, 13, 2], 8, 4)
    pack_chunks([3, 13, 2], 16, 4)  # the suggested size works


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(param_sizes=[1, -2], chunk_size=4, dp=1), r"param_sizes\[1\]=-2"),
        (dict(param_sizes=[1], chunk_size=0, dp=1), r"chunk_size=0"),
        (dict(param_sizes=[1], chunk_size=4, dp=0), r"dp=0"),
        (dict(param_sizes=[1, 2], chunk_size=4, dp=1, groups=[0]), r"groups has 1 entries"),
        (dict(param_sizes=[1, 2], chunk_size=4, dp={0: 2}, groups=[0, 1]), r"no size for group\(s\) \[1\]"),
    ],
)
def test_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        pack_chunks(**kwargs)


def test_groups_never_mix_and_have_their_own_dp():
    # dense (group 0) over dp=4, experts (group 1) over dp=2, interleaved in execution order
    sizes = [6, 4, 4, 6, 2, 4, 4]
    groups = [0, 1, 1, 0, 0, 1, 1]
    lay = pack_chunks(sizes, 10, {0: 4, 1: 2}, groups=groups)
    check_invariants(lay, sizes)
    # chunk size 10 -> 12 for dp 4, stays 10 for dp 2; each group keeps its own open chunk
    assert [(c.group, c.size, c.params) for c in lay.chunks] == [
        (0, 12, (0, 3)),
        (1, 10, (1, 2)),
        (0, 12, (4,)),
        (1, 10, (5, 6)),
    ]
    assert lay.chunks[1].shard(1) == (5, 5)
    with pytest.raises(ValueError, match="rank 2 is outside group 1's dp size 2"):
        lay.chunks[1].shard(2)
    assert lay.rank_elements(3, 0) == 6 and lay.rank_elements(1, 1) == 10


def test_search_picks_least_waste():
    # six params of 3: size 9 packs 3 per chunk with no padding; 8 and 16 waste 2 and 14... ;
    # 18 also has none: the tie goes to the larger size
    sizes = [3] * 6
    best, table = search_chunk_size(sizes, 1, candidates=[4, 8, 9, 16, 18])
    assert best == 18
    row = {r.size: r for r in table}
    assert (row[9].num_chunks, row[9].padding_elements) == (2, 0)
    assert (row[8].num_chunks, row[8].padding_elements) == (3, 6)
    assert row[16].padding_pct == pytest.approx(100 * 14 / 32)
    best, _ = search_chunk_size(sizes, 1, candidates=[4, 8, 9, 16])
    assert best == 9
    with pytest.raises(ValueError, match="largest parameter"):
        search_chunk_size(sizes, 1, candidates=[1, 2])


def test_search_default_candidates():
    sizes = [100, 100, 100, 30, 70] * 8
    best, table = search_chunk_size(sizes, 2)
    assert all(r.size >= 100 for r in table)
    assert any(r.size == 128 for r in table) and any(r.size == 200 for r in table)
    assert min(r.padding_elements for r in table) == {r.size: r for r in table}[best].padding_elements
    row = {r.size: r for r in table}
    # 200 packs [100, 100] [100, 30, 70] exactly, so do 400 and 800 (the default cap, total / 4);
    # the tie goes to the largest: fewer, larger collectives
    assert row[200].padding_elements == row[400].padding_elements == row[800].padding_elements == 0
    # 128 packs each [100, 100, 100, 30, 70] as [100] [100] [100] [30, 70]: 4 x 128 - 400 = 112, x 8
    assert row[128].padding_elements == 8 * (4 * 128 - 400)
    assert best == 800
    assert best <= sum(sizes) // 4


def reference_search(sizes, dp, groups, candidates):
    """The search written plainly: every candidate's layout built by ``pack_chunks``, the least
    padding kept, ties to the larger size."""
    table = []
    for size in sorted(set(candidates)):
        lay = pack_chunks(sizes, size, dp, groups=groups)
        table.append((size, lay.num_chunks, lay.padding_elements, lay.total_elements))
    best = min(table, key=lambda r: (r[2], -r[0]))[0]
    return best, table


def test_search_counts_the_layouts_pack_chunks_builds():
    """On thousands of random models (zero-sized parameters, one to three groups of their own dp,
    interleaved) the vectorised search counts, per candidate, the chunks and padding of the layout
    ``pack_chunks`` builds, and picks what the plain search picks."""
    rng = random.Random(2)
    for _ in range(3000):
        n = rng.randint(1, 40)
        sizes = [rng.choice([0, 1, rng.randint(0, 60), rng.randint(0, 3000)]) for _ in range(n)]
        num_groups = rng.randint(1, 3)
        groups = [rng.randrange(num_groups) for _ in sizes]
        dp = {g: rng.choice([1, 2, 3, 4, 7, 8]) for g in range(num_groups)}
        largest = max(max(sizes), 1)
        cands = [largest] + [rng.randint(largest, 3 * largest + 20) for _ in range(rng.randint(0, 12))]
        best, table = reference_search(sizes, dp, groups, cands)
        got, rows = search_chunk_size(sizes, dp, groups=groups, candidates=cands)
        assert got == best
        assert [(r.size, r.num_chunks, r.padding_elements) for r in rows] == [t[:3] for t in table]
        assert [r.padding_pct for r in rows] == [100.0 * t[2] / t[3] for t in table]
        present = {g: d for g, d in dp.items() if g in groups}
        got, chunks, elements = least_padding(sizes, groups, present, sorted(set(cands)))
        assert got == best
        assert (chunks.tolist(), elements.tolist()) == ([t[1] for t in table], [t[3] for t in table])


def model_sizes():
    rng = random.Random(1)
    return [rng.randint(1, 5000) for _ in range(100)]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_memory_stages(stage):
    sizes = model_sizes()
    lay = pack_chunks(sizes, 8192, 4)
    m = zero_memory_bytes(lay, stage, 4)
    e, s = lay.total_elements, lay.total_elements // 4
    assert m.params == 2 * (s if stage == 3 else e)
    assert m.grads == 2 * (s if stage >= 2 else e)
    assert m.master == 4 * (s if stage >= 1 else e)
    assert m.optim_states == 8 * (s if stage >= 1 else e)
    assert m.total == m.params + m.grads + m.master + m.optim_states


def test_stage3_at_dp4_is_a_quarter_plus_padding():
    sizes = model_sizes()
    best, _ = search_chunk_size(sizes, 4)
    lay = pack_chunks(sizes, best, 4)
    serial = sum(sizes) * (2 + 2 + 4 + 8)
    m = zero_memory_bytes(lay, 3, 4)
    pad_bytes = lay.padding_elements * 16
    assert m.total <= serial / 4 + pad_bytes
    assert m.total <= serial / 4 + m.padding
    assert m.padding <= pad_bytes
    print(
        f"zero-3 dp=4: per rank {m.total} B vs serial/4 {serial / 4:.0f} B, "
        f"padding {100 * lay.padding_fraction:.2f}% of chunk elements (chunk size {best})"
    )
    assert lay.padding_fraction < 0.05


def test_memory_with_groups_and_errors():
    lay = pack_chunks([8, 8, 8, 8], 16, {0: 4, 1: 2}, groups=[0, 0, 1, 1])
    m = zero_memory_bytes(lay, 3, {0: 4, 1: 2}, param_bytes=1, grad_bytes=0, master_bytes=0, optim_state_bytes=0)
    assert m.params == 16 // 4 + 16 // 2
    with pytest.raises(ValueError, match="does not match the layout's dp"):
        zero_memory_bytes(lay, 3, 4)
    with pytest.raises(ValueError, match="stage=4 is not a ZeRO stage"):
        zero_memory_bytes(lay, 4)


def test_pack_buckets_packs_from_the_last_parameter_like_ddp():
    from behemoth.parallel.zero.chunks import pack_buckets

    # cap 10, from the back: [8] (+3 = 11 > 10), [5, 3] = 8 (+6 = 14), [4, 6] = 10 (+12), [12] alone
    layout = pack_buckets([12, 4, 6, 5, 3, 8], 10)
    assert [c.params for c in layout.chunks] == [(0,), (1, 2), (3, 4), (5,)]
    assert [c.size for c in layout.chunks] == [12, 10, 8, 8] and layout.padding_elements == 0
    assert [(s.chunk, s.offset) for s in layout.params] == [(0, 0), (1, 0), (1, 4), (2, 0), (2, 5), (3, 0)]
    assert all(c.dp == 1 and c.shard(0) == (0, c.size) for c in layout.chunks)
    assert pack_buckets([], 10).num_chunks == 0
    with pytest.raises(ValueError, match="bucket_size=0"):
        pack_buckets([1], 0)


def test_least_padding_refuses_a_candidate_below_a_parameter_instead_of_looping():
    import pytest

    from behemoth.parallel.zero.chunks import least_padding

    with pytest.raises(ValueError, match="below a parameter"):
        least_padding([5, 10], [0, 0], {0: 1}, [6, 12])
    best, chunks, elements = least_padding([5, 10], [0, 0], {0: 1}, [10, 15])
    assert (best, chunks.tolist(), elements.tolist()) == (15, [2, 1], [20, 15])

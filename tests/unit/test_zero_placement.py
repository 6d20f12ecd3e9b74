"""ZeRO chunk placement: Belady/OPT eviction matches a brute-force optimum in misses on small
random traces, byte and peak accounting, budget errors that name the fix, and the Elixir
static split (monotonic in the budget, keeps everything on GPU when it fits). No processes."""

from __future__ import annotations

import random

import pytest

from behemoth.parallel.zero import plan_placement, static_split


def brute_force_misses(order, capacity):
    """Fewest misses over every demand-paging eviction choice (exhaustive over resident sets)."""
    states = {frozenset(): 0}
    for c in order:
        nxt = {}
        for s, m in states.items():
            if c in s:
                options = [(s, m)]
            elif len(s) < capacity:
                options = [(s | {c}, m + 1)]
            else:
                options = [((s - {v}) | {c}, m + 1) for v in s]
            for t, k in options:
                if k < nxt.get(t, 1 << 30):
                    nxt[t] = k
        states = nxt
    return min(states.values())


def test_opt_matches_brute_force_on_random_traces():
    rng = random.Random(0)
    for _ in range(150):
        n_chunks = rng.randint(1, 6)
        order = [rng.randrange(n_chunks) for _ in range(rng.randint(1, 16))]
        capacity = rng.randint(1, 4)
        plan = plan_placement(order, [10] * n_chunks, 10 * capacity + rng.randint(0, 9))
        assert plan.misses == brute_force_misses(order, capacity), (order, capacity)
        assert plan.peak_resident_bytes <= plan.budget_bytes
        assert plan.h2d_bytes == 10 * plan.misses


def test_actions_on_a_forward_backward_trace():
    # forward 0 1 2 3, backward 3 2 1 0, room for 2 chunks
    plan = plan_placement([0, 1, 2, 3, 3, 2, 1, 0], [4, 4, 4, 4], 8)
    got = [(a.chunk, a.hit, a.evict) for a in plan.actions]
    # at chunk 2 the furthest next use is chunk 0's (backward's end): evict it; then chunk 1
    assert got == [
        (0, False, ()),
        (1, False, ()),
        (2, False, (0,)),
        (3, False, (1,)),
        (3, True, ()),
        (2, True, ()),
        (1, False, (3,)),
        (0, False, (2,)),
    ]
    assert plan.misses == 6 and plan.hits == 2
    assert plan.h2d_bytes == 24 and plan.d2h_bytes == 16
    assert plan.peak_resident_bytes == 8 and plan.resident_at_end == (0, 1)
    clean = plan_placement([0, 1, 2, 3, 3, 2, 1, 0], [4, 4, 4, 4], 8, evict_writes_back=False)
    assert clean.d2h_bytes == 0 and clean.misses == 6


def test_everything_fits_loads_each_chunk_once():
    plan = plan_placement([0, 1, 2, 1, 0, 2], {0: 3, 1: 5, 2: 7}, 15)
    assert plan.misses == 3 and plan.d2h_bytes == 0 and plan.peak_resident_bytes == 15
    warm = plan_placement([0, 1, 2, 1, 0, 2], {0: 3, 1: 5, 2: 7}, 15, resident=plan.resident_at_end)
    assert warm.misses == 0 and warm.h2d_bytes == 0


def test_mixed_sizes_evict_until_it_fits():
    plan = plan_placement([0, 1, 2, 0], [4, 4, 8], 8)
    assert plan.actions[2].evict == (1, 0)  # never-used-again chunk 1 first, then chunk 0
    assert plan.peak_resident_bytes == 8


def test_budget_errors():
    with pytest.raises(ValueError, match=r"budget_bytes=7 cannot hold chunk 1 of 9 bytes.*>= 9 bytes"):
        plan_placement([0, 1], [4, 9], 7)
    with pytest.raises(ValueError, match="chunk 5 appears in access_order"):
        plan_placement([0, 5], [4, 4], 8)
    with pytest.raises(ValueError, match=r"cannot hold the largest chunk \(9 bytes\).*>= 9 bytes"):
        static_split([4, 9], 3.0, 8, h2d_bandwidth=1.0, d2h_bandwidth=1.0)
    with pytest.raises(ValueError, match="one per chunk"):
        static_split([4, 4], [1], 100, h2d_bandwidth=1.0, d2h_bandwidth=1.0)
    with pytest.raises(ValueError, match="bandwidths must be positive"):
        static_split([4, 4], 1.0, 100, h2d_bandwidth=0.0, d2h_bandwidth=1.0)


def test_static_split_keeps_everything_when_it_fits():
    chunks = [100] * 8
    s = static_split(chunks, 6.0, 8 * 100 * 7, h2d_bandwidth=25e9, d2h_bandwidth=25e9)
    assert (s.num_param_chunks, s.num_optim_chunks) == (8, 8)
    assert s.predicted_seconds == 0 and s.h2d_bytes == s.d2h_bytes == 0 and s.buffer_bytes == 0
    assert "Everything fits" in s.explain()


def test_static_split_hand_computed():
    # 4 chunks of 10 B, optimizer 30 B each, budget 60: keep params of p chunks, optim of o,
    # buffer 10 while any parameter is offloaded. p=4 (40) leaves 20: o=0 -> 40 B h2d + 40 d2h.
    # p=3 (30 + 10 buffer) leaves 20: o=0 -> 3*10 + 2*10 = 50 h2d, 30 + 10 = 40 d2h: worse.
    # p=1, o=1 (10 + 30 + buffer 10 = 50): 3 chunks offloaded -> 60 h2d, 30 d2h: 90 B also worse.
    s = static_split([10] * 4, [30] * 4, 60, h2d_bandwidth=1.0, d2h_bandwidth=1.0)
    assert (s.num_param_chunks, s.num_optim_chunks) == (4, 0)
    assert (s.h2d_bytes, s.d2h_bytes, s.predicted_seconds) == (40, 40, 80.0)
    text = s.explain()
    assert "parameters of 4/4 chunks, optimizer state of 0/4" in text and "Predicted transfer" in text


@pytest.mark.parametrize("ratio", [1.0, 6.0, [3, 20, 5, 9, 14, 2]])
def test_static_split_monotonic_in_budget(ratio):
    rng = random.Random(2)
    chunks = [rng.randint(5, 20) for _ in range(6)]
    prev = float("inf")
    for budget in range(max(chunks), 8 * sum(chunks) + 200):
        s = static_split(chunks, ratio, budget, h2d_bandwidth=3.0, d2h_bandwidth=2.0)
        assert s.gpu_bytes <= budget
        assert s.predicted_seconds <= prev + 1e-12
        prev = s.predicted_seconds
    assert prev == 0.0


def test_static_split_is_optimal_over_prefix_choices():
    rng = random.Random(3)
    for _ in range(50):
        chunks = [rng.randint(1, 9) for _ in range(rng.randint(1, 6))]
        opt = [rng.randint(0, 30) for _ in chunks]
        budget = rng.randint(max(chunks), 150)
        s = static_split(chunks, opt, budget, h2d_bandwidth=2.0, d2h_bandwidth=1.0)
        n, best = len(chunks), float("inf")
        for p in range(n + 1):
            for o in range(p + 1):
                buf = max(chunks[p:], default=0)
                if sum(chunks[:p]) + sum(opt[:o]) + buf > budget:
                    continue
                mid, rest = sum(chunks[o:p]), sum(chunks[p:])
                best = min(best, (mid + 2 * rest) / 2.0 + (mid + rest) / 1.0)
        assert s.predicted_seconds == pytest.approx(best)


def test_static_split_counts_the_cpu_update_and_respects_the_host():
    # The hand-computed case above, with a CPU optimizer updating 1 B/s: every chunk whose
    # optimizer state is offloaded now costs 10 s more. p=4, o=0: 80 + 40 = 120 s; p=1, o=1:
    # 90 + 30 = 120 s (tie: more parameters kept wins); p=2, o=1 (20 + 30 + buffer 10 = 60):
    # h2d 10 + 2*20 = 50, d2h 10 + 20 = 30, cpu 30 -> 110 s: the best now.
    s = static_split([10] * 4, [30] * 4, 60, h2d_bandwidth=1.0, d2h_bandwidth=1.0, cpu_update_bandwidth=1.0)
    assert (s.num_param_chunks, s.num_optim_chunks) == (2, 1)
    assert s.predicted_seconds == 110.0
    assert "of CPU optimizer update" in s.explain()
    # The host holds 25 B per offloaded chunk: 3 offloaded (75 B) fit a 75 B host, 4 (100 B) do not.
    h = static_split(
        [10] * 4, [30] * 4, 60, h2d_bandwidth=1.0, d2h_bandwidth=1.0, host_bytes=[25] * 4, host_budget_bytes=75
    )
    assert h.num_optim_chunks >= 1
    with pytest.raises(ValueError, match="no split fits both budgets"):
        static_split(
            [10] * 4, [30] * 4, 60, h2d_bandwidth=1.0, d2h_bandwidth=1.0, host_bytes=[25] * 4, host_budget_bytes=10
        )


def test_split_costs_fp32_masters_and_bf16_copies():
    """fp32 parameters are their own masters (AdamW: 4 B on the device, 12 B optimizer side, 16 B
    on the host when offloaded); bf16 copies (param_dtype) move the fp32 master to the optimizer
    side and keep a 2-byte copy, on the host too when offloaded: 18 B per element either way."""
    from behemoth.parallel.zero.placement import split_costs

    dev, ratio, host = split_costs([10, 30], 8)
    assert dev == [40, 120] and ratio == 3.0 and host == [160, 480]
    dev, ratio, host = split_costs([10, 30], 8, param_bytes=2)
    assert dev == [20, 60] and ratio == 8.0 and host == [180, 540]
    for pb, per_element in ((4, 16), (2, 18)):  # everything on the device: parameters + optimizer side
        dev, ratio, _ = split_costs([10, 30], 8, pb)
        assert [d + d * ratio for d in dev] == [10 * per_element, 30 * per_element]
    with pytest.raises(ValueError, match="param_bytes=3"):
        split_costs([1], 8, param_bytes=3)


def test_chunk_split_per_stage_and_the_measured_budget():
    """The split ``offload='auto'`` runs (and the planner predicts with): at ZeRO-3 the static split
    itself; at stages 1-2 every chunk keeps its parameters and the longest prefix of optimizer sides
    the budget holds beside them (fp32 AdamW: 12 B an element; chunks of 10 elements: 120 B each)."""
    from behemoth.parallel.zero.placement import chunk_split, measured_budget

    p, o, why = chunk_split(3, [10] * 4, 8, 4, 400, bandwidth=1.0)
    s = static_split(*split_costs_of([10] * 4), 400, h2d_bandwidth=1.0, d2h_bandwidth=1.0)
    assert (p, o) == (s.num_param_chunks, s.num_optim_chunks) and why == s
    for stage in (1, 2):
        assert chunk_split(stage, [10] * 4, 8, 4, 250, bandwidth=1.0) == (4, 2, (2, 4, 250))
        assert chunk_split(stage, [10] * 4, 8, 4, 480, bandwidth=1.0)[:2] == (4, 4)
        assert chunk_split(stage, [10] * 4, 8, 4, 119, bandwidth=1.0)[:2] == (4, 0)
        # the whole parameters (160 B) stay on the device inside the budget: 410 B leave 250 B
        assert chunk_split(stage, [10] * 4, 8, 4, 410, bandwidth=1.0, resident_bytes=160) == (4, 2, (2, 4, 250))
    # the budget after a warm-up: 92% of the device less its measured other peak and 2 GiB
    assert measured_budget(100 * 2**30, 10 * 2**30) == int(100 * 2**30 * 0.92) - 12 * 2**30


def split_costs_of(shards):
    from behemoth.parallel.zero.placement import split_costs

    dev, ratio, _ = split_costs(shards, 8)
    return dev, ratio


def test_other_peak_is_read_between_hooks_not_from_the_end_of_the_step():
    """offload='auto''s warm-up measure of non-model memory: the activations peak before the
    gradients (model data) exist, so the step's peak less its *final* model data under-counts
    them (the old reading; GPT-13B on an H200 then ran out of memory in step 2)."""
    from behemoth.parallel.zero.measure import OtherPeak

    mem = {"model": 10, "alloc": 10, "peak": 10}

    def alloc(n):
        mem["alloc"], mem["peak"] = n, max(mem["peak"], n)

    def reset():
        mem["peak"] = mem["alloc"]

    probe = OtherPeak(lambda: mem["model"], lambda: mem["peak"], reset)
    probe.sample()  # not started: nothing read
    assert probe.finish() is None and not probe.running
    probe.start()
    for a in (30, 50, 75, 60):  # forward: activations, then the loss's logits (a transient 65 above the model)
        alloc(a)
        probe.sample()
    for _ in range(3):  # backward: each segment frees 15 of activations, adds 10 of gradients
        alloc(mem["alloc"] - 15 + 10)
        mem["model"] += 10
        probe.sample()
    # 65; the old reading, the step's peak less its final model data, gave 75 - 40 = 35
    assert probe.finish() == 65 and not probe.running
    probe.start()  # a retried step starts afresh (not from 65) ...
    alloc(mem["alloc"] + 20)  # ... and a transient after the last hook is read by finish()
    alloc(mem["alloc"] - 20)
    assert probe.finish() == 45 + 20 - 40

"""What one decode step of bh.generate costs under 1D tensor parallelism (tp = 2, gloo), pinned.

* collectives: exactly one all-reduce for the embedding, two per layer (attention's and the
  MLP's row layers) and one all-gather of the logits per forward, nothing on other axes;
* host syncs (``.item()``, ``.tolist()``, ``bool(t)``, ...): a fixed number per call, none
  per decode step, under tp = 1 and tp = 2 alike;
* no autograd Function runs in a decode step (the 1D layers' no-grad forward: no region
  bookkeeping, functional collectives);
* ``torch.compile`` of the model's forward under tp = 2 traces prefill and decode into one
  graph each (``fullgraph=True``: the collectives are inside the graph), compiles nothing
  new on a second call, and gives the serial model's tokens;
* ``bh.generate(compile=backend)`` compiles the whole decode step (forward, pick, bookkeeping)
  once, compiles nothing new on a second call, syncs the host a fixed
  number of times per call, and gives the serial model's greedy tokens, seeded samples and
  EOS-stopped rows; checking EOS every 5 steps gives the tokens of checking after every step;
  the timings are positive;
* ``one_shot_all_reduce=True`` under gloo falls back to the usual all-reduce (same tokens, same
  ledger); with a stand-in switched on for the tp axis, exactly the decode steps' all-reduces
  (those within its byte bound) go through it, booked in the ledger as before.

The reference is the serial model's greedy tokens, computed in each process.
"""

from __future__ import annotations

import contextlib

import torch

import behemoth as bh

VOCAB, SEQ, LAYERS = 96, 64, 3
ROWS = [[5, 6, 7, 8, 9], [3, 4], [11]]
SYNCS = ("item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__")


def build() -> torch.nn.Module:
    from behemoth.models import Llama, LlamaConfig

    cfg = LlamaConfig(vocab_size=VOCAB, seq_len=SEQ, num_layers=LAYERS, num_heads=4, num_kv_heads=2, hidden=32)
    return Llama(cfg).eval()


@contextlib.contextmanager
def counted_host_syncs():
    """Count the calls of every Tensor method that copies a value to the host (a device sync
    on a GPU) for the duration; yields the list of the names called."""
    calls: list[str] = []
    saved = {name: torch.Tensor.__dict__.get(name) for name in SYNCS}
    originals = {name: getattr(torch.Tensor, name) for name in SYNCS}

    def counting(name):
        def method(self, *args, **kwargs):
            calls.append(name)
            return originals[name](self, *args, **kwargs)

        return method

    for name in SYNCS:
        setattr(torch.Tensor, name, counting(name))
    try:
        yield calls
    finally:
        for name in SYNCS:
            if saved[name] is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, saved[name])


def _collectives(model, want, world: int) -> None:
    ledger = model._behemoth_parallelization.mesh.ledger
    for new in (1, 9):
        ledger.reset()
        assert bh.generate(model, ROWS, max_new_tokens=new) == [r[:new] for r in want]
        stats = ledger.stats()
        forwards = new  # the prefill and new - 1 decode steps
        assert set(stats) == {"tp"}, stats
        assert stats["tp"]["ops"] == {"all_reduce": forwards * (1 + 2 * LAYERS), "all_gather": forwards}, (new, stats)


def _host_syncs(model, want) -> None:
    counts = []
    for new in (2, 12):
        with counted_host_syncs() as calls:
            out = bh.generate(model, ROWS, max_new_tokens=new)
        assert out == [r[:new] for r in want]
        counts.append(sorted(calls))
    assert counts[0] == counts[1], f"host syncs grow with the decode steps: {counts}"


def _no_autograd_functions(model) -> None:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        bh.generate(model, ROWS, max_new_tokens=4)
    names = {e.key for e in prof.key_averages()}
    ran = sorted(n for n in names if n.endswith("Fn") or n.endswith("Axis"))
    assert not ran, f"autograd Functions ran during generation: {ran}"
    assert "_c10d_functional::all_reduce" in names, sorted(names)


def _compiled(model, want) -> None:
    import torch._dynamo
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    eager_forward = model.forward
    model.forward = torch.compile(eager_forward, backend=counter, fullgraph=True, dynamic=False)
    try:
        assert bh.generate(model, ROWS, max_new_tokens=8) == [r[:8] for r in want]
        assert counter.frame_count == 2, counter.frame_count  # the prefill's shapes and the decode step's
        assert bh.generate(model, ROWS, max_new_tokens=8) == [r[:8] for r in want]
        assert counter.frame_count == 2, counter.frame_count  # a second call reuses both graphs
    finally:
        model.forward = eager_forward
        torch._dynamo.reset()


SAMPLING = dict(do_sample=True, temperature=0.8, top_k=40, top_p=0.9, seed=7)


def _compiled_step(model, want, sampled, want_eos, eos) -> None:
    import torch._dynamo
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    try:
        for _ in range(2):
            assert bh.generate(model, ROWS, max_new_tokens=12, compile=counter) == want
            assert counter.frame_count == 1, counter.frame_count  # the decode step, once
        counts = []
        for new in (3, 12):
            with counted_host_syncs() as calls:
                out = bh.generate(model, ROWS, max_new_tokens=new, compile=counter)
            assert out == [r[:new] for r in want]
            counts.append(sorted(calls))
        assert counts[0] == counts[1], f"host syncs grow with the decode steps: {counts}"
        assert bh.generate(model, ROWS, max_new_tokens=12, compile=counter, **SAMPLING) == sampled
        assert bh.generate(model, ROWS, max_new_tokens=12, compile=counter, eos_token_id=eos) == want_eos
        got = bh.generate(model, ROWS, max_new_tokens=12, compile=counter, eos_token_id=eos, return_timing=True)
        assert got.tokens == want_eos and got.logits_BTV is None
        assert got.prefill_s > 0 and got.decode_s > 0 and got.decode_steps == 11, vars(got)
    finally:
        torch._dynamo.reset()
    for every in (1, 5):
        assert bh.generate(model, ROWS, max_new_tokens=12, eos_token_id=eos, stop_check_every=every) == want_eos


def _one_shot(model, want) -> None:
    import torch.distributed as dist

    from behemoth.comm import oneshot

    axis = model._behemoth_parallelization.mesh.axis("tp")
    ledger = model._behemoth_parallelization.mesh.ledger
    per_forward = {"all_reduce": 1 + 2 * LAYERS, "all_gather": 1}
    with bh.comm.one_shot_all_reduce(axis) as impl:
        assert impl is None  # gloo on CPU: the usual all-reduce stays
    ledger.reset()
    assert bh.generate(model, ROWS, max_new_tokens=9, one_shot_all_reduce=True) == [r[:9] for r in want]
    assert ledger.stats()["tp"]["ops"] == {k: 9 * n for k, n in per_forward.items()}

    class StandIn:  # sums as the one-shot kernel would, through gloo, and counts what it is given
        max_bytes = 1024  # a decode step's [3, 1, 32] fp32 (384 bytes), not the prefill's [3, 5, 32] (1920)
        group_name = axis.group.group_name

        def __init__(self):
            self.sizes = []

        def __call__(self, t):
            self.sizes.append(t.numel() * t.element_size())
            out = t.clone()
            dist.all_reduce(out, group=axis.group)
            return out

    stand_in, rule = StandIn(), oneshot.eligible
    oneshot._ACTIVE[axis.group.group_name] = stand_in
    oneshot.eligible = lambda nbytes, dtype, device_type, max_bytes: rule(nbytes, dtype, "cuda", max_bytes)
    try:
        ledger.reset()
        assert bh.generate(model, ROWS, max_new_tokens=9) == [r[:9] for r in want]
    finally:
        oneshot._ACTIVE.pop(axis.group.group_name)
        oneshot.eligible = rule
    assert stand_in.sizes == [384] * 8 * (1 + 2 * LAYERS), stand_in.sizes  # 8 decode steps
    assert ledger.stats()["tp"]["ops"] == {k: 9 * n for k, n in per_forward.items()}


def _world(rank, world):
    want = bh.generate(build(), ROWS, max_new_tokens=12)
    sampled = bh.generate(build(), ROWS, max_new_tokens=12, **SAMPLING)
    eos = want[0][3]
    want_eos = bh.generate(build(), ROWS, max_new_tokens=12, eos_token_id=eos, stop_check_every=1)
    assert len(want_eos[0]) == 4 and len(want_eos[1]) > 4, want_eos  # rows stop at different steps
    serial_syncs = []
    for new in (2, 12):
        with counted_host_syncs() as calls:
            bh.generate(build(), ROWS, max_new_tokens=new)
        serial_syncs.append(sorted(calls))
    assert serial_syncs[0] == serial_syncs[1], serial_syncs
    model = bh.parallelize(build(), bh.Plan(tp=world))
    _collectives(model, want, world)
    _host_syncs(model, want)
    _no_autograd_functions(model)
    _compiled(model, want)
    _compiled_step(model, want, sampled, want_eos, eos)
    _one_shot(model, want)
    # sequence parallelism: the decode steps pause it, so they communicate as plain 1D does
    sp = bh.parallelize(build(), bh.Plan(tp=world, sequence_parallel=True))
    assert bh.generate(sp, ROWS, max_new_tokens=12) == want
    _host_syncs(sp, want)


def test_decode_step_under_tp2():
    bh.spawn(_world, 2, timeout=600)

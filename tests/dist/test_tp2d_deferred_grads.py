"""Deferred gradient reductions of the grid layers (behemoth.parallel.tensor.deferred_grads),
2D on 4 gloo ranks and 2.5D (depth 2) on 8.

A model of grid layers (LayerNorm, Linear with bias, RMSNorm, Linear without, Linear with) runs
three training passes (an SGD update between them), in float64 and under bf16 autocast, once
as built and once with ``install_deferred_grads``. Checked:

* every output, input gradient, parameter gradient and updated parameter is bit-identical, and
  the ledger books the same bytes per axis and operation, and the same calls but on ``tp_row``
  (and ``tp_depth``), where the biases' and norms' gradients are summed in one all-reduce per
  flushed bucket instead of one per layer (and one per parameter over ``tp_depth``): a flush
  when a layer lands a gradient still in a bucket -- per pass 4 (the first, which lands each
  layer right after its backward), 3 with lead 1 (out; rms and fc; ln) and 1 with lead 100;
* where gradients land: without deferral each right after its layer's backward; with it, from
  the second pass on (the first records the layers' order), ``lead`` layers later (lead 1: the
  last Linear's weight after the Linear before it; lead 100: every gradient after the backward
  has reached the input); each pass hands over one reduction per Linear weight and each norm
  weight, norm bias and bias; a layer that does not run gets no gradient and runs no post-accumulate hook;
* evaluation (no gradients) opens no pass.
"""

from __future__ import annotations

import types

import torch
from torch import nn

import behemoth as bh
from behemoth.mesh import ParallelMesh
from behemoth.parallel.tensor import tp2d, tp2p5d
from behemoth.parallel.tensor.deferred_grads import DeferredGrads, GradPass, install_deferred_grads
from behemoth.parallel.tensor.grid import grid_of

B, S, H = 4, 3, 8
F64 = torch.float64


class Chain(nn.Module):
    """Five layers in a row, and a sixth that never runs (its parameters get no gradient)."""

    def __init__(self, ln, fc, rms, proj, out, spare) -> None:
        super().__init__()
        self.ln, self.fc, self.rms, self.proj, self.out, self.spare = ln, fc, rms, proj, out, spare

    def forward(self, x):
        return self.out(self.proj(self.rms(self.fc(self.ln(x)))))


def _serial() -> Chain:
    torch.manual_seed(7)
    return Chain(
        nn.LayerNorm(H),
        nn.Linear(H, 2 * H),
        nn.RMSNorm(2 * H),
        nn.Linear(2 * H, H, bias=False),
        nn.Linear(H, H),
        nn.Linear(H, H),
    )


def _build(mesh, mod, dtype, defer: bool) -> Chain:
    s = _serial().to(dtype)
    with torch.no_grad():  # norms with weights and biases away from 1 and 0
        for p in list(s.ln.parameters()) + list(s.rms.parameters()):
            p.add_(torch.rand(p.shape, generator=torch.Generator().manual_seed(p.numel()), dtype=dtype))
    model = Chain(
        mod.LayerNorm.from_serial(s.ln, mesh),
        mod.Linear.from_serial(s.fc, mesh),
        mod.RMSNorm.from_serial(s.rms, mesh),
        mod.Linear.from_serial(s.proj, mesh),
        mod.Linear.from_serial(s.out, mesh),
        mod.Linear.from_serial(s.spare, mesh),
    )
    if defer:
        g = grid_of(mesh, mesh.plan.tp_mode, "test")
        assert install_deferred_grads(model, g, list(model.children())) is not None
    return model


def _dx_reductions(mesh) -> int:
    """tp_col reduce-scatters so far: one per Linear backward (its dX)."""
    return mesh.ledger.stats().get("tp_col", {}).get("ops", {}).get("reduce_scatter", 0)


def _passes(mesh, mod, split, autocast: bool, defer: bool, lead: int = DeferredGrads.lead):
    """Three training passes and an evaluation: values, ledger, and for each backward whether
    each parameter's gradient landed after the input's, how many Linear backwards had run when
    ``out.weight``'s landed, and the reductions each pass deferred."""
    dtype = torch.float32 if autocast else F64
    model = _build(mesh, mod, dtype, defer)
    after_input: list[bool] = []
    out_landed: list[int] = []
    x_ref: list[torch.Tensor] = []
    at_start: list[int] = []
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: after_input.append(x_ref[-1].grad is not None))
    model.out.weight.register_post_accumulate_grad_hook(
        lambda p: out_landed.append(_dx_reductions(mesh) - at_start[-1])
    )
    passes: list[GradPass] = []
    init = GradPass.__init__

    def recording_init(self, *args):
        init(self, *args)
        passes.append(self)

    GradPass.__init__ = recording_init
    saved_lead, DeferredGrads.lead = DeferredGrads.lead, lead
    mesh.ledger.reset()
    outs = []
    try:
        for step in range(3):
            full = torch.randn(B, S, H, generator=torch.Generator().manual_seed(step), dtype=dtype)
            x = split(full, mesh).requires_grad_()
            x_ref.append(x)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                y = model(x)
            at_start.append(_dx_reductions(mesh))
            y.float().pow(2).sum().backward()
            assert model.spare.weight.grad is None and model.spare.bias.grad is None
            outs += [y.detach(), x.grad] + [p.grad.clone() for p in model.parameters() if p.grad is not None]
            with torch.no_grad():
                for p in model.parameters():
                    p.sub_(0 if p.grad is None else 0.1 * p.grad)
                    p.grad = None
        with torch.no_grad():
            outs.append(model(split(torch.ones(B, S, H, dtype=dtype), mesh)))
    finally:
        GradPass.__init__ = init
        DeferredGrads.lead = saved_lead
    outs += [p.detach() for p in model.parameters()]
    ledger = {a: {k: v for k, v in s.items() if k != "seconds"} for a, s in mesh.ledger.stats().items()}
    return outs, ledger, after_input, out_landed, [gp.deferred for gp in passes], [gp.flushes for gp in passes]


def _check(mesh, mod, split):
    _twice(mesh, mod, split)
    for autocast in (False, True):
        what = f"{mesh.plan.describe()} autocast={autocast}"
        want, want_ledger, want_after, want_out, want_handed, _ = _passes(mesh, mod, split, autocast, defer=False)
        assert want_handed == [] and not all(want_after) and want_out == [1, 1, 1], f"{what}: without deferral"
        # lead 1: out's node is made at proj's forward from the second pass on (the first records
        # the order), so out.weight lands after proj's backward; lead 100: after the input's
        for lead, landed, flushes in ((1, [1, 2, 2], [4, 3, 3]), (100, [1, 3, 3], [4, 1, 1])):
            got, ledger, after, out, handed, flushed = _passes(mesh, mod, split, autocast, defer=True, lead=lead)
            assert len(got) == len(want)
            for i, (a, b) in enumerate(zip(got, want)):
                assert torch.equal(a, b), f"{what} lead {lead}: deferral changes value {i}"
            assert flushed == flushes, f"{what} lead {lead}: buckets flushed per pass {flushed}"
            # without deferral, per pass: 4 all-reduces over tp_row (ln's weight and bias in one, fc's
            # and out's biases, rms's weight) and, under Tesseract, one per parameter over tp_depth (5
            # vectors, 3 weights); with it one per flush on each, and the weights' 3 over tp_depth
            bucketed = _bucketed(want_ledger, {"tp_row": 3 * 4, "tp_depth": 3 * 5}, sum(flushes))
            assert ledger == bucketed, f"{what} lead {lead}: ledger {ledger} != {bucketed}"
            assert len(after) == 3 * 8, f"{what} lead {lead}: {len(after)} gradients landed"
            assert out == landed, f"{what} lead {lead}: out.weight landed after {out} Linear backwards"
            if lead == 100:  # passes 2 and 3: every gradient after the input's
                assert all(after[8:]), f"{what}: a gradient landed before the backward reached the input"
            # per pass: 3 Linear weights' reductions, and 5 vectors into buckets (ln's weight and
            # bias, rms's weight, 2 biases); the evaluation opens none
            assert handed == [8, 8, 8], f"{what} lead {lead}: {handed}"


def _bucketed(ledger: dict, vectors: dict, flushes: int) -> dict:
    """``ledger`` (of a run without deferral) with the all-reduces of ``vectors[axis]`` gradient
    vectors on each axis it has replaced by ``flushes`` bucket all-reduces: same bytes, fewer calls."""
    out = {a: dict(s, ops=dict(s["ops"])) for a, s in ledger.items()}
    for axis, n in vectors.items():
        if axis in out:
            out[axis]["ops"]["all_reduce"] += flushes - n
            out[axis]["calls"] += flushes - n
    return out


class Twice(nn.Module):
    """One Linear applied twice in a forward: its reductions are handed over twice and summed."""

    def __init__(self, lin) -> None:
        super().__init__()
        self.lin = lin

    def forward(self, x):
        return self.lin(self.lin(x))


def _twice(mesh, mod, split):
    grads = []
    for defer in (False, True):
        torch.manual_seed(3)
        model = Twice(mod.Linear.from_serial(nn.Linear(H, H).double(), mesh))
        if defer:
            install_deferred_grads(model, grid_of(mesh, mesh.plan.tp_mode, "test"), [model.lin])
        x = split(torch.randn(B, S, H, generator=torch.Generator().manual_seed(5), dtype=F64), mesh)
        for _ in range(2):  # the second pass follows the first one's order
            model(x.requires_grad_()).pow(2).sum().backward()
        grads.append([x.grad, model.lin.weight.grad, model.lin.bias.grad])
    for a, b in zip(*grads):  # Tesseract sums the two uses' parts before its depth all-reduce: rounding
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=f"{mesh.plan.describe()}: a Linear run twice")


L2D = types.SimpleNamespace(LayerNorm=tp2d.LayerNorm2D, Linear=tp2d.Linear2D, RMSNorm=tp2d.RMSNorm2D)
L25D = types.SimpleNamespace(LayerNorm=tp2p5d.LayerNorm25D, Linear=tp2p5d.Linear25D, RMSNorm=tp2p5d.RMSNorm25D)


def _world_2d(rank, world):
    _check(ParallelMesh(bh.Plan(tp=4, tp_mode="2d"), rank, world), L2D, tp2d.split_activation_2d)


def _world_25d(rank, world):
    _check(ParallelMesh(bh.Plan(tp=8, tp_mode="2.5d", tp_depth=2), rank, world), L25D, tp2p5d.split_activation_25d)


def test_2d_deferred_gradients_match_and_land_last():
    bh.spawn(_world_2d, 4)


def test_25d_deferred_gradients_match_and_land_last():
    bh.spawn(_world_25d, 8, timeout=600)


# Collective calls of one training step of a tiny model under 2D (q = 2, 4 ranks), from the second
# step on: (family, ledger calls at most on a rank of the grid's diagonal -- the others add the
# embedding's swap with the transposed rank, forward and backward --, all-reduces over tp_row other
# than the bucket flushes: the loss's sum over the batch blocks, and GPT's learned position table).
# Before the biases' and norms' gradients were summed in buckets: GPT 76 calls (15 all-reduces over
# tp_row), Llama 97 (6).
STEP_CALLS = (("gpt", 65, 2), ("llama", 95, 1))


def _step_calls_world(rank, world):
    from common import SEQ, build, global_batches, make_optimizer, shard

    from behemoth.planner.tp2d_traffic import grid_deferred_layers, grid_vector_flushes
    from behemoth.planner.workload import workload_for

    for family, most, others in STEP_CALLS:
        model = build(family)
        shape = workload_for(model, seq_len=SEQ, global_batch=8).shape
        engine = bh.boost(model, make_optimizer("sgd", model), bh.Plan(tp=4, tp_mode="2d"))
        batches = global_batches(3, 8)
        for i, batch in enumerate(batches):
            if i == len(batches) - 1:  # the first pass records the layers' order: count a later one
                engine.mesh.ledger.reset()
            engine.step(shard(batch, engine.dp_rank, engine.dp_size))
        stats = engine.comm_stats()
        calls = sum(s["calls"] for s in stats.values())
        flushes = grid_vector_flushes(grid_deferred_layers(shape, 2, shape.num_layers))
        row = stats["tp_row"]["ops"]["all_reduce"]
        assert row == flushes + others, f"{family}: {row} all-reduces over tp_row, {flushes} flushes + {others}"
        most += 0 if engine.mesh.coord("tp_row") == engine.mesh.coord("tp_col") else 2
        assert calls <= most, f"{family}: {calls} collective calls a step, more than {most}: {stats}"


def test_2d_step_collective_calls():
    """A 2D step's collective calls (the ledger's): the biases' and norms' gradient all-reduces over
    tp_row are the planner's bucket flushes (GPT: 2 for 13 vectors; Llama: 3 for 5), and the step
    issues no more calls than it did when they were counted (GPT 65, Llama 95)."""
    bh.spawn(_step_calls_world, 4)

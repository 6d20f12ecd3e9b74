"""An MoE model trained with compiled blocks on ranks that hold every expert (``Plan(dp=2,
compile=True, precision="bf16")``: a trivial ep axis): the device-only route
(:mod:`behemoth.parallel.expert.local`) is traced into each block's one graph -- no graph break --
and the run follows serial autocast training (losses, gradient norms, ``full_state_dict()``).

The route needs the grouped GEMMs' fast kernel, which only a CUDA build has; it is claimed here for
bf16 GEMMs on the CPU (``torch._grouped_mm`` then runs a loop of its own), as the layer's unit tests
claim it. The compiled blocks use inductor, the library's setting.
"""

from __future__ import annotations

import torch
from common import assert_grad_norms_close, assert_losses_close, assert_state_close, global_batches, train_steps
from test_expert_parallel import build_moe, optimizer_for, serial_moe_run

import behemoth as bh
from behemoth.parallel.expert import grouped, style

STEPS, BATCH = 3, 8


def _compiled_world(rank: int, world: int) -> None:
    batches = global_batches(STEPS, BATCH)
    want = serial_moe_run(batches, clip=1.0, world=world, dtype=torch.bfloat16, opt_name="sgd")
    grouped._fast_kernel = lambda x: grouped.gemm_dtype(x) == torch.bfloat16
    traced = []
    real = style.local_exchange
    style.local_exchange = lambda *a: traced.append(1) or real(*a)  # called while dynamo traces a block
    torch._dynamo.utils.counters.clear()
    model = build_moe()
    plan = bh.Plan(dp=world, compile=True, precision="bf16")
    engine = bh.boost(model, optimizer_for(model, "sgd"), plan, max_grad_norm=1.0)
    losses, norms = train_steps(engine, batches)
    breaks = dict(torch._dynamo.utils.counters["graph_break"])
    assert traced, "the compiled blocks did not take the device-only route"
    assert not breaks, f"graph breaks in the compiled MoE blocks: {breaks}"
    what = f"dp={world} compile=True precision=bf16, device-only route"
    assert_losses_close(losses, want[0], what=what, rtol=2e-2)
    assert_grad_norms_close(norms, want[2], what=what, rtol=2e-2)
    assert_state_close(engine.full_state_dict(), want[1], what=what, rtol=2e-2, atol=2e-3)


def test_compiled_moe_blocks_trace_the_local_route_and_match_serial():
    bh.spawn(_compiled_world, 2, timeout=900)

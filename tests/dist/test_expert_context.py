"""Experts under context parallelism: attention over sequence shards (Ulysses, ring), experts
sharded over ep and replicated over ep_dp x cp (their gradients summed there), the router losses
over every token of the global batch -- against serial training (losses, every step's gradient
norm, ``full_state_dict()``, rtol 1e-4, fp32) on dp=2 x cp=2 with ep=2, plain and under ZeRO-2.
A capacity per sequence is refused under cp (the sequence is split), before any collective."""
from __future__ import annotations

import torch

import behemoth as bh
from behemoth.models import Llama, LlamaConfig

from common import (SEQ, VOCAB, assert_grad_norms_close, assert_losses_close, assert_state_close, expect_error,
                    global_batches, train_steps)
from test_expert_parallel import BATCH, STEPS, build_moe, optimizer_for, serial_moe_run


def _context_world(rank: int, world: int) -> None:
    batches = global_batches(STEPS, BATCH)
    want = serial_moe_run(batches, clip=1.0)
    for mode, zero in (("ulysses", 0), ("ring", 2)):
        what = f"dp=2 cp=2 ({mode}) ep=2 zero={zero}"
        model = build_moe()
        plan = bh.Plan(dp=2, cp=2, cp_mode=mode, ep=2, zero=zero)
        engine = bh.boost(model, optimizer_for(model), plan, max_grad_norm=1.0)
        shard = engine.model.layers[0].mlp.gate_up_proj
        assert shard.shape[0] == 2 and shard._behemoth_expert_shard.data_axis == "ep_dp_cp", what
        losses, norms = train_steps(engine, batches)
        assert_losses_close(losses, want[0], what=what)
        assert_grad_norms_close(norms, want[2], what=what)
        assert_state_close(engine.full_state_dict(), want[1], what=what)
        counts = engine.expert_token_counts()["layers.0.mlp"]
        assert counts == want[3][0], (what, counts)  # over every token of the global batch
    capped = Llama(LlamaConfig(vocab_size=VOCAB, seq_len=SEQ, num_layers=2, num_heads=4, num_kv_heads=2, hidden=32,
                               num_experts=4, expert_ffn_hidden=24, expert_capacity_factor=1.0))
    expect_error(lambda: bh.boost(capped, optimizer_for(capped), bh.Plan(dp=2, cp=2, ep=2)), "cp=2", "capacity",
                 kind=NotImplementedError)
    t = torch.ones(1)
    torch.distributed.all_reduce(t)  # every rank got here: nothing hung
    assert t.item() == world


def test_experts_with_context_parallel_match_serial():
    bh.spawn(_context_world, 4, timeout=1200)

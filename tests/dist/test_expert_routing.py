"""Routing under expert parallelism matches serial training, including the adversarial cases:
losses, every step's gradient norm, ``full_state_dict()`` (the balancing biases included) and the
per-expert token and drop counts, rtol 1e-4 in fp32, at dp=2 x ep=2.

* sigmoid scores with the auxiliary-loss-free bias (updated once per step from the global
  counts of every micro-batch, with activation checkpointing recomputing each block), a shared
  expert, unnormalised top-k weights, and a capacity that drops assignments: the same ones as
  the serial model;
* one hot expert (a frozen, all-zero router with top-1 sends every token to one expert, so one
  ep rank's experts get no token at all), with and without a capacity, and under ZeRO-3 (ep_dp = 1:
  expert chunks unsharded, the idle rank's experts still gathered and reduced in step);
* a rank whose batch is empty (0 rows) while the other holds the whole global batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from common import (
    assert_grad_norms_close,
    assert_losses_close,
    assert_state_close,
    global_batches,
    moe_llama_config,
    shard,
)

import behemoth as bh
from behemoth.models import Llama
from behemoth.models.moe import update_expert_bias
from behemoth.parallel.expert.traffic import ep_all_to_all_bytes

STEPS, BATCH = 3, 8

OPTIONS = {
    "sigmoid-bias-shared-capacity": dict(
        router_score_func="sigmoid",
        router_bias_update_rate=0.05,
        shared_expert_ffn_hidden=16,
        router_norm_topk=False,
        expert_capacity_factor=1.0,
    ),
    "hot-expert": dict(experts_top_k=1),
    "hot-expert-capacity": dict(experts_top_k=1, expert_capacity_factor=2.0),
}


def build(name: str) -> Llama:
    model = Llama(moe_llama_config(**{"router_aux_loss_coef": 0.05, "router_z_loss_coef": 0.01, **OPTIONS[name]}))
    if name.startswith("hot"):  # equal scores: top-1 is the same expert for every token
        for layer in model.layers:
            layer.mlp.router.weight.data.zero_()
            layer.mlp.router.weight.requires_grad_(False)
    return model


def adamw(model):
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3, weight_decay=0.1, eps=1e-5)


def serial_run(name, batches, world, micro):
    """Plain PyTorch: micro-batch i of the step is micro-batch i of every data rank together;
    its router losses weigh 1/micro; the balancing bias moves once per step."""
    model = build(name)
    opt = adamw(model)
    losses, norms, counts, rows = [], [], [], []
    for b in batches:
        rows.append([])
        n = (b["labels"] != -100).sum()
        loss = 0.0
        for i in range(micro):
            g = {k: torch.cat([shard(b, r, world)[k].chunk(micro)[i] for r in range(world)]) for k in b}
            logits = model(g["input_ids"])
            ce = F.cross_entropy(logits.flatten(0, 1), g["labels"].flatten(), ignore_index=-100, reduction="sum")
            part = ce / n + model.aux_loss() / micro
            part.backward()
            loss += part.item()
            rows[-1] += [int(l.mlp.token_counts.sum() - l.mlp.dropped_counts.sum()) for l in model.layers]
        norms.append(torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0).item())
        opt.step()
        opt.zero_grad()
        update_expert_bias(model)
        losses.append(loss)
        counts.append([(l.mlp.token_counts.tolist(), l.mlp.dropped_counts.tolist()) for l in model.layers])
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, norms, counts, rows


def check_ledger(engine, rows, world, recompute, what) -> None:
    """The ep axis's bytes, summed over its ranks, equal the formula for every layer's forward and
    backward of every micro-batch (the kept rows the serial run dispatched), plus the gradient
    norm's one fp32 all-reduce per step."""
    sent = torch.tensor([float(engine.comm_stats()["ep"]["bytes"])], dtype=torch.float64)
    torch.distributed.all_reduce(sent)
    want = (
        sum(
            ep_all_to_all_bytes(rows=r, num_experts=4, ep=2, hidden=32, recompute=recompute)
            for step in rows
            for r in step
        )
        + len(rows) * world * 4
    )
    assert sent.item() == want, (what, sent.item(), want)


def _routing_world(rank: int, world: int) -> None:
    batches = global_batches(STEPS, BATCH)
    for name, micro, ckpt, zero in (
        ("sigmoid-bias-shared-capacity", 2, True, 0),
        ("hot-expert", 1, False, 0),
        ("hot-expert-capacity", 1, False, 0),
        ("hot-expert", 1, False, 3),
    ):
        what = f"{name} dp={world} ep=2 micro={micro} ckpt={ckpt} zero={zero}"
        want = serial_run(name, batches, world, micro)
        model = build(name)
        plan = bh.Plan(dp=world, ep=2, microbatches=micro, activation_checkpointing=ckpt, zero=zero)
        engine = bh.boost(model, adamw(model), plan, max_grad_norm=1.0)
        losses, norms = [], []
        for step, b in enumerate(batches):
            losses.append(engine.step(shard(b, engine.dp_rank, engine.dp_size)))
            norms.append(engine.last_grad_norm)
            got = [(l.mlp.token_counts.tolist(), l.mlp.dropped_counts.tolist()) for l in engine.model.layers]
            assert got == want[3][step], (what, step, got, want[3][step])  # the same drops as serial
            assert engine.expert_token_counts()["layers.0.mlp"] == want[3][step][0][0], what
        if zero == 0:  # (ZeRO's gradient norm is summed over dp, not ep)
            check_ledger(engine, want[4], world, ckpt, what)
        assert_losses_close(losses, want[0], what=what)
        assert_grad_norms_close(norms, want[2], what=what)
        assert_state_close(engine.full_state_dict(), want[1], what=what)
        if name.startswith("hot"):
            counts = want[3][-1][0][0]
            assert sorted(counts)[:-1] == [0.0] * 3, (what, counts)  # one expert got every token
            dropped = want[3][-1][0][1]
            assert (sum(dropped) > 0) == name.endswith("capacity"), (what, dropped)
        else:
            assert any(sum(d) > 0 for step in want[3] for _, d in step), what  # the capacity dropped some
            assert engine.model.layers[0].mlp.expert_bias.abs().sum() > 0, what  # the bias moved

    # an empty rank: rank 0 holds the whole global batch, rank 1 none of it (0 rows)
    what = f"empty batch on rank 1, dp={world} ep=2"
    want = serial_run("sigmoid-bias-shared-capacity", batches, 1, 1)
    model = build("sigmoid-bias-shared-capacity")
    engine = bh.boost(model, adamw(model), bh.Plan(dp=world, ep=2), max_grad_norm=1.0)
    losses, norms = [], []
    for b in batches:
        mine = b if engine.dp_rank == 0 else {k: v[:0] for k, v in b.items()}
        losses.append(engine.step(mine))
        norms.append(engine.last_grad_norm)
    check_ledger(engine, want[4], world, False, what)
    assert_losses_close(losses, want[0], what=what)
    assert_grad_norms_close(norms, want[2], what=what)
    assert_state_close(engine.full_state_dict(), want[1], what=what)


def test_expert_routing_matches_serial():
    bh.spawn(_routing_world, 2, timeout=900)

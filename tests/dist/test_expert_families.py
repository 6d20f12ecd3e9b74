"""transformers' mixture-of-experts models, unchanged, under expert parallelism: tiny random
``MixtralForCausalLM``, ``Qwen3MoeForCausalLM`` (a dense first layer, unnormalised top-k weights)
and ``OlmoeForCausalLM`` (8 experts, top-4, unnormalised) train as serial transformers does with
``output_router_logits=True``: the token loss plus ``router_aux_loss_coef`` times transformers'
own ``load_balancing_loss_func`` on the serial batch (``outputs.aux_loss``). Losses, every step's
gradient norm and ``full_state_dict()`` (transformers' keys, experts in the serial ``[E, ...]``
shapes), rtol 1e-4 in fp32, for ep=2 alone and dp=4 x ep=2 / ep=4 (gloo)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from common import (
    SEQ,
    assert_grad_norms_close,
    assert_losses_close,
    assert_state_close,
    global_batches,
    train_steps,
)
from common import (
    build_hf_moe as build_hf_moe_common,
)

import behemoth as bh

STEPS, BATCH = 3, 8


def build_hf_moe(family: str, coef: float = 0.05, layers: int = 2):
    """common.build_hf_moe with its router losses on (weight ``coef``) and weights far from zero."""
    return build_hf_moe_common(
        family,
        num_hidden_layers=layers,
        output_router_logits=coef > 0,
        router_aux_loss_coef=coef,
        initializer_range=0.2,
    )


def adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, eps=1e-5)


def serial_hf_run(family: str, batches, clip=1.0):
    """Serial transformers: cross-entropy over the (already shifted) labels, mean over the global
    batch, plus ``router_aux_loss_coef * outputs.aux_loss`` as transformers adds it."""
    model = build_hf_moe(family)
    opt = adamw(model)
    losses, norms = [], []
    for b in batches:
        out = model(b["input_ids"])
        ce = F.cross_entropy(out.logits.float().flatten(0, 1), b["labels"].flatten(), ignore_index=-100)
        loss = ce + model.config.router_aux_loss_coef * out.aux_loss
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, norms


def _families_world(rank: int, world: int, runs) -> None:
    batches = global_batches(STEPS, BATCH)
    for family, eps in runs:
        want = serial_hf_run(family, batches)
        for ep in eps:
            what = f"{family} dp={world} ep={ep}"
            model = build_hf_moe(family)
            engine = bh.boost(model, adamw(model), bh.Plan(dp=world, ep=ep), max_grad_norm=1.0)
            blocks = engine.parallel.experts.layers
            assert len(blocks) == (1 if family == "qwen3-moe" else 2), (what, list(blocks))
            experts = next(iter(blocks.values())).experts
            assert experts.gate_up_proj.shape[0] == experts.num_experts // ep, what  # E/ep experts here
            losses, norms = train_steps(engine, batches)
            assert_losses_close(losses, want[0], what=what)
            assert_grad_norms_close(norms, want[2], what=what)
            assert_state_close(engine.full_state_dict(), want[1], what=what)
            counts = engine.expert_token_counts()
            k = next(iter(blocks.values())).gate.top_k
            assert all(sum(c) == BATCH * SEQ * k for c in counts.values()), (what, counts)


@pytest.mark.parametrize(
    "world,runs",
    [
        (2, (("mixtral", (2,)), ("qwen3-moe", (2,)), ("olmoe", (2,)))),
        (4, (("mixtral", (2,)), ("olmoe", (4,)))),
    ],
)
def test_transformers_moe_families_match_serial(world, runs):
    bh.spawn(_families_world, world, runs, timeout=900)

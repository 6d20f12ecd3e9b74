"""Routing options of the serial MoE layer (models/moe.py) and the expert style on one rank:
sigmoid scores, unnormalised top-k, the auxiliary-loss-free bias (its update rule, counted once
per step under micro-batches and activation checkpointing), the capacity per sequence (which
assignments it drops, exactly), the shared expert; transformers' MoE blocks through
ExpertParallel on trivial axes equal their own forward, and their balancing loss equals
``load_balancing_loss_func``.

Shape legend: B batch, S sequence, T tokens, H hidden, E experts, K top-k.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from behemoth.comm import Axis, Ledger
from behemoth.models.moe import MoEFeedForward, capacity_keep, expert_capacity, route, swiglu_expert
from behemoth.parallel.expert import ExpertLayers, ExpertParallel, moe_layers

H, I, E, K = 16, 12, 4, 2


class OneRankMesh:
    def __init__(self) -> None:
        self.ledger = Ledger()

    def axis(self, name: str) -> Axis:
        return Axis(name, 1, 0, (0,), None, self.ledger)


def random_layer(dtype=torch.float64, seed=0, **kw) -> MoEFeedForward:
    torch.manual_seed(seed)
    layer = MoEFeedForward(H, I, E, K, **kw).to(dtype)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.5)
    return layer


def loop_reference(layer: MoEFeedForward, x_BSH: torch.Tensor) -> torch.Tensor:
    """Token by token, in GShard's priority order for the capacity (slot 0 of every position of
    a row first, then slot 1, ...), with the layer's scoring and bias."""
    B, S, _ = x_BSH.shape
    out = torch.zeros_like(x_BSH)
    cap = None if layer.capacity_factor is None else expert_capacity(layer.capacity_factor, S, K, E)
    for b in range(B):
        choices = []
        for s in range(S):
            logits = layer.router.weight @ x_BSH[b, s]
            scores = torch.softmax(logits, -1) if layer.score_func == "softmax" else torch.sigmoid(logits)
            bias = layer.expert_bias if layer.expert_bias is not None else torch.zeros(E, dtype=scores.dtype)
            idx = torch.topk(scores + bias, K).indices
            w = scores[idx]
            choices.append((idx.tolist(), w / w.sum() if layer.norm_topk else w))
        used = [0] * E
        for k in range(K):
            for s in range(S):
                e, w = choices[s][0][k], choices[s][1][k]
                if cap is not None and used[e] >= cap:
                    continue
                used[e] += 1
                x = x_BSH[b, s]
                out[b, s] += w * swiglu_expert(x[None], layer.gate_up_proj[e], layer.down_proj[e])[0]
        if layer.shared is not None:
            out[b] += layer.shared(x_BSH[b])
    return out


@pytest.mark.parametrize(
    "options",
    [
        dict(score_func="sigmoid"),
        dict(score_func="softmax", norm_topk=False),
        dict(capacity_factor=0.75),
        dict(capacity_factor=1.0, score_func="sigmoid", shared_ffn_hidden=8),
        dict(bias_update_rate=0.1, score_func="sigmoid"),
    ],
    ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()),
)
def test_routing_options_equal_the_loop_and_the_style_on_one_rank(options):
    layer = random_layer(**options)
    if layer.expert_bias is not None:
        layer.expert_bias.copy_(torch.tensor([0.3, -0.2, 0.0, 0.1]))
    x_BSH = torch.randn(3, 8, H, dtype=torch.float64)
    y = layer(x_BSH)
    torch.testing.assert_close(y, loop_reference(layer, x_BSH), rtol=1e-12, atol=1e-12)
    dropped = float(layer.dropped_counts.sum())
    if layer.capacity_factor == 0.75:  # capacity 3 of 4 per expert per row: some assignment is dropped
        assert dropped > 0
    styled = random_layer(**options)
    styled.load_state_dict(layer.state_dict())
    ExpertParallel().apply(styled, OneRankMesh())
    torch.testing.assert_close(styled(x_BSH), y, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(styled.aux_loss, layer.aux_loss, rtol=1e-12, atol=0)
    assert styled.token_counts.tolist() == layer.token_counts.tolist()
    assert float(styled.dropped_counts.sum()) == dropped


def test_capacity_keep_exact():
    # one row, 4 positions, top-2 of 3 experts, capacity 2: slot 0 first in position order
    experts_BSK = torch.tensor([[[0, 1], [0, 2], [0, 1], [1, 0]]])
    keep = capacity_keep(experts_BSK, 3, 2)
    # slot 0: e0 at s0, s1 kept, s2 dropped; e1 at s3 kept. slot 1: e1 s0 kept (e1 now 2), e2 s1 kept,
    # e1 s2 dropped (full), e0 s3 dropped (full)
    assert keep.tolist() == [[[True, True], [True, True], [False, False], [True, False]]]
    assert expert_capacity(1.25, 16, 2, 8) == 5
    # rows are independent: a row's drops do not depend on the other rows
    two = torch.cat([experts_BSK, torch.tensor([[[2, 1], [2, 1], [2, 1], [2, 1]]])])
    assert capacity_keep(two, 3, 2)[:1].tolist() == keep.tolist()


def test_sigmoid_route_normalises_probs_and_bias_only_chooses():
    logits = torch.tensor([[2.0, 0.0, -1.0, 1.0]])
    probs, w, idx = route(logits, 2, score_func="sigmoid", norm_topk=False, bias_E=torch.tensor([0, 5.0, 0, 0]))
    assert idx.tolist() == [[1, 0]]  # the bias moves expert 1 to the top
    torch.testing.assert_close(w, torch.sigmoid(logits)[:, [1, 0]])  # weights are the scores, no bias
    torch.testing.assert_close(probs.sum(-1), torch.ones(1))


def test_bias_update_counts_each_step_once():
    """Two micro-batches with activation checkpointing: the bias moves once, by the counts of both
    micro-batches' forwards (a recomputed forward does not count)."""
    layer = random_layer(torch.float32, bias_update_rate=0.01, score_func="sigmoid")
    x1, x2 = torch.randn(2, 6, H), torch.randn(2, 6, H)
    for x in (x1, x2):
        y = checkpoint(layer, x, use_reentrant=False)
        y.square().sum().backward()
    with torch.no_grad():
        layer(x1)  # evaluation: not counted
    want = torch.zeros(E, dtype=torch.float64)
    for x in (x1, x2):
        with torch.no_grad():
            _, _, idx = route(layer.router(x.reshape(-1, H)), K, score_func="sigmoid", bias_E=layer.expert_bias)
        want += torch.bincount(idx.reshape(-1), minlength=E).double()
    torch.testing.assert_close(layer.load_counts, want)
    layer.update_bias()
    torch.testing.assert_close(layer.expert_bias, (0.01 * torch.sign(want.mean() - want)).float())
    assert layer.load_counts is None
    before = layer.expert_bias.clone()
    layer.update_bias()  # nothing counted since: no move
    torch.testing.assert_close(layer.expert_bias, before)


def _hf_block(family: str):
    from transformers import MixtralConfig, OlmoeConfig, Qwen3MoeConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralForCausalLM
    from transformers.models.olmoe.modeling_olmoe import OlmoeForCausalLM
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeForCausalLM

    torch.manual_seed(0)
    common = dict(
        vocab_size=32,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        initializer_range=0.3,
        pad_token_id=0,
        bos_token_id=0,
        eos_token_id=0,
    )
    if family == "mixtral":
        model = MixtralForCausalLM(MixtralConfig(**common, intermediate_size=12, num_local_experts=4))
    elif family == "qwen3-moe":
        model = Qwen3MoeForCausalLM(
            Qwen3MoeConfig(
                **common, moe_intermediate_size=12, num_experts=4, num_experts_per_tok=2, mlp_only_layers=[0]
            )
        )
    else:
        model = OlmoeForCausalLM(OlmoeConfig(**common, intermediate_size=12, num_experts=8, num_experts_per_tok=3))
    model.set_experts_implementation("eager")  # transformers' grouped_mm path has no float64
    return model.double()


@pytest.mark.parametrize("family", ["mixtral", "qwen3-moe", "olmoe"])
def test_transformers_blocks_through_the_style_equal_their_forward(family):
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    model = _hf_block(family)
    blocks = moe_layers(model)
    assert list(blocks) == (
        ["model.layers.1.mlp"] if family == "qwen3-moe" else ["model.layers.0.mlp", "model.layers.1.mlp"]
    )
    x_BSH = torch.randn(2, 5, 16, dtype=torch.float64)
    logits, want = [], []
    for block in blocks.values():
        want.append(block(x_BSH))
        logits.append(block.gate(x_BSH.reshape(-1, 16))[0])
    for block in blocks.values():
        ExpertParallel().apply(block, OneRankMesh())
    model.config.output_router_logits, model.config.router_aux_loss_coef = True, 0.5
    record = ExpertLayers(model, blocks)
    for block, y in zip(blocks.values(), want):
        torch.testing.assert_close(block(x_BSH), y, rtol=1e-12, atol=1e-12)
    gate = next(iter(blocks.values())).gate
    theirs = load_balancing_loss_func(tuple(logits), gate.num_experts, gate.top_k)
    torch.testing.assert_close(record.aux_loss(), 0.5 * theirs, rtol=1e-6, atol=0)
    assert record.aux_loss() is None  # read once


def test_moe_layers_of_a_dense_model_and_softmax_probs():
    from behemoth.models import build_model

    assert moe_layers(build_model("llama-tiny", vocab_size=16, seq_len=4)) == {}
    probs, w, idx = route(torch.randn(5, E), K)
    torch.testing.assert_close(probs, F.softmax(probs.log(), -1))

"""Stage partitioning: balanced contiguous splits (checked against brute force), embedding and
head extras on the first and last stage, user overrides with errors that name the fix, the
virtual-stage map for interleaving, cost estimates, and the module layouts of known models.
No processes."""

from __future__ import annotations

import itertools
import random

import pytest

from behemoth.models.gpt import GPT, GPTConfig
from behemoth.models.llama import Llama, LlamaConfig
from behemoth.parallel.pipeline.partition import (
    balance_stages,
    estimate_block_costs,
    find_tied_parameters,
    stage_costs,
    stage_modules,
    tied_parameter_ranks,
    validate_stages,
    virtual_partition,
)
from behemoth.specs import spec_for


def brute_force(costs, pp, first_extra=0.0, last_extra=0.0):
    """The least bottleneck over every contiguous split into pp non-empty stages."""
    n, best = len(costs), float("inf")
    for cuts in itertools.combinations(range(1, n), pp - 1):
        bounds = (0, *cuts, n)
        stages = list(zip(bounds, bounds[1:]))
        best = min(best, max(stage_costs(costs, stages, first_extra=first_extra, last_extra=last_extra)))
    return best


def assert_partition(stages, n, pp):
    assert len(stages) == pp and stages[0][0] == 0 and stages[-1][1] == n
    assert all(a < b for a, b in stages) and all(s[1] == t[0] for s, t in zip(stages, stages[1:]))


def test_balanced_on_known_inputs():
    assert balance_stages([1.0] * 8, 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert balance_stages([1.0] * 8, 1) == [(0, 8)]
    assert balance_stages([1.0] * 4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert balance_stages([5, 1, 1, 1, 1, 1], 2) == [(0, 1), (1, 6)]
    assert balance_stages([1, 2, 3, 4, 5, 6, 7, 8, 9], 3) == [(0, 5), (5, 7), (7, 9)]  # 15, 13, 17
    # the head (4.5 blocks' worth, like GPT-2 small's) leaves the last stage one block
    assert balance_stages([1.0] * 12, 4, last_extra=4.5) == [(0, 3), (3, 7), (7, 11), (11, 12)]
    # the embedding pushes blocks off the first stage
    assert balance_stages([1.0] * 8, 2, first_extra=2.0) == [(0, 3), (3, 8)]
    assert balance_stages([1.0] * 8, 2, last_extra=2.0) == [(0, 5), (5, 8)]
    # pp=1: one stage pays both extras
    assert balance_stages([1.0] * 3, 1, first_extra=2.0, last_extra=1.0) == [(0, 3)]
    # most even among equally good bottlenecks: 3 | 3 | 3 | 3 rather than 2 | 4 ... with the same max
    assert stage_costs([1.0] * 12, balance_stages([1.0] * 12, 4)) == [3.0] * 4


def test_balanced_matches_brute_force():
    rng = random.Random(0)
    for _ in range(150):
        n = rng.randint(1, 9)
        pp = rng.randint(1, n)
        costs = [rng.choice([0.0, 0.5, 1.0, 2.0, 3.0, rng.random() * 4]) for _ in range(n)]
        fe, le = rng.choice([0.0, 1.0, 3.5]), rng.choice([0.0, 2.0, 4.5])
        stages = balance_stages(costs, pp, first_extra=fe, last_extra=le)
        assert_partition(stages, n, pp)
        got = max(stage_costs(costs, stages, first_extra=fe, last_extra=le))
        assert got == pytest.approx(brute_force(costs, pp, fe, le)), (costs, pp, fe, le, stages)


def test_balance_errors():
    with pytest.raises(ValueError, match="pp=5 stages need at least 5 blocks .* has 4. Lower pp"):
        balance_stages([1.0] * 4, 5)
    with pytest.raises(ValueError, match="must be finite and >= 0"):
        balance_stages([1.0, -1.0], 1)
    with pytest.raises(ValueError, match="pp=0"):
        balance_stages([1.0], 0)


def test_validate_stages_override():
    assert validate_stages([(0, 2), (2, 5), (5, 8)], 8, 3) == [(0, 2), (2, 5), (5, 8)]
    assert validate_stages([[0, 8]], 8, 1) == [(0, 8)]
    cases = [
        ([(0, 4), (4, 8)], 3, r"has 2 entries but the pipeline has 3 stages"),
        ([(0, 3), (3, 3), (3, 8)], 3, r"stage 1 = \(3, 3\) is empty"),
        ([(1, 3), (3, 5), (5, 8)], 3, r"stage 0 starts at block 1; the first stage must start at block 0"),
        ([(0, 3), (4, 6), (6, 8)], 3, r"stage 1 starts at 4 but stage 0 ends at 3 \(leaves a gap\)"),
        ([(0, 4), (3, 6), (6, 8)], 3, r"stage 1 starts at 3 but stage 0 ends at 4 \(overlaps\)"),
        ([(0, 3), (3, 5), (5, 7)], 3, r"the last stage ends at 7 but the model has 8 blocks"),
        ([(0, 2.5), (2.5, 8)], 2, r"must be a list of \(start, end\) integer pairs"),
        ([0, 8], 1, r"must be a list of \(start, end\) integer pairs"),
    ]
    for stages, num, pattern in cases:
        with pytest.raises(ValueError, match=pattern) as err:
            validate_stages(stages, 8, num)
        assert "For example stages=[" in str(err.value) and "stages=" in str(err.value)


def test_virtual_partition_maps_stages_to_ranks_and_chunks():
    # 8 stages of 2 blocks: stage s is chunk s // pp of rank s % pp
    part = virtual_partition([1.0] * 16, 4, 2)
    assert part == [[(0, 2), (8, 10)], [(2, 4), (10, 12)], [(4, 6), (12, 14)], [(6, 8), (14, 16)]]
    assert virtual_partition([1.0] * 4, 2) == [[(0, 2)], [(2, 4)]]
    # the embedding extra lands on rank 0 chunk 0, the head's on rank pp-1 chunk v-1
    part = virtual_partition([1.0] * 10, 2, 2, first_extra=1.0, last_extra=1.0)
    assert part[0][0] == (0, 2) and part[1][1] == (8, 10)
    assert virtual_partition([1.0] * 6, 2, 2, stages=[(0, 1), (1, 3), (3, 5), (5, 6)]) == [
        [(0, 1), (3, 5)],
        [(1, 3), (5, 6)],
    ]
    with pytest.raises(ValueError, match="has 2 entries but the pipeline has 4 stages"):
        virtual_partition([1.0] * 6, 2, 2, stages=[(0, 3), (3, 6)])
    with pytest.raises(ValueError, match=r"pp\*v=8 stages need at least 8 blocks"):
        virtual_partition([1.0] * 6, 4, 2)


def test_estimate_block_costs():
    cfg = GPTConfig(vocab_size=1000, seq_len=128, num_layers=4, num_heads=4, hidden=64)
    c = estimate_block_costs(cfg)
    h, f, s, V = 64, 256, 128, 1000
    assert c.blocks == (2.0 * (4 * h * h + 2 * h * f) + 4 * s * h,) * 4  # identical blocks cost the same
    assert c.last_extra == 2.0 * V * h
    assert c.first_extra == pytest.approx(2.0 * (V + s) * h / s)
    assert estimate_block_costs(cfg, seq_len=64).blocks[0] < c.blocks[0]
    assert estimate_block_costs(cfg, tokens_per_microbatch=4 * s).first_extra == pytest.approx(c.first_extra / 4)
    # Llama: grouped-query attention and a gated MLP
    lc = LlamaConfig(vocab_size=500, seq_len=64, num_layers=3, num_heads=4, num_kv_heads=2, hidden=64, ffn_hidden=160)
    d = 16
    assert estimate_block_costs(lc).blocks == (2.0 * (h * d * (8 + 4) + 3 * h * 160) + 4 * 64 * h,) * 3
    assert estimate_block_costs(lc).first_extra == pytest.approx(2.0 * 500 * h / 64)  # RoPE: no table
    # transformers' configs, read by their family's spec (behemoth.specs)
    transformers = pytest.importorskip("transformers")
    hf = transformers.GPT2Config(n_embd=64, n_inner=None, n_layer=4, n_head=4, vocab_size=1000, n_positions=128)
    assert estimate_block_costs(hf) == c
    # per-block parameter counts for any other model
    pc = estimate_block_costs(block_params=[10, 20, 30], head_params=100, embedding_params=64, seq_len=32)
    assert pc.blocks == (20.0, 40.0, 60.0) and pc.last_extra == 200.0 and pc.first_extra == 4.0
    with pytest.raises(ValueError, match="not both and not neither"):
        estimate_block_costs()
    with pytest.raises(ValueError, match="block_params=\\[\\]"):
        estimate_block_costs(block_params=[])


def test_layouts_of_behemoth_models():
    tiny = dict(vocab_size=64, seq_len=16, num_layers=4, num_heads=2, hidden=32)
    for model, tied in (
        (GPT(GPTConfig(**tiny)), [("wte.weight", "lm_head.weight")]),
        (Llama(LlamaConfig(num_kv_heads=1, **tiny)), []),
        (Llama(LlamaConfig(num_kv_heads=1, tie_embeddings=True, **tiny)), [("embed.weight", "lm_head.weight")]),
    ):
        layout = spec_for(model).pipeline
        check_layout(model, layout)
        assert layout.blocks == spec_for(model).blocks
        assert find_tied_parameters(model) == tied
        assert all(pair in layout.tied for pair in tied)  # every real tie is a listed candidate


def check_layout(model, layout):
    names = {n for n, _ in model.named_modules()}
    for name in (*layout.pre, layout.blocks, *layout.post, *layout.shared):
        assert name in names, name
    # every parameter is in exactly one place: pre, a block, or post
    placed = (*layout.pre, layout.blocks, *layout.post)
    for pname, _ in model.named_parameters():
        assert sum(pname.startswith(m + ".") for m in placed) == 1, pname
    n = len(model.get_submodule(layout.blocks))
    part = virtual_partition([1.0] * n, 2, 2)
    mods = stage_modules(layout, part)
    flat = [m for row in mods for chunk in row for m in chunk]
    assert sorted(m for m in flat if m.startswith(layout.blocks + ".")) == sorted(
        f"{layout.blocks}.{i}" for i in range(n)
    )
    assert all(m in mods[0][0] for m in layout.pre) and all(m in mods[1][1] for m in layout.post)
    assert all(m in chunk for m in layout.shared for row in mods for chunk in row)
    assert mods[0][0][len(layout.shared) : len(layout.shared) + len(layout.pre)] == list(layout.pre)


def test_layouts_of_transformers_models():
    transformers = pytest.importorskip("transformers")
    gpt2 = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            n_layer=4, n_embd=32, n_head=2, vocab_size=64, n_positions=16, bos_token_id=0, eos_token_id=0
        )
    )
    llama = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            num_hidden_layers=4,
            hidden_size=32,
            num_attention_heads=2,
            num_key_value_heads=1,
            intermediate_size=64,
            vocab_size=64,
            bos_token_id=0,
            eos_token_id=0,
        )
    )
    for model in (gpt2, llama):
        layout = spec_for(model).pipeline
        check_layout(model, layout)
        assert layout.blocks == spec_for(model).blocks
    assert find_tied_parameters(gpt2) == [("transformer.wte.weight", "lm_head.weight")]
    assert find_tied_parameters(llama) == []
    assert (
        estimate_block_costs(gpt2.config).blocks
        == estimate_block_costs(GPTConfig(vocab_size=64, seq_len=16, num_layers=4, num_heads=2, hidden=32)).blocks
    )


def test_tied_parameter_ranks():
    from behemoth.specs.gpt import GPT as GPT_SPEC
    from behemoth.specs.hf_gpt2 import HF_GPT2
    from behemoth.specs.llama import LLAMA

    gpt2 = HF_GPT2.pipeline
    assert tied_parameter_ranks(gpt2, 4) == [("transformer.wte.weight", 0, "lm_head.weight", 3)]
    assert tied_parameter_ranks(gpt2, 1) == [("transformer.wte.weight", 0, "lm_head.weight", 0)]  # no sync
    assert tied_parameter_ranks(LLAMA.pipeline, 2, tied=[]) == []
    with pytest.raises(ValueError, match="'blocks.0.attn.qkv.weight' is in neither"):
        tied_parameter_ranks(GPT_SPEC.pipeline, 2, tied=[("wte.weight", "blocks.0.attn.qkv.weight")])

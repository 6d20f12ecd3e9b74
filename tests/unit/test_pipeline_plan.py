"""Pipeline plans and stage partitions of real models, pure (no processes): what Plan
accepts and refuses with pp > 1 (value, rule, fix), and the balanced or user-given stages
``bh.boost`` would cut each known model family into."""

from __future__ import annotations

import pytest

from behemoth.models import GPT, GPTConfig
from behemoth.parallel.pipeline.stage import partition_for
from behemoth.plan import Plan


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(pp=2, microbatches=8, schedule="1f1b"),
        dict(pp=4, microbatches=2, schedule="interleaved", virtual_stages=2),  # m < pp runs, never refused
        dict(pp=2, tp=2, microbatches=4, schedule="zero-bubble", precision="bf16", activation_checkpointing=True),
        dict(pp=2, tp=4, tp_mode="2d", schedule="gpipe"),
        dict(pp=2, tp=8, tp_mode="2.5d", tp_depth=2, schedule="interleaved", virtual_stages=2),
        dict(pp=2, tp=8, tp_mode="3d", tp_overlap=2, schedule="zero-bubble"),
        dict(pp=2, cp=2, cp_mode="ring", microbatches=4, schedule="interleaved", virtual_stages=2),
        dict(pp=2, zero=1, microbatches=4),
        dict(pp=2, zero=2, microbatches=4, schedule="zero-bubble"),
        dict(pp=2, zero=3, microbatches=4, schedule="interleaved", virtual_stages=2),
        dict(pp=2, precision="fp16", zero=2),
        dict(pp=2, zero=3, precision="bf16", param_dtype="bf16"),
        dict(pp=2, zero=1, offload="cpu"),
        dict(pp=2, zero=3, offload="auto", offload_budget_gb=1.0),
        dict(pp=2, compile=True, schedule="zero-bubble", zero=3),
    ],
)
def test_pipeline_plans_are_supported(kwargs):
    Plan(**kwargs).check_supported()


@pytest.mark.parametrize(
    "kwargs, needles",
    [
        (dict(schedule="interleaved", virtual_stages=2), ("virtual_stages=2", "pp=1", "set pp >= 2")),
    ],
)
def test_pipeline_refusals_name_value_rule_and_fix(kwargs, needles):
    with pytest.raises(ValueError) as e:
        Plan(**kwargs).check_supported()
    for n in needles:
        assert n in str(e.value)


def _gpt(layers):
    return GPT(GPTConfig(vocab_size=50304, seq_len=2048, num_layers=layers, num_heads=4, hidden=64))


def test_partition_balances_by_cost_and_accepts_overrides():
    layout, part = partition_for(_gpt(8), 2, 1)
    assert layout.blocks == "blocks"
    (a, b), (c, d) = part[0][0], part[1][0]
    assert a == 0 and b == c and d == 8
    assert b - a > d - c  # the head (2 V h per token) outweighs the embedding: fewer blocks last
    _, part = partition_for(_gpt(8), 2, 2)
    assert [len(row) for row in part] == [2, 2] and part[0][0][0] == 0 and part[1][1][1] == 8
    _, part = partition_for(_gpt(4), 2, 1, stages=[(0, 1), (1, 4)])
    assert part == [[(0, 1)], [(1, 4)]]
    with pytest.raises(ValueError, match="overlaps"):
        partition_for(_gpt(4), 2, 1, stages=[(0, 3), (2, 4)])
    with pytest.raises(ValueError, match="need at least 8 blocks"):
        partition_for(_gpt(4), 4, 2)

"""The label convention: engine.step takes labels shifted by one (labels[:, i] follows input_ids[:, i]).
transformers-style labels (labels = input_ids) are refused on every rank with the fix, before any
collective, instead of silently training a copy task; shift_labels makes them behemoth's, and the
engine then trains exactly like a serial model on transformers' own loss."""

from __future__ import annotations

import torch
from common import build, expect_error, make_optimizer

import behemoth as bh
from behemoth.train.data import shift_labels


def _labels_world(rank, world):
    model = build("gpt")
    engine = bh.boost(model, make_optimizer("adamw", model), bh.Plan(dp=world))
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(rank))
    expect_error(
        lambda: engine.step({"input_ids": ids, "labels": ids.clone()}),
        "labels equal input_ids",
        "shift_labels",
    )
    assert engine.step_count == 0  # nothing ran
    # a row of one repeated token is the same under both conventions: not refused
    same = torch.full((4, 16), 7)
    engine.step({"input_ids": same, "labels": same.clone()})
    loss = engine.step({"input_ids": ids, "labels": shift_labels(ids)})
    assert engine.step_count == 2 and loss == loss


def test_transformers_style_labels_are_refused_on_every_rank():
    bh.spawn(_labels_world, 2, timeout=300)

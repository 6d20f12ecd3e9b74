"""Export to transformers of mixture-of-experts models trained under expert parallelism: behemoth's
Llama with experts (as ``MixtralForCausalLM``) under ep = 2 with tp = 2, dp = 4 x ep = 2 and
ep = 4, and transformers' Mixtral, Qwen3-MoE and OLMoE under one plan each. Each trains two
steps, then writes the model with ``engine.save_hf`` (the live engine: expert shards on every ep
rank) and, for behemoth's model, with ``behemoth.hf.export_checkpoint`` from the checkpoint
``engine.save`` wrote (what ``behemoth export`` runs). Every export loads with
``AutoModelForCausalLM.from_pretrained`` (no missing, unexpected or mismatched tensor) to the
logits of the serial model holding the engine's ``full_state_dict()`` (the padded vocabulary
trimmed), and holds the tensor names, shapes and dtypes transformers' ``save_pretrained`` writes
(one tensor per expert)."""

from __future__ import annotations

import os
from functools import partial

import pytest
from common import build_hf_moe
from hf_export_checks import check_native_export, check_plan_exports

import behemoth as bh

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

PLANS = (
    ("ep2-tp2", bh.Plan(dp=2, ep=2, tp=2)),
    ("dp4-ep2", bh.Plan(dp=4, ep=2)),
    ("ep4", bh.Plan(dp=4, ep=4)),
)
NATIVE = (  # one plan per family
    ("mixtral", bh.Plan(dp=2, ep=2, tp=2)),
    ("qwen3-moe", bh.Plan(dp=4, ep=2)),
    ("olmoe", bh.Plan(dp=4, ep=4)),
)


def _world(rank, world, root):
    preset = "llama-moe-tiny"
    check_plan_exports(rank, root, preset, PLANS, preset)
    for family, plan in NATIVE:
        build = partial(build_hf_moe, family, initializer_range=0.2)
        check_native_export(rank, os.path.join(root, family), build, plan, f"{family} {plan.describe()} engine.save_hf")


def test_moe_export_under_expert_parallelism_loads_in_transformers(tmp_path):
    bh.spawn(_world, 4, str(tmp_path), timeout=900)

"""Export to transformers from a model trained under a plan: dp, ZeRO-3 + CPU offload, 1D and 2D
tensor parallelism, pipeline parallelism. Each plan trains a few steps, then writes the model two
ways: ``engine.save_hf`` from the live engine, and ``behemoth.hf.export_checkpoint`` from the
checkpoint ``engine.save`` wrote (what ``behemoth export`` runs). Both load with
``AutoModelForCausalLM.from_pretrained`` (no missing, unexpected or mismatched tensor) to the
logits of behemoth's serial model holding the engine's ``full_state_dict()``, the padded vocabulary
trimmed, and hold the tensor names, shapes and dtypes transformers' ``save_pretrained`` writes.
transformers' own GPT-2 and Llama trained under a plan export with their own names."""

from __future__ import annotations

import os

import pytest
from common import build
from hf_export_checks import check_native_export, check_plan_exports

import behemoth as bh

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

PLANS = (
    ("dp", bh.Plan(dp=4)),
    ("zero3-offload", bh.Plan(dp=4, zero=3, offload="cpu")),
    ("tp1d", bh.Plan(dp=2, tp=2)),
    ("tp2d", bh.Plan(tp=4, tp_mode="2d")),
    ("pp", bh.Plan(pp=2, dp=2, microbatches=2)),
)
NATIVE = {"gpt": ("hf-gpt2", bh.Plan(dp=2, tp=2)), "llama": ("hf-llama", bh.Plan(pp=2, dp=2, microbatches=2))}


def _export_world(rank, world, root, family):
    check_plan_exports(rank, root, {"gpt": "gpt-tiny", "llama": "llama-tiny"}[family], PLANS, family)
    native, plan = NATIVE[family]
    check_native_export(rank, os.path.join(root, native), lambda: build(native), plan, f"{native} engine.save_hf")


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_export_under_every_plan_loads_in_transformers(tmp_path, family):
    bh.spawn(_export_world, 4, str(tmp_path), family, timeout=600)

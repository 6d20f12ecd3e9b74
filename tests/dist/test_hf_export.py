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
import torch

import behemoth as bh
from behemoth.hf import export_checkpoint
from common import build, global_batches, make_optimizer, shard

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

VOCAB, SEQ, KEEP = 300, 16, 257  # a vocabulary padded past the byte tokenizer's 257 ids
PLANS = (
    ("dp", bh.Plan(dp=4)),
    ("zero3-offload", bh.Plan(dp=4, zero=3, offload="cpu")),
    ("tp1d", bh.Plan(dp=2, tp=2)),
    ("tp2d", bh.Plan(tp=4, tp_mode="2d")),
    ("pp", bh.Plan(pp=2, dp=2, microbatches=2)),
)
NATIVE = {"gpt": ("hf-gpt2", bh.Plan(dp=2, tp=2)), "llama": ("hf-llama", bh.Plan(pp=2, dp=2, microbatches=2))}


def tensors_of(directory: str) -> dict:
    from safetensors import safe_open

    out = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(directory, name), framework="pt") as f:
                for k in f.keys():
                    s = f.get_slice(k)
                    out[k] = (tuple(s.get_shape()), s.get_dtype())
    return out


def check_export(directory: str, want_logits: torch.Tensor, x: torch.Tensor, what: str) -> None:
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(directory, output_loading_info=True)
    assert not any(info.values()), (what, info)
    with torch.no_grad():
        got = hf.eval()(x).logits
    torch.testing.assert_close(got, want_logits, atol=1e-5, rtol=1e-4, msg=lambda m: f"{what}: {m}")
    hf.save_pretrained(directory + "-resaved")  # what transformers itself writes for these weights
    assert tensors_of(directory) == tensors_of(directory + "-resaved"), what


def _train(model, plan, steps: int = 2):
    engine = bh.boost(model, make_optimizer("adamw", model), plan)
    for b in global_batches(steps, 8):
        engine.step(shard(b, engine.dp_rank, engine.dp_size))
    return engine


def _export_world(rank, world, root, family):
    from behemoth.models import build_model
    from behemoth.train.config import Config

    preset = {"gpt": "gpt-tiny", "llama": "llama-tiny"}[family]
    run = Config.from_dict({"model": {"name": preset, "vocab_size": VOCAB, "seq_len": SEQ}, "data": {"tokenizer": "byte"}})
    x = torch.randint(0, KEEP, (2, SEQ), generator=torch.Generator().manual_seed(5))
    for name, plan in PLANS:
        model = build_model(preset, vocab_size=VOCAB, seq_len=SEQ, seed=1)
        engine = _train(model, plan)
        ckpt = os.path.join(root, name, "checkpoints", "step-2")
        engine.save(ckpt, extra={"config": run.to_dict()})
        engine.save_hf(os.path.join(root, name, "engine"), vocab_size=KEEP, max_shard_size="100KB")
        state = engine.full_state_dict()
        if rank == 0:
            serial = build_model(preset, vocab_size=VOCAB, seq_len=SEQ).eval()
            serial.load_state_dict(state)
            with torch.no_grad():
                want = serial(x)[..., :KEEP]
            check_export(os.path.join(root, name, "engine"), want, x, f"{family} {name} engine.save_hf")
            info = export_checkpoint(os.path.join(root, name), os.path.join(root, name, "cli"), max_shard_size="100KB")
            assert info["checkpoint"] == ckpt and info["vocab_size"] == KEEP and len(info["files"]) > 1, info
            check_export(os.path.join(root, name, "cli"), want, x, f"{family} {name} export_checkpoint")
    native, plan = NATIVE[family]
    engine = _train(build(native), plan)
    engine.save_hf(os.path.join(root, native), max_shard_size="50KB")
    state = engine.full_state_dict()
    if rank == 0:
        serial = build(native).eval()
        serial.load_state_dict(state)
        x = torch.randint(0, 96, (2, SEQ), generator=torch.Generator().manual_seed(5))
        with torch.no_grad():
            want = serial(x).logits
        check_export(os.path.join(root, native), want, x, f"{native} engine.save_hf")
        assert not [f for f in os.listdir(os.path.join(root, native)) if f.startswith(".")]  # staging removed


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_export_under_every_plan_loads_in_transformers(tmp_path, family):
    bh.spawn(_export_world, 4, str(tmp_path), family, timeout=600)

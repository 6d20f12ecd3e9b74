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

import pytest
import torch

import behemoth as bh
from behemoth.hf import export_checkpoint
from common import SEQ, global_batches, make_optimizer, shard
from test_hf_export import check_export

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

VOCAB, KEEP = 300, 257  # a vocabulary padded past the byte tokenizer's 257 ids
PLANS = (
    ("ep2-tp2", bh.Plan(dp=2, ep=2, tp=2)),
    ("dp4-ep2", bh.Plan(dp=4, ep=2)),
    ("ep4", bh.Plan(dp=4, ep=4)),
)
NATIVE = (  # OLMoE's q/k norms span every head: no tensor parallelism for it
    ("mixtral", bh.Plan(dp=2, ep=2, tp=2)),
    ("qwen3-moe", bh.Plan(dp=4, ep=2)),
    ("olmoe", bh.Plan(dp=4, ep=4)),
)


def build_hf_moe(family: str):
    from transformers import (
        MixtralConfig,
        MixtralForCausalLM,
        OlmoeConfig,
        OlmoeForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    torch.manual_seed(0)
    common = dict(
        vocab_size=96,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=SEQ,
        initializer_range=0.2,
        pad_token_id=0,
        bos_token_id=0,
        eos_token_id=0,
    )
    if family == "mixtral":
        cfg = MixtralConfig(
            **common, intermediate_size=24, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2
        )
        return MixtralForCausalLM(cfg)
    if family == "qwen3-moe":
        cfg = Qwen3MoeConfig(
            **common,
            intermediate_size=48,
            moe_intermediate_size=24,
            num_key_value_heads=2,
            head_dim=8,
            num_experts=4,
            num_experts_per_tok=2,
            mlp_only_layers=[0],
        )
        return Qwen3MoeForCausalLM(cfg)
    cfg = OlmoeConfig(**common, intermediate_size=16, num_key_value_heads=4, num_experts=8, num_experts_per_tok=4)
    return OlmoeForCausalLM(cfg)


def _train(model, plan, steps: int = 2):
    engine = bh.boost(model, make_optimizer("adamw", model), plan)
    for b in global_batches(steps, 8):
        engine.step(shard(b, engine.dp_rank, engine.dp_size))
    return engine


def _world(rank, world, root):
    from behemoth.models import build_model
    from behemoth.train.config import Config

    preset = "llama-moe-tiny"
    run = Config.from_dict(
        {"model": {"name": preset, "vocab_size": VOCAB, "seq_len": SEQ}, "data": {"tokenizer": "byte"}}
    )
    x = torch.randint(0, KEEP, (2, SEQ), generator=torch.Generator().manual_seed(5))
    for name, plan in PLANS:
        engine = _train(build_model(preset, vocab_size=VOCAB, seq_len=SEQ, seed=1), plan)
        ckpt = os.path.join(root, name, "checkpoints", "step-2")
        engine.save(ckpt, extra={"config": run.to_dict()})
        engine.save_hf(os.path.join(root, name, "engine"), vocab_size=KEEP, max_shard_size="100KB")
        state = engine.full_state_dict()
        if rank == 0:
            serial = build_model(preset, vocab_size=VOCAB, seq_len=SEQ).eval()
            serial.load_state_dict(state)
            with torch.no_grad():
                want = serial(x)[..., :KEEP]
            check_export(os.path.join(root, name, "engine"), want, x, f"{preset} {name} engine.save_hf")
            info = export_checkpoint(os.path.join(root, name), os.path.join(root, name, "cli"), max_shard_size="100KB")
            assert info["checkpoint"] == ckpt and info["vocab_size"] == KEEP and len(info["files"]) > 1, info
            check_export(os.path.join(root, name, "cli"), want, x, f"{preset} {name} export_checkpoint")
    x = torch.randint(0, 96, (2, SEQ), generator=torch.Generator().manual_seed(5))
    for family, plan in NATIVE:
        engine = _train(build_hf_moe(family), plan)
        out = os.path.join(root, family)
        engine.save_hf(out, max_shard_size="50KB")
        state = engine.full_state_dict()
        if rank == 0:
            serial = build_hf_moe(family).eval()
            serial.load_state_dict(state)
            with torch.no_grad():
                want = serial(x).logits
            check_export(out, want, x, f"{family} {plan.describe()} engine.save_hf")
            assert not [f for f in os.listdir(out) if f.startswith(".")]  # staging removed


def test_moe_export_under_expert_parallelism_loads_in_transformers(tmp_path):
    bh.spawn(_world, 4, str(tmp_path), timeout=900)

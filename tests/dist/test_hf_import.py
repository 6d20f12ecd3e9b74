"""Import from transformers under a plan: a ``save_pretrained`` directory (sharded, with its index)
read by ``bh.load_hf`` into an engine under ZeRO-3 + CPU offload, 1D and 2D tensor parallelism
and pp x tp, each rank reading only its slices -- bytes read per rank about model/world, counted
-- to the serial state transformers' weights give; then the round trip: train a few steps,
``engine.save_hf``, ``from_pretrained``: logits equal to behemoth's serial model of the trained
weights. behemoth's GPT and Llama read GPT-2 and Llama checkpoints (GPT-2's Conv1D transposed),
transformers' own models their own names."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist
from common import global_batches, make_optimizer, serial_loss, shard

import behemoth as bh
from behemoth.hf import load_hf, model_from_hf

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

V, S = 96, 16
PLANS = (
    ("zero3-offload", bh.Plan(dp=4, zero=3, offload="cpu")),
    ("tp1d", bh.Plan(dp=2, tp=2)),
    ("tp2d", bh.Plan(tp=4, tp_mode="2d")),
    ("pp-tp", bh.Plan(pp=2, tp=2, microbatches=2)),
)


def save_reference(family: str, path: str) -> None:
    """A transformers model with weights far from any init, saved as transformers saves it."""
    torch.manual_seed(0)
    if family == "gpt2":
        cfg = transformers.GPT2Config(
            vocab_size=V,
            n_positions=S,
            n_embd=32,
            n_layer=2,
            n_head=4,
            eos_token_id=0,
            bos_token_id=0,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
        model = transformers.GPT2LMHeadModel(cfg)
    else:
        cfg = transformers.LlamaConfig(
            vocab_size=V,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=S,
            rope_theta=500.0,
        )
        model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape))
    model.save_pretrained(path, max_shard_size="40KB")


def file_bytes(path: str) -> int:
    index = json.load(open(os.path.join(path, "model.safetensors.index.json")))
    return index["metadata"]["total_size"]


def logits(model, x):
    with torch.no_grad():
        out = model.eval()(x)
    return out.logits if hasattr(out, "logits") else out


def _import_world(rank, world, root, family):
    src = os.path.join(root, family)
    hf_ref = transformers.AutoModelForCausalLM.from_pretrained(src)
    x = torch.randint(0, V, (2, S), generator=torch.Generator().manual_seed(3))
    want = logits(hf_ref, x)
    serial = model_from_hf(src)  # behemoth's GPT / Llama of the checkpoint's shape
    load_hf(serial, src)  # serial: no process group involved
    torch.testing.assert_close(logits(serial, x), want, atol=1e-5, rtol=1e-4)
    want_state = serial.state_dict()
    batches = global_batches(2, 8)
    total = file_bytes(src)
    for native in (False, True):
        for name, plan in PLANS:
            what = f"{family} {'transformers' if native else 'behemoth'} {name}"
            model = model_from_hf(src, transformers=native, seed=11)
            engine = bh.boost(model, make_optimizer("adamw", model), plan)
            stats = load_hf(engine, src)
            state = engine.full_state_dict()
            reference = hf_ref.state_dict() if native else want_state
            for k, v in reference.items():
                assert torch.equal(state[k], v), (what, k)
            read = [None] * world
            dist.all_gather_object(read, stats["bytes_read"])
            # each rank reads its slices: about model/world (replicated norms read by each tp rank)
            assert max(read) <= 1.3 * total / world and sum(read) >= total, (what, read, total)
            first = engine.step(shard(batches[0], engine.dp_rank, engine.dp_size))
            want_loss = serial_loss(hf_ref, batches[0]).item()
            assert abs(first - want_loss) <= 1e-4 * abs(want_loss), (what, first, want_loss)
            engine.step(shard(batches[1], engine.dp_rank, engine.dp_size))
            out = os.path.join(root, "out", what.replace(" ", "-"))
            engine.save_hf(out, max_shard_size="40KB")
            trained = engine.full_state_dict()
            if rank == 0:
                ref = model_from_hf(src, transformers=native)
                ref.load_state_dict(trained)
                back = transformers.AutoModelForCausalLM.from_pretrained(out)
                torch.testing.assert_close(logits(back, x), logits(ref, x), atol=1e-5, rtol=1e-4)
            if rank == 0 and name == "tp1d":
                print(what, "bytes read per rank", read, "of", total, flush=True)
    # bh.parallelize alone (no optimizer, no engine): the same slices, the same serial state
    from behemoth.parallelize import serial_state_dict

    model = bh.parallelize(model_from_hf(src, seed=11), bh.Plan(dp=2, tp=2))
    stats = load_hf(model, src)
    state = serial_state_dict(model)
    for k, v in want_state.items():
        assert torch.equal(state[k], v), ("bh.parallelize", k)
    assert stats["bytes_read"] <= 1.3 * total / world, stats


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_import_under_every_plan_and_round_trip(tmp_path, family):
    save_reference(family, str(tmp_path / family))
    bh.spawn(_import_world, 4, str(tmp_path), family, timeout=900)

"""Shared checks of the exports to transformers: serial (tests/unit/test_hf_layout.py,
test_hf_layout_moe.py: behemoth.hf.export.write_hf of a model's own state dict) and from an engine
trained under a plan (tests/dist/test_hf_export.py, test_hf_export_moe.py: ``engine.save_hf`` and
``behemoth.hf.export_checkpoint``). An export passes when ``AutoModelForCausalLM.from_pretrained``
loads it with no missing, unexpected or mismatched tensor, to the expected logits, and it holds
the tensor names, shapes and dtypes transformers' ``save_pretrained`` writes for the same weights.
"""

from __future__ import annotations

import os

import torch
from common import SEQ, VOCAB, global_batches, make_optimizer, shard

import behemoth as bh

PADDED_VOCAB, KEEP = 300, 257  # a vocabulary padded past the byte tokenizer's 257 ids


def tensors_of(directory: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every tensor of a transformers checkpoint directory: name -> (shape, dtype), from the files."""
    from safetensors import safe_open

    out = {}
    for name in os.listdir(directory):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(directory, name), framework="pt") as f:
                for k in f.keys():
                    t = f.get_tensor(k)
                    out[k] = (tuple(t.shape), t.dtype)
    return out


def logits(model, x):
    """A behemoth model's logits or a transformers model's ``.logits``, without autograd."""
    with torch.no_grad():
        out = model(x)
    return out.logits if hasattr(out, "logits") else out


# ------------------------------------------------------------------ serial exports
def export(model, out: str, **kw):
    """``write_hf`` of ``model``'s own state dict into ``out`` (``kw``: write_hf's options); its writer."""
    from behemoth.hf.export import write_hf
    from behemoth.hf.names import layout_for

    state = model.state_dict()
    return write_hf(
        out,
        layout=layout_for(model),
        model_config=model.config,
        stored={k: (tuple(v.shape), v.dtype) for k, v in state.items()},
        read=lambda k: state[k].clone(),
        **kw,
    )


def transformers_twin(model) -> torch.nn.Module:
    """transformers' own model of ``model``'s shape, configured by hand here (not from the export's
    config.json): GPT-2 for behemoth's GPT, Llama for its Llama, Mixtral for its Llama with
    experts; a transformers model is its own twin."""
    import transformers

    from behemoth.models import GPTConfig, LlamaConfig

    c = model.config
    if isinstance(c, GPTConfig):
        cfg = transformers.GPT2Config(
            vocab_size=c.vocab_size,
            n_positions=c.seq_len,
            n_embd=c.hidden,
            n_layer=c.num_layers,
            n_head=c.num_heads,
            activation_function="gelu_new",
            tie_word_embeddings=c.tie_embeddings,
        )
        return transformers.GPT2LMHeadModel(cfg)
    if not isinstance(c, LlamaConfig):
        return model
    shape = dict(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden,
        num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads,
        max_position_embeddings=c.seq_len,
        tie_word_embeddings=c.tie_embeddings,
    )
    if c.num_experts:
        cfg = transformers.MixtralConfig(
            **shape,
            intermediate_size=c.expert_ffn_hidden,
            num_local_experts=c.num_experts,
            num_experts_per_tok=c.experts_top_k,
        )
        return transformers.MixtralForCausalLM(cfg)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape, intermediate_size=c.resolved_ffn_hidden))


def check_serial_export(model, reference, root, vocab: int, seq: int):
    """``model``'s weights moved far from the init (so every tensor, and which is which, matters),
    then exported to ``root/out`` in shards of 20KB: more than one file, loading with no missing,
    unexpected or mismatched tensor to ``model``'s logits on ids below ``vocab``, holding the
    tensors that ``reference`` (:func:`transformers_twin`) saves to ``root/ref``. Returns the writer
    and the loaded model."""
    import transformers

    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        for p in model.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=g))
    writer = export(model, str(root / "out"), max_shard_size="20KB")
    assert len(writer.files) > 1
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(str(root / "out"), output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched tensor
    x = torch.randint(0, vocab, (2, seq), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(logits(hf.eval(), x), logits(model, x), atol=1e-5, rtol=1e-4)
    reference.save_pretrained(str(root / "ref"))
    assert tensors_of(str(root / "out")) == tensors_of(str(root / "ref"))
    return writer, hf


# ------------------------------------------------------------------ exports of a trained engine
def check_export(directory: str, want_logits: torch.Tensor, x: torch.Tensor, what: str) -> None:
    """The export in ``directory`` loads whole to ``want_logits`` on ``x`` and holds what
    transformers' ``save_pretrained`` writes for the weights it loaded."""
    import transformers

    hf, info = transformers.AutoModelForCausalLM.from_pretrained(directory, output_loading_info=True)
    assert not any(info.values()), (what, info)
    with torch.no_grad():
        got = hf.eval()(x).logits
    torch.testing.assert_close(got, want_logits, atol=1e-5, rtol=1e-4, msg=lambda m: f"{what}: {m}")
    hf.save_pretrained(directory + "-resaved")  # what transformers itself writes for these weights
    assert tensors_of(directory) == tensors_of(directory + "-resaved"), what


def trained(model, plan, steps: int = 2):
    """The engine of ``model`` under ``plan`` after ``steps`` AdamW steps on the global batches."""
    engine = bh.boost(model, make_optimizer("adamw", model), plan)
    for b in global_batches(steps, 8):
        engine.step(shard(b, engine.dp_rank, engine.dp_size))
    return engine


def check_plan_exports(rank: int, root: str, preset: str, plans, label: str) -> None:
    """behemoth's ``preset`` (vocabulary PADDED_VOCAB) trained under each of ``plans`` (``(name,
    Plan)`` pairs), then exported from the live engine (``engine.save_hf``) and from the checkpoint
    ``engine.save`` wrote (``export_checkpoint``, what ``behemoth export`` runs), both trimmed to
    KEEP ids: each loads to the logits of the serial model holding ``full_state_dict()``, trimmed.
    ``label`` starts each failure message. Collective: every rank of the plans' world."""
    from behemoth.hf import export_checkpoint
    from behemoth.models import build_model
    from behemoth.train.config import Config

    config = {"model": {"name": preset, "vocab_size": PADDED_VOCAB, "seq_len": SEQ}, "data": {"tokenizer": "byte"}}
    run = Config.from_dict(config)
    x = torch.randint(0, KEEP, (2, SEQ), generator=torch.Generator().manual_seed(5))
    for name, plan in plans:
        engine = trained(build_model(preset, vocab_size=PADDED_VOCAB, seq_len=SEQ, seed=1), plan)
        ckpt = os.path.join(root, name, "checkpoints", "step-2")
        engine.save(ckpt, extra={"config": run.to_dict()})
        engine.save_hf(os.path.join(root, name, "engine"), vocab_size=KEEP, max_shard_size="100KB")
        state = engine.full_state_dict()
        if rank == 0:
            serial = build_model(preset, vocab_size=PADDED_VOCAB, seq_len=SEQ).eval()
            serial.load_state_dict(state)
            with torch.no_grad():
                want = serial(x)[..., :KEEP]
            check_export(os.path.join(root, name, "engine"), want, x, f"{label} {name} engine.save_hf")
            info = export_checkpoint(os.path.join(root, name), os.path.join(root, name, "cli"), max_shard_size="100KB")
            assert info["checkpoint"] == ckpt and info["vocab_size"] == KEEP and len(info["files"]) > 1, info
            check_export(os.path.join(root, name, "cli"), want, x, f"{label} {name} export_checkpoint")


def check_native_export(rank: int, out: str, build, plan, what: str) -> None:
    """A transformers model (``build()``, the same weights on every call) trained under ``plan`` and
    written by ``engine.save_hf`` to ``out``: it loads to the logits of the serial model holding
    ``full_state_dict()``, and no staging file is left. Collective: every rank of the plan's world."""
    engine = trained(build(), plan)
    engine.save_hf(out, max_shard_size="50KB")
    state = engine.full_state_dict()
    if rank == 0:
        serial = build().eval()
        serial.load_state_dict(state)
        x = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(5))
        with torch.no_grad():
            want = serial(x).logits
        check_export(out, want, x, what)
        assert not [f for f in os.listdir(out) if f.startswith(".")]  # staging removed

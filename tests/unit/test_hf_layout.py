"""Export to transformers, serial: behemoth's GPT and Llama and transformers' own GPT-2 and Llama
written by behemoth.hf.export.write_hf load with AutoModelForCausalLM.from_pretrained to the same
logits, with the tensor names, shapes and dtypes transformers' save_pretrained writes; the
streaming writer's shards and index read back with safetensors."""

from __future__ import annotations

import json
import os

import pytest
import torch
from hf_export_checks import check_serial_export, export, logits, tensors_of, transformers_twin

from behemoth.hf.names import layout_for
from behemoth.hf.writer import ShardedWriter, parse_size, plan_shards

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors")

V, S = 96, 16


def build(family: str) -> torch.nn.Module:
    from behemoth.models import GPT, GPTConfig, Llama, LlamaConfig

    torch.manual_seed(0)
    if family == "gpt":
        return GPT(GPTConfig(vocab_size=V, seq_len=S, num_layers=2, num_heads=4, hidden=32, seed=3))
    if family == "gpt-untied":
        return GPT(GPTConfig(vocab_size=V, seq_len=S, num_layers=2, num_heads=4, hidden=32, tie_embeddings=False))
    if family == "llama":
        return Llama(LlamaConfig(vocab_size=V, seq_len=S, num_layers=2, num_heads=4, num_kv_heads=2, hidden=32))
    if family == "llama-tied":
        return Llama(
            LlamaConfig(
                vocab_size=V,
                seq_len=S,
                num_layers=2,
                num_heads=4,
                num_kv_heads=2,
                hidden=32,
                tie_embeddings=True,
                rope_theta=500.0,
            )
        )
    if family == "hf-gpt2":
        cfg = transformers.GPT2Config(vocab_size=V, n_positions=S, n_embd=32, n_layer=2, n_head=4)
        return transformers.GPT2LMHeadModel(cfg)
    cfg = transformers.LlamaConfig(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=S,
    )
    return transformers.LlamaForCausalLM(cfg)


@pytest.mark.parametrize("family", ["gpt", "gpt-untied", "llama", "llama-tied", "hf-gpt2", "hf-llama"])
def test_export_loads_in_transformers_with_the_same_logits_and_layout(tmp_path, family):
    model = build(family).eval()
    writer, _ = check_serial_export(model, transformers_twin(model), tmp_path, V, S)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == writer.files
    assert index["metadata"]["total_size"] == sum((tmp_path / "out" / f).stat().st_size for f in writer.files) - sum(
        8 + int.from_bytes((tmp_path / "out" / f).read_bytes()[:8], "little") for f in writer.files
    )


def test_padded_vocab_trimmed_and_dtype_cast(tmp_path):
    model = build("gpt").eval()
    export(model, str(tmp_path / "out"), vocab_size=90, dtype=torch.bfloat16, bos=89, eos=89)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["vocab_size"] == 90 and config["torch_dtype"] == "bfloat16" and config["eos_token_id"] == 89
    assert json.loads((tmp_path / "out" / "generation_config.json").read_text())["eos_token_id"] == 89
    layout = tensors_of(str(tmp_path / "out"))
    assert layout["transformer.wte.weight"] == ((90, 32), torch.bfloat16)
    assert all(d == torch.bfloat16 for _, d in layout.values())
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32).eval()
    x = torch.randint(0, 90, (2, S), generator=torch.Generator().manual_seed(2))
    want = logits(model.to(torch.bfloat16).float(), x)[..., :90]
    torch.testing.assert_close(logits(hf, x), want, atol=1e-5, rtol=1e-4)


def test_no_layout_is_refused():
    from behemoth.models import GPT, GPTConfig, Llama, LlamaConfig

    with pytest.raises(ValueError, match="bias=False"):
        layout_for(GPT(GPTConfig(vocab_size=V, seq_len=S, num_layers=1, num_heads=2, hidden=8, bias=False)))
    # a mixture of experts exports as Mixtral (tests/unit/test_hf_export_moe.py) only with Mixtral's routing
    moe = dict(vocab_size=V, seq_len=S, num_layers=2, num_heads=2, num_kv_heads=2, hidden=8, num_experts=2)
    for field, value in (("router_norm_topk", False), ("moe_every", 2), ("router_score_func", "sigmoid")):
        with pytest.raises(
            ValueError, match=f"mixture-of-experts Llama exports as .*{field}|{field}.*mixture-of-experts"
        ):
            layout_for(Llama(LlamaConfig(**moe, **{field: value}), device="meta"))
    with pytest.raises(ValueError, match="has no config"):
        layout_for(torch.nn.Linear(2, 2))


def test_writer_plans_shards_and_reads_back(tmp_path):
    from safetensors.torch import load_file

    assert parse_size("5GB") == 5 * 10**9 and parse_size("20KiB") == 20 * 1024 and parse_size(7) == 7
    for bad in ("0MB", "lots", -1):
        with pytest.raises(ValueError, match="max_shard_size"):
            parse_size(bad)
    assert plan_shards([("a", 4), ("b", 4), ("c", 9), ("d", 1)], 8) == [["a", "b"], ["c"], ["d"]]
    assert plan_shards([("a", 9), ("b", 0), ("c", 1)], 8) == [["a", "b"], ["c"]]
    tensors = {
        "a": torch.arange(6, dtype=torch.float32).reshape(2, 3),
        "b": torch.ones(5, dtype=torch.bfloat16),
        "c": torch.arange(4, dtype=torch.int64),
        "d": torch.zeros(0, 3),
    }
    w = ShardedWriter(str(tmp_path), {k: (tuple(v.shape), v.dtype) for k, v in tensors.items()}, 30)
    with pytest.raises(ValueError, match="next tensor"):
        w.write("b", tensors["b"])
    for name in w.order:
        w.write(name, tensors[name])
    w.close()
    assert w.files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]  # a | b | c, d (empty)
    assert w.peak_bytes == 32
    back = {}
    for f in w.files:
        back.update(load_file(str(tmp_path / f)))
    assert back.keys() == tensors.keys()
    for k, v in tensors.items():
        assert torch.equal(back[k], v) and back[k].dtype == v.dtype, k
    again = ShardedWriter(str(tmp_path / "again"), {"a": ((2, 3), torch.float32)}, 30)
    assert again.files == ["model-00001-of-00001.safetensors"]
    (tmp_path / "keep.txt").write_text("not a weight file")
    ShardedWriter(str(tmp_path), {"a": ((2, 3), torch.float32)}, 30)  # a second export into the same directory
    assert sorted(os.listdir(tmp_path))[:2] == ["again", "keep.txt"]
    assert not [f for f in os.listdir(tmp_path) if f.endswith("-of-00003.safetensors")]  # the stale shards went


def test_byte_tokenizer_files_encode_as_behemoth_does(tmp_path):
    pytest.importorskip("tokenizers")
    from behemoth.hf.tokenizer_files import write_tokenizer
    from behemoth.train.tokenizer import ByteTokenizer

    assert write_tokenizer(str(tmp_path), "byte", 128) == ["tokenizer.json", "tokenizer_config.json"]
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    text = "héllo wörld\n\tdef f(x):  return 🙂"
    ids = ByteTokenizer().encode(text)
    assert tok(text)["input_ids"] == ids and tok.decode(ids) == text
    assert tok.eos_token_id == ByteTokenizer.eot_id and tok.convert_ids_to_tokens(256) == "<|endoftext|>"
    assert write_tokenizer(str(tmp_path / "none"), None, 128) == []

"""Unit tests for behemoth.train.tokenizer and behemoth.train.data (no processes, no network)."""

from __future__ import annotations

import math
import os
import sys

import numpy as np
import pytest
import torch

from behemoth.train.data import (
    IGNORE_INDEX,
    BatchSampler,
    TokenDataset,
    check_vocab,
    default_corpus_text,
    epoch_permutation,
    num_windows,
    shard_slice,
    shift_labels,
    unigram_entropy,
    write_bin,
)
from behemoth.train.tokenizer import ByteTokenizer, GPT2Tokenizer, Tokenizer, get_tokenizer

UNICODE_TEXT = "Héllo, wörld! — 日本語のテキスト 🎉\n\n\tdef f(x):\n    return x ** 2  # ünïcödé"


# ----------------------------------------------------------------------------- tokenizers


def test_byte_tokenizer_round_trip():
    tok = get_tokenizer("byte")
    assert isinstance(tok, ByteTokenizer) and isinstance(tok, Tokenizer)
    assert (tok.vocab_size, tok.eot_id) == (257, 256)
    ids = tok.encode(UNICODE_TEXT)
    assert all(0 <= i < 256 for i in ids)
    assert tok.decode(ids) == UNICODE_TEXT
    assert tok.decode(tok.encode("a") + [tok.eot_id] + tok.encode("b")) == "a<|endoftext|>b"
    with pytest.raises(ValueError, match="257"):
        tok.decode([300])


def test_gpt2_tokenizer_matches_gpt2():
    pytest.importorskip("tokenizers")
    tok = get_tokenizer("gpt2")
    assert isinstance(tok, GPT2Tokenizer)
    assert (tok.vocab_size, tok.eot_id) == (50257, 50256)
    assert tok.encode("Hello world") == [15496, 995]
    assert tok.decode(tok.encode(UNICODE_TEXT)) == UNICODE_TEXT
    assert tok.encode_batch(["Hello world", UNICODE_TEXT]) == [[15496, 995], tok.encode(UNICODE_TEXT)]
    assert tok.decode([tok.eot_id]) == "<|endoftext|>"
    # Literal "<|endoftext|>" in text is ordinary text, never the eot id.
    assert tok.eot_id not in tok.encode("a<|endoftext|>b")


def test_gpt2_missing_packages_names_the_extra(monkeypatch):
    from behemoth.train import tokenizer as tokmod

    tokmod._load_gpt2_backend.cache_clear()
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # makes `import tokenizers` fail
    try:
        with pytest.raises(ImportError, match=r"behemoth\[tokenizers\].*'byte'"):
            get_tokenizer("gpt2")
    finally:
        tokmod._load_gpt2_backend.cache_clear()


def test_unknown_tokenizer_lists_options():
    with pytest.raises(ValueError, match=r"'byte', 'gpt2'"):
        get_tokenizer("sentencepiece")


# ----------------------------------------------------------------------------- corpus


def test_default_corpus_is_deterministic_and_bounded():
    a = default_corpus_text(max_bytes=200_000)
    assert a == default_corpus_text(max_bytes=200_000)
    assert 190_000 < len(a.encode("utf-8")) <= 200_000
    assert "=====" in a and "def " in a
    assert default_corpus_text(max_bytes=50_000) == a[: len(default_corpus_text(max_bytes=50_000))]
    with pytest.raises(ValueError, match="max_bytes"):
        default_corpus_text(max_bytes=0)


# ----------------------------------------------------------------------------- .bin files


@pytest.mark.parametrize("dtype, high", [("uint16", 65535), ("uint32", 2**32 - 1)])
def test_bin_round_trip(tmp_path, dtype, high):
    tokens = np.array([0, 1, 7, high, 42], dtype=dtype)
    path = write_bin(tmp_path / "sub" / "t.bin", tokens)
    assert os.path.getsize(path) == tokens.nbytes
    assert not [p for p in os.listdir(tmp_path / "sub") if p.startswith(".tmp")]
    ds = TokenDataset.from_bin(path, dtype=dtype)
    assert isinstance(ds.tokens, np.memmap) and not ds.tokens.flags.writeable
    np.testing.assert_array_equal(ds.tokens, tokens)
    assert len(ds) == 5 and ds.vocab_size == high + 1


def test_bin_bad_size_and_bad_values(tmp_path):
    path = tmp_path / "odd.bin"
    path.write_bytes(b"\x01\x02\x03")
    with pytest.raises(ValueError, match=r"3 bytes.*multiple"):
        TokenDataset.from_bin(path, dtype="uint16")
    with pytest.raises(ValueError, match="uint32"):
        write_bin(tmp_path / "big.bin", np.array([70_000]), dtype="uint16")
    with pytest.raises(ValueError, match="dtype"):
        TokenDataset.from_bin(path, dtype="int8")
    with pytest.raises(FileNotFoundError, match="write_bin"):
        TokenDataset.from_bin(tmp_path / "nope.bin")


def test_check_vocab():
    ds = TokenDataset(np.array([1, 5, 9], dtype=np.uint16))
    check_vocab(ds, 10)
    with pytest.raises(ValueError, match=r"token id 9.*vocab_size is 9.*at least 10"):
        check_vocab(ds, 9)


# ----------------------------------------------------------------------------- texts and files


def test_from_texts_joins_documents_with_eot():
    tok = ByteTokenizer()
    ds = TokenDataset.from_texts(["ab", "c"], tok)
    assert ds.tokens.tolist() == [97, 98, 256, 99, 256]
    assert ds.tokens.dtype == np.uint16 and ds.vocab_size == 257


def test_from_files_txt_and_jsonl(tmp_path):
    (tmp_path / "a.txt").write_text("hello", encoding="utf-8")
    (tmp_path / "b.jsonl").write_text('{"text": "x"}\n\n{"text": "yz", "id": 3}\n', encoding="utf-8")
    ds = TokenDataset.from_files([tmp_path / "a.txt", tmp_path / "b.jsonl"], ByteTokenizer())
    assert ByteTokenizer().decode(ds.tokens.tolist()) == "hello<|endoftext|>x<|endoftext|>yz<|endoftext|>"


@pytest.mark.parametrize(
    "content, match",
    [
        ('{"text": "ok"}\n{"text": "broken"\n', r"bad\.jsonl:2: invalid JSON"),
        ('{"text": "ok"}\n\n{"body": "no text"}\n', r"bad\.jsonl:3: .*'text'.*body"),
        ('["a list"]\n', r"bad\.jsonl:1: .*'text'"),
    ],
)
def test_jsonl_errors_name_file_and_line(tmp_path, content, match):
    (tmp_path / "bad.jsonl").write_text(content, encoding="utf-8")
    with pytest.raises(ValueError, match=match):
        TokenDataset.from_files(tmp_path / "bad.jsonl", ByteTokenizer())


def test_unsupported_suffix(tmp_path):
    (tmp_path / "a.csv").write_text("x", encoding="utf-8")
    with pytest.raises(ValueError, match=r"\.jsonl"):
        TokenDataset.from_files([tmp_path / "a.csv"], ByteTokenizer())


class CountingTokenizer(ByteTokenizer):
    def __init__(self):
        self.calls = 0

    def encode(self, text):
        self.calls += 1
        return super().encode(text)


def test_from_files_cache_is_reused_and_invalidated(tmp_path):
    data, cache = tmp_path / "d.txt", tmp_path / "cache"
    data.write_text("some text", encoding="utf-8")
    tok = CountingTokenizer()
    first = TokenDataset.from_files([data], tok, cache_dir=cache)
    assert tok.calls == 1 and len(os.listdir(cache)) == 1
    second = TokenDataset.from_files([data], tok, cache_dir=cache)
    assert tok.calls == 1, "second call must read the cache, not tokenize"
    assert isinstance(second.tokens, np.memmap) and second.vocab_size == 257
    np.testing.assert_array_equal(first.tokens, second.tokens)
    data.write_text("other text!", encoding="utf-8")  # new size and mtime -> new key
    third = TokenDataset.from_files([data], tok, cache_dir=cache)
    assert tok.calls == 2 and len(os.listdir(cache)) == 2
    assert ByteTokenizer().decode(third.tokens.tolist()) == "other text!<|endoftext|>"


# ----------------------------------------------------------------------------- entropy


def test_unigram_entropy_known_distributions():
    assert unigram_entropy([3, 3, 3]) == 0.0
    assert math.isclose(unigram_entropy(np.arange(8)), math.log(8))
    p = np.array([0.5, 0.25, 0.25])
    ds = TokenDataset(np.array([0, 0, 1, 2], dtype=np.uint16))
    assert math.isclose(unigram_entropy(ds), float(-(p * np.log(p)).sum()))
    with pytest.raises(ValueError, match="empty"):
        unigram_entropy([])


# ----------------------------------------------------------------------------- sampler


def _dataset(n=1001):
    # Token value == position, so a window is identified by its first token.
    return TokenDataset(np.arange(n, dtype=np.uint32))


def _sampler(ds=None, *, dp_rank=0, dp_size=1, seq_len=10, gbs=8, seed=0):
    return BatchSampler(
        ds if ds is not None else _dataset(),
        seq_len=seq_len,
        global_batch_size=gbs,
        dp_rank=dp_rank,
        dp_size=dp_size,
        seed=seed,
    )


def test_sampling_math():
    assert num_windows(1001, 10) == 100 and num_windows(1000, 10) == 99 and num_windows(5, 10) == 0
    assert shard_slice(global_batch_size=8, dp_rank=1, dp_size=4) == slice(2, 4)
    np.testing.assert_array_equal(
        epoch_permutation(num_windows=50, seed=3, epoch=2),
        np.random.Generator(np.random.PCG64(5)).permutation(50),
    )


def test_windows_labels_and_coverage():
    s = _sampler()
    assert (s.num_windows, s.steps_per_epoch) == (100, 12)
    batch = s.global_batch(0)
    x, y = batch["input_ids"], batch["labels"]
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (8, 10)
    torch.testing.assert_close(y[:, :-1], x[:, 1:], rtol=0, atol=0)
    torch.testing.assert_close(y - x, torch.ones_like(x), rtol=0, atol=0)  # labels are next tokens
    assert ((x[:, 0] % 10) == 0).all()
    # One epoch visits distinct windows; 12 * 8 = 96 of 100 (last partial batch dropped).
    starts = torch.cat([s.global_batch(t)["input_ids"][:, 0] for t in range(12)])
    assert len(set(starts.tolist())) == 96


@pytest.mark.parametrize("dp_size", [1, 2, 4])
def test_shards_concatenate_to_global_batch(dp_size):
    samplers = [_sampler(dp_rank=r, dp_size=dp_size) for r in range(dp_size)]
    reference = _sampler()
    for step in range(15):  # crosses the epoch boundary at 12
        shards = [s.next_batch() for s in samplers]
        expected = reference.global_batch(step)
        for key in ("input_ids", "labels"):
            got = torch.cat([b[key] for b in shards])
            torch.testing.assert_close(got, expected[key], rtol=0, atol=0)
    assert samplers[0].state_dict() == {"epoch": 1, "step_in_epoch": 3, "seed": 0, "samples_seen": 120}


def test_epoch_rollover_uses_new_permutation():
    s = _sampler()
    first_epoch = [s.next_batch()["input_ids"] for _ in range(12)]
    assert s.state_dict()["epoch"] == 1 and s.state_dict()["step_in_epoch"] == 0
    nxt = s.next_batch()["input_ids"][:, 0] // 10
    perm1 = epoch_permutation(num_windows=100, seed=0, epoch=1)
    assert nxt.tolist() == perm1[:8].tolist()
    assert not torch.equal(nxt, first_epoch[0][:, 0] // 10)


@pytest.mark.parametrize("new_dp_size", [1, 2, 4])
def test_resume_mid_epoch_is_identical_even_with_resharding(new_dp_size):
    ref = _sampler(seed=7)
    for _ in range(5):
        ref.next_batch()
    state = ref.state_dict()
    expected = [ref.next_batch() for _ in range(10)]  # crosses into epoch 1

    resumed = [_sampler(dp_rank=r, dp_size=new_dp_size, seed=123) for r in range(new_dp_size)]
    for s in resumed:
        s.load_state_dict(dict(state))
    for exp in expected:
        got = torch.cat([s.next_batch()["input_ids"] for s in resumed])
        torch.testing.assert_close(got, exp["input_ids"], rtol=0, atol=0)
    assert resumed[0].state_dict() == ref.state_dict()


def test_sampler_reads_memmap(tmp_path):
    path = write_bin(tmp_path / "t.bin", np.arange(1001, dtype=np.uint16))
    from_bin = _sampler(TokenDataset.from_bin(path, dtype="uint16"))
    for step in range(3):
        torch.testing.assert_close(from_bin.next_batch()["labels"], _sampler().global_batch(step)["labels"])


def test_sampler_validation_errors():
    with pytest.raises(ValueError, match=r"global_batch_size=10.*dp_size=4.*global_batch_size=12"):
        _sampler(gbs=10, dp_size=4)
    with pytest.raises(ValueError, match=r"global_batch_size=5.*dp_size=4.*global_batch_size=4 "):
        _sampler(gbs=5, dp_size=4)
    with pytest.raises(ValueError, match=r"global_batch_size=3.*dp_size=4.*global_batch_size=4 "):
        _sampler(gbs=3, dp_size=4)
    with pytest.raises(ValueError, match=r"5 tokens.*seq_len \+ 1 = 11"):
        _sampler(_dataset(5))
    with pytest.raises(ValueError, match=r"yields 4 windows.*global_batch_size=8"):
        _sampler(_dataset(41))
    with pytest.raises(ValueError, match="dp_rank"):
        _sampler(dp_rank=2, dp_size=2)
    s = _sampler()
    with pytest.raises(ValueError, match="step_in_epoch=12"):
        s.load_state_dict({"epoch": 0, "step_in_epoch": 12, "seed": 0, "samples_seen": 0})
    with pytest.raises(ValueError, match="lacks keys"):
        s.load_state_dict({"epoch": 0})


def test_shift_labels_trains_transformers_own_objective():
    """transformers' loss with labels = input_ids equals behemoth's loss (logits[:, i] against
    labels[:, i]) on shift_labels(input_ids): the same next-token objective, not a copy task."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=61, n_positions=16, n_embd=32, n_layer=1, n_head=2)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    ids = torch.randint(0, 61, (3, 16))
    with torch.no_grad():
        theirs = model(ids, labels=ids).loss
        logits = model(ids).logits
    labels = shift_labels(ids)
    assert labels[:, -1].tolist() == [IGNORE_INDEX] * 3 and torch.equal(labels[:, :-1], ids[:, 1:])
    ours = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match=r"labels must be \[B, S\]"):
        shift_labels(ids[0])

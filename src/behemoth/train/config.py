"""The training job's configuration: small keyword-only frozen dataclasses, one per section.

A job is one TOML file with the sections ``[model]``, ``[data]``, ``[optim]``, ``[plan]``
and ``[train]``, plus command-line overrides ``--section.key=value`` (the value is read as
a TOML literal, else taken as a string)::

    cfg = load_config("src/behemoth/configs/demo.toml", ["--train.steps=50", "--optim.lr=1e-3"])
    print(format_config(cfg.resolved(world_size=4)))   # what `behemoth config` prints

Every section validates itself at construction and :class:`Config` checks the rules that
span sections, so a bad job fails before any process group exists, with a message that
names the value, the rule and the fix. ``[plan]`` *is* :class:`behemoth.Plan` (same fields,
same validation). Optional fields take the string ``"none"`` in TOML, which has no null.

Test: ``pytest tests/unit/test_config.py``.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import sys
import typing
from dataclasses import dataclass, field

from behemoth.plan import Plan

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

__all__ = [
    "ConfigError",
    "ModelSection",
    "DataSection",
    "OptimSection",
    "PlanSection",
    "TrainSection",
    "Config",
    "load_config",
    "parse_overrides",
    "format_config",
]

PlanSection = Plan
"""The ``[plan]`` section is the Plan itself: every field of ``bh.Plan``, validated by it."""

TOKENIZER_VOCAB = {"byte": 257, "gpt2": 50257}  # class attributes of the tokenizers; no import needed
TEXT_SUFFIXES = (".txt", ".jsonl")


WANDB_MODES = ("online", "offline", "disabled")


class ConfigError(ValueError):
    """An invalid configuration; the message names the value, the rule and the fix."""


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass(frozen=True, kw_only=True)
class ModelSection:
    """Which model to train (``behemoth.models.build_model``)."""

    name: str = "gpt-mini"
    """Preset name: gpt-tiny, gpt-mini, gpt-125m, gpt-1.3b, llama-mini, ... (behemoth.models.MODEL_PRESETS)."""
    vocab_size: int | None = None
    """Rows of the embedding; "none" takes the tokenizer's vocabulary size."""
    seq_len: int = 128
    """Tokens per training sample (and the model's maximum sequence length)."""
    num_layers: int | None = None
    """Transformer blocks; "none" keeps the preset's."""
    num_heads: int | None = None
    """Attention heads per block; "none" keeps the preset's."""
    hidden: int | None = None
    """Model width; "none" keeps the preset's."""
    dropout: float = 0.0
    """Dropout probability (GPT only); each dp rank draws its own masks (seed + dp_rank)."""
    seed: int = 0
    """Seed of the weight initialisation (identical on every rank)."""

    def __post_init__(self) -> None:
        from behemoth.models import MODEL_PRESETS

        _require(
            self.name in MODEL_PRESETS,
            f"model.name={self.name!r} is not a known preset; use one of {', '.join(sorted(MODEL_PRESETS))}.",
        )
        for key in ("vocab_size", "num_layers", "num_heads", "hidden"):
            v = getattr(self, key)
            _require(
                v is None or (_is_int(v) and v > 0),
                f'model.{key}={v!r}: must be a positive integer, or "none" for the default.',
            )
        _require(
            _is_int(self.seq_len) and self.seq_len > 0,
            f"model.seq_len={self.seq_len!r}: must be a positive integer, e.g. 128.",
        )
        _require(
            _is_number(self.dropout) and 0.0 <= self.dropout < 1.0,
            f"model.dropout={self.dropout!r}: must satisfy 0 <= dropout < 1, e.g. 0.0 or 0.1.",
        )
        _require(_is_int(self.seed), f"model.seed={self.seed!r}: must be an integer.")

    def shape_overrides(self) -> dict:
        """The non-preset shape fields to pass to ``build_model``."""
        return {k: getattr(self, k) for k in ("num_layers", "num_heads", "hidden") if getattr(self, k) is not None}


@dataclass(frozen=True, kw_only=True)
class DataSection:
    """Where the training tokens come from (``behemoth.train.data``)."""

    source: str | tuple[str, ...] = "default"
    """"default" (the embedded Python-stdlib corpus), one .bin token file, or .txt/.jsonl file(s)."""
    tokenizer: str = "byte"
    """"byte" (UTF-8 bytes, vocab 257, no dependencies) or "gpt2" (GPT-2 BPE, vocab 50257)."""
    bin_dtype: str = "uint16"
    """Element type of a .bin source: "uint16" or "uint32"."""
    cache_dir: str | None = None
    """Where tokenized .txt/.jsonl sources are cached as .bin files; "none": train.out_dir/cache."""
    default_corpus_bytes: int = 2_000_000
    """How many bytes of stdlib source the "default" corpus holds."""
    eval_fraction: float = 0.0
    """Fraction of the tokens (the end of the stream) held out of training for train.eval_every; 0: none."""

    def __post_init__(self) -> None:
        if isinstance(self.source, list):
            object.__setattr__(self, "source", tuple(self.source))
        _require(
            self.tokenizer in TOKENIZER_VOCAB,
            f"data.tokenizer={self.tokenizer!r}: must be one of {list(TOKENIZER_VOCAB)}.",
        )
        _require(
            self.bin_dtype in ("uint16", "uint32"), f'data.bin_dtype={self.bin_dtype!r}: must be "uint16" or "uint32".'
        )
        _require(
            _is_int(self.default_corpus_bytes) and self.default_corpus_bytes > 0,
            f"data.default_corpus_bytes={self.default_corpus_bytes!r}: must be a positive integer, e.g. 2000000.",
        )
        _require(
            _is_number(self.eval_fraction) and 0 <= self.eval_fraction <= 0.5,
            f"data.eval_fraction={self.eval_fraction!r}: must be a number in [0, 0.5], e.g. 0.05.",
        )
        paths = self.paths
        _require(
            bool(paths) and all(isinstance(p, str) and p for p in paths),
            f'data.source={self.source!r}: must be "default", a file path or a list of file paths.',
        )
        if self.source == "default":
            return
        bins = [p for p in paths if p.endswith(".bin")]
        if bins:
            _require(
                len(paths) == 1,
                f"data.source={self.source!r}: a .bin token file must be the only source; "
                f"concatenate the token files into one .bin, or list only .txt/.jsonl files.",
            )
        else:
            bad = [p for p in paths if not p.lower().endswith(TEXT_SUFFIXES)]
            if bad:
                raise ConfigError(
                    f"data.source file {bad[0]!r} has an unsupported type; use .bin (tokens), "
                    f'.txt (one document) or .jsonl (one {{"text": ...}} per line).'
                )

    @property
    def paths(self) -> tuple[str, ...]:
        return (self.source,) if isinstance(self.source, str) else tuple(self.source)


@dataclass(frozen=True, kw_only=True)
class OptimSection:
    """Optimizer and learning-rate schedule."""

    name: str = "adamw"
    """"adamw" (torch.optim.AdamW) or "sgd" (torch.optim.SGD with momentum)."""
    lr: float = 3e-4
    """Peak learning rate, reached at the end of warm-up."""
    weight_decay: float = 0.1
    """Decoupled weight decay, applied to matrices only (not to biases, norms or position rows of 1-D)."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW's (beta1, beta2)."""
    momentum: float = 0.9
    """SGD momentum."""
    warmup_steps: int = 0
    """Steps of linear warm-up from lr / warmup_steps to lr."""
    schedule: str = "cosine"
    """After warm-up: "cosine" decay to lr * min_lr_ratio at the last step, or "constant"."""
    min_lr_ratio: float = 0.1
    """Final learning rate of the cosine schedule, as a fraction of lr."""
    max_grad_norm: float | None = 1.0
    """Clip the global gradient norm to this; "none" disables clipping."""

    def __post_init__(self) -> None:
        if isinstance(self.betas, list):
            object.__setattr__(self, "betas", tuple(self.betas))
        _require(self.name in ("adamw", "sgd"), f'optim.name={self.name!r}: must be "adamw" or "sgd".')
        _require(_is_number(self.lr) and self.lr > 0, f"optim.lr={self.lr!r}: must be a number > 0, e.g. 3e-4.")
        _require(
            _is_number(self.weight_decay) and self.weight_decay >= 0,
            f"optim.weight_decay={self.weight_decay!r}: must be a number >= 0, e.g. 0.1.",
        )
        _require(
            isinstance(self.betas, tuple)
            and len(self.betas) == 2
            and all(_is_number(b) and 0 <= b < 1 for b in self.betas),
            f"optim.betas={self.betas!r}: must be two numbers in [0, 1), e.g. [0.9, 0.95].",
        )
        _require(
            _is_number(self.momentum) and 0 <= self.momentum < 1,
            f"optim.momentum={self.momentum!r}: must be a number in [0, 1), e.g. 0.9.",
        )
        _require(
            _is_int(self.warmup_steps) and self.warmup_steps >= 0,
            f"optim.warmup_steps={self.warmup_steps!r}: must be an integer >= 0.",
        )
        _require(
            self.schedule in ("cosine", "constant"),
            f'optim.schedule={self.schedule!r}: must be "cosine" or "constant".',
        )
        _require(
            _is_number(self.min_lr_ratio) and 0 <= self.min_lr_ratio <= 1,
            f"optim.min_lr_ratio={self.min_lr_ratio!r}: must be a number in [0, 1], e.g. 0.1.",
        )
        _require(
            self.max_grad_norm is None or (_is_number(self.max_grad_norm) and self.max_grad_norm > 0),
            f'optim.max_grad_norm={self.max_grad_norm!r}: must be a number > 0, or "none" to disable clipping.',
        )


@dataclass(frozen=True, kw_only=True)
class TrainSection:
    """Length of the run, batch, logging and checkpoints."""

    steps: int = 200
    """Total optimizer steps (a resumed run continues up to this many)."""
    global_batch_size: int = 32
    """Samples per optimizer step summed over every data-parallel rank (divisible by plan.dp)."""
    seed: int = 0
    """Data-order seed; dropout uses seed + dp_rank."""
    log_every: int = 10
    """Print a log line every this many steps (the first and last step always log)."""
    save_every: int = 0
    """Save a checkpoint every this many steps; 0 saves only at the end."""
    out_dir: str = "runs/demo"
    """Directory of checkpoints/, metrics.jsonl, tensorboard/, loss.png and summary.json."""
    resume: bool = True
    """Continue from the newest complete checkpoint in out_dir/checkpoints if there is one. With false,
    an out_dir that holds another run is refused (see overwrite)."""
    resume_from: str | None = None
    """Resume from this checkpoint directory instead of the newest in out_dir/checkpoints (a checkpoint of
    this run's own out_dir rewinds it: newer checkpoints are deleted). A group restarted by torchrun
    continues from its own newest checkpoint instead (and neither overwrites nor refuses its out_dir)."""
    init_from: str | None = None
    """Start a new run from this checkpoint's model weights only (fresh optimizer, step 0, data from the
    start); a transformers checkpoint directory (config.json, .safetensors) of the same shape works too
    (GPT-2 for gpt-* models, Llama for llama-*); ignored when the run resumes from a checkpoint of its own."""
    overwrite: bool = False
    """Delete the run files already in out_dir (checkpoints, metrics, logs) and start over; implies no resume."""
    keep_last: int = 3
    """Complete checkpoints to keep (older ones are deleted once a newer one is complete); 0 keeps all."""
    async_checkpoint: bool = True
    """Write the save_every checkpoints in the background: training stops only to copy its state to host
    memory (which then holds one more copy of it) and goes on while the files are written; the previous
    save completes before the next begins. The last checkpoint and a SIGTERM's are written before the run ends."""
    eval_every: int = 0
    """Measure the loss on the held-out split (data.eval_fraction) every this many steps and at the end; 0: never."""
    eval_batches: int = 4
    """Global batches of held-out windows each evaluation reads (the same ones every time)."""
    hang_timeout: float = 120.0
    """Seconds without a heartbeat from a rank before the job stops and names it (stopped, hung in native
    code, or its host gone); 0 turns the watchdog off."""
    wandb_project: str | None = None
    """Also log every step's scalars (those of metrics.jsonl) to this Weights & Biases project; needs the
    wandb package (pip install wandb). None: no wandb."""
    wandb_entity: str | None = None
    """The wandb team or user the run belongs to; None: wandb's default."""
    wandb_run_name: str | None = None
    """The wandb run's display name; None: wandb picks one. A resumed run continues the same wandb run."""
    wandb_mode: str | None = None
    """'online', 'offline' (files under out_dir/wandb only, nothing sent; upload later with wandb sync) or
    'disabled'; None: wandb's own setting (the WANDB_MODE environment variable, else online)."""
    sample_every: int = 0
    """Write the model's greedy continuation of sample_prompt to the training log every this many steps and
    at the end; 0: never."""
    sample_prompt: str = "def "
    """The prompt of train.sample_every's samples."""
    sample_tokens: int = 32
    """Tokens each train.sample_every sample adds to its prompt."""

    def __post_init__(self) -> None:
        for key, low in (
            ("steps", 1),
            ("global_batch_size", 1),
            ("log_every", 1),
            ("save_every", 0),
            ("keep_last", 0),
            ("eval_every", 0),
            ("eval_batches", 1),
            ("sample_every", 0),
            ("sample_tokens", 1),
        ):
            v = getattr(self, key)
            _require(_is_int(v) and v >= low, f"train.{key}={v!r}: must be an integer >= {low}.")
        _require(_is_int(self.seed), f"train.seed={self.seed!r}: must be an integer.")
        _require(
            isinstance(self.out_dir, str) and self.out_dir != "",
            f"train.out_dir={self.out_dir!r}: must be a non-empty directory path.",
        )
        for key in ("resume", "overwrite", "async_checkpoint"):
            v = getattr(self, key)
            _require(isinstance(v, bool), f"train.{key}={v!r}: must be true or false.")
        for key in ("resume_from", "init_from"):
            v = getattr(self, key)
            _require(
                v is None or (isinstance(v, str) and v != ""),
                f'train.{key}={v!r}: must be a checkpoint directory, or "none".',
            )
        for key in ("wandb_project", "wandb_entity", "wandb_run_name"):
            v = getattr(self, key)
            _require(v is None or (isinstance(v, str) and v != ""), f'train.{key}={v!r}: must be a name, or "none".')
        _require(
            self.wandb_mode in (None, *WANDB_MODES),
            f"train.wandb_mode={self.wandb_mode!r}: must be one of {', '.join(map(repr, WANDB_MODES))}, or "
            f'"none" for wandb\'s own setting.',
        )
        for key in ("wandb_entity", "wandb_run_name", "wandb_mode"):
            _require(
                getattr(self, key) is None or self.wandb_project is not None,
                f"train.{key}={getattr(self, key)!r} configures Weights & Biases logging, which is off: set "
                f"train.wandb_project too.",
            )
        _require(
            isinstance(self.sample_prompt, str) and self.sample_prompt != "",
            f"train.sample_prompt={self.sample_prompt!r}: must be a non-empty string.",
        )
        _require(
            _is_number(self.hang_timeout) and self.hang_timeout >= 0,
            f"train.hang_timeout={self.hang_timeout!r}: must be a number of seconds >= 0 (0 turns the watchdog off).",
        )


SECTIONS: dict[str, type] = {
    "model": ModelSection,
    "data": DataSection,
    "optim": OptimSection,
    "plan": PlanSection,
    "train": TrainSection,
}


@dataclass(frozen=True, kw_only=True)
class Config:
    """One training job: every section, checked together."""

    model: ModelSection = field(default_factory=ModelSection)
    """The model to build."""
    data: DataSection = field(default_factory=DataSection)
    """The training tokens."""
    optim: OptimSection = field(default_factory=OptimSection)
    """Optimizer and learning-rate schedule."""
    plan: Plan = field(default_factory=Plan)
    """How the job is parallelised (bh.Plan)."""
    train: TrainSection = field(default_factory=TrainSection)
    """Run length, batch, logging and checkpoints."""

    def __post_init__(self) -> None:
        _require(
            not self.train.eval_every or self.data.eval_fraction > 0,
            f"train.eval_every={self.train.eval_every} needs a held-out split; set data.eval_fraction, e.g. "
            f"--data.eval_fraction=0.05 (the end of the token stream, never trained on).",
        )
        if self.train.sample_every:
            _require(
                self.plan.pp == 1 and self.plan.cp == 1,
                f"train.sample_every={self.train.sample_every}: generation runs under data and tensor parallelism, "
                f"and this plan has pp={self.plan.pp}, cp={self.plan.cp}; set train.sample_every=0, or sample from "
                f"a checkpoint with `behemoth generate CHECKPOINT --prompt ...` under a plan without pp and cp.",
            )
            needed = len(self.train.sample_prompt.encode("utf-8")) + self.train.sample_tokens
            _require(
                needed <= self.model.seq_len,
                f"train.sample_prompt ({len(self.train.sample_prompt.encode('utf-8'))} bytes) plus "
                f"train.sample_tokens={self.train.sample_tokens} may need {needed} positions, more than "
                f"model.seq_len={self.model.seq_len}; shorten the prompt or lower train.sample_tokens.",
            )
        vocab = TOKENIZER_VOCAB[self.data.tokenizer]
        v = self.model.vocab_size
        _require(
            v is None or v >= vocab,
            f"model.vocab_size={v} is smaller than the {self.data.tokenizer!r} tokenizer's {vocab} ids; "
            f'set model.vocab_size >= {vocab} or "none" to use the tokenizer\'s.',
        )
        if self.plan.dp is not None:
            per = self.plan.dp * self.plan.microbatches
            b = self.train.global_batch_size
            _require(
                b % per == 0,
                f"train.global_batch_size={b} is not divisible by plan.dp * plan.microbatches = "
                f"{self.plan.dp} * {self.plan.microbatches} = {per}; use a multiple of {per}, "
                f"e.g. {max(per, round(b / per) * per)}.",
            )

    # ------------------------------------------------------------ construction
    @classmethod
    def from_dict(cls, data: dict) -> Config:
        """Build from ``{section: {key: value}}``; unknown sections or keys are errors."""
        if not isinstance(data, dict):
            raise ConfigError(f"a config must be a table of sections, got {type(data).__name__}.")
        sections = {}
        for name, values in data.items():
            if name not in SECTIONS:
                raise ConfigError(_unknown("section", name, SECTIONS))
            if not isinstance(values, dict):
                raise ConfigError(
                    f"[{name}] must be a table of keys, got {name} = {values!r}; write it as a [{name}] section."
                )
            hints = _field_types(SECTIONS[name])
            kwargs = {}
            for key, value in values.items():
                if key not in hints:
                    raise ConfigError(_unknown("key", f"{name}.{key}", hints, prefix=f"{name}."))
                kwargs[key] = _coerce(f"{name}.{key}", value, hints[key])
            try:
                sections[name] = SECTIONS[name](**kwargs)
            except ConfigError:
                raise
            except ValueError as e:  # Plan's own validation
                raise ConfigError(f"[{name}] {e}") from None
        return cls(**sections)

    def to_dict(self) -> dict:
        """``{section: {key: value}}`` with tuples as lists (JSON- and TOML-friendly)."""
        out = {}
        for f in dataclasses.fields(self):
            section = getattr(self, f.name)
            out[f.name] = {k.name: _plain(getattr(section, k.name)) for k in dataclasses.fields(section)}
        return out

    def replace(self, overrides: dict[str, dict]) -> Config:
        """A copy with ``{section: {key: value}}`` applied on top."""
        merged = self.to_dict()
        for name, values in overrides.items():
            if name not in SECTIONS:
                raise ConfigError(_unknown("section", name, SECTIONS))
            merged[name].update(values)
        return Config.from_dict(merged)

    def resolved(self, *, world_size: int | None = None) -> Config:
        """Every "none" that can be known here filled in: the vocabulary from the tokenizer, the
        model shape from its preset, the token cache directory, and (given ``world_size``) the
        plan's dp degree."""
        from behemoth.models import build_config

        vocab = self.model.vocab_size or TOKENIZER_VOCAB[self.data.tokenizer]
        shape = build_config(
            self.model.name, vocab_size=vocab, seq_len=self.model.seq_len, **self.model.shape_overrides()
        )
        model = dataclasses.replace(
            self.model, vocab_size=vocab, num_layers=shape.num_layers, num_heads=shape.num_heads, hidden=shape.hidden
        )
        data = self.data
        if data.cache_dir is None:
            data = dataclasses.replace(data, cache_dir=os.path.join(self.train.out_dir, "cache"))
        plan = self.plan
        if world_size is not None:
            try:
                plan = plan.resolve(world_size)
            except ValueError as e:
                raise ConfigError(str(e)) from None
        return dataclasses.replace(self, model=model, data=data, plan=plan)


# ------------------------------------------------------------------ typing helpers
def _field_types(cls) -> dict[str, object]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


# Keys that were renamed: the old name gets an error that names the new one.
_RENAMED_KEYS = {
    "plan.sp": "plan.cp",
    "plan.sp_mode": "plan.cp_mode",
}


def _unknown(kind: str, name: str, valid, prefix: str = "") -> str:
    if name in _RENAMED_KEYS:
        new = _RENAMED_KEYS[name]
        return (
            f"config {kind} {name!r} is now {new!r} (context parallelism: Ulysses or ring attention; "
            f"plan.sequence_parallel is Megatron's, inside 1D tp). Rename {name!r} to {new!r}."
        )
    names = [prefix + k for k in valid]
    close = difflib.get_close_matches(name, names, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return f"unknown config {kind} {name!r}.{hint} Valid {kind}s: {', '.join(names)}."


def _plain(v):
    if isinstance(v, tuple):
        return [_plain(x) for x in v]
    return v


def _describe(hint) -> str:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) is tuple:
        return f"a list of {len(args)} numbers" if args and args[-1] is not Ellipsis else "a list"
    if args:
        return " or ".join(_describe(a) for a in args)
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(hint, str(hint))


def _coerce(where: str, value, hint):
    """``value`` checked against (and converted to) the field type ``hint``."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    optional = type(None) in args
    if optional and isinstance(value, str) and value.lower() in ("none", "null"):
        return None
    if value is None and optional:
        return None
    candidates = [a for a in args if a is not type(None)] if args and origin is not tuple else [hint]
    for cand in candidates:
        ok, out = _convert(value, cand)
        if ok:
            return out
    extra = ' or "none"' if optional else ""
    raise ConfigError(
        f"{where}={value!r}: expected {_describe(hint)}{extra}; fix the value (for example --{where}=...)."
    )


def _convert(value, hint):
    if hint is bool:
        return isinstance(value, bool), value
    if hint is int:
        return _is_int(value), value
    if hint is float:
        return _is_number(value), float(value) if _is_number(value) else value
    if hint is str:
        return isinstance(value, str), value
    if typing.get_origin(hint) is tuple:
        args = typing.get_args(hint)
        if not isinstance(value, (list, tuple)):
            return False, value
        if len(args) == 2 and args[1] is Ellipsis:
            items = [_convert(v, args[0]) for v in value]
        else:
            if len(value) != len(args):
                return False, value
            items = [_convert(v, a) for v, a in zip(value, args)]
        return all(ok for ok, _ in items), tuple(v for _, v in items)
    return False, value


# ------------------------------------------------------------------ files and overrides
def parse_overrides(args: list[str]) -> dict[str, dict]:
    """``["--train.steps=10", "--data.source=a.txt"]`` -> ``{"train": {"steps": 10}, ...}``.

    The value is read as a TOML literal (numbers, booleans, lists, quoted strings);
    anything that is not one is taken as a plain string.
    """
    out: dict[str, dict] = {}
    for arg in args:
        body = arg[2:] if arg.startswith("--") else None
        if body is None or "=" not in body or "." not in body.split("=", 1)[0]:
            raise ConfigError(
                f"override {arg!r} is not of the form --section.key=value (for example --train.steps=100)."
            )
        dotted, raw = body.split("=", 1)
        section, key = dotted.split(".", 1)
        if section not in SECTIONS:
            raise ConfigError(_unknown("section", section, SECTIONS) + f" (in override {arg!r})")
        if key not in _field_types(SECTIONS[section]):
            raise ConfigError(_unknown("key", dotted, _field_types(SECTIONS[section]), prefix=f"{section}."))
        try:
            value = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw
        out.setdefault(section, {})[key] = value
    return out


def load_config(path: str | None, overrides: list[str] = ()) -> Config:
    """Read the TOML file at ``path`` (None: all defaults) and apply ``--section.key=value`` overrides."""
    data: dict = {}
    if path is not None:
        if not os.path.isfile(path):
            raise ConfigError(
                f"config file {path!r} does not exist; pass the path of a .toml file, "
                f"e.g. src/behemoth/configs/demo.toml."
            )
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {path!r} is not valid TOML: {e}.") from None
    for section, values in parse_overrides(list(overrides)).items():
        if not isinstance(data.get(section, {}), dict):
            raise ConfigError(f"config file {path!r}: {section} must be a [{section}] table.")
        data.setdefault(section, {}).update(values)
    return Config.from_dict(data)


def _toml_value(v) -> str:
    if v is None:
        return '"none"'
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return repr(v)


def format_config(config: Config) -> str:
    """The config as TOML (loadable again), every field shown, defaults included."""
    lines = []
    for name, values in config.to_dict().items():
        lines.append(f"[{name}]")
        width = max(len(k) for k in values)
        lines += [f"{k.ljust(width)} = {_toml_value(v)}" for k, v in values.items()]
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"

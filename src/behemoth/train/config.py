"""The training job's configuration: its sections together, read from TOML and overrides.

A job is one TOML file with the sections ``[model]``, ``[data]``, ``[optim]``, ``[plan]``
and ``[train]``, plus command-line overrides ``--section.key=value`` (the value is read as
a TOML literal, else taken as a string)::

    cfg = load_config("src/behemoth/configs/demo.toml", ["--train.steps=50", "--optim.lr=1e-3"])
    print(format_config(cfg.resolved(world_size=4)))   # what `behemoth config` prints

Every section validates itself at construction (:mod:`behemoth.train.config_sections`, one
dataclass per section) and :class:`Config` checks the rules that span sections, so a bad job
fails before any process group exists, with a message that names the value, the rule and the
fix. Here live the job as a whole and its text form: values checked against the field types,
unknown keys answered with the closest valid one, overrides, loading and printing. Optional
fields take the string ``"none"`` in TOML, which has no null.

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
from behemoth.train.config_sections import (
    SECTIONS,
    TOKENIZER_VOCAB,
    ConfigError,
    DataSection,
    ModelSection,
    OptimSection,
    TrainSection,
    is_int,
    is_number,
    require,
)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

__all__ = [
    "Config",
    "load_config",
    "parse_overrides",
    "format_config",
]


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
        require(
            not self.train.eval_every or self.data.eval_fraction > 0,
            f"train.eval_every={self.train.eval_every} needs a held-out split; set data.eval_fraction, e.g. "
            f"--data.eval_fraction=0.05 (the end of the token stream, never trained on).",
        )
        if self.train.sample_every:
            needed = len(self.train.sample_prompt.encode("utf-8")) + self.train.sample_tokens
            require(
                needed <= self.model.seq_len,
                f"train.sample_prompt ({len(self.train.sample_prompt.encode('utf-8'))} bytes) plus "
                f"train.sample_tokens={self.train.sample_tokens} may need {needed} positions, more than "
                f"model.seq_len={self.model.seq_len}; shorten the prompt or lower train.sample_tokens.",
            )
        vocab = TOKENIZER_VOCAB[self.data.tokenizer]
        v = self.model.vocab_size
        require(
            v is None or v >= vocab,
            f"model.vocab_size={v} is smaller than the {self.data.tokenizer!r} tokenizer's {vocab} ids; "
            f'set model.vocab_size >= {vocab} or "none" to use the tokenizer\'s.',
        )
        if self.plan.dp is not None:
            per = self.plan.dp * self.plan.microbatches
            b = self.train.global_batch_size
            require(
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
        return is_int(value), value
    if hint is float:
        return is_number(value), float(value) if is_number(value) else value
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

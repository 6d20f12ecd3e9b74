"""The training job's sections: one small keyword-only frozen dataclass per TOML table.

Each section lists its keys with their defaults and a docstring each, and validates every key
at construction with a message that names the value, the rule and the fix. :data:`SECTIONS`
maps a table's name (``[model]``, ``[data]``, ``[optim]``, ``[plan]``, ``[train]``) to its class;
``[plan]`` *is* :class:`behemoth.Plan` (same fields, same validation). The job as a whole (the
rules that span sections, reading TOML and ``--section.key=value`` overrides, printing) is
:mod:`behemoth.train.config`.

Test: ``pytest tests/unit/test_config.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

from behemoth.plan import Plan

__all__ = [
    "ConfigError",
    "ModelSection",
    "DataSection",
    "OptimSection",
    "PlanSection",
    "TrainSection",
    "SECTIONS",
    "TOKENIZER_VOCAB",
]

PlanSection = Plan
"""The ``[plan]`` section is the Plan itself: every field of ``bh.Plan``, validated by it."""

TOKENIZER_VOCAB = {"byte": 257, "gpt2": 50257}  # class attributes of the tokenizers; no import needed
TEXT_SUFFIXES = (".txt", ".jsonl")


WANDB_MODES = ("online", "offline", "disabled")


class ConfigError(ValueError):
    """An invalid configuration; the message names the value, the rule and the fix."""


def require(ok: bool, message: str) -> None:
    """Raise :class:`ConfigError` with ``message`` unless ``ok``."""
    if not ok:
        raise ConfigError(message)


def is_int(v) -> bool:
    """An int that is not a bool (TOML's true is not a count)."""
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v) -> bool:
    """An int or float that is not a bool."""
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

        require(
            self.name in MODEL_PRESETS,
            f"model.name={self.name!r} is not a known preset; use one of {', '.join(sorted(MODEL_PRESETS))}.",
        )
        for key in ("vocab_size", "num_layers", "num_heads", "hidden"):
            v = getattr(self, key)
            require(
                v is None or (is_int(v) and v > 0),
                f'model.{key}={v!r}: must be a positive integer, or "none" for the default.',
            )
        require(
            is_int(self.seq_len) and self.seq_len > 0,
            f"model.seq_len={self.seq_len!r}: must be a positive integer, e.g. 128.",
        )
        require(
            is_number(self.dropout) and 0.0 <= self.dropout < 1.0,
            f"model.dropout={self.dropout!r}: must satisfy 0 <= dropout < 1, e.g. 0.0 or 0.1.",
        )
        require(is_int(self.seed), f"model.seed={self.seed!r}: must be an integer.")

    def shape_overrides(self) -> dict:
        """The non-preset shape fields to pass to ``build_model``."""
        return {k: getattr(self, k) for k in ("num_layers", "num_heads", "hidden") if getattr(self, k) is not None}


@dataclass(frozen=True, kw_only=True)
class DataSection:
    """Where the training tokens come from (``behemoth.train.dataset``)."""

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
        require(
            self.tokenizer in TOKENIZER_VOCAB,
            f"data.tokenizer={self.tokenizer!r}: must be one of {list(TOKENIZER_VOCAB)}.",
        )
        require(
            self.bin_dtype in ("uint16", "uint32"), f'data.bin_dtype={self.bin_dtype!r}: must be "uint16" or "uint32".'
        )
        require(
            is_int(self.default_corpus_bytes) and self.default_corpus_bytes > 0,
            f"data.default_corpus_bytes={self.default_corpus_bytes!r}: must be a positive integer, e.g. 2000000.",
        )
        require(
            is_number(self.eval_fraction) and 0 <= self.eval_fraction <= 0.5,
            f"data.eval_fraction={self.eval_fraction!r}: must be a number in [0, 0.5], e.g. 0.05.",
        )
        paths = self.paths
        require(
            bool(paths) and all(isinstance(p, str) and p for p in paths),
            f'data.source={self.source!r}: must be "default", a file path or a list of file paths.',
        )
        if self.source == "default":
            return
        bins = [p for p in paths if p.endswith(".bin")]
        if bins:
            require(
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
        require(self.name in ("adamw", "sgd"), f'optim.name={self.name!r}: must be "adamw" or "sgd".')
        require(is_number(self.lr) and self.lr > 0, f"optim.lr={self.lr!r}: must be a number > 0, e.g. 3e-4.")
        require(
            is_number(self.weight_decay) and self.weight_decay >= 0,
            f"optim.weight_decay={self.weight_decay!r}: must be a number >= 0, e.g. 0.1.",
        )
        require(
            isinstance(self.betas, tuple)
            and len(self.betas) == 2
            and all(is_number(b) and 0 <= b < 1 for b in self.betas),
            f"optim.betas={self.betas!r}: must be two numbers in [0, 1), e.g. [0.9, 0.95].",
        )
        require(
            is_number(self.momentum) and 0 <= self.momentum < 1,
            f"optim.momentum={self.momentum!r}: must be a number in [0, 1), e.g. 0.9.",
        )
        require(
            is_int(self.warmup_steps) and self.warmup_steps >= 0,
            f"optim.warmup_steps={self.warmup_steps!r}: must be an integer >= 0.",
        )
        require(
            self.schedule in ("cosine", "constant"),
            f'optim.schedule={self.schedule!r}: must be "cosine" or "constant".',
        )
        require(
            is_number(self.min_lr_ratio) and 0 <= self.min_lr_ratio <= 1,
            f"optim.min_lr_ratio={self.min_lr_ratio!r}: must be a number in [0, 1], e.g. 0.1.",
        )
        require(
            self.max_grad_norm is None or (is_number(self.max_grad_norm) and self.max_grad_norm > 0),
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
    save_threads: int = 0
    """Threads (each writing its own file) with which a rank writes its part of a checkpoint; 0: one per GiB
    the rank writes, up to 8."""
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
            ("save_threads", 0),
        ):
            v = getattr(self, key)
            require(is_int(v) and v >= low, f"train.{key}={v!r}: must be an integer >= {low}.")
        require(is_int(self.seed), f"train.seed={self.seed!r}: must be an integer.")
        require(
            isinstance(self.out_dir, str) and self.out_dir != "",
            f"train.out_dir={self.out_dir!r}: must be a non-empty directory path.",
        )
        for key in ("resume", "overwrite", "async_checkpoint"):
            v = getattr(self, key)
            require(isinstance(v, bool), f"train.{key}={v!r}: must be true or false.")
        for key in ("resume_from", "init_from"):
            v = getattr(self, key)
            require(
                v is None or (isinstance(v, str) and v != ""),
                f'train.{key}={v!r}: must be a checkpoint directory, or "none".',
            )
        for key in ("wandb_project", "wandb_entity", "wandb_run_name"):
            v = getattr(self, key)
            require(v is None or (isinstance(v, str) and v != ""), f'train.{key}={v!r}: must be a name, or "none".')
        require(
            self.wandb_mode in (None, *WANDB_MODES),
            f"train.wandb_mode={self.wandb_mode!r}: must be one of {', '.join(map(repr, WANDB_MODES))}, or "
            f'"none" for wandb\'s own setting.',
        )
        for key in ("wandb_entity", "wandb_run_name", "wandb_mode"):
            require(
                getattr(self, key) is None or self.wandb_project is not None,
                f"train.{key}={getattr(self, key)!r} configures Weights & Biases logging, which is off: set "
                f"train.wandb_project too.",
            )
        require(
            isinstance(self.sample_prompt, str) and self.sample_prompt != "",
            f"train.sample_prompt={self.sample_prompt!r}: must be a non-empty string.",
        )
        require(
            is_number(self.hang_timeout) and self.hang_timeout >= 0,
            f"train.hang_timeout={self.hang_timeout!r}: must be a number of seconds >= 0 (0 turns the watchdog off).",
        )


SECTIONS: dict[str, type] = {
    "model": ModelSection,
    "data": DataSection,
    "optim": OptimSection,
    "plan": PlanSection,
    "train": TrainSection,
}

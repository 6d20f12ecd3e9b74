"""Metrics of a training run: log lines, ``metrics.jsonl``, TensorBoard and a loss-curve PNG.

Only rank 0 writes (a :class:`MetricsLogger` built with ``enabled=False`` does nothing),
so nothing here communicates. Everything lands under the run's ``out_dir``::

    metrics.jsonl      one JSON object per logged step (always; appended across resumes)
    tensorboard/       scalars under train/* (if torch.utils.tensorboard can be imported)
    loss.png           the loss curve with the unigram-entropy bar (if matplotlib can be imported)
    wandb/, wandb-run-id   with ``train.wandb_project``: the same scalars under train/* in a Weights &
                       Biases run (its id kept, so a resumed run continues it); wandb's mode decides
                       whether anything leaves the machine (``train.wandb_mode=offline``: nothing)

Also the helpers that turn a step's timing into throughput, TFLOP/s, MFU and memory.
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
import uuid
import warnings

import torch

__all__ = [
    "MetricsLogger",
    "WandbLog",
    "check_wandb",
    "peak_flops",
    "memory_mib",
    "format_step",
    "format_count",
    "format_duration",
    "log",
]

# Dense bf16 peak per card (no sparsity), for MFU in the PaLM convention.
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}


def log(message: str) -> None:
    """One line to stdout, flushed (so it interleaves sanely with the other ranks' output)."""
    print(message, flush=True)


def peak_flops(device: torch.device) -> float | None:
    """The card's dense bf16 peak in FLOP/s: ``BEHEMOTH_PEAK_FLOPS`` if set, else a table
    (H100/H200 989e12, A100 312e12) by CUDA device name; None when unknown or on CPU."""
    env = os.environ.get("BEHEMOTH_PEAK_FLOPS")
    if env:
        try:
            return float(env)
        except ValueError:
            raise ValueError(
                f"BEHEMOTH_PEAK_FLOPS={env!r} is not a number; set it to the card's peak FLOP/s, e.g. 989e12."
            ) from None
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, value in PEAK_BF16_FLOPS.items():
        if key in name:
            return value
    return None


def memory_mib(device: torch.device) -> float:
    """Peak memory of this process in MiB: ``torch.cuda.max_memory_allocated`` on a GPU,
    the peak resident set size (``getrusage``) on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10  # bytes on macOS, KiB on Linux


def format_count(n: int) -> str:
    """A parameter (or token) count people read at a glance: 840 -> "840", 837_888 -> "0.84M",
    124_439_808 -> "124.4M", 1_315_575_808 -> "1.32B"."""
    if n < 10_000:
        return f"{n:,}"
    if n < 1e8:
        return f"{n / 1e6:.2f}M"
    if n < 1e9:
        return f"{n / 1e6:.1f}M"
    return f"{n / 1e9:.2f}B"


def format_duration(seconds: float) -> str:
    """``h:mm:ss`` (or ``m:ss`` under an hour)."""
    s = max(0, int(round(seconds)))
    h, rest = divmod(s, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def format_step(m: dict, total_steps: int) -> str:
    """The per-step log line."""
    parts = [
        f"step {m['step']:>{len(str(total_steps))}}/{total_steps}",
        f"loss {m['loss']:.4f}" + (f" (val {m['val_loss']:.4f})" if m.get("val_loss") is not None else ""),
        f"grad {m['grad_norm']:.3f}",
        f"lr {m['lr']:.2e}",
        f"{m['tokens_per_s']:,.0f} tok/s",
    ]
    if "tflops_per_device" in m:
        parts.append(f"{m['tflops_per_device']:.1f} TFLOP/s/dev")
    if "mfu" in m:
        parts.append(f"MFU {100 * m['mfu']:.1f}%")
    mem = f"mem {m['memory_mib']:,.0f} MiB"
    if "model_data_mib" in m:
        mem += f" (model data {m['model_data_mib']:,.0f}"
        if "other_data_mib" in m:
            mem += f", other {m['other_data_mib']:,.0f}"
        if m.get("host_model_data_mib"):
            mem += f", on host {m['host_model_data_mib']:,.0f}"
        mem += ")"
    parts.append(mem)
    if "elapsed_s" in m:
        parts.append(f"{format_duration(m['elapsed_s'])} elapsed, eta {format_duration(m.get('eta_s', 0.0))}")
    return " | ".join(parts)


class MetricsLogger:
    """Writes a run's scalars on rank 0; a no-op elsewhere.

    ``start_step`` > 0 (a resumed run) drops TensorBoard events past it, so the curve
    of a resumed run has no stale tail; metrics.jsonl is appended and de-duplicated
    by step (latest wins) when the PNG is drawn.
    """

    def __init__(self, out_dir: str, *, enabled: bool = True, start_step: int = 0, wandb: dict | None = None) -> None:
        self.enabled = enabled
        self.out_dir = out_dir
        self.jsonl_path = os.path.join(out_dir, "metrics.jsonl")
        self.png_path = os.path.join(out_dir, "loss.png")
        self.tb_dir = os.path.join(out_dir, "tensorboard")
        self._jsonl = None
        self._tb = None
        self._wandb = None
        if not enabled:
            return
        os.makedirs(out_dir, exist_ok=True)
        self._jsonl = open(self.jsonl_path, "a")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            log(f"warning: TensorBoard logging is off ({e}); install it with pip install 'behemoth[logging]'.")
        else:
            self._tb = SummaryWriter(self.tb_dir, purge_step=start_step if start_step > 0 else None)
        if wandb is not None:
            self._wandb = WandbLog(out_dir, **wandb)

    def log_step(self, metrics: dict) -> None:
        """Record one step's scalars (``metrics['step']`` is the x axis)."""
        if not self.enabled:
            return
        self._jsonl.write(json.dumps(metrics) + "\n")
        self._jsonl.flush()
        scalars = {f"train/{k}": v for k, v in metrics.items() if k != "step" and _is_scalar(v)}
        if self._tb is not None:
            for key, value in scalars.items():
                self._tb.add_scalar(key, value, metrics["step"])
        if self._wandb is not None:
            self._wandb.log(scalars, metrics["step"])

    def log_text(self, tag: str, text: str) -> None:
        """A text entry in TensorBoard (the resolved config, for instance)."""
        if self.enabled and self._tb is not None:
            self._tb.add_text(tag, "```\n" + text + "\n```", 0)

    def history(self) -> list[dict]:
        """Every logged step in metrics.jsonl, one per step (the latest record wins), in order."""
        by_step = {}
        if os.path.isfile(self.jsonl_path):
            with open(self.jsonl_path) as f:
                for line in f:
                    if line.strip():
                        rec = json.loads(line)
                        by_step[rec["step"]] = rec
        return [by_step[s] for s in sorted(by_step)]

    def close(self, *, unigram_entropy: float | None = None, title: str = "") -> str | None:
        """Flush everything and draw the loss curve; returns the PNG path (None if not drawn)."""
        if not self.enabled:
            return None
        self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.close()
        return plot_loss(self.history(), self.png_path, unigram_entropy=unigram_entropy, title=title)


def _is_scalar(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


WANDB_ID_FILE = "wandb-run-id"


def check_wandb(train) -> None:
    """With ``train.wandb_project`` set, the wandb package must be importable: checked on every rank
    before anything starts (only rank 0 logs)."""
    if train.wandb_project is None:
        return
    try:
        import wandb  # noqa: F401
    except ImportError as e:
        from behemoth.train.config_sections import ConfigError

        raise ConfigError(
            f"train.wandb_project={train.wandb_project!r} logs to Weights & Biases, but wandb cannot be imported "
            f"({e}): pip install wandb (or pip install 'behemoth[wandb]'), or leave train.wandb_project unset."
        ) from None


def wandb_settings(train, config: dict) -> dict | None:
    """The :class:`WandbLog` arguments ``train`` asks for (None: no wandb)."""
    if train.wandb_project is None:
        return None
    return {
        "project": train.wandb_project,
        "entity": train.wandb_entity,
        "name": train.wandb_run_name,
        "mode": train.wandb_mode,
        "config": config,
    }


class WandbLog:
    """One Weights & Biases run of a training run: ``wandb.init`` in ``out_dir`` (its files under
    ``out_dir/wandb``) with an id kept in ``out_dir/wandb-run-id``, so a resumed run (or a group
    restarted by torchrun) continues the same wandb run. ``mode`` None leaves the choice to wandb
    (``WANDB_MODE``); behemoth itself sends nothing anywhere."""

    def __init__(self, out_dir: str, *, project: str, entity=None, name=None, mode=None, config=None) -> None:
        import wandb

        id_path = os.path.join(out_dir, WANDB_ID_FILE)
        if os.path.isfile(id_path):
            with open(id_path) as f:
                run_id = f.read().strip()
        else:
            run_id = uuid.uuid4().hex[:12]
            with open(id_path, "w") as f:
                f.write(run_id + "\n")
        kwargs = {"project": project, "entity": entity, "name": name, "mode": mode, "config": config}
        self.run = wandb.init(
            id=run_id, resume="allow", dir=out_dir, **{k: v for k, v in kwargs.items() if v is not None}
        )

    def log(self, scalars: dict, step: int) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


def plot_loss(history: list[dict], path: str, *, unigram_entropy: float | None, title: str = "") -> str | None:
    """Loss against step, with the unigram entropy drawn as the bar a model must beat."""
    if not history:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        log(f"warning: no loss plot ({e}); install matplotlib with pip install 'behemoth[logging]'.")
        return None
    steps = [h["step"] for h in history]
    losses = [h["loss"] for h in history]
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    ax.plot(steps, losses, lw=1.4, label="training loss (global batch mean)")
    val = [(h["step"], h["val_loss"]) for h in history if h.get("val_loss") is not None]
    if val:
        ax.plot(*zip(*val), "o-", lw=1.4, ms=3, label="validation loss (held-out split)")
    if unigram_entropy is not None:
        ax.axhline(
            unigram_entropy,
            color="tab:red",
            ls="--",
            lw=1.2,
            label=f"unigram entropy of the data = {unigram_entropy:.3f} nats",
        )
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats / token)")
    ax.set_title(title or "behemoth training loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    tmp = path + ".tmp.png"
    fig.savefig(tmp)
    plt.close(fig)
    os.replace(tmp, path)
    return path

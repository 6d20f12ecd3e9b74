"""The training loop: ``train(config)`` -> ``train_step()`` -> ``engine.step()``.

``train`` builds everything from a :class:`~behemoth.train.config.Config` (tokenizer,
model, optimizer, engine, data, sampler), resumes from the newest complete checkpoint
under ``out_dir/checkpoints`` (or starts a new run there, see ``behemoth.train.run_dir``),
runs ``train_step`` until ``train.steps`` and saves at ``save_every``, at the end, and when
SIGTERM asks it to stop (``behemoth.train.lifecycle``). It runs the same on every rank
(launched by torchrun or ``behemoth run``); only rank 0 prints and writes metrics.

Distributed contract: every rank builds the same model (the engine broadcasts rank 0's
weights anyway); each dp rank's :class:`BatchSampler` yields its rows of the same global
batch; the loss each step returns is the global batch mean, identical on every rank, so
every rank takes the same branch (log, save, stop) without extra communication. Data
files that must be tokenized are tokenized by rank 0 first (it writes the cache), then
read by the others.

Tested end to end by ``tests/e2e/test_cli.py`` (2 processes, gloo, resume).
"""

from __future__ import annotations

import math
import os
import signal
import time

import torch

import behemoth as bh
from behemoth import comm
from behemoth.checkpoint import latest_checkpoint
from behemoth.launcher import write_status
from behemoth.models import build_model
from behemoth.train.config import Config, format_config
from behemoth.train.config_sections import DataSection, OptimSection
from behemoth.train.data import BatchSampler
from behemoth.train.dataset import TokenDataset, check_vocab, default_corpus_text, unigram_entropy
from behemoth.train.evaluate import Validation, split_held_out
from behemoth.train.lifecycle import StopRequest, Watchdog
from behemoth.train.metrics import (
    MetricsLogger,
    check_wandb,
    format_count,
    format_step,
    log,
    memory_mib,
    peak_flops,
    wandb_settings,
)
from behemoth.train.run_dir import (
    build_for_checkpoint,
    check_out_dir,
    check_resume,
    clear_run,
    load_weights,
    prune_checkpoints,
    restarted,
    rewind,
    skipped_checkpoints,
    truncate_metrics,
)
from behemoth.train.sample import sample_text
from behemoth.train.tokenizer import Tokenizer, get_tokenizer

__all__ = ["train", "train_step", "lr_at", "build_optimizer", "build_dataset"]

ENTROPY_SAMPLE_TOKENS = 10_000_000  # unigram entropy is measured on at most this many tokens


# ------------------------------------------------------------------ pure pieces
def lr_at(step: int, optim: OptimSection, total_steps: int) -> float:
    """Learning rate of 0-based step ``step``: linear warm-up to ``optim.lr`` over
    ``warmup_steps``, then constant or cosine decay reaching ``lr * min_lr_ratio`` at the last step."""
    warmup = optim.warmup_steps
    if step < warmup:
        return optim.lr * (step + 1) / warmup
    if optim.schedule == "constant":
        return optim.lr
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup - 1))
    low = optim.lr * optim.min_lr_ratio
    return low + 0.5 * (optim.lr - low) * (1.0 + math.cos(math.pi * progress))


def build_optimizer(model: torch.nn.Module, optim: OptimSection) -> torch.optim.Optimizer:
    """AdamW or SGD over ``model``; weight decay only on matrices (dim >= 2), as in GPT-2/nanoGPT."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [
        g
        for g in ({"params": decay, "weight_decay": optim.weight_decay}, {"params": no_decay, "weight_decay": 0.0})
        if g["params"]
    ]
    if optim.name == "adamw":
        return torch.optim.AdamW(groups, lr=optim.lr, betas=optim.betas)
    return torch.optim.SGD(groups, lr=optim.lr, momentum=optim.momentum)


def build_dataset(data: DataSection, tokenizer: Tokenizer) -> TokenDataset:
    """The token stream ``data`` names: the default corpus, a .bin file, or text files (cached)."""
    if data.source == "default":
        return TokenDataset.from_texts([default_corpus_text(data.default_corpus_bytes)], tokenizer)
    if data.paths[0].endswith(".bin"):
        return TokenDataset.from_bin(data.paths[0], data.bin_dtype, vocab_size=tokenizer.vocab_size)
    return TokenDataset.from_files(list(data.paths), tokenizer, cache_dir=data.cache_dir)


def _rank0_first(fn, world: comm.Axis):
    """``fn()`` on rank 0, then on the others (so rank 0 fills caches alone). A failure on rank 0
    is reported to every rank instead of leaving them waiting at a barrier."""
    result, error = None, None
    if world.rank == 0:
        try:
            result = fn()
        except Exception as e:  # re-raised below, after the others have been told
            error = e
    ok = comm.all_agree(error is None, world)
    if error is not None:
        raise error
    if not ok:
        raise RuntimeError("rank 0 failed to prepare the training data; its error is printed above.")
    return fn() if world.rank != 0 else result


# ------------------------------------------------------------------ the step
def train_step(engine: bh.Engine, sampler: BatchSampler, lr: float) -> dict:
    """One optimizer step at learning rate ``lr`` on the sampler's next batch.

    Returns ``loss`` (global batch mean), ``grad_norm`` (before clipping), ``tokens``
    (labelled tokens of the global batch) and ``seconds`` (this rank's wall time)."""
    for group in engine.optimizer.param_groups:
        group["lr"] = lr
    t0 = time.perf_counter()
    batch = sampler.next_batch()
    loss = engine.step(batch)  # returns a Python float: the device has finished the step
    seconds = time.perf_counter() - t0
    return {
        "loss": loss,
        "grad_norm": engine.last_grad_norm,
        "tokens": engine.last_tokens,
        "seconds": seconds,
        "memory": engine.memory_report(),
    }


def _step_metrics(
    step: int, lr: float, out: dict, *, flops_per_token: int, world_size: int, peak: float | None, device: torch.device
) -> dict:
    tokens_per_s = out["tokens"] / max(out["seconds"], 1e-9)
    m = {
        "step": step,
        "loss": out["loss"],
        "grad_norm": out["grad_norm"],
        "lr": lr,
        "tokens_per_s": tokens_per_s,
        "step_seconds": out["seconds"],
    }
    if device.type == "cuda" or peak is not None:
        flops = flops_per_token * tokens_per_s / world_size
        m["tflops_per_device"] = flops / 1e12
        if peak:
            m["mfu"] = flops / peak
    m["memory_mib"] = memory_mib(device)
    if "memory" in out:  # the memory tracer: model data on the device (and offloaded to the host) vs other
        rep = out["memory"]
        dev = rep.get(device.type, {})
        m["model_data_mib"] = sum(v for k, v in dev.items() if k != "other") / 2**20
        if "other" in dev:
            m["other_data_mib"] = dev["other"] / 2**20
        if device.type == "cuda":
            m["host_model_data_mib"] = sum(rep.get("cpu", {}).values()) / 2**20
    return m


# ------------------------------------------------------------------ the run
def train(config: Config) -> dict:
    """Train the job ``config`` describes, on every rank of the (torchrun) world.

    Returns the run's summary on every rank: ``first_loss``, ``final_loss``,
    ``unigram_entropy`` (rank 0 only; None elsewhere), ``start_step``, ``steps``,
    ``last_step`` (the step it stopped at: ``steps``, or earlier when SIGTERM stopped it),
    ``stopped_by`` (None, or the signal's name), ``tokens_per_s``, ``wall_seconds``,
    ``checkpoint`` and ``num_params``.
    """
    t_start = time.perf_counter()
    config = restarted(config)
    stop = StopRequest().install()
    try:
        return _train(config, stop, t_start)
    finally:
        stop.restore()


def _train(config: Config, stop: StopRequest, t_start: float) -> dict:
    check_out_dir(config.train)  # every rank, before any collective
    check_wandb(config.train)
    bh.init()
    world_size = torch.distributed.get_world_size()
    config = config.resolved(world_size=world_size)
    mc, tc = config.model, config.train
    ckpt_dir = os.path.join(tc.out_dir, "checkpoints")
    resumed_from = None
    if tc.resume_from is not None:
        resumed_from = os.path.abspath(tc.resume_from)
    elif tc.resume and not tc.overwrite:
        resumed_from = latest_checkpoint(ckpt_dir)
    changes = check_resume(resumed_from, config) if resumed_from else []  # every rank, before any collective
    watchdog = Watchdog.for_torchelastic(
        rank=torch.distributed.get_rank(), world_size=world_size, timeout=tc.hang_timeout
    )
    if watchdog is not None:
        watchdog.start()
        stop.watchdog = watchdog  # a SIGTERM because a peer died exits at once (lifecycle.StopRequest)

    tokenizer = get_tokenizer(config.data.tokenizer)
    # Every weight comes from the checkpoint to load, when there is one: no random init (run_dir).
    weights_from = resumed_from or tc.init_from
    if weights_from is not None:
        model, _ = build_for_checkpoint(lambda device: _build_model(mc, device), weights_from)
    else:
        model = _build_model(mc)
    if tc.init_from is not None and not resumed_from:
        load_weights(model, tc.init_from)  # before boost shards it: any plan reads the serial tensors
    # Serial counts, taken before boost shards the model in place (tensor parallelism).
    num_params, flops_per_token = model.num_params(), model.flops_per_token(mc.seq_len)
    engine = bh.boost(
        model, build_optimizer(model, config.optim), config.plan, max_grad_norm=config.optim.max_grad_norm
    )
    rank0 = engine.mesh.rank == 0
    torch.manual_seed(tc.seed + engine.dp_rank)  # dropout masks differ per dp rank

    world = engine.mesh.axis("world")
    if tc.overwrite:  # rank 0 deletes the old run; nobody looks for checkpoints before it is done
        cleared = clear_run(tc.out_dir) if rank0 else []
        comm.all_agree(True, world)
        if cleared:
            log(f"train.overwrite: deleted the previous run's {', '.join(os.path.basename(p) for p in cleared)}")
    if config.data.source == "default" or config.data.paths[0].endswith(".bin"):
        dataset = build_dataset(config.data, tokenizer)
    else:
        dataset = _rank0_first(lambda: build_dataset(config.data, tokenizer), world)
    check_vocab(dataset, mc.vocab_size)
    validation = None
    if config.data.eval_fraction > 0:
        dataset, held_out = split_held_out(dataset, config.data.eval_fraction, mc.seq_len)
        if tc.eval_every:
            validation = Validation(
                held_out,
                seq_len=mc.seq_len,
                batch_size=tc.global_batch_size,
                num_batches=tc.eval_batches,
                build_model=lambda: _build_model(mc),
                rank=engine.mesh.rank,
            )
    sampler = BatchSampler(
        dataset,
        seq_len=mc.seq_len,
        global_batch_size=tc.global_batch_size,
        dp_rank=engine.dp_rank,
        dp_size=engine.dp_size,
        seed=tc.seed,
    )
    entropy = unigram_entropy(dataset.tokens[:ENTROPY_SAMPLE_TOKENS]) if rank0 else None

    if resumed_from:
        extra = engine.load(resumed_from)
        sampler.load_state_dict(extra["sampler"])
    start = engine.step_count
    if rank0:
        log(
            f"model {mc.name}: {format_count(num_params)} parameters, {mc.num_layers} layers x {mc.hidden} "
            f"hidden, seq_len {mc.seq_len} | {engine.plan.describe()} on {world_size} process(es), "
            f"{engine.device.type} | data: {len(dataset):,} {tokenizer.name} tokens, "
            f"{sampler.steps_per_epoch} steps/epoch"
        )
        log(
            f"unigram entropy of the training tokens: {entropy:.4f} nats (the loss must fall below this "
            f"to show the model learned more than token frequencies)"
        )
        if config.optim.warmup_steps >= tc.steps:
            log(
                f"warning: optim.warmup_steps={config.optim.warmup_steps} >= train.steps={tc.steps}: the "
                f"learning rate never reaches optim.lr={config.optim.lr:g} (it ends at "
                f"{lr_at(tc.steps - 1, config.optim, tc.steps):.2e}); lower the warm-up or train longer."
            )
        skipped = skipped_checkpoints(ckpt_dir, resumed_from)
        if skipped:
            log(
                f"warning: {', '.join(skipped)} in {ckpt_dir} has no meta.json (an interrupted save, or a "
                "damaged checkpoint) and is not used"
            )
        if resumed_from:
            log(f"resumed from {resumed_from} at step {start}")
        elif tc.init_from is not None:
            log(f"initialised the model from {tc.init_from} (weights only: new optimizer, step 0)")
        if changes:
            log(f"changed since the checkpoint (applied from now on): {'; '.join(changes)}")
        rewound = rewind(ckpt_dir, start) if resumed_from and tc.resume_from is not None else []
        if rewound:
            log(
                f"train.resume_from rewinds the run to step {start}: deleted "
                f"{', '.join(map(os.path.basename, rewound))}"
            )
        # The log holds this run's lineage only: steps past the checkpoint are about to be redone.
        dropped = truncate_metrics(os.path.join(tc.out_dir, "metrics.jsonl"), start)
        if dropped:
            log(f"metrics.jsonl: dropped {dropped} record(s) past step {start} (they are trained again)")

    logger = MetricsLogger(
        tc.out_dir, enabled=rank0, start_step=start, wandb=wandb_settings(tc, config.to_dict()) if rank0 else None
    )
    logger.log_text("config", format_config(config))
    peak = peak_flops(engine.device)
    engine.reset_comm_stats()

    losses, seconds, tokens = [], 0.0, 0
    last_saved = start if resumed_from else None
    last_step, last_val, loop_start = start, None, time.perf_counter()
    for step in range(start + 1, tc.steps + 1):
        lr = lr_at(step - 1, config.optim, tc.steps)
        out = train_step(engine, sampler, lr)
        if not math.isfinite(out["loss"]):
            raise FloatingPointError(
                f"the loss is {out['loss']} at step {step} (lr {lr:.2e}): training "
                f"diverged; lower optim.lr, raise optim.warmup_steps or set "
                f"optim.max_grad_norm."
            )
        losses.append(out["loss"])
        last_step = step
        if step > start + 1:  # the first step pays one-off costs (allocator, thread pools)
            seconds, tokens = seconds + out["seconds"], tokens + out["tokens"]
        metrics = _step_metrics(
            step, lr, out, flops_per_token=flops_per_token, world_size=world_size, peak=peak, device=engine.device
        )
        expert_tokens = engine.expert_token_counts()  # MoE: tokens per expert per block (last micro-batch)
        if expert_tokens:
            metrics["expert_tokens"] = expert_tokens
        if validation is not None and (step % tc.eval_every == 0 or step == tc.steps):
            metrics["val_loss"] = last_val = validation.loss(engine)  # rank 0's number; None elsewhere
        metrics["elapsed_s"] = time.perf_counter() - loop_start
        done = step - start
        metrics["eta_s"] = metrics["elapsed_s"] / done * (tc.steps - step)
        logger.log_step(metrics)
        if rank0 and (step % tc.log_every == 0 or step == start + 1 or step == tc.steps or "val_loss" in metrics):
            log(format_step(metrics, tc.steps))
        if tc.sample_every and (step % tc.sample_every == 0 or step == tc.steps):
            text = sample_text(engine, tokenizer, tc.sample_prompt, tc.sample_tokens)  # every rank
            if rank0:
                log(f"sample at step {step}: {text!r}")
        if step == start + 1 and tc.async_checkpoint and tc.save_every:
            if -(-step // tc.save_every) * tc.save_every < tc.steps:  # a background save is to come
                engine.reserve_save_buffers()  # its host memory, allocated in the background from here
        stopping = stop.agreed(world)
        if (tc.save_every and step % tc.save_every == 0) or step == tc.steps or stopping:
            # the last save, and the one a SIGTERM asks for, are complete before the loop ends
            _save(engine, sampler, config, ckpt_dir, step, rank0, blocking=stopping or step == tc.steps)
            last_saved = step
        if stopping:
            break
    engine.wait_for_save()

    if watchdog is not None:
        watchdog.stop()
    stopped_by = None
    if stop.signum is not None:
        stopped_by = signal.Signals(stop.signum).name
        write_status("stopped", step=last_step)
    final_ckpt = os.path.join(ckpt_dir, f"step-{last_saved}") if last_saved is not None else None
    png = logger.close(unigram_entropy=entropy, title=f"behemoth {mc.name} on {world_size} process(es)")
    summary = {
        "first_loss": losses[0] if losses else None,
        "final_loss": losses[-1] if losses else None,
        "final_loss_mean10": sum(losses[-10:]) / len(losses[-10:]) if losses else None,
        "val_loss": last_val,
        "unigram_entropy": entropy,
        "start_step": start,
        "steps": tc.steps,
        "last_step": last_step,
        "stopped_by": stopped_by,
        "tokens_per_s": tokens / seconds if seconds else None,
        "wall_seconds": time.perf_counter() - t_start,
        "checkpoint": final_ckpt,
        "loss_png": png,
        "num_params": num_params,
        "world_size": world_size,
        "dp_bytes_per_step": engine.comm_stats().get("dp", {}).get("bytes", 0) / max(1, len(losses)),
    }
    if rank0:
        _report(summary, tc.out_dir)
    return summary


def _build_model(mc, device: torch.device | None = None) -> torch.nn.Module:
    return build_model(
        mc.name,
        vocab_size=mc.vocab_size,
        seq_len=mc.seq_len,
        seed=mc.seed,
        dropout=mc.dropout,
        device=device,
        **mc.shape_overrides(),
    )


def _save(engine, sampler, config: Config, ckpt_dir: str, step: int, rank0: bool, *, blocking: bool) -> None:
    """Checkpoint ``step-N``: in the background when ``train.async_checkpoint`` is on, unless
    ``blocking``. Older checkpoints are pruned (keep-last) only once the new one is committed."""
    path = os.path.join(ckpt_dir, f"step-{step}")
    tc = config.train
    background = tc.async_checkpoint and not blocking
    engine.wait_for_save()  # the previous save first: its time is not this one's
    t0 = time.perf_counter()

    def committed(path: str) -> None:  # rank 0, once the checkpoint is complete
        pruned = prune_checkpoints(ckpt_dir, tc.keep_last, newest=step)
        note = f" (removed {len(pruned)} older)" if pruned else ""
        how = f", in the background (training held up {engine.last_save_stall:.2f} s)" if background else ""
        log(f"saved checkpoint {path} in {time.perf_counter() - t0:.1f} s{how}{note}")

    engine.save(
        path,
        extra={"sampler": sampler.state_dict(), "config": config.to_dict()},
        blocking=not background,
        on_commit=committed if rank0 else None,
        threads=tc.save_threads or None,
    )


def _report(summary: dict, out_dir: str) -> None:
    import json

    if summary["final_loss"] is None:  # nothing trained: the previous summary stays
        log(
            f"nothing to do: the checkpoint is at step {summary['start_step']} >= train.steps="
            f"{summary['steps']}; raise --train.steps to train further."
        )
        return
    with open(os.path.join(out_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    tps = f"{summary['tokens_per_s']:,.0f} tok/s" if summary["tokens_per_s"] else "n/a tok/s"
    verdict = "below" if summary["final_loss_mean10"] < summary["unigram_entropy"] else "NOT below"
    if summary["stopped_by"]:
        log(
            f"stopped by {summary['stopped_by']} after step {summary['last_step']} of {summary['steps']}: "
            f"checkpoint {summary['checkpoint']} saved; run the same command again to resume."
        )
    log(
        f"done: steps {summary['start_step'] + 1}-{summary['last_step']} | loss {summary['first_loss']:.4f} "
        f"-> {summary['final_loss']:.4f} (mean of last 10: {summary['final_loss_mean10']:.4f}, {verdict} "
        f"the unigram entropy {summary['unigram_entropy']:.4f})"
        + (f" | validation loss {summary['val_loss']:.4f}" if summary["val_loss"] is not None else "")
        + f" | {tps} | {summary['wall_seconds']:.1f} s"
    )
    log(
        f"outputs: {summary['checkpoint']} | {os.path.join(out_dir, 'metrics.jsonl')} | "
        f"{summary['loss_png'] or 'no loss.png'} | {os.path.join(out_dir, 'tensorboard')}"
    )

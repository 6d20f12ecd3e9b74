"""``bh.boost`` and the Engine: one training step over whatever the Plan asks for.

Contract: ``engine.step(batch)`` takes this data-parallel rank's share of the global batch,
runs forward, backward and the optimizer step, and returns the mean loss over every token of
the *global* batch, the same float on every rank.

An engine is three parts, built by :func:`boost` and held side by side (no subclass, no hook):

* the model, rewritten by :func:`behemoth.parallelize.parallelize` (its record, read with
  ``parallelization(model)``, says how the batch is split: row blocks for 2D/2.5D/3D tensor
  parallelism, sequence shares for context parallelism, pipeline stages);
* a **step executor** that runs one step's micro-batches: :class:`~behemoth.executor.SequentialExecutor`,
  or :class:`~behemoth.parallel.pipeline.executor.PipelineExecutor` (a pipeline schedule) when ``pp > 1``;
* a **gradient sync** (:func:`behemoth.parallel.zero.sync.build_grad_sync`): the reductions over
  the data axis, the fp16 overflow vote, the global norm, clipping and the optimizer update, for
  plain data parallelism and every ZeRO stage alike.

How the loss is made exact under any split: every micro-batch's loss is the *sum* of its token
losses divided by the global token count (one tiny all-reduce at the start of the step), so
summing gradients over micro-batches and data-parallel ranks gives exactly the serial model's
mean-loss gradient. Mixture-of-experts layers add their router losses (this rank's share of the
global micro-batch's, :mod:`behemoth.parallel.expert`) to the objective with weight
1/microbatches and to the reported loss. Loss sums are partial over the data axis, over the axes that split the batch
inside the tp group, and over ``pp`` (the executor sums that one); the token count needs no more
than the dp all-reduce (every tp and cp rank holds its dp rank's whole batch).

Layers: ``step()`` -> ``grad_sync.run(_forward_backward)`` -> ``executor.run()``, then
``grad_sync.step()``. The optimizer the user passed is re-targeted in place over this rank's
parameters (tensor-parallel shards, the pipeline stage's), keeping its class, hyper-parameters
and identity.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from . import comm
from .async_checkpoint import AsyncSaver
from .batch import rows, split_microbatches, to_device
from .checkpoint import RNGState, load_checkpoint, save_checkpoint
from .engine_state import ModelState, OptimizerState
from .executor import SequentialExecutor, StepExecutor
from .generation import generate
from .loss import IGNORE_INDEX, MicroBatchLoss, check_shifted_labels
from .parallel.pipeline.executor import PipelineExecutor, module_runs
from .parallel.pipeline.schedules import make_schedule
from .parallel.pipeline.simulate import simulate
from .parallel.zero.sync import GradSync, build_grad_sync
from .parallelize import Parallelization, apply_plan, check_model, parallelization, resolve, serial_state_dict
from .plan import Plan
from .precision import LossScaler

__all__ = ["Engine", "boost"]


def _auto_plan(model: nn.Module, name: str) -> Plan:
    """``plan="auto"``: the planner's choice for this model on this job's world and device."""
    if name != "auto":
        raise ValueError(f"plan={name!r}: pass a bh.Plan, None, or 'auto' (the planner's choice).")
    from .distributed import init
    from .parallel.zero.measure import agreed_offload_host_budget
    from .planner.auto import auto_plan
    from .planner.calibration import shipped_calibration_for
    from .planner.search import Limits

    init()
    cuda = torch.cuda.is_available()
    gpu = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory if cuda else None
    cal = shipped_calibration_for(torch.cuda.get_device_name() if cuda else None)
    limits = Limits(precision="bf16" if cuda else "fp32")
    world = torch.distributed.get_world_size()
    host = agreed_offload_host_budget(world)
    return auto_plan(model, world, gpu_bytes=gpu, host_bytes=host, limits=limits, calibration=cal)


def boost(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    plan: Plan | str | None = None,
    *,
    loss_fn: Callable | None = None,
    max_grad_norm: float | None = None,
    tp_policy: dict[str, str] | None = None,
    stages: list[tuple[int, int]] | None = None,
) -> Engine:
    """``parallelize(model, plan)``, then the gradient sync and the step executor around it: the
    :class:`Engine` that trains ``model`` with ``optimizer`` (re-targeted in place over this rank's
    parameters; ``engine.optimizer``).

    ``loss_fn(outputs, batch) -> scalar`` replaces the default token-level cross-entropy;
    it must return the *mean* over its (micro-)batch, and micro-batches must be the same
    size on every rank for the global mean to be exact. Under tensor parallelism it gets
    the full logits (gathered over tp); the default loss never builds them. Under context
    parallelism it gets this rank's share of the sequence (outputs, and the batch split
    alike), and its mean is averaged over the cp shares.

    ``tp_policy`` (``{module-name pattern: role or style}``, see :mod:`behemoth.specs` and
    :mod:`behemoth.parallel.tensor`) says how to shard a model class that no spec describes.

    ``stages`` (pipeline parallelism only) overrides the stage balance: ``pp * virtual_stages``
    half-open ranges ``(start, end)`` of transformer blocks, in stage order.

    ``plan="auto"``: the planner's fastest plan that fits (``behemoth.planner.auto_plan``), for
    8 sequences per GPU per step of the model's length; the same on every rank.
    """
    if isinstance(plan, str):
        plan = _auto_plan(model, plan)
    plan, mesh = resolve(plan, None)  # ValueError on every rank, before any collective but the mesh's
    if max_grad_norm is not None and not max_grad_norm > 0:
        raise ValueError(f"max_grad_norm={max_grad_norm!r}: must be > 0, or None to disable clipping.")
    stage_layout = check_model(model, plan, stages)  # experts, pipeline stages
    _check_optimizer(model, optimizer, plan)
    schedule = _pipeline_schedule(plan)
    # ZeRO-3 without tp/cp/pp moves parameters to the device chunk by chunk (a model built on the
    # host may be larger than the device); the gradient sync broadcasts the trainable parameters
    # over the data axis chunk by chunk (plain data parallelism: the frozen ones are broadcast here).
    chunked = plan.zero == 3 and plan.tp == 1 and plan.cp == 1 and plan.pp == 1
    model = apply_plan(
        model,
        plan,
        mesh,
        tp_policy=tp_policy,
        stage_layout=stage_layout,
        params_on_host=chunked,
        sync_params="frozen" if not plan.zero else "none",
    )
    par = parallelization(model)
    _retarget_optimizer(optimizer, model, par.replaced)
    grad_sync = build_grad_sync(
        model,
        optimizer,
        plan,
        mesh,
        device=par.device,
        data_axis=par.data_axis,
        names=par.serial_param_names(model),
        module_runs=module_runs(par.pipeline) if par.pipeline is not None else None,
    )
    loss = MicroBatchLoss(loss_fn, par.vocab_head, user_gets_local=par.context is not None)
    parts = dict(batch_parts=par.batch_parts, batch_index=par.batch_index, device=par.device)
    if schedule is not None:
        executor = PipelineExecutor(
            model, par.pipeline, par.channels, schedule, plan, loss, context=par.context, experts=par.experts, **parts
        )
    else:
        executor = SequentialExecutor(model, plan, loss, context=par.context, experts=par.experts, **parts)
    executor.configure(grad_sync)
    return Engine(model, grad_sync, executor, loss_fn=loss_fn, max_grad_norm=max_grad_norm)


def _check_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, plan: Plan) -> None:
    if plan.pp > 1 and optimizer.state:
        raise ValueError(
            "the optimizer already has state; under pipeline parallelism build the engine before "
            "the first optimizer step (each stage keeps the state of its own parameters only)."
        )
    model_params = {id(p) for p in model.parameters()}
    if any(id(p) not in model_params for g in optimizer.param_groups for p in g["params"]):
        raise ValueError(
            "the optimizer holds a parameter that is not in the model; build it over "
            "model.parameters() (or groups of them) before bh.boost."
        )
    if (plan.tp > 1 or plan.zero or plan.ep > 1) and optimizer.state:
        raise ValueError(
            "the optimizer already has state; under tensor or expert parallelism or ZeRO build the engine "
            "before the first optimizer step (its state would not match the parameter shards)."
        )


def _pipeline_schedule(plan: Plan):
    """This plan's pipeline schedule, checked deadlock-free by the simulator (None without pp)."""
    if plan.pp == 1:
        return None
    schedule = make_schedule(plan.schedule, plan.pp, plan.microbatches, plan.virtual_stages)
    simulate(schedule, plan.pp)  # raises on a dependency violation, deadlock or FIFO break
    return schedule


def _retarget_optimizer(optimizer: torch.optim.Optimizer, model: nn.Module, replaced: dict) -> None:
    """Point ``optimizer``'s groups, in place, at the parameters this rank holds: a tensor-parallel
    shard for its serial parameter, nothing for a parameter another pipeline stage holds."""
    held = {id(p) for p in model.parameters()}
    for g in optimizer.param_groups:
        g["params"] = [q for q in (replaced.get(id(p), p) for p in g["params"]) if id(q) in held]
    if optimizer.state:  # plain data parallelism after steps on the host: state where its parameter is
        optimizer.load_state_dict(optimizer.state_dict())


class Engine:
    """Trains one parallelized model with a step executor and a gradient sync. Build it with :func:`boost`."""

    def __init__(
        self, model: nn.Module, grad_sync: GradSync, executor: StepExecutor, *, loss_fn=None, max_grad_norm=None
    ) -> None:
        self.model = model
        self.parallel: Parallelization = parallelization(model)
        self.plan, self.mesh, self.device = self.parallel.plan, self.parallel.mesh, self.parallel.device
        self.data_axis = self.parallel.data_axis
        self.grad_sync, self.executor = grad_sync, executor
        self.loss_fn, self.max_grad_norm = loss_fn, max_grad_norm
        self.scaler = LossScaler() if self.plan.precision == "fp16" else None
        self.step_count = 0
        self._labels_checked = False
        self._grad_norm: torch.Tensor | float | None = float("nan")
        self.last_tokens = 0
        self._saver: AsyncSaver | None = None

    # ---------------------------------------------------------------- identity
    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The optimizer passed to :func:`boost`, the very object, re-targeted at this rank's
        parameters (under ZeRO at its chunk shards): a learning-rate scheduler attached to it
        steps the real learning rate."""
        return self.grad_sync.optimizer

    @property
    def dp_rank(self) -> int:
        return self.mesh.dp_rank

    @property
    def dp_size(self) -> int:
        return self.mesh.dp_size

    @property
    def stage_ranges(self) -> list[list[tuple[int, int]]] | None:
        """Block ranges ``[rank][chunk] = (start, end)`` of the pipeline (None without one)."""
        split = self.parallel.pipeline
        return None if split is None else [list(row) for row in split.partition]

    def comm_stats(self) -> dict[str, dict]:
        """Collective traffic per mesh axis since the engine was built (or ``reset_comm_stats``)."""
        return self.mesh.ledger.stats()

    def reset_comm_stats(self) -> None:
        self.mesh.ledger.reset()

    # ---------------------------------------------------------------- step
    def step(self, batch) -> float:
        """One optimizer step on this rank's share of the global batch; returns the global mean loss."""
        loss = self.grad_sync.run(lambda: self._forward_backward(batch), self.max_grad_norm, self.scaler)
        if self._saver is not None:  # a background save's copy of the state ends before the update writes it
            self._saver.fence()
        self._grad_norm = self.grad_sync.step(self.max_grad_norm, self.scaler)
        if self.parallel.experts:
            self.parallel.experts.update_bias()  # auxiliary-loss-free balancing: once per step
        self.step_count += 1
        return loss

    def expert_token_counts(self) -> dict[str, list[float]]:
        """``{MoE block name: tokens routed to each expert}`` in the last micro-batch, over the
        global batch (the same on every rank; empty for a dense model): for the step log. Under
        pipeline parallelism a collective over ``pp`` (every rank calls it), which brings every
        stage's blocks to every rank."""
        experts = self.parallel.experts
        if experts is None or not experts.names:
            return {}
        pp = self.mesh.axis("pp")
        return experts.token_counts(pp if self.parallel.pipeline is not None else None, self.device)

    def _forward_backward(self, batch) -> float:
        """Forward and backward of this rank's batch, gradients left reduced in the gradient sync
        (no optimizer step: :meth:`step` is the public way). Returns the global mean loss."""
        self._check_batch(batch)
        batch = to_device(batch, self.device)
        micro = split_microbatches(batch, self.plan.microbatches)
        n_global, scale = self._loss_normaliser(batch, len(micro))
        loss_scale = self.scaler.scale if self.scaler else 1.0
        total = self.executor.run(micro, scale, loss_scale, self.grad_sync)  # [loss sum, router losses]
        comm.all_reduce(total, self.data_axis)
        if self.loss_fn is None:  # sums over this rank's row block: add the other blocks
            for ax in self.parallel.batch_axes:
                comm.all_reduce(total, ax)
        loss_val, aux_val, n = torch.cat(
            [
                total[:1] * scale,
                total[1:].sum().reshape(1) / len(micro),
                n_global if n_global is not None else total.new_zeros(1),
            ]
        ).tolist()
        loss_val += aux_val  # the MoE layers' router losses, averaged over micro-batches
        if self.loss_fn is None and n == 0:
            raise ValueError("the global batch has no labelled token (every label is -100).")
        self.last_tokens = int(n)
        return loss_val

    def _check_batch(self, batch) -> None:
        if self.parallel.context is not None:  # sequence length vs cp: every rank, before any collective
            self.parallel.context.check_batch(batch)
        if self.loss_fn is None:
            if not isinstance(batch, dict) or "input_ids" not in batch or "labels" not in batch:
                raise ValueError(
                    "engine.step(batch) needs a dict with 'input_ids' and 'labels' ([B, S] each); "
                    "for other inputs pass loss_fn=... to bh.boost."
                )
            x, y = batch["input_ids"], batch["labels"]
            if x.dim() != 2 or x.shape != y.shape:
                raise ValueError(f"input_ids {tuple(x.shape)} and labels {tuple(y.shape)} must both be [B, S].")
            # The label check reads its verdict on the host: free for a batch still on the host, a
            # device sync for one already on an accelerator, which would stall every step's launch
            # queue; such batches are checked on the engine's first step only.
            if x.device.type == "cpu" or not self._labels_checked:
                check_shifted_labels(x, y)
                self._labels_checked = True
        n_rows, m, parts = rows(batch), self.plan.microbatches, self.parallel.batch_parts
        if n_rows is not None and not (self.loss_fn is not None and parts == 1):
            if n_rows % m:
                raise ValueError(
                    f"this rank's batch of {n_rows} rows is not divisible by Plan.microbatches={m}; "
                    f"use a per-rank batch that is a multiple of {m}."
                )
            if (n_rows // m) % parts:
                axes = " x ".join(f"{a.name}={a.size}" for a in self.parallel.batch_axes)
                raise ValueError(
                    f"tensor parallelism ({self.plan.tp_mode}): batch size = {n_rows} rows per data-parallel rank "
                    f"({m} micro-batch(es) of {n_rows // m}) is not divisible by {parts}: tp_mode="
                    f"{self.plan.tp_mode!r} splits every micro-batch into {parts} row blocks ({axes}). Use "
                    f"a per-rank batch that is a multiple of microbatches * {parts} = {m * parts}."
                )
        self.executor.check_batch(n_rows, m)

    def _loss_normaliser(self, batch, num_micro: int) -> tuple[torch.Tensor | None, torch.Tensor]:
        """``(global token count, factor)``: each micro-batch's loss sum times ``factor`` adds up to
        the global mean. The count stays on the device (no host sync before backward); every cp
        and tp rank holds its dp rank's whole batch, so it is summed over dp only. A user's
        ``loss_fn`` returns means: their mean over micro-batches and data ranks."""
        if self.loss_fn is None:
            n_global = (batch["labels"] != IGNORE_INDEX).sum().to(torch.float64).reshape(1)
            comm.all_reduce(n_global, self.mesh.axis("dp"))
            return n_global, 1.0 / n_global
        return None, torch.tensor(1.0 / (num_micro * self.data_axis.size), dtype=torch.float64, device=self.device)

    # ---------------------------------------------------------------- generation
    def generate(self, prompts, **kwargs):
        """:func:`behemoth.generation.generate` on this engine's model, its parameters readable in
        full for the duration (ZeRO-3 gathers them), in evaluation mode; every rank calls it with
        the same arguments. Training resumes where it was."""
        with self.grad_sync.gathered():
            return generate(self.model, prompts, **kwargs)

    # ---------------------------------------------------------------- state
    @property
    def last_grad_norm(self) -> float:
        """Global gradient norm of the last step, before clipping (inf for a skipped fp16 step)."""
        if self._grad_norm is None:  # not needed by the step: read now from the gradients still held
            self._grad_norm = self.grad_sync.grad_norm()
        return float(self._grad_norm)

    def memory_report(self) -> dict[str, dict[str, int]]:
        """The memory tracer: bytes of model data this rank holds now, per device type
        ({'cuda': ..., 'cpu': ...}; parameters, gradients, fp32 masters held apart from the
        parameters, optimizer state) and, on a GPU, ``other`` = allocated - model data
        (activations, workspaces). Call it between steps, or from a hook mid-step."""
        return self.grad_sync.memory_report()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The serial model's state dict (same keys, shapes and values), on CPU on every rank:
        tensor-parallel shards all-gathered, pipeline stages broadcast (a collective: every rank)."""
        with self.grad_sync.gathered():
            return serial_state_dict(self.model)

    def state_dict(self) -> dict:
        """The engine's own part of a checkpoint: the step counter, the loss scaler and the plan."""
        return {
            "step": self.step_count,
            "scaler": self.scaler.state_dict() if self.scaler else None,
            "plan": repr(self.plan),
        }

    def load_state_dict(self, state) -> None:
        self.step_count = int(state["step"])
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])

    def _checkpoint_parts(self) -> dict:
        names = self.parallel.serial_param_names(self.model)
        params = {names[id(p)]: p for p in self.grad_sync.params}
        return {"model": ModelState(self.model), "optim": OptimizerState(self.grad_sync, params), "engine": self}

    def save(
        self,
        path: str,
        extra: dict | None = None,
        *,
        blocking: bool = True,
        on_commit: Callable[[str], None] | None = None,
        threads: int | None = None,
    ) -> None:
        """Sharded checkpoint to directory ``path`` (atomic: a killed save leaves the old one intact),
        with the JSON ``extra`` that :meth:`load` returns. Collective: every rank.

        ``blocking=False`` returns once the state is copied to host memory and writes it in a
        background thread (:mod:`behemoth.async_checkpoint`): training may go on at once, the
        checkpoint holds the state of this call. At most one save is in flight (the next save, and
        :meth:`load`, wait for it); :meth:`wait_for_save` waits for it and raises its error.
        ``on_commit(path)`` runs on rank 0 once the checkpoint is complete (in the writer thread for
        a background save). ``threads``: writer threads (and files) per rank; None: one per GiB the
        rank writes, up to 8.

        Once background saves (or :meth:`reserve_save_buffers`) have host buffers, a blocking save
        goes through them too -- the copy, then the same write, waited for -- rather than copying
        each tensor to fresh host memory."""
        self.wait_for_save()
        if blocking and self._saver is None:
            with self.grad_sync.gathered():  # ZeRO-3: parameters gathered while they are written
                save_checkpoint(
                    path, self._checkpoint_parts(), extra=extra or {}, rank_state={"rng": RNGState()}, threads=threads
                )
            if on_commit is not None and self.mesh.rank == 0:
                on_commit(path)
            return
        if self._saver is None:
            self._saver = AsyncSaver()
        with self.grad_sync.gathered():
            self._saver.save(
                path,
                self._checkpoint_parts(),
                extra=extra or {},
                rank_state={"rng": RNGState()},
                on_commit=on_commit,
                threads=threads,
            )
            if blocking or not self._state_is_live:  # copied from temporaries (gathered chunks, fp32 copies, ...)
                self._saver.fence()
        if blocking:
            self._saver.wait()

    def reserve_save_buffers(self) -> None:
        """Allocate the host memory a background save copies the state into now, in a thread of its own,
        so that the first ``save(blocking=False)`` does not wait for it (page-locking a GPU's state
        takes seconds; training goes on meanwhile). Collective: every rank. Call it once the
        optimizer state exists (after the first step); the buffers stay for every later save."""
        if self._saver is None:
            self._saver = AsyncSaver()
        with self.grad_sync.gathered():
            self._saver.reserve(self._checkpoint_parts())

    @property
    def _state_is_live(self) -> bool:
        """Whether the tensors a checkpoint reads are the ones training keeps and only the optimizer
        update writes (so a background copy may run until the next update): not under ZeRO-3,
        ``param_dtype`` (fp32 copies) or offload (updates during the backward)."""
        return self.plan.zero < 3 and self.plan.param_dtype is None and self.plan.offload is None

    def wait_for_save(self) -> str | None:
        """Wait until the background save in flight (if any) is committed on every rank; returns its
        path, or None when there was none. Raises, naming the checkpoint, if it failed."""
        return self._saver.wait() if self._saver is not None else None

    @property
    def last_save_stall(self) -> float:
        """Seconds the last background save held up its caller (the copy of the state to host memory)."""
        return self._saver.last_stall_seconds if self._saver is not None else 0.0

    def save_hf(
        self,
        path: str,
        *,
        max_shard_size: int | str = "5GB",
        dtype=None,
        vocab_size: int | None = None,
        tokenizer: str | None = None,
    ) -> None:
        """The serial model as a transformers checkpoint in directory ``path`` (``config.json``,
        ``generation_config.json``, sharded ``.safetensors`` and their index; with ``tokenizer``
        "gpt2" its files): ``AutoModelForCausalLM.from_pretrained(path)`` gives this model's logits.
        ``vocab_size`` trims a padded vocabulary, ``dtype`` ("bf16", ...) casts. A collective:
        every rank calls it, rank 0 writes (see :mod:`behemoth.hf.export`)."""
        from .hf.export import save_engine_hf

        save_engine_hf(
            self, path, max_shard_size=max_shard_size, dtype=dtype, vocab_size=vocab_size, tokenizer=tokenizer
        )

    def load(self, path: str) -> dict:
        """Load a checkpoint written by :meth:`save` under any plan; returns its ``extra``."""
        self.wait_for_save()
        with self.grad_sync.gathered(writable=True):  # ZeRO: what is read becomes the shards and masters
            return load_checkpoint(path, self._checkpoint_parts(), rank_state={"rng": RNGState()})

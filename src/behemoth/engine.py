"""boost() and the Engine: one training step over whatever the Plan asks for.

Contract (DESIGN.md): ``engine.step(batch)`` takes this data-parallel rank's share of
the global batch, runs forward, backward and the optimizer step, and returns the mean
loss over every token of the *global* batch, the same float on every rank.

How the loss is made exact under any split: every micro-batch's loss is the *sum* of
its token losses divided by the global token count (one tiny all-reduce at the start of
the step), so summing gradients over micro-batches and data-parallel ranks gives exactly
the serial model's mean-loss gradient.

Tensor-parallel modes that split the batch inside the tp group (2D, 2.5D, 3D) name the
axes in ``Parallelized.batch_axes``: each micro-batch is then cut into ``prod(sizes)``
row blocks and this rank runs the model on block ``ravel(coords)``; the loss sums are added
over dp *and* those axes (the token count needs no extra collective: every tp rank holds
its dp rank's whole batch). 1D and pure data parallelism split nothing here.

Context parallelism (``Plan.cp``) cuts every micro-batch along the sequence instead
(``self.context_parallel``, from :mod:`behemoth.parallel.context.style`): each cp rank runs the
model on its share of the tokens with their global position ids, so loss sums and parameter
gradients are partial over ``cp`` as well and are summed over ``dp_cp`` (``data_axis``).

Mixture-of-experts models (``Plan.ep``, :mod:`behemoth.parallel.expert`): each MoE layer's
router losses (its ``aux_loss`` after the forward, this rank's share of the global
micro-batch's) are added to the objective with weight 1/microbatches and to the reported loss;
expert gradients are summed over ``ep_dp`` by the gradient sync.

Layers: ``step()`` -> ``forward_backward()`` -> ``_micro_step()``; gradients are reduced,
clipped and applied by the gradient sync (:mod:`behemoth.parallel.zero.sync`), which re-targets
the user's optimizer, in place, at this rank's parameters or shards.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from . import comm
from .distributed import device_for_rank, init
from .mesh import ParallelMesh
from .models.moe import auxiliary_loss
from .parallel.expert import check_experts, data_axis_of, gather_expert_state
from .parallel.tensor import full_state_dict
from .parallel.zero.sync import build_grad_sync
from .plan import Plan
from .precision import LossScaler, autocast_context
from .styles import (
    apply_activation_checkpointing,
    apply_compile,
    apply_context_parallel,
    apply_expert_parallel,
    apply_tensor_parallel,
    prepare_model,
)

IGNORE_INDEX = -100


def logits_of(outputs) -> torch.Tensor:
    """The logits tensor of a model's output (a tensor, or a transformers ModelOutput)."""
    if isinstance(outputs, torch.Tensor):
        return outputs
    logits = getattr(outputs, "logits", None)
    if logits is None and isinstance(outputs, (tuple, list)):
        logits = outputs[0]
    if not isinstance(logits, torch.Tensor):
        raise TypeError(
            f"the model returned {type(outputs).__name__}, which has no logits; pass "
            f"loss_fn=... to bh.boost to compute the loss from it."
        )
    return logits


def _rows(batch) -> int | None:
    """Rows of a batch: those of ``input_ids``, else of its first tensor."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() else None
    if isinstance(batch, dict):
        if isinstance(batch.get("input_ids"), torch.Tensor):
            return batch["input_ids"].shape[0]
        values = list(batch.values())
    elif isinstance(batch, (tuple, list)):
        values = list(batch)
    else:
        return None
    return next((r for r in map(_rows, values) if r is not None), None)


def token_loss_sum(outputs, batch: dict) -> torch.Tensor:
    """Sum of next-token cross-entropy over the batch's labelled positions (fp32)."""
    logits = logits_of(outputs)
    return F.cross_entropy(
        logits.float().flatten(0, -2), batch["labels"].flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )


def boost(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    plan: Plan | None = None,
    *,
    loss_fn: Callable | None = None,
    max_grad_norm: float | None = None,
    tp_policy: dict[str, str] | None = None,
    stages: list[tuple[int, int]] | None = None,
) -> Engine:
    """Shard and wrap ``model`` for ``plan``, re-target ``optimizer`` (the same object, in place)
    at its shards, and return the :class:`Engine` that trains it.

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
    """
    init()
    plan = plan or Plan()
    world, rank = dist.get_world_size(), dist.get_rank()
    plan = plan.resolve(world)  # ValueError on every rank, before any collective
    plan.check_supported()
    if max_grad_norm is not None and not max_grad_norm > 0:
        raise ValueError(f"max_grad_norm={max_grad_norm!r}: must be > 0, or None to disable clipping.")
    if stages is not None and plan.pp == 1:
        raise ValueError(f"stages={stages!r} partitions a pipeline, but Plan.pp=1; set pp > 1 or drop stages.")
    mesh = ParallelMesh(plan, rank, world)
    if plan.pp > 1:
        from .parallel.pipeline.engine import PipelineEngine

        return PipelineEngine(
            model,
            optimizer,
            plan,
            mesh,
            loss_fn=loss_fn,
            max_grad_norm=max_grad_norm,
            tp_policy=tp_policy,
            stages=stages,
        )
    return Engine(model, optimizer, plan, mesh, loss_fn=loss_fn, max_grad_norm=max_grad_norm, tp_policy=tp_policy)


def retarget_optimizer(optimizer: torch.optim.Optimizer, params_of: Callable) -> torch.optim.Optimizer:
    """Point each of ``optimizer``'s param groups at ``params_of(group_params)``, in place: the same
    optimizer object and the same group dicts, so a learning-rate scheduler attached to it keeps
    working. State of a parameter that stays is kept; state of one that goes is dropped."""
    for g in optimizer.param_groups:
        g["params"] = list(params_of(g["params"]))
    kept = {id(p) for g in optimizer.param_groups for p in g["params"]}
    for p in [p for p in optimizer.state if id(p) not in kept]:
        del optimizer.state[p]
    return optimizer


class Engine:
    """Trains one model under one plan. Build it with :func:`boost`."""

    def __init__(
        self, model, optimizer, plan: Plan, mesh: ParallelMesh, *, loss_fn=None, max_grad_norm=None, tp_policy=None
    ) -> None:
        self.plan, self.mesh = plan, mesh
        self.device = device_for_rank()
        self.loss_fn = loss_fn
        self.max_grad_norm = max_grad_norm
        model_params = {id(p) for p in model.parameters()}
        for g in optimizer.param_groups:
            for p in g["params"]:
                if id(p) not in model_params:
                    raise ValueError(
                        "the optimizer holds a parameter that is not in the model; build it over "
                        "model.parameters() (or groups of them) before bh.boost."
                    )
        if (plan.tp > 1 or plan.zero) and optimizer.state:
            raise ValueError(
                "the optimizer already has state; under tensor parallelism or ZeRO build the engine "
                "before the first optimizer step (its state would not match the parameter shards)."
            )
        check_experts(model, plan)  # every rank, before any collective
        # ZeRO-3 without tp/cp moves parameters to the device chunk by chunk (a model built on the
        # host may be larger than the device); everything else moves the whole model now.
        chunked_build = plan.zero == 3 and plan.tp == 1 and plan.cp == 1 and plan.pp == 1
        self.model = prepare_model(model, self.device, keep_params=chunked_build)
        self.tensor_parallel = apply_tensor_parallel(self.model, mesh, plan, tp_policy)
        self.vocab_head = self.tensor_parallel.head  # vocab-sharded logits: the loss goes through it
        self.batch_axes = [mesh.axis(a) for a in self.tensor_parallel.batch_axes]
        self.batch_parts, self.batch_index = 1, 0  # this rank's row block of every micro-batch
        for ax in self.batch_axes:
            self.batch_parts, self.batch_index = self.batch_parts * ax.size, self.batch_index * ax.size + ax.rank
        if self.vocab_head is not None and loss_fn is not None:
            self.vocab_head.gather_output = True
        self.context_parallel = apply_context_parallel(self.model, mesh, plan)  # None unless cp > 1
        # The axis the global batch's tokens are spread over (dp; with cp, dp x cp: each cp rank
        # holds part of every sequence): loss sums, token counts and the gradients of the
        # parameters (replicated over it) are summed over it.
        self.data_axis = mesh.axis("dp_cp" if plan.cp > 1 else "dp")
        self.moe_layers = apply_expert_parallel(self.model, mesh, plan)  # this rank's experts
        if plan.activation_checkpointing:
            apply_activation_checkpointing(self.model)
        if plan.compile:
            apply_compile(self.model)
        self._apply_pipeline()
        self._sync_initial_params()
        replaced = self.tensor_parallel.replaced
        retarget_optimizer(optimizer, lambda ps: [replaced.get(id(p), p) for p in ps])
        # gradient reduction over the data axis, norm, clipping and the update (ZeRO stage 0-3)
        self.grad_sync = build_grad_sync(
            self.model, optimizer, plan, mesh, device=self.device, data_axis=self.data_axis
        )
        self.scaler = LossScaler() if plan.precision == "fp16" else None
        self.step_count = 0
        self._grad_norm: torch.Tensor | float = float("nan")
        self.last_tokens = 0

    # ---------------------------------------------------------------- identity
    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The optimizer passed to :func:`boost`, the very object: it updates this rank's parameters
        (under ZeRO: its param groups hold the chunk shards), so a learning-rate scheduler attached
        to it steps the real learning rate."""
        return self.grad_sync.optimizer

    @property
    def dp_rank(self) -> int:
        return self.mesh.dp_rank

    @property
    def dp_size(self) -> int:
        return self.mesh.dp_size

    def comm_stats(self) -> dict[str, dict]:
        """Collective traffic per mesh axis since the engine was built (or ``reset_comm_stats``)."""
        return self.mesh.ledger.stats()

    def reset_comm_stats(self) -> None:
        self.mesh.ledger.reset()

    # ---------------------------------------------------------------- set-up
    def _apply_pipeline(self) -> None:
        """Step 4 of the rewrite order (styles.py): keep only this rank's pipeline stage of the
        model. Nothing to do without pipelining (``behemoth.parallel.pipeline.engine`` overrides it);
        it runs before the dp weight sync and the gradient buckets, which see the stage's parameters."""

    def _sync_initial_params(self) -> None:
        """Make every data-parallel (and context-parallel) replica start from rank 0's weights
        (users who seed differently per rank still train one model)."""
        dp = self.data_axis
        # the gradient sync broadcasts the trainable parameters chunk by chunk
        params = [] if self.plan.zero else [p for p in self.model.parameters() if not p.requires_grad]
        with torch.no_grad():
            for t in params + list(self.model.buffers()):  # an expert over ep_dp: each ep rank has its own
                comm.broadcast(t.data, self.mesh.axis(data_axis_of(t, dp.name)), 0)

    # ---------------------------------------------------------------- step
    def _check_batch(self, batch) -> None:
        if self.context_parallel is not None:  # sequence length vs cp: every rank, before any collective
            self.context_parallel.check_batch(batch)
        if self.loss_fn is None:
            if not isinstance(batch, dict) or "input_ids" not in batch or "labels" not in batch:
                raise ValueError(
                    "engine.step(batch) needs a dict with 'input_ids' and 'labels' ([B, S] each); "
                    "for other inputs pass loss_fn=... to bh.boost."
                )
            x, y = batch["input_ids"], batch["labels"]
            if x.dim() != 2 or x.shape != y.shape:
                raise ValueError(f"input_ids {tuple(x.shape)} and labels {tuple(y.shape)} must both be [B, S].")
        rows = _rows(batch)
        if rows is None or (self.loss_fn is not None and self.batch_parts == 1):
            return
        m = self.plan.microbatches
        if rows % m:
            raise ValueError(
                f"this rank's batch of {rows} rows is not divisible by Plan.microbatches={m}; "
                f"use a per-rank batch that is a multiple of {m}."
            )
        if (rows // m) % self.batch_parts:
            axes = " x ".join(f"{a.name}={a.size}" for a in self.batch_axes)
            raise ValueError(
                f"tensor parallelism ({self.plan.tp_mode}): batch size = {rows} rows per data-parallel rank "
                f"({m} micro-batch(es) of {rows // m}) is not divisible by {self.batch_parts}: tp_mode="
                f"{self.plan.tp_mode!r} splits every micro-batch into {self.batch_parts} row blocks ({axes}). Use "
                f"a per-rank batch that is a multiple of microbatches * {self.batch_parts} = {m * self.batch_parts}."
            )

    def _split(self, batch) -> list:
        m = self.plan.microbatches
        if m == 1:
            return [batch]
        if isinstance(batch, dict):
            parts = {k: (v.chunk(m, 0) if isinstance(v, torch.Tensor) else [v] * m) for k, v in batch.items()}
            return [{k: parts[k][i] for k in batch} for i in range(m)]
        if isinstance(batch, (tuple, list)):
            cols = [v.chunk(m, 0) for v in batch]
            return [type(batch)(c[i] for c in cols) for i in range(m)]
        return list(batch.chunk(m, 0))

    def _batch_block(self, micro):
        """This rank's row block of every tensor of the micro-batch whose first dim is its
        rows (ids, labels, masks, position ids...): a view, no communication."""
        if self.batch_parts == 1:
            return micro
        rows = _rows(micro)
        n = rows // self.batch_parts

        def take(v):
            if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == rows:
                return v.narrow(0, self.batch_index * n, n)
            if isinstance(v, dict):
                return {k: take(x) for k, x in v.items()}
            if isinstance(v, (tuple, list)):
                return type(v)(take(x) for x in v)
            return v

        return take(micro)

    def _to_device(self, batch):
        if isinstance(batch, torch.Tensor):
            return batch.to(self.device, non_blocking=True)
        if isinstance(batch, dict):
            return {k: self._to_device(v) for k, v in batch.items()}
        if isinstance(batch, (tuple, list)):
            return type(batch)(self._to_device(v) for v in batch)
        return batch

    def _model_inputs(self, micro):
        if isinstance(micro, dict) and "input_ids" in micro:
            return (micro["input_ids"],)
        return micro if isinstance(micro, (tuple, list)) else (micro,)

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

    def forward_backward(self, batch) -> float:
        """Forward and backward of this rank's batch; gradients left reduced in ``.grad``.
        Returns the global mean loss."""
        self._check_batch(batch)
        batch = self._to_device(batch)
        dp = self.data_axis
        micro = self._split(batch)
        n_global, scale = self._loss_normaliser(batch, len(micro))
        loss_scale = self.scaler.scale if self.scaler else 1.0
        # the loss sums, and with MoE layers their router losses
        total = torch.zeros(2 if self.moe_layers else 1, dtype=torch.float64, device=self.device)
        for i, mb in enumerate(micro):
            self.grad_sync.begin(sync=i == len(micro) - 1)
            local, kwargs = self._batch_block(mb), {}
            if self.context_parallel is not None:  # this rank's share of the sequence, and its positions
                local, kwargs = self.context_parallel.split(local)
            # param_dtype: the model computes in its (bf16) parameters' dtype, as FSDP2 and DeepSpeed's bf16 do
            with autocast_context(
                "fp32" if self.plan.param_dtype else self.plan.precision, self.device, cache=self.plan.zero < 3
            ):
                out = self.model(*self._model_inputs(local), **kwargs)
            if self.loss_fn is not None:  # gets the gathered outputs: the whole micro-batch (cp: its share)
                loss = self.loss_fn(out, mb if self.context_parallel is None else local)
            elif self.vocab_head is not None:
                loss = self.vocab_head.vocab_parallel_loss_sum(logits_of(out), local["labels"])
            else:
                loss = token_loss_sum(out, local)
            total[0] += loss.detach().double().sum()
            objective = loss.float() * (scale * loss_scale).float()
            aux = auxiliary_loss(self.model) if self.moe_layers else None
            if aux is not None:  # this rank's share of the global micro-batch's router losses
                total[1] += aux.detach().double()
                objective = objective + aux.float() * (loss_scale / len(micro))
            objective.backward()
        self.grad_sync.finish()
        comm.all_reduce(total, dp)
        if self.loss_fn is None:  # sums over this rank's row block: add the other blocks
            for ax in self.batch_axes:
                comm.all_reduce(total, ax)
        loss_val, aux_val, n = torch.cat(
            [
                total[:1] * scale,
                total[1:].sum().reshape(1) / len(micro),
                n_global if n_global is not None else total.new_zeros(1),
            ]
        ).tolist()
        loss_val += aux_val
        if self.loss_fn is None and n == 0:
            raise ValueError("the global batch has no labelled token (every label is -100).")
        self.last_tokens = int(n)
        return loss_val

    def step(self, batch) -> float:
        """One optimizer step on this rank's share of the global batch; returns the global mean loss."""
        loss = self.grad_sync.run(lambda: self.forward_backward(batch), self.max_grad_norm, self.scaler)
        self._grad_norm = self.grad_sync.step(self.max_grad_norm, self.scaler)
        self.step_count += 1
        return loss

    # ---------------------------------------------------------------- state
    def memory_report(self) -> dict[str, dict[str, int]]:
        """The memory tracer: bytes of model data this rank holds now, per device type
        ({'cuda': ..., 'cpu': ...}; parameters, gradients, fp32 masters held apart from the
        parameters, optimizer state) and, on a GPU, ``other`` = allocated - model data
        (activations, workspaces). Call it between steps, or from a hook mid-step."""
        return self.grad_sync.memory_report()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The serial model's state dict (same keys, shapes and values), on CPU; tensor-parallel
        shards are all-gathered over tp (a collective: call it on every rank)."""
        with self.grad_sync.gathered():
            return gather_expert_state(self.model, self.mesh, full_state_dict(self.model, self.mesh))

    def save(self, path: str, extra: dict | None = None) -> None:
        """Sharded checkpoint to directory ``path`` (atomic: a killed save leaves the old one intact)."""
        self._check_checkpointable()
        from .train.checkpoint import save_checkpoint

        save_checkpoint(self, path, extra or {})

    def load(self, path: str) -> dict:
        """Load a checkpoint written by :meth:`save` under any plan; returns its ``extra``."""
        self._check_checkpointable()
        from .train.checkpoint import load_checkpoint

        return load_checkpoint(self, path)

    def _check_checkpointable(self) -> None:
        if self.plan.ep > 1:
            raise NotImplementedError(
                f"engine.save/load with Plan.ep={self.plan.ep}: checkpoints of expert-sharded parameters are not "
                f"built yet. Export engine.full_state_dict() (the serial model's state) instead, or train with ep=1."
            )

    @property
    def last_grad_norm(self) -> float:
        """Global gradient norm of the last step, before clipping (inf for a skipped fp16 step).
        The gradient sync's step computes it wherever it is a collective (sharded gradients, tp,
        pipelines); else it is read here, from the gradients still held."""
        if self._grad_norm is None:
            self._grad_norm = self.grad_sync.grad_norm()
        return float(self._grad_norm)

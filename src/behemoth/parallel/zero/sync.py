"""The gradient-sync protocol: how an engine's step executor hands gradients to data parallelism.

Every plan's gradients go through one object built by :func:`build_grad_sync`: plain data
parallelism is ZeRO stage 0 -- the same chunks, gradient hooks and reductions launched during the
backward in a fixed order (:mod:`.store`), all-reducing unsharded buckets of ``Plan.bucket_mb``
instead of reduce-scattering -- so every plan has one gradient path, one global norm and one fp16
overflow vote (:class:`.optimizer.ZeroOptimizer`). The executor (a sequential loop, a
pipeline schedule) runs forward and backward; the sync object owns what surrounds them -- the
gradient hooks and their reductions over the data axis, the fp16 overflow vote, the global
gradient norm, clipping, the optimizer update and publishing the updated parameters -- and the
optimizer state a checkpoint stores.

A step, as :class:`~behemoth.engine.Engine` drives it::

    loss = sync.run(forward_backward, max_grad_norm, scaler)   # start_step(), begin()/finish() inside
    norm = sync.step(max_grad_norm, scaler)

where ``forward_backward()`` calls ``sync.begin(sync=last)`` before each micro-batch's backward
and ``sync.finish()`` after the last one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Protocol, runtime_checkable

import torch

from ...comm import Axis
from ..expert import expert_param_axes
from .optimizer import ZeroOptimizer

__all__ = ["GradSync", "build_grad_sync"]


@runtime_checkable
class GradSync(Protocol):
    """Gradient reduction, norm, clipping and the optimizer update of one rank's parameters."""

    params: list[torch.nn.Parameter]
    """This rank's trainable parameters, in model order."""

    optimizer: torch.optim.Optimizer
    """The optimizer the user passed to ``bh.boost``, the same object for the engine's life: its own
    param groups are re-targeted in place (under ZeRO 1-3 at this rank's chunk masters), and the
    update reads their hyper-parameters at every step, so a learning-rate scheduler on it works."""

    def start_step(self) -> None:
        """Begin a step: this step's gradients start empty. :meth:`run` calls it."""

    def begin(self, sync: bool) -> None:
        """Before each micro-batch's backward; ``sync`` marks the step's last micro-batch (the
        one whose gradients complete the step: reductions launch during its backward)."""

    def finish(self) -> None:
        """After the step's last backward: launch what is left and wait for every reduction."""

    def ensure_grad(self, p: torch.nn.Parameter) -> torch.Tensor:
        """``p``'s gradient as the fp32 tensor the reduction will read (zeros if no gradient arrived
        yet), so a caller may add into it in place before :meth:`finish` (pipelines sum tied copies)."""

    def configure_norm(self, extra_axes: list[Axis], skip: list[torch.nn.Parameter]) -> None:
        """The serial model's norm when this rank holds only part of the model: also sum the
        squared norm over ``extra_axes`` (pipeline stages), and leave ``skip`` out (a tied copy
        counted on another rank). Call once, before the first step."""

    def run(self, forward_backward: Callable[[], float], max_grad_norm: float | None, scaler) -> float:
        """Run one step's forward and backward (``forward_backward()``, which returns the loss)
        with what the gradient sync needs around it: :meth:`start_step`, offloaded chunks updated
        on the host during the backward, offload='auto''s out-of-memory retry. Returns the loss."""

    def step(self, max_grad_norm: float | None, scaler) -> torch.Tensor | float | None:
        """After :meth:`run`: the fp16 overflow vote (a skipped step returns ``inf``), unscale,
        the global norm, clipping to ``max_grad_norm``, the update, and publishing the updated
        parameters. Returns the gradient norm before clipping (a tensor, read lazily), or None
        when nothing needed it (:meth:`grad_norm` then reads it from the gradients still held)."""

    def grad_norm(self) -> torch.Tensor:
        """The serial model's gradient 2-norm from this rank's reduced gradients (a collective
        over the axes the gradients are sharded on: every rank calls it)."""

    def gathered(self, writable: bool = False) -> contextlib.AbstractContextManager[None]:
        """Every parameter readable in full (ZeRO-3 gathers its chunks) and in fp32 for the
        duration. ``writable``: values written into the parameters become the shards and masters
        on exit (a checkpoint load)."""

    def memory_report(self) -> dict[str, dict[str, int]]:
        """Model data bytes this rank holds per device type (params, grads, masters, optimizer)
        and on a GPU the other data: see :func:`.measure.memory_report`."""

    def state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        """The optimizer state per parameter name: ``{name: {key: tensor}}``, each tensor shaped
        like this rank's parameter (gathered from the ZeRO shards: a collective), on the CPU
        under ZeRO. Names are the ``names`` given to :func:`build_grad_sync`."""

    def load_state_dict(self, state: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
        """The inverse of :meth:`state_dict` (names this rank does not hold are ignored)."""


def param_names(model: torch.nn.Module) -> dict[int, str]:
    """``id(param) -> name``, the first name of a tied parameter."""
    names: dict[int, str] = {}
    for name, p in model.named_parameters():
        names.setdefault(id(p), name)
    return names


def build_grad_sync(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    plan,
    mesh,
    *,
    device: torch.device,
    data_axis: Axis,
    names: Mapping[int, str] | None = None,
    module_runs: Callable[[torch.nn.Module], bool] | None = None,
) -> GradSync:
    """The gradient sync for ``plan``: ZeRO ``plan.zero`` over ``data_axis`` (stage 0 is plain
    data parallelism) for the trainable parameters of ``model``, updated by ``optimizer``.
    ``names`` (``id(param) -> name``, default: the model's own names) keys the optimizer state
    of :meth:`GradSync.state_dict`. ``module_runs(module)`` says whether a called module computes
    now (ZeRO-3 gathers only for those: a pipeline's inactive chunks pass through). Expert parameters sharded by
    :class:`~behemoth.parallel.expert.ExpertParallel` are reduced and broadcast over ``ep_dp``
    instead, and under tensor parallelism an MoE block's parameters over their axis times tp
    (their gradients partial over tp: summed there once per step). Collective: every rank of ``data_axis`` builds it."""
    budget = None if plan.offload_budget_gb is None else int(plan.offload_budget_gb * 2**30)
    return ZeroOptimizer(
        model,
        optimizer,
        data_axis,
        mesh.axis("tp"),
        stage=plan.zero,
        offload=plan.offload,
        device=device,
        chunk_mb=plan.chunk_mb,
        bucket_mb=plan.bucket_mb,
        budget_bytes=budget,
        world=mesh.axis("world") if plan.pp > 1 else None,
        param_dtype=torch.bfloat16 if plan.param_dtype == "bf16" else None,
        names=dict(names) if names is not None else param_names(model),
        param_axes=expert_param_axes(model, mesh, data_axis),  # experts: over ep_dp; MoE blocks under tp: x tp
        reduce_once=plan.pp > 1,  # a stage's gradients: reduced once per step, after its last micro-batch
        module_runs=module_runs,
    )

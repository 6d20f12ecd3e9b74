"""The sequential step executor: one step's micro-batches one after another on this rank.

Each micro-batch: this rank's row block (2D/2.5D/3D tensor parallelism) and its share of the
sequence (context parallelism), forward under the plan's autocast, its loss times the engine's
factor, backward. The gradient sync is told before each backward whether it is the step's last
(its reductions then launch during that backward) and finishes after it. The pipeline
counterpart is :class:`behemoth.parallel.pipeline.executor.PipelineExecutor`; both are chosen by
:func:`behemoth.engine.boost` and driven by :class:`behemoth.engine.Engine`.
"""

from __future__ import annotations

from typing import Protocol

import torch

from .batch import model_inputs, row_block
from .loss import MicroBatchLoss
from .precision import autocast_context

__all__ = ["SequentialExecutor", "StepExecutor"]


class StepExecutor(Protocol):
    """What the engine asks of a step executor."""

    def configure(self, grad_sync) -> None:
        """Once, before the first step: tell the gradient sync what this rank's layout needs
        (a pipeline stage: the norm is summed over pp, a tied copy counted once)."""

    def check_batch(self, rows: int | None, microbatches: int) -> None:
        """Refuse a batch this executor cannot split (ValueError, on every rank, before any collective)."""

    def run(self, micro: list, scale: torch.Tensor, loss_scale: float, grad_sync) -> torch.Tensor:
        """Forward and backward of the step's micro-batches (each loss times ``scale * loss_scale``;
        a mixture-of-experts model's router losses times ``loss_scale / len(micro)``), telling
        ``grad_sync`` before each backward whether it is the step's last (``begin``) and finishing it
        after the last. Returns float64 ``[sum of the losses (not scaled)]``, with the sum of the
        router losses appended for a mixture-of-experts model."""


class SequentialExecutor:
    """Runs ``model`` over the micro-batches of a step (``run``)."""

    def __init__(
        self,
        model,
        plan,
        loss: MicroBatchLoss,
        *,
        batch_parts: int,
        batch_index: int,
        context,
        experts,
        device: torch.device,
    ) -> None:
        self.model, self.loss, self.context, self.device = model, loss, context, device
        self.experts = experts  # ExpertLayers: the router losses
        self.moe = bool(experts)
        self.batch_parts, self.batch_index = batch_parts, batch_index
        # param_dtype: the model computes in its (bf16) parameters' dtype, as FSDP2 and DeepSpeed's bf16 do
        self.precision = "fp32" if plan.param_dtype else plan.precision
        self.autocast_cache = plan.zero < 3

    def configure(self, grad_sync) -> None:
        """Nothing to tell the gradient sync: this rank holds the whole model."""

    def check_batch(self, rows: int | None, microbatches: int) -> None:
        """Nothing beyond the engine's checks."""

    def run(self, micro: list, scale: torch.Tensor, loss_scale: float, grad_sync) -> torch.Tensor:
        """Forward and backward of every micro-batch (its loss times ``scale * loss_scale``, router
        losses times ``loss_scale / len(micro)``); gradients left reduced in ``grad_sync``. Returns
        this rank's loss sum (float64, not scaled: of its row block, its sequence share), and for a
        mixture-of-experts model its share of the router losses."""
        total = torch.zeros(2 if self.moe else 1, dtype=torch.float64, device=self.device)
        for i, mb in enumerate(micro):
            grad_sync.begin(sync=i == len(micro) - 1)
            local, kwargs = row_block(mb, self.batch_parts, self.batch_index), {}
            if self.context is not None:  # this rank's share of the sequence, and its positions
                local, kwargs = self.context.split(local)
            with autocast_context(self.precision, self.device, cache=self.autocast_cache):
                out = self.model(*model_inputs(local), **kwargs)
            loss = self.loss(out, mb, local)
            total[0] += loss.detach().double().sum()
            objective = loss.float() * (scale * loss_scale).float()
            aux = self.experts.aux_loss() if self.moe else None
            if aux is not None:  # this rank's share of the global micro-batch's router losses
                total[1] += aux.detach().double()
                objective = objective + aux.float() * (loss_scale / len(micro))
            objective.backward()
        grad_sync.finish()
        return total

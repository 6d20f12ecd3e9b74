"""The pipeline engine: ``Plan(pp=..., microbatches=..., schedule=..., virtual_stages=...)``.

Implements GPipe (Huang et al. 2019), 1F1B / PipeDream-Flush (Narayanan et al. 2021),
interleaved 1F1B (Narayanan et al., SC'21) and ZB-H1 zero-bubble (Qi et al., ICLR 2024)
behind the same ``engine.step(batch)`` as every other plan. :class:`PipelineEngine` is the
base :class:`~behemoth.engine.Engine` with three things changed:

* ``_apply_pipeline`` (step 4 of styles.py's order, after tensor parallelism, activation
  checkpointing): cut the model down to this rank's stage(s) (:mod:`.stage`), after rank 0
  has sent every stage its initial weights. The base engine then builds the dp weight sync,
  the gradient sync (``self.grad_sync``: buckets, or ZeRO's chunks) and the optimizer over
  the stage's parameters only;
* ``forward_backward``: split this dp rank's batch into ``microbatches``, run this rank's
  action list of the schedule (``schedules.make_schedule``; checked deadlock-free by
  ``simulate.simulate`` at build time), sum tied-weight gradients between the first and the
  last stage, and return the global mean loss, the same float on every rank;
* ``full_state_dict`` / the gradient norm: gathered (broadcast) / summed over ``pp`` too.

Loss: every micro-batch's loss on the last stage is its token-loss sum over the global
token count (counted from the labels on every rank, one all-reduce over dp), so gradients
summed over micro-batches, stages' dp replicas and tied copies are exactly the serial
model's. Zero-bubble splits each backward for real: ``BI`` is ``autograd.grad`` of the
stage output w.r.t. the stage input only (graph retained), ``BW`` later backpropagates the
same output gradient into the stage's parameters only (``backward(inputs=params)``), as
``torch.distributed.pipelining``'s stage_backward_input / stage_backward_weight do; the
gradients equal a full backward's.

Data-parallel overlap: with one chunk per rank, the last weight-gradient action of the step
(B or BW of the last micro-batch) touches every parameter of the stage, so the buckets
launch their all-reduces during it as without pipelining; with interleaving (``v > 1``) the
chunks finish at different times and the buckets are reduced after the schedule.

Failure: a rank that raises, or dies, leaves its peers waiting in a receive, which the
process group's timeout (``BEHEMOTH_TIMEOUT``) turns into an error on every rank.

Tested in tests/dist/test_pipeline_parity.py and tests/dist/test_pipeline_faults.py.
"""

from __future__ import annotations

import torch

from ... import comm
from ...engine import Engine, _rows, logits_of, retarget_optimizer, token_loss_sum
from ...precision import autocast_context
from .p2p import StageChannels, pipeline_channels
from .partition import stage_modules
from .schedules import BI, BW, B, F, make_schedule
from .simulate import simulate
from .stage import PipelineSplit, partition_for

__all__ = ["PipelineEngine"]


class PipelineEngine(Engine):
    """Trains one pipeline stage (or ``virtual_stages`` chunks) of the model on this rank.
    Build it with ``bh.boost(model, optimizer, Plan(pp=...), stages=...)``; ``stages`` is an
    optional list of ``pp * virtual_stages`` half-open block ranges ``(start, end)`` that
    overrides the balance by estimated cost."""

    def __init__(
        self, model, optimizer, plan, mesh, *, loss_fn=None, max_grad_norm=None, tp_policy=None, stages=None
    ) -> None:
        # Everything that can be refused is checked here, on every rank, before any collective.
        if optimizer.state:
            raise ValueError(
                "the optimizer already has state; under pipeline parallelism build the engine before "
                "the first optimizer step (each stage keeps the state of its own parameters only)."
            )
        self.pp_axis = mesh.axis("pp")
        self._layout, self._partition = partition_for(model, plan.pp, plan.virtual_stages, stages)
        schedule = make_schedule(plan.schedule, plan.pp, plan.microbatches, plan.virtual_stages)
        simulate(schedule, plan.pp)  # raises on a dependency violation, deadlock or FIFO break
        self.schedule = schedule
        self.actions = schedule[self.pp_axis.rank]
        # The optimizer over this rank's parameters only (the base engine re-targets it after tp).
        names = stage_modules(self._layout, self._partition)[self.pp_axis.rank]
        mine = {id(p) for row in names for n in row for p in model.get_submodule(n).parameters()}
        model_params = {id(p) for p in model.parameters()}
        if any(id(p) not in model_params for g in optimizer.param_groups for p in g["params"]):
            raise ValueError(
                "the optimizer holds a parameter that is not in the model; build it over "
                "model.parameters() (or groups of them) before bh.boost."
            )
        retarget_optimizer(optimizer, lambda ps: [p for p in ps if id(p) in mine])
        super().__init__(
            model, optimizer, plan, mesh, loss_fn=loss_fn, max_grad_norm=max_grad_norm, tp_policy=tp_policy
        )
        self.serial_param_names = self.split.serial_param_names  # checkpoints name tied copies serially
        weight_steps = [i for i, a in enumerate(self.actions) if a.kind in (B, BW)]
        self._sync_at = weight_steps[-1] if plan.virtual_stages == 1 else None
        if plan.zero:
            # ZeRO-1: accumulate through the schedule, add the tied copies' local gradients, then
            # reduce-scatter every chunk (reduction is linear: the same sums as reduce-then-add).
            self._sync_at = None
        # The serial model's norm: summed over pp, a tied copy counted on the first stage only;
        # computed in every step on every rank, so reading ``last_grad_norm`` is never a collective.
        kept = {id(p) for p in self.split.norm_parameters()}
        self.grad_sync.configure_norm([self.pp_axis], [p for p in self.grad_sync.params if id(p) not in kept])

    # ---------------------------------------------------------------- set-up
    def _apply_pipeline(self) -> None:
        # One process group per one-way channel, every channel connected before the first step.
        pp = self.pp_axis
        self.channels = StageChannels(pp.rank, self.mesh.channel_axes("pp", pipeline_channels(pp.size)), self.device)
        self.channels.connect()
        self.split = PipelineSplit(self.model, self._layout, self._partition, self.pp_axis)
        self.split.distribute()
        self.split.apply()

    @property
    def stage_ranges(self) -> list[list[tuple[int, int]]]:
        """Block ranges ``[rank][chunk] = (start, end)`` of the pipeline (the same on every rank)."""
        return [list(row) for row in self._partition]

    # ---------------------------------------------------------------- step
    def _check_batch(self, batch) -> None:
        super()._check_batch(batch)
        rows, m = _rows(batch), self.plan.microbatches
        if rows is None or rows % m:
            raise ValueError(
                f"pipeline parallelism: this rank's batch of {rows} rows cannot be split into "
                f"Plan.microbatches={m} micro-batches; use a per-rank batch that is a multiple of {m}."
            )

    def _loss(self, out, micro, local) -> torch.Tensor:
        if self.loss_fn is not None:
            return self.loss_fn(out, micro)
        if self.vocab_head is not None:
            return self.vocab_head.vocab_parallel_loss_sum(logits_of(out), local["labels"])
        return token_loss_sum(out, local)

    def forward_backward(self, batch) -> float:
        """Run this rank's actions of the schedule on this dp rank's batch; gradients are left
        reduced over dp and summed over tied copies. Returns the global mean loss (every rank)."""
        self._check_batch(batch)
        batch = self._to_device(batch)
        micro = self._split(batch)
        dp, split, ch = self.data_axis, self.split, self.channels
        n_global, scale = self._loss_normaliser(batch, len(micro))
        total = torch.zeros(1, dtype=torch.float64, device=self.device)
        pp, rank, last = split.pp, split.rank, split.num_stages - 1
        nxt, prv = (rank + 1) % pp, (rank - 1) % pp
        saved: dict[tuple[int, int], list] = {}  # (micro-batch, chunk) -> [stage input, output, output grad]
        for i, a in enumerate(self.actions):
            s, key = split.stage(a.chunk), (a.microbatch, a.chunk)
            if a.kind == F:
                local = self._batch_block(micro[a.microbatch])
                inputs = self._model_inputs(local)
                shape = tuple(tuple(t.shape) for t in inputs if isinstance(t, torch.Tensor))
                x = None if s == 0 else ch.recv_activation(s - 1, shape, prv).requires_grad_()
                split.ctx.chunk, split.ctx.stash = a.chunk, x
                try:
                    with autocast_context(self.plan.precision, self.device):
                        out = self.model(*inputs)
                finally:
                    split.ctx.chunk, split.ctx.stash = None, None
                if s == last:
                    loss = self._loss(out, micro[a.microbatch], local)
                    total += loss.detach().double()
                    y = loss.float() * scale.float()
                else:
                    y = logits_of(out)
                    ch.send_activation(y, s, shape, nxt)
                saved[key] = [x, y, None]
            elif a.kind in (B, BI):
                x, y, _ = saved[key]
                g = None if s == last else ch.recv_grad(y, nxt)
                if a.kind == B:
                    self.grad_sync.begin(sync=i == self._sync_at)
                    torch.autograd.backward(y, g)
                    del saved[key]
                    if s > 0:
                        ch.send_grad(x.grad, prv)
                else:  # input gradient only; the graph is kept for BW
                    if s > 0:
                        (gx,) = torch.autograd.grad(y, (x,), g, retain_graph=True)
                        ch.send_grad(gx, prv)
                    saved[key][2] = g
            else:  # BW: the same output gradient into this chunk's parameters only
                _, y, g = saved.pop(key)
                self.grad_sync.begin(sync=i == self._sync_at)
                torch.autograd.backward(y, g, inputs=split.chunk_parameters(a.chunk))
        ch.finish()
        if self.plan.zero:  # tied copies summed before the reduce-scatter; the norm comes with the step
            for a, ra, b, rb in split.tied:
                if split.rank in (ra, rb):
                    self.grad_sync.ensure_grad(self.model.get_parameter(a if split.rank == ra else b))
            split.sync_tied_grads()
            self.grad_sync.begin(sync=True)
            self.grad_sync.finish()
        else:
            if self._sync_at is None:
                self.grad_sync.begin(sync=True)  # interleaved: reduce every bucket now
            self.grad_sync.finish()
            split.sync_tied_grads()
        comm.all_reduce(total, dp)
        if self.loss_fn is None:
            for ax in self.batch_axes:
                comm.all_reduce(total, ax)
        comm.all_reduce(total, self.pp_axis)  # only the last stage holds a non-zero sum
        loss_val, n = torch.cat([total * scale, n_global if n_global is not None else total.new_zeros(1)]).tolist()
        if self.loss_fn is None and n == 0:
            raise ValueError("the global batch has no labelled token (every label is -100).")
        self.last_tokens = int(n)
        return loss_val

    # ---------------------------------------------------------------- gradients and state
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The serial model's state dict on every rank: each stage's entries (tp-gathered)
        broadcast over pp. A collective: call it on every rank."""
        return self.split.gather_state(super().full_state_dict(), self.device)

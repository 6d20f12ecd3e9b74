"""The pipeline step executor: one step's micro-batches through a schedule.

Implements GPipe (Huang et al. 2019), 1F1B / PipeDream-Flush (Narayanan et al. 2021),
interleaved 1F1B (Narayanan et al., SC'21) and ZB-H1 zero-bubble (Qi et al., ICLR 2024)
behind the same ``engine.step(batch)`` as every other plan. The engine
(:mod:`behemoth.engine`) splits the batch and owns the gradient sync; this executor runs this
rank's action list of the schedule (``schedules.make_schedule``; checked deadlock-free by
``simulate.simulate`` before anything is built) over the stage(s) :class:`~.stage.PipelineSplit` cut,
sums tied-weight gradients between the first and the last stage, and sums the loss over ``pp``.

Loss: every micro-batch's loss on the last stage is its token-loss sum times the engine's
factor (1 / global token count), so gradients summed over micro-batches, stages' dp replicas
and tied copies are exactly the serial model's. Zero-bubble splits each backward for real:
``BI`` is ``autograd.grad`` of the stage output w.r.t. the stage input only (graph retained),
``BW`` later backpropagates the same output gradient into the stage's parameters only
(``backward(inputs=params)``), as ``torch.distributed.pipelining``'s stage_backward_input /
stage_backward_weight do; the gradients equal a full backward's.

Mixture of experts: the MoE layers of each stage run their all-to-alls over ``ep`` inside the
stage's forward and backward (every rank of an ep group holds the same stage and runs the same
actions), and their router losses -- this rank's share of each global micro-batch's, weighted
1/microbatches as the sequential executor weighs them -- join *that stage's* backward as a second
root beside its output (on the last stage, its loss). behemoth's layers have a loss per layer,
read after the stage's forward. transformers' pooled balancing loss needs every layer's counts
and token totals (:mod:`behemoth.parallel.expert.losses`): they ride with the activations to the
last stage, summed stage by stage, and back with the gradients, so each stage's share is taken in
its backward, when the totals have arrived.

Gradient sync: tied copies are summed into the gradients the sync reduces (reduction is linear:
the same sums as reducing first), then the sync reduces every gradient. With one chunk per rank
and no tied copy on this rank, the last weight-gradient action of the step (B or BW of the last
micro-batch) touches every parameter of the stage, so the sync launches its reductions during
it, overlapped with the backward; otherwise it reduces after the schedule. Under every ZeRO stage
a stage's gradients accumulate over its micro-batches and are reduced (ZeRO-2/3: reduce-scattered
into shards) once per step (``build_grad_sync``'s ``reduce_once``), so tied copies can be summed
first; the step's norm and fp16 overflow vote span dp and pp. ZeRO-3 gathers a module's chunks
before its forward and its backward in every micro-batch and releases them as the working set
moves on (re-gathered per micro-batch, not held for the step: the stage's memory holds its shards
and the working set, at the cost of two all-gathers per chunk per micro-batch, three with
activation checkpointing); a module of an inactive chunk (interleaving) gathers nothing
(:func:`module_runs`).

Compiled blocks (``Plan.compile``): a block's chunk gate runs inside its compiled code, so
torch.compile specialises on it -- one graph per block shape with one chunk per rank; with
interleaving, one more for the pass-through of a chunk that is not the active one. Zero-bubble's
BI and BW each run a compiled block's whole backward (its input and weight gradients are one
compiled graph; BI keeps the input gradient, BW the weight gradients): correct, at the cost of
that block's backward computed twice.

Context parallelism: every stage runs its micro-batch's share of the sequence (the same split
on every stage, so the activations between stages are ``[b, s/cp, h]`` and each cp rank's stages
talk to the same cp rank's), with the global position ids of its tokens; attention inside each
stage is context-parallel over ``cp`` (the model's attention modules were rewritten before the
split).

Failure: a rank that raises, or dies, leaves its peers waiting in a receive, which the
process group's timeout (``BEHEMOTH_TIMEOUT``) turns into an error on every rank.

Tested in tests/dist/test_pipeline_parity.py, tests/dist/test_pipeline_zero.py and
tests/dist/test_pipeline_faults.py.
"""

from __future__ import annotations

import contextlib

import torch

from ... import comm
from ...batch import model_inputs, row_block
from ...loss import MicroBatchLoss
from ...precision import autocast_context
from .p2p import StageChannels
from .schedules import BI, BW, B, F
from .stage import PipelineSplit

__all__ = ["PipelineExecutor", "module_runs"]


def _roots(y: torch.Tensor, g: torch.Tensor | None, aux: torch.Tensor | None):
    """``(tensors, grad_tensors)`` of one stage's backward: its output ``y`` with the gradient
    ``g`` received (None on the last stage, whose ``y`` is the loss), and the router losses of
    the stage's MoE layers (a scalar) when they reach any parameter."""
    if aux is None or not aux.requires_grad:
        return [y], [g]
    return [y, aux], [g, None]


def module_runs(split: PipelineSplit):
    """``runs(module)``: whether a module of this rank computes when called now -- not one of a
    chunk that is not the active one (it passes its input through). What ZeRO-3 gathers for."""
    chunk_of = {id(m): c for name, c in split.module_chunks.items() for m in split.model.get_submodule(name).modules()}

    def runs(module: torch.nn.Module) -> bool:
        c, active = chunk_of.get(id(module)), split.ctx.chunk
        return c is None or active is None or c == active

    return runs


def _chunk_modules(split: PipelineSplit, chunk: int) -> set[int]:
    """The ids of the modules of this rank's ``chunk``."""
    return {
        id(m)
        for name, c in split.module_chunks.items()
        if c == chunk
        for m in split.model.get_submodule(name).modules()
    }


class PipelineExecutor:
    """Runs this rank's actions of ``schedule`` (``schedules.make_schedule``'s per-rank action
    lists, checked by ``simulate.simulate``) for one step (``run``)."""

    def __init__(
        self,
        model,
        split: PipelineSplit,
        channels: StageChannels,
        schedule,
        plan,
        loss: MicroBatchLoss,
        *,
        batch_parts: int,
        batch_index: int,
        device: torch.device,
        context=None,
        experts=None,
    ) -> None:
        self.model, self.split, self.channels, self.loss = model, split, channels, loss
        # mixture of experts: each chunk's MoE layers (their router losses join that stage's backward)
        # (a stage may hold none of them: a model has MoE layers when the serial model has, on every rank)
        self.experts = experts if experts is not None and experts.names else None
        moe = self.experts is not None
        self.chunk_experts = [experts.subset(_chunk_modules(split, c)) for c in range(split.v)] if moe else []
        self.pooled = experts.pooled_experts if moe else 0  # transformers' pooled loss: E, else 0
        self.context = context  # context parallelism: each micro-batch's share of the sequence
        # param_dtype: the stages compute in their (bf16) parameters' dtype, as the sequential executor does
        self.precision, self.device = "fp32" if plan.param_dtype else plan.precision, device
        self.autocast_cache = plan.zero < 3  # ZeRO-3 releases weights between uses: no cached bf16 copies
        self.batch_parts, self.batch_index = batch_parts, batch_index
        self.schedule, self.actions = schedule, schedule[split.rank]
        # Zero-bubble runs each backward twice over one retained graph (BI, then BW); a compiled block's
        # backward may not donate (overwrite) its saved buffers then. Donation is decided when a graph
        # compiles, at its first forward: those run with it off, and without AOTAutograd's on-disk
        # cache, whose entries (compiled elsewhere, with donation) it would otherwise load.
        split_backward = any(a.kind == BI for a in self.actions)
        self.compile_context = (
            (lambda: torch._functorch.config.patch(donated_buffer=False, enable_autograd_cache=False))
            if plan.compile and split_backward
            else contextlib.nullcontext
        )
        weight_steps = [i for i, a in enumerate(self.actions) if a.kind in (B, BW)]
        holds_tied = any(split.rank in (ra, rb) for _, ra, _, rb in split.tied)
        # the action whose backward completes every gradient of the stage: reductions overlap it
        self.sync_at = weight_steps[-1] if plan.virtual_stages == 1 and not holds_tied else None

    def configure(self, grad_sync) -> None:
        """The serial model's gradient norm: summed over pp, a tied copy counted on the first stage only."""
        kept = {id(p) for p in self.split.norm_parameters()}
        grad_sync.configure_norm([self.split.axis], [p for p in grad_sync.params if id(p) not in kept])

    def check_batch(self, rows: int | None, microbatches: int) -> None:
        if rows is None or rows % microbatches:
            raise ValueError(
                f"pipeline parallelism: this rank's batch of {rows} rows cannot be split into "
                f"Plan.microbatches={microbatches} micro-batches; use a per-rank batch that is a multiple of "
                f"{microbatches}."
            )

    def run(self, micro: list, scale: torch.Tensor, loss_scale: float, grad_sync) -> torch.Tensor:
        """This rank's actions on the step's micro-batches (backward of each loss times ``scale`` and
        ``loss_scale``, fp16's loss scale or 1; a mixture-of-experts model's router losses times
        ``loss_scale / len(micro)``); gradients left reduced in ``grad_sync``. Returns the loss sum of
        the step's micro-batches (float64 ``[1]``, not times ``scale``; with the sum of the router
        losses appended for a mixture-of-experts model), summed over ``pp``."""
        split, ch = self.split, self.channels
        total = torch.zeros(1 if self.experts is None else 2, dtype=torch.float64, device=self.device)
        pp, rank, last = split.pp, split.rank, split.num_stages - 1
        nxt, prv = (rank + 1) % pp, (rank - 1) % pp
        aux_weight = loss_scale / len(micro)
        # (micro-batch, chunk) -> [stage input, output, backward roots, router losses, RouterTerms, totals]
        saved: dict[tuple[int, int], list] = {}
        for i, a in enumerate(self.actions):
            s, key = split.stage(a.chunk), (a.microbatch, a.chunk)
            if a.kind == F:
                local, kwargs = row_block(micro[a.microbatch], self.batch_parts, self.batch_index), {}
                if self.context is not None:  # this rank's share of the sequence, and its positions
                    local, kwargs = self.context.split(local)
                inputs = model_inputs(local)
                shape = tuple(tuple(t.shape) for t in inputs if isinstance(t, torch.Tensor))
                x = None if s == 0 else ch.recv_activation(s - 1, shape, prv).requires_grad_()
                totals = self._recv_totals(s, prv, backward=False)
                split.ctx.chunk, split.ctx.stash = a.chunk, x
                try:
                    with self.compile_context(), autocast_context(self.precision, self.device, self.autocast_cache):
                        out = self.model(*inputs, **kwargs)
                finally:
                    split.ctx.chunk, split.ctx.stash = None, None
                aux, terms = self.chunk_experts[a.chunk].take() if self.experts is not None else (None, None)
                if totals is not None and terms is not None:  # this stage's layers join the running totals
                    totals = totals + terms.totals()
                if s == last:
                    loss = self.loss(out, micro[a.microbatch], local)
                    total[0] += loss.detach().double()
                    y = loss.float() * (scale * loss_scale).float()
                    aux = self._router_loss(aux, terms, totals, total)
                    if aux is not None:
                        y = y + aux.float() * aux_weight
                    aux = terms = None
                else:
                    y = split.stage_output(out)
                    ch.send_activation(y, s, shape, nxt)
                    if totals is not None:
                        ch.send_terms(totals, nxt, backward=False)
                saved[key] = [x, y, None, aux, terms, totals]
            elif a.kind in (B, BI):
                x, y, _, aux, terms, totals = saved[key]
                g = None
                if s != last:
                    g = ch.recv_grad(y, nxt)
                    totals = self._recv_totals(s, nxt, backward=True)  # every layer's, from the last stage
                    aux = self._router_loss(aux, terms, totals, total)
                    aux = None if aux is None else aux.float() * aux_weight
                roots = _roots(y, g, aux)
                if a.kind == B:
                    grad_sync.begin(sync=i == self.sync_at)
                    torch.autograd.backward(*roots)
                    del saved[key]
                    if s > 0:
                        ch.send_grad(x.grad, prv)
                else:  # input gradient only; the graph is kept for BW
                    if s > 0:
                        (gx,) = torch.autograd.grad(roots[0], (x,), roots[1], retain_graph=True)
                        ch.send_grad(gx, prv)
                    saved[key] = [None, None, roots, None, None, None]
                if s > 0 and totals is not None:
                    ch.send_terms(totals, prv, backward=True)
            else:  # BW: the same output gradients into this chunk's parameters only
                roots = saved.pop(key)[2]
                grad_sync.begin(sync=i == self.sync_at)
                torch.autograd.backward(*roots, inputs=split.chunk_parameters(a.chunk))
        ch.finish()
        if self.sync_at is None:  # tied copies summed before the reduction, which runs now
            self._sum_tied_grads(grad_sync)
            grad_sync.begin(sync=True)
        grad_sync.finish()
        comm.all_reduce(total, split.axis)  # each stage's part: the loss on the last, router losses where they ran
        return total

    def _recv_totals(self, s: int, peer: int, backward: bool) -> torch.Tensor | None:
        """transformers' pooled balancing loss: the router totals that ride with the activation
        (the layers before stage ``s``; zeros on stage 0) or with the gradient (every layer's, which
        the last stage summed); None for any other model."""
        if not self.pooled:
            return None
        if not backward and s == 0:
            return torch.zeros(self.pooled + 1, dtype=torch.float64, device=self.device)
        return self.channels.recv_terms(self.pooled + 1, peer, backward)

    def _router_loss(self, aux, terms, totals, total: torch.Tensor):
        """This stage's router losses for one micro-batch: behemoth layers' ``aux`` plus, given
        every layer's ``totals``, transformers' pooled share of this stage's ``terms``; their value
        is added to ``total[1]``. None when the stage has none."""
        if terms is not None and totals is not None:
            pooled = self.experts.pooled_loss(terms.prob_sums_E, totals)
            aux = pooled if aux is None else aux + pooled
        if aux is not None:
            total[1] += aux.detach().double()
        return aux

    def _sum_tied_grads(self, grad_sync) -> None:
        """Sum the gradients of tied weights held on two ranks (embedding on the first stage, head on
        the last), in place in the fp32 gradients the sync will reduce (``ensure_grad``: also under
        bf16 parameters, whose own ``.grad`` is bf16); both ranks add in the same order, so the
        copies stay bit-identical. Point-to-point over ``pp``, one exchange per tied pair."""
        split, rank = self.split, self.split.rank
        for a, ra, b, rb in split.tied:
            if rank not in (ra, rb):
                continue
            g = grad_sync.ensure_grad(self.model.get_parameter(a if rank == ra else b))
            other = comm.exchange(g, split.axis, rb if rank == ra else ra)
            if rank == ra:
                g.add_(other)
            else:
                g.copy_(other + g)

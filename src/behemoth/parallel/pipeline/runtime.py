"""Pipeline runtime prototype: one rank's stage of a serial model, and the executor of a
schedule's action list with real point-to-point transfers.

Implements the synchronous pipelines of GPipe (Huang et al. 2019) and 1F1B / PipeDream-Flush
(Narayanan et al. 2021) on top of the pure pieces in ``schedules.py`` (which actions, in
which order) and ``partition.py`` (which modules on which rank). Not yet wired into
``Plan``/``boost`` (``Plan.check_supported`` still refuses ``pp > 1``): callers build a
:class:`PipelineStage` over the mesh's ``pp`` axis, an optimizer over
``stage.parameters()``, and call :func:`run_schedule` once per step.

Distributed contract of :func:`run_schedule` (axis ``pp``, all traffic through
``comm.py`` and its ledger):

* every rank is given *all* micro-batches of the step (``input_ids`` and ``labels``): the
  first stage reads the ids, the last the labels, and every rank derives the shape of
  every message from ``input_ids.shape`` (``(rows, seq, hidden)`` in the stage's dtype), so
  there is no per-step shape handshake;
* ``F`` of stage ``s > 0`` posts the activation receive right before it runs and waits on
  it; ``F`` of stage ``s < pp-1`` sends its output with ``isend``; ``B`` mirrors this for
  output gradients. Activations and gradients travel on separate tags; sends are never
  waited on mid-step (their handles are kept until the step ends), which with a schedule
  that ``schedules.simulate`` accepts cannot deadlock;
* the loss of a micro-batch is the sum of its token losses divided by the *global* token
  count of the step (counted on every rank from the labels it was given), so gradients
  add up to the serial mean-loss gradient; the step's loss is summed on the last stage
  and broadcast over ``pp``: every rank returns the same float;
* tied input/output embeddings on different stages: the last stage holds a copy of the
  tied weight, initialised equal; after the backward the two copies' gradients are
  summed (a point-to-point exchange between the first and the last rank, so no extra
  process group is needed), so identical optimizer steps keep them identical.

Tested in tests/dist/test_pipeline_runtime.py (pp=2, GPipe and 1F1B, against serial
training with SGD and AdamW).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ... import comm
from ...comm import Axis
from .partition import (PIPELINE_LAYOUTS, estimate_block_costs, find_tied_parameters, stage_modules,
                        tied_parameter_ranks, virtual_partition)
from .schedules import B, F as FWD, Action, check_schedule, simulate

__all__ = ["PipelineStage", "run_schedule", "STAGE_ENDS", "ACT_TAG", "GRAD_TAG"]

IGNORE_INDEX = -100
ACT_TAG, GRAD_TAG = 1, 2
"""Message tags: activations (forward) and output gradients (backward) never share a channel."""


# -- what the first stage runs before the blocks and the last after them ---------------------
def _gpt_embed(model: nn.Module, input_ids_BS: torch.Tensor) -> torch.Tensor:
    pos_1S = torch.arange(input_ids_BS.shape[1], device=input_ids_BS.device).unsqueeze(0)
    return model.drop(model.wte(input_ids_BS) + model.wpe(pos_1S))


def _gpt_head(model: nn.Module, x_BSH: torch.Tensor) -> torch.Tensor:
    return model.lm_head(model.ln_f(x_BSH))


STAGE_ENDS: dict[str, tuple[Callable, Callable]] = {
    "GPT": (_gpt_embed, _gpt_head),
}
"""Per model class: ``(embed(model, input_ids_BS) -> x_BSH, head(model, x_BSH) -> logits_BSV)``,
the parts of the serial ``forward`` around the blocks (the modules of ``PIPELINE_LAYOUTS``'
``pre`` and ``post``)."""


class PipelineStage:
    """This rank's share of a serial model: the modules ``partition.stage_modules`` assigns
    to pipeline rank ``pp_axis.rank`` (embedding first, blocks balanced by cost, final norm
    and head last). Holds references into ``model`` (which it takes ownership of: a tied
    head on the last stage is untied into a copy); the other stages' modules stay allocated
    but unused in this prototype.

    ``stages``: optional user partition ``[(start, end), ...]`` of the blocks (half-open).
    """

    def __init__(self, model: nn.Module, pp_axis: Axis, *, stages: Sequence[tuple[int, int]] | None = None) -> None:
        family = type(model).__name__
        if family not in PIPELINE_LAYOUTS or family not in STAGE_ENDS:
            raise ValueError(f"PipelineStage: no pipeline layout for {family}; the runtime prototype knows "
                             f"{sorted(set(PIPELINE_LAYOUTS) & set(STAGE_ENDS))}. Add its embed/head to STAGE_ENDS.")
        self.model, self.axis, self.layout = model, pp_axis, PIPELINE_LAYOUTS[family]
        self.pp, self.rank = pp_axis.size, pp_axis.rank
        self.is_first, self.is_last = self.rank == 0, self.rank == self.pp - 1
        costs = estimate_block_costs(model.config)
        self.partition = virtual_partition(costs.blocks, self.pp, 1, first_extra=costs.first_extra,
                                           last_extra=costs.last_extra, stages=stages)
        self.block_range = self.partition[self.rank][0]
        self.all_module_names = [row[0] for row in stage_modules(self.layout, self.partition)]
        self.module_names = self.all_module_names[self.rank]
        self.blocks = [model.get_submodule(f"{self.layout.blocks}.{i}") for i in range(*self.block_range)]
        self._embed, self._head = STAGE_ENDS[family]
        # Serial state-dict keys, their shapes and owning rank (for full_state_dict()).
        self._serial_meta = {k: (v.shape, v.dtype, self._owner(k)) for k, v in model.state_dict().items()}
        # Tied pairs split across stages: the last stage gets its own copy, initialised equal.
        confirmed = {frozenset(g) for g in find_tied_parameters(model)}
        self.tied = [(a, ra, b, rb) for a, ra, b, rb in tied_parameter_ranks(self.layout, self.pp)
                     if frozenset((a, b)) in confirmed and ra != rb]
        for a, ra, b, rb in self.tied:
            if self.rank == rb:
                mod_name, _, attr = b.rpartition(".")
                setattr(model.get_submodule(mod_name), attr, nn.Parameter(model.get_parameter(a).detach().clone()))

    def _owner(self, key: str) -> int:
        for r, names in enumerate(self.all_module_names):
            if any(key == n or key.startswith(n + ".") for n in names):
                return r
        raise ValueError(f"state-dict key {key!r} belongs to no pipeline stage's modules {self.all_module_names}.")

    # -- parameters and state ----------------------------------------------------------
    def named_parameters(self):
        """This stage's parameters under their serial names (a tensor once)."""
        seen = set()
        for name in self.module_names:
            for n, p in self.model.get_submodule(name).named_parameters(prefix=name):
                if id(p) not in seen:
                    seen.add(id(p))
                    yield n, p

    def parameters(self):
        return [p for _, p in self.named_parameters()]

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This stage's entries of the serial model's state dict (serial keys)."""
        out = {}
        for name in self.module_names:
            out.update(self.model.get_submodule(name).state_dict(prefix=name + "."))
        return out

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The serial model's state dict, assembled on every rank: each stage broadcasts its
        entries over ``pp`` (one flat broadcast per owning rank and dtype)."""
        local = self.state_dict()
        out: dict[str, torch.Tensor] = {}
        for src in range(self.pp):
            for dtype in dict.fromkeys(d for _, d, r in self._serial_meta.values() if r == src):
                keys = [k for k, (_, d, r) in self._serial_meta.items() if r == src and d == dtype]
                if src == self.rank:
                    flat = torch.cat([local[k].detach().reshape(-1) for k in keys])
                else:
                    flat = torch.empty(sum(self._serial_meta[k][0].numel() for k in keys), dtype=dtype,
                                       device=self.device)
                comm.broadcast(flat, self.axis, src)
                for k, piece in zip(keys, flat.split([self._serial_meta[k][0].numel() for k in keys])):
                    out[k] = piece.view(self._serial_meta[k][0]).clone()
        return {k: out[k] for k in self._serial_meta}

    @property
    def device(self) -> torch.device:
        return self.parameters()[0].device

    @property
    def dtype(self) -> torch.dtype:
        return self.parameters()[0].dtype

    # -- compute ----------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """First stage: ``input_ids_BS -> x_BSH``; others ``x_BSH -> x_BSH``; the last ends
        with the head: ``-> logits_BSV``. No communication."""
        if self.is_first:
            x = self._embed(self.model, x)
        for block in self.blocks:
            x = block(x)
        return self._head(self.model, x) if self.is_last else x

    def activation_shape(self, input_ids_BS: torch.Tensor) -> tuple[int, ...]:
        """Shape of every message between stages for a micro-batch: ``(B, S, hidden)``."""
        return (*input_ids_BS.shape, self.model.config.hidden)

    def sync_tied_grads(self) -> None:
        """Sum the gradients of tied weights held on two stages (exchange between the two
        ranks, then add: both ranks get the same sum, bit for bit)."""
        for a, ra, b, rb in self.tied:
            if self.rank not in (ra, rb):
                continue
            p = self.model.get_parameter(a if self.rank == ra else b)
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            other = comm.exchange(g, self.axis, rb if self.rank == ra else ra)
            # Same operand order on both ranks (first stage's part + last stage's part).
            p.grad = g + other if self.rank == ra else other + g


# -- the executor ------------------------------------------------------------------------
def run_schedule(stage: PipelineStage, actions: Sequence[Sequence[Action]], microbatches: Sequence[dict], *,
                 check: bool = True) -> float:
    """Run one step's forwards and backwards of ``actions`` (``schedules.make_schedule(name,
    pp, m)``, one list per pipeline rank) on ``microbatches`` (``m`` dicts with
    ``input_ids_BS`` and ``labels_BS``, the same on every rank); accumulate gradients into
    the stage's parameters (the caller zeroes them and steps the optimizer) and sum tied
    gradients across stages. Returns the global mean token loss, the same float on every
    rank. Communication: see the module docstring; the only collective besides the
    point-to-point traffic is one scalar broadcast of the loss (and the tied-gradient
    exchange between the first and last rank).
    """
    pp, rank = stage.pp, stage.rank
    if check:  # pure and cheap: refuse a schedule that could deadlock before any message
        m, v = check_schedule(actions, pp)
        simulate(actions, pp)
        if v != 1:
            raise ValueError(f"run_schedule: the prototype runs one model chunk per rank; the schedule has v={v}. "
                             f"Use 'gpipe' or '1f1b'.")
        if m != len(microbatches):
            raise ValueError(f"run_schedule: the schedule has {m} micro-batches but {len(microbatches)} were "
                             f"given; build it with make_schedule(name, pp={pp}, m={len(microbatches)}).")
    if any(a.kind not in (FWD, B) for a in actions[rank]):
        raise ValueError("run_schedule: the prototype runs F and B actions only (no BI/BW split yet).")
    num_tokens = sum(int((mb["labels"] != IGNORE_INDEX).sum()) for mb in microbatches)
    if num_tokens == 0:
        raise ValueError("run_schedule: the step has no labelled token (every label is -100).")
    device, dtype = stage.device, stage.dtype
    saved: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}  # mb -> (stage input, output or loss)
    sends: list[comm.AsyncCollective] = []  # kept until the step ends
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    for a in actions[rank]:
        mb = microbatches[a.microbatch]
        shape = stage.activation_shape(mb["input_ids"])
        if a.kind == FWD:
            if stage.is_first:
                x = mb["input_ids"].to(device)
            else:
                x = comm.recv_async(shape, dtype, stage.axis, rank - 1, ACT_TAG, device).wait().requires_grad_()
            out = stage.forward(x)
            if stage.is_last:
                loss = F.cross_entropy(out.float().flatten(0, -2), mb["labels"].to(device).flatten(),
                                       ignore_index=IGNORE_INDEX, reduction="sum") / num_tokens
                loss_sum += loss.detach().double()
                out = loss
            else:
                sends.append(comm.send_async(out, stage.axis, rank + 1, ACT_TAG))
            saved[a.microbatch] = (None if stage.is_first else x, out)
        else:
            x, out = saved.pop(a.microbatch)
            if stage.is_last:
                out.backward()
            else:
                grad = comm.recv_async(shape, dtype, stage.axis, rank + 1, GRAD_TAG, device).wait()
                torch.autograd.backward(out, grad)
            if not stage.is_first:
                sends.append(comm.send_async(x.grad, stage.axis, rank - 1, GRAD_TAG))
    for s in sends:
        s.wait()
    stage.sync_tied_grads()
    comm.broadcast(loss_sum, stage.axis, pp - 1)
    return loss_sum.item()

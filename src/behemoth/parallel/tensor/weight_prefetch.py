"""Forward prefetch of the grid Linears' weight columns (2D, 2.5D).

A SUMMA Linear gathers its weight column W(:, j) over ``tp_row`` before its GEMM
(:class:`~.grid.SummaFn`). That gather depends on nothing the forward computes, yet issued
where the Linear runs it waits, on the GPU, for the compute stream to reach that point on both
members of ``tp_row``: one synchronisation of the grid column per Linear, on the forward's
critical path. :class:`WeightPrefetch` issues those gathers ahead instead: it records the order
in which the Linears run; when a pass starts again (a Linear of the recorded pass runs again),
it starts the gathers of every Linear that followed that one, in that order, and each Linear
then takes its own. The first pass only records.

Each Linear is gathered exactly once per pass, as without prefetch (the ledger books the same
calls and bytes). The gathered weights are those each Linear keeps for its backward anyway
(``keep_gathered_weight``), so the peak memory at the end of the forward does not change;
they are alive from the start of the pass instead of from each Linear's forward.

A Linear takes part only when nothing else manages its parameters: no forward pre-hooks (ZeRO-3
gathers a module's parameters in one, and frees them after), a weight with storage. A pass is
prefetched only with gradients enabled, outside the backward (activation checkpointing's
recomputation gathers as it goes) and outside compiled code. A prefetched weight is used
only if its parameter's version, storage and the compute dtype are those it was gathered
from; otherwise it is dropped (the Linear gathers again); what no Linear took is dropped when
a Linear's backward runs, so a gathered column never outlives its forward pass. Every member of ``tp_row`` runs the
same Linears in the same order, so they issue the same gathers.

Tested in tests/dist/test_tp2d_layers.py (a chain of Linears over several passes: the
gradients and the ledger equal the non-prefetched run's).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import nn

from ... import comm
from ...comm import AsyncCollective


@dataclass
class _Pending:
    module: weakref.ref
    handle: AsyncCollective
    key: tuple


def weight_key(module: nn.Module, dtype: torch.dtype | None) -> tuple:
    """What a gathered weight column was gathered from: parameter version, storage, dtype."""
    w = module.weight
    return (w._version, w.data_ptr(), dtype)


def may_prefetch(module: nn.Module) -> bool:
    """Whether ``module``'s weight may be gathered ahead of its forward (see the module doc)."""
    return (
        module.prefetch_weight
        and module.keep_gathered_weight
        and not module._forward_pre_hooks
        and not nn.modules.module._global_forward_pre_hooks
        and module.weight.untyped_storage().nbytes() > 0
    )


def prefetching_pass() -> bool:
    """Whether the running pass may prefetch: eager, gradients on, not inside a backward."""
    return torch.is_grad_enabled() and not torch.compiler.is_compiling() and torch._C._current_graph_task_id() == -1


def gather_column(module: nn.Module, dtype: torch.dtype | None) -> AsyncCollective:
    """Start the all-gather of ``module``'s W(:, j) over ``tp_row`` (as SummaFn gathers it)."""
    w = module.weight.detach()
    if dtype is not None:
        w = w.to(dtype)
    return comm.all_gather_async(w if module.weight_layout == "in_out" else w.t(), module.grid.row_axis)


class WeightPrefetch:
    """The prefetched weight columns of the grid Linears over one ``tp_row`` group."""

    def __init__(self) -> None:
        self.order: list[weakref.ref] = []
        """The Linears of the last complete pass, in the order they ran."""
        self.recording: list[weakref.ref] = []
        self.pending: dict[int, _Pending] = {}
        self.taken = 0
        """How many prefetched weight columns the Linears used."""

    def take(self, module: nn.Module, dtype: torch.dtype | None) -> torch.Tensor | None:
        """``module``'s gathered W(:, j) in ``dtype`` if it was prefetched and is still valid;
        else None (the Linear gathers it itself). A Linear that already ran in the pass being
        recorded starts a new pass: the recorded order becomes the pass order, and the gathers
        of the Linears that follow this one in it are issued."""
        entry = self.pending.pop(id(module), None)
        if entry is not None:
            got = entry.handle.wait()
            if entry.module() is module and entry.key == weight_key(module, dtype):
                self.recording.append(weakref.ref(module))
                self.taken += 1
                return got
        self.drop()  # what is left pending: this pass runs differently from the last one
        if any(r() is module for r in self.recording):
            self.order, self.recording = self.recording, []
        mods = [r() for r in self.order]
        start = next((i for i, m in enumerate(mods) if m is module), None)
        if start is None:
            self.recording.append(weakref.ref(module))
            return None
        self.recording = [weakref.ref(module)]
        for m in mods[start + 1 :]:
            if m is None or m is module or id(m) in self.pending or not may_prefetch(m):
                continue
            self.pending[id(m)] = _Pending(weakref.ref(m), gather_column(m, dtype), weight_key(m, dtype))
        return None

    def drop(self) -> None:
        """Drop the prefetched columns no Linear took: the backward of a Linear calls this, so
        none outlives the forward pass it was gathered for (and can see the weights change)."""
        if self.pending:
            for left in self.pending.values():
                left.handle.wait()
            self.pending.clear()


_BY_GROUP: dict[int, WeightPrefetch] = {}


def prefetch_of(module: nn.Module) -> WeightPrefetch:
    """The :class:`WeightPrefetch` of ``module``'s ``tp_row`` group (one per process group)."""
    key = id(module.grid.row_axis.group)
    pf = _BY_GROUP.get(key)
    if pf is None:
        pf = _BY_GROUP[key] = WeightPrefetch()
    return pf

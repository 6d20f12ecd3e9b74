"""Deferred reductions of the grid layers' parameter gradients (2D, 2.5D).

A parameter of a grid layer is summed over an axis where its gradient has parts: a SUMMA
Linear's weight column ``dW(:, j)`` is reduce-scattered over ``tp_row`` (:class:`~.grid.SummaFn`),
biases and norm weights (replicated over ``tp_row``) are all-reduced there, and under Tesseract
every one of them is all-reduced over ``tp_depth`` too. Nothing in the backward pass reads those
sums: only the optimizer (and the data-parallel reduction before it) does. Yet a layer that
returns a summed gradient to autograd must wait for its collective first, so each one puts a
wait, on the GPU a synchronisation of the compute stream with the other members of ``tp_row``,
on the backward's critical path: one per Linear for ``dW``, one per bias and one per norm.

:class:`DeferredGrads` moves those waits out of the layers, and sums the small gradients in
buckets. In every forward pass of the model (opened and closed by hooks on the model) it routes
each layer's parameters through an autograd node, :class:`LandGradsFn` (identity forward), and
the layer computes with its outputs. In the backward each layer issues its weight's
reduce-scatter as before, at the same point, but hands the in-flight handle to the pass
(:class:`GradPass`); its bias's and norm weights' gradients it hands over unsummed, into a
bucket per axis and dtype; and it returns zero placeholders to autograd. The layer's node then
waits for its reductions -- starting the buckets' all-reduces first if one of its gradients is
still in one (:meth:`GradPass.flush`) --, completes each gradient (cast, the ``tp_depth``
all-reduce under Tesseract) and returns it, so each parameter's gradient lands in ``.grad`` (and
its post-accumulate hooks, the data-parallel buckets', run) once, complete, before ``backward()``
returns. Autograd runs, of the nodes that are ready, the newest first; a layer's node is made
:attr:`DeferredGrads.lead` layers before the layer in the forward (in the order of the last pass
that began with the same layer), so it runs when the backward has gone past that earlier layer:
each reduction has several layers' backward to finish in, and a bucket holds the vectors of the
``lead + 1`` layers or so whose backward ran since the last flush -- one all-reduce where there
were one per bias and one per norm (a GPT block's six in under one). At most
:attr:`GradPass.in_flight` handles stay unwaited (the oldest is waited as a new one is issued):
they hold the reductions' buffers.

Every element is summed over the same ranks, in the same dtype, as without deferral, so the
gradients are the same bits where an all-reduce's sum of an element does not depend on where in
the tensor it sits (two ranks, as at q = 2); the ledger books the same bytes, in fewer
all-reduces. (Under Tesseract the ``tp_depth`` all-reduce of a weight runs when its node lands
it, that of a bucket when its first gradient lands: once, where a layer applied twice in one
pass would have run it once per use.) A layer takes part only when nothing else manages its
parameters (no forward pre-hooks: ZeRO-3 gathers in one) and in eager forward passes with
gradients on (compiled blocks, activation checkpointing's recomputation and evaluation compute
as before, summing where they are). A parameter another module also uses (a head tied to the
token embedding) gets that module's gradient as before: autograd adds the two when both are in.

Tested in tests/dist/test_tp2d_deferred_grads.py (a model of grid layers: values equal the
non-deferred run's, the ledger's bytes too in the flushes' calls, gradients land ``lead`` layers
late) and, through
the engine, in tests/dist/test_tp2d.py and the pipeline tests (zero-bubble, interleaved).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from ... import comm
from ...comm import Axis
from .grid import Grid

__all__ = ["DeferredGrads", "GradPass", "LandGradsFn", "deferred_pass", "install_deferred_grads"]


@dataclass
class _Reduction:
    """A reduction handed to a :class:`GradPass`: of one layer's weight (:meth:`GradPass.put`) or of
    a bucket of several layers' vectors (:meth:`GradPass.flush`)."""

    ids: tuple[int, ...]
    """The parameters whose gradients ``finish(result)`` gives, in order (one may come twice: a
    layer that ran twice in the pass)."""
    handle: comm.AsyncCollective | None
    """In flight; None once waited for (``result``)."""
    finish: Callable[[torch.Tensor], list[torch.Tensor]]
    result: torch.Tensor | None = None
    bucket: bool = False
    """A bucket: summed over ``tp_depth`` as a whole, where the pass sums the others' gradients one by one."""


class GradPass:
    """One forward pass's parameters (in :class:`LandGradsFn`'s input order) and the reductions
    of their gradients that its layers issued and did not wait for (:meth:`put`), or handed over
    unsummed (:meth:`add`: biases and norm weights, summed in buckets)."""

    in_flight: int = 16
    """Handles left unwaited at most; issuing one more waits for the oldest."""

    def __init__(self, grid: Grid, params: list[nn.Parameter]) -> None:
        self.grid = grid
        self.index = {id(p): i for i, p in enumerate(params)}
        self.meta = [(p.shape, p.dtype, p.device) for p in params]
        self.entries: list[_Reduction] = []
        self.buckets: dict[tuple, tuple[Axis, list]] = {}  # (axis name, dtype) -> (axis, [(index, gradient)])
        self.pending: set[int] = set()  # indices in the buckets
        self.zeros: dict[tuple, torch.Tensor] = {}  # (dtype, device) -> the placeholders' one zero
        self.deferred = 0
        """Reductions handed to this pass (:meth:`put`) and gradients handed over unsummed (:meth:`add`)."""
        self.flushes = 0
        """Buckets reduced (:meth:`flush`): one all-reduce each over its axis (and one over ``tp_depth``)."""

    @staticmethod
    def active(defer: tuple | None) -> tuple | None:
        """``defer`` (``(pass, ..., the pass's LandGradsFn node)``, as a layer hands it to its
        autograd Function) if the running backward will land the pass's gradients, else None:
        a backward towards the inputs only (a zero-bubble pipeline's input half, which keeps the
        graph for a second, weight backward) runs no landing, so the layer sums as before."""
        if defer is None or not torch._C._will_engine_execute_node(defer[-1]):
            return None
        return defer

    def placeholder(self, i: int) -> torch.Tensor:
        """The zero gradient a layer returns to autograd for parameter ``i`` (no memory: zero strides)."""
        shape, dtype, device = self.meta[i]
        zero = self.zeros.get((dtype, device))
        if zero is None:
            zero = self.zeros[(dtype, device)] = torch.zeros((), dtype=dtype, device=device)
        return zero.expand(shape)

    def put(self, indices: tuple[int, ...], handle: comm.AsyncCollective, finish) -> None:
        """Hand over the in-flight reduction ``handle`` of parameters ``indices`` (of one layer):
        ``finish(result)`` gives their gradients (each summed over ``tp_row``, in the parameter's
        shape and dtype)."""
        self._enter(_Reduction(indices, handle, finish))
        self.deferred += 1

    def add(self, i: int, grad: torch.Tensor, axis: Axis) -> None:
        """Hand over parameter ``i``'s gradient as this rank computed it (a bias's, a norm
        weight's: small), to be summed over ``axis`` (and ``tp_depth``) together with the others
        of its dtype handed over since the last :meth:`flush`, in one all-reduce. ``grad`` is the
        layer's own tensor (the all-reduce may run on it in place)."""
        key = (axis.name, grad.dtype)
        if key not in self.buckets:
            self.buckets[key] = (axis, [])
        self.buckets[key][1].append((i, grad))
        self.pending.add(i)
        self.deferred += 1

    def flush(self) -> None:
        """Start the all-reduce of each bucket, its gradients flattened into one tensor in the
        order they were handed over: an element is summed over the same ranks, in the same
        dtype, as it would be alone. :meth:`land` calls it when a layer's landing needs a
        gradient still in a bucket, so a bucket holds what the layers between a layer's backward
        and its landing (:attr:`DeferredGrads.lead` layers later) handed over."""
        for axis, parts in self.buckets.values():
            flat = torch.cat([g.reshape(-1) for _, g in parts]) if len(parts) > 1 else parts[0][1].reshape(-1)
            cuts, at = [], 0
            for _, g in parts:
                cuts.append((at, at + g.numel(), g.shape))
                at += g.numel()
            handle = comm.all_reduce(flat, axis, async_op=True)
            self._enter(_Reduction(tuple(i for i, _ in parts), handle, partial(_cut, cuts), bucket=True))
            self.flushes += 1
        self.buckets.clear()
        self.pending.clear()

    def _enter(self, entry: _Reduction) -> None:
        """Keep ``entry`` (in flight); past :attr:`in_flight` unwaited ones, wait for the oldest."""
        self.entries.append(entry)
        unwaited = [e for e in self.entries if e.handle is not None]
        if len(unwaited) > self.in_flight:
            oldest = unwaited[0]
            oldest.result, oldest.handle = oldest.handle.wait(), None

    def land(self, indices: tuple[int, ...], grads: tuple) -> list:
        """The complete gradients of parameters ``indices`` (one layer's), from the reductions
        handed over for them; ``grads`` are what autograd delivered for them (placeholders)."""
        mine = set(indices)
        if not mine.isdisjoint(self.pending):
            self.flush()
        depth = self.grid.depth_axis
        out: dict[int, torch.Tensor] = {}
        whole: set[int] = set()  # a bucket's: summed over tp_depth with the bucket
        kept = []
        for e in self.entries:
            if mine.isdisjoint(e.ids):
                kept.append(e)
                continue
            if e.handle is not None:
                e.result, e.handle = e.handle.wait(), None
                if e.bucket and not depth.trivial:  # Tesseract: the whole bucket over tp_depth, once
                    e.result = comm.all_reduce(e.result, depth)
            rest = []
            for i, g in zip(e.ids, e.finish(e.result)):
                if i not in mine:
                    rest.append(i)
                    continue
                out[i] = g if i not in out else out[i] + g
                if e.bucket:
                    whole.add(i)
            if rest:  # a bucket's other layers land later
                e.ids, e.finish = tuple(rest), partial(_pick, e.finish, e.ids, set(rest))
                kept.append(e)
        self.entries = kept
        for i, g in zip(indices, grads):  # placeholders (summed if the layer ran twice), or None
            if g is not None and i not in out:
                raise RuntimeError(
                    "deferred gradient reductions (tensor parallelism, grid modes): a parameter's stand-in got "
                    "a gradient from outside its layer; the layers alone may use it."
                )
        summed = [out.get(i) for i in indices]
        if not depth.trivial:  # Tesseract: summed over the depth layers too, in parameter order
            summed = [
                g if g is None or i in whole else comm.all_reduce(g.contiguous(), depth)
                for i, g in zip(indices, summed)
            ]
        return summed


def _cut(cuts, flat: torch.Tensor) -> list[torch.Tensor]:
    """A bucket's gradients: views of its reduced ``flat`` tensor (``cuts``: start, end, shape)."""
    return [flat[a:b].view(shape) for a, b, shape in cuts]


def _pick(finish, ids, keep: set[int], result: torch.Tensor) -> list[torch.Tensor]:
    """Of ``finish(result)`` (one gradient per index of ``ids``), those of the indices in ``keep``."""
    return [g for i, g in zip(ids, finish(result)) if i in keep]


class LandGradsFn(torch.autograd.Function):
    """Identity forward (views of one layer's parameters, for it to compute with); backward:
    :meth:`GradPass.land` -- waits for the reductions the layer deferred to the pass and returns
    the parameters' complete gradients (no collective of its own on ``tp_row``; under Tesseract
    the all-reduce of each over ``tp_depth``). One node per layer: a layer that does not run in
    a pass leaves its node out of the backward (autograd would otherwise hand its parameters
    ``None`` gradients and run their post-accumulate hooks)."""

    @staticmethod
    def forward(ctx, grad_pass: GradPass, indices: tuple[int, ...], *params):
        ctx.grad_pass, ctx.indices = grad_pass, indices
        ctx.set_materialize_grads(False)
        return tuple(p.view_as(p) for p in params)

    @staticmethod
    def backward(ctx, *grads):
        return (None, None, *ctx.grad_pass.land(ctx.indices, grads))


def eager_training_pass() -> bool:
    """Whether the running forward may defer: eager, gradients on, not inside a backward."""
    return torch.is_grad_enabled() and not torch.compiler.is_compiling() and torch._C._current_graph_task_id() == -1


class DeferredGrads:
    """The deferred gradient reductions of one model's grid layers (see the module docstring).
    :meth:`open` (a forward pre-hook on the model) starts a pass, :meth:`close` (a forward hook)
    ends it; each layer asks :func:`deferred_pass` for the pass and its parameters' stand-ins.

    A layer's landing node is made :attr:`lead` layers ahead of it in the forward, in the order
    the layers ran in the last pass that began with the same layer: autograd runs it once the
    backward has gone past that earlier layer, so the layer's gradients land ``lead`` layers
    after its own backward (not all at the end: the data-parallel buckets still reduce during
    the backward). The first pass (or a layer the last one did not run) makes the node at the
    layer's own forward: its gradients land right after its backward, still waited for there."""

    lead: int = 6
    """How many layers ahead of a layer its landing node is made (a GPT block: 2 norms and 4
    Linears)."""

    def __init__(self, grid: Grid, groups: list[list[nn.Parameter]]) -> None:
        self.grid, self.groups = grid, groups
        self.group_of = {id(p): k for k, ps in enumerate(groups) for p in ps}
        self.orders: dict[int, list[int]] = {}
        """First layer of a pass -> the layers (groups) that pass used, in order."""
        self.current: GradPass | None = None
        self.stand_ins: dict[int, torch.Tensor] = {}
        self.running: list[int] = []
        self.used: set[int] = set()
        self.ahead: dict[int, int] = {}  # group -> its position in the order followed now
        self.order: list[int] = []
        self.passes = 0

    def open(self, module=None, args=None) -> None:
        self.close()
        if not eager_training_pass():
            return
        params = [p for ps in self.groups for p in ps if p.requires_grad and p.untyped_storage().nbytes() > 0]
        if params:
            self.current = GradPass(self.grid, params)
            self.passes += 1

    def close(self, module=None, args=None, output=None) -> None:
        if self.running:
            self.orders[self.running[0]] = self.running
        self.current, self.stand_ins, self.running, self.used, self.ahead, self.order = None, {}, [], set(), {}, []

    def _make(self, k: int) -> None:
        """Make group ``k``'s landing node and stand-ins in the open pass (once)."""
        gp = self.current
        ps = [p for p in self.groups[k] if id(p) in gp.index]
        if ps and id(ps[0]) not in self.stand_ins:
            stand_ins = LandGradsFn.apply(gp, tuple(gp.index[id(p)] for p in ps), *ps)
            self.stand_ins.update((id(p), s) for p, s in zip(ps, stand_ins))

    def use(self, params) -> list:
        """The stand-ins of ``params`` (one layer's, about to run); makes the landing nodes of the
        layers :attr:`lead` ahead of it."""
        ks = [self.group_of[id(p)] for p in params if p is not None and id(p) in self.group_of]
        for k in ks:
            self._make(k)
            if k not in self.used:
                if not self.running:  # the pass's first layer: follow the last pass that began here
                    self.order = self.orders.get(k, [])
                    self.ahead = {g: i for i, g in enumerate(self.order)}
                self.running.append(k)
                self.used.add(k)
        at = max((self.ahead[k] for k in ks if k in self.ahead), default=None)
        if at is not None:
            for g in self.order[at + 1 : at + 1 + self.lead]:
                self._make(g)
        return [self.stand_in(p) for p in params]

    def stand_in(self, p: nn.Parameter | None) -> torch.Tensor | None:
        """``p``'s stand-in in the open pass; ``p`` itself if it needs no gradient; None if it
        needs one but has no valid stand-in (the layer then sums its gradient itself)."""
        if p is None or not p.requires_grad:
            return p
        s = self.stand_ins.get(id(p))
        return s if s is not None and s.data_ptr() == p.data_ptr() and s.shape == p.shape else None


def deferred_pass(module: nn.Module, *params) -> tuple[GradPass, list] | None:
    """``(pass, [stand-in of each of params])`` when ``module`` defers its gradient reductions in
    the running forward, else None (the layer then sums its gradients itself, as before). The
    layer hands its autograd Function ``(pass, index of each parameter, node)``, ``node`` being
    the stand-ins' ``grad_fn`` (:meth:`GradPass.active`)."""
    owner = module.__dict__.get("deferred_grads")
    if owner is None or owner.current is None or not eager_training_pass():
        return None
    if module._forward_pre_hooks or nn.modules.module._global_forward_pre_hooks:
        return None
    stand_ins = owner.use(params)
    if any(s is None and p is not None for s, p in zip(stand_ins, params)):
        return None
    if all(s is p for s, p in zip(stand_ins, params)):  # nothing to sum: no parameter needs a gradient
        return None
    return owner.current, stand_ins


def install_deferred_grads(model: nn.Module, grid: Grid, layers: list[nn.Module]) -> DeferredGrads | None:
    """Defer the gradient reductions of ``layers`` (grid Linears and norms of ``model``) to the end
    of each backward pass: hooks on ``model`` open and close the passes. None when no axis sums
    them (q = d = 1)."""
    if grid.row_axis.trivial and grid.depth_axis.trivial:
        return None
    groups, seen = [], set()
    for layer in layers:  # one group per layer (a parameter two layers share: the first one's)
        groups.append([p for p in layer.parameters(recurse=False) if id(p) not in seen])
        seen.update(id(p) for p in groups[-1])
    if not seen:
        return None
    deferred = DeferredGrads(grid, [ps for ps in groups if ps])
    for layer in layers:
        layer.deferred_grads = deferred
    model.register_forward_pre_hook(deferred.open)
    model.register_forward_hook(deferred.close)
    return deferred

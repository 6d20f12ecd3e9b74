"""Deferred reductions of the grid layers' parameter gradients (2D, 2.5D).

A parameter of a grid layer is summed over an axis where its gradient has parts: a SUMMA
Linear's weight column ``dW(:, j)`` is reduce-scattered over ``tp_row`` (:class:`~.grid.SummaFn`),
biases and norm weights (replicated over ``tp_row``) are all-reduced there, and under Tesseract
every one of them is all-reduced over ``tp_depth`` too. Nothing in the backward pass reads those
sums: only the optimizer (and the data-parallel reduction before it) does. Yet a layer that
returns a summed gradient to autograd must wait for its collective first, so each one puts a
wait, on the GPU a synchronisation of the compute stream with the other members of ``tp_row``,
on the backward's critical path: one per Linear for ``dW``, one per bias and one per norm.

:class:`DeferredGrads` moves those waits out of the layers. In every forward pass of the model
(opened and closed by hooks on the model) it routes each layer's parameters through an autograd
node, :class:`LandGradsFn` (identity forward), and the layer computes with its outputs. In the
backward each layer issues its reductions as before, at the same points, but hands the
in-flight handles to the pass (:class:`GradPass`) and returns zero placeholders to autograd; the
layer's node then waits for them, completes each gradient (cast, the ``tp_depth`` all-reduce
under Tesseract) and returns it, so each parameter's gradient lands in ``.grad`` (and its
post-accumulate hooks, the data-parallel buckets', run) once, complete, before ``backward()``
returns. Autograd runs, of the nodes that are ready, the newest first; a layer's node is made
:attr:`DeferredGrads.lead` layers before the layer in the forward (in the order of the last pass
that began with the same layer), so it runs when the backward has gone past that earlier layer:
each reduction has several layers' backward to finish in. At most :attr:`GradPass.in_flight`
handles stay unwaited (the oldest is waited as a new one is issued): they hold the reductions'
buffers.

The collectives are the same calls and bytes as without deferral (the ledger books the same
entries), issued at the same points; only where the compute stream waits for them moves. (Under
Tesseract the ``tp_depth`` all-reduce of a parameter runs when its node lands it: once, where a
layer applied twice in one pass would have run it once per use.) A layer takes part only when
nothing else manages its parameters (no forward pre-hooks: ZeRO-3 gathers in one) and in eager
forward passes with gradients on (compiled blocks, activation checkpointing's recomputation and
evaluation compute as before, summing where they are). A parameter another module also uses (a
head tied to the token embedding) gets that module's gradient as before: autograd adds the two
when both are in.

Tested in tests/dist/test_tp2d_deferred_grads.py (a model of grid layers: values and ledger equal
the non-deferred run's, gradients land ``lead`` layers late) and, through
the engine, in tests/dist/test_tp2d.py and the pipeline tests (zero-bubble, interleaved).
"""

from __future__ import annotations

import torch
from torch import nn

from ... import comm
from .grid import Grid

__all__ = ["DeferredGrads", "GradPass", "LandGradsFn", "deferred_pass", "install_deferred_grads"]


class GradPass:
    """One forward pass's parameters (in :class:`LandGradsFn`'s input order) and the reductions
    of their gradients that its layers issued and did not wait for."""

    in_flight: int = 16
    """Handles left unwaited at most; issuing one more waits for the oldest."""

    def __init__(self, grid: Grid, params: list[nn.Parameter]) -> None:
        self.grid = grid
        self.index = {id(p): i for i, p in enumerate(params)}
        self.meta = [(p.shape, p.dtype, p.device) for p in params]
        self.entries: list[list] = []  # [indices, handle, finish, result or None]
        self.zeros: dict[tuple, torch.Tensor] = {}  # (dtype, device) -> the placeholders' one zero
        self.unwaited = 0
        self.deferred = 0
        """Reductions handed to this pass."""

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
        self.entries.append([indices, handle, finish, None])
        self.deferred += 1
        self.unwaited += 1
        if self.unwaited > self.in_flight:  # the unwaited entries are the newest
            oldest = self.entries[len(self.entries) - self.unwaited]
            oldest[3], oldest[1] = oldest[1].wait(), None
            self.unwaited -= 1

    def land(self, indices: tuple[int, ...], grads: tuple) -> list:
        """The complete gradients of parameters ``indices`` (one layer's), from the reductions
        handed over for them; ``grads`` are what autograd delivered for them (placeholders)."""
        mine = set(indices)
        out: dict[int, torch.Tensor] = {}
        kept = []
        for entry in self.entries:
            if entry[0][0] not in mine:
                kept.append(entry)
                continue
            ids, handle, finish, result = entry
            self.unwaited -= result is None
            for i, g in zip(ids, finish(handle.wait() if result is None else result)):
                out[i] = g if i not in out else out[i] + g
        self.entries = kept
        for i, g in zip(indices, grads):  # placeholders (summed if the layer ran twice), or None
            if g is not None and i not in out:
                raise RuntimeError(
                    "deferred gradient reductions (tensor parallelism, grid modes): a parameter's stand-in got "
                    "a gradient from outside its layer; the layers alone may use it."
                )
        summed = [out.get(i) for i in indices]
        depth = self.grid.depth_axis
        if not depth.trivial:  # Tesseract: summed over the depth layers too, in parameter order
            summed = [g if g is None else comm.all_reduce(g.contiguous(), depth) for g in summed]
        return summed


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

"""The ZeRO optimizer: the user's optimizer over this rank's chunks (stages 0-3, offload), and the
gradient sync of every plan (:class:`.sync.GradSync`).

Wraps the user's optimizer (STYLE #7) without replacing it: under ZeRO 1-3 the ``"params"`` of
its own param groups are re-targeted, in place, to the fp32 *master shards* of the chunks (one
flat tensor per chunk, in the chunk's group), so the object the user holds -- and any learning-rate
scheduler attached to it -- stays the optimizer that runs. Element-wise optimizers (SGD, Adam,
AdamW, ...) update a flat shard exactly as they would update each parameter, so ZeRO changes where
the arithmetic happens, not its result; an optimizer that is not element-wise is refused. Stage 0
(plain data parallelism) leaves the param groups as they are: the optimizer updates the parameters
themselves, whose gradients are views into the all-reduced buckets. At world size 1 without
offload every chunk is one shard on the device and the step is the plain optimizer's.

``step()`` (after the store has reduced the gradients):

1. fp16: one agreement whether any gradient overflowed -- over the data axis when it is sharded
   (stages 1-3), over ep for stage 0's expert chunks, and over tp and the pipeline's axes -- then
   unscale;
2. the global gradient norm (:meth:`ZeroOptimizer.grad_norm`, the one norm of every plan; :mod:`.norm`):
   squared norms of the chunks' gradients, each parameter piece weighted 1/(its copies over tp),
   summed over the axes the gradients are split on -- the serial model's norm; clip with it;
3. ``optimizer.step()`` (masters on the host run PyTorch's fused CPU kernel: Adam, AdamW, SGD,
   Adagrad, vectorised, nothing compiled at install time);
4. publish: host masters copied to the device, stages 1-2 all-gather the chunks.

Offloaded chunks may be updated on the host during the backward instead, when the update needs
nothing global first (:mod:`.overlap`); step 3 then updates the remaining masters. Where chunks
live, and ``offload='auto'``'s choice, warm-up and retries: :mod:`.auto`.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable

import torch

from ... import comm
from ...comm import Axis
from .auto import FUSED_CPU, ChunkPlacement, raise_everywhere
from .chunks import chunk_candidates, pack_buckets, pack_chunks, search_chunk_size
from .hooks import GatherHooks
from .measure import memory_report, optimizer_state_bytes
from .norm import GradNorm
from .overlap import HostUpdate
from .reduce import GradReducer
from .state import load_param_states, param_states, reload_from_params, state_to
from .store import ChunkStore

__all__ = ["ZeroOptimizer", "ELEMENTWISE_OPTIMIZERS"]

ELEMENTWISE_OPTIMIZERS = ("SGD", "Adam", "AdamW", "Adagrad", "Adamax", "NAdam", "RAdam", "RMSprop", "Rprop")


def _check_optimizer(optimizer: torch.optim.Optimizer, stage: int) -> None:
    name = type(optimizer).__name__
    if name not in ELEMENTWISE_OPTIMIZERS or type(optimizer).__module__.split(".")[:2] != ["torch", "optim"]:
        raise ValueError(
            f"Plan.zero={stage}: ZeRO updates flat shards of several parameters at once, which is exact only "
            f"for element-wise optimizers (torch.optim {', '.join(ELEMENTWISE_OPTIMIZERS)}); got {name} from "
            f"{type(optimizer).__module__}. Use one of those, or zero=0."
        )


def _by_device(tensors: list[torch.Tensor]) -> dict[torch.device, list[torch.Tensor]]:
    out: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        out.setdefault(t.device, []).append(t)
    return out


class ZeroOptimizer:
    """ZeRO ``stage`` (0: plain data parallelism) over ``axis`` for the trainable parameters of
    ``model``, updated by ``optimizer``; implements :class:`.sync.GradSync`."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        axis: Axis,
        tp: Axis,
        *,
        stage: int,
        offload: str | None = None,
        device: torch.device,
        chunk_mb: float | None = None,
        bucket_mb: float = 100.0,
        budget_bytes: int | None = None,
        prefetch: int = 2,
        world: Axis | None = None,
        param_dtype: torch.dtype | None = None,
        names: dict[int, str] | None = None,
        param_axes: Callable[[torch.nn.Parameter], tuple[Axis, Axis | None]] | None = None,
        reduce_once: bool = False,
        module_runs: Callable[[torch.nn.Module], bool] | None = None,
    ) -> None:
        if stage:
            _check_optimizer(optimizer, stage)
        self.stage, self.offload, self.axis, self.tp, self.device = stage, offload, axis, tp, device
        self.optimizer = optimizer
        self.names = dict(names) if names is not None else {id(p): n for n, p in model.named_parameters()}
        self.cls, self.name = type(optimizer), type(optimizer).__name__
        params = [p for p in model.parameters() if p.requires_grad]
        group_of = {id(p): g for g, group in enumerate(optimizer.param_groups) for p in group["params"]}
        if stage:
            for p in params:
                if id(p) not in group_of:
                    raise ValueError(
                        f"Plan.zero={stage}: a trainable parameter of shape {tuple(p.shape)} is not in the "
                        f"optimizer; ZeRO shards every trainable parameter. Add it to the optimizer or "
                        f"set requires_grad=False on it before bh.boost."
                    )
        self.params = params
        accepted = inspect.signature(self.cls.__init__).parameters
        self.defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
        sizes = [p.numel() for p in params]
        self.chunk_table: list = []
        # param_axes(p) = (the axis p is replicated over, the axis it is sharded over or None): experts
        # are replicated over ep_dp and sharded over ep, so their chunks reduce and count apart
        axes = [param_axes(p) for p in params] if param_axes is not None else None
        kinds = None
        if axes is not None:
            seen: dict[tuple, int] = {}
            kinds = [seen.setdefault((a.name, s.name if s else None), len(seen)) for a, s in axes]
        self._opt_group: list[int] = list(range(len(optimizer.param_groups)))  # chunk group -> param group
        if stage == 0:  # unsharded buckets, all-reduced (DDP's layout)
            self.chunk_elems = max(1, int(bucket_mb * 2**20 // 4))
            self.layout = pack_buckets(sizes, self.chunk_elems, kinds)
        elif kinds is None:
            self.layout = self._pack(sizes, [group_of[id(p)] for p in params], chunk_mb, world)
        else:
            # experts form chunk groups of their own, sharded over the axis they are replicated over
            # (ep_dp) while the dense chunks shard over the data axis: a chunk group per (param group, kind)
            pairs: dict[tuple[int, int], int] = {}
            groups = [pairs.setdefault((group_of[id(p)], k), len(pairs)) for p, k in zip(params, kinds)]
            self._opt_group = [g for g, _ in pairs]
            dp = {c: axes[kinds.index(k)][0].size for (_, k), c in pairs.items()}
            self.layout = self._pack(sizes, groups, chunk_mb, world, dp)
        self.store: ChunkStore | None = None
        self.placement = ChunkPlacement(
            self.layout,
            stage=stage,
            offload=offload,
            device=device,
            optimizer_cls=self.cls,
            defaults=self.defaults,
            # device bytes per element of a chunk's parameters: a bf16 copy under param_dtype (its fp32
            # master then counts with the optimizer state), else the fp32 shard that is the master
            param_bytes=2 if param_dtype is not None and stage == 3 else 4,
            budget_bytes=budget_bytes,
            host_held=self._host_held,
            device_model_bytes=lambda: sum(self.store.bytes_on("cuda").values()),
            world=world,
        )
        chunk_axes = [axes[ch.params[0]] for ch in self.layout.chunks] if axes is not None else None
        # per chunk, whose shard this rank holds: its rank on the axis the chunk is replicated over
        self._ranks = [
            (chunk_axes[ch.index][0] if chunk_axes else axis).rank if stage else 0 for ch in self.layout.chunks
        ]
        self.norm = GradNorm(
            self.layout,
            params,
            self._ranks,
            stage=stage,
            axis=axis,
            tp=tp,
            device=device,
            batched=stage == 0 and offload is None,
            # stage 0, per chunk, the axis its parameters are sharded over (their squared norms are summed over
            # it); at stages 1-3 every rank's shards are distinct pieces, all summed over the data axis
            shard_axes=[s for _, s in chunk_axes] if chunk_axes and stage == 0 else None,
            # stages 1-3: chunks sharded over the data axis times tp (an MoE block's parameters under
            # tensor parallelism) hold distinct pieces on every tp rank
            split_over_tp=[set(tp.ranks) <= set(a.ranks) for a, _ in chunk_axes]
            if chunk_axes and stage and not tp.trivial
            else None,
        )
        self.host_update = HostUpdate(
            lambda st: self.store.upload(st), device, self.cls, self.defaults, self.norm.norm_sq
        )
        on_gpu = self.placement.flags(self.placement.keep)
        self.store = ChunkStore(
            params,
            self.layout,
            axis,
            stage,
            device,
            param_on_gpu=on_gpu[0],
            optim_on_gpu=on_gpu[1],
            param_dtype=param_dtype,
            replica_axes=[a for a, _ in chunk_axes] if chunk_axes else None,
        )
        self.reducer = GradReducer(
            self.store,
            norm_of=self.norm.norm_sq if stage else None,
            on_final=self.host_update.submit if offload is not None else None,
            reduce_once=reduce_once,
        )
        self.hooks = (
            GatherHooks(
                model,
                self.store,
                prefetch,
                probe=self.placement.sample if offload == "auto" else None,
                runs=module_runs,
            )
            if stage == 3
            else None
        )
        self._user_flags = [{k: g[k] for k in ("fused", "foreach") if k in g} for g in optimizer.param_groups]
        if stage:
            self._retarget()

    # ------------------------------------------------------------------ set-up
    def _pack(self, sizes: list[int], groups: list[int], chunk_mb: float | None, world: Axis | None, dp=None):
        dp = self.axis.size if dp is None else dp  # or {chunk group: its shard count}
        if chunk_mb is None:  # least padding among 256 sizes from the largest parameter up to 1/32 of the
            # model (or twice the largest): fine enough to place a model between GPU and host, to prefetch
            # and to overlap reductions (GPT-13B: 41 chunks, 0.5% padding)
            cands = chunk_candidates(sizes)
            self.chunk_elems, self.chunk_table = search_chunk_size(sizes, dp, groups=groups, candidates=cands)
        else:
            self.chunk_elems = max(1, int(chunk_mb * 2**20 // 4))
        largest = max(sizes, default=0)
        raise_everywhere(
            world,
            None
            if self.chunk_elems >= largest
            else ValueError(
                f"Plan.chunk_mb={chunk_mb!r} holds {self.chunk_elems} fp32 elements, but a parameter has {largest} and a "
                f"parameter is never split across chunks: set chunk_mb >= {largest * 4 / 2**20:.4g}, or None to search "
                f"the size with the least padding."
            ),
            "Plan.chunk_mb",
        )
        return pack_chunks(sizes, self.chunk_elems, dp, groups=groups)

    def _retarget(self) -> None:
        """Point the user's param groups (the same dicts) at the chunks' masters; groups with masters on
        the host run the fused CPU kernel (unless the user asked for foreach), else the user's flags."""
        masters: list[list[torch.Tensor]] = [[] for _ in self.optimizer.param_groups]
        for st in self.store.chunks:
            masters[self._opt_group[st.group]].append(st.master)
        host = self.offload is not None and any(not st.optim_on_gpu for st in self.store.chunks)
        for g, ps, flags in zip(self.optimizer.param_groups, masters, self._user_flags):
            g["params"] = ps
            g.update(flags)
            if host and self.name in FUSED_CPU and not flags.get("foreach"):
                g["fused"], g["foreach"] = True, False

    def _host_held(self) -> int:
        """Host bytes held by the parameters and, once built, by the chunks and the optimizer's state
        (a re-placement may reuse them)."""
        held = sum(p.numel() * p.element_size() for p in self.params if p.device.type == "cpu")
        if self.store is not None:
            held += sum(self.store.bytes_on("cpu").values()) + optimizer_state_bytes(self.optimizer, "cpu")
        return held

    def _place(self, keep: tuple[int, int] | None) -> None:
        """Move the chunks to ``keep`` (:mod:`.auto`); each master keeps its optimizer state, moved with it."""
        if keep is None:
            return
        chunks = self.store.chunks
        old_state = {st.index: self.optimizer.state.pop(st.master, None) for st in chunks}
        param_on_gpu, optim_on_gpu = self.placement.flags(keep)
        for st in chunks:
            self.store.place(st, param_on_gpu[st.index], optim_on_gpu[st.index])
        self._retarget()  # fused/foreach follow the new placement
        for st in chunks:
            if old_state[st.index]:
                self.optimizer.state[st.master] = {
                    k: state_to(v, st.master.device, self.optimizer) for k, v in old_state[st.index].items()
                }
        if hasattr(torch._C, "_host_emptyCache"):  # freed pinned blocks go back to the OS
            torch._C._host_emptyCache()

    def configure_norm(self, extra_axes: list[Axis], skip: list[torch.nn.Parameter]) -> None:
        """The serial model's norm when this rank holds only part of the model: also sum over
        ``extra_axes`` (pipeline stages), and leave out ``skip`` (a tied copy counted elsewhere)."""
        self.norm.configure(extra_axes, skip)

    # ------------------------------------------------------------------ the engine's gradient protocol
    def start_step(self) -> None:
        self.reducer.start_step()
        if self.hooks is not None:
            self.hooks.new_step()

    def begin(self, sync: bool) -> None:
        self.reducer.begin(sync)

    def finish(self) -> None:
        self.reducer.finish()

    def ensure_grad(self, p: torch.nn.Parameter) -> torch.Tensor:
        return self.reducer.ensure_grad(p)

    def run(self, forward_backward: Callable[[], float], max_grad_norm: float | None, scaler) -> float:
        """One step's forward and backward: offloaded chunks may be updated on the host while the
        backward runs; offload='auto''s warm-up step (and the step after its re-placement), out of
        device memory in a single-process job, runs again with half the model data on the device
        (its first guess cannot know the activations)."""
        self.start_step()
        while True:
            early = self.offload is not None and max_grad_norm is None and scaler is None
            self.host_update.arm(self.optimizer if early and self.placement.may_update_early else None)
            self.placement.start()
            try:
                return forward_backward()
            except torch.OutOfMemoryError as exc:
                self.host_update.wait()
                if not self.placement.may_retry():
                    if self.offload != "auto":
                        raise
                    raise self.placement.out_of_memory(exc, self._device_model_bytes()) from exc
            except BaseException:
                self.host_update.wait()
                raise
            # out of the except block: the failed attempt's frames (and their tensors) are gone.
            # Drop what it left (reductions in flight, gradients, gathered chunks), move half the
            # device's model data to the host, and measure the next attempt's peak afresh.
            self.reducer.abandon()
            self._place(self.placement.shrink())
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(self.device)
            self.start_step()

    def _device_model_bytes(self) -> int:
        return sum(v for k, v in self.memory_report()[self.device.type].items() if k != "other")

    @property
    def early_updates(self) -> int:
        """Chunks updated during a backward, in all."""
        return self.host_update.count

    # ------------------------------------------------------------------ the step
    def _grads(self) -> list[torch.Tensor]:
        """The reduced gradients the update reads, one per chunk: stage 0's gradient chunks (the
        parameters' ``.grad`` are views into them), else the masters' ``.grad`` (the gradient shards)."""
        if self.stage == 0:
            return [g for g in self.reducer.grads() if g is not None]
        out = []
        for st in self.store.chunks:
            if st.grad_acc is None:
                st.grad_acc = torch.zeros_like(st.master)
            st.master.grad = st.grad_acc
            out.append(st.grad_acc)
        return out

    def grad_norm(self) -> torch.Tensor:
        """The serial model's gradient 2-norm (a collective over the sharded data axis, tp and the
        axes of :meth:`configure_norm`)."""
        return self.norm.total(self.store.chunks, self.reducer.grads())

    def _all_finite(self, grads: list[torch.Tensor]) -> bool:
        """The fp16 overflow vote: every rank calls every agreement (no short-circuit). Stage 0's
        gradients are identical over the data axis (no vote there) but for its chunks of sharded
        experts, which differ over their shard axis (ep): a vote there, so an overflow in one ep
        rank's experts skips the step everywhere."""
        local = all(bool(torch.stack([torch.isfinite(g).all() for g in gs]).all()) for gs in _by_device(grads).values())
        finite = comm.all_agree(local, self.axis) if self.stage else local
        shard_axes = {ax.name: ax for ax in self.norm.shard_axes or () if ax is not None and not ax.trivial}
        for ax in shard_axes.values():
            finite = comm.all_agree(finite, ax)
        for ax in self.norm.axes:
            finite = comm.all_agree(finite, ax)
        return finite

    def step(self, max_grad_norm: float | None, scaler=None) -> torch.Tensor | float | None:
        """Unscale (fp16), clip, update and publish; returns the grad norm (stage 0 without clipping,
        tp or pipeline: None, read on demand by :meth:`grad_norm`)."""
        early = {st.index for st in self.host_update.wait()}
        self._place(self.placement.fitted())  # after offload='auto''s warm-up: re-placed for its measurement
        grads = self._grads()
        if scaler is not None:
            inv = 1.0 / scaler.scale
            if not scaler.update(self._all_finite(grads)):
                self._drop_master_grads()
                return float("inf")
            for gs in _by_device(grads).values():
                torch._foreach_mul_(gs, inv)
            for st in self.store.chunks:  # norms read before the unscaling are stale
                st.norm_sq = None
        norm = None
        if self.stage or max_grad_norm is not None or self.norm.axes or self.norm.shard_axes:
            norm = self.grad_norm()  # a collective: every rank, now
        if max_grad_norm is not None:  # as torch.nn.utils.clip_grads_with_norm_
            coef = torch.clamp(max_grad_norm / (norm + 1e-6), max=1.0)
            for dev, gs in _by_device(grads).items():
                torch._foreach_mul_(gs, coef.to(dev))
        for st in self.store.chunks:
            if st.index in early:  # updated during the backward: the optimizer skips a master without grad
                st.master.grad = None
        self.optimizer.step()
        self._drop_master_grads()
        self.store.publish(frozenset(early))
        return norm

    def _drop_master_grads(self) -> None:
        if self.stage:
            for st in self.store.chunks:
                st.master.grad = None

    # ------------------------------------------------------------------ state (checkpoints: see .state)
    @contextlib.contextmanager
    def gathered(self, writable: bool = False):
        """Every chunk gathered (stage 3) for the duration, parameters holding the fp32 masters
        (with ``param_dtype``, fp32 copies, at every stage: a checkpoint is never rounded to bf16):
        full_state_dict, checkpoints. ``writable``: what was written into the parameters becomes
        this rank's shards and masters on exit."""
        if self.stage < 3 and self.store.param_dtype is None:
            yield
            if writable:
                reload_from_params(self.store)
            return
        for st in self.store.chunks:
            self.store.gather(st, exact=True)
        try:
            yield
            if writable:
                reload_from_params(self.store)
        finally:
            self.store.release_all()

    def memory_report(self) -> dict[str, dict[str, int]]:
        """Model data (parameters, gradients, masters, optimizer state) per device type, and on the GPU
        the other data: see :func:`.measure.memory_report`."""
        return memory_report(self.store.bytes_on, self.optimizer)

    def state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        """The optimizer state per parameter name (under ZeRO 1-3 gathered from the shards: see :mod:`.state`)."""
        if self.stage == 0:
            return {self.names[id(p)]: dict(st) for p, st in self.optimizer.state.items()}
        return {self.names[id(p)]: st for p, st in param_states(self).items()}

    def load_state_dict(self, state) -> None:
        by_name = {self.names[id(p)]: p for p in self.params}
        if self.stage:
            load_param_states(self, {by_name[n]: dict(v) for n, v in state.items() if n in by_name})
            return
        self.optimizer.state.clear()
        for n, st in state.items():
            p = by_name.get(n)
            if p is not None:
                self.optimizer.state[p] = {k: state_to(v, p.device, self.optimizer) for k, v in st.items()}

    def remove(self) -> None:
        self.reducer.remove()
        if self.hooks is not None:
            self.hooks.remove()

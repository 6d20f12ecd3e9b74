"""ZeRO-3 module hooks: gather a chunk just before a module that owns its parameters runs,
release it when the working set moves on, and prefetch what the last step used next.

* forward pre-hook of a module with chunked parameters: wait for (or issue) the gathers of its
  chunks, then release every other resident chunk that is neither in use by a module still
  running forward nor prefetched -- the working set is the running modules' chunks plus the
  prefetch window;
* the module's outputs get a gradient hook that gathers the chunks again before the module's
  backward (the store releases a chunk as soon as all its gradients are reduced);
* every gather is appended to this step's *trace*; the next step, gather number ``i`` also
  issues asynchronous gathers for the chunks of trace entries ``i+1 .. i+depth`` (every rank
  runs the same model, so every rank issues the same collectives in the same order).

Activation checkpointing: the recomputed forward (inside the backward) runs the pre-hooks, which
then evict neither a chunk the recompute has used so far (the block's backward, right after its
recompute, needs them all) nor one the backward's hooks gathered (its gradients are still coming:
a tied head's table, the module whose backward set the recompute off). So a chunk is gathered as
often as without checkpointing, and held as long: until the store releases it, its gradients
reduced. A forward pre-hook outside the backward forgets what the last backward held.
A module that is called but passes its input through (``runs(module)`` false: a pipeline chunk
that is not the active one) gathers nothing.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.hooks import RemovableHandle

from .store import ChunkState, ChunkStore

__all__ = ["GatherHooks"]


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (tuple, list)):
        for v in obj:
            yield from _tensors(v)
    elif hasattr(obj, "to_tuple"):  # transformers ModelOutput
        yield from _tensors(obj.to_tuple())


class GatherHooks:
    """Stage-3 gathering for ``model``'s modules over ``store`` with ``prefetch`` chunks of look-ahead;
    ``probe()``, if given, is called at every hook (offload='auto''s warm-up measures there);
    ``runs(module)``, if given, says whether a called module computes (else it gathers nothing)."""

    def __init__(
        self,
        model: torch.nn.Module,
        store: ChunkStore,
        prefetch: int = 2,
        probe=None,
        runs: Callable[[torch.nn.Module], bool] | None = None,
    ) -> None:
        self.store, self.depth, self.runs = store, prefetch, runs
        self._handles: list[RemovableHandle] = []
        self.trace: list[int] = []  # chunk indices in gather order, this step
        self._last: list[int] = []  # the previous step's trace
        self._active: list[set[int]] = []  # chunks of the modules whose forward is running
        self._held: set[int] = set()  # chunks the running backward's hooks gathered
        self._recomputed: set[int] = set()  # chunks the running recompute has used so far
        self.probe = probe
        for module in model.modules():
            chunks = []
            for p in module.parameters(recurse=False):
                st = store.chunk_of.get(id(p))
                if st is not None and st not in chunks:
                    chunks.append(st)
            if chunks:
                self._handles.append(module.register_forward_pre_hook(self._pre_forward(chunks)))
                self._handles.append(module.register_forward_hook(self._post_forward(chunks)))

    def new_step(self) -> None:
        self._last, self.trace = self.trace, []
        self._active, self._held, self._recomputed = [], set(), set()

    def _use(self, chunks: list[ChunkState]) -> None:
        if self.probe is not None:
            self.probe()
        store = self.store
        for st in chunks:
            pos = len(self.trace)
            self.trace.append(st.index)
            if self.depth and self._last[pos : pos + 1] == [st.index]:
                for nxt in self._last[pos + 1 : pos + 1 + self.depth]:
                    ahead = store.chunks[nxt]
                    if not ahead.resident and ahead.pending is None:
                        store.gather(ahead, async_op=True)
            store.gather(st)

    def _evict_others(self, keep: set[int]) -> None:
        pos = len(self.trace)
        window = set(self._last[pos : pos + self.depth]) if self.depth else set()
        for st in self.store.chunks:
            if st.resident and st.index not in keep and st.index not in window:
                self.store.release(st)

    def _pre_forward(self, chunks: list[ChunkState]):
        def hook(module, args):
            if self.runs is not None and not self.runs(module):
                return
            self._use(chunks)
            self._active.append({st.index for st in chunks})
            keep = set().union(*self._active)
            if torch._C._current_graph_task_id() != -1:  # activation checkpointing's recompute, in the backward
                self._recomputed |= self._active[-1]
                keep |= self._recomputed | self._held
            else:
                self._held = set()
            self._evict_others(keep)

        return hook

    def _post_forward(self, chunks: list[ChunkState]):
        def hook(module, args, output):
            if self.runs is not None and not self.runs(module):
                return None
            if self._active:
                self._active.pop()
            if torch.is_grad_enabled():
                for t in _tensors(output):
                    # an output whose gradient also arrives by another path names that tensor
                    # (1D sequence parallelism's norms: tp1d.make_sequence_parallel_norm)
                    for u in (t, getattr(t, "grad_source", None)):
                        if u is not None and u.requires_grad:
                            u.register_hook(self._pre_backward(chunks))
            return None

        return hook

    def _pre_backward(self, chunks: list[ChunkState]):
        def hook(grad):
            self._use(chunks)
            self._held |= {st.index for st in chunks}
            self._recomputed = set()
            return None

        return hook

    def remove(self) -> None:
        for h in self._handles:
            h.remove()

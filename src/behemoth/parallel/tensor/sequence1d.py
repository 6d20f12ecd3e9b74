"""Where 1D sequence parallelism's shards begin and end: the blocks of the model.

With ``Plan(sequence_parallel=True)`` the residual stream inside the blocks is each tp rank's
sequence shard ``[b, s/tp, h]``; the model's own code before the first block (embeddings,
position ids, rotary tables, masks) and after the last (final norm, head) sees whole sequences.
:class:`SequenceShards` holds that boundary for one model: ``install`` hooks the first block's
input (:class:`~behemoth.comm.ScatterToAxis`: keep this rank's slice, all-gather the gradient)
and the last block's output (:class:`~behemoth.comm.GatherFromAxis`: all-gather, slice the
gradient).

A pipeline stage that does not hold the embedding (:mod:`behemoth.parallel.pipeline.stage`)
receives the previous stage's shard. The model's code before the stage's first block must still
see the whole sequence length (transformers' Llama builds its rotary tables and causal mask for
``inputs_embeds.shape[1]`` positions), so :meth:`SequenceShards.widen` places the shard in its
slot of a zero tensor of the whole length and :meth:`SequenceShards.take` slices it out again at
the stage's first block; a stage that does not hold the head widens its last block's output the
same way (transformers' GPT-2 views the output as the input's shape) and takes its shard back to
send it. No communication either way, the gradient reaches the shards unchanged, and the stages
send shards (``1/tp`` of the activation). The pipeline removes the model-wide hooks
(:meth:`SequenceShards.remove`) and hooks each of its chunks instead.

While :func:`~.tp1d.sequence_parallel_paused` holds (generation), nothing here acts.
Tested by tests/dist/test_tp1d.py and tests/dist/test_pipeline_sequence_parallel.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ... import comm
from ...comm import Axis
from .region1d import SEQ_DIM, ParallelRegion

__all__ = ["SequenceShards", "sequence_shards"]

_ATTR = "_behemoth_sequence_shards"


class SequenceShards:
    """1D sequence parallelism's boundary for one model: ``axis`` (tp) and the model's
    :class:`~.region1d.ParallelRegion` objects (their pause flag)."""

    def __init__(self, axis: Axis, regions: list[ParallelRegion]) -> None:
        self.axis, self.regions = axis, regions
        self._handles: list = []

    @property
    def active(self) -> bool:
        """False while the model's sequence-parallel layers run as plain 1D ones."""
        return not self.regions[0].sequence_parallel_paused

    # -- the tensors ----------------------------------------------------------------------------
    def scatter(self, x: torch.Tensor) -> torch.Tensor:
        """The whole sequence -> this rank's shard (all-gather of the gradient)."""
        return comm.ScatterToAxis.apply(x, self.axis, SEQ_DIM)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's shard -> the whole sequence (slice of the gradient)."""
        return comm.GatherFromAxis.apply(x, self.axis, SEQ_DIM)

    def widen(self, shard: torch.Tensor) -> torch.Tensor:
        """``shard`` in this rank's slot of a zero tensor of the whole sequence (no communication;
        the gradient is the slot's slice). Only its shape and slot matter: :meth:`take` reads it back."""
        n, p, r = shard.shape[SEQ_DIM], self.axis.size, self.axis.rank
        pad = [0, 0] * (shard.dim() - SEQ_DIM - 1) + [r * n, (p - 1 - r) * n]
        return F.pad(shard, pad)

    def take(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's slot of a :meth:`widen`-ed tensor (the gradient: zeros around it)."""
        n = x.shape[SEQ_DIM] // self.axis.size
        return x.narrow(SEQ_DIM, self.axis.rank * n, n)

    # -- the hooks ------------------------------------------------------------------------------
    def input_hook(self, fn, when=lambda: True):
        """A forward pre-hook (with kwargs) replacing a block's hidden states by ``fn`` of them
        while ``when()`` holds and sequence parallelism is not paused."""

        def hook(module, args, kwargs):
            if not (self.active and when()):
                return None
            if args:
                return (fn(args[0]),) + tuple(args[1:]), kwargs
            return args, dict(kwargs, hidden_states=fn(kwargs["hidden_states"]))

        return hook

    def output_hook(self, fn, when=lambda: True):
        """A forward hook applying ``fn`` to a block's output (or its first element)."""

        def hook(module, args, output):
            if not (self.active and when()):
                return None
            if isinstance(output, torch.Tensor):
                return fn(output)
            return (fn(output[0]),) + tuple(output[1:])

        return hook

    def hook_blocks(self, first: nn.Module, last: nn.Module, enter, leave, when=lambda: True) -> None:
        """Hook ``first``'s input with ``enter`` (:meth:`scatter` or :meth:`take`) and ``last``'s
        output with ``leave`` (:meth:`gather` or :meth:`widen`), while ``when()`` holds."""
        self._handles.append(first.register_forward_pre_hook(self.input_hook(enter, when), with_kwargs=True))
        self._handles.append(last.register_forward_hook(self.output_hook(leave, when)))

    def install(self, model: nn.Module, blocks) -> None:
        """The model-wide boundary: scatter at ``blocks[0]``'s input, gather at ``blocks[-1]``'s output."""
        self.hook_blocks(blocks[0], blocks[-1], self.scatter, self.gather)
        model.__dict__[_ATTR] = self

    def remove(self) -> None:
        """Remove every hook this object installed."""
        for h in self._handles:
            h.remove()
        self._handles.clear()


def sequence_shards(model: nn.Module) -> SequenceShards | None:
    """The model's :class:`SequenceShards` (1D tensor parallelism with sequence parallelism), or None."""
    return model.__dict__.get(_ATTR)

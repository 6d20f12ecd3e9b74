"""The forward of a pipeline-split model called outside a schedule (evaluation, generation).

After :class:`~.stage.PipelineSplit` cut a model down to this rank's chunks, calling it the
usual way, ``model(input_ids)``, runs the pipeline forward of that one batch: every pipeline
rank calls it with the same inputs (as every rank holds every micro-batch in training);
stage ``s`` receives stage ``s - 1``'s output, runs its chunk, and sends its output on. The
rank that holds the last stage returns the model's output (the serial model's logits); the
other ranks return ``None``. Inside a schedule (a chunk active) the model's own forward runs.

Communication: one activation send per stage boundary over the pipeline channels (:mod:`.p2p`),
keyed by the input shapes and the autocast dtype, so it never mixes with a training step's
cached message shapes. Forward only: no gradient crosses a stage boundary here. A transformers
MoE model's own pooled router loss is switched off in every stage's forward (in training too): a
stage holds some of the layers only, and the expert style computes that loss itself.
Tested in tests/dist/test_parallelize.py (pp logits against the serial model's).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from .p2p import StageChannels
from .stage import PipelineSplit

__all__ = ["install_pipelined_forward"]


def _message_key(args, kwargs, device: torch.device) -> tuple:
    """The inputs' shapes (positional, then keyword by name) and the autocast dtype: one message
    shape per key (a call by keywords alone, as transformers' generation makes, is keyed too)."""
    shapes = tuple(tuple(t.shape) for t in args if isinstance(t, torch.Tensor))
    shapes += tuple((k, tuple(v.shape)) for k, v in sorted(kwargs.items()) if isinstance(v, torch.Tensor))
    dtype = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else None
    return ("forward", shapes, str(dtype))


def install_pipelined_forward(model: nn.Module, split: PipelineSplit, channels: StageChannels) -> None:
    """Make ``model(...)`` outside a schedule run the pipeline forward (the model's ``forward`` is
    wrapped on the instance, like activation checkpointing does: state-dict keys unchanged)."""
    inner = model.forward
    # transformers' MoE models pool the router logits of every layer in their own forward when
    # ``output_router_logits`` is set; a stage holds some layers only (none of them MoE blocks: an
    # IndexError there), and the expert style computes that loss itself (parallel/expert/losses.py)
    if getattr(getattr(model, "config", None), "output_router_logits", False):
        inner = functools.partial(inner, output_router_logits=False)
    last = split.num_stages - 1
    nxt, prv = (split.rank + 1) % split.pp, (split.rank - 1) % split.pp

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        if split.ctx.chunk is not None:  # a schedule runs one chunk: the model's own forward
            return inner(*args, **kwargs)
        key, out = _message_key(args, kwargs, channels.device), None
        try:
            for chunk in range(split.v):
                stage = split.stage(chunk)
                x = None if stage == 0 else channels.recv_activation(stage - 1, key, prv)
                split.ctx.chunk, split.ctx.stash = chunk, x
                # ``logits_to_keep`` (the positions whose logits the head computes) is the last
                # stage's: another stage slicing its output by it would send on too few positions
                kw = kwargs if stage == last else {k: v for k, v in kwargs.items() if k != "logits_to_keep"}
                try:
                    out = inner(*args, **kw)
                finally:
                    split.ctx.chunk, split.ctx.stash = None, None
                if stage != last:
                    channels.send_activation(split.stage_output(out), stage, key, nxt)
        finally:
            channels.finish()
        return out if split.stage(split.v - 1) == last else None

    model.forward = forward

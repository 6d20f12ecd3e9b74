"""One rank's pipeline stage(s) of a serial model, cut out of the model in place.

Implements the model side of GPipe / 1F1B / interleaved / zero-bubble pipelining without
rewriting any model's ``forward``: the model keeps running its own
``forward`` on every rank, but

* modules another rank owns are replaced by parameter-free :class:`Skip` modules, so this
  rank's ``model.parameters()`` and ``model.state_dict()`` hold exactly its stage's tensors
  under their serial names (checkpoints, the optimizer and the dp buckets need nothing else);
* every module this rank owns runs only while its chunk is the active one
  (:attr:`StageContext.chunk`), and otherwise passes through like a :class:`Skip`;
* a pass-through token embedding returns the activation received from the previous stage
  (:attr:`StageContext.stash`), other embeddings (learned positions) return 0 and dropout,
  blocks, final norm and head return their input. A stage that is not the last so returns
  its hidden state where the serial model returns logits.

Works for any model whose ``forward`` is "embeddings -> blocks -> norm -> head" with the
modules named in its family's ``PipelineLayout`` (``behemoth.specs``: behemoth's GPT and
Llama, transformers' GPT2LMHeadModel and LlamaForCausalLM, and subclasses), after tensor
parallelism and activation checkpointing have rewritten it (their layouts travel through).
Under 1D sequence parallelism the stages send each tp rank's sequence shard, and the model's code
outside a stage's blocks still sees the whole sequence length (``PipelineSplit._hook_sequence_shards``,
``tensor/sequence1d.py``; tested by tests/dist/test_pipeline_sequence_parallel.py).

Communication (pipeline axis ``pp``, through ``behemoth.comm``): :meth:`PipelineSplit.distribute`
sends every stage's initial weights from pp rank 0 once; :meth:`PipelineSplit.gather_state`
broadcasts each stage's state dict; the pipeline executor sums the gradients of tied weights
(embedding on the first stage, head on the last) between the two ranks. Tested by
tests/dist/test_pipeline_parity.py.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
from torch import nn

from ... import comm
from ...comm import Axis
from ...loss import logits_of
from ...specs import PipelineLayout, find_spec, known_classes
from ..tensor.layout import get_spec
from ..tensor.sequence1d import SequenceShards, sequence_shards
from .partition import (
    estimate_block_costs,
    find_tied_parameters,
    stage_modules,
    tied_parameter_ranks,
    virtual_partition,
)

__all__ = ["StageContext", "Skip", "PipelineSplit", "partition_for"]

_INIT_TAG = 7


class StageContext:
    """What the pass-through modules of one rank read while a chunk runs."""

    def __init__(self) -> None:
        self.chunk: int | None = None
        """The chunk whose modules run for real; ``None`` outside a pipeline step."""
        self.stash: torch.Tensor | None = None
        """The activation received from the previous stage (``None`` on stage 0)."""
        self.sequence: SequenceShards | None = None
        """1D sequence parallelism's boundary (the stash is then this tp rank's sequence shard)."""


def _passthrough(role: str, ctx: StageContext, args, kwargs):
    if role == "input":
        if ctx.stash is None:
            raise RuntimeError(
                "pipeline stage: an embedding this stage does not run was called with no received "
                "activation; call the model through engine.step()."
            )
        seq = ctx.sequence
        # sequence parallelism: the model's code before the blocks sees the whole sequence length
        return seq.widen(ctx.stash) if seq is not None and seq.active else ctx.stash
    if role == "zero":
        return torch.zeros((), dtype=ctx.stash.dtype, device=ctx.stash.device)
    return args[0] if args else next(iter(kwargs.values()))


class Skip(nn.Module):
    """Stands in for a module another pipeline rank owns: no parameters, passes through
    (``role``: ``"input"`` returns the received activation, ``"zero"`` a 0, ``"identity"`` its
    first argument)."""

    def __init__(self, role: str, ctx: StageContext) -> None:
        super().__init__()
        self.role, self._ctx = role, [ctx]  # a list: the context is not a submodule

    def forward(self, *args, **kwargs):
        return _passthrough(self.role, self._ctx[0], args, kwargs)

    def extra_repr(self) -> str:
        return self.role


def partition_for(model: nn.Module, pp: int, v: int, stages=None) -> tuple[PipelineLayout, list]:
    """``(layout, partition[rank][chunk] = (start, end))`` for ``model``: balanced by estimated
    cost, or the user's ``stages`` (validated). Pure: raises ValueError before any collective."""
    spec = find_spec(model)
    if spec is None:
        raise ValueError(
            f"pipeline parallelism: no pipeline layout for {type(model).__name__}; known: {known_classes()} (and their "
            f"subclasses). Describe the family (embeddings, block list, norm and head names) in a ModelSpec "
            f"file under behemoth/specs/ and add it to behemoth.specs.SPECS."
        )
    layout = spec.pipeline
    config = getattr(model, "config", None)
    try:
        costs = estimate_block_costs(config)
        blocks, first, last = costs.blocks, costs.first_extra, costs.last_extra
    except Exception:  # an unknown config: equal blocks
        blocks, first, last = (1.0,) * len(model.get_submodule(layout.blocks)), 0.0, 0.0
    if len(blocks) != len(model.get_submodule(layout.blocks)):
        blocks = (1.0,) * len(model.get_submodule(layout.blocks))
    return layout, virtual_partition(blocks, pp, v, first_extra=first, last_extra=last, stages=stages)


class PipelineSplit:
    """Cuts ``model`` (in place) down to pipeline rank ``pp_axis.rank``'s chunks of
    ``partition`` and gates them by :class:`StageContext`. Holds the serial state-dict
    layout (keys, full shapes, dtypes, owning rank) to reassemble it later."""

    def __init__(
        self, model: nn.Module, layout: PipelineLayout, partition: Sequence[Sequence[tuple[int, int]]], pp_axis: Axis
    ) -> None:
        self.model, self.layout, self.partition, self.axis = model, layout, partition, pp_axis
        self.pp, self.rank, self.v = pp_axis.size, pp_axis.rank, len(partition[0])
        self.num_stages = self.pp * self.v
        self.ctx = StageContext()
        names = stage_modules(layout, partition)  # names[rank][chunk]
        self.module_chunks: dict[str, int] = {}  # this rank's modules -> chunk
        for c, row in enumerate(names[self.rank]):
            for n in row:
                self.module_chunks.setdefault(n, c)
        owners: list[set[str]] = [{n for row in names[r] for n in row} for r in range(self.pp)]
        self._owners = owners
        # The serial state dict: key -> (full shape, dtype, owning rank).
        self.serial_meta = {}
        for k, t in model.state_dict(keep_vars=True).items():
            spec = get_spec(t)
            shape = tuple(spec.full_shape) if spec is not None and spec.dims else tuple(t.shape)
            self.serial_meta[k] = (shape, t.dtype, self._owner(k))
        # Tied pairs across ranks: (name_a, rank_a, name_b, rank_b), a on the first stage.
        groups = [set(g) for g in find_tied_parameters(model)]
        self.tied = [
            (a, ra, b, rb)
            for a, ra, b, rb in tied_parameter_ranks(layout, self.pp)
            if ra != rb and any(a in g and b in g for g in groups)
        ]
        self.serial_param_names = {b: a for a, _, b, rb in self.tied if rb == self.rank}
        """This rank's parameter name -> the serial model's name for it (a tied copy is saved
        under the serial model's first name, so checkpoints load under any pp)."""

    def _owner(self, key: str) -> int:
        for r, names in enumerate(self._owners):
            if any(key == n or key.startswith(n + ".") for n in names):
                return r
        raise ValueError(
            f"pipeline parallelism: state-dict key {key!r} belongs to no stage's modules (layout "
            f"{self.layout}); every parameter and buffer must live in an embedding, a block, the "
            f"final norm or the head."
        )

    # -- set-up ---------------------------------------------------------------------------
    def distribute(self) -> None:
        """Give every stage pp rank 0's initial weights (one model, however ranks were seeded):
        rank 0 sends each rank the tensors it owns (point-to-point, once)."""
        if self.pp == 1:
            return
        state = self.model.state_dict()
        with torch.no_grad():
            if self.rank == 0:
                handles = [
                    comm.send_async(state[k], self.axis, r, _INIT_TAG)
                    for r in range(1, self.pp)
                    for k in state
                    if self._owns(r, k)
                ]
                for h in handles:
                    h.wait()
            else:
                for k in state:
                    if self._owns(self.rank, k):
                        got = comm.recv_async(
                            state[k].shape, state[k].dtype, self.axis, 0, _INIT_TAG, state[k].device
                        ).wait()
                        state[k].copy_(got)

    def _owns(self, r: int, key: str) -> bool:
        return any(key == n or key.startswith(n + ".") for n in self._owners[r])

    def apply(self) -> None:
        """Replace what this rank does not own by :class:`Skip`; gate what it owns by chunk."""
        layout, ctx = self.layout, self.ctx
        roles: dict[str, str] = {}
        for i, name in enumerate(layout.pre):
            m = self.model.get_submodule(name)
            roles[name] = "input" if i == 0 else ("identity" if isinstance(m, nn.Dropout) else "zero")
        for name in layout.post:
            roles[name] = "identity"
        blocks = self.model.get_submodule(layout.blocks)
        for i in range(len(blocks)):
            roles[f"{layout.blocks}.{i}"] = "identity"
        for name, role in roles.items():
            if name in self.module_chunks:
                _gate(self.model.get_submodule(name), role, ctx, self.module_chunks[name])
            elif name.startswith(layout.blocks + "."):
                blocks[int(name.rsplit(".", 1)[1])] = Skip(role, ctx)
            else:
                parent, _, attr = name.rpartition(".")
                setattr(self.model.get_submodule(parent) if parent else self.model, attr, Skip(role, ctx))
        self._hook_sequence_shards(blocks)

    def _hook_sequence_shards(self, blocks) -> None:
        """1D sequence parallelism: each of this rank's chunks takes its shard at its first
        block's input (stage 0 scatters the embedding's output; a later stage takes back the
        received shard :func:`_passthrough` widened) and the last stage gathers the sequence after
        its last block; another stage widens its last block's output (the model's code after the
        blocks sees the whole length: transformers' GPT-2 views it as the input's shape) and
        :meth:`stage_output` takes the shard it sends. Hooks fire only while their chunk is the
        active one (a gated block's hooks run when it passes through too)."""
        shards = sequence_shards(self.model)
        if shards is None:
            return
        shards.remove()  # the whole model's boundary (the first and the last block)
        self.ctx.sequence = shards
        last = self.num_stages - 1
        for c, (a, b) in enumerate(self.partition[self.rank]):
            s = self.stage(c)
            shards.hook_blocks(
                blocks[a],
                blocks[b - 1],
                shards.scatter if s == 0 else shards.take,
                shards.gather if s == last else shards.widen,
                when=lambda c=c: self.ctx.chunk == c,
            )

    def stage_output(self, out) -> torch.Tensor:
        """What a stage that is not the last sends on: the model's output ``out`` (its hidden
        state), with 1D sequence parallelism this tp rank's sequence shard of it."""
        y = logits_of(out)
        seq = self.ctx.sequence
        return seq.take(y) if seq is not None and seq.active else y

    # -- queries ----------------------------------------------------------------------------
    def stage(self, chunk: int) -> int:
        return chunk * self.pp + self.rank

    def chunk_parameters(self, chunk: int) -> list[nn.Parameter]:
        """The parameters of this rank's ``chunk`` (zero-bubble's weight-gradient pass)."""
        seen, out = set(), []
        for name, c in self.module_chunks.items():
            if c != chunk:
                continue
            for p in self.model.get_submodule(name).parameters():
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
        return out

    def norm_parameters(self) -> list[nn.Parameter]:
        """This rank's parameters, a tied copy held by the last stage left out (it is counted
        on the first stage: the two copies hold the same summed gradient)."""
        skip = {id(self.model.get_parameter(b)) for a, ra, b, rb in self.tied if rb == self.rank}
        return [p for p in self.model.parameters() if id(p) not in skip]

    def gather_state(self, local: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
        """The serial state dict from each stage's ``local`` entries (tp already gathered): one
        flat broadcast over ``pp`` per owning rank and dtype. A collective: every rank calls it."""
        out: dict[str, torch.Tensor] = {}
        meta = self.serial_meta
        for src in range(self.pp):
            for dtype in dict.fromkeys(d for _, d, r in meta.values() if r == src):
                keys = [k for k, (_, d, r) in meta.items() if r == src and d == dtype]
                sizes = [int(torch.Size(meta[k][0]).numel()) for k in keys]
                if src == self.rank:
                    flat = torch.cat([local[k].reshape(-1) for k in keys]).to(device)
                else:
                    flat = torch.empty(sum(sizes), dtype=dtype, device=device)
                comm.broadcast(flat, self.axis, src)
                for k, piece in zip(keys, flat.split(sizes)):
                    out[k] = piece.view(meta[k][0]).to("cpu", copy=True)
        return {k: out[k] for k in meta}


def _gate(module: nn.Module, role: str, ctx: StageContext, chunk: int) -> None:
    """Run ``module`` only while ``chunk`` is active; pass through otherwise (instance
    ``forward`` patched, like activation checkpointing does: state-dict keys unchanged)."""
    inner = module.forward

    @functools.wraps(inner)
    def forward(*args, _inner=inner, **kwargs):
        if ctx.chunk == chunk:
            return _inner(*args, **kwargs)
        return _passthrough(role, ctx, args, kwargs)

    module.forward = forward

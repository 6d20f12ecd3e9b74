"""``bh.parallelize(model, plan)``: a serial model rewritten in place for a plan, in one fixed order.

    prepare (device, no KV cache) -> tensor -> context -> experts -> activation checkpointing
        -> compile -> pipeline split -> initial weight sync over the data axes

Each step is one call below; a new parallel dimension is a set of styles and one more line in
:func:`parallelize`. The result is still the model: it runs forward under any plan without an
optimizer (evaluation, generation), and :func:`behemoth.engine.boost` adds the gradient sync
and the step executor to train it. What the rewrite did (parameters replaced by their shards,
the vocabulary-parallel head, the axes that split the batch, the context-parallel record, the
pipeline stage) is recorded on the model as a :class:`Parallelization`, which the engine reads.

What a rank's forward takes and returns under each plan:

* data parallelism, 1D tensor parallelism: the serial model's inputs and outputs (1D logits are
  all-gathered over tp, so every rank holds the serial logits);
* 2D / 2.5D / 3D tensor parallelism: this rank's row block of the batch
  (:attr:`Parallelization.batch_parts`, :attr:`Parallelization.batch_index`) and its logits;
* context parallelism: this rank's share of the sequence and its position ids
  (``Parallelization.context.split``);
* pipeline parallelism: every pipeline rank passes the same inputs; the rank holding the last
  stage returns the serial model's output, the others ``None``
  (:mod:`behemoth.parallel.pipeline.forward`).

Tested in tests/dist/test_parallelize.py against the serial model.
"""

from __future__ import annotations

import functools
import gc
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from . import comm
from .comm import Axis
from .distributed import device_for_rank, init
from .mesh import ParallelMesh
from .parallel.context import ContextParallelized, parallelize_context
from .parallel.expert import (
    ExpertLayers,
    check_experts,
    data_axis_of,
    dense_tensor_plan,
    gather_expert_state,
    moe_layers,
    parallelize_experts,
    recorded,
    replays_routing,
)
from .parallel.pipeline.forward import install_pipelined_forward
from .parallel.pipeline.p2p import StageChannels, pipeline_channels
from .parallel.pipeline.stage import PipelineSplit, partition_for
from .parallel.tensor import Parallelized, full_state_dict, parallelize_tensor
from .plan import Plan
from .specs import tensor_plan, transformer_blocks

__all__ = ["Parallelization", "parallelization", "parallelize", "serial_state_dict"]


@dataclass
class Parallelization:
    """What :func:`parallelize` did to a model (``parallelization(model)`` reads it back)."""

    plan: Plan
    mesh: ParallelMesh
    device: torch.device
    data_axis: Axis
    """The axis the global batch's tokens are spread over (dp; with context parallelism dp x cp):
    loss sums, token counts and the gradients of parameters replicated over it are summed over it."""
    replaced: dict[int, nn.Parameter] = field(default_factory=dict)
    """``id(serial parameter) -> its tensor-parallel replacement`` (to re-target an optimizer)."""
    vocab_head: nn.Module | None = None
    """The vocabulary-parallel output head, if any (``vocab_parallel_loss_sum``, ``gather_output``)."""
    batch_axes: list[Axis] = field(default_factory=list)
    """Mesh axes that split every micro-batch into row blocks inside the tp group (2D/2.5D/3D)."""
    context: ContextParallelized | None = None
    """The context-parallel record (``check_batch``, ``split``), or None without context parallelism."""
    experts: ExpertLayers | None = None
    """The model's mixture-of-experts blocks (their router losses join the objective, their token
    counts the step log); empty for a dense model."""
    pipeline: PipelineSplit | None = None
    """This rank's pipeline stage(s) of the model, or None without pipeline parallelism."""
    channels: StageChannels | None = None
    """The pipeline's point-to-point channels, connected (None without pipeline parallelism)."""

    @property
    def batch_parts(self) -> int:
        """Row blocks every micro-batch is cut into (the product of the batch axes' sizes)."""
        parts = 1
        for ax in self.batch_axes:
            parts *= ax.size
        return parts

    @property
    def batch_index(self) -> int:
        """This rank's row block: its coordinates on the batch axes, raveled."""
        index = 0
        for ax in self.batch_axes:
            index = index * ax.size + ax.rank
        return index

    def serial_param_names(self, model: nn.Module) -> dict[int, str]:
        """``id(param) -> the serial model's name`` of ``model``'s parameters (a pipeline's last
        stage holds a tied embedding under the head's name; it keeps the serial first name)."""
        aliases = self.pipeline.serial_param_names if self.pipeline is not None else {}
        names: dict[int, str] = {}
        for name, p in model.named_parameters():
            names.setdefault(id(p), aliases.get(name, name))
        return names


def parallelization(model: nn.Module) -> Parallelization:
    """The record :func:`parallelize` left on ``model``."""
    record = model.__dict__.get("_behemoth_parallelization")
    if record is None:
        raise ValueError(f"{type(model).__name__} was not parallelized; call bh.parallelize(model, plan) first.")
    return record


def resolve(plan: Plan | None, mesh: ParallelMesh | None) -> tuple[Plan, ParallelMesh]:
    """The plan resolved for this world (ValueError on every rank, before any collective) and its mesh."""
    init()
    world, rank = dist.get_world_size(), dist.get_rank()
    plan = (plan or Plan()).resolve(world)
    plan.check_supported()
    if mesh is None:
        return plan, ParallelMesh(plan, rank, world)
    if mesh.plan != plan:
        raise ValueError(f"the mesh was built for {mesh.plan.describe()}, not {plan.describe()}; pass mesh=None.")
    return plan, mesh


def parallelize(
    model: nn.Module,
    plan: Plan | None = None,
    mesh: ParallelMesh | None = None,
    *,
    tp_policy: dict[str, str] | None = None,
    stages: list[tuple[int, int]] | None = None,
) -> nn.Module:
    """Rewrite ``model`` in place for ``plan`` and return it: the order in this module's docstring.

    ``mesh`` defaults to a new :class:`~behemoth.mesh.ParallelMesh` of the plan (a collective:
    every rank calls this). ``tp_policy`` (``{module-name pattern: role}``) shards a model class
    behemoth has no description for; ``stages`` (pipelines only) overrides the stage balance with
    ``pp * virtual_stages`` half-open block ranges ``(start, end)``. Every check runs on every
    rank before any collective."""
    plan, mesh = resolve(plan, mesh)
    stage_layout = check_model(model, plan, stages)
    return apply_plan(model, plan, mesh, tp_policy=tp_policy, stage_layout=stage_layout)


def check_model(model: nn.Module, plan: Plan, stages: list[tuple[int, int]] | None):
    """Refuse a model ``plan`` cannot run (its experts, its pipeline stages) and return the
    ``(layout, partition)`` of its pipeline stages (None without pp): balanced by estimated cost,
    or the user's ``stages``, validated. Pure: raises on every rank before any collective."""
    check_experts(model, plan)
    if stages is not None and plan.pp == 1:
        raise ValueError(f"stages={stages!r} partitions a pipeline, but Plan.pp=1; set pp > 1 or drop stages.")
    return partition_for(model, plan.pp, plan.virtual_stages, stages) if plan.pp > 1 else None


def apply_plan(
    model: nn.Module,
    plan: Plan,
    mesh: ParallelMesh,
    *,
    tp_policy: dict[str, str] | None,
    stage_layout,
    params_on_host: bool = False,
    sync_params: str = "all",
) -> nn.Module:
    """The order itself: :func:`parallelize` for a resolved plan, its mesh and its
    :func:`check_model` (``stage_layout``). ``params_on_host`` leaves parameters where they
    are (ZeRO-3 moves them to the device chunk by chunk); ``sync_params`` says which parameters are
    broadcast over the data axis: ``"all"``, ``"frozen"`` (a gradient sync broadcasts the
    trainable ones, chunk by chunk) or ``"none"``."""
    if "_behemoth_parallelization" in model.__dict__:
        raise ValueError(f"{type(model).__name__} is already parallelized; build a fresh serial model.")
    device = device_for_rank()
    data_axis = mesh.axis("dp_cp" if plan.cp > 1 else "dp")
    record = Parallelization(plan, mesh, device, data_axis)

    model = prepare_model(model, device, keep_params=params_on_host)
    tensor = apply_tensor_parallel(model, mesh, plan, tp_policy)
    record.replaced, record.vocab_head = tensor.replaced, tensor.head
    record.batch_axes = [mesh.axis(a) for a in tensor.batch_axes]
    if record.vocab_head is not None:
        record.vocab_head.gather_output = True  # the serial model's logits; an engine's loss may shard them
    record.context = apply_context_parallel(model, mesh, plan)
    record.experts = apply_expert_parallel(model, mesh, plan)
    if plan.activation_checkpointing:
        apply_activation_checkpointing(model)
    if plan.compile:
        apply_compile(model)
    if stage_layout is not None:
        record.pipeline, record.channels = split_pipeline(model, mesh, device, *stage_layout)
        _let_go_of_other_stages(record, model)
    broadcast_parameters(model, mesh, data_axis, sync_params)
    broadcast_buffers(model, mesh, data_axis)

    model.__dict__["_behemoth_parallelization"] = record
    return model


def _let_go_of_other_stages(record: Parallelization, model: nn.Module) -> None:
    """Free what the pipeline split cut out of this rank: the tensor-parallel shards of the other
    stages' parameters (``record.replaced`` keeps this stage's only; the vocabulary-parallel head
    is kept by the stage holding it), and the other stages' MoE
    blocks (``record.experts`` keeps this stage's), which sit in reference cycles -- the forward
    the expert style binds to each block -- so they are collected here, or their parameters stay
    allocated until Python's cycle collector happens to run (tests/dist/test_planner_memory.py)."""
    held = {id(p) for p in model.parameters()}
    record.replaced = {k: p for k, p in record.replaced.items() if id(p) in held}
    head = record.vocab_head
    if head is not None and not any(id(p) in held for p in head.parameters()):
        record.vocab_head = None  # another stage's: this one computes no loss
    everywhere = len(record.experts)
    record.experts = record.experts.held(model)  # this stage's MoE blocks (the others' are gone)
    if len(record.experts) < everywhere:
        gc.collect()


# ------------------------------------------------------------------ the steps, in order
def prepare_model(model: nn.Module, device: torch.device, *, keep_params: bool = False) -> nn.Module:
    """Move the model to this rank's device and turn off what breaks exact training
    (transformers' KV cache, which only serves generation). ``keep_params`` moves the buffers
    only: ZeRO-3 moves parameters chunk by chunk, so a model larger than the device can be
    built on the host."""
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "use_cache"):
        config.use_cache = False
    if not keep_params:
        return model.to(device)
    for m in model.modules():
        for name, b in m._buffers.items():
            if b is not None:
                m._buffers[name] = b.to(device)
    return model


def apply_tensor_parallel(model: nn.Module, mesh, plan, policy=None) -> Parallelized:
    """Rewrite ``model`` in place for ``plan.tp_mode`` over ``mesh.axis('tp')``; ``policy`` is
    ``{module-name pattern: role or style}`` (``None``: the model family's plan). See
    :func:`behemoth.parallel.tensor.parallelize_tensor`. A mixture-of-experts model keeps its
    experts whole on every tp rank: its family's plan loses the dense-MLP entries its MoE blocks
    replaced (:func:`~behemoth.parallel.expert.dense_tensor_plan`)."""
    if policy is None and plan.tp > 1 and tensor_plan(model) is not None:
        policy = dense_tensor_plan(model, tensor_plan(model))
    if plan.tp > 1 and plan.sequence_parallel:  # the expert style runs them on the gathered sequence
        for m in moe_layers(model).values():
            m._behemoth_sequence_parallel = True
    return parallelize_tensor(model, mesh, plan, policy)


def apply_context_parallel(model: nn.Module, mesh, plan) -> ContextParallelized | None:
    """After tensor parallelism (whose local head counts it sees): the style
    :class:`~behemoth.parallel.context.ContextParallelAttention` (``plan.cp_mode``, over
    ``mesh.axis('cp')``) on every attention module of ``model``; returns the
    :class:`~behemoth.parallel.context.ContextParallelized` record the engine splits batches
    with, or ``None`` when ``plan.cp == 1`` (nothing changes). Checks run on every rank before
    anything changes; no collective is issued."""
    if plan.cp == 1:
        return None
    return parallelize_context(model, mesh, plan)


def apply_expert_parallel(model: nn.Module, mesh, plan) -> ExpertLayers:
    """The style :class:`~behemoth.parallel.expert.ExpertParallel` on every MoE block (this rank
    keeps E/ep experts; router losses over the global batch). Returns the
    :class:`~behemoth.parallel.expert.ExpertLayers` record (empty for a dense model).
    :func:`check_model` must have passed on every rank."""
    return parallelize_experts(model, mesh, plan)


def apply_activation_checkpointing(model: nn.Module) -> int:
    """Recompute each transformer block in backward instead of saving its activations.

    The block's ``forward`` is wrapped in place (non-reentrant checkpoint, RNG state
    preserved), so state-dict keys do not change. Returns the number of blocks wrapped.
    """
    blocks = transformer_blocks(model)
    for block in blocks:
        if getattr(block, "_behemoth_checkpointed", False):
            continue
        inner = block.forward

        @functools.wraps(inner)
        def forward(*args, _inner=inner, _moe=replays_routing(block), **kwargs):
            # an MoE block's recompute reuses its forward's routes (no second sort or host read)
            return checkpoint(recorded(_inner) if _moe else _inner, *args, use_reentrant=False, **kwargs)

        block.forward = forward
        block._behemoth_checkpointed = True
    return len(blocks)


def apply_compile(model: nn.Module) -> int:
    """torch.compile each transformer block in place (``nn.Module.compile``: state-dict keys
    and parameters are unchanged, so gradient hooks and checkpoints see the same tensors).
    Returns the number of blocks compiled."""
    blocks = transformer_blocks(model)
    for block in blocks:
        block.compile()
    return len(blocks)


def split_pipeline(model: nn.Module, mesh: ParallelMesh, device: torch.device, layout, partition):
    """Keep only this rank's pipeline stage(s) of ``model`` (after pp rank 0 sent every stage its
    initial weights), connect the stage channels, and make ``model(...)`` run the pipeline forward."""
    pp = mesh.axis("pp")
    channels = StageChannels(pp.rank, mesh.channel_axes("pp", pipeline_channels(pp.size)), device)
    channels.connect()
    split = PipelineSplit(model, layout, partition, pp)
    split.distribute()
    split.apply()
    install_pipelined_forward(model, split, channels)
    return split, channels


def broadcast_parameters(model: nn.Module, mesh: ParallelMesh, axis: Axis, which: str = "all") -> None:
    """Every replica over ``axis`` starts from its rank 0's weights (users who seed differently
    per rank still get one model): ``which`` parameters, ``"all"``, ``"frozen"`` or ``"none"``.
    An expert's shard is replicated over ``ep_dp`` instead (each ep rank holds its own experts)."""
    if which not in ("all", "frozen", "none"):
        raise ValueError(f"sync_params={which!r}: must be 'all', 'frozen' or 'none'.")
    with torch.no_grad():
        for p in model.parameters():
            if which == "all" or (which == "frozen" and not p.requires_grad):
                comm.broadcast(p.data, mesh.axis(data_axis_of(p, axis.name)), 0)


def broadcast_buffers(model: nn.Module, mesh: ParallelMesh, axis: Axis) -> None:
    with torch.no_grad():
        for b in model.buffers():
            comm.broadcast(b.data, mesh.axis(data_axis_of(b, axis.name)), 0)


def serial_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The serial model's state dict (same keys, shapes and values) of a parallelized ``model``, on
    the CPU of every rank: tensor-parallel shards all-gathered over tp, pipeline stages' entries
    broadcast over pp. A collective: every rank calls it (under ZeRO-3, inside the gradient sync's
    ``gathered()``)."""
    record = parallelization(model)
    local = gather_expert_state(model, record.mesh, full_state_dict(model, record.mesh))
    return local if record.pipeline is None else record.pipeline.gather_state(local, record.device)

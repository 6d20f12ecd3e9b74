"""Expert parallelism as a style: each rank keeps E/ep experts of every MoE layer and exchanges
tokens with the ranks that hold the others ("GShard", Lepikhin et al., 2021; dropless, as
MegaBlocks and torchtitan's ``ExpertParallel``).

The data axis ``dp`` is split ``ep_dp x ep`` (behemoth.mesh): experts are sharded over the
inner ``ep`` part and replicated over ``ep_dp``, while the rest of the model (attention, norms,
embeddings, the routers) stays replicated over the whole of ``dp``. So per-operator:

===================  ======================  ============================  ====================
parameters           held                    gradients summed over         initial broadcast
===================  ======================  ============================  ====================
dense (and routers)  whole, every dp rank    ``dp``                        over ``dp``
experts              E/ep of E, by ep rank   ``ep_dp`` (:func:`data_axis   over ``ep_dp``
                                             _of`)
===================  ======================  ============================  ====================

:class:`ExpertParallel` (``apply(moe_layer, mesh)``) slices a
:class:`~behemoth.models.moe.MoEFeedForward`'s fused ``gate_up_proj`` / ``down_proj`` to this
rank's block of experts *in place* (the same Parameter objects, so an optimizer built over the
serial model keeps them) and replaces the layer's forward (on the instance) by route ->
:func:`~.dispatch.dispatch` -> local experts (:func:`~.grouped.grouped_swiglu`) ->
:func:`~.dispatch.combine` over ``mesh.axis('ep')``. The router losses are those of the serial
model on the *global* batch: the expert counts and the token count are summed over ``dp`` (one
all-reduce of E + 1 numbers per layer; ``token_counts`` holds the global counts), and each rank's
``aux_loss`` is its share (the router
probabilities of its tokens), so the shares summed over ``dp`` are the serial layer's loss. The
style is applied at ep = 1 too whenever the batch is spread over ranks, for that reason.

:func:`parallelize_experts` applies it to every MoE layer of a model; :func:`check_experts`
refuses (before any collective) what does not compose yet; :func:`gather_expert_state` puts
the experts of a state dict back in the serial ``[E, ...]`` shapes.

Tested in tests/dist/test_expert_parallel.py against serial training.
"""

from __future__ import annotations

import types
from dataclasses import dataclass

import torch
from torch import nn

from ... import comm
from ...comm import Axis
from ...models.moe import MoEFeedForward, balance_terms, route, z_loss_sum
from ..style import apply_styles
from ..tensor.layout import DimShard, ShardSpec, set_spec
from .dispatch import combine, dispatch
from .grouped import grouped_swiglu

__all__ = [
    "ExpertParallel",
    "ExpertShard",
    "check_experts",
    "data_axis_of",
    "expert_param_axes",
    "expert_shard",
    "gather_expert_state",
    "moe_layers",
    "parallelize_experts",
]


@dataclass(frozen=True)
class ExpertShard:
    """How a fused expert parameter is sharded: experts ``first .. first + count - 1`` of
    ``num_experts`` along dim 0, over the mesh axis ``axis`` (replicated over ``data_axis``)."""

    num_experts: int
    first: int
    count: int
    axis: str = "ep"
    data_axis: str = "ep_dp"


def expert_shard(p: torch.Tensor) -> ExpertShard | None:
    """The :class:`ExpertShard` of an expert-parallel parameter, or None for any other tensor."""
    return getattr(p, "_behemoth_expert_shard", None)


def data_axis_of(p: torch.Tensor, default: str) -> str:
    """The mesh axis ``p``'s copies are replicated over (its gradient is summed over it, its
    initial value broadcast over it): ``ep_dp`` for a sharded expert parameter, else ``default``."""
    shard = expert_shard(p)
    return default if shard is None else shard.data_axis


def expert_param_axes(model: nn.Module, mesh, data_axis: Axis):
    """For the gradient sync: ``p -> (the axis p is replicated over, the axis it is sharded over or
    None)`` -- ``(ep_dp, ep)`` for a sharded expert, ``(data_axis, None)`` for the rest -- or None
    when ``model`` holds no sharded expert (every parameter then follows ``data_axis``)."""
    if not any(expert_shard(p) is not None for p in model.parameters()):
        return None

    def axes(p: torch.Tensor) -> tuple[Axis, Axis | None]:
        shard = expert_shard(p)
        return (data_axis, None) if shard is None else (mesh.axis(shard.data_axis), mesh.axis(shard.axis))

    return axes


def moe_layers(model: nn.Module) -> dict[str, MoEFeedForward]:
    """``{name: layer}`` of the model's mixture-of-experts layers, in module order."""
    return {name: m for name, m in model.named_modules() if isinstance(m, MoEFeedForward)}


def check_experts(model: nn.Module, plan) -> None:
    """Refuse, on every rank before any collective, a plan the model's experts cannot run under:
    ``Plan.ep`` > 1 on a model without behemoth MoE layers or with a number of experts it does
    not divide (ValueError), and MoE layers with a dimension they do not compose with yet
    (NotImplementedError)."""
    layers = moe_layers(model)
    if not layers:
        if plan.ep > 1:
            raise ValueError(
                f"Plan.ep={plan.ep} shards experts, but {type(model).__name__} has no mixture-of-experts layer "
                f"behemoth knows (behemoth.models.MoEFeedForward; transformers' MoE classes are not supported yet). "
                f"Use ep=1, or a model with num_experts > 0 (e.g. the llama-moe-tiny preset)."
            )
        return
    for name, layer in layers.items():
        if layer.num_experts % plan.ep:
            raise ValueError(
                f"Plan.ep={plan.ep} must divide the number of experts of every MoE layer; {name!r} has "
                f"{layer.num_experts}. Choose ep among the divisors of {layer.num_experts}."
            )
    pending = [
        (plan.tp > 1, f"tp={plan.tp}", "tensor parallelism inside experts"),
        (plan.cp > 1, f"cp={plan.cp}", "context parallelism (expert gradients over ep_dp x cp)"),
        (plan.pp > 1, f"pp={plan.pp}", "pipeline stages holding MoE layers (their router losses)"),
        (plan.zero > 0, f"zero={plan.zero}", "ZeRO over expert-data-parallel chunks"),
    ]
    for bad, value, missing in pending:
        if bad:
            raise NotImplementedError(
                f"Plan.{value} with mixture-of-experts layers needs {missing}, which is not built yet. MoE models "
                f"train today under dp, ep (dividing dp), microbatches, precision and activation checkpointing; "
                f"use {value.split('=')[0]}={0 if value.startswith('zero') else 1}."
            )


class ExpertParallel:
    """Style for a :class:`~behemoth.models.moe.MoEFeedForward`: keep this rank's experts of
    ``ep_axis`` and run tokens through dispatch -> local experts -> combine; the router losses
    over the batch spread on ``data_axis`` (see the module docstring)."""

    def __init__(self, ep_axis: str = "ep", data_axis: str = "dp") -> None:
        self.ep_axis, self.data_axis = ep_axis, data_axis

    def apply(self, module: nn.Module, mesh) -> nn.Module:
        if not isinstance(module, MoEFeedForward):
            raise TypeError(f"ExpertParallel applies to behemoth.models.MoEFeedForward, not {type(module).__name__}.")
        ep, data = mesh.axis(self.ep_axis), mesh.axis(self.data_axis)
        count = module.num_experts // ep.size
        shard = ExpertShard(module.num_experts, ep.rank * count, count, ep.name, f"{ep.name}_dp")
        if not ep.trivial:
            with torch.no_grad():
                for p in (module.gate_up_proj, module.down_proj):
                    full_shape = tuple(p.shape)
                    p.data = p.data[shard.first : shard.first + count].clone()
                    p._behemoth_expert_shard = shard
                    # where the block sits in the serial tensor: checkpoints write and read it as such
                    set_spec(p, ShardSpec(full_shape, (DimShard(0, ep.size, ep.rank, (ep.name,)),)))
        module.forward = types.MethodType(_make_forward(ep, data), module)
        return module


def _make_forward(ep: Axis, data: Axis):
    def forward(self: MoEFeedForward, x_BSH: torch.Tensor) -> torch.Tensor:
        x_TH = x_BSH.reshape(-1, x_BSH.shape[-1])
        logits_TE = self.router(x_TH)
        probs_TE, weights_TK, experts_TK = route(logits_TE, self.top_k)
        x_NH, local_counts, routed = dispatch(x_TH, experts_TK, self.num_experts, ep)
        y_NH = grouped_swiglu(x_NH, local_counts, self.gate_up_proj, self.down_proj)
        y_TH = combine(y_NH, weights_TK, routed)
        counts_E, prob_sums_E = balance_terms(probs_TE, experts_TK)
        # the serial batch's counts and tokens (float64: exact integers at any scale)
        totals = comm.all_reduce(torch.cat([counts_E, counts_E.new_tensor([x_TH.shape[0]])]).double(), data)
        totals = totals.to(prob_sums_E.dtype)
        self.token_counts = totals[:-1]  # the serial layer's: over the global batch
        self.aux_loss = self.router_loss(totals[:-1], prob_sums_E, z_loss_sum(logits_TE), totals[-1])
        return y_TH.view_as(x_BSH)

    return forward


def parallelize_experts(model: nn.Module, mesh, plan) -> dict[str, MoEFeedForward]:
    """Apply :class:`ExpertParallel` to every MoE layer of ``model`` (nothing to do for a model
    without one, or on a single data rank at ep = 1). Returns the layers. Run
    :func:`check_experts` first."""
    layers = moe_layers(model)
    if layers and (plan.ep > 1 or mesh.axis("dp").size > 1):
        apply_styles(model, {name: ExpertParallel() for name in layers}, mesh, what="expert plan")
    return layers


def gather_expert_state(model: nn.Module, mesh, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` (a full state dict of ``model``, on CPU) with each expert-parallel tensor
    replaced by all of its experts in the serial ``[E, ...]`` shape: one all-gather over ``ep``
    per expert tensor (a collective: every rank calls it)."""
    for name, t in model.state_dict(keep_vars=True).items():
        shard = expert_shard(t)
        if shard is not None:
            state[name] = comm.all_gather(t.detach().contiguous(), mesh.axis(shard.axis), 0).to("cpu")
    return state

"""Expert parallelism as a style: each rank keeps E/ep experts of every MoE layer and exchanges
tokens with the ranks that hold the others ("GShard", Lepikhin et al., 2021; dropless, as
MegaBlocks and torchtitan's ``ExpertParallel``).

The data axis ``dp`` is split ``ep_dp x ep`` (behemoth.mesh): experts are sharded over the
inner ``ep`` part and replicated over ``ep_dp``, while the rest of the model (attention, norms,
embeddings, the routers) stays replicated over the whole of ``dp``. So per-operator (with context
parallelism, ``dp`` reads ``dp_cp`` and ``ep_dp`` reads ``ep_dp_cp``: the cp ranks hold copies too):

===================  ======================  ============================  ====================
parameters           held                    gradients summed over         initial broadcast
===================  ======================  ============================  ====================
dense                whole, every dp rank    ``dp``                        over ``dp``
routers              whole, every dp rank    ``dp``; under tp ``dp_tp``    over ``dp``
experts              E/ep of E, by ep rank   ``ep_dp``; under tp           over ``ep_dp``
                                             ``ep_dp_tp``                  (:func:`data_axis_of`)
===================  ======================  ============================  ====================

Under ZeRO 1-3 the dense parameters and the experts are chunked apart and each chunk is sharded
over its own axis (the dense chunks over ``dp``, the expert chunks over ``ep_dp``: never gathered
beyond the ep rank's experts; under tensor parallelism an MoE block's chunks over those axes
times tp, :func:`expert_param_axes`). Under 1D tensor parallelism the attention and dense MLPs are split
over ``tp`` (:func:`dense_tensor_plan`) and the experts are whole on every tp rank, but the tp
ranks split each MoE block's tokens (:mod:`.tokens`, Megatron's "parallel folding" with expert
tensor parallelism 1): each routes and runs the experts on its own share, 1/tp of them (the
sequence's ``S/tp`` positions of each row; where ``S`` does not divide, the ``B*S`` tokens padded
to a multiple of tp). Without sequence parallelism the block takes its share of the whole input
(``ScatterToAxis``: the input gradient all-gathered whole again) and all-gathers its output
(``GatherFromAxis``); with sequence parallelism it slices its shard of the sequence the norm
gathered (the gather's reduce-scatter then sums exactly this rank's gradient into its shard) and
returns it: this rank's shard of the output. The block's parameters (router, experts, a shared
expert) have then seen only this rank's tokens, so their gradients are partial over ``tp``: they
are whole on every tp rank, replicated over their data axis times tp, and the gradient sync sums
them there, once per step as every gradient (``dp_tp``, ``ep_dp_tp``; under context parallelism
``dp_cp_tp``, ``ep_dp_cp_tp``: :func:`expert_param_axes`), not in every micro-batch's backward. Under the 2D, 2.5D and 3D grids the
block's input is the rank's batch block with its hidden block: the ranks of its grid row
(``tp_col``) exchange them (one all-to-all) for whole rows of a 1/q share of that batch block's
tokens each, and the outputs back (:class:`~.tokens.TokenShare` with ``hidden``); every rank of
the grid has then seen its own tokens, so the gradients are summed over the whole ``tp`` group
(every grid axis) with the data axis.

:class:`ExpertParallel` (``apply(moe_block, mesh)``) takes behemoth's
:class:`~behemoth.models.moe.MoEFeedForward` or a transformers sparse MoE block (Mixtral,
Qwen3-MoE, OLMoE; :mod:`.blocks`). It slices the fused ``gate_up_proj`` / ``down_proj`` to this
rank's block of experts *in place* (the same Parameter objects, so an optimizer built over the
serial model keeps them, and the state-dict keys stay the model's) and replaces the block's
forward (on the instance) by the block's own routing -> :func:`~.dispatch.dispatch` -> local
experts (:func:`~.grouped.grouped_swiglu`) -> :func:`~.dispatch.combine` over
``mesh.axis('ep')`` (+ the shared expert); with ``chunks`` > 1 (``Plan.ep_overlap``) chunk by
chunk, the all-to-alls overlapped with the experts' GEMMs (:func:`~.overlap.exchange`). The
router losses are those of the serial model on the *global* batch: the expert counts, the
capacity's drops and the token count are summed over ``dp`` (one all-reduce of 2E + 1 numbers
per layer; ``token_counts`` holds the global counts), and each rank's loss is its share (the
router probabilities of its tokens), so the shares summed over ``dp`` are the serial loss
(:mod:`.losses`). Under 1D tensor parallelism the tp shares of those numbers, of the probability
sums and of the z-loss sum are first added up over ``tp`` (one all-reduce of 3E + 2 numbers per
layer): each tp rank's loss then reads as its data rank's whole share (the reported loss stays
the serial one) while its gradient is that of its own tokens' part. Under a grid the shares are
added over the axis whose ranks hold the same input rows (:func:`~.tokens.grid_axes`), the
counts over the rest of the grid too, since the engine sums the reported loss over the grid's
input batch axes. The style is applied to
every MoE block, at ep = 1 and on one data rank too
(a pipeline, tensor parallelism, one device): its trivial axes' collectives cost nothing, and the
tokens still take one sort by expert, one host read of the split sizes and grouped GEMMs, where
the serial layer's loop over experts waits for the device once per expert (``torch.where``)
and runs each expert's GEMMs alone, in every micro-batch. A capacity is per sequence, and each data rank holds whole sequences, so every
rank drops exactly what the serial model drops; where a rank holds a share of each sequence
(context parallelism, and the tp ranks' token split: the same path, the tp share inside the cp
one) the experts its peers' tokens chose are all-gathered (``B*S*K`` integers per layer over
``cp``, and over ``tp``), the capacity is taken over the whole sequences as serially, and each
rank keeps its share of the verdict.

:func:`parallelize_experts` applies it to every MoE layer of a model; :func:`check_experts`
refuses (before any collective) what does not compose yet; :func:`gather_expert_state` puts
the experts of a state dict back in the serial ``[E, ...]`` shapes.

Tested in tests/dist/test_expert_parallel.py against serial training (under 1D tensor
parallelism: tests/dist/test_expert_tensor.py and tests/dist/test_expert_tokens.py; under the
grids: tests/dist/test_expert_grid.py).
"""

from __future__ import annotations

import fnmatch
import types
from dataclasses import dataclass

import torch
from torch import nn
from torch.profiler import record_function

from ... import comm
from ...comm import Axis
from ...models.moe import MoEFeedForward, balance_terms, z_loss_sum
from ...specs import find_spec
from ..context.layout import gather_sequence, split_sequence
from ..style import apply_styles
from ..tensor.layout import DimShard, ShardSpec, set_spec
from ..tensor.region1d import ParallelRegion
from .blocks import ExpertBlock, experts_forward, is_transformers_moe_block
from .dispatch_members import dedup_applies
from .grouped import group_alignment
from .local import local_exchange, local_ready
from .losses import ExpertLayers
from .overlap import exchange
from .replay import routes
from .tokens import TokenShare, TokenSplit, grid_axes, sum_shares, token_axis

__all__ = [
    "ExpertParallel",
    "ExpertShard",
    "check_experts",
    "data_axis_of",
    "dense_tensor_plan",
    "expert_param_axes",
    "expert_shard",
    "gather_expert_state",
    "moe_layers",
    "parallelize_experts",
    "summed_over_tp",
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


def summed_over_tp(p: torch.Tensor) -> bool:
    """Whether ``p`` belongs to an MoE block whose tp ranks each run their own share of its tokens
    (:mod:`.tokens`): its gradient on a rank is that share's, summed over tp by the gradient sync."""
    return getattr(p, "_behemoth_summed_over_tp", False)


def expert_param_axes(model: nn.Module, mesh, data_axis: Axis):
    """For the gradient sync: ``p -> (the axis p is replicated over, the axis it is sharded over or
    None)`` -- ``(ep_dp, ep)`` for a sharded expert, ``(data_axis, None)`` for the rest; under tensor
    parallelism an MoE block's parameters (:func:`summed_over_tp`: router, experts, shared expert)
    are replicated over that axis times tp, ``dp_tp`` (``dp_cp_tp``) or ``ep_dp_tp``
    (``ep_dp_cp_tp``), where their partial gradients are summed once per step -- or None when
    ``model`` holds neither (every parameter then follows ``data_axis``)."""
    if not any(expert_shard(p) is not None or summed_over_tp(p) for p in model.parameters()):
        return None

    def axes(p: torch.Tensor) -> tuple[Axis, Axis | None]:
        shard = expert_shard(p)
        replicas = data_axis.name if shard is None else shard.data_axis
        if summed_over_tp(p):
            replicas += "_tp"
        return mesh.axis(replicas), None if shard is None else mesh.axis(shard.axis)

    return axes


def moe_layers(model: nn.Module) -> dict[str, nn.Module]:
    """``{name: block}`` of the model's mixture-of-experts blocks, in module order: behemoth's
    :class:`~behemoth.models.moe.MoEFeedForward` layers, and for a transformers family whose spec
    names its MoE blocks (``ModelSpec.experts``) the sparse blocks that pattern matches (a dense
    MLP it also matches, as in Qwen3-MoE's ``mlp_only_layers``, is left out)."""
    spec = find_spec(model)
    pattern = spec.experts if spec is not None else None
    found = {}
    for name, m in model.named_modules():
        if isinstance(m, MoEFeedForward):
            found[name] = m
        elif pattern and fnmatch.fnmatchcase(name, pattern) and is_transformers_moe_block(m):
            found[name] = m
    return found


def check_experts(model: nn.Module, plan) -> None:
    """Refuse, on every rank before any collective, a plan the model's experts cannot run under:
    ``Plan.ep`` > 1 on a model without behemoth MoE layers or with a number of experts it does
    not divide (ValueError); every tensor-parallel mode composes. Under a tensor-parallel grid
    (2D, 2.5D, 3D) it marks each MoE block ``_behemoth_grid_rows``: the grid's parameter check
    then leaves its parameters to this style, which runs the block on whole rows."""
    layers = moe_layers(model)
    if not layers:
        if plan.ep > 1:
            raise ValueError(
                f"Plan.ep={plan.ep} shards experts, but {type(model).__name__} has no mixture-of-experts layer "
                f"behemoth knows (behemoth.models.MoEFeedForward, or the sparse MoE blocks of a transformers "
                f"family in behemoth.specs: Mixtral, Qwen3-MoE, OLMoE). Use ep=1, or a model with num_experts > 0 "
                f"(e.g. the llama-moe-tiny preset)."
            )
        return
    for name, layer in layers.items():
        num_experts = ExpertBlock(layer).num_experts
        if num_experts % plan.ep:
            raise ValueError(
                f"Plan.ep={plan.ep} must divide the number of experts of every MoE layer; {name!r} has "
                f"{num_experts}. Choose ep among the divisors of {num_experts}."
            )
    if plan.tp > 1 and plan.tp_mode != "1d":  # whole rows of its tokens: tensor parallelism leaves it be
        for layer in layers.values():
            layer._behemoth_grid_rows = True


class ExpertParallel:
    """Style for a mixture-of-experts block (behemoth's
    :class:`~behemoth.models.moe.MoEFeedForward` or a transformers sparse MoE block,
    :mod:`.blocks`): keep this rank's experts of ``ep_axis`` and run tokens through dispatch ->
    local experts -> combine; the router losses over the batch spread on ``data_axis`` (``dp``, or
    ``dp_cp`` under context parallelism; see the module docstring). The experts' copies are
    replicated over ``replica_axis`` (``ep_dp``, or ``ep_dp_cp`` under context parallelism).
    ``context``: ``(cp axis, cp mode)`` when the sequence is split over ranks (a capacity then
    sees the whole sequences), else None. ``sequence_parallel``: the model's 1D
    :class:`~behemoth.parallel.tensor.region1d.ParallelRegion` under sequence parallelism (the
    block reads the norm's gathered sequence and returns this tp rank's shard; whole in and out
    while the region pauses it), else None.
    ``tensor_axis``: the tensor-parallel axis whose ranks split the block's tokens
    (:mod:`.tokens`), or None (every token on every rank). ``grid``: under the 2D, 2.5D and 3D
    grids (``tensor_axis`` then ``"tp_col"``, the block's input and output this rank's hidden
    block of its batch block, the block's gradients summed over the whole grid ``"tp"`` by the
    gradient sync), ``(the
    axis the router losses' shares are summed over, the other axes of the grid)``: the first is
    the grid axis the engine does not sum the reported losses over (:func:`grid_axes`); else
    None. ``chunks``: the tokens of each forward
    split into this many runs, each run's all-to-alls overlapped with another's expert GEMMs
    (:mod:`.overlap`); 1 exchanges them at once. ``dedup``: send each token once per member
    holding any of its experts (:mod:`.dispatch_members`) where
    :func:`~.dispatch_members.dedup_applies`."""

    def __init__(
        self,
        ep_axis: str = "ep",
        data_axis: str = "dp",
        replica_axis: str = "ep_dp",
        context: tuple[str, str] | None = None,
        sequence_parallel=None,
        chunks: int = 1,
        dedup: bool = False,
        tensor_axis: str | None = None,
        grid: tuple[str, tuple[str, ...]] | None = None,
    ) -> None:
        if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1:
            raise ValueError(f"ExpertParallel(chunks={chunks!r}): must be an integer >= 1 (1: no overlap).")
        self.ep_axis, self.data_axis, self.replica_axis = ep_axis, data_axis, replica_axis
        self.context, self.sequence_parallel, self.chunks = context, sequence_parallel, chunks
        self.dedup = dedup
        self.tensor_axis, self.grid = tensor_axis, grid

    def apply(self, module: nn.Module, mesh) -> nn.Module:
        block = ExpertBlock(module)  # TypeError for any other module
        ep, data = mesh.axis(self.ep_axis), mesh.axis(self.data_axis)
        count = block.num_experts // ep.size
        shard = ExpertShard(block.num_experts, ep.rank * count, count, ep.name, self.replica_axis)
        if not ep.trivial:
            with torch.no_grad():
                for p in (block.holder.gate_up_proj, block.holder.down_proj):
                    full_shape = tuple(p.shape)
                    p.data = p.data[shard.first : shard.first + count].clone()
                    p._behemoth_expert_shard = shard
                    # where the block sits in the serial tensor: checkpoints write and read it as such
                    set_spec(p, ShardSpec(full_shape, (DimShard(0, ep.size, ep.rank, (ep.name,)),)))
        if not block.native:
            block.holder.forward = types.MethodType(experts_forward, block.holder)
        whole_rows = None
        if self.context is not None and not mesh.axis(self.context[0]).trivial:
            whole_rows = _whole_rows(mesh.axis(self.context[0]), self.context[1])
        split = None
        grid = self.grid is not None
        if self.tensor_axis is not None and not mesh.axis(self.tensor_axis).trivial:
            tp = mesh.axis(self.tensor_axis)
            loss, rows = (mesh.axis(self.grid[0]), tuple(mesh.axis(a) for a in self.grid[1])) if grid else (tp, ())
            split = TokenSplit(tp, self.sequence_parallel, grid, loss, rows)
        # each token sent once per member holding its experts where that sends fewer rows (dispatch_members)
        facts = dict(ep=ep.size, num_experts=block.num_experts, top_k=block.top_k, chunks=self.chunks)
        members = self.dedup and dedup_applies(**facts, dropless=block.dropless)
        forward = _make_forward(block, ep, data, whole_rows, split, self.chunks, members)
        module.forward = types.MethodType(forward, module)
        if split is not None:  # partial gradients over tp (the whole grid): the gradient sync sums them
            for p in module.parameters():
                p._behemoth_summed_over_tp = True
        module._behemoth_expert_routes = True  # its routes are kept for a recompute (replay.recorded)
        return module


def _whole_rows(cp: Axis, mode: str):
    """``(gather, take)`` for a capacity under context parallelism (``mode``'s layout of the
    sequence over ``cp``): ``gather(t_BSK)`` all-gathers a per-token tensor over ``cp`` and puts
    the whole sequences back in order; ``take(t_BSK)`` returns this rank's share of them."""

    def gather(t_BSK: torch.Tensor) -> torch.Tensor:
        parts = comm.all_gather(t_BSK.unsqueeze(0).contiguous(), cp, 0)
        return gather_sequence(list(parts.unbind(0)), 1, mode)

    def take(t_BSK: torch.Tensor) -> torch.Tensor:
        return split_sequence(t_BSK, 1, cp.size, cp.rank, mode)

    return gather, take


def _make_forward(
    block: ExpertBlock, ep: Axis, data: Axis, whole_rows=None, split=None, chunks: int = 1, members: bool = False
):
    def forward(self: nn.Module, x_BSH: torch.Tensor) -> torch.Tensor:
        # 1D tensor parallelism: this tp rank routes and runs its own share of the tokens (.tokens);
        # sequence parallelism (unless paused): x_BSH is the norm's gathered sequence, and the share
        # (this rank's shard) is what the block returns
        share = None
        if split is not None:
            region = split.region
            sequence_parallel = region is not None and not region.sequence_parallel_paused
            share = TokenShare(split.tp, x_BSH.shape, sequence_parallel, hidden=split.hidden)
        x_in = x_BSH if share is None else share.take(x_BSH)
        rows = whole_rows if share is None else _then(share.rows(), whole_rows)
        x_in = block.jitter(x_in)
        x_TH = x_in.reshape(-1, x_in.shape[-1])
        with record_function("behemoth::moe_route"):  # ranges a profiler's tables can name
            r = block.route(x_in, rows)
            # groups padded for the grouped GEMMs where they run (in the permutation dispatch makes anyway);
            # a checkpointed block's recompute gets its forward's routes back (no sort, no host read). The
            # split sizes' read to the host is started here and waited for in the exchange: the balancing
            # statistics in between keep the device busy while the host waits
            # every expert on this rank (local_ready): routes made on the device alone, no host read
            local = ep.trivial and local_ready(x_TH, block, r)
            routed = (
                None
                if local
                else routes(
                    r.experts_TK, block.num_experts, ep, chunks=chunks, align=group_alignment(x_TH), members=members
                )
            )
        with record_function("behemoth::moe_balance"):
            counts_E, prob_sums_E = balance_terms(r.probs_TE, r.chosen_TK)
            z_sum = z_loss_sum(r.logits_TE) if block.native else None
            # the serial batch's counts, drops and tokens (float64: exact integers at any scale)
            local = torch.cat([counts_E, r.dropped_counts(), counts_E.new_full((1,), x_TH.shape[0])]).double()
            if share is not None:
                local, prob_sums_E, z_sum = sum_shares(local, prob_sums_E, z_sum, split.loss)
                for ax in split.rows:  # the grid's other tokens: their counts, drops and token counts
                    local = comm.all_reduce(local, ax)
            totals = comm.all_reduce(local, data).to(prob_sums_E.dtype)
        with record_function("behemoth::moe_exchange"):
            if routed is None:
                experts = (r.experts_TK, block.num_experts, block.run_experts, block.shared)
                y_TH = local_exchange(x_TH, r.weights_TK, *experts)
            else:
                y_TH = exchange(x_TH, r.weights_TK, routed, block.run_experts, block.shared)
        num_experts = block.num_experts
        counts_E, dropped_E, num_tokens = totals[:num_experts], totals[num_experts:-1], totals[-1]
        if block.native:
            self.record_routing(counts_E, dropped_E)
            self.aux_loss = self.router_loss(counts_E, prob_sums_E, z_sum, num_tokens)
        else:  # transformers: one balancing loss over every layer (behemoth.parallel.expert.losses)
            self.token_counts = counts_E
            self._behemoth_router_terms = (counts_E, prob_sums_E, num_tokens)
        y = y_TH.view_as(x_in)
        return y if share is None else share.give(y)

    return forward


def _then(inner, outer):
    """``(gather, take)`` of a capacity's rows through ``inner`` (the tp share) then ``outer``
    (context parallelism's, or None)."""
    if outer is None:
        return inner
    (gather_in, take_in), (gather_out, take_out) = inner, outer
    return (lambda t: gather_out(gather_in(t))), (lambda t: take_in(take_out(t)))


def dense_tensor_plan(model: nn.Module, tp_plan: dict[str, str]) -> dict[str, str]:
    """``tp_plan`` (a family's tensor plan) for a model with MoE blocks: entries inside an MoE
    block (a dense MLP's roles where the family's MLP became experts) that match no module are
    dropped -- experts are whole on every tp rank -- and every other entry is kept as it is."""
    layers = moe_layers(model)
    if not layers:
        return tp_plan
    names = [n for n, _ in model.named_modules()]
    out = {}
    for pattern, role in tp_plan.items():
        hits = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        inside = any(fnmatch.fnmatchcase(layer, pattern.rsplit(".", 1)[0]) for layer in layers)
        if hits or not inside:
            out[pattern] = role
    return out


def parallelize_experts(model: nn.Module, mesh, plan) -> ExpertLayers:
    """Apply :class:`ExpertParallel` to every MoE block of ``model``, whatever the plan (see the
    module docstring; transformers' blocks need it for their balancing loss to join the objective
    too). Returns the :class:`~.losses.ExpertLayers` record. Run :func:`check_experts` first."""
    layers = moe_layers(model)
    sequence_parallel = plan.tp > 1 and plan.sequence_parallel  # the block returns its tp rank's shard
    style = ExpertParallel(
        data_axis="dp_cp" if plan.cp > 1 else "dp",
        replica_axis="ep_dp_cp" if plan.cp > 1 and plan.ep > 1 else "ep_dp",
        context=("cp", plan.cp_mode) if plan.cp > 1 else None,
        sequence_parallel=_region_of(model) if sequence_parallel else None,
        chunks=plan.ep_overlap,
        dedup=plan.ep_dedup,
        tensor_axis=token_axis(plan),  # the tp ranks split the tokens
        grid=grid_axes(plan),
    )
    styled = dict.fromkeys(layers, style)
    if styled:
        apply_styles(model, styled, mesh, what="expert plan")
    return ExpertLayers(model, layers)


def _region_of(model: nn.Module):
    """The 1D tensor-parallel region of ``model`` (one per model: whether sequence parallelism is
    paused, as generation pauses it)."""
    for m in model.modules():
        region = getattr(m, "region", None)
        if isinstance(region, ParallelRegion):
            return region
    raise ValueError(f"sequence parallelism: {type(model).__name__} has no 1D tensor-parallel layer.")


def gather_expert_state(model: nn.Module, mesh, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` (a full state dict of ``model``, on CPU) with each expert-parallel tensor
    replaced by all of its experts in the serial ``[E, ...]`` shape: one all-gather over ``ep``
    per expert tensor (a collective: every rank calls it)."""
    for name, t in model.state_dict(keep_vars=True).items():
        shard = expert_shard(t)
        if shard is not None:
            state[name] = comm.all_gather(t.detach().contiguous(), mesh.axis(shard.axis), 0).to("cpu")
    return state

"""Expert parallelism: the router's tokens dispatched to the ranks holding their experts
(:mod:`.dispatch`, its rows moved by :mod:`.rows`; once per member holding any of a token's
experts, :mod:`.dispatch_members`), chunk by chunk with the all-to-alls overlapped with the
experts' GEMMs (:mod:`.overlap`), grouped expert GEMMs (:mod:`.grouped`), the MoE blocks it knows
(:mod:`.blocks`: behemoth's and transformers'), the style that plugs them into a model's MoE
blocks (:mod:`.style`), their routes kept for activation checkpointing's recompute
(:mod:`.replay`), and their router losses (:mod:`.losses`)."""

from .blocks import ExpertBlock, is_transformers_moe_block
from .dispatch import Routes, combine, dispatch
from .grouped import grouped_swiglu
from .losses import ExpertLayers
from .overlap import exchange
from .replay import recorded, replays_routing
from .style import (
    ExpertParallel,
    ExpertShard,
    check_experts,
    data_axis_of,
    dense_tensor_plan,
    expert_param_axes,
    expert_shard,
    gather_expert_state,
    moe_layers,
    parallelize_experts,
)

__all__ = [
    "ExpertBlock",
    "ExpertLayers",
    "ExpertParallel",
    "ExpertShard",
    "Routes",
    "check_experts",
    "combine",
    "data_axis_of",
    "dense_tensor_plan",
    "dispatch",
    "exchange",
    "expert_param_axes",
    "expert_shard",
    "gather_expert_state",
    "grouped_swiglu",
    "is_transformers_moe_block",
    "moe_layers",
    "parallelize_experts",
    "recorded",
    "replays_routing",
]

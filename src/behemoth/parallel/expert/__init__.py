"""Expert parallelism: the router's tokens dispatched to the ranks holding their experts
(:mod:`.dispatch`), grouped expert GEMMs (:mod:`.grouped`), and the style that plugs them into
a model's MoE layers (:mod:`.style`)."""

from .dispatch import combine, dispatch
from .grouped import grouped_swiglu
from .style import (
    ExpertParallel,
    ExpertShard,
    check_experts,
    data_axis_of,
    expert_param_axes,
    expert_shard,
    gather_expert_state,
    moe_layers,
    parallelize_experts,
)

__all__ = [
    "ExpertParallel",
    "ExpertShard",
    "check_experts",
    "combine",
    "data_axis_of",
    "dispatch",
    "expert_param_axes",
    "expert_shard",
    "gather_expert_state",
    "grouped_swiglu",
    "moe_layers",
    "parallelize_experts",
]

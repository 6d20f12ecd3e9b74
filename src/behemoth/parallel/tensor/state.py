"""The serial model seen through its tensor-parallel shards: its state dict
(:func:`full_state_dict`), from every parameter's :class:`~behemoth.parallel.tensor.layout.ShardSpec`
alone, whatever the mode. (The serial model's gradient norm is the gradient sync's, which weighs
each shard by :func:`~.layout.shard_copies`: :meth:`behemoth.parallel.zero.optimizer.ZeroOptimizer.grad_norm`.)

Tested in tests/dist/test_tp*.py (``full_state_dict()`` and the clipped norm against serial
training).
"""

from __future__ import annotations

import torch

from ... import comm
from .layout import get_spec, is_sharded, place_shard, with_indices


def full_state_dict(model: torch.nn.Module, mesh) -> dict[str, torch.Tensor]:
    """The serial model's state dict on CPU: every sharded parameter all-gathered over ``tp``
    and reassembled from its ShardSpec (fused views and tied weights included); one
    all-gather of the shard indices, then one all-gather per sharded tensor."""
    tp = mesh.axis("tp")
    state = model.state_dict(keep_vars=True)
    sharded = {}
    for v in state.values():
        spec = get_spec(v)
        over_ep = is_sharded(spec) and any("ep" in d.axes for d in spec.dims)  # experts: gathered by their style
        if is_sharded(spec) and not over_ep and id(v) not in sharded:
            sharded[id(v)] = (v, spec)
    full: dict[int, torch.Tensor] = {}
    if sharded and not tp.trivial:
        width = max(len(spec.dims) for _, spec in sharded.values())
        device = next(iter(sharded.values()))[0].device
        mine = torch.tensor(
            [[d.index for d in spec.dims] + [0] * (width - len(spec.dims)) for _, spec in sharded.values()],
            dtype=torch.int64,
            device=device,
        )
        everyone = comm.all_gather(mine.reshape(1, -1), tp).reshape(tp.size, len(sharded), width).tolist()
        for k, (key, (v, spec)) in enumerate(sharded.items()):
            parts = comm.all_gather(v.detach().reshape(1, -1), tp)
            out = torch.empty(spec.full_shape, dtype=v.dtype, device=v.device)
            for member in range(tp.size):
                place_shard(out, parts[member], with_indices(spec, everyone[member][k][: len(spec.dims)]))
            full[key] = out
    elif sharded:  # a "sharded" tensor on a trivial axis is the whole tensor
        full = {key: v.detach().reshape(spec.full_shape) for key, (v, spec) in sharded.items()}
    return {k: full.get(id(v), v).detach().to("cpu", copy=True) for k, v in state.items()}

"""The serial model seen through its tensor-parallel shards: its state dict
(:func:`full_state_dict`) and its gradient norm (:func:`global_grad_norm`), from every
parameter's :class:`~behemoth.parallel.tensor.layout.ShardSpec` alone, whatever the mode.

Tested in tests/dist/test_tp*.py (``full_state_dict()`` and the clipped norm against serial
training).
"""

from __future__ import annotations

import torch

from ... import comm
from .layout import get_spec, is_sharded, place_shard, shard_copies, with_indices


def full_state_dict(model: torch.nn.Module, mesh) -> dict[str, torch.Tensor]:
    """The serial model's state dict on CPU: every sharded parameter all-gathered over ``tp``
    and reassembled from its ShardSpec (fused views and tied weights included); one
    all-gather of the shard indices, then one all-gather per sharded tensor."""
    tp = mesh.axis("tp")
    state = model.state_dict(keep_vars=True)
    sharded = {}
    for v in state.values():
        spec = get_spec(v)
        if is_sharded(spec) and id(v) not in sharded:
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


def global_grad_norm(params: list[torch.nn.Parameter], mesh) -> torch.Tensor:
    """The serial model's gradient 2-norm from this rank's shards (gradients already reduced
    over dp): replicated parameters count once; sharded ones are summed over ``tp`` with one
    all-reduce of a scalar, each shard weighted 1/(its number of copies on the tp axis)."""
    tp = mesh.axis("tp")
    grads = [p.grad for p in params if p.grad is not None]
    if tp.trivial:
        return torch.nn.utils.get_total_norm(grads, foreach=True)
    rep, shd, weights = [], [], []
    for p in params:
        if p.grad is None:
            continue
        spec = get_spec(p)
        if is_sharded(spec):
            shd.append(p.grad)
            weights.append(1.0 / shard_copies(spec, tp.size))
        else:
            rep.append(p.grad)
    device = grads[0].device if grads else torch.device("cpu")
    sq = torch.zeros(2, dtype=torch.float32, device=device)
    if rep:
        sq[0] = torch.stack(torch._foreach_norm(rep)).square().sum()
    if shd:
        w = torch.tensor(weights, dtype=torch.float32, device=device)
        sq[1] = (torch.stack(torch._foreach_norm(shd)).square() * w).sum()
    shard_sq = sq[1:].clone()
    comm.all_reduce(shard_sq, tp)
    return (sq[0] + shard_sq[0]).sqrt()

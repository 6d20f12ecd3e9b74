"""What a checkpoint sees of ZeRO's sharded state: the optimizer state per parameter (shaped like
the parameter), gathered from every rank's chunk shards and cut back into them, the masters
reloaded from parameters a checkpoint wrote, and where an optimizer wants a loaded state tensor
(shared with the plain optimizer's checkpoint path)."""

from __future__ import annotations

import torch

from ... import comm

__all__ = ["load_param_states", "param_states", "reload_from_params", "state_to"]


def state_to(v, device: torch.device, optimizer: torch.optim.Optimizer):
    """Optimizer state ``v`` where ``optimizer`` wants it for a parameter on ``device``: tensors on
    that device; 0-d step counters on the CPU unless a group is fused or capturable."""
    if not isinstance(v, torch.Tensor):
        return v
    fused = any(g.get("fused") or g.get("capturable") for g in optimizer.param_groups)
    return v.to(device) if v.dim() > 0 or fused else v.cpu()


def param_states(zero) -> dict[torch.nn.Parameter, dict[str, torch.Tensor]]:
    """The optimizer state per parameter of the ZeRO optimizer ``zero`` (shaped like the parameter,
    on the CPU), gathered chunk by chunk over the axis each chunk is sharded over: what a checkpoint stores (a
    collective: every rank)."""
    out: dict = {}
    for st in zero.store.chunks:
        state = zero.optimizer.state.get(st.master, {})
        for key in sorted(state):
            v = state[key]
            if isinstance(v, torch.Tensor) and v.shape == st.master.shape:
                full = torch.empty(st.size, dtype=v.dtype, device=zero.device)
                comm.all_gather_into(full, v.to(zero.device), zero.store.replica_axis(st))
                full = full.cpu()
                for p, off in zip(st.params, st.offsets):
                    out.setdefault(p, {})[key] = full[off : off + p.numel()].view(p.shape).clone()
            else:
                for p in st.params:
                    out.setdefault(p, {})[key] = v.detach().clone() if isinstance(v, torch.Tensor) else v
    return out


def load_param_states(zero, states: dict[torch.nn.Parameter, dict[str, torch.Tensor]]) -> None:
    """Inverse of :func:`param_states`: cut every parameter's state into this rank's shards."""
    zero.optimizer.state.clear()
    for st in zero.store.chunks:
        keys = {k for p in st.params for k in states.get(p, {})}
        if not keys:
            continue
        state = {}
        for key in sorted(keys):
            sample = next(states[p][key] for p in st.params if key in states.get(p, {}))
            if sample.dim() > 0:
                full = torch.zeros(st.size, dtype=sample.dtype)
                for p, off in zip(st.params, st.offsets):
                    if key in states.get(p, {}):
                        full[off : off + p.numel()] = states[p][key].reshape(-1).cpu()
                state[key] = full[st.start : st.start + st.shard_size].to(st.master.device).clone()
            else:
                state[key] = sample
        zero.optimizer.state[st.master] = {k: state_to(v, st.master.device, zero.optimizer) for k, v in state.items()}


def reload_from_params(store) -> None:
    """After parameters were written in place (a checkpoint load, inside the ZeRO optimizer's
    ``gathered()``): copy this rank's slice of every chunk of ``store`` into its shard and master."""
    with torch.no_grad():
        for st in store.chunks:
            mine = store.own_slot(st)
            for t in (st.shard, st.master):
                if t is not None and t.data_ptr() != mine.data_ptr():
                    t.copy_(mine)

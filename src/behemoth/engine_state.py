"""What an engine's parts contribute to a checkpoint (:mod:`behemoth.checkpoint`'s ``Stateful``).

* :class:`ModelState` -- this rank's model tensors under their serial names, read in place (each
  tensor-parallel shard carries its ShardSpec; a pipeline stage holds its stage's tensors only);
* :class:`OptimizerState` -- the gradient sync's optimizer state per parameter (``<name>/<key>``,
  each tensor shaped like this rank's parameter, so a shard's state is written as the shard), the
  optimizer class and its hyper-parameters;
* the engine itself contributes its step counter, loss scaler and plan
  (:meth:`behemoth.engine.Engine.state_dict`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from .checkpoint_shards import with_spec
from .parallel.tensor import is_sharded
from .parallel.tensor.layout import get_spec

__all__ = ["ModelState", "OptimizerState"]


class ModelState:
    """The model's parameters and buffers (``state_dict(keep_vars=True)``), loaded in place."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.model.state_dict(keep_vars=True)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Nothing left to do: the checkpoint read into the model's own tensors."""


def _hyper_params(optimizer: torch.optim.Optimizer) -> list[dict]:
    groups = []
    for g in optimizer.param_groups:
        d = {}
        for k, v in g.items():
            if k == "params":
                continue
            if isinstance(v, torch.Tensor):
                v = v.item()
            if isinstance(v, tuple):
                v = list(v)
            if isinstance(v, (int, float, bool, str, list)) or v is None:
                d[k] = v
        groups.append(d)
    return groups


class OptimizerState:
    """The optimizer state of ``grad_sync`` (a :class:`~behemoth.parallel.zero.sync.GradSync`, whose
    ``state_dict()`` is ``{param name: {key: tensor}}``) for ``params``, this rank's parameters by
    the serial model's names."""

    def __init__(self, grad_sync, params: Mapping[str, nn.Parameter]) -> None:
        self.grad_sync, self.params = grad_sync, dict(params)

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, state in self.grad_sync.state_dict().items():
            p = self.params[name]
            for key, v in state.items():
                v = v if isinstance(v, torch.Tensor) else torch.tensor(v)
                out[f"{name}/{key}"] = with_spec(v, get_spec(p) if v.shape == p.shape else None)
        optimizer = self.grad_sync.optimizer
        out["optimizer"] = type(optimizer).__name__
        out["param_groups"] = _hyper_params(optimizer)
        return out

    def load_targets(self, stored: Mapping[str, Any], meta: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """Where to read the stored state of the parameters this rank holds: shard-shaped for a
        tensor-parallel parameter's state, full-shaped on the CPU otherwise."""
        mine = type(self.grad_sync.optimizer).__name__
        if meta["optimizer"] != mine:
            raise ValueError(
                f"checkpoint holds {meta['optimizer']} state; the engine's optimizer is {mine}. Build the same "
                f"optimizer class to resume."
            )
        targets = {}
        for k, md in stored.items():
            name, _ = k.rsplit("/", 1)
            if name not in self.params:
                continue
            p = self.params[name]
            spec = get_spec(p)
            if is_sharded(spec) and tuple(md.size) == spec.full_shape:  # state shaped like the shard
                t = torch.empty(spec.local_shape(), dtype=md.properties.dtype, device=p.device)
                targets[k] = with_spec(t, spec)
            else:
                targets[k] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
        return targets

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        states: dict[str, dict[str, torch.Tensor]] = {}
        for k, v in state.items():
            if "/" in k:
                name, key = k.rsplit("/", 1)
                states.setdefault(name, {})[key] = v
        self.grad_sync.load_state_dict(states)
        for g, hyper in zip(self.grad_sync.optimizer.param_groups, state["param_groups"]):
            for k, v in hyper.items():
                if k in g:
                    g[k] = tuple(v) if isinstance(g[k], tuple) else v

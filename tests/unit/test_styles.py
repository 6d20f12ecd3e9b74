"""The style protocol: a plan's patterns, their errors, and replacement by name."""

from __future__ import annotations

import pytest
from torch import nn

from behemoth.parallel.style import ParallelStyle, apply_styles, match_plan


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(2, 2), nn.ReLU()) for _ in range(2))
        self.head = nn.Linear(2, 3)


class Tag:
    """A style that records the modules it saw and swaps Linears for Identity."""

    def __init__(self) -> None:
        self.seen: list[nn.Module] = []

    def apply(self, module, mesh):
        self.seen.append(module)
        return nn.Identity() if isinstance(module, nn.Linear) else module


def test_match_plan_orders_by_module_and_rejects_bad_patterns():
    net = Net()
    assert list(match_plan(net, {"head": 1, "blocks.*.0": 2})) == ["blocks.0.0", "blocks.1.0", "head"]
    with pytest.raises(ValueError, match="pattern 'blocks.*.9' .* matches no module of Net"):
        match_plan(net, {"blocks.*.9": 1})
    with pytest.raises(ValueError, match="module 'head' of Net gets two entries of tp_plan"):
        match_plan(net, {"head": 1, "he*": 2}, what="tp_plan")
    with pytest.raises(ValueError, match="must be a non-empty dict"):
        match_plan(net, {})


def test_apply_styles_replaces_by_name_and_checks_everything_first():
    net, style = Net(), Tag()
    assert isinstance(style, ParallelStyle)
    apply_styles(net, {"blocks.*.0": style, "head": style}, mesh=None)
    assert [type(m) for m in style.seen] == [nn.Linear] * 3
    assert isinstance(net.blocks[0][0], nn.Identity) and isinstance(net.head, nn.Identity)
    fresh, other = Net(), Tag()
    with pytest.raises(TypeError, match="is not a parallel style"):
        apply_styles(fresh, {"head": other, "blocks.0.1": "colwise"}, mesh=None)
    assert other.seen == [] and isinstance(fresh.head, nn.Linear)  # nothing applied before the error

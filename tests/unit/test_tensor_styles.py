"""The tensor-parallel style tables: one style class per role and mode, found by plain import,
and the plan entries parallelize_tensor accepts (no processes: everything here is checked before
any collective)."""

import re

import pytest
import torch.nn as nn

import behemoth as bh
from behemoth.mesh import ParallelMesh
from behemoth.parallel import tensor as tp
from behemoth.parallel.tensor.apply import MODE_STYLES, _style_of
from behemoth.specs import TP_ROLES


@pytest.mark.parametrize("mode", sorted(MODE_STYLES))
def test_every_mode_has_one_style_class_per_role(mode):
    table = MODE_STYLES[mode].styles
    assert sorted(table) == sorted(TP_ROLES)
    suffix = {"1d": "1D", "2d": "2D", "2.5d": "25D", "3d": "3D"}[mode]
    for role, cls in table.items():
        assert cls.role == role and cls.mode == mode
        assert re.fullmatch(r"[A-Z][A-Za-z]*Parallel" + suffix, cls.__name__), cls.__name__
        assert getattr(tp, cls.__name__) is cls  # exported by the package
        assert isinstance(cls(), bh.parallel.style.ParallelStyle)


def test_plan_entries_become_styles():
    assert _style_of("a", "colwise", "1d") == tp.ColwiseParallel1D()
    assert _style_of("a", "head", "2.5d") == tp.HeadParallel25D()
    mine = tp.RowwiseParallel3D(overlap=2)
    assert _style_of("a", mine, "3d") is mine
    with pytest.raises(ValueError, match=r"tp_policy\['a'\] = 'columnwise' is not a tensor-parallel role"):
        _style_of("a", "columnwise", "1d")
    with pytest.raises(ValueError, match="tp_mode='3d' style, but the plan has tp_mode='2d'; use RowwiseParallel2D"):
        _style_of("a", mine, "2d")
    with pytest.raises(ValueError, match="neither a tensor-parallel role"):
        _style_of("a", nn.Linear(2, 2), "1d")


def test_plan_errors_before_any_collective():
    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = nn.Linear(8, 8), nn.Linear(8, 8)

    plan = bh.Plan(tp=2)
    mesh = ParallelMesh(plan, rank=0, world_size=2, create_groups=False)
    with pytest.raises(ValueError, match="tensor parallelism has no policy for Tiny"):
        tp.parallelize_tensor(Tiny(), mesh, plan)
    with pytest.raises(ValueError, match="'upp' .* matches no module of Tiny"):
        tp.parallelize_tensor(Tiny(), mesh, plan, {"upp": "colwise"})
    with pytest.raises(ValueError, match="module 'up' of Tiny gets two entries of tp_policy"):
        tp.parallelize_tensor(Tiny(), mesh, plan, {"up": "colwise", "u*": "rowwise"})
    with pytest.raises(ValueError, match="out features of up\\) = 8 is not divisible by 3"):
        plan3 = bh.Plan(tp=3)
        tp.parallelize_tensor(
            Tiny(), ParallelMesh(plan3, rank=0, world_size=3, create_groups=False), plan3, {"up": "colwise"}
        )


def test_layer_modules_do_not_import_their_rewriters():
    """The layers (tp1d, grid, tp2d, tp3d, ...) know nothing of the styles that build them from a
    serial model, nor of the entry that applies a plan (read from the source with ast)."""
    import ast
    from pathlib import Path

    root = Path(tp.__file__).parent
    rewriters = {"styles1d", "styles2d", "styles3d", "apply"}
    layers = [p for p in root.glob("*.py") if p.stem not in rewriters | {"__init__"}]
    assert {"tp1d", "vocab1d", "grid", "tp2d", "embed2d", "tp2p5d", "tp3d", "embed3d"} <= {p.stem for p in layers}
    for path in layers:
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                imported |= {node.module} if node.module else {a.name for a in node.names}
        assert not imported & rewriters, f"{path.name} imports {sorted(imported & rewriters)}"

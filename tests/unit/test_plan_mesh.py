"""Plan validation (errors for people) and the pure rank <-> coordinate math of the mesh."""

from __future__ import annotations

import pytest

from behemoth.mesh import ParallelMesh, atomic_dims, axis_groups, named_axes, ravel, unravel
from behemoth.plan import Plan


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (dict(tp=6, tp_mode="2d"), "tp_mode='2d' needs a square tp degree (q*q); got tp=6. Use tp=4 or tp=9"),
        (dict(tp=4, tp_mode="3d"), "tp_mode='3d' needs a cubic tp degree"),
        (dict(tp=8, tp_mode="2.5d", tp_depth=3), "tp = tp_depth * q*q; got tp=8, tp_depth=3"),
        (dict(tp=12, tp_mode="2.5d", tp_depth=2), "tp/tp_depth=6 is not a square"),
        (dict(tp_mode="4d"), "Plan.tp_mode='4d' is not one of"),
        (dict(schedule="magic"), "Plan.schedule='magic' is not one of"),
        (dict(cp_mode="rings"), "Plan.cp_mode='rings'"),
        (dict(precision="fp8"), "Plan.precision='fp8'"),
        (dict(zero=4), "ZeRO stage must be 0, 1, 2 or 3"),
        (dict(offload="cpu"), "needs ZeRO sharding; got zero=0"),
        (dict(offload="disk", zero=1), "Plan.offload='disk'"),
        (dict(tp=0), "Plan.tp=0: must be an integer >= 1"),
        (dict(dp=0), "Plan.dp=0"),
        (dict(microbatches=2.5), "Plan.microbatches=2.5"),
        (dict(sequence_parallel=True), "sequence_parallel=True needs 1D tensor parallelism with tp > 1"),
        (dict(virtual_stages=2), "only applies to schedule='interleaved'"),
        (dict(tp_depth=2, tp_mode="2d", tp=4), "tp_depth=2 only applies to tp_mode='2.5d'"),
        (dict(tp_overlap=2, tp=4, tp_mode="2d"), "is built for tp_mode '1d' and '3d', not '2d'"),
        (dict(tp_overlap=2), "there is none with tp=1"),
        (dict(dp=4, ep=3), "Plan.ep=3 must divide dp=4"),
        (dict(bucket_mb=0), "bucket_mb=0"),
    ],
)
def test_bad_plans_name_the_rule(kwargs, needle):
    with pytest.raises(ValueError) as e:
        Plan(**kwargs)
    assert needle in str(e.value)


def test_good_plans_validate():
    Plan(tp=9, tp_mode="2d")
    Plan(tp=8, tp_mode="2.5d", tp_depth=2)
    Plan(tp=27, tp_mode="3d", tp_overlap=2)
    Plan(tp=4, tp_overlap=2, sequence_parallel=True)
    Plan(tp=4, sequence_parallel=True)
    Plan(pp=4, schedule="interleaved", virtual_stages=2)
    Plan(zero=3, offload="auto")


def test_resolve_world_size():
    assert Plan(tp=2, pp=2).resolve(8).dp == 2
    assert Plan(dp=2, tp=2).resolve(4).dp == 2
    with pytest.raises(ValueError, match=r"dp\*pp\*tp\*cp = 2\*1\*2\*1 = 4 must equal the world size 8"):
        Plan(dp=2, tp=2).resolve(8)
    with pytest.raises(ValueError, match="world size 6 is not divisible by pp\\*tp\\*cp"):
        Plan(tp=4).resolve(6)


def test_unbuilt_capabilities_raise_not_implemented():
    Plan(dp=2, microbatches=4, precision="bf16", activation_checkpointing=True).check_supported()
    Plan(cp=2, cp_mode="ring", tp=2).check_supported()  # context parallelism is built (with dp and 1D tp)
    Plan(cp=2, tp=8, tp_mode="2.5d", tp_depth=2, pp=2).check_supported()  # ... with the grid modes and pipelines
    Plan(pp=2, microbatches=4, schedule="zero-bubble", tp=4, tp_mode="2d").check_supported()  # pipelines are built
    Plan(pp=2, tp=8, tp_mode="3d").check_supported()  # pipelines compose with every tp mode
    Plan(zero=3, offload="auto", tp=4, tp_mode="2d").check_supported()  # ZeRO and offload are built
    Plan(dp=4, ep=2, microbatches=2, precision="bf16").check_supported()  # experts are built (with dp)
    Plan(dp=4, ep=2, zero=3).check_supported()  # experts under ZeRO 1-3: expert chunks over ep_dp
    Plan(dp=2, ep=2, tp=2, zero=1).check_supported()  # experts with 1D tp: attention split, experts whole
    Plan(dp=2, ep=2, cp=2, zero=2).check_supported()  # experts with cp: expert gradients over ep_dp x cp
    Plan(dp=2, ep=2, pp=2, microbatches=2).check_supported()  # experts inside pipeline stages
    Plan(dp=2, ep=2, precision="fp16").check_supported()  # fp16: the overflow vote spans the ep ranks
    Plan(dp=2, ep=2, tp=2, sequence_parallel=True).check_supported()  # experts under sequence parallelism
    Plan(dp=2, ep=2, tp=4, tp_mode="2d").check_supported()  # experts under the grids: rows exchanged
    Plan(dp=2, ep=2, tp=8, tp_mode="3d").check_supported()
    with pytest.raises(ValueError, match="interleaves pipeline stages, but pp=1"):
        Plan(virtual_stages=2, schedule="interleaved").check_supported()


def test_ravel_unravel_roundtrip():
    sizes = [2, 3, 4]
    for r in range(24):
        assert ravel(unravel(r, sizes), sizes) == r
    assert unravel(23, sizes) == (1, 2, 3)
    assert unravel(5, sizes) == (0, 1, 1)
    with pytest.raises(ValueError):
        unravel(24, sizes)


def test_axis_groups_1d():
    plan = Plan(dp=2, pp=2, tp=2).resolve(8)
    dims = atomic_dims(plan)
    axes = named_axes(plan)
    # layout pp, dp, cp, tp with tp innermost: rank = pp*4 + dp*2 + tp
    assert axis_groups(dims, axes["tp"]) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert axis_groups(dims, axes["dp"]) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert axis_groups(dims, axes["pp"]) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert axis_groups(dims, axes["world"]) == [list(range(8))]


@pytest.mark.parametrize(
    "kwargs, world",
    [
        (dict(tp=4, tp_mode="2d", dp=2), 8),
        (dict(tp=8, tp_mode="2.5d", tp_depth=2), 8),
        (dict(tp=8, tp_mode="3d"), 8),
        (dict(dp=4, ep=2, cp=2), 8),
    ],
)
def test_every_axis_partitions_the_world(kwargs, world):
    plan = Plan(**kwargs).resolve(world)
    dims = atomic_dims(plan)
    for name, members in named_axes(plan).items():
        groups = axis_groups(dims, members)
        flat = sorted(r for g in groups for r in g)
        assert flat == list(range(world)), name
        size = 1
        for m in members:
            size *= dict(dims)[m]
        assert all(len(g) == size for g in groups), name


def test_2d_grid_rows_and_columns():
    plan = Plan(tp=4, tp_mode="2d").resolve(4)
    dims = atomic_dims(plan)
    axes = named_axes(plan)
    # tp rank = row*q + col
    assert axis_groups(dims, axes["tp_col"]) == [[0, 1], [2, 3]]  # same row, varying column
    assert axis_groups(dims, axes["tp_row"]) == [[0, 2], [1, 3]]  # same column, varying row


def test_mesh_without_groups_reports_coordinates():
    plan = Plan(dp=2, pp=2, tp=2)
    mesh = ParallelMesh(plan, rank=5, world_size=8, create_groups=False)
    assert (mesh.coord("pp"), mesh.coord("ep_dp"), mesh.coord("tp")) == (1, 0, 1)
    assert mesh.axis("dp").ranks == (5, 7) and mesh.dp_rank == 0 and mesh.dp_size == 2
    assert mesh.axis("tp").ranks == (4, 5) and mesh.axis("tp").rank == 1
    with pytest.raises(KeyError, match="no axis 'tp_row'"):
        mesh.axis("tp_row")

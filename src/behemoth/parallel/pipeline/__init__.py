"""Pipeline parallelism: ``bh.Plan(pp=..., microbatches=..., schedule=..., virtual_stages=...)``.

Pure foundation (no process group):

* ``schedules.py`` -- GPipe, 1F1B, interleaved 1F1B and zero-bubble (ZB-H1) as per-rank
  action lists, chosen by the Plan's ``schedule`` name; the communication each action
  implies; a simulator that checks a schedule for dependency violations and deadlocks and
  reports its makespan, bubble and peak in-flight micro-batches.
* ``partition.py`` -- cost estimates per block, balanced (or user-given) contiguous stage
  partitions, the virtual-stage partition for interleaving, and which modules of a family's
  ``PipelineLayout`` (``behemoth.specs``) go to the first, every and the last stage.

Runtime (what ``bh.parallelize`` and ``bh.boost`` build when ``pp > 1``):

* ``stage.py`` -- cut a model down to one rank's stage(s) in place, gate chunks, tied weights;
* ``p2p.py`` -- activation / gradient transfers with shapes cached after the first step;
* ``forward.py`` -- the split model's forward outside a schedule (evaluation, generation);
* ``executor.py`` -- :class:`~.executor.PipelineExecutor`, the engine's step executor that runs
  a schedule per step.

Tests: tests/unit/test_pipeline_schedules.py, tests/unit/test_pipeline_partition.py (pure);
tests/dist/test_pipeline_parity.py, test_pipeline_checkpoint.py, test_pipeline_faults.py.
"""

from .partition import (
    ModelCosts,
    balance_stages,
    estimate_block_costs,
    find_tied_parameters,
    stage_costs,
    stage_modules,
    tied_parameter_ranks,
    validate_stages,
    virtual_partition,
)
from .schedules import (
    BI,
    BW,
    KINDS,
    SCHEDULES,
    Action,
    B,
    F,
    Transfer,
    check_schedule,
    get_schedule,
    gpipe,
    interleaved,
    make_schedule,
    one_f_one_b,
    rank_chunk_of,
    stage_of,
    transfers,
    zero_bubble,
)
from .simulate import SimResult, render, simulate

__all__ = [
    "ModelCosts",
    "balance_stages",
    "estimate_block_costs",
    "find_tied_parameters",
    "stage_costs",
    "stage_modules",
    "tied_parameter_ranks",
    "validate_stages",
    "virtual_partition",
    "B",
    "BI",
    "BW",
    "F",
    "KINDS",
    "SCHEDULES",
    "Action",
    "SimResult",
    "Transfer",
    "check_schedule",
    "get_schedule",
    "gpipe",
    "interleaved",
    "make_schedule",
    "one_f_one_b",
    "rank_chunk_of",
    "render",
    "simulate",
    "stage_of",
    "transfers",
    "zero_bubble",
]

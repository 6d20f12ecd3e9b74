"""The pure memory planner behind `behemoth plan --memory`: its numbers are the runtime's
(chunk search, per-stage accounting, static split with the host limit)."""

from __future__ import annotations

import pytest

from behemoth.cli import main
from behemoth.parallel.zero import pack_chunks, zero_memory_bytes
from behemoth.planner.memory import memory_plan

GIB = 2**30
SIZES = [4096 * 512] + [3 * 512 * 512, 512 * 512, 4 * 512 * 512, 4 * 512 * 512, 512, 512] * 48


def test_per_stage_bytes_and_padding_match_the_chunk_layout():
    plan = memory_plan(SIZES, dp=4, stage=3, gpu_bytes=80 * GIB, host_bytes=256 * GIB)
    layout = pack_chunks(SIZES, plan.chunk_elements, 4)
    assert plan.num_chunks == layout.num_chunks and plan.padding_pct < 5
    want = zero_memory_bytes(layout, 3, param_bytes=4, grad_bytes=4, master_bytes=0, optim_state_bytes=8)
    assert plan.per_stage_gib[3] == pytest.approx(want.total / GIB)
    # Stage 3 at dp=4 holds about a quarter of stage 0 (16 B per element, padding aside).
    assert plan.per_stage_gib[3] == pytest.approx(plan.per_stage_gib[0] / 4, rel=0.05)
    assert plan.fits_without_offload and plan.split is None and "fits on the GPU" in plan.text


def test_bf16_parameters_count_their_fp32_masters():
    """param_dtype='bf16': 2-byte parameters (whole below stage 3) beside 4-byte masters sharded from stage 1."""
    plan = memory_plan(SIZES, dp=4, stage=1, gpu_bytes=80 * GIB, host_bytes=256 * GIB, param_bytes=2)
    layout = pack_chunks(SIZES, plan.chunk_elements, 4)
    for stage in (0, 1, 2, 3):
        want = zero_memory_bytes(layout, stage, param_bytes=2, grad_bytes=4, master_bytes=4, optim_state_bytes=8)
        assert plan.per_stage_gib[stage] == pytest.approx(want.total / GIB)
    full = sum(c.size for c in layout.chunks)
    assert plan.per_stage_gib[1] * GIB == pytest.approx(full * (2 + 4) + full * (4 + 8) / 4)
    assert "bf16 parameters + fp32 masters" in plan.text


def test_offload_split_respects_gpu_and_host_and_refuses_what_cannot_fit():
    total = memory_plan(SIZES, dp=1, stage=3, gpu_bytes=10**12, host_bytes=10**12).per_stage_gib[3] * GIB
    plan = memory_plan(SIZES, dp=1, stage=3, gpu_bytes=int(total / 2), host_bytes=int(total))
    assert not plan.fits_without_offload and plan.split is not None
    assert plan.split.gpu_bytes <= total / 2
    assert 0 < plan.split.num_optim_chunks < plan.num_chunks
    assert "Offloaded" in plan.text and "CPU optimizer update" in plan.text
    tiny = memory_plan(SIZES, dp=1, stage=3, gpu_bytes=int(total / 4), host_bytes=int(total / 4))
    assert tiny.split is None and "Does not fit even with offload" in tiny.text


def test_cli_prints_the_plan(capsys):
    assert main(["plan", "--memory", "--model", "gpt-tiny", "--gpu-gb", "1"]) == 0
    out = capsys.readouterr().out
    assert "chunks" in out and "zero=3" in out and "fits on the GPU" in out

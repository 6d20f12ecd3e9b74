"""The one-shot all-reduce's selection rule (behemoth.comm.oneshot), without processes: which
tensors go through it, and that nothing does unless it is switched on for the axis."""

from __future__ import annotations

import pytest
import torch

from behemoth.comm import Axis, Ledger, one_shot_all_reduce
from behemoth.comm.oneshot import ONE_SHOT_MAX_BYTES, eligible, one_shot_for


def test_eligible_tensors():
    bf16, fp32 = torch.bfloat16, torch.float32
    assert eligible(4096 * 2, bf16, "cuda", ONE_SHOT_MAX_BYTES)  # a decode step's [1, 1, 4096] bf16
    assert eligible(ONE_SHOT_MAX_BYTES, fp32, "cuda", ONE_SHOT_MAX_BYTES)  # the bound itself
    assert not eligible(ONE_SHOT_MAX_BYTES + 16, fp32, "cuda", ONE_SHOT_MAX_BYTES)  # larger: NCCL
    assert not eligible(4096 * 2, bf16, "cpu", ONE_SHOT_MAX_BYTES)  # CPU: gloo's all-reduce
    assert not eligible(4096 * 2, torch.float16, "cuda", ONE_SHOT_MAX_BYTES)  # the kernel sums bf16 and fp32
    assert not eligible(24, fp32, "cuda", ONE_SHOT_MAX_BYTES)  # 6 floats: not a multiple of 16 bytes
    assert not eligible(0, fp32, "cuda", ONE_SHOT_MAX_BYTES)


def test_nothing_goes_through_it_unless_switched_on():
    class Group:
        group_name = "g"

    axis = Axis("tp", 2, 0, (0, 1), Group(), Ledger())
    assert one_shot_for(axis, torch.zeros(4, dtype=torch.bfloat16)) is None
    with pytest.raises(ValueError, match="multiple of 16"):
        with one_shot_all_reduce(axis, max_bytes=100):
            pass
    trivial = Axis("tp", 1, 0, (0,), None, Ledger())
    with one_shot_all_reduce(trivial) as impl:  # one rank: nothing to reduce
        assert impl is None

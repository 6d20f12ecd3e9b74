"""behemoth.planner.elementwise against the operators a block actually runs: a dispatch-level count
of every non-GEMM, non-attention operator's bytes (its tensor inputs and outputs) over one GPT or
Llama block's forward and backward under bf16 autocast over fp32 parameters, per token (two
sequence lengths' difference, so the weights' own casts, which compute.CAST_BYTES counts, drop
out), equals the formula exactly; and the seconds compute.py charges for them, for sequence
parallelism's copies and for the embedding's backward."""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import behemoth as bh
from behemoth.models import build_model
from behemoth.planner.calibration import load_calibration
from behemoth.planner.compute import (
    _cast_seconds,
    accumulate_bytes,
    block_times,
    elementwise_seconds,
    embedding_backward_seconds,
    head_times,
    sequence_parallel_copy_seconds,
)
from behemoth.planner.elementwise import block_elementwise_bytes, cross_entropy_bytes, norm_bytes
from behemoth.planner.host import serial_block_kernels
from behemoth.planner.params import weight_split
from behemoth.planner.workload import workload_for

GEMM = ("mm", "addmm", "bmm")
# views cost nothing; ``clone`` is the contiguous copy the CPU attention kernel's gradient layout
# needs before a reshape (on CUDA the kernel hands its gradients back in the layout the views expect)
FREE = ("_unsafe_view", "clone")


class _Bytes(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.total = 0
        self.by = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.__name__.split(".")[0]
        ret = func._schema.returns
        if ret and ret[0].alias_info is not None and not ret[0].alias_info.is_write:
            return out  # a view
        if name in GEMM or "scaled_dot_product" in name or name in FREE:
            return out
        n = 0
        for x in [*args, *(kwargs or {}).values(), out]:
            for t in x if isinstance(x, (list, tuple)) else [x]:
                if isinstance(t, torch.Tensor):
                    n += t.numel() * t.element_size()
        self.total += n
        self.by[name] += n
        return out


class _Kernels(TorchDispatchMode):
    """Operators that launch a kernel: every one but views, allocations and the CPU attention
    kernel's contiguous copies (``clone``, see ``FREE``)."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ret = func._schema.returns
        name = func.__name__.split(".")[0]
        if ret and ret[0].alias_info is not None and not ret[0].alias_info.is_write:
            return out
        if name not in FREE + ("detach", "empty", "empty_like", "ones_like"):
            self.n += 1
        return out


def _count(family: str, tokens: int, **kw) -> tuple[int, int]:
    model = build_model(family, vocab_size=64, seq_len=tokens, num_layers=1, **kw)
    llama = hasattr(model, "layers")
    block = (model.layers if llama else model.blocks)[0]
    x = torch.randn(1, tokens, model.config.hidden, requires_grad=True)
    args = (x, torch.arange(tokens).unsqueeze(0)) if llama else (x,)
    fwd, bwd = _Bytes(), _Bytes()
    with torch.autocast("cpu", dtype=torch.bfloat16), fwd:
        y = block(*args)
    g = torch.randn_like(y)
    with bwd:
        y.backward(g)
    return fwd.total, bwd.total


SHAPES = [
    ("gpt-tiny", dict(hidden=256, num_heads=4)),
    ("gpt-tiny", dict(hidden=128, num_heads=2, bias=False)),
    ("llama-tiny", dict(hidden=256, num_heads=8, num_kv_heads=2, ffn_hidden=896)),
    ("llama-tiny", dict(hidden=128, num_heads=4, num_kv_heads=4, ffn_hidden=320)),
]


@pytest.mark.parametrize("family, kw", SHAPES, ids=[f"{f}-{k['hidden']}" for f, k in SHAPES])
def test_block_bytes_equal_the_operators_count(family, kw):
    (f1, b1), (f2, b2) = (_count(family, t, **kw) for t in (16, 48))
    shape = workload_for(
        build_model(family, vocab_size=64, seq_len=48, num_layers=1, device="meta", **kw), global_batch=1
    ).shape
    e = block_elementwise_bytes(shape)
    hq, hkv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    gqa = 4 * (hq - hkv) + 4 * hq + 4 * hkv if hkv < hq else 0  # the flash kernel's, not the CPU one's
    assert (f2 - f1) / 32 == e.hidden_forward + e.split_forward
    assert (b2 - b1) / 32 == e.hidden_backward + e.split_backward - gqa


def test_shared_casts():
    """1D tensor parallelism casts each norm output once for all the Linears reading it, and sums
    their 16-bit input gradients in place: Llama's three q/k/v and two gate/up casts become two,
    the fp32 sums of four extra readers' gradients (12 h each) 16-bit ones (6 h each)."""
    s = workload_for("llama-8b", global_batch=1).shape
    h = 4096
    own, shared = block_elementwise_bytes(s), block_elementwise_bytes(s, shared_casts=True)
    assert own.hidden_forward - shared.hidden_forward == 6 * h * (5 - 2)
    assert own.hidden_backward - shared.hidden_backward == 6 * h * (5 - 2) + (12 - 6) * h * 3
    assert (own.split_forward, own.split_backward) == (shared.split_forward, shared.split_backward)
    gpt = workload_for("gpt-1.3b", global_batch=1).shape  # one reader per norm: nothing shared
    assert block_elementwise_bytes(gpt) == block_elementwise_bytes(gpt, shared_casts=True)


def test_llama_8b_formula():
    """Llama-3-8B's shape per token, from the formula's terms: forward 2 RMSNorms (28h + 24), five
    input casts, the residual adds (20h), rotary tables (42d + 16); q and k's rotation and casts
    36 (hq + hkv), SwiGLU 10f."""
    s = workload_for("llama-8b", global_batch=1).shape
    h, f, d, hq, hkv = 4096, 14336, 128, 4096, 1024
    e = block_elementwise_bytes(s)
    assert e.hidden_forward == 2 * (28 * h + 24) + 30 * h + 20 * h + 42 * d + 16
    assert e.split_forward == 10 * f + 36 * (hq + hkv)
    assert e.hidden_backward == 2 * (96 * h + 36) + 30 * h + 36 * h + 36 * h + 16 * d
    assert e.split_backward == 18 * f + 46 * (hq + hkv) + 4 * (hq - hkv) + 4 * hq + 4 * hkv
    assert norm_bytes(s) == (28 * h + 24, 96 * h + 36)


def test_seconds_split_by_layout():
    """1D without sequence parallelism repeats the model-width part on every rank; with it (and
    2D) that part is split too; fp32 compute moves twice the bytes."""
    w = workload_for("llama-8b", global_batch=8)
    cal = load_calibration("h200")
    e = block_elementwise_bytes(w.shape, shared_casts=True)  # 1D's
    t = 4096.0
    r = cal.elementwise_rate
    one = elementwise_seconds(bh.Plan(tp=4, precision="bf16"), w, cal, t)
    split = (t * (e.hidden_forward + e.split_forward / 4) / r, t * (e.hidden_backward + e.split_backward / 4) / r)
    assert one == pytest.approx(split, rel=1e-12)
    sp = elementwise_seconds(bh.Plan(tp=4, sequence_parallel=True, precision="bf16"), w, cal, t)
    both = (t * (e.hidden_forward + e.split_forward) / 4 / r, t * (e.hidden_backward + e.split_backward) / 4 / r)
    assert sp == pytest.approx(both, rel=1e-12)
    fp32 = elementwise_seconds(bh.Plan(), w, cal, t)
    e = block_elementwise_bytes(w.shape)  # serial: each Linear casts its input
    twice = (2 * t * (e.hidden_forward + e.split_forward) / r, 2 * t * (e.hidden_backward + e.split_backward) / r)
    assert fp32 == pytest.approx(twice, rel=1e-12)


def test_elementwise_rate_defaults_to_hbm():
    cal = load_calibration("h200")
    assert cal.elementwise_bytes_per_s == 0.0 and cal.elementwise_rate == cal.hbm_bytes_per_s
    slow = type(cal).from_dict({**cal.__dict__, "elementwise_bytes_per_s": cal.hbm_bytes_per_s / 2})
    w = workload_for("llama-8b", global_batch=8)
    plan = bh.Plan(tp=2, precision="bf16")
    fast_f, fast_b = elementwise_seconds(plan, w, cal, 1024.0)
    assert elementwise_seconds(plan, w, slow, 1024.0) == pytest.approx((2 * fast_f, 2 * fast_b), rel=1e-12)


def test_head_cross_entropy_bytes():
    """The loss per logit: serial 14 forward (fp32 copy, log-softmax), vocabulary-parallel 38
    (copy, max, shift, exp, sum, normalisation); 22 backward either way; the head's time grows by
    exactly those bytes at the elementwise rate."""
    assert cross_entropy_bytes(False) == (14.0, 22.0)
    assert cross_entropy_bytes(True) == (38.0, 22.0)
    w = workload_for("llama-8b", global_batch=8)
    cal = load_calibration("h200")
    big = workload_for("llama-8b", global_batch=8, vocab_size=2 * w.shape.vocab_size)
    plan = bh.Plan(tp=2, precision="bf16").resolve(2)
    (f1, b1), (f2, b2) = head_times(plan, w, cal, 1), head_times(plan, big, cal, 1)
    t, v = 2048, w.shape.vocab_size / 2  # the added logits per rank
    g1 = cal.gemm_seconds(t, w.shape.vocab_size / 2, w.shape.hidden)
    g2 = cal.gemm_seconds(t, w.shape.vocab_size, w.shape.hidden)
    c1 = _cast_seconds(plan, w.shape.vocab_size * w.shape.hidden / weight_split(plan), cal)
    c2 = _cast_seconds(plan, big.shape.vocab_size * w.shape.hidden / weight_split(plan), cal)
    assert f2 - f1 == pytest.approx(g2 - g1 + t * v * 38 / cal.elementwise_rate + c2[0] - c1[0], rel=1e-9)
    assert b2 - b1 == pytest.approx(2 * (g2 - g1) + t * v * 22 / cal.elementwise_rate + c2[1] - c1[1], rel=1e-9)


def test_sequence_parallel_copies():
    """The copies around 1D sequence parallelism's collectives per block, in units of 16-bit
    [token, h] rows: forward, the norms' two blocking gathers (flat buffer to parts, parts
    concatenated: 8 each), the rows' reduce-scatter inputs made sequence-major (4 each) and, with
    tp_overlap 2, their pieces' shards concatenated (4 / tp each); backward, the rows' two gathers
    (8 each), the columns' re-gathered shards (4 / tp) and gathered inputs (4) and their dX
    made sequence-major (4); one sequence per micro-batch needs no sequence-major copies."""
    w = workload_for("gpt-1.3b", global_batch=8)
    cal = load_calibration("h200")
    t, p = 8192.0, 4
    unit = t * w.shape.hidden / cal.elementwise_rate
    plan = bh.Plan(tp=p, sequence_parallel=True, tp_overlap=2, precision="bf16")
    f, b = sequence_parallel_copy_seconds(plan, w, cal, t, 4)
    assert f == pytest.approx(unit * (16 + 8 + 8 / p), rel=1e-12)
    assert b == pytest.approx(unit * (16 + 8 / p + 8 + 8), rel=1e-12)
    one = bh.Plan(tp=p, sequence_parallel=True, precision="bf16")
    assert sequence_parallel_copy_seconds(one, w, cal, t, 1) == pytest.approx((16 * unit, 16 * unit), rel=1e-12)
    assert sequence_parallel_copy_seconds(bh.Plan(tp=p, precision="bf16"), w, cal, t, 4) == (0.0, 0.0)
    base = block_times(one.resolve(p), w, cal, 4)
    off = block_times(bh.Plan(tp=p, precision="bf16").resolve(p), w, cal, 4)
    sp_f, sp_b = sequence_parallel_copy_seconds(one, w, cal, 4 * 2048, 4)
    e1 = elementwise_seconds(one, w, cal, 4 * 2048)
    e0 = elementwise_seconds(bh.Plan(tp=p, precision="bf16"), w, cal, 4 * 2048)
    assert base.forward - off.forward == pytest.approx(sp_f + e1[0] - e0[0], rel=1e-9)
    assert base.backward - off.backward == pytest.approx(sp_b + e1[1] - e0[1], rel=1e-9)


def test_calibration_classifies_kernels():
    """benchmarks/calibrate.py's elementwise rate times a block's kernels but its GEMMs (cuBLAS's,
    CUTLASS's, split-K's reduction), attention and the runtime's copies and fills."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
    from calibrate import is_elementwise_kernel

    for name in (
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1",
        "nvjet_tst_192x192_64x4_2x1_v_bz_coopA_TNT",
        "void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn_align8>(Params)",
        "void splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float>(cublasSplitKParams<float>)",
        "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>, false, true>(Params)",
        "fmha_cutlassB_bf16_aligned_64x64_k128_sm80",
        "Memcpy DtoD (Device -> Device)",
        "Memset (Device)",
    ):
        assert not is_elementwise_kernel(name), name
    for name in (
        "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>(int, ...)",
        "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MeanOps<float>>>(...)",
        "void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<float, float, false>(...)",
        "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda>(...)",
        "void at::native::CatArrayBatchedCopy<at::native::OpaqueType<2u>, unsigned int, 4, 128, 128>(...)",
    ):
        assert is_elementwise_kernel(name), name


def test_embedding_backward():
    """The first stage's token-embedding backward per micro-batch: the dense fp32 gradient of this
    rank's table share zero-filled (4 bytes an element), every token's row added (12 bytes a
    token per hidden unit), then copied or added into the gradient sync's chunk (an untied table,
    compute.accumulate_bytes) or added to the head's gradient of a tied one (12)."""
    cal = load_calibration("h200")
    llama = workload_for("llama-8b", global_batch=8, vocab_size=128256)
    plan = bh.Plan(tp=2, microbatches=4, precision="bf16").resolve(2)
    table, rows = 128256 * 4096 / 2, 2 * 2048 * 4096
    got = embedding_backward_seconds(plan, llama, cal, 2)
    assert got == pytest.approx((table * (4 + accumulate_bytes(plan)) + 12 * rows) / cal.hbm_bytes_per_s, rel=1e-12)
    assert accumulate_bytes(plan) == (8 + 12 * 3) / 4
    gpt = workload_for("gpt-1.3b", global_batch=8)  # tied
    tied = embedding_backward_seconds(bh.Plan(precision="bf16").resolve(1), gpt, cal, 1)
    assert tied == pytest.approx((50304 * 2048 * (4 + 12) + 12 * 2048 * 2048) / cal.hbm_bytes_per_s, rel=1e-12)


def test_embedding_backward_in_the_step(monkeypatch):
    """Without data parallelism, host bound or pipeline, the step holds each micro-batch's
    embedding backward once."""
    from behemoth.planner import cost
    from behemoth.planner.cluster import Cluster

    cal = type(load_calibration("h200")).from_dict(
        {**load_calibration("h200").__dict__, "host_kernel_s": 0.0, "host_call_s": {}}
    )
    w = workload_for("llama-8b", global_batch=8, vocab_size=128256)
    c = Cluster(num_gpus=2, gpus_per_node=2, calibration=cal)
    plan = bh.Plan(dp=1, tp=2, microbatches=4, precision="bf16")
    with_it = cost.predict(plan, w, c).step
    monkeypatch.setattr(cost, "embedding_backward_seconds", lambda *a: 0.0)
    without = cost.predict(plan, w, c).step
    emb = embedding_backward_seconds(plan.resolve(2), w, cal, 2)
    assert with_it - without == pytest.approx(4 * emb, rel=1e-9)


@pytest.mark.parametrize("family, kw", SHAPES, ids=[f"{f}-{k['hidden']}" for f, k in SHAPES])
def test_serial_block_kernels_equal_the_operators_count(family, kw):
    """planner.host.serial_block_kernels: the kernels one block's forward and backward launch under
    bf16 autocast, as a dispatch-level count of its operators finds them."""
    model = build_model(family, vocab_size=64, seq_len=16, num_layers=1, **kw)
    llama = hasattr(model, "layers")
    block = (model.layers if llama else model.blocks)[0]
    x = torch.randn(2, 16, model.config.hidden, requires_grad=True)
    args = (x, torch.arange(16).unsqueeze(0)) if llama else (x,)
    fwd, bwd = _Kernels(), _Kernels()
    with torch.autocast("cpu", dtype=torch.bfloat16), fwd:
        y = block(*args)
    g = torch.randn_like(y)
    with bwd:
        y.backward(g)
    assert serial_block_kernels(workload_for(model, global_batch=1).shape) == (fwd.n, bwd.n)

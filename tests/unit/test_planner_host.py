"""The planner's host-issue bound (planner/host.py), the terms that repeat a block's work
(activation checkpointing's recompute, zero-bubble's second backward) in bytes and time, the
MoE split-size exchange in the ep bytes, and the zero-bubble closed form for any BI/BW split."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

import behemoth as bh
from behemoth.models import build_config
from behemoth.parallel.expert.traffic import ep_all_to_all_bytes
from behemoth.planner.axis_traffic import Dtypes, step_traffic
from behemoth.planner.bubble import _closed, _simulated
from behemoth.planner.calibration import Calibration, load_calibration
from behemoth.planner.cluster import Cluster
from behemoth.planner.cost import predict
from behemoth.planner.expert_kernels import (
    EP_DEVICE_COPIES,
    expert_route,
    mlp_kernels,
    moe_block_kernels,
    moe_layer_kernels,
)
from behemoth.planner.host import (
    host_block_kernels,
    host_call_seconds,
    host_times,
    kernels_per_call,
    serial_block_kernels,
    serial_recompute_kernels,
    tp_block_kernels,
    tp_recompute_kernels,
)
from behemoth.planner.host_calls import block_calls, cp_block_calls, ep_block_calls, pipeline_calls, tp_block_calls
from behemoth.planner.params import stage_layers
from behemoth.planner.traffic import block_traffic
from behemoth.planner.workload import workload_for

GOLDEN_CAL = Path(__file__).parent / "data" / "planner_calibration.json"
GPT = workload_for("gpt-1.3b", seq_len=2048, global_batch=32)


def _plan(**kw) -> bh.Plan:
    return bh.Plan(precision="bf16", **kw).resolve(16)


def test_collective_calls_per_block():
    """GPT-1.3B (biases, 16 heads, plain MLP): the calls each layout's block issues per micro-batch."""
    assert tp_block_calls(_plan(), GPT) == (0.0, 0.0)
    assert tp_block_calls(_plan(tp=4), GPT) == (2.0, 2.0)  # rows' all-reduces; columns' fused dX
    assert tp_block_calls(_plan(tp=4, tp_overlap=2), GPT) == (4.0, 2.0)
    # gathers + reduce-scatters (2 + 2 k); re-gathers, dX scatters, dY gathers (4 + 2 k), norms'
    # weights and biases and the rows' biases (6)
    assert tp_block_calls(_plan(tp=4, sequence_parallel=True), GPT) == (4.0, 12.0)
    # SUMMA: 2 gathers per Linear and the norms' statistics; 3 per Linear and 1 per norm back, and
    # the norms' and biases' gradients in 21 bucket all-reduces a pass (145 vectors: 6 a block
    # and the final norm's, one flush per 7 layers), a 24th of them a block
    assert tp_block_calls(_plan(tp=4, tp_mode="2d"), GPT) == (10.0, 14.0 + 21 / 24)
    # a checkpointed block's too (its recompute issues the forward's calls again: block_calls)
    assert tp_block_calls(_plan(tp=4, tp_mode="2d", activation_checkpointing=True), GPT) == (10.0, 14.0 + 21 / 24)
    # summed where they run (1 per norm, 1 per bias): compiled blocks, ZeRO-3's hooks
    for summed in (dict(compile=True), dict(zero=3)):
        assert tp_block_calls(_plan(tp=4, tp_mode="2d", **summed), GPT) == (10.0, 20.0), summed
    # 3D: 8 per Linear, 5 per extra piece; 2 per norm, and 2 per vector (norms', biases) over the cube
    assert tp_block_calls(_plan(tp=8, tp_mode="3d", tp_overlap=2), GPT) == pytest.approx((24.0, 48.0))
    # 2.5D: 2D's, and every weight's gradient (4) and each bucket summed over depth
    assert tp_block_calls(_plan(tp=8, tp_mode="2.5d", tp_depth=2), GPT) == (10.0, 18.0 + 2 * 21 / 24)
    # summed where they run: every parameter's gradient over depth (4 weights, 4 biases, 4 norm vectors)
    assert tp_block_calls(_plan(tp=8, tp_mode="2.5d", tp_depth=2, compile=True), GPT) == (10.0, 32.0)
    assert cp_block_calls(_plan(cp=2)) == (2.0, 2.0)  # Ulysses: q/k/v and the output, each way
    assert cp_block_calls(_plan(cp=4, cp_mode="ring")) == (3.0, 7.0)  # cp - 1 shifts; 2 cp - 1 back
    # ZeRO-3 gathers forward and backward and reduce-scatters; a checkpointed block repeats its forward
    assert block_calls(_plan(tp=4, zero=3), GPT) == (3.0, 4.0)
    assert block_calls(_plan(tp=4, zero=3, activation_checkpointing=True), GPT) == (3.0, 7.0)
    assert block_calls(_plan(pp=2, microbatches=4, tp=4, zero=3), GPT) == (3.0, 3.0)  # reduced once a step
    assert pipeline_calls(_plan(pp=2, microbatches=4)) == (2.0, 2.0)
    assert pipeline_calls(_plan(pp=2, microbatches=4, schedule="interleaved", virtual_stages=2)) == (4.0, 4.0)
    moe = workload_for("mixtral-4b", seq_len=2048, global_batch=32)
    # split sizes, dispatch, combine and the balancing statistics' all-reduce over dp; the pair back
    assert block_calls(_plan(ep=2), moe) == (4.0, 2.0)
    assert ep_block_calls(_plan(), moe) == (1.0, 0.0, 1.0)  # ep 1: the statistics only
    assert ep_block_calls(bh.Plan(ep=2).resolve(2), GPT) == (0.0, 0.0, 0.0)  # no MoE layer
    # ep_overlap = k: a dispatch and a combine per chunk each way, the split sizes once
    assert block_calls(_plan(ep=2, ep_overlap=2), moe) == (6.0, 4.0)
    assert block_calls(_plan(ep=2, ep_overlap=4), moe) == (10.0, 8.0)
    # a recompute runs the chunks' pairs and the statistics again, not the split sizes
    assert block_calls(_plan(ep=2, ep_overlap=2, activation_checkpointing=True), moe) == (6.0, 9.0)
    assert block_calls(_plan(ep=2, ep_overlap=2, zero=3, activation_checkpointing=True), moe) == (7.0, 12.0)


def test_host_time_is_kernels_and_calls_at_the_calibrated_costs():
    """The serial block's kernels, the layout's own (counted, tp_block_kernels) and its calls at the
    calibrated costs; the other axes' calls (here ZeRO-3's) at 1D's kernels per call too."""
    cal = load_calibration(GOLDEN_CAL)
    plan = _plan(tp=4, sequence_parallel=True)
    f, b = block_calls(plan, GPT)
    tf, tb = tp_block_kernels(plan, GPT)
    kern, kpc, c_k, c_c = cal.host_block_kernels, cal.kernels_per_collective, cal.host_kernel_s, cal.host_call_s["1d"]
    ht = host_times(plan, GPT, cal)
    assert ht.forward == pytest.approx((kern / 3 + tf) * c_k + f * c_c)
    assert ht.backward == pytest.approx((2 * kern / 3 + tb) * c_k + b * c_c)
    grid = host_times(_plan(tp=4, tp_mode="2d"), GPT, cal)  # 2D's calls at 2D's own cost
    f2, b2 = block_calls(_plan(tp=4, tp_mode="2d"), GPT)
    tf2, _ = tp_block_kernels(_plan(tp=4, tp_mode="2d"), GPT)
    assert grid.forward == pytest.approx((kern / 3 + tf2) * c_k + f2 * cal.host_call_s["2d"])
    zero = _plan(tp=4, tp_mode="2d", zero=3)  # ZeRO-3's gathers and reduce-scatter: 1D's kernels per call
    f3, b3 = block_calls(zero, GPT)
    (c3f, c3b), (t3f, t3b) = tp_block_calls(zero, GPT), tp_block_kernels(zero, GPT)
    z = host_times(zero, GPT, cal)
    assert (f3 - c3f, b3 - c3b) == (1.0, 2.0)
    assert z.forward == pytest.approx((kern / 3 + t3f + kpc) * c_k + f3 * cal.host_call_s["2d"])
    assert z.backward == pytest.approx((2 * kern / 3 + t3b + 2 * kpc) * c_k + b3 * cal.host_call_s["2d"])
    assert host_call_seconds(cal, "3d") == host_call_seconds(cal, "2.5d") == cal.host_call_s["2d"]
    assert host_call_seconds(dataclasses.replace(cal, host_call_s={"1d": 1e-5}), "3d") == 1e-5
    ckpt = host_times(_plan(tp=4, sequence_parallel=True, activation_checkpointing=True), GPT, cal)
    # the recompute's kernels and calls: the forward's as far as the recompute reaches, the serial
    # block's (it stops short of the down projection's GEMM and the residual add: 2 of the forward's
    # 20 operators fewer, at the calibration's forward kernels per operator) and the layout's (it
    # stops before the last row's bias cast and add, and runs the GEMM the serial one stops short of)
    assert serial_recompute_kernels(GPT.shape) == serial_block_kernels(GPT.shape)[0] - 2
    assert tp_recompute_kernels(_plan(tp=4, sequence_parallel=True, activation_checkpointing=True), GPT) == tf - 1
    assert ckpt.backward == pytest.approx(ht.backward + ht.forward - (kern / 3 * 2 / 20 + 1) * c_k)
    none = dataclasses.replace(cal, host_kernel_s=0.0, host_call_s={})
    assert host_times(plan, GPT, none) == host_times(plan, GPT, none).__class__(0.0, 0.0)


def test_kernels_per_call_by_mode():
    """A calibration's kernels per call by tensor-parallel mode: 2D's own where measured, 2.5D and
    3D falling back to 2D's, and to ``kernels_per_collective`` where no mode was measured. The
    host time no longer reads a layout's own (its layers' kernels are counted, tp_block_kernels):
    2D's measured 4.2 does not move it."""
    cal = dataclasses.replace(load_calibration(GOLDEN_CAL), kernels_per_call={"1d": 1.5, "2d": 4.2})
    assert kernels_per_call(cal, "1d") == 1.5
    assert kernels_per_call(cal, "2d") == kernels_per_call(cal, "3d") == kernels_per_call(cal, "2.5d") == 4.2
    assert kernels_per_call(dataclasses.replace(cal, kernels_per_call={}), "2d") == cal.kernels_per_collective
    plan = _plan(tp=4, tp_mode="2d")
    f, b = block_calls(plan, GPT)
    ht = host_times(plan, GPT, cal)
    tf, tb = tp_block_kernels(plan, GPT)
    c_k, c_c = cal.host_kernel_s, cal.host_call_s["2d"]
    assert ht.forward == pytest.approx((cal.host_block_kernels / 3 + tf) * c_k + f * c_c, rel=1e-12)
    assert ht.kernels == pytest.approx(cal.host_block_kernels + tf + tb, rel=1e-12)
    assert host_times(plan, GPT, dataclasses.replace(cal, kernels_per_call={"1d": 1.5})) == ht


def test_block_kernels_scale_with_the_model():
    """The calibration's kernels of the tiny GPT's serial block, scaled to a Llama block by their
    operator counts (Llama-8B: 59 forward + 81 backward, GPT: 20 + 31): Llama's RMSNorms, rotary
    embeddings, separate q/k/v and SwiGLU launch 140 / 51 of the GPT block's kernels."""
    cal = load_calibration(GOLDEN_CAL)
    llama = workload_for("llama-8b", global_batch=8)
    assert serial_block_kernels(llama.shape) == (59.0, 81.0)
    assert serial_block_kernels(GPT.shape) == (20.0, 31.0)
    assert host_block_kernels(cal, GPT.shape) == cal.host_block_kernels
    assert host_block_kernels(cal, llama.shape) == pytest.approx(cal.host_block_kernels * 140 / 51, rel=1e-12)
    ht = host_times(_plan(), llama, cal)
    assert ht.kernels == pytest.approx(cal.host_block_kernels * 140 / 51, rel=1e-12)
    assert ht.forward + ht.backward == pytest.approx(ht.kernels * cal.host_kernel_s, rel=1e-12)


def test_a_checkpointed_serial_blocks_recompute_stops_short_of_its_forward():
    """A checkpointed serial block's recompute runs its forward but the down projection's GEMM and
    the residual add after it (torch.utils.checkpoint stops once the GEMM's inputs are saved again;
    checked against a run in tests/dist/test_planner_host_kernels.py), GPT's and Llama's, with
    biases or without: host_times adds that share of the calibrated forward's kernels, not a whole
    forward."""
    cal = load_calibration(GOLDEN_CAL)
    measured = dataclasses.replace(cal, host_forward_share=0.26)
    gpt = workload_for(build_config("gpt-1.3b", vocab_size=50304, seq_len=2048, bias=False), global_batch=32)
    llama = workload_for("llama-8b", global_batch=8)
    assert (GPT.shape.linear_bias, gpt.shape.linear_bias, llama.shape.linear_bias) == (True, False, False)
    for w in (GPT, gpt, llama):
        fwd, _ = serial_block_kernels(w.shape)
        assert serial_recompute_kernels(w.shape) == fwd - 2
        for c in (cal, measured):
            plain, ckpt = (host_times(_plan(activation_checkpointing=a), w, c) for a in (False, True))
            forward = host_block_kernels(c, w.shape) * c.host_forward_share
            assert ckpt.kernels - plain.kernels == pytest.approx(forward * (fwd - 2) / fwd, rel=1e-12)
            assert ckpt.backward - plain.backward == pytest.approx(forward * (fwd - 2) / fwd * c.host_kernel_s)


def test_moe_layer_kernels_replace_the_dense_mlps():
    """An MoE block's host kernels: the dense block's with its MLP's (Llama's SwiGLU: 10 forward, 16
    backward) replaced by the MoE layer's, counted from the code (expert_kernels; checked against a
    run in tests/dist/test_planner_host_expert_kernels.py) for the route the plan takes: the local
    route at ep 1, the routed one at ep > 1 (its device copies included), a recompute without the
    routes it replays nor the loss's sum over the layers, nor the router loss's last division and add
    (where it stops); a dense model adds none. The MoE block's recompute less the dense block's: the
    layer's less the dense MLP's but the down projection's GEMM, where the dense recompute stops."""
    moe = workload_for("mixtral-4b", seq_len=2048, global_batch=32)
    dense = dataclasses.replace(moe, num_experts=0)
    assert mlp_kernels(moe.shape) == (10.0, 16.0)
    assert moe_block_kernels(_plan(), dense) == (0.0, 0.0, 0.0)
    local, routed = _plan(), _plan(ep=2)
    assert (expert_route(local, moe), expert_route(routed, moe)) == ("local", "routed")
    # widths the grouped GEMMs do not take (2 I not a multiple of 16): the routed path at ep 1 too
    assert expert_route(local, dataclasses.replace(moe, expert_ffn_hidden=5636)) == "routed"
    f, b, r = moe_layer_kernels(local, moe)
    assert (f, b, r) == (67.0, 49.0, 0.0)
    rf, rb, _ = moe_layer_kernels(routed, moe)
    assert (rf, rb) == (52.0 + EP_DEVICE_COPIES[0], 54.0)
    # unnormalised top-k weights (OLMoE): the weights' sum and division fewer, and their backward
    unnormed = dataclasses.replace(moe, experts_norm_topk=False)
    assert moe_layer_kernels(local, unnormed) == (f - 2, b - 7, 0.0)
    ckpt = moe_layer_kernels(_plan(activation_checkpointing=True), moe)
    assert ckpt == (f, b, f - 3)
    ckpt = moe_layer_kernels(_plan(ep=2, activation_checkpointing=True), moe)
    assert ckpt[2] == rf - 3 - 5 - EP_DEVICE_COPIES[0] + EP_DEVICE_COPIES[2]
    assert moe_block_kernels(_plan(activation_checkpointing=True), moe) == (f - 10, b - 16, f - 3 - 9)
    assert moe_block_kernels(local, moe) == (f - 10, b - 16, 0.0)
    # host_times: the MoE block's kernels beyond the dense block's are exactly these (one rank, no
    # calls: the statistics' all-reduce needs a data axis)
    cal = load_calibration(GOLDEN_CAL)
    one = bh.Plan(precision="bf16").resolve(1)
    for plan in (one, dataclasses.replace(one, activation_checkpointing=True)):
        extra = host_times(plan, moe, cal).kernels - host_times(plan, dense, cal).kernels
        assert extra == pytest.approx(sum(moe_block_kernels(plan, moe)), rel=1e-12)


def test_a_shared_experts_kernels_join_the_moe_layers():
    """A shared expert (one SwiGLU every token goes through beside its k experts) adds the same
    kernels by either route: its input's cast, two weight casts, two GEMMs, SiLU, the product and
    the add to the routed output forward (8); backward the branch gradient's cast, each Linear's two
    GEMMs and weight-gradient cast, the product's two and SiLU's, the gate/up concatenation, the
    input gradient's cast back, the third reader's sum and its two parameters' accumulations (15).
    Under 1D sequence parallelism the layer's input is already in bf16: the three casts go. A
    recompute runs it again whole."""
    moe = workload_for("mixtral-4b", seq_len=2048, global_batch=32)
    shared = dataclasses.replace(moe, shared_expert_ffn_hidden=1024)
    for plan in (_plan(), _plan(ep=2), _plan(tp=2), _plan(tp=4, tp_mode="2d"), _plan(activation_checkpointing=True)):
        with_it, without = moe_layer_kernels(plan, shared), moe_layer_kernels(plan, moe)
        again = 8.0 if plan.activation_checkpointing else 0.0
        assert tuple(a - b for a, b in zip(with_it, without)) == (8.0, 15.0, again), plan.describe()
    sp = _plan(tp=2, sequence_parallel=True, activation_checkpointing=True)
    assert tuple(a - b for a, b in zip(moe_layer_kernels(sp, shared), moe_layer_kernels(sp, moe))) == (7.0, 13.0, 7.0)
    assert moe_block_kernels(_plan(), dataclasses.replace(shared, num_experts=0)) == (0.0, 0.0, 0.0)
    # read from a model's config
    config = build_config("llama-moe-tiny", vocab_size=512, seq_len=64, shared_expert_ffn_hidden=16)
    assert workload_for(config, seq_len=64, global_batch=8).shared_expert_ffn_hidden == 16


def test_a_pipelines_host_bound_is_its_busiest_ranks():
    """Each pipeline rank's host issues its own blocks: the step's host time is the busiest rank's
    (GPT-1.3B at pp 2: 13 blocks on the first rank, 11 on the last), all micro-batches."""
    cal = load_calibration(GOLDEN_CAL)
    plan = bh.Plan(tp=2, pp=2, microbatches=8, schedule="1f1b", precision="bf16").resolve(16)
    assert stage_layers(plan, GPT) == (13, 11)
    ht = host_times(plan, GPT, cal)
    p = predict(plan, GPT, Cluster(num_gpus=16, calibration=cal))
    assert p.host == pytest.approx(8 * (13 * (ht.forward + ht.backward) + ht.pipeline), rel=1e-12)


def test_host_fit_reproduces_the_measured_blocks():
    """benchmarks/calibrate.py's fit of the host figures: the serial block gives the seconds per
    kernel; each mode's seconds per collective call beyond the serial block's kernels and those its
    layers add (counted, tp_block_kernels of the tiny GPT's block: 1D on 4 ranks 2 + 0, 2D 40 +
    25), its calls counted as the cost model counts them (1D: 2 forward, 2 backward; 2D: 10 and
    15, its 2 blocks' biases and norms summed in 2 bucket flushes a pass), so host_times of that
    block equals the measured seconds; the measured extra kernels per call kept as measured. A
    profile that also listed each call's record function (8 NCCL entries for 4 calls) has those
    entries taken off its kernels."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
    from calibrate import fit_host

    from behemoth.models import build_config

    tiny = workload_for(build_config("gpt-tiny", vocab_size=512, seq_len=128), global_batch=1)
    blocks = {
        "serial": dict(seconds=4e-3, kernels=50.0, nccl=0.0),
        "1d": dict(seconds=5e-3, kernels=60.0, nccl=8.0),
        "2d": dict(seconds=20e-3, kernels=200.0, nccl=25.0),
    }
    fit = fit_host(blocks, 4)
    per_kernel = 4e-3 / 50
    assert fit["host_kernel_s"] == per_kernel and fit["host_block_kernels"] == 50.0
    assert fit["kernels_per_call"] == {"1d": (56.0 - 50.0) / 4, "2d": (200.0 - 50.0) / 25}
    counted = {
        mode: sum(tp_block_kernels(plan, tiny))
        for mode, plan in (("1d", _plan(tp=4)), ("2d", _plan(tp=4, tp_mode="2d")))
    }
    assert counted == {"1d": 2.0, "2d": 65.0}  # 1D: the rows' biases; 2D: the norms' 2 x (18 + 14), the
    # biases' adds (4) less their gradients' casts (4), the block's share of the pass's flushes (1)
    assert fit["host_call_s"]["1d"] == pytest.approx((5e-3 - (50 + 2) * per_kernel) / 4, rel=1e-12)
    assert fit["host_call_s"]["2d"] == pytest.approx((20e-3 - (50 + 65) * per_kernel) / 25, rel=1e-12)
    assert fit["kernels_per_collective"] == 1.5
    cal = dataclasses.replace(load_calibration(GOLDEN_CAL), host_forward_share=0.5, **fit)
    for mode, plan in (("1d", _plan(tp=4)), ("2d", _plan(tp=4, tp_mode="2d"))):
        ht = host_times(plan, tiny, cal)
        assert ht.forward + ht.backward == pytest.approx(blocks[mode]["seconds"], rel=1e-12)


def test_host_fit_takes_the_host_issue_time_not_the_device_wait():
    """Synthetic blocks made from known host figures (seconds per kernel and per call; the kernels:
    the serial block's, those the layout's layers add as tp_block_kernels counts them, and each
    call's own; the calls as the cost model counts them) plus, in each step's wall time, a wait for
    the device that does not grow with the host's calls (a chain of dependent collectives at the
    device's and the peers' latency in a block with no work): the fit recovers the host figures
    from the issue seconds (the seconds per call: the call's own kernel's and its Python), and
    host_times of each block is its issue time, not its wall time. A block without issue seconds
    (an older calibration's) is fitted from its wall time, wait included."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
    from calibrate import fit_host

    from behemoth.models import build_config

    tiny = workload_for(build_config("gpt-tiny", vocab_size=512, seq_len=128), global_batch=1)
    per_kernel, per_call = 30e-6, {"1d": 80e-6, "2d": 120e-6}
    serial_kernels = 50.0
    plans = {"1d": _plan(tp=4), "2d": _plan(tp=4, tp_mode="2d")}
    blocks = {"serial": dict(seconds=serial_kernels * per_kernel + 1e-4, kernels=serial_kernels, nccl=0.0)}
    blocks["serial"]["issue"] = serial_kernels * per_kernel
    for mode, plan in plans.items():
        calls = sum(tp_block_calls(plan, tiny))
        layers = sum(tp_block_kernels(plan, tiny))
        issue = (serial_kernels + layers + calls) * per_kernel + calls * per_call[mode]
        wait = 5e-3  # per block, the device chain the host waited for at the step's end
        blocks[mode] = dict(seconds=issue + wait, issue=issue, kernels=serial_kernels + layers + calls, nccl=calls)
    fit = fit_host(blocks, 4)
    assert fit["host_kernel_s"] == pytest.approx(per_kernel, rel=1e-12)
    for mode, plan in plans.items():
        calls = sum(tp_block_calls(plan, tiny))
        assert fit["host_call_s"][mode] == pytest.approx(per_call[mode] + per_kernel, rel=1e-9)
        layers = sum(tp_block_kernels(plan, tiny))
        assert fit["kernels_per_call"][mode] == pytest.approx((layers + calls) / calls, rel=1e-12)
    cal = dataclasses.replace(load_calibration(GOLDEN_CAL), host_forward_share=0.5, **fit)
    for mode, plan in plans.items():
        ht = host_times(plan, tiny, cal)
        assert ht.forward + ht.backward == pytest.approx(blocks[mode]["issue"], rel=1e-9)
    old = {m: {k: v for k, v in b.items() if k != "issue"} for m, b in blocks.items()}
    before = fit_host(old, 4)
    assert before["host_kernel_s"] == pytest.approx(blocks["serial"]["seconds"] / serial_kernels, rel=1e-12)
    assert before["host_call_s"]["2d"] > fit["host_call_s"]["2d"]


def test_the_step_is_at_least_its_host_time():
    """2D with 8 one-sequence micro-batches per step is host-bound on the golden calibration: the
    step is its host time (plus what follows the last micro-batch); without host figures it is the
    device's, smaller; a costlier host never predicts faster, and a host-bound plan's step does not
    move with faster GEMMs."""
    cal = load_calibration(GOLDEN_CAL)
    plan = bh.Plan(tp=4, tp_mode="2d", microbatches=8, precision="bf16")
    c = Cluster(num_gpus=16, calibration=cal)
    p = predict(plan, GPT, c)
    assert p.host_bound and p.step >= p.host and p.host_wait > 0
    device = predict(
        plan, GPT, Cluster(num_gpus=16, calibration=dataclasses.replace(cal, host_kernel_s=0.0, host_call_s={}))
    )
    assert not device.host_bound and device.host_wait == 0 and device.step < p.step
    # no pipeline: the wait adds to the step, less what the longer backward hides of the gradient sync
    hidden_more = device.exposed["dp"] - p.exposed["dp"]
    assert hidden_more >= 0 and p.step - device.step == pytest.approx(p.host_wait - hidden_more)
    slower = dataclasses.replace(cal, host_kernel_s=2 * cal.host_kernel_s)
    assert predict(plan, GPT, Cluster(num_gpus=16, calibration=slower)).step > p.step
    fast = dataclasses.replace(cal, gemm=tuple((f, 2 * r) for f, r in cal.gemm))
    assert predict(plan, GPT, Cluster(num_gpus=16, calibration=fast)).step == pytest.approx(p.step)
    dense = predict(bh.Plan(precision="bf16", microbatches=2), GPT, c)
    assert not dense.host_bound and dense.host < dense.compute


def test_recompute_and_zero_bubble_repeat_the_blocks_collectives():
    """The ledger books a checkpointed block's forward collectives again in its backward, and
    zero-bubble's BW the blocks' backward ones on every stage but the first (tests/dist/
    test_planner_ledger.py checks both against real runs)."""
    fp32 = Dtypes(compute=4, stream=4, param=4)
    base = bh.Plan(tp=2, cp=2).resolve(4)
    ckpt = dataclasses.replace(base, activation_checkpointing=True)
    one = block_traffic("1d", GPT.shape, batch=32, seq=1024, tp=2, dtype_bytes=4, param_bytes=4)
    layers = GPT.shape.num_layers
    want, got = step_traffic(base, GPT, dt=fp32), step_traffic(ckpt, GPT, dt=fp32)
    assert got["tp"] - want["tp"] == layers * one.forward
    assert got["cp"] == pytest.approx(1.5 * want["cp"])  # Ulysses: as many bytes forward as backward
    zb = bh.Plan(tp=2, pp=2, microbatches=4, schedule="zero-bubble").resolve(4)
    fb = dataclasses.replace(zb, schedule="1f1b")
    stage_block = block_traffic("1d", GPT.shape, batch=8, seq=2048, tp=2, dtype_bytes=4, param_bytes=4)
    layers = stage_layers(zb, GPT)
    for stage in (0, 1):
        extra = step_traffic(zb, GPT, stage=stage, dt=fp32)["tp"] - step_traffic(fb, GPT, stage=stage, dt=fp32)["tp"]
        assert extra == (stage > 0) * layers[stage] * stage_block.backward * zb.microbatches


def test_moe_split_size_exchange_is_in_the_ep_bytes():
    """Per rank, an even routing's ep wire bytes are (ep-1)/ep of its share of the group's payload,
    ``ep_all_to_all_bytes`` (the split sizes' exchange included, once per chunk of ``ep_overlap``;
    a recomputation runs the row all-to-alls again, not the split sizes')."""
    w = workload_for("mixtral-4b", seq_len=2048, global_batch=32)
    s = w.shape
    for ckpt, chunks in ((False, 1), (True, 1), (True, 2)):
        plan = bh.Plan(
            ep=4, ep_overlap=chunks, microbatches=2, precision="bf16", activation_checkpointing=ckpt
        ).resolve(8)
        mbs = w.global_batch // (plan.dp * plan.microbatches)
        rows = plan.ep * mbs * w.seq_len * w.experts_top_k
        group = ep_all_to_all_bytes(
            rows=rows,
            num_experts=w.num_experts,
            ep=plan.ep,
            hidden=s.hidden,
            elem_bytes=2,
            recompute=ckpt,
            chunks=chunks,
        )
        want = (plan.ep - 1) / plan.ep * group / plan.ep * s.num_layers * plan.microbatches
        want += 2 * (plan.ep - 1) / plan.ep * 4  # the step's gradient norm: the experts' fp32 share over ep
        assert step_traffic(plan, w)["ep"] == pytest.approx(want, rel=1e-12)


def test_zero_bubble_closed_form_is_the_simulator_for_any_split():
    for pp in (2, 3, 4):
        for m in (pp, 2 * pp, 8):
            for ratio in (0.5, 1.0, 2.0, 3.0):
                for bi in (0.125, 0.25, 0.5, 0.75, 0.875):
                    sim = _simulated("zero-bubble", pp, m, 1, ratio, bi)
                    assert sim == pytest.approx(_closed("zero-bubble", pp, m, 1, ratio, bi)), (pp, m, ratio, bi)


def test_zero_bubble_runs_the_backward_twice():
    """A zero-bubble stage's BW backpropagates through the stage again: its micro-batch backward
    (device time) is the 1F1B one plus the input-gradient path again."""
    from behemoth.planner.compute import block_times

    cal = dataclasses.replace(load_calibration(GOLDEN_CAL), host_kernel_s=0.0, host_call_s={})
    c = Cluster(num_gpus=16, calibration=cal)
    zb = predict(bh.Plan(pp=2, microbatches=4, schedule="zero-bubble", precision="bf16"), GPT, c)
    fb = predict(bh.Plan(pp=2, microbatches=4, schedule="1f1b", precision="bf16"), GPT, c)
    bt = block_times(zb.plan, GPT, cal, zb.micro_batch_size)
    layers = stage_layers(zb.plan, GPT)[-1]  # the last stage's (it holds the head)
    assert zb.stage_times[0] == pytest.approx(fb.stage_times[0])
    assert zb.stage_times[1] - fb.stage_times[1] == pytest.approx(layers * (bt.backward - bt.weight_grad))


def test_calibration_host_figures_round_trip_and_are_checked():
    cal = load_calibration(GOLDEN_CAL)
    again = Calibration.from_dict(json.loads(cal.to_json()))
    assert again.host_call_s == cal.host_call_s and again.sustained_ratio == cal.sustained_ratio
    for bad in (dict(host_kernel_s=-1.0), dict(host_call_s={"1d": -1e-6}), dict(sustained_ratio=0.0)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            dataclasses.replace(cal, **bad)
    slow = dataclasses.replace(cal, sustained_ratio=0.5)
    assert slow.gemm_seconds(4096, 4096, 4096) == pytest.approx(
        2 * dataclasses.replace(cal, sustained_ratio=1.0).gemm_seconds(4096, 4096, 4096)
    )


def test_grid_gradient_lead_is_the_runtimes():
    """The planner's bucket flushes follow the runtime's landing lead (deferred_grads)."""
    from behemoth.parallel.tensor.deferred_grads import DeferredGrads
    from behemoth.planner.tp2d_traffic import GRID_GRAD_LEAD, grid_vector_flushes

    assert GRID_GRAD_LEAD == DeferredGrads.lead
    # one flush per lead + 1 layers with vectors; layers without none; the first layers' at the end
    assert grid_vector_flushes([True] * 14, lead=6) == 2
    assert grid_vector_flushes([False] * 14, lead=6) == 0
    assert grid_vector_flushes([True] * 15, lead=6) == 3

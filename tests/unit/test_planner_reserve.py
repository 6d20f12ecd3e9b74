"""planner/reserve.py: the device memory a rank holds beyond PyTorch's tensors (CUDA context,
NCCL buffers per communicator it opens, the allocator's slack), and "fits" counting it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

import behemoth as bh
from behemoth.planner.calibration import load_calibration
from behemoth.planner.cluster import Cluster
from behemoth.planner.cost import predict
from behemoth.planner.footprint import plan_memory
from behemoth.planner.reserve import communicators, device_reserve
from behemoth.planner.workload import workload_for

GOLDEN_CAL = Path(__file__).parent / "data" / "planner_calibration.json"


@pytest.mark.parametrize(
    "plan, world, want",
    [
        (bh.Plan(zero=1), 4, (0, 0)),  # dp over the world: the world's communicator
        (bh.Plan(dp=2, tp=2), 4, (2, 0)),  # dp, tp
        (bh.Plan(tp=2, cp=2), 4, (3, 1)),  # tp, cp, dp_cp (cp's members, its own group); Ulysses' peer
        (bh.Plan(tp=2, pp=2, microbatches=8), 4, (2, 4)),  # tp, pp; four channels
        (bh.Plan(pp=4, microbatches=8), 4, (0, 4)),  # pp over the world; four channels
        (bh.Plan(pp=2, cp=2, microbatches=8), 4, (3, 5)),  # cp, dp_cp, pp; four channels, Ulysses' peer
        (bh.Plan(tp=4, tp_mode="2d"), 4, (2, 0)),  # the grid is the world; its rows and columns
        (bh.Plan(tp=4, tp_mode="2d"), 8, (4, 0)),  # dp, tp, rows, columns
        (bh.Plan(tp=8, tp_mode="2.5d", tp_depth=2), 8, (3, 0)),  # rows, columns, depth
        (bh.Plan(tp=8, tp_mode="3d"), 16, (5, 0)),  # dp, tp, three grid axes
        (bh.Plan(cp=4), 4, (0, 3)),  # cp and dp_cp are the world's; dp has one rank; 3 all-to-all peers
        (bh.Plan(cp=4, cp_mode="ring"), 4, (0, 2)),  # the ring's previous and next rank
        (bh.Plan(cp=2, cp_mode="ring"), 4, (2, 1)),  # cp, dp_cp; one peer, both ways
        (bh.Plan(ep=4), 4, (0, 3)),  # the experts' all-to-all over the world: 3 peers
    ],
)
def test_communicators_a_rank_opens(plan, world, want):
    assert communicators(plan.resolve(world)) == want


def test_communicators_of_moe_blocks_under_tensor_parallelism():
    """A mixture of experts under tp syncs its MoE blocks' gradients over the data axis times tp
    (and, under ep, over ep_dp times tp): one more group each where it is not the world's."""
    plan = bh.Plan(dp=2, ep=2, tp=2, pp=2, microbatches=8).resolve(8)
    # dp, tp, ep, pp; four channels and the ep peer (ep_dp has one rank)
    assert communicators(plan) == (4, 5)
    # and dp_tp (4 ranks), ep_dp_tp (2 ranks)
    assert communicators(plan, experts=True) == (6, 5)
    # without a pipeline dp_tp is the world's; ep_dp_tp is not
    assert communicators(bh.Plan(dp=2, ep=2, tp=2).resolve(4), experts=True) == (4, 1)


def test_device_reserve_is_context_communicators_and_slack():
    cal = dataclasses.replace(
        load_calibration(GOLDEN_CAL),
        cuda_context_bytes=5e8,
        nccl_comm_bytes=7e8,
        nccl_p2p_bytes=4e8,
        allocator_slack=0.05,
    )
    plan = bh.Plan(tp=2, pp=2, microbatches=8).resolve(4)
    assert device_reserve(plan, cal, 100e9) == pytest.approx(5e8 + 3 * 7e8 + 4 * 4e8 + 5e9)
    # an older calibration: its flat reserve, and the slack
    old = dataclasses.replace(cal, cuda_context_bytes=0.0, reserved_bytes=3e9)
    assert device_reserve(plan, old, 100e9) == pytest.approx(3e9 + 5e9)
    # plan_memory carries it as the footprint's reserve, over the tensors' peak
    w = workload_for("gpt-1.3b", seq_len=2048, global_batch=32)
    mem = plan_memory(plan, w, Cluster(num_gpus=4, calibration=cal))
    tensors = mem.params + mem.grads + mem.optimizer + mem.activations
    assert mem.allocated == pytest.approx(tensors)
    # the calibration's fraction reads the peak the footprint hands it: the tensors and their slack
    assert mem.reserved == pytest.approx(device_reserve(plan, cal, tensors + mem.slack))
    assert mem.gpu_total == pytest.approx(tensors + mem.slack + mem.reserved)


def test_a_layout_fits_only_with_its_communicators_and_slack():
    """The memory a layout's tensors leave on a card is not all its own: a card just large enough
    for the tensors and the context does not fit the layout once its NCCL buffers and the
    allocator's slack count."""
    cal = load_calibration(GOLDEN_CAL)
    w = workload_for("gpt-1.3b", seq_len=2048, global_batch=32)
    plan = bh.Plan(tp=2, pp=2, microbatches=8)
    bare = dataclasses.replace(cal, cuda_context_bytes=5e8)
    full = dataclasses.replace(bare, nccl_comm_bytes=7e8, nccl_p2p_bytes=4e8, allocator_slack=0.05)
    tensors = plan_memory(plan.resolve(4), w, Cluster(num_gpus=4, calibration=bare))
    card = tensors.gpu_total + 1e8
    assert predict(plan, w, Cluster(num_gpus=4, gpu_bytes=card, calibration=bare)).fits
    p = predict(plan, w, Cluster(num_gpus=4, gpu_bytes=card, calibration=full))
    assert not p.fits and "GiB per GPU" in p.why_not


def test_autocast_weight_copies_count_once_per_micro_batch_in_flight():
    """Under bf16 autocast every GEMM keeps the 16-bit copy of its fp32 weight until its backward:
    a block's saved set holds 2 bytes a parameter besides its activations, once per micro-batch a
    pipeline rank holds; fp32 and bf16 parameter copies (param_dtype) keep none."""
    from behemoth.planner.footprint import block_activation_bytes, footprint
    from behemoth.planner.params import block_local_params, stage_layers

    w = workload_for("gpt-1.3b", seq_len=2048, global_batch=32)
    bf16 = bh.Plan(tp=2, precision="bf16").resolve(2)
    own = bh.Plan(tp=2, precision="bf16", zero=1, param_dtype="bf16").resolve(2)
    copies = 2 * block_local_params(bf16, w)
    assert block_activation_bytes(bf16, w, 4)[0] - block_activation_bytes(own, w, 4)[0] == pytest.approx(copies)
    pipe = bh.Plan(pp=4, microbatches=8, precision="bf16").resolve(4)
    for stage in (0, 3):  # each stage's own blocks (the default: the last)
        layers = stage_layers(pipe, w)[stage]
        one, four = (footprint(pipe, w, mbs=1, inflight=k, reserved=0.0, stage=stage).activations for k in (1, 4))
        assert four - one == pytest.approx(3 * layers * block_activation_bytes(pipe, w, 1)[0])
    assert footprint(pipe, w, mbs=1, inflight=1, reserved=0.0) == footprint(
        pipe, w, mbs=1, inflight=1, reserved=0.0, stage=3
    )
    assert block_activation_bytes(pipe, w, 1)[0] > 2 * block_local_params(pipe, w)  # the copies are in it


def test_zero1_keeps_the_reduced_shard_and_gpipe_the_loss_of_every_micro_batch():
    """ZeRO-1 holds the fp32 gradient chunks and the reduced shard the optimizer reads (4 + 4/g a
    parameter), ZeRO-2 the shard and the chunks its backward reduces; GPipe's last stage keeps every micro-batch's fp32
    log-probabilities and the head's 16-bit weight copy until the backwards, 1F1B's one."""
    from behemoth.planner.footprint import footprint, gradient_chunk_elements
    from behemoth.planner.params import local_params

    w = workload_for("gpt-1.3b", seq_len=2048, global_batch=32)
    z0, z1, z2 = (bh.Plan(zero=z, precision="bf16").resolve(4) for z in (0, 1, 2))
    n = local_params(z1, w)
    g0, g1, g2 = (footprint(p, w, mbs=8, inflight=1, reserved=0.0).grads for p in (z0, z1, z2))
    # ZeRO-2 also holds, while its backward runs, the gradient chunks in flight and filling
    chunk, largest = gradient_chunk_elements(z2, w)
    assert (g0, g1, g2) == pytest.approx((4 * n, 4 * n + n, n + 4 * (3 * chunk + largest)))
    kw = dict(pp=2, microbatches=8, precision="bf16")
    gpipe, one = (bh.Plan(schedule=s, **kw).resolve(2) for s in ("gpipe", "1f1b"))
    a = footprint(gpipe, w, mbs=2, inflight=1, reserved=0.0).activations
    b = footprint(one, w, mbs=2, inflight=1, reserved=0.0).activations
    s = w.shape
    per_mb = 2 * 2048 * s.vocab_size * 4 + 2 * s.vocab_size * s.hidden
    assert a - b == pytest.approx(7 * per_mb)


def test_allocator_slack_is_the_loss_logits_blocks_of_one_micro_batch():
    """The footprint's slack is reserve.allocator_slack of one micro-batch's fp32 logits on the rank:
    four logits-sized blocks (the loss's fp32 cast, log-probabilities and their two gradients), and
    nothing for ZeRO-3's gathered chunks or a checkpointed block's recompute, which are freed and
    requested again at the same sizes."""
    from behemoth.planner.footprint import footprint
    from behemoth.planner.reserve import LOSS_LOGITS_BLOCKS, allocator_slack

    w = workload_for("gpt-1.3b", seq_len=2048, global_batch=32)
    v = w.shape.vocab_size

    def slack(plan, world, mbs):
        return footprint(plan.resolve(world), w, mbs=mbs, inflight=1, reserved=0.0).slack

    assert LOSS_LOGITS_BLOCKS == 4
    assert allocator_slack(0.0) == 0.0
    assert allocator_slack(3.0 * 2**30) == 12.0 * 2**30
    # dp=4: 8 sequences of 2048 tokens a rank, the vocabulary whole; ZeRO-3 the same
    logits = 8 * 2048 * v * 4
    assert slack(bh.Plan(zero=2, precision="bf16"), 4, 8) == pytest.approx(4 * logits)
    assert slack(bh.Plan(zero=3, precision="bf16"), 4, 8) == pytest.approx(4 * logits)
    pipe = bh.Plan(pp=2, microbatches=8, zero=3, precision="bf16")
    assert slack(pipe, 2, 4) == pytest.approx(4 * 4 * 2048 * v * 4)
    # tp=2 with cp=2: half the vocabulary, half the sequence; checkpointing adds nothing
    ck = bh.Plan(tp=2, cp=2, precision="bf16", activation_checkpointing=True)
    assert slack(ck, 4, 32) == pytest.approx(4 * 32 * 1024 * v / 2 * 4)


def _gpt69b_on_h200(world: int):
    from behemoth.models import build_config

    config = build_config("gpt-6.7b", vocab_size=50304, seq_len=2048, tie_embeddings=False)
    w = workload_for(config, seq_len=2048, global_batch=8 * world)
    cal = load_calibration("h200-measured-2gpu")  # the H200's 139.8 GiB, the measured reserve
    return w, Cluster(num_gpus=world, gpus_per_node=world, gpu_bytes=cal.gpu_bytes, calibration=cal)


@pytest.mark.parametrize(
    "plan",
    [
        bh.Plan(dp=1, cp=4, zero=3, precision="bf16"),  # out of memory: 10.8 GiB reserved unallocated
        bh.Plan(dp=1, cp=4, cp_mode="ring", zero=3, precision="bf16"),  # the run hung inside it
    ],
    ids=lambda p: p.describe(),
)
def test_the_4_gpu_layouts_that_ran_out_of_memory_do_not_fit(plan):
    """GPT-6.9B on 4 x H200: ``Plan(cp=4, zero=3)``, 130.0 GiB allocated predicted (127.1 when
    ZeRO-3's gathered parameters were counted as two blocks instead of whole chunks), ran out of
    memory with 124.6 GiB allocated and 10.8 reserved beside it, 2.75 GiB outside the allocator:
    the slack of its 3 GiB logits and ZeRO-3's gathered blocks, and Ulysses' peers, no longer fit
    the card."""
    w, cluster = _gpt69b_on_h200(4)
    p = predict(plan, w, cluster)
    assert p.memory.allocated / 2**30 == pytest.approx(130.0, abs=0.05)
    assert not p.fits and "GiB per GPU" in p.why_not


@pytest.mark.parametrize(
    "plan",
    [
        bh.Plan(dp=1, tp=2, microbatches=2, zero=1, precision="bf16"),  # 123.8 allocated, 128.6 reserved
        bh.Plan(dp=1, microbatches=2, cp=2, cp_mode="ring", zero=2, precision="bf16"),  # 124.2, 131.1
        bh.Plan(dp=1, pp=2, microbatches=8, schedule="interleaved", virtual_stages=2, zero=3, precision="bf16"),
    ],
    ids=lambda p: p.describe(),
)
def test_the_2_gpu_layouts_that_ran_still_fit(plan):
    """GPT-6.9B on 2 x H200: the layouts of the 2-GPU proof closest to the card ran; the slack
    model keeps them fits."""
    w, cluster = _gpt69b_on_h200(2)
    assert predict(plan, w, cluster).fits


def test_zero2_holds_three_gradient_chunks_and_a_parameter_gradient_beside_its_shards():
    """Without a pipeline ZeRO-2 keeps, beside its gradient shards, the chunk the backward fills,
    the 2 whose reductions are in flight and the largest parameter's own gradient, in fp32: the
    chunk size the runtime's search picks for the rank's weights (Llama-8B's shape: 1,032M
    elements, the size ZeroOptimizer picks for the model's own parameters). A pipeline's
    ZeRO-2 holds its whole gradient instead, and no shard: the last step's are freed as the step
    starts, at one data rank or more (parallel/zero/reduce.py; at one, a 2 x H200 Llama-8B proof
    ran out of memory while they were kept)."""
    from behemoth.models import build_config
    from behemoth.planner.footprint import footprint, gradient_chunk_elements
    from behemoth.planner.params import local_params

    w = workload_for(build_config("llama-8b", vocab_size=128256, seq_len=2048), seq_len=2048, global_batch=16)
    plan = bh.Plan(cp=2, zero=2, precision="bf16").resolve(2)
    chunk, largest = gradient_chunk_elements(plan, w)
    assert (chunk, largest) == (1032131861, 128256 * 4096)
    n = local_params(plan, w)
    grads = footprint(plan, w, mbs=4, inflight=1, reserved=0.0).grads
    assert grads == pytest.approx(4 * n / 2 + 4 * (3 * chunk + largest))
    pipe = bh.Plan(dp=2, pp=2, microbatches=8, zero=2, precision="bf16").resolve(4)
    assert footprint(pipe, w, mbs=2, inflight=1, reserved=0.0).grads == pytest.approx(
        4 * local_params(pipe, w, stage=1)
    )
    alone = bh.Plan(pp=2, microbatches=8, zero=2, precision="bf16").resolve(2)
    assert footprint(alone, w, mbs=2, inflight=1, reserved=0.0).grads == pytest.approx(
        4 * local_params(alone, w, stage=1)
    )


def test_a_pipeline_needs_the_most_any_stage_needs_with_its_own_blocks_and_micro_batches():
    """plan_memory takes every pipeline stage with its own blocks, parameters and in-flight
    micro-batches: 1F1B's first rank holds pp micro-batches, its last one; zero-bubble's BI keeps
    each micro-batch's graph for its BW, so every rank holds pp; GPipe all m. The allocated peak is
    the stage with the most tensors, the total the most any stage needs with its slack."""
    from behemoth.planner.bubble import rank_inflight
    from behemoth.planner.footprint import footprint, plan_memory
    from behemoth.planner.params import local_params, stage_layers

    assert [rank_inflight("1f1b", 4, 8, 1, r) for r in range(4)] == [4, 3, 2, 1]
    assert [rank_inflight("zero-bubble", 4, 8, 1, r) for r in range(4)] == [4, 4, 4, 4]
    assert [rank_inflight("gpipe", 2, 8, 1, r) for r in range(2)] == [8, 8]
    assert [rank_inflight("interleaved", 4, 16, 2, r) for r in range(4)] == [5.5, 4.5, 3.5, 2.5]
    # past the simulator's limit, the closed forms agree with it
    assert [rank_inflight("interleaved", 8, 64, 4, r) for r in (0, 7)] == [8 + 7 / 4, 8 - 7 / 4]
    assert [rank_inflight("1f1b", 8, 64, 1, r) for r in (0, 7)] == [8, 1]
    from behemoth.models import build_config

    w = workload_for(build_config("mixtral-4b", vocab_size=50304, seq_len=2048), seq_len=2048, global_batch=16)
    cal = load_calibration("h200-measured-2gpu")
    cluster = Cluster(num_gpus=2, gpus_per_node=2, gpu_bytes=cal.gpu_bytes, calibration=cal)
    plan = bh.Plan(pp=2, microbatches=4, precision="bf16").resolve(2)
    assert stage_layers(plan, w) == (9, 7)  # the head's cost on the last stage
    first = footprint(plan, w, mbs=4, inflight=2, reserved=0.0, stage=0)
    last = footprint(plan, w, mbs=4, inflight=1, reserved=0.0, stage=1)
    assert first.params == pytest.approx(4 * local_params(plan, w, stage=0))
    assert first.slack == 0.0 and last.slack > 0.0  # the loss's blocks on the last stage only
    mem = plan_memory(plan, w, cluster)
    assert first.allocated > last.allocated and mem.allocated == pytest.approx(first.allocated)
    assert mem.allocated + mem.slack == pytest.approx(max(first.gpu_total, last.gpu_total))


def test_a_checkpointed_forward_holds_every_blocks_weight_copy_in_autocasts_cache():
    """Under activation checkpointing with fp32 weights under autocast and ZeRO 0-2 (the cache
    on), the forward's end holds autocast's 16-bit copy of every block's weights (2 bytes a
    parameter) where the backward holds one recomputed block's full set: the activations count
    the larger. ZeRO-3 runs without the cache; bf16 parameters make no copies."""
    from behemoth.planner.footprint import autocast_cache_bytes, block_activation_bytes, footprint
    from behemoth.planner.params import block_local_params

    w = workload_for("gpt-1.3b", seq_len=2048, global_batch=32)
    z1 = bh.Plan(zero=1, precision="bf16", activation_checkpointing=True).resolve(4)
    assert autocast_cache_bytes(z1, w, 24) == 2 * 24 * block_local_params(z1, w)
    full, kept = block_activation_bytes(z1, w, 8)
    assert autocast_cache_bytes(z1, w, 24) > full  # 24 blocks' copies outweigh one block's set
    logits = 8 * 2048 * w.shape.vocab_size * 4
    act = footprint(z1, w, mbs=8, inflight=1, reserved=0.0).activations
    head = 2 * w.shape.vocab_size * w.shape.hidden
    assert act == pytest.approx(24 * kept + 2 * 24 * block_local_params(z1, w) + 2 * logits + head)
    z3 = bh.Plan(zero=3, precision="bf16", activation_checkpointing=True).resolve(4)
    own = bh.Plan(zero=1, precision="bf16", param_dtype="bf16", activation_checkpointing=True).resolve(4)
    assert autocast_cache_bytes(z3, w, 24) == 0.0 and autocast_cache_bytes(own, w, 24) == 0.0
    act3 = footprint(z3, w, mbs=8, inflight=1, reserved=0.0).activations
    assert act3 == pytest.approx(24 * kept + full + 2 * logits + head)

"""Import of mixture-of-experts checkpoints from transformers under expert parallelism: Mixtral,
Qwen3-MoE and OLMoE directories written by ``save_pretrained`` (one tensor per expert, sharded
files with their index) read by ``bh.load_hf`` into transformers' own models -- and, for Mixtral,
behemoth's Llama with experts -- under ep x 1D tp, dp x ep, ep x pp, ep x cp, ep x ZeRO-3 (with
CPU offload at ep = 4), and into a model of ``bh.parallelize`` alone.

Each plan gives the serial state transformers' weights give (``full_state_dict`` exactly equal),
logits equal to transformers' ``from_pretrained`` model's on the same input, each rank reading
only its own experts (every read recorded) and its share of the dense tensors (bytes read per
rank counted: about model/world, every byte read about once), and an ``engine.save_hf`` of the
imported model holding exactly the tensors of the checkpoint it read (the round trip). Trained
one step under ep x tp, exported, and imported under ep = 4: the trained state exactly, exported
again identically. A checkpoint holding the experts fused under transformers 5's module names
(which ``from_pretrained`` reads too) loads the same. Bad input -- a missing expert tensor, an
expert of the wrong shape, a number of experts ep does not divide -- raises on every rank,
naming the value, the rule and the fix."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch
import torch.distributed as dist
from common import build_hf_moe, expect_error, global_batches, make_optimizer, shard

import behemoth as bh
from behemoth.hf import load_hf, model_from_hf
from behemoth.hf.load import HFCheckpoint

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors")

V, S, WORLD = 96, 16, 4
NUM_EXPERTS = {"mixtral": 4, "qwen3-moe": 4, "olmoe": 8}
PLANS = {
    "mixtral": (
        ("ep2-tp2", bh.Plan(dp=2, ep=2, tp=2)),
        ("dp2-ep2", bh.Plan(dp=4, ep=2)),
        ("ep2-pp2", bh.Plan(pp=2, dp=2, ep=2, microbatches=2)),
    ),
    "qwen3-moe": (
        ("ep2-tp2", bh.Plan(dp=2, ep=2, tp=2)),
        ("dp2-ep2-zero3", bh.Plan(dp=4, ep=2, zero=3)),
        ("ep2-cp2", bh.Plan(dp=2, ep=2, cp=2)),
    ),
    "olmoe": (  # its q/k norms span every head: split with the heads over tp (role colwise_norm)
        ("ep2-tp2", bh.Plan(dp=2, ep=2, tp=2)),
        ("dp2-ep2", bh.Plan(dp=4, ep=2)),
        ("ep4-zero3-offload", bh.Plan(dp=4, ep=4, zero=3, offload="cpu")),
    ),
}


def build_reference(family: str, num_experts: int | None = None):
    """A transformers MoE model with weights far from any init."""
    n = num_experts or NUM_EXPERTS[family]
    experts = {"num_local_experts": n} if family == "mixtral" else {"num_experts": n}
    model = build_hf_moe(family, rope_theta=500.0, pad_token_id=None, **experts)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape))
    return model


def stored(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint in ``path``, by its stored name."""
    from safetensors.torch import load_file

    out = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, f)))
    return out


def file_bytes(path: str) -> int:
    return sum(t.numel() * t.element_size() for t in stored(path).values())


def write_single(path: str, config_from: str, tensors: dict[str, torch.Tensor]) -> None:
    """A checkpoint directory of one ``model.safetensors`` holding ``tensors``."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    with open(os.path.join(config_from, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(path, "model.safetensors"))


def prepare(root: str, family: str) -> None:
    """The reference checkpoint (sharded, as save_pretrained writes it) and, for Mixtral, the bad
    ones and one with the experts fused."""
    src = os.path.join(root, "src")
    model = build_reference(family)
    model.save_pretrained(src, max_shard_size="40KB")
    if family != "mixtral":
        return
    write_single(os.path.join(root, "fused"), src, model.state_dict())  # transformers 5's module names
    tensors = stored(src)
    missing = dict(tensors)
    del missing["model.layers.1.block_sparse_moe.experts.3.w1.weight"]
    write_single(os.path.join(root, "missing"), src, missing)
    misshapen = dict(tensors)
    name = "model.layers.0.block_sparse_moe.experts.2.w2.weight"
    misshapen[name] = misshapen[name][:, :12]
    write_single(os.path.join(root, "misshapen"), src, misshapen)
    build_reference(family, num_experts=3).save_pretrained(os.path.join(root, "three"))


def logits_of(model, x: torch.Tensor) -> torch.Tensor:
    """The whole logits of a (possibly parallelized) model on ``x``, given on every rank."""
    record = model.__dict__.get("_behemoth_parallelization")
    head = record.vocab_head if record is not None else None
    if head is not None:
        head.gather_output = True
    try:
        with torch.no_grad():
            out = model.eval()(x)
    finally:
        if head is not None:
            head.gather_output = False
    return out.logits if hasattr(out, "logits") else out


def spied_load(target, src: str) -> tuple[dict, list[tuple]]:
    """``load_hf(target, src)`` and the ``(name, offsets, sizes)`` of every read it made."""
    reads = []
    read = HFCheckpoint.read

    def spy(self, name, offsets, sizes, transpose=False):
        reads.append((name, tuple(offsets), tuple(sizes)))
        return read(self, name, offsets, sizes, transpose)

    HFCheckpoint.read = spy
    try:
        return load_hf(target, src), reads
    finally:
        HFCheckpoint.read = read


def check_own_experts(reads, num_experts: int, ep: int, ep_rank: int, what: str) -> None:
    """Every expert this rank read is one of its ep rank's ``num_experts / ep``."""
    first, count = ep_rank * num_experts // ep, num_experts // ep
    experts = 0
    for name, offsets, sizes in reads:
        one = re.search(r"\.experts\.(\d+)\.", name)
        if one is not None:
            assert first <= int(one.group(1)) < first + count, (what, name, ep_rank)
        elif re.search(r"\.experts\.(gate_up|down)_proj$", name):  # fused: a block of its experts
            assert first <= offsets[0] and offsets[0] + sizes[0] <= first + count, (what, name, offsets, sizes)
        else:
            continue
        experts += 1
    assert experts > 0 or ep == 1, (what, "read no expert")  # someone reads each expert: the state check


def check_import(rank, root, family, src, native, name, plan, ref_state, want_logits, x, total):
    what = f"{family} {'transformers' if native else 'behemoth'} {name} from {os.path.basename(src)}"
    model = model_from_hf(src, transformers=native, seed=11)
    engine = bh.boost(model, make_optimizer("adamw", model), plan)
    stats, reads = spied_load(engine, src)
    state = engine.full_state_dict()
    for k, v in ref_state.items():
        assert torch.equal(state[k], v), (what, k)
    check_own_experts(reads, NUM_EXPERTS[family], plan.ep, engine.mesh.coord("ep"), what)
    read = [None] * WORLD
    dist.all_gather_object(read, stats["bytes_read"])
    # each rank reads its experts and its share of the dense tensors, every byte about once
    # (norms replicated over tp read by each tp rank)
    assert max(read) <= 1.3 * total / WORLD, (what, read, total)
    assert total <= sum(read) <= 1.1 * total, (what, read, total)
    if plan.pp == 1 and plan.cp == 1:  # (a pipeline's and context parallelism's forward take a schedule)
        got = logits_of(engine.model, x)
        torch.testing.assert_close(got, want_logits, rtol=1e-5, atol=1e-5, msg=what)
    if rank == 0:
        print(what, "bytes read per rank", read, "of", total, flush=True)
    return engine


def _import_world(rank, world, root, family):
    src = os.path.join(root, "src")
    hf_ref = transformers.AutoModelForCausalLM.from_pretrained(src).eval()
    x = torch.randint(0, V, (2, S), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = hf_ref(x).logits
    total = file_bytes(src)
    natives = (True, False) if family == "mixtral" else (True,)
    for native in natives:
        ref_state = hf_ref.state_dict()
        if not native:  # behemoth's Llama with experts, read serially: transformers' logits
            serial = model_from_hf(src)
            load_hf(serial, src)
            torch.testing.assert_close(logits_of(serial, x), want, rtol=1e-5, atol=1e-5)
            ref_state = serial.state_dict()
        for name, plan in PLANS[family]:
            engine = check_import(rank, root, family, src, native, name, plan, ref_state, want, x, total)
            # round trip: the imported model exported again is the checkpoint it read, tensor for tensor
            out = os.path.join(root, "out", f"{native}-{name}")
            engine.save_hf(out, max_shard_size="40KB")
            if rank == 0:
                back, original = stored(out), stored(src)
                assert sorted(back) == sorted(original), (family, native, name)
                for k, v in original.items():
                    assert back[k].dtype == v.dtype and torch.equal(back[k], v), (family, native, name, k)
        if family == "mixtral":  # the experts fused, under transformers 5's module names
            fused = os.path.join(root, "fused")
            check_import(rank, root, family, fused, native, "ep2-tp2", PLANS[family][0][1], ref_state, want, x, total)
    if family == "mixtral":
        for native in natives:
            trained_round_trip(rank, root, src, native)
        parallelized_alone(src, hf_ref.state_dict(), want, x, total)
        bad_inputs(root)


def trained_round_trip(rank, root, src, native):
    """Import under ep x tp, one training step, export; import that under ep = 4: the trained
    state exactly, and its export the same tensors again."""
    model = model_from_hf(src, transformers=native, seed=11)
    engine = bh.boost(model, make_optimizer("adamw", model), bh.Plan(dp=2, ep=2, tp=2))
    load_hf(engine, src)
    before = engine.full_state_dict()
    engine.step(shard(global_batches(1, 8)[0], engine.dp_rank, engine.dp_size))
    trained = engine.full_state_dict()
    experts = [k for k in trained if k.endswith("gate_up_proj")]
    assert experts and all(not torch.equal(trained[k], before[k]) for k in experts)  # the step moved them
    first, second = (os.path.join(root, "trained", f"{native}-{i}") for i in (1, 2))
    engine.save_hf(first, max_shard_size="40KB")
    model = model_from_hf(first, transformers=native, seed=5)
    engine = bh.boost(model, make_optimizer("adamw", model), bh.Plan(dp=4, ep=4))
    load_hf(engine, first)
    state = engine.full_state_dict()
    assert sorted(state) == sorted(trained)
    for k, v in trained.items():
        assert torch.equal(state[k], v), ("trained round trip", native, k)
    engine.save_hf(second, max_shard_size="40KB")
    if rank == 0:
        back, original = stored(second), stored(first)
        assert sorted(back) == sorted(original)
        for k, v in original.items():
            assert torch.equal(back[k], v), ("trained round trip", native, k)


def parallelized_alone(src, ref_state, want_logits, x, total):
    """``bh.parallelize`` alone (no optimizer, no engine): the same slices, the same serial state."""
    from behemoth.parallelize import serial_state_dict

    plan = bh.Plan(dp=2, ep=2, tp=2)
    model = bh.parallelize(model_from_hf(src, transformers=True, seed=11), plan)
    stats, reads = spied_load(model, src)
    state = serial_state_dict(model)
    for k, v in ref_state.items():
        assert torch.equal(state[k], v), ("bh.parallelize", k)
    record = model.__dict__["_behemoth_parallelization"]
    check_own_experts(reads, NUM_EXPERTS["mixtral"], plan.ep, record.mesh.coord("ep"), "bh.parallelize")
    assert stats["bytes_read"] <= 1.3 * total / WORLD, stats
    torch.testing.assert_close(logits_of(model, x), want_logits, rtol=1e-5, atol=1e-5)


def bad_inputs(root):
    """Each bad checkpoint raises on every rank, before anything is read."""
    plan = bh.Plan(dp=2, ep=2, tp=2)
    for native in (True, False):
        src = os.path.join(root, "missing")
        model = model_from_hf(src, transformers=native)
        engine = bh.boost(model, make_optimizer("adamw", model), plan)
        expect_error(
            lambda: load_hf(engine, src),
            "model.layers.1.block_sparse_moe.experts.3.w1.weight: missing (expert 3 of 4; the model needs (24, 32))",
            "re-save it with transformers' save_pretrained",
        )
        src = os.path.join(root, "misshapen")
        expect_error(
            lambda: load_hf(engine, src),
            "model.layers.0.block_sparse_moe.experts.2.w2.weight: (32, 12) (expert 2 of 4; the model needs (32, 24))",
            "build the model with the checkpoint's shape",
        )
        three = os.path.join(root, "three")
        model = model_from_hf(three, transformers=native)
        expect_error(
            lambda: bh.boost(model, make_optimizer("adamw", model), plan),
            "Plan.ep=2 must divide the number of experts",
            "has 3",
            "Choose ep among the divisors of 3",
        )


@pytest.mark.parametrize("family", ["mixtral", "qwen3-moe", "olmoe"])
def test_moe_import_under_expert_plans_and_round_trip(tmp_path, family):
    prepare(str(tmp_path), family)
    bh.spawn(_import_world, WORLD, str(tmp_path), family, timeout=900)

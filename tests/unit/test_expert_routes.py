"""The chunked exchange of an MoE layer (behemoth.parallel.expert.overlap) and the routes kept for
activation checkpointing's recompute (behemoth.parallel.expert.replay) on one process: the chunks'
bookkeeping, a layer of 2 or 3 chunks equal to the serial layer, and a checkpointed model whose
backward (its recompute included) sorts nothing and reads nothing to the host."""

from __future__ import annotations

import pytest
import torch
from common import moe_llama_config
from host_reads import HostReads

from behemoth.comm import Axis, Ledger
from behemoth.models import Llama
from behemoth.models.moe import MoEFeedForward
from behemoth.parallel.expert import ExpertParallel, Routes
from behemoth.parallel.expert.dispatch import chunk_sizes
from behemoth.parallelize import apply_activation_checkpointing


class OneRankMesh:
    def __init__(self) -> None:
        self.ledger = Ledger()

    def axis(self, name: str) -> Axis:
        return Axis(name, 1, 0, (0,), None, self.ledger)


def test_chunk_sizes_split_tokens_evenly_longer_runs_first():
    assert chunk_sizes(10, 1) == [10]
    assert chunk_sizes(10, 4) == [3, 3, 2, 2]
    assert chunk_sizes(2, 3) == [1, 1, 0]
    assert chunk_sizes(0, 2) == [0, 0]


def test_routes_sort_each_chunk_by_expert_dropped_last():
    """Each chunk's assignments (flat indices within the chunk) in stable expert order, the
    capacity's drops (expert E) last; the chunk's counts as a plain sort of the chunk gives."""
    E = 4
    experts_TK = torch.tensor([[2, 0], [1, 4], [0, 3], [3, 3], [4, 1]])  # 4: dropped
    routes = Routes.build(experts_TK, E, OneRankMesh().axis("ep"), chunks=2)
    assert routes.token_sizes == [3, 2]
    for c, (lo, hi) in enumerate(((0, 3), (3, 5))):
        flat = experts_TK[lo:hi].reshape(-1)
        assert routes.orders[c].tolist() == torch.argsort(flat, stable=True).tolist()
        routed = routes.routed(c, torch.float32)
        kept = int((flat < E).sum())
        assert routed.order_A.tolist() == torch.argsort(flat, stable=True)[:kept].tolist()
        assert routed.token_A.tolist() == (routed.order_A // 2).tolist()
        assert routed.counts == torch.bincount(flat[flat < E], minlength=E).tolist()


@pytest.mark.parametrize("chunks", [2, 3])
def test_chunked_layer_on_one_rank_equals_serial(chunks):
    torch.manual_seed(0)
    serial = MoEFeedForward(16, 12, 4, 2, aux_loss_coef=0.1, z_loss_coef=0.01, capacity_factor=1.0)
    with torch.no_grad():
        for p in serial.parameters():
            p.normal_(0, 0.5)
    parallel = MoEFeedForward(16, 12, 4, 2, aux_loss_coef=0.1, z_loss_coef=0.01, capacity_factor=1.0)
    parallel.load_state_dict(serial.state_dict())
    ExpertParallel(chunks=chunks).apply(parallel, OneRankMesh())
    x_s = torch.randn(2, 5, 16, requires_grad=True)
    x_p = x_s.detach().clone().requires_grad_()
    y_s, y_p = serial(x_s), parallel(x_p)
    torch.testing.assert_close(y_p, y_s, rtol=1e-6, atol=1e-6)
    (y_s.square().sum() + serial.aux_loss).backward()
    (y_p.square().sum() + parallel.aux_loss).backward()
    torch.testing.assert_close(x_p.grad, x_s.grad, rtol=1e-5, atol=1e-6)
    # the chunks' weight gradients are summed chunk by chunk: float32 rounding of the largest entries
    for (name, a), b in zip(serial.named_parameters(), parallel.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-6 * float(a.grad.abs().max()), msg=name)


def test_chunks_must_be_a_positive_integer():
    with pytest.raises(ValueError, match="must be an integer >= 1"):
        ExpertParallel(chunks=0)


def _moe_llama(num_layers: int) -> Llama:
    cfg = moe_llama_config(vocab_size=64, seq_len=8, num_layers=num_layers, router_aux_loss_coef=0.05, seed=0)
    return Llama(cfg)


@pytest.mark.parametrize("chunks", [1, 2])
def test_checkpointed_recompute_sorts_and_reads_nothing(chunks):
    """Under activation checkpointing, a model's forward reads the split sizes to the host once per
    MoE layer and sorts once per layer; its backward -- which recomputes every block -- reads
    nothing and sorts nothing (the recompute replays the forward's routes), and the gradients
    equal those of the same model without checkpointing."""
    layers = 3
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    grads = []
    for ckpt in (False, True):
        model = _moe_llama(layers)
        mesh = OneRankMesh()
        for layer in model.layers:
            ExpertParallel(chunks=chunks).apply(layer.mlp, mesh)
        if ckpt:
            assert apply_activation_checkpointing(model) == layers
        with HostReads() as forward:
            loss = model(ids).square().mean() + model.aux_loss()
        with HostReads() as backward:
            loss.backward()
        what = f"chunks={chunks} ckpt={ckpt}"
        assert dict(forward.counts) == {"tolist": layers}, (what, forward.counts)
        assert forward.ops["sort"] == layers, (what, forward.ops)
        assert backward.total() == 0, (what, backward.counts)
        assert "sort" not in backward.ops, (what, backward.ops)
        if ckpt:  # the recompute did run: the experts' GEMMs again
            assert backward.ops["mm"] > forward.ops["mm"], (what, backward.ops["mm"], forward.ops["mm"])
        grads.append([p.grad for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(b, a, rtol=0, atol=0)

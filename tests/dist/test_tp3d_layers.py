"""3D tensor-parallel layers (Colossal-AI 3D + Tensor3D over-decomposition) against the serial layers.

One spawned world of 8 ranks (q = 2) runs every scenario: a layer built with ``from_serial``
gets the split input, and its output, input gradient and every parameter gradient --
gathered through the ShardSpecs, which also checks that replicated shards are identical --
must match the serial layer on the full input (float64, tight tolerance). Also: an MLP and
an attention block chained with no redistribution (the ledger holds nothing but the
Linears' and the norm's traffic), embedding + norm + head + vocab-parallel cross-entropy,
tied and untied, overlap k = 2 against k = 1, the ledger against ``linear3d_bytes``, saved
activations within 1.25x of serial / p. A second world checks the forward without autograd:
weight-stationary for a few tokens, the training form for many, both with the training
forward's output and the ledger's bytes those of the collectives each form issues. A
no-process test covers specs, the overlap schedule, the traffic formulas and the errors.
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F
from common import saved_activation_bytes
from test_tp2d_layers import LM, MLPBlock, check_layer, check_params, close, gather_full, labels_BS, rand, serial_lm
from torch import nn

import behemoth as bh
from behemoth import comm
from behemoth.mesh import ParallelMesh
from behemoth.parallel.tensor import embed3d, norms3d, tp3d
from behemoth.parallel.tensor.base import no_grad_forward
from behemoth.parallel.tensor.layout import DimShard, ShardSpec, get_spec, shard_tensor
from behemoth.planner import tp3d_traffic
from behemoth.planner.tp3d_traffic import linear3d_bytes

B, S, H, V = 4, 4, 8, 16  # q = 2: B/q^2 = 1 row of 4 tokens per rank (overlap 2 splits it)
F64 = torch.float64
TP_AXES = ("tp_depth", "tp_row", "tp_col")
L = types.SimpleNamespace(spec=tp3d.activation_spec_3d)


def spec(shape, mesh, swapped=False, hidden=True):
    return tp3d.activation_spec_3d(shape, mesh, swapped=swapped, hidden=hidden)


def fused_spec(shape, parts, mesh, swapped):
    """Layout of a fused ``[.., parts*h]`` output: the view ``[.., parts, h]`` blocked on h."""
    batch, hidden = spec(shape, mesh, swapped).dims
    view = tuple(shape[:-1]) + (parts, shape[-1] // parts)
    return ShardSpec(
        tuple(shape),
        (batch, DimShard(len(shape), hidden.parts, hidden.index, hidden.axes)),
        (),
        view,
        fused_dim=len(shape) - 1,
    )


def tp_bytes(mesh, wire=False):
    key = "wire_bytes" if wire else "bytes"
    return sum(mesh.ledger.stats().get(a, {}).get(key, 0) for a in TP_AXES)


class AttnBlock(nn.Module):
    """x + proj(causal attention(qkv(norm(x)))) with a fused qkv; ``heads`` = heads held here."""

    def __init__(self, norm, qkv, proj, heads):
        super().__init__()
        self.norm, self.qkv, self.proj, self.heads = norm, qkv, proj, heads

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (t.reshape(b, s, self.heads, -1).transpose(1, 2) for t in self.qkv(self.norm(x)).chunk(3, -1))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.proj(o.transpose(1, 2).reshape(b, s, -1))


def shard_mlp(mesh, serial, overlap=1):
    return MLPBlock(
        H,
        norms3d.LayerNorm3D.from_serial(serial.norm, mesh),
        tp3d.Linear3D.from_serial(serial.fc1, mesh, overlap=overlap),
        tp3d.Linear3D.from_serial(serial.fc2, mesh, swapped=True, overlap=overlap),
    )


# --------------------------------------------------------------------------- scenarios
def linear_scenarios(mesh):
    torch.manual_seed(0)  # the serial layers must be identical on every rank
    x = rand(B, S, H)
    for swapped in (False, True):
        for bias in (True, False):
            lin = nn.Linear(H, 12, bias=bias).double()
            check_layer(
                mesh,
                L,
                lin,
                tp3d.Linear3D.from_serial(lin, mesh, swapped=swapped),
                x,
                f"linear swapped={swapped} bias={bias}",
                in_spec=spec(x.shape, mesh, swapped),
                out_spec=spec((B, S, 12), mesh, not swapped),
            )
    # Fused QKV: the local output is [q_i | k_i | v_i] of heads block i (tp_row).
    qkv = nn.Linear(H, 3 * H).double()
    layer = tp3d.Linear3D.from_serial(qkv, mesh, fused=3)
    assert get_spec(layer.weight).view_shape == (3, H, H) and layer.weight.shape == (3 * H // 4, H // 2)
    yl = check_layer(mesh, L, qkv, layer, x, "fused qkv", out_spec=fused_spec((B, S, 3 * H), 3, mesh, True))
    k_rows = shard_tensor(qkv(x)[..., H : 2 * H].detach(), spec((B, S, H), mesh, True))
    close(yl.split(H // 2, dim=-1)[1], k_rows, "fused qkv: the local k rows")
    from transformers.pytorch_utils import Conv1D

    conv = Conv1D(3 * H, H).double()
    nn.init.normal_(conv.bias)
    check_layer(
        mesh,
        L,
        conv,
        tp3d.Linear3D.from_serial(conv, mesh, fused=3),
        x,
        "fused Conv1D",
        out_spec=fused_spec((B, S, 3 * H), 3, mesh, True),
    )
    conv = Conv1D(H, 12).double()  # Conv1D(nf=H, nx=12): [12, H] weight, swapped orientation
    check_layer(
        mesh,
        L,
        conv,
        tp3d.Linear3D.from_serial(conv, mesh, swapped=True),
        rand(B, S, 12, seed=1),
        "Conv1D swapped",
        in_spec=spec((B, S, 12), mesh, True),
        out_spec=spec((B, S, H), mesh),
    )


def norm_scenarios(mesh):
    torch.manual_seed(0)
    x = rand(B, S, H)
    for swapped in (False, True):
        ln = nn.LayerNorm(H).double()
        nn.init.normal_(ln.weight), nn.init.normal_(ln.bias)
        sp = spec(x.shape, mesh, swapped)
        check_layer(
            mesh,
            L,
            ln,
            norms3d.LayerNorm3D.from_serial(ln, mesh, swapped=swapped),
            x * 3 + 1,
            f"layernorm swapped={swapped}",
            in_spec=sp,
            out_spec=sp,
        )
        rms = nn.RMSNorm(H, eps=1e-6).double()
        nn.init.normal_(rms.weight)
        check_layer(
            mesh,
            L,
            rms,
            norms3d.RMSNorm3D.from_serial(rms, mesh, swapped=swapped),
            x,
            f"rmsnorm swapped={swapped}",
            in_spec=sp,
            out_spec=sp,
        )
    ln = nn.LayerNorm(H, bias=False).double()
    check_layer(mesh, L, ln, norms3d.LayerNorm3D.from_serial(ln, mesh), x, "layernorm no bias")
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from behemoth.models.llama import RMSNorm  # both compute in float32: compare in float32

    for rms in (RMSNorm(H), LlamaRMSNorm(H, eps=1e-6)):
        nn.init.normal_(rms.weight)
        check_layer(
            mesh, L, rms, norms3d.RMSNorm3D.from_serial(rms, mesh), x.float(), type(rms).__name__, rtol=1e-5, atol=1e-6
        )


def block_scenarios(mesh):
    """Chained layers: canonical -> swapped -> canonical with no redistribution in between."""
    torch.manual_seed(0)
    q, T = mesh.axis("tp_col").size, B * S
    x = rand(B, S, H)
    block = MLPBlock(H).double()
    par = shard_mlp(mesh, block)
    mesh.ledger.reset()
    check_layer(mesh, L, block, par, x, "mlp block")
    # The ledger's tp traffic is exactly the two Linears' formula plus the norm's own.
    xl = tp3d.split_activation_3d(x, mesh).requires_grad_()
    mesh.ledger.reset()
    par(xl).sum().backward()
    block_bytes, ops = tp_bytes(mesh), {o for a in TP_AXES for o in mesh.ledger.stats().get(a, {}).get("ops", {})}
    mesh.ledger.reset()
    par.norm(xl).sum().backward()
    linears = linear3d_bytes(T, H, 4 * H, q, bias=True, element_size=8) + linear3d_bytes(
        T, 4 * H, H, q, bias=True, element_size=8
    )
    assert block_bytes == tp_bytes(mesh) + linears, (block_bytes, tp_bytes(mesh), linears)
    assert ops <= {"all_gather", "reduce_scatter", "all_reduce"}, ops
    # Saved activations: only shards (the Linears re-gather in backward).
    serial_saved = saved_activation_bytes(lambda: block(x.clone().requires_grad_()), block)
    par_saved = saved_activation_bytes(lambda: par(tp3d.split_activation_3d(x, mesh).requires_grad_()), par)
    assert par_saved <= 1.25 * serial_saved / mesh.axis("tp").size, (par_saved, serial_saved)

    # Attention: fused QKV (heads block over tp_row) -> local attention -> out projection.
    torch.manual_seed(1)
    attn = AttnBlock(nn.LayerNorm(H), nn.Linear(H, 3 * H), nn.Linear(H, H), heads=2).double()
    par = AttnBlock(
        norms3d.LayerNorm3D.from_serial(attn.norm, mesh),
        tp3d.Linear3D.from_serial(attn.qkv, mesh, fused=3),
        tp3d.Linear3D.from_serial(attn.proj, mesh, swapped=True),
        heads=2 // q,
    )
    check_layer(mesh, L, attn, par, x, "attention block")


def overlap_scenarios(mesh):
    """Tensor3D over-decomposition: k = 2 computes what k = 1 does, with the same bytes."""
    torch.manual_seed(2)
    block = MLPBlock(H).double()
    x = tp3d.split_activation_3d(rand(B, S, H, seed=4), mesh)
    G = tp3d.split_activation_3d(rand(B, S, H, seed=5), mesh)
    runs = []
    for k in (1, 2):
        par = shard_mlp(mesh, block, overlap=k)
        xl = x.clone().requires_grad_()
        mesh.ledger.reset()
        y = par(xl)
        (y * G).sum().backward()
        runs.append(
            (
                y.detach(),
                xl.grad,
                [p.grad for p in par.parameters()],
                tp_bytes(mesh),
                sum(mesh.ledger.stats()[a]["calls"] for a in ("tp_row", "tp_col")),
            )
        )  # per piece
    (y1, dx1, g1, b1, c1), (y2, dx2, g2, b2, c2) = runs
    # Rows are computed independently (bit-equal with the CPU BLAS here); dW sums the pieces'
    # partial products, so it is equal up to rounding.
    for a, b, what in [(y1, y2, "output"), (dx1, dx2, "input grad")] + [(a, b, "param grad") for a, b in zip(g1, g2)]:
        close(b, a, f"overlap=2 vs 1: {what}", rtol=1e-12, atol=1e-12)
    assert b1 == b2 and c2 > c1, (b1, b2, c1, c2)


def lm_scenarios(mesh):
    """Token + position embedding, norm, head and vocab-parallel cross-entropy, tied and untied."""
    ids = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(11))
    ids[0, 0] = 5  # padding row: no gradient
    labels = labels_BS(shape=(B, S))
    for tied in (False, True):
        serial = serial_lm(tied, seq=S)
        wte = embed3d.Embedding3D.from_serial(serial.wte, mesh)
        head = embed3d.VocabParallelHead3D.from_serial(serial.head, mesh, tied=wte if tied else None)
        lm = LM(
            wte,
            embed3d.PositionEmbedding3D.from_serial(serial.wpe, mesh),
            norms3d.LayerNorm3D.from_serial(serial.ln, mesh),
            head,
        )
        loss = F.cross_entropy(serial(ids).flatten(0, 1), labels.flatten(), reduction="sum")
        loss.backward()
        emb = lm.wte(ids)
        close(gather_full(emb, spec((B, S, H), mesh), mesh), serial.wte(ids).detach(), "embedding output")
        logits = lm(ids)
        assert logits.shape == (B // 4, S, V // 2)
        if tied:  # the engine's protocol: the tp group's total, the same on every rank
            total = head.vocab_parallel_loss_sum(logits, labels)
            total.backward()
        else:  # this rank's block; the total is the sum over the two batch axes
            local = embed3d.vocab_parallel_cross_entropy_3d(
                logits, tp3d.split_batch_3d(labels, mesh, swapped=True), mesh
            )
            local.backward()
            s = comm.all_reduce_scalars([local.item()], mesh.axis("tp_col"))
            total = torch.tensor(comm.all_reduce_scalars(s, mesh.axis("tp_depth"))[0], dtype=F64)
        close(total.detach(), loss.detach(), f"lm tied={tied} loss")
        my_labels = tp3d.split_batch_3d(labels, mesh, swapped=True)
        per_token = embed3d.vocab_parallel_cross_entropy_3d(logits.detach(), my_labels, mesh, reduction="none")
        want = F.cross_entropy(serial(ids).flatten(0, 1), labels.flatten(), reduction="none").view(B, S)
        close(gather_full(per_token, spec((B, S), mesh, True, hidden=False), mesh), want.detach(), "per-token loss")
        check_params(lm, serial, mesh, f"lm tied={tied}")
        if tied:
            assert head.weight is wte.weight
            head.gather_output = True  # for a user's loss_fn: full logits on every rank
            close(lm(ids), serial(ids).detach(), "gathered logits")
            close(head.vocab_parallel_loss_sum(lm(ids), labels).detach(), loss.detach(), "gathered loss")


def ledger_scenarios(mesh):
    """One Linear forward + backward: the ledger's payload and wire bytes equal linear3d_bytes."""
    torch.manual_seed(0)
    q = mesh.axis("tp_col").size
    for swapped, bias, in_grad in ((False, False, True), (True, True, True), (False, True, False)):
        lin = nn.Linear(H, 2 * H, bias=bias).double()
        layer = tp3d.Linear3D.from_serial(lin, mesh, swapped=swapped)
        xl = tp3d.split_activation_3d(rand(B, S, H), mesh, swapped=swapped).requires_grad_(in_grad)
        mesh.ledger.reset()
        layer(xl).sum().backward()
        for wire in (False, True):
            want = linear3d_bytes(B * S, H, 2 * H, q, bias=bias, input_grad=in_grad, element_size=8, wire=wire)
            got = tp_bytes(mesh, wire)
            # payload exactly; wire within the one byte the ledger's int() of its float sum can drop
            assert got == want if not wire else abs(got - want) <= 1, (swapped, bias, in_grad, wire, got, want)


def no_grad_scenarios(mesh):
    """Without autograd (``no_grad_forward``) a 3D Linear and the head run weight-stationary for
    a few tokens and the training form for many: both give the training forward's output in its
    layout (float64: equal up to the order of the in-block sums) for both layouts, with and
    without bias, fused (qkv, Conv1D, gate_up) and the head, gathered logits too. Each rank's
    wire bytes are those of the collectives each form issues: the training form receives X over
    I, W over tp_depth and the reduce-scatter over O, ``(q-1) (m K/q + K/q N/q^2 + q m N/q^2)``
    elements; the stationary one X of the whole (I, W) plane, the reduce-scatter over O and the
    all-to-all over tp_depth, ``(q^2-1) m (K/q + N/q^2)``, no weight element."""
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(2)
    q = mesh.axis("tp_col").size
    conv = Conv1D(3 * H, H).double()
    nn.init.normal_(conv.bias)
    serial_head = nn.Linear(H, V, bias=False).double()
    layers = {}  # name: (layer, out_features, reads the swapped layout)
    for swapped in (False, True):
        for bias in (True, False):
            lin = nn.Linear(H, 12, bias=bias).double()
            layers[f"linear swapped={swapped} bias={bias}"] = (
                tp3d.Linear3D.from_serial(lin, mesh, swapped=swapped),
                12,
                swapped,
            )
    layers["fused qkv"] = (tp3d.Linear3D.from_serial(nn.Linear(H, 3 * H).double(), mesh, fused=3), 3 * H, False)
    layers["fused Conv1D"] = (tp3d.Linear3D.from_serial(conv, mesh, fused=3), 3 * H, False)
    gate_up = nn.Linear(H, 4 * H, bias=False).double()
    layers["fused gate_up swapped"] = (tp3d.Linear3D.from_serial(gate_up, mesh, swapped=True, fused=2), 4 * H, True)
    layers["head"] = (embed3d.VocabParallelHead3D.from_serial(serial_head, mesh), V, False)
    for seq, stationary in ((1, True), (S, False)):
        for what, (layer, out, swapped) in layers.items():
            what = f"{what}, {seq} position(s)"
            x = tp3d.split_activation_3d(rand(B, seq, H, seed=4), mesh, swapped=swapped)
            rows, n_in, n_out = x.shape[0] * seq, H // q, out // q**2
            stationary_wire = (q * q - 1) * rows * (n_in + n_out) * 8
            training_wire = (q - 1) * (rows * n_in + n_in * n_out + q * rows * n_out) * 8
            assert (stationary_wire < training_wire) == stationary, what  # a decode step's few rows: fewer
            want_wire = stationary_wire if stationary else training_wire
            want = layer(x).detach()
            mesh.ledger.reset()
            with torch.no_grad(), no_grad_forward(layer):
                got = layer(x)
            assert tp_bytes(mesh, wire=True) == want_wire, (what, tp_bytes(mesh, wire=True), want_wire)
            close(got, want, f"{what} without autograd")
            assert tp3d.stationary_is_cheaper(rows, n_in, n_out, q) == stationary, what
            assert tp_bytes(mesh) == tp3d_traffic.linear3d_no_grad_bytes(B * seq, H, out, q, element_size=8), what
            assert "forward" not in layer.__dict__  # the training forward is back
    head = layers["head"][0]  # gathered logits, as generation asks for them
    head.gather_output = True
    ids_x = rand(B, 1, H, seed=4)
    with torch.no_grad(), no_grad_forward(head):
        close(head(tp3d.split_activation_3d(ids_x, mesh)), serial_head(ids_x).detach(), "gathered logits, no autograd")
    head.gather_output = False
    layer = layers["linear swapped=False bias=True"][0]  # weight_stationary=False: the training form
    layer.weight_stationary = False
    x = tp3d.split_activation_3d(rand(B, 1, H, seed=4), mesh)
    want = layer(x).detach()
    mesh.ledger.reset()
    with torch.no_grad(), no_grad_forward(layer):
        close(layer(x), want, "linear without autograd, training form")
    training = tp3d_traffic.linear3d_no_grad_bytes(B, H, 12, q, stationary=False, element_size=8)
    assert tp_bytes(mesh) == training > tp3d_traffic.linear3d_no_grad_bytes(B, H, 12, q, element_size=8)


def helper_scenarios(mesh):
    x = rand(B, S, H, seed=9)
    for swapped in (False, True):
        xl = tp3d.split_activation_3d(x, mesh, swapped=swapped)
        assert xl.shape == (B // 4, S, H // 2)
        assert torch.equal(tp3d.gather_activation_3d(xl, mesh, swapped=swapped), x)
        xb = tp3d.split_batch_3d(x, mesh, swapped=swapped)
        assert torch.equal(tp3d.gather_batch_3d(xb, mesh, swapped=swapped), x)


def autocast_smoke(mesh):
    """bf16 autocast: the shards travel in bf16, gradients come back in the parameters' fp32."""
    torch.manual_seed(0)
    lin = nn.Linear(H, H)
    layer = tp3d.Linear3D.from_serial(lin, mesh, overlap=2)
    x = rand(B, S, H, dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = lin(x)
        y = layer(tp3d.split_activation_3d(x, mesh))
        norm = norms3d.LayerNorm3D(H, mesh, swapped=True)(y)
    assert y.dtype == torch.bfloat16 and norm.dtype == torch.float32
    (y.float().sum() + norm.sum()).backward()
    assert layer.weight.grad.dtype == torch.float32
    close(gather_full(y.float(), spec((B, S, H), mesh, True), mesh), want.float(), "autocast", rtol=2e-2, atol=2e-2)


def _world_3d(rank, world):
    mesh = ParallelMesh(bh.Plan(tp=8, tp_mode="3d"), rank, world)
    helper_scenarios(mesh)
    linear_scenarios(mesh)
    norm_scenarios(mesh)
    block_scenarios(mesh)
    overlap_scenarios(mesh)
    lm_scenarios(mesh)
    ledger_scenarios(mesh)
    autocast_smoke(mesh)


# --------------------------------------------------------------------------- tests
def test_3d_layers_match_serial():
    bh.spawn(_world_3d, 8, timeout=240)


def _world_no_grad(rank, world):
    no_grad_scenarios(ParallelMesh(bh.Plan(tp=8, tp_mode="3d"), rank, world))


def test_3d_no_grad_forward_is_weight_stationary_for_few_tokens():
    bh.spawn(_world_no_grad, 8, timeout=240)


def test_pure_layout_schedule_and_errors(monkeypatch):
    """No processes: a mesh without groups is enough for shapes, specs and every ValueError
    (a collective would fail on the missing group, so each error comes before any)."""
    mesh = ParallelMesh(bh.Plan(tp=8, tp_mode="3d"), rank=6, world_size=8, create_groups=False)
    assert (mesh.coord("tp_depth"), mesh.coord("tp_row"), mesh.coord("tp_col")) == (1, 1, 0)
    full = torch.arange(12 * 8.0).view(12, 8)
    a, b = tp3d.Linear3D(8, 12, mesh), tp3d.Linear3D(8, 12, mesh, swapped=True)
    # canonical: out block r*q + d = 3 of 4 over (tp_row, tp_depth), in block c = 0 over tp_col
    assert [(d.dim, d.parts, d.index, d.axes) for d in get_spec(a.weight).dims] == [
        (0, 4, 3, ("tp_row", "tp_depth")),
        (1, 2, 0, ("tp_col",)),
    ]
    assert torch.equal(shard_tensor(full, get_spec(a.weight)), full[9:12, 0:4])
    # swapped: out block c*q + d = 1 over (tp_col, tp_depth), in block r = 1 over tp_row
    assert torch.equal(shard_tensor(full, get_spec(b.weight)), full[3:6, 4:8])
    assert get_spec(a.bias).dims[0] == DimShard(0, 2, 1, ("tp_row",))
    assert set(get_spec(a.bias).replicated_on) == {"tp_depth", "tp_col"}
    assert spec((8, 3, 8), mesh).dims == (DimShard(0, 4, 3, ("tp_depth", "tp_row")), DimShard(2, 2, 0, ("tp_col",)))
    assert spec((8, 3, 8), mesh, True).dims == (
        DimShard(0, 4, 2, ("tp_depth", "tp_col")),
        DimShard(2, 2, 1, ("tp_row",)),
    )
    assert spec((8, 3), mesh, hidden=False).replicated_on == ("tp_col",)
    qkv = tp3d.Linear3D(8, 24, mesh, fused=3)
    assert qkv.weight.shape == (6, 4) and get_spec(qkv.weight).local_view_shape() == (3, 2, 4)
    fq = torch.arange(24 * 8.0).view(24, 8)
    assert torch.equal(shard_tensor(fq, get_spec(qkv.weight)), fq.view(3, 8, 8)[:, 6:8, 0:4].reshape(6, 4))
    conv = tp3d.Linear3D(8, 24, mesh, fused=3, weight_layout="in_out")
    assert torch.equal(shard_tensor(fq.t(), get_spec(conv.weight)), fq.view(3, 8, 8)[:, 6:8, 0:4].reshape(6, 4).t())
    emb, head = embed3d.Embedding3D(16, 8, mesh), embed3d.VocabParallelHead3D(8, 16, mesh)
    assert get_spec(emb.weight) == get_spec(head.weight) and emb.vocab_start == 12
    assert get_spec(norms3d.LayerNorm3D(8, mesh, swapped=True).weight).dims == (DimShard(0, 2, 1, ("tp_row",)),)
    # traffic: (3 T K + 3 K N + 2 T N) / q^2 elements, bias 2 N / q
    assert linear3d_bytes(64, 16, 32, 2) == 4 * (3 * 64 * 16 + 3 * 16 * 32 + 2 * 64 * 32) // 4
    want = 2 * ((3 * 64 * 16 + 3 * 16 * 32 + 2 * 64 * 32) // 4 + 32)
    assert linear3d_bytes(64, 16, 32, 2, bias=True, element_size=2) == want
    assert linear3d_bytes(64, 16, 32, 1) == 0
    # without autograd, per rank m = T/q^2 rows, K/q in, N/q^2 out: stationary q (q+1) m (K/q + N/q^2)
    # elements of payload, the training form (T K + K N + T N) / q^2; wire (q-1)/q of either
    nb = tp3d_traffic.linear3d_no_grad_bytes
    assert nb(4, 16, 32, 2, stationary=True) == 2 * (2 * 3 * 1 * (8 + 8))
    assert nb(4, 16, 32, 2, stationary=False) == 2 * (4 * 16 + 16 * 32 + 4 * 32) // 4
    assert nb(4, 16, 32, 2) == nb(4, 16, 32, 2, stationary=True)  # 1 * (2*8 + 8) < 8 * 8
    assert nb(64, 16, 32, 2) == nb(64, 16, 32, 2, stationary=False)  # 16 * (2*8 + 8) > 8 * 8
    assert nb(4, 16, 32, 2, wire=True) == nb(4, 16, 32, 2) / 2 and nb(4, 16, 32, 1) == 0
    assert tp3d.stationary_is_cheaper(1, 8, 8, 2) and not tp3d.stationary_is_cheaper(16, 8, 8, 2)

    msg = "tensor parallelism \\(3d\\): "
    with pytest.raises(ValueError, match=msg + "Linear3D in_features = 7 is not divisible by 2"):
        tp3d.Linear3D(7, 8, mesh)
    with pytest.raises(ValueError, match=msg + "Linear3D out_features = 6 is not divisible by 4"):
        tp3d.Linear3D(8, 6, mesh)
    with pytest.raises(ValueError, match=r"per fused part\) = 6 is not divisible by 4"):
        tp3d.Linear3D(8, 18, mesh, fused=3)
    with pytest.raises(ValueError, match="expected the hidden block in_features/q = 8/2 = 4"):
        tp3d.Linear3D(8, 8, mesh)(torch.zeros(1, 3, 8))
    with pytest.raises(ValueError, match="tokens per rank .* = 3 is not divisible by overlap = 2"):
        tp3d.Linear3D(8, 8, mesh, overlap=2)(torch.zeros(1, 3, 4))
    with pytest.raises(ValueError, match="overlap=0 must be an integer >= 1"):
        tp3d.Linear3D(8, 8, mesh, overlap=0)
    with pytest.raises(ValueError, match="vocabulary size = 18 is not divisible by 4"):
        embed3d.Embedding3D(18, 8, mesh)
    with pytest.raises(ValueError, match="batch size .* = 6 is not divisible by 4"):
        embed3d.Embedding3D(16, 8, mesh)(torch.zeros(6, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="batch size = 3 is not divisible by 4"):
        tp3d.split_batch_3d(torch.zeros(3, 2), mesh)
    with pytest.raises(ValueError, match="RMSNorm3D hidden size = 5 is not divisible by 2"):
        norms3d.RMSNorm3D(5, mesh)
    with pytest.raises(ValueError, match="expected hidden/q = 8/2 = 4"):
        norms3d.LayerNorm3D(8, mesh)(torch.zeros(1, 3, 8))
    with pytest.raises(ValueError, match="labels .* must be this rank's batch block"):
        head.vocab_parallel_loss_sum(torch.zeros(1, 3, 8), torch.zeros(4, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="does not match"):
        embed3d.VocabParallelHead3D.from_serial(nn.Linear(8, 16, bias=False), mesh, tied=emb, swapped=True)
    with pytest.raises(ValueError, match="tp_mode='3d'"):
        tp3d.Linear3D(8, 8, ParallelMesh(bh.Plan(tp=4, tp_mode="2d"), rank=0, world_size=4, create_groups=False))

    # Over-decomposition schedule (trivial axes, collectives logged): piece 1's gather is issued
    # before piece 0's GEMM, and piece 0's reduce-scatter is in flight while piece 1 computes.
    mesh1 = ParallelMesh(bh.Plan(tp=1, tp_mode="3d"), rank=0, world_size=1, create_groups=False)
    log, issued = [], []

    def logged(fn, op):
        def call(t, axis, dim=0):
            h, n = fn(t, axis, dim), len(issued)
            issued.append(n)
            log.append(("issue", op, n))
            return types.SimpleNamespace(wait=lambda: (log.append(("wait", op, n)), h.wait())[1])

        return call

    monkeypatch.setattr(comm, "all_gather_async", logged(comm.all_gather_async, "ag"))
    monkeypatch.setattr(comm, "reduce_scatter_async", logged(comm.reduce_scatter_async, "rs"))
    lin = nn.Linear(4, 4)
    layer = tp3d.Linear3D.from_serial(lin, mesh1, overlap=2)
    x = torch.randn(2, 2, 4, requires_grad=True)
    y = layer(x)
    assert log == [
        ("issue", "ag", 0),
        ("issue", "ag", 1),
        ("wait", "ag", 0),
        ("wait", "ag", 1),  # W, x0
        ("issue", "ag", 2),
        ("issue", "rs", 3),
        ("wait", "ag", 2),
        ("issue", "rs", 4),  # x1, y0, y1
        ("wait", "rs", 3),
        ("wait", "rs", 4),
    ]
    torch.testing.assert_close(y, lin(x).detach(), rtol=1e-6, atol=1e-6)
    # Backward: W once (for dX); pieces' dY and x gathers one piece ahead; dX pieces and dW in flight.
    log.clear(), issued.clear()
    y.sum().backward()
    assert log == [
        ("issue", "ag", 0),
        ("issue", "ag", 1),
        ("issue", "ag", 2),
        ("wait", "ag", 0),  # W, dy0, x0
        ("wait", "ag", 1),
        ("wait", "ag", 2),
        ("issue", "ag", 3),
        ("issue", "ag", 4),  # dy1, x1
        ("issue", "rs", 5),
        ("wait", "ag", 3),
        ("wait", "ag", 4),
        ("issue", "rs", 6),  # dx0, dx1
        ("issue", "rs", 7),
        ("wait", "rs", 5),
        ("wait", "rs", 6),
        ("wait", "rs", 7),
    ]  # dW
    torch.testing.assert_close(layer.weight.grad, torch.ones(4, 1) * x.detach().sum((0, 1)), rtol=1e-6, atol=1e-6)

"""2D (Optimus) and 2.5D (Tesseract) tensor-parallel layers against the serial layers.

Each spawned world runs every scenario: a layer built with ``from_serial`` gets the split
input, and its output, its input gradient and every parameter gradient -- gathered through
the ShardSpecs, which also checks that replicated shards are identical -- must match the
serial layer run on the full input (float64, tight tolerance). Also: layers chained with no
redistribution, the ledger's bytes for one Linear against ``summa_linear_bytes``, errors for
non-divisible dims, and 2.5D at depth 1 bit-identical to 2D.
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F
from common import saved_activation_bytes
from torch import nn

import behemoth as bh
from behemoth import comm
from behemoth.mesh import ParallelMesh, ravel, unravel
from behemoth.parallel.tensor import embed2d, tp2d, tp2p5d
from behemoth.parallel.tensor.base import no_grad_forward
from behemoth.parallel.tensor.grid import stationary_is_cheaper
from behemoth.parallel.tensor.layout import DimShard, ShardSpec, get_spec, shard_tensor
from behemoth.planner.tp2d_traffic import summa_linear_bytes

B, S, H, V = 4, 3, 8, 16
F64 = torch.float64
TP_AXES = ("tp_depth", "tp_row", "tp_col")

LAYERS_2D = types.SimpleNamespace(
    Linear=tp2d.Linear2D,
    LayerNorm=tp2d.LayerNorm2D,
    RMSNorm=tp2d.RMSNorm2D,
    Embedding=embed2d.Embedding2D,
    PositionEmbedding=embed2d.PositionEmbedding2D,
    Head=embed2d.VocabParallelHead2D,
    cross_entropy=embed2d.vocab_parallel_cross_entropy_2d,
    spec=tp2d.activation_spec_2d,
    split_batch=tp2d.split_batch_2d,
    split=tp2d.split_activation_2d,
    gather=tp2d.gather_activation_2d,
)
LAYERS_25D = types.SimpleNamespace(
    Linear=tp2p5d.Linear25D,
    LayerNorm=tp2p5d.LayerNorm25D,
    RMSNorm=tp2p5d.RMSNorm25D,
    Embedding=tp2p5d.Embedding25D,
    PositionEmbedding=tp2p5d.PositionEmbedding25D,
    Head=tp2p5d.VocabParallelHead25D,
    cross_entropy=tp2p5d.vocab_parallel_cross_entropy_25d,
    spec=tp2p5d.activation_spec_25d,
    split_batch=tp2p5d.split_batch_25d,
    split=tp2p5d.split_activation_25d,
    gather=tp2p5d.gather_activation_25d,
)


# --------------------------------------------------------------------------- helpers
def gather_full(t: torch.Tensor, spec: ShardSpec, mesh) -> torch.Tensor:
    """Rebuild the serial tensor from every tp rank's shard using the ShardSpecs; asserts that
    shards meant to be copies (``replicated_on``) are identical and that the blocks tile it."""
    sizes = [mesh.axis(a).size for a in TP_AXES]
    tp = mesh.axis("tp")
    parts = comm.all_gather(t.detach().contiguous().reshape(1, -1), tp, 0)
    copies = {a for a, n in zip(TP_AXES, sizes) if n > 1} - {a for d in spec.dims for a in d.axes}
    assert copies == set(spec.replicated_on), f"replicated_on {spec.replicated_on} but copies over {copies}"
    view = spec.view_shape or spec.full_shape
    full = torch.full(view, float("nan"), dtype=t.dtype)
    for m in range(tp.size):
        coords = dict(zip(TP_AXES, unravel(m, sizes)))
        idx = [slice(None)] * len(view)
        for d in spec.dims:
            index = ravel(tuple(coords[a] for a in d.axes), [mesh.axis(a).size for a in d.axes])
            n = view[d.dim] // d.parts
            idx[d.dim] = slice(index * n, (index + 1) * n)
        block = parts[m].reshape(spec.local_view_shape())
        seen = full[tuple(idx)]
        if not torch.isnan(seen).all():
            assert torch.equal(seen, block), "replicated shards differ"
        full[tuple(idx)] = block
    assert not torch.isnan(full).any(), "shards do not cover the tensor"
    return full.reshape(spec.full_shape)


def close(got, want, what, rtol=1e-10, atol=1e-10):
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


def check_params(layer, serial, mesh, what, **tol):
    for name, p in layer.named_parameters():
        ref = serial.get_parameter(name)
        spec = get_spec(p)
        close(gather_full(p, spec, mesh), ref.detach(), f"{what} {name} value", **tol)
        close(gather_full(p.grad, spec, mesh), ref.grad, f"{what} {name} grad", **tol)


def check_layer(mesh, L, serial, layer, x, what, in_spec=None, out_spec=None, **tol):
    """Serial ``serial(x)`` vs ``layer(split x)``: output, input gradient, parameter gradients,
    under the loss sum(y * G) for a fixed random G."""
    x = x.clone().requires_grad_(x.is_floating_point())
    y = serial(x)
    G = torch.randn(y.shape, generator=torch.Generator().manual_seed(7), dtype=y.dtype)
    (y * G).sum().backward()
    in_spec = in_spec or L.spec(x.shape, mesh)
    out_spec = out_spec or L.spec(y.shape, mesh)
    xl = shard_tensor(x.detach(), in_spec).requires_grad_(x.is_floating_point())
    yl = layer(xl)
    (yl * shard_tensor(G, out_spec)).sum().backward()
    close(gather_full(yl, out_spec, mesh), y.detach(), f"{what} output", **tol)
    if x.is_floating_point():
        close(gather_full(xl.grad, in_spec, mesh), x.grad, f"{what} input grad", **tol)
    check_params(layer, serial, mesh, what, **tol)
    return yl


def fused_spec(shape, parts, mesh, L):
    """Layout of a fused [.., parts*h] output: the view [.., parts, h] blocked on h."""
    base = L.spec(shape, mesh)
    view = tuple(shape[:-1]) + (parts, shape[-1] // parts)
    q = mesh.axis("tp_col").size
    return ShardSpec(
        tuple(shape),
        (base.dims[0], DimShard(len(shape), q, mesh.coord("tp_col"), ("tp_col",))),
        base.replicated_on,
        view,
        fused_dim=len(shape) - 1,
    )


def rand(*shape, seed=0, dtype=F64):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def labels_BS(seed=3, shape=(B, S)):
    """Labels of ``shape`` in ``[0, V)``, about 30% of them ignored (-100)."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, V, shape, generator=g)
    y[torch.rand(shape, generator=g) < 0.3] = -100
    return y


def tp_sum(x: float, mesh) -> float:
    """Sum of a per-row value over the grid's rows and depth (each row counted once)."""
    return comm.all_reduce_scalars(comm.all_reduce_scalars([x], mesh.axis("tp_row")), mesh.axis("tp_depth"))[0]


class MLPBlock(nn.Module):
    """x + fc2(gelu(fc1(norm(x)))): the serial reference of a chained block."""

    def __init__(self, hidden, norm=None, fc1=None, fc2=None):
        super().__init__()
        self.norm = norm if norm is not None else nn.LayerNorm(hidden)
        self.fc1 = fc1 if fc1 is not None else nn.Linear(hidden, 4 * hidden)
        self.fc2 = fc2 if fc2 is not None else nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x)), approximate="tanh"))


class LM(nn.Module):
    """Embedding + positions -> LayerNorm -> head (optionally tied); returns logits."""

    def __init__(self, wte, wpe, ln, head):
        super().__init__()
        self.wte, self.wpe, self.ln, self.head = wte, wpe, ln, head

    def forward(self, ids):
        pos = torch.arange(ids.shape[1]).unsqueeze(0)
        return self.head(self.ln(self.wte(ids) + self.wpe(pos)))


def shard_block(mesh, L, serial):
    return MLPBlock(
        H,
        L.LayerNorm.from_serial(serial.norm, mesh),
        L.Linear.from_serial(serial.fc1, mesh),
        L.Linear.from_serial(serial.fc2, mesh),
    )


def shard_lm(mesh, L, serial, tied):
    wte = L.Embedding.from_serial(serial.wte, mesh)
    head = L.Head.from_serial(serial.head, mesh, tied=wte if tied else None)
    return LM(wte, L.PositionEmbedding.from_serial(serial.wpe, mesh), L.LayerNorm.from_serial(serial.ln, mesh), head)


def serial_lm(tied, seed=5, seq=S):
    """The serial :class:`LM` in float64 (position table of ``seq`` rows), its head tied or not."""
    torch.manual_seed(seed)
    lm = LM(nn.Embedding(V, H, padding_idx=5), nn.Embedding(seq, H), nn.LayerNorm(H), nn.Linear(H, V, bias=False))
    if tied:
        lm.head.weight = lm.wte.weight
    return lm.double()


def check_lm(mesh, L, tied):
    """Token + position embedding, norm, head and vocab-parallel cross-entropy (sum)."""
    serial = serial_lm(tied)
    lm = shard_lm(mesh, L, serial, tied)
    ids = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(11))
    ids[0, 0] = 5  # padding row: no gradient
    labels = labels_BS()
    loss = F.cross_entropy(serial(ids).flatten(0, 1), labels.flatten(), reduction="sum")
    loss.backward()
    logits = lm(ids)
    assert logits.shape == (B // L.spec((B, 1), mesh, hidden=False).dims[0].parts, S, V // mesh.axis("tp_col").size)
    if tied:  # the engine's protocol: the tp group's total, the same on every rank
        total = lm.head.vocab_parallel_loss_sum(logits, labels)
        total.backward()
    else:  # this rank's block; the total is the sum over grid rows (and depth)
        local = L.cross_entropy(logits, L.split_batch(labels, mesh), mesh)
        local.backward()
        total = torch.tensor(tp_sum(local.item(), mesh), dtype=F64)
    close(total.detach(), loss.detach(), f"lm tied={tied} loss")
    per_token = L.cross_entropy(logits.detach(), L.split_batch(labels, mesh), mesh, reduction="none")
    want = F.cross_entropy(serial(ids).flatten(0, 1), labels.flatten(), reduction="none").view(B, S)
    close(gather_full(per_token, L.spec((B, S), mesh, hidden=False), mesh), want.detach(), "per-token loss")
    check_params(lm, serial, mesh, f"lm tied={tied}")
    if tied:
        assert lm.head.weight is lm.wte.weight
        lm.head.gather_output = True  # for a user's loss_fn: full logits on every rank
        close(lm(ids), serial(ids).detach(), "gathered logits")


# --------------------------------------------------------------------------- scenarios
def layer_scenarios(mesh, L):
    torch.manual_seed(0)
    q, d = mesh.axis("tp_col").size, mesh.axis("tp_depth").size
    x = rand(B, S, H)

    lin = nn.Linear(H, 12).double()
    check_layer(mesh, L, lin, L.Linear.from_serial(lin, mesh), x, "linear")
    lin = nn.Linear(H, 12, bias=False).double()
    check_layer(mesh, L, lin, L.Linear.from_serial(lin, mesh), x, "linear no bias")

    # Fused QKV: out block j holds the q, k and v rows of heads block j.
    qkv = nn.Linear(H, 3 * H).double()
    layer = L.Linear.from_serial(qkv, mesh, fused=3)
    assert get_spec(layer.weight).view_shape == (3, H, H) and layer.weight.shape == (3 * H // q, H // q)
    yl = check_layer(mesh, L, qkv, layer, x, "fused qkv", out_spec=fused_spec((B, S, 3 * H), 3, mesh, L))
    q_local = yl.split(H // q, dim=-1)[0]  # the local heads' q, as the serial model splits [q | k | v]
    close(q_local, L.split(qkv(x)[..., :H].detach(), mesh), "fused qkv: local q rows")
    from transformers.pytorch_utils import Conv1D

    conv = Conv1D(3 * H, H).double()
    nn.init.normal_(conv.bias)
    check_layer(
        mesh,
        L,
        conv,
        L.Linear.from_serial(conv, mesh, fused=3),
        x,
        "fused Conv1D",
        out_spec=fused_spec((B, S, 3 * H), 3, mesh, L),
    )

    ln = nn.LayerNorm(H).double()
    nn.init.normal_(ln.weight), nn.init.normal_(ln.bias)
    check_layer(mesh, L, ln, L.LayerNorm.from_serial(ln, mesh), x * 3 + 1, "layernorm")
    ln = nn.LayerNorm(H, bias=False).double()
    check_layer(mesh, L, ln, L.LayerNorm.from_serial(ln, mesh), x, "layernorm no bias")
    rms = nn.RMSNorm(H, eps=1e-6).double()
    nn.init.normal_(rms.weight)
    check_layer(mesh, L, rms, L.RMSNorm.from_serial(rms, mesh), x, "rmsnorm")
    from behemoth.models.llama import RMSNorm  # computes in float32: compare in float32

    rms = RMSNorm(H)
    nn.init.normal_(rms.weight)
    check_layer(mesh, L, rms, L.RMSNorm.from_serial(rms, mesh), x.float(), "llama rmsnorm", rtol=1e-5, atol=1e-6)

    # Chained block, no redistribution between layers; it saves only shards for backward.
    block = MLPBlock(H).double()
    par = shard_block(mesh, L, block)
    check_layer(mesh, L, block, par, x, "mlp block")
    serial_saved = saved_activation_bytes(lambda: block(x.clone().requires_grad_()), block)
    par_saved = saved_activation_bytes(lambda: par(L.split(x, mesh).requires_grad_()), par)
    assert par_saved <= 1.25 * serial_saved / mesh.axis("tp").size, (par_saved, serial_saved)

    check_lm(mesh, L, tied=False)
    check_lm(mesh, L, tied=True)

    # Ledger: one Linear forward + backward moves (3 BSh/d + 2 h h_o)/q elements per device
    # keeping its gathered weight, 3 (BSh/d + h h_o)/q gathering it again; the gradients agree.
    for bias in (False, True):
        lin = nn.Linear(H, 2 * H, bias=bias).double()
        grads = {}
        for keep in (True, False):
            layer = L.Linear.from_serial(lin, mesh)
            layer.keep_gathered_weight = keep
            xl = L.split(x, mesh).requires_grad_()
            mesh.ledger.reset()
            layer(xl).sum().backward()
            stats = mesh.ledger.stats()
            got = sum(stats.get(a, {}).get("bytes", 0) for a in TP_AXES)
            want = summa_linear_bytes(B * S, H, 2 * H, q, depth=d, bias=bias, element_size=8, keep_weights=keep)
            assert got == want, f"ledger {got} B vs formula {want} B (bias={bias}, keep={keep})"  # exact
            grads[keep] = [xl.grad] + [p.grad for p in layer.parameters()]
        for a, b in zip(grads[True], grads[False]):
            assert torch.equal(a, b), f"keep_gathered_weight changes a gradient (bias={bias})"

    # Errors, raised on every rank before any collective.
    with pytest.raises(ValueError, match="in_features = 7 is not divisible by 2"):
        L.Linear(7, 8, mesh)
    with pytest.raises(ValueError, match=r"per fused part\) = 5 is not divisible by 2"):
        L.Linear(8, 15, mesh, fused=3)
    with pytest.raises(ValueError, match="expected the hidden block"):
        L.Linear(8, 8, mesh)(torch.zeros(2, 3, 8, dtype=F64))
    with pytest.raises(ValueError, match="vocabulary size = 15 is not divisible"):
        L.Embedding(15, 8, mesh)
    with pytest.raises(ValueError, match=f"batch size.* = 5 is not divisible by {d * q}"):
        L.Embedding(16, 8, mesh)(torch.zeros(5, 3, dtype=torch.long))
    with pytest.raises(ValueError, match=f"batch size = 3 is not divisible by {d * q}"):
        L.split_batch(torch.zeros(3, 2), mesh)
    with pytest.raises(ValueError, match="hidden size = 5 is not divisible by 2"):
        L.RMSNorm(5, mesh)


def depth_one_is_2d(mesh2, mesh25):
    """A Tesseract layer at depth 1 computes exactly what the Optimus layer computes."""
    torch.manual_seed(1)
    block = MLPBlock(H).double()
    outs = []
    for mesh, L in ((mesh2, LAYERS_2D), (mesh25, LAYERS_25D)):
        par = shard_block(mesh, L, block)
        x = L.split(rand(B, S, H, seed=2), mesh).requires_grad_()
        mesh.ledger.reset()
        y = par(x)
        (y * y).sum().backward()
        lm = shard_lm(mesh, L, serial_lm(True), tied=True)
        ids = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(4))
        loss = L.cross_entropy(lm(ids), L.split_batch(labels_BS(), mesh), mesh)
        loss.backward()
        grads = [p.grad for p in list(par.parameters()) + list(lm.parameters())]
        stats = mesh.ledger.stats()
        specs = [get_spec(p) for p in list(par.parameters()) + list(lm.parameters())]
        outs.append((y, x.grad, loss, grads, specs, {a: stats.get(a, {}).get("bytes", 0) for a in TP_AXES + ("tp",)}))
    for a, b in zip(*outs):
        if isinstance(a, list) and isinstance(a[0], torch.Tensor):
            assert all(torch.equal(u, v) for u, v in zip(a, b))
        elif isinstance(a, torch.Tensor):
            assert torch.equal(a, b)
        else:
            assert a == b, (a, b)


def autocast_smoke(mesh, L):
    """bf16 autocast: the shards travel in bf16, gradients come back in the parameters' fp32."""
    lin = nn.Linear(H, H)
    layer = L.Linear.from_serial(lin, mesh)
    x = rand(B, S, H, dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = lin(x)
        y = layer(L.split(x, mesh))
        norm = L.LayerNorm(H, mesh)(y)
    assert y.dtype == torch.bfloat16 and norm.dtype == torch.float32
    (y.float().sum() + norm.sum()).backward()
    assert layer.weight.grad.dtype == torch.float32
    close(gather_full(y.float(), L.spec((B, S, H), mesh), mesh), want.float(), "autocast", rtol=2e-2, atol=2e-2)


def prefetch_passes(mesh, L, prefetch: bool, autocast: bool):
    """Three training passes of a chain of Linears (an SGD update between them): outputs,
    input and parameter gradients, parameters and the ledger per axis."""
    torch.manual_seed(11)
    dtype = torch.float32 if autocast else F64
    serial = [nn.Linear(H, 2 * H), nn.Linear(2 * H, H, bias=False), nn.Linear(H, H)]
    chain = [L.Linear.from_serial(m.to(dtype), mesh) for m in serial]
    for m in chain:
        m.prefetch_weight = prefetch
    mesh.ledger.reset()
    outs = []
    for step in range(3):
        xl = L.split(rand(B, S, H, seed=step, dtype=dtype), mesh).requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y = xl
            for m in chain:
                y = m(y)
        y.float().pow(2).sum().backward()
        outs += [y.detach(), xl.grad] + [p.grad.clone() for m in chain for p in m.parameters()]
        with torch.no_grad():
            for m in chain:
                for p in m.parameters():
                    p.sub_(0.1 * p.grad)
                    p.grad = None
    outs += [p.detach() for m in chain for p in m.parameters()]
    return outs, mesh.ledger.stats(), chain


def prefetch_matches(mesh, L):
    """Prefetching the weight columns changes no value and no ledger entry (only when they travel)."""
    from behemoth.parallel.tensor.weight_prefetch import prefetch_of

    for autocast in (False, True):
        want, want_ledger, _ = prefetch_passes(mesh, L, False, autocast)
        got, ledger, chain = prefetch_passes(mesh, L, True, autocast)
        for a, b in zip(got, want):
            assert torch.equal(a, b), f"prefetch changes a value (autocast={autocast})"
        strip = lambda st: {a: {k: v for k, v in s.items() if k != "seconds"} for a, s in st.items()}  # noqa: E731
        assert strip(ledger) == strip(want_ledger), (ledger, want_ledger)
        if mesh.axis("tp_row").size > 1:  # passes 2 and 3 take the 2nd and 3rd Linears' columns prefetched
            assert prefetch_of(chain[0]).taken >= 4
        assert not prefetch_of(chain[0]).pending  # nothing outlives its pass


def no_grad_matches(mesh, L):
    """Without autograd a grid Linear runs weight-stationary for a few tokens and SUMMA's forward
    for many (whichever moves fewer elements, ``stationary_is_cheaper``): both give the training
    forward's output (float64: equal up to the order of the in-block sums) for plain, fused,
    Conv1D and replicated-kv layers, and the stationary form moves no weight over ``tp_row``."""
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(2)
    q, d = mesh.axis("tp_col").size, mesh.axis("tp_depth").size
    conv = Conv1D(3 * H, H).double()
    nn.init.normal_(conv.bias)
    layers = {
        "linear": (L.Linear.from_serial(nn.Linear(H, 12).double(), mesh), 12),
        "no bias": (L.Linear.from_serial(nn.Linear(H, 12, bias=False).double(), mesh), 12),
        "fused qkv": (L.Linear.from_serial(nn.Linear(H, 3 * H).double(), mesh, fused=3), 3 * H),
        "fused Conv1D": (L.Linear.from_serial(conv, mesh, fused=3), 3 * H),
    }
    if d == 1:  # one kv head for the grid's q columns (2D's grouped-query k/v projection)
        kv = nn.Linear(H, H // q, bias=True).double()
        layers["replicated kv"] = (tp2d.KVReplicatedLinear2D(kv, mesh, "2d", 1, H // q), None)
    for seq, stationary in ((1, True), (S, False)):
        x = L.split(rand(B, seq, H, seed=4), mesh)
        rows = x.shape[0] * seq
        for what, (layer, out) in layers.items():
            n_out = out // q if out is not None else H // q
            cheaper = stationary_is_cheaper(rows, H // q, n_out, q)
            assert out is None or cheaper == stationary, (what, rows)  # the kv block is small: either
            want = layer(x)
            mesh.ledger.reset()
            with torch.no_grad(), no_grad_forward(layer):
                got = layer(x)
            close(got, want.detach(), f"{what} without autograd, {seq} position(s)")
            row_bytes = mesh.ledger.stats().get("tp_row", {}).get("bytes", 0)
            weight_bytes = q * layer.weight.numel() * 8 if out is not None else q * (H // q) ** 2 * 8
            if cheaper:  # only the partial outputs' reduce-scatter over tp_row
                assert row_bytes == q * rows * n_out * 8, (what, row_bytes)
            else:  # the gathered weight column
                assert row_bytes == weight_bytes, (what, row_bytes, weight_bytes)
        assert "forward" not in layer.__dict__  # the training forward is back
    layer, _ = layers["linear"]  # weight_stationary=False: SUMMA's forward for few tokens too
    layer.weight_stationary = False
    x = L.split(rand(B, 1, H, seed=4), mesh)
    want = layer(x).detach()
    mesh.ledger.reset()
    with torch.no_grad(), no_grad_forward(layer):
        close(layer(x), want, "linear without autograd, SUMMA's forward")
    assert mesh.ledger.stats()["tp_row"]["bytes"] == q * layer.weight.numel() * 8  # the gathered weight column


def _world_2d(rank, world):
    mesh = ParallelMesh(bh.Plan(tp=4, tp_mode="2d"), rank, world)
    layer_scenarios(mesh, LAYERS_2D)
    autocast_smoke(mesh, LAYERS_2D)
    prefetch_matches(mesh, LAYERS_2D)
    no_grad_matches(mesh, LAYERS_2D)
    mesh25 = ParallelMesh(bh.Plan(tp=4, tp_mode="2.5d", tp_depth=1), rank, world)
    depth_one_is_2d(mesh, mesh25)


def _world_25d(rank, world):
    mesh = ParallelMesh(bh.Plan(tp=8, tp_mode="2.5d", tp_depth=2), rank, world)
    layer_scenarios(mesh, LAYERS_25D)
    prefetch_matches(mesh, LAYERS_25D)
    no_grad_matches(mesh, LAYERS_25D)


# --------------------------------------------------------------------------- tests
def test_2d_layers_match_serial_and_depth_one_is_2d():
    bh.spawn(_world_2d, 4, timeout=180)


def test_25d_layers_match_serial():
    bh.spawn(_world_25d, 8, timeout=180)


def test_pure_layout_and_errors():
    """No processes: a mesh without groups is enough for shapes, specs and every ValueError."""
    mesh = ParallelMesh(bh.Plan(tp=8, tp_mode="2.5d", tp_depth=2), rank=6, world_size=8, create_groups=False)
    assert (mesh.coord("tp_depth"), mesh.coord("tp_row"), mesh.coord("tp_col")) == (1, 1, 0)
    layer = tp2p5d.Linear25D(8, 12, mesh)
    spec = get_spec(layer.weight)
    assert layer.weight.shape == (6, 4) and spec.replicated_on == ("tp_depth",)
    assert [(d.dim, d.index, d.axes) for d in spec.dims] == [(0, 0, ("tp_col",)), (1, 1, ("tp_row",))]
    assert get_spec(layer.bias).replicated_on == ("tp_row", "tp_depth")
    x_spec = tp2p5d.activation_spec_25d((8, 3, 8), mesh)
    assert x_spec.dims[0] == DimShard(0, 4, 3, ("tp_depth", "tp_row")) and x_spec.local_shape() == (2, 3, 4)
    assert layer.grid.transpose_peer == 5  # (1, 1, 0) <-> (1, 0, 1)
    qkv = tp2p5d.Linear25D(8, 24, mesh, fused=3)
    assert qkv.weight.shape == (12, 4) and get_spec(qkv.weight).local_view_shape() == (3, 4, 4)
    full = torch.arange(24 * 8.0).view(24, 8)
    want = full.view(3, 8, 8)[:, 0:4, 4:8].reshape(12, 4)  # q, k, v rows of heads block 0, in block 1
    assert torch.equal(shard_tensor(full, get_spec(qkv.weight)), want)
    with pytest.raises(ValueError, match="tp_mode='2d'"):
        tp2d.Linear2D(8, 8, mesh)
    with pytest.raises(ValueError, match="Linear25D out_features = 9 is not divisible by 2"):
        tp2p5d.Linear25D(8, 9, mesh)
    assert summa_linear_bytes(64, 16, 32, 2, keep_weights=False) == 4 * 3 * (64 * 16 + 16 * 32) // 2
    assert summa_linear_bytes(64, 16, 32, 2) == 4 * (3 * 64 * 16 + 2 * 16 * 32) // 2
    assert summa_linear_bytes(64, 16, 32, 2, depth=2, keep_weights=False) == 4 * (
        3 * (32 * 16 + 16 * 32) // 2 + 16 * 32 // 4
    )
    assert summa_linear_bytes(64, 16, 32, 2, depth=2) == 4 * ((3 * 32 * 16 + 2 * 16 * 32) // 2 + 16 * 32 // 4)

"""1D (Megatron) tensor parallelism matches serial training (the parity law).

* each parallel layer against its serial layer: outputs and gradients (column/row pair,
  fused QKV, sequence-parallel norms, vocab-parallel embedding, head and cross-entropy);
* whole models -- behemoth's GPT and Llama, transformers' GPT2LMHeadModel (fused Conv1D QKV,
  tied embeddings) and LlamaForCausalLM (GQA) -- at tp=2 and tp=4, with and without
  sequence parallelism, and dp=2 x tp=2, and with the row GEMMs in two pieces whose
  collectives overlap (``tp_overlap=2``): losses and full_state_dict() within rtol 1e-4;
* the comm ledger's tp bytes against behemoth.planner.tp1d_traffic for one forward+backward;
* checkpoints saved under tp=2 load under dp=2 and the reverse, and keep matching serial;
* compiled blocks (``Plan(compile=True)``) under tp=2, with and without sequence
  parallelism, match serial training and compile once for all blocks;
* clear errors, on every rank, for dimensions tp does not divide.

Each world runs many scenarios (spawning costs seconds on two cores).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from common import (
    SEQ,
    assert_grad_norms_close,
    assert_losses_close,
    assert_state_close,
    build,
    expect_error,
    global_batches,
    load_and_continue,
    make_optimizer,
    serial_run,
    serial_train,
    shard,
    train_and_save,
    train_steps,
)
from torch.utils._python_dispatch import TorchDispatchMode

import behemoth as bh
from behemoth.mesh import ParallelMesh
from behemoth.parallel.tensor import tp1d, vocab1d
from behemoth.parallel.tensor.layout import DimShard, ShardSpec, set_spec, shard_tensor
from behemoth.planner.tp1d_traffic import tp1d_model_traffic
from behemoth.specs import shape_of

STEPS, BATCH = 3, 8
close = torch.testing.assert_close
_SERIAL: dict = {}


def _serial(family, opt, batches_key, batches, clip, precision="fp32"):
    key = (family, opt, batches_key, clip, precision)
    if key not in _SERIAL:
        _SERIAL[key] = serial_run(family, opt, batches, max_grad_norm=clip, precision=precision)
    return _SERIAL[key]


def _check_plan(family, plan, *, opt="adamw", clip=1.0, loss_fn=None, what=""):
    batches = global_batches(STEPS, BATCH)
    model = build(family)
    engine = bh.boost(model, make_optimizer(opt, model), plan, max_grad_norm=clip, loss_fn=loss_fn)
    losses, norms = train_steps(engine, batches)
    want = _serial(family, opt, "parity", batches, clip, plan.precision)
    what = f"{what or engine.plan.describe()} {family}/{opt}/clip={clip}"
    if plan.precision != "fp32":  # low-precision matmuls on differently split operands round differently
        assert_losses_close(losses, want.losses, rtol=2e-2, what=what)
        assert_state_close(engine.full_state_dict(), want.state, rtol=2e-2, atol=2e-3, what=what)
    else:
        assert_losses_close(losses, want.losses, what=what)
        assert_state_close(engine.full_state_dict(), want.state, what=what)
    t = torch.tensor(losses, dtype=torch.float64)
    ref = t.clone()
    torch.distributed.broadcast(ref, 0)
    assert torch.equal(t, ref), f"{what}: ranks disagree on the loss"
    # every step's global gradient norm is the serial one, the same float on every rank
    assert_grad_norms_close(norms, want.grad_norms, rtol=1e-4 if plan.precision == "fp32" else 2e-2, what=what)


# ----------------------------------------------------------------------------- layers
def _spec(shape, dim, p, r, view=None, fused_dim=0):
    return ShardSpec(tuple(shape), (DimShard(dim, p, r, ("tp",)),), view_shape=view, fused_dim=fused_dim)


def _param(full, spec):
    return set_spec(nn.Parameter(shard_tensor(full.detach(), spec)), spec)


def _layers(rank, world):
    """Each 1D layer against the serial computation, outputs and gradients (float64)."""
    torch.set_default_dtype(torch.float64)
    try:
        mesh = ParallelMesh(bh.Plan(tp=world), rank, world)
        ax, p, r = mesh.axis("tp"), world, rank
        g = torch.Generator().manual_seed(0)
        B, S, H, Fh, V = 2, 4 * p, 8, 16, 12 * p
        rnd = lambda *s: torch.randn(*s, generator=g)  # noqa: E731  same draws on every rank

        # Column then row pair, plain Linear and transposed (Conv1D layout), with biases.
        for transposed in (False, True):
            x, w1, b1, w2, b2, dy = rnd(B, S, H), rnd(Fh, H), rnd(Fh), rnd(H, Fh), rnd(H), rnd(B, S, H)
            xs = x.clone().requires_grad_()
            ws = [t.clone().requires_grad_() for t in (w1, b1, w2, b2)]
            ys = F.linear(F.gelu(F.linear(xs, ws[0], ws[1])), ws[2], ws[3])
            ys.backward(dy)
            region = tp1d.ParallelRegion(ax)
            s1 = _spec((H, Fh) if transposed else (Fh, H), 1 if transposed else 0, p, r)
            s2 = _spec((Fh, H) if transposed else (H, Fh), 0 if transposed else 1, p, r)
            W1 = _param(w1.t() if transposed else w1, s1)
            B1 = _param(b1, _spec((Fh,), 0, p, r))
            W2 = _param(w2.t() if transposed else w2, s2)
            B2 = nn.Parameter(b2.clone())
            col = tp1d.ColumnParallelLinear(W1, B1, axis=ax, region=region, transposed=transposed)
            row = tp1d.RowParallelLinear(W2, B2, axis=ax, region=region, transposed=transposed)
            xp = x.clone().requires_grad_()
            yp = row(F.gelu(col(xp)))
            yp.backward(dy)
            close(yp, ys)
            close(xp.grad, xs.grad)
            close(W1.grad, shard_tensor(ws[0].grad.t() if transposed else ws[0].grad, s1))
            close(B1.grad, shard_tensor(ws[1].grad, _spec((Fh,), 0, p, r)))
            close(W2.grad, shard_tensor(ws[2].grad.t() if transposed else ws[2].grad, s2))
            close(B2.grad, ws[3].grad)

        # Fused [q; k; v]: this rank's q, k and v rows; two column layers reading one input
        # share one f (one all-reduce of dX backward).
        x, w, b, w2 = rnd(B, S, H), rnd(3 * H, H), rnd(3 * H), rnd(H, H)
        xs = x.clone().requires_grad_()
        ws_, bs_, w2s_ = (t.clone().requires_grad_() for t in (w, b, w2))
        ys = F.linear(xs, ws_, bs_)
        ys2 = F.linear(xs, w2s_)
        (ys.sum() + (ys2 * 2).sum()).backward()
        spec = _spec(w.shape, 1, p, r, (3, H, H), 0)
        bspec = _spec(b.shape, 1, p, r, (3, H), 0)
        region = tp1d.ParallelRegion(ax)
        Wp, Bp = _param(w, spec), _param(b, bspec)
        W2p = _param(w2, _spec(w2.shape, 0, p, r))
        qkv = tp1d.ColumnParallelLinear(Wp, Bp, axis=ax, region=region)
        other = tp1d.ColumnParallelLinear(W2p, None, axis=ax, region=region)
        xp = x.clone().requires_grad_()
        yp, yp2 = qkv(xp), other(xp)
        mine = torch.cat([part.chunk(p, -1)[r] for part in ys.split(H, -1)], -1)
        close(yp, mine)
        close(yp2, ys2.chunk(p, -1)[r])
        ax.ledger.reset()
        (yp.sum() + (yp2 * 2).sum()).backward()
        close(xp.grad, xs.grad)
        close(Wp.grad, shard_tensor(ws_.grad, spec))
        close(Bp.grad, shard_tensor(bs_.grad, bspec))
        close(W2p.grad, shard_tensor(w2s_.grad, _spec(w2.shape, 0, p, r)))
        assert ax.ledger.stats()["tp"]["ops"] == {"all_reduce": 1}, ax.ledger.stats()

        # Sequence parallel: norm on the sequence shard -> gathered -> column -> row -> shard.
        for norm_cls in (nn.LayerNorm, _RMS):
            x, w1, w2, dy = rnd(B, S, H), rnd(Fh, H), rnd(H, Fh), rnd(B, S, H)
            serial = norm_cls(H)
            with torch.no_grad():
                for prm in serial.parameters():
                    prm.copy_(rnd(*prm.shape))
            xs = x.clone().requires_grad_()
            w1s, w2s = w1.clone().requires_grad_(), w2.clone().requires_grad_()
            ys = F.linear(F.linear(serial(xs), w1s), w2s)
            ys.backward(dy)
            par = norm_cls(H)
            par.load_state_dict(serial.state_dict())
            region = tp1d.ParallelRegion(ax)
            tp1d.make_sequence_parallel_norm(par, ax, region)
            s1, s2 = _spec(w1.shape, 0, p, r), _spec(w2.shape, 1, p, r)
            W1, W2 = _param(w1, s1), _param(w2, s2)
            col = tp1d.ColumnParallelLinear(W1, None, axis=ax, region=region, expect_gathered=True)
            row = tp1d.RowParallelLinear(W2, None, axis=ax, region=region, sequence_parallel=True)
            xp = x.chunk(p, 1)[r].clone().requires_grad_()
            yp = row(col(par(xp)))
            yp.backward(dy.chunk(p, 1)[r])
            close(yp, ys.chunk(p, 1)[r])
            close(xp.grad, xs.grad.chunk(p, 1)[r])
            for (n, a), (_, b_) in zip(par.named_parameters(), serial.named_parameters()):
                close(a.grad, b_.grad, msg=f"SP {norm_cls.__name__}.{n} grad (summed over tp)")
            close(W1.grad, shard_tensor(w1s.grad, s1))
            close(W2.grad, shard_tensor(w2s.grad, s2))
            # A column layer fed a sequence shard no norm gathered is refused, not silently wrong.
            with pytest.raises(ValueError, match="sequence-sharded input"):
                col(xp)

        # Vocab-parallel embedding, head and cross-entropy (with ignored labels).
        ids = torch.randint(0, V, (B, S), generator=g)
        labels = torch.randint(0, V, (B, S), generator=g)
        labels[0, :3] = -100
        emb, x = rnd(V, H), rnd(B, S, H)
        es, xs = emb.clone().requires_grad_(), x.clone().requires_grad_()
        hs = F.embedding(ids, es) + xs
        loss_s = F.cross_entropy(F.linear(hs, es).float().flatten(0, 1), labels.flatten(), reduction="sum")
        loss_s.backward()
        espec = _spec(emb.shape, 0, p, r)
        E = _param(emb, espec)
        region = tp1d.ParallelRegion(ax)
        embed = vocab1d.VocabParallelEmbedding(E, axis=ax, vocab_start=r * V // p, vocab_size=V)
        head = vocab1d.VocabParallelHead(E, None, axis=ax, region=region, vocab_start=r * V // p, vocab_size=V)
        xp = x.clone().requires_grad_()
        logits = head(embed(ids) + xp)
        assert logits.shape == (B, S, V // p)
        loss_p = head.vocab_parallel_loss_sum(logits, labels)
        loss_p.backward()
        # The loss is computed in fp32 (as the engine's serial loss is): fp32 tolerances.
        close(loss_p, loss_s, rtol=1e-5, atol=1e-5)
        close(xp.grad, xs.grad, rtol=1e-5, atol=1e-6)
        close(E.grad, shard_tensor(es.grad, espec), rtol=1e-5, atol=1e-6)
    finally:
        torch.set_default_dtype(torch.float32)


class _RMS(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(h))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


def test_shard_rectangles_rebuild_the_serial_tensor():
    """Pure: every rank's rectangles (what checkpoints write, with offsets) tile the serial
    tensor exactly once, for plain, fused (Linear [3h, in] and Conv1D [in, 3h]) and nested specs."""
    from behemoth.parallel.tensor import place_shard, shard_rectangles

    h, hin, p = 8, 6, 4
    cases = [
        (lambda r: _spec((16, hin), 0, p, r), (16, hin)),
        (lambda r: _spec((hin, 16), 1, p, r), (hin, 16)),
        (lambda r: _spec((3 * h, hin), 1, p, r, (3, h, hin), 0), (3 * h, hin)),
        (lambda r: _spec((hin, 3 * h), 2, p, r, (hin, 3, h), 1), (hin, 3 * h)),
        (lambda r: _spec((3 * h,), 1, p, r, (3, h), 0), (3 * h,)),
        (
            lambda r: ShardSpec((8, 8), (DimShard(0, 2, r // 2, ("tp_row",)), DimShard(1, 2, r % 2, ("tp_col",)))),
            (8, 8),
        ),
        (lambda r: ShardSpec((16, 2), (DimShard(0, 2, r // 2, ("a",)), DimShard(0, 2, r % 2, ("b",)))), (16, 2)),
    ]
    for spec_of, shape in cases:
        full = torch.arange(float(torch.Size(shape).numel())).reshape(shape)
        rebuilt, covered = torch.full(shape, -1.0), torch.zeros(shape)
        for r in range(p):
            spec = spec_of(r)
            local = shard_tensor(full, spec)
            place_shard(rebuilt, local, spec)
            for _, off, size in shard_rectangles(spec):
                region = covered
                for d, (o, n) in enumerate(zip(off, size)):
                    region = region.narrow(d, o, n)
                region += 1
        assert torch.equal(rebuilt, full), spec_of(0)
        assert torch.equal(covered, torch.ones(shape)), spec_of(0)
    fused = shard_rectangles(_spec((3 * h, hin), 1, p, 1, (3, h, hin), 0))
    assert [off for _, off, _ in fused] == [(2, 0), (10, 0), (18, 0)]  # rank 1's q, k, v rows


# ----------------------------------------------------------------------------- overlap
class _MatmulLog(TorchDispatchMode):
    """Appends ("mm", output shape) to ``log`` for every matrix multiply that runs."""

    def __init__(self, log):
        super().__init__()
        self.log = log

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.mm.out):
            self.log.append(("mm", tuple(out.shape)))
        return out


def _index(log, event, start=0):
    for i in range(start, len(log)):
        if log[i] == event:
            return i
    raise AssertionError(f"{event} not in {log[start:]}")


def _overlap(rank, world):
    """The column layer's backward launches its collective on dX, computes the weight
    gradient while it is in flight, then waits (Megatron's asynchronous tensor parallelism);
    with sequence parallelism it also re-gathers X asynchronously during the dX GEMM instead
    of saving the gathered X. Gradients stay those of the serial layers (float64)."""
    torch.set_default_dtype(torch.float64)
    try:
        ax = ParallelMesh(bh.Plan(tp=world), rank, world).axis("tp")
        p, r = world, rank
        g = torch.Generator().manual_seed(0)
        B, S, H, Fh = 3, 2 * p, 8, 16 * p  # dW of the column layer [Fh/p, H]; dX [B*S, H]
        rnd = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
        dw_shape = (Fh // p, H)
        for sp in (False, True):
            x, w1, b1, w2, dy = rnd(B, S, H), rnd(Fh, H), rnd(Fh), rnd(H, Fh), rnd(B, S, H)
            norm = nn.LayerNorm(H)
            xs, ws = x.clone().requires_grad_(), [t.clone().requires_grad_() for t in (w1, b1, w2)]
            F.linear(F.gelu(F.linear(norm(xs), ws[0], ws[1])), ws[2]).backward(dy)
            region = tp1d.ParallelRegion(ax)
            par = nn.LayerNorm(H)
            par.load_state_dict(norm.state_dict())
            if sp:
                tp1d.make_sequence_parallel_norm(par, ax, region)
            s1, s2 = _spec(w1.shape, 0, p, r), _spec(w2.shape, 1, p, r)
            W1, B1, W2 = _param(w1, s1), _param(b1, _spec(b1.shape, 0, p, r)), _param(w2, s2)
            col = tp1d.ColumnParallelLinear(W1, B1, axis=ax, region=region, expect_gathered=sp, name="col")
            row = tp1d.RowParallelLinear(W2, None, axis=ax, region=region, sequence_parallel=sp)
            xp = (x.chunk(p, 1)[r] if sp else x).clone().requires_grad_()
            saved = []
            with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
                yp = row(F.gelu(col(par(xp))))
            if sp:  # only X's sequence shard is kept; the gathered [B, S, H] is re-gathered in backward
                assert (B, S, H) not in saved and (B, S // p, H) in saved, saved
            log = ax.ledger.trace = []
            with _MatmulLog(log):
                yp.backward(dy.chunk(p, 1)[r] if sp else dy)
            ax.ledger.trace = None
            if sp:
                # re-gather X launched before the dX GEMM, waited after it ...
                gather = _index(log, ("call", "tp", "all_gather"))
                dx = _index(log, ("mm", (B * S, H)), gather)
                _index(log, ("wait", "tp"), dx)
                launch = _index(log, ("call", "tp", "reduce_scatter"), dx)
            else:
                launch = _index(log, ("call", "tp", "all_reduce"))
            # ... and the collective on dX launched before the weight-gradient GEMM, waited after it.
            dw = _index(log, ("mm", dw_shape), launch)
            _index(log, ("wait", "tp"), dw)
            what = f"sp={sp}"
            close(xp.grad, xs.grad.chunk(p, 1)[r] if sp else xs.grad, msg=what)
            close(W1.grad, shard_tensor(ws[0].grad, s1), msg=what)
            close(B1.grad, shard_tensor(ws[1].grad, _spec(b1.shape, 0, p, r)), msg=what)
            close(W2.grad, shard_tensor(ws[2].grad, s2), msg=what)
            for a, b_ in zip(par.parameters(), norm.parameters()):
                close(a.grad, b_.grad, msg=what)

        # tp_overlap=2: the row layer's GEMM runs in two batch pieces (3 rows: 2 + 1); piece 0's
        # all-reduce (SP: reduce-scatter) is launched before piece 1's GEMM and waited after it.
        # Output and gradients are the serial layer's.
        for sp in (False, True):
            h, w2s = rnd(B, S, Fh), w2.clone().requires_grad_()
            hs = h.clone().requires_grad_()
            F.linear(hs, w2s).backward(dy)
            W2 = _param(w2, s2)
            row = tp1d.RowParallelLinear(
                W2, None, axis=ax, region=tp1d.ParallelRegion(ax), sequence_parallel=sp, pieces=2
            )
            hp = h.chunk(p, 2)[r].clone().requires_grad_()
            log = ax.ledger.trace = []
            with _MatmulLog(log):
                yp = row(hp)
            ax.ledger.trace = None
            op = "reduce_scatter" if sp else "all_reduce"
            events = [e[0] if e[0] != "call" else e[2] for e in log if e[0] in ("mm", "call", "wait")]
            assert events == ["mm", op, "mm", op, "wait", "wait"], (sp, log)
            assert [e[1] for e in log if e[0] == "mm"] == [(2 * S, H), (S, H)], log
            close(yp, F.linear(h, w2).chunk(p, 1)[r] if sp else F.linear(h, w2), msg=f"tp_overlap sp={sp}")
            yp.backward(dy.chunk(p, 1)[r] if sp else dy)
            close(hp.grad, hs.grad.chunk(p, 2)[r], msg=f"tp_overlap sp={sp}")
            close(W2.grad, shard_tensor(w2s.grad, s2), msg=f"tp_overlap sp={sp}")

        # A split backward (zero-bubble's BI, then BW) does only what each pass asks for: the
        # input pass no weight-gradient GEMM, the weight pass no dX GEMM and no collective.
        region = tp1d.ParallelRegion(ax)
        W1 = _param(w1, s1)
        col = tp1d.ColumnParallelLinear(W1, None, axis=ax, region=region, name="col")
        row = tp1d.RowParallelLinear(_param(w2, s2), None, axis=ax, region=region)
        xp, xs, w1s = x.clone().requires_grad_(), x.clone().requires_grad_(), w1.clone().requires_grad_()
        F.linear(F.gelu(F.linear(xs, w1s)), w2).backward(dy)
        yp = row(F.gelu(col(xp)))
        log = ax.ledger.trace = []
        with _MatmulLog(log):
            (gx,) = torch.autograd.grad(yp, (xp,), dy, retain_graph=True)
        assert ("mm", dw_shape) not in log and ("call", "tp", "all_reduce") in log, log
        log = ax.ledger.trace = []
        with _MatmulLog(log):
            torch.autograd.backward(yp, dy, inputs=[W1])
        ax.ledger.trace = None
        assert log == [("mm", (B * S, Fh // p)), ("mm", dw_shape)], log  # row's dX (on the way to W1), W1's dW
        close(gx, xs.grad)
        close(W1.grad, shard_tensor(w1s.grad, s1))

        # Two column layers reading one input communicate dX once; if the loss uses only one of
        # them, the sum would never be communicated: an error, not a silently partial gradient.
        region = tp1d.ParallelRegion(ax)
        x = rnd(B, S, H).requires_grad_()
        a = tp1d.ColumnParallelLinear(_param(w1, s1), None, axis=ax, region=region, name="a")
        b = tp1d.ColumnParallelLinear(_param(w1, s1), None, axis=ax, region=region, name="b")
        ya, _ = a(x), b(x)
        with pytest.raises(RuntimeError, match="reached only 1 of them"):
            ya.sum().backward()
    finally:
        torch.set_default_dtype(torch.float32)


def test_column_backward_overlaps_its_collective_with_the_weight_gradient():
    bh.spawn(_overlap, 2, timeout=120)


# ----------------------------------------------------------------------------- traffic
def _check_traffic(family, plan):
    model = build(family)
    shape = shape_of(model.config)
    engine = bh.boost(model, make_optimizer("sgd", model), plan)
    batch = shard(global_batches(1, BATCH)[0], engine.dp_rank, engine.dp_size)
    engine.reset_comm_stats()
    engine._forward_backward(batch)
    got = engine.comm_stats()["tp"]["wire_bytes"]
    want = tp1d_model_traffic(
        shape,
        batch=batch["input_ids"].shape[0],
        seq=SEQ,
        tp=plan.tp,
        sequence_parallel=plan.sequence_parallel,
        dtype_bytes=4,
        param_bytes=4,
    ).total
    assert got == want, f"{plan.describe()} {family}: ledger {got} B vs formula {want:.0f} B"
    return got, want


# ----------------------------------------------------------------------------- errors
def _boost_gpt(plan, **cfg):
    from behemoth.models import GPT, GPTConfig

    base = dict(vocab_size=96, seq_len=SEQ, num_layers=1, num_heads=4, hidden=32)
    model = GPT(GPTConfig(**{**base, **cfg}))
    return bh.boost(model, make_optimizer("sgd", model), plan)


def _errors(world):
    plan = bh.Plan(tp=world)
    expect_error(lambda: _boost_gpt(plan, num_heads=3, hidden=24), "attention heads", "= 3", f"by {world}")
    expect_error(lambda: _boost_gpt(plan, vocab_size=95), "vocab_size (rows of wte) = 95", f"by {world}")
    expect_error(lambda: _boost_gpt(plan, ffn_hidden=33), "ffn hidden", "= 33", f"by {world}")
    engine = _boost_gpt(bh.Plan(tp=world, tp_overlap=4))
    expect_error(lambda: engine.step(global_batches(1, 2)[0]), "tp_overlap=4", "a batch of 2 rows")
    engine = _boost_gpt(bh.Plan(tp=world, sequence_parallel=True))
    odd = {k: v[:, : SEQ - 1] for k, v in global_batches(1, 2)[0].items()}
    expect_error(lambda: engine.step(odd), "sequence length", f"= {SEQ - 1}", f"by {world}")
    model = build("gpt")
    opt = make_optimizer("sgd", model)
    expect_error(
        lambda: bh.boost(model, opt, plan, tp_policy={"blocks.*.attn.qkvv": "colwise"}),
        "'blocks.*.attn.qkvv'",
        "matches no module",
    )
    expect_error(
        lambda: bh.boost(model, opt, plan, tp_policy={"blocks.*.attn.qkv": "columnwise"}), "not a tensor-parallel role"
    )
    from behemoth.parallel.tensor import ColwiseParallel2D

    expect_error(
        lambda: bh.boost(model, opt, plan, tp_policy={"blocks.*.mlp.fc": ColwiseParallel2D()}),
        "tp_mode='2d' style",
        "use ColwiseParallel1D or the role string 'colwise'",
    )
    # Every rank got here without a collective hanging; prove all are alive.
    t = torch.ones(1)
    torch.distributed.all_reduce(t)
    assert t.item() == world


# ----------------------------------------------------------------------------- a user's own model
class TinyBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(16), nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x):
        return x + self.down(F.relu(self.up(self.norm(x))))


class TinyLM(nn.Module):
    """A model behemoth has no table for: sharded through the documented dict form."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(7)
        self.tok = nn.Embedding(96, 16)
        self.stack = nn.ModuleList(TinyBlock() for _ in range(2))
        self.out = nn.Linear(16, 96, bias=False)
        with torch.no_grad():
            for prm in self.parameters():
                prm.copy_(torch.randn(prm.shape, generator=g) * 0.1)

    def forward(self, ids):
        x = self.tok(ids)
        for blk in self.stack:
            x = blk(x)
        return self.out(x)


TINY_POLICY = {
    "tok": "embedding",
    "stack.*.norm": "norm",
    "stack.*.up": "colwise",
    "stack.*.down": "rowwise",
    "out": "head",
}


def _check_user_model(world, sp, policy=TINY_POLICY):
    batches = global_batches(STEPS, BATCH)
    ref = TinyLM()
    opt = make_optimizer("adamw", ref)
    want = []
    for b in batches:
        loss = F.cross_entropy(ref(b["input_ids"]).flatten(0, 1), b["labels"].flatten(), ignore_index=-100)
        loss.backward()
        opt.step()
        opt.zero_grad()
        want.append(loss.item())
    model = TinyLM()
    engine = bh.boost(model, make_optimizer("adamw", model), bh.Plan(tp=world, sequence_parallel=sp), tp_policy=policy)
    got = [engine.step(b) for b in batches]
    assert_losses_close(got, want, what=f"TinyLM tp={world} sp={sp}")
    assert_state_close(
        engine.full_state_dict(),
        {k: v.detach() for k, v in ref.state_dict().items()},
        what=f"TinyLM tp={world} sp={sp}",
    )


# ----------------------------------------------------------------------------- checkpoints
# ----------------------------------------------------------------------------- worlds
FAMILIES = ("gpt", "llama", "hf-gpt2", "hf-llama")


def _world_tp2(rank, world, root):
    _layers(rank, world)
    for family in FAMILIES:
        for sp in (False, True):
            _check_plan(family, bh.Plan(tp=2, sequence_parallel=sp))
    _check_plan(
        "llama",
        bh.Plan(tp=2, sequence_parallel=True, microbatches=2, activation_checkpointing=True),
        opt="sgd",
        clip=None,
    )
    # A user loss_fn gets the full logits (gathered over tp); dp=1, one micro-batch: the mean is serial's.
    _check_plan(
        "hf-gpt2",
        bh.Plan(tp=2),
        what="loss_fn",
        loss_fn=lambda out, b: F.cross_entropy(out.logits.flatten(0, 1), b["labels"].flatten(), ignore_index=-100),
    )
    _check_plan("gpt", bh.Plan(tp=2, sequence_parallel=True, precision="bf16"), opt="sgd")
    _check_plan("gpt", bh.Plan(tp=2, tp_overlap=2, precision="bf16"), opt="sgd")
    _check_plan("llama", bh.Plan(tp=2, precision="fp16"), opt="sgd")
    for family, sp in (("gpt", False), ("hf-gpt2", False), ("hf-llama", True)):  # row GEMMs in 2 pieces
        _check_plan(family, bh.Plan(tp=2, sequence_parallel=sp, tp_overlap=2))
    _check_user_model(world, sp=False)
    _check_user_model(world, sp=True)
    # Style objects in place of role strings, with their own layout (the row layers in 2 pieces).
    from behemoth.parallel import tensor as tp

    styles = {
        "tok": tp.EmbeddingParallel1D(),
        "stack.*.norm": "norm",
        "stack.*.up": tp.ColwiseParallel1D(),
        "stack.*.down": tp.RowwiseParallel1D(pieces=2),
        "out": tp.HeadParallel1D(),
    }
    _check_user_model(world, sp=True, policy=styles)
    for family, sp in (("gpt", False), ("gpt", True), ("llama", True), ("hf-gpt2", True)):
        _check_traffic(family, bh.Plan(tp=2, sequence_parallel=sp))
    _check_traffic("gpt", bh.Plan(tp=2, sequence_parallel=True, tp_overlap=2))  # the same bytes
    _errors(world)
    # Checkpoints: tp=2 -> dp=2 and dp=2 -> tp=2 (+SP), in the same processes.
    for family in ("hf-gpt2", "llama"):
        train_and_save(family, bh.Plan(tp=2), os.path.join(root, family, "tp2", "step-2"), BATCH)
        train_and_save(family, bh.Plan(dp=2), os.path.join(root, family, "dp2", "step-2"), BATCH)
        load_and_continue(family, bh.Plan(dp=2), os.path.join(root, family, "tp2", "step-2"), BATCH)
        load_and_continue(
            family, bh.Plan(tp=2, sequence_parallel=True), os.path.join(root, family, "dp2", "step-2"), BATCH
        )


def _world_tp4(rank, world, root):
    for family in FAMILIES:  # Llama's 2 kv heads < tp=4: replicated kv heads
        for sp in (False, True):
            _check_plan(family, bh.Plan(tp=4, sequence_parallel=sp), opt="adamw" if sp else "sgd")
    for family in FAMILIES:
        _check_plan(family, bh.Plan(dp=2, tp=2, sequence_parallel=family.startswith("hf"), microbatches=2))
    for family, sp in (("llama", False), ("hf-llama", True)):
        _check_traffic(family, bh.Plan(tp=4, sequence_parallel=sp))
    # tp=4 with 3 kv heads: neither a multiple nor a divisor of 4.
    from behemoth.models import Llama, LlamaConfig

    model = Llama(LlamaConfig(vocab_size=96, seq_len=SEQ, num_layers=1, num_heads=12, num_kv_heads=3, hidden=48))
    expect_error(
        lambda: bh.boost(model, make_optimizer("sgd", model), bh.Plan(tp=4)),
        "key/value heads (num_kv_heads of layers.0.attn) = 3",
        "tp = 4",
    )
    for family in ("hf-gpt2", "llama"):  # the tp=2 checkpoint under dp=2 x tp=2
        load_and_continue(family, bh.Plan(dp=2, tp=2), os.path.join(root, family, "tp2", "step-2"), BATCH)


@pytest.fixture(scope="module")
def ckpt_root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tp1d-ckpt"))


def test_tp2_layers_models_traffic_errors_checkpoints(ckpt_root):
    bh.spawn(_world_tp2, 2, ckpt_root, timeout=400)


def test_tp4_and_dp2_tp2(ckpt_root):
    if not os.path.isdir(os.path.join(ckpt_root, "llama", "tp2")):
        bh.spawn(_save_tp2_world, 2, ckpt_root, timeout=300)
    bh.spawn(_world_tp4, 4, ckpt_root, timeout=500)


def _compile_world(rank, world):
    """Plan(compile=True) with 1D tp: the blocks compile with graph breaks at the tp layers
    (which run eagerly: region bookkeeping, collectives), train to serial parity, and every
    block reuses the first one's compiled code (a recompile, e.g. per block on a guard on
    a layer's name, is an error here)."""
    import torch._dynamo

    batches = global_batches(2, BATCH)
    torch._dynamo.config.error_on_recompile = True
    try:
        for layers, sp, overlap in ((4, False, 1), (2, True, 2)):
            torch._dynamo.reset()
            model = build("gpt", num_layers=layers)
            plan = bh.Plan(tp=world, compile=True, sequence_parallel=sp, tp_overlap=overlap)
            engine = bh.boost(model, make_optimizer("adamw", model), plan, max_grad_norm=1.0)
            losses = [engine.step(b) for b in batches]
            want_losses, want_state = serial_train("gpt", "adamw", batches, max_grad_norm=1.0, num_layers=layers)
            what = f"{plan.describe()} gpt layers={layers}"
            assert_losses_close(losses, want_losses, what=what)
            assert_state_close(engine.full_state_dict(), want_state, what=what)
    finally:
        torch._dynamo.config.error_on_recompile = False


def test_tp2_compiled_blocks_match_serial_and_compile_once():
    bh.spawn(_compile_world, 2, timeout=600)


def _save_tp2_world(rank, world, root):
    for family in ("hf-gpt2", "llama"):
        train_and_save(family, bh.Plan(tp=2), os.path.join(root, family, "tp2", "step-2"), BATCH)

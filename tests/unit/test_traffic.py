"""behemoth.planner.traffic and its per-mode modules: the per-rank tensor-parallel traffic formulas (pure, no processes).
tests/dist/test_tp1d.py checks the same formulas against the comm ledger of real runs."""

from __future__ import annotations

import dataclasses

import pytest

from behemoth.planner import collectives as co
from behemoth.planner import tp1d_traffic as t1
from behemoth.planner import tp2d_traffic as t2
from behemoth.planner import tp3d_traffic as t3
from behemoth.planner import traffic as tr
from behemoth.planner.collectives import Traffic
from behemoth.specs import TransformerShape, shape_of

GPT = TransformerShape(
    hidden=32,
    ffn_hidden=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=4,
    vocab_size=96,
    norm_params=64,
    linear_bias=True,
    fused_qkv=True,
    max_positions=16,
)
GQA = TransformerShape(
    hidden=32,
    ffn_hidden=96,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    vocab_size=96,
    norm_params=32,
    linear_bias=False,
    gated_mlp=True,
    rms_norm=True,
)


def test_collective_costs():
    assert co.all_reduce_bytes(100, 2) == 100
    assert co.all_reduce_bytes(100, 4) == 150
    assert co.all_gather_bytes(100, 4) == 75 == co.reduce_scatter_bytes(100, 4)


def test_linear_pair_with_sequence_parallel_adds_only_the_backward_regather():
    kw = dict(tokens=64, in_features=32, out_features=32, tp=4, dtype_bytes=4)
    plain = t1.tp1d_linear_traffic(orientation="column", **kw) + t1.tp1d_linear_traffic(orientation="row", **kw)
    sp = t1.tp1d_linear_traffic(orientation="column", sequence_parallel=True, **kw) + t1.tp1d_linear_traffic(
        orientation="row", sequence_parallel=True, **kw
    )
    # Megatron: one all-reduce forward (g) and one backward (f): 2 x 2(p-1)/p T h e.
    assert plain == Traffic(1.5 * 64 * 32 * 4, 1.5 * 64 * 32 * 4)
    # SP: the same volume as all-gather + reduce-scatter, plus the column layer's backward
    # re-gather of X (only X's sequence shard is kept from forward).
    regather = co.all_gather_bytes(64 * 32 * 4, 4)
    assert sp.forward == plain.forward and sp.backward == plain.backward + regather
    assert t1.tp1d_linear_traffic(orientation="column", **kw).forward == 0  # f is free forward
    with pytest.raises(ValueError, match="orientation"):
        t1.tp1d_linear_traffic(orientation="diagonal", **kw)


def test_model_traffic_by_hand():
    # p = 2: an all-reduce of n bytes puts n bytes on the wire, an all-gather n/2.
    t, h, e = 8 * 16, 32, 4
    blocks = 2 * 4 * (t * h * e)  # 2 blocks x (f + g) x (attention, MLP)
    edges = t * h * 4 + t * h * e + 3 * t * 4  # embedding g, head f, loss: [T] max + [2, T] sums
    got = t1.tp1d_model_traffic(GPT, batch=8, seq=16, tp=2, dtype_bytes=e)
    assert got.total == blocks + edges == 165376
    sp = t1.tp1d_model_traffic(GPT, batch=8, seq=16, tp=2, dtype_bytes=e, sequence_parallel=True)
    norms_and_biases = 2 * (2 * 64 * 4 + 2 * 32 * 4)  # per block: 2 norms (w, b) and 2 row biases
    scatter_gather = 2 * (t * h * e / 2)
    regathers = 2 * 2 * (t * h * e / 2)  # per block: attention and MLP column inputs
    assert sp.total == got.total + norms_and_biases + scatter_gather + regathers == 216064


def test_gqa_with_fewer_kv_heads_than_tp_all_reduces_the_kv_weight_grads():
    kw = dict(batch=4, seq=16, dtype_bytes=4)
    at2 = t1.tp1d_block_traffic(GQA, tp=2, **kw)  # K = 2 = p: kv heads split, nothing extra
    at4 = t1.tp1d_block_traffic(GQA, tp=4, **kw)  # K = 2 < p = 4: k, v replicated
    pair = 4 * 1.5 * 4 * 16 * 32 * 4
    assert at4.total == pair + 2 * co.all_reduce_bytes(2 * 8 * 32 * 4, 4)
    assert at2.total == 4 * 1.0 * 4 * 16 * 32 * 4


def test_bf16_autocast_dtypes_and_trivial_degree():
    mixed = t1.tp1d_block_traffic(GPT, batch=1, seq=8, tp=2, dtype_bytes=2, stream_bytes=4)
    assert mixed.forward == 2 * 8 * 32 * 2  # g on bf16 Linear outputs
    assert mixed.backward == 2 * 8 * 32 * 2  # f on the bf16-cast Linear inputs (not the fp32 stream)
    assert t1.tp1d_model_traffic(GPT, batch=4, seq=16, tp=1) == Traffic()


def test_shape_from_configs():
    from transformers import GPT2Config
    from transformers import LlamaConfig as HFLlamaConfig

    from behemoth.models import GPTConfig, LlamaConfig

    g = shape_of(GPTConfig(vocab_size=96, seq_len=16, num_layers=2, num_heads=4, hidden=32))
    assert g == GPT
    ll = shape_of(
        LlamaConfig(vocab_size=96, seq_len=16, num_layers=2, num_heads=4, num_kv_heads=2, hidden=32, ffn_hidden=96)
    )
    assert ll == GQA
    hg = shape_of(GPT2Config(vocab_size=96, n_embd=32, n_layer=2, n_head=4))
    assert hg == dataclasses.replace(GPT, max_positions=1024)
    hl = shape_of(
        HFLlamaConfig(
            vocab_size=96,
            hidden_size=32,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    )
    assert hl == GQA and hl.head_dim == 8


def test_2d_linear_is_summa_and_matches_the_layer_formula():
    for depth in (1, 2):
        for bias in (False, True):
            for keep in (True, False):
                kw = dict(
                    tokens=64,
                    in_features=16,
                    out_features=32,
                    tp=4 * depth,
                    depth=depth,
                    bias=bias,
                    dtype_bytes=4,
                    param_bytes=4,
                    keep_weights=keep,
                )
                paid, got = t2.tp2d_linear_traffic(**kw, wire=False), t2.tp2d_linear_traffic(**kw)
                assert paid.total == t2.summa_linear_bytes(64, 16, 32, 2, depth=depth, bias=bias, keep_weights=keep)
                # forward: gather the q X blocks (64/(d q) x 16/q) of the grid row and the q W blocks
                # (16/q x 32/q) of the grid column; backward: re-gather X (and W unless kept), the
                # reduce-scatters of both partials, the depth all-reduce of dW (16/q x 32/q) and the
                # bias gradient's all-reduces over tp_row and depth (32/q each); fp32, q = 2
                act, wgt = 64 * 16 / depth / 2 * 4, 16 * 32 / 2 * 4
                assert paid.forward == act + wgt
                dw = 16 * 32 / 4 * 4 if depth > 1 else 0
                db = 32 / 2 * 4 * (2 if depth > 1 else 1) if bias else 0
                assert paid.backward == 2 * act + (1 if keep else 2) * wgt + dw + db
                # on the wire a ring gather / reduce-scatter over q = 2 sends half its payload; an
                # all-reduce over 2 sends its payload
                assert got.forward == paid.forward / 2
                assert got.backward == (2 * act + (1 if keep else 2) * wgt) / 2 + dw + db
    # Optimus: 3 (bsh + h h_o) / q per Linear per device re-gathering W, (3 bsh + 2 h h_o) / q
    # keeping it, of which a ring sends (q-1)/q.
    assert tr.linear_traffic(
        "2d", tokens=64, in_features=16, out_features=32, tp=9, dtype_bytes=1, keep_weights=False
    ).total == (pytest.approx(3 * (64 * 16 + 16 * 32) / 3 * 2 / 3))
    assert tr.linear_traffic("2d", tokens=64, in_features=16, out_features=32, tp=9, dtype_bytes=1).total == (
        pytest.approx((3 * 64 * 16 + 2 * 16 * 32) / 3 * 2 / 3)
    )
    with pytest.raises(ValueError, match="tp_depth"):
        t2.tp2d_linear_traffic(tokens=8, in_features=8, out_features=8, tp=6)


def test_2d_model_traffic_by_hand():
    # q = 2, fp32: GPT's blocks are 4 SUMMA Linears + 2 LayerNorms each; the model adds the
    # embedding (ids, reduce-scatter, swap), positions, final norm, head and loss.
    t, h, f, v, q, e = 4 * 16, 32, 128, 96, 2, 4
    # a Linear's gathers and reduce-scatters put (q-1)/q of their payload on the wire
    # (X gathered forward and backward, W gathered once and kept for the backward)
    lin = lambda i, o, b=True: (3 * t * i + 2 * i * o) / q * e * (q - 1) / q + (o / q * e if b else 0)  # noqa: E731
    norm = (2 * t / q * e) + (2 * t / q * e) + 2 * (h / q * e)  # stats fwd, sums bwd, weight + bias
    block = lin(h, 3 * h) + lin(h, h) + lin(h, f) + lin(f, h) + 2 * norm
    emb = (t / q * 8) + (t * h / q * e / 2) + 2 * (t / q * h / q * e) + (t * h / q * e / 2)
    edges = emb + 16 * h / q * e + norm + lin(h, v, False) + 3 * t / q * 4
    got = tr.model_traffic("2d", GPT, batch=4, seq=16, tp=4, dtype_bytes=e, param_bytes=e)
    assert got.total == 2 * block + edges
    diag = t2.tp2d_model_traffic(GPT, batch=4, seq=16, tp=4, dtype_bytes=e, param_bytes=e, diagonal=True)
    assert got.total - diag.total == 2 * t / q * h / q * e  # no transpose swap on the diagonal
    assert t2.tp2p5d_block_traffic(GQA, batch=4, seq=16, tp=4, depth=1) == tr.block_traffic(
        "2d", GQA, batch=4, seq=16, tp=4
    )
    deep = tr.model_traffic("2.5d", GQA, batch=8, seq=16, tp=8, depth=2)
    assert deep.total > tr.model_traffic("2d", GQA, batch=4, seq=16, tp=4).total  # + the depth all-reduces


def test_3d_linear_matches_the_layer_formula():
    for q in (2, 3):
        for bias in (False, True):
            for input_grad in (False, True):
                kw = dict(bias=bias, input_grad=input_grad)
                got = t3.tp3d_linear_traffic(
                    tokens=36 * 16, in_features=18, out_features=36, tp=q**3, dtype_bytes=4, param_bytes=4, **kw
                )
                assert got.total == pytest.approx(t3.linear3d_bytes(36 * 16, 18, 36, q, wire=True, **kw))
                # forward: gather X and W, reduce-scatter Y; backward: gather dY, re-gather X,
                # reduce-scatter dW (+ re-gather W, reduce-scatter dX with input_grad; + the bias
                # gradient's two all-reduces of 36/q); (q-1)/q of each on the wire (2 (q-1)/q for
                # an all-reduce); fp32
                T, K, N = 36 * 16, 18, 36
                fwd = (T * K + K * N + T * N) / q**2 * (q - 1) / q * 4
                extra = (K * N + T * K) / q**2 * (q - 1) / q * 4 if input_grad else 0
                extra += 2 * N / q * 2 * (q - 1) / q * 4 if bias else 0
                assert got.forward == pytest.approx(fwd, rel=1e-12)
                assert got.backward == pytest.approx(fwd + extra, rel=1e-12)
    # Payload (3 T K + 3 K N + 2 T N) / q^2; q = 2 puts half of each gather/reduce-scatter on the wire.
    assert (
        tr.linear_traffic("3d", tokens=64, in_features=16, out_features=32, tp=8, dtype_bytes=1).total
        == (3 * 64 * 16 + 3 * 16 * 32 + 2 * 64 * 32) / 4 / 2
    )
    assert t3.tp3d_linear_traffic(tokens=64, in_features=16, out_features=32, tp=1) == Traffic()
    with pytest.raises(ValueError, match="not a cube"):
        t3.tp3d_linear_traffic(tokens=8, in_features=8, out_features=8, tp=4)


def test_3d_model_traffic_by_hand():
    # q = 2, fp32, T = 64: every Linear moves (3 T i + 3 i o + 2 T o)/q^2 elements, half on the
    # wire, plus its bias's two all-reduces; GPT's blocks are 4 Linears + 2 LayerNorms each.
    t, h, f, v, e = 4 * 16, 32, 128, 96, 4
    lin = lambda i, o, b=True: (3 * t * i + 3 * i * o + 2 * t * o) / 8 * e + (o * e if b else 0)  # noqa: E731
    norm = 2 * 16 * e + 2 * 16 * e + 2 * (h / 2 * 2 * e)  # stats fwd, sums bwd, weight + bias over row, depth
    block = lin(h, 3 * h) + lin(h, h) + lin(h, f) + lin(f, h) + 2 * norm
    emb = (16 * 8 + 2 * 16 * 8) / 2 * 2 + 2 * (t * h / 2 + t * h / 4) / 2 * e  # ids; lookups fwd + bwd
    pos = 2 * 16 * 8 / 2 + 2 * (16 * h / 2 * e)  # position ids; table grad
    edges = emb + pos + norm + lin(h, v, False) + 3 * 16 * 4
    got = tr.model_traffic("3d", GPT, batch=4, seq=16, tp=8, dtype_bytes=e, param_bytes=e)
    assert got.total == 2 * block + edges
    gqa = tr.block_traffic("3d", GQA, batch=4, seq=16, tp=8, dtype_bytes=e, param_bytes=e)
    kv = 2 * 8  # K D: q, k, v each gather X
    assert gqa == (
        tr.linear_traffic("3d", tokens=t, in_features=h, out_features=h, tp=8, dtype_bytes=e)
        + 2 * tr.linear_traffic("3d", tokens=t, in_features=h, out_features=kv, tp=8, dtype_bytes=e)
        + tr.linear_traffic("3d", tokens=t, in_features=h, out_features=h, tp=8, dtype_bytes=e)
        + 2 * tr.linear_traffic("3d", tokens=t, in_features=h, out_features=96, tp=8, dtype_bytes=e)
        + tr.linear_traffic("3d", tokens=t, in_features=96, out_features=h, tp=8, dtype_bytes=e)
        + 2 * Traffic(16 * e, 16 * e + 2 * (h / 2 * e))
    )  # RMS: all-reduce one statistic
    with pytest.raises(ValueError, match="tp_mode='4d'"):
        tr.model_traffic("4d", GPT, batch=1, seq=8, tp=8)
    assert tr.model_traffic("1d", GPT, batch=8, seq=16, tp=2, dtype_bytes=4).total == 165376

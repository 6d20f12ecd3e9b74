"""Per-rank collectives and memory of generation (``bh.generate``): a prefill of the padded
prompts and one-token decode steps, per tensor-parallel mode, from the code the runtime runs.

A forward of generation runs each tensor-parallel layer's no-grad form
(``parallel/tensor/base.no_grad_forward``) on the tp group's ``rows`` (padded to a multiple of
the grid's batch split, ``generation/loop.py``) and ``seq`` tokens a row (the padded prompt, or
1 in a decode step), and computes the final norm and the head on the last position only
(``logits_to_keep=1``); the vocabulary-parallel head gathers the logits of all the group's rows
on every rank. Per mode, in call order:

* **1D** (``tp1d``, ``vocab1d``): the embedding's all-reduce of ``[B, S, h]``; per block the two
  row layers' all-reduces of ``[B, S, h]``; the head's all-gather of ``[B, V]``. With sequence
  parallelism (the prefill only: a decode step pauses it; the prompt padded to a multiple of tp)
  the row layers reduce-scatter and the norms all-gather, and the sequence is gathered after the
  last block. Replicated kv heads (K < tp) move nothing without autograd.
* **2D / 2.5D** (``embed2d``, ``tp2d``, ``grid.linear_no_grad``): the embedding all-gathers the
  int64 ids over ``tp_row``, reduce-scatters its partial lookups over ``tp_col`` and swaps with
  the transposed grid rank (off the diagonal); each RMS norm all-reduces ``[b, S]`` fp32 sums of
  squares over ``tp_col`` (a LayerNorm all-gathers mean and M2); each Linear runs
  weight-stationary while :func:`stationary_is_cheaper` (one all-to-all over ``tp`` of the input
  blocks, a reduce-scatter of the partials over ``tp_row``), SUMMA's forward otherwise (the
  input blocks all-gathered over ``tp_col``, the weight column over ``tp_row``); the head's
  logits are all-gathered over ``tp_col``, ``tp_row`` and ``tp_depth``.
* **3D** (``embed3d``, ``norms3d``, ``tp3d``): as 2D's with the cube's axes (:func:`_forward_3d`),
  each Linear's bytes those of :func:`~.tp3d_traffic.linear3d_no_grad_bytes` (a unit test holds
  them equal).

:func:`forward_collectives` lists the calls of one forward as :class:`Call` s (axis, op, the
ledger's ``bytes`` and ``wire_bytes``); :func:`ledger_of` sums them as ``Ledger.stats()`` does,
so a test compares a prediction with a run's ledger key for key. :func:`kv_cache_bytes`
(``generation/sizes.py``) and the stationary rules (``parallel/tensor/stationary.py``) are the
runtime's own; :func:`generation_memory` is one rank's memory.

Pure: no torch, no process group. Checked against the ledger in
tests/dist/test_planner_generation_ledger.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..generation.sizes import kv_cache_bytes
from ..parallel.tensor.stationary import cube_stationary_is_cheaper
from ..parallel.tensor.stationary import grid_stationary_is_cheaper as stationary_is_cheaper
from ..specs import TransformerShape
from .tp2d_traffic import grid_side
from .tp3d_traffic import cube_side

__all__ = [
    "Call",
    "GenerationMemory",
    "batch_parts",
    "block_linears",
    "forward_collectives",
    "generation_memory",
    "kv_cache_bytes",
    "ledger_of",
    "padded_rows",
    "stationary_is_cheaper",
]


@dataclass(frozen=True)
class Call:
    """One collective call as the comm ledger books it."""

    axis: str
    op: str
    bytes: float
    """The ledger's ``bytes`` (payload)."""
    wire: float
    """The ledger's ``wire_bytes`` (what leaves this rank)."""
    size: int
    """Ranks of the axis."""


def ledger_of(calls: list[Call]) -> dict[str, dict]:
    """``{axis: {"calls", "bytes", "wire_bytes", "ops": {op: n}}}``, as ``Ledger.stats()`` less its seconds."""
    out: dict[str, dict] = {}
    for c in calls:
        s = out.setdefault(c.axis, {"calls": 0, "bytes": 0, "wire_bytes": 0, "ops": {}})
        s["calls"] += 1
        s["bytes"] += c.bytes
        s["wire_bytes"] += c.wire
        s["ops"][c.op] = s["ops"].get(c.op, 0) + 1
    return out


def _grid(tp: int, mode: str, depth: int) -> tuple[int, int]:
    """(q, depth) of a grid mode."""
    if mode == "3d":
        q = cube_side(tp)
        return q, q
    d = depth if mode == "2.5d" else 1
    return grid_side(tp, d), d


def batch_parts(tp: int, mode: str, depth: int = 1) -> int:
    """How many row blocks a tp group's rows are split into: 1 (1D), ``q * depth`` (2D, 2.5D), ``q**2`` (3D)."""
    if tp == 1 or mode == "1d":
        return 1
    q, d = _grid(tp, mode, depth)
    return q * q if mode == "3d" else q * d


def padded_rows(batch: int, tp: int, mode: str, depth: int = 1) -> int:
    """The tp group's rows ``bh.generate`` runs for ``batch`` prompts: a multiple of the grid's
    batch split (copies of the last row fill it)."""
    p = batch_parts(tp, mode, depth)
    return -(-batch // p) * p


def _ag(axis: str, shard: float, n: int) -> Call:
    """All-gather of a ``shard``-byte block over n ranks: payload the gathered tensor."""
    return Call(axis, "all_gather", n * shard, (n - 1) * shard, n)


def _rs(axis: str, full: float, n: int) -> Call:
    return Call(axis, "reduce_scatter", full, (n - 1) / n * full, n)


def _ar(axis: str, full: float, n: int) -> Call:
    return Call(axis, "all_reduce", full, 2 * (n - 1) / n * full, n)


def block_linears(shape: TransformerShape) -> list[tuple[int, int]]:
    """(in, out) of one block's Linears in call order: q, k, v (or fused qkv), the attention's
    output, the MLP's."""
    h, f = shape.hidden, shape.ffn_hidden
    attn, kv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    qkv = [(h, attn + 2 * kv)] if shape.fused_qkv else [(h, attn), (h, kv), (h, kv)]
    mlp = [(h, f), (h, f), (f, h)] if shape.gated_mlp else [(h, f), (f, h)]
    return qkv + [(attn, h)] + mlp


def forward_collectives(
    shape: TransformerShape,
    *,
    rows: int,
    seq: int,
    tp: int,
    mode: str = "1d",
    depth: int = 1,
    sequence_parallel: bool = False,
    dtype_bytes: int = 2,
    param_bytes: int | None = None,
    diagonal: bool = False,
) -> list[Call]:
    """The collectives one rank issues in one forward of generation: ``rows`` the tp group's
    (padded: :func:`padded_rows`), ``seq`` tokens each (the padded prompt in a prefill, 1 in a
    decode step). ``dtype_bytes``: the activations' element size (the model's dtype);
    ``param_bytes``: the embedding's (default the same); ``diagonal``: a grid rank (i, i), which
    skips the embedding's swap and keeps its own input block in the stationary all-to-all.
    ``sequence_parallel``: 1D's, in a prefill (pass False for a decode step, which pauses it)."""
    if tp == 1:
        return []
    pb = dtype_bytes if param_bytes is None else param_bytes
    h, v, n_layers = shape.hidden, shape.vocab_size, shape.num_layers
    if mode == "1d":
        return _forward_1d(shape, rows, seq, tp, sequence_parallel, dtype_bytes, pb)
    if mode == "3d":
        return _forward_3d(shape, rows, seq, tp, dtype_bytes, pb)
    q, d = _grid(tp, mode, depth)
    b = rows // (q * d)  # this rank's rows
    stat = max(4, dtype_bytes)
    out: list[Call] = []
    # embedding: ids of the grid row gathered into the depth slab, lookups reduce-scattered, swap
    out.append(_ag("tp_row", b * seq * 8, q))
    out.append(_rs("tp_col", q * b * seq * h / q * pb, q))
    if not diagonal:
        x = b * seq * h / q * pb
        out.append(Call("tp", "exchange", x, x, tp))

    def norm(tokens: int) -> list[Call]:
        if shape.rms_norm:
            return [_ar("tp_col", tokens * stat, q)]
        return [_ag("tp_col", 2 * tokens * stat, q)]  # mean and M2 of each token

    def linear(tokens: int, fin: int, fout_local: int) -> list[Call]:
        n_in = fin // q
        if q > 1 and stationary_is_cheaper(tokens, n_in, fout_local, q):
            sent = q * tokens * n_in * dtype_bytes
            own = tokens * n_in * dtype_bytes if diagonal else 0
            return [
                Call("tp", "all_to_all", sent, sent - own, tp),
                _rs("tp_row", q * tokens * fout_local * dtype_bytes, q),
            ]
        return [
            _ag("tp_col", tokens * n_in * dtype_bytes, q),
            _ag("tp_row", n_in * fout_local * dtype_bytes, q),
        ]

    replicated = not shape.fused_qkv and shape.num_kv_heads < q and shape.num_kv_heads != shape.num_heads
    kv_out = shape.head_dim if replicated else 0
    t = b * seq
    block: list[Call] = []
    for i, (fin, fout) in enumerate(block_linears(shape)):
        if i == 0:
            block += norm(t)
        local_out = kv_out if (replicated and i in (1, 2)) else fout // q
        block += linear(t, fin, local_out)
        if i == (1 if shape.fused_qkv else 3):  # after the attention's output: the MLP's norm
            block += norm(t)
    out += block * n_layers
    out += norm(b)  # the final norm, last position only
    out += linear(b, h, v // q)  # the head
    logits = b * v / q * dtype_bytes
    out.append(_ag("tp_col", logits, q))
    out.append(_ag("tp_row", q * logits, q))
    if d > 1:
        out.append(_ag("tp_depth", q * q * logits, d))
    return out


def _forward_1d(shape, rows, seq, tp, sp, dt, pb) -> list[Call]:
    h = shape.hidden
    if sp:
        seq = -(-seq // tp) * tp  # the prompt padded to a multiple of tp
    x = rows * seq * h
    out = [_ar("tp", x * pb, tp)]  # vocab-parallel embedding
    if sp:
        out += [_ag("tp", x * dt / tp, tp), _rs("tp", x * dt, tp)] * 2 * shape.num_layers
        out.append(_ag("tp", x * dt / tp, tp))  # the sequence gathered after the last block
    else:
        out += [_ar("tp", x * dt, tp)] * 2 * shape.num_layers
    out.append(_ag("tp", rows * shape.vocab_size / tp * dt, tp))  # the head's logits, last position
    return out


def _forward_3d(shape, rows, seq, tp, dt, pb) -> list[Call]:
    """3D (``embed3d``, ``norms3d``, ``tp3d``): this rank's ``b = rows / q**2`` rows. The
    embedding all-gathers the int64 ids over tp_col then tp_depth and reduce-scatters its
    lookups over tp_depth then tp_row (the canonical layout); each RMS norm all-reduces over
    tp_col (the canonical layout's hidden axis); a Linear reading the canonical layout (q, k, v,
    gate, up, the head) has (I, W, O) = (tp_row, tp_depth, tp_col), one reading the swapped
    layout (the attention's output, down) (tp_col, tp_depth, tp_row); weight-stationary while
    :func:`.tp3d_traffic.linear3d_no_grad_bytes`' rule says so (all-gather the input over I
    then W, reduce-scatter over O, all-to-all over W), else the training form (all-gather the
    weight over W and the input over I, reduce-scatter over O); the head's logits (swapped
    layout) are all-gathered over tp_row, tp_col and tp_depth."""
    q = cube_side(tp)
    b = rows // q**2
    h, v = shape.hidden, shape.vocab_size
    m = b * seq
    out = [_ag("tp_col", m * 8, q), _ag("tp_depth", q * m * 8, q)]
    out += [_rs("tp_depth", q * q * m * h / q * pb, q), _rs("tp_row", q * m * h / q * pb, q)]

    def linear(tokens: int, fin: int, fout: int, swapped: bool) -> list[Call]:
        i_ax, o_ax = ("tp_col", "tp_row") if swapped else ("tp_row", "tp_col")
        n_in, n_out = fin // q, fout // q**2
        if cube_stationary_is_cheaper(tokens, n_in, n_out, q):
            part = q * tokens * n_out * dt
            return [
                _ag(i_ax, tokens * n_in * dt, q),
                _ag("tp_depth", q * tokens * n_in * dt, q),
                _rs(o_ax, q * q * tokens * n_out * dt, q),
                Call("tp_depth", "all_to_all", part, part - tokens * n_out * dt, q),
            ]
        return [
            _ag("tp_depth", n_out * n_in * dt, q),
            _ag(i_ax, tokens * n_in * dt, q),
            _rs(o_ax, q * q * tokens * n_out * dt, q),
        ]

    stat = max(4, dt)
    block: list[Call] = []
    last_attn = 1 if shape.fused_qkv else 3
    down = len(block_linears(shape)) - 1
    for i, (fin, fout) in enumerate(block_linears(shape)):
        if i == 0:
            block.append(_ar("tp_col", m * stat, q))
        block += linear(m, fin, fout, swapped=i in (last_attn, down))
        if i == last_attn:
            block.append(_ar("tp_col", m * stat, q))
    out += block * shape.num_layers
    out.append(_ar("tp_col", b * stat, q))  # the final norm, last position only
    out += linear(b, h, v, swapped=False)
    logits = b * v / q * dt
    out += [_ag("tp_row", logits, q), _ag("tp_col", q * logits, q), _ag("tp_depth", q * q * logits, q)]
    return out


# --------------------------------------------------------------------------- memory
@dataclass(frozen=True)
class GenerationMemory:
    """One rank's device memory for a generation of ``rows`` (the tp group's) x ``length`` slots, bytes."""

    weights: float
    kv_cache: float
    transient: float
    """The prefill's largest live activations and the logits."""
    reserve: float
    """CUDA context, NCCL buffers, allocator slack (:func:`.reserve.device_reserve`)."""

    @property
    def total(self) -> float:
        return self.weights + self.kv_cache + self.transient + self.reserve


def prefill_transient_bytes(
    shape: TransformerShape,
    *,
    rows_local: int,
    prompt: int,
    length: int,
    heads_local: int,
    ffn_local: int,
    hidden_local: int,
    dtype_bytes: int,
) -> float:
    """The prefill's largest transient tensors on a rank: the residual stream and a block's
    input, the MLP's intermediates (gate, up, their product: three ``[T, f_local]``), the
    attention's scores against the cache (``[b, heads, P, L]``: the math path's, an upper bound
    where a fused kernel runs) and its mask (``[b, 1, P, L]`` bools), and the fp32 logits of
    the last position (``[rows, V]``, gathered)."""
    t = rows_local * prompt
    stream = 4 * t * hidden_local * dtype_bytes
    mlp = 3 * t * ffn_local * dtype_bytes
    attn = rows_local * heads_local * prompt * length * dtype_bytes + rows_local * prompt * length
    return stream + max(mlp, attn)


def generation_memory(
    shape: TransformerShape,
    *,
    weights: float,
    batch: int,
    prompt: int,
    new_tokens: int,
    tp: int,
    mode: str = "1d",
    depth: int = 1,
    dtype_bytes: int = 2,
    reserve=None,
) -> GenerationMemory:
    """One rank's memory: ``weights`` (bytes: :func:`.params.local_params` times the element
    size), the KV cache of the padded rows for ``prompt + new_tokens`` slots
    (:func:`kv_cache_bytes`), the prefill's transients (:func:`prefill_transient_bytes`) and
    ``reserve(allocated)`` (bytes beyond PyTorch's allocated peak; None: nothing)."""
    rows = padded_rows(batch, tp, mode, depth)
    parts = batch_parts(tp, mode, depth)
    local = rows // parts
    length = prompt + new_tokens
    kv = kv_cache_bytes(
        num_layers=shape.num_layers,
        rows=local,
        num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        length=length,
        dtype_bytes=dtype_bytes,
        tp=tp,
        tp_mode=mode,
        tp_depth=depth,
    )
    if tp == 1 or mode == "1d":
        heads, ffn, hid = max(1, shape.num_heads // tp), shape.ffn_hidden // tp, shape.hidden
    else:
        q, _ = _grid(tp, mode, depth)
        heads, ffn, hid = max(1, shape.num_heads // q), shape.ffn_hidden // q, shape.hidden // q
    transient = prefill_transient_bytes(
        shape,
        rows_local=local,
        prompt=prompt,
        length=length,
        heads_local=heads,
        ffn_local=ffn,
        hidden_local=hid,
        dtype_bytes=dtype_bytes,
    )
    transient += rows * shape.vocab_size * 4  # the gathered fp32 logits of the last position
    allocated = weights + kv + transient
    return GenerationMemory(weights, kv, transient, reserve(allocated) if reserve else 0.0)

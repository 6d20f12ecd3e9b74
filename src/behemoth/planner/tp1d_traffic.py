"""Per-rank bytes of 1D (Megatron) tensor parallelism, for a model and a batch.

1D (Megatron; behemoth.parallel.tensor.tp1d). Per column/row pair, forward + backward:
``f`` = all-reduce of dX [T, h] backward and ``g`` = all-reduce of Y [T, h] forward, i.e.
``4 (p-1)/p T h`` elements; with sequence parallelism all-gather + reduce-scatter of the
same volume plus a second all-gather of X backward (Megatron's: the column layers keep only
X's sequence shard and re-gather it, overlapped with the dX GEMM), and the all-reduce of the
gradients of the norm weights and row biases (which see only this rank's tokens). Two pairs per block (attention, MLP); q/k/v (and
gate/up) share one ``f``. GQA with K < p replicates the k/v projections and all-reduces
their weight gradients. Model level: vocab-parallel embedding (all-reduce of [T, h] forward),
head (``f``), vocab-parallel cross-entropy (all-reduce of [T] maxima and of [2, T] sums,
fp32), and with sequence parallelism the scatter/gather of the sequence around the blocks. A
mixture-of-experts MLP has no column/row pair: the tp ranks split its tokens
(:func:`tp1d_block_traffic`).


Dtypes: ``dtype_bytes`` is the element size of the Linears' inputs and outputs (2 under
bf16 autocast; ``f`` acts on the column input already cast, as Megatron's does),
``stream_bytes`` that of the residual stream (4 under autocast; where the sequence-parallel
scatter/gather around the blocks acts), ``param_bytes`` that of parameters and their
gradients (and of the embedding output).


Units and notation: :mod:`behemoth.planner.traffic`.
"""

from __future__ import annotations

from ..specs import TransformerShape
from .collectives import Traffic, all_gather_bytes, all_reduce_bytes, reduce_scatter_bytes


def tp1d_linear_traffic(
    *,
    tokens: int,
    in_features: int,
    out_features: int,
    tp: int,
    orientation: str,
    sequence_parallel: bool = False,
    bias: bool = False,
    dtype_bytes: int = 2,
    stream_bytes: int | None = None,
    param_bytes: int = 4,
) -> Traffic:
    """One 1D Linear, forward + backward. ``orientation='column'`` counts its ``f`` (which
    Linears reading the same input share: count it once per input; sequence parallel: the
    forward gather, the backward re-gather and reduce-scatter); ``'row'`` its ``g``.
    ``stream_bytes`` is accepted for symmetry with the model-level functions and unused: the
    column input is cast to ``dtype_bytes`` before it travels."""
    p = tp
    if p == 1:
        return Traffic()
    if orientation == "column":
        x = tokens * in_features * dtype_bytes
        if sequence_parallel:
            return Traffic(all_gather_bytes(x, p), all_gather_bytes(x, p) + reduce_scatter_bytes(x, p))
        return Traffic(0.0, all_reduce_bytes(x, p))
    if orientation == "row":
        y = tokens * out_features * dtype_bytes
        if sequence_parallel:
            b = all_reduce_bytes(out_features * param_bytes, p) if bias else 0.0
            return Traffic(reduce_scatter_bytes(y, p), all_gather_bytes(y, p) + b)
        return Traffic(all_reduce_bytes(y, p), 0.0)
    raise ValueError(f"orientation={orientation!r}: 'column' or 'row'.")


def tp1d_block_traffic(
    shape: TransformerShape,
    *,
    batch: int,
    seq: int,
    tp: int,
    sequence_parallel: bool = False,
    dtype_bytes: int = 2,
    stream_bytes: int | None = None,
    param_bytes: int = 4,
    experts: int = 0,
) -> Traffic:
    """One transformer block (attention pair + MLP pair), forward + backward, per rank. With
    ``experts`` (E > 0) the MLP is a mixture of E experts whose tokens the tp ranks split
    (``parallel/expert/tokens.py``): each rank routes and runs its share. Forward, the tp shares
    of the balancing statistics (``3E + 2`` float64: counts, drops, tokens, probability sums,
    z-loss) all-reduced (the block's parameter gradients, partial over tp, are summed by the step's
    gradient sync over the data axis times tp: ``axis_traffic.step_traffic``).
    Without sequence parallelism the output all-gathered forward and the input gradient
    all-gathered backward (the ``[T, h]`` residual stream's dtype; ``T`` padded to a multiple
    of tp where the sequence does not divide); with it, the norm's all-gather of the sequence
    forward and the reduce-scatter of its gradient backward (the block returns its shard)."""
    p, h, t = tp, shape.hidden, batch * seq
    if p == 1:
        return Traffic()
    kw = dict(
        tokens=t,
        tp=p,
        sequence_parallel=sequence_parallel,
        dtype_bytes=dtype_bytes,
        stream_bytes=stream_bytes,
        param_bytes=param_bytes,
        bias=shape.linear_bias,
    )
    attn_width = shape.num_heads * shape.head_dim
    if experts:
        if sequence_parallel:
            x = t * h * dtype_bytes
            mlp = Traffic(all_gather_bytes(x, p), reduce_scatter_bytes(x, p))
        else:
            rows = t if seq % p == 0 else -(-t // p) * p  # the token split pads to a multiple of tp
            x = rows * h * (dtype_bytes if stream_bytes is None else stream_bytes)
            mlp = Traffic(all_gather_bytes(x, p), all_gather_bytes(x, p))
        mlp += Traffic(all_reduce_bytes((3 * experts + 2) * 8, p), 0.0)
        out = (
            tp1d_linear_traffic(in_features=h, out_features=attn_width, orientation="column", **kw)
            + tp1d_linear_traffic(in_features=attn_width, out_features=h, orientation="row", **kw)
            + mlp
        )
    else:
        out = (
            tp1d_linear_traffic(in_features=h, out_features=attn_width, orientation="column", **kw)
            + tp1d_linear_traffic(in_features=attn_width, out_features=h, orientation="row", **kw)
            + tp1d_linear_traffic(in_features=h, out_features=shape.ffn_hidden, orientation="column", **kw)
            + tp1d_linear_traffic(in_features=shape.ffn_hidden, out_features=h, orientation="row", **kw)
        )
    k = shape.num_kv_heads
    if k < p and k < shape.num_heads:  # replicated k and v projections: their weight gradients are summed
        kv = k * shape.head_dim * (h + (1 if shape.linear_bias else 0))
        out += Traffic(0.0, 2 * all_reduce_bytes(kv * param_bytes, p))
    if sequence_parallel:  # the two norms' parameters see only this rank's tokens
        out += Traffic(0.0, 2 * all_reduce_bytes(shape.norm_params * param_bytes, p))
    return out


def tp1d_model_traffic(
    shape: TransformerShape,
    *,
    batch: int,
    seq: int,
    tp: int,
    sequence_parallel: bool = False,
    dtype_bytes: int = 2,
    stream_bytes: int | None = None,
    param_bytes: int = 4,
    experts: int = 0,
) -> Traffic:
    """A whole forward + backward: embedding, every block, head and vocab-parallel loss."""
    p, h, t = tp, shape.hidden, batch * seq
    if p == 1:
        return Traffic()
    stream = dtype_bytes if stream_bytes is None else stream_bytes
    out = shape.num_layers * tp1d_block_traffic(
        shape,
        batch=batch,
        seq=seq,
        tp=tp,
        sequence_parallel=sequence_parallel,
        dtype_bytes=dtype_bytes,
        stream_bytes=stream_bytes,
        param_bytes=param_bytes,
        experts=experts,
    )
    out += Traffic(all_reduce_bytes(t * h * param_bytes, p), 0.0)  # vocab-parallel embedding
    out += Traffic(0.0, all_reduce_bytes(t * h * dtype_bytes, p))  # head's f (cast input)
    out += Traffic(all_reduce_bytes(t * 4, p) + all_reduce_bytes(2 * t * 4, p), 0.0)  # loss: max, [target, sumexp]
    if sequence_parallel:  # scatter at the first block (all-gather backward), gather after the last
        out += Traffic(all_gather_bytes(t * h * stream, p), all_gather_bytes(t * h * stream, p))
    return out

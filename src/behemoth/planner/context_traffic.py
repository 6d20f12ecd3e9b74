"""Bytes moved per rank by context parallelism, as the ledger counts them.

Context parallelism (behemoth.parallel.context; the ledger's ``cp`` axis). Per attention
layer, with the heads and rows of one tensor-parallel rank (1D: ``N/tp`` query heads, ``K/tp``
kv heads or one replicated head when ``K < tp``, every row; 2D, 2.5D and 3D: the heads split by
the grid side ``q``, the rows by the grid's other axes, ``tp_attention_split``): Ulysses all-to-alls q/k/v and the output forward and
the inverse pair backward, ``b (s/cp) d (2n + 2 lcm(k, cp))`` elements each way of payload --
Ulysses' ``4 b s h/cp`` for multi-head attention -- ``(cp-1)/cp`` of it on the wire; ring
attention shifts K/V ``cp-1`` times forward, ``2 (cp-1) b (s/cp) h_kv`` elements, and backward
``cp-1`` K/V shifts plus ``cp`` shifts of the dK/dV buffer (fp32 for 16-bit inputs); a shift's
payload is its wire. The exact per-layer counts are ``ulysses_bytes`` / ``ring_bytes`` in
the cores, reused here. The gradient all-reduce then runs over ``dp_cp`` (the data-parallel
formula with ``dp * cp`` ranks). Checked in tests/dist/test_context_parallel.py.
"""

from __future__ import annotations

from ..specs import TransformerShape
from .collectives import Traffic
from .traffic import tp_grid


def _local_heads(num_heads: int, num_kv_heads: int, parts: int) -> tuple[int, int]:
    """Query and kv heads of one tensor-parallel rank whose layout splits the heads ``parts``
    ways (kv heads replicated when K < parts)."""
    return num_heads // parts, (num_kv_heads // parts if num_kv_heads >= parts else 1)


def tp_attention_split(tp: int, tp_mode: str = "1d", tp_depth: int = 1) -> tuple[int, int]:
    """``(head parts, batch parts)``: how tensor parallelism of ``tp_mode`` cuts one attention
    call's operands on each rank. 1D splits the heads ``tp`` ways; 2D (``tp = q*q``) splits
    the heads ``q`` ways and the batch ``q`` ways, 2.5D (``tp = d*q*q``) the heads ``q`` ways and
    the batch ``d*q`` ways, 3D (``tp = q**3``) the heads ``q`` ways and the batch ``q*q`` ways
    (attention runs in the layout between a pair of Linears). Pure."""
    if tp_mode == "1d":
        return tp, 1
    q, d = tp_grid(tp, tp_mode, tp_depth)  # 3D: d = q
    return q, d * q


def cp_attention_traffic(
    mode: str,
    *,
    batch: int,
    seq: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    cp: int,
    dtype_bytes: int = 2,
    wire: bool = True,
) -> Traffic:
    """One context-parallel attention layer (``mode`` 'ulysses' or 'ring'), forward + backward,
    per rank, on the ``cp`` axis. ``batch``: sequences of this rank's data-parallel share;
    ``seq``: the whole sequence; head counts are this rank's (after tensor parallelism);
    ``dtype_bytes``: q/k/v's element size (2 under bf16 autocast). ``wire=False`` gives the
    payload (the ledger's ``bytes``); ring shifts move their payload, so both agree there."""
    if cp == 1:
        return Traffic()
    from ..parallel.context import ring_bytes, ulysses_bytes  # the cores' own exact counts

    if mode == "ulysses":
        one = ulysses_bytes(batch, seq, num_heads, num_kv_heads, head_dim, cp, dtype_bytes, wire=wire)
        return Traffic(float(one), float(one))
    if mode == "ring":
        return Traffic(
            float(ring_bytes(batch, seq, num_kv_heads, head_dim, cp, dtype_bytes)),
            float(ring_bytes(batch, seq, num_kv_heads, head_dim, cp, dtype_bytes, backward=True)),
        )
    raise ValueError(f"cp_mode={mode!r}: 'ulysses' or 'ring'.")


def cp_model_traffic(
    shape: TransformerShape,
    *,
    batch: int,
    seq: int,
    cp: int,
    mode: str,
    tp: int = 1,
    tp_mode: str = "1d",
    tp_depth: int = 1,
    dtype_bytes: int = 2,
    wire: bool = True,
) -> Traffic:
    """A whole forward + backward on the ``cp`` axis: every layer's attention, with the heads and
    the rows of one tensor-parallel rank when ``tp > 1`` (``tp_attention_split``: 1D splits the
    heads; 2D, 2.5D and 3D split the heads by the grid side and ``batch``, the data-parallel
    rank's sequences, by the other grid axes). Nothing else crosses ``cp`` (parameter gradients
    are reduced over ``dp_cp``, and counted with data parallelism)."""
    head_parts, batch_parts = tp_attention_split(tp, tp_mode, tp_depth)
    n, k = _local_heads(shape.num_heads, shape.num_kv_heads, head_parts)
    return shape.num_layers * cp_attention_traffic(
        mode,
        batch=batch // batch_parts,
        seq=seq,
        num_heads=n,
        num_kv_heads=k,
        head_dim=shape.head_dim,
        cp=cp,
        dtype_bytes=dtype_bytes,
        wire=wire,
    )

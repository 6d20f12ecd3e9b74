"""The bytes a block's non-GEMM work moves per token: norms, residual adds, activations, rotary
embeddings and the activations' dtype casts, counted from the models' code
(``models/gpt.py``, ``models/llama.py``) as their operators run under bf16 autocast over fp32
parameters (the residual stream in fp32, each Linear's input cast to bf16 where it is read):

* a **norm** forward: LayerNorm one kernel (read and write the fp32 row, ``8 h``, and its two
  statistics, 8); RMSNorm as written (``pow``, ``mean``, the ``+ eps`` and ``rsqrt`` of the
  statistic, two products: ``28 h + 24``). Backward: LayerNorm one kernel (``12 h + 8``);
  RMSNorm's autograd (the products' and the power's gradients, the mean's expansion, the two
  sums, the two paths into x added: ``96 h + 36``);
* each **Linear input** cast to bf16 (read 4, write 2: ``6 h``; GPT's fused q/k/v reads one,
  Llama's q, k and v three, its gate and up two), and backward each gradient cast back
  (``6 h``) and the gradients of a norm output several Linears read summed in fp32 (``12 h``
  per extra reader);
* the two **residual adds** (the fp32 stream plus a bf16 branch: ``10 h`` each; backward the
  stream's two gradients summed, ``12 h``, and the branch's cast to bf16, ``6 h``);
* the **activation** over the MLP's width ``f``: GELU ``4 f`` (backward ``6 f``); SwiGLU's SiLU
  and product ``10 f`` (backward ``18 f``);
* **rotary embeddings** (no position table, ``max_positions == 0``) of q and k over their
  widths ``hq + hkv``: ``x cos + rotate_half(x) sin`` with fp32 tables promotes q and k to fp32
  (two products, the negation, the concatenation, the sum: ``30`` a channel) and attention's
  autocast casts them back (``6``); backward ``46`` a channel (the products' and the sum's
  gradients in fp32, the concatenation's split, two casts back to bf16, the two paths added); the
  tables themselves, per token over the head dim ``d`` (``42 d + 16`` forward, ``16 d`` of
  broadcast reads backward);
* grouped-query attention (``hkv < hq``): the flash kernel's backward writes each query head's
  dK and dV (``4 (hq - hkv)`` beyond the kv heads' own) and sums them per kv head (read
  ``4 hq``, write ``4 hkv``); the CPU kernel the test counts with does not, so the test checks
  this term by its formula;
* a fused q/k/v's split backward (the three gradients concatenated, ``4 (hq + 2 hkv)``), and
  the Linears' bias gradients (each output's gradient summed over tokens, ``2`` a column).

What runs over the model width (norms, residual adds, input casts, the rotary tables and the
row Linears' biases) is what 1D tensor parallelism without sequence parallelism repeats on every
rank; what runs over heads and the MLP's width every layout splits over tp. The head: the final
norm and the head's input cast per token, and the cross-entropy per logit: serially, the fp32
copy and the log-softmax forward (``14``), the NLL's zeroed gradient, the log-softmax's and the
cast back backward (``22``); vocabulary-parallel (``parallel/tensor/functional.py``), the copy,
max, shift, exp, sum and normalisation forward (``38``), the clone, product and cast back
backward (``22``).

Counted under autocast; other precisions are approximated by scaling (fp32 compute moves twice
the 16-bit bytes). Checked operator by operator against a dispatch-level count of GPT and Llama
blocks in tests/unit/test_planner_elementwise.py. Pure.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..specs import TransformerShape

__all__ = ["ElementwiseBytes", "block_elementwise_bytes", "norm_bytes", "cross_entropy_bytes"]


@dataclass(frozen=True)
class ElementwiseBytes:
    """Bytes per token of one block's non-GEMM work: ``hidden_*`` over the model width (what 1D
    tensor parallelism without sequence parallelism repeats on every rank), ``split_*`` over heads
    and the MLP's width (split over tp by every layout)."""

    hidden_forward: float
    split_forward: float
    hidden_backward: float
    split_backward: float


def norm_bytes(shape: TransformerShape) -> tuple[float, float]:
    """(forward, backward) bytes per token of one norm over the hidden width."""
    h = shape.hidden
    if shape.rms_norm:
        return 28.0 * h + 24.0, 96.0 * h + 36.0
    return 8.0 * h + 8.0, 12.0 * h + 8.0


def _activation_bytes(shape: TransformerShape, f: float) -> tuple[float, float]:
    return (10.0 * f, 18.0 * f) if shape.gated_mlp else (4.0 * f, 6.0 * f)


def block_elementwise_bytes(
    shape: TransformerShape, *, mlp_width: float | None = None, shared_casts: bool = False
) -> ElementwiseBytes:
    """One block's non-GEMM bytes per token (see the module docstring). ``mlp_width``: the
    width the activation runs over per token (a mixture of experts: each expert's width times
    the experts a token visits); default the dense ``ffn_hidden``. ``shared_casts``: the Linears
    that read one norm's output share one cast of it (1D tensor parallelism's
    ``parallel/tensor/region1d.py``), and backward sum their 16-bit input gradients in place
    (``6 h`` per extra reader) before the one cast back."""
    s = shape
    h, d = float(s.hidden), float(s.head_dim)
    hq, hkv = float(s.num_heads * s.head_dim), float(s.num_kv_heads * s.head_dim)
    f = float(s.ffn_hidden if mlp_width is None else mlp_width)
    attn_in = 1 if s.fused_qkv else 3
    mlp_in = 2 if s.gated_mlp else 1
    nf, nb = norm_bytes(s)
    act_f, act_b = _activation_bytes(s, f)
    readers = attn_in - 1 + mlp_in - 1  # Linears beyond the first that read a norm's output
    casts, sums = (2, 6 * h * readers) if shared_casts else (attn_in + mlp_in, 12 * h * readers)
    hidden_f = 2 * nf + 6 * h * casts + 20 * h
    hidden_b = 2 * nb + 6 * h * casts + sums + 36 * h
    split_f, split_b = act_f, act_b
    if s.max_positions == 0:  # rotary embeddings of q and k, and their tables
        split_f += 36 * (hq + hkv)
        split_b += 46 * (hq + hkv)
        hidden_f += 42 * d + 16
        hidden_b += 16 * d
    if hkv < hq:  # grouped-query attention's backward (flash): each q head's dK and dV, summed per kv head
        split_b += 4 * (hq - hkv) + 4 * hq + 4 * hkv
    if s.fused_qkv:
        split_b += 4 * (hq + 2 * hkv)
    if s.linear_bias:
        hidden_b += 2 * 2 * h  # the two row Linears' biases (output width h)
        split_b += 2 * (hq + 2 * hkv) + 2 * f * mlp_in
    return ElementwiseBytes(hidden_f, split_f, hidden_b, split_b)


def cross_entropy_bytes(vocab_parallel: bool) -> tuple[float, float]:
    """(forward, backward) bytes per logit of the loss over 16-bit logits."""
    return (38.0, 22.0) if vocab_parallel else (14.0, 22.0)

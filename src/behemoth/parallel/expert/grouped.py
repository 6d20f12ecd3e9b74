"""Grouped expert GEMMs: a batch of tokens sorted by expert through each expert's SwiGLU.

The tokens of expert e are rows ``offsets[e-1]:offsets[e]`` of ``x_NH``; the experts' fused
weights are ``gate_up [E, 2I, H]`` and ``down [E, H, I]`` (transformers 5's layout, as
:class:`behemoth.models.moe.MoEFeedForward` stores them). Two paths compute the same thing:

* :func:`swiglu_grouped_mm`: ``torch._grouped_mm``, one kernel per projection for all experts
  (the weights passed transposed, as the kernel expects), through :func:`grouped_mm`: an operator
  of behemoth's own, so compiled blocks trace it as one opaque call, which copies an operand that
  does not start on 16 bytes (a check on real addresses) and makes a transposed weight's gradient
  in the weight's own layout (made in the transposed view's, it was copied strided into the
  parameter's gradient: 1.25 ms per projection for an OLMoE layer on an H200). It runs the GEMMs
  in bf16 -- the operands' dtype, or autocast's, the operands then cast once per call as autocast casts them
  for each ``F.linear`` (the casts' backward hands float32 gradients to float32 parameters, as
  autocast's does) -- and runs each expert's rows as a group padded with zero rows to a
  multiple of :data:`GROUP_ROWS` (at least one block, so no group is empty): the padding is
  where the CUDA kernel's 16-byte alignment rules are met whatever the routing, its rows give
  zero outputs and add nothing to the weights' gradients, and it is dropped from the output.
  :func:`pad_groups` is the pure bookkeeping; :func:`~.dispatch.dispatch` can lay its rows
  out padded already (``align``), so the copy here is skipped.
* :func:`swiglu_loop`: a loop over experts with ``F.linear``. An expert with no rows costs
  nothing and its weights get a zero gradient.

:func:`grouped_swiglu` takes the grouped path where :func:`grouped_mm_available` says the fast
kernel runs (a CUDA build with ``torch._grouped_mm``, compute capability 9.0 or more, GEMMs in
bf16, widths H and I multiples of 8) and the loop everywhere else (CPU, float32 or float16 GEMMs).
``torch._grouped_mm`` also runs on CPU builds (a loop of its own), which is how the grouped path
is tested.

Tested in tests/unit/test_expert_dispatch.py (the loop against the serial layer's per-expert
computation) and tests/unit/test_expert_grouped.py (the grouped path against the loop).
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

__all__ = [
    "GROUP_ROWS",
    "GroupEnds",
    "gemm_dtype",
    "group_alignment",
    "grouped_mm",
    "grouped_mm_available",
    "grouped_swiglu",
    "pad_groups",
    "padded_rows",
    "swiglu_grouped_ends",
    "swiglu_grouped_mm",
    "swiglu_loop",
    "to_device",
]

GROUP_ROWS = 16
"""Rows each expert's group is padded to a multiple of on the grouped path (bf16 rows of a
multiple of 8 elements keep every group's start 16-byte aligned, for the forward and for the
weight gradients' grouped GEMM over the same offsets; 16 is also what fp8 kernels ask)."""


def to_device(values: list[int], device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """``values`` as a 1-D tensor on ``device`` without the host waiting: through pinned memory,
    copied without blocking, on a CUDA device (a plain host-to-device copy waits for the stream):
    made pinned at once, one host op and one copy."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def gemm_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the expert GEMMs on ``x`` run in: autocast's where autocast is on for ``x``'s
    device and would cast ``x`` (float32, float16 or bf16, as ``F.linear`` sees it), else ``x``'s."""
    dev = x.device.type
    if torch.is_autocast_enabled(dev) and x.dtype in (torch.float32, torch.float16, torch.bfloat16):
        return torch.get_autocast_dtype(dev)
    return x.dtype


def group_alignment(x: torch.Tensor) -> int:
    """Rows per block the expert groups of rows like ``x`` should be padded to: :data:`GROUP_ROWS`
    where :func:`grouped_swiglu` will take the grouped path on them (device, build and GEMM dtype;
    the weights' widths are not looked at), else 1 (no padding)."""
    return GROUP_ROWS if _fast_kernel(x) else 1


def _fast_kernel(x: torch.Tensor) -> bool:
    if not (hasattr(torch, "_grouped_mm") and x.is_cuda and gemm_dtype(x) == torch.bfloat16):
        return False
    return torch.cuda.get_device_capability(x.device) >= (9, 0)


def grouped_mm_available(x_NH: torch.Tensor, gate_up: torch.Tensor, counts: list[int]) -> bool:
    """Whether :func:`grouped_swiglu` takes the grouped path (:func:`swiglu_grouped_mm`) for these
    operands: the fast kernel for ``x_NH``'s device and GEMM dtype, weights already in bf16 unless
    autocast casts them, and widths H and I multiples of 8 (16-byte rows). Any ``counts``: groups
    not a multiple of :data:`GROUP_ROWS` are padded."""
    if not _fast_kernel(x_NH):
        return False
    if not torch.is_autocast_enabled(x_NH.device.type) and (x_NH.dtype, gate_up.dtype) != (torch.bfloat16,) * 2:
        return False
    return gate_up.shape[-1] % 8 == 0 and gate_up.shape[-2] % 16 == 0


class GroupEnds:
    """Expert groups told by their ends on the device (``ends`` int32 ``[E]``, cumulative rows;
    every group a multiple of :data:`GROUP_ROWS` rows, none empty, the last ending at the last
    row): rows laid out for ``torch._grouped_mm`` already, whose sizes the host never reads
    (:mod:`.local`). :func:`grouped_swiglu` runs them on the grouped path only."""

    def __init__(self, ends: torch.Tensor) -> None:
        self.ends = ends


def grouped_swiglu(
    x_NH: torch.Tensor, counts: list[int] | GroupEnds, gate_up: torch.Tensor, down: torch.Tensor, act=F.silu
) -> torch.Tensor:
    """``y_NH``: rows of expert e (the e-th run of ``counts[e]`` rows) through
    ``down[e](act(gate[e] x) * up[e] x)`` (``act``: SiLU, or a transformers model's
    ``experts.act_fn``); local compute, no communication. The grouped path where
    :func:`grouped_mm_available`, else the loop (see the module docstring); ``counts`` a
    :class:`GroupEnds`: the grouped path (:func:`swiglu_grouped_ends`)."""
    if isinstance(counts, GroupEnds):
        return swiglu_grouped_ends(x_NH, counts.ends, gate_up, down, act)
    if grouped_mm_available(x_NH, gate_up, counts):
        return swiglu_grouped_mm(x_NH, counts, gate_up, down, act)
    return swiglu_loop(x_NH, counts, gate_up, down, act)


def swiglu_loop(
    x_NH: torch.Tensor, counts: list[int], gate_up: torch.Tensor, down: torch.Tensor, act=F.silu
) -> torch.Tensor:
    """:func:`grouped_swiglu` as a loop of ``F.linear`` over the experts with rows. The weights are
    split into experts once (``unbind``: its backward writes every expert's gradient into one
    ``[E, ...]`` tensor, where indexing ``gate_up[e]`` would make a whole zero ``[E, ...]`` gradient
    per expert and sum them)."""
    parts = []
    gate_ups, downs = (gate_up.unbind(0), down.unbind(0)) if any(counts) else ((), ())
    # the rows split once (its backward: one cat; a slice per expert would make a whole zero [N, H]
    # gradient per expert and sum them)
    for e, x_TH in enumerate(x_NH.split(list(counts)) if any(counts) else ()):
        if counts[e]:
            gate_TI, up_TI = F.linear(x_TH, gate_ups[e]).chunk(2, dim=-1)
            parts.append(F.linear(act(gate_TI) * up_TI, downs[e]))
    if not parts:
        # No rows: stay in the graph of the input (the backward must still reach the dispatch's
        # collective) and of the weights (their zero gradient arrives at the same point of the
        # backward as on a rank with rows, so gradient buckets launch in the same order everywhere);
        # in the dtype rows come out in (autocast's, under autocast)
        return (x_NH * 0 + (gate_up.sum() + down.sum()) * 0).to(gemm_dtype(x_NH))
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def pad_groups(counts: list[int], multiple: int) -> tuple[list[int], list[int]]:
    """``(padded, shift)``: each group of ``counts[e]`` rows grown to ``padded[e]`` rows, the
    multiple of ``multiple`` at or above it (an empty group: ``multiple`` rows, so no group is
    empty), and ``shift[e]``: how far group e's rows move when the groups are laid out padded
    (row i of group e, at ``sum(counts[:e]) + i`` unpadded, lands at that plus ``shift[e]``). Pure."""
    padded = [max(multiple, -(-n // multiple) * multiple) for n in counts]
    shift, moved = [], 0
    for n, p in zip(counts, padded):
        shift.append(moved)
        moved += p - n
    return padded, shift


def padded_rows(counts: list[int], shift: list[int], device: torch.device) -> torch.Tensor:
    """Where each of the ``sum(counts)`` rows lands in the padded layout of :func:`pad_groups`."""
    total = sum(counts)
    shift_E, counts_E = to_device(list(shift) + list(counts), device).split([len(shift), len(counts)])
    moved = torch.repeat_interleave(shift_E, counts_E, output_size=total)
    return torch.arange(total, device=device) + moved


class _ContiguousGrad(torch.autograd.Function):
    """Identity forward; backward: the gradient made contiguous (``torch._grouped_mm``'s backward
    takes row- or column-major operands only, and a caller's gradient may be a broadcast)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """``t``, copied where its storage does not start on 16 bytes (a view into a flat buffer can
    start anywhere; the CUDA kernel's loads ask for 16-byte aligned operands)."""
    return t if t.data_ptr() % 16 == 0 else t.clone()


def _grouped_mm(x_NK: torch.Tensor, w_EOK: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``x_NK``'s rows of group e times ``w_EOK[e]`` transposed (``offsets``: the groups' int32
    ends), its operands already in the GEMM dtype: :func:`grouped_mm` (the weights' gradient made
    in their own layout)."""
    return grouped_mm(x_NK, w_EOK.transpose(-2, -1), offsets)


@torch.library.custom_op("behemoth::grouped_mm", mutates_args=())
def grouped_mm(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm(a, b, offs=offsets)`` as one opaque operator of its own, so compiled
    blocks trace it: each operand copied where it does not start on 16 bytes (read from the real
    tensors when it runs), autocast off. ``a`` 2-D rows by groups and ``b`` ``[E, K, O]``
    (differentiable), or both 2-D with the groups along their shared dimension (the weights'
    gradient, ``[E, K, O]``)."""
    with torch.autocast(a.device.type, enabled=False):
        out = torch._grouped_mm(_aligned(a), _aligned(b), offs=offsets)
    # the kernel may pad its output's rows to 16 bytes (a width not a multiple of 8): the compiled
    # graph assumes the contiguous layout the fake below describes
    return out if out.is_contiguous() else out.contiguous()


@grouped_mm.register_fake
def _grouped_mm_fake(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    if b.dim() == 3:
        return a.new_empty(a.shape[0], b.shape[-1])
    return a.new_empty(offsets.shape[0], a.shape[0], b.shape[-1])


def _grouped_mm_save(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _grouped_mm_backward(ctx, grad_NO):
    a_NK, b_EKO, offsets = ctx.saved_tensors
    grad_NO = grad_NO.contiguous()
    grad_a = grouped_mm(grad_NO, b_EKO.transpose(-2, -1), offsets) if ctx.needs_input_grad[0] else None
    grad_b = None
    if ctx.needs_input_grad[1]:
        if b_EKO.stride(-2) == 1:  # a weight [E, O, K] passed transposed: its gradient made in its own layout
            grad_b = grouped_mm(grad_NO.transpose(-2, -1), a_NK, offsets).transpose(-2, -1)
        else:
            grad_b = grouped_mm(a_NK.transpose(-2, -1), grad_NO, offsets)
    return grad_a, grad_b, None


grouped_mm.register_autograd(_grouped_mm_backward, setup_context=_grouped_mm_save)


def swiglu_grouped_mm(
    x_NH: torch.Tensor, counts: list[int], gate_up: torch.Tensor, down: torch.Tensor, act=F.silu
) -> torch.Tensor:
    """:func:`grouped_swiglu` through ``torch._grouped_mm`` (see the module docstring): operands in
    :func:`gemm_dtype`, each expert's group padded to a multiple of :data:`GROUP_ROWS` (unless
    ``counts`` are already such multiples, none zero), the padding dropped from the output."""
    dtype = gemm_dtype(x_NH)
    x_NH, gate_up, down = x_NH.to(dtype), gate_up.to(dtype), down.to(dtype)
    padded, shift = pad_groups(counts, GROUP_ROWS)
    rows = None
    if padded != list(counts):
        rows = padded_rows(counts, shift, x_NH.device)
        x_NH = x_NH.new_zeros(sum(padded), x_NH.shape[-1]).index_copy(0, rows, x_NH)
    offsets = to_device(list(itertools.accumulate(padded)), x_NH.device, torch.int32)
    y_PH = _swiglu_groups(x_NH, offsets, gate_up, down, act)
    return _ContiguousGrad.apply(y_PH if rows is None else y_PH.index_select(0, rows))


def _swiglu_groups(x_NH, ends, gate_up, down, act) -> torch.Tensor:
    gate_PI, up_PI = _grouped_mm(x_NH, gate_up, ends).chunk(2, dim=-1)
    return _grouped_mm(act(gate_PI) * up_PI, down, ends)


def swiglu_grouped_ends(
    x_NH: torch.Tensor, ends: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, act=F.silu
) -> torch.Tensor:
    """:func:`swiglu_grouped_mm` on rows laid out for it already (:class:`GroupEnds`: the groups'
    int32 ends on the device, each group a multiple of :data:`GROUP_ROWS` rows): no padding, no
    host read. Operands in :func:`gemm_dtype`; every row of ``x_NH`` comes out."""
    dtype = gemm_dtype(x_NH)
    x_NH, gate_up, down = x_NH.to(dtype), gate_up.to(dtype), down.to(dtype)
    return _ContiguousGrad.apply(_swiglu_groups(x_NH, ends, gate_up, down, act))

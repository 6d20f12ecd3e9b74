"""Context parallelism: the sequence is split over the ``cp`` mesh axis everywhere except
inside attention, which is one of two exact cores:

* :func:`ulysses_attention` (DeepSpeed-Ulysses, Jacobs et al. 2023, ``ulysses.py``): two
  all-to-alls trade the sequence split for a head split around a local attention;
* :func:`ring_attention` (Ring Attention, Liu et al. 2023, blockwise online softmax,
  ``ring.py``): K/V blocks circulate around the ring, merged by log-sum-exp.

Modules, each depending only on those above it:

================  ================================================================
``layout.py``     which tokens rank ``r`` holds in each mode: split, gather, position
                  ids, validation (pure)
``ulysses.py``    the Ulysses core and its exact byte count
``ring.py``       the ring core (zigzag balance, its own backward ring), byte count
``attention.py``  :func:`context_attention` (either core by mode) as a drop-in for the
                  call a model makes: ``F.scaled_dot_product_attention``
                  (:class:`ContextSDPA`) or a transformers attention function
``style.py``      the style :class:`ContextParallelAttention` (``apply(module, mesh)``)
                  and :func:`parallelize_context`, which applies it to a model's
                  attention modules and returns the :class:`ContextParallelized`
                  record the engine splits batches with
================  ================================================================

The engine does the rest: it splits each batch with :func:`split_sequence` (``dim=1`` for
``[B, S]``), passes :func:`position_ids_for` to the model, and sums the loss over the ``cp``
axis as over ``dp`` (every token lives on exactly one cp rank). Parameter gradients are
partial sums over ``cp`` (each rank saw part of the sequence) and are all-reduced over
``dp_cp``, not just ``dp``.

Tests: ``tests/unit/test_context_layout.py`` (layouts), ``tests/dist/test_context_attention.py``
(the cores against full causal attention), ``tests/dist/test_context_parallel.py`` (whole
models against serial training).
"""

from .attention import CP_ATTENTION_IMPL, ContextSDPA, context_attention, transformers_context_attention
from .layout import (
    MODES,
    check_sequence,
    gather_sequence,
    position_ids_for,
    split_sequence,
    zigzag_chunks,
    zigzag_indices,
)
from .ring import ring_attention, ring_bytes, ring_step_block
from .style import (
    ContextParallelAttention,
    ContextParallelized,
    check_attention_module,
    context_parallel_paused,
    parallelize_context,
)
from .ulysses import ulysses_attention, ulysses_bytes, ulysses_kv_heads

__all__ = [
    "MODES",
    "check_sequence",
    "context_parallel_paused",
    "zigzag_chunks",
    "zigzag_indices",
    "position_ids_for",
    "split_sequence",
    "gather_sequence",
    "ulysses_attention",
    "ulysses_bytes",
    "ulysses_kv_heads",
    "ring_attention",
    "ring_bytes",
    "ring_step_block",
    "context_attention",
    "ContextSDPA",
    "CP_ATTENTION_IMPL",
    "transformers_context_attention",
    "ContextParallelAttention",
    "ContextParallelized",
    "check_attention_module",
    "parallelize_context",
]

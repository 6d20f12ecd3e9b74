"""The only home of collectives in behemoth.

Every collective goes through an :class:`Axis` (one mesh axis's process group, seen from
this rank) and is booked in that axis's :class:`~behemoth.ledger.Ledger` when it is issued:
calls, payload bytes, wire bytes (what a bandwidth-optimal ring algorithm sends per rank)
and blocking time. ``engine.comm_stats()`` reports the ledger, and the tests compare it
with the traffic formulas of :mod:`behemoth.planner.traffic`.

The package, one module per kind of operation (every name is importable from here):

* :mod:`.axis` -- :class:`Axis`, and :class:`AsyncCollective`: the one handle every
  asynchronous call returns (``wait()`` blocks, books the blocked time, returns the result);
* :mod:`.collectives` -- collectives as plain functions, for engine-level work (gradient
  buckets, ZeRO chunks, SUMMA's steps): :func:`all_reduce`, :func:`all_gather`,
  :func:`reduce_scatter`, :func:`broadcast`, :func:`reduce`, :func:`all_to_all`,
  :func:`all_to_all_single` (uneven splits; :func:`all_to_all_rows` when shapes, not data, fix
  the sizes: traced inside compiled code), :func:`all_gather_into`, and
  :func:`all_gather_async`, :func:`reduce_scatter_async`, :func:`all_to_all_single_async` that
  return a handle; the scalar helpers :func:`all_reduce_scalars`, :func:`all_agree`;
* :mod:`.traced` -- what :func:`all_reduce`, :func:`all_gather`, :func:`reduce_scatter` and
  the ``*_async`` forms run inside ``torch.compile``'d code: functional collectives the
  compiler traces (a 2D block with its SUMMA Linears is one graph), each booked in the ledger
  by an op that runs with the graph;
* :mod:`.functional` -- functional collectives for forwards without autograd, traceable by
  ``torch.compile`` (a compiled decode step is one graph, collectives inside):
  :func:`all_reduce_functional`, :func:`all_gather_functional`;
* :mod:`.oneshot` -- :func:`one_shot_all_reduce`: for its duration, the small all-reduces of
  :func:`all_reduce_functional` over an axis run as a symmetric-memory one-shot all-reduce
  (CUDA, one host; elsewhere the usual all-reduce stays);
* :mod:`.functions` -- named autograd Functions for model-level communication, each docstring
  stating the forward and the backward operation (Megatron's f/g mappings and their
  relatives, and :class:`ExchangeWithPeer` over :func:`exchange`);
* :mod:`.p2p` -- point-to-point: :func:`exchange`, :func:`ring_shift_async`,
  :func:`send_async`, :func:`recv_async`.

An axis of size 1 short-circuits every call: one code path for 1 rank and for N.
Other collectives run eagerly even inside ``torch.compile``'d blocks (a graph break): the
ledger's clock readings would otherwise become graph guards and force a recompile on every
call (the functional and traced collectives read no clock and are traced instead).
"""

from ..ledger import AxisTraffic, Ledger
from .axis import AsyncCollective, Axis
from .collectives import (
    all_agree,
    all_gather,
    all_gather_async,
    all_gather_into,
    all_reduce,
    all_reduce_scalars,
    all_to_all,
    all_to_all_rows,
    all_to_all_single,
    all_to_all_single_async,
    broadcast,
    reduce,
    reduce_scatter,
    reduce_scatter_async,
)
from .functional import all_gather_functional, all_reduce_functional
from .functions import (
    AllGatherToAxis,
    AllToAllAxis,
    AllToAllSingleAxis,
    CopyToAxis,
    ExchangeWithPeer,
    GatherFromAxis,
    ReduceFromAxis,
    ReduceScatterToAxis,
    ScatterToAxis,
)
from .oneshot import one_shot_all_reduce
from .p2p import exchange, recv_async, ring_shift_async, send_async

__all__ = [
    "AxisTraffic",  # the ledger classes live in ledger.py, re-exported here
    "Ledger",
    "Axis",
    "AsyncCollective",
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "broadcast",
    "reduce",
    "all_to_all",
    "all_to_all_rows",
    "all_to_all_single",
    "all_to_all_single_async",
    "all_gather_into",
    "all_gather_async",
    "reduce_scatter_async",
    "all_reduce_scalars",
    "all_agree",
    "all_reduce_functional",
    "all_gather_functional",
    "one_shot_all_reduce",
    "CopyToAxis",
    "ReduceFromAxis",
    "GatherFromAxis",
    "ScatterToAxis",
    "AllGatherToAxis",
    "ReduceScatterToAxis",
    "AllToAllAxis",
    "AllToAllSingleAxis",
    "ExchangeWithPeer",
    "exchange",
    "ring_shift_async",
    "send_async",
    "recv_async",
]

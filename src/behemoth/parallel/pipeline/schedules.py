"""Pipeline schedules as data (their simulator lives in simulate.py, which imports this module).

Implements four schedules, one pure function each, chosen by the Plan's name through
:func:`get_schedule`:

=================  ==================================================================
name               function and source
=================  ==================================================================
``"gpipe"``        :func:`gpipe` -- all forwards, then all backwards (GPipe, Huang et
                   al. 2019)
``"1f1b"``         :func:`one_f_one_b` -- warm-up, one-forward-one-backward, cool-down
                   (PipeDream-Flush; Narayanan et al. 2021, Megatron-LM)
``"interleaved"``  :func:`interleaved` -- interleaved 1F1B over ``v`` model chunks per
                   rank (Narayanan et al., SC'21)
``"zero-bubble"``  :func:`zero_bubble` -- ZB-H1: backward split into input-gradient and
                   weight-gradient halves, weight gradients deferred into the cool-down
                   (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024)
=================  ==================================================================

Vocabulary. ``pp`` pipeline ranks, ``m`` micro-batches, ``v`` model chunks per rank. The
model is cut into ``S = pp * v`` *stages*; stage ``s`` is chunk ``s // pp`` of rank
``s % pp`` (so ``s = chunk * pp + rank``). Without interleaving ``v == 1`` and stage ==
rank. Stage 0 holds the embedding, stage ``S - 1`` the head and the loss.

Action semantics. A schedule is ``list[list[Action]]``: for every pipeline rank, the
actions it executes, in order. ``Action(kind, microbatch, chunk)``:

* ``F``  forward of ``microbatch`` through ``chunk``. On the last stage it also computes
  the loss.
* ``B``  full backward (input gradient and weight gradients). On the last stage it starts
  from the loss.
* ``BI`` input-gradient half of the backward (``autograd.grad`` w.r.t. the stage input
  only); it is what the previous stage waits for.
* ``BW`` weight-gradient half; needs the ``BI`` of the same micro-batch and chunk; sends
  nothing.

Every (micro-batch, stage) gets exactly one ``F`` and either one ``B`` or one ``BI`` and
one ``BW``. On every stage the schedules here run forwards, input-gradient backwards and
weight-gradient backwards each in increasing micro-batch order, so weight gradients are
accumulated in the same order by all four schedules.

Communication is *derived*, not listed (:func:`transfers`): an ``F`` of stage ``s > 0``
first receives the activation of stage ``s - 1``, and one of stage ``s < S - 1`` sends its
output to stage ``s + 1`` afterwards; a ``B``/``BI`` of stage ``s < S - 1`` first receives
the output gradient from stage ``s + 1``, and one of stage ``s > 0`` sends the input
gradient to stage ``s - 1`` afterwards. With ``pp == 1`` and ``v > 1`` these hand-offs stay
on one rank. Each ordered pair of ranks and each kind of message (activation, gradient)
is a FIFO channel: :func:`check_schedule` verifies that the receiver consumes the
messages of every channel in the order the sender produces them, so a runtime may match
messages by (peer, kind) in order, with no per-message tag.

Deadlock freedom. :func:`~.simulate.simulate` executes all ranks in order with sends that never
block the sender (``isend``) and receives that wait for their message; it raises on the
first dependency violation or deadlock. A runtime that follows the same rule (post each
receive before its action and wait on it, never wait on a send before the step ends)
cannot hang because of a schedule that :func:`~.simulate.simulate` accepts. Every schedule here is
accepted for every ``pp <= 8, m <= 16, v <= 4`` swept (``m < pp`` included; the tests
sweep ``pp <= 6, m <= 12`` and ``pp = 8, m < 8``), and the simulation is cheap
(O(pp m v) actions) enough to run in ``boost`` for the actual configuration.

Cost model and bubble. With compute times ``t_f``, ``t_b`` (= ``t_bi + t_bw``) and free
communication, GPipe and 1F1B take ``(m + p - 1)(t_f + t_b)`` and every rank idles
``(p - 1)(t_f + t_b)``, so the bubble fraction (idle / (p * makespan)) is exactly
``(p - 1) / (m + p - 1)`` for any ``t_f, t_b``. Interleaving divides the idle time by ``v``
(``v`` chunks each taking ``1/v`` of the times): ``(p - 1) / (v m + p - 1)`` for ``m >= p``.
ZB-H1 idles ``(p - 1)(t_f + t_bi - t_bw)`` per rank when ``m >= p`` and
``t_bw <= min(t_f, t_bi)`` (the paper's regime). With a message latency ``t_comm``, GPipe
adds ``2 (p - 1) t_comm`` to the makespan, but 1F1B (for small ``t_comm``)
``2 t_comm ((p - 1) + floor((m - 1)(p - 1) / p))``: its steady state waits on a round trip
per micro-batch, so the runtime should prefetch receives and overlap sends.

Simulated bubble fractions (``t_f=1, t_b=2, t_bi=t_bw=1``, no comm; interleaved with
``v=2``; checked in tests/unit/test_pipeline_schedules.py):

====  ==  =======  =======  ===========  ===========
  pp   m  gpipe    1f1b     interleaved  zero-bubble
====  ==  =======  =======  ===========  ===========
   2   4  0.2000   0.2000   0.1111       0.0769
   2   8  0.1111   0.1111   0.0588       0.0400
   4   4  0.4286   0.4286   0.2727       0.2000
   4   8  0.2727   0.2727   0.1579       0.1111
====  ==  =======  =======  ===========  ===========

Activation memory (peaks per rank, counted by :func:`~.simulate.simulate`): GPipe holds ``m``
micro-batches, 1F1B and ZB-H1 ``min(pp - rank, m)`` un-backpropagated ones; ZB-H1 also
holds, until their ``BW``, up to ``rank`` micro-batches whose input gradient is done
(weight-gradient inputs only), so at most ``min(pp, m)`` on any rank -- 1F1B's peak on rank
0. Interleaved holds ``min(2 (pp - rank - 1) + (v - 1) g + 1, m v)`` (micro-batch, chunk)
pairs, each ``1/v`` of the rank's layers (``g`` the micro-batch group size, ``pp`` when
``m`` is a multiple of it).

Tested in tests/unit/test_pipeline_schedules.py (pure; no processes).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import NamedTuple

__all__ = [
    "F",
    "B",
    "BI",
    "BW",
    "KINDS",
    "SCHEDULES",
    "Action",
    "Transfer",
    "gpipe",
    "one_f_one_b",
    "interleaved",
    "zero_bubble",
    "get_schedule",
    "make_schedule",
    "stage_of",
    "rank_chunk_of",
    "transfers",
    "check_schedule",
    "check_fifo",
]

F, B, BI, BW = "F", "B", "BI", "BW"
KINDS = (F, B, BI, BW)


class Action(NamedTuple):
    """One unit of work on one pipeline rank: ``kind`` in F, B, BI, BW."""

    kind: str
    microbatch: int
    chunk: int = 0

    def __repr__(self) -> str:
        return f"{self.kind}{self.microbatch}" + (f"c{self.chunk}" if self.chunk else "")


class Transfer(NamedTuple):
    """A message implied by an action: ``kind`` is ``"act"`` (forward) or ``"grad"`` (backward)."""

    kind: str
    microbatch: int
    src_stage: int
    dst_stage: int
    src_rank: int
    dst_rank: int


# -- validation of arguments ---------------------------------------------------------------
def _check_args(name: str, pp: int, m: int, v: int = 1) -> None:
    for arg, value, fix in (
        ("pp", pp, "pp=1 for no pipeline"),
        ("m", m, "at least one micro-batch"),
        ("v", v, "v=1 for one chunk per rank"),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}: {arg}={value!r} must be an integer >= 1 ({fix}).")


# -- the four schedules --------------------------------------------------------------------
def gpipe(pp: int, m: int) -> list[list[Action]]:
    """GPipe: every rank runs all ``m`` forwards, then all ``m`` backwards (micro-batch order).

    Peak activation memory ``m`` micro-batches on every rank; bubble ``(pp-1)/(m+pp-1)``.
    """
    _check_args("gpipe", pp, m)
    return [[Action(F, i) for i in range(m)] + [Action(B, i) for i in range(m)] for _ in range(pp)]


def one_f_one_b(pp: int, m: int) -> list[list[Action]]:
    """1F1B (PipeDream-Flush): rank ``r`` runs ``min(pp - r - 1, m)`` warm-up forwards, then
    alternates one forward and one backward, then drains the remaining backwards.

    Same bubble as GPipe, ``(pp-1)/(m+pp-1)``, but rank ``r`` holds at most ``min(pp - r, m)``
    micro-batches. With ``m <= pp - r - 1`` rank ``r`` is all warm-up (GPipe order): fewer
    micro-batches than stages degenerates gracefully and cannot deadlock.
    """
    _check_args("one_f_one_b", pp, m)
    out = []
    for r in range(pp):
        warmup = min(pp - r - 1, m)
        acts = [Action(F, i) for i in range(warmup)]
        for i in range(m - warmup):
            acts += [Action(F, warmup + i), Action(B, i)]
        acts += [Action(B, i) for i in range(m - warmup, m)]
        out.append(acts)
    return out


def _microbatch_groups(pp: int, m: int) -> list[range]:
    """Micro-batches in groups of ``pp``; a remainder joins the last group (so every group
    has at least ``pp`` members when ``m >= pp``, which keeps the ring of chunks busy)."""
    if m <= pp:
        return [range(m)]
    starts = list(range(0, m - m % pp if m % pp else m, pp))
    return [range(s, starts[i + 1] if i + 1 < len(starts) else m) for i, s in enumerate(starts)]


def interleaved(pp: int, m: int, v: int) -> list[list[Action]]:
    """Megatron's interleaved 1F1B with ``v`` model chunks per rank (``v == 1`` is :func:`one_f_one_b`).

    Forward order on every rank: micro-batches in groups of ``pp``; for each group, chunk 0
    for the group's micro-batches, then chunk 1, ...; the backward order is the same with the
    chunks reversed. Rank ``r`` runs ``w = min(2 (pp - r - 1) + (v - 1) g, m v)`` warm-up
    forwards (``g`` the largest group), then alternates forward and backward, then drains.

    Any ``m >= 1`` works. ``m`` a multiple of ``pp`` is Megatron's case. Otherwise the
    remainder ``m % pp`` joins the last group: a trailing group smaller than ``pp`` would leave
    rank 0 waiting for its own chunk to come around the ring (simulated, that is sometimes
    slower than plain 1F1B), while the merged group costs ``(v-1)(m % pp)`` more warm-up
    forwards of activation memory. Either way, for ``m >= pp`` and free communication every
    rank idles exactly ``(pp-1)(t_f + t_b)/v``, 1F1B's idle time divided by ``v``: bubble
    ``(pp-1)/(v m + pp-1)``. With ``m < pp`` there is a single group of ``m``; the chunk ring
    then idles too, but the bubble is still below 1F1B's.
    """
    _check_args("interleaved", pp, m, v)
    if v == 1:
        return one_f_one_b(pp, m)
    groups = _microbatch_groups(pp, m)
    g = max(len(grp) for grp in groups)
    order = [(mb, c) for grp in groups for c in range(v) for mb in grp]
    fwd = [Action(F, mb, c) for mb, c in order]
    bwd = [Action(B, mb, v - 1 - c) for mb, c in order]
    total = m * v
    out = []
    for r in range(pp):
        warmup = min(2 * (pp - r - 1) + (v - 1) * g, total)
        acts = fwd[:warmup]
        for k in range(total - warmup):
            acts += [fwd[warmup + k], bwd[k]]
        acts += bwd[total - warmup :]
        out.append(acts)
    return out


def zero_bubble(pp: int, m: int) -> list[list[Action]]:
    """ZB-H1: 1F1B with each backward split into ``BI`` then ``BW``; rank ``r`` keeps up to
    ``r`` weight-gradient halves pending and runs them at the end, where 1F1B idles.

    Rank ``r``: ``min(pp - r - 1, m)`` warm-up forwards; then per remaining micro-batch ``F``,
    ``BI`` (and the oldest pending ``BW`` once more than ``r`` are pending); then the remaining
    ``BI`` the same way; then the pending ``BW``. Un-backpropagated micro-batches stay at
    1F1B's ``min(pp - r, m)``; counting those whose ``BW`` is pending, at most ``min(pp, m)``
    on any rank (1F1B's rank-0 peak). Bubble per rank ``(pp-1)(t_f + t_bi - t_bw)`` when
    ``m >= pp`` and ``t_bw <= min(t_f, t_bi)`` (a third of 1F1B's when all three are equal).
    """
    _check_args("zero_bubble", pp, m)
    out = []
    for r in range(pp):
        warmup = min(pp - r - 1, m)
        acts = [Action(F, i) for i in range(warmup)]
        pending: deque[int] = deque()

        def backward(i: int) -> None:
            acts.append(Action(BI, i))
            pending.append(i)
            if len(pending) > r:
                acts.append(Action(BW, pending.popleft()))

        for i in range(m - warmup):
            acts.append(Action(F, warmup + i))
            backward(i)
        for i in range(m - warmup, m):
            backward(i)
        acts += [Action(BW, i) for i in pending]
        out.append(acts)
    return out


SCHEDULES: dict[str, Callable[..., list[list[Action]]]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved": interleaved,
    "zero-bubble": zero_bubble,
}


def get_schedule(name: str) -> Callable[..., list[list[Action]]]:
    """The schedule function for a Plan's ``schedule`` name. ``interleaved`` takes
    ``(pp, m, v)``, the others ``(pp, m)``; :func:`make_schedule` calls either."""
    try:
        return SCHEDULES[name]
    except KeyError:
        raise ValueError(f"unknown pipeline schedule {name!r}; use one of {list(SCHEDULES)}.") from None


def make_schedule(name: str, pp: int, m: int, v: int = 1) -> list[list[Action]]:
    """``get_schedule(name)`` applied to ``pp`` ranks, ``m`` micro-batches, ``v`` chunks per rank."""
    fn = get_schedule(name)
    if name == "interleaved":
        return fn(pp, m, v)
    if v != 1:
        raise ValueError(
            f"schedule {name!r} runs one model chunk per rank; got v={v}. Use schedule='interleaved' for v > 1, or v=1."
        )
    return fn(pp, m)


# -- stages and derived communication ------------------------------------------------------
def stage_of(rank: int, chunk: int, pp: int) -> int:
    """The (virtual) stage of ``chunk`` on ``rank``: ``chunk * pp + rank``."""
    return chunk * pp + rank


def rank_chunk_of(stage: int, pp: int) -> tuple[int, int]:
    """Inverse of :func:`stage_of`: ``(rank, chunk)`` holding ``stage``."""
    return stage % pp, stage // pp


def transfers(action: Action, rank: int, pp: int, v: int) -> tuple[Transfer | None, Transfer | None]:
    """``(receive before, send after)`` implied by ``action`` on ``rank`` (``None`` when none).

    F at stage s: receive activation s-1 -> s (s > 0); send activation s -> s+1 (s < S-1).
    B/BI at stage s: receive gradient s+1 -> s (s < S-1); send gradient s -> s-1 (s > 0).
    BW: nothing. ``src_rank == dst_rank`` (only with ``pp == 1``) is a local hand-off.
    """
    s, last = stage_of(rank, action.chunk, pp), pp * v - 1

    def msg(kind: str, src: int, dst: int) -> Transfer:
        return Transfer(kind, action.microbatch, src, dst, src % pp, dst % pp)

    if action.kind == F:
        return (msg("act", s - 1, s) if s > 0 else None), (msg("act", s, s + 1) if s < last else None)
    if action.kind in (B, BI):
        return (msg("grad", s + 1, s) if s < last else None), (msg("grad", s, s - 1) if s > 0 else None)
    return None, None


# -- static checks -------------------------------------------------------------------------
def check_schedule(actions: Sequence[Sequence[Action]], pp: int, *, fifo: bool = True) -> tuple[int, int]:
    """Check a schedule's structure; return ``(m, v)`` (inferred from the largest indices).

    Raises ``ValueError`` naming the first problem: wrong number of ranks, an unknown kind,
    a (micro-batch, stage) without exactly one F and one B (or one BI and one BW), a rank
    that runs a backward before its own forward (or BW before BI), and with ``fifo`` a
    channel (sender rank, receiver rank, kind) whose messages the receiver consumes in a
    different order than the sender produces them.
    """
    if len(actions) != pp:
        raise ValueError(f"schedule has {len(actions)} rank lists but pp={pp}: give one action list per rank.")
    flat = [a for acts in actions for a in acts]
    for r, acts in enumerate(actions):
        for i, a in enumerate(acts):
            if (
                a.kind not in KINDS
                or not (isinstance(a.microbatch, int) and a.microbatch >= 0)
                or not (isinstance(a.chunk, int) and a.chunk >= 0)
            ):
                raise ValueError(
                    f"rank {r} step {i}: {a!r} is not a valid action; kind must be one of {KINDS}, "
                    f"microbatch and chunk non-negative integers."
                )
    if not flat:
        raise ValueError("schedule is empty: every rank needs at least one forward and one backward.")
    m = 1 + max(a.microbatch for a in flat)
    v = 1 + max(a.chunk for a in flat)
    pos: dict[tuple[str, int, int], tuple[int, int]] = {}  # (kind, mb, stage) -> (rank, index)
    for r, acts in enumerate(actions):
        for i, a in enumerate(acts):
            key = (a.kind, a.microbatch, stage_of(r, a.chunk, pp))
            if key in pos:
                raise ValueError(
                    f"{a!r} (stage {key[2]}) appears twice: rank {pos[key][0]} step {pos[key][1]} and "
                    f"rank {r} step {i}; each (micro-batch, stage) runs each kind once."
                )
            pos[key] = (r, i)
    for mb in range(m):
        for s in range(pp * v):
            r, c = rank_chunk_of(s, pp)
            where = f"micro-batch {mb} at stage {s} (rank {r}, chunk {c})"
            have = {k for k in KINDS if (k, mb, s) in pos}
            if F not in have:
                raise ValueError(f"{where} has no F: every (micro-batch, stage) needs exactly one forward.")
            if have - {F} not in ({B}, {BI, BW}):
                raise ValueError(
                    f"{where} has backward actions {sorted(have - {F})}: it needs exactly one B, or one BI and one BW."
                )
            f_at = pos[(F, mb, s)][1]
            back = pos.get((B, mb, s)) or pos[(BI, mb, s)]
            if back[1] < f_at:
                raise ValueError(
                    f"{where}: rank {r} runs its backward (step {back[1]}) before its forward "
                    f"(step {f_at}); a backward needs the forward's saved activations."
                )
            if (BW, mb, s) in pos and pos[(BW, mb, s)][1] < back[1]:
                raise ValueError(
                    f"{where}: rank {r} runs BW (step {pos[(BW, mb, s)][1]}) before BI "
                    f"(step {back[1]}); the weight gradient needs the output gradient."
                )
    if fifo:
        check_fifo(actions, pp, v)
    return m, v


def check_fifo(actions: Sequence[Sequence[Action]], pp: int, v: int) -> None:
    sent: dict[tuple[int, int, str], list[tuple[int, int]]] = {}
    recvd: dict[tuple[int, int, str], list[tuple[int, int]]] = {}
    for r, acts in enumerate(actions):
        for a in acts:
            recv, send = transfers(a, r, pp, v)
            for t, book in ((recv, recvd), (send, sent)):
                if t is not None and t.src_rank != t.dst_rank:
                    book.setdefault((t.src_rank, t.dst_rank, t.kind), []).append((t.microbatch, t.src_stage))
    for key, order in sent.items():
        if recvd.get(key) != order:
            src, dst, kind = key
            raise ValueError(
                f"channel rank {src} -> rank {dst} ({kind}): rank {src} sends (micro-batch, stage) {order[:8]}... "
                f"but rank {dst} receives {recvd.get(key, [])[:8]}...; a runtime matching messages in order "
                f"would pair them wrongly. Reorder the receiver's actions or tag messages by micro-batch."
            )

"""Point-to-point transfers between pipeline stages, all through ``behemoth.comm``'s ledger.

One process group per channel. A channel is one (sender, receiver, kind) triple of the pp
axis: activations go to the next rank (``i -> i+1 mod pp``), gradients to the previous one
(``i -> i-1 mod pp``), so a pipeline of ``pp >= 3`` has ``2 pp`` channels and one of 2 has
four (0->1 and 1->0, each for activations and gradients). Every channel has its own 2-rank
group (on GPU, its own NCCL communicator and stream) and carries one direction of one
kind only, so the sender's order of sends is the receiver's order of receives
(``schedules.check_schedule`` verifies that FIFO property per (peer, kind) for every
schedule), and a transfer that waits for its receiver delays only later transfers of the
same channel, which that receiver consumes later anyway: no wait between channels can
close a cycle the schedule simulator has not already ruled out.

Why not one group for the pp axis. On NCCL every operation of a communicator runs in issue
order on one stream, and a large send completes only once its receive is posted. With
activations and gradients crossing on one stream, "send activation, then receive gradient"
on one rank against "send gradient, then receive activation" on its peer deadlocks; batching
them (``batch_isend_irecv``) moves the deadlock inside the group, where NCCL may serialise
operations to the same peer (measured: GPT-350M, 1F1B, 2x H200 hung with every send held and
batched with the next receive, which gloo runs fine). NCCL also connects a channel lazily
inside its first call and blocks the host until the peer joins, so :meth:`StageChannels.
connect` opens every channel at build time, in one global order.

Shapes without a per-step handshake: an activation's shape and dtype depend only on the
micro-batch's input shape and the stage that produced it, and every pipeline rank holds
every micro-batch (so all agree on those). The first time a (stage, input shape) pair is
seen, the sender precedes the activation with a 10-integer header (rank, shape, dtype) on
the same channel; both sides cache it, and every later step sends the tensor alone. That
covers every tensor-parallel layout (1D's ``[b, s, h]``, 2D's ``[b/q, s, h/q]``, 2.5D's
``[b/(d q), s, h/q]``, 3D's ``[b/q**2, s, h/q]``: each rank sends its own block to the rank of
the same tp coordinates on the next stage) and autocast dtypes without the stage code having
to predict them. Gradients need no header:
a gradient has the shape and dtype of the activation it belongs to, which its receiver
produced.

A mixture-of-experts model whose balancing loss pools every layer (transformers') also sends,
after each activation and each gradient, the router-loss totals (:meth:`StageChannels.send_terms`,
``E + 1`` float64 values) on the same channel: the FIFO order is kept, as the receiver reads them
right after the tensor they ride with.

Sends are issued as soon as their tensor exists and waited at the end of the step (buffers
kept alive until then). A receive is posted right before the action that needs it and waited
on, bounded by the process group's timeout (``BEHEMOTH_TIMEOUT``): a peer that died or
raised turns into an error here, never a hang.
"""

from __future__ import annotations

import torch

from ... import comm
from ...comm import Axis

__all__ = ["StageChannels", "ACT_TAG", "GRAD_TAG", "pipeline_channels"]

ACT_TAG, GRAD_TAG = 1, 2
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_HEADER = 10


def pipeline_channels(pp: int) -> list[tuple[int, int, int]]:
    """Every ``(sender, receiver, tag)`` channel of a ``pp``-rank pipeline, in one fixed order."""
    if pp < 2:
        return []
    chans = [(i, (i + 1) % pp, ACT_TAG) for i in range(pp)] + [(i, (i - 1) % pp, GRAD_TAG) for i in range(pp)]
    return list(dict.fromkeys(chans))


class StageChannels:
    """Activation and gradient transfers of one pipeline rank (index ``me`` on the pp axis).

    ``links`` maps this rank's channels ``(sender, receiver, tag)`` to 2-member axes whose
    ``ranks`` are ``(sender, receiver)`` in global ranks (``ParallelMesh.channel_axes``), in
    the global creation order."""

    def __init__(self, me: int, links: dict[tuple[int, int, int], Axis], device: torch.device) -> None:
        self.me, self.links, self.device = me, links, device
        self.shapes: dict[tuple, tuple[tuple[int, ...], torch.dtype]] = {}  # (stage, input shape) -> message
        self.pending: list[comm.AsyncCollective] = []  # sends issued, not waited

    def connect(self) -> None:
        """Open every channel (a small and a 4 MiB message, so NCCL sets up the links of both
        its small- and large-message protocols) in the global creation order, so no transfer
        of a step waits on a connection.
        A collective over all pipeline ranks: every rank calls it at build time."""
        for (src, _dst, tag), ax in self.links.items():
            for n in (8, 1 << 20):
                if src == self.me:
                    comm.send_async(torch.zeros(n, device=self.device), ax, 1, tag).wait()
                else:
                    comm.recv_async((n,), torch.float32, ax, 0, tag, self.device).wait()
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()

    def _send(self, t: torch.Tensor, dst: int, tag: int) -> None:
        self.pending.append(comm.send_async(t, self.links[(self.me, dst, tag)], 1, tag))

    def _recv(self, shape, dtype, src: int, tag: int) -> torch.Tensor:
        return comm.recv_async(shape, dtype, self.links[(src, self.me, tag)], 0, tag, self.device).wait()

    def send_activation(self, y: torch.Tensor, src_stage: int, key: tuple, dst_rank: int) -> None:
        """Send stage ``src_stage``'s output ``y`` for a micro-batch of input shape ``key``."""
        if (src_stage, key) not in self.shapes:
            if y.dim() > _HEADER - 2 or y.dtype not in _DTYPES:
                raise ValueError(
                    f"pipeline: stage {src_stage} returned a {y.dim()}-d {y.dtype} tensor; stages "
                    f"exchange tensors of at most {_HEADER - 2} dims in {_DTYPES}."
                )
            header = [y.dim(), *y.shape, *([0] * (_HEADER - 2 - y.dim())), _DTYPES.index(y.dtype)]
            self._send(torch.tensor(header, dtype=torch.int64, device=self.device), dst_rank, ACT_TAG)
            self.shapes[(src_stage, key)] = (tuple(y.shape), y.dtype)
        self._send(y.detach(), dst_rank, ACT_TAG)

    def recv_activation(self, src_stage: int, key: tuple, src_rank: int) -> torch.Tensor:
        """Receive stage ``src_stage``'s output for a micro-batch of input shape ``key``."""
        if (src_stage, key) not in self.shapes:
            h = self._recv((_HEADER,), torch.int64, src_rank, ACT_TAG).tolist()
            self.shapes[(src_stage, key)] = (tuple(h[1 : 1 + h[0]]), _DTYPES[h[-1]])
        shape, dtype = self.shapes[(src_stage, key)]
        return self._recv(shape, dtype, src_rank, ACT_TAG)

    def send_grad(self, g: torch.Tensor, dst_rank: int) -> None:
        self._send(g, dst_rank, GRAD_TAG)

    def recv_grad(self, like: torch.Tensor, src_rank: int) -> torch.Tensor:
        """The gradient of ``like`` (this stage's output) from the next stage."""
        return self._recv(like.shape, like.dtype, src_rank, GRAD_TAG)

    def send_terms(self, t: torch.Tensor, dst_rank: int, backward: bool) -> None:
        """A small float64 vector that rides with the activation (``backward``: the gradient) just
        sent to ``dst_rank``, on the same channel: the router-loss totals of
        :mod:`behemoth.parallel.expert.losses`. Its size is known to both sides, so no header."""
        self._send(t.detach().to(torch.float64), dst_rank, GRAD_TAG if backward else ACT_TAG)

    def recv_terms(self, size: int, src_rank: int, backward: bool) -> torch.Tensor:
        """The ``size`` float64 values :meth:`send_terms` sent after the activation (gradient) just
        received from ``src_rank``."""
        return self._recv((size,), torch.float64, src_rank, GRAD_TAG if backward else ACT_TAG)

    def finish(self) -> None:
        """Wait for every send of the step (their buffers may be freed after this)."""
        for h in self.pending:
            h.wait()
        self.pending = []

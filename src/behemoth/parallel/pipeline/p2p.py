"""Point-to-point transfers between pipeline stages, all through ``comm.py``'s ledger.

Shapes without a per-step handshake: an activation's shape and dtype depend only on the
micro-batch's input shape and the stage that produced it, and every pipeline rank holds
every micro-batch (so all agree on those). The first time a (stage, input shape) pair is
seen, the sender precedes the activation with a 10-integer header (rank, shape, dtype) on
the same channel; both sides cache it, and every later step sends the tensor alone. That
covers every tensor-parallel layout (1D's ``[b, s, h]``, 2D's ``[b/q, s, h/q]``) and
autocast dtypes without the stage code having to predict them. Gradients need no header:
a gradient has the shape and dtype of the activation it belongs to, which its receiver
produced.

Order: messages of one (peer, tag) channel are consumed in send order (``schedules.
check_schedule`` verifies every schedule keeps that FIFO property), activations and
gradients on separate tags. Batching: a send is held until this rank's next receive and
issued with it as one ``comm.exchange_async`` call (one NCCL group: Megatron's
``send_forward_recv_backward``), or at the end of the step. NCCL runs a rank pair's
transfers in issue order on one stream, and unbatched "send activation, then receive
gradient" against "send gradient, then receive activation" would deadlock on messages larger
than its buffers. Holding a send until the next receive delays nothing a peer could wait
for: the actions in between are local compute. Send handles are waited at the end of the
step. A receive is posted right before the action that needs it and waited on, bounded by
the process group's timeout (``BEHEMOTH_TIMEOUT``): a peer that died or raised turns into an
error here, never a hang.
"""
from __future__ import annotations

import torch

from ... import comm
from ...comm import Axis

__all__ = ["StageChannels", "ACT_TAG", "GRAD_TAG"]

ACT_TAG, GRAD_TAG = 1, 2
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_HEADER = 10


class StageChannels:
    """Activation and gradient transfers of one pipeline rank over ``axis`` (pp)."""

    def __init__(self, axis: Axis, device: torch.device) -> None:
        self.axis, self.device = axis, device
        self.shapes: dict[tuple, tuple[tuple[int, ...], torch.dtype]] = {}  # (stage, input shape) -> message
        self.held: list[tuple[torch.Tensor, int, int]] = []   # sends not issued yet
        self.pending: list[comm.AsyncCollective] = []         # sends issued, not waited

    def _recv(self, shape, dtype, src_rank: int, tag: int) -> torch.Tensor:
        sent, got = comm.exchange_async(self.held, (shape, dtype, src_rank, tag), self.axis, self.device)
        self.held = []
        self.pending += sent
        return got.wait()

    def send_activation(self, y: torch.Tensor, src_stage: int, key: tuple, dst_rank: int) -> None:
        """Send stage ``src_stage``'s output ``y`` for a micro-batch of input shape ``key``."""
        if (src_stage, key) not in self.shapes:
            if y.dim() > _HEADER - 2 or y.dtype not in _DTYPES:
                raise ValueError(f"pipeline: stage {src_stage} returned a {y.dim()}-d {y.dtype} tensor; stages "
                                 f"exchange tensors of at most {_HEADER - 2} dims in {_DTYPES}.")
            header = [y.dim(), *y.shape, *([0] * (_HEADER - 2 - y.dim())), _DTYPES.index(y.dtype)]
            self.held.append((torch.tensor(header, dtype=torch.int64, device=self.device), dst_rank, ACT_TAG))
            self.shapes[(src_stage, key)] = (tuple(y.shape), y.dtype)
        self.held.append((y.detach(), dst_rank, ACT_TAG))

    def recv_activation(self, src_stage: int, key: tuple, src_rank: int) -> torch.Tensor:
        """Receive stage ``src_stage``'s output for a micro-batch of input shape ``key``."""
        if (src_stage, key) not in self.shapes:
            h = self._recv((_HEADER,), torch.int64, src_rank, ACT_TAG).tolist()
            self.shapes[(src_stage, key)] = (tuple(h[1:1 + h[0]]), _DTYPES[h[-1]])
        shape, dtype = self.shapes[(src_stage, key)]
        return self._recv(shape, dtype, src_rank, ACT_TAG)

    def send_grad(self, g: torch.Tensor, dst_rank: int) -> None:
        self.held.append((g, dst_rank, GRAD_TAG))

    def recv_grad(self, like: torch.Tensor, src_rank: int) -> torch.Tensor:
        """The gradient of ``like`` (this stage's output) from the next stage."""
        return self._recv(like.shape, like.dtype, src_rank, GRAD_TAG)

    def finish(self) -> None:
        """Issue the sends still held, and wait for every send of the step (buffers free)."""
        if self.held:
            sent, _ = comm.exchange_async(self.held, None, self.axis, self.device)
            self.pending += sent
            self.held = []
        for h in self.pending:
            h.wait()
        self.pending = []

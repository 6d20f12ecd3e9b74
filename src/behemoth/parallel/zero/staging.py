"""Host -> device uploads that change dtype on the host: two alternating pinned staging buffers.

A dtype-converting host->device copy (fp32 host master into a bf16 device copy) makes PyTorch
move the fp32 data into a device temporary and convert it there: twice the bytes over the
link, and a device allocation on whatever stream the copy runs. :class:`PinnedStaging`
converts on the host instead, in the calling thread, into one of two pinned buffers, then
copies that buffer as is on the current stream. A buffer is reused only once its last copy
has run (a CUDA event), so the next conversion overlaps this copy. Used by the chunk store
(:mod:`.store`) from the main thread and from the CPU-update worker (:mod:`.overlap`).
"""

from __future__ import annotations

import threading

import torch

from . import pinned

__all__ = ["PinnedStaging"]


class PinnedStaging:
    """Two pinned buffers of ``numel`` elements, allocated at first use."""

    def __init__(self, numel: int) -> None:
        self.numel = numel
        self._slots: list[list] = []  # [pinned buffer, event of its last copy or None]
        self._turn = 0
        self._lock = threading.Lock()

    def upload(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst`` (device) = ``src`` (host) in ``dst``'s dtype; the copy is queued on the current stream."""
        with self._lock:
            if not self._slots:
                self._slots = [[pinned.empty(self.numel, dst.dtype, True), None] for _ in range(2)]
            slot = self._slots[self._turn]
            self._turn ^= 1
            if slot[1] is not None:
                slot[1].synchronize()
            buf = slot[0][: src.numel()]
            buf.copy_(src)
            dst.copy_(buf, non_blocking=True)
            slot[1] = torch.cuda.Event()
            slot[1].record()

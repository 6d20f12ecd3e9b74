"""A batch as the step executors see it: rows, micro-batches, this rank's row block, the device.

A batch is a tensor, a dict (``input_ids`` and ``labels`` for language models, or whatever a
user's ``loss_fn`` reads), or a tuple/list of them; its rows are the first dim of
``input_ids`` (else of its first tensor). Everything here is local: no communication.
"""

from __future__ import annotations

import torch

__all__ = ["model_inputs", "row_block", "rows", "split_microbatches", "to_device"]


def rows(batch) -> int | None:
    """Rows of a batch: those of ``input_ids``, else of its first tensor."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() else None
    if isinstance(batch, dict):
        if isinstance(batch.get("input_ids"), torch.Tensor):
            return batch["input_ids"].shape[0]
        values = list(batch.values())
    elif isinstance(batch, (tuple, list)):
        values = list(batch)
    else:
        return None
    return next((r for r in map(rows, values) if r is not None), None)


def split_microbatches(batch, m: int) -> list:
    """``m`` micro-batches of equal rows (views; non-tensor entries of a dict repeated)."""
    if m == 1:
        return [batch]
    if isinstance(batch, dict):
        parts = {k: (v.chunk(m, 0) if isinstance(v, torch.Tensor) else [v] * m) for k, v in batch.items()}
        return [{k: parts[k][i] for k in batch} for i in range(m)]
    if isinstance(batch, (tuple, list)):
        cols = [v.chunk(m, 0) for v in batch]
        return [type(batch)(c[i] for c in cols) for i in range(m)]
    return list(batch.chunk(m, 0))


def row_block(micro, parts: int, index: int):
    """Row block ``index`` of ``parts`` of every tensor of ``micro`` whose first dim is its rows
    (ids, labels, masks, position ids...): a view."""
    if parts == 1:
        return micro
    n_rows = rows(micro)
    n = n_rows // parts

    def take(v):
        if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == n_rows:
            return v.narrow(0, index * n, n)
        if isinstance(v, dict):
            return {k: take(x) for k, x in v.items()}
        if isinstance(v, (tuple, list)):
            return type(v)(take(x) for x in v)
        return v

    return take(micro)


def to_device(batch, device: torch.device):
    """Every tensor of ``batch`` on ``device`` (non-blocking copies)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


def model_inputs(micro) -> tuple:
    """The positional arguments of the model's call: ``input_ids`` of a dict batch, else the batch."""
    if isinstance(micro, dict) and "input_ids" in micro:
        return (micro["input_ids"],)
    return micro if isinstance(micro, (tuple, list)) else (micro,)

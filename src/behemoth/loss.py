"""The loss of one micro-batch, as every step executor adds it up.

Default (language models): the *sum* of next-token cross-entropy over the micro-batch's
labelled positions (``labels`` already aligned with the positions, ``-100`` ignored), in fp32;
the engine divides by the global token count, so summed gradients are the serial mean-loss
gradient. With vocabulary-sharded logits the sum goes through the head's
``vocab_parallel_loss_sum`` (no rank builds the full logits). A user's ``loss_fn(outputs,
batch)`` returns a *mean* instead and gets the gathered outputs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

__all__ = ["IGNORE_INDEX", "MicroBatchLoss", "check_shifted_labels", "logits_of", "token_loss_sum"]

IGNORE_INDEX = -100


def logits_of(outputs) -> torch.Tensor:
    """The logits tensor of a model's output (a tensor, or a transformers ModelOutput)."""
    if isinstance(outputs, torch.Tensor):
        return outputs
    logits = getattr(outputs, "logits", None)
    if logits is None and isinstance(outputs, (tuple, list)):
        logits = outputs[0]
    if not isinstance(logits, torch.Tensor):
        raise TypeError(
            f"the model returned {type(outputs).__name__}, which has no logits; pass "
            f"loss_fn=... to bh.boost to compute the loss from it."
        )
    return logits


def check_shifted_labels(input_ids: torch.Tensor, labels: torch.Tensor) -> None:
    """Refuse transformers-style labels (``labels = input_ids``, which transformers shifts inside
    its own loss): here ``logits[:, i]`` meets ``labels[:, i]``, so such a batch would train a
    copy task. Exact: the batch is refused only when every labelled position equals its input
    token and some labelled position i is followed by a different token (shifted labels of one
    stream have ``labels[:, i] = input_ids[:, i + 1]`` there); a row of one repeated token
    reads the same both ways and passes. Local: this rank's rows, no communication."""
    labelled = labels != IGNORE_INDEX
    if not bool(((labels == input_ids) | ~labelled).all()):
        return
    if bool((labelled[:, :-1] & (input_ids[:, 1:] != input_ids[:, :-1])).any()):
        raise ValueError(
            "labels equal input_ids at every labelled position, but labels must be shifted: labels[:, i] is "
            "the token that follows input_ids[:, i] (-100: no loss); as given, the model would learn to copy "
            "its input. For transformers-style batches (labels = input_ids) pass "
            "labels=behemoth.train.data.shift_labels(labels)."
        )


def token_loss_sum(outputs, batch: dict) -> torch.Tensor:
    """Sum of next-token cross-entropy over the batch's labelled positions (fp32)."""
    logits = logits_of(outputs)
    return F.cross_entropy(
        logits.float().flatten(0, -2), batch["labels"].flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )


class MicroBatchLoss:
    """``loss(outputs, micro, local)``: the loss of one micro-batch. ``micro`` is the whole
    micro-batch, ``local`` the part this rank ran the model on (its row block, its share of the
    sequence). ``loss_fn`` (a mean) gets ``micro``, or ``local`` when ``user_gets_local`` (context
    parallelism: the outputs cover this rank's share of the sequence only); the default sum reads
    ``local``'s labels, through ``vocab_head`` when the logits are vocabulary-sharded."""

    def __init__(
        self, loss_fn: Callable | None, vocab_head: torch.nn.Module | None, *, user_gets_local: bool = False
    ) -> None:
        self.loss_fn, self.vocab_head, self.user_gets_local = loss_fn, vocab_head, user_gets_local
        if vocab_head is not None:  # sharded logits for the default loss; a user's loss reads the full ones
            vocab_head.gather_output = loss_fn is not None

    @property
    def is_sum(self) -> bool:
        """True for the default token-loss sum (divided by the global token count), False for a
        user's mean (averaged over micro-batches and data ranks)."""
        return self.loss_fn is None

    def __call__(self, outputs, micro, local) -> torch.Tensor:
        if self.loss_fn is not None:
            return self.loss_fn(outputs, local if self.user_gets_local else micro)
        if self.vocab_head is not None:
            return self.vocab_head.vocab_parallel_loss_sum(logits_of(outputs), local["labels"])
        return token_loss_sum(outputs, local)

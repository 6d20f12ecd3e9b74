"""The decode loop's state on the device, and one decode step as a function of it alone.

A step feeds each row's last token at its position and slot, picks the next tokens
(:class:`~.sampling.Sampler`, its uniform numbers drawn for every step up front), records them,
counts each row's length, marks the rows that produced ``eos_token_id``, and advances the token,
position, slot and step index -- all in place, in tensors allocated once
(:class:`DecodeState`). So a step takes no argument, syncs nothing to the host, and has the same
shapes and addresses every time: ``torch.compile`` traces it into one function and, on GPUs,
inductor replays it as one CUDA graph (:class:`CompiledDecode`, kept on the
model so that later calls of the same shape replay the graphs already recorded). The loop reads
the device's "every row has stopped" flag only every ``stop_check_every`` steps.

No communication of its own. Tested in tests/dist/test_generate_decode.py (tokens of the compiled
step against the serial model's, host syncs, compilations) and tests/dist/test_generate.py.
"""

from __future__ import annotations

import time

import torch

from .sampling import Sampler

__all__ = ["CompiledDecode", "DecodeState", "Decoder", "StepClock"]


class DecodeState:
    """Tensors of one rank's rows (``rows``) that decode steps read and advance in place.

    ``token_B1``: each row's last token; ``pos_B1``: its position; ``slot_1``: the cache slot it
    goes to; ``t_1``: the index of the token to pick next; ``done_B``: rows that stopped (or hold
    no prompt of their own); ``lengths_B``: tokens counted per row; ``tokens_BT``: the picked
    tokens (``pad`` after a row's end); ``uniforms_TB``: the sampler's numbers (None: greedy);
    ``logits_BTV``: the logits of every pick (kept on request, else None)."""

    def __init__(self, rows: int, steps: int, device: torch.device) -> None:
        long = dict(dtype=torch.long, device=device)
        self.token_B1 = torch.zeros(rows, 1, **long)
        self.pos_B1 = torch.zeros(rows, 1, **long)
        self.slot_1 = torch.zeros(1, **long)
        self.t_1 = torch.zeros(1, **long)
        self.done_B = torch.zeros(rows, dtype=torch.bool, device=device)
        self.lengths_B = torch.zeros(rows, **long)
        self.tokens_BT = torch.zeros(rows, steps, **long)
        self.uniforms_TB: torch.Tensor | None = None
        self.logits_BTV: torch.Tensor | None = None
        for t in (self.token_B1, self.pos_B1, self.slot_1, self.t_1, self.done_B, self.lengths_B, self.tokens_BT):
            _static(t)

    def start(self, *, done_B, next_pos_B, prompt: int, pad: int, uniforms_TB) -> None:
        """Reset for a generation: ``done_B`` the rows that hold no prompt, ``next_pos_B`` the
        position of each row's first new token, ``prompt`` the padded prompt length (its first
        slot), ``uniforms_TB`` the sampler's numbers (None: greedy). Keeps no logits until
        :meth:`keep_logits`."""
        self.done_B.copy_(done_B)
        self.pos_B1.copy_(next_pos_B[:, None])
        self.slot_1.fill_(prompt)
        self.t_1.zero_()
        self.lengths_B.zero_()
        self.tokens_BT.fill_(pad)
        self.token_B1.fill_(pad)
        if uniforms_TB is None:
            self.uniforms_TB = None
        elif self.uniforms_TB is not None and self.uniforms_TB.shape == uniforms_TB.shape:
            self.uniforms_TB.copy_(uniforms_TB)
        else:
            self.uniforms_TB = _static(uniforms_TB.clone())
        self.logits_BTV = None

    def keep_logits(self, vocab: int) -> None:
        """Keep the logits of every pick from now on (zeros where no step ran)."""
        self.logits_BTV = _static(torch.zeros(*self.tokens_BT.shape, vocab, device=self.tokens_BT.device))


class Decoder:
    """Picks tokens into a :class:`DecodeState` and runs decode steps with ``step`` (a
    :class:`~.steps.CachedStep` or :class:`~.steps.TransformersStep`); ``block`` takes the rows
    the model's layout feeds this rank out of the tp group's rows."""

    def __init__(self, step, sampler: Sampler, state: DecodeState, *, eos: int | None, pad: int, block) -> None:
        self.step, self.sampler, self.state = step, sampler, state
        self.eos, self.pad, self.block = eos, pad, block

    def choose(self, logits_BV: torch.Tensor) -> None:
        """Pick token ``t`` of every row from ``logits_BV``, record it, advance ``t``."""
        s = self.state
        u_B = None if s.uniforms_TB is None else s.uniforms_TB.index_select(0, s.t_1)[0]
        token_B = self.sampler.pick(logits_BV, u_B).masked_fill(s.done_B, self.pad)
        s.tokens_BT.index_copy_(1, s.t_1, token_B[:, None])
        if s.logits_BTV is not None:
            s.logits_BTV.index_copy_(1, s.t_1, logits_BV[:, None].float())
        s.lengths_B.add_((~s.done_B).long())
        if self.eos is not None:
            s.done_B.logical_or_(token_B == self.eos)
        s.token_B1.copy_(token_B[:, None])
        s.t_1.add_(1)

    def decode(self) -> None:
        """One decode step: the last tokens through the model, then :meth:`choose`."""
        s = self.state
        logits_BV = self.step.decode(self.block(s.token_B1), self.block(s.pos_B1), s.slot_1)
        s.pos_B1.add_(1)
        s.slot_1.add_(1)
        self.choose(logits_BV)


def decode_step(decoder: Decoder) -> None:
    decoder.decode()


GPU_DECODE_OPTIONS = {"triton.cudagraphs": True, "coordinate_descent_tuning": True}
"""inductor's settings for the decode step on a GPU: ``mode="reduce-overhead"``'s CUDA graphs,
and coordinate-descent tuning of the generated kernels, with which inductor also writes a
decode step's matrix-vector products (a few rows by a weight) as its own kernels instead of
calling cuBLAS: Llama-3-8B at batch 1 on one H200, 5.32 -> 4.59 ms a token
(benchmarks/RESULTS.md)."""


class CompiledDecode:
    """The buffers and the compiled decode step of ``bh.generate(..., compile=...)`` for one
    shape, kept on the model between calls: the KV cache and :class:`DecodeState` (their
    addresses stay, so the CUDA graph recorded by an earlier call replays) and the step compiled
    (with inductor on GPUs: :data:`GPU_DECODE_OPTIONS`, CUDA graphs among them). The prefill stays eager:
    it runs once a call, and compiled it would compile again for every prompt length. Another
    shape replaces them."""

    ATTRIBUTE = "_behemoth_compiled_decode"

    def __init__(self, key, cache, state: DecodeState, backend, device: torch.device) -> None:
        self.key, self.cache, self.state = key, cache, state
        graphs = backend == "inductor" and device.type == "cuda"
        self.decode = torch.compile(decode_step, backend=backend, options=GPU_DECODE_OPTIONS if graphs else None)

    @classmethod
    def of(cls, model, key, build):
        """The model's kept instance for ``key``, else a new one from ``build()`` (kept)."""
        kept = model.__dict__.get(cls.ATTRIBUTE)
        if kept is not None and kept.key == key:
            return kept
        model.__dict__.pop(cls.ATTRIBUTE, None)  # free the old buffers first
        kept = build()
        model.__dict__[cls.ATTRIBUTE] = kept
        return kept


class StepClock:
    """Wall time of the prefill and of the decode steps, without a host sync of its own: CUDA
    events on GPUs (read after the loop), the host's clock on CPU (where every op is done when
    it returns)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def spans(self) -> list[float]:
        """Seconds between consecutive marks."""
        if self.cuda:
            self.marks[-1].synchronize()
            return [a.elapsed_time(b) / 1e3 for a, b in zip(self.marks, self.marks[1:])]
        return [b - a for a, b in zip(self.marks, self.marks[1:])]


def _static(t: torch.Tensor) -> torch.Tensor:
    if t.device.type == "cuda":  # written in place: a CUDA graph reads it where it is
        torch._dynamo.mark_static_address(t)
    return t

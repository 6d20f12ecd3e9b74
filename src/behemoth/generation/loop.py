"""``bh.generate``: prefill, then one-token decode steps, on a model parallelized under any plan.

Each rank runs the same loop on the rows its plan gives it, with a static KV cache sharded like
the attention that owns it (:mod:`.cache`):

* **Rows.** The prompts (the same on every rank) are left-padded to one length and, when the
  plan splits the batch, extended with copies of the last row up to a multiple of
  ``dp * batch_parts``; data-parallel rank d takes row block d, and inside its tp group the
  2D / 2.5D / 3D layers take their row block as in training (a batch of 1 under 2D tp = 4 thus
  runs as 2 rows, one a copy whose tokens are dropped).
* **Steps.** Prefill runs the padded prompts through the model once (1D sequence parallelism
  as in training, the prompt padded to a multiple of tp); each decode step feeds one token per
  row at its slot and position (1D sequence parallelism paused: one token cannot be split on
  the sequence). The vocabulary-parallel head gathers its logits, so every rank of a tp group
  holds the logits of all the group's rows and picks the same tokens (:mod:`.sampling`: greedy,
  or seeded draws that do not depend on the plan) with no further communication. Tensor-parallel
  layers run their no-grad forward for the duration (``base.no_grad_forward``; 1D: plain
  Linears and functional collectives; the 2D/2.5D and 3D Linears: weight-stationary for a
  decode step's few tokens, moving activations instead of weight blocks), so a 1D decode step issues
  one all-reduce per row layer and for the embedding and one all-gather of the logits, syncs
  nothing to the host, and ``torch.compile``
  of the model's forward traces it into one graph. The step's token, position, slot and
  bookkeeping live in device tensors advanced in place (:mod:`.decode`), so
  ``generate(compile=True)`` compiles the whole step -- forward, pick, bookkeeping -- once and,
  on GPUs, replays it as one CUDA graph per token.
* **Stop.** A row stops at its ``eos_token_id`` (later tokens are ``pad_token_id``); a tp
  group stops when all its rows have, read from the device every ``stop_check_every`` steps
  (under ZeRO-3 or expert parallelism, whose forward communicates over dp, when every dp rank's
  rows have: one vote per read); steps run past the last row's end change no token. The
  data-parallel ranks then all-gather their rows' tokens over dp.

behemoth's models take the cache through their attention modules' ``kv_cache`` seam;
transformers models (GPT-2, Llama) through their own ``StaticCache`` (``past_key_values``,
``cache_position``), which sizes itself from the first keys it sees, so sharded heads and row
blocks need nothing more.

* **Pipelines.** Every pipeline rank runs the step: the model's pipelined forward carries the
  activations from stage to stage (one send per boundary), each stage's attention modules fill
  their own part of the cache, and the last stage's logits are broadcast over ``pp``
  (:class:`~.steps.StageStep`), so every rank picks the same tokens. Eager only (a compiled step
  is one graph of the whole model).
* **Context parallelism.** Its ranks take rows of their own, as data-parallel ranks do (the rows
  are split over ``dp x cp``), and the attention modules run the model's own attention for the
  duration (:func:`~behemoth.parallel.context.context_parallel_paused`): one token cannot be
  split on the sequence. A capacity that drops assignments per sequence, counted over the cp
  shares of one sequence inside the forward, is refused.

Tested in tests/dist/test_generate.py (tokens equal to transformers' ``generate`` and to a
no-cache serial loop, logits at every step, sampling across plans, KV bytes per rank) and
tests/dist/test_generate_decode.py (a decode step's collectives and host syncs, compiled steps).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from .. import comm
from ..parallel.context import context_parallel_paused
from ..parallel.tensor.base import no_grad_forward
from ..parallel.tensor.tp1d import sequence_parallel_paused
from ..specs import max_seq_len_of
from .cache import KVCache, cached_attentions
from .decode import CompiledDecode, Decoder, DecodeState, StepClock, decode_step
from .prompts import Prompts, left_pad, padded_rows, positions
from .sampling import Sampler, Sampling
from .steps import CachedStep, StageStep, TransformersStep

__all__ = ["generate", "Generation"]


class Generation:
    """What :func:`generate` returns with ``return_logits=True`` or ``return_timing=True``:
    ``tokens`` (as without them); ``logits_BTV``, the fp32 logits each new token was chosen from
    (``[B, T, V]``, T the steps run; a row's entries after its end are undefined; None without
    ``return_logits``); ``cache_bytes``, the KV cache's bytes on this rank; ``prefill_s``, the
    seconds of the prefill (the prompts' forward and the first token's pick); ``decode_s``, the
    seconds of the ``decode_steps`` decode steps after it (``decode_s / decode_steps`` is the
    time per token; both measured on the device's stream, so no step waits for the clock)."""

    def __init__(
        self,
        tokens,
        logits_BTV: torch.Tensor | None,
        cache_bytes: int,
        prefill_s: float = 0.0,
        decode_s: float = 0.0,
        decode_steps: int = 0,
    ) -> None:
        self.tokens, self.logits_BTV, self.cache_bytes = tokens, logits_BTV, cache_bytes
        self.prefill_s, self.decode_s, self.decode_steps = prefill_s, decode_s, decode_steps


def generate(
    model: nn.Module,
    prompts,
    *,
    max_new_tokens: int,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int = 0,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
    attention_mask: torch.Tensor | None = None,
    return_logits: bool = False,
    return_timing: bool = False,
    compile=False,
    stop_check_every: int = 16,
    one_shot_all_reduce: bool = False,
):
    """Continue each prompt by up to ``max_new_tokens`` tokens with ``model`` (serial, or
    parallelized by ``bh.parallelize`` / ``bh.boost`` under any plan; every rank calls it with the
    same arguments).

    ``prompts``: a ``[B, P]`` tensor of token ids (left-padded where ``attention_mask`` is 0) or
    a list of token lists of any lengths. Returns, on every rank, for a tensor the ``[B, P + T]``
    tensor of the prompts followed by the new tokens as transformers' ``generate`` does (T the
    steps run: ``max_new_tokens``, or fewer when every row has stopped), for a list the list of
    each row's new tokens (up to and including its ``eos_token_id``). ``do_sample=False`` is
    greedy; otherwise tokens are drawn after ``temperature``, ``top_k`` and ``top_p`` with the
    draws of ``seed``, identical under every plan. ``pad_token_id`` (default: ``eos_token_id``,
    else 0) fills padding. ``return_logits`` / ``return_timing``: a :class:`Generation` instead.

    ``compile``: False runs the decode steps as they are (a ``torch.compile``'d ``model.forward``
    still compiles); True compiles the whole decode step -- the forward, the pick, the
    bookkeeping -- into one function (inductor; on GPUs replayed as a CUDA graph, its kernels
    tuned, ``decode.GPU_DECODE_OPTIONS``; the prefill stays as it is); a ``torch.compile`` backend (a
    name or a callable) compiles the step with it. A compiled call keeps its KV cache and
    buffers on the model for the next call of the same shape (behemoth's models only).
    ``stop_check_every``: with ``eos_token_id``, how many steps run between two reads of "has
    every row stopped" (each read waits for the device; the tokens do not depend on it).
    ``one_shot_all_reduce``: the tp axis's small all-reduces (a decode step's, up to
    ``comm.oneshot.ONE_SHOT_MAX_BYTES``) run as a symmetric-memory one-shot all-reduce where every
    rank of the axis can (CUDA, one host; :mod:`behemoth.comm.oneshot`), else as usual."""
    sampling = Sampling(do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens!r}: must be an int >= 1.")
    if not isinstance(stop_check_every, int) or stop_check_every < 1:
        raise ValueError(f"stop_check_every={stop_check_every!r}: must be an int >= 1 (1 checks after every step).")
    pad = pad_token_id if pad_token_id is not None else (eos_token_id if eos_token_id is not None else 0)
    run = _Run.of(model)
    prompts_in = prompts
    batch = left_pad(prompts, attention_mask, pad, multiple=run.prompt_multiple)
    _check_length(model, int(batch.valid_BP.sum(-1).max()) + max_new_tokens)
    real_rows = batch.rows
    batch = padded_rows(batch, run.row_split)

    with run.active(one_shot_all_reduce):
        out = run.loop(
            batch,
            real_rows,
            max_new_tokens,
            sampling,
            eos_token_id,
            pad,
            keep=return_logits,
            compile=compile,
            check_every=stop_check_every,
        )
    tokens, lengths = run.gather_rows(out.tokens_BT, real_rows), run.gather_rows(out.lengths_B, real_rows)
    steps = int(lengths.max())
    if isinstance(prompts_in, torch.Tensor):
        result = torch.cat([prompts_in.to(tokens.device).long(), tokens[:, :steps]], 1)
    else:
        result = [row[:n].tolist() for row, n in zip(tokens, lengths.tolist())]
    if not (return_logits or return_timing):
        return result
    logits = run.gather_rows(out.logits_BTV, real_rows)[:, :steps] if return_logits else None
    return Generation(result, logits, out.nbytes, out.prefill_s, out.decode_s, out.decode_steps)


def _check_length(model: nn.Module, needed: int) -> None:
    """Refuse positions past the model's table (the longest prompt plus the new tokens)."""
    config = getattr(model, "config", None)
    try:
        limit = max_seq_len_of(config)
    except (ValueError, AttributeError):
        return
    if needed > limit:
        raise ValueError(
            f"generation needs {needed} positions (the longest prompt plus max_new_tokens), more than the "
            f"model's {limit}; shorten the prompts or lower max_new_tokens."
        )


class _Run:
    """How one rank runs generation for its model and plan."""

    def __init__(self, model: nn.Module, record) -> None:
        self.model, self.record = model, record
        self.pp, self.context = None, None
        if record is not None:
            plan = record.plan
            if plan.cp > 1:
                _check_context(model, plan)
                self.context = record.context
            if plan.pp > 1:
                self.pp = record.mesh.axis("pp")
            self.device = record.device
            self.dp = record.data_axis  # dp, or dp x cp: context parallelism's ranks take rows of their own
            self.parts, self.index = record.batch_parts, record.batch_index
            self.sp = plan.sequence_parallel and plan.tp > 1
            self.prompt_multiple = plan.tp if self.sp else 1
            # ZeRO-3 gathers parameters over dp, experts exchange tokens over ep, inside the forward:
            # the dp ranks then step together
            self.lockstep = (plan.zero == 3 or plan.ep > 1) and self.dp.size > 1
        else:
            self.device = next(model.parameters()).device
            self.dp, self.parts, self.index, self.sp, self.prompt_multiple = None, 1, 0, False, 1
            self.lockstep = False
        self.row_split = self.parts * (self.dp.size if self.dp is not None else 1)

    @classmethod
    def of(cls, model: nn.Module) -> _Run:
        return cls(model, model.__dict__.get("_behemoth_parallelization"))

    @contextlib.contextmanager
    def active(self, one_shot: bool = False):
        """Evaluation mode, no autograd (1D layers: their no-grad forward), the head's logits
        gathered, and (``one_shot``) the tp axis's one-shot all-reduce, for the duration."""
        head = self.record.vocab_head if self.record is not None else None
        gather, training = (head.gather_output if head is not None else None), self.model.training
        tp = self.record.mesh.axis("tp") if self.record is not None and self.record.plan.tp > 1 else None
        context = self.context
        self.model.eval()
        if head is not None:
            head.gather_output = True
        try:
            with (
                torch.no_grad(),
                no_grad_forward(self.model),
                comm.one_shot_all_reduce(tp) if one_shot and tp is not None else contextlib.nullcontext(),
                context_parallel_paused(self.model, context.attention) if context else contextlib.nullcontext(),
            ):
                yield
        finally:
            self.model.train(training)
            if head is not None:
                head.gather_output = gather

    # -------------------------------------------------------------- rows
    def dp_block(self, t: torch.Tensor) -> torch.Tensor:
        if self.dp is None or self.dp.size == 1:
            return t
        n = t.shape[0] // self.dp.size
        return t.narrow(0, self.dp.rank * n, n)

    def tp_block(self, t: torch.Tensor) -> torch.Tensor:
        if self.parts == 1:
            return t
        n = t.shape[0] // self.parts
        return t.narrow(0, self.index * n, n)

    def gather_rows(self, t: torch.Tensor, real_rows: int) -> torch.Tensor:
        if self.dp is not None and self.dp.size > 1:
            t = comm.all_gather(t.contiguous(), self.dp, 0)
        return t[:real_rows].cpu()

    # -------------------------------------------------------------- the loop
    def loop(
        self,
        batch: Prompts,
        real_rows: int,
        max_new: int,
        sampling: Sampling,
        eos,
        pad: int,
        *,
        keep,
        compile,
        check_every,
    ):
        """This rank's rows' tokens ``[b, max_new]``, their counts, their logits (``keep``), the
        cache's bytes and the clock's readings (:class:`_Loop`)."""
        dev = self.device
        ids_BP, valid_BP = self.dp_block(batch.ids_BP).to(dev), self.dp_block(batch.valid_BP).to(dev)
        rows_global = self.dp_block(torch.arange(batch.rows))
        B, P = ids_BP.shape
        real = rows_global < real_rows
        sampler = Sampler(sampling, real_rows, rows_global)
        valid_bP = self.tp_block(valid_BP)
        if compile and self.pp is not None:
            raise ValueError(
                f"generate(compile=...) compiles one decode step of the whole model; under pipeline parallelism "
                f"(pp={self.pp.size}) a step runs stage by stage with sends between them. Pass compile=False "
                f"(each stage's blocks may still be torch.compile'd), or load the checkpoint under pp=1 to compile."
            )
        if compile:
            compiled = self._compiled(valid_bP, B, P + max_new, max_new, compile)
            step, state = CachedStep(self.model, compiled.cache), compiled.state
            decode = compiled.decode
        else:
            step, state = self._step_fn(valid_bP, P + max_new), DecodeState(B, max_new, dev)
            decode = decode_step
            if self.pp is not None:  # the last stage's logits, on every pipeline rank
                step = StageStep(step, self.pp, self.pp.size - 1)
        state.start(
            done_B=~real.to(dev),
            next_pos_B=valid_BP.long().sum(-1),
            prompt=P,
            pad=pad,
            uniforms_TB=sampler.draws(max_new, dev),
        )
        decoder = Decoder(step, sampler, state, eos=eos, pad=pad, block=self.tp_block)
        clock = StepClock(dev)
        steps = 1
        with step.attached():
            clock.mark()
            logits_BV = step(self.tp_block(ids_BP), self.tp_block(positions(valid_BP)), 0)
            if keep:
                state.keep_logits(logits_BV.shape[-1])
            decoder.choose(logits_BV)
            clock.mark()
            step.follow(state.slot_1)
            # one token cannot be split on the sequence: sequence parallelism pauses for the decode steps
            with sequence_parallel_paused(self.model) if self.sp else contextlib.nullcontext():
                for t in range(1, max_new):
                    if eos is not None and t % check_every == 0 and self._finished(state.done_B):
                        break
                    decode(decoder)
                    steps += 1
            clock.mark()
        prefill_s, decode_s = clock.spans()
        logits = state.logits_BTV if keep else torch.zeros(B, 0, 0, device=dev)
        # a compiled call's buffers serve the next call: hand out copies
        return _Loop(
            state.tokens_BT.clone(), state.lengths_B.clone(), logits, step.nbytes, prefill_s, decode_s, steps - 1
        )

    def _finished(self, done_B: torch.Tensor) -> bool:
        """Whether every row has stopped (one host read; under ZeRO-3 or experts every dp rank's rows, one vote)."""
        finished = bool(done_B.all())
        if self.lockstep:
            finished = comm.all_agree(finished, self.dp)
        return finished

    def _step_fn(self, valid_bP: torch.Tensor, length: int):
        attentions = cached_attentions(self.model)
        if attentions:
            dtype = next(self.model.parameters()).dtype
            return CachedStep(self.model, KVCache(attentions, valid_bP, length, dtype=dtype, device=self.device))
        if hasattr(getattr(self.model, "config", None), "num_hidden_layers"):
            return TransformersStep(self.model, valid_bP, length)
        raise ValueError(
            f"{type(self.model).__name__} has no attention module with a kv_cache seam (behemoth's GPT and Llama) "
            f"and is not a transformers model; generation cannot cache its keys and values."
        )

    def _compiled(self, valid_bP: torch.Tensor, rows: int, length: int, max_new: int, compile) -> CompiledDecode:
        """The model's kept :class:`CompiledDecode` for this shape (a new one for another)."""
        attentions = cached_attentions(self.model)
        if not attentions:
            raise ValueError(
                f"generate(compile=...) compiles the decode step of behemoth's models (their attention's kv_cache "
                f"seam); {type(self.model).__name__} has none. Pass compile=False, and torch.compile the model's "
                f"forward instead if you want it compiled."
            )
        backend = "inductor" if compile is True else compile
        dtype = next(self.model.parameters()).dtype
        key = (tuple(valid_bP.shape), rows, length, max_new, dtype, self.device, backend)

        def build() -> CompiledDecode:
            cache = KVCache(attentions, valid_bP, length, dtype=dtype, device=self.device)
            return CompiledDecode(key, cache, DecodeState(rows, max_new, self.device), backend, self.device)

        compiled = CompiledDecode.of(self.model, key, build)
        compiled.cache.reset(valid_bP)
        return compiled


def _check_context(model: nn.Module, plan) -> None:
    """Under context parallelism generation splits the rows over ``dp x cp`` (whole rows a rank,
    attention as the model's own); a capacity that drops assignments per sequence gathers its
    sequences over ``cp`` inside the forward, which whole rows do not allow."""
    if any(getattr(m, "capacity_factor", None) is not None for m in model.modules()):
        raise ValueError(
            f"generation under context parallelism (cp={plan.cp}) gives each cp rank whole rows, but the model's "
            f"experts have a capacity (capacity_factor), whose drops are counted over the cp ranks' shares of one "
            f"sequence. Load the checkpoint under a plan with cp=1 to generate."
        )


class _Loop:
    """What :meth:`_Run.loop` hands back."""

    def __init__(self, tokens_BT, lengths_B, logits_BTV, nbytes, prefill_s, decode_s, decode_steps) -> None:
        self.tokens_BT, self.lengths_B, self.logits_BTV, self.nbytes = tokens_BT, lengths_B, logits_BTV, nbytes
        self.prefill_s, self.decode_s, self.decode_steps = prefill_s, decode_s, decode_steps

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
  or seeded draws that do not depend on the plan) with no further communication. 1D layers
  run their no-grad forward for the duration (``tp1d.no_grad_forward``: plain Linears and
  functional collectives), so a decode step issues one all-reduce per row layer and for the
  embedding and one all-gather of the logits, syncs nothing to the host (without
  ``eos_token_id``), and ``torch.compile`` of the model's forward traces it into one graph.
* **Stop.** A row stops at its ``eos_token_id`` (later tokens are ``pad_token_id``); a tp
  group stops when all its rows have (under ZeRO-3 or expert parallelism, whose forward
  communicates over dp, when every dp rank's rows have: one vote per step); the data-parallel
  ranks then all-gather their rows' tokens over dp.

behemoth's models take the cache through their attention modules' ``kv_cache`` seam;
transformers models (GPT-2, Llama) through their own ``StaticCache`` (``past_key_values``,
``cache_position``), which sizes itself from the first keys it sees, so sharded heads and row
blocks need nothing more. Pipeline and context parallelism are refused.

Tested in tests/dist/test_generate.py (tokens equal to transformers' ``generate`` and to a
no-cache serial loop, logits at every step, sampling across plans, KV bytes per rank).
"""

from __future__ import annotations

import contextlib
import inspect

import torch
from torch import nn

from .. import comm
from ..parallel.tensor.tp1d import no_grad_forward, sequence_parallel_paused
from ..specs import max_seq_len_of
from .cache import KVCache, cached_attentions
from .prompts import Prompts, left_pad, padded_rows, positions
from .sampling import Sampler, Sampling

__all__ = ["generate", "Generation"]


class Generation:
    """What :func:`generate` returns with ``return_logits=True``: ``tokens`` (as without it) and
    ``logits_BTV``, the fp32 logits each new token was chosen from (``[B, T, V]``, T the steps
    run; a row's entries after its end are undefined), and ``cache_bytes``, the KV cache's bytes
    on this rank."""

    def __init__(self, tokens, logits_BTV: torch.Tensor, cache_bytes: int) -> None:
        self.tokens, self.logits_BTV, self.cache_bytes = tokens, logits_BTV, cache_bytes


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
):
    """Continue each prompt by up to ``max_new_tokens`` tokens with ``model`` (serial, or
    parallelized by ``bh.parallelize`` / ``bh.boost`` under any plan without pp or cp; every rank
    calls it with the same arguments).

    ``prompts``: a ``[B, P]`` tensor of token ids (left-padded where ``attention_mask`` is 0) or
    a list of token lists of any lengths. Returns, on every rank, for a tensor the ``[B, P + T]``
    tensor of the prompts followed by the new tokens as transformers' ``generate`` does (T the
    steps run: ``max_new_tokens``, or fewer when every row has stopped), for a list the list of
    each row's new tokens (up to and including its ``eos_token_id``). ``do_sample=False`` is
    greedy; otherwise tokens are drawn after ``temperature``, ``top_k`` and ``top_p`` with the
    draws of ``seed``, identical under every plan. ``pad_token_id`` (default: ``eos_token_id``,
    else 0) fills padding. ``return_logits``: a :class:`Generation` instead."""
    sampling = Sampling(do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens!r}: must be an int >= 1.")
    pad = pad_token_id if pad_token_id is not None else (eos_token_id if eos_token_id is not None else 0)
    run = _Run.of(model)
    prompts_in = prompts
    batch = left_pad(prompts, attention_mask, pad, multiple=run.prompt_multiple)
    _check_length(model, int(batch.valid_BP.sum(-1).max()) + max_new_tokens)
    real_rows = batch.rows
    batch = padded_rows(batch, run.row_split)

    with run.active():
        tokens_bT, lengths_b, logits_bTV, nbytes = run.loop(
            batch, real_rows, max_new_tokens, sampling, eos_token_id, pad, return_logits
        )
    tokens, lengths = run.gather_rows(tokens_bT, real_rows), run.gather_rows(lengths_b, real_rows)
    steps = int(lengths.max())
    if isinstance(prompts_in, torch.Tensor):
        out = torch.cat([prompts_in.to(tokens.device).long(), tokens[:, :steps]], 1)
    else:
        out = [row[:n].tolist() for row, n in zip(tokens, lengths.tolist())]
    if return_logits:
        return Generation(out, run.gather_rows(logits_bTV, real_rows)[:, :steps], nbytes)
    return out


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
        if record is not None:
            plan = record.plan
            if plan.pp > 1 or plan.cp > 1:
                raise ValueError(
                    f"generation runs under data and tensor parallelism; the plan has pp={plan.pp}, cp={plan.cp}. "
                    f"Load the checkpoint under a plan with pp=1 and cp=1 (any dp and tp) to generate."
                )
            self.device = record.device
            self.dp = record.mesh.axis("dp")
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
    def active(self):
        """Evaluation mode, no autograd (1D layers: their no-grad forward), the head's logits
        gathered, for the duration."""
        head = self.record.vocab_head if self.record is not None else None
        gather, training = (head.gather_output if head is not None else None), self.model.training
        self.model.eval()
        if head is not None:
            head.gather_output = True
        try:
            with torch.no_grad(), no_grad_forward(self.model):
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
    def loop(self, batch: Prompts, real_rows: int, max_new: int, sampling: Sampling, eos, pad: int, keep: bool):
        """This rank's rows' tokens ``[b, max_new]``, their counts, their logits (``keep``) and the cache's bytes."""
        dev = self.device
        ids_BP, valid_BP = self.dp_block(batch.ids_BP).to(dev), self.dp_block(batch.valid_BP).to(dev)
        rows_global = self.dp_block(torch.arange(batch.rows))
        B, P = ids_BP.shape
        real = rows_global < real_rows
        sampler = Sampler(sampling, real_rows, rows_global)
        step = self._step_fn(self.tp_block(valid_BP), P + max_new)
        pos_BP = positions(valid_BP)
        next_pos_B = valid_BP.long().sum(-1)

        tokens_BT = torch.full((B, max_new), pad, dtype=torch.long, device=dev)
        lengths_B = torch.zeros(B, dtype=torch.long, device=dev)
        done_B = ~real.to(dev)
        kept: list[torch.Tensor] = []
        with step.attached():
            logits_BV = step(self.tp_block(ids_BP), self.tp_block(pos_BP), 0)
            for t in range(max_new):
                if t > 0:
                    with sequence_parallel_paused(self.model) if self.sp else contextlib.nullcontext():
                        logits_BV = step(
                            self.tp_block(tokens_BT[:, t - 1 : t]),
                            self.tp_block((next_pos_B + t - 1)[:, None]),
                            P + t - 1,
                        )
                if keep:
                    kept.append(logits_BV)
                token_B = sampler(logits_BV).masked_fill(done_B, pad)
                tokens_BT[:, t] = token_B
                lengths_B += (~done_B).long()
                if eos is None:
                    continue  # no row stops early: no host sync per step
                done_B |= token_B == eos
                finished = bool(done_B.all())
                if self.lockstep:
                    finished = comm.all_agree(finished, self.dp)
                if finished:
                    break
        logits = torch.stack(kept, 1) if kept else torch.zeros(B, 0, 0, device=dev)
        if kept and logits.shape[1] < max_new:
            logits = torch.cat([logits, logits.new_zeros(B, max_new - logits.shape[1], logits.shape[2])], 1)
        return tokens_BT, lengths_B, logits, step.nbytes

    def _step_fn(self, valid_bP: torch.Tensor, length: int):
        attentions = cached_attentions(self.model)
        if attentions:
            return _CachedStep(self.model, attentions, valid_bP, length, self.device)
        if hasattr(getattr(self.model, "config", None), "num_hidden_layers"):
            return _TransformersStep(self.model, valid_bP, length)
        raise ValueError(
            f"{type(self.model).__name__} has no attention module with a kv_cache seam (behemoth's GPT and Llama) "
            f"and is not a transformers model; generation cannot cache its keys and values."
        )


class _CachedStep:
    """One forward of a behemoth model with its :class:`~.cache.KVCache`; returns the last
    position's fp32 logits of the tp group's rows."""

    def __init__(self, model, attentions, valid_bP, length, device) -> None:
        dtype = next(model.parameters()).dtype
        self.model = model
        self.cache = KVCache(attentions, valid_bP, length, dtype=dtype, device=device)

    @property
    def nbytes(self) -> int:
        return self.cache.nbytes

    def attached(self):
        return self.cache.attached()

    def __call__(self, ids_bS, pos_bS, start: int) -> torch.Tensor:
        """Logits of the last position of ``ids_bS``, written into slots ``start, start + 1, ...``."""
        self.cache.begin(torch.arange(start, start + ids_bS.shape[1], device=ids_bS.device))
        out = self.model(ids_bS, pos_bS, logits_to_keep=1)
        return _logits(out)[:, -1].float()


class _TransformersStep:
    """One forward of a transformers model with its own ``StaticCache``."""

    def __init__(self, model, valid_bP, length) -> None:
        from transformers import StaticCache

        self.model = model
        self.cache = StaticCache(config=model.config, max_cache_len=length)
        mask = torch.ones(valid_bP.shape[0], length, dtype=torch.long, device=valid_bP.device)
        mask[:, : valid_bP.shape[1]] = valid_bP.long()
        self.mask_bL = mask
        # transformers renamed ``past_key_values`` to ``cache``; pass the name this version reads
        params = inspect.signature(model.forward).parameters
        self.cache_arg = "cache" if "cache" in params else "past_key_values"

    @property
    def nbytes(self) -> int:
        return sum(
            t.numel() * t.element_size()
            for layer in self.cache.layers
            if getattr(layer, "is_initialized", False)
            for t in (layer.keys, layer.values)
        )

    def attached(self):
        return contextlib.nullcontext()

    def __call__(self, ids_bS, pos_bS, start: int) -> torch.Tensor:
        end = start + ids_bS.shape[1]
        slots_S = torch.arange(start, end, device=ids_bS.device)
        out = self.model(
            input_ids=ids_bS,
            attention_mask=self.mask_bL[:, :end],
            position_ids=pos_bS,
            cache_position=slots_S,
            use_cache=True,
            logits_to_keep=1,
            **{self.cache_arg: self.cache},
        )
        return _logits(out)[:, -1].float()


def _logits(out) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out.logits

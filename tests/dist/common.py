"""Shared pieces of the multi-process parity tests: tiny models of every supported family,
deterministic global batches, and the serial reference that every plan must match.

Each spawned world runs many scenarios in one go (process start-up costs seconds on two
cores). A scenario failure raises AssertionError inside the child; bh.spawn turns it
into a test failure with the child's traceback.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import os
from collections import Counter
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import behemoth as bh

VOCAB, SEQ = 96, 16


def build(family: str, seed: int = 0, dropout: float = 0.0, num_layers: int = 2) -> torch.nn.Module:
    """A tiny model of ``family``, identical for the same seed in every process (``hf-llama-kv1``:
    transformers' Llama with one kv head)."""
    if family == "gpt":
        from behemoth.models import GPT, GPTConfig

        return GPT(
            GPTConfig(
                vocab_size=VOCAB, seq_len=SEQ, num_layers=num_layers, num_heads=4, hidden=32, dropout=dropout, seed=seed
            )
        )
    if family == "llama":
        from behemoth.models import Llama, LlamaConfig

        return Llama(
            LlamaConfig(
                vocab_size=VOCAB, seq_len=SEQ, num_layers=num_layers, num_heads=4, num_kv_heads=2, hidden=32, seed=seed
            )
        )
    torch.manual_seed(seed)
    if family == "hf-gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(
            vocab_size=VOCAB,
            n_positions=SEQ,
            n_embd=32,
            n_layer=num_layers,
            n_head=4,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=0,
            eos_token_id=0,
        )
        return GPT2LMHeadModel(cfg)
    if family in ("hf-llama", "hf-llama-kv1"):
        from transformers import LlamaConfig as HFLlamaConfig
        from transformers import LlamaForCausalLM

        cfg = HFLlamaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=num_layers,
            num_attention_heads=4,
            num_key_value_heads=1 if family == "hf-llama-kv1" else 2,
            max_position_embeddings=SEQ,
        )
        return LlamaForCausalLM(cfg)
    raise ValueError(family)


def moe_llama_config(**fields):
    """behemoth's tiny mixture-of-experts Llama config (2 layers, 4 heads over 2 kv heads, hidden
    32, 4 experts of width 24, top-2); ``fields`` add to or override it."""
    from behemoth.models import LlamaConfig

    shape = dict(
        vocab_size=VOCAB,
        seq_len=SEQ,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        hidden=32,
        num_experts=4,
        experts_top_k=2,
        expert_ffn_hidden=24,
    )
    return LlamaConfig(**{**shape, **fields})


def build_hf_moe(family: str, **config) -> torch.nn.Module:
    """A tiny transformers mixture of experts -- ``family``: mixtral, qwen3-moe or olmoe -- the
    same on every call; ``config`` adds to or overrides its config's fields."""
    from transformers import (
        MixtralConfig,
        MixtralForCausalLM,
        OlmoeConfig,
        OlmoeForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    torch.manual_seed(0)
    common = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=SEQ,
        pad_token_id=0,
        bos_token_id=0,
        eos_token_id=0,
    )
    if family == "mixtral":
        shape = dict(intermediate_size=24, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)
        return MixtralForCausalLM(MixtralConfig(**{**common, **shape, **config}))
    if family == "qwen3-moe":
        shape = dict(
            intermediate_size=48,
            moe_intermediate_size=24,
            num_key_value_heads=2,
            head_dim=8,
            num_experts=4,
            num_experts_per_tok=2,
            mlp_only_layers=[0],
        )
        return Qwen3MoeForCausalLM(Qwen3MoeConfig(**{**common, **shape, **config}))
    if family == "olmoe":
        shape = dict(intermediate_size=16, num_key_value_heads=4, num_experts=8, num_experts_per_tok=4)
        return OlmoeForCausalLM(OlmoeConfig(**{**common, **shape, **config}))
    raise ValueError(family)


def make_optimizer(name: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    """AdamW's eps is 1e-5 (not 1e-8): a gradient element's rounding error d, which differs with
    the order of summation, moves its update by up to lr * d / eps. With eps 1e-6 a d of 6e-9 in
    a near-zero gradient (a tied embedding row under pp = 4) moved a weight by 1.8e-5, past the
    parity tolerance on one CPU type; with 1e-5 that bound is 10x smaller, and gradients above
    1e-4 -- nearly all -- still take lr-sized steps, so a wrong gradient still shows."""
    if name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, eps=1e-5)
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    raise ValueError(name)


def global_batches(num_steps: int, batch: int, seed: int = 1234) -> list[dict]:
    """Deterministic global batches; some labels are -100 (ignored), unevenly per row so
    the global-token mean differs from a mean of per-rank means."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(num_steps):
        x = torch.randint(0, VOCAB, (batch, SEQ + 1), generator=g)
        labels = x[:, 1:].clone()
        mask = torch.rand(batch, SEQ, generator=g) < torch.linspace(0.0, 0.5, batch)[:, None]
        labels[mask] = -100
        out.append({"input_ids": x[:, :-1].contiguous(), "labels": labels})
    return out


def full_label_batches(num_steps: int, batch: int, seed: int = 4321) -> list[dict]:
    """Deterministic global batches with every label counted (no -100): a user loss_fn's mean
    per micro-batch then averages to the serial mean."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(num_steps):
        x = torch.randint(0, VOCAB, (batch, SEQ + 1), generator=g)
        out.append({"input_ids": x[:, :-1].contiguous(), "labels": x[:, 1:].contiguous()})
    return out


def shard(batch: dict, rank: int, size: int) -> dict:
    return {k: v.chunk(size, 0)[rank].contiguous() for k, v in batch.items()}


def serial_loss(model: torch.nn.Module, batch: dict, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The serial model's mean token loss on ``batch``, its forward under CPU autocast to ``dtype``."""
    ctx = torch.autocast("cpu", dtype=dtype) if dtype else torch.autocast("cpu", enabled=False)
    with ctx:
        out = model(batch["input_ids"])
    logits = out if isinstance(out, torch.Tensor) else out.logits
    return F.cross_entropy(logits.float().flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)


@dataclass
class SerialRun:
    """What plain single-process PyTorch did on the global batches: the reference."""

    losses: list[float]
    state: dict
    grad_norms: list[float]
    """Each step's total gradient 2-norm before clipping: ``clip_grad_norm_``'s return value
    (``get_total_norm`` of the same gradients when not clipping)."""


def train_serially(model, opt, batches, dtype=None, router_loss: bool = False):
    """Plain PyTorch on the global batches (a model returning logits, or an output with
    ``.logits``; cross-entropy over the shifted labels, clipped at 1.0): losses, state, pre-clip
    gradient norms. ``dtype``: the forward under CPU autocast to it; ``router_loss``: a
    transformers MoE model's ``router_aux_loss_coef * outputs.aux_loss`` added to the loss."""
    losses, norms = [], []
    for b in batches:
        with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
            out = model(b["input_ids"])
        logits = out if isinstance(out, torch.Tensor) else out.logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), b["labels"].flatten(), ignore_index=-100)
        if router_loss:
            loss = loss + model.config.router_aux_loss_coef * out.aux_loss
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, norms


def serial_run(
    family: str,
    opt_name: str,
    batches: list[dict],
    *,
    max_grad_norm=None,
    precision: str = "fp32",
    seed: int = 0,
    num_layers: int = 2,
) -> SerialRun:
    """Plain single-process PyTorch: the reference every plan must reproduce."""
    model = build(family, seed, num_layers=num_layers)
    opt = make_optimizer(opt_name, model)
    losses, norms = [], []
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    for b in batches:
        loss = serial_loss(model, b, dtype)
        loss.backward()
        if max_grad_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
        norms.append(norm.item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return SerialRun(losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, norms)


@functools.cache
def serial_reference(
    family: str, opt_name: str, num_steps: int, batch: int, max_grad_norm=None, precision: str = "fp32"
) -> SerialRun:
    """:func:`serial_run` on ``global_batches(num_steps, batch)``, computed once per process for
    the same arguments (a spawned world compares many plans with the same reference)."""
    batches = global_batches(num_steps, batch)
    return serial_run(family, opt_name, batches, max_grad_norm=max_grad_norm, precision=precision)


def serial_train(family: str, opt_name: str, batches: list[dict], **kwargs):
    """``(losses, state)`` of :func:`serial_run`."""
    run = serial_run(family, opt_name, batches, **kwargs)
    return run.losses, run.state


def bf16_param_reference(
    family: str, opt_name: str, batches: list[dict], max_grad_norm: float | None, num_layers: int = 2
):
    """Serial training that keeps fp32 master weights and runs forward and backward on a bf16
    copy of them (the model in bf16, no autocast), the gradients added into fp32: ZeRO-3
    param_dtype's math."""
    master = build(family, num_layers=num_layers)
    opt = make_optimizer(opt_name, master)
    work = copy.deepcopy(master).to(torch.bfloat16)
    losses = []
    for b in batches:
        with torch.no_grad():
            for w, m in zip(work.parameters(), master.parameters()):
                w.copy_(m)
        loss = serial_loss(work, b)
        loss.backward()
        for w, m in zip(work.parameters(), master.parameters()):
            m.grad = w.grad.float()
            w.grad = None
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(master.parameters(), max_grad_norm)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in master.state_dict().items()}


def train_steps(engine, batches: list[dict], after_step=None) -> tuple[list[float], list[float]]:
    """``engine.step`` on this rank's share of each global batch: ``(losses, grad norms)``, the
    norm read after each step (``engine.last_grad_norm``, on every rank). ``after_step(i)``, when
    given, runs after step ``i`` (a check of that step's state)."""
    losses, norms = [], []
    for i, b in enumerate(batches):
        losses.append(engine.step(shard(b, engine.dp_rank, engine.dp_size)))
        norms.append(float(engine.last_grad_norm))
        if after_step is not None:
            after_step(i)
    return losses, norms


def train_steps_dropping_as_serial(engine, batches: list[dict], want_counts, what: str = ""):
    """:func:`train_steps`, and after each step every block's expert token and drop counts
    (``mlp.token_counts``, ``mlp.dropped_counts``) equal the serial model's ``want_counts[step]``."""

    def check(step: int) -> None:
        got = [(l.mlp.token_counts.tolist(), l.mlp.dropped_counts.tolist()) for l in engine.model.layers]
        assert got == want_counts[step], (what, step, got, want_counts[step])  # the serial model's drops

    return train_steps(engine, batches, after_step=check)


def assert_grad_norms_close(got, want, rtol=1e-4, what: str = "") -> None:
    """The engine's per-step gradient norms against serial ``clip_grad_norm_``'s, and the same
    float on every rank."""
    assert len(got) == len(want), what
    for i, (a, b) in enumerate(zip(got, want)):
        assert abs(a - b) <= rtol * abs(b), f"{what}: step {i} grad norm {a} != serial {b}"
    t = torch.tensor(got, dtype=torch.float64)
    ref = t.clone()
    torch.distributed.broadcast(ref, 0)
    assert torch.equal(t, ref), f"{what}: ranks disagree on the grad norm ({got} vs {ref.tolist()})"


def assert_state_close(got: dict, want: dict, rtol=1e-4, atol=1e-5, what: str = "") -> None:
    assert got.keys() == want.keys(), f"{what}: keys differ: {set(got) ^ set(want)}"
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=rtol, atol=atol, msg=lambda m: f"{what} {k}: {m}")


def assert_losses_close(got, want, rtol=1e-4, atol=1e-6, what: str = "") -> None:
    assert len(got) == len(want), what
    for i, (a, b) in enumerate(zip(got, want)):
        assert abs(a - b) <= atol + rtol * abs(b), f"{what}: step {i} loss {a} != serial {b}"


def check_last_complete_checkpoint(root: str, engine, name: str, batches: list[dict], what: str, **serial) -> None:
    """The newest complete checkpoint under ``root`` is ``name``, and ``engine`` loaded from it holds
    the serial GPT trained on ``batches`` (AdamW, gradients clipped at 1.0; ``serial``: more of
    :func:`serial_train`'s options)."""
    from behemoth.checkpoint import latest_checkpoint

    path = latest_checkpoint(root)
    assert path is not None and path.endswith(name), path
    engine.load(path)
    _, want = serial_train("gpt", "adamw", batches, max_grad_norm=1.0, **serial)
    assert_state_close(engine.full_state_dict(), want, what=what)


def assert_ranks_agree(values, what: str) -> None:
    """Every rank of the world holds the same ``values`` (a list of floats) as rank 0, exactly."""
    t = torch.tensor(values, dtype=torch.float64)
    ref = t.clone()
    torch.distributed.broadcast(ref, 0)
    assert torch.equal(t, ref), f"{what}: ranks disagree ({values} vs {ref.tolist()})"


def expect_error(fn, *needles, kind=ValueError) -> None:
    """``fn()`` must raise ``kind`` whose message contains every needle."""
    try:
        fn()
    except kind as e:
        for n in needles:
            assert n in str(e), f"{n!r} not in {e}"
        return
    raise AssertionError(f"no {kind.__name__} mentioning {needles}")


class TinyLM(nn.Module):
    """A user model with an odd hidden size, sharded through the dict form of tp_policy."""

    def __init__(self, hidden):
        super().__init__()
        self.tok, self.norm = nn.Embedding(VOCAB, hidden), nn.LayerNorm(hidden)
        self.up, self.down, self.out = nn.Linear(hidden, 32), nn.Linear(32, hidden), nn.Linear(hidden, VOCAB)
        self.gate = nn.Parameter(torch.ones(()))

    def forward(self, ids):
        x = self.tok(ids)
        return self.out(self.norm(x + self.gate * self.down(F.relu(self.up(x)))))


TINY_POLICY = {"tok": "embedding", "norm": "norm", "up": "colwise", "down": "rowwise", "out": "head"}


def train_and_save(family, plan, path, batch: int) -> None:
    """Two AdamW steps (clipping 1.0) of ``family`` under ``plan`` on the first two of four
    global batches, then a checkpoint at ``path``: the first half of a resharding round trip."""
    model = build(family)
    engine = bh.boost(model, make_optimizer("adamw", model), plan, max_grad_norm=1.0)
    for b in global_batches(4, batch)[:2]:
        engine.step(shard(b, engine.dp_rank, engine.dp_size))
    engine.save(path)


def load_and_continue(family, plan, path, batch: int) -> None:
    """The second half of :func:`train_and_save`'s round trip: load ``path`` under ``plan``, train
    on the last two of the four global batches; losses and state must match serial training
    over all four."""
    batches = global_batches(4, batch)
    model = build(family)
    engine = bh.boost(model, make_optimizer("adamw", model), plan, max_grad_norm=1.0)
    engine.load(path)
    losses = [engine.step(shard(b, engine.dp_rank, engine.dp_size)) for b in batches[2:]]
    want = serial_reference(family, "adamw", len(batches), batch, 1.0)
    what = f"{family} {os.path.basename(os.path.dirname(path))} -> {plan.describe()}"
    assert_losses_close(losses, want.losses[2:], what=what)
    assert_state_close(engine.full_state_dict(), want.state, what=what)


def assert_pipeline_p2p_ops(engine, m: int, steps: int) -> None:
    """After ``steps`` steps of ``m`` micro-batches, each of this rank's stages received m
    activations per step (but stage 0) and m gradients (but the last), and sent as many the other
    way; the first step adds one shape header per activation channel; nothing else travels over
    pp but scalars."""
    pp, v = engine.plan.pp, engine.plan.virtual_stages
    ops, last = engine.comm_stats()["pp"]["ops"], pp * v - 1
    stages = [c * pp + engine.mesh.axis("pp").rank for c in range(v)]
    sends = sum((s < last) * (m * steps + 1) + (s > 0) * m * steps for s in stages)
    recvs = sum((s > 0) * (m * steps + 1) + (s < last) * m * steps for s in stages)
    assert (ops["send"], ops["recv"]) == (sends, recvs), (engine.plan.describe(), ops)


def saved_activation_bytes(fn, module) -> int:
    """Bytes of the distinct non-parameter storages that ``fn``'s autograd graph saves."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    seen = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def block_saved_bytes(family: str, plan, split, batch: int) -> tuple[int, int]:
    """``(per-rank, serial)`` saved activation bytes of one forward of a realistic block
    (h=64, 4 heads, S=SEQ, ``batch`` rows) of ``family`` under ``plan``; ``split(x, mesh)``
    gives a rank its share of the block input (None: the whole input). With a split, each rank
    must save at most 1.02x the serial block's bytes / tp (partitioned activations: Optimus; the
    README reports 1.00x for 2D, 2.5D and 3D)."""
    from behemoth.models import GPT, GPTConfig, Llama, LlamaConfig

    cfg = dict(vocab_size=VOCAB, seq_len=SEQ, num_layers=1, num_heads=4, hidden=64)
    make = (lambda: GPT(GPTConfig(**cfg))) if family == "gpt" else (lambda: Llama(LlamaConfig(num_kv_heads=2, **cfg)))
    serial, model = make(), make()
    engine = bh.boost(model, make_optimizer("sgd", model), plan)
    blocks = "blocks" if family == "gpt" else "layers"
    sblock, pblock = getattr(serial, blocks)[0], getattr(engine.model, blocks)[0]
    x = torch.randn(batch, SEQ, 64, generator=torch.Generator().manual_seed(0))
    extra = () if family == "gpt" else (torch.arange(SEQ).unsqueeze(0),)
    want = saved_activation_bytes(lambda: sblock(x.clone().requires_grad_(), *extra), sblock)
    xl = split(x, engine.mesh) if split else x.clone()
    got = saved_activation_bytes(lambda: pblock(xl.requires_grad_(), *extra), pblock)
    if split:
        assert got <= 1.02 * want / plan.tp, f"{plan.describe()} {family}: saves {got} B, serial {want} B/tp={plan.tp}"
    return got, want


@contextlib.contextmanager
def untraced_gather_layout():
    """For the duration, the compiler refuses to trace the helper that lays out a functional
    all-gather along a dim other than 0, as torch 2.11's does (torch 2.13 traces it): a compiled
    graph that calls it breaks there, as it would on the GPU machines' torch."""
    import torch._dynamo
    import torch.distributed._functional_collectives as funcol

    helper = funcol._maybe_view_chunk_cat
    funcol._maybe_view_chunk_cat = torch._dynamo.disable(helper)
    try:
        yield
    finally:
        funcol._maybe_view_chunk_cat = helper


class PhaseCounter(TorchDispatchMode):
    """Counts, in ``self.n``, the ops reaching the dispatcher that :meth:`counts` accepts, in the
    forward and, once the model's output gradient arrives (:func:`count_by_phase`), the backward."""

    def __init__(self) -> None:
        super().__init__()
        self.phase, self.n = "forward", Counter()

    def counts(self, func) -> bool:
        raise NotImplementedError

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.counts(func):
            self.n[self.phase] += 1
        return out


class KernelCounter(PhaseCounter):
    """Kernel-launching aten ops by phase: not the collectives, not the views (by schema), not the
    ops named in ``no_kernel``; ``copies=False`` leaves the contiguous copies (``clone``) out too."""

    def __init__(self, no_kernel: tuple[str, ...], copies: bool = True) -> None:
        super().__init__()
        self.no_kernel, self.copies = no_kernel, copies

    def counts(self, func) -> bool:
        name = str(func.overloadpacket)
        if name.startswith("c10d") or "_c10d_functional" in name:
            return False
        ret = func._schema.returns
        if ret and ret[0].alias_info is not None and not ret[0].alias_info.is_write:
            return False
        name = func.__name__.split(".")[0]
        return name not in self.no_kernel and (self.copies or name != "clone")


def count_by_phase(engine, batch: dict, mode: PhaseCounter) -> Counter:
    """``mode``'s forward and backward counts over one forward and backward of ``engine`` on
    ``batch`` (after a step that leaves lazy set-up behind)."""
    engine.step(batch)

    def backward_starts(module, inputs, out):
        def flip(grad):
            mode.phase = "backward"
            return grad

        out.register_hook(flip)

    hook = engine.model.register_forward_hook(backward_starts)
    try:
        with mode:
            engine._forward_backward(batch)
    finally:
        hook.remove()
    return mode.n

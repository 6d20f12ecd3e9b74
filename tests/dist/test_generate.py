"""bh.generate under every plan against serial references computed once in the parent.

References (fp32, CPU), per family: the serial model's greedy tokens, checked against a no-cache
serial forward of each row alone (every token is the argmax of its step's logits, so they are
the no-cache greedy loop's) and, for transformers' GPT-2 and Llama, against their own
``generate(do_sample=False)`` on the left-padded batch; those no-cache logits of every step;
seeded samples of bh.generate on the serial model.

Every plan must give the reference tokens exactly, logits within 1e-5 at every step, the
serial model's samples, and a KV cache of exactly ``kv_cache_bytes`` on every rank. Two spawned
worlds (4 and 8 ranks) run the plans; the 4-rank one also generates from a checkpoint written
by an engine under another plan (loaded under 2D and under ZeRO-3). A third (8 ranks) runs 3D
and checks that its decode steps' Linears run weight-stationary. Under 2D, 2.5D and 3D the
decode step compiled whole is one graph with the eager call's tokens and collectives.
"""

from __future__ import annotations

import contextlib
import os

import torch
from common import expect_error, untraced_gather_layout

import behemoth as bh
from behemoth.generation import kv_cache_bytes

VOCAB, SEQ, NEW = 96, 64, 32
FAMILIES = ("gpt", "llama", "hf-gpt2", "hf-llama")
PROMPT_LENGTHS = (5, 9, 2)
SAMPLING = dict(do_sample=True, temperature=0.8, top_k=40, top_p=0.9, seed=7)


def build(family: str) -> torch.nn.Module:
    """A tiny model of ``family`` with room for the prompts and 32 new tokens (the same on every rank)."""
    if family == "gpt":
        from behemoth.models import GPT, GPTConfig

        return GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, num_layers=2, num_heads=4, hidden=32)).eval()
    if family == "llama":
        from behemoth.models import Llama, LlamaConfig

        return Llama(
            LlamaConfig(vocab_size=VOCAB, seq_len=SEQ, num_layers=2, num_heads=4, num_kv_heads=2, hidden=32)
        ).eval()
    torch.manual_seed(0)
    if family == "hf-gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(
            vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0
        )
        return GPT2LMHeadModel(cfg).eval()
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
    )
    return LlamaForCausalLM(cfg).eval()


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def left_padded(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, rows))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :], mask[i, width - len(r) :] = torch.tensor(r), 1
    return ids, mask


def _logits(out) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out.logits


@torch.no_grad()
def no_cache_logits(model, rows: list[list[int]], new: list[list[int]]) -> list[torch.Tensor]:
    """Each row alone, unpadded, one full forward of prompt + new tokens with no cache: the
    logits ``[len(new), V]`` each new token was chosen from (a causal model's logits at a
    position are those of a forward of the prefix alone)."""
    out = []
    for r, n in zip(rows, new):
        z = _logits(model(torch.tensor([r + n[:-1]])))[0].float()
        out.append(z[len(r) - 1 :])
    return out


def references() -> dict:
    """Per family: the greedy tokens, every step's no-cache logits, seeded samples. The greedy
    tokens are checked to be the no-cache greedy loop's (each is the argmax of its step's
    no-cache logits) and, for transformers models, transformers' ``generate``'s."""
    rows, out = prompts(), {}
    for family in FAMILIES:
        model = build(family)
        tokens = bh.generate(model, rows, max_new_tokens=NEW)
        logits = no_cache_logits(model, rows, tokens)
        for t, z in zip(tokens, logits):
            assert t == z.argmax(-1).tolist(), family
        if family.startswith("hf-"):
            ids, mask = left_padded(rows)
            full = model.generate(
                ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0, eos_token_id=None
            )
            assert full[:, ids.shape[1] :].tolist() == tokens, family
        samples = bh.generate(model, rows, max_new_tokens=NEW, **SAMPLING)
        out[family] = dict(tokens=tokens, logits=logits, samples=samples)
    return out


def _cache_formula(model, plan: bh.Plan, local_rows: int) -> int:
    cfg = model.config
    heads = getattr(cfg, "num_heads", None) or cfg.num_attention_heads
    kv = getattr(cfg, "num_kv_heads", None) or getattr(cfg, "num_key_value_heads", None) or heads
    hidden = getattr(cfg, "hidden", None) or cfg.hidden_size
    layers = getattr(cfg, "num_layers", None) or cfg.num_hidden_layers
    width = max(PROMPT_LENGTHS) + (-max(PROMPT_LENGTHS) % plan.tp if plan.sequence_parallel else 0)
    return kv_cache_bytes(
        num_layers=layers // plan.pp,  # a pipeline rank caches its stage's layers
        rows=local_rows,
        num_kv_heads=kv,
        head_dim=hidden // heads,
        length=width + NEW,
        dtype_bytes=4,
        tp=plan.tp,
        tp_mode=plan.tp_mode,
        tp_depth=plan.tp_depth,
    )


def _check_plan(plan: bh.Plan, refs: dict, families=FAMILIES) -> None:
    rows = prompts()
    for family in families:
        what = f"{family} {plan.describe()}"
        want = refs[family]
        model = bh.parallelize(build(family), plan)
        par = bh.parallelization(model)
        got = bh.generate(model, rows, max_new_tokens=NEW, return_logits=True)
        assert got.tokens == want["tokens"], (what, got.tokens, want["tokens"])
        for i, z in enumerate(want["logits"]):
            torch.testing.assert_close(got.logits_BTV[i], z, rtol=0, atol=1e-5, msg=lambda m: f"{what} row {i}: {m}")
        split = par.batch_parts * par.plan.dp * par.plan.cp  # context parallelism's ranks take rows too
        local = -(-len(rows) // split)
        assert got.cache_bytes == _cache_formula(model, plan, local), (what, got.cache_bytes)
        sampled = bh.generate(model, rows, max_new_tokens=NEW, **SAMPLING)
        assert sampled == want["samples"], (what, sampled, want["samples"])
        if family == "hf-llama":  # a tensor in, transformers' layout out: prompts then new tokens
            ids, mask = left_padded(rows)
            full = bh.generate(model, ids, attention_mask=mask, max_new_tokens=NEW, pad_token_id=0)
            assert full[:, ids.shape[1] :].tolist() == want["tokens"], what
            assert torch.equal(full[:, : ids.shape[1]], ids), what


def _check_eos_and_batch_of_one(plan: bh.Plan, refs: dict) -> None:
    """EOS stops each row on its own (later tokens are padding); a batch of one row under a plan
    that splits the batch runs with a copied row."""
    rows, want = prompts(), refs["llama"]["tokens"]
    model = bh.parallelize(build("llama"), plan)
    eos = want[0][3]
    got = bh.generate(model, rows, max_new_tokens=NEW, eos_token_id=eos)
    for g, w in zip(got, want):
        cut = w.index(eos) + 1 if eos in w else NEW
        assert g == w[:cut], (plan.describe(), g, w)
    one = bh.generate(model, rows[1:2], max_new_tokens=NEW)
    assert one == want[1:2], plan.describe()


def _check_compiled_grid(plan: bh.Plan, refs: dict) -> None:
    """The whole decode step compiled (``compile=backend``) under a grid layout is one graph (the
    embedding's swap with the transposed grid rank traced as an all-to-all, no graph break),
    gives the reference tokens and books the eager call's collectives on every axis."""
    import torch._dynamo
    from torch._dynamo.testing import CompileCounterWithBackend

    rows, want = prompts(), refs["llama"]["tokens"]
    model = bh.parallelize(build("llama"), plan)
    ledger = model._behemoth_parallelization.mesh.ledger
    ledger.reset()
    assert bh.generate(model, rows, max_new_tokens=NEW) == want, plan.describe()
    eager = {axis: stats["ops"] for axis, stats in ledger.stats().items()}
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    try:
        with untraced_gather_layout():  # one graph on torch 2.11 too
            assert bh.generate(model, rows, max_new_tokens=NEW, compile=counter) == want, plan.describe()
            assert counter.frame_count == 1, (plan.describe(), counter.frame_count)
            ledger.reset()
            assert bh.generate(model, rows, max_new_tokens=NEW, compile=counter) == want, plan.describe()
            assert counter.frame_count == 1, (plan.describe(), counter.frame_count)  # nothing new compiled
        assert {axis: stats["ops"] for axis, stats in ledger.stats().items()} == eager, plan.describe()
    finally:
        torch._dynamo.reset()


def _world4(rank, world, refs, tmp):
    _check_plan(bh.Plan(tp=4), refs)
    _check_plan(bh.Plan(tp=4, sequence_parallel=True), refs, ("llama", "hf-gpt2"))
    _check_plan(bh.Plan(dp=2, tp=2, sequence_parallel=True), refs, ("gpt", "hf-llama"))
    _check_plan(bh.Plan(dp=2, tp=2), refs, ("llama",))
    _check_plan(bh.Plan(dp=4), refs, ("gpt",))
    _check_plan(bh.Plan(tp=4, tp_mode="2d"), refs)
    _check_eos_and_batch_of_one(bh.Plan(tp=4, tp_mode="2d"), refs)
    _check_compiled_grid(bh.Plan(tp=4, tp_mode="2d"), refs)
    _check_eos_and_batch_of_one(bh.Plan(dp=2, tp=2), refs)
    # an engine under one plan saves; another under another plan loads and generates the same
    rows = prompts()
    model = build("llama").train()
    engine = bh.boost(model, torch.optim.SGD(model.parameters(), lr=0.1), bh.Plan(dp=2, tp=2))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, 17), generator=g)
    engine.step({"input_ids": ids[:, :-1], "labels": ids[:, 1:]})
    before = engine.generate(rows, max_new_tokens=NEW)
    assert before != refs["llama"]["tokens"]  # the step changed the weights
    engine.save(os.path.join(tmp, "ckpt"))
    model = build("llama").train()
    other = bh.boost(model, torch.optim.SGD(model.parameters(), lr=0.1), bh.Plan(tp=4, tp_mode="2d"))
    other.load(os.path.join(tmp, "ckpt"))
    assert other.generate(rows, max_new_tokens=NEW) == before
    assert other.model.training  # generation left the engine in training mode
    model = build("llama").train()
    zero3 = bh.boost(model, torch.optim.SGD(model.parameters(), lr=0.1), bh.Plan(dp=4, zero=3))
    zero3.load(os.path.join(tmp, "ckpt"))
    assert zero3.generate(rows, max_new_tokens=NEW) == before  # parameters gathered over dp in the forward
    # refusals, on every rank, before any collective
    expect_error(lambda: bh.generate(build("gpt"), rows, max_new_tokens=0), "max_new_tokens")
    expect_error(lambda: bh.generate(build("gpt"), rows, max_new_tokens=SEQ), "positions")
    expect_error(
        lambda: bh.generate(build("gpt"), rows, max_new_tokens=4, do_sample=True, temperature=0), "temperature"
    )


def _world8(rank, world, refs):
    _check_plan(bh.Plan(tp=8, tp_mode="2.5d", tp_depth=2), refs, ("gpt", "hf-llama"))
    _check_compiled_grid(bh.Plan(tp=8, tp_mode="2.5d", tp_depth=2), refs)


def test_generate_under_every_plan(tmp_path):
    refs = references()
    bh.spawn(_world4, 4, refs, str(tmp_path), timeout=600)
    bh.spawn(_world8, 8, refs, timeout=600)


@contextlib.contextmanager
def _recorded_3d_forms():
    """For the duration, record the rows of every 3D Linear forward without autograd, by form:
    ``{"stationary": [...], "gathered": [...]}`` (the weight-stationary one, the training one)."""
    from behemoth.parallel.tensor import tp3d

    forms = {"stationary": "stationary_linear", "gathered": "gathered_linear"}
    seen = {form: [] for form in forms}
    saved = {form: getattr(tp3d, name, None) for form, name in forms.items()}  # a form tp3d lacks: never seen

    def record(form, fn):
        def run(x, *args):
            seen[form].append(x.shape[0])
            return fn(x, *args)

        return run

    for form, fn in saved.items():
        if fn is not None:
            setattr(tp3d, forms[form], record(form, fn))
    try:
        yield seen
    finally:
        for form, fn in saved.items():
            if fn is not None:
                setattr(tp3d, forms[form], fn)


def _world_3d(rank, world, refs):
    """3D (q = 2): the reference tokens and logits, every decode step's Linears (the head's too)
    weight-stationary and the prompt's blocks in the training form; with ``weight_stationary``
    off the same tokens for more bytes a rank; the decode step compiled whole is one graph."""
    from behemoth.parallel.tensor.tp3d import Linear3D

    plan = bh.Plan(tp=8, tp_mode="3d")
    with _recorded_3d_forms() as seen:
        _check_plan(plan, refs, ("llama", "hf-gpt2"))
    rows_per_rank = -(-len(PROMPT_LENGTHS) // 4)  # the tp group's rows over q**2 batch blocks
    assert seen["stationary"], "no 3D Linear ran weight-stationary"
    assert set(seen["stationary"]) == {rows_per_rank}, set(seen["stationary"])  # a decode step's rows
    assert seen["gathered"] and min(seen["gathered"]) >= rows_per_rank * max(PROMPT_LENGTHS), set(seen["gathered"])
    model = bh.parallelize(build("llama"), plan)
    linears = sum(isinstance(m, Linear3D) for m in model.modules())
    with _recorded_3d_forms() as seen:
        assert bh.generate(model, prompts(), max_new_tokens=NEW) == refs["llama"]["tokens"]
    counts = (len(seen["stationary"]), len(seen["gathered"]), linears)
    # the prompt's forward: every block's Linears in the training form, the head (logits of the
    # last position alone: one row a rank) weight-stationary; then every Linear of each step
    assert counts[1] == linears - 1 and (counts[0] - 1) % linears == 0, counts
    assert counts[0] >= (NEW - 1) * linears + 1, counts  # at least one step a new token after the first
    ledger = bh.parallelization(model).mesh.ledger
    moved = {}
    for stationary in (True, False):
        Linear3D.weight_stationary = stationary
        ledger.reset()
        try:
            assert bh.generate(model, prompts(), max_new_tokens=NEW) == refs["llama"]["tokens"], stationary
        finally:
            Linear3D.weight_stationary = True
        moved[stationary] = sum(s["bytes"] for a, s in ledger.stats().items() if a.startswith("tp"))
    assert moved[True] < moved[False], moved
    _check_compiled_grid(plan, refs)  # the stationary form traced too: one graph a step


def test_generate_3d_weight_stationary():
    bh.spawn(_world_3d, 8, references(), timeout=600)


def _world_stages(rank, world, refs):
    """Pipelines (the last stage's logits shared over pp) and context parallelism (whole rows a cp
    rank, the model's own attention), alone and with dp and tp; compile under pp refused."""
    _check_plan(bh.Plan(pp=2, tp=2), refs, ("gpt", "hf-llama"))
    _check_plan(bh.Plan(pp=2, dp=2), refs, ("llama", "hf-gpt2"))
    _check_plan(bh.Plan(cp=2, tp=2), refs, ("llama", "hf-llama"))
    _check_plan(bh.Plan(cp=2, dp=2, cp_mode="ring"), refs, ("gpt",))
    _check_plan(bh.Plan(pp=2, cp=2), refs, ("llama",))
    _check_eos_and_batch_of_one(bh.Plan(pp=2, dp=2), refs)
    model = bh.parallelize(build("llama"), bh.Plan(pp=2, dp=2))
    expect_error(lambda: bh.generate(model, prompts(), max_new_tokens=4, compile=True), "pipeline parallelism")
    capacity = _build_moe(expert_capacity_factor=1.0)  # drops counted over the cp shares of a sequence
    model = bh.parallelize(capacity, bh.Plan(cp=2, dp=2))
    expect_error(lambda: bh.generate(model, prompts(), max_new_tokens=4), "capacity", "cp=1")


def test_generate_under_pipelines_and_context_parallelism():
    bh.spawn(_world_stages, 4, references(), timeout=600)


def _build_moe(**extra) -> torch.nn.Module:
    from behemoth.models import Llama, LlamaConfig

    cfg = LlamaConfig(
        vocab_size=VOCAB, seq_len=SEQ, num_layers=2, num_heads=4, num_kv_heads=2, hidden=32, num_experts=4, **extra
    )
    return Llama(cfg).eval()


def _world_experts(rank, world):
    """Experts exchange tokens over ep inside the forward: the dp ranks decode in lockstep, also
    when their rows stop at their EOS at different steps."""
    rows = prompts() + [[14]]
    want = bh.generate(_build_moe(), rows, max_new_tokens=12)
    eos = want[2][1]
    want_eos = bh.generate(_build_moe(), rows, max_new_tokens=12, eos_token_id=eos)
    steps = [max(len(r) for r in want_eos[:2]), max(len(r) for r in want_eos[2:])]
    assert steps[0] != steps[1], want_eos  # the two dp ranks' rows are done after different steps
    model = bh.parallelize(_build_moe(), bh.Plan(dp=2, ep=2))
    assert bh.generate(model, rows, max_new_tokens=12) == want
    assert bh.generate(model, rows, max_new_tokens=12, eos_token_id=eos) == want_eos


def test_generate_with_experts():
    bh.spawn(_world_experts, 2, timeout=300)

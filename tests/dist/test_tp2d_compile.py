"""2D (Optimus) tensor parallelism with compiled blocks (``Plan(tp=4, tp_mode="2d",
compile=True)``): every transformer block compiles into one graph with no graph break
(its SUMMA Linears' and sharded norms' collectives, forward and backward, are traced as
functional collectives, behemoth.comm.traced), every block reuses the first one's graph,
and training matches serial and eager 2D.

* behemoth's GPT and Llama, and transformers' Llama with one kv head (fewer than q: the
  replicated kv projections) at 2D tp=4 over 3 steps: losses, ``full_state_dict()`` and the
  gradient norms within rtol 1e-4 of serial, and of eager 2D; GPT under
  ``precision="bf16"`` (autocast: shards cast before they travel) against eager 2D;
* zero graph breaks (``torch._dynamo.utils.counters["graph_break"]``), one graph for all
  blocks, no recompile (``error_on_recompile``);
* the comm ledger of the compiled run books the same calls and bytes per axis and operation
  as the eager run (the compiled graphs book each traced collective when they run), but for
  the all-reduces of the biases' and norms' gradients over ``tp_row``: one per layer in the
  compiled blocks, fewer in the eager run (summed in buckets, behemoth.parallel.tensor.deferred_grads).

The blocks compile with the ``aot_eager`` backend (``nn.Module.compile``'s default backend is
patched in the spawned processes) to keep CPU time low: it runs the same traced forward and
backward graphs that inductor would compile.
"""

from __future__ import annotations

import torch
from common import (
    SEQ,
    VOCAB,
    assert_grad_norms_close,
    assert_losses_close,
    assert_state_close,
    build,
    global_batches,
    make_optimizer,
    train_serially,
    train_steps,
    untraced_gather_layout,
)

import behemoth as bh

STEPS, BATCH = 3, 8


def _traffic(engine):
    """The ledger without its clock readings: calls, bytes, wire bytes and ops per axis."""
    return {a: {k: v for k, v in s.items() if k != "seconds"} for a, s in engine.comm_stats().items()}


def _model(family):
    """common.build with 3 blocks, or transformers' Llama with one kv head (fewer than q = 2)."""
    if family != "hf-llama-kv1":
        return build(family, num_layers=3)
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=1,
            max_position_embeddings=SEQ,
        )
    )


def _serial(family, batches):
    """Plain PyTorch on the global batches: losses, state, pre-clip gradient norms."""
    model = _model(family)
    return train_serially(model, make_optimizer("adamw", model), batches)


def _run(family, compile_blocks, batches, precision="fp32"):
    model = _model(family)
    plan = bh.Plan(tp=4, tp_mode="2d", compile=compile_blocks, precision=precision)
    engine = bh.boost(model, make_optimizer("adamw", model), plan, max_grad_norm=1.0)
    losses, norms = train_steps(engine, batches)
    return losses, norms, engine.full_state_dict(), _traffic(engine)


def _compile_world(rank, world):
    import torch._dynamo
    from torch._dynamo.utils import counters

    compile_module = torch.nn.Module.compile
    torch.nn.Module.compile = lambda self, **kw: compile_module(self, **{"backend": "aot_eager", **kw})
    torch._dynamo.config.error_on_recompile = True
    batches = global_batches(STEPS, BATCH)
    try:
        for family, precision in (("gpt", "fp32"), ("llama", "fp32"), ("hf-llama-kv1", "fp32"), ("gpt", "bf16")):
            what = f"2D tp=4 compiled {family} {precision}"
            e_losses, e_norms, e_state, e_traffic = _run(family, False, batches, precision)
            torch._dynamo.reset()
            counters.clear()
            with untraced_gather_layout():  # no break on torch 2.11 either
                losses, norms, state, traffic = _run(family, True, batches, precision)
            breaks = dict(counters["graph_break"])
            assert not breaks, f"{what}: {sum(breaks.values())} graph breaks: {list(breaks)}"
            assert counters["stats"]["unique_graphs"] == 1, f"{what}: {dict(counters['stats'])} (one graph expected)"
            if precision == "fp32":
                want_losses, want_state, want_norms = _serial(family, batches)
                assert_losses_close(losses, want_losses, what=what)
                assert_state_close(state, want_state, what=what)
                assert_grad_norms_close(norms, want_norms, what=what)
            assert_losses_close(losses, e_losses, what=f"{what} vs eager")
            assert_state_close(state, e_state, what=f"{what} vs eager")
            assert_grad_norms_close(norms, e_norms, what=f"{what} vs eager")
            # the same bytes; the same calls but the biases' and norms' gradient all-reduces over
            # tp_row, one per layer in compiled blocks, bucketed in the eager run (deferred_grads)
            bucketed = e_traffic["tp_row"]["ops"]["all_reduce"]
            summed = traffic["tp_row"]["ops"]["all_reduce"]
            assert summed > bucketed, f"{what}: {summed} all-reduces over tp_row compiled, eager {bucketed}"
            e_traffic["tp_row"]["ops"]["all_reduce"] = summed
            e_traffic["tp_row"]["calls"] += summed - bucketed
            assert traffic == e_traffic, f"{what}: ledger {traffic} != eager {e_traffic}"
    finally:
        torch._dynamo.config.error_on_recompile = False
        torch.nn.Module.compile = compile_module


def test_tp2d_compiled_blocks_one_graph_match_serial_and_eager():
    bh.spawn(_compile_world, 4, timeout=900)

"""The planner's bytes per axis of a dense model's whole step under ZeRO-3 equal the comm ledger's.

behemoth's tiny GPT (a tied head, LayerNorms) and Llama (an untied head, whose final norm and head
sit in two chunks) over 2 gloo ranks, with and without micro-batches, and with activation
checkpointing (whose recomputes gather for the backward, which keeps what they gathered; with
several micro-batches its trace's prefetch window keeps a few chunks across them, so it gathers
fewer than counted: not checked here): every chunk's parameters
gathered forward and backward each micro-batch but those of the chunks the forward ends in (the
final norm's to the head's: once), reduce-scattered every micro-batch, plus the step's scalars, as
``behemoth.planner.axis_traffic.step_traffic`` counts them; the chunks' padding (which the planner
does not count) is taken from the run's layout and added per gather.
"""

from __future__ import annotations

import pytest
import torch
from common import VOCAB
from test_planner_expert_ledger import zero3_padding
from test_planner_ledger import FP32, SEQ, _workload, second_step_bytes

import behemoth as bh
from behemoth.models import build_model
from behemoth.planner.axis_traffic import step_traffic


def _world(rank, world, name):
    for m, ckpt in ((1, False), (2, False), (1, True)):
        model = build_model(name, vocab_size=VOCAB, seq_len=SEQ, num_layers=4)
        w = _workload(model)
        plan = bh.Plan(dp=world, precision="fp32", zero=3, microbatches=m, activation_checkpointing=ckpt)
        engine = bh.boost(model, torch.optim.SGD(model.parameters(), lr=0.05), plan)
        got = second_step_bytes(engine)
        want = step_traffic(engine.plan, w, dt=FP32)
        zero3_padding(plan, engine.grad_sync.reducer.store, model, w, want)
        want = {axis: int(b) for axis, b in want.items() if b}
        assert got == want, f"{name} {engine.plan.describe()} rank {rank}: ledger {got} vs planner {want}"


@pytest.mark.parametrize("name", ("gpt-tiny", "llama-tiny"))
def test_zero3_dense_bytes_equal_the_ledger(name):
    bh.spawn(_world, 2, name, timeout=500)

"""Generation's pure parts: left padding, row padding, positions, the sampler's filters and draws,
the KV-cache byte formula. No processes."""

from __future__ import annotations

import pytest
import torch

from behemoth.generation import Sampler, Sampling, kv_cache_bytes
from behemoth.generation.prompts import left_pad, padded_rows, positions
from behemoth.generation.sampling import filter_logits


def test_left_pad_lists_and_tensors():
    p = left_pad([[5, 6, 7], [8]], None, pad_token_id=0)
    assert p.ids_BP.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert p.valid_BP.tolist() == [[True, True, True], [False, False, True]]
    assert positions(p.valid_BP).tolist() == [[0, 1, 2], [0, 0, 0]]
    q = left_pad([[5, 6, 7], [8]], None, pad_token_id=1, multiple=4)  # sequence parallelism: P % tp == 0
    assert q.ids_BP.tolist() == [[1, 5, 6, 7], [1, 1, 1, 8]]
    t = left_pad(p.ids_BP, p.valid_BP.long(), pad_token_id=0)
    assert torch.equal(t.ids_BP, p.ids_BP) and torch.equal(t.valid_BP, p.valid_BP)
    with pytest.raises(ValueError, match="left padding"):
        left_pad(torch.ones(2, 3, dtype=torch.long), torch.tensor([[1, 1, 0], [1, 1, 1]]), pad_token_id=0)
    with pytest.raises(ValueError, match="non-empty"):
        left_pad([[1], []], None, pad_token_id=0)


def test_padded_rows_copy_the_last_row():
    p = padded_rows(left_pad([[5, 6], [7]], None, pad_token_id=0), 4)
    assert p.ids_BP.tolist() == [[5, 6], [0, 7], [0, 7], [0, 7]]
    assert padded_rows(p, 2) is p


def test_filters_keep_what_transformers_keeps():
    z = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    assert torch.isinf(filter_logits(z, Sampling(top_k=2))).tolist() == [[False, False, True, True, True]]
    probs = z.softmax(-1)[0]  # 0.636, 0.234, 0.086, ...: top_p 0.8 keeps the first two
    assert probs[0] < 0.8 < probs[0] + probs[1]
    assert torch.isinf(filter_logits(z, Sampling(top_p=0.8))).tolist() == [[False, False, True, True, True]]
    assert torch.isinf(filter_logits(z, Sampling(top_p=0.1))).tolist() == [[False, True, True, True, True]]
    torch.testing.assert_close(filter_logits(z, Sampling(temperature=2.0)), z / 2)
    with pytest.raises(ValueError, match="temperature"):
        Sampling(temperature=0.0)


def test_draws_do_not_depend_on_the_split():
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    s = Sampling(do_sample=True, top_k=20, top_p=0.95, temperature=0.7, seed=3)
    whole = Sampler(s, 6, torch.arange(6))
    halves = [Sampler(s, 6, torch.arange(3)), Sampler(s, 6, torch.arange(3, 6))]
    for _ in range(4):
        a = whole(logits)
        b = torch.cat([halves[0](logits[:3]), halves[1](logits[3:])])
        assert torch.equal(a, b)
    assert torch.equal(Sampler(Sampling(), 6, torch.arange(6))(logits), logits.argmax(-1))
    # the draws follow the filtered distribution: a token is never one top_k removed
    one = Sampler(Sampling(do_sample=True, top_k=2, seed=1), 1, torch.arange(1))
    row = torch.tensor([[0.0, 5.0, 4.9, -1.0]])
    assert {int(one(row)) for _ in range(50)} == {1, 2}


def test_kv_cache_bytes_formula():
    args = dict(num_layers=2, rows=3, head_dim=8, length=40, dtype_bytes=2)
    assert kv_cache_bytes(num_kv_heads=8, tp=4, **args) == 2 * 2 * 3 * 2 * 40 * 8 * 2
    assert kv_cache_bytes(num_kv_heads=2, tp=4, **args) == 2 * 2 * 3 * 1 * 40 * 8 * 2  # replicated kv head
    assert kv_cache_bytes(num_kv_heads=8, tp=4, tp_mode="2d", **args) == 2 * 2 * 3 * 4 * 40 * 8 * 2
    assert kv_cache_bytes(num_kv_heads=8, tp=8, tp_mode="2.5d", tp_depth=2, **args) == 2 * 2 * 3 * 4 * 40 * 8 * 2
    assert kv_cache_bytes(num_kv_heads=8, tp=8, tp_mode="3d", **args) == 2 * 2 * 3 * 4 * 40 * 8 * 2

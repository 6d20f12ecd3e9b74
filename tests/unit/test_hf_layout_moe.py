"""Export to transformers of mixture-of-experts models, serial: behemoth's Llama with experts (as
``MixtralForCausalLM``) and transformers' ``MixtralForCausalLM``, ``Qwen3MoeForCausalLM`` and
``OlmoeForCausalLM`` written by behemoth.hf.export.write_hf load with
AutoModelForCausalLM.from_pretrained (no missing, unexpected or mismatched tensor) to the same
logits, with exactly the tensor names, shapes and dtypes transformers' save_pretrained writes for
the same weights (one tensor per expert). Multi-process exports (ep, ep x dp): tests/dist/test_hf_export_moe.py."""

from __future__ import annotations

import pytest
import torch
from common import build_hf_moe, moe_llama_config
from hf_export_checks import check_serial_export, transformers_twin

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

V, S = 96, 16
FAMILIES = ("llama-moe", "hf-mixtral", "hf-qwen3-moe", "hf-olmoe")


def build(family: str) -> torch.nn.Module:
    """A tiny model of ``family`` (the same weights on every call)."""
    if family == "llama-moe":
        from behemoth.models import Llama

        torch.manual_seed(0)
        return Llama(moe_llama_config(vocab_size=V, seq_len=S))
    return build_hf_moe(family.removeprefix("hf-"))


@pytest.mark.parametrize("family", FAMILIES)
def test_moe_export_loads_in_transformers_with_the_same_logits_and_layout(tmp_path, family):
    model = build(family).eval()
    _, hf = check_serial_export(model, transformers_twin(model), tmp_path, V, S)
    assert type(hf).__name__ == ("MixtralForCausalLM" if family == "llama-moe" else type(model).__name__)

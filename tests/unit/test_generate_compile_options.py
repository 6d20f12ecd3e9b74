"""The decode step's compile settings: on a GPU with inductor, CUDA graphs and tuned kernels
(``GPU_DECODE_OPTIONS``); elsewhere, or with another backend, none (torch.compile's own)."""

from __future__ import annotations

import torch

from behemoth.generation import decode


def _options(monkeypatch, backend, device: str):
    seen = {}

    def fake_compile(fn, **kwargs):
        seen.update(kwargs)
        return fn

    monkeypatch.setattr(torch, "compile", fake_compile)
    decode.CompiledDecode(None, None, None, backend, torch.device(device))
    return seen


def test_gpu_inductor_decode_is_graphed_and_tuned(monkeypatch):
    seen = _options(monkeypatch, "inductor", "cuda")
    assert seen == {"backend": "inductor", "options": decode.GPU_DECODE_OPTIONS}
    assert decode.GPU_DECODE_OPTIONS["triton.cudagraphs"] and decode.GPU_DECODE_OPTIONS["coordinate_descent_tuning"]


def test_cpu_or_other_backend_gets_no_options(monkeypatch):
    assert _options(monkeypatch, "inductor", "cpu") == {"backend": "inductor", "options": None}
    assert _options(monkeypatch, "aot_eager", "cuda") == {"backend": "aot_eager", "options": None}

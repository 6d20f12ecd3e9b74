"""Exact-size page-locked host memory (zero/pinned.py): the CUDA registration is replaced by a
recorder, so the allocation, the zero fill and the unlock at the last tensor's release are
checked without a GPU (the real registration runs in benchmarks/gpu_check.py's offload plans)."""

import gc

import torch

from behemoth.parallel.zero import pinned


class Recorder:
    def __init__(self, ok=True):
        self.ok, self.registered, self.unregistered = ok, [], []

    def register(self, ptr, nbytes):
        self.registered.append((ptr, nbytes))
        return self.ok

    def unregister(self, ptr):
        self.unregistered.append(ptr)


def test_exact_size_zero_filled_and_unlocked_with_the_last_view(monkeypatch):
    rec = Recorder()
    monkeypatch.setattr(pinned.ExactPinned, "unregister", staticmethod(rec.unregister))
    n = pinned.MIN_BYTES // 2 + 3  # bf16: just over MIN_BYTES, far from a power of two
    before = pinned.locked_bytes
    t = pinned.zeros(n, torch.bfloat16, True, register=rec.register)
    nbytes = n * 2
    assert pinned.locked_bytes == before + nbytes
    assert t.dtype == torch.bfloat16 and t.numel() == n and t.untyped_storage().nbytes() == nbytes
    assert rec.registered == [(t.data_ptr(), nbytes)]
    assert not t.any()
    t[-1] = 3.0
    view = t[n // 2 :]
    ptr = t.data_ptr()
    del t
    gc.collect()
    assert rec.unregistered == []  # a view still uses the memory
    assert view[-1].item() == 3.0
    del view
    gc.collect()
    assert rec.unregistered == [ptr]  # unlocked once, at the base address
    assert pinned.locked_bytes == before


def test_not_pinned_and_refused_registrations_fall_back(monkeypatch):
    rec = Recorder(ok=False)
    monkeypatch.setattr(pinned.ExactPinned, "unregister", staticmethod(rec.unregister))
    t = pinned.empty(pinned.MIN_BYTES // 4, torch.float32, False, register=rec.register)
    assert rec.registered == [] and t.numel() == pinned.MIN_BYTES // 4
    fallback = []
    monkeypatch.setattr(pinned, "_torch_pinned", lambda n, dtype, zero: fallback.append((n, dtype, zero)) or "torch")
    assert pinned.zeros(pinned.MIN_BYTES, torch.float32, True, register=rec.register) == "torch"
    assert rec.registered and fallback == [(pinned.MIN_BYTES, torch.float32, True)]
    gc.collect()
    assert rec.unregistered == []  # never locked, never unlocked
    assert pinned.empty(16, torch.float32, True, register=rec.register) == "torch"  # small: torch's allocator
    assert fallback[-1] == (16, torch.float32, False) and len(rec.registered) == 1

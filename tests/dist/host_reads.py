"""Count the reads of device values by the host inside a block (each one a wait for the device on a
GPU): the Python conversions of a tensor (``tolist``, ``item``, ``int()``, ``float()``, ``bool()``,
``numpy``) and the ATen ops that read a device value to size their output (``nonzero`` and boolean
masks, ``bincount``, ``repeat_interleave`` without ``output_size``, ``unique``, ``masked_select``),
and a Python number written into a tensor's elements (``t[i] = 3``: the number lifted to a tensor
and copied in, on a GPU from pageable host memory, which waits for the device). On the CPU none of
them waits, but each is the same read on a GPU: counting them here pins a
layer's waits without one."""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

CONVERSIONS = ("tolist", "item", "__int__", "__float__", "__bool__", "__index__", "numpy")
SYNCING_OPS = {"nonzero", "bincount", "unique", "_unique", "_unique2", "unique_consecutive", "masked_select"}


class HostReads(TorchDispatchMode):
    """``with HostReads() as reads: ...`` -- then ``reads.counts``: ``{what: how many}`` (a
    conversion's name, or ``op:<name>`` for a reading ATen op), and ``reads.ops``: every ATen op."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter = Counter()
        self.ops: Counter = Counter()
        """Every ATen op run in the block, by name (what the block costs in kernels, roughly)."""
        self._saved: dict = {}
        self._lifted: dict[int, torch.Tensor] = {}  # kept alive: their ids stay theirs

    def __enter__(self):
        for name in CONVERSIONS:
            real = getattr(torch.Tensor, name)
            self._saved[name] = torch.Tensor.__dict__.get(name)

            def counting(t, *args, _real=real, _name=name, **kwargs):
                self.counts[_name] += 1
                return _real(t, *args, **kwargs)

            setattr(torch.Tensor, name, counting)
        return super().__enter__()

    def __exit__(self, *exc):
        for name, saved in self._saved.items():
            if saved is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, saved)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name.split("::")[-1]
        self.ops[name] += 1
        if name in SYNCING_OPS:
            self.counts[f"op:{name}"] += 1
        elif name == "copy_" and id(args[1]) in self._lifted:  # t[i] = number
            self.counts["op:scalar_write"] += 1
        elif name == "repeat_interleave" and kwargs.get("output_size") is None and len(args) < 3:
            self.counts["op:repeat_interleave"] += 1
        out = func(*args, **kwargs)
        if name == "lift_fresh":
            self._lifted[id(out)] = out
        return out

    def total(self) -> int:
        return sum(self.counts.values())

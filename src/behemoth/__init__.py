"""behemoth: train large models across many devices with one Plan.

import behemoth as bh
bh.init()
engine = bh.boost(model, optimizer, bh.Plan(dp=2))
loss = engine.step(batch)
"""

from .distributed import init, spawn
from .engine import Engine, boost
from .mesh import ParallelMesh
from .plan import Plan

__all__ = ["init", "spawn", "boost", "Engine", "Plan", "ParallelMesh"]
__version__ = "0.1.0"

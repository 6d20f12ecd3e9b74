"""behemoth: train large models across many devices with one Plan.

import behemoth as bh
bh.init()
engine = bh.boost(model, optimizer, bh.Plan(dp=2))   # = bh.parallelize + gradient sync + step executor
loss = engine.step(batch)

model = bh.parallelize(model, bh.Plan(tp=2))          # no optimizer: evaluation, generation
engine.save_hf("hf_dir")                              # a transformers checkpoint (AutoModelForCausalLM)
bh.load_hf(engine, "hf_dir")                          # and back, under any plan: each rank reads its slices
tokens = bh.generate(model, [[1, 2, 3], [4, 5]], max_new_tokens=32)
"""

from .distributed import init, spawn
from .engine import Engine, boost
from .generation import generate
from .hf.load import load_hf
from .mesh import ParallelMesh
from .parallelize import Parallelization, parallelization, parallelize
from .plan import Plan

__all__ = [
    "init",
    "spawn",
    "parallelize",
    "parallelization",
    "Parallelization",
    "boost",
    "load_hf",
    "Engine",
    "generate",
    "Plan",
    "ParallelMesh",
]
__version__ = "0.1.0"

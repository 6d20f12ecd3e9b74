"""Generation on a model parallelized under any plan: a static KV cache sharded like the
attention that owns it (:mod:`.cache`), seeded sampling identical across plans
(:mod:`.sampling`), ragged prompts by left padding (:mod:`.prompts`), the prefill and decode
forwards of each model kind (:mod:`.steps`), the decode step as a function of device state
advanced in place, compiled once (:mod:`.decode`), and the loop (:mod:`.loop`, ``bh.generate``)."""

from .cache import KVCache, LayerCache, cached_attentions, kv_cache_bytes
from .loop import Generation, generate
from .sampling import Sampler, Sampling

__all__ = [
    "Generation",
    "KVCache",
    "LayerCache",
    "Sampler",
    "Sampling",
    "cached_attentions",
    "generate",
    "kv_cache_bytes",
]

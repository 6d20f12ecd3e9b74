"""Generation on a model parallelized under any plan: a static KV cache sharded like the
attention that owns it (:mod:`.cache`), seeded sampling identical across plans
(:mod:`.sampling`), ragged prompts by left padding (:mod:`.prompts`), and the prefill and
decode loop (:mod:`.loop`, ``bh.generate``)."""

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

"""transformers checkpoints in and out: export a model trained under any plan, import one into any plan.

* ``engine.save_hf(OUT)`` / ``behemoth export CHECKPOINT OUT`` (:mod:`.export`): ``config.json``,
  ``generation_config.json``, sharded ``.safetensors`` with their index and the run's tokenizer
  files, streamed tensor by tensor; ``AutoModelForCausalLM.from_pretrained(OUT)`` loads them.
* ``bh.load_hf(engine_or_model, DIR)`` (:mod:`.load`): each rank reads only its slices of a
  transformers checkpoint (an expert-parallel rank only its experts: :mod:`.experts`);
  ``model_from_hf(DIR)`` builds the matching serial model.

Name and layout maps per family live in :mod:`.names`, configs in :mod:`.configs`.
Export needs no extra package; import reads with ``safetensors`` (``pip install 'behemoth[hf]'``).
"""

from .export import export_checkpoint, save_engine_hf
from .load import load_hf, model_from_hf

__all__ = ["export_checkpoint", "save_engine_hf", "load_hf", "model_from_hf"]

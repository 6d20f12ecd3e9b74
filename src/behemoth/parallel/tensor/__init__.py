"""Tensor parallelism: 1D (Megatron), 2D (Optimus), 2.5D (Tesseract) and 3D, as styles.

Each role of each mode is a style class (``ColwiseParallel1D``, ``RowwiseParallel2D``,
``HeadParallel3D``, ...; :mod:`.styles1d`, :mod:`.styles2d`, :mod:`.styles3d`) whose
``apply(module, mesh)`` builds the mode's layer from a serial module; :func:`parallelize_tensor`
(:mod:`.apply`) applies a plan ``{module-name pattern: role or style}`` to a whole model.

Modules, one concept each:

* :mod:`.layout`: where a shard sits in the serial tensor (pure); every parameter carries a
  :class:`~.layout.ShardSpec`, and everything mode-agnostic reads only that;
* :mod:`.state`: the serial model's state dict from the shards;
* :mod:`.serial`: reading serial modules (Linear / Conv1D, norms, attention head counts);
* :mod:`.functional`: dtype rules, the sharded norm and the vocab-parallel cross-entropy;
* :mod:`.projection_norm`: norms of a split projection's output (q / k norms), every mode;
* 1D: :mod:`.tp1d` (Linear layers, sequence-parallel norm), :mod:`.region1d` (``f``/``g``),
  :mod:`.vocab1d` (embedding, head);
* 2D / 2.5D: :mod:`.grid` (the grid and SUMMA, shared), :mod:`.tp2d`, :mod:`.embed2d`,
  :mod:`.tp2p5d`;
* 3D: :mod:`.tp3d` (cube, Linear3D), :mod:`.norms3d`, :mod:`.embed3d`;
* what the grid and the cube share: :mod:`.sharded_norm` (norms over a split hidden dim),
  :mod:`.vocab_blocks` (the embedding's vocabulary rows, the LM head's engine protocol).

A module whose logits are vocabulary-sharded exposes ``vocab_parallel_loss_sum(logits,
labels)`` and a ``gather_output`` flag; the engine computes the loss through it (no rank
materialises the full logits) unless the user brings a ``loss_fn``, in which case
``gather_output`` is set. A mode that splits the batch inside the tp group (2D, 2.5D, 3D) names
the axes in ``Parallelized.batch_axes``.
"""

from .apply import MODE_STYLES, Parallelized, parallelize_tensor
from .base import TensorStyle
from .layout import ShardSpec, get_spec, is_sharded, place_shard, shard_copies, shard_rectangles
from .state import full_state_dict
from .styles1d import (
    AttentionParallel1D,
    ColwiseNormParallel1D,
    ColwiseParallel1D,
    EmbeddingParallel1D,
    FusedQKVParallel1D,
    HeadNormParallel1D,
    HeadParallel1D,
    NormParallel1D,
    PositionEmbeddingParallel1D,
    RowwiseParallel1D,
)
from .styles2d import (
    AttentionParallel2D,
    AttentionParallel25D,
    ColwiseNormParallel2D,
    ColwiseNormParallel25D,
    ColwiseParallel2D,
    ColwiseParallel25D,
    EmbeddingParallel2D,
    EmbeddingParallel25D,
    FusedQKVParallel2D,
    FusedQKVParallel25D,
    HeadNormParallel2D,
    HeadNormParallel25D,
    HeadParallel2D,
    HeadParallel25D,
    NormParallel2D,
    NormParallel25D,
    PositionEmbeddingParallel2D,
    PositionEmbeddingParallel25D,
    RowwiseParallel2D,
    RowwiseParallel25D,
)
from .styles3d import (
    AttentionParallel3D,
    ColwiseNormParallel3D,
    ColwiseParallel3D,
    EmbeddingParallel3D,
    FusedQKVParallel3D,
    HeadNormParallel3D,
    HeadParallel3D,
    NormParallel3D,
    PositionEmbeddingParallel3D,
    RowwiseParallel3D,
)

__all__ = [
    "MODE_STYLES",
    "Parallelized",
    "ShardSpec",
    "TensorStyle",
    "full_state_dict",
    "get_spec",
    "is_sharded",
    "parallelize_tensor",
    "place_shard",
    "shard_copies",
    "shard_rectangles",
    "AttentionParallel1D",
    "ColwiseNormParallel1D",
    "ColwiseParallel1D",
    "EmbeddingParallel1D",
    "FusedQKVParallel1D",
    "HeadNormParallel1D",
    "HeadParallel1D",
    "NormParallel1D",
    "PositionEmbeddingParallel1D",
    "RowwiseParallel1D",
    "AttentionParallel2D",
    "ColwiseNormParallel2D",
    "ColwiseParallel2D",
    "EmbeddingParallel2D",
    "FusedQKVParallel2D",
    "HeadNormParallel2D",
    "HeadParallel2D",
    "NormParallel2D",
    "PositionEmbeddingParallel2D",
    "RowwiseParallel2D",
    "AttentionParallel25D",
    "ColwiseNormParallel25D",
    "ColwiseParallel25D",
    "EmbeddingParallel25D",
    "FusedQKVParallel25D",
    "HeadNormParallel25D",
    "HeadParallel25D",
    "NormParallel25D",
    "PositionEmbeddingParallel25D",
    "RowwiseParallel25D",
    "AttentionParallel3D",
    "ColwiseNormParallel3D",
    "ColwiseParallel3D",
    "EmbeddingParallel3D",
    "FusedQKVParallel3D",
    "HeadNormParallel3D",
    "HeadParallel3D",
    "NormParallel3D",
    "PositionEmbeddingParallel3D",
    "RowwiseParallel3D",
]

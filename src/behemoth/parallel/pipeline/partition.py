"""Stage partitioning for pipeline parallelism: which transformer blocks each stage holds.

Pure functions of numbers and names (no torch, no process group):

* :func:`estimate_block_costs` -- forward FLOPs per token of each block, of the embedding
  and of the head + loss, from a model config (behemoth's ``GPTConfig`` / ``LlamaConfig``,
  transformers' ``GPT2Config`` / ``LlamaConfig``) or from per-block parameter counts;
* :func:`balance_stages` -- the contiguous split of blocks into stages that minimises the
  most expensive stage (exact dynamic programme), the first stage also paying for the
  embedding and the last for the head and the loss;
* :func:`validate_stages` -- a user's ``stages=[(start, end), ...]`` override, checked;
* :func:`virtual_partition` -- either of the two mapped onto ``pp`` ranks x ``v`` chunks
  (stage ``s`` is chunk ``s // pp`` of rank ``s % pp``, as in ``schedules.py``);
* :func:`stage_modules` and :func:`tied_parameter_ranks` turn a model family's
  :class:`~behemoth.specs.PipelineLayout` (``spec_for(model).pipeline``: which modules go
  before the blocks, which after, which every stage needs, which parameters may be tied) and
  a partition into module names per stage and the ranks that must keep each tied pair in sync.

Ranges are half-open, like Python slices: ``(start, end)`` holds blocks ``start .. end-1``.

Tested in tests/unit/test_pipeline_partition.py.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

from ...specs import PipelineLayout, TransformerShape, max_seq_len_of, shape_of

__all__ = [
    "ModelCosts",
    "estimate_block_costs",
    "balance_stages",
    "validate_stages",
    "virtual_partition",
    "stage_costs",
    "stage_modules",
    "tied_parameter_ranks",
    "find_tied_parameters",
]


# -- costs ---------------------------------------------------------------------------------
class ModelCosts(NamedTuple):
    """Forward FLOPs per token (the backward is ~2x for every part, so ratios hold)."""

    blocks: tuple[float, ...]
    """One entry per transformer block."""
    first_extra: float
    """What the first stage does besides its blocks (embedding lookups and their dense gradient)."""
    last_extra: float
    """What the last stage does besides its blocks (final norm, head projection, loss)."""


def estimate_block_costs(
    config=None,
    *,
    seq_len: int | None = None,
    tokens_per_microbatch: int | None = None,
    block_params: Sequence[int] | None = None,
    embedding_params: int = 0,
    head_params: int = 0,
) -> ModelCosts:
    """Estimate the cost of every block, of the embedding and of the head.

    From a config (``seq_len`` defaults to the config's maximum sequence length):

    * block: ``2 x`` its matmul parameters (q, k, v, o and the MLP, with GQA and gated MLPs)
      ``+ 4 s h_attn`` for the attention scores and the weighted sum (PaLM's convention, no
      causal discount, as behemoth's MFU); identical blocks cost the same;
    * head + loss: ``2 V h`` (the logits' matmul; the norm and the softmax are O(h + V));
    * embedding: a lookup costs nothing per token, but its backward builds and accumulates a
      dense ``V x h`` gradient (and ``max_positions x h`` for a learned position table) once
      per micro-batch: ``2 (V + positions) h / tokens_per_microbatch`` per token, one unit per
      element touched (``tokens_per_microbatch`` defaults to ``seq_len``, one sequence).

    From ``block_params`` (a model this function does not know): block ``i`` costs
    ``2 * block_params[i]``, the head ``2 * head_params``, the embedding
    ``2 * embedding_params / tokens_per_microbatch`` (both default to 0).
    """
    if (config is None) == (block_params is None):
        raise ValueError(
            "estimate_block_costs: pass a model config or block_params=[params of each block], "
            "not both and not neither."
        )
    if block_params is not None:
        if not block_params or any(not isinstance(n, int) or n < 0 for n in block_params):
            raise ValueError(
                f"block_params={list(block_params)!r}: must be a non-empty list of non-negative "
                f"ints (the parameter count of each block, in order)."
            )
        tokens = tokens_per_microbatch or seq_len or 1
        return ModelCosts(tuple(2.0 * n for n in block_params), 2.0 * embedding_params / tokens, 2.0 * head_params)
    shape = config if isinstance(config, TransformerShape) else shape_of(config)
    s = seq_len or (None if isinstance(config, TransformerShape) else max_seq_len_of(config))
    if not s:
        raise ValueError(f"estimate_block_costs: {type(config).__name__} has no sequence length; pass seq_len=.")
    h, d = shape.hidden, shape.head_dim
    attn_params = h * d * (2 * shape.num_heads + 2 * shape.num_kv_heads)
    mlp_params = (3 if shape.gated_mlp else 2) * h * shape.ffn_hidden
    block = 2.0 * (attn_params + mlp_params) + 4.0 * s * shape.num_heads * d
    tokens = tokens_per_microbatch or s
    embedding = 2.0 * (shape.vocab_size + shape.max_positions) * h / tokens
    return ModelCosts((block,) * shape.num_layers, embedding, 2.0 * shape.vocab_size * h)


# -- balancing -----------------------------------------------------------------------------
def _check_costs(costs: Sequence[float], num_stages: int, what: str) -> list[float]:
    if not isinstance(num_stages, int) or isinstance(num_stages, bool) or num_stages < 1:
        raise ValueError(f"{what}={num_stages!r}: the number of stages must be an integer >= 1.")
    costs = [float(c) for c in costs]
    if any(not math.isfinite(c) or c < 0 for c in costs):
        raise ValueError(f"block costs {costs!r} must be finite and >= 0.")
    if len(costs) < num_stages:
        raise ValueError(
            f"{what}={num_stages} stages need at least {num_stages} blocks (one per stage); the model "
            f"has {len(costs)}. Lower pp (or virtual_stages), or use a model with more blocks."
        )
    return costs


def stage_costs(
    costs: Sequence[float], stages: Sequence[tuple[int, int]], *, first_extra: float = 0.0, last_extra: float = 0.0
) -> list[float]:
    """The cost of each stage of a partition (the first and last stage with their extras)."""
    out = [float(sum(costs[a:b])) for a, b in stages]
    out[0] += first_extra
    out[-1] += last_extra
    return out


def balance_stages(
    costs: Sequence[float], pp: int, *, first_extra: float = 0.0, last_extra: float = 0.0
) -> list[tuple[int, int]]:
    """Split blocks with ``costs`` into ``pp`` contiguous, non-empty stages minimising the
    most expensive stage, where stage 0 also costs ``first_extra`` and stage ``pp-1``
    ``last_extra``. Among the optimal splits, the one with the smallest sum of squared stage
    costs (the most even), then the earliest cuts. Exact: O(pp n^2) dynamic programme.
    """
    costs = _check_costs(costs, pp, "pp")
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def cost(j: int, a: int, b: int) -> float:  # stage j holds blocks a..b-1
        return prefix[b] - prefix[a] + (first_extra if j == 0 else 0.0) + (last_extra if j == pp - 1 else 0.0)

    inf = math.inf
    # pass 1: the optimal bottleneck; best[j][i] = min over splits of blocks[:i] into j+1 stages
    best = [[inf] * (n + 1) for _ in range(pp)]
    for i in range(1, n + 1):
        best[0][i] = cost(0, 0, i)
    for j in range(1, pp):
        for i in range(j + 1, n + 1):
            best[j][i] = min(max(best[j - 1][a], cost(j, a, i)) for a in range(j, i))
    limit = best[pp - 1][n]
    limit += 1e-9 * max(1.0, abs(limit))
    # pass 2: under that bottleneck, the most even split (least sum of squares)
    sq = [[inf] * (n + 1) for _ in range(pp)]
    cut = [[0] * (n + 1) for _ in range(pp)]
    for i in range(1, n + 1):
        if cost(0, 0, i) <= limit:
            sq[0][i] = cost(0, 0, i) ** 2
    for j in range(1, pp):
        for i in range(j + 1, n + 1):
            for a in range(j, i):
                c = cost(j, a, i)
                if c > limit or sq[j - 1][a] == inf:
                    continue
                val, cur = sq[j - 1][a] + c * c, sq[j][i]
                if cur == inf or val < cur - 1e-12 * max(1.0, cur):
                    sq[j][i], cut[j][i] = val, a
    stages, end = [], n
    for j in range(pp - 1, 0, -1):
        start = cut[j][end]
        stages.append((start, end))
        end = start
    stages.append((0, end))
    return stages[::-1]


def validate_stages(stages, num_blocks: int, num_stages: int) -> list[tuple[int, int]]:
    """Check a user's ``stages=[(start, end), ...]`` (half-open block ranges) and return it as
    a list of int pairs. Rules: ``num_stages`` entries (pp, or pp * virtual_stages with
    interleaving), each non-empty, the first starting at 0, each starting where the previous
    ended, the last ending at ``num_blocks``. Errors name the value, the rule and a fix."""
    example = [(i * num_blocks // num_stages, (i + 1) * num_blocks // num_stages) for i in range(num_stages)]
    fix = f"For example stages={example} (end exclusive), or leave stages unset to balance by cost."
    try:
        pairs = [(int(a), int(b)) for a, b in stages]
        if any(a != x or b != y for (a, b), (x, y) in zip(pairs, stages)):
            raise TypeError
    except (TypeError, ValueError):
        raise ValueError(f"stages={stages!r}: must be a list of (start, end) integer pairs. {fix}") from None
    if len(pairs) != num_stages:
        raise ValueError(
            f"stages={pairs}: has {len(pairs)} entries but the pipeline has {num_stages} stages "
            f"(pp x virtual_stages); give one (start, end) per stage. {fix}"
        )
    for i, (a, b) in enumerate(pairs):
        if b <= a:
            raise ValueError(
                f"stages={pairs}: stage {i} = ({a}, {b}) is empty; every stage needs at least one "
                f"block (end is exclusive, so end > start). {fix}"
            )
    if pairs[0][0] != 0:
        raise ValueError(
            f"stages={pairs}: stage 0 starts at block {pairs[0][0]}; the first stage must start at block 0. {fix}"
        )
    for i in range(1, len(pairs)):
        if pairs[i][0] != pairs[i - 1][1]:
            gap = "leaves a gap" if pairs[i][0] > pairs[i - 1][1] else "overlaps"
            raise ValueError(
                f"stages={pairs}: stage {i} starts at {pairs[i][0]} but stage {i - 1} ends at "
                f"{pairs[i - 1][1]} ({gap}); stages must be contiguous: each starts where the "
                f"previous ends. {fix}"
            )
    if pairs[-1][1] != num_blocks:
        raise ValueError(
            f"stages={pairs}: the last stage ends at {pairs[-1][1]} but the model has {num_blocks} "
            f"blocks; the stages must cover every block, the last ending at {num_blocks}. {fix}"
        )
    return pairs


def virtual_partition(
    costs: Sequence[float], pp: int, v: int = 1, *, first_extra: float = 0.0, last_extra: float = 0.0, stages=None
) -> list[list[tuple[int, int]]]:
    """Block ranges per rank and chunk: ``result[rank][chunk] = (start, end)``.

    The model is cut into ``pp * v`` stages, balanced by :func:`balance_stages` (the
    embedding's ``first_extra`` on stage 0 = rank 0 chunk 0, the head's ``last_extra`` on stage
    ``pp*v - 1`` = rank ``pp-1`` chunk ``v-1``), or taken from the user's ``stages`` after
    :func:`validate_stages`. Stage ``s`` is chunk ``s // pp`` of rank ``s % pp``.
    """
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"v={v!r}: model chunks per rank must be an integer >= 1.")
    num_stages = pp * v
    _check_costs(costs, num_stages, "pp*v" if v > 1 else "pp")
    if stages is None:
        flat = balance_stages(costs, num_stages, first_extra=first_extra, last_extra=last_extra)
    else:
        flat = validate_stages(stages, len(costs), num_stages)
    return [[flat[c * pp + r] for c in range(v)] for r in range(pp)]


# -- model layouts -------------------------------------------------------------------------
def stage_modules(layout: PipelineLayout, partition: Sequence[Sequence[tuple[int, int]]]) -> list[list[list[str]]]:
    """Module names each stage holds: ``result[rank][chunk]``, from a :func:`virtual_partition`.

    Stage 0 (rank 0, chunk 0) gets ``pre``, the last stage (rank pp-1, chunk v-1) ``post``,
    every chunk the ``shared`` helpers (one copy per rank is enough) and its blocks as
    ``f"{layout.blocks}.{i}"``, in execution order.
    """
    pp, v = len(partition), len(partition[0])
    out = []
    for r in range(pp):
        row = []
        for c in range(v):
            a, b = partition[r][c]
            names = list(layout.shared)
            if (r, c) == (0, 0):
                names += layout.pre
            names += [f"{layout.blocks}.{i}" for i in range(a, b)]
            if (r, c) == (pp - 1, v - 1):
                names += layout.post
            row.append(names)
        out.append(row)
    return out


def tied_parameter_ranks(
    layout: PipelineLayout, pp: int, tied: Sequence[tuple[str, str]] | None = None
) -> list[tuple[str, int, str, int]]:
    """``(name_a, rank_a, name_b, rank_b)`` for every tied pair (default: all of the layout's
    candidates; pass the pairs :func:`find_tied_parameters` confirmed), where each name lives.
    Pairs with ``rank_a != rank_b`` must be initialised equal and have their gradients summed
    over the two ranks before every optimizer step (Megatron's embedding group)."""
    out = []
    for a, b in layout.tied if tied is None else tied:
        out.append((a, _owner_rank(layout, a, pp), b, _owner_rank(layout, b, pp)))
    return out


def _owner_rank(layout: PipelineLayout, param: str, pp: int) -> int:
    if any(param == m or param.startswith(m + ".") for m in layout.pre):
        return 0
    if any(param == m or param.startswith(m + ".") for m in layout.post):
        return pp - 1
    raise ValueError(
        f"tied parameter {param!r} is in neither the first stage's modules {layout.pre} nor the last "
        f"stage's {layout.post}; only embeddings and heads can be tied across stages."
    )


def find_tied_parameters(model) -> list[tuple[str, ...]]:
    """Groups of parameter names that are one tensor in ``model`` (any object with torch's
    ``named_parameters(remove_duplicate=False)``), in first-seen order."""
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    return [tuple(g) for g in groups.values() if len(g) > 1]

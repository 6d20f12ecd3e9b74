"""What the planner plans for: a model's shape, its sequence length and its global batch.

:class:`Workload` is pure data (ints); :func:`workload_for` reads one from a model preset
name (``behemoth.models``) or a model config. Parameter counts per part are exact for
behemoth's GPT and Llama (tests/unit/test_planner_cost.py checks them against the models).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from ..specs import TransformerShape

__all__ = ["Workload", "workload_for"]


@dataclass(frozen=True, kw_only=True)
class Workload:
    """A model and how it is fed: every global step sees ``global_batch`` sequences of ``seq_len``."""

    shape: TransformerShape
    seq_len: int
    """Tokens per sequence."""
    global_batch: int
    """Sequences per optimizer step, over all data-parallel ranks."""
    tied_embeddings: bool = True
    """The head shares the embedding's table (GPT-2), or has its own (Llama)."""
    num_experts: int = 0
    """Experts per MoE MLP (0: dense)."""
    experts_top_k: int = 1
    """Experts each token visits."""
    expert_ffn_hidden: int = 0
    """Inner width of one expert (0: the dense ffn_hidden)."""
    shared_expert_ffn_hidden: int = 0
    """Inner width of the shared expert every token goes through beside its k experts
    (``LlamaConfig.shared_expert_ffn_hidden``; 0: none). Counted in the MoE layer's kernels
    (:mod:`.expert_kernels`) only."""
    experts_norm_topk: bool = True
    """Each token's k expert weights divided by their sum (Mixtral), or not (OLMoE): a few more
    kernels per MoE layer (:mod:`.expert_kernels`)."""
    expert_spread: float | None = None
    """The ep members a token's k experts sit on, on average, under ``Plan.ep_dedup`` (what the
    member exchange sends per token): None as if the k were drawn uniformly without replacement
    (``ep (1 - C(E - E/ep, k) / C(E, k))`` at each ep); a number: that many at every ep > 1
    (at most ep and k; e.g. 1 where every token's experts share a member)."""
    expert_load_imbalance: float = 1.07
    """Under expert parallelism (ep > 1), the rows the busiest ep rank's experts receive in one MoE
    layer over the mean rank's, on average over the layers: every layer's all-to-alls wait for its
    busiest rank, so its experts' GEMMs and its rows' all-to-alls take this factor of the balanced
    time. The router decides it, not the layout: 1 for a perfectly balanced router. Default 1.07:
    the Mixtral-shaped preset (8 experts, top 2, a freshly initialised router) over 2 ep ranks
    measured a busiest layer's 1.11-1.28x (``bench_moe.py``'s ``rank_load_max_over_mean``: the
    largest over 16 layers, about 1.2 typically); a layer's excess over 1 taken as half-normal,
    the largest of 16 is about 2.2 of its spread and the mean 0.8, so the mean layer's is about
    1 + 0.2 x 0.8 / 2.2 = 1.07."""

    def __post_init__(self) -> None:
        if not self.expert_load_imbalance >= 1.0:
            raise ValueError(f"Workload.expert_load_imbalance={self.expert_load_imbalance!r}: must be >= 1.")
        for name in ("seq_len", "global_batch"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"Workload.{name}={v!r}: must be an integer >= 1.")

    @property
    def tokens(self) -> int:
        """Tokens per optimizer step."""
        return self.seq_len * self.global_batch

    # -- parameters ----------------------------------------------------------------------
    @cached_property
    def attention_params(self) -> int:
        s = self.shape
        qkv = s.hidden * (s.num_heads + 2 * s.num_kv_heads) * s.head_dim
        out = s.num_heads * s.head_dim * s.hidden
        bias = ((s.num_heads + 2 * s.num_kv_heads) * s.head_dim + s.hidden) if s.linear_bias else 0
        return qkv + out + bias

    def _mlp(self, f: int) -> int:
        s = self.shape
        w = (3 if s.gated_mlp else 2) * s.hidden * f
        return w + ((f * (2 if s.gated_mlp else 1) + s.hidden) if s.linear_bias else 0)

    @cached_property
    def mlp_params(self) -> int:
        """Dense MLP parameters of one block (an MoE block: its experts, all of them, and its router)."""
        if self.num_experts:
            f = self.expert_ffn_hidden or self.shape.ffn_hidden
            return self.num_experts * self._mlp(f) + self.shape.hidden * self.num_experts
        return self._mlp(self.shape.ffn_hidden)

    @cached_property
    def expert_params(self) -> int:
        """Expert parameters of one block (what ``ep`` shards); 0 for a dense model."""
        return self.mlp_params - self.shape.hidden * self.num_experts if self.num_experts else 0

    @cached_property
    def block_params(self) -> int:
        return self.attention_params + self.mlp_params + 2 * self.shape.norm_params

    @cached_property
    def embedding_params(self) -> int:
        s = self.shape
        return s.vocab_size * s.hidden + s.max_positions * s.hidden

    @cached_property
    def head_params(self) -> int:
        """The final norm, and the head's table unless tied."""
        s = self.shape
        return s.norm_params + (0 if self.tied_embeddings else s.vocab_size * s.hidden)

    @cached_property
    def num_params(self) -> int:
        return self.shape.num_layers * self.block_params + self.embedding_params + self.head_params


def workload_for(model, *, seq_len: int | None = None, global_batch: int, vocab_size: int = 50304) -> Workload:
    """A :class:`Workload` for a preset name (``"gpt-1.3b"``), a behemoth/transformers config or
    a model with a ``.config``. ``seq_len`` defaults to the config's (2048 for a preset)."""
    from ..specs import max_seq_len_of, shape_of

    if isinstance(model, str):
        from ..models import build_config

        config = build_config(model, vocab_size=vocab_size, seq_len=seq_len or 2048)
    else:
        config = getattr(model, "config", model)
    shape = shape_of(config)
    tied = getattr(config, "tie_embeddings", getattr(config, "tie_word_embeddings", True))
    experts = getattr(config, "num_experts", 0) or 0
    return Workload(
        shape=shape,
        seq_len=seq_len or max_seq_len_of(config),
        global_batch=global_batch,
        tied_embeddings=bool(tied),
        num_experts=experts,
        experts_top_k=getattr(config, "experts_top_k", 1) if experts else 1,
        expert_ffn_hidden=(getattr(config, "expert_ffn_hidden", None) or 0) if experts else 0,
        shared_expert_ffn_hidden=(getattr(config, "shared_expert_ffn_hidden", None) or 0) if experts else 0,
        experts_norm_topk=bool(getattr(config, "router_norm_topk", getattr(config, "norm_topk_prob", True))),
    )

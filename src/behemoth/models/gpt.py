"""GPT-2 style decoder-only transformer, plain serial PyTorch.

Implements the architecture of "Language Models are Unsupervised Multitask
Learners" (Radford et al., 2019): learned absolute position embeddings,
pre-LayerNorm blocks, fused q/k/v projection, GELU (tanh approximation) MLP and
an LM head tied to the token embedding. Initialisation follows GPT-2: normal
(0, 0.02) everywhere, with the residual output projections scaled by
1/sqrt(2 * num_layers). What it shares with Llama (building, the init, the
forward's plumbing, parameter counts) lives in models/causal_lm.py.

This file holds no collectives and takes no process group; how the model is
sharded lives in its spec (behemoth/specs/gpt.py), which matches on the module names used
here (``wte``, ``wpe``, ``blocks.N.attn.qkv``, ``blocks.N.attn.proj``,
``blocks.N.mlp.fc``, ``blocks.N.mlp.proj``, ``lm_head``...). Modules read head
counts from their own ``num_heads`` attribute so that a tensor-parallel policy
can shrink it to the local head count.

Tested in tests/unit/test_models.py against a naive masked-softmax attention
and against ``transformers.GPT2LMHeadModel`` with the weights copied over.

Shape legend:
    B  batch
    S  sequence (tokens)
    H  hidden (model width)
    F  MLP inner width (ffn_hidden)
    V  vocabulary
    N  attention heads
    D  head dim (H // N)
    L  slots of a generation KV cache
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .causal_lm import AttentionSeams, CausalLM, CausalLMConfig, require

__all__ = [
    "GPT",
    "GPTBlock",
    "GPTConfig",
    "GPT_PRESETS",
    "CausalSelfAttention",
    "MLP",
]

# Shapes only; callers choose vocab_size and seq_len. Sizes from GPT-2 / GPT-3.
GPT_PRESETS: dict[str, dict] = {
    "gpt-tiny": dict(num_layers=2, num_heads=4, hidden=64),
    "gpt-mini": dict(num_layers=4, num_heads=4, hidden=128),
    "gpt2-small": dict(num_layers=12, num_heads=12, hidden=768),
    "gpt-125m": dict(num_layers=12, num_heads=12, hidden=768),
    "gpt-350m": dict(num_layers=24, num_heads=16, hidden=1024),
    "gpt-1.3b": dict(num_layers=24, num_heads=16, hidden=2048),
    "gpt-2.7b": dict(num_layers=32, num_heads=32, hidden=2560),
    "gpt-6.7b": dict(num_layers=32, num_heads=32, hidden=4096),
    "gpt-13b": dict(num_layers=40, num_heads=40, hidden=5120),
    # Between GPT-3's 13B and 175B, for the offload benchmarks (models larger than one GPU).
    "gpt-15b": dict(num_layers=48, num_heads=40, hidden=5120),
    "gpt-20b": dict(num_layers=44, num_heads=48, hidden=6144),
    "gpt-22b": dict(num_layers=48, num_heads=48, hidden=6144),  # > 3x the 6.9B plain PyTorch fits on one H200
}


@dataclass(frozen=True, kw_only=True)
class GPTConfig(CausalLMConfig):
    """Shape and regularisation of a GPT-2 style model."""

    vocab_size: int
    """Number of token ids (rows of ``wte``, columns of the logits)."""
    seq_len: int
    """Maximum sequence length: rows of the position embedding ``wpe``."""
    num_layers: int
    """Number of transformer blocks."""
    num_heads: int
    """Attention heads per block; must divide ``hidden``."""
    hidden: int
    """Model width H."""
    ffn_hidden: int | None = None
    """MLP inner width F; None means 4 * hidden (see ``resolved_ffn_hidden``)."""
    dropout: float = 0.0
    """Dropout on embeddings, attention probabilities and residual branches."""
    tie_embeddings: bool = True
    """Share one tensor between ``wte.weight`` and ``lm_head.weight``."""
    bias: bool = True
    """Biases in the Linear layers and LayerNorms (GPT-2 has them)."""
    norm_eps: float = 1e-5
    """LayerNorm epsilon."""
    seed: int = 0
    """Seed of the private generator that initialises the weights."""

    def __post_init__(self) -> None:
        self._check_common(("vocab_size", "seq_len", "num_layers", "num_heads", "hidden"))
        require(
            0.0 <= self.dropout < 1.0,
            f"GPTConfig.dropout={self.dropout!r}: must satisfy 0 <= dropout < 1; pass e.g. 0.0 or 0.1.",
        )

    def _default_ffn_hidden(self) -> int:
        return 4 * self.hidden


class CausalSelfAttention(AttentionSeams):
    """Multi-head causal self-attention with a fused q/k/v projection.

    ``qkv`` maps H to 3 * N * D laid out as [q | k | v], each block ordered by
    head. Input and output are x_BSH; no communication. Its seams (``attention_fn``,
    ``kv_cache``: :class:`~behemoth.models.causal_lm.AttentionSeams`) take q, k and v as
    q_BNSD, k_BNSD, v_BNSD.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.head_dim = config.head_dim
        self.dropout = config.dropout
        self.qkv = nn.Linear(config.hidden, 3 * config.hidden, bias=config.bias)
        self.proj = nn.Linear(config.hidden, config.hidden, bias=config.bias)

    def forward(self, x_BSH: torch.Tensor) -> torch.Tensor:
        B, S, _ = x_BSH.shape
        qkv_BSX = self.qkv(x_BSH)
        q_BSX, k_BSX, v_BSX = qkv_BSX.split(self.num_heads * self.head_dim, dim=-1)
        q_BNSD = q_BSX.view(B, S, self.num_heads, self.head_dim).transpose(1, 2)
        k_BNSD = k_BSX.view(B, S, self.num_heads, self.head_dim).transpose(1, 2)
        v_BNSD = v_BSX.view(B, S, self.num_heads, self.head_dim).transpose(1, 2)
        if self.kv_cache is None:
            dropout_p = self.dropout if self.training else 0.0
            y_BNSD = self.attention_fn(q_BNSD, k_BNSD, v_BNSD, dropout_p=dropout_p, is_causal=True)
        else:
            k_BNLD, v_BNLD, mask_B1SL = self.kv_cache.update(k_BNSD, v_BNSD)
            y_BNSD = F.scaled_dot_product_attention(q_BNSD, k_BNLD, v_BNLD, attn_mask=mask_B1SL)
        y_BSX = y_BNSD.transpose(1, 2).reshape(B, S, self.num_heads * self.head_dim)
        return F.dropout(self.proj(y_BSX), self.dropout, self.training)


class MLP(nn.Module):
    """Position-wise MLP: ``proj(gelu_tanh(fc(x)))``. x_BSH -> x_BSH, no communication."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.dropout = config.dropout
        self.fc = nn.Linear(config.hidden, config.resolved_ffn_hidden, bias=config.bias)
        self.proj = nn.Linear(config.resolved_ffn_hidden, config.hidden, bias=config.bias)

    def forward(self, x_BSH: torch.Tensor) -> torch.Tensor:
        h_BSF = F.gelu(self.fc(x_BSH), approximate="tanh")
        return F.dropout(self.proj(h_BSF), self.dropout, self.training)


class GPTBlock(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln_1(x)), then + mlp(ln_2(x))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.hidden, eps=config.norm_eps, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.hidden, eps=config.norm_eps, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x_BSH: torch.Tensor) -> torch.Tensor:
        x_BSH = x_BSH + self.attn(self.ln_1(x_BSH))
        return x_BSH + self.mlp(self.ln_2(x_BSH))


class GPT(CausalLM):
    """GPT-2 style language model: ``forward(input_ids_BS) -> logits_BSV``.

    Built, initialised and run as every :class:`~behemoth.models.causal_lm.CausalLM`; its trunk
    adds learned position embeddings to the token embeddings, then runs the blocks.
    """

    config: GPTConfig
    norm_types = (nn.LayerNorm,)

    def _build_modules(self, config: GPTConfig) -> None:
        self.wte = nn.Embedding(config.vocab_size, config.hidden)
        self.wpe = nn.Embedding(config.seq_len, config.hidden)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(GPTBlock(config) for _ in range(config.num_layers))
        self.ln_f = nn.LayerNorm(config.hidden, eps=config.norm_eps, bias=config.bias)
        self.lm_head = nn.Linear(config.hidden, config.vocab_size, bias=False)

    def embeddings(self) -> tuple[nn.Embedding, nn.Embedding]:
        """The lookup tables: ``wte`` (tokens; a tied ``lm_head`` shares it) and ``wpe`` (positions)."""
        return self.wte, self.wpe

    def _is_residual_output(self, module_name: str, param_name: str) -> bool:
        """The blocks' output projections ``attn.proj`` and ``mlp.proj``."""
        return module_name.endswith(("attn.proj", "mlp.proj"))

    def _trunk(self, input_ids_BS: torch.Tensor, position_ids_BS: torch.Tensor) -> torch.Tensor:
        """Token plus position embeddings (``position_ids_BS`` index ``wpe``), dropout, the blocks."""
        x_BSH = self.drop(self.wte(input_ids_BS) + self.wpe(position_ids_BS))
        for block in self.blocks:
            x_BSH = block(x_BSH)
        return x_BSH

    def _logits(self, x_BSH: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x_BSH))

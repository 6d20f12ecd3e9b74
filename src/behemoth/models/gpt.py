"""GPT-2 style decoder-only transformer, plain serial PyTorch.

Implements the architecture of "Language Models are Unsupervised Multitask
Learners" (Radford et al., 2019): learned absolute position embeddings,
pre-LayerNorm blocks, fused q/k/v projection, GELU (tanh approximation) MLP and
an LM head tied to the token embedding. Initialisation follows GPT-2: normal
(0, 0.02) everywhere, with the residual output projections scaled by
1/sqrt(2 * num_layers).

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

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

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


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
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
        for name in ("vocab_size", "seq_len", "num_layers", "num_heads", "hidden"):
            value = getattr(self, name)
            _require(
                isinstance(value, int) and value > 0,
                f"GPTConfig.{name}={value!r}: must be a positive int; pass e.g. {name}=1 or larger.",
            )
        _require(
            self.hidden % self.num_heads == 0,
            f"GPTConfig.hidden={self.hidden} is not divisible by num_heads={self.num_heads}: "
            f"hidden % num_heads must be 0; choose a hidden that is a multiple of {self.num_heads} "
            f"or a num_heads that divides {self.hidden}.",
        )
        _require(
            self.ffn_hidden is None or (isinstance(self.ffn_hidden, int) and self.ffn_hidden > 0),
            f"GPTConfig.ffn_hidden={self.ffn_hidden!r}: must be a positive int or None; "
            f"pass None for the default 4 * hidden = {4 * self.hidden}.",
        )
        _require(
            0.0 <= self.dropout < 1.0,
            f"GPTConfig.dropout={self.dropout!r}: must satisfy 0 <= dropout < 1; pass e.g. 0.0 or 0.1.",
        )
        _require(
            self.norm_eps > 0.0,
            f"GPTConfig.norm_eps={self.norm_eps!r}: must be > 0; pass e.g. 1e-5.",
        )

    @property
    def head_dim(self) -> int:
        """Per-head width D = hidden // num_heads."""
        return self.hidden // self.num_heads

    @property
    def resolved_ffn_hidden(self) -> int:
        """MLP inner width F actually used: ``ffn_hidden`` or 4 * hidden."""
        return 4 * self.hidden if self.ffn_hidden is None else self.ffn_hidden


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with a fused q/k/v projection.

    ``qkv`` maps H to 3 * N * D laid out as [q | k | v], each block ordered by
    head. Input and output are x_BSH; no communication.

    The core attention is ``self.attention_fn``, called like
    ``F.scaled_dot_product_attention`` (its default). It is the one seam a parallel plan
    may override on an instance (sequence parallelism plugs its attention in there), so
    the model code itself never changes and never communicates.

    ``self.kv_cache`` (None: training, full causal attention) is the generation seam: an
    object whose ``update(k_BNSD, v_BNSD) -> (k_BNLD, v_BNLD, mask_B1SL)`` stores this
    forward's keys and values and returns every cached slot with the boolean mask of the
    slots each query may read (``behemoth.generation.KVCache`` is one).
    """

    attention_fn = staticmethod(F.scaled_dot_product_attention)
    kv_cache = None

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


def _seeded_fill_(param: torch.Tensor, kind: str, std: float, generator: torch.Generator) -> None:
    """Fill ``param`` in place; draws are made on CPU in float32 so the values do
    not depend on the parameter's device or dtype."""
    with torch.no_grad():
        if kind == "normal":
            if param.device.type == "cpu" and param.dtype == torch.float32:
                param.normal_(0.0, std, generator=generator)  # same draws, no temporary
            else:
                values = torch.empty(param.shape, dtype=torch.float32)
                param.copy_(values.normal_(0.0, std, generator=generator))
        elif kind == "zeros":
            param.zero_()
        elif kind == "ones":
            param.fill_(1.0)
        else:
            raise AssertionError(kind)


class GPT(nn.Module):
    """GPT-2 style language model: ``forward(input_ids_BS) -> logits_BSV``.

    Built on the meta device and then materialised on ``device`` (default: the
    current default device), so each weight is written once, by the seeded
    init. Building with ``device="meta"`` skips the init (for counting
    parameters or deferred materialisation; call ``init_weights()`` after
    ``to_empty``). Two models built from equal configs have bit-identical
    weights whatever the global torch seed, device or dtype.
    """

    def __init__(
        self,
        config: GPTConfig,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        with torch.device("meta"):
            self.wte = nn.Embedding(config.vocab_size, config.hidden)
            self.wpe = nn.Embedding(config.seq_len, config.hidden)
            self.drop = nn.Dropout(config.dropout)
            self.blocks = nn.ModuleList(GPTBlock(config) for _ in range(config.num_layers))
            self.ln_f = nn.LayerNorm(config.hidden, eps=config.norm_eps, bias=config.bias)
            self.lm_head = nn.Linear(config.hidden, config.vocab_size, bias=False)
        if dtype is not None:
            self.to(dtype)
        device = torch.device(device) if device is not None else torch.get_default_device()
        self.to_empty(device=device)
        self.tie_weights()
        if device.type != "meta":
            self.init_weights()

    def tie_weights(self) -> None:
        """Make ``lm_head.weight`` the same Parameter as ``wte.weight`` when
        ``config.tie_embeddings``. Call again after ``to_empty``, which unties."""
        if self.config.tie_embeddings:
            self.lm_head.weight = self.wte.weight

    @torch.no_grad()
    def init_weights(self) -> None:
        """GPT-2 init from ``config.seed`` with a private CPU generator.

        Parameters are visited in ``named_parameters`` order (a tied weight
        once): normal(0, 0.02) for Linear and Embedding weights,
        normal(0, 0.02 / sqrt(2 * num_layers)) for the residual output
        projections ``attn.proj`` and ``mlp.proj``, zeros for biases,
        ones for LayerNorm weights.
        """
        generator = torch.Generator(device="cpu").manual_seed(self.config.seed)
        residual_std = 0.02 / math.sqrt(2 * self.config.num_layers)
        for module_name, module in self.named_modules():
            for name, param in module.named_parameters(recurse=False):
                if self.config.tie_embeddings and module is self.lm_head:
                    continue  # same tensor as wte.weight, drawn there
                if isinstance(module, nn.LayerNorm):
                    _seeded_fill_(param, "ones" if name == "weight" else "zeros", 0.0, generator)
                elif name == "bias":
                    _seeded_fill_(param, "zeros", 0.0, generator)
                elif module_name.endswith(("attn.proj", "mlp.proj")):
                    _seeded_fill_(param, "normal", residual_std, generator)
                else:
                    _seeded_fill_(param, "normal", 0.02, generator)

    def forward(
        self, input_ids_BS: torch.Tensor, position_ids_BS: torch.Tensor | None = None, logits_to_keep: int = 0
    ) -> torch.Tensor:
        """Logits for every position.

        Args:
            input_ids_BS: int64 token ids, S <= ``config.seq_len``.
            position_ids_BS: positions into ``wpe`` (B or 1 rows); default
                ``arange(S)``. Pass offsets when this rank holds a slice of a
                longer sequence.
            logits_to_keep: compute logits for the last this many positions only
                (generation's prefill needs the last one); 0: every position.
        Returns:
            logits_BSV in the model's dtype.
        """
        S = input_ids_BS.shape[1]
        if S > self.config.seq_len:
            raise ValueError(
                f"GPT.forward: sequence length {S} exceeds config.seq_len={self.config.seq_len}; "
                f"truncate the input or build the model with seq_len >= {S}."
            )
        if position_ids_BS is None:
            position_ids_BS = torch.arange(S, device=input_ids_BS.device).unsqueeze(0)
        x_BSH = self.drop(self.wte(input_ids_BS) + self.wpe(position_ids_BS))
        for block in self.blocks:
            x_BSH = block(x_BSH)
        if logits_to_keep:
            x_BSH = x_BSH[:, -logits_to_keep:]
        return self.lm_head(self.ln_f(x_BSH))

    def num_params(self, exclude_embeddings: bool = False) -> int:
        """Number of parameters, a tied weight counted once.

        ``exclude_embeddings`` drops the lookup tables ``wte`` and ``wpe``
        (and so a head tied to ``wte``; an untied ``lm_head`` still counts).
        """
        total = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            total -= self.wte.weight.numel() + self.wpe.weight.numel()
        return total

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token, PaLM convention: 6 * N + 12 * L * H * S,
        with N = ``num_params()`` (forward + backward matmuls, plus attention
        scores and the weighted sum over ``seq_len`` keys)."""
        c = self.config
        return 6 * self.num_params() + 12 * c.num_layers * c.hidden * seq_len

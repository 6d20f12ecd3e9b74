"""Llama style decoder-only transformer, plain serial PyTorch.

Implements the architecture of "LLaMA: Open and Efficient Foundation Language
Models" (Touvron et al., 2023) with grouped-query attention from "GQA"
(Ainslie et al., 2023): pre-RMSNorm blocks, rotary position embeddings (RoPE,
Su et al., 2021) in the rotate-half convention used by Hugging Face Llama,
SwiGLU MLP (Shazeer, 2020) and no biases.

This file holds no collectives and takes no process group; its spec
(behemoth/specs/llama.py) matches on the module names used here (``embed``, ``layers.N.attn.q/k/v/o``,
``layers.N.mlp.gate/up/down``, ``lm_head``...). Attention reads its head counts
from its ``num_heads`` / ``num_kv_heads`` attributes so that a tensor-parallel
policy can shrink them to the local counts. RoPE tables are computed on the
fly from position ids, so they are never in the state_dict and an offset
slice of a sequence only needs its position ids.

With ``num_experts > 0`` the MLP of every ``moe_every``-th block is a mixture of experts
(:class:`~behemoth.models.moe.MoEFeedForward`, Mixtral's top-k routed SwiGLU experts);
:meth:`Llama.aux_loss` then returns the router losses of the last forward, which a training
loop adds to the task loss.

Tested in tests/unit/test_models.py against ``transformers.LlamaForCausalLM``
with the weights copied over (which pins the RoPE convention) and against
itself with key/value heads repeated (which pins the GQA grouping).

Shape legend:
    B  batch
    S  sequence (tokens)
    H  hidden (model width)
    F  MLP inner width (ffn_hidden)
    V  vocabulary
    N  query heads
    K  key/value heads (N % K == 0; query head n uses kv head n // (N // K))
    D  head dim (H // N)
    R  rotary frequencies (D // 2)
    L  slots of a generation KV cache
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .causal_lm import AttentionSeams, CausalLM, CausalLMConfig, require
from .moe import MoEFeedForward, auxiliary_loss

__all__ = [
    "LLAMA_PRESETS",
    "Llama",
    "LlamaAttention",
    "LlamaBlock",
    "LlamaConfig",
    "LlamaMLP",
    "RMSNorm",
    "apply_rope",
    "rope_cos_sin",
]

# Shapes only; callers choose vocab_size and seq_len.
LLAMA_PRESETS: dict[str, dict] = {
    "llama-tiny": dict(num_layers=2, num_heads=4, num_kv_heads=2, hidden=64),
    "llama-mini": dict(num_layers=4, num_heads=4, num_kv_heads=2, hidden=128),
    "llama-1b": dict(num_layers=16, num_heads=32, num_kv_heads=8, hidden=2048, ffn_hidden=8192),
    # Llama-3-8B's shape (8,030,261,248 parameters with its vocabulary: vocab_size=128256)
    "llama-8b": dict(num_layers=32, num_heads=32, num_kv_heads=8, hidden=4096, ffn_hidden=14336, rope_theta=500000.0),
    # mixtures of experts: Mixtral's routing (top-2 of 8) at two sizes
    "llama-moe-tiny": dict(
        num_layers=2, num_heads=4, num_kv_heads=2, hidden=64, num_experts=4, experts_top_k=2, expert_ffn_hidden=64
    ),
    "mixtral-4b": dict(
        num_layers=16, num_heads=16, num_kv_heads=8, hidden=2048, ffn_hidden=5632, num_experts=8, experts_top_k=2
    ),
    # fine-grained experts, OLMoE's shape (top-8 of 64, narrow experts, softmax weights not renormalised)
    "olmoe-tiny": dict(
        num_layers=2,
        num_heads=4,
        num_kv_heads=4,
        hidden=64,
        num_experts=16,
        experts_top_k=4,
        expert_ffn_hidden=32,
        router_norm_topk=False,
    ),
    "olmoe-1b-7b": dict(
        num_layers=16,
        num_heads=16,
        num_kv_heads=16,
        hidden=2048,
        num_experts=64,
        experts_top_k=8,
        expert_ffn_hidden=1024,
        router_norm_topk=False,
    ),
}


@dataclass(frozen=True, kw_only=True)
class LlamaConfig(CausalLMConfig):
    """Shape of a Llama style model."""

    vocab_size: int
    """Number of token ids (rows of ``embed``, columns of the logits)."""
    seq_len: int
    """Maximum sequence length the model is meant for (RoPE has no table)."""
    num_layers: int
    """Number of transformer blocks."""
    num_heads: int
    """Query heads N per block; must divide ``hidden``."""
    num_kv_heads: int
    """Key/value heads K per block; must divide ``num_heads`` (K == N is MHA)."""
    hidden: int
    """Model width H."""
    ffn_hidden: int | None = None
    """SwiGLU inner width F; None means int(8 * hidden / 3) rounded up to a
    multiple of 64 (see ``resolved_ffn_hidden``)."""
    rope_theta: float = 10000.0
    """RoPE base: frequency i is rope_theta ** (-2i / D)."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    tie_embeddings: bool = False
    """Share one tensor between ``embed.weight`` and ``lm_head.weight``."""
    seed: int = 0
    """Seed of the private generator that initialises the weights."""
    num_experts: int = 0
    """Experts E of each mixture-of-experts MLP; 0 keeps every MLP dense."""
    experts_top_k: int = 2
    """Experts each token is routed to (k, 1 <= k <= num_experts)."""
    moe_every: int = 1
    """Block i's MLP is a mixture of experts when (i + 1) % moe_every == 0 (1: every block)."""
    expert_ffn_hidden: int | None = None
    """Inner width I of each expert; None means ``resolved_ffn_hidden``."""
    router_aux_loss_coef: float = 0.01
    """Weight of each MoE layer's load-balancing loss in :meth:`Llama.aux_loss`."""
    router_z_loss_coef: float = 0.0
    """Weight of each MoE layer's router z-loss in :meth:`Llama.aux_loss`."""
    router_score_func: str = "softmax"
    """Router scores: ``"softmax"`` (Mixtral, OLMoE) or ``"sigmoid"`` (DeepSeek-V3)."""
    router_norm_topk: bool = True
    """Divide each token's k expert weights by their sum (Mixtral: yes; OLMoE, Qwen3-MoE: no)."""
    router_bias_update_rate: float = 0.0
    """Auxiliary-loss-free balancing (DeepSeek-V3): > 0 chooses experts by score plus a bias that
    moves by this much per optimizer step (``models.moe.update_expert_bias``); 0: no bias."""
    expert_capacity_factor: float | None = None
    """Each expert takes at most ``ceil(factor * S * k / E)`` assignments per sequence, the rest
    dropped; None: dropless."""
    shared_expert_ffn_hidden: int = 0
    """Inner width of a shared expert every token goes through beside its k experts; 0: none."""

    def __post_init__(self) -> None:
        self._check_common(("vocab_size", "seq_len", "num_layers", "num_heads", "num_kv_heads", "hidden"))
        require(
            self.num_heads % self.num_kv_heads == 0,
            f"LlamaConfig.num_heads={self.num_heads} is not divisible by "
            f"num_kv_heads={self.num_kv_heads}: each kv head must serve a whole group of query "
            f"heads; choose num_kv_heads among the divisors of {self.num_heads}.",
        )
        require(
            (self.hidden // self.num_heads) % 2 == 0,
            f"LlamaConfig head_dim = hidden // num_heads = {self.hidden // self.num_heads} is odd: "
            f"RoPE rotates pairs of channels, so head_dim must be even; change hidden or num_heads.",
        )
        require(
            self.rope_theta > 0.0,
            f"LlamaConfig.rope_theta={self.rope_theta!r}: must be > 0; pass e.g. 10000.0.",
        )

        if self.num_experts:
            require(
                isinstance(self.num_experts, int) and self.num_experts > 0,
                f"LlamaConfig.num_experts={self.num_experts!r}: must be a positive int, or 0 for dense MLPs.",
            )
            require(
                1 <= self.experts_top_k <= self.num_experts,
                f"LlamaConfig.experts_top_k={self.experts_top_k!r}: must be in [1, num_experts={self.num_experts}].",
            )
            require(
                isinstance(self.moe_every, int) and 1 <= self.moe_every <= self.num_layers,
                f"LlamaConfig.moe_every={self.moe_every!r}: must be in [1, num_layers={self.num_layers}] so that "
                f"at least one block has experts.",
            )
            require(
                self.router_score_func in ("softmax", "sigmoid"),
                f"LlamaConfig.router_score_func={self.router_score_func!r}: must be 'softmax' or 'sigmoid'.",
            )
            require(
                self.expert_capacity_factor is None or self.expert_capacity_factor > 0,
                f"LlamaConfig.expert_capacity_factor={self.expert_capacity_factor!r}: must be > 0, or None for "
                f"dropless routing.",
            )
            require(
                self.router_bias_update_rate >= 0 and self.shared_expert_ffn_hidden >= 0,
                f"LlamaConfig.router_bias_update_rate={self.router_bias_update_rate!r} and "
                f"shared_expert_ffn_hidden={self.shared_expert_ffn_hidden!r}: must be >= 0 (0 turns them off).",
            )

    def is_moe_layer(self, index: int) -> bool:
        """Whether block ``index``'s MLP is a mixture of experts."""
        return self.num_experts > 0 and (index + 1) % self.moe_every == 0

    def _default_ffn_hidden(self) -> int:
        return -(-int(8 * self.hidden / 3) // 64) * 64


class RMSNorm(nn.Module):
    """Root-mean-square norm: x / sqrt(mean(x^2) + eps) * weight.

    Computed in float32 and cast back to the input dtype.
    """

    def __init__(self, hidden: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden))

    def forward(self, x_BSH: torch.Tensor) -> torch.Tensor:
        x32_BSH = x_BSH.float()
        x32_BSH = x32_BSH * torch.rsqrt(x32_BSH.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32_BSH * self.weight.float()).to(x_BSH.dtype)


def rope_cos_sin(
    position_ids_BS: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE tables cos_BSD, sin_BSD for the given positions (float32 math).

    Frequencies are duplicated as [f_0..f_{R-1}, f_0..f_{R-1}], the layout that
    pairs channel i with channel i + R (rotate-half convention).
    """
    device = position_ids_BS.device
    inv_freq_R = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))
    freqs_BSR = position_ids_BS.float()[..., None] * inv_freq_R
    emb_BSD = torch.cat((freqs_BSR, freqs_BSR), dim=-1)
    return emb_BSD.cos().to(dtype), emb_BSD.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x_BNSD: torch.Tensor, cos_BSD: torch.Tensor, sin_BSD: torch.Tensor) -> torch.Tensor:
    """Rotate each head's channel pairs (i, i + D/2) by position * frequency."""
    cos_B1SD, sin_B1SD = cos_BSD.unsqueeze(1), sin_BSD.unsqueeze(1)
    return x_BNSD * cos_B1SD + _rotate_half(x_BNSD) * sin_B1SD


class LlamaAttention(AttentionSeams):
    """Causal grouped-query attention with RoPE. x_BSH -> x_BSH, no communication.

    Its seams (``attention_fn``, ``kv_cache``: :class:`~behemoth.models.causal_lm.AttentionSeams`)
    take q_BNSD and the rotated keys and values k_BKSD, v_BKSD (``enable_gqa`` when K < N).
    """

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.rope_theta = config.rope_theta
        h, d = config.hidden, config.head_dim
        self.q = nn.Linear(h, config.num_heads * d, bias=False)
        self.k = nn.Linear(h, config.num_kv_heads * d, bias=False)
        self.v = nn.Linear(h, config.num_kv_heads * d, bias=False)
        self.o = nn.Linear(config.num_heads * d, h, bias=False)

    def forward(self, x_BSH: torch.Tensor, position_ids_BS: torch.Tensor) -> torch.Tensor:
        B, S, _ = x_BSH.shape
        q_BNSD = self.q(x_BSH).view(B, S, self.num_heads, self.head_dim).transpose(1, 2)
        k_BKSD = self.k(x_BSH).view(B, S, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v_BKSD = self.v(x_BSH).view(B, S, self.num_kv_heads, self.head_dim).transpose(1, 2)
        cos_BSD, sin_BSD = rope_cos_sin(position_ids_BS, self.head_dim, self.rope_theta, x_BSH.dtype)
        q_BNSD = apply_rope(q_BNSD, cos_BSD, sin_BSD)
        k_BKSD = apply_rope(k_BKSD, cos_BSD, sin_BSD)
        # enable_gqa: query head n reads kv head n // (N // K), as HF's repeat_kv,
        # without materialising the repeated keys and values.
        gqa = self.num_heads != self.num_kv_heads
        if self.kv_cache is None:
            y_BNSD = self.attention_fn(q_BNSD, k_BKSD, v_BKSD, is_causal=True, enable_gqa=gqa)
        else:
            k_BKLD, v_BKLD, mask_B1SL = self.kv_cache.update(k_BKSD, v_BKSD)
            y_BNSD = F.scaled_dot_product_attention(q_BNSD, k_BKLD, v_BKLD, attn_mask=mask_B1SL, enable_gqa=gqa)
        return self.o(y_BNSD.transpose(1, 2).reshape(B, S, self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    """SwiGLU MLP: ``down(silu(gate(x)) * up(x))``. x_BSH -> x_BSH, no communication."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        f = config.resolved_ffn_hidden
        self.gate = nn.Linear(config.hidden, f, bias=False)
        self.up = nn.Linear(config.hidden, f, bias=False)
        self.down = nn.Linear(f, config.hidden, bias=False)

    def forward(self, x_BSH: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x_BSH)) * self.up(x_BSH))


class LlamaBlock(nn.Module):
    """Pre-RMSNorm block: x + attn(attn_norm(x)), then + mlp(mlp_norm(x)); the MLP of block
    ``index`` is a :class:`MoEFeedForward` when ``config.is_moe_layer(index)``."""

    def __init__(self, config: LlamaConfig, index: int = 0) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.hidden, eps=config.norm_eps)
        self.attn = LlamaAttention(config)
        self.mlp_norm = RMSNorm(config.hidden, eps=config.norm_eps)
        if config.is_moe_layer(index):
            self.mlp = MoEFeedForward(
                config.hidden,
                config.expert_ffn_hidden or config.resolved_ffn_hidden,
                config.num_experts,
                config.experts_top_k,
                aux_loss_coef=config.router_aux_loss_coef,
                z_loss_coef=config.router_z_loss_coef,
                score_func=config.router_score_func,
                norm_topk=config.router_norm_topk,
                capacity_factor=config.expert_capacity_factor,
                bias_update_rate=config.router_bias_update_rate,
                shared_ffn_hidden=config.shared_expert_ffn_hidden,
            )
        else:
            self.mlp = LlamaMLP(config)

    def forward(self, x_BSH: torch.Tensor, position_ids_BS: torch.Tensor) -> torch.Tensor:
        x_BSH = x_BSH + self.attn(self.attn_norm(x_BSH), position_ids_BS)
        return x_BSH + self.mlp(self.mlp_norm(x_BSH))


class Llama(CausalLM):
    """Llama style language model: ``forward(input_ids_BS) -> logits_BSV``.

    Built, initialised and run as every :class:`~behemoth.models.causal_lm.CausalLM`; its trunk
    embeds the tokens and runs the blocks, each rotating its queries and keys by the positions.
    """

    config: LlamaConfig
    norm_types = (RMSNorm,)

    def _build_modules(self, config: LlamaConfig) -> None:
        self.embed = nn.Embedding(config.vocab_size, config.hidden)
        self.layers = nn.ModuleList(LlamaBlock(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden, eps=config.norm_eps)
        self.lm_head = nn.Linear(config.hidden, config.vocab_size, bias=False)

    def embeddings(self) -> tuple[nn.Embedding]:
        """The lookup table ``embed`` (a tied ``lm_head`` shares it); RoPE has none."""
        return (self.embed,)

    def _is_residual_output(self, module_name: str, param_name: str) -> bool:
        """``attn.o``, ``mlp.down``, a shared expert's ``down`` and the experts' ``down_proj``."""
        return module_name.endswith(("attn.o", "mlp.down", "shared.down")) or param_name == "down_proj"

    @torch.no_grad()
    def init_weights(self) -> None:
        """The seeded init of every :class:`~behemoth.models.causal_lm.CausalLM` (residual outputs:
        see ``_is_residual_output``), and the routers' balancing biases at 0."""
        for module in self.modules():
            if isinstance(module, MoEFeedForward) and module.expert_bias is not None:
                module.expert_bias.zero_()  # the balancing bias starts at 0
        super().init_weights()

    def _trunk(self, input_ids_BS: torch.Tensor, position_ids_BS: torch.Tensor) -> torch.Tensor:
        """Token embeddings, then the blocks (``position_ids_BS`` are RoPE's positions)."""
        x_BSH = self.embed(input_ids_BS)
        for layer in self.layers:
            x_BSH = layer(x_BSH, position_ids_BS)
        return x_BSH

    def _logits(self, x_BSH: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(x_BSH))

    def aux_loss(self) -> torch.Tensor | None:
        """The MoE layers' router losses (balancing and z-loss, weighted by the config's
        coefficients) from the last forward, summed over layers; None for a dense model.
        Training adds it to the task loss; reading it clears it."""
        return auxiliary_loss(self)

    def active_params(self) -> int:
        """Parameters one token's forward multiplies by: ``num_params()`` less the experts a token
        does not visit (each MoE layer counts k of its E experts)."""
        idle = sum(
            (m.gate_up_proj.numel() + m.down_proj.numel()) * (m.num_experts - m.top_k) // m.num_experts
            for m in self.modules()
            if isinstance(m, MoEFeedForward)
        )
        return self.num_params() - idle

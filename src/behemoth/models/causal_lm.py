"""What behemoth's decoder-only language models share, plain serial PyTorch.

GPT (``models/gpt.py``) and Llama (``models/llama.py``) are one kind of model: token ids ->
embeddings -> a stack of blocks -> final norm -> a head over the vocabulary, built on the meta
device and materialised once by a seeded init. This module holds that common part, so each family
file holds only what makes it that family (its blocks, its embeddings, its config fields):

* :class:`AttentionSeams`: the two attributes through which a parallel plan and generation plug
  into a family's attention without changing its code;
* :class:`CausalLMConfig`: the checks and derived widths of the fields every family's config has
  (``vocab_size``, ``seq_len``, ``num_layers``, ``num_heads``, ``hidden``, ``ffn_hidden``,
  ``norm_eps``); each family declares its fields itself, with their meaning in that family;
* :class:`CausalLM`: materialisation, the tied head, the init of "Language Models are
  Unsupervised Multitask Learners" (Radford et al., 2019; residual output projections scaled by
  1/sqrt(2 * num_layers)), the forward's plumbing around the family's trunk (length check,
  default positions, ``logits_to_keep``) and the parameter and FLOP counts.

No collectives, no process group. Tested through both families in tests/unit/test_models.py
(logits against transformers' models, weights independent of device and dtype).

Shape legend:
    B  batch
    S  sequence (tokens)
    H  hidden (model width)
    V  vocabulary
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["AttentionSeams", "CausalLM", "CausalLMConfig", "require", "seeded_normal_"]


def require(ok: bool, message: str) -> None:
    """Raise ``ValueError(message)`` unless ``ok`` (a config's checks)."""
    if not ok:
        raise ValueError(message)


class CausalLMConfig:
    """Checks and derived widths of the fields every family's config declares.

    A base of the families' frozen dataclasses (``GPTConfig``, ``LlamaConfig``), holding no fields
    of its own; a family supplies ``_default_ffn_hidden()`` and calls :meth:`_check_common` first in
    its ``__post_init__``. Messages name the family's config class.
    """

    def _default_ffn_hidden(self) -> int:
        raise NotImplementedError

    def _check_common(self, positive: tuple[str, ...]) -> None:
        """The fields ``positive`` are positive ints; heads divide ``hidden``; ``ffn_hidden`` is a
        positive int or None; ``norm_eps`` > 0."""
        cls = type(self).__name__
        for name in positive:
            value = getattr(self, name)
            require(
                isinstance(value, int) and value > 0,
                f"{cls}.{name}={value!r}: must be a positive int; pass e.g. {name}=1 or larger.",
            )
        require(
            self.hidden % self.num_heads == 0,
            f"{cls}.hidden={self.hidden} is not divisible by num_heads={self.num_heads}: "
            f"hidden % num_heads must be 0; choose a hidden that is a multiple of {self.num_heads} "
            f"or a num_heads that divides {self.hidden}.",
        )
        require(
            self.ffn_hidden is None or (isinstance(self.ffn_hidden, int) and self.ffn_hidden > 0),
            f"{cls}.ffn_hidden={self.ffn_hidden!r}: must be a positive int or None; "
            f"pass None for the default {self._default_ffn_hidden()}.",
        )
        require(
            self.norm_eps > 0.0,
            f"{cls}.norm_eps={self.norm_eps!r}: must be > 0; pass e.g. 1e-5.",
        )

    @property
    def head_dim(self) -> int:
        """Per-head width D = hidden // num_heads."""
        return self.hidden // self.num_heads

    @property
    def resolved_ffn_hidden(self) -> int:
        """MLP inner width F actually used: ``ffn_hidden``, or the family's default when None."""
        return self._default_ffn_hidden() if self.ffn_hidden is None else self.ffn_hidden


class AttentionSeams(nn.Module):
    """The seams of a family's causal self-attention, a base of its attention module.

    The core attention is ``self.attention_fn``, called like ``F.scaled_dot_product_attention``
    (its default). It is the one seam a parallel plan may override on an instance (context
    parallelism plugs its attention in there), so the model code itself never changes and never
    communicates.

    ``self.kv_cache`` (None: training, full causal attention) is the generation seam: an object
    whose ``update(k, v) -> (k_cached, v_cached, mask_B1SL)`` stores this forward's keys and values
    (B, heads, S, D) and returns every cached slot (B, heads, L, D) with the boolean mask of the
    slots each query may read (``behemoth.generation.KVCache`` is one).
    """

    attention_fn = staticmethod(F.scaled_dot_product_attention)
    kv_cache = None


def seeded_normal_(param: torch.Tensor, std: float, generator: torch.Generator) -> None:
    """Fill ``param`` with normal(0, std) draws from ``generator``, made on CPU in float32 so the
    values do not depend on the parameter's device or dtype."""
    if param.device.type == "cpu" and param.dtype == torch.float32:
        param.normal_(0.0, std, generator=generator)  # same draws, no temporary
    else:
        values = torch.empty(param.shape, dtype=torch.float32)
        param.copy_(values.normal_(0.0, std, generator=generator))


class CausalLM(nn.Module):
    """A decoder-only language model: ``forward(input_ids_BS) -> logits_BSV``.

    Built on the meta device and then materialised on ``device`` (default: the current default
    device), so each weight is written once, by the seeded init. Building with ``device="meta"``
    skips the init (for counting parameters or deferred materialisation; call ``tie_weights()``
    and ``init_weights()`` after ``to_empty``). Two models built from equal configs have
    bit-identical weights whatever the global torch seed, device or dtype.

    A family supplies:

    * ``_build_modules(config)``: its modules, registered in ``state_dict`` order, ``lm_head`` last;
    * ``embeddings()``: its lookup tables, the token embedding (which a tied head shares) first;
    * ``norm_types``: the class(es) of its norms (ones for their weights, zeros for their biases);
    * ``_is_residual_output(module_name, param_name)``: the weights that end a residual branch;
    * ``_trunk(input_ids_BS, position_ids_BS) -> x_BSH``: the embeddings and the blocks;
    * ``_logits(x_BSH) -> logits_BSV``: the final norm and ``lm_head``.
    """

    norm_types: tuple[type[nn.Module], ...] = ()

    def __init__(
        self,
        config: CausalLMConfig,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        with torch.device("meta"):
            self._build_modules(config)
        if dtype is not None:
            self.to(dtype)
        device = torch.device(device) if device is not None else torch.get_default_device()
        self.to_empty(device=device)
        self.tie_weights()
        if device.type != "meta":
            self.init_weights()

    def _build_modules(self, config: CausalLMConfig) -> None:
        raise NotImplementedError

    def embeddings(self) -> tuple[nn.Module, ...]:
        raise NotImplementedError

    def _is_residual_output(self, module_name: str, param_name: str) -> bool:
        raise NotImplementedError

    def _trunk(self, input_ids_BS: torch.Tensor, position_ids_BS: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _logits(self, x_BSH: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def tie_weights(self) -> None:
        """Make ``lm_head.weight`` the same Parameter as the token embedding's weight when
        ``config.tie_embeddings``. Call again after ``to_empty``, which unties."""
        if self.config.tie_embeddings:
            self.lm_head.weight = self.embeddings()[0].weight

    @torch.no_grad()
    def init_weights(self) -> None:
        """GPT-2's init from ``config.seed`` with a private CPU generator.

        Parameters are visited in ``named_parameters`` order (a tied weight once): ones for norm
        weights and zeros for norm biases, zeros for other biases, normal(0, 0.02 / sqrt(2 *
        num_layers)) for the weights that end a residual branch (``_is_residual_output``),
        normal(0, 0.02) for every other weight. Values are drawn on CPU in float32, so they do not
        depend on device or dtype.
        """
        generator = torch.Generator(device="cpu").manual_seed(self.config.seed)
        residual_std = 0.02 / math.sqrt(2 * self.config.num_layers)
        for module_name, module in self.named_modules():
            for param_name, param in module.named_parameters(recurse=False):
                if self.config.tie_embeddings and module is self.lm_head:
                    continue  # the token embedding's tensor, drawn there
                if isinstance(module, self.norm_types) and param_name == "weight":
                    param.fill_(1.0)
                elif param_name == "bias":  # a norm's or a Linear's
                    param.zero_()
                elif self._is_residual_output(module_name, param_name):
                    seeded_normal_(param, residual_std, generator)
                else:
                    seeded_normal_(param, 0.02, generator)

    def forward(
        self, input_ids_BS: torch.Tensor, position_ids_BS: torch.Tensor | None = None, logits_to_keep: int = 0
    ) -> torch.Tensor:
        """Logits for every position.

        Args:
            input_ids_BS: int64 token ids, S <= ``config.seq_len``.
            position_ids_BS: positions (B or 1 rows); default ``arange(S)``. Pass offsets when
                this rank holds a slice of a longer sequence.
            logits_to_keep: compute logits for the last this many positions only
                (generation's prefill needs the last one); 0: every position.
        Returns:
            logits_BSV in the model's dtype.
        """
        S = input_ids_BS.shape[1]
        if S > self.config.seq_len:
            raise ValueError(
                f"{type(self).__name__}.forward: sequence length {S} exceeds config.seq_len={self.config.seq_len}; "
                f"truncate the input or build the model with seq_len >= {S}."
            )
        if position_ids_BS is None:
            position_ids_BS = torch.arange(S, device=input_ids_BS.device).unsqueeze(0)
        x_BSH = self._trunk(input_ids_BS, position_ids_BS)
        if logits_to_keep:
            x_BSH = x_BSH[:, -logits_to_keep:]
        return self._logits(x_BSH)

    def num_params(self, exclude_embeddings: bool = False) -> int:
        """Number of parameters, a tied weight counted once.

        ``exclude_embeddings`` drops the lookup tables (``embeddings()``; and so a head tied to
        the token embedding; an untied ``lm_head`` still counts).
        """
        total = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            total -= sum(table.weight.numel() for table in self.embeddings())
        return total

    def active_params(self) -> int:
        """Parameters one token's forward multiplies by: every one (:meth:`num_params`) in a dense
        model."""
        return self.num_params()

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token, PaLM convention: 6 * N + 12 * L * H * S, with N =
        ``active_params()`` (forward + backward matmuls, plus attention scores and the weighted
        sum over ``seq_len`` keys)."""
        c = self.config
        return 6 * self.active_params() + 12 * c.num_layers * c.hidden * seq_len

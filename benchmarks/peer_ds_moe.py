"""Peer for MoE benchmarks: DeepSpeed-MoE (``deepspeed.moe.layer.MoE``, expert parallelism over
``--ep`` ranks, default all of them) under ZeRO stage 2, training a plain PyTorch Mixtral-shaped
decoder at the shape of behemoth's ``mixtral-4b`` preset (16 layers, hidden 2,048, 16 query and 8
key/value heads, expert FFN 5,632, 8 experts, top-2, vocab 32,000, seq 2,048), so that
``bench_moe.py --part model`` can be compared with it in the same GPU call.

    torchrun --standalone --nproc-per-node 2 benchmarks/peer_ds_moe.py --mbs 4
    python benchmarks/peer_ds_moe.py --dry                      # parameter counts, no DeepSpeed
    DS_ACCELERATOR=cpu torchrun --standalone --nproc-per-node 2 benchmarks/peer_ds_moe.py \\
        --tiny --device cpu [--check]                          # smoke, gloo (measures nothing)

DeepSpeed travels as wheels (the GPU machines have no registry): ``.whl/INSTALL.txt`` holds the
install line, ``benchmarks/run_ds_moe.sh`` runs this peer and behemoth in one call. Built with
DeepSpeed 0.19.8, ``DS_BUILD_OPS=0`` (no compiled ops; nothing here JIT-compiles one).

The model: pre-RMSNorm blocks (fp32 norm math, as behemoth's and transformers' Mixtral), causal
grouped-query attention through ``F.scaled_dot_product_attention`` with rotary embeddings (the
rotate-half convention), every block's MLP a ``deepspeed.moe.layer.MoE`` whose expert is a SwiGLU
FFN (``down(silu(gate(x)) * up(x))``, no biases), untied embedding and head. Parameter counts
equal behemoth's preset exactly (``--dry`` prints both and the run checks it): DeepSpeed's gate
``wg`` is behemoth's router, each expert's three matrices its ``gate_up_proj`` and ``down_proj``.
``--check`` loads behemoth's model's weights into the peer and compares the two forwards (fp32, no
engine): on CPU at ``--tiny``, ep 2, the logits are equal (max difference 0.0) and an expert's
gradient within 1e-11 of behemoth's (scale 3e-5), so the peer computes behemoth's function.

DeepSpeed settings and why:

* ``drop_tokens=False`` (``--capacity-factor 0``, the default): dropless, as behemoth's preset.
  DeepSpeed then sizes every expert's buffer to the busiest expert's count over the expert-parallel
  group (an all-reduce of the max and a host read per layer) and computes the padding rows too;
  behemoth computes only the routed rows. ``--capacity-factor F`` instead drops past
  ``ceil(F * k * T / E)`` rows per expert (GShard-style fixed buffers).
* ``top2_2nd_expert_sampling=False``: DeepSpeed's default picks the second expert with Gumbel
  noise; Mixtral (and behemoth) take the deterministic top-2, weights renormalised over the two.
* ``use_rts`` and ``noisy_gate_policy`` only act at k = 1; ``use_residual=False``.
* Loss: cross-entropy plus ``0.01 *`` the sum over layers of each layer's ``l_aux`` (behemoth's
  ``router_aux_loss_coef``; DeepSpeed's balance term counts first choices, behemoth's all k).
* Optimizer: ``torch.optim.AdamW`` (fused on CUDA; lr 1e-4, no weight decay) as the client
  optimizer, its parameter groups split by ``split_params_into_different_moe_groups_for_optimizer``
  (ZeRO-2 asserts a group marked ``moe``). ZeRO-2: bf16 parameters and gradients, fp32 masters and
  Adam state partitioned over the data ranks (the experts' over their expert-data group: size 1 at
  ep = world, so not partitioned), ``overlap_comm``, ``contiguous_gradients``, ``reduce_scatter``,
  buckets of 5e8 elements (as ``peer_deepspeed.py``); no gradient clipping.

Measured as ``bench_moe.py --part model``: each rank its own ``--mbs`` sequences of ``--seq + 1``
random tokens (inputs and shifted labels); the step is forward, backward and ``engine.step()``
between device syncs; step seconds the median of the steps after the first ``--warmup`` (3), the
slowest rank's; tokens/s per GPU ``mbs * seq / step_s``; MFU on active FLOPs with behemoth's own
``Llama.flops_per_token`` (``6 * N_active + 12 * L * H * S``, N_active counting k of E experts per
layer) of the same preset and overrides, imported from ``behemoth.models`` (``src/`` on
``PYTHONPATH``, as ``benchmarks/env.sh`` sets it), peak 989 TFLOP/s; peak GiB
``torch.cuda.max_memory_allocated`` since the engine was built (rank 0). One ``RESULT {json}``
line from rank 0; an exception is printed as the result's ``error``."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

TINY = dict(hidden=64, ffn=96, heads=4, kv_heads=2, layers=2, vocab=512, seq=64, mbs=2, steps=4, warmup=1)
"""``--tiny``: defaults small enough for a CPU smoke check (gloo); measures nothing."""

SETTINGS = (
    "MoE(drop_tokens=False unless --capacity-factor: dropless as behemoth; top2_2nd_expert_sampling=False: "
    "deterministic top-2 as Mixtral; min_capacity=0, use_rts=False, use_residual=False); client torch AdamW "
    "(fused on CUDA) over split_params_into_different_moe_groups_for_optimizer groups (ZeRO-2 asserts a moe "
    "group); ZeRO-2 overlap_comm, contiguous_gradients, reduce_scatter, 5e8 buckets; DS_BUILD_OPS=0"
)
"""What the RESULT says was chosen, and why (the module docstring has the long form)."""

AUX_LOSS_COEF = 0.01
"""Weight of each layer's balancing loss (behemoth's ``LlamaConfig.router_aux_loss_coef``)."""


# ---------------------------------------------------------------- the model (plain PyTorch)


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden))

    def forward(self, x_BSH: torch.Tensor) -> torch.Tensor:
        x32_BSH = x_BSH.float()
        x32_BSH = x32_BSH * torch.rsqrt(x32_BSH.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32_BSH * self.weight.float()).to(x_BSH.dtype)


def rope_cos_sin(seq: int, head_dim: int, device, dtype, theta: float = 10000.0):
    inv_freq_R = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))
    freqs_SR = torch.arange(seq, device=device).float()[:, None] * inv_freq_R
    emb_SD = torch.cat((freqs_SR, freqs_SR), dim=-1)
    return emb_SD.cos().to(dtype), emb_SD.sin().to(dtype)


def apply_rope(x_BNSD: torch.Tensor, cos_SD: torch.Tensor, sin_SD: torch.Tensor) -> torch.Tensor:
    x1, x2 = x_BNSD.chunk(2, dim=-1)
    return x_BNSD * cos_SD + torch.cat((-x2, x1), dim=-1) * sin_SD


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        self.q = nn.Linear(hidden, heads * self.head_dim, bias=False)
        self.k = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.v = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.o = nn.Linear(heads * self.head_dim, hidden, bias=False)

    def forward(self, x_BSH: torch.Tensor, cos_SD: torch.Tensor, sin_SD: torch.Tensor) -> torch.Tensor:
        B, S, _ = x_BSH.shape
        q_BNSD = self.q(x_BSH).view(B, S, self.heads, self.head_dim).transpose(1, 2)
        k_BKSD = self.k(x_BSH).view(B, S, self.kv_heads, self.head_dim).transpose(1, 2)
        v_BKSD = self.v(x_BSH).view(B, S, self.kv_heads, self.head_dim).transpose(1, 2)
        q_BNSD, k_BKSD = apply_rope(q_BNSD, cos_SD, sin_SD), apply_rope(k_BKSD, cos_SD, sin_SD)
        gqa = self.heads != self.kv_heads
        y_BNSD = F.scaled_dot_product_attention(q_BNSD, k_BKSD, v_BKSD, is_causal=True, enable_gqa=gqa)
        return self.o(y_BNSD.transpose(1, 2).reshape(B, S, self.heads * self.head_dim))


class SwiGLU(nn.Module):
    """One expert: ``down(silu(gate(x)) * up(x))``; DeepSpeed calls it on ``[ep, C, H]`` rows."""

    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden, ffn, bias=False)
        self.up = nn.Linear(hidden, ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, a, moe_cls) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(a.hidden)
        self.attn = Attention(a.hidden, a.heads, a.kv_heads)
        self.mlp_norm = RMSNorm(a.hidden)
        self.moe = moe_cls(
            hidden_size=a.hidden,
            expert=SwiGLU(a.hidden, a.ffn),
            num_experts=a.experts,
            ep_size=a.ep,
            k=a.top_k,
            capacity_factor=a.capacity_factor or 1.0,
            eval_capacity_factor=a.capacity_factor or 1.0,
            min_capacity=0,
            use_residual=False,
            drop_tokens=a.capacity_factor > 0,
            use_rts=False,
            top2_2nd_expert_sampling=a.top2_sampling,
        )

    def forward(self, x_BSH, cos_SD, sin_SD):
        x_BSH = x_BSH + self.attn(self.attn_norm(x_BSH), cos_SD, sin_SD)
        y_BSH, l_aux, _ = self.moe(self.mlp_norm(x_BSH))
        return x_BSH + y_BSH, l_aux


class MixtralLike(nn.Module):
    """``forward(ids_BS) -> (logits_BSV, aux)``: ``aux`` is ``AUX_LOSS_COEF`` times the sum of the
    layers' balancing losses."""

    def __init__(self, a, moe_cls) -> None:
        super().__init__()
        self.head_dim = a.hidden // a.heads
        self.embed = nn.Embedding(a.vocab, a.hidden)
        self.layers = nn.ModuleList(Block(a, moe_cls) for _ in range(a.layers))
        self.norm = RMSNorm(a.hidden)
        self.lm_head = nn.Linear(a.hidden, a.vocab, bias=False)

    def forward(self, ids_BS: torch.Tensor):
        x_BSH = self.embed(ids_BS)
        cos_SD, sin_SD = rope_cos_sin(ids_BS.shape[1], self.head_dim, ids_BS.device, x_BSH.dtype)
        aux = x_BSH.new_zeros((), dtype=torch.float32)
        for layer in self.layers:
            x_BSH, l_aux = layer(x_BSH, cos_SD, sin_SD)
            aux = aux + l_aux.float()
        return self.lm_head(self.norm(x_BSH)), AUX_LOSS_COEF * aux


def is_expert(name: str) -> bool:
    return ".deepspeed_experts." in name


@torch.no_grad()
def init_weights(model: nn.Module, seed: int, expert_seed: int) -> None:
    """normal(0, 0.02), ones for the norms (as ``bench_moe.py``), drawn where the parameter lives;
    the experts from ``expert_seed`` (each expert-parallel rank holds different experts: DeepSpeed
    deep-copies one expert module into all its local slots)."""
    dev = next(model.parameters()).device
    dense = torch.Generator(device=dev).manual_seed(seed)
    experts = torch.Generator(device=dev).manual_seed(expert_seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        else:
            p.normal_(0.0, 0.02, generator=experts if is_expert(name) else dense)


# ---------------------------------------------------------------- counts and FLOPs


def counts(model: nn.Module, a) -> dict:
    """Global parameter counts of the peer (the experts of all ``ep`` ranks)."""
    dense = sum(p.numel() for n, p in model.named_parameters() if not is_expert(n))
    expert_local = sum(p.numel() for n, p in model.named_parameters() if is_expert(n))
    expert = expert_local * a.ep
    return dict(total=dense + expert, active=dense + expert * a.top_k // a.experts, expert_local=expert_local)


def behemoth_flops(a) -> tuple[int | None, dict]:
    """``(flops_per_token, counts)`` of behemoth's ``mixtral-4b`` preset with this run's shape, built
    on the meta device (``Llama.flops_per_token``, what ``bench_moe.py --part model`` uses); ``(None,
    {})`` when behemoth is not importable."""
    try:
        from behemoth.models import build_model
    except ImportError:
        return None, {}
    model = build_model(
        "mixtral-4b",
        vocab_size=a.vocab,
        seq_len=a.seq,
        device="meta",
        num_layers=a.layers,
        hidden=a.hidden,
        num_heads=a.heads,
        num_kv_heads=a.kv_heads,
        ffn_hidden=a.ffn,
        num_experts=a.experts,
        experts_top_k=a.top_k,
    )
    flops = model.flops_per_token(a.seq)
    cfg = model.config
    return flops, dict(total=model.num_params(), active=(flops - 12 * cfg.num_layers * cfg.hidden * a.seq) // 6)


def flops_per_token(a, peer: dict) -> tuple[int, str]:
    """Behemoth's count where importable (checked equal to the peer's), else the same formula
    ``6 * N_active + 12 * L * H * S`` on the peer's own count (``Llama.flops_per_token``)."""
    flops, theirs = behemoth_flops(a)
    if flops is None:
        return 6 * peer["active"] + 12 * a.layers * a.hidden * a.seq, "peer count, Llama.flops_per_token's formula"
    if (theirs["total"], theirs["active"]) != (peer["total"], peer["active"]):
        raise RuntimeError(f"peer parameters {peer} differ from behemoth's preset {theirs}: the shapes do not match")
    return flops, "behemoth.models Llama.flops_per_token (same preset and overrides)"


# ---------------------------------------------------------------- the run


def ds_config(a) -> dict:
    return {
        "train_micro_batch_size_per_gpu": a.mbs,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": a.bf16},
        "zero_optimization": {
            "stage": 2,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_scatter": True,
            "reduce_bucket_size": int(a.bucket),
            "allgather_bucket_size": int(a.bucket),
        },
        "gradient_clipping": 0.0,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def run(a, dev: torch.device, result: dict) -> None:
    import deepspeed
    from deepspeed.moe.layer import MoE
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    rank = dist.get_rank()
    result.update(deepspeed=deepspeed.__version__)
    with dev:
        model = MixtralLike(a, MoE)
    init_weights(model, seed=0, expert_seed=1 + rank % a.ep)  # ranks r, r + ep, ... hold the same experts
    peer = counts(model, a)
    flops_tok, flops_from = flops_per_token(a, peer)
    result.update(
        total_b=round(peer["total"] / 1e9, 3),
        active_b=round(peer["active"] / 1e9, 3),
        expert_params_local_b=round(peer["expert_local"] / 1e9, 3),
        flops_per_token=flops_tok,
        flops_from=flops_from,
    )
    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": list(model.parameters()), "name": "parameters", "lr": 1e-4, "weight_decay": 0.0}
    )
    opt = torch.optim.AdamW(groups, lr=1e-4, weight_decay=0.0, fused=dev.type == "cuda")
    t0 = time.perf_counter()
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config(a))
    result["setup_s"] = round(time.perf_counter() - t0, 1)
    g = torch.Generator(device=dev).manual_seed(rank)
    ids = torch.randint(0, a.vocab, (a.mbs, a.seq + 1), device=dev, generator=g)
    inputs, labels = ids[:, :-1], ids[:, 1:]
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    times, loss = [], float("nan")
    for i in range(a.steps):
        _sync(dev)
        t = time.perf_counter()
        logits, aux = engine(inputs)
        ce = F.cross_entropy(logits.float().view(-1, a.vocab), labels.reshape(-1))
        engine.backward(ce + aux)
        engine.step()
        _sync(dev)
        times.append(time.perf_counter() - t)
        loss = float(ce.detach())
        if rank == 0:
            print(f"step {i + 1}: {times[-1]:.3f} s, loss {loss:.3f}", file=sys.stderr, flush=True)
    warm = times[a.warmup :] or times
    dt = slowest(sorted(warm)[len(warm) // 2], dev)
    tok_s_gpu = a.mbs * a.seq / dt
    result.update(
        step_s=round(dt, 3),
        tok_s_gpu=round(tok_s_gpu),
        tflops_active_gpu=round(tok_s_gpu * flops_tok / 1e12, 1),
        mfu_active=round(tok_s_gpu * flops_tok / a.peak, 4),
        peak_gib=round(torch.cuda.max_memory_allocated(dev) / 2**30, 2) if dev.type == "cuda" else None,
        loss=round(loss, 3),
        aux=round(float(aux.detach()), 4),
        step_times=[round(t, 3) for t in times],
        gpu=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
    )


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def slowest(value: float, dev: torch.device) -> float:
    """The largest ``value`` over all ranks (as ``bench_moe.py``)."""
    t = torch.tensor([value], dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def check(a, dev: torch.device, result: dict) -> None:
    """``--check``: the peer's forward (DeepSpeed-MoE over the ep ranks, fp32, no engine) against
    behemoth's serial ``mixtral-4b`` model of the same shape with the same weights, on this rank's
    tokens: the largest logit difference, and that of one expert's gradient (the peer's local expert
    against behemoth's, summed over the ranks' losses). Equal up to float rounding when the two
    compute the same function; a perturbed weight shows at once."""
    import deepspeed
    from deepspeed.moe.layer import MoE

    from behemoth.models import build_model

    deepspeed.init_distributed(dist_backend="nccl" if dev.type == "cuda" else "gloo")
    rank, local = dist.get_rank(), a.experts // a.ep
    shape = dict(hidden=a.hidden, num_heads=a.heads, num_kv_heads=a.kv_heads, ffn_hidden=a.ffn, num_experts=a.experts)
    ref = build_model(
        "mixtral-4b", vocab_size=a.vocab, seq_len=a.seq, device=dev, num_layers=a.layers, experts_top_k=a.top_k, **shape
    )
    with dev:
        peer = MixtralLike(a, MoE)
    for module in peer.modules():
        if isinstance(module, MoE):
            module.set_deepspeed_parallelism()
    with torch.no_grad():
        for name in ("embed", "lm_head", "norm"):
            getattr(peer, name).weight.copy_(getattr(ref, name).weight)
        for mine, theirs in zip(peer.layers, ref.layers):
            for name in "qkvo":
                getattr(mine.attn, name).weight.copy_(getattr(theirs.attn, name).weight)
            mine.attn_norm.weight.copy_(theirs.attn_norm.weight)
            mine.mlp_norm.weight.copy_(theirs.mlp_norm.weight)
            mine.moe.deepspeed_moe.gate.wg.weight.copy_(theirs.mlp.router.weight)
            for j, expert in enumerate(mine.moe.deepspeed_moe.experts.deepspeed_experts):
                e = rank * local + j  # DeepSpeed's all-to-all hands rank r experts r * E / ep ...
                gate, up = theirs.mlp.gate_up_proj[e].chunk(2, dim=0)
                expert.gate.weight.copy_(gate)
                expert.up.weight.copy_(up)
                expert.down.weight.copy_(theirs.mlp.down_proj[e])
    g = torch.Generator(device=dev).manual_seed(rank)
    ids = torch.randint(0, a.vocab, (a.mbs, a.seq), device=dev, generator=g)
    got, _ = peer(ids)
    want = ref(ids)
    got.float().pow(2).mean().backward()
    want.float().pow(2).mean().backward()
    mine = peer.layers[0].moe.deepspeed_moe.experts.deepspeed_experts[0].down.weight.grad
    theirs = ref.layers[0].mlp.down_proj.grad.clone()
    dist.all_reduce(theirs)  # the peer's expert saw both ranks' tokens
    result.update(
        check_logits_max_diff=slowest((got - want).abs().max().item(), dev),
        check_logits_scale=round(want.abs().max().item(), 4),
        check_expert_grad_max_diff=slowest((mine - theirs[rank * local]).abs().max().item(), dev),
        check_expert_grad_scale=float(theirs[rank * local].abs().max()),
    )


def dry(a) -> None:
    """Parameter counts without DeepSpeed's engine or process groups: the peer's MoE layers are
    stand-ins with DeepSpeed's parameter layout (gate ``wg`` and ``E / ep`` local experts)."""

    class LayoutMoE(nn.Module):
        def __init__(self, hidden_size, expert, num_experts, ep_size, **_):
            super().__init__()
            import copy

            self.deepspeed_moe = nn.Module()
            self.deepspeed_moe.gate = nn.Module()
            self.deepspeed_moe.gate.wg = nn.Linear(hidden_size, num_experts, bias=False)
            self.deepspeed_moe.experts = nn.Module()
            self.deepspeed_moe.experts.deepspeed_experts = nn.ModuleList(
                copy.deepcopy(expert) for _ in range(num_experts // ep_size)
            )

    with torch.device("meta"):
        model = MixtralLike(a, LayoutMoE)
    peer = counts(model, a)
    flops, theirs = behemoth_flops(a)
    out = dict(
        what="moe-model-dry",
        peer="deepspeed-moe",
        ep=a.ep,
        total=peer["total"],
        active=peer["active"],
        expert_local=peer["expert_local"],
        behemoth_total=theirs.get("total"),
        behemoth_active=theirs.get("active"),
        match=None if flops is None else (theirs["total"], theirs["active"]) == (peer["total"], peer["active"]),
        flops_per_token=flops if flops is not None else 6 * peer["active"] + 12 * a.layers * a.hidden * a.seq,
    )
    print("RESULT " + json.dumps(out), flush=True)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mbs", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3, help="untimed first steps")
    p.add_argument("--peak", type=float, default=989e12, help="dense bf16 peak FLOP/s per GPU (H100/H200 SXM)")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--ffn", type=int, default=5632, help="each expert's FFN width")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--ep", type=int, default=0, help="expert-parallel ranks (0: the world size; --dry: 2)")
    p.add_argument(
        "--capacity-factor",
        type=float,
        default=0.0,
        help="0: dropless (drop_tokens=False); F > 0: drop past ceil(F * k * T / E) rows per expert",
    )
    p.add_argument("--top2-sampling", action="store_true", help="DeepSpeed's Gumbel-sampled 2nd expert")
    p.add_argument("--bucket", type=float, default=5e8, help="ZeRO reduce/allgather bucket (elements)")
    p.add_argument("--no-bf16", dest="bf16", action="store_false", help="fp32 (a CPU smoke check's fallback)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: gloo, DS_ACCELERATOR=cpu")
    p.add_argument("--tiny", action="store_true", help="tiny shapes: a CPU smoke check, not a measurement")
    p.add_argument(
        "--check", action="store_true", help="compare the peer's forward with behemoth's model (fp32; --tiny on CPU)"
    )
    p.add_argument("--dry", action="store_true", help="print parameter counts and exit (no DeepSpeed, no GPU)")
    if p.parse_args(argv).tiny:  # tiny defaults; flags given still win
        p.set_defaults(**TINY)
    return p.parse_args(argv)


def main(argv=None) -> None:
    a = parse_args(argv)
    if a.dry:
        a.ep = a.ep or 2
        dry(a)
        return
    cuda = a.device == "cuda"
    if not cuda:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    a.ep = a.ep or world
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    result = dict(
        what="moe-model",
        model="mixtral-4b" if not a.tiny else "tiny",
        peer="deepspeed-moe",
        mode=f"deepspeed-moe-ep{a.ep}-zero2",
        gpus=world,
        ep=a.ep,
        layers=a.layers,
        experts=a.experts,
        top_k=a.top_k,
        mbs=a.mbs,
        global_batch=a.mbs * world,
        seq=a.seq,
        vocab=a.vocab,
        dropless=a.capacity_factor <= 0,
        capacity_factor=a.capacity_factor or None,
        top2_2nd_expert_sampling=a.top2_sampling,
        bf16=a.bf16,
        zero=2,
        settings=SETTINGS,
    )
    failed = False
    try:
        if a.experts % a.ep or world % a.ep:
            raise ValueError(f"--ep {a.ep} must divide --experts {a.experts} and the world size {world}.")
        (check if a.check else run)(a, dev, result)
    except Exception as e:  # the peer's failure is its result
        failed = True
        result.update(error=f"{type(e).__name__}: {e}"[:600], rank=rank)
        traceback.print_exc()
    if rank == 0 or failed:
        print("RESULT " + json.dumps(result), flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    if failed:  # the other ranks may be inside a collective: no barrier; torchrun ends them
        os._exit(1)
    try:
        dist.barrier()
    finally:
        dist.destroy_process_group()
        os._exit(0)  # DeepSpeed's and NCCL's threads must not hold the exit


if __name__ == "__main__":
    main()

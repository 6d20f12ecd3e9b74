"""Peer for MoE benchmarks: transformers' own expert parallelism training its Mixtral
(``DistributedConfig(tp_size=world, enable_expert_parallel=True)``: experts sharded over the ranks
by the model's ``ep_plan``, attention split by its tensor plan, the ranks' expert outputs summed by
an all-reduce), at the shape of behemoth's ``mixtral-4b`` preset (16 layers, hidden 2,048, expert
FFN 5,632, 8 experts, top-2, vocab 32,000), random weights written once with ``save_pretrained``
and loaded through ``from_pretrained`` as transformers asks.

    torchrun --nproc-per-node 2 benchmarks/peer_hf_mixtral_ep.py [--mbs 4] [--seq 2048]
    torchrun --nproc-per-node 2 benchmarks/peer_hf_mixtral_ep.py --tiny --device cpu   # smoke, gloo

Under ``tp_size`` (transformers before 5.18) every rank runs the same sequences (tensor
parallelism replicates the input), so tokens/s per GPU is the batch's tokens over the step time
over the world size; under ``fsdp_size`` x ``ep_size`` (5.18 on) each rank runs its own. bf16 parameters
and AdamW over them (what the model loads as; no fp32 masters), the loss with the router's
balancing term (``output_router_logits``). MFU counts active FLOPs as ``peer_hf_mixtral.py``
does. One RESULT json line (rank 0); an exception during the step is printed as the result's
``error`` (transformers' expert parallelism is documented for inference)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist


def config(a):
    from transformers import MixtralConfig

    shape = (
        dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
        if a.tiny
        else dict(
            hidden_size=2048,
            intermediate_size=5632,
            num_hidden_layers=16,
            num_attention_heads=16,
            num_key_value_heads=8,
        )
    )
    cfg = MixtralConfig(
        **shape,
        num_local_experts=8,
        num_experts_per_tok=2,
        vocab_size=512 if a.tiny else 32000,
        max_position_embeddings=a.seq,
        tie_word_embeddings=False,
        output_router_logits=True,
    )
    cfg._attn_implementation = "sdpa"
    return cfg


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mbs", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--ckpt", default=os.path.join(tempfile.gettempdir(), "peer_hf_mixtral_ep"))
    a = p.parse_args(argv)
    if a.tiny:
        a.seq, a.ckpt = min(a.seq, 64), a.ckpt + "-tiny"
    cuda = a.device == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    from transformers import MixtralForCausalLM

    cfg = config(a)
    if rank == 0:
        torch.manual_seed(0)
        MixtralForCausalLM(cfg).to(torch.bfloat16).save_pretrained(a.ckpt)
    dist.barrier()
    result = dict(what="moe-model", model="hf-mixtral", peer="transformers-ep", gpus=world, mbs=a.mbs, seq=a.seq)
    try:
        from transformers.distributed.configuration_utils import DistributedConfig

        dist_config, replicated = _distributed_config(DistributedConfig, world)
        result["distributed_config"] = repr(dist_config)[:300]
        model = MixtralForCausalLM.from_pretrained(
            a.ckpt,
            dtype=torch.bfloat16,
            distributed_config=dist_config,
        ).train()
        total = sum(p.numel() for p in model.parameters())  # this rank's (local shards)
        expert = sum(p.numel() for n, p in model.named_parameters() if "experts" in n)
        result.update(params_local_b=round(total / 1e9, 3), expert_params_local_b=round(expert / 1e9, 3))
        # active FLOPs as the serial model counts them (the world's experts over E, times k)
        h, i, n_layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
        expert_total = n_layers * cfg.num_local_experts * 3 * h * i
        dense_total = _dense_params(cfg)
        active = dense_total + expert_total * cfg.num_experts_per_tok / cfg.num_local_experts
        flops_tok = 6 * active + 12 * n_layers * h * a.seq
        # one parameter at a time: its DTensor and plain parameters cannot share a fused or foreach step
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False, fused=False)
        g = torch.Generator(device=dev).manual_seed(0 if replicated else rank)
        x = torch.randint(0, cfg.vocab_size, (a.mbs, a.seq), device=dev, generator=g)
        times = []
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        for _ in range(a.steps):
            if cuda:
                torch.cuda.synchronize()
            t = time.perf_counter()
            out = model(input_ids=x.to(model.device), labels=x.to(model.device))
            out.loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        tail = times[min(3, len(times) - 1) :]
        dt = sorted(tail)[len(tail) // 2]
        tok_gpu = a.mbs * a.seq / dt / (world if replicated else 1)
        result.update(
            step_s=round(dt, 3),
            tok_s_gpu=round(tok_gpu),
            tflops_active_gpu=round(tok_gpu * flops_tok / 1e12, 1),
            mfu_active=round(tok_gpu * flops_tok / 989e12, 4),
            peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
            loss=round(float(out.loss.detach()), 3),
            gpu=torch.cuda.get_device_name() if cuda else "cpu",
        )
    except Exception as e:  # the peer's failure is its result
        result["error"] = f"{type(e).__name__}: {e}"[:400]
        traceback.print_exc()
    if rank == 0:
        print("RESULT " + json.dumps(result), flush=True)
    sys.stdout.flush()
    dist.barrier()
    dist.destroy_process_group()


def _distributed_config(cls, world: int):
    """``(config, replicated)``: expert parallelism over ``world`` ranks as this transformers
    version spells it -- ``ep_size`` where it has one (5.18 on), with ``fsdp_size`` over the same
    ranks for the dense modules as it asks (each rank its own sequences), else ``tp_size`` with
    ``enable_expert_parallel`` (attention split by the tensor plan; every rank the same
    sequences: ``replicated``)."""
    import inspect

    if "ep_size" in inspect.signature(cls).parameters:
        return cls(fsdp_size=world, ep_size=world), False
    return cls(tp_size=world, enable_expert_parallel=True), True


def _dense_params(cfg) -> int:
    """Parameters outside the experts: embeddings, head, attention, norms, routers."""
    h, n = cfg.hidden_size, cfg.num_hidden_layers
    kv = cfg.num_key_value_heads * (h // cfg.num_attention_heads)
    attention = h * h * 2 + h * kv * 2
    return 2 * cfg.vocab_size * h + n * (attention + 2 * h + h * cfg.num_local_experts) + h


if __name__ == "__main__":
    main()

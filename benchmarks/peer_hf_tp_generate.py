"""Peer for ``generate.py``: transformers' own tensor-parallel generation (``from_pretrained(...,
tp_plan="auto")``, its DTensor plan for Llama) over every rank of the launch, at the Llama-3-8B
shape with random bf16 weights, batch ``--batch``, ``--prompt`` tokens, ``--new`` new tokens.

    torchrun --standalone --nproc-per-node 2 benchmarks/peer_hf_tp_generate.py            # tp 2
    torchrun --standalone --nproc-per-node 4 benchmarks/peer_hf_tp_generate.py --batch 1,64
    torchrun --standalone --nproc-per-node 2 benchmarks/peer_hf_tp_generate.py --tiny     # CPU, gloo: a smoke run

transformers' tensor parallelism loads from a checkpoint directory, so rank 0 first writes one
(``--ckpt``, safetensors, the random weights drawn on its device; kept and reused when it is
there with the same config). Two modes per batch size, each timed on the last of ``--repeats``
calls (the earlier ones warm up and compile): ``eager-dynamic-cache`` (transformers' default)
and ``static-cache-compile`` (``cache_implementation="static"``, which transformers compiles by
itself). Greedy, no EOS: every call makes exactly ``--new`` tokens per row. tokens/s counts
``batch * new / seconds`` of the whole ``generate`` call (prefill included), as ``generate.py``
counts behemoth's. One ``RESULT {json}`` line per run on rank 0; ``same_tokens``: every rank
produced the tokens rank 0 did. Needs transformers and accelerate (which ``tp_plan`` requires;
neither is a dependency of behemoth's).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist


def hf_config(tiny: bool, layers: int | None):
    from transformers import LlamaConfig

    shape = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, vocab_size=128256)
    if tiny:
        shape = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, vocab_size=1024)
    if layers:
        shape["num_hidden_layers"] = layers
    cfg = LlamaConfig(
        **shape,
        num_attention_heads=32 if not tiny else 8,
        num_key_value_heads=8 if not tiny else 4,
        max_position_embeddings=4096,
        rope_theta=500000.0,
        tie_word_embeddings=False,
    )
    cfg._attn_implementation = "sdpa"
    return cfg


def write_checkpoint(cfg, path: str, device: torch.device) -> None:
    """Rank 0: random weights (normal(0, 0.02), norms one) of ``cfg`` in bf16, saved to ``path``
    unless a checkpoint of the same config is there."""
    from transformers import LlamaConfig, LlamaForCausalLM

    marker = os.path.join(path, "config.json")
    if os.path.exists(marker) and LlamaConfig.from_pretrained(path).to_dict() == cfg.to_dict():
        return
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model = model.to_empty(device=device).to(torch.bfloat16)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    model.save_pretrained(path)
    del model


def timed(model, ids, new: int, repeats: int, **kw) -> tuple[float, torch.Tensor]:
    for _ in range(repeats):
        if ids.is_cuda:
            torch.cuda.synchronize()
        dist.barrier()
        t = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, **kw)
        if ids.is_cuda:
            torch.cuda.synchronize()
        dt = time.perf_counter() - t
    return dt, out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", default="1", help="batch sizes, comma-separated (default 1)")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3, help="calls per run; the last is timed")
    p.add_argument("--layers", type=int, default=None, help="fewer layers for a quick check")
    p.add_argument("--modes", default="eager-dynamic-cache,static-cache-compile")
    p.add_argument("--ckpt", default="/tmp/hf_llama3_8b_random", help="where rank 0 writes the checkpoint")
    p.add_argument("--tiny", action="store_true", help="a tiny model on CPU (gloo): checks the script")
    a = p.parse_args()

    cuda = torch.cuda.is_available() and not a.tiny
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    cfg = hf_config(a.tiny, a.layers)
    if a.tiny:
        a.ckpt += "-tiny"
    if dist.get_rank() == 0:
        write_checkpoint(cfg, a.ckpt, device)
    dist.barrier()
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(a.ckpt, tp_plan="auto", dtype=torch.bfloat16).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    world = dist.get_world_size()
    modes = {"eager-dynamic-cache": {}, "static-cache-compile": {"cache_implementation": "static"}}
    for batch in map(int, a.batch.split(",")):
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(0, cfg.vocab_size, (batch, a.prompt), generator=g).to(device)
        for mode in a.modes.split(","):
            result = dict(what="hf-tp-generate", mode=mode, tp=world, batch=batch, prompt=a.prompt, new=a.new)
            try:
                dt, out = timed(model, ids, a.new, a.repeats, **modes[mode])
            except torch.OutOfMemoryError as e:
                result["error"] = f"OOM: {e}"[:200]
            else:
                first = out.clone()
                dist.broadcast(first, 0)
                same = torch.tensor([int(torch.equal(first, out))], device=device)
                dist.all_reduce(same, op=dist.ReduceOp.MIN)
                result.update(
                    s=round(dt, 3),
                    tok_s=round(batch * a.new / dt, 1),
                    same_tokens=bool(same.item()),
                    peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
                    gpu=torch.cuda.get_device_name() if cuda else "cpu",
                )
            if dist.get_rank() == 0:
                print("RESULT " + json.dumps(result), flush=True)
    dist.barrier()
    # the process group's teardown after transformers' tp model and the compiled static-cache runs
    # hung on 2x H200 (torch 2.11, transformers 5) after every result was printed, until the call's
    # time limit: leave without it (the results are out, the job is over)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()

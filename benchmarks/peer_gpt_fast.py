"""Peer benchmark: pytorch-labs/gpt-fast's own generation code at the Llama-3-8B shape, random
weights, bf16, one ``RESULT {json}`` line per configuration in the format of
``benchmarks/generate.py`` (behemoth's), so the two can be run in one device call and compared.

gpt-fast is not part of this repository: point ``--gpt-fast`` at an unpacked snapshot of it
(default ``peers/gpt-fast``, relative to the working directory). Its ``generate.py``,
``model.py`` and ``tp.py`` are imported and run as they are; this script only replaces what
needs a checkpoint or a tokenizer:

* the model is ``Transformer.from_name(--model)`` (default ``llama-3-8b``: 32 layers, 32 heads,
  8 kv heads, hidden 4096, ffn 14336, vocab 128256) built on the meta device, materialized in
  bf16 with normal(0, 0.02) weights (norms 1) drawn with the same seed on every rank, then split
  by gpt-fast's ``tp.apply_tp`` when launched under torchrun with more than one process
  (``tp.maybe_init_dist``, NCCL) and copied into compact tensors, as gpt-fast's ``_load_model``
  does when it moves the split checkpoint to the GPU;
* the prompt is gpt-fast's synthetic one (``--prompt`` integer: token ids drawn from 0..1023),
  the same row repeated ``--batch`` times, as its ``generate`` does;
* its ``tokenizer.py`` imports sentencepiece and tiktoken: where they are missing, empty stand-in
  modules are put in ``sys.modules`` for the import alone (no tokenizer is ever used).

``--compile`` compiles as gpt-fast's ``main()`` does: its module-level ``decode_one_token``
replaced by ``torch.compile(..., mode="reduce-overhead", fullgraph=True)`` (CUDA graphs, the
tensor-parallel all-reduces inside the graph), and with ``--compile-prefill`` its ``prefill`` by
``torch.compile(..., fullgraph=True, dynamic=True)``; importing its ``generate.py`` sets its
inductor options (coordinate-descent tuning, the FX graph cache).

Sampling is gpt-fast's own sampler. The default ``--top-k 1`` makes it greedy (only the largest
logit survives its top-k filter, so its exponential-race draw returns the argmax), the decoding
of ``benchmarks/generate.py``; ``--top-k 200 --temperature 0.8`` are gpt-fast's own defaults.

Timing: per configuration, ``--warmup`` calls of gpt-fast's ``generate`` (the first compiles;
gpt-fast's ``main()`` discards one), then ``--samples`` timed calls. ``s`` is their mean (gpt-fast
averages its samples), ``tok_s = batch * new / s`` (every row's new tokens, prefill included,
as ``benchmarks/generate.py`` counts; gpt-fast's own "tokens/sec" is ``new / s``, given as
``row_tok_s``), ``prefill_s`` is the second of two timed calls of its ``prefill`` on the same
batch, ``decode_ms = (s - prefill_s) / (new - 1)`` (gpt-fast's ``generate`` makes the first new
token in the prefill and the other ``new - 1`` in decode steps), ``peak_gib`` the CUDA allocator's
peak from the start of the configuration (weights included). Several configurations run in one
process (``--batch``/``--prompt``/``--new`` take comma lists, paired in order); each starts from
fresh caches and a ``torch._dynamo.reset()``, so nothing compiled for one is reused by the next.

    # GPU: tp = 1 on one GPU, tp = 2 on two (world size = tp)
    python3 benchmarks/peer_gpt_fast.py --compile --batch 1,64 --prompt 128,512 --new 256,128
    torchrun --standalone --nproc-per-node 2 benchmarks/peer_gpt_fast.py --compile \\
        --batch 1,64 --prompt 128,512 --new 256,128
    # CPU check of the script path (tp = 1 only: gpt-fast's tp.py initializes NCCL)
    python3 benchmarks/peer_gpt_fast.py --device cpu --model stories15M --batch 2 --prompt 16 --new 8
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
import types
from pathlib import Path

import torch
import torch.distributed as dist


def _stub_missing(names: list[str]) -> list[str]:
    """Put empty stand-ins in ``sys.modules`` for the modules in ``names`` that cannot be imported;
    returns the ones stubbed (to be removed after gpt-fast's import)."""
    stubbed = []
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError:
            module = types.ModuleType(name)
            module.__dict__["load_tiktoken_bpe"] = None  # ``from tiktoken.load import load_tiktoken_bpe``
            sys.modules[name] = module
            stubbed.append(name)
    return stubbed


def load_gpt_fast(directory: Path) -> tuple[types.ModuleType, types.ModuleType]:
    """gpt-fast's ``generate`` (loaded as ``gpt_fast_generate``, so this directory's own
    ``generate.py`` is not shadowed) and its ``tp`` module, from ``directory``."""
    directory = directory.resolve()
    if not (directory / "generate.py").is_file() or not (directory / "tp.py").is_file():
        sys.exit(
            f"--gpt-fast {directory}: no generate.py and tp.py there; the peer needs an unpacked "
            "pytorch-labs/gpt-fast snapshot: pass its directory with --gpt-fast."
        )
    sys.path.insert(0, str(directory))  # its modules import each other by bare name (model, tp, ...)
    stubbed = _stub_missing(["sentencepiece", "tiktoken", "tiktoken.load"])
    try:
        spec = importlib.util.spec_from_file_location("gpt_fast_generate", directory / "generate.py")
        generate = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(generate)
        import tp  # gpt-fast's tp.py: the first entry of sys.path
    finally:
        for name in stubbed:
            sys.modules.pop(name, None)
    if not hasattr(torch.backends.cuda, "sdp_kernel"):  # used by its decode_n_tokens; gone from newer torch
        raise SystemExit("this torch has no torch.backends.cuda.sdp_kernel, which gpt-fast's decode_n_tokens uses")
    return generate, tp


def build(gf, tp, name: str, device: str, use_tp: bool):
    """gpt-fast's ``Transformer.from_name(name)`` with random bf16 weights on ``device``, split by
    its ``apply_tp`` when ``use_tp``."""
    with torch.device("meta"):
        model = gf.Transformer.from_name(name)
    model = model.to(dtype=torch.bfloat16).to_empty(device=device)
    torch.manual_seed(0)  # the same full weights on every rank before the split
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    if use_tp:
        tp.apply_tp(model)
        # apply_tp keeps views of the full weights (rowwise ones strided); gpt-fast's _load_model
        # then copies them to the GPU, compact: the same here
        with torch.no_grad():
            for module in model.modules():
                for pname, p in list(module._parameters.items()):
                    if p is not None:
                        module._parameters[pname] = torch.nn.Parameter(p.contiguous().clone(), requires_grad=False)
    return model.eval()


def _sync(device: str) -> None:
    if "cuda" in device:
        torch.cuda.synchronize()


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def run_case(gf, model, originals, args, *, world: int, batch: int, prompt_len: int, new: int) -> dict:
    cuda = "cuda" in args.device
    # fresh caches and compiled code for this configuration (setup_caches keeps larger ones)
    torch._dynamo.reset()
    for block in model.layers:
        block.attention.kv_cache = None
    model.max_batch_size = model.max_seq_length = -1
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    gf.decode_one_token, gf.prefill = originals
    if args.compile:  # as gpt-fast's main() does for --compile (and --compile_prefill)
        gf.decode_one_token = torch.compile(gf.decode_one_token, mode="reduce-overhead", fullgraph=True)
        if args.compile_prefill:
            gf.prefill = torch.compile(gf.prefill, fullgraph=True, dynamic=True)

    g = torch.Generator().manual_seed(1)
    encoded = torch.randint(0, 1024, (prompt_len,), generator=g, dtype=torch.int64).to(args.device)
    sampling = dict(temperature=args.temperature, top_k=args.top_k)
    torch.manual_seed(1234)  # as its main()
    times = []
    for i in range(args.warmup + args.samples):
        _sync(args.device)
        _barrier()
        t = time.perf_counter()
        y, _ = gf.generate(
            model,
            encoded,
            new,
            batch_size=batch,
            interactive=False,
            draft_model=None,
            callback=lambda x: x,
            **sampling,
        )
        _sync(args.device)
        if i >= args.warmup:
            times.append(time.perf_counter() - t)
    assert y.shape == (batch, prompt_len + new), y.shape
    rows = encoded.view(1, -1).repeat(batch, 1)
    with torch.no_grad():
        for _ in range(2):
            _sync(args.device)
            _barrier()
            t = time.perf_counter()
            gf.prefill(model, rows, torch.arange(0, prompt_len, device=args.device), **sampling)
            _sync(args.device)
            prefill = time.perf_counter() - t
    s = sum(times) / len(times)
    return dict(
        what="gpt-fast-generate",
        tp=world,
        batch=batch,
        prompt=prompt_len,
        new_tokens=new,
        model=args.model,
        compile=args.compile,
        compile_prefill=args.compile_prefill,
        sampling="greedy (top_k=1)" if args.top_k == 1 else f"top_k={args.top_k} temperature={args.temperature}",
        s=round(s, 3),
        samples_s=[round(x, 3) for x in times],
        tok_s=round(batch * new / s, 1),
        row_tok_s=round(new / s, 1),
        decode_ms=round((s - prefill) / max(1, new - 1) * 1e3, 2),
        prefill_s=round(prefill, 4),
        prefill_tok_s=round(batch * prompt_len / prefill, 1),
        peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
        gpu=torch.cuda.get_device_name() if cuda else "cpu",
    )


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpt-fast", type=Path, default=Path("peers/gpt-fast"), help="gpt-fast snapshot directory")
    p.add_argument("--model", default="llama-3-8b", help="gpt-fast config name (default llama-3-8b)")
    p.add_argument("--tp", type=int, default=None, help="checked against the world size (torchrun's processes)")
    p.add_argument("--batch", type=_ints, default=[1], help="batch size(s), comma list (default 1)")
    p.add_argument("--prompt", type=_ints, default=[128], help="prompt length(s) (default 128)")
    p.add_argument("--new", type=_ints, default=[256], help="new tokens (default 256)")
    p.add_argument("--compile", action="store_true", help="compile decode_one_token as gpt-fast's --compile")
    p.add_argument("--compile-prefill", action="store_true", help="also compile prefill (its --compile_prefill)")
    p.add_argument("--top-k", type=int, default=1, help="its sampler's top_k; 1 (default) is greedy; its own is 200")
    p.add_argument("--temperature", type=float, default=0.8, help="its sampler's temperature (its default 0.8)")
    p.add_argument("--warmup", type=int, default=1, help="untimed generate calls first (the first compiles)")
    p.add_argument("--samples", type=int, default=3, help="timed generate calls (mean reported)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    cases = [args.batch, args.prompt, args.new]
    n = max(map(len, cases))
    if any(len(c) not in (1, n) for c in cases):
        sys.exit(
            f"--batch {args.batch}, --prompt {args.prompt}, --new {args.new}: lists pair up in order, so "
            "each must have one entry or as many as the longest; give them equal lengths."
        )
    cases = [c * n if len(c) == 1 else c for c in cases]
    if args.samples < 1 or min(cases[2]) < 2:
        sys.exit("--samples must be at least 1 and every --new at least 2 (one prefill token, one decode step).")

    gf, tp = load_gpt_fast(args.gpt_fast)
    world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # what gpt-fast's tp.py splits by
    if args.tp is not None and args.tp != world:
        sys.exit(
            f"--tp {args.tp} but {world} process(es): gpt-fast splits over all local processes; "
            f"launch with torchrun --nproc-per-node {args.tp}."
        )
    if world > 1 and "cuda" not in args.device:
        sys.exit(f"tp = {world} on {args.device}: gpt-fast's tp.py initializes NCCL, so tp > 1 needs GPUs.")
    rank = tp.maybe_init_dist()  # None at world 1; else sets the CUDA device and NCCL
    if rank is None and "cuda" in args.device:
        torch.cuda.set_device(0)
    model = build(gf, tp, args.model, args.device, use_tp=rank is not None)
    originals = (gf.decode_one_token, gf.prefill)
    for batch, prompt_len, new in zip(*cases):
        try:
            result = run_case(gf, model, originals, args, world=world, batch=batch, prompt_len=prompt_len, new=new)
        except torch.OutOfMemoryError as e:
            result = dict(
                what="gpt-fast-generate",
                tp=world,
                batch=batch,
                prompt=prompt_len,
                new_tokens=new,
                error=f"OOM: {e}"[:200],
            )
        if not rank:
            print("RESULT " + json.dumps(result), flush=True)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""GPU benchmark of generation: ``bh.generate`` on behemoth's Llama at the Llama-3-8B shape (random
weights, bf16), one RESULT json line per configuration, with transformers' own ``generate``
(the ``peer_hf_generate.py`` peer: eager dynamic cache and static cache) in the same run;
transformers' own tensor parallelism is ``peer_hf_tp_generate.py`` (``run_generate.sh`` runs both).

    torchrun --standalone --nproc-per-node 4 benchmarks/generate.py                 # tp = 1, 2, 4 + peer
    torchrun --standalone --nproc-per-node 4 benchmarks/generate.py --compile       # decode step compiled
    torchrun --standalone --nproc-per-node 4 benchmarks/generate.py --sweep 2d-vs-1d

``--sweep tp`` (default): batch 1 (``--batch 1,64``: each), prompt 128, 256 new tokens, tp = 1,
2, 4 (1D) up to the world size; the other ranks of the world run the same configuration as data-parallel replicas
(``dp = world / tp``; each replica decodes its own copy of the batch), so the figures are one
tp group's. ``--sweep 2d-vs-1d``: tp = 4 in 1D and 2D for batch 1, 8, 64, 256 (2D splits the
batch over its grid rows: a batch of 1 runs as 2 rows, one a copy). tokens/s counts the real
rows' new tokens: ``batch * new_tokens / seconds`` of the whole ``generate`` call (prefill
included); ``decode_ms`` is the time per decode step after the prefill and ``prefill_ms`` the
prefill's, both measured by ``bh.generate(return_timing=True)`` with CUDA events around them in
the timed call itself (no second call, no subtraction).

``--compile`` (``--compile step``) runs ``bh.generate(compile=True)``: the whole decode step
(forward, sampling, cache position and bookkeeping, advanced in place on the device) compiled by
inductor and replayed as one CUDA graph per token (the prefill eager), the KV cache and buffers
kept on the model between calls (the timed call replays the graphs the
earlier calls recorded). ``--compile forward`` is the older way: ``torch.compile(model.forward,
mode="reduce-overhead")``, the sampling and bookkeeping eager around it. Under 1D tensor
parallelism generation runs the layers' no-grad forward (functional collectives), so a decode
step is one graph with its all-reduces inside; 2D / 2.5D / 3D layers trace their collectives as
functional ones inside compiled code (``behemoth.comm.traced``), so their decode step is one
graph too. ``--grid-decode both`` runs each 2D configuration twice: the Linears' no-grad forward
weight-stationary (each rank keeps its weight block and moves the activations: the default) and
SUMMA's (gathering the weight columns every step), key ``grid_decode``.

``--sweep fit`` (``--prompt 4096 --new 16`` say): the largest batch 1D and 2D at tp = 4 each
generate (eager) within ``--fit-gib`` GiB a GPU (``torch.cuda.set_per_process_memory_fraction``),
doubled then bisected, every probe a RESULT line, and the 2D/1D ratio of batch x context.

``--one-shot on|both`` (tp > 1) runs ``bh.generate(one_shot_all_reduce=True)``: the decode
steps' small all-reduces over tp as a symmetric-memory one-shot all-reduce (no NVLink multicast;
``behemoth.comm.oneshot``; NCCL where it cannot run), ``both`` with and without it on the same
model, one RESULT line each (key ``one_shot``).

Each run prints ``decode_ms`` (ms per decode step) in its RESULT line; ``--profile`` adds, per
run, a torch.profiler table of the top operators per decode step (rank 0, lines prefixed
``PROFILE``): a profile of the timed call (``--new`` tokens, so a compiled run replays the graphs
it already has) minus one of a 1-token call, divided by the ``--new - 1`` decode steps; sorted by
GPU time on GPUs, by CPU time on CPU, with each op's calls per step.
"""

from __future__ import annotations

import argparse
import ast
import faulthandler
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch._dynamo.utils import counters

import behemoth as bh
from behemoth.comm import oneshot
from behemoth.models import Llama, LlamaConfig
from behemoth.parallel.tensor import tp2d

GRID_DECODE = {"stationary": [True], "summa": [False], "both": [True, False]}
"""``--grid-decode``: the 2D runs' ``Linear2D.weight_stationary`` values."""

LLAMA3_8B = dict(
    vocab_size=128256,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    hidden=4096,
    ffn_hidden=14336,
    rope_theta=500000.0,
    tie_embeddings=False,
)


TINY = dict(LLAMA3_8B, vocab_size=1024, num_layers=2, hidden=256, ffn_hidden=512)
"""``--tiny``: a smoke test of this script on CPU (gloo), not a measurement."""


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def build(seq_len: int, layers: int | None, tiny: bool) -> Llama:
    """Llama-3-8B shape, bf16, random normal(0, 0.02) weights drawn on the GPU (the same on every
    rank: ``parallelize`` broadcasts tp rank 0's anyway)."""
    base = TINY if tiny else LLAMA3_8B
    shape = dict(base, num_layers=layers or base["num_layers"])
    cfg = LlamaConfig(seq_len=seq_len, **shape)
    model = Llama(cfg, device="meta", dtype=torch.bfloat16)
    model.to_empty(device=_device())
    model.tie_weights()
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    return model.eval()


def timed_generate(model, prompts, new: int, repeats: int, compile_step: bool, one_shot: bool = False):
    """The last of ``repeats`` calls: its wall seconds (prefill included) and its
    :class:`~behemoth.generation.Generation` (the prefill's and the decode steps' seconds, read
    from CUDA events on the stream; the earlier calls compile and record the CUDA graphs)."""
    for _ in range(repeats):
        _sync()
        dist.barrier()
        t = time.perf_counter()
        out = bh.generate(
            model,
            prompts,
            max_new_tokens=new,
            compile=compile_step,
            return_timing=True,
            one_shot_all_reduce=one_shot,
        )
        _sync()
        total = time.perf_counter() - t
    return total, out


def profile_decode(model, prompts, new: int, tag: str, compile_step: bool) -> None:
    """Print (rank 0) the top operators per decode step: a profile of a ``new``-token call minus
    one of a 1-token call (the prefill), divided by the ``new - 1`` decode steps. Each profiled
    call follows an unprofiled one of the same shape, so neither compiles nor records a graph."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])

    def ops(new: int) -> dict:
        bh.generate(model, prompts, max_new_tokens=new, compile=compile_step)
        _sync()
        with profile(activities=activities) as prof:
            bh.generate(model, prompts, max_new_tokens=new, compile=compile_step)
            _sync()
        return {
            e.key: (e.count, e.self_cpu_time_total, getattr(e, "self_device_time_total", 0.0))
            for e in prof.key_averages()
        }

    steps = max(1, new - 1)
    full, prefill = ops(new), ops(1)
    rows = []
    for key, (n, cpu, dev) in full.items():
        n0, cpu0, dev0 = prefill.get(key, (0, 0.0, 0.0))
        rows.append(((n - n0) / steps, (cpu - cpu0) / steps, (dev - dev0) / steps, key))
    if dist.get_rank() != 0:
        return
    by = 2 if torch.cuda.is_available() else 1
    rows = sorted((r for r in rows if r[0] > 0), key=lambda r: -r[by])
    total_cpu, total_dev = sum(r[1] for r in rows), sum(r[2] for r in rows)
    print(
        f"PROFILE {tag}: per decode step, {sum(r[0] for r in rows):.0f} ops, self CPU {total_cpu / 1e3:.2f} ms, "
        f"self GPU {total_dev / 1e3:.2f} ms",
        flush=True,
    )
    print(f"PROFILE {'calls':>8} {'CPU us':>9} {'GPU us':>9}  op", flush=True)
    for n, cpu, dev, key in rows[:25]:
        print(f"PROFILE {n:8.1f} {cpu:9.1f} {dev:9.1f}  {key[:90]}", flush=True)


def run_config(args, *, tp: int, mode: str, batch: int, stationary: bool = True) -> None:
    world = dist.get_world_size()
    for cls in (tp2d.Linear2D, tp2d.KVReplicatedLinear2D):  # the class default, else SUMMA's forward
        cls.weight_stationary = stationary
    plan = bh.Plan(dp=world // tp, tp=tp, tp_mode=mode)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    model = bh.parallelize(build(args.prompt + args.new, args.layers, args.tiny), plan)
    if args.compile == "forward":
        model.forward = torch.compile(model.forward, mode="reduce-overhead", dynamic=False)
    g = torch.Generator().manual_seed(1)
    # every dp replica decodes the same batch: one row block per replica
    vocab = (TINY if args.tiny else LLAMA3_8B)["vocab_size"]
    prompts = torch.randint(0, vocab, (batch, args.prompt), generator=g).repeat(world // tp, 1)
    one_shots = {"off": [False], "on": [True], "both": [False, True]}[args.one_shot] if tp > 1 else [False]
    first = None
    for one_shot in one_shots:
        total, out = timed_generate(model, prompts, args.new, args.repeats, args.compile == "step", one_shot)
        first = out.tokens if first is None else first
        result = dict(
            what="behemoth-generate",
            tp=tp,
            tp_mode=mode,
            grid_decode=("stationary" if stationary else "summa") if mode != "1d" else None,
            dp=world // tp,
            batch=batch,
            prompt=args.prompt,
            new_tokens=args.new,
            compile=args.compile,
            inductor=args.inductor or None,
            one_shot=one_shot,
            # switched on where every rank could run it (else the usual all-reduce ran)
            one_shot_ran=one_shot and bool(oneshot._KEPT),
            same_tokens_as_first=bool(torch.equal(out.tokens, first)),
            s=round(total, 3),
            tok_s=round(batch * args.new / total, 1),
            decode_ms=round(out.decode_s / max(1, out.decode_steps) * 1e3, 3),
            decode_tok_s=round(batch * out.decode_steps / out.decode_s, 1) if out.decode_s > 0 else None,
            prefill_ms=round(out.prefill_s * 1e3, 2),
            prefill_tok_s=round(batch * args.prompt / out.prefill_s, 1),
            peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
            gpu=torch.cuda.get_device_name() if cuda else "cpu",
            # so far in this process: graphs compiled, and compiled graphs run without CUDA graphs
            graphs=counters["stats"]["unique_graphs"],
            cudagraph_skips=counters["inductor"]["cudagraph_skips"],
        )
        if dist.get_rank() == 0:
            print("RESULT " + json.dumps(result), flush=True)
    if args.profile:
        tag = f"tp={tp} {mode} batch={batch}" + (f" compiled ({args.compile})" if args.compile != "none" else "")
        profile_decode(model, prompts, args.new, tag, args.compile == "step")
    del model
    if cuda:
        torch.cuda.empty_cache()


def run_peer(args) -> None:
    """transformers' generate on rank 0's GPU alone (``peer_hf_generate.py``'s two modes)."""
    from transformers import LlamaConfig as HFConfig
    from transformers import LlamaForCausalLM

    cfg = HFConfig(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=args.layers or 32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=4096,
        rope_theta=500000.0,
        tie_word_embeddings=False,
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    ids = torch.randint(0, cfg.vocab_size, (1, args.prompt), device="cuda")
    for tag, kw in (("eager-dynamic-cache", {}), ("static-cache-auto-compile", {"cache_implementation": "static"})):
        for _ in range(3 if kw else 2):  # warm-ups include compilation
            torch.cuda.synchronize()
            t = time.perf_counter()
            model.generate(ids, max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False, **kw)
            torch.cuda.synchronize()
            dt = time.perf_counter() - t
        print("RESULT " + json.dumps(dict(what="hf-generate", mode=tag, s=round(dt, 3), tok_s=round(args.new / dt, 1))))
    del model
    torch.cuda.empty_cache()


def generate_fits(model, batch: int, args) -> bool:
    """Whether ``bh.generate`` of ``batch`` rows (``--prompt`` tokens, ``--new`` new ones; eager)
    runs in the memory allowed, every rank agreeing (an out-of-memory error on any rank fails it;
    the ranks hold equal shapes, so they meet it at the same operation)."""
    world, cuda = dist.get_world_size(), torch.cuda.is_available()
    vocab = (TINY if args.tiny else LLAMA3_8B)["vocab_size"]
    prompts = torch.randint(0, vocab, (batch, args.prompt), generator=torch.Generator().manual_seed(1))
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    try:
        bh.generate(model, prompts.repeat(world // 4, 1), max_new_tokens=args.new)
        failed = 0.0
    except torch.OutOfMemoryError:
        failed = 1.0
    vote = torch.tensor([failed], device=_device())
    dist.all_reduce(vote, op=dist.ReduceOp.MAX)
    return vote.item() == 0.0


def run_fit(args, mode: str) -> int:
    """The largest batch (a multiple of 2: 2D splits it over its grid rows) that ``mode`` at tp 4
    generates in the memory allowed: doubled from 2 until a batch fails or ``--fit-max`` is
    passed, then bisected. One RESULT line per probe and one for the fit; returns the batch."""
    world = dist.get_world_size()
    model = bh.parallelize(
        build(args.prompt + args.new, args.layers, args.tiny), bh.Plan(dp=world // 4, tp=4, tp_mode=mode)
    )
    context = args.prompt + args.new

    def probe(batch: int) -> bool:
        t = time.perf_counter()
        ok = generate_fits(model, batch, args)
        peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
        if dist.get_rank() == 0:
            line = dict(
                what="fit-probe",
                tp_mode=mode,
                batch=batch,
                context=context,
                fits=ok,
                s=round(time.perf_counter() - t, 1),
            )
            print("RESULT " + json.dumps(dict(line, peak_gib=None if peak is None else round(peak, 2))), flush=True)
        return ok

    lo, hi = 0, None
    batch = 2
    while hi is None and batch <= args.fit_max:
        lo, hi = (batch, None) if probe(batch) else (lo, batch)
        batch *= 2
    while hi is not None and hi - lo > 2:
        mid = (lo + hi) // 4 * 2
        lo, hi = (mid, hi) if probe(mid) else (lo, mid)
    if dist.get_rank() == 0:
        fit = dict(what="fit", tp_mode=mode, batch=lo, context=context, batch_x_context=lo * context)
        print("RESULT " + json.dumps(dict(fit, capped=hi is None, fit_gib=args.fit_gib)), flush=True)
    return lo  # the model goes with this frame; the caller empties the cache


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sweep", default="tp", choices=["tp", "2d-vs-1d", "fit"])
    p.add_argument("--fit-gib", type=float, default=24.0, help="fit: GiB a GPU may use (default 24)")
    p.add_argument("--fit-max", type=int, default=4096, help="fit: the largest batch probed (default 4096)")
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens (default 128)")
    p.add_argument("--new", type=int, default=256, help="new tokens (default 256)")
    p.add_argument("--batch", default="1", help="tp sweep: batch sizes (comma-separated; default 1)")
    p.add_argument("--batches", default="1,8,64,256", help="2d-vs-1d: batch sizes")
    p.add_argument("--repeats", type=int, default=2, help="calls per configuration; the last is timed")
    p.add_argument(
        "--compile",
        nargs="?",
        const="step",
        default="none",
        choices=["none", "step", "forward"],
        help="step (the default of a bare --compile): bh.generate(compile=True), the whole decode step one "
        "CUDA graph; forward: torch.compile(model.forward, mode='reduce-overhead') only",
    )
    p.add_argument(
        "--one-shot",
        default="off",
        choices=["off", "on", "both"],
        help="tp > 1: the decode steps' small all-reduces as the symmetric-memory one-shot all-reduce "
        "(bh.generate(one_shot_all_reduce=True)); both: one RESULT line each, the same model",
    )
    p.add_argument(
        "--grid-decode",
        default="stationary",
        choices=sorted(GRID_DECODE),
        help="2d-vs-1d: the 2D Linears' no-grad forward: weight-stationary (default), SUMMA's, or both",
    )
    p.add_argument("--layers", type=int, default=None, help="fewer layers for a quick check")
    p.add_argument("--profile", action="store_true", help="print the top ops per decode step of each run")
    p.add_argument("--no-peer", action="store_true", help="skip transformers' generate")
    p.add_argument("--tiny", action="store_true", help="a tiny model on CPU: checks the script, measures nothing")
    p.add_argument(
        "--inductor",
        default="",
        help="inductor settings for the compiled runs, e.g. coordinate_descent_tuning=1,max_autotune=1 "
        "(torch._inductor.config; each RESULT line names them)",
    )
    args = p.parse_args()
    for item in filter(None, args.inductor.split(",")):
        import torch._inductor.config as inductor_config

        key, value = item.split("=")
        setattr(inductor_config, key, ast.literal_eval(value))

    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    bh.init()
    world = dist.get_world_size()
    configs = []
    if args.sweep == "tp":
        configs = [
            dict(tp=tp, mode="1d", batch=b)
            for b in map(int, args.batch.split(","))
            for tp in (1, 2, 4)
            if tp <= world and world % tp == 0
        ]
    elif args.sweep == "fit":
        if world % 4:
            sys.exit("--sweep fit needs a multiple of 4 GPUs (tp = 4).")
        if torch.cuda.is_available():
            torch.cuda.set_per_process_memory_fraction(
                args.fit_gib * 2**30 / torch.cuda.get_device_properties(0).total_memory
            )
        fits = {}
        for mode in ("1d", "2d"):
            fits[mode] = run_fit(args, mode)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        if dist.get_rank() == 0:
            ratio = fits["2d"] / fits["1d"] if fits["1d"] else None
            print("RESULT " + json.dumps(dict(what="fit-ratio", two_d_over_one_d=ratio, **fits)), flush=True)
    else:
        if world < 4:
            sys.exit("--sweep 2d-vs-1d needs 4 GPUs (tp = 4).")
        for b in map(int, args.batches.split(",")):
            configs += [dict(tp=4, mode="1d", batch=b)]
            configs += [dict(tp=4, mode="2d", batch=b, stationary=s) for s in GRID_DECODE[args.grid_decode]]
    for c in configs:
        try:
            run_config(args, **c)
        except torch.OutOfMemoryError as e:
            if dist.get_rank() == 0:
                print("RESULT " + json.dumps(dict(what="behemoth-generate", **c, error=f"OOM: {e}"[:200])), flush=True)
            torch.cuda.empty_cache()
    if args.sweep == "tp" and not args.no_peer and not args.tiny and dist.get_rank() == 0:
        run_peer(args)
    # On GPUs this script has sat for minutes after its last result: if the barrier, the group's
    # teardown or the interpreter's exit takes over 60 s, print every thread's stack (where it
    # hangs) and exit, rather than hold the machine until the timeout.
    faulthandler.dump_traceback_later(60, exit=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""The planner's proof on GPUs: run layouts it ranks and print predicted vs measured step time
and memory, one JSON line per layout, then a summary line.

    torchrun --standalone --nproc-per-node 2 benchmarks/planner_proof.py --calibration cal.json
    torchrun --standalone --nproc-per-node 4 benchmarks/planner_proof.py --model gpt-1.3b --layouts 12
    torchrun --standalone --nproc-per-node 4 benchmarks/planner_proof.py --model gpt-6.7b --untied  # GPT-6.9B
    torchrun --standalone --nproc-per-node 4 benchmarks/planner_proof.py --model llama-8b   # Llama-3-8B's shape
    torchrun --standalone --nproc-per-node 2 benchmarks/planner_proof.py --model mixtral-4b  # experts (ep)
    torchrun --standalone --nproc-per-node 2 benchmarks/planner_proof.py --model gpt-tiny --seq 64 \
        --steps 1 --gpu-gb 80 --budget-s 120                  # no GPU: a smoke run on gloo
    python benchmarks/planner_proof.py --model gpt-6.7b --untied --calibration cal.json \
        --repredict planner_proof.log                         # an earlier run's layouts, predicted again

All ranks run the same (deterministic) search for ``--model`` on this many GPUs with
``--batch`` sequences of ``--seq`` tokens per step, run the layouts ``--include`` names (if any),
then take its top pick and, greedily,
the layouts that show the most features not yet run (tp modes, sequence parallelism,
over-decomposition, cp modes, pipeline schedules, ZeRO stages, offload, checkpointing), up to
``--layouts``, and time each for ``--steps`` steps after ``--warmup`` warm-up steps (median).
Memory measured is the peak allocated (and reserved) of the rank that used most; the
prediction's device reserve (``behemoth.planner.reserve``: CUDA context, NCCL buffers per
communicator, the allocator's slack) is not in "allocated".

Each layout builds the serial model on its GPU (fp32: 27.5 GB for GPT-6.9B, 32.1 GB for the
Llama-8B shape, within an 80 GB card) and ``bh.boost`` shards it there, as ``bench_gpt.py``
does; memory is measured from after ``boost``. The weights are drawn on the GPU (normal(0,
0.02), norms one, biases zero: the presets' init, other draws; ``--seeded-init`` draws the
presets' exact values on the CPU, a minute per 6.9B model), since step time does not depend on them.

The budget (``--budget-s``) counts from the process's start: imports, the search, each layout's
build, ``bh.boost`` and warm-up steps. A layout starts only if its expected run -- the slowest
setup seen so far (``SETUP_S`` before the first), plus ``warmup + steps`` steps at its predicted
step time times the worst measured / predicted ratio seen so far (at least 1.5 before the first)
-- ends inside it (all ranks agree), so one device call ends with its summary. A summary line
(``"final": false``) follows every layout, so a run stopped from outside still has one.

A layout that fails (out of memory on any rank, or refused by ``bh.boost``) is reported as such
and everything it held is freed before the next one starts -- its engine and model, the frames
of its traceback, and the process groups its mesh created (their NCCL buffers live outside
PyTorch's allocator); each row records what was left over when it started (``leftover_gib``,
``leftover_groups``: 0 and 0). The ranks agree on how a layout ended through the store, not a
collective: a rank that failed alone (out of memory inside ring attention's exchange, say) while
the others wait in the layout's collectives learns it within ``--agree-s`` seconds (30), prints
the layout's row with its error and ends the process, and torchrun stops the others: the run
ends in seconds, not when the collectives time out, and ``--resume`` (below) carries on with the
layout counted as out of memory. A run whose processes die inside a layout (a line
``"started": true`` with no result after it) is finished by running it again with ``--resume``
and its output: the layouts done are kept, the one it died in counts as failed (``crashed``);
``run_planner_proof.sh`` does this itself.

Summary: mean absolute step-time error, Spearman rank correlation, the measured gap of the
top pick to the best measured layout, mean memory error, and out-of-memory among layouts
predicted to fit (and layouts a run died inside). ``benchmarks/run_planner_proof.sh``
calibrates and runs 2 and 4 GPUs in one device call.
"""

from __future__ import annotations

import time

START = time.perf_counter()  # the budget counts the imports too

import argparse  # noqa: E402
import contextlib  # noqa: E402
import datetime  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import behemoth as bh  # noqa: E402
from behemoth.models import build_config, build_model  # noqa: E402
from behemoth.parallel.zero.measure import agreed_offload_host_budget  # noqa: E402
from behemoth.planner.calibration import load_calibration  # noqa: E402
from behemoth.planner.cluster import Cluster  # noqa: E402
from behemoth.planner.cost import predict  # noqa: E402
from behemoth.planner.search import Limits, search  # noqa: E402
from behemoth.planner.workload import workload_for  # noqa: E402


def features(plan) -> set:
    f = {("dp", plan.dp > 1), ("zero", plan.zero), ("offload", plan.offload), ("ckpt", plan.activation_checkpointing)}
    f.add(("param_dtype", plan.param_dtype))
    if plan.tp > 1:
        f |= {("tp", plan.tp_mode, plan.tp), ("sp", plan.sequence_parallel), ("ov", plan.tp_mode, plan.tp_overlap)}
    if plan.cp > 1:
        f |= {("cp", plan.cp_mode, plan.cp)}
    if plan.pp > 1:
        f |= {("pp", plan.pp, plan.schedule, plan.virtual_stages)}
    f.add(("mbs", plan.microbatches))
    return f


def pick(ranked, n: int) -> list:
    out, covered, cands = [ranked[0]], features(ranked[0].plan), list(ranked[1:])
    while cands and len(out) < n:
        best = max(cands, key=lambda p: (len(features(p.plan) - covered), -p.step))
        covered |= features(best.plan)
        out.append(best)
        cands.remove(best)
    return out


def spearman(a: list[float], b: list[float]) -> float:
    def ranks(x):
        order = sorted(range(len(x)), key=lambda i: x[i])
        r = [0.0] * len(x)
        for k, i in enumerate(order):
            r[i] = float(k)
        return r

    ra, rb = ranks(a), ranks(b)
    n = len(a)
    ma, mb = sum(ra) / n, sum(rb) / n
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    va = sum((x - ma) ** 2 for x in ra) ** 0.5
    vb = sum((y - mb) ** 2 for y in rb) ** 0.5
    return cov / (va * vb) if va and vb else float("nan")


DEFAULT_VOCAB = {"llama-8b": 128256}  # Llama 3's tokenizer; the other presets use GPT-2's, padded to 50304


SHRUNK_SEQ, SHRUNK_VOCAB = 64, 512


def model_overrides(a) -> dict:
    return {} if a.untied is None else {"tie_embeddings": not a.untied}


def shrunk_overrides(config) -> dict:
    """``--shrink``: the family and its head counts (what the layouts' divisibility rules read),
    8-wide heads, 8 blocks (pipelines of up to 4 ranks x 2 virtual stages), a small MLP."""
    hidden = 8 * config.num_heads
    out = dict(num_layers=8, hidden=hidden, ffn_hidden=2 * hidden)
    if getattr(config, "num_experts", 0):
        out["expert_ffn_hidden"] = hidden
    return out


@torch.no_grad()
def init_on_device(model: torch.nn.Module, seed: int = 0) -> None:
    """The presets' init recipe drawn on the parameters' device: normal(0, 0.02) for weights,
    ones for norm weights, zeros for biases and buffers (a tied weight drawn once)."""
    g = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    seen = set()
    for module in model.modules():
        norm = "Norm" in type(module).__name__
        for name, p in module.named_parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            if norm and name == "weight":
                p.fill_(1.0)
            elif name == "bias" or norm:
                p.zero_()
            else:
                p.normal_(0.0, 0.02, generator=g)
    for b in model.buffers():  # the routers' load-balancing biases start at zero
        b.zero_()


def build(a, dev, vocab: int) -> torch.nn.Module:
    kw = model_overrides(a)
    if a.shrink:
        kw.update(shrunk_overrides(build_config(a.model, vocab_size=vocab, seq_len=a.seq)))
    if a.seeded_init or dev.type != "cuda":
        return build_model(a.model, vocab_size=vocab, seq_len=a.seq, device=dev, **kw)
    model = build_model(a.model, vocab_size=vocab, seq_len=a.seq, device="meta", **kw)
    model.to_empty(device=dev)
    model.tie_weights()
    init_on_device(model)
    return model


def run_one(a, plan, dev, vocab: int) -> dict:
    cuda = dev.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    t0 = time.perf_counter()
    model = build(a, dev, vocab)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda and plan.offload is None)
    engine = bh.boost(model, opt, plan)
    LIVE_ENGINE[:] = [engine]  # for oom_census; run_guarded drops it
    sync()
    built = time.perf_counter() - t0
    g = torch.Generator(device=dev).manual_seed(engine.dp_rank)
    share = a.batch // engine.dp_size
    x = torch.randint(0, vocab, (share, a.seq + 1), device=dev, generator=g)
    batch = {"input_ids": x[:, :-1], "labels": x[:, 1:]}
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    # offload='auto' places its chunks after a measured warm-up step and runs the next one on
    # probation: both untimed, and the memory read from the placement it keeps
    warmup = max(a.warmup, 2) if plan.offload == "auto" else a.warmup
    times, retries = [], 0
    for i in range(warmup + a.steps):
        if cuda and i == warmup:
            retries = torch.cuda.memory_stats().get("num_alloc_retries", 0)
        if cuda and plan.offload == "auto" and i == warmup:
            torch.cuda.reset_peak_memory_stats()
        injected = i == 0 and INJECT.get("rank", -1) in (-1, dist.get_rank())
        if injected and INJECT.get("oom") == plan:  # a test's stand-in for running out of device memory
            raise torch.OutOfMemoryError("injected out-of-memory (--inject-oom)")
        if injected and INJECT.get("crash") == plan:  # a test's stand-in for a rank dying mid-layout
            os._exit(3)
        sync()
        t = time.perf_counter()
        engine.step(batch)
        sync()
        times.append(time.perf_counter() - t)
    warm = sorted(times[warmup:])
    # the most any rank used (a pipeline's last stage holds the head and the logits); no figure on CPU
    used = [torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()] if cuda else [float("nan")] * 2
    # the caching allocator's frees-and-retries in the timed steps (each synchronizes the device): a
    # layout near the card's memory may lose time to them that no cost term holds
    used.append(torch.cuda.memory_stats().get("num_alloc_retries", 0) - retries if cuda else 0)
    peak = torch.tensor(used, device=dev, dtype=torch.float64)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return dict(
        measured_step_s=warm[len(warm) // 2],
        measured_alloc_gib=peak[0].item() / 2**30,
        measured_reserved_gib=peak[1].item() / 2**30,
        alloc_retries=int(peak[2].item()),
        build_s=built,
        first_step_s=times[0],
        step_times_s=times,
        **card_state(dev),
    )


def card_state(dev) -> dict:
    """This rank's GPU after the timed steps: SM clock (MHz), power (W), temperature (C), where
    torch can read them (pynvml); what a step time measured slower than predicted may owe to."""
    if dev.type != "cuda":
        return {}
    out = {}
    for key, fn in (("sm_clock_mhz", torch.cuda.clock_rate), ("power_w", torch.cuda.power_draw)):
        try:
            out[key] = float(fn(dev)) / (1000.0 if key == "power_w" else 1.0)
        except Exception:  # no pynvml, or a driver that does not say
            pass
    with contextlib.suppress(Exception):
        out["temperature_c"] = float(torch.cuda.temperature(dev))
    return out


def _rounded(v):
    return [round(x, 4) for x in v] if isinstance(v, list) else round(v, 4)


INJECT: dict = {}
"""``--inject-oom`` / ``--inject-crash``: the Plan whose first step raises out-of-memory or ends
the process, on every rank or on ``--inject-rank`` only (``"rank"``)the process (tests of the recovery and of ``--resume``)."""


AGREE_S = 30.0
"""Seconds a rank waits, once its part of a layout has ended, for every other rank to say how
theirs ended (``--agree-s``). All ranks end a layout within a step of each other when it runs
or fails everywhere alike; a rank still silent after this is blocked in a collective or a
point-to-point exchange with a rank that failed alone (an out-of-memory on one rank inside ring
attention's exchange), and no collective can reach it."""


class LayoutStuck(Exception):
    """Some rank did not end the layout in :data:`AGREE_S` after this one did (args: this rank's
    error, '' if its part ran, and the ranks that did not answer)."""


def agree(key: str, err: str, timeout: float) -> dict[int, str]:
    """Every rank's outcome of the layout ``key`` ('' if its part ran, else its error), through the
    default group's key-value store: no collective, so a rank that failed alone learns within
    ``timeout`` seconds that the others are blocked, instead of joining a collective they never
    reach. Raises :class:`LayoutStuck` when some rank has not answered by then."""
    store = dist.distributed_c10d._get_default_store()
    rank, world = dist.get_rank(), dist.get_world_size()
    store.set(f"{key}/{rank}", "failed " + err if err else "ok")
    keys = [f"{key}/{r}" for r in range(world)]
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout))
    except dist.DistStoreError:
        silent = [r for r in range(world) if not store.check([f"{key}/{r}"])]
        raise LayoutStuck(err, silent) from None
    said = {r: store.get(k).decode() for r, k in zip(range(world), keys)}
    return {r: v.removeprefix("failed ") if v != "ok" else "" for r, v in said.items()}


def run_guarded(run, dev, key: str = "layout", agree_s: float = AGREE_S) -> tuple[dict | None, str]:
    """``run()`` on every rank, whatever it raises: ``(its result, "")``, or ``(None, kind: message)``
    when any rank failed (agreed through the store, :func:`agree`, before anything touches the
    device or a collective: freeing the cache synchronizes the device, which waits forever on a
    communication kernel whose peer never comes). What the layout held is freed before
    returning -- its engine, optimizer and model (the exception's traceback and frames are
    dropped first: they keep every local of the failed step alive, and the allocator's cache
    cannot be emptied under them) and the process groups its mesh created (each holds an NCCL
    communicator's buffers on the device, outside PyTorch's allocator): else the next layout
    starts with less memory than the plan assumed, or fails to create its groups at all. A rank
    that failed alone, the others blocked with it, raises :class:`LayoutStuck` (main reports the
    layout and ends the process: torchrun stops the rest, ``--resume`` goes on)."""
    before = set(_process_groups())
    out, err = None, ""
    try:
        out = run()
    except torch.OutOfMemoryError as e:  # predicted to fit: a failure of the model, reported
        err = "oom: " + str(e).splitlines()[0] + oom_census()
        _drop(e)
    except (ValueError, NotImplementedError) as e:  # refused by bh.boost on every rank: a search bug
        err = "refused: " + str(e).splitlines()[0]
        _drop(e)
    except MemoryError as e:  # the host had less free memory for offloaded chunks than planned for
        err = "host memory: " + str(e).splitlines()[0]
        _drop(e)
    LIVE_ENGINE.clear()
    said = agree(key, err, agree_s)
    free_memory()
    for pg in _process_groups():
        if pg not in before:
            with contextlib.suppress(Exception):
                dist.destroy_process_group(pg)
    free_memory()
    failed = [(r, v) for r, v in sorted(said.items()) if v]
    if failed and not err:
        r, v = failed[0]
        kind, _, msg = v.partition(": ")
        err = f"{kind}: rank {r} failed this layout: {msg}"
    return (None, err) if err else (out, "")


LIVE_ENGINE: list = []
"""The layout's engine while it runs (run_one sets it, run_guarded clears it): what :func:`oom_census` reads."""


def oom_census() -> str:
    """What the device held when a layout ran out of memory, appended to its error: the engine's
    model data by kind (GiB) and the largest live allocations (GiB x count). An out-of-memory
    layout predicted to fit then says which term the footprint missed."""
    if not torch.cuda.is_available():
        return ""
    out = []
    with contextlib.suppress(Exception):
        model = LIVE_ENGINE[0].memory_report().get("cuda", {}) if LIVE_ENGINE else {}
        out.append("model data GiB " + ", ".join(f"{k} {v / 2**30:.2f}" for k, v in model.items()))
    with contextlib.suppress(Exception):
        sizes: dict[float, int] = {}
        for seg in torch.cuda.memory_snapshot():
            for block in seg["blocks"]:
                if block["state"] == "active_allocated":
                    gib = round(block["size"] / 2**30, 2)
                    sizes[gib] = sizes.get(gib, 0) + 1
        top = sorted(sizes.items(), reverse=True)[:8]
        out.append("largest live blocks GiB " + ", ".join(f"{g} x{n}" for g, n in top))
    return (" | " + "; ".join(out)) if out else ""


def _process_groups() -> list:
    """The process groups that exist now but the world's (torch's own registry of them)."""
    world = dist.group.WORLD
    return [pg for pg in list(dist.distributed_c10d._world.pg_map) if pg is not world]


def _drop(e: BaseException) -> None:
    """Release what an exception keeps alive: its traceback's frames and their locals."""
    tb = e.__traceback__
    traceback.clear_frames(tb)
    e.__traceback__ = e.__context__ = e.__cause__ = None


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def leftover_gib(dev) -> float:
    """Device memory still allocated before a layout starts (the most on any rank): a layout that
    did not free what it held would inflate the next one's measured peak."""
    used = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0
    t = torch.tensor([float(used)], device=dev, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item() / 2**30


def record(row: dict, out: dict | None, err: str) -> None:
    """Put a layout's outcome in its row: what it measured, or why it failed."""
    if out is not None:
        row.update({k: _rounded(v) for k, v in out.items()})
        row["oom"] = False
        row["step_err_pct"] = round(100 * (row["predicted_step_s"] / row["measured_step_s"] - 1), 1)
        row["mem_err_pct"] = round(100 * (row["predicted_alloc_gib"] / row["measured_alloc_gib"] - 1), 1)
    elif err.startswith("refused: "):
        row.update(oom=False, refused=err.removeprefix("refused: "))
    else:
        row.update(oom=True, error=err.removeprefix("oom: "))


def end_stuck(row: dict, err: str, silent: list[int], *, rank: int, agree_s: float) -> None:
    """End the process after :class:`LayoutStuck`: ranks ``silent`` are blocked inside the layout.
    A rank that failed prints the layout's row with its error (what ``--resume`` keeps: the
    layout counts as failed, not as crashed), one whose part ran says so on stderr; either way
    it exits at once, without freeing anything (that could wait on the blocked exchange), and
    torchrun stops the blocked ranks."""
    why = f"ranks {silent} did not end the layout within {agree_s:g} s of rank {rank} (blocked): the run ended"
    if err:
        kind, _, msg = err.partition(": ")
        record(row, None, f"{kind}: rank {rank}: {msg}; {why}")
        row["stuck_ranks"] = silent
        print(json.dumps(row), flush=True)
    print(f"planner_proof: {row['plan']}: {why}", file=sys.stderr, flush=True)
    os._exit(1)


def parse_plan(text: str) -> bh.Plan:
    """A ``Plan(...)`` as ``Plan.describe()`` prints it."""
    text = text.strip()
    if not (text.startswith("Plan(") and text.endswith(")")):
        raise SystemExit(f"planner_proof: --include takes Plan(...) texts separated by ';', got {text!r}")
    return eval(text, {"__builtins__": {}}, {"Plan": bh.Plan})  # noqa: S307 -- the command line's own text


def rank_of(ranked: list, p) -> int | None:
    """``p``'s place in the search's ranking (1 = predicted fastest); None when it is not there."""
    for i, q in enumerate(ranked):
        if q.plan == p.plan:
            return i + 1
    return None


SETUP_S = 30.0
"""Seconds to allow the first layout for building the model, ``bh.boost`` and its process
groups, before one has been timed (later layouts: the slowest setup seen)."""
FIRST_RATIO = 1.5
"""Measured / predicted step time assumed before a layout has been measured."""


def seconds_left(budget: float | None, dev) -> float:
    """``budget`` less what the slowest rank has spent since its start (every rank gets the same answer)."""
    if budget is None:
        return float("inf")
    spent = torch.tensor([time.perf_counter() - START], device=dev, dtype=torch.float64)
    dist.all_reduce(spent, op=dist.ReduceOp.MAX)
    return budget - spent.item()


def expected_seconds(p, rows: list[dict], warmup: int, steps: int) -> float:
    """What running ``p`` is expected to take: the slowest setup seen (build, ``bh.boost``, the first
    step's excess over a warm one), plus its steps at its predicted time times the worst
    measured / predicted ratio seen."""
    done = [r for r in rows if "measured_step_s" in r]
    setup = max([SETUP_S] if not done else [r["build_s"] + r["first_step_s"] - r["measured_step_s"] for r in done])
    ratio = max([FIRST_RATIO] if not done else [r["measured_step_s"] / r["predicted_step_s"] for r in done])
    return setup + (warmup + steps) * p.step * max(ratio, 1.0)


def summary(rows: list[dict], *, world: int, model: str, chosen: int, skipped: int, final: bool) -> dict | None:
    """The proof's figures over the layouts measured so far (None before the first)."""
    ok = [r for r in rows if "measured_step_s" in r]
    if not rows:
        return None
    nan = float("nan")
    pred = [r["predicted_step_s"] for r in ok] or [nan]
    meas = [r["measured_step_s"] for r in ok] or [nan]
    best = min(meas)
    first = [r for r in rows if r["predicted_rank"] == 1]
    top = first[0].get("measured_step_s", float("nan")) if first else float("nan")
    return dict(
        summary=True,
        final=final,
        gpus=world,
        model=model,
        layouts=len(rows),
        chosen=chosen,
        skipped_for_time=skipped,
        seconds=round(time.perf_counter() - START, 1),
        mean_abs_step_err_pct=round(sum(abs(r["step_err_pct"]) for r in ok) / len(ok), 1) if ok else nan,
        spearman=round(spearman(pred, meas), 3) if len(ok) > 1 else float("nan"),
        top_pick_vs_best_measured_pct=round(100 * (top / best - 1), 1),
        mean_abs_mem_err_pct=round(sum(abs(r["mem_err_pct"]) for r in ok) / len(ok), 1) if ok else nan,
        oom_predicted_to_fit=sum(r["oom"] for r in rows),
        crashed=sum(bool(r.get("crashed")) for r in rows),
        refused_by_boost=sum("refused" in r for r in rows),
    )


def resumed_rows(path: str) -> list[dict]:
    """The layouts an earlier attempt of this run finished (its JSON lines in ``path``), and the one it
    ended inside (a ``started`` line with no result after it), counted as failed (``crashed``)."""
    rows: dict[str, dict] = {}
    with open(path) as f:
        for line in f:
            try:
                r = json.loads(line)
            except ValueError:
                continue
            if not isinstance(r, dict) or "plan" not in r:
                continue
            if r.pop("started", False):
                rows.setdefault(r["plan"], dict(r, oom=False, crashed=True, error="the run ended during this layout"))
            else:
                rows[r["plan"]] = r
    return list(rows.values())


def parts(p) -> dict:
    """A prediction's step time by part (seconds): what each row records beside the total."""
    return dict(
        compute=round(p.compute, 4),
        bubble=round(p.bubble, 4),
        exposed={k: round(v, 4) for k, v in p.exposed.items()},
        optimizer=round(p.optimizer + p.offload, 4),
        host=round(p.host, 4),
        host_wait=round(p.host_wait, 4),
        host_bound=p.host_bound,
    )


def repredict(a) -> None:
    """``--repredict LOG``: the layouts an earlier run measured (its JSON lines), predicted again by
    this tree's model with ``--calibration``, beside what they measured and what that run
    predicted; one line per layout and a summary. No GPU, no process group. (A model tuned on
    these measurements and judged on them proves little: the next run on GPUs is the test.)
    Layouts that failed in that run (out of memory, or the run died inside them) get a line too,
    with ``failed``: the summary counts those the model now refuses (``fits`` false) and the
    measured ones it now refuses (``refused_measured``), and compares the allocator's slack it
    predicts (``predicted_slack_gib``: what it cannot release under pressure) with the one measured (peak
    reserved less peak allocated)."""
    all_rows = resumed_rows(a.repredict)
    rows = [r for r in all_rows if "measured_step_s" in r]
    failed = [r for r in all_rows if "measured_step_s" not in r and not r.get("refused")]
    if not rows:
        raise SystemExit(f"planner_proof: no measured layouts in {a.repredict}")
    cal = load_calibration(a.calibration)
    config = build_config(
        a.model, vocab_size=a.vocab or DEFAULT_VOCAB.get(a.model, 50304), seq_len=a.seq, **model_overrides(a)
    )

    def again(r: dict):
        world = r["gpus"]
        gpu = a.gpu_gb * 2**30 if a.gpu_gb else cal.gpu_bytes
        host = {"host_bytes": a.host_gb * 2**30} if a.host_gb else {}
        cluster = Cluster(num_gpus=world, gpus_per_node=world, gpu_bytes=gpu, calibration=cal, **host)
        w = workload_for(config, seq_len=a.seq, global_batch=a.batch or 8 * world)
        return predict(parse_plan(r["plan"]), w, cluster)

    out = []
    for r in rows:
        p = again(r)
        alloc = p.memory.allocated / 2**30
        line = dict(
            plan=r["plan"],
            measured_step_s=r["measured_step_s"],
            was_step_err_pct=r["step_err_pct"],
            predicted_step_s=round(p.step, 4),
            step_err_pct=round(100 * (p.step / r["measured_step_s"] - 1), 1),
            was_predicted_parts=r.get("predicted_parts"),
            predicted_parts=parts(p),
            measured_alloc_gib=r["measured_alloc_gib"],
            was_mem_err_pct=r["mem_err_pct"],
            predicted_alloc_gib=round(alloc, 2),
            mem_err_pct=round(100 * (alloc / r["measured_alloc_gib"] - 1), 1),
            measured_slack_gib=round(r["measured_reserved_gib"] - r["measured_alloc_gib"], 2),
            predicted_slack_gib=round(p.memory.slack / 2**30, 2),
            was_predicted_gib=r["predicted_gib"],
            predicted_gib=round(p.memory.gpu_total / 2**30, 2),
            fits=p.fits,
        )
        out.append(line)
        print(json.dumps(line), flush=True)
    gone = []
    for r in failed:
        p = again(r)
        line = dict(
            plan=r["plan"],
            failed=r.get("error", "crashed")[:120],
            was_predicted_gib=r["predicted_gib"],
            predicted_alloc_gib=round(p.memory.allocated / 2**30, 2),
            predicted_slack_gib=round(p.memory.slack / 2**30, 2),
            predicted_gib=round(p.memory.gpu_total / 2**30, 2),
            fits=p.fits,
        )
        gone.append(line)
        print(json.dumps(line), flush=True)

    def mean(key: str) -> float:
        return round(sum(abs(x[key]) for x in out) / len(out), 1)

    def top_vs_best(key: str) -> float:
        """The measured step of the layout ``key`` predicts fastest (among those it lets fit) over
        the best measured, in percent (the proof's top-pick figure, over the measured layouts)."""
        fit = [x for x in out if x["fits"]] or out
        return round(100 * (min(fit, key=lambda x: x[key])["measured_step_s"] / best - 1), 1)

    best = min(x["measured_step_s"] for x in out)
    for x, r in zip(out, rows):
        x["was_predicted_step_s"] = r["predicted_step_s"]

    print(
        json.dumps(
            dict(
                repredicted=len(out),
                calibration=cal.name,
                mean_abs_step_err_pct=mean("step_err_pct"),
                was_mean_abs_step_err_pct=mean("was_step_err_pct"),
                spearman=round(spearman([x["predicted_step_s"] for x in out], [x["measured_step_s"] for x in out]), 3),
                was_spearman=round(
                    spearman([x["was_predicted_step_s"] for x in out], [x["measured_step_s"] for x in out]), 3
                ),
                top_pick_vs_best_measured_pct=top_vs_best("predicted_step_s"),
                mean_abs_mem_err_pct=mean("mem_err_pct"),
                was_mean_abs_mem_err_pct=mean("was_mem_err_pct"),
                refused_measured=[x["plan"] for x in out if not x["fits"]],
                failed=len(gone),
                failed_still_fit=[x["plan"] for x in gone if x["fits"]],
            )
        ),
        flush=True,
    )


def host_budget(a, world: int) -> dict:
    """``host_bytes`` for the planner: what the runtime lets one rank's offloaded chunks take on this
    host (``--host-gb`` per GPU, else the share of MemAvailable the ZeRO placement allows, split over
    the host's ranks), the smallest any rank reads so that every rank searches alike; {} where the
    host does not say (the planner's default)."""
    if a.host_gb:
        return {"host_bytes": a.host_gb * 2**30}
    budget = agreed_offload_host_budget(world)
    return {} if budget is None else {"host_bytes": budget}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--model",
        default="gpt-1.3b",
        help="a preset of behemoth.models: gpt-1.3b, gpt-6.7b (with --untied: GPT-6.9B), llama-8b, mixtral-4b, ...",
    )
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=None, help="sequences per step (default 8 per GPU)")
    ap.add_argument("--layouts", type=int, default=12)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per layout (the median is reported)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps before them")
    ap.add_argument(
        "--seeded-init",
        action="store_true",
        help="draw the presets' exact weights on the CPU (slow at 6.9B) instead of on the GPU",
    )
    ap.add_argument("--calibration", default="h100", help="h100, h200 or a JSON from calibrate.py")
    ap.add_argument("--vocab", type=int, default=None, help="default: 128256 for llama-8b, else 50304")
    ap.add_argument(
        "--untied",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the head its own table (default: the preset's)",
    )
    ap.add_argument(
        "--no-offload", action="store_true", help="leave offload out of the search (CPU Adam steps are slow)"
    )
    ap.add_argument("--budget-s", type=float, default=None, help="start no layout after this many seconds")
    ap.add_argument(
        "--include",
        default="",
        help="layouts to run first, as Plan.describe() prints them, separated by ';' (e.g. an earlier run's)",
    )
    ap.add_argument("--gpu-gb", type=float, default=None, help="memory per device to plan for (default: the GPU's)")
    ap.add_argument(
        "--host-gb",
        type=float,
        default=None,
        help="host memory per GPU for offloaded chunks (default: the share of MemAvailable the runtime allows)",
    )
    ap.add_argument(
        "--resume",
        default="",
        help="the output of an earlier attempt of this run that ended early: its layouts are not run again "
        "(one it ended inside counts as failed) and the summary covers them",
    )
    ap.add_argument(
        "--repredict",
        default="",
        help="an earlier run's output: predict its measured layouts again with this tree and --calibration "
        "(no GPU), beside what they measured",
    )
    ap.add_argument(
        "--param-dtypes",
        default="fp32",
        help="Plan.param_dtype choices the search tries, comma-separated: fp32 (None), bf16 (default: fp32)",
    )
    ap.add_argument("--inject-oom", default="", help="a Plan(...) whose first step raises out-of-memory (tests)")
    ap.add_argument("--inject-crash", default="", help="a Plan(...) whose first step ends the process (tests)")
    ap.add_argument(
        "--inject-rank", type=int, default=-1, help="the rank --inject-oom/--inject-crash act on (default: every rank)"
    )
    ap.add_argument(
        "--agree-s",
        type=float,
        default=AGREE_S,
        help="seconds to wait for the other ranks' outcome of a layout before ending the run (a rank failed alone)",
    )
    ap.add_argument(
        "--shrink",
        action="store_true",
        help=f"search for --model, but run each layout on a small model of its family ({SHRUNK_SEQ}-token "
        f"sequences, vocabulary {SHRUNK_VOCAB}): a CPU check that bh.boost accepts and steps every layout",
    )
    a = ap.parse_args()
    INJECT.update({k: parse_plan(v) for k, v in (("oom", a.inject_oom), ("crash", a.inject_crash)) if v})
    INJECT["rank"] = a.inject_rank
    if a.repredict:
        return repredict(a)
    bh.init()
    world, rank = dist.get_world_size(), dist.get_rank()
    dev = bh.distributed.device_for_rank()
    a.batch = a.batch or 8 * world
    vocab = a.vocab or DEFAULT_VOCAB.get(a.model, 50304)
    cal = load_calibration(a.calibration)
    if a.gpu_gb is None and dev.type != "cuda":
        raise SystemExit("planner_proof: no GPU here; pass --gpu-gb (the memory to plan for) for a smoke run on CPU")
    gpu = a.gpu_gb * 2**30 if a.gpu_gb else float(torch.cuda.get_device_properties(dev).total_memory)
    cluster = Cluster(num_gpus=world, gpus_per_node=world, gpu_bytes=gpu, calibration=cal, **host_budget(a, world))
    config = build_config(a.model, vocab_size=vocab, seq_len=a.seq, **model_overrides(a))
    w = workload_for(config, seq_len=a.seq, global_batch=a.batch)
    pdts = tuple(None if d == "fp32" else d for d in a.param_dtypes.split(","))
    limits = Limits(top=5000, offloads=(None,) if a.no_offload else Limits().offloads, param_dtypes=pdts)
    res = search(w, cluster, limits)
    chosen = pick(res.ranked, 2 * a.layouts)  # the first --layouts, and stand-ins for those left out for time
    if a.include:  # named layouts first (e.g. an earlier run's, to compare), then the picks
        named = [predict(parse_plan(t), w, cluster) for t in a.include.split(";") if t.strip()]
        keys = {p.plan for p in named}
        chosen = named + [p for p in chosen if p.plan not in keys]
    card = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    if rank == 0:
        print(
            json.dumps(
                dict(search=True, gpus=world, model=a.model, params=w.num_params, fits=res.fits, chosen=len(chosen))
            ),
            flush=True,
        )
    rows = resumed_rows(a.resume) if a.resume else []
    done = {r["plan"] for r in rows}
    skipped = 0
    for p in chosen:
        if p.plan.describe() in done:
            continue
        if len(rows) == a.layouts:
            break
        # a layout expected to end past the budget is left out (the same on every rank: the
        # prediction and the rows are), a cheaper one may fit
        if expected_seconds(p, rows, a.warmup + (p.plan.offload == "auto"), a.steps) > seconds_left(a.budget_s, dev):
            skipped += 1
            continue
        row = dict(
            gpus=world,
            model=a.model,
            card=card,
            calibration=cal.name,
            plan=p.plan.describe(),
            predicted_rank=rank_of(res.ranked, p),
            predicted_step_s=round(p.step, 4),
            predicted_gib=round(p.memory.gpu_total / 2**30, 2),
            predicted_alloc_gib=round(p.memory.allocated / 2**30, 2),
            predicted_parts=parts(p),
        )
        if rank == 0:  # what --resume reads back when the run ends inside this layout
            print(json.dumps(dict(row, started=True)), flush=True)
        row["leftover_gib"], row["leftover_groups"] = round(leftover_gib(dev), 3), len(_process_groups())
        key = f"planner_proof/layout-{len(rows)}"
        try:
            if a.shrink:
                small = argparse.Namespace(**{**vars(a), "seq": SHRUNK_SEQ})
                out, err = run_guarded(lambda: run_one(small, p.plan, dev, SHRUNK_VOCAB), dev, key, a.agree_s)
                row["shrunk"] = True
            else:
                out, err = run_guarded(lambda: run_one(a, p.plan, dev, vocab), dev, key, a.agree_s)
        except LayoutStuck as e:
            end_stuck(row, *e.args, rank=rank, agree_s=a.agree_s)
        record(row, out, err)
        rows.append(row)
        if rank == 0:
            print(json.dumps(row), flush=True)
            running = summary(rows, world=world, model=a.model, chosen=len(chosen), skipped=skipped, final=False)
            if running:
                print(json.dumps(running), flush=True)
        dist.barrier()
    final = summary(rows, world=world, model=a.model, chosen=len(chosen), skipped=skipped, final=True)
    if rank == 0 and final:
        print(json.dumps(final), flush=True)
    dist.destroy_process_group()
    sys.exit(0)


if __name__ == "__main__":
    main()

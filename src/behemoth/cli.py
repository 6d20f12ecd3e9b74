"""The ``behemoth`` command.

    behemoth config CONFIG [--section.key=value ...]     print the fully resolved config
    behemoth train  CONFIG [--section.key=value ...]     train (one process, or one rank under torchrun)
    behemoth run --nproc N [--max-restarts R] [--] train CONFIG [...]   N local ranks through torchrun
    behemoth run --nproc N [--] SCRIPT.py [ARGS ...]     N local ranks of your own script
    behemoth plan --search MODEL --gpus N [--explain ...]  the fastest layouts, predicted (no GPU needed)
    behemoth plan --memory --model NAME [--dp N ...]    what ZeRO / offload='auto' would keep where, and why
    behemoth plan --generate MODEL --gpus N [--batch B --context C --sweep N]  generation per tp layout, predicted
    behemoth export CHECKPOINT OUT [--max-shard-size 5GB] [--dtype bf16]   a transformers checkpoint
    behemoth generate CHECKPOINT --prompt TEXT [--prompts-file F] [--max-new-tokens N] [--plan.key=value ...]
                                                         continue prompts with a trained checkpoint
    behemoth --version

``train`` reads its rank and world from torchrun's environment (``bh.init()``), so the
same command scales to several nodes through torchrun's c10d rendezvous::

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        -m behemoth train CONFIG

Errors in the configuration or the job (``ValueError``, missing files or packages,
unsupported plan fields) print one line and exit with status 2; set ``BEHEMOTH_TRACEBACK=1``
for the full traceback. Any other failure keeps its traceback and exits with status 1.
Ctrl-C exits with status 130 and one line. Under ``behemoth run`` each worker that ends
abnormally also leaves a status record for the launcher's summary (``behemoth.launcher``).
"""

from __future__ import annotations

import argparse
import os
import sys

from behemoth.cli_plan import add_plan_parser, cmd_plan

USER_ERRORS = (ValueError, FileNotFoundError, ImportError, NotImplementedError, FloatingPointError)
EXIT_USER_ERROR = 2

_EPILOG = """overrides: --section.key=value, the value read as a TOML literal (else a string), e.g.
  --train.steps=100 --optim.lr=1e-3 --model.name=gpt-tiny --optim.betas=[0.9,0.99] --optim.max_grad_norm=none
sections: model, data, optim, plan, train (see `behemoth config CONFIG` for every key)."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="behemoth",
        description="Train large models with one Plan.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=_EPILOG,
    )
    p.add_argument("--version", action="version", version=f"behemoth {_version()}")
    sub = p.add_subparsers(dest="command", required=True, metavar="{train,run,config,plan,export,generate}")
    for name, text in (
        ("train", "train (one process, or one rank under torchrun)"),
        ("config", "print the fully resolved config and exit"),
    ):
        s = sub.add_parser(
            name, help=text, description=text, epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter
        )
        s.add_argument("config", help="path of a .toml job file (e.g. src/behemoth/configs/demo.toml)")
    r = sub.add_parser(
        "run",
        help="launch N local processes with torchrun, each running a behemoth command or your script",
        description="launch N local processes (torchrun --standalone) running `behemoth "
        "train|config|generate ...` or `python SCRIPT.py ARGS...`; a failed rank restarts the group up to "
        "--max-restarts times (the trainer resumes from its newest checkpoint)",
    )
    r.add_argument("--nproc", type=int, required=True, help="processes to start on this machine")
    r.add_argument(
        "--max-restarts", type=int, default=0, help="restart the whole group this many times after a failure"
    )
    r.add_argument(
        "args",
        nargs=argparse.REMAINDER,
        help="[--] train CONFIG [--section.key=value ...] | generate CHECKPOINT [...] | SCRIPT.py [ARGS ...]",
    )
    add_plan_parser(sub)
    e = sub.add_parser(
        "export",
        help="write a checkpoint (of any plan) as a transformers checkpoint directory",
        description="write the model of a `behemoth train` checkpoint as config.json, "
        "generation_config.json, sharded .safetensors with model.safetensors.index.json and the run's "
        "tokenizer files, loadable with transformers' AutoModelForCausalLM.from_pretrained(OUT); tensors "
        "are streamed one at a time",
    )
    e.add_argument("checkpoint", help="a checkpoint directory (runs/demo/checkpoints/step-200) or a run's out_dir")
    e.add_argument("out", help="the directory to write")
    e.add_argument("--max-shard-size", default="5GB", help="largest .safetensors file (default 5GB)")
    e.add_argument("--dtype", default=None, choices=["fp32", "bf16", "fp16"], help="cast (default: as stored)")
    e.add_argument(
        "--vocab-size", type=int, default=None, help="vocabulary to keep (default: the run tokenizer's; trims padding)"
    )
    g = sub.add_parser(
        "generate",
        help="continue prompts with a checkpoint the trainer wrote, printing text with the run's tokenizer",
        description="load CHECKPOINT (written under any plan) into the model and tokenizer of its run, "
        "parallelize it under --plan.key=value options (default: data parallelism over every process; under "
        "torchrun or `behemoth run`, e.g. --plan.tp=2) and print each prompt followed by its continuation",
        epilog="example:\n"
        "  behemoth generate runs/demo/checkpoints/step-200 --prompt 'def main(' --max-new-tokens 64\n"
        "  behemoth run --nproc 2 -- generate CKPT --prompt 'import' --plan.tp=2",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    g.add_argument("checkpoint", help="a checkpoint directory (runs/demo/checkpoints/step-200) or a run's out_dir")
    g.add_argument("--prompt", action="append", default=[], help="a prompt (repeat for several)")
    g.add_argument("--prompts-file", help="a text file with one prompt per line")
    g.add_argument("--max-new-tokens", type=int, default=64, help="tokens to add to each prompt (default 64)")
    g.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    g.add_argument("--temperature", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--seed", type=int, default=0, help="seed of the draws (the same text under every plan)")
    return p


def cmd_export(a) -> int:
    from behemoth.hf.export import export_checkpoint

    info = export_checkpoint(
        a.checkpoint, a.out, max_shard_size=a.max_shard_size, dtype=a.dtype, vocab_size=a.vocab_size
    )
    extra = f" and the tokenizer ({', '.join(info['tokenizer'])})" if info["tokenizer"] else ""
    print(
        f"exported {info['checkpoint']} to {info['out']}: {len(info['files'])} .safetensors file(s), "
        f"vocabulary {info['vocab_size']}{extra}",
        flush=True,
    )
    return 0


def _generation_plan(overrides: list[str]):
    """``--plan.key=value`` options as a Plan (any other section is an error)."""
    import behemoth as bh
    from behemoth.train.config import parse_overrides
    from behemoth.train.config_sections import ConfigError

    parsed = parse_overrides(overrides)
    other = sorted(set(parsed) - {"plan"})
    if other:
        raise ConfigError(f"behemoth generate takes only --plan.key=value options; got --{other[0]}.*.")
    try:
        return bh.Plan(**parsed.get("plan", {}))
    except (TypeError, ValueError) as e:
        raise ConfigError(f"[plan] {e}") from None


def cmd_generate(a, overrides: list[str]) -> int:
    import torch.distributed as dist

    import behemoth as bh
    from behemoth.train.sample import complete, load_for_generation, read_run_config, resolve_checkpoint

    prompts = list(a.prompt)
    if a.prompts_file:
        with open(a.prompts_file, encoding="utf-8") as f:
            prompts += [line.rstrip("\n") for line in f if line.strip()]
    if not prompts:
        raise ValueError("no prompt: pass --prompt TEXT (repeatable) or --prompts-file FILE (one prompt per line).")
    plan = _generation_plan(overrides)
    checkpoint = resolve_checkpoint(a.checkpoint)
    read_run_config(checkpoint)  # refuses a checkpoint without its run's config before any process group
    bh.init()
    try:
        model, tokenizer = load_for_generation(checkpoint, plan)
        texts = complete(
            model,
            tokenizer,
            prompts,
            max_new_tokens=a.max_new_tokens,
            do_sample=a.sample,
            temperature=a.temperature,
            top_k=a.top_k,
            top_p=a.top_p,
            seed=a.seed,
        )
        if dist.get_rank() == 0:
            for prompt, text in zip(prompts, texts):
                print(prompt + text, end="\n\n", flush=True)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


def _load(path: str, overrides: list[str], world_size: int | None):
    from behemoth.train.config import load_config

    return load_config(path, overrides).resolved(world_size=world_size)


def _env_world_size() -> int | None:
    return int(os.environ["WORLD_SIZE"]) if "WORLD_SIZE" in os.environ else None


def cmd_config(path: str, overrides: list[str]) -> int:
    from behemoth.train.config import format_config

    print(format_config(_load(path, overrides, _env_world_size())), end="")
    return 0


def cmd_train(path: str, overrides: list[str]) -> int:
    import torch.distributed as dist

    import behemoth as bh
    from behemoth.train.config import format_config
    from behemoth.train.run_dir import check_out_dir, restarted
    from behemoth.train.trainer import train

    config = restarted(_load(path, overrides, _env_world_size()))  # fails before any process group exists
    config.plan.check_supported()
    check_out_dir(config.train)
    bh.init()
    config = config.resolved(world_size=dist.get_world_size())
    if dist.get_rank() == 0:
        print(f"# behemoth train {path} {' '.join(overrides)}".rstrip() + "\n# fully resolved config:", flush=True)
        print(format_config(config), flush=True)
    try:
        train(config)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


def cmd_run(nproc: int, args: list[str], max_restarts: int = 0) -> int:
    from behemoth import launcher

    if args and args[0] == "--":
        args = args[1:]
    if len(args) >= 2 and args[0] in ("train", "config"):
        # Check the job here, before starting N processes that would all fail the same way.
        config = _load(args[1], _split_overrides(args[2:]), nproc)
        if args[0] == "train":
            config.plan.check_supported()
            from behemoth.train.run_dir import check_out_dir

            check_out_dir(config.train)
    return launcher.run(nproc, args, max_restarts=max_restarts)


def _split_overrides(rest: list[str]) -> list[str]:
    bad = [a for a in rest if not a.startswith("--")]
    if bad:
        raise ValueError(
            f"unexpected argument {bad[0]!r}: overrides look like --section.key=value (for example --train.steps=100)."
        )
    return rest


def main(argv: list[str] | None = None) -> int:
    """Run the command ``argv`` (default: ``sys.argv[1:]``) and return its exit status.

    Called as a program (``argv`` None: the ``behemoth`` script, ``python -m behemoth``), it
    leaves through ``os._exit`` once everything is flushed and closed: at interpreter exit
    torch 2.13's CPU runtime intermittently aborts ("terminate called without an active
    exception") after all work is done, which would turn a finished run into a failed one.
    """
    status = _main(list(sys.argv[1:] if argv is None else argv))
    if argv is None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    return status


def _version() -> str:
    from behemoth import __version__

    return __version__


def _main(argv: list[str]) -> int:
    parser = _parser()
    args, rest = parser.parse_known_args(argv)
    try:
        if args.command == "run":
            if rest:
                raise ValueError(
                    f"unexpected argument(s) {' '.join(rest)} before the launched command; "
                    f"write `behemoth run --nproc N train CONFIG ...`."
                )
            return cmd_run(args.nproc, args.args, args.max_restarts)
        if args.command == "export":
            if rest:
                raise ValueError(f"unexpected argument(s) {' '.join(rest)}; see `behemoth export --help`.")
            return cmd_export(args)
        if args.command == "plan":
            if rest:
                raise ValueError(f"unexpected argument(s) {' '.join(rest)}; see `behemoth plan --help`.")
            return cmd_plan(args)
        if args.command == "generate":
            return cmd_generate(args, _split_overrides(rest))
        overrides = _split_overrides(rest)
        return cmd_config(args.config, overrides) if args.command == "config" else cmd_train(args.config, overrides)
    except USER_ERRORS as e:
        _record_exit(e)
        if os.environ.get("BEHEMOTH_TRACEBACK"):
            raise
        rank = os.environ.get("RANK")
        where = f" (rank {rank})" if rank is not None and os.environ.get("WORLD_SIZE", "1") != "1" else ""
        print(f"behemoth: error{where}: {e}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        _record_exit(None)
        print("behemoth: interrupted", file=sys.stderr)
        return 130
    except BaseException as e:
        if isinstance(e, SystemExit):
            raise
        _record_exit(e)
        if _lost_peer_under_launcher(e):
            print(
                f"behemoth: rank {os.environ.get('RANK')} lost a peer ({_first_line(e)}); "
                f"the launcher names the rank that failed first.",
                file=sys.stderr,
                flush=True,
            )
            return 1
        raise


def _lost_peer_under_launcher(e: BaseException) -> bool:
    """A collective failing because another rank died, in a worker of ``behemoth run``: its
    traceback says nothing the launcher's summary does not (``BEHEMOTH_TRACEBACK=1`` keeps it)."""
    from behemoth import launcher

    return (
        launcher.STATUS_ENV in os.environ
        and not os.environ.get("BEHEMOTH_TRACEBACK")
        and launcher.is_comm_error(e)
        and not isinstance(e, USER_ERRORS)
    )


def _first_line(e: BaseException) -> str:
    from behemoth import launcher

    return launcher.first_line(e)


def _record_exit(e: BaseException | None) -> None:
    """Tell ``behemoth run`` (if it launched this process) how it is ending."""
    from behemoth import launcher

    if e is None:
        launcher.write_status("interrupted")
    else:
        kind = "comm_error" if launcher.is_comm_error(e) else "error"
        launcher.write_status(kind, message=launcher.first_line(e))

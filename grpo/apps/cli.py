"""The `grpo` command line: parses arguments, calls the library, turns errors into one line."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from grpo.config import DataConfig
from grpo.distributed import CollectiveError, exit_if_joined
from grpo.errors import GrpoError


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="YAML config file")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. optim.lr=1e-5")


def cmd_config(args) -> int:
    import yaml

    from grpo.config import config_to_dict, load_config

    cfg = load_config(args.config, args.overrides, plugins=args.plugin)
    check_before_model(cfg, args.trainer)
    print(yaml.safe_dump(config_to_dict(cfg), sort_keys=False), end="")
    return 0


def check_before_model(cfg, trainer: str) -> None:
    """What `grpo train` (trainer "grpo"), `grpo sft` or `grpo rm` checks before it loads the
    model, by the same functions: the names in their registries and the GRPO rules
    (`grpo.checks.check_config`), the environments and their kwargs, the reward names and
    parameters, then the preflight (output directory, the critic's and reward models'
    checkpoints, token budgets against the context, LoRA shapes, generated-data caps, memory
    estimate). The preflight reads the checkpoint's config.json, so it runs only when
    model.path exists on this machine (the scorers' checkpoints are read either way): `grpo
    config` never downloads. Left to training: the run directory's state (it depends on --resume /
    --overwrite), the weights, tokenizer and data.

    Raises:
        GrpoError: one line naming the field.
    """
    from pathlib import Path

    from grpo.checks import check_config

    check_config(cfg, trainer)
    if trainer == "grpo":
        from grpo.envs import env_factory
        from grpo.rewards import build_rewards

        if cfg.rollout.multi_turn:
            env_factory(cfg.rollout.env, cfg.rollout.env_kwargs)
        if cfg.eval.env:
            from grpo.eval import eval_env_settings

            env_factory(cfg.eval.env, eval_env_settings(cfg).get("env_kwargs"), key="eval.env")
        if cfg.rewards:
            build_rewards([r.spec for r in cfg.rewards])
    if not Path(cfg.model.path).expanduser().exists():
        if trainer == "grpo":  # the scorers' own checkpoints are read all the same
            from grpo.run.preflight import check_scorer_checkpoints

            check_scorer_checkpoints(cfg)
        logging.getLogger(__name__).info(
            "model.path %r is not on this machine: the checks that read its config.json "
            "(context, LoRA shapes, memory) run when training starts",
            cfg.model.path,
        )
        return
    if trainer == "rm":
        from grpo.train.rm import check_rm

        check_rm(cfg)
        return
    from grpo.run.preflight import preflight

    preflight(cfg, trainer)


def cmd_train(args) -> int:
    from grpo.config import load_config
    from grpo.train.grpo import train_grpo

    cfg = load_config(args.config, args.overrides, plugins=args.plugin)
    summary = train_grpo(cfg, resume=args.resume, overwrite=args.overwrite)
    if summary.get("role") == "producer":  # a rollout producer rank (rollout.ranks)
        print(f"rollout producer done: {summary['batches']} batches sampled")
    else:
        print_done(summary, job_rank())
    return 0


def job_rank() -> int:
    """This process's rank in its torchrun job (RANK; 0 without torchrun). Rank 0 is always a
    trainer (rollout producers are the last ranks) and writes final/."""
    return int(os.environ.get("RANK", "0") or 0)


def print_done(summary: dict, rank: int = 0) -> None:
    """The end of a `grpo train` / `grpo sft` run on stdout, printed by rank 0 only (every rank
    returns the same summary): ``done: N steps; weights in DIR``, or for a run that
    train.stop_on_stall ended because the task was solved ``converged at step N: ...; weights
    in DIR``; then, when they fired, the learning-health rules (`describe`) and, for a run
    that went on, the step its task was solved.

    Args:
        summary: what `train_grpo` / `train_sft` returned.
        rank: this process's rank in the job (`job_rank`).
    """
    if rank != 0:
        return
    converged = summary.get("converged")
    if converged and converged.get("stopped"):
        print(
            f"converged at step {summary['step']}: {converged['message']}; stopped by "
            f"train.stop_on_stall; weights in {summary['final']}"
        )
    else:
        print(f"done: {summary['step']} steps; weights in {summary['final']}")
    if summary.get("health"):  # learning-health rules that fired (their warnings say more)
        from grpo.run.health import describe

        print(describe(summary["health"]))
    if converged and not converged.get("stopped"):
        print(
            f"converged at step {converged['fired_step']}: {converged['message']} "
            "(train.stop_on_stall: true ends such a run there)"
        )


def cmd_sft(args) -> int:
    from grpo.config import load_config
    from grpo.train.sft import train_sft

    cfg = load_config(args.config, args.overrides, plugins=args.plugin)
    summary = train_sft(cfg, resume=args.resume, overwrite=args.overwrite)
    print_done(summary, job_rank())
    return 0


def cmd_rm(args) -> int:
    from grpo.config import load_config
    from grpo.train.rm import train_rm

    cfg = load_config(args.config, args.overrides, plugins=args.plugin)
    summary = train_rm(cfg, resume=args.resume, overwrite=args.overwrite)
    print_done(summary, job_rank())
    return 0


def cmd_demo(args) -> int:
    from grpo.apps.demo import demo_task, run_demo

    run = run_demo
    if demo_task(args.config, args.task) == "rlhf":  # SFT -> reward model -> GRPO
        from grpo.apps.demo_rlhf import run_rlhf as run
    run(
        args.out,
        quick=args.quick,
        seed=args.seed,
        config=args.config,
        task=args.task,
        overrides=args.overrides,
    )
    return 0


def cmd_plot(args) -> int:
    from grpo.apps.plot import plot_run

    print(f"wrote {plot_run(args.run_dir)}")
    return 0


def cmd_merge(args) -> int:
    from grpo.lora import merge_command

    out = merge_command(
        args.model,
        args.adapter,
        args.out,
        dtype=args.dtype,
        overwrite=args.overwrite,
        any_base=args.any_base,
    )
    print(f"wrote merged checkpoint to {out}")
    return 0


def _json_object(text: str | None, flag: str) -> dict | None:
    """A JSON object given on the command line (None when not given)."""
    if text is None:
        return None
    import json

    try:
        value = json.loads(text)
    except ValueError as e:
        raise GrpoError(f"{flag}: not valid JSON ({e}): {text!r:.80}") from None
    if not isinstance(value, dict):
        raise GrpoError(f"{flag}: expected a JSON object, got {text!r:.80}")
    return value


def cmd_eval(args) -> int:
    from grpo.eval import run_eval_command

    run_eval_command(
        model=args.model,
        adapter=args.adapter,
        data=args.data,
        max_samples=args.max_samples,
        k=args.k,
        out=args.out,
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
        details=args.details,
        compare=args.compare,
        env=args.env,
        max_turns=args.max_turns,
        skip_memory_check=args.skip_memory_check,
        max_prompt_len=args.max_prompt_len,
        env_kwargs=_json_object(args.env_kwargs, "--env-kwargs"),
        without_tool=not args.no_without_tool,
    )
    return 0


def cmd_tiny_model(args) -> int:
    from grpo.settings import check_value, one_of
    from grpo.tiny import SIZES, make_tiny_model

    check_value("--size", args.size, one_of(SIZES))
    out = make_tiny_model(args.out, size=args.size, seed=args.seed)
    print(f"wrote a tiny random-init Qwen3 ({args.size}) and its tokenizer to {out}")
    return 0


OVERWRITE_HELP = (
    "start afresh in a train.output_dir that holds an earlier run (its checkpoints, final "
    "weights, metrics and configs are removed once every input is checked)"
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="grpo", description="GRPO for LLMs in pure PyTorch (run `grpo CMD -h` for help)."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("demo", help="offline: tiny model, SFT then GRPO on mini-math (CPU)")
    p.add_argument("--out", default="runs/demo", help="run directory (default runs/demo)")
    p.add_argument("--quick", action="store_true", help="a smoke-test sized run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--config", default=None, help="the demo config (default: configs/demo_cpu.yaml)"
    )
    p.add_argument(
        "--task",
        default=None,
        choices=["math", "tools", "gsm8k-tools", "rlhf"],
        help="math (default); tools: products with a calculator tool, multi-turn; gsm8k-tools: "
        "GSM8K with a Python interpreter (pass base.data.source=DIR); rlhf: a reward model "
        "trained on preference pairs is GRPO's only reward",
    )
    p.add_argument(
        "overrides",
        nargs="*",
        help="pipeline overrides, stage.section.key=value (stage: base, sft, grpo; rm with "
        "--task rlhf), e.g. grpo.rollout.async=on",
    )
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("plot", help="PNG curves of a run from its metrics.jsonl")
    p.add_argument("run_dir")
    p.set_defaults(func=cmd_plot)

    p = sub.add_parser(
        "config", help="check a config as `grpo train` does before loading the model; print it"
    )
    _add_config_args(p)
    p.add_argument(
        "--trainer",
        default="grpo",
        choices=("grpo", "sft", "rm"),
        help="check it for `grpo train` (grpo, default), `grpo sft` or `grpo rm`",
    )
    p.set_defaults(func=cmd_config)

    p = sub.add_parser("sft", help="supervised fine-tuning on worked solutions")
    _add_config_args(p)
    _add_resume_arg(p)
    p.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    p.set_defaults(func=cmd_sft)

    p = sub.add_parser("rm", help="train a reward model (Bradley-Terry) on preference pairs")
    _add_config_args(p)
    _add_resume_arg(p)
    p.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    p.set_defaults(func=cmd_rm)

    p = sub.add_parser("train", help="GRPO training")
    _add_config_args(p)
    _add_resume_arg(p)
    p.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("eval", help="accuracy, pass@k, lengths, format, errors of a model")
    p.add_argument("--model", required=True, help="HF-format model directory or hub id")
    p.add_argument("--adapter", help="a LoRA adapter directory to apply")
    p.add_argument("--data", default="minimath:test", help="NAME[:SPLIT] or a .jsonl/.parquet")
    p.add_argument("--max-samples", type=int, default=None)
    p.add_argument(
        "--max-prompt-len",
        type=int,
        default=DataConfig.max_prompt_len,
        help="longest prompt in tokens (longer ones fail, naming the row)",
    )
    p.add_argument("--k", type=int, default=1, help="samples per prompt for pass@k")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--out", help="write the results JSON here")
    p.add_argument("--details", action="store_true", help="keep per-sample records in --out")
    p.add_argument(
        "--compare",
        nargs="*",
        default=[],
        metavar="NAME=MODEL[+ADAPTER]",
        help="more models to evaluate on the same data, shown side by side",
    )
    p.add_argument(
        "--env", default=None, help="multi-turn episodes with this environment (e.g. calculator)"
    )
    p.add_argument("--max-turns", type=int, default=4, help="model turns per episode (--env)")
    p.add_argument(
        "--env-kwargs",
        default=None,
        metavar="JSON",
        help="the environment's keyword arguments, e.g. '{\"use_template_tools\": true}'",
    )
    p.add_argument(
        "--no-without-tool",
        action="store_true",
        help="with --env, skip the second pass without the tool",
    )
    p.add_argument(
        "--skip-memory-check",
        action="store_true",
        help="skip the start-up memory estimate (docs/safety.md)",
    )
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("merge", help="fold a LoRA adapter into its base: an HF checkpoint")
    p.add_argument("--model", required=True, help="base model directory or hub id")
    p.add_argument("--adapter", required=True, help="PEFT-format adapter directory")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: base)")
    p.add_argument(
        "--overwrite", action="store_true", help="replace the contents of a non-empty --out"
    )
    p.add_argument(
        "--any-base",
        action="store_true",
        help="merge although the adapter's config names another base (the same model moved)",
    )
    p.set_defaults(func=cmd_merge)

    from grpo.apps import pipeline, serve, sweep

    pipeline.add_parser(sub)
    sweep.add_parser(sub)
    serve.add_parser(sub)

    p = sub.add_parser(
        "bench",
        help="benchmarks from the installed package: `grpo bench logprobs --help`",
        add_help=False,  # --help goes to the benchmark's own parser
    )
    p.add_argument("benchmark", choices=BENCHMARKS, help="which benchmark")
    p.add_argument("bench_args", nargs=argparse.REMAINDER, help="its arguments (see its --help)")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("tiny-model", help="write a tiny random-init model + tokenizer (offline)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--size", default="ci", help="ci (L=2, C=64) or demo (L=3, C=192)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_tiny_model)

    for p in sub.choices.values():  # every command, so each torchrun worker gets them too
        p.add_argument(
            "--plugin",
            action="append",
            default=[],
            metavar="MODULE",
            help="import MODULE (package.module, or package.module:function to "
            "call) first: the names it registers become valid (repeatable)",
        )
    return parser


BENCHMARKS = ("logprobs",)  # grpo bench <name>: grpo.apps.bench.<name>


def cmd_bench(args) -> int:
    """`grpo bench logprobs ...`: the log-prob kernel benchmark (grpo/apps/bench/logprobs.py),
    its results in --out-dir (default ./bench_results outside a source checkout). A kernel
    registered by name comes from `grpo bench --plugin MODULE logprobs --impl NAME`."""
    from grpo.apps.bench import logprobs

    logprobs.main(list(args.bench_args), prog=f"grpo bench {args.benchmark}")
    return 0


def print_error(line: str) -> None:
    """Print `line` on stderr on a line of its own: open progress bars are closed first (each
    ends its line), so the message is never glued to a bar nor followed by a stale one."""
    std = sys.modules.get("tqdm.std")  # no bar exists unless tqdm was imported
    for bar in list(getattr(getattr(std, "tqdm", None), "_instances", ())):
        try:
            bar.close()
        except Exception:  # e.g. its stream closed already: the message matters more
            pass
    print(line, file=sys.stderr, flush=True)


def _add_resume_arg(p) -> None:
    p.add_argument(
        "--resume",
        nargs="?",
        const=True,
        default=False,
        type=_resume_value,
        metavar="auto",
        help="continue from the newest valid checkpoint; `--resume auto`: continue if "
        "train.output_dir holds a checkpoint, else start (what a cluster job's restarts and "
        "requeues run: docs/distributed.md)",
    )


def _resume_value(text: str):
    if text == "auto":
        return "auto"
    if text == "on":
        return True
    raise argparse.ArgumentTypeError(f"{text!r}: --resume takes nothing or `auto`")


TRAINERS = ("train", "sft", "rm")  # the commands whose --resume takes `auto`


def resume_words(argv: list[str]) -> list[str]:
    """For a trainer's command: `--resume auto` -> `--resume=auto`, a bare `--resume` ->
    `--resume=on`; the flag then never takes the override after it (`--resume
    train.max_steps=8`) for its value. Other commands' arguments are returned as they are."""
    if next((a for a in argv if not a.startswith("-")), None) not in TRAINERS:
        return argv
    out, i = [], 0
    while i < len(argv):
        if argv[i] == "--":
            return out + argv[i:]
        if argv[i] == "--resume":
            auto = argv[i + 1 : i + 2] == ["auto"]
            out.append("--resume=auto" if auto else "--resume=on")
            i += 2 if auto else 1
            continue
        out.append(argv[i])
        i += 1
    return out


def parse_args(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """`parser.parse_args`, with dotted overrides anywhere among the options: argparse takes
    the positional `overrides` once, so those after a flag (`--plugin m a.b=1`) come back
    unrecognized; they join the overrides, in order. Anything else unrecognized is argparse's
    error, as before."""
    args, extra = parser.parse_known_args(resume_words(argv))
    if extra:
        overrides = getattr(args, "overrides", None)
        stray = [a for a in extra if a.startswith("-") or "=" not in a]
        if overrides is None or stray:
            parser.error(f"unrecognized arguments: {' '.join(stray or extra)}")
        args.overrides = [*overrides, *extra]
    return args


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parse_args(parser, list(sys.argv[1:] if argv is None else argv))
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    try:
        from grpo.plugins import load_plugins

        load_plugins(args.plugin, "--plugin")  # before any config is read (and entry points)
        return args.func(args) or 0
    except GrpoError as e:
        message = " ".join(str(e).split())  # always one line
        if getattr(e, "rank", 0) == 0:  # under torchrun an interrupt is reported by rank 0
            prefix = getattr(e, "cli_prefix", "error: ")
            print_error(f"grpo {args.command}: {prefix}{message}")
        code = getattr(e, "exit_code", 2)  # 2; 128 + N when signal N stopped training
        if isinstance(e, CollectiveError):  # the process group is broken: exiting
            sys.stderr.flush()  # normally could hang or abort in its threads' destructors
            os._exit(code)
        exit_if_joined(code)  # a group teardown left to a failing rank: the same
        return code
    except KeyboardInterrupt:
        print_error(f"grpo {args.command}: interrupted")
        return 130


if __name__ == "__main__":
    sys.exit(main())

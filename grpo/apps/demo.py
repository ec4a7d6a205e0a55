"""`grpo demo`: the offline end-to-end run, on a CPU, from nothing to a model that GRPO improved.

    tokenizer (BPE on mini-math text) + tiny Qwen3 from random init
      -> `run_pipeline`: SFT on worked solutions -> evaluate -> GRPO from the SFT model
         -> evaluate (training_results.json)
      -> results.json, metrics.jsonl, curves.png and a short table

Settings live in `configs/demo_cpu.yaml` (a `demo` section for what is built before training,
a `pipeline` section in the `grpo pipeline` format, and `quick` overrides for the smoke run);
docs/demo.md explains the choices and gives measured numbers. Both evaluations use the same
held-out problems and the same decoding (greedy accuracy, pass@k from k samples).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from datasets import Dataset, DatasetDict

from grpo.data import register_dataset
from grpo.data.minimath import MAX_STEPS, Level, distinct_problems
from grpo.errors import GrpoError
from grpo.io import read_text
from grpo.settings import (
    ConfigError,
    FieldError,
    Settings,
    between,
    build_settings,
    one_of,
    setting,
)
from grpo.tiny import SIZES

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
DEFAULT_CONFIG = CONFIGS / "demo_cpu.yaml"
TASK_CONFIGS = {
    "math": DEFAULT_CONFIG,
    "tools": CONFIGS / "demo_tools_cpu.yaml",
    "gsm8k-tools": CONFIGS / "gsm8k_tools_cpu.yaml",
    "rlhf": CONFIGS / "demo_rlhf_cpu.yaml",
}
DATASET = "demo-minimath"  # the name the demo registers its three splits under
TOOLS_DATASET = "demo-toolmath"  # --task tools: problems (RL and evaluation)
TOOLS_SFT_DATASET = "demo-toolmath-sft"  # --task tools: one (prompt, completion) per turn


UNIT = between(0, 1)


@dataclass(frozen=True)
class DemoSettings(Settings):
    """What the demo builds before training (the `demo` section of the config)."""

    task: Literal["math", "tools", "gsm8k-tools", "rlhf"] = "math"  # math: mini-math word
    # problems; tools: products with a calculator; gsm8k-tools: GSM8K (the pipeline's
    # data.source) with a Python interpreter, the tokenizer trained on SFT's traces; rlhf:
    # mini-math with a reward model trained on preference pairs as GRPO's only reward
    # (grpo/apps/demo_rlhf.py) (TASK_CONFIGS)
    model_size: str = setting("demo", check=one_of(SIZES))  # a key of grpo.tiny.SIZES
    vocab_size: int = 384
    context: int = setting(512, check=between(64))  # the model's max_position_embeddings
    # The mini-math problems (a `grpo.data.minimath.Level`): steps per problem, the first
    # quantity in [1, start_max], +/- operands in [1, add_max], */÷ operands in
    # [2, factor_max], every value <= value_max.
    min_steps: int = setting(1, check=between(1, MAX_STEPS))
    max_steps: int = setting(1, check=between(1, MAX_STEPS))
    start_max: int = setting(10, check=between(1))
    add_max: int = setting(10, check=between(1))
    factor_max: int = setting(5, check=between(2))
    value_max: int = setting(50, check=between(2))
    data_seed: int = 0  # which problems (the same for every --seed)
    train_problems: int = setting(4000, check=between(1))
    validation_problems: int = setting(256, check=between(1))  # generated after train's
    # problems: disjoint from them, for tuning
    test_problems: int = setting(256, check=between(1))  # disjoint from train by construction
    threads: int = setting(2, check=between(1))  # torch threads (capped at the machine's cores)
    # --task tools: the share of hard (two-digit) problems, and of hard training problems
    # whose SFT trace calls the calculator (the others are worked mentally, correct but a
    # trick the model cannot learn): GRPO is left to find out which works.
    hard_frac: float = setting(0.7, check=UNIT)
    tool_frac: float = setting(0.5, check=UNIT)
    # --task rlhf: preference pairs per problem, each a different error kind
    # (grpo.data.preferences.math_preferences)
    pairs_per_problem: int = setting(2, check=between(1, 5))

    def __post_init__(self):  # types are checked by `build_settings`
        super().__post_init__()
        if self.min_steps > self.max_steps:
            raise FieldError("min_steps: must be <= max_steps", field="min_steps")
        if self.value_max < self.start_max:
            raise FieldError("value_max: must be >= start_max", field="value_max")

    def level(self) -> Level:
        return Level(
            self.min_steps,
            self.max_steps,
            self.start_max,
            self.add_max,
            self.factor_max,
            self.value_max,
        )


@dataclass(frozen=True)
class QuickSection:
    """The smoke run's changes: demo settings and pipeline overrides."""

    demo: dict = dataclasses.field(default_factory=dict)
    overrides: tuple[str, ...] = ()


@dataclass(frozen=True)
class DemoFile:
    """The demo config file's top level."""

    demo: dict = dataclasses.field(default_factory=dict)
    pipeline: dict = dataclasses.field(default_factory=dict)
    rm: dict = dataclasses.field(default_factory=dict)  # --task rlhf: the `grpo rm` config
    # --task rlhf: the online reward model's module `kwargs` and `optim` (grpo/apps/demo_rlhf.py)
    online_rm: dict = dataclasses.field(default_factory=dict)
    quick: QuickSection = QuickSection()


def load_demo_config(
    path: str | Path | None = None, quick: bool = False
) -> tuple[DemoSettings, dict, list[str]]:
    """Read the demo config: (settings, pipeline mapping, pipeline overrides).

    With `quick`, the `quick` section's `demo` values replace the settings and its
    `overrides` (``sft.train.max_steps=4`` ...) are returned for `load_pipeline_config`.
    """
    p = Path(path) if path is not None else DEFAULT_CONFIG
    if not p.is_file():
        raise ConfigError(f"demo config {str(p)!r} does not exist")
    data = yaml.safe_load(read_text(p, "a YAML demo config")) or {}
    try:
        f = build_settings(DemoFile, data, null_is_default=True)
    except ConfigError as e:
        raise ConfigError(f"{p}: {e}", field=e.field) from None
    build_settings(DemoSettings, f.demo, "demo")  # the file's own section must be valid alone
    values, overrides = f.demo, []
    if quick:
        values = {**values, **f.quick.demo}
        overrides = list(f.quick.overrides)
    where = "quick.demo" if quick else "demo"
    return build_settings(DemoSettings, values, where), f.pipeline, overrides


def demo_config_path(config: str | Path | None, task: str | None) -> Path:
    """The demo config to read: `config`, else the task's (`TASK_CONFIGS`), else the math
    demo's."""
    if config is None and task is not None:
        if task not in TASK_CONFIGS:
            raise ConfigError(f"--task: one of {sorted(TASK_CONFIGS)}, got {task!r}")
        return TASK_CONFIGS[task]
    return Path(config) if config is not None else DEFAULT_CONFIG


def check_task(settings: DemoSettings, task: str | None) -> None:
    """--task, when given, must be the config's demo.task."""
    if task is not None and task != settings.task:
        raise ConfigError(f"--task {task} but the config's demo.task is {settings.task!r}")


def demo_task(config: str | Path | None, task: str | None) -> str:
    """The task `grpo demo --config C --task T` runs (checked as the demo checks it)."""
    settings = load_demo_config(demo_config_path(config, task))[0]
    check_task(settings, task)
    return settings.task


def _demo_file(path: str | Path | None) -> DemoFile:
    """The demo config file's sections (already checked by `load_demo_config`)."""
    p = Path(path) if path is not None else DEFAULT_CONFIG
    data = yaml.safe_load(read_text(p, "a YAML demo config")) or {}
    return build_settings(DemoFile, data, null_is_default=True)


def demo_problems(n: int, seed: int, split: str, level: Level) -> Dataset:
    """`n` distinct mini-math problems of `level` in the minimath format; the train and test
    splits never share a question (the same hash rule as `grpo.data.minimath`)."""
    rng = random.Random(f"grpo-demo|{seed}|{split}|{level}")
    rows = distinct_problems(rng, n, split, level, where=f"demo: {level}")
    return Dataset.from_list(rows)


def register_demo_data(s: DemoSettings, solutions: bool = False) -> dict[str, int]:
    """Register the demo's mini-math splits as dataset `DATASET`: train, validation, test.

    Validation is the `validation_problems` problems that train's generator makes after its
    first `train_problems` (so the two never share a question); test is the held-out split.
    `solutions`: each row also gets a ``solution`` column, its worked solution as SFT writes
    it (the reference a `reward_model` with ``reference_column: solution`` reads).
    """
    pool = demo_problems(s.train_problems + s.validation_problems, s.data_seed, "train", s.level())
    splits = DatasetDict(
        train=pool.select(range(s.train_problems)),
        validation=pool.select(range(s.train_problems, len(pool))),
        test=demo_problems(s.test_problems, s.data_seed, "test", s.level()),
    )
    if solutions:
        from grpo.data.formats import sft_solution, split_solution

        def add(rows: list[dict]) -> Dataset:
            return Dataset.from_list(
                [
                    {**r, "solution": sft_solution(*split_solution(r["answer"], row=i))}
                    for i, r in enumerate(rows)
                ]
            )

        splits = DatasetDict({k: add(v.to_list()) for k, v in splits.items()})
    register_dataset(DATASET, splits, overwrite=True)
    return {name: len(ds) for name, ds in splits.items()}


def register_tools_data(
    s: DemoSettings, tokenizer, env_kwargs: dict | None = None
) -> dict[str, int]:
    """--task tools: register the problems (`TOOLS_DATASET`: train / validation / test) and the
    SFT traces (`TOOLS_SFT_DATASET`: one rendered (prompt, completion) pair per assistant turn;
    its validation and test splits are the problems', for SFT's own evaluation). With the
    calculator's `env_kwargs` (GRPO's), each trace's prompt renders the tool schemas exactly as
    that environment's episode of the problem does (`use_template_tools`, `tool_variants`)."""
    from grpo.data.toolmath import sft_pairs, toolmath, trace
    from grpo.envs.calculator import CalculatorEnv

    env = CalculatorEnv(**(env_kwargs or {}))

    pool = toolmath(s.train_problems + s.validation_problems, s.data_seed, "train", s.hard_frac)
    train, validation = pool[: s.train_problems], pool[s.train_problems :]
    test = toolmath(s.test_problems, s.data_seed, "test", s.hard_frac)
    rng = random.Random(f"grpo-demo-tools|{s.data_seed}")
    pairs = []
    for row in train:
        use_tool = row["kind"] == "hard" and rng.random() < s.tool_frac
        tools = env.tools if env.start(row) is not None else None  # as its episode renders
        for pair in sft_pairs(tokenizer, trace(row, use_tool), tools=tools):  # keep the problem
            pairs.append({"question": row["question"], "answer": row["answer"], **pair})
    problems = DatasetDict(
        train=Dataset.from_list(train),
        validation=Dataset.from_list(validation),
        test=Dataset.from_list(test),
    )
    register_dataset(TOOLS_DATASET, problems, overwrite=True)
    sft = DatasetDict(
        train=Dataset.from_list(pairs), validation=problems["validation"], test=problems["test"]
    )
    register_dataset(TOOLS_SFT_DATASET, sft, overwrite=True)
    return {
        "train": len(train),
        "validation": len(validation),
        "test": len(test),
        "sft_pairs": len(pairs),
        "test_hard": sum(r["kind"] == "hard" for r in test),
        "train_hard": sum(r["kind"] == "hard" for r in train),
    }


def gsm8k_tools_corpus(data) -> tuple[list[str], dict[str, int]]:
    """--task gsm8k-tools: the tokenizer's texts (every row of SFT's split in both forms) and
    the trace counts of that split (`grpo.data.gsm8k_tools.summary`).

    Args:
        data: SFT's `DataConfig` (dataset ``gsm8k-tools-sft``, its source, split, max_samples).
    """
    from collections import Counter

    from grpo.data.gsm8k_tools import corpus, summary
    from grpo.loading import dataset_rows

    rows = dataset_rows(data, data.split, data.max_samples).to_list()
    counts = Counter(r["status"] for r in rows if "status" in r)
    counts.update(f"form:{r['form']}" for r in rows if "form" in r)
    return corpus(rows), summary(counts)


_TOOL_MESSAGE_RE = re.compile(r"<\|im_start\|>tool\n(.*?)<\|im_end\|>", re.S)


def tool_use_summary(samples: list[dict]) -> dict[str, Any]:
    """What the greedy episodes of an evaluation did with the tool, from their transcripts
    (ChatML, as the demo's tokenizer renders tool messages).

    Returns:
        problems; tool_use_rate (problems with at least one tool answer); error_message_rate
        (tool messages with an ``error:`` line, over all tool messages: the code raised or hit
        a limit, or the call was invalid; the evaluation's own tool_error_rate and
        invalid_call_rate count calls); accuracy_called and accuracy_not_called (greedy
        accuracy of the problems whose episode did / did not use the tool; None when there are
        none).
    """
    observations = [_TOOL_MESSAGE_RE.findall(s.get("transcript") or "") for s in samples]
    used = [bool(obs) for obs in observations]
    messages = [m for obs in observations for m in obs]
    errors = sum(any(line.startswith("error:") for line in m.splitlines()) for m in messages)

    def accuracy(flag: bool) -> float | None:
        hits = [s["correct"] for s, u in zip(samples, used) if u == flag]
        return sum(hits) / len(hits) if hits else None

    return {
        "problems": len(samples),
        "tool_use_rate": sum(used) / max(len(samples), 1),
        "tool_messages": len(messages),
        "error_message_rate": errors / max(len(messages), 1),
        "accuracy_called": accuracy(True),
        "accuracy_not_called": accuracy(False),
    }


def _pipeline_file(
    out: Path, pipeline: dict, model_dir: Path, seed: int, task: str = "math"
) -> Path:
    """Write the demo's pipeline config, with its run paths, seed and dataset, to out/."""
    data = json.loads(json.dumps(pipeline))
    base = data.setdefault("base", {})
    base.setdefault("model", {})["path"] = str(model_dir)
    base.setdefault("train", {})["seed"] = seed
    if task != "gsm8k-tools":  # gsm8k-tools: the config names built-in datasets itself
        base.setdefault("data", {})["dataset"] = DATASET if task == "math" else TOOLS_DATASET
    if task == "tools":  # SFT reads the traces; GRPO and both evaluations the problems
        data.setdefault("sft", {}).setdefault("data", {})["dataset"] = TOOLS_SFT_DATASET
    data["output_dir"] = str(out)
    path = out / "pipeline.yaml"
    header = (
        "# The pipeline `grpo demo` ran (written by the demo; its dataset exists in the demo's\n"
        "# process only, so rerun it with `grpo demo`, not `grpo pipeline`).\n"
    )
    if task == "gsm8k-tools":
        header = (
            "# The pipeline `grpo demo --task gsm8k-tools` ran (written by the demo; its datasets\n"
            "# are built in, so `grpo pipeline` reruns it on the tokenizer and init in model/).\n"
        )
    path.write_text(header + yaml.safe_dump(data, sort_keys=False))
    return path


def _combined_metrics(out: Path, sft_steps: int, grpo_steps: int, evals: dict) -> Path:
    """out/metrics.jsonl: SFT's and GRPO's records tagged with their stage, plus the demo's
    held-out evaluations as `eval/*` points (after SFT: SFT's last step and GRPO's step 0;
    after GRPO: its last step), so the accuracy curve runs from the SFT model to the end."""
    from grpo.metrics import read_metrics

    def point(stage: str, step: int, summary: dict) -> dict:
        keep = ("accuracy", "format_rate", "avg_length", "tool_calls_mean", "invalid_call_rate")
        values = {f"eval/{k}": summary[k] for k in keep if k in summary}
        values.update({f"eval/{k}": v for k, v in summary.items() if k.startswith("pass@")})
        return {"stage": stage, "step": step, **values}

    def stage_records(stage: str, last: int, summary: dict) -> list[dict]:
        rows = [{"stage": stage, **r} for r in read_metrics(out / stage / "metrics.jsonl")]
        for r in rows:  # the trainer's own evaluation at the last step is the demo's one
            if r.get("step") == last:
                for k in [k for k in r if k.startswith("eval/")]:
                    del r[k]
        return rows + [point(stage, last, summary)]

    records = stage_records("sft", sft_steps, evals["sft"])
    records.append(point("grpo", 0, evals["sft"]))
    records += stage_records("grpo", grpo_steps, evals["grpo"])
    path = out / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _fmt_s(seconds: float) -> str:
    m, s = divmod(int(round(seconds)), 60)
    return f"{m}m{s:02d}s" if m else f"{s}s"


def summary_table(results: dict) -> str:
    """The closing Markdown table: held-out accuracy after SFT and after GRPO, and times."""
    k = results["eval"]["k"]
    head = f"| model | greedy accuracy | pass@{k} | mean@{k} | format | length | train time |"
    lines = [head, "|---|---|---|---|---|---|---|"]
    for name in ("sft", "grpo"):
        e = results[name]["eval"]
        lines.append(
            f"| {name.upper()} | {e['accuracy']:.3f} | {e.get(f'pass@{k}', 0.0):.3f} | "
            f"{e.get(f'mean@{k}', 0.0):.3f} | {e['format_rate']:.3f} | {e['avg_length']:.1f} | "
            f"{_fmt_s(results['time_s'][name])} |"
        )
    delta = 100 * results["accuracy_gain"]
    n = results["eval"]["n"]
    off = results.get("without_tool") or {}
    if off:
        s, g = results["sft"]["eval"], results["grpo"]["eval"]
        lines.append("")
        lines.append(
            f"tool calls per problem {s['tool_calls_mean']:.2f} -> {g['tool_calls_mean']:.2f}; "
            f"invalid-call rate {s['invalid_call_rate']:.3f} -> {g['invalid_call_rate']:.3f}; "
            f"greedy accuracy without the tool: SFT {off['sft']['accuracy']:.3f}, "
            f"GRPO {off['grpo']['accuracy']:.3f}"
        )
    lines.append("")
    lines.append(
        f"GRPO - SFT: {delta:+.1f} points of greedy accuracy on {n} held-out problems; "
        f"total time {_fmt_s(results['time_s']['total'])} "
        f"(CPU time {_fmt_s(results['time_s']['cpu'])} on {results['threads']} thread(s))"
    )
    return "\n".join(lines)


def _clean(out: Path) -> None:
    """Remove what an earlier demo wrote to `out` (and nothing else)."""
    for name in ("model", "sft", "rm", "grpo"):
        shutil.rmtree(out / name, ignore_errors=True)
    written = ("pipeline.yaml", "training_results.json", "metrics.jsonl", "results.json")
    for name in (*written, "curves.png"):
        (out / name).unlink(missing_ok=True)


STAGE_TITLES = {  # the pipeline's stages as the demo announces them
    "sft": "2/5 SFT on worked solutions",
    "sft_eval": "3/5 evaluate the SFT model on the held-out problems",
    "grpo": "4/5 GRPO from the SFT model",
    "grpo_eval": "5/5 evaluate the GRPO model on the same problems",
}


def run_demo(
    out: str | Path = "runs/demo",
    quick: bool = False,
    seed: int = 0,
    config: str | Path | None = None,
    task: str | None = None,
    overrides: list[str] | tuple[str, ...] = (),
) -> dict:
    """Run the demo into `out` and return what it writes to out/results.json.

    The demo builds a tokenizer, a tiny model and its problems, then runs its config's
    `pipeline` section through `run_pipeline` (SFT -> evaluate -> GRPO -> evaluate, with the
    pipeline's checks and out/training_results.json), and adds what is its own: for --task
    tools and gsm8k-tools the same problems without the tool (and for gsm8k-tools what the
    greedy episodes did with it), the combined metrics, curves and the table.

    Args:
        out: the run directory (model/, sft/, grpo/, results.json, metrics.jsonl, curves.png).
        quick: the smoke-test sizes of the config's `quick` section (CI).
        seed: model init, data order and sampling seed (the problems stay the same).
        config: the demo config (default: `TASK_CONFIGS[task]`, configs/demo_cpu.yaml without
            a task).
        task: "math", "tools" or "gsm8k-tools" (default: the config's demo.task).
        overrides: pipeline overrides, ``stage.section.key=value`` (stage: base, sft or
            grpo), applied after --quick's: e.g. ``grpo.rollout.async=on``.

    Returns:
        the results: per stage the held-out evaluation and training summary, the accuracy
        gain of GRPO over SFT, times in seconds, settings and paths.
    """
    import torch

    from grpo.apps.pipeline import grpo_config_from_sft, load_pipeline_config, run_pipeline
    from grpo.apps.plot import plot_run
    from grpo.eval import evaluate_config
    from grpo.loading import trained_model
    from grpo.models import load_model
    from grpo.tiny import make_tiny_model

    config = demo_config_path(config, task)
    settings, pipeline, quick_overrides = load_demo_config(config, quick)
    overrides = [*quick_overrides, *overrides]
    check_task(settings, task)
    if settings.task == "rlhf":
        raise ConfigError(
            "demo.task rlhf runs through grpo.apps.demo_rlhf.run_rlhf (`grpo demo --task rlhf`)"
        )
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    _clean(out)
    threads_before = torch.get_num_threads()
    torch.set_num_threads(max(1, min(settings.threads, os.cpu_count() or 1)))
    t_start, cpu_start = time.perf_counter(), time.process_time()

    def announce(stage: str) -> None:
        if stage in STAGE_TITLES:
            print(f"\n== {STAGE_TITLES[stage]}", flush=True)

    try:
        print("\n== 1/5 tokenizer and model", flush=True)
        task = settings.task
        tools = task in ("tools", "gsm8k-tools")  # episodes with a tool; also evaluated without
        model_dir = out / "model"
        pcfg = load_pipeline_config(_pipeline_file(out, pipeline, model_dir, seed, task), overrides)
        corpus, specials, sizes = None, (), {}
        if task == "tools":
            from grpo.data.toolmath import TOOL_TOKENS, toolmath
            from grpo.data.toolmath import corpus as tool_corpus

            variants = int(pcfg.grpo.rollout.env_kwargs.get("tool_variants", 0))
            rows = toolmath(2000, settings.data_seed, "train", settings.hard_frac)
            corpus = tool_corpus(rows, variants)
            specials = TOOL_TOKENS
        elif task == "gsm8k-tools":
            from grpo.data.gsm8k_tools import TOOL_TOKENS

            corpus, sizes = gsm8k_tools_corpus(pcfg.sft.data)
            specials = TOOL_TOKENS
        make_tiny_model(
            model_dir,
            size=settings.model_size,
            vocab_size=settings.vocab_size,
            seed=seed,
            max_position_embeddings=settings.context,
            corpus=corpus,
            extra_special_tokens=specials,
        )
        if task == "tools":
            from grpo.tokenizer import load_tokenizer

            sizes = register_tools_data(
                settings, load_tokenizer(model_dir), pcfg.grpo.rollout.env_kwargs
            )
        elif task == "math":
            sizes = register_demo_data(settings)
        n_params = sum(p.numel() for p in load_model(model_dir, device="cpu").parameters())
        print(
            f"model: {settings.model_size} ({n_params / 1e6:.2f}M parameters) in {model_dir}; "
            f"problems: {sizes}",
            flush=True,
        )
        setup_s = time.perf_counter() - t_start

        piped = run_pipeline(pcfg, details=True, on_stage=announce)
        if piped["status"] != "completed":  # the SFT accuracy threshold stopped it
            raise GrpoError(f"demo: {piped['message']}")
        stages = piped["stages"]
        sft_cfg = pcfg.sft
        grpo_cfg = grpo_config_from_sft(pcfg.grpo, sft_cfg, stages["sft"]["paths"]["final"])
        sft_eval, grpo_eval = stages["sft_eval"]["metrics"], stages["grpo_eval"]["metrics"]
        _print_eval("SFT", sft_eval, sft_cfg.eval.k)
        _print_eval("GRPO", grpo_eval, grpo_cfg.eval.k)
        t_no_tool = time.perf_counter()
        no_tool = {}
        if tools:  # the same problems with the tool switched off: one turn, nothing executed
            # gsm8k-tools: greedy only (its long episodes make k samples the costly part)
            k = {"k": 1} if task == "gsm8k-tools" else {}
            for name, cfg_ in (("sft", sft_cfg), ("grpo", grpo_cfg)):
                off = dataclasses.replace(
                    cfg_, eval=dataclasses.replace(cfg_.eval, env="single_turn", **k)
                )
                final = stages[name]["paths"]["final"]
                no_tool[name] = evaluate_config(off, trained_model(off, final), details=True)
                # a call written anyway (the decoded text has no special tokens: look for its
                # JSON), which ends the episode unanswered
                calls = ['"arguments"' in s["completion"] for s in no_tool[name].pop("samples")]
                no_tool[name]["tool_call_attempts"] = sum(calls) / max(len(calls), 1)
                _print_eval(f"{name.upper()} without the tool", no_tool[name], off.eval.k)
        no_tool_s = time.perf_counter() - t_no_tool
        tool_use = {}
        if task == "gsm8k-tools":
            tool_use = {name: tool_use_summary(piped["samples"][name]) for name in ("sft", "grpo")}
            for name, summary in tool_use.items():
                print(f"{name.upper()} tool use: {summary}", flush=True)
    finally:
        torch.set_num_threads(threads_before)
    times = {
        "setup": setup_s + stages["prepare_data"]["seconds"],
        "sft": stages["sft"]["seconds"],
        "eval_sft": stages["sft_eval"]["seconds"],
        "grpo": stages["grpo"]["seconds"],
        "eval_grpo": stages["grpo_eval"]["seconds"] + no_tool_s,
        "total": time.perf_counter() - t_start,
        "cpu": time.process_time() - cpu_start,  # all threads; wall is noisy on busy machines
    }
    sft_summary, grpo_summary = stages["sft"]["metrics"], stages["grpo"]["metrics"]
    evals = {"sft": sft_eval, "grpo": grpo_eval}
    metrics = _combined_metrics(out, sft_summary["step"], grpo_summary["step"], evals)
    curves = plot_run(out)
    results: dict[str, Any] = {
        "quick": quick,
        "seed": seed,
        "settings": asdict(settings),
        "problems": sizes,
        "eval": {
            "split": sft_cfg.data.eval_split,
            "n": sft_eval["n"],
            "k": sft_cfg.eval.k,
            "temperature": sft_cfg.eval.temperature,
            "max_new_tokens": sft_cfg.eval.max_new_tokens or sft_cfg.rollout.max_new_tokens,
            "decoding": "greedy for accuracy; k samples at the temperature for pass@k, mean@k",
        },
        "sft": {
            "eval": evals["sft"],
            "steps": sft_summary["step"],
            "train_loss_first": _first(out / "sft" / "metrics.jsonl", "train/loss"),
            "train_loss_last": sft_summary.get("train/loss"),
        },
        "grpo": {
            "eval": evals["grpo"],
            "steps": grpo_summary["step"],
            "reward_last": grpo_summary.get("rollout/reward_mean"),
        },
        "accuracy_gain": grpo_eval["accuracy"] - sft_eval["accuracy"],
        "without_tool": no_tool,
        "tool_use": tool_use,
        "examples": _examples(piped["samples"]["sft"], piped["samples"]["grpo"]),
        "time_s": {k: round(v, 2) for k, v in times.items()},
        "threads": max(1, min(settings.threads, os.cpu_count() or 1)),
        "paths": {
            "model": str(model_dir),
            "sft": str(stages["sft"]["paths"]["final"]),
            "grpo": str(stages["grpo"]["paths"]["final"]),
            "pipeline": str(out / "training_results.json"),
            "metrics": str(metrics),
            "curves": str(curves),
        },
    }
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    print("\n" + summary_table(results))
    print(f"results.json, metrics.jsonl and curves.png are in {out}", flush=True)
    return results


def _first(path: Path, key: str) -> float | None:
    from grpo.metrics import read_metrics

    for r in read_metrics(path):
        if key in r:
            return r[key]
    return None


def _print_eval(name: str, summary: dict, k: int) -> None:
    extra = f", pass@{k} {summary[f'pass@{k}']:.3f}" if f"pass@{k}" in summary else ""
    print(
        f"{name}: greedy accuracy {summary['accuracy']:.3f} on {summary['n']} held-out problems"
        f"{extra}, format {summary['format_rate']:.3f}",
        flush=True,
    )


def _examples(sft: list[dict], grpo: list[dict], n: int = 3) -> list[dict]:
    """A few held-out problems that SFT got wrong and GRPO right (else any), side by side."""
    pairs = list(zip(sft, grpo))
    fixed = [p for p in pairs if p[1]["correct"] and not p[0]["correct"]]
    chosen = (fixed or pairs)[:n]
    return [
        {
            "question": a["question"],
            "ground_truth": a.get("ground_truth"),
            "sft": a["completion"],
            "grpo": b["completion"],
        }
        for a, b in chosen
    ]

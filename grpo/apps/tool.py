"""RLTrainingTool: the tutorial's (HelloAgents ch. 11) JSON-action interface over this library.

    tool = RLTrainingTool()
    tool.run({"action": "train", "algorithm": "sft", "model_name": "Qwen/Qwen3-0.6B",
              "output_dir": "./models/sft", "max_samples": 100, "use_lora": True})  # -> JSON str

Actions and their keys (the tutorial's names; each is translated to our `Config`):

- ``train``: algorithm (sft | grpo), model_name (a checkpoint, hub id, or an earlier run's
  output_dir), output_dir, dataset / custom_dataset, max_samples, num_epochs, batch_size
  (SFT: examples; GRPO: prompts, each sampled num_generations times), learning_rate, use_lora,
  lora_rank, lora_alpha, num_generations, kl_coef, reward_type, reward_config, ...
  -> output_dir, model_path, final_loss (SFT) or average_reward (GRPO), metrics.
- ``load_dataset``: format (sft | rl), split, max_samples -> dataset_size, format, sample_keys.
- ``create_reward``: reward_type and its parameters -> reward_type, description, examples.
- ``evaluate``: model_path, max_samples, use_lora, metrics, k, return_details -> accuracy,
  average_reward, num_samples, ...

Each action's parameters are a frozen dataclass (`Train`, `LoadDataset`, `CreateReward`,
`Evaluate`) read by the config's one builder (`grpo.settings.build_settings`: types, unknown and
required keys, each field's check), whose fields name the config fields they set (`to`); an
action maps them onto a `Config` (plus what follows from several of them, e.g. batch sizes
from batch_size x num_generations) and calls the core (`train_sft` / `train_grpo`,
`load_rows`, `evaluate_config`). A default of None is the core's default. Every answer is a
JSON string with ``"status": "success"`` or ``"error"``; an error's message starts with the
parameter it is about, never a traceback. `register_dataset` and `register_reward_function`
name data and rewards for later calls; a reward registered under a dataset's name is the
default reward of training on that dataset.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import typing
from collections.abc import Callable
from dataclasses import MISSING, dataclass
from pathlib import Path
from typing import Any, Literal

from grpo.errors import GrpoError
from grpo.loading import TrainedModel, resolve_device, resolve_trained
from grpo.settings import ConfigError, Settings, between, build_settings, non_empty, setting

log = logging.getLogger(__name__)

ACTIONS = ("train", "load_dataset", "create_reward", "evaluate")
BUILTIN_REWARDS = ("accuracy", "length_penalty", "step", "format", "combined")
BUILTIN_DATASETS = ("gsm8k", "gsm8k-tools-sft", "minimath")
EVAL_METRICS = {
    "accuracy": "accuracy",
    "average_reward": "average_reward",
    "average_length": "avg_length",
    "average_steps": "avg_steps",
    "format_correctness": "format_rate",
    "mean_abs_error": "mean_abs_error",
    "error_types": "errors",
    "by_difficulty": "by_difficulty",
    "accuracy_at_k": None,  # pass@k (k > 1), else the greedy accuracy
    "mean_at_k": None,
}
EXAMPLES = [  # (completion, ground truth) shown by create_reward
    ("Step 1: 48 / 2 = 24\nStep 2: 48 + 24 = 72\nFinal Answer: 72", "72"),
    ("Final Answer: 72", "72"),
    ("Step 1: 48 + 25 = 73\nFinal Answer: 73", "72"),
]


class ToolError(GrpoError):
    """A bad parameter; the message starts with its name."""

    def __init__(self, parameter: str, problem: str):
        super().__init__(f"{parameter}: {problem}")
        self.parameter = parameter


# --------------------------------------------------------------------------- parameters
#
# Each action's parameters are a frozen dataclass read by the config's one builder
# (`grpo.settings.build_settings`: types, unknown keys and required ones, each field's check),
# and `to` names the config field(s) a parameter sets. A default of None leaves those fields
# at the core's defaults (`grpo.config`); only the tutorial's own defaults are spelled out here.

POSITIVE = between(0, lo_open=True)
NON_NEGATIVE = between(0)
UNIT = between(0, 1, hi_open=True)


def param(default: Any = None, check=None, *, to: str | tuple[str, ...] = (), factory=MISSING):
    """A parameter: its default, its check, and the config fields (dotted) its value sets."""
    if factory is not MISSING:
        default = MISSING
    return setting(default, check=check, factory=factory, to=(to,) if isinstance(to, str) else to)


class Params(Settings):
    """Base of every action's (and reward's) parameters."""


def parse_params(params: dict, cls: type, aliases: dict[str, str] | None = None) -> Params:
    """`cls` from a JSON action (aliases renamed): a `ToolError` naming the bad parameter. A
    null means the parameter's default, except where null is a value (max_samples: all rows)."""
    named: dict = {}
    for key, value in params.items():
        name = (aliases or {}).get(key, key)
        if name in named:
            raise ToolError(key, f"given twice (as {name!r} and an alias)")
        named[name] = value
    try:
        return build_settings(cls, named, null_is_default=True)
    except ConfigError as e:
        raise ToolError(e.field or "params", e.problem) from None


def config_sections(p: Params) -> dict:
    """The config mapping that a parameter set sets through its fields' `to`, e.g.
    {"lora": {"rank": 8}, "loss": {"epsilon_low": 0.2, "epsilon_high": 0.2}}; a value of None
    leaves its fields to the core's defaults, unless None was given for a non-None default."""
    out: dict = {}
    for f in dataclasses.fields(p):
        value = getattr(p, f.name)
        if value is None and f.default is None:
            continue
        for dotted in f.metadata.get("to", ()):
            section, key = dotted.split(".")
            out.setdefault(section, {})[key] = value
    return out


# The tutorial's parameters; `to` is the config field each sets. The rest (batch sizes, group
# size, the per-algorithm defaults, epochs vs steps) follow from several of them: `_train`.


@dataclass(frozen=True, kw_only=True)
class Common(Params):
    model_name: str = param("Qwen/Qwen3-0.6B", non_empty)
    dataset: str = param("gsm8k", non_empty)
    custom_dataset: Any = None  # a Dataset or a list of rows: `raw_rows`
    system_prompt: str | None = param(None, non_empty, to="data.system_prompt")
    enable_thinking: bool | None = param(to="data.enable_thinking")
    max_prompt_len: int | None = param(None, POSITIVE, to="data.max_prompt_len")
    device: str | None = param(None, non_empty, to="model.device")
    dtype: Literal["float32", "bfloat16", "float16"] | None = param(to="model.dtype")
    seed: int | None = param(to="train.seed")
    progress: bool | None = param(to="train.progress")


@dataclass(frozen=True, kw_only=True)
class RewardChoice(Params):
    reward_type: str | None = param(None, non_empty)
    reward_config: dict = param(factory=dict)
    custom_reward: Callable | None = None


@dataclass(frozen=True, kw_only=True)
class Train(Common, RewardChoice):
    algorithm: Literal["sft", "grpo"] = param(MISSING)
    output_dir: str = param(MISSING, non_empty, to="train.output_dir")
    split: str | None = param(None, non_empty, to="data.split")
    max_samples: int | None = param(None, POSITIVE, to="data.max_samples")
    num_epochs: float = param(3, POSITIVE)
    max_steps: int | None = param(None, POSITIVE)
    batch_size: int | None = param(None, POSITIVE)
    gradient_accumulation_steps: int = param(1, POSITIVE)
    learning_rate: float | None = param(None, POSITIVE)
    warmup_ratio: float = param(0.1, UNIT, to="optim.warmup_ratio")
    weight_decay: float = param(0.01, NON_NEGATIVE, to="optim.weight_decay")
    max_grad_norm: float | None = param(None, POSITIVE, to="optim.max_grad_norm")
    optimizer: Literal["adamw"] = "adamw"
    use_lora: bool = param(False, to="lora.enabled")
    lora_rank: int | None = param(None, POSITIVE, to="lora.rank")
    lora_alpha: float | None = param(None, POSITIVE, to="lora.alpha")
    lora_dropout: float | None = param(None, UNIT)  # default: 0.05 for SFT, 0 for GRPO (must be)
    lora_target_modules: tuple[str, ...] | None = param(None, non_empty, to="lora.targets")
    num_generations: int = param(4, between(2))
    max_new_tokens: int | None = param(None, POSITIVE)
    temperature: float = param(0.8, NON_NEGATIVE, to="rollout.temperature")
    top_p: float | None = param(None, between(0, 1, lo_open=True), to="rollout.top_p")
    top_k: int | None = param(None, NON_NEGATIVE, to="rollout.top_k")
    kl_coef: float = param(0.05, NON_NEGATIVE, to="loss.beta")
    clip_range: float | None = param(
        None,
        between(0, 1, lo_open=True, hi_open=True),
        to=("loss.epsilon_low", "loss.epsilon_high"),
    )
    save_steps: int | None = param(None, NON_NEGATIVE, to="train.save_every")
    logging_steps: int = param(10, POSITIVE, to="train.log_every")
    eval_steps: int | None = param(None, NON_NEGATIVE, to="train.eval_every")
    eval_samples: int | None = param(None, NON_NEGATIVE)
    gradient_checkpointing: bool | None = param(to="model.gradient_checkpointing")
    bf16: bool | None = param(to="model.autocast_bf16")
    use_wandb: bool | None = param(to="log.wandb")
    use_tensorboard: bool | None = param(to="log.tensorboard")
    wandb_project: str | None = param(None, non_empty, to="log.wandb_project")
    config_overrides: tuple[str, ...] = ()
    resume: bool = False


TRAIN_ALIASES = {"lora_r": "lora_rank", "beta": "kl_coef", "epsilon": "clip_range"}


@dataclass(frozen=True, kw_only=True)
class LoadDataset(Common):
    format: Literal["sft", "rl"] = "sft"
    split: str = param("train", non_empty)
    max_samples: int | None = param(100, POSITIVE)  # null: every row


def _known_metrics(metrics: tuple[str, ...]) -> str | None:
    unknown = [m for m in metrics if m not in EVAL_METRICS]
    return f"unknown metric {unknown[0]!r}; valid: {list(EVAL_METRICS)}" if unknown else None


@dataclass(frozen=True, kw_only=True)
class Evaluate(Common, RewardChoice):
    model_path: str = param(MISSING, non_empty)
    split: str = param("test", non_empty, to="data.eval_split")
    max_samples: int | None = param(100, POSITIVE, to="eval.max_samples")  # null: every row
    use_lora: bool | None = None
    metrics: tuple[str, ...] = param(tuple(EVAL_METRICS), _known_metrics)
    k: int = param(1, POSITIVE, to="eval.k")
    temperature: float | None = param(None, NON_NEGATIVE, to="eval.temperature")
    max_new_tokens: int = param(256, POSITIVE, to="eval.max_new_tokens")
    batch_size: int = param(16, POSITIVE, to="eval.batch_size")
    return_details: bool = False


# The built-in rewards' parameters (the tutorial's names and ours); `to` is the factory's
# argument in `grpo.rewards.functions`, whose defaults apply to what is not given.


@dataclass(frozen=True, kw_only=True)
class AccuracyArgs(Params):
    tolerance: float = param(None, NON_NEGATIVE, to="tolerance")


@dataclass(frozen=True, kw_only=True)
class LengthPenaltyArgs(AccuracyArgs):
    max_length: float = param(None, NON_NEGATIVE, to="target")
    target_length: float = param(None, NON_NEGATIVE, to="target")
    target: float = param(None, NON_NEGATIVE, to="target")
    penalty_weight: float = param(None, NON_NEGATIVE, to="alpha")
    alpha: float = param(None, NON_NEGATIVE, to="alpha")
    floor: float | None = param(None, to="floor")  # null: no floor


@dataclass(frozen=True, kw_only=True)
class StepArgs(AccuracyArgs):
    step_bonus: float = param(None, NON_NEGATIVE, to="beta")
    beta: float = param(None, NON_NEGATIVE, to="beta")
    cap: int | None = param(None, NON_NEGATIVE, to="cap")  # null: no cap


@dataclass(frozen=True, kw_only=True)
class FormatArgs(Params):
    pass


REWARD_ARGS: dict[str, type[Params]] = {
    "accuracy": AccuracyArgs,
    "length_penalty": LengthPenaltyArgs,
    "step": StepArgs,
    "format": FormatArgs,
}


@dataclass(frozen=True, kw_only=True)
class Combined(Params):
    components: tuple[dict, ...] = param(MISSING, non_empty)


@dataclass(frozen=True, kw_only=True)
class Component(Params):
    type: str = param(MISSING, non_empty)
    weight: float = 1.0


def _reward_arg_fields() -> list[tuple]:
    """Every built-in reward's parameters, for create_reward's top level (tutorial style)."""
    out: dict[str, tuple] = {}
    for cls in REWARD_ARGS.values():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            out.setdefault(f.name, (f.name, hints[f.name], param(None, f.metadata["check"])))
    return list(out.values())


CreateReward = dataclasses.make_dataclass(
    "CreateReward",
    [
        ("reward_type", str, param(MISSING, non_empty)),
        ("reward_config", dict, param(factory=dict)),
        *_reward_arg_fields(),
    ],
    bases=(Params,),
    frozen=True,
    kw_only=True,
)


def values_of(p: Params) -> dict:
    """The fields of a parameter set as a dict (not deep-copied, unlike `asdict`)."""
    return {f.name: getattr(p, f.name) for f in dataclasses.fields(p)}


# --------------------------------------------------------------------------- data and rewards


def raw_rows(dataset: Any, parameter: str) -> list[dict]:
    """{question, answer, ...} rows from raw, RL-format or list data (SFT format is refused)."""
    from datasets import Dataset

    if isinstance(dataset, Dataset):
        rows = dataset.to_list()
    elif isinstance(dataset, (list, tuple)):
        rows = list(dataset)
    else:
        raise ToolError(parameter, f"expected a Dataset or a list of rows, got {type(dataset)}")
    if not rows:
        raise ToolError(parameter, "has no rows")
    out = []
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise ToolError(parameter, f"row {i} is a {type(row).__name__}, expected a mapping")
        row = dict(row)
        if "question" in row and "answer" not in row:
            if "full_answer" in row:
                row["answer"] = row.pop("full_answer")
            elif "ground_truth" in row:
                row["answer"] = str(row["ground_truth"])
        if "question" not in row or "answer" not in row:
            if "prompt" in row and "completion" in row:
                raise ToolError(
                    parameter,
                    f"row {i} is in the SFT format (prompt/completion), which cannot be "
                    "re-rendered for another model; pass the rows with 'question' and 'answer' "
                    "(what format_math_dataset takes) or the RL format",
                )
            raise ToolError(parameter, f"row {i} has no 'question' and 'answer' ({sorted(row)})")
        for key in ("prompt", "ground_truth", "completion", "text"):
            row.pop(key, None)  # rendered again with the model's own chat template
        out.append(row)
    return out


def reward_specs(reward_type: str, config: dict, parameter: str = "reward_config") -> list[dict]:
    """[{name, weight, kwargs}] for `Config.rewards` from the tutorial's reward keys.

    combined: ``{"components": [{"type": "accuracy", "weight": 1.0}, {"type": "length_penalty",
    "weight": 0.5, "target_length": 200}, ...]}``, flattened into weighted rewards (the same
    sum, logged per component).
    """
    from grpo.rewards import available_rewards

    try:
        if reward_type == "combined":
            out = []
            for i, part in enumerate(build_settings(Combined, config, parameter).components):
                where = f"{parameter}.components[{i}]"
                head = {k: part[k] for k in ("type", "weight") if k in part}
                c = build_settings(Component, head, where)
                if c.type == "combined":
                    raise ToolError(f"{where}.type", "a component cannot be combined itself")
                rest = {k: v for k, v in part.items() if k not in head}
                (spec,) = reward_specs(c.type, rest, where)
                out.append({**spec, "weight": c.weight})
            return out
        if reward_type in REWARD_ARGS:
            args = build_settings(REWARD_ARGS[reward_type], config, parameter)
            fields = dataclasses.fields(args)
            kwargs = {
                f.metadata["to"][0]: getattr(args, f.name) for f in fields if f.name in config
            }
            return [{"name": reward_type, "weight": 1.0, "kwargs": kwargs}]
    except ConfigError as e:
        raise ToolError(e.field or parameter, e.problem) from None
    if reward_type in available_rewards():  # a registered function or factory
        return [{"name": reward_type, "weight": 1.0, "kwargs": dict(config)}]
    valid = ", ".join(available_rewards())
    raise ToolError("reward_type", f"unknown reward {reward_type!r}; valid: {valid}")


def describe_reward(spec: dict) -> str:
    """One line saying what a reward spec computes."""
    from grpo.rewards import get_reward, reward_defaults

    name = spec["name"]
    kw = {**reward_defaults(name), **spec.get("kwargs", {})}  # the core's defaults, not copies
    if name == "accuracy":
        return "accuracy: 1.0 when the extracted final answer equals the ground truth, else 0.0"
    if name == "length_penalty":
        alpha, target = kw["alpha"], kw["target"]
        return (
            f"length penalty: for a correct answer 1 - {alpha} * max(0, length - {target}) "
            "(length in tokens when training), 0.0 for a wrong one"
        )
    if name == "step":
        cap = f" (at most {kw['cap']} steps)" if kw.get("cap") is not None else ""
        return f"step reward: accuracy + {kw['beta']} per reasoning step{cap}"
    if name == "format":
        return "format: 1.0 when the completion ends with 'Final Answer: <answer>', else 0.0"
    if name == "reward_model":
        return f"reward model: the score of the classifier {kw.get('path')!r} (grpo rm)"
    if name == "judge":
        return f"LLM judge: the score {kw.get('model')!r} at {kw.get('base_url')!r} gives"
    doc = (getattr(get_reward(name).fn, "__doc__", None) or "").strip().splitlines()
    return f"{name}: {doc[0]}" if doc else f"custom reward function {name!r}"


# --------------------------------------------------------------------------- the tool


class RLTrainingTool:
    """The tutorial's `RLTrainingTool` over `grpo`: `run(params) -> JSON str`.

    Args:
        defaults: parameters used when a call does not give them (only for actions that take
            them), e.g. ``{"model_name": "runs/tiny-model", "dataset": "minimath"}``.
    """

    name = "rl_training"
    description = "Train (SFT / GRPO), load data, create rewards and evaluate math LLMs."

    def __init__(self, defaults: dict | None = None):
        self.defaults = dict(defaults or {})

    # ---- registration (methods, as in the tutorial)

    def register_dataset(self, name: str, dataset: Any) -> None:
        """Name a dataset (raw {question, answer} or RL-format rows) for `dataset: name`."""
        from grpo.data import register_dataset

        if name in BUILTIN_DATASETS:
            raise ToolError("name", f"{name!r} is a built-in dataset; choose another name")
        register_dataset(name, raw_rows(dataset, "dataset"), overwrite=True)

    def register_reward_function(self, name: str, fn: Callable[..., list[float]]) -> None:
        """Name a reward ``fn(completions, **columns) -> list[float]``; registered under a
        dataset's name, it is the default reward of GRPO on that dataset."""
        from grpo.rewards import register_reward

        if name in BUILTIN_REWARDS:
            raise ToolError("name", f"{name!r} is a built-in reward; choose another name")
        register_reward(name, fn, overwrite=True)

    # ---- the JSON interface

    def run(self, params: dict) -> str:
        """Do one action; returns JSON with status "success" or "error" (never raises for bad
        input)."""
        try:
            if not isinstance(params, dict):
                raise ToolError("params", f"expected a mapping, got {type(params).__name__}")
            params = dict(params)
            action = params.pop("action", "train" if "algorithm" in params else None)
            if action not in ACTIONS:
                raise ToolError("action", f"must be one of {list(ACTIONS)}, got {action!r}")
            handler, cls, aliases = self._handlers()[action]
            names = {f.name for f in dataclasses.fields(cls)}
            given = {**{k: v for k, v in self.defaults.items() if k in names}, **params}
            result = handler(parse_params(given, cls, aliases))
            return json.dumps({"status": "success", "action": action, **result}, default=str)
        except ToolError as e:
            return json.dumps({"status": "error", "parameter": e.parameter, "message": str(e)})
        except GrpoError as e:
            return json.dumps({"status": "error", "message": str(e)})
        except Exception as e:  # a bug or a library error: still one JSON line for the agent
            log.debug("RLTrainingTool.run failed", exc_info=True)
            return json.dumps({"status": "error", "message": f"{type(e).__name__}: {e}"})

    def _handlers(self):
        return {
            "train": (self._train, Train, TRAIN_ALIASES),
            "load_dataset": (self._load_dataset, LoadDataset, {}),
            "create_reward": (self._create_reward, CreateReward, {}),
            "evaluate": (self._evaluate, Evaluate, {}),
        }

    # ---- actions

    def _dataset_name(self, p: Common, out_dir: Path | None) -> str:
        """The dataset a config should name; custom_dataset is written as JSONL (reproducible)."""
        if p.custom_dataset is None:
            return p.dataset
        rows = raw_rows(p.custom_dataset, "custom_dataset")
        if out_dir is None:
            from grpo.data import register_dataset

            register_dataset("_rltool_custom", rows, overwrite=True)
            return "_rltool_custom"
        path = out_dir / "data" / "custom.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(r, default=str) + "\n" for r in rows))
        return str(path)

    def _rewards(self, p: RewardChoice, dataset: str) -> list[dict]:
        from grpo.rewards import available_rewards, register_reward

        if p.custom_reward is not None:
            fn = p.custom_reward
            name = f"custom_{getattr(fn, '__name__', 'reward')}".replace(":", "_")
            register_reward(name, fn, overwrite=True)
            return [{"name": name, "weight": 1.0, "kwargs": dict(p.reward_config)}]
        if p.reward_type is None and dataset in available_rewards():
            return [{"name": dataset, "weight": 1.0, "kwargs": dict(p.reward_config)}]
        return reward_specs(p.reward_type or "accuracy", p.reward_config)

    def _config(self, p: Common, model: TrainedModel, dataset: str) -> dict:
        """The config mapping of an action: its parameters' fields, the model and the data."""
        if len(model.adapters) > 1:
            raise ToolError(
                "model_name",
                f"{p.model_name!r} stacks {len(model.adapters)} adapters; fold them into one "
                "checkpoint with `grpo merge` first",
            )
        d = {"model": {}, "data": {}, "train": {}, **config_sections(p)}
        d["model"].update(
            path=model.path,
            tokenizer=model.tokenizer,
            adapter=model.adapters[0] if model.adapters else None,
        )
        d["data"]["dataset"] = dataset
        return d

    def _train(self, p: Train) -> dict:
        from grpo.checks import check_config
        from grpo.config import load_config
        from grpo.settings import ConfigError
        from grpo.train.sft import train_sft

        sft = p.algorithm == "sft"
        out_dir = Path(p.output_dir)
        dataset = self._dataset_name(p, out_dir)
        d = self._config(p, resolve_trained(p.model_name), dataset)
        # what follows from several parameters (or from the algorithm) rather than one field
        per_step = p.batch_size or (4 if sft else 2)  # SFT: examples; GRPO: prompts
        G = 2 if sft else p.num_generations
        rows = per_step if sft else per_step * G  # rows of one micro-batch
        if sft:  # Config wants whole groups even for SFT: a group size that divides the batch
            if rows < 2:
                raise ToolError("batch_size", "SFT needs a batch_size of at least 2")
            G = rows
        gas = p.gradient_accumulation_steps
        eval_samples = p.eval_samples
        if eval_samples is None:
            eval_samples = 64 if p.eval_steps else 0
        dropout = (0.05 if sft else 0.0) if p.lora_dropout is None else p.lora_dropout
        d.setdefault("lora", {})["dropout"] = dropout
        d["data"]["eval_samples"] = eval_samples
        d.setdefault("rollout", {}).update(
            group_size=G, max_new_tokens=p.max_new_tokens or (512 if sft else 256)
        )
        d.setdefault("optim", {})["lr"] = p.learning_rate or (2e-5 if sft else 1e-5)
        d["train"].update(
            batch_size=rows * gas,
            micro_batch_size=rows,
            max_steps=p.max_steps or 1,
            epochs=None if (p.max_steps or not sft) else float(p.num_epochs),
        )
        if not sft:
            d["rewards"] = self._rewards(p, dataset)
        try:
            cfg = check_config(load_config(None, p.config_overrides, base=d))
        except ConfigError as e:
            where = "config_overrides" if p.config_overrides else "params"
            raise ToolError(where, str(e)) from None
        n_rows = _count_rows(cfg)
        if not sft and not p.max_steps:  # GRPO has no epochs: steps over the prompts
            steps = max(1, math.ceil(p.num_epochs * n_rows / (per_step * gas)))
            cfg = load_config(None, [*p.config_overrides, f"train.max_steps={steps}"], base=d)
        if sft:
            summary = train_sft(cfg, resume=p.resume)
        else:
            from grpo.train.grpo import train_grpo

            summary = train_grpo(cfg, resume=p.resume)
        metrics = {k: v for k, v in summary.items() if k not in ("output_dir", "final")}
        result = {
            "algorithm": p.algorithm,
            "model_name": p.model_name,
            "output_dir": summary["output_dir"],
            "model_path": summary["final"],
            "config": str(out_dir / "config.yaml"),
            "dataset": dataset,
            "num_samples": n_rows,
            "num_epochs": p.num_epochs,
            "steps": summary["step"],
            "use_lora": p.use_lora,
        }
        if sft:
            result["final_loss"] = summary.get("train/loss")
        else:
            rewards = _logged(out_dir / "metrics.jsonl", "rollout/reward_mean")
            result["average_reward"] = sum(rewards) / len(rewards) if rewards else None
            result["final_reward"] = summary.get("rollout/reward_mean")
            result["reward_functions"] = [r["name"] for r in d["rewards"]]
        result["metrics"] = metrics
        return result

    def _load_dataset(self, p: LoadDataset) -> dict:
        from grpo.config import DataConfig
        from grpo.loading import load_rows
        from grpo.tokenizer import load_tokenizer

        dataset = self._dataset_name(p, None)
        data = DataConfig(dataset=dataset, **config_sections(p).get("data", {}))
        tok = load_tokenizer(resolve_trained(p.model_name).tokenizer_path)
        rows = load_rows(data, p.split, p.max_samples, p.format, tok)
        keys = [k for k in rows[0] if k != "prompt_ids"]
        return {
            "dataset": dataset,
            "format": p.format,
            "split": p.split,
            "dataset_size": len(rows),
            "sample_keys": keys,
            "sample": {k: rows[0][k] for k in keys},
            "max_prompt_tokens": max(len(r["prompt_ids"]) for r in rows),
        }

    def _create_reward(self, p) -> dict:
        from grpo.rewards import build_rewards, compute_rewards

        kind = p.reward_type
        given = {k: v for k, v in values_of(p).items() if v is not None}
        given = {k: v for k, v in given.items() if k not in ("reward_type", "reward_config")}
        if given and kind not in REWARD_ARGS:
            raise ToolError(next(iter(given)), f"{kind!r} takes its parameters in reward_config")
        if given:
            reward_specs(kind, given, parameter="")  # names a bad top-level parameter
        specs = reward_specs(kind, {**p.reward_config, **given})
        fns = build_rewards(
            [{"name": s["name"], "weight": s["weight"], **s["kwargs"]} for s in specs]
        )
        out = {
            "reward_type": p.reward_type,
            "description": " + ".join(
                (f"{s['weight']:g} x " if len(specs) > 1 else "") + describe_reward(s)
                for s in specs
            ),
            "parameters": specs if len(specs) > 1 else specs[0]["kwargs"],
            **given,
        }
        if all(s["name"] in REWARD_ARGS for s in specs):  # built-ins: show what they give
            texts = [c for c, _ in EXAMPLES]
            total, _ = compute_rewards(fns, texts, {"ground_truth": [t for _, t in EXAMPLES]})
            out["examples"] = [
                {"completion": c, "ground_truth": t, "reward": round(float(r), 6)}
                for (c, t), r in zip(EXAMPLES, total.tolist())
            ]
        return out

    def _evaluate(self, p: Evaluate) -> dict:
        from grpo.checks import check_config
        from grpo.config import load_config
        from grpo.eval import evaluate_config

        spec = resolve_trained(p.model_path)
        if p.use_lora and not spec.adapters:
            raise ToolError("use_lora", f"{p.model_path!r} holds no LoRA adapter")
        dataset = self._dataset_name(p, None)
        d = self._config(p, TrainedModel(spec.path, (), spec.tokenizer), dataset)
        d["data"]["eval_samples"] = 0
        d["rewards"] = self._rewards(p, dataset)
        cfg = check_config(load_config(None, base=d))
        s = evaluate_config(cfg, spec, details=True)
        samples = s.pop("samples")
        result = {
            "model_path": p.model_path,
            "base_model": spec.path,
            "adapters": list(spec.adapters),
            "dataset": dataset,
            "split": p.split,
            "num_samples": s["n"],
            "accuracy": s.get("accuracy", 0.0),
            "average_reward": s["average_reward"],
            "k": p.k,
            "device": resolve_device(cfg.model.device).type,
        }
        k = p.k
        for m in p.metrics:
            if m == "accuracy_at_k":
                result[m] = s.get(f"pass@{k}", result["accuracy"])
            elif m == "mean_at_k":
                result[m] = s.get(f"mean@{k}", result["accuracy"])
            else:
                result[m] = s.get(EVAL_METRICS[m])
        if p.return_details:
            for sample in samples:
                sample["prediction"] = sample["completion"]
            result["details"] = samples
            result["errors"] = [x for x in samples if not x["correct"]]
        return result


def _count_rows(cfg) -> int:
    """Rows of the training split that the trainer will see (as `load_rows` selects them)."""
    from grpo.loading import dataset_rows

    n = len(dataset_rows(cfg.data, cfg.data.split, cfg.data.max_samples))
    if n == 0:
        raise ToolError("dataset", f"{cfg.data.dataset!r} split {cfg.data.split!r} has no rows")
    return n


def _logged(path: Path, key: str) -> list[float]:
    """Every logged value of `key` in a metrics.jsonl."""
    if not path.is_file():
        return []
    from grpo.metrics import read_metrics

    rows = read_metrics(path)  # one line naming the file if unreadable; a torn tail skipped
    return [float(r[key]) for r in rows if isinstance(r.get(key), (int, float))]

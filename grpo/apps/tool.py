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

Each action's parameters are a declarative table of `P` (kind, default, check, and the config
field the value sets), so an action is: check the parameters, map them onto a `Config` (plus
what follows from several of them, e.g. batch sizes from batch_size x num_generations), call
the core (`train_sft` / `train_grpo`, `load_rows`, `evaluate_config`). A default of None is the
core's default. Every answer is a JSON string with ``"status": "success"`` or ``"error"``;
an error's message starts with the parameter it is about, never a traceback. `register_dataset` and
`register_reward_function` name data and rewards for later calls; a reward registered under a
dataset's name is the default reward of training on that dataset.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpo.errors import GrpoError
from grpo.loading import TrainedModel, resolve_device, resolve_trained

log = logging.getLogger(__name__)

ACTIONS = ("train", "load_dataset", "create_reward", "evaluate")
BUILTIN_REWARDS = ("accuracy", "length_penalty", "step", "format", "combined")
BUILTIN_DATASETS = ("gsm8k", "minimath")
# tutorial reward parameter -> our factory's parameter, per reward type
REWARD_PARAMS = {
    "accuracy": {"tolerance": "tolerance"},
    "length_penalty": {
        "max_length": "target", "target_length": "target", "target": "target",
        "penalty_weight": "alpha", "alpha": "alpha", "floor": "floor", "tolerance": "tolerance",
    },
    "step": {"step_bonus": "beta", "beta": "beta", "cap": "cap", "tolerance": "tolerance"},
    "format": {},
}  # fmt: skip
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


@dataclass(frozen=True)
class P:
    """One parameter: its kind, default, a check returning a problem (or None), and the config
    fields its value sets (`to`, dotted). A default of None leaves those fields at the core's
    defaults (`grpo.config`); only the tutorial's own defaults are spelled out here."""

    kind: str  # str | int | float | bool | list | dict | callable | rows
    default: Any = None
    check: Callable[[Any], str | None] | None = None
    required: bool = False
    nullable: bool = False  # an explicit None stays None (e.g. max_samples: all rows)
    to: str | tuple[str, ...] = ()

    @property
    def fields(self) -> tuple[str, ...]:
        return (self.to,) if isinstance(self.to, str) else self.to


def _positive(v):
    return None if v > 0 else f"must be > 0, got {v!r}"


def _non_negative(v):
    return None if v >= 0 else f"must be >= 0, got {v!r}"


def _unit(v):
    return None if 0 <= v < 1 else f"must be in [0, 1), got {v!r}"


def _open_unit(v):
    return None if 0 < v < 1 else f"must be in (0, 1), got {v!r}"


def _choice(*allowed):
    return lambda v: None if v in allowed else f"must be one of {list(allowed)}, got {v!r}"


def _kind_ok(kind: str, v: Any) -> bool:
    if kind == "str":
        return isinstance(v, str) and v != ""
    if kind == "int":
        return isinstance(v, int) and not isinstance(v, bool)
    if kind == "float":
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    if kind == "bool":
        return isinstance(v, bool)
    if kind == "list":
        return isinstance(v, (list, tuple)) and all(isinstance(x, str) for x in v)
    if kind == "dict":
        return isinstance(v, dict)
    if kind == "callable":
        return callable(v)
    return True  # rows: checked where used


KIND_NAMES = {
    "str": "a non-empty string", "int": "an integer", "float": "a finite number",
    "bool": "true or false", "list": "a list of strings", "dict": "a mapping",
    "callable": "a function", "rows": "a dataset",
}  # fmt: skip


def parse_params(params: dict, spec: dict[str, P], aliases: dict[str, str]) -> dict:
    """Check `params` against `spec`: unknown keys, kinds, ranges; fill defaults."""
    out: dict = {}
    for key, value in params.items():
        name = aliases.get(key, key)
        if name not in spec:
            raise ToolError(key, f"unknown parameter; valid: {', '.join(sorted(spec))}")
        if name in out:
            raise ToolError(key, f"given twice (as {name!r} and an alias)")
        out[name] = (key, value)
    values = {}
    for name, p in spec.items():
        key, value = out.get(name, (name, None))
        if value is None:
            if p.required:
                raise ToolError(name, "is required")
            values[name] = None if (p.nullable and name in out) else p.default
            continue
        if not _kind_ok(p.kind, value):
            raise ToolError(key, f"expected {KIND_NAMES[p.kind]}, got {value!r}")
        problem = p.check(value) if p.check else None
        if problem:
            raise ToolError(key, problem)
        values[name] = list(value) if p.kind == "list" else value
    return values


def config_sections(values: dict, spec: dict[str, P]) -> dict:
    """The config mapping that parsed parameters set through their `to` fields, e.g.
    {"lora": {"rank": 8}, "loss": {"epsilon_low": 0.2, "epsilon_high": 0.2}}; a value of None
    (unless the parameter is nullable) leaves its fields to the core's defaults."""
    out: dict = {}
    for name, param in spec.items():
        value = values[name]
        if value is None and not param.nullable:
            continue
        for dotted in param.fields:
            section, key = dotted.split(".")
            out.setdefault(section, {})[key] = value
    return out


# The tutorial's parameters; `to` is the config field each sets. The rest (batch sizes, group
# size, the per-algorithm defaults, epochs vs steps) follow from several of them: `_train`.
COMMON = {
    "model_name": P("str", "Qwen/Qwen3-0.6B"),
    "dataset": P("str", "gsm8k"),
    "custom_dataset": P("rows"),
    "system_prompt": P("str", to="data.system_prompt"),
    "enable_thinking": P("bool", to="data.enable_thinking"),
    "max_prompt_len": P("int", None, _positive, to="data.max_prompt_len"),
    "device": P("str", to="model.device"),
    "dtype": P("str", None, _choice("float32", "bfloat16", "float16"), to="model.dtype"),
    "seed": P("int", to="train.seed"),
    "progress": P("bool", to="train.progress"),
}
REWARD = {"reward_type": P("str"), "reward_config": P("dict", {}), "custom_reward": P("callable")}
TRAIN = {
    **COMMON, **REWARD,
    "algorithm": P("str", None, _choice("sft", "grpo"), required=True),
    "output_dir": P("str", required=True, to="train.output_dir"),
    "split": P("str", to="data.split"),
    "max_samples": P("int", None, _positive, to="data.max_samples"),
    "num_epochs": P("float", 3, _positive),
    "max_steps": P("int", None, _positive),
    "batch_size": P("int", None, _positive),
    "gradient_accumulation_steps": P("int", 1, _positive),
    "learning_rate": P("float", None, _positive),
    "warmup_ratio": P("float", 0.1, _unit, to="optim.warmup_ratio"),
    "weight_decay": P("float", 0.01, _non_negative, to="optim.weight_decay"),
    "max_grad_norm": P("float", None, _positive, to="optim.max_grad_norm"),
    "optimizer": P("str", "adamw", _choice("adamw")),
    "use_lora": P("bool", False, to="lora.enabled"),
    "lora_rank": P("int", None, _positive, to="lora.rank"),
    "lora_alpha": P("float", None, _positive, to="lora.alpha"),
    "lora_dropout": P("float", None, _unit),  # default: 0.05 for SFT, 0 for GRPO (must be)
    "lora_target_modules": P("list", None, to="lora.targets"),
    "num_generations": P("int", 4, lambda v: None if v >= 2 else f"must be >= 2, got {v}"),
    "max_new_tokens": P("int", None, _positive),
    "temperature": P("float", 0.8, _non_negative, to="rollout.temperature"),
    "top_p": P("float", None, lambda v: None if 0 < v <= 1 else f"must be in (0, 1], got {v}",
               to="rollout.top_p"),
    "top_k": P("int", None, _non_negative, to="rollout.top_k"),
    "kl_coef": P("float", 0.05, _non_negative, to="loss.beta"),
    "clip_range": P("float", None, _open_unit, to=("loss.epsilon_low", "loss.epsilon_high")),
    "save_steps": P("int", None, _non_negative, to="train.save_every"),
    "logging_steps": P("int", 10, _positive, to="train.log_every"),
    "eval_steps": P("int", None, _non_negative, to="train.eval_every"),
    "eval_samples": P("int", None, _non_negative),
    "gradient_checkpointing": P("bool", to="model.gradient_checkpointing"),
    "bf16": P("bool", to="model.autocast_bf16"),
    "use_wandb": P("bool", to="log.wandb"),
    "use_tensorboard": P("bool", to="log.tensorboard"),
    "wandb_project": P("str", to="log.wandb_project"),
    "config_overrides": P("list", []),
    "resume": P("bool", False),
}  # fmt: skip
TRAIN_ALIASES = {"lora_r": "lora_rank", "beta": "kl_coef", "epsilon": "clip_range"}
LOAD = {
    **COMMON,
    "format": P("str", "sft", _choice("sft", "rl")),
    "split": P("str", "train"),
    "max_samples": P("int", 100, _positive, nullable=True),
}
EVALUATE = {
    **COMMON, **REWARD,
    "model_path": P("str", required=True),
    "split": P("str", "test", to="data.eval_split"),
    "max_samples": P("int", 100, _positive, nullable=True, to="eval.max_samples"),
    "use_lora": P("bool"),
    "metrics": P("list", list(EVAL_METRICS)),
    "k": P("int", 1, _positive, to="eval.k"),
    "temperature": P("float", None, _non_negative, to="eval.temperature"),
    "max_new_tokens": P("int", 256, _positive, to="eval.max_new_tokens"),
    "batch_size": P("int", 16, _positive, to="eval.batch_size"),
    "return_details": P("bool", False),
}  # fmt: skip
CREATE_REWARD = {
    "reward_type": P("str", required=True),
    "reward_config": P("dict", {}),
    **{k: P("float") for m in REWARD_PARAMS.values() for k in m if k != "cap"},
    "cap": P("int", None, _non_negative),
}


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

    if reward_type == "combined":
        parts = config.get("components")
        extra = sorted(set(config) - {"components"})
        if extra or not isinstance(parts, list) or not parts:
            raise ToolError(f"{parameter}.components", "combined needs a non-empty list")
        out = []
        for i, part in enumerate(parts):
            where = f"{parameter}.components[{i}]"
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise ToolError(where, "expected a mapping with a 'type'")
            part = dict(part)
            kind, weight = part.pop("type"), part.pop("weight", 1.0)
            if isinstance(weight, bool) or not isinstance(weight, (int, float)):
                raise ToolError(f"{where}.weight", f"expected a number, got {weight!r}")
            (spec,) = reward_specs(kind, part, where)
            out.append({**spec, "weight": float(weight)})
        return out
    if reward_type in REWARD_PARAMS:
        names = REWARD_PARAMS[reward_type]
        kwargs = {}
        for key, value in config.items():
            where = f"{parameter}.{key}" if parameter else key
            if key not in names:
                valid = ", ".join(names) or "none"
                raise ToolError(where, f"not a parameter of reward {reward_type!r} ({valid})")
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not (value is None and key in ("floor", "cap")) and not (
                number and math.isfinite(value) and (value >= 0 or key == "floor")
            ):
                raise ToolError(where, f"expected a number >= 0, got {value!r}")
            kwargs[names[key]] = value
        return [{"name": reward_type, "weight": 1.0, "kwargs": kwargs}]
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
            handler, spec, aliases = self._handlers()[action]
            given = {**{k: v for k, v in self.defaults.items() if k in spec}, **params}
            result = handler(parse_params(given, spec, aliases))
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
            "train": (self._train, TRAIN, TRAIN_ALIASES),
            "load_dataset": (self._load_dataset, LOAD, {}),
            "create_reward": (self._create_reward, CREATE_REWARD, {}),
            "evaluate": (self._evaluate, EVALUATE, {}),
        }

    # ---- actions

    def _dataset_name(self, p: dict, out_dir: Path | None) -> str:
        """The dataset a config should name; custom_dataset is written as JSONL (reproducible)."""
        if p["custom_dataset"] is None:
            return p["dataset"]
        rows = raw_rows(p["custom_dataset"], "custom_dataset")
        if out_dir is None:
            from grpo.data import register_dataset

            register_dataset("_rltool_custom", rows, overwrite=True)
            return "_rltool_custom"
        path = out_dir / "data" / "custom.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(r, default=str) + "\n" for r in rows))
        return str(path)

    def _rewards(self, p: dict, dataset: str) -> list[dict]:
        from grpo.rewards import available_rewards, register_reward

        if p["custom_reward"] is not None:
            fn = p["custom_reward"]
            name = f"custom_{getattr(fn, '__name__', 'reward')}".replace(":", "_")
            register_reward(name, fn, overwrite=True)
            return [{"name": name, "weight": 1.0, "kwargs": dict(p["reward_config"])}]
        if p["reward_type"] is None and dataset in available_rewards():
            return [{"name": dataset, "weight": 1.0, "kwargs": dict(p["reward_config"])}]
        return reward_specs(p["reward_type"] or "accuracy", p["reward_config"])

    def _config(self, p: dict, spec: dict[str, P], model: TrainedModel, dataset: str) -> dict:
        """The config mapping of an action: its parameters' fields, the model and the data."""
        if len(model.adapters) > 1:
            raise ToolError(
                "model_name",
                f"{p['model_name']!r} stacks {len(model.adapters)} adapters; fold them into one "
                "checkpoint with `grpo merge` first",
            )
        d = {"model": {}, "data": {}, "train": {}, **config_sections(p, spec)}
        d["model"].update(path=model.path, tokenizer=model.tokenizer,
                          adapter=model.adapters[0] if model.adapters else None)  # fmt: skip
        d["data"]["dataset"] = dataset
        return d

    def _train(self, p: dict) -> dict:
        from grpo.config import ConfigError, load_config
        from grpo.train.sft import train_sft

        sft = p["algorithm"] == "sft"
        out_dir = Path(p["output_dir"])
        dataset = self._dataset_name(p, out_dir)
        d = self._config(p, TRAIN, resolve_trained(p["model_name"]), dataset)
        # what follows from several parameters (or from the algorithm) rather than one field
        per_step = p["batch_size"] or (4 if sft else 2)  # SFT: examples; GRPO: prompts
        G = 2 if sft else p["num_generations"]
        rows = per_step if sft else per_step * G  # rows of one micro-batch
        if sft:  # Config wants whole groups even for SFT: a group size that divides the batch
            if rows < 2:
                raise ToolError("batch_size", "SFT needs a batch_size of at least 2")
            G = rows
        gas = p["gradient_accumulation_steps"]
        eval_samples = p["eval_samples"]
        if eval_samples is None:
            eval_samples = 64 if p["eval_steps"] else 0
        dropout = (0.05 if sft else 0.0) if p["lora_dropout"] is None else p["lora_dropout"]
        d.setdefault("lora", {})["dropout"] = dropout
        d["data"]["eval_samples"] = eval_samples
        d.setdefault("rollout", {}).update(
            group_size=G, max_new_tokens=p["max_new_tokens"] or (512 if sft else 256)
        )
        d.setdefault("optim", {})["lr"] = p["learning_rate"] or (2e-5 if sft else 1e-5)
        d["train"].update(
            batch_size=rows * gas, micro_batch_size=rows, max_steps=p["max_steps"] or 1,
            epochs=None if (p["max_steps"] or not sft) else float(p["num_epochs"]),
        )  # fmt: skip
        if not sft:
            d["rewards"] = self._rewards(p, dataset)
        try:
            cfg = load_config(None, p["config_overrides"], base=d)
        except ConfigError as e:
            where = "config_overrides" if p["config_overrides"] else "params"
            raise ToolError(where, str(e)) from None
        n_rows = _count_rows(cfg)
        if not sft and not p["max_steps"]:  # GRPO has no epochs: steps over the prompts
            steps = max(1, math.ceil(p["num_epochs"] * n_rows / (per_step * gas)))
            cfg = load_config(None, [*p["config_overrides"], f"train.max_steps={steps}"], base=d)
        if sft:
            summary = train_sft(cfg, resume=p["resume"])
        else:
            from grpo.train.grpo import train_grpo

            summary = train_grpo(cfg, resume=p["resume"])
        metrics = {k: v for k, v in summary.items() if k not in ("output_dir", "final")}
        result = {
            "algorithm": p["algorithm"], "model_name": p["model_name"],
            "output_dir": summary["output_dir"], "model_path": summary["final"],
            "config": str(out_dir / "config.yaml"), "dataset": dataset, "num_samples": n_rows,
            "num_epochs": p["num_epochs"], "steps": summary["step"], "use_lora": p["use_lora"],
        }  # fmt: skip
        if sft:
            result["final_loss"] = summary.get("train/loss")
        else:
            rewards = _logged(out_dir / "metrics.jsonl", "rollout/reward_mean")
            result["average_reward"] = sum(rewards) / len(rewards) if rewards else None
            result["final_reward"] = summary.get("rollout/reward_mean")
            result["reward_functions"] = [r["name"] for r in d["rewards"]]
        result["metrics"] = metrics
        return result

    def _load_dataset(self, p: dict) -> dict:
        from grpo.config import DataConfig
        from grpo.loading import load_rows
        from grpo.tokenizer import load_tokenizer

        dataset = self._dataset_name(p, None)
        data = DataConfig(dataset=dataset, **config_sections(p, LOAD).get("data", {}))
        tok = load_tokenizer(resolve_trained(p["model_name"]).tokenizer_path)
        rows = load_rows(data, p["split"], p["max_samples"], p["format"], tok)
        keys = [k for k in rows[0] if k != "prompt_ids"]
        return {
            "dataset": dataset, "format": p["format"], "split": p["split"],
            "dataset_size": len(rows), "sample_keys": keys,
            "sample": {k: rows[0][k] for k in keys},
            "max_prompt_tokens": max(len(r["prompt_ids"]) for r in rows),
        }  # fmt: skip

    def _create_reward(self, p: dict) -> dict:
        from grpo.rewards import build_rewards, compute_rewards

        given = {k: v for k, v in p.items() if v is not None and k not in CREATE_REWARD_META}
        kind = p["reward_type"]
        for key in given:  # top-level parameters (the tutorial's style) must fit the type
            if key not in REWARD_PARAMS.get(kind, {}):
                valid = ", ".join(REWARD_PARAMS.get(kind, {})) or "none; use reward_config"
                raise ToolError(key, f"not a parameter of reward {kind!r} (valid: {valid})")
        if given:
            reward_specs(kind, given, parameter="")  # names a bad top-level parameter
        specs = reward_specs(kind, {**p["reward_config"], **given})
        fns = build_rewards(
            [{"name": s["name"], "weight": s["weight"], **s["kwargs"]} for s in specs]
        )
        out = {
            "reward_type": p["reward_type"],
            "description": " + ".join(
                (f"{s['weight']:g} x " if len(specs) > 1 else "") + describe_reward(s)
                for s in specs
            ),
            "parameters": specs if len(specs) > 1 else specs[0]["kwargs"],
            **given,
        }
        if all(s["name"] in REWARD_PARAMS for s in specs):  # built-ins: show what they give
            texts = [c for c, _ in EXAMPLES]
            total, _ = compute_rewards(fns, texts, {"ground_truth": [t for _, t in EXAMPLES]})
            out["examples"] = [
                {"completion": c, "ground_truth": t, "reward": round(float(r), 6)}
                for (c, t), r in zip(EXAMPLES, total.tolist())
            ]
        return out

    def _evaluate(self, p: dict) -> dict:
        from grpo.config import load_config
        from grpo.eval import evaluate_config

        unknown = [m for m in p["metrics"] if m not in EVAL_METRICS]
        if unknown:
            raise ToolError(
                "metrics", f"unknown metric {unknown[0]!r}; valid: {list(EVAL_METRICS)}"
            )
        spec = resolve_trained(p["model_path"])
        if p["use_lora"] and not spec.adapters:
            raise ToolError("use_lora", f"{p['model_path']!r} holds no LoRA adapter")
        dataset = self._dataset_name(p, None)
        d = self._config(p, EVALUATE, TrainedModel(spec.path, (), spec.tokenizer), dataset)
        d["data"]["eval_samples"] = 0
        d["rewards"] = self._rewards(p, dataset)
        cfg = load_config(None, base=d)
        s = evaluate_config(cfg, spec, details=True)
        samples = s.pop("samples")
        result = {
            "model_path": p["model_path"], "base_model": spec.path,
            "adapters": list(spec.adapters), "dataset": dataset, "split": p["split"],
            "num_samples": s["n"], "accuracy": s.get("accuracy", 0.0),
            "average_reward": s["average_reward"], "k": p["k"],
            "device": resolve_device(cfg.model.device).type,
        }  # fmt: skip
        k = p["k"]
        for m in p["metrics"]:
            if m == "accuracy_at_k":
                result[m] = s.get(f"pass@{k}", result["accuracy"])
            elif m == "mean_at_k":
                result[m] = s.get(f"mean@{k}", result["accuracy"])
            else:
                result[m] = s.get(EVAL_METRICS[m])
        if p["return_details"]:
            for sample in samples:
                sample["prediction"] = sample["completion"]
            result["details"] = samples
            result["errors"] = [x for x in samples if not x["correct"]]
        return result


CREATE_REWARD_META = ("reward_type", "reward_config")


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

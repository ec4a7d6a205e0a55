"""RLTrainingTool through `run()`: the tutorial's parameter sets (scaled to a tiny model) for
each action, custom data and rewards, and invalid input answered as a JSON error."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from datasets import Dataset

from grpo.apps.tool import RLTrainingTool


@pytest.fixture(scope="module")
def tool(shared_tiny_model):
    # the tutorial's defaults are Qwen3-0.6B on GSM8K from the hub; offline: tiny + minimath
    return RLTrainingTool(
        defaults={"model_name": str(shared_tiny_model), "dataset": "minimath", "progress": False}
    )


def ok(result: str) -> dict:
    data = json.loads(result)
    assert data["status"] == "success", data
    return data


def error(result: str) -> dict:
    data = json.loads(result)
    assert data["status"] == "error", data
    assert "Traceback" not in data["message"]
    return data


def test_load_dataset_sft_and_rl(tool, shared_tiny_model):
    # 11.2.1: {"action": "load_dataset", "format": "sft", "max_samples": 5}
    sft = ok(tool.run({"action": "load_dataset", "format": "sft", "max_samples": 5}))
    assert (sft["dataset_size"], sft["format"]) == (5, "sft")
    assert sft["sample_keys"][-2:] == ["prompt", "completion"]
    assert sft["sample"]["completion"].rstrip().endswith("<|im_end|>")
    rl = ok(
        tool.run(
            {
                "action": "load_dataset",
                "format": "rl",
                "split": "train",
                "max_samples": 5,
                "model_name": str(shared_tiny_model),
            }
        )
    )
    assert rl["dataset_size"] == 5
    assert {"question", "prompt", "ground_truth", "full_answer"} <= set(rl["sample_keys"])
    # null is the parameter's default, except where null is a value: max_samples null = all
    default = ok(tool.run({"action": "load_dataset", "split": None, "format": None}))
    assert (default["split"], default["format"], default["dataset_size"]) == ("train", "sft", 100)
    every = ok(tool.run({"action": "load_dataset", "max_samples": None, "split": "test"}))
    assert every["dataset_size"] > 100


def test_create_reward_types(tool):
    acc = ok(tool.run({"action": "create_reward", "reward_type": "accuracy"}))
    assert acc["reward_type"] == "accuracy" and "ground truth" in acc["description"]
    assert [e["reward"] for e in acc["examples"]] == [1.0, 1.0, 0.0]
    length = ok(
        tool.run(
            {
                "action": "create_reward",
                "reward_type": "length_penalty",
                "max_length": 1024,
                "penalty_weight": 0.001,
            }
        )
    )
    assert (length["max_length"], length["penalty_weight"]) == (1024, 0.001)
    assert length["parameters"] == {"target": 1024, "alpha": 0.001}
    assert [e["reward"] for e in length["examples"]] == [1.0, 1.0, 0.0]
    step = ok(tool.run({"action": "create_reward", "reward_type": "step", "step_bonus": 0.1}))
    assert step["step_bonus"] == 0.1 and "0.1 per reasoning step" in step["description"]
    assert step["examples"][0]["reward"] == pytest.approx(1.2)  # correct, 2 steps
    combined = ok(
        tool.run(
            {
                "action": "create_reward",
                "reward_type": "combined",
                "reward_config": {
                    "components": [
                        {"type": "accuracy", "weight": 1.0},
                        {"type": "length_penalty", "weight": 0.5, "target_length": 200},
                        {"type": "step", "weight": 0.3, "step_bonus": 0.1},
                    ]
                },
            }
        )
    )
    assert [p["name"] for p in combined["parameters"]] == ["accuracy", "length_penalty", "step"]
    # correct with 2 steps: 1 + 0.5 * 1 + 0.3 * (1 + 2 * 0.1)
    assert combined["examples"][0]["reward"] == pytest.approx(1.86)


@pytest.fixture(scope="module")
def sft_run(tool, tmp_path_factory):
    # 11.1.5 quick start: max_samples 10, num_epochs 1, batch_size 2, use_lora (scaled: 4 rows)
    out = tmp_path_factory.mktemp("tool") / "quick_test_sft"
    result = tool.run(
        {
            "action": "train",
            "algorithm": "sft",
            "output_dir": str(out),
            "max_samples": 4,
            "num_epochs": 1,
            "batch_size": 2,
            "use_lora": True,
            "learning_rate": 5e-5,
            "lora_rank": 8,
            "lora_alpha": 16,
            "max_new_tokens": 32,
        }
    )
    return ok(result)


def test_train_sft(sft_run):
    assert sft_run["algorithm"] == "sft" and sft_run["steps"] == 2  # 4 rows / batch 2
    assert isinstance(sft_run["final_loss"], float) and sft_run["final_loss"] > 0
    assert Path(sft_run["model_path"], "adapter_config.json").is_file()
    assert sft_run["num_samples"] == 4 and sft_run["use_lora"] is True
    cfg = yaml.safe_load(Path(sft_run["config"]).read_text())
    assert (cfg["lora"]["rank"], cfg["lora"]["alpha"], cfg["optim"]["lr"]) == (8, 16.0, 5e-5)


@pytest.fixture(scope="module")
def grpo_run(tool, sft_run, tmp_path_factory):
    # 11.4.2 complete GRPO from the SFT model, scaled: 4 prompts, 1 epoch, 2 prompts per step
    out = tmp_path_factory.mktemp("tool") / "grpo_full"
    result = tool.run(
        {
            "action": "train",
            "algorithm": "grpo",
            "model_name": sft_run["output_dir"],
            "output_dir": str(out),
            "max_samples": 4,
            "num_epochs": 1,
            "batch_size": 2,
            "learning_rate": 1e-5,
            "warmup_ratio": 0.1,
            "num_generations": 4,
            "max_new_tokens": 16,
            "temperature": 0.8,
            "kl_coef": 0.05,
            "clip_range": 0.2,
            "use_lora": True,
            "lora_rank": 16,
            "lora_alpha": 32,
            "reward_type": "combined",
            "reward_config": {
                "components": [
                    {"type": "accuracy", "weight": 1.0},
                    {"type": "length_penalty", "weight": 0.5, "target_length": 200},
                    {"type": "step", "weight": 0.3, "step_bonus": 0.1},
                ]
            },
            "save_steps": 500,
            "logging_steps": 1,
        }
    )
    return ok(result)


def test_train_grpo_from_sft_output(grpo_run, sft_run):
    assert grpo_run["steps"] == 2  # ceil(1 epoch x 4 prompts / 2 per step)
    assert isinstance(grpo_run["average_reward"], float)
    assert grpo_run["reward_functions"] == ["accuracy", "length_penalty", "step"]
    assert Path(grpo_run["model_path"], "adapter_config.json").is_file()
    cfg = yaml.safe_load(Path(grpo_run["config"]).read_text())
    assert cfg["model"]["adapter"] == sft_run["model_path"]  # the SFT adapter, merged
    assert (cfg["rollout"]["group_size"], cfg["train"]["batch_size"]) == (4, 8)
    assert (cfg["loss"]["beta"], cfg["loss"]["epsilon_low"]) == (0.05, 0.2)
    assert [r["weight"] for r in cfg["rewards"]] == [1.0, 0.5, 0.3]
    assert cfg["rewards"][1]["kwargs"] == {"target": 200}


def test_evaluate_trained_and_base(tool, grpo_run, shared_tiny_model):
    # 11.5.2: metrics list, k=3, return_details (scaled: 4 samples, k=2, 16 tokens)
    result = ok(
        tool.run(
            {
                "action": "evaluate",
                "model_path": grpo_run["output_dir"],
                "max_samples": 4,
                "use_lora": True,
                "k": 2,
                "max_new_tokens": 16,
                "return_details": True,
                "metrics": [
                    "accuracy",
                    "accuracy_at_k",
                    "average_length",
                    "average_steps",
                    "format_correctness",
                ],
            }
        )
    )
    assert result["num_samples"] == 4 and 0 <= result["accuracy"] <= 1
    assert isinstance(result["average_reward"], float)
    for key in ("accuracy_at_k", "average_length", "average_steps", "format_correctness"):
        assert key in result, key
    assert len(result["adapters"]) == 2  # the SFT adapter, then GRPO's
    assert len(result["details"]) == 4
    detail = result["details"][0]
    for key in ("question", "prediction", "ground_truth", "correct", "ground_truth_steps"):
        assert key in detail, key
    assert len(result["errors"]) == sum(not d["correct"] for d in result["details"])
    base = ok(
        tool.run(
            {
                "action": "evaluate",
                "model_path": str(shared_tiny_model),
                "max_samples": 2,
                "use_lora": False,
                "max_new_tokens": 8,
            }
        )
    )
    assert base["adapters"] == [] and base["num_samples"] == 2


def test_registered_dataset_uses_the_reward_of_the_same_name(
    tool, shared_tiny_model, tmp_path, monkeypatch
):
    # 11.2.3 complete example: custom rows -> RL format -> register both -> train GRPO
    from grpo.data import format_math_dataset
    from grpo.tokenizer import load_tokenizer

    custom_data = [
        {"question": "What is 2+2?", "answer": "2+2=4. #### 4"},
        {"question": "What is 5+3?", "answer": "5+3=8. #### 8"},
        {"question": "What is 10+7?", "answer": "10+7=17. #### 17"},
    ]
    rl_dataset = format_math_dataset(
        Dataset.from_list(custom_data), "rl", tokenizer=load_tokenizer(shared_tiny_model)
    )
    calls = []

    def tolerant_reward(completions, **kwargs):
        calls.append(list(kwargs["ground_truth"]))
        numbers = [re.findall(r"-?\d+\.?\d*", c) for c in completions]
        return [
            1.0 if n and abs(float(n[-1]) - float(t)) < 0.01 else 0.0
            for n, t in zip(numbers, kwargs["ground_truth"])
        ]

    tool.register_dataset("my_dataset", rl_dataset)
    tool.register_reward_function("my_dataset", tolerant_reward)
    loaded = ok(tool.run({"action": "load_dataset", "dataset": "my_dataset", "format": "rl"}))
    assert loaded["dataset_size"] == 3
    result = ok(
        tool.run(
            {
                "action": "train",
                "algorithm": "grpo",
                "dataset": "my_dataset",
                "output_dir": str(tmp_path / "custom_grpo"),
                "num_epochs": 2,
                "batch_size": 2,
                "use_lora": True,
                "max_steps": 1,
                "max_new_tokens": 8,
            }
        )
    )
    assert result["reward_functions"] == ["my_dataset"] and result["steps"] == 1
    assert calls and set(calls[0]) <= {"4", "8", "17"}
    # custom_dataset: raw rows written beside the run (a reproducible config)
    custom = ok(
        tool.run({"action": "load_dataset", "custom_dataset": custom_data, "format": "sft"})
    )
    assert custom["dataset_size"] == 3


@pytest.mark.parametrize(
    "params, parameter",
    [
        ({"algorithm": "ppo", "output_dir": "o"}, "algorithm"),
        ({"action": "fly"}, "action"),
        ({"model_name": "m"}, "action"),
        ({"action": "train", "algorithm": "sft"}, "output_dir"),
        (
            {"action": "train", "algorithm": "sft", "output_dir": "o", "batch_size": "4"},
            "batch_size",
        ),
        (
            {"action": "train", "algorithm": "sft", "output_dir": "o", "learning_rate": -1.0},
            "learning_rate",
        ),
        (
            {"action": "train", "algorithm": "sft", "output_dir": "o", "learning_rat": 1e-5},
            "learning_rat",
        ),
        (
            {"action": "train", "algorithm": "grpo", "output_dir": "o", "num_generations": 1},
            "num_generations",
        ),
        (
            {"action": "train", "algorithm": "grpo", "output_dir": "o", "use_lora": "yes"},
            "use_lora",
        ),
        (
            {"action": "train", "algorithm": "grpo", "output_dir": "o", "reward_type": "nope"},
            "reward_type",
        ),
        (
            {
                "action": "train",
                "algorithm": "grpo",
                "output_dir": "o",
                "reward_type": "combined",
                "reward_config": {"components": [{"weight": 1.0}]},
            },
            "reward_config.components[0].type",
        ),
        (
            {
                "action": "train",
                "algorithm": "sft",
                "output_dir": "o",
                "custom_dataset": [{"prompt": "p", "completion": "c"}],
            },
            "custom_dataset",
        ),
        ({"action": "load_dataset", "format": "csv"}, "format"),
        ({"action": "load_dataset", "max_samples": 0}, "max_samples"),
        ({"action": "create_reward"}, "reward_type"),
        (
            {"action": "create_reward", "reward_type": "accuracy", "penalty_weight": 0.1},
            "penalty_weight",
        ),
        (
            {"action": "create_reward", "reward_type": "length_penalty", "penalty_weight": -1},
            "penalty_weight",
        ),
        (
            {
                "action": "create_reward",
                "reward_type": "length_penalty",
                "reward_config": {"max_lenght": 5},
            },
            "reward_config.max_lenght",
        ),
        ({"action": "evaluate"}, "model_path"),
        ({"action": "evaluate", "model_path": "m", "metrics": ["bogus"]}, "metrics"),
        ({"action": "evaluate", "model_path": "m", "k": 0}, "k"),
        ({"action": "evaluate", "model_path": "m", "metrics": "accuracy"}, "metrics"),
        ({"action": "create_reward", "reward_type": "format", "alpha": 1.0}, "alpha"),
        ({"action": "create_reward", "reward_type": "step", "cap": 1.5}, "cap"),
        (
            {"action": "train", "algorithm": "grpo", "output_dir": "o", "custom_reward": 5},
            "custom_reward",
        ),
        (
            {
                "action": "train",
                "algorithm": "grpo",
                "output_dir": "o",
                "reward_type": "combined",
                "reward_config": {"components": [{"type": "step", "weight": "x"}]},
            },
            "reward_config.components[0].weight",
        ),
        (
            {
                "action": "train",
                "algorithm": "grpo",
                "output_dir": "o",
                "reward_type": "combined",
                "reward_config": {"components": []},
            },
            "reward_config.components",
        ),
        (
            {
                "action": "train",
                "algorithm": "grpo",
                "output_dir": "o",
                "reward_type": "combined",
                "reward_config": {"components": [{"type": "combined"}]},
            },
            "reward_config.components[0].type",
        ),
        (
            {
                "action": "train",
                "algorithm": "grpo",
                "output_dir": "o",
                "lora_r": 4,
                "lora_rank": 4,
            },
            "lora_rank",
        ),
        ({"action": "train", "algorithm": None, "output_dir": "o"}, "algorithm"),
    ],
)
def test_invalid_parameters_are_json_errors_naming_the_parameter(tool, params, parameter):
    data = error(tool.run(params))
    assert data["parameter"] == parameter
    assert data["message"].startswith(f"{parameter}:")


def test_other_failures_are_one_json_error(tool, shared_tiny_model, tmp_path):
    assert error(tool.run("train"))["parameter"] == "params"
    data = error(
        tool.run({"action": "evaluate", "model_path": str(shared_tiny_model), "use_lora": True})
    )
    assert data["parameter"] == "use_lora" and "no LoRA adapter" in data["message"]
    missing = error(
        tool.run({"action": "evaluate", "model_path": str(tmp_path / "nothing"), "max_samples": 1})
    )
    assert "nothing" in missing["message"]

"""grpo pipeline: the tutorial configs load, the offline tiny pipeline writes a complete
training_results.json, the SFT threshold stops it, and a failing stage is named and recorded."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest
import yaml

from grpo.apps.pipeline import (
    RESULTS_FILE,
    PipelineError,
    add_parser,
    grpo_config_from_sft,
    load_pipeline_config,
    run_pipeline,
)
from grpo.config import load_config
from grpo.errors import GrpoError
from grpo.loading import resolve_trained
from grpo.settings import ConfigError

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"


def cli(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="grpo")
    add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(argv)


def test_gsm8k_configs_load_with_the_tutorial_settings():
    sft = load_config(CONFIGS / "gsm8k_qwen3_0.6b_sft.yaml")
    assert sft.model.path == "Qwen/Qwen3-0.6B"
    assert (sft.lora.enabled, sft.lora.rank, sft.lora.alpha) == (True, 16, 32.0)
    assert sft.lora.targets == ("q_proj", "k_proj", "v_proj", "o_proj")
    assert (sft.optim.lr, sft.optim.warmup_ratio, sft.optim.weight_decay) == (5e-5, 0.1, 0.01)
    assert (sft.train.epochs, sft.train.batch_size) == (3.0, 8)
    assert (sft.train.log_every, sft.train.eval_every, sft.train.save_every) == (100, 500, 500)
    grpo = load_config(CONFIGS / "gsm8k_qwen3_0.6b_grpo.yaml")
    assert (grpo.rollout.group_size, grpo.rollout.max_new_tokens) == (4, 512)
    assert (grpo.rollout.temperature, grpo.optim.lr, grpo.loss.beta) == (0.8, 1e-5, 0.05)
    assert grpo.loss.epsilon_low == grpo.loss.epsilon_high == 0.2
    assert [(r.name, r.weight) for r in grpo.rewards] == [
        ("accuracy", 1.0),
        ("length_penalty", 0.5),
        ("step", 0.3),
    ]
    assert grpo.model.adapter == "runs/gsm8k-qwen3-0.6b-sft/final"
    pipe = load_pipeline_config(CONFIGS / "pipeline_gsm8k.yaml")
    assert pipe.sft.lora.rank == 16 and pipe.grpo.rollout.group_size == 4
    assert pipe.sft.data.max_samples == 1000 and pipe.sft.eval.sft_accuracy_threshold == 0.4
    assert pipe.grpo.model.adapter is None  # set from the SFT result when SFT is done
    assert pipe.sft.train.output_dir == "runs/pipeline-gsm8k/sft"
    load_pipeline_config(CONFIGS / "pipeline_tiny.yaml")
    for name in ("gsm8k_qwen3_0.6b_sft", "gsm8k_qwen3_0.6b_grpo", "pipeline_gsm8k"):
        header = (CONFIGS / f"{name}.yaml").read_text().split("\n\n")[0].split("\nmodel:")[0]
        assert header.startswith("#") and "grpo " in header, name  # the launch command
        assert "GPU memory" in header and "ESTIMATE" in header, name


def test_pipeline_config_errors_name_the_stage_and_field(tmp_path):
    bad = tmp_path / "p.yaml"
    bad.write_text(yaml.safe_dump({"output_dir": "o", "sft": {}, "grpo": {}, "extra": 1}))
    with pytest.raises(ConfigError, match="extra: unknown key; valid keys: base, evaluate"):
        load_pipeline_config(bad)
    bad.write_text(yaml.safe_dump({"output_dir": "o", "sft": {"model": {"path": "m"}}}))
    with pytest.raises(ConfigError, match="grpo: is required"):
        load_pipeline_config(bad)
    # the top level and file stages go through the config's one builder: types by field
    for doc, message in (
        ({"output_dir": 3, "sft": {}, "grpo": {}}, "output_dir: expected a string, got 3"),
        (
            {"output_dir": "o", "sft": {}, "grpo": {}, "evaluate_base": "yes"},
            "evaluate_base: expected true/false",
        ),
        ({"output_dir": "o", "sft": [], "grpo": {}}, "sft: expected a mapping, got []"),
        (
            {"output_dir": "o", "sft": {"config": "a.yaml", "x": 1}, "grpo": {}},
            "sft.x: unknown key; valid keys of sft: config, overrides",
        ),
        (
            {"output_dir": "o", "sft": {"config": "a.yaml", "overrides": [1]}, "grpo": {}},
            "sft.overrides[0]: expected a string, got 1",
        ),
    ):
        bad.write_text(yaml.safe_dump(doc))
        with pytest.raises(ConfigError, match=re.escape(message)):
            load_pipeline_config(bad)
    good = CONFIGS / "pipeline_tiny.yaml"
    with pytest.raises(ConfigError, match=r"^sft: optim.lr"):
        load_pipeline_config(good, ["sft.optim.lr=-1"])
    with pytest.raises(ConfigError, match=r"^grpo: rollout.nope: unknown key"):
        load_pipeline_config(good, ["grpo.rollout.nope=1"])
    # whole groups is GRPO's rule: checked at load (before SFT runs), and SFT is exempt
    with pytest.raises(ConfigError, match=r"^grpo: train.batch_size: .*not divisible"):
        load_pipeline_config(good, ["grpo.rollout.group_size=3"])
    assert load_pipeline_config(good, ["sft.rollout.group_size=3"]).sft.rollout.group_size == 3
    bad.write_text(
        yaml.safe_dump({"output_dir": "o", "sft": {"config": "missing.yaml"}, "grpo": {}})
    )
    with pytest.raises(ConfigError, match="sft: config file .*missing.yaml"):
        load_pipeline_config(bad)


def test_grpo_starts_from_the_sft_result():
    final = "runs/x/sft/final"
    lora = load_pipeline_config(CONFIGS / "pipeline_tiny.yaml")
    cfg = grpo_config_from_sft(lora.grpo, lora.sft, final)
    assert (cfg.model.path, cfg.model.adapter) == (lora.sft.model.path, final)  # LoRA: merged
    full = load_pipeline_config(CONFIGS / "pipeline_tiny.yaml", ["sft.lora.enabled=false"])
    cfg = grpo_config_from_sft(full.grpo, full.sft, final)
    assert (cfg.model.path, cfg.model.tokenizer, cfg.model.adapter) == (final, final, None)


@pytest.fixture(scope="module")
def tiny_pipeline(shared_tiny_model, tmp_path_factory):
    """The offline tiny pipeline, through the `grpo pipeline` CLI function."""
    out = tmp_path_factory.mktemp("pipeline") / "run"
    args = cli(
        [
            "pipeline",
            "--config",
            str(CONFIGS / "pipeline_tiny.yaml"),
            f"model.path={shared_tiny_model}",
            f"output_dir={out}",
            "grpo.train.max_steps=1",
            "eval.max_samples=4",
        ]
    )
    return out, args.func(args)


def test_tiny_pipeline_writes_complete_results(tiny_pipeline, capsys):
    out, rc = tiny_pipeline
    assert rc == 0
    results = json.loads((out / RESULTS_FILE).read_text())
    assert results["status"] == "completed"
    assert list(results["stages"]) == ["prepare_data", "sft", "sft_eval", "grpo", "grpo_eval"]
    for name, stage in results["stages"].items():
        assert stage["status"] == "done" and stage["seconds"] > 0, name
        assert stage["metrics"], name
    stages = results["stages"]
    assert stages["prepare_data"]["metrics"]["dataset_size"] == 32
    assert stages["sft"]["metrics"]["step"] == 2 and "train/loss" in stages["sft"]["metrics"]
    assert stages["grpo"]["metrics"]["step"] == 1
    assert "rollout/reward_mean" in stages["grpo"]["metrics"]
    for name in ("sft_eval", "grpo_eval"):
        metrics = stages[name]["metrics"]
        assert metrics["n"] == 4 and 0 <= metrics["accuracy"] <= 1, name
        assert "average_reward" in metrics, name
    sft_final = Path(stages["sft"]["paths"]["final"])
    assert (sft_final / "adapter_config.json").is_file()
    assert Path(stages["grpo"]["paths"]["final"], "adapter_config.json").is_file()
    # GRPO started from the SFT model: its adapter was merged in (and is its reference)
    grpo_cfg = yaml.safe_load(Path(stages["grpo"]["paths"]["config"]).read_text())
    assert grpo_cfg["model"]["adapter"] == str(sft_final)
    assert stages["grpo_eval"]["paths"]["adapters"] == [
        str(sft_final),
        stages["grpo"]["paths"]["final"],
    ]
    assert set(results["summary"]) == {"sft", "grpo"} and results["total_s"] > 0


def test_resolve_trained_reads_run_directories(tiny_pipeline, shared_tiny_model):
    out, _ = tiny_pipeline
    grpo_run = resolve_trained(out / "grpo")
    assert grpo_run.path == str(shared_tiny_model)
    assert grpo_run.adapters == (str(out / "sft" / "final"), str(out / "grpo" / "final"))
    assert resolve_trained(out / "grpo" / "final") == grpo_run
    assert resolve_trained(out / "sft").adapters == (str(out / "sft" / "final"),)
    assert resolve_trained("Qwen/Qwen3-0.6B").adapters == ()


def _fake_sft(cfg, resume=False):
    final = Path(cfg.train.output_dir) / "final"
    final.mkdir(parents=True)
    return {"output_dir": cfg.train.output_dir, "final": str(final), "step": 1, "train/loss": 1.0}


def test_sft_threshold_stops_before_grpo(shared_tiny_model, tmp_path, monkeypatch, capsys):
    import grpo.apps.pipeline as pipeline

    monkeypatch.setattr("grpo.train.sft.train_sft", _fake_sft)
    monkeypatch.setattr(
        pipeline, "evaluate_config", lambda cfg, spec, details: {"n": 2, "accuracy": 0.25}
    )
    args = cli(
        [
            "pipeline",
            "--config",
            str(CONFIGS / "pipeline_tiny.yaml"),
            f"model.path={shared_tiny_model}",
            f"output_dir={tmp_path}",
            "sft.eval.sft_accuracy_threshold=0.5",
        ]
    )
    assert args.func(args) == 1
    err = capsys.readouterr().err
    assert "accuracy 0.2500 < eval.sft_accuracy_threshold 0.5" in err
    results = json.loads((tmp_path / RESULTS_FILE).read_text())
    assert results["status"] == "stopped" and "GRPO was not run" in results["message"]
    assert list(results["stages"]) == ["prepare_data", "sft", "sft_eval"]


def test_failing_stage_is_named_and_earlier_results_kept(shared_tiny_model, tmp_path, monkeypatch):
    def boom(cfg, resume=False):
        raise GrpoError("reward 'x' raised at row 3")

    monkeypatch.setattr("grpo.train.sft.train_sft", boom)
    pipe = load_pipeline_config(
        CONFIGS / "pipeline_tiny.yaml",
        [f"model.path={shared_tiny_model}", f"output_dir={tmp_path}"],
    )
    with pytest.raises(PipelineError, match=r"stage 'sft' failed: reward 'x' raised at row 3"):
        run_pipeline(pipe)
    results = json.loads((tmp_path / RESULTS_FILE).read_text())
    assert results["status"] == "failed" and results["failed_stage"] == "sft"
    assert results["stages"]["prepare_data"]["status"] == "done"
    assert results["stages"]["prepare_data"]["metrics"]["dataset_size"] == 32
    assert results["stages"]["sft"]["status"] == "failed"
    assert "raised at row 3" in results["stages"]["sft"]["error"]

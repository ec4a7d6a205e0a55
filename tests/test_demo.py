"""`grpo demo --quick` end to end (every stage, tiny sizes) and `grpo plot` on hand-written
metrics."""

from __future__ import annotations

import json
import re

import pytest

from grpo.apps.cli import main
from grpo.apps.demo import DEFAULT_CONFIG, load_demo_config
from grpo.apps.plot import plot_run
from grpo.errors import GrpoError
from grpo.settings import ConfigError

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _is_png(path) -> bool:
    return path.is_file() and path.read_bytes()[:8] == PNG_MAGIC


def test_demo_quick_writes_every_output(tmp_path, capsys):
    out = tmp_path / "demo"
    assert main(["demo", "--out", str(out), "--quick", "--seed", "1"]) == 0
    printed = capsys.readouterr().out
    assert "| SFT |" in printed and "| GRPO |" in printed and "GRPO - SFT" in printed

    results = json.loads((out / "results.json").read_text())
    assert results["quick"] is True and results["seed"] == 1
    for stage in ("sft", "grpo"):
        e = results[stage]["eval"]
        assert e["n"] == results["eval"]["n"] == 8  # the same held-out problems
        assert 0.0 <= e["accuracy"] <= 1.0 and "pass@2" in e and "format_rate" in e
    assert results["accuracy_gain"] == pytest.approx(
        results["grpo"]["eval"]["accuracy"] - results["sft"]["eval"]["accuracy"]
    )
    assert results["sft"]["train_loss_last"] < results["sft"]["train_loss_first"]
    stages = {"setup", "sft", "eval_sft", "grpo", "eval_grpo", "total", "cpu"}
    assert set(results["time_s"]) == stages
    assert (out / "model" / "tokenizer.json").is_file()
    assert (out / "model" / "model.safetensors").is_file()
    assert (out / "sft" / "final" / "model.safetensors").is_file()
    assert (out / "grpo" / "final" / "model.safetensors").is_file()

    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    stages = {r["stage"] for r in records}
    assert stages == {"sft", "grpo"}
    assert any("train/loss" in r for r in records if r["stage"] == "sft")
    grpo = [r for r in records if r["stage"] == "grpo"]
    assert any("rollout/reward_mean" in r and "train/kl" in r for r in grpo)
    held_out = [r for r in grpo if "eval/accuracy" in r]
    assert [r["step"] for r in held_out] == [0, results["grpo"]["steps"]]
    assert held_out[-1]["eval/accuracy"] == results["grpo"]["eval"]["accuracy"]
    assert _is_png(out / "curves.png")


def test_plot_run_with_only_sft_metrics(tmp_path):
    rows = [{"step": s, "train/loss": 3.0 / s, "train/lr": 1e-3} for s in range(1, 6)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["plot", str(tmp_path)]) == 0
    assert _is_png(tmp_path / "curves.png")


def test_plot_run_stages_long_series_and_torn_line(tmp_path):
    rows = [{"stage": "sft", "step": s, "train/loss": 1.0 / s} for s in range(1, 4)]
    rows += [
        {
            "stage": "grpo",
            "step": s,
            "rollout/reward_mean": s / 50,
            "rollout/accuracy": s / 50,
            "train/kl": 0.001 * s,
            "rollout/completion_len_mean": 20.0,
            "eval/errors": {"format": 1},  # not a number: ignored
        }
        for s in range(1, 41)
    ]
    rows.append({"stage": "grpo", "step": 40, "eval/accuracy": 0.5, "eval/pass@8": 0.7})
    text = "".join(json.dumps(r) + "\n" for r in rows) + '{"step": 41, "train/lo'
    (tmp_path / "metrics.jsonl").write_text(text)
    png = plot_run(tmp_path / "metrics.jsonl", out=tmp_path / "plots" / "c.png")
    assert png == tmp_path / "plots" / "c.png" and _is_png(png)


def test_plot_run_errors_name_the_problem(tmp_path):
    with pytest.raises(GrpoError, match="no metrics.jsonl"):
        plot_run(tmp_path)
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "note": "text"}) + "\n")
    with pytest.raises(GrpoError, match="no metrics to plot"):
        plot_run(tmp_path)


def test_demo_config_is_valid_and_strict(tmp_path):
    from grpo.apps.pipeline import load_pipeline_config

    for quick in (False, True):
        settings, pipeline, overrides = load_demo_config(DEFAULT_CONFIG, quick=quick)
        pipeline = {**pipeline, "output_dir": str(tmp_path)}
        pipeline["base"] = {**pipeline["base"], "model": {"path": "x", "device": "cpu"}}
        path = tmp_path / "p.yaml"
        path.write_text(json.dumps(pipeline))  # JSON is YAML
        pcfg = load_pipeline_config(path, overrides)
        assert pcfg.sft.eval == pcfg.grpo.eval  # both evaluations decode the same way
        assert pcfg.sft.data.eval_split == pcfg.grpo.data.eval_split == "test"
    assert load_demo_config(DEFAULT_CONFIG, quick=True)[0].model_size == "ci"
    empty = tmp_path / "empty.yaml"  # empty sections (YAML nulls) are their defaults
    empty.write_text("demo:\npipeline:\nquick:\n  overrides:\n")
    assert load_demo_config(empty, quick=True) == (load_demo_config(empty)[0], {}, [])
    bad = tmp_path / "bad.yaml"
    bad.write_text("demo: {model_sise: demo}\npipeline: {}\n")
    with pytest.raises(ConfigError, match="model_sise"):
        load_demo_config(bad)
    # the demo's settings go through the config's one builder: types by field, dotted names
    for text, message in (
        ("demo: {threads: two}", "demo.threads: expected an integer, got 'two'"),
        (
            "demo: {task: chess}",
            "demo.task: must be one of ['math', 'tools', 'gsm8k-tools', 'rlhf'], got 'chess'",
        ),
        ("demo: {hard_frac: .nan}", "demo.hard_frac: must be a finite number"),
        (
            "demo: {}\nquick: {demo: {vocab_size: 1.5}}",
            "quick.demo.vocab_size: expected an integer",
        ),
        ("demo: {hard_frac: 1.5}", "demo.hard_frac: must be in [0, 1], got 1.5"),
        ("demo: {}\nquick: {demo: {threads: 0}}", "quick.demo.threads: must be >= 1, got 0"),
        ("demo: {min_steps: 3, max_steps: 2}", "demo.min_steps: must be <= max_steps"),
        ("demo: {model_size: huge}", "demo.model_size: must be one of"),
        ("demo: {}\nquick: {overrides: [1]}", "quick.overrides[0]: expected a string, got 1"),
    ):
        bad.write_text(text + "\npipeline: {}\n")
        with pytest.raises(ConfigError, match=re.escape(message)):
            load_demo_config(bad, quick="quick" in text)


def test_demo_cli_config_errors_are_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("demo: {threads: 0}\npipeline: {}\n")
    for path, message in ((tmp_path / "missing.yaml", "does not exist"), (bad, "demo.threads")):
        assert main(["demo", "--out", str(tmp_path / "out"), "--config", str(path)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err
    assert not (tmp_path / "out").exists()  # nothing written before the config is checked


def test_tools_demo_quick_writes_every_output(tmp_path, capsys):
    out = tmp_path / "demo-tools"
    assert main(["demo", "--task", "tools", "--out", str(out), "--quick"]) == 0
    printed = capsys.readouterr().out
    assert "tool calls per problem" in printed and "without the tool" in printed
    results = json.loads((out / "results.json").read_text())
    assert results["settings"]["task"] == "tools"
    for stage in ("sft", "grpo"):
        e = results[stage]["eval"]
        for key in ("accuracy", "turns_mean", "tool_calls_mean", "invalid_call_rate"):
            assert key in e
        assert 1.0 <= e["turns_mean"] <= 3.0  # episodes with the calculator (max_turns 3)
        assert "turns_mean" not in results["without_tool"][stage]  # one turn, no tool
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert any("env/turns_mean" in r for r in records if r["stage"] == "grpo")


def test_rlhf_demo_quick_writes_every_output(tmp_path, capsys):
    """SFT -> reward model -> GRPO on the reward model alone: the reward model's held-out
    pairs, the true accuracy beside its score before and after, the weight-0 accuracy logged
    (never in the total), and `rm` overrides reaching `grpo rm`."""
    out = tmp_path / "demo-rlhf"
    assert (
        main(["demo", "--task", "rlhf", "--out", str(out), "--quick", "rm.rm.center_coef=0.01"])
        == 0
    )
    printed = capsys.readouterr().out
    assert "held-out pair accuracy" in printed and "reward-model score" in printed
    results = json.loads((out / "results.json").read_text())
    rm = results["reward_model"]
    assert rm["eval"]["pairs"] == 8 and 0 <= rm["eval"]["accuracy"] <= 1 and rm["steps"] == 4
    assert set(rm["accuracy_by_kind"]) <= {
        "arithmetic",
        "operation",
        "operand",
        "final_answer",
        "no_final_answer",
    }
    rm_cfg = (out / "rm" / "config.yaml").read_text()
    assert "center_coef: 0.01" in rm_cfg and "demo-preferences" in rm_cfg
    for stage in ("sft", "grpo"):
        assert results[stage]["rm_score"] == results[stage]["eval"]["average_reward"]
    assert (out / "rm" / "final" / "config.json").is_file()
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    grpo = [r for r in records if r["stage"] == "grpo" and "rollout/reward_mean" in r]
    assert grpo
    for r in grpo:  # the total is the reward model's score alone; accuracy only logged
        assert r["rollout/reward_mean"] == pytest.approx(r["rewards/reward_model"], abs=1e-6)
        assert "rollout/accuracy" in r and "rewards/reward_model/score_mean" in r
    assert _is_png(out / "curves.png")
    # the online variant: the same SFT model and steps, its reward the online reward model's
    # score alone (started from out/rm/final), 4 labels a step (quick.overrides)
    online = results["grpo_online"]
    assert online["steps"] == results["grpo"]["steps"] == 3
    assert online["labels"] <= 3 * 4 and 0 <= online["eval"]["accuracy"] <= 1
    rows = [json.loads(line) for line in (out / "grpo_online" / "metrics.jsonl").open()]
    steps = [r for r in rows if "rollout/reward_mean" in r]
    assert steps
    for r in steps:
        assert r["rollout/reward_mean"] == pytest.approx(r["rewards/online_rm"], abs=1e-6)
        assert r["module/online_reward_model/labels"] <= 4 and "rollout/accuracy" in r
    assert "online_reward_model" in rows[0]["run/modules"]
    state = out / "grpo_online" / "final" / "modules" / "online_reward_model"
    assert (state / "weights.safetensors").is_file()
    variants = json.loads((out / "rm_variants.json").read_text())
    for name in ("offline", "online"):
        assert variants[name]["eval_accuracy"][0] == results["sft"]["eval"]["accuracy"]
        assert variants[name]["eval_step"][-1] == 3 and variants[name]["rm_score"]
    assert variants["online"]["final_accuracy"] == online["eval"]["accuracy"]
    assert _is_png(out / "rm_variants.png")


def test_task_and_config_must_agree(tmp_path, capsys):
    assert (
        main(
            [
                "demo",
                "--task",
                "tools",
                "--config",
                str(DEFAULT_CONFIG),
                "--out",
                str(tmp_path / "o"),
            ]
        )
        == 2
    )
    assert "--task tools but the config's demo.task is 'math'" in capsys.readouterr().err

"""grpo sweep: a 2x2 grid on the tiny config completes and prints its table, a rerun resumes
without retraining, spaces are validated, random draws are seeded."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest
import yaml

from grpo.errors import GrpoError
from grpo.sweep import Range, add_parser, grid_trials, load_space, random_trials, run_sweep

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs" / "tiny_ci.yaml")


def tiny_overrides(model: Path) -> list[str]:
    return [f"model.path={model}", "train.max_steps=1", "train.save_every=0",
            "train.progress=false", "data.max_samples=8", "data.eval_samples=2",
            "rollout.max_new_tokens=8", "eval.max_new_tokens=8", "train.batch_size=4",
            "train.micro_batch_size=4", "loss.num_iterations=1"]  # fmt: skip


def write_space(path: Path, space: dict) -> Path:
    path.write_text(yaml.safe_dump(space, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def grid_sweep(shared_tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sweep")
    space = write_space(tmp / "space.yaml", {"optim.lr": [1e-3, 5e-4], "loss.beta": [0.0, 0.04]})
    parser = argparse.ArgumentParser(prog="grpo")
    add_parser(parser.add_subparsers(dest="command"))
    argv = ["sweep", "--config", TINY, "--space", str(space), "--method", "grid",
            "--metric", "rollout/reward_mean", "--out", str(tmp / "out")]  # fmt: skip
    args = parser.parse_args([*argv, *tiny_overrides(shared_tiny_model)])
    return tmp, args


def test_grid_sweep_completes_and_prints_its_table(grid_sweep, capsys):
    tmp, args = grid_sweep
    assert args.func(args) == 0
    printed = capsys.readouterr().out
    lines = [line for line in printed.splitlines() if line.startswith("| ")]
    assert (
        lines[0]
        == "| rank | trial | optim.lr | loss.beta | rollout/reward_mean | status | seconds |"
    )
    assert len(lines) == 5 and all("| done |" in line for line in lines[1:])
    assert "best: trial_" in printed
    results = json.loads((tmp / "out" / "sweep_results.json").read_text())
    trials = results["trials"]
    assert [t["params"] for t in trials] == [
        {"optim.lr": 1e-3, "loss.beta": 0.0}, {"optim.lr": 1e-3, "loss.beta": 0.04},
        {"optim.lr": 5e-4, "loss.beta": 0.0}, {"optim.lr": 5e-4, "loss.beta": 0.04},
    ]  # fmt: skip
    for i, t in enumerate(trials):
        run = tmp / "out" / f"trial_{i:03d}"
        assert t["status"] == "done" and (run / "trial.json").is_file()
        cfg = yaml.safe_load((run / "config.yaml").read_text())
        assert (cfg["optim"]["lr"], cfg["loss"]["beta"]) == (
            t["params"]["optim.lr"], t["params"]["loss.beta"],
        )  # fmt: skip
        assert "eval/accuracy" in t["metrics"]
    # sorted by the metric, best first
    values = [float(line.split("|")[5]) for line in lines[1:]]
    assert values == sorted(values, reverse=True)


def test_rerun_resumes_without_training(grid_sweep, monkeypatch, shared_tiny_model):
    tmp, _ = grid_sweep

    def no_training(cfg, resume=False):
        raise AssertionError("a finished trial was trained again")

    monkeypatch.setattr("grpo.train.grpo.train_grpo", no_training)
    space = load_space(tmp / "space.yaml")
    over = tiny_overrides(shared_tiny_model)
    records = run_sweep(TINY, space, method="grid", metric="train/loss", mode="min",
                        out_dir=tmp / "out", overrides=over)  # fmt: skip
    assert len(records) == 4 and all(r["status"] == "done" for r in records)
    assert all(r["metric"] == r["metrics"]["train/loss"] for r in records)  # --metric changed
    with pytest.raises(GrpoError, match="not in the trials' metrics"):
        run_sweep(TINY, space, method="grid", metric="nope", out_dir=tmp / "out",
                  overrides=tiny_overrides(shared_tiny_model))  # fmt: skip
    other = write_space(tmp / "other.yaml", {"optim.lr": [1e-4]})
    with pytest.raises(GrpoError, match="run with other parameters"):
        run_sweep(TINY, load_space(other), out_dir=tmp / "out",
                  overrides=tiny_overrides(shared_tiny_model))  # fmt: skip


def test_space_validation(tmp_path):
    with pytest.raises(GrpoError, match="space optim.lr: the list of values is empty"):
        load_space(write_space(tmp_path / "a.yaml", {"optim.lr": []}))
    with pytest.raises(GrpoError, match="a log range needs low > 0"):
        load_space(
            write_space(tmp_path / "b.yaml", {"optim.lr": {"low": 0, "high": 1, "log": True}})
        )
    with pytest.raises(GrpoError, match="unknown field 'hi'"):
        load_space(write_space(tmp_path / "c.yaml", {"loss.beta": {"low": 0, "hi": 1}}))
    with pytest.raises(GrpoError, match="does not exist"):
        load_space(tmp_path / "missing.yaml")
    with pytest.raises(GrpoError, match="grid needs a list"):
        grid_trials({"loss.beta": Range(0.0, 1.0)})
    with pytest.raises(GrpoError, match="unknown config key 'optim.lrr'"):
        run_sweep(TINY, {"optim.lrr": [1.0]}, out_dir=tmp_path / "o", overrides=["model.path=m"])
    assert not (tmp_path / "o").exists()  # nothing ran: every trial is checked first


def test_random_trials_are_seeded_and_in_range():
    space = {
        "optim.lr": Range(1e-6, 1e-4, log=True),
        "lora.rank": Range(4, 32, integer=True),
        "loss.beta": [0.0, 0.04],
    }
    a, b = random_trials(space, 20, seed=3), random_trials(space, 20, seed=3)
    assert a == b and a != random_trials(space, 20, seed=4)
    for t in a:
        assert 1e-6 <= t["optim.lr"] <= 1e-4
        assert isinstance(t["lora.rank"], int) and 4 <= t["lora.rank"] <= 32
        assert t["loss.beta"] in (0.0, 0.04)


def test_optuna_method_without_optuna_is_one_clear_error(tmp_path, monkeypatch):
    # optuna is optional and not a dependency; without it the method says so. A None entry in
    # sys.modules makes `import optuna` fail whether or not the package is installed.
    monkeypatch.setitem(sys.modules, "optuna", None)
    with pytest.raises(GrpoError, match="needs the optuna package"):
        run_sweep(TINY, {"loss.beta": [0.0]}, method="optuna", out_dir=tmp_path / "o",
                  overrides=["model.path=m"])  # fmt: skip

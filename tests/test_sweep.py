"""grpo sweep: a 2x2 grid on the tiny config completes and prints its table, --resume continues
without retraining, spaces are validated, random draws are seeded; optuna (TPE) prunes trials
that trail the median of finished ones, stores its study in sqlite and resumes after an
interruption mid-trial or between a trial's record and the study being told."""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

import pytest
import yaml

from grpo.apps.sweep import Range, add_parser, grid_trials, load_space, random_trials, run_sweep
from grpo.errors import GrpoError

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs" / "tiny_ci.yaml")


def tiny_overrides(model: Path) -> list[str]:
    return [
        f"model.path={model}",
        "train.max_steps=1",
        "train.save_every=0",
        "train.progress=false",
        "data.max_samples=8",
        "data.eval_samples=2",
        "rollout.max_new_tokens=8",
        "eval.max_new_tokens=8",
        "train.batch_size=4",
        "train.micro_batch_size=4",
        "loss.num_iterations=1",
        "rollout.compile=off",
    ]


def write_space(path: Path, space: dict) -> Path:
    path.write_text(yaml.safe_dump(space, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def grid_sweep(shared_tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sweep")
    space = write_space(tmp / "space.yaml", {"optim.lr": [1e-3, 5e-4], "loss.beta": [0.0, 0.04]})
    parser = argparse.ArgumentParser(prog="grpo")
    add_parser(parser.add_subparsers(dest="command"))
    argv = [
        "sweep",
        "--config",
        TINY,
        "--space",
        str(space),
        "--method",
        "grid",
        "--metric",
        "rollout/reward_mean",
        "--out",
        str(tmp / "out"),
    ]
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
        {"optim.lr": 1e-3, "loss.beta": 0.0},
        {"optim.lr": 1e-3, "loss.beta": 0.04},
        {"optim.lr": 5e-4, "loss.beta": 0.0},
        {"optim.lr": 5e-4, "loss.beta": 0.04},
    ]
    for i, t in enumerate(trials):
        run = tmp / "out" / f"trial_{i:03d}"
        assert t["status"] == "done" and (run / "trial.json").is_file()
        cfg = yaml.safe_load((run / "config.yaml").read_text())
        assert (cfg["optim"]["lr"], cfg["loss"]["beta"]) == (
            t["params"]["optim.lr"],
            t["params"]["loss.beta"],
        )
        assert "eval/accuracy" in t["metrics"]
    # sorted by the metric, best first
    values = [float(line.split("|")[5]) for line in lines[1:]]
    assert values == sorted(values, reverse=True)


def test_rerun_resumes_without_training(grid_sweep, monkeypatch, shared_tiny_model):
    tmp, _ = grid_sweep

    def no_training(cfg, resume=False, on_step=None):
        raise AssertionError("a finished trial was trained again")

    monkeypatch.setattr("grpo.train.grpo.train_grpo", no_training)
    space = load_space(tmp / "space.yaml")
    over = tiny_overrides(shared_tiny_model)
    before = (tmp / "out" / "sweep_results.json").read_bytes()
    with pytest.raises(GrpoError, match="holds a sweep already; pass --resume"):
        run_sweep(TINY, space, method="grid", out_dir=tmp / "out", overrides=over)
    assert (tmp / "out" / "sweep_results.json").read_bytes() == before  # untouched
    with pytest.raises(GrpoError, match="holds a grid / random sweep, not --method optuna"):
        run_sweep(TINY, space, method="optuna", out_dir=tmp / "out", overrides=over, resume=True)
    with pytest.raises(GrpoError, match="--resume: no sweep in"):
        run_sweep(TINY, space, out_dir=tmp / "new", overrides=over, resume=True)
    records = run_sweep(
        TINY,
        space,
        method="grid",
        metric="train/loss",
        mode="min",
        out_dir=tmp / "out",
        overrides=over,
        resume=True,
    )
    assert len(records) == 4 and all(r["status"] == "done" for r in records)
    assert all(r["metric"] == r["metrics"]["train/loss"] for r in records)  # --metric changed
    with pytest.raises(GrpoError, match="not in the trials' metrics"):
        run_sweep(
            TINY,
            space,
            method="grid",
            metric="nope",
            out_dir=tmp / "out",
            overrides=tiny_overrides(shared_tiny_model),
            resume=True,
        )
    other = write_space(tmp / "other.yaml", {"optim.lr": [1e-4]})
    with pytest.raises(GrpoError, match="run with other parameters"):
        run_sweep(
            TINY,
            load_space(other),
            out_dir=tmp / "out",
            overrides=tiny_overrides(shared_tiny_model),
            resume=True,
        )


def test_space_validation(tmp_path):
    with pytest.raises(GrpoError, match="space optim.lr: the list of values is empty"):
        load_space(write_space(tmp_path / "a.yaml", {"optim.lr": []}))
    with pytest.raises(GrpoError, match="a log range needs low > 0"):
        load_space(
            write_space(tmp_path / "b.yaml", {"optim.lr": {"low": 0, "high": 1, "log": True}})
        )
    with pytest.raises(
        GrpoError,
        match="space loss.beta.hi: unknown key; valid keys of space loss.beta: high, log, low",
    ):
        load_space(write_space(tmp_path / "c.yaml", {"loss.beta": {"low": 0, "hi": 1}}))
    # ranges go through the config's one builder: types named by field
    for spec, message in (
        ({"low": "a", "high": 1}, "space loss.beta.low: expected a number, got 'a'"),
        ({"low": 0, "high": 1, "type": "bool"}, "space loss.beta.type: must be one of"),
        ({"low": 0, "high": 1, "log": "yes"}, "space loss.beta.log: expected true/false"),
        ({"low": 0}, "space loss.beta.high: is required"),
        ({"low": 2, "high": 1}, "space loss.beta: low 2.0 > high 1.0"),
    ):
        with pytest.raises(GrpoError, match=re.escape(message)):
            load_space(write_space(tmp_path / "d.yaml", {"loss.beta": spec}))
    with pytest.raises(GrpoError, match="does not exist"):
        load_space(tmp_path / "missing.yaml")
    with pytest.raises(GrpoError, match="grid needs a list"):
        grid_trials({"loss.beta": Range(0.0, 1.0)})
    with pytest.raises(GrpoError, match="optim.lrr: unknown key"):
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
        run_sweep(
            TINY,
            {"loss.beta": [0.0]},
            method="optuna",
            out_dir=tmp_path / "o",
            overrides=["model.path=m"],
        )


# ----------------------------------------------------------------- optuna

OPTUNA_METRIC = "eval/avg_length"  # with a random-init model: about eval.max_new_tokens


def optuna_argv(tmp: Path, model: Path, space: Path, steps: int, *extra: str) -> list[str]:
    argv = [
        "sweep",
        "--config",
        TINY,
        "--space",
        str(space),
        "--method",
        "optuna",
        "--metric",
        OPTUNA_METRIC,
        "--mode",
        "max",
        "--out",
        str(tmp / "out"),
        *extra,
    ]
    return [*argv, *tiny_overrides(model), f"train.max_steps={steps}", "train.eval_every=1"]


def logged(run: Path, key: str) -> dict[int, float]:
    """step -> value of `key` in a trial's metrics.jsonl (what the trainer measured)."""
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r[key] for r in rows}


def test_optuna_sweep_prunes_trailing_trials(shared_tiny_model, tmp_path, capsys):
    import optuna  # the test extra has it

    from grpo.apps import cli

    space = write_space(tmp_path / "space.yaml", {"eval.max_new_tokens": [2, 8]})
    steps = 3
    argv = optuna_argv(
        tmp_path, shared_tiny_model, space, steps, "--trials", "4", "--prune-startup", "1"
    )
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    lines = [line for line in printed.splitlines() if line.startswith("| ")]
    assert lines[0] == (
        "| rank | trial | eval.max_new_tokens | eval/avg_length | status | seconds |"
    )  # the grid / random table
    trials = json.loads((tmp_path / "out" / "sweep_results.json").read_text())["trials"]
    assert [t["name"] for t in trials] == [f"trial_{i:03d}" for i in range(4)]
    # The median rule, from what each trial logged: trial k stops at the first step s where
    # its best value so far is below the median, at s, of the trials finished before it.
    finished: list[dict[int, float]] = []
    for t in trials:
        values = logged(tmp_path / "out" / t["name"], OPTUNA_METRIC)
        expect_prune = None
        for s in range(1, steps + 1):
            best = max(values[i] for i in range(1, s + 1))
            if finished and best < statistics.median(f[s] for f in finished):
                expect_prune = s
                break
        if expect_prune is None:
            assert t["status"] == "done" and sorted(values) == list(range(1, steps + 1))
            assert t["metric"] == values[steps]
            finished.append(values)
        else:  # stopped right there: nothing trained or logged after the pruned step
            assert t["status"] == "pruned" and t["pruned_at"] == expect_prune, t
            assert sorted(values) == list(range(1, expect_prune + 1))
            assert t["metric"] == values[expect_prune]
    statuses = [t["status"] for t in trials]
    assert statuses.count("pruned") >= 1 and statuses.count("done") >= 2, statuses
    # the study in sqlite agrees: outcomes, final values, every intermediate value reported
    study = optuna.load_study(
        study_name="grpo-sweep", storage=f"sqlite:///{tmp_path / 'out' / 'optuna.db'}"
    )
    state = {"done": optuna.trial.TrialState.COMPLETE, "pruned": optuna.trial.TrialState.PRUNED}
    for t, ft in zip(trials, study.get_trials()):
        assert ft.state == state[t["status"]] and ft.params == t["params"]
        assert ft.intermediate_values == logged(tmp_path / "out" / t["name"], OPTUNA_METRIC)
        if t["status"] == "done":
            assert ft.value == t["metric"]
    # table rows: done trials best first, then pruned ones
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in lines[1:]]
    assert len(rows) == 4
    order = [r[4] for r in rows]
    assert order == sorted(order, key=["done", "pruned"].index)
    done_values = [float(r[3]) for r in rows if r[4] == "done"]
    assert done_values == sorted(done_values, reverse=True)


def test_optuna_sweep_resumes_after_interruptions(shared_tiny_model, tmp_path, monkeypatch, capsys):
    import optuna

    import grpo.apps.sweep as sweep_mod
    import grpo.train.grpo as g
    from grpo.apps import cli

    space = write_space(tmp_path / "space.yaml", {"eval.max_new_tokens": [2, 4, 8]})
    argv = optuna_argv(tmp_path, shared_tiny_model, space, 2, "--trials", "3", "--pruner", "none")
    trained: list[str] = []
    real_train, real_run_trial = g.train_grpo, sweep_mod.run_trial
    seeds: list[int] = []
    real_tpe = optuna.samplers.TPESampler

    def tpe(*a, **k):
        if k.get("seed") is not None:
            seeds.append(k["seed"])
        return real_tpe(*a, **k)

    monkeypatch.setattr(optuna.samplers, "TPESampler", tpe)

    def train(cfg, resume=False, on_step=None):  # Ctrl-C inside the 2nd training, at step 2
        trained.append(Path(cfg.train.output_dir).name)

        def hook(step, metrics):
            if len(trained) == 2 and step == 2:
                raise KeyboardInterrupt
            on_step(step, metrics)

        return real_train(cfg, resume, on_step=hook)

    monkeypatch.setattr(g, "train_grpo", train)
    assert cli.main(argv) == 130  # "grpo sweep: interrupted"
    storage = f"sqlite:///{tmp_path / 'out' / 'optuna.db'}"
    states = optuna.trial.TrialState
    study = optuna.load_study(study_name="grpo-sweep", storage=storage)
    assert [t.state for t in study.get_trials()] == [states.COMPLETE, states.RUNNING]
    interrupted = study.get_trials()[1].params
    record = json.loads((tmp_path / "out" / "trial_001" / "trial.json").read_text())
    assert record["status"] == "interrupted"

    # without --resume: one line, exit 2, nothing touched
    before = (tmp_path / "out" / "trial_000" / "trial.json").read_bytes()
    capsys.readouterr()
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds a sweep already; pass --resume" in err[0]
    assert (tmp_path / "out" / "trial_000" / "trial.json").read_bytes() == before

    # resume; the retry of trial 1 (trial 2) finishes and is recorded, then the sweep dies
    # before telling the study
    def dies_after_record(setup, index, params, on_step=None):
        record = real_run_trial(setup, index, params, on_step)
        if index == 2:
            raise KeyboardInterrupt
        return record

    monkeypatch.setattr(sweep_mod, "run_trial", dies_after_record)
    assert cli.main([*argv, "--resume"]) == 130
    study = optuna.load_study(study_name="grpo-sweep", storage=storage)
    t1, t2 = study.get_trials()[1:]
    assert (t1.state, t2.state) == (states.FAIL, states.RUNNING)
    assert t2.params == interrupted and t2.user_attrs == {"retry_of": 1}
    assert not (tmp_path / "out" / "trial_001").exists()  # the interrupted attempt is gone
    assert json.loads((tmp_path / "out" / "trial_002" / "trial.json").read_text())["status"] == (
        "done"
    )

    # resume again: trial 2 is told from its record, not retrained; trial 3 completes the 3
    monkeypatch.setattr(sweep_mod, "run_trial", real_run_trial)
    capsys.readouterr()
    assert cli.main([*argv, "--resume"]) == 0
    assert trained == ["trial_000", "trial_001", "trial_002", "trial_003"]
    printed = capsys.readouterr().out
    rows = [line for line in printed.splitlines() if line.startswith("| ")][1:]
    assert sorted(r.split("|")[2].strip() for r in rows) == ["trial_000", "trial_002", "trial_003"]
    study = optuna.load_study(study_name="grpo-sweep", storage=storage)
    assert [t.state for t in study.get_trials()] == [
        states.COMPLETE,
        states.FAIL,
        states.COMPLETE,
        states.COMPLETE,
    ]
    results = json.loads((tmp_path / "out" / "sweep_results.json").read_text())["trials"]
    assert [r["name"] for r in results] == ["trial_000", "trial_002", "trial_003"]
    for r, t in zip(results, [study.get_trials()[i] for i in (0, 2, 3)]):
        assert r["params"] == t.params and r["metric"] == t.value
    assert seeds == [0, 2, 3]  # a resumed sampler does not replay the draws made before


def test_huge_spaces_are_refused_before_anything_is_built(tmp_path):
    from grpo.apps.sweep import MAX_TRIALS

    space = {f"k{i}": list(range(10)) for i in range(8)}  # 10^8 combinations
    with pytest.raises(GrpoError, match="the grid has 100000000 combinations; at most 10000"):
        grid_trials(space)
    first = grid_trials(space, 3)  # the first N only: islice, nothing else is built
    assert first == [{**{f"k{i}": 0 for i in range(7)}, "k7": j} for j in range(3)]
    out = tmp_path / "sweep"
    with pytest.raises(GrpoError, match=f"--trials: must be in \\[1, {MAX_TRIALS}\\]"):
        run_sweep(
            str(tmp_path / "missing.yaml"),
            {"optim.lr": [1e-3]},
            method="random",
            trials=10**7,
            out_dir=str(out),
        )
    assert not out.exists()

"""Limits that never act silently, and logs a researcher reads (issue #26, items 4 and 5):
multi-turn budgets stated before the run and counted per step (env/turn_limit_frac,
env/budget_cut_frac, env/obs_truncated_*), the evaluation's fit with the environment and the
rewards, advantage statistics per step (also over two gloo ranks), the run header in the log
and in metrics.jsonl's first record, and estimator results accepted only as (B, T_c)."""

from __future__ import annotations

import logging
import math
import re
from pathlib import Path

import pytest
import torch

from grpo.algo import compute_advantages, register_advantage
from grpo.algo.advantages import broadcast
from grpo.apps import cli
from grpo.config import load_config
from grpo.envs import Step
from grpo.errors import GrpoError
from grpo.eval import evaluate
from grpo.metrics import MetricLogger, read_metrics
from grpo.rollout.multiturn import env_metrics
from grpo.rollout.sampler import Rollout
from grpo.run.notices import (
    OBS_GLUE_TOKENS,
    eval_fit_notice,
    guaranteed_turns,
    same_data_notice,
    start_notices,
    turn_budget_notices,
)
from grpo.run.stats import advantage_stats

REPO = Path(__file__).resolve().parents[1]
TINY_CI = REPO / "configs" / "tiny_ci.yaml"


def config(*overrides: str):
    return load_config(TINY_CI, ["model.path=unused", *overrides])


# ----------------------------------------------------------------- estimator shapes


def test_estimator_result_only_as_B_by_T():
    """A (T_c,) vector returned by mistake, with T_c == B, is refused, not broadcast as (B,);
    (B,) is refused too (the two cannot be told apart), (B, T_c) goes through."""
    B = T = 4
    rewards = torch.zeros(B, T)
    rewards[:, -1] = torch.tensor([1.0, 0.0, 1.0, 1.0])
    mask = torch.ones(B, T, dtype=torch.bool)

    @register_advantage("test_per_token_vector", overwrite=True)
    def per_token(token_rewards):
        return token_rewards.mean(0)  # (T_c,): the batch's mean per column

    @register_advantage("test_per_row_vector", overwrite=True)
    def per_row(scores):
        return scores - scores.mean()  # (B,)

    @register_advantage("test_per_row_broadcast", overwrite=True)
    def per_row_ok(scores, mask):
        return broadcast(scores - scores.mean(), mask)  # (B, T_c)

    hint = r"; for one value per row return grpo\.algo\.broadcast\(values, mask\)$"
    for name in ("test_per_token_vector", "test_per_row_vector"):
        with pytest.raises(
            GrpoError,
            match=rf"'{name}' returned shape \(4,\), expected \(B, T_c\) "
            rf"= \(4, 4\){hint}",
        ):
            compute_advantages(name, rewards, mask, group_size=2)
    a = compute_advantages("test_per_row_broadcast", rewards, mask, group_size=2)
    torch.testing.assert_close(a[:, 0], torch.tensor([0.25, -0.75, 0.25, 0.25]))


# ----------------------------------------------------------------- advantage statistics


def test_advantage_stats_by_hand():
    adv = torch.tensor([[1.0, 0.0, 9.0], [-2.0, 0.0, float("nan")]])
    mask = torch.tensor([[True, True, False], [True, True, False]])
    s = advantage_stats(adv, mask)
    # counted: 1, 0, -2, 0 -> mean -0.25, E[x^2] = 5/4, var = 5/4 - 1/16 = 19/16
    assert s["adv/mean"] == -0.25 and s["adv/std"] == pytest.approx(math.sqrt(19 / 16))
    assert s["adv/min"] == -2.0 and s["adv/max"] == 1.0 and s["adv/zero_frac"] == 0.5
    none = advantage_stats(adv, torch.zeros_like(mask))
    assert all(math.isnan(v) for v in none.values()) and len(none) == 5


def test_advantage_stats_two_ranks_equal_one_process(rank_pool):
    from limits_ddp_worker import make_inputs

    [got, _] = rank_pool.run("limits_ddp_worker:rank_stats")
    adv, mask = make_inputs()
    want = advantage_stats(adv, mask)
    assert got.keys() == want.keys()
    for k in want:
        assert got[k] == pytest.approx(want[k], abs=1e-12), k
    assert want["adv/max"] == 9.0 and want["adv/min"] == -7.0  # held by rank 1


# ----------------------------------------------------------------- env metrics


def fake_rollout(turns: list[int], finished: list[bool], truncated: list[int]) -> Rollout:
    B = len(turns)
    z = torch.zeros(B, 1)
    return Rollout(
        ids=z.long(),
        prompt_lens=z[:, 0].long(),
        prompt_width=0,
        completion_ids=z.long(),
        completion_mask=z.bool(),
        completion_lens=z[:, 0].long(),
        finished=torch.tensor(finished),
        logprobs=z,
        group_size=B,
        turn_rewards=[[0.0] * n for n in turns],
        turn_texts=[[[1]] * n for n in turns],
        infos=[{"obs_truncated": t} if t else {} for t in truncated],
    )


def test_env_metrics_name_the_limit_that_cut():
    # ended by the env after 2 turns; cut by max_turns (3); cut by the budget after 2 and 1
    r = fake_rollout([2, 3, 2, 1], [True, False, False, False], [1, 2, 1, 0])
    m = env_metrics(r, max_turns=3)
    assert m["env/turns_mean"] == 2.0
    assert m["env/turn_limit_frac"] == 0.25 and m["env/budget_cut_frac"] == 0.5
    assert m["env/obs_truncated_mean"] == 1.0  # 4 cut observations / 4 trajectories
    assert m["env/obs_truncated_rate"] == 4 / 4  # of 1 + 2 + 1 + 0 observations
    assert env_metrics(fake_rollout([1, 1], [True, True], [0, 0]), 3)["env/obs_truncated_rate"] == 0


class LongObservations:
    """Never ends a trajectory; answers every turn with an observation far over the limit."""

    tools: list = []

    def start(self, row):
        return None

    def step(self, text, token_ids):
        return Step(observation="blah " * 40, reward=0.1, info={"tool_calls": 1})


def test_budget_notice_is_what_the_sampler_does(shared_tiny_model):
    """Under the default budget the template's glue and the truncation mark take more than the
    16 tokens per observation default_total_tokens allows: a 3rd turn does not fit, the notice
    says so (from the settings and the tokenizer), the cut trajectories count in
    env/budget_cut_frac, and the budget the notice asks for fits every turn. obs_truncated
    counts only the observations that entered a trajectory."""
    from grpo.loading import TrainedModel, load_rows, load_trained_model
    from grpo.rollout import Sampler
    from grpo.rollout.multiturn import sample_with_env

    model, tok, stops, _ = load_trained_model(
        TrainedModel(str(shared_tiny_model), ()), "float32", "cpu"
    )
    cfg = config(
        f"model.path={shared_tiny_model}",
        "rollout.env=calculator",
        "rollout.max_turns=3",
        "rollout.max_new_tokens=8",
        "rollout.max_obs_tokens=8",
        "data.eval_samples=0",
    )
    assert turn_budget_notices(cfg) == []  # the settings alone: 3 * 8 + 2 * (8 + 16) = 72 fits
    (line,) = turn_budget_notices(cfg, tokenizer=tok)
    assert line.startswith(
        "rollout.max_total_tokens (default: 72 tokens) guarantees a rollout "
        "2 of rollout.max_turns=3 turns: "
    ), line
    need = int(
        re.search(r"Set rollout.max_total_tokens=(\d+) to guarantee every turn$", line).group(1)
    )
    rows = load_rows(cfg.data, "train", 4, "rl", tok)

    def rollout(total):
        return sample_with_env(
            Sampler(model),
            tok,
            rows,
            LongObservations,
            env_name="long",
            group_size=4,
            max_new_tokens=8,
            max_turns=3,
            max_total_tokens=total,
            max_obs_tokens=8,
            stop_ids=stops,
            seed=0,
            pad_id=tok.pad_token_id,
            temperature=1.0,
        )

    cut = rollout(cfg.rollout.total_tokens)
    m = env_metrics(cut, 3)
    assert m["env/budget_cut_frac"] > 0 and m["env/turn_limit_frac"] + m["env/budget_cut_frac"] == 1
    for texts, info in zip(cut.turn_texts, cut.infos):
        assert info["obs_truncated"] == len(texts) - 1  # not the unused answer to the last turn
    assert m["env/obs_truncated_rate"] == 1.0
    fits = rollout(need)
    m = env_metrics(fits, 3)
    assert m["env/turns_mean"] == 3.0 and m["env/turn_limit_frac"] == 1.0
    assert m["env/budget_cut_frac"] == 0.0 and m["env/obs_truncated_mean"] == 2.0


def test_turn_budget_notice_from_the_settings():
    assert guaranteed_turns(8, 3, 8, 72, OBS_GLUE_TOKENS) == 3
    assert guaranteed_turns(8, 3, 8, 71, OBS_GLUE_TOKENS) == 2
    assert guaranteed_turns(8, 3, 8, 8, OBS_GLUE_TOKENS) == 1
    multi = (
        "rollout.env=calculator",
        "rollout.max_turns=3",
        "rollout.max_new_tokens=8",
        "rollout.max_obs_tokens=8",
        "eval.max_new_tokens=null",
    )
    assert turn_budget_notices(config(*multi)) == []
    assert turn_budget_notices(config("rollout.max_total_tokens=20")) == []  # single turn
    lines = turn_budget_notices(config(*multi, "rollout.max_total_tokens=50"))
    assert lines == [
        "rollout.max_total_tokens (set: 50 tokens) guarantees a rollout 2 of rollout.max_turns=3 "
        "turns: with turns at rollout.max_new_tokens=8 and observations cut at "
        "rollout.max_obs_tokens=8 (+ 16 tokens of template and truncation mark each) all 3 need "
        "72; trajectories the budget cuts are counted in env/budget_cut_frac. Set "
        "rollout.max_total_tokens=72 to guarantee every turn"
    ]
    # the evaluation's own per-turn limit: a second line, for eval/budget_cut_frac
    lines = turn_budget_notices(
        config(*multi, "rollout.max_total_tokens=72", "eval.max_new_tokens=16")
    )
    assert len(lines) == 1 and "guarantees an evaluation episode 2 of" in lines[0]
    assert "eval.max_new_tokens=16" in lines[0] and "eval/budget_cut_frac" in lines[0]
    # SFT samples nothing; its pipeline's evaluation does
    assert turn_budget_notices(config(*multi, "rollout.max_total_tokens=50"), "sft") == []
    assert (
        len(
            turn_budget_notices(config(*multi, "rollout.max_total_tokens=50"), "sft", pipeline=True)
        )
        == 1
    )


# ----------------------------------------------------------------- evaluation fit


def test_eval_fit_notice():
    custom = ("rollout.env=my_pkg.envs:Custom", "rewards=[{name: format}]")
    line = eval_fit_notice(config(*custom))
    assert line == (
        "eval.env: evaluation episodes run in 'my_pkg.envs:Custom' (rollout.env's, as eval.env "
        "is unset) and are scored by math accuracy of the final turn against each row's "
        "ground_truth (eval/accuracy), which no training reward measures (rewards: format); add "
        "an accuracy reward if the final turn answers the row, set eval.env to an environment "
        "that does, or set data.eval_samples=0 to skip evaluation"
    )
    assert "(eval.env)" in eval_fit_notice(config(*custom[1:], "eval.env=my_pkg.envs:Custom"))
    # fits: the environment ends in a math answer, or a reward scores that answer
    assert eval_fit_notice(config(*custom, "eval.env=calculator")) is None
    assert eval_fit_notice(config(*custom, "eval.env=single_turn")) is None
    assert eval_fit_notice(config(custom[0])) is None  # tiny_ci's accuracy + format
    assert eval_fit_notice(config(custom[0], "rewards=[{name: step}]")) is None
    combined = "rewards=[{name: combined, kwargs: {weights: {accuracy: 1.0, format: 0.1}}}]"
    assert eval_fit_notice(config(custom[0], combined)) is None
    # stated only where an evaluation runs
    assert start_notices(config(*custom, "data.eval_samples=0")) == []
    assert start_notices(config(*custom, "data.eval_samples=0"), pipeline=True) == [line]
    assert start_notices(config()) == []  # tiny_ci says nothing


def test_evaluating_on_the_training_problems_is_stated(tmp_path):
    """One file read for both splits, or one split named twice: a line before the run."""
    data = tmp_path / "all.jsonl"
    data.write_text('{"question": "q", "answer": "#### 1"}\n')
    src = ["data.dataset=gsm8k", f"data.source={data}"]
    line = same_data_notice(config(*src))
    assert line == (
        f"data.source: one file ({data}) serves both data.split='train' and "
        "data.eval_split='test' (a file is read whatever the split name): the evaluation "
        "scores training problems; give a directory with a file per split, or slice the file "
        "(e.g. data.split='train[:90%]', data.eval_split='train[90%:]')"
    )
    assert line in start_notices(config(*src))
    assert same_data_notice(config(f"data.dataset={data}")).startswith("data.dataset: one file")
    sliced = ["data.split=train[:90%]", "data.eval_split=train[90%:]"]
    assert same_data_notice(config(*src, *sliced)) is None
    assert same_data_notice(config("data.eval_split=train")) == (
        "data.eval_split: 'train' is data.split: the evaluation scores training problems; "
        "name a held-out split (e.g. test)"
    )
    assert same_data_notice(config(*sliced)) is None  # minimath: two slices, no overlap
    assert start_notices(config(*src, "data.eval_samples=0")) == []  # nothing evaluates


def test_evaluate_refuses_rows_without_ground_truth():
    rows = [{"prompt_ids": [1], "ground_truth": "3"}, {"prompt_ids": [1]}]
    with pytest.raises(GrpoError, match=r"^evaluation: row 1 has no 'ground_truth' to score"):
        evaluate(None, None, rows, stop_ids=[0])


# ----------------------------------------------------------------- run header


def test_header_in_the_first_record_only(tmp_path, capsys):
    header = {"run/advantage": "grpo", "run/policy_loss": "clip"}
    logger = MetricLogger(tmp_path, header=header)
    logger.log(1, {"train/loss": 0.5})
    logger.log(2, {"train/loss": 0.25})
    assert read_metrics(tmp_path / "metrics.jsonl") == [
        {"step": 1, "run/advantage": "grpo", "run/policy_loss": "clip", "train/loss": 0.5},
        {"step": 2, "train/loss": 0.25},
    ]
    assert "grpo" not in capsys.readouterr().out  # the stdout line shows numbers only
    from grpo.apps.plot import plot_run  # curves read numbers and pass over the header

    assert plot_run(tmp_path).is_file()


LONG_ENV = """
from grpo.envs import Step


class Long:
    tools = []

    def start(self, row):
        return None

    def step(self, text, token_ids):
        return Step(observation="blah " * 40, reward=0.1, info={"tool_calls": 1})
"""


def test_train_states_limits_and_logs_the_header(
    shared_tiny_model, tmp_path, monkeypatch, capsys, caplog
):
    """`grpo train` with a custom environment, a reward that is not accuracy and the default
    budget: both notices once before the run, the run header in the log and in the first
    record, advantage statistics and the limit metrics per step."""
    (tmp_path / "long_env.py").write_text(LONG_ENV)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    caplog.set_level(logging.INFO)  # what `python -m grpo` logs to stderr
    code = cli.main(
        [
            "train",
            "--config",
            str(TINY_CI),
            f"model.path={shared_tiny_model}",
            "train.output_dir=run",
            "train.max_steps=1",
            "train.progress=false",
            "data.eval_samples=2",
            "rewards=[{name: format}]",
            "rollout.env=long_env:Long",
            "rollout.max_turns=3",
            "rollout.max_new_tokens=8",
            "rollout.max_obs_tokens=8",
            "eval.max_new_tokens=8",
        ]
    )
    assert code == 0, capsys.readouterr().err[-3000:]
    lines = [x for r in caplog.records for x in f"{r.levelname} {r.getMessage()}".splitlines()]
    budget = [x for x in lines if "guarantees a rollout 2 of" in x]
    fit = [x for x in lines if "eval.env: evaluation episodes run in" in x]
    assert len(budget) == 1 and len(fit) == 1 and budget[0].startswith("WARNING "), lines
    assert "'long_env:Long' (rollout.env's, as eval.env is unset)" in fit[0]
    assert any(
        "run: advantage grpo | policy_loss clip | kl_estimator k3 | aggregation" in x for x in lines
    ), lines
    (row,) = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert row["step"] == 1
    assert row["run/advantage"] == "grpo" and row["run/policy_loss"] == "clip"
    assert row["run/kl_estimator"] == "k3" and row["run/env"] == "long_env:Long"
    assert row["run/eval_env"] == "long_env:Long" and row["run/precision"].startswith("weights")
    assert row["adv/min"] <= row["adv/mean"] <= row["adv/max"] and row["adv/std"] >= 0
    assert 0 <= row["adv/zero_frac"] <= 1
    assert row["env/turn_limit_frac"] + row["env/budget_cut_frac"] == 1.0  # never ended
    assert row["env/budget_cut_frac"] > 0
    assert row["env/obs_truncated_mean"] == pytest.approx(row["env/turns_mean"] - 1)
    assert row["env/obs_truncated_rate"] == 1.0
    assert "eval/budget_cut_frac" in row and "eval/accuracy" in row

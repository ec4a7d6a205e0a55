"""Learning health (grpo/run/health.py): each rule on hand-made metric sequences (fires on the
stall_steps-th step of a symptom, not before, clears when it stops, stays quiet on a healthy
run), `train/weight_change`, and `grpo train` runs that stall: the warnings in the log, the
`health` section of the summary, and train.stop_on_stall stopping with one line and exit 2."""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from grpo.apps import cli
from grpo.config import load_config
from grpo.run.health import RULES, LearningHealth, StallError, WeightChange, describe
from grpo.settings import ConfigError

REPO = Path(__file__).resolve().parents[1]
TINY_CI = str(REPO / "configs" / "tiny_ci.yaml")
FAST = [
    "train.progress=false",
    "data.eval_samples=0",
    "rollout.compile=off",
    "data.max_samples=16",
    "loss.num_iterations=1",
    "train.save_every=0",
]
# Every completion cut: greedy, the random model's argmax never ends one (at temperature 1 it
# ends one in 8 now and then, and 7 of 8 is under the 90% the rule asks for)
TRUNCATING = ["rollout.max_new_tokens=4", "rollout.temperature=0"]


def cfg_with(*overrides):
    return load_config(TINY_CI, ["model.path=m", *overrides])


def healthy(step: int) -> dict:
    """A step of a run that learns: some truncation, signal in most groups, a moving reward,
    a gradient and an update."""
    return {
        "rollout/truncated_frac": 0.2,
        "rollout/frac_zero_std_groups": 0.25,
        "rollout/reward_mean": 0.1 + 0.01 * step,
        "train/grad_norm": 0.5,
        "train/weight_change": 1e-3,
        "train/lr": 1e-3,
        "advantage/reverse_kl": 1.0 - 0.01 * step,  # a distillation's objective (distill)
    }


# each rule's symptom at step s, applied to a healthy step (the others stay healthy): for
# truncation, 95% cut, 90% of groups equal, and a reward sliding to new lows
SYMPTOMS = {
    "truncated": lambda s: {
        "rollout/truncated_frac": 0.95,
        "rollout/frac_zero_std_groups": 0.9,
        "rollout/reward_mean": -0.01 * s,
    },
    "zero_variance": lambda s: {"rollout/frac_zero_std_groups": 1.0},
    "zero_gradient": lambda s: {"train/grad_norm": 0.0},
    "frozen_weights": lambda s: {"train/weight_change": 0.0},
    "flat_reward": lambda s: {"rollout/reward_mean": 0.3},
    "flat_objective": lambda s: {"advantage/reverse_kl": 0.5},
}
# a rule that judges another kind of run: its config
RUN_OF = {"flat_objective": ["loss.advantage=distill", "rewards=[]"]}


def feed(health: LearningHealth, steps: list[dict], start: int = 1) -> list:
    events = []
    for i, m in enumerate(steps):
        events += [(e.rule, e.step, e.fired) for e in health.observe(start + i, m)]
    return events


@pytest.mark.parametrize("rule", [r.name for r in RULES])
def test_each_rule_fires_on_the_nth_step_of_its_symptom_and_clears(rule):
    """stall_steps = 3: healthy steps 1-2, the symptom on steps 3-6 (fires at step 5, the third;
    nothing at steps 3-4), healthy again at step 7 (cleared); the summary has its steps."""
    h = LearningHealth(cfg_with("train.stall_steps=3", *RUN_OF.get(rule, [])))
    steps = [healthy(s) for s in (1, 2)]
    steps += [healthy(s) | SYMPTOMS[rule](s) for s in (3, 4, 5, 6)]
    steps += [healthy(7)]
    events = feed(h, steps)
    assert events == [(rule, 5, True), (rule, 7, False)], events
    assert h.summary() == {
        rule: {
            "first_step": 3,
            "fired_step": 5,
            "last_step": 6,
            "times": 1,
            "message": h.stalls[rule].message,
        }
    }
    assert describe(h.summary()).startswith(f"learning stalled: {rule} (steps 3-6); ")


@pytest.mark.parametrize(
    "step, holds",
    [
        ({"rollout/truncated_frac": 0.9, "rollout/frac_zero_std_groups": 0.9}, True),
        ({"rollout/truncated_frac": 0.89, "rollout/frac_zero_std_groups": 1.0}, False),
        # truncated, but the groups still have spread (configs/quickstart.yaml: its toy reward
        # needs no end, ~95% of completions hit the budget while it learns)
        ({"rollout/truncated_frac": 1.0, "rollout/frac_zero_std_groups": 0.5}, False),
        ({"rollout/truncated_frac": float("nan"), "rollout/frac_zero_std_groups": 1.0}, False),
    ],
)
def test_truncated_rule(step, holds):
    h = LearningHealth(cfg_with("train.stall_steps=2"))
    fired = feed(h, [{"rollout/reward_mean": 0.0, **step}] * 2)
    assert (("truncated", 2, True) in fired) is holds


def test_truncated_at_a_saturated_reward_is_not_blamed_on_the_budget():
    """Every completion truncated and every group equal, but at the run's highest reward (the
    quickstart's steps 25-30: the task is learned): no-variance fires, truncation does not.
    With loss.mask_truncated_completions truncation alone is the stall."""
    rising = [
        {
            "rollout/reward_mean": r,
            "rollout/truncated_frac": 1.0,
            "rollout/frac_zero_std_groups": 0.0,
        }
        for r in (0.0, 0.5)
    ]
    saturated = [
        {
            "rollout/reward_mean": 1.0,
            "rollout/truncated_frac": 1.0,
            "rollout/frac_zero_std_groups": 1.0,
        }
    ] * 2
    fired = feed(LearningHealth(cfg_with("train.stall_steps=2")), rising + saturated)
    assert {r for r, _, _ in fired} == {"zero_variance", "flat_reward"}, fired
    masked = LearningHealth(cfg_with("train.stall_steps=2", "loss.mask_truncated_completions=true"))
    assert ("truncated", 2, True) in feed(masked, rising)


@pytest.mark.parametrize(
    "key, values, holds",
    [
        ("train/grad_norm", [0.0, 1e-13], True),
        ("train/grad_norm", [0.0, 1e-9], False),
        ("train/grad_norm", [0.0, float("nan")], False),  # skipped updates: not this rule's
        ("train/weight_change", [0.0, 1e-12], True),
        ("train/weight_change", [0.0, 1e-10], False),
        ("rollout/reward_mean", [0.25, 0.25 + 1e-7], True),
        ("rollout/reward_mean", [0.25, 0.25 + 2e-6], False),
        ("rollout/frac_zero_std_groups", [1.0, 1.0], True),
        ("rollout/frac_zero_std_groups", [1.0, 0.875], False),
    ],
)
def test_thresholds(key, values, holds):
    rule = {
        "train/grad_norm": "zero_gradient",
        "train/weight_change": "frozen_weights",
        "rollout/reward_mean": "flat_reward",
        "rollout/frac_zero_std_groups": "zero_variance",
    }[key]
    h = LearningHealth(cfg_with("train.stall_steps=2"))
    fired = feed(h, [healthy(1) | {key: v} for v in values])
    assert (rule in h.stalls) is holds, fired


def test_flat_reward_needs_two_steps():
    """stall_steps 1 fires the per-step rules at once; the flat reward compares two steps."""
    h = LearningHealth(cfg_with("train.stall_steps=1"))
    assert feed(h, [healthy(1) | {"train/grad_norm": 0.0}]) == [("zero_gradient", 1, True)]
    assert feed(h, [healthy(1) | {"train/grad_norm": 0.0}], start=2) == [("flat_reward", 2, True)]


def test_a_healthy_run_never_fires():
    """A quickstart-like run (every completion at the budget, rising reward) and tiny noise."""
    h = LearningHealth(cfg_with("train.stall_steps=2"))
    steps = [
        healthy(s) | {"rollout/truncated_frac": 1.0, "rollout/frac_zero_std_groups": 0.0}
        for s in range(1, 40)
    ]
    assert feed(h, steps) == [] and h.summary() == {}


def test_messages_name_the_numbers_and_the_setting():
    h = LearningHealth(
        cfg_with("train.stall_steps=2", "rollout.max_new_tokens=16", "optim.lr=1e-30")
    )
    truncated = {
        "rollout/truncated_frac": 1.0,
        "rollout/frac_zero_std_groups": 1.0,
        "rollout/reward_mean": 0.0,
        "train/grad_norm": 0.5,
        "train/weight_change": 0.0,
        "train/lr": 1e-30,
    }
    feed(h, [truncated, truncated])
    msg = {name: s.message for name, s in h.stalls.items()}
    assert msg["truncated"] == (
        "completions truncated: 100% of completions hit rollout.max_new_tokens=16 for 2 steps "
        "(steps 1-2; reward mean 0.000, 100% of groups with equal rewards: no learning signal); "
        "raise rollout.max_new_tokens or ask for shorter answers (data.system_prompt)"
    )
    assert "optim.lr=1e-30" in msg["frozen_weights"] and "raise optim.lr" in msg["frozen_weights"]
    assert "rollout.group_size (4)" in msg["zero_variance"]
    multi = LearningHealth(cfg_with("train.stall_steps=2", "rollout.env=calculator"))
    feed(multi, [truncated, truncated])
    assert "rollout.max_turns=4" in multi.stalls["truncated"].message


def test_stop_on_stall_raises_once_naming_the_first_rule(caplog):
    """Every rank decides from the same reduced metrics, so all stop at the same step; rank 0
    alone logs the warnings, and the error carries the rank (the CLI prints rank 0's)."""
    cfg = cfg_with("train.stall_steps=2", "train.stop_on_stall=true")

    def stalled(s):
        return healthy(s) | SYMPTOMS["zero_variance"](s) | SYMPTOMS["zero_gradient"](s)

    errors = []
    with caplog.at_level(logging.WARNING, logger="grpo.run.health"):
        for rank in (0, 1):
            h = LearningHealth(cfg, rank)
            assert h.observe(1, stalled(1)) == []
            with pytest.raises(StallError) as e:
                h.observe(2, stalled(2))
            errors.append(e.value)
    assert [e.rank for e in errors] == [0, 1] and str(errors[0]) == str(errors[1])
    assert str(errors[0]).startswith("learning stalled at step 2: no reward variance: ")
    assert "(also fired: zero_gradient); stopped by train.stop_on_stall" in str(errors[0])
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 2 and all(w.startswith("learning stalled at step 2: ") for w in warned)


def test_settings_are_checked():
    assert LearningHealth(cfg_with("train.stall_steps=0")).observe(1, {}) == []
    with pytest.raises(ConfigError, match=r"^train.stall_steps: must be >= 0"):
        cfg_with("train.stall_steps=-1")
    with pytest.raises(ConfigError, match=r"^train.stop_on_stall: needs train.stall_steps > 0"):
        cfg_with("train.stall_steps=0", "train.stop_on_stall=true")
    assert cfg_with().train.stall_steps == 10 and not cfg_with().train.stop_on_stall


def test_weight_change_is_the_relative_norm_of_the_step():
    a = torch.nn.Parameter(torch.full((3, 4), 2.0))  # ||w|| = sqrt(12 * 4 + 16 * 9) = sqrt(192)
    b = torch.nn.Parameter(torch.full((16,), 3.0))
    wc = WeightChange([a, b])
    assert wc.stride == 1 and wc.measure() == 0.0
    with torch.no_grad():
        a[0, 0] += 3.0
        b[5] -= 4.0
    # ||(3, -4)|| = 5; float32 norms per tensor
    assert wc.measure() == pytest.approx(5 / math.sqrt(192), rel=1e-6)
    assert wc.measure() == 0.0  # measured from the new weights
    sampled = WeightChange([a, b], budget=8)  # 28 elements: every 4th is kept
    assert sampled.stride == 4 and sum(t.numel() for t in sampled.prev) == 3 + 4
    with torch.no_grad():
        a[0, 1] += 1.0  # not sampled
    assert sampled.measure() == 0.0
    with torch.no_grad():
        b[4] += 1.0  # sampled
    assert sampled.measure() > 0


# ----------------------------------------------------------------------- grpo train, end to end


def test_truncated_run_warns_in_the_log_and_the_summary(
    shared_tiny_model, tmp_path, monkeypatch, capsys, caplog
):
    """tiny_ci, greedy, 4 new tokens: the random model's completions are all cut and score 0;
    its LoRA B starts at 0 and the KL's gradient at policy = reference is 0, so nothing moves.
    With stall_steps 2 every rule fires at step 2: one WARNING line each (in the order of
    cause), and the summary line after `done:`."""
    monkeypatch.chdir(tmp_path)
    with caplog.at_level(logging.WARNING, logger="grpo.run.health"):
        code = cli.main(
            [
                "train",
                "--config",
                TINY_CI,
                *FAST,
                *TRUNCATING,
                f"model.path={shared_tiny_model}",
                "train.output_dir=run",
                "train.max_steps=3",
                "train.stall_steps=2",
            ]
        )
    out, err = capsys.readouterr()
    assert code == 0, err[-3000:]
    warned = [
        r.getMessage()
        for r in caplog.records
        if r.name == "grpo.run.health" and r.levelname == "WARNING"
    ]
    assert all(len(w.splitlines()) == 1 for w in warned), warned
    assert [w.split(": ", 2)[1] for w in warned] == [
        "completions truncated",
        "no reward variance",
        "zero gradient",
        "weights unchanged",
        "reward flat",
    ], warned
    assert warned[0] == (
        "learning stalled at step 2: completions truncated: 100% of completions hit "
        "rollout.max_new_tokens=4 for 2 steps (steps 1-2; reward mean 0.000, 100% of groups "
        "with equal rewards: no learning signal); raise rollout.max_new_tokens or ask for "
        "shorter answers (data.system_prompt)"
    )
    assert warned[3].startswith(
        "learning stalled at step 2: weights unchanged: the trainable "
        "weights moved by at most 0 (relative"
    )
    done = out.splitlines()[-2:]
    assert done[0].startswith("done: 3 steps; weights in ")
    assert done[1].startswith(
        "learning stalled: truncated (steps 1-3), zero_variance (steps "
        "1-3), zero_gradient (steps 1-3), frozen_weights (steps 1-3), "
        "flat_reward (steps 1-3); "
    )
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [row["train/weight_change"] for row in rows] == [0.0, 0.0, 0.0]


def test_stop_on_stall_exits_2_with_one_line(shared_tiny_model, tmp_path, monkeypatch, capsys):
    """train.stop_on_stall: the run stops at the step a rule fires (2), exit 2, one line naming
    the rule, the setting, the checkpoint it saved of step 2 first and the resume command; the
    checkpoint of step 1 stays, no final/."""
    monkeypatch.chdir(tmp_path)
    code = cli.main(
        [
            "train",
            "--config",
            TINY_CI,
            *FAST,
            f"model.path={shared_tiny_model}",
            "train.output_dir=run",
            "train.max_steps=4",
            "train.save_every=1",
            *TRUNCATING,
            "train.stall_steps=2",
            "train.stop_on_stall=true",
        ]
    )
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith(
        "grpo train: error: learning stalled at step 2: completions truncated: "
        "100% of completions hit rollout.max_new_tokens=4 "
    )
    assert err.endswith(
        "(also fired: zero_variance, zero_gradient, frozen_weights, flat_reward); "
        "stopped by train.stop_on_stall; checkpoint saved in "
        "run/checkpoints/step_000002; resume with: grpo train --config "
        "run/config.yaml --resume (append the settings to change, e.g. "
        "train.stop_on_stall=false)"
    )
    run = tmp_path / "run"
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_000002"
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == [
        "step_000001",
        "step_000002",
    ]
    assert not (run / "final").exists()
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [
        1,
        2,
    ]


def test_too_small_lr_is_caught_as_frozen_weights(shared_tiny_model, tmp_path, caplog):
    """Full fine-tuning at optim.lr=1e-30 (lr must be > 0) with a reward the random model has
    spread on: rewards vary, the gradient is not 0, but no float32 weight moves. Only the
    frozen-weights rule fires, and says to raise optim.lr."""
    from grpo.train.grpo import train_grpo

    cfg = load_config(
        TINY_CI,
        [
            *FAST,
            f"model.path={shared_tiny_model}",
            f"train.output_dir={tmp_path / 'run'}",
            "train.max_steps=3",
            "lora.enabled=false",
            "loss.beta=0",
            "optim.lr=1e-30",
            "rewards=[{name: 'grpo.tiny:digit_share'}]",
            "train.stall_steps=2",
        ],
    )
    with caplog.at_level(logging.WARNING, logger="grpo.run.health"):
        summary = train_grpo(cfg)
    assert list(summary["health"]) == ["frozen_weights"], summary["health"]
    stall = summary["health"]["frozen_weights"]
    assert (stall["first_step"], stall["fired_step"], stall["last_step"]) == (1, 2, 3)
    assert summary["train/grad_norm"] > 0 and summary["train/weight_change"] == 0.0
    (warning,) = [r.getMessage() for r in caplog.records]
    assert warning.startswith("learning stalled at step 2: weights unchanged: ")
    assert "optim.lr=1e-30" in warning and "raise optim.lr" in warning


@pytest.mark.process
def test_stop_on_stall_stops_every_torchrun_rank_at_the_same_step(shared_tiny_model, tmp_path):
    """Two DDP ranks read the same reduced metrics: both stop at step 2 with exit 2 (torchrun
    reports each), after the checkpoint of step 2 (collective); rank 0 alone logs the warnings
    and prints the one line, naming the torchrun resume command."""
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            "-m",
            "grpo",
            "train",
            "--config",
            TINY_CI,
            *FAST,
            *TRUNCATING,
            f"model.path={shared_tiny_model}",
            "train.output_dir=run",
            "train.max_steps=4",
            "train.save_every=1",
            "train.stall_steps=2",
            "train.stop_on_stall=true",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert r.returncode != 0
    ours = [x for x in r.stderr.splitlines() if x.startswith("grpo train:")]
    assert len(ours) == 1 and ours[0].startswith(
        "grpo train: error: learning stalled at step 2: completions truncated: "
    ), r.stderr[-3000:]
    assert r.stderr.count("exitcode  : 2") == 2, r.stderr[-3000:]  # both ranks, the same exit
    assert sum(" WARNING grpo.run.health: " in x for x in r.stderr.splitlines()) == 5
    assert (
        "resume with: torchrun --standalone --nproc_per_node=2 -m grpo train --config "
        "run/config.yaml --resume"
    ) in ours[0]
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text().strip() == "step_000002"


def test_a_distillation_is_judged_by_its_objective_never_solved_by_constant_rewards():
    """Issue 65: a run of the `distill` estimator with `rewards: []` (every reward 0, every group
    equal, the reward 'at its maximum' 0) while the reverse KL falls: no rule fires and
    stop_on_stall does not stop it; the same metrics under a reward estimator are 'solved'.
    When the reverse KL stops moving, flat_objective fires and stop_on_stall stops it."""
    constant = {
        "rollout/truncated_frac": 1.0,
        "rollout/frac_zero_std_groups": 1.0,
        "rollout/reward_mean": 0.0,
        "train/grad_norm": 0.5,
        "train/weight_change": 1e-3,
        "train/lr": 1e-3,
    }
    falling = [constant | {"advantage/reverse_kl": 2.0 / s} for s in range(1, 9)]
    distill = cfg_with(
        "train.stall_steps=3", "train.stop_on_stall=true", "loss.advantage=distill", "rewards=[]"
    )
    h = LearningHealth(distill, reward_hi=0.0)
    assert h.objective == "advantage/reverse_kl" and not h.judge_rewards
    assert feed(h, falling) == [] and not h.finished and h.converged is None
    # by the rewards the same steps look solved (and with stop_on_stall the run would end)
    grpo = LearningHealth(cfg_with("train.stall_steps=3", "train.stop_on_stall=true"), 0, 0.0)
    assert ("solved", 3, True) in feed(grpo, falling) and grpo.finished
    # the objective stops moving: a stall, stopped
    with pytest.raises(StallError, match="objective flat: advantage/reverse_kl"):
        feed(h, [constant | {"advantage/reverse_kl": 0.25}] * 3, start=9)

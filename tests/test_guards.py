"""Guards that end a run keep the work (docs/safety.md, "Learning health"): reward bounds
(grpo/rewards/bounds.py) and the `solved` rule, a solved task ending with final/ weights and
exit 0 ("converged at step N"), a stall or a non-finite stop saving a checkpoint first (or,
with non-finite weights, naming the good one that stays) and naming the resume command, and
the end-of-run lines printed by rank 0 only."""

from __future__ import annotations

import functools
import json
import math
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from grpo.apps import cli
from grpo.config import load_config
from grpo.errors import GrpoError
from grpo.rewards import call_reward, get_reward
from grpo.rewards.bounds import bounded, reward_bounds, total_bounds, with_bounds
from grpo.run.health import LearningHealth, StallError
from grpo.run.state import latest_checkpoint
from tests.test_reliability import nan_at_update

REPO = Path(__file__).resolve().parents[1]
TINY_CI = str(REPO / "configs" / "tiny_ci.yaml")
FAST = [
    "train.progress=false",
    "data.eval_samples=0",
    "rollout.compile=off",
    "data.max_samples=16",
    "loss.num_iterations=1",
    "train.save_every=0",
    "rollout.max_new_tokens=4",
]
# rewards the random model gets no spread from: every completion scores the same
GUARD_REWARDS = '''
from grpo.rewards.bounds import bounded


@bounded(0.0, 1.0)
def full(completions, **columns):
    """At its declared maximum for every completion: a solved task."""
    return [1.0] * len(completions)


def flat(completions, **columns):
    """The same value everywhere, bounds unknown: a stall, as far as anyone can tell."""
    return [0.5] * len(completions)
'''


@pytest.fixture
def guard_rewards(tmp_path, monkeypatch):
    """`guard_rewards:full` and `guard_rewards:flat`, importable here and in torchrun workers
    (PYTHONPATH); the test runs in tmp_path, so `run` is its run directory."""
    (tmp_path / "guard_rewards.py").write_text(GUARD_REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    sys.modules.pop("guard_rewards", None)


def train_args(model: str, *overrides: str) -> list[str]:
    return [
        "train",
        "--config",
        TINY_CI,
        *FAST,
        f"model.path={model}",
        "train.output_dir=run",
        *overrides,
    ]


def one_line(capsys) -> tuple[str, str]:
    out = capsys.readouterr()
    err = out.err.strip()
    assert len(err.splitlines()) <= 1 and "Traceback" not in err, err
    return out.out, err


def final_lines(out: str) -> list[str]:
    """stdout without the per-step metric lines: what the run printed at its end."""
    return [x for x in out.splitlines() if not x.startswith("step ")]


def steps_logged(run: Path) -> list[int]:
    return [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]


# ----------------------------------------------------------------------- bounds


def test_builtin_rewards_declare_their_bounds():
    """From their parameters: accuracy and format [0, 1]; length_penalty [min(0, floor), 1];
    step r_acc + beta * min(steps, cap): [0, 1 + beta * cap], [beta * cap, 1] for beta < 0."""
    assert reward_bounds(get_reward("accuracy")) == (0.0, 1.0)
    assert reward_bounds(get_reward("format")) == (0.0, 1.0)
    assert reward_bounds(get_reward("length_penalty")) == (0.0, 1.0)
    assert reward_bounds(get_reward({"name": "length_penalty", "floor": -0.5})) == (-0.5, 1.0)
    assert reward_bounds(get_reward({"name": "length_penalty", "floor": None})) == (-math.inf, 1)
    assert reward_bounds(get_reward("step")) == (0.0, math.inf)  # cap None: no upper bound
    assert reward_bounds(get_reward({"name": "step", "cap": 3})) == (0.0, 1.0 + 0.1 * 3)
    assert reward_bounds(get_reward({"name": "step", "cap": 3, "beta": -0.1})) == (-0.1 * 3, 1.0)
    assert reward_bounds(get_reward({"name": "step", "beta": 0.0})) == (0.0, 1.0)


def test_declared_bounds_are_read_through_wrappers_and_checked():
    @bounded(-1, 2)
    def mine(completions, scale=1.0, **columns):
        return [0.0] * len(completions)

    assert reward_bounds(mine) == (-1.0, 2.0)
    assert reward_bounds(functools.partial(mine, scale=2.0)) == (-1.0, 2.0)
    assert reward_bounds(functools.wraps(mine)(lambda c, **k: mine(c, **k))) == (-1.0, 2.0)
    assert reward_bounds(get_reward({"name": mine, "scale": 3.0})) == (-1.0, 2.0)  # partial
    assert reward_bounds(lambda c, **k: [0.0] * len(c)) is None  # unknown
    with pytest.raises(GrpoError, match=r"bounds must be two numbers lo <= hi"):
        bounded(1.0, 0.0)
    with pytest.raises(GrpoError, match=r"bounds must be two numbers lo <= hi"):
        with_bounds(mine, float("nan"), 1.0)


def test_total_bounds_are_the_weighted_sum_swapped_for_negative_weights():
    acc, fmt = get_reward("accuracy"), get_reward("format")
    assert total_bounds([(acc, 1.0), (fmt, 0.1)]) == (0.0, 1.1)  # configs/tiny_ci.yaml
    # -0.5 * [0, 1] = [-0.5, 0]
    assert total_bounds([(acc, 1.0), (fmt, -0.5)]) == (-0.5, 1.0)
    assert total_bounds([(acc, 2.0), (get_reward("step"), 0.0)]) == (0.0, 2.0)  # 0 * inf: 0
    assert total_bounds([(acc, 1.0), (lambda c, **k: [0.0] * len(c), 1.0)]) is None


def test_a_value_outside_the_declared_bounds_is_an_error_naming_the_function_and_row():
    @bounded(0.0, 1.0)
    def overshoots(completions, **columns):
        return [1.0, 1.0 + 1e-12, 1.5]  # rounding past a bound is not a breach

    with pytest.raises(GrpoError) as e:
        call_reward("overshoots", overshoots, ["a", "b", "c"], {})
    assert str(e.value) == (
        "reward function 'overshoots' returned 1.5 at row 2 (completion 'c'), outside the "
        "bounds it declares [0, 1] (grpo.rewards.bounds)"
    )


# ----------------------------------------------------------------------- the solved rule


def solved_step(hi: float) -> dict:
    """Every group equal at `hi`: no gradient, no weight change, a flat reward, every
    completion truncated (a reward that needs no ending, like the quickstart's)."""
    return {
        "rollout/truncated_frac": 1.0,
        "rollout/frac_zero_std_groups": 1.0,
        "rollout/reward_mean": hi,
        "train/grad_norm": 0.0,
        "train/weight_change": 0.0,
        "train/lr": 1e-3,
    }


def cfg_with(*overrides):
    return load_config(TINY_CI, ["model.path=m", "train.stall_steps=2", *overrides])


def test_every_group_at_the_highest_reward_is_solved_not_stalled(caplog):
    """Known bounds, every group at hi for stall_steps steps: `solved` fires (an INFO line)
    instead of every stall rule (their symptoms are a solved task's); with train.stop_on_stall
    it ends the run (`finished`), no StallError. Below hi, or with unknown bounds, it is a
    stall as before, every rule firing."""
    h = LearningHealth(cfg_with(), reward_hi=1.1)
    with caplog.at_level("INFO", logger="grpo.run.health"):
        events = [(e.rule, e.step, e.fired) for s in (1, 2) for e in h.observe(s, solved_step(1.1))]
    assert events == [("solved", 2, True)] and h.summary() == {} and not h.finished
    assert h.converged_summary() == {
        "first_step": 1,
        "fired_step": 2,
        "last_step": 2,
        "times": 1,
        "stopped": False,
        "message": "every completion in every group got the rewards' maximum (1.1) for 2 steps "
        "(steps 1-2): the task is learned; harder prompts (data) would give the policy "
        "more to learn",
    }
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("INFO", f"learning health: solved at step 2: {h.converged.message}")
    ]

    stop = LearningHealth(cfg_with("train.stop_on_stall=true"), reward_hi=1.1)
    stop.observe(1, solved_step(1.1))
    stop.observe(2, solved_step(1.1))  # no StallError
    assert stop.finished and stop.converged_summary()["stopped"]

    for hi, mean in ((None, 1.1), (1.1, 1.0)):  # unknown bounds; equal rewards below the top
        stalled = LearningHealth(cfg_with("train.stop_on_stall=true"), reward_hi=hi)
        stalled.observe(1, solved_step(mean))
        with pytest.raises(
            StallError,
            match=r"^learning stalled at step 2: completions truncat"
            r".*\(also fired: zero_variance, zero_gradient, frozen_weights, "
            r"flat_reward\); stopped by train.stop_on_stall$",
        ):
            stalled.observe(2, solved_step(mean))
        assert not stalled.finished and stalled.converged is None


# ----------------------------------------------------------------------- grpo train, end to end


def test_a_solved_task_ends_with_final_weights_and_exit_0(shared_tiny_model, guard_rewards, capsys):
    """train.stop_on_stall with a reward at its declared maximum for every completion: the run
    ends at the step `solved` fires (2 of 5) as at its last step: checkpoint, final/, exit 0,
    one stdout line "converged at step 2: ..."."""
    code = cli.main(
        train_args(
            shared_tiny_model,
            "rewards=[{name: 'guard_rewards:full'}]",
            "train.max_steps=5",
            "train.stall_steps=2",
            "train.stop_on_stall=true",
        )
    )
    out, err = one_line(capsys)
    assert code == 0 and err == "", err
    assert final_lines(out) == [
        "converged at step 2: every completion in every group got the rewards' maximum (1) for 2 "
        "steps (steps 1-2): the task is learned; harder prompts (data) would give the policy "
        "more to learn; stopped by train.stop_on_stall; weights in run/final"
    ]
    run = guard_rewards / "run"
    assert (run / "final").is_dir() and latest_checkpoint(run).name == "step_000002"
    assert steps_logged(run) == [1, 2]


def test_a_stall_with_unknown_bounds_saves_first_and_resumes(
    shared_tiny_model, guard_rewards, capsys, caplog
):
    """The same run with a reward that declares no bounds: a stall as before (exit 2, one
    line), but the step's checkpoint is saved first and the line names the resume command,
    which (with the setting changed) continues from that step to the end."""
    code = cli.main(
        train_args(
            shared_tiny_model,
            "rewards=[{name: 'guard_rewards:flat'}]",
            "train.max_steps=4",
            "train.stall_steps=2",
            "train.stop_on_stall=true",
        )
    )
    _, err = one_line(capsys)
    # the flat reward stalls the run (which rule the line leads with depends on the draws:
    # truncation fires too when no completion of the tiny model stops within 4 tokens)
    assert code == 2 and err.startswith("grpo train: error: learning stalled at step 2: "), err
    assert "no reward variance: " in err or "zero_variance" in err, err
    tail = (
        "stopped by train.stop_on_stall; checkpoint saved in run/checkpoints/step_000002; "
        "resume with: grpo train --config run/config.yaml --resume (append the settings to "
        "change, e.g. train.stop_on_stall=false)"
    )
    assert err.endswith(tail), err
    run = guard_rewards / "run"
    assert latest_checkpoint(run).name == "step_000002" and not (run / "final").exists()

    resume = shlex.split(err.split("resume with: ", 1)[1].split(" (append", 1)[0])
    assert resume[:2] == ["grpo", "train"]
    with caplog.at_level("INFO", logger="grpo.run.loop"):
        code = cli.main([*resume[1:], "train.stop_on_stall=false"])
    out, err = one_line(capsys)
    assert code == 0 and final_lines(out)[0] == "done: 4 steps; weights in run/final", (out, err)
    assert any(
        "resumed from run/checkpoints/step_000002 (step 2)" in r.getMessage()
        for r in caplog.records
    )
    assert steps_logged(run) == [1, 2, 3, 4]


def test_skipped_nonfinite_updates_save_the_intact_weights_and_resume(
    shared_tiny_model, guard_rewards, capsys, monkeypatch
):
    """train.max_nonfinite_steps consecutive skipped updates: no update was applied, the
    weights are intact, so the stop saves them (step 2) and names the resume command; the run
    resumes from it once the loss is finite again."""
    import grpo.train.grpo as g

    real = g.policy_loss_on_device

    def nan_loss(*a, **k):
        loss, stats, bad_row = real(*a, **k)
        return loss * float("nan"), stats, bad_row

    args = train_args(shared_tiny_model, "train.max_steps=3", "train.max_nonfinite_steps=2")
    with monkeypatch.context() as m:
        m.setattr(g, "policy_loss_on_device", nan_loss)
        code = cli.main(args)
    _, err = one_line(capsys)
    assert code == 2 and err == (
        "grpo train: error: 2 consecutive updates had a non-finite loss or gradient (step 2); "
        "stopped. Lower optim.lr or check the rewards (the weights are those of the last update "
        "applied); checkpoint saved in run/checkpoints/step_000002; resume with: grpo train "
        "--config run/config.yaml --resume"
    ), err
    run = guard_rewards / "run"
    assert latest_checkpoint(run).name == "step_000002"
    code = cli.main(["train", "--config", "run/config.yaml", "--resume"])
    out, _ = one_line(capsys)
    assert code == 0 and final_lines(out) == ["done: 3 steps; weights in run/final"]


@pytest.mark.parametrize("save_every", [1, 0])
def test_nonfinite_weights_are_never_saved_and_the_good_checkpoint_is_named(
    shared_tiny_model, guard_rewards, capsys, monkeypatch, save_every
):
    """An update that leaves a weight NaN (step 2): nothing is saved; the line names the last
    good checkpoint (step 1) and the resume command, or says none was written yet."""
    monkeypatch.setattr("grpo.run.loop.build_optimizer", nan_at_update(2))
    code = cli.main(
        train_args(shared_tiny_model, "train.max_steps=3", f"train.save_every={save_every}")
    )
    _, err = one_line(capsys)
    assert code == 2 and err.startswith(
        "grpo train: error: step 2: the weights are not finite after the update (loss "
    ), err
    assert (
        "; lower optim.lr (and keep optim.max_grad_norm set); nothing saved (the weights "
        "after the update of step 2 are not finite); " in err
    ), err
    run = guard_rewards / "run"
    if save_every:
        assert err.endswith(
            "the last checkpoint stays: run/checkpoints/step_000001 (step 1); "
            "resume from it with: grpo train --config run/config.yaml --resume"
        )
        assert latest_checkpoint(run).name == "step_000001"
    else:
        assert err.endswith(
            "no checkpoint was written before it (train.save_every=0: at the "
            "end only); start again with --overwrite"
        ), err
        assert latest_checkpoint(run) is None
    assert not (run / "final").exists()


# ----------------------------------------------------------------------- rank 0 prints


def test_done_is_printed_by_rank_0_only(monkeypatch, capsys):
    """Every rank returns the summary; `grpo train` / `grpo sft` print its lines on rank 0."""
    summary = {"step": 3, "final": "run/final", "health": {}}
    monkeypatch.setattr("grpo.train.grpo.train_grpo", lambda cfg, **kw: summary)
    monkeypatch.setattr("grpo.train.sft.train_sft", lambda cfg, **kw: summary)
    for command in ("train", "sft"):
        for rank, want in (("1", ""), ("0", "done: 3 steps; weights in run/final\n")):
            monkeypatch.setenv("RANK", rank)
            assert cli.main([command, "--config", TINY_CI, "model.path=m"]) == 0
            assert capsys.readouterr().out == want, (command, rank)
    converged = {"fired_step": 5, "message": "every completion ...", "stopped": False}
    cli.print_done({**summary, "step": 9, "converged": converged}, rank=0)
    assert capsys.readouterr().out.splitlines() == [
        "done: 9 steps; weights in run/final",
        "converged at step 5: every completion ... (train.stop_on_stall: true ends such a run "
        "there)",
    ]
    cli.print_done({**summary, "converged": converged}, rank=2)
    assert capsys.readouterr().out == ""


@pytest.mark.process
def test_a_solved_task_stops_every_torchrun_rank_at_the_same_step(shared_tiny_model, guard_rewards):
    """Two DDP ranks read the same reduced metrics: both end at step 2 with exit 0, after the
    checkpoint and final/; rank 0 alone prints the one stdout line."""
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            "-m",
            "grpo",
            *train_args(
                shared_tiny_model,
                "rewards=[{name: 'guard_rewards:full'}]",
                "train.max_steps=5",
                "train.stall_steps=2",
                "train.stop_on_stall=true",
            ),
        ],
        cwd=guard_rewards,
        capture_output=True,
        text=True,
        timeout=300,
        env={
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([str(guard_rewards), str(REPO)]),
        },
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert final_lines(r.stdout) == [
        "converged at step 2: every completion in every group got the rewards' maximum (1) for 2 "
        "steps (steps 1-2): the task is learned; harder prompts (data) would give the policy "
        "more to learn; stopped by train.stop_on_stall; weights in run/final"
    ], r.stdout
    run = guard_rewards / "run"
    assert (run / "final").is_dir() and latest_checkpoint(run).name == "step_000002"
    assert steps_logged(run) == [1, 2]


def test_the_converged_quickstart_ends_with_exit_0(shared_tiny_model, tmp_path, capsys):
    """The issue's command: configs/quickstart.yaml with train.stop_on_stall=true reaches
    reward 1.000 in every group (grpo.tiny:digit_share declares [0, 1]) and ends converged,
    exit 0, with final weights, instead of exit 2 with nothing saved."""
    from grpo.rewards import reward_bounds as bounds_of
    from grpo.tiny import digit_share

    assert bounds_of(digit_share) == (0.0, 1.0)
    out = tmp_path / "run"
    code = cli.main(
        [
            "train",
            "--config",
            str(REPO / "configs" / "quickstart.yaml"),
            f"model.path={shared_tiny_model}",
            f"train.output_dir={out}",
            "train.max_steps=60",
            "train.stop_on_stall=true",
            "train.progress=false",
        ]
    )
    printed = capsys.readouterr().out.strip().splitlines()
    assert code == 0
    assert printed[-1].startswith("converged at step ") and printed[-1].endswith(f"{out}/final")
    assert (out / "final" / "model.safetensors").is_file()

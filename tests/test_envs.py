"""Environments: the calculator environment's turns, the registry's errors, per-turn rewards
and the discounted return, and multi-turn training / evaluation end to end from the CLI."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from grpo.apps import cli
from grpo.envs import CalculatorEnv, Step, check_step, env_factory
from grpo.errors import GrpoError
from grpo.experience.batch import turn_token_rewards
from grpo.rollout.sampler import Rollout

REPO = Path(__file__).resolve().parents[1]


def test_calculator_env_turns():
    env = CalculatorEnv(tool_reward=0.1, invalid_penalty=0.05)
    assert env.start({"question": "q"}) is None
    call = (
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "37 * 48"}}\n</tool_call>'
    )
    step = env.step("Let me compute.\n" + call, [])
    assert step.observation == "1776" and not step.done
    assert step.info == {"tool_calls": 1, "invalid_calls": 0} and step.reward == pytest.approx(0.1)
    bad = '<tool_call>{"name": "calc", "arguments": {}}</tool_call><tool_call>{oops</tool_call>'
    step = env.step(bad, [])
    assert step.info == {"tool_calls": 2, "invalid_calls": 2}
    assert step.observation.startswith("error: unknown tool 'calc'")
    assert step.reward == pytest.approx(-0.1)
    slow = '<tool_call>{"name": "calculator", "arguments": {"expression": "9**9**9"}}</tool_call>'
    assert env.step(slow, []).observation.startswith("error: exponent")
    final = env.step("Final Answer: 1776", [])
    assert final.done and final.observation is None
    assert env_factory("calculator", {"tool_reward": 0.2})().tool_reward == 0.2


def test_env_registry_errors():
    with pytest.raises(
        GrpoError,
        match=r"rollout.env: unknown environment 'nope'; registered: "
        r"calculator, python, single_turn",
    ):
        env_factory("nope")
    with pytest.raises(GrpoError, match="rollout.env_kwargs: .*unexpected keyword argument 'x'"):
        env_factory("calculator", {"x": 1})
    with pytest.raises(GrpoError, match=r"environment 'e': step\(\) returned dict"):
        check_step("e", {"observation": "x"})
    with pytest.raises(GrpoError, match="step reward must be a finite number"):
        check_step("e", Step(reward=float("nan")))
    with pytest.raises(GrpoError, match="observation must be a string or a message dict"):
        check_step("e", Step(observation={"content": 3}))


def test_turn_token_rewards_discounted_return():
    # one row, 2 turns: turn 0 = cols 0-1, observation cols 2-3, turn 1 = cols 4-5
    scored = torch.tensor([[True, True, False, False, True, True]])
    r = Rollout(
        ids=torch.zeros(1, 7, dtype=torch.long),
        prompt_lens=torch.tensor([1]),
        prompt_width=1,
        completion_ids=torch.zeros(1, 6, dtype=torch.long),
        completion_mask=torch.ones(1, 6, dtype=torch.bool),
        completion_lens=torch.tensor([6]),
        finished=torch.tensor([True]),
        logprobs=torch.zeros(1, 6),
        group_size=1,
        generated_mask=scored,
        turn_ids=torch.tensor([[0, 0, 0, 0, 1, 1]]),
        turn_rewards=[[0.1, 0.0]],
        turn_texts=[[[1], [2]]],
        infos=[{}],
    )
    # step reward 0.1 at turn 0's last token; final reward 0.6 at the last token, x gamma^1
    tok = turn_token_rewards(torch.tensor([0.6]), r, gamma=0.9)
    assert tok[0].tolist() == pytest.approx([0.0, 0.1, 0.0, 0.0, 0.0, 0.9 * 0.6])


ECHO_ENV = '''
from grpo.envs import Step

class Echo:
    """Answers the first turn with a tool result, ends on the second."""
    tools = []

    def __init__(self, reward=0.1):
        self.turn, self.reward = 0, reward

    def start(self, row):
        return None

    def step(self, text, token_ids):
        self.turn += 1
        if self.turn == 1:
            return Step(observation="result: 42", reward=self.reward, info={"tool_calls": 1})
        return Step(done=True)

class Broken(Echo):
    def step(self, text, token_ids):
        return "not a step"
'''


def grpo_here(monkeypatch, tmp_path, *argv) -> int:
    """`python -m grpo ARGV` in this process, run in `tmp_path` with it first on sys.path: its
    echo_env.py is imported afresh (not another test's module of that name)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "echo_env", raising=False)
    return cli.main(list(argv))


def test_multi_turn_training_end_to_end(shared_tiny_model, tmp_path, monkeypatch, capsys):
    (tmp_path / "echo_env.py").write_text(ECHO_ENV)
    code = grpo_here(
        monkeypatch,
        tmp_path,
        "train",
        "--config",
        str(REPO / "configs/tiny_ci.yaml"),
        f"model.path={shared_tiny_model}",
        "train.output_dir=run",
        "train.max_steps=2",
        "train.progress=false",
        "data.eval_samples=4",
        "rewards=[{name: step}]",
        "rollout.env=echo_env:Echo",
        "rollout.max_turns=3",
        "rollout.max_new_tokens=8",
        "rollout.turn_discount=0.9",
    )
    assert code == 0, capsys.readouterr().err[-2000:]
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    last = rows[-1]
    assert last["env/turns_mean"] == 2.0 and last["env/tool_calls_mean"] == 1.0
    assert last["env/step_reward_mean"] == pytest.approx(0.1)
    assert last["env/turn_limit_frac"] == 0.0
    assert "eval/turns_mean" in last and "eval/accuracy" in last


def test_broken_environment_is_one_line(shared_tiny_model, tmp_path, monkeypatch, capsys):
    (tmp_path / "echo_env.py").write_text(ECHO_ENV)
    code = grpo_here(
        monkeypatch,
        tmp_path,
        "train",
        "--config",
        str(REPO / "configs/tiny_ci.yaml"),
        f"model.path={shared_tiny_model}",
        "train.output_dir=run",
        "train.progress=false",
        "rollout.env=echo_env:Broken",
    )
    assert code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "grpo train: error: environment 'echo_env:Broken': step() returned str, expected a "
        "grpo.envs.Step"
    )
    code = cli.main(
        [
            "train",
            "--config",
            str(REPO / "configs/tiny_ci.yaml"),
            f"model.path={shared_tiny_model}",
            "train.output_dir=run2",
            "rollout.env=nope",
        ]
    )
    assert code == 2 and "unknown environment 'nope'" in capsys.readouterr().err
    assert not (tmp_path / "run2").exists()


def test_eval_with_calculator_env(shared_tiny_model, tmp_path, monkeypatch, capsys):
    code = grpo_here(
        monkeypatch,
        tmp_path,
        "eval",
        "--model",
        str(shared_tiny_model),
        "--data",
        "minimath:test",
        "--max-samples",
        "4",
        "--max-new-tokens",
        "8",
        "--env",
        "calculator",
        "--max-turns",
        "2",
        "--out",
        "res.json",
    )
    assert code == 0, capsys.readouterr().err[-2000:]
    summary = json.loads((tmp_path / "res.json").read_text())["models"]["model"]["summary"]
    for key in (
        "accuracy",
        "turns_mean",
        "tool_calls_mean",
        "invalid_call_rate",
        "turn_limit_frac",
    ):
        assert key in summary
    assert 1.0 <= summary["turns_mean"] <= 2.0


@pytest.mark.parametrize("name", __import__("grpo.envs", fromlist=["x"]).available_envs())
def test_every_registered_env_follows_the_protocol(name):
    """Every registered environment: fresh per trajectory, start() gives None or messages,
    step() on a final answer, a tool call and garbage returns a valid Step (never raises)."""
    make = env_factory(name)
    a, b = make(), make()
    assert a is not b and isinstance(a.tools, list)
    first = a.start({"question": "What is 2 * 3?", "ground_truth": "6", "prompt_ids": [1]})
    assert first is None or (isinstance(first, list) and all("role" in m for m in first))
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "2 * 3"}}</tool_call>'
    for text in ("Final Answer: 6", call, "<tool_call>{oops", "\x00 \n"):
        step = check_step(name, a.step(text, [1, 2, 3]))
        assert step.done or step.observation is not None

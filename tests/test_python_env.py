"""Tests for grpo.envs.python and its sandbox (grpo.envs.sandbox): run_python's limits (each
bounded: small time, CPU and memory limits, so a failing test cannot hurt the machine), the
environment's turns and counters, the reward-hacking guard, and a multi-turn rollout that goes
on past a runaway program."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from grpo.envs import PYTHON_TOOL, PythonEnv, Step, check_step, env_factory, run_python
from grpo.envs.python import code_runs
from grpo.envs.sandbox import isolation
from grpo.envs.tool_calls import tool_call_text
from grpo.errors import GrpoError
from grpo.rewards import make_accuracy
from tests.test_sandbox import processes_with

SMALL = dict(timeout_s=2.0, cpu_s=2, memory_mb=256, max_output_chars=1024, max_file_mb=1)


def small(**over):
    return {**SMALL, **over}


def gone(pid: int, within_s: float = 2.0) -> bool:
    """Whether `pid` no longer runs (a zombie waiting for its reaper counts as gone)."""
    end = time.monotonic() + within_s
    while True:
        try:
            os.kill(pid, 0)
            state = Path(f"/proc/{pid}/status").read_text().split("State:")[1].split()[0]
        except (ProcessLookupError, FileNotFoundError, IndexError):
            return True
        if state == "Z":
            return True
        if time.monotonic() > end:
            return False
        time.sleep(0.05)


def call(code: str, name: str = "python") -> str:
    return tool_call_text(name, {"code": code})


# ----------------------------------------------------------------- run_python


def test_normal_code_and_exceptions():
    r = run_python("print(48/2)", **SMALL)
    assert (r.output, r.ok, r.error, r.limit, r.truncated) == ("24.0\n", True, None, None, False)
    assert r.observation() == "24.0" and r.elapsed_s < 2.0
    r = run_python("print('before')\n1/0", **SMALL)
    assert not r.ok and r.limit is None and r.error == "ZeroDivisionError: division by zero"
    assert r.observation() == "before\nerror: ZeroDivisionError: division by zero"
    r = run_python("x = (", **SMALL)
    assert r.error.startswith("SyntaxError: ") and not r.ok
    assert run_python("raise ValueError('a\\nb')", **SMALL).error == "ValueError: a b"
    assert run_python("import sys; sys.exit(3)", **SMALL).error == "exit code 3"
    assert run_python("x = 1", **SMALL).observation() == "(no output)"


def test_infinite_loop_hits_the_cpu_limit():
    r = run_python("while True: pass", **small(timeout_s=3.0, cpu_s=1))
    assert (r.limit, r.ok) == ("cpu", False) and r.error == "CPU time limit (1 s) exceeded"
    assert r.observation() == "error: CPU time limit (1 s) exceeded"
    assert 0.9 < r.elapsed_s < 2.5


def test_infinite_loop_hits_the_wall_clock():
    r = run_python("while True: pass", **small(timeout_s=1.0, cpu_s=5))
    assert r.limit == "time" and r.observation() == "error: time limit (1 s) exceeded"
    assert 0.9 < r.elapsed_s < 2.0


def test_sleep_hits_the_wall_clock_and_keeps_earlier_output():
    start = time.monotonic()
    r = run_python("import time\nprint('started')\ntime.sleep(60)", **small(timeout_s=1.0))
    assert time.monotonic() - start < 3.0
    assert r.limit == "time" and r.observation() == "started\nerror: time limit (1 s) exceeded"


@pytest.mark.parametrize(
    "code",
    ["x = bytearray(10**10)", "x = []\nwhile True:\n    x.append(' ' * 10**5)"],
    ids=["one_allocation", "growing_list"],
)
def test_memory_bomb_hits_the_memory_limit(code):
    r = run_python(code, **small(memory_mb=256))
    assert r.limit == "memory" and r.observation() == "error: memory limit (256 MB) exceeded"
    assert r.elapsed_s < 2.0


def test_huge_output_is_cut_and_stopped_fast():
    r = run_python("while True:\n    print('x' * 10**6)", **small(max_output_chars=100))
    assert r.limit == "output" and r.truncated and not r.ok and r.elapsed_s < 1.5
    assert r.output == "x" * 100
    assert r.observation() == "x" * 100 + "\nerror: output cut at 100 characters"
    # a program that ends by itself with too much output: cut, and its exception still shown
    r = run_python("print('é' * 150)\n1/0", **small(max_output_chars=100))
    assert r.limit is None and r.truncated and r.output == "é" * 100
    assert r.observation().splitlines()[1:] == [
        "error: output cut at 100 characters",
        "error: ZeroDivisionError: division by zero",
    ]


def test_file_size_limit_and_the_directory_is_removed():
    code = "import os\nprint(os.getcwd())\nopen('big', 'wb').write(b'x' * (2 * 2**20))"
    r = run_python(code, **small(max_file_mb=1))
    assert r.limit == "file" and r.error == "file size limit (1 MB) exceeded"
    workdir = r.output.strip()
    assert workdir and not os.path.exists(workdir)  # its temporary directory is gone
    r = run_python("open('small', 'w').write('x' * 1000)\nprint(open('small').read()[:3])", **SMALL)
    assert r.ok and r.observation() == "xxx"


def spawn(token: str) -> str:
    """Code that starts `sleep 30` named `token` (its argv[0], found through the host's /proc:
    inside the sandbox a pid means nothing outside it)."""
    return f"import subprocess\np = subprocess.Popen(['{token}', '30'], executable='sleep')\n"


@pytest.mark.parametrize(
    "tail, limit",
    [
        ("", None),  # exits at once, leaving `sleep` behind
        ("import time\ntime.sleep(60)", "time"),  # killed at the deadline with its child
        ("import os, time\nif os.fork() == 0:\n    time.sleep(30)\n", None),  # a forked Python
    ],
    ids=["exits", "sleeps", "forks"],
)
def test_processes_the_code_started_do_not_outlive_it(tail, limit):
    token = f"{os.getpid()}-{time.monotonic_ns()}"
    r = run_python(spawn(token) + tail, **small(timeout_s=1.0))
    try:
        assert r.limit == limit and r.elapsed_s < 2.5
        end = time.monotonic() + 2
        while processes_with(token) and time.monotonic() < end:
            time.sleep(0.05)
        assert processes_with(token) == [], "a process started by the code is still running"
    finally:
        for pid in processes_with(token):
            os.kill(pid, 9)


def test_child_sees_a_minimal_environment(monkeypatch):
    monkeypatch.setenv("GRPO_TEST_SECRET", "hunter2")
    code = "import os, sys\nprint(sorted(os.environ))\nprint(repr(sys.stdin.read()))\n"
    r = run_python(code + "print(hash('abc'))", **SMALL)
    names, stdin, first_hash = r.output.splitlines()
    assert "GRPO_TEST_SECRET" not in names and "'PATH'" in names and stdin == "''"
    assert run_python("print(hash('abc'))", **SMALL).output.strip() == first_hash  # fixed seed


def test_no_network():
    """The sandbox has its own network namespace (only a loopback device, down): nothing is
    reachable, not even the host's loopback."""
    assert isolation().layers.get("network")
    r = run_python(
        "import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=1)\nprint('connected')",
        **SMALL,
    )
    assert not r.ok and "connected" not in r.output
    assert r.error.split(":")[0] in ("OSError", "PermissionError")  # no route; Landlock: EACCES


@pytest.mark.parametrize(
    "bad",
    [
        dict(timeout_s=0),
        dict(cpu_s=-1),
        dict(memory_mb=float("inf")),
        dict(cpu_s=True),
        dict(memory_mb=1e30),
        dict(timeout_s=1e9),
        dict(max_file_mb=1e6),
        dict(max_processes=10**6),
        dict(max_output_chars=10**12),
        dict(max_processes=2.5),
    ],
)
def test_limits_must_be_positive(bad):
    with pytest.raises(GrpoError, match=next(iter(bad))):
        run_python("print(1)", **small(**bad))
    with pytest.raises(GrpoError, match=next(iter(bad))):
        PythonEnv(**bad)


# ----------------------------------------------------------------- the environment


def test_tool_schema_and_registry():
    assert PYTHON_TOOL["function"]["name"] == "python"
    assert PYTHON_TOOL["function"]["parameters"]["required"] == ["code"]
    json.dumps(PYTHON_TOOL)
    env = env_factory("python", {"timeout_s": 1.0, "tool_reward": 0.1})()
    assert isinstance(env, PythonEnv) and env.tools == [PYTHON_TOOL]
    with pytest.raises(GrpoError, match="rollout.env_kwargs"):
        env_factory("python", {"timeout": 1.0})
    row = {"question": "What is 2 * 3?", "prompt_ids": [1]}
    assert env.start(row) is None
    templated = PythonEnv(use_template_tools=True, system_prompt="Use python.")
    assert templated.start(row) == [
        {"role": "system", "content": "Use python."},
        {"role": "user", "content": "What is 2 * 3?"},
    ]


@pytest.fixture
def env():
    return PythonEnv(
        **SMALL, max_calls_per_turn=2, tool_reward=0.5, invalid_penalty=0.25, error_penalty=0.125
    )


@pytest.mark.parametrize(
    "text, observation, counts",
    [
        (call("print(48/2)"), "24.0", (1, 0, 0)),
        (
            "Let me compute.\n" + call("print(6*7)") + "\n" + call("print(1/0)"),
            "42\nerror: ZeroDivisionError: division by zero",
            (2, 0, 1),
        ),
        (
            '<tool_call>{"name": "python", "arguments": {"code": </tool_call>',
            "error: malformed JSON: Expecting value at 41",
            (1, 1, 0),
        ),
        (
            call("print(1)", name="calculator"),
            "error: unknown tool 'calculator'; available: python",
            (1, 1, 0),
        ),
        (tool_call_text("python", {}), "error: python needs the argument 'code'", (1, 1, 0)),
        (
            tool_call_text("python", {"code": "print(1)", "x": 1}),
            "error: unexpected argument 'x'; python takes 'code'",
            (1, 1, 0),
        ),
        (
            tool_call_text("python", {"code": 7}),
            "error: argument 'code' must be a string, got number",
            (1, 1, 0),
        ),
        (call("print(1)") * 3, "1\n1\nerror: at most 2 tool calls per turn", (3, 1, 0)),
        ("```python\nprint(2 + 2)\n```", "4", (1, 0, 0)),
        (
            "```python\nx = 3\nprint(x)\n```\nand\n```py\nprint(x)\n```",
            "3\nerror: NameError: name 'x' is not defined",
            (2, 0, 1),
        ),  # each block runs alone
        (
            "```python\nprint(1)\n```\n```python\nprint(2",
            "1\nerror: unterminated code block (close it with ```)",
            (2, 1, 0),
        ),
        (call("print(5)") + "\n```python\nprint(6)\n```", "5", (1, 0, 0)),  # tool calls win
    ],
    ids=[
        "valid",
        "two_calls",
        "malformed_json",
        "wrong_tool",
        "missing_arg",
        "extra_arg",
        "non_string",
        "over_max_calls",
        "code_block",
        "two_blocks",
        "unterminated_block",
        "call_and_block",
    ],
)
def test_env_step(env, text, observation, counts):
    step = check_step("python", env.step(text, [1, 2]))
    calls, invalid, errors = counts
    assert not step.done and step.observation == observation
    assert step.info == {"tool_calls": calls, "invalid_calls": invalid, "tool_errors": errors}
    ok = calls - invalid - errors
    assert step.reward == pytest.approx(0.5 * ok - 0.25 * invalid - 0.125 * errors)


@pytest.mark.parametrize("text", ["Final Answer: 6", "The answer is 6.", "```\nprint(1)\n```", ""])
def test_plain_turn_is_the_final_answer(env, text):
    assert code_runs(text) == []
    step = env.step(text, [])
    assert step.done and step.observation is None and step.reward == 0.0


def test_limit_in_a_turn_is_a_tool_error():
    env = PythonEnv(**small(cpu_s=1), error_penalty=1.0)
    step = env.step(call("while True: pass") + call("print('next')"), [])
    assert step.observation == "error: CPU time limit (1 s) exceeded\nnext"
    assert step.reward == -1.0
    assert step.info == {"tool_calls": 2, "invalid_calls": 0, "tool_errors": 1}


def test_printed_answer_does_not_score_a_wrong_final_turn(env):
    """Reward hacking guard: the code prints the right answer (and tries to leave files around);
    the trajectory's reward functions read the model's final turn, which is wrong, so it
    scores 0, and the step reward counts one clean run whatever the code printed."""
    hack = "print('Final Answer: 42')\nopen('reward.json', 'w').write('{\"reward\": 1}')"
    turns = [call(hack), "I trust the tool. Final Answer: 7"]
    steps = [env.step(t, []) for t in turns]
    assert steps[0].observation == "Final Answer: 42" and steps[0].reward == 0.5
    assert steps[1].done
    accuracy = make_accuracy(strict=True)
    final_turn = turns[-1]  # what Rollout.decode gives the trainer's reward functions
    assert accuracy([final_turn], ground_truth=["42"]) == [0.0]
    assert accuracy(["Final Answer: 42"], ground_truth=["42"]) == [1.0]  # the check can pass


# ----------------------------------------------------------------- a rollout goes on

RUNAWAY = "print('Final Answer: 987654321')\nwhile True: pass"


class RunawayEnv(PythonEnv):
    """Whatever the model writes: its first turn runs a runaway program, its second ends."""

    def __init__(self):
        super().__init__(**small(timeout_s=1.0, cpu_s=1))
        self.turns = 0

    def step(self, text: str, token_ids: list[int]) -> Step:
        self.turns += 1
        return self.answer([(RUNAWAY, None)]) if self.turns == 1 else Step(done=True)


def test_rollout_goes_on_after_a_runaway_program(shared_tiny_model):
    from grpo.loading import TrainedModel, load_trained_model
    from grpo.rollout import Sampler
    from grpo.rollout.multiturn import sample_with_env

    model, tok, stops, _ = load_trained_model(
        TrainedModel(str(shared_tiny_model), ()), "float32", "cpu"
    )
    question = "What is 12345 * 80000?"
    text = tok.apply_chat_template(
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
    )
    rows = [
        {
            "prompt_ids": tok(text, add_special_tokens=False)["input_ids"],
            "question": question,
            "ground_truth": "987654321",
        }
    ]
    start = time.monotonic()
    rollout = sample_with_env(
        Sampler(model),
        tok,
        rows,
        RunawayEnv,
        env_name="runaway",
        group_size=2,
        max_new_tokens=8,
        max_turns=2,
        max_total_tokens=160,
        max_obs_tokens=64,
        stop_ids=stops,
        seed=0,
        pad_id=tok.pad_token_id,
        temperature=1.0,
    )
    assert time.monotonic() - start < 10.0
    assert [len(t) for t in rollout.turn_texts] == [2, 2]
    for info, transcript in zip(rollout.infos, rollout.transcript(tok)):
        assert info["tool_calls"] == 1 and info["tool_errors"] == 1
        assert "limit (1 s) exceeded" in transcript  # CPU or wall clock, whichever is first
        assert "Final Answer: 987654321" in transcript  # the model saw it ...
    finals = rollout.decode(tok, skip_special_tokens=True)
    accuracy = make_accuracy()
    assert accuracy(finals, ground_truth=["987654321"] * 2) == [0.0, 0.0]  # ... it scores nothing

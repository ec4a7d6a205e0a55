"""The `python` environment: the model may run Python code in any turn (ToRL / ReTool /
SimpleTIR style tool-integrated reasoning), by tool calls or ```` ```python ```` blocks, each run
in a fresh, limited, isolated process (`grpo.envs.sandbox.run_python`).

What the code can influence is only the observation text shown to the model: rewards read the
model's own final turn, and the environment's reward and counters come from the parent's own
bookkeeping of each run (ok, invalid, error), never from anything the code writes.
"""

from __future__ import annotations

import json
import re
from typing import Any

from grpo.envs.base import Step, question_messages
from grpo.envs.sandbox import check_limits, isolation, run_python
from grpo.envs.tool_calls import ToolCall, ToolCallError, json_type, parse_tool_calls
from grpo.errors import GrpoError

PYTHON_NAME = "python"

# The tool schema in the OpenAI / HF chat-template "tools" format (a constant: never mutate it).
PYTHON_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": PYTHON_NAME,
        "description": (
            "Run a Python 3 program in a fresh interpreter and return what it prints (stdout), "
            "or the error it ends with. Nothing is kept between calls; use print() to see "
            "values. Time, memory and output are limited; there is no network."
        ),
        "parameters": {
            "type": "object",
            "properties": {
                "code": {
                    "type": "string",
                    "description": "The complete program, e.g. 'print(sum(range(10)))'.",
                }
            },
            "required": ["code"],
        },
    },
}


_CODE_BLOCK_RE = re.compile(r"```(?:python|py)[ \t]*\n(.*?)```", re.S)
_CODE_OPEN_RE = re.compile(r"```(?:python|py)[ \t]*(?:\n|$)")


def code_runs(text: str) -> list[tuple[str | None, str | None]]:
    """The runs a model turn asks for, as (code, None) or (None, error line) per call.

    Tool calls (``<tool_call>{"name": "python", "arguments": {"code": ...}}</tool_call>``) when
    the turn has any; otherwise each markdown ```` ```python ```` (or ```` ```py ````) block,
    an unclosed last one being an error. ``[]``: neither, the turn is a final answer.
    """
    calls = parse_tool_calls(text)
    if calls:
        return [_call_code(call) for call in calls]
    runs: list[tuple[str | None, str | None]] = []
    end = 0
    for match in _CODE_BLOCK_RE.finditer(text):
        runs.append((match.group(1), None))
        end = match.end()
    if _CODE_OPEN_RE.search(text, end):
        runs.append((None, "unterminated code block (close it with ```)"))
    return runs


def _call_code(call: ToolCall | ToolCallError) -> tuple[str | None, str | None]:
    if isinstance(call, ToolCallError):
        return None, call.message
    if call.name != PYTHON_NAME:
        return None, f"unknown tool {call.name!r}; available: {PYTHON_NAME}"
    extra = sorted(set(call.arguments) - {"code"})
    if extra:
        names = ", ".join(repr(k) for k in extra)
        return None, f"unexpected argument {names}; {PYTHON_NAME} takes 'code'"
    if "code" not in call.arguments:
        return None, f"{PYTHON_NAME} needs the argument 'code'"
    code = call.arguments["code"]
    if not isinstance(code, str):
        return None, f"argument 'code' must be a string, got {json_type(code)}"
    return code, None


class PythonEnv:
    """The `python` environment: the model may run Python code in any turn.

    A turn that calls the tool (Hermes/Qwen3 tool calls, or markdown ```` ```python ````
    blocks when it has no tool call) gets one `tool` message back joining each run's
    observation with newlines: its stdout, and an ``error: ...`` line for an exception, a limit,
    a cut output, or a malformed call (malformed JSON, unknown tool, bad arguments: answered
    and counted, never raised). A turn with neither is the final answer and ends the trajectory
    (the trajectory's reward functions score it; nothing the code prints or writes reaches a
    reward). Runs are sequential: a turn takes at most ``max_calls_per_turn * timeout_s``.

    Args:
        timeout_s: wall-clock limit of one run.
        cpu_s: CPU-seconds limit of one run (RLIMIT_CPU).
        memory_mb: address-space limit of one run in MiB (RLIMIT_AS).
        max_output_chars: a run's stdout is cut here (with an ``error: output cut`` line).
        max_file_mb: largest file a run may write, in MiB (RLIMIT_FSIZE).
        max_processes: most processes and threads alive in one run's sandbox at once.
        require_isolation: refuse to start (GrpoError, at construction) where a required
            sandbox layer is missing on this machine (`isolation()`); False runs the code with
            the resource limits alone there.
        max_calls_per_turn: calls beyond this in one turn are answered with an error (invalid).
        tool_reward: step reward per run that finished cleanly.
        invalid_penalty: subtracted per invalid call (malformed, unknown tool, bad arguments,
            over max_calls_per_turn).
        error_penalty: subtracted per well-formed call whose code raised or hit a limit.
        system_prompt: with use_template_tools, a system message before the question.
        use_template_tools: start() returns the messages [system (optional), user question] so
            the chat template renders the tool schema; otherwise the row's own prompt is used.

    `Step.info` counts tool_calls (all calls), invalid_calls and tool_errors.
    """

    tools = [PYTHON_TOOL]

    def __init__(
        self,
        timeout_s: float = 5.0,
        cpu_s: int = 5,
        memory_mb: float = 512,
        max_output_chars: int = 1024,
        max_file_mb: float = 1,
        max_processes: int = 16,
        require_isolation: bool = True,
        max_calls_per_turn: int = 4,
        tool_reward: float = 0.0,
        invalid_penalty: float = 0.0,
        error_penalty: float = 0.0,
        system_prompt: str | None = None,
        use_template_tools: bool = False,
    ):
        check_limits(timeout_s, cpu_s, memory_mb, max_output_chars, max_file_mb, max_processes)
        if not isinstance(require_isolation, bool):
            raise GrpoError(
                f"python environment: require_isolation must be true or false, "
                f"got {require_isolation!r}"
            )
        self.isolation = isolation()
        if require_isolation and not self.isolation.complete:
            raise GrpoError(self.isolation.refusal())
        n = max_calls_per_turn
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise GrpoError(
                f"python environment: max_calls_per_turn must be an integer >= 1, "
                f"got {max_calls_per_turn!r}"
            )
        self.limits = dict(
            timeout_s=timeout_s,
            cpu_s=cpu_s,
            memory_mb=memory_mb,
            max_output_chars=max_output_chars,
            max_file_mb=max_file_mb,
            max_processes=max_processes,
            require_isolation=require_isolation,
        )
        self.max_calls_per_turn = max_calls_per_turn
        self.tool_reward = tool_reward
        self.invalid_penalty = invalid_penalty
        self.error_penalty = error_penalty
        self.system_prompt = system_prompt
        self.use_template_tools = use_template_tools

    def start(self, row: dict) -> list[dict] | None:
        return question_messages(row, self.system_prompt, self.use_template_tools)

    def metadata(self) -> dict[str, str]:
        """Recorded in a run's header: the sandbox layers as JSON (`Isolation.as_dict`)."""
        return {"isolation": json.dumps(self.isolation.as_dict(), sort_keys=True)}

    def step(self, text: str, token_ids: list[int]) -> Step:
        return self.answer(code_runs(text))

    def answer(self, runs: list[tuple[str | None, str | None]]) -> Step:
        """The Step for a turn's runs (`code_runs`' format): run each, join the observations."""
        if not runs:
            return Step(done=True)
        results, ok, invalid, errors = [], 0, 0, 0
        for i, (code, problem) in enumerate(runs):
            if i >= self.max_calls_per_turn:
                results.append(f"error: at most {self.max_calls_per_turn} tool calls per turn")
                invalid += 1
            elif code is None:
                results.append(f"error: {problem}")
                invalid += 1
            else:
                result = run_python(code, **self.limits)
                results.append(result.observation())
                ok += result.ok
                errors += not result.ok
        penalty = self.invalid_penalty * invalid + self.error_penalty * errors
        reward = self.tool_reward * ok - penalty
        info = {"tool_calls": len(runs), "invalid_calls": invalid, "tool_errors": errors}
        return Step(observation="\n".join(results), reward=reward, info=info)

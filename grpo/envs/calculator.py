"""Calculator tool: a bounded arithmetic evaluator on `ast`, and Qwen3/Hermes tool-call handling.

    calls = parse_tool_calls('<tool_call>\\n{"name": "calculator", '
                             '"arguments": {"expression": "(12 + 7) * 3 / 4"}}\\n</tool_call>')
    run_tool_call(calls[0])  # -> ("14.25", True)

The evaluator never runs code: it parses the text with ``ast.parse(mode="eval")``, rejects every
node that is not a number literal, unary +/-, or one of the binary operators + - * / // % **, and
then walks the tree with Python's own operators, so results follow Python semantics exactly (an
int when every operand is an int and the operation is exact, a float otherwise). Every input is
bounded before any work that could grow: text length, node count, the magnitude of every value,
and for ``**`` the exponent and the result's magnitude (estimated with log10 before computing),
so ``9**9**9`` fails at once instead of hanging. Every rejection is a `CalculatorError` with one
short line.
"""

from __future__ import annotations

import ast
import math
import operator
import random
import time
import warnings
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from grpo.envs.base import question_messages
from grpo.envs.tool_calls import ToolCall, ToolCallError, json_type, parse_tool_calls
from grpo.errors import GrpoError

CALCULATOR_NAME = "calculator"

# The tool schema in the OpenAI / HF chat-template "tools" format (a constant: never mutate it).
CALCULATOR_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": CALCULATOR_NAME,
        "description": (
            "Evaluate an arithmetic expression and return its value. Supports integers and "
            "decimals, + - * / // % ** and parentheses; no variables or functions."
        ),
        "parameters": {
            "type": "object",
            "properties": {
                "expression": {
                    "type": "string",
                    "description": "The arithmetic expression, e.g. '(12 + 7) * 3 / 4'.",
                }
            },
            "required": ["expression"],
        },
    },
}

# Rewordings and optional JSON-schema keywords of the calculator's schema: `tool_variants`
# draws a schema from them, so a model trained on several renderings of one tool reads a
# client's own rendering (the Agents SDK's `strict` schema, LangChain's) as the same tool.
_DESCRIPTIONS = (
    "Compute the value of an arithmetic expression.",
    "Calculator: evaluates + - * / // % ** and parentheses, and returns the number.",
    "Returns the exact result of a math expression such as 12 * 34.",
    "Use this tool for arithmetic. It takes an expression and gives back its value.",
    "Evaluate arithmetic.",
    "A calculator for products, sums, differences and quotients of numbers.",
)
_ARG_DESCRIPTIONS = (
    "An expression like 37 * 48.",
    "Math expression to evaluate",
    "The expression to compute, with numbers and + - * / ( ).",
    "what to calculate",
    None,
)
_TITLES = ("calculator_arguments", "CalculatorInput", "Arguments")
_EXAMPLES = ("2 + 2", "(3 - 1) * 4", "12 * 34", "100 / 8", "7 ** 2")


def calculator_tool_variant(index: int) -> dict[str, Any]:
    """The calculator's schema, rendering number `index`: 0 is `CALCULATOR_TOOL`; any other
    index draws (deterministically) a reworded description or none, the argument's description
    or none, shuffled key orders, `strict` with ``additionalProperties: false``, and
    ``title`` / ``examples`` keywords. The function's keys keep OpenAI's order (name,
    description, parameters, strict), the order `grpo serve` renders a request's tools in.
    The tool's name and its one argument, ``expression``, never change."""
    if index == 0:
        return CALCULATOR_TOOL
    rng = random.Random(f"grpo-calculator-tool|{index}")
    prop: dict[str, Any] = {"type": "string"}
    arg_description = rng.choice(_ARG_DESCRIPTIONS)
    if arg_description is not None:
        prop["description"] = arg_description
    if rng.random() < 0.5:
        prop["title"] = "Expression"
    if rng.random() < 0.3:
        prop["examples"] = rng.sample(_EXAMPLES, 2)
    params: dict[str, Any] = {
        "type": "object",
        "properties": {"expression": _shuffled(prop, rng)},
        "required": ["expression"],
    }
    strict = rng.random() < 0.5
    if strict:
        params["additionalProperties"] = False
    if rng.random() < 0.5:
        params["title"] = rng.choice(_TITLES)
    fn: dict[str, Any] = {"name": CALCULATOR_NAME}
    if rng.random() < 0.9:
        fn["description"] = rng.choice(_DESCRIPTIONS)
    fn["parameters"] = _shuffled(params, rng)
    if strict:
        fn["strict"] = True
    return {"type": "function", "function": fn}


def _shuffled(d: dict, rng: random.Random) -> dict:
    keys = list(d)
    rng.shuffle(keys)
    return {k: d[k] for k in keys}


def tools_for(question: str, variants: int) -> list[dict[str, Any]]:
    """The tool schemas a problem's episodes render: ``[CALCULATOR_TOOL]`` with `variants` 0,
    else one of `calculator_tool_variant(0 .. variants - 1)` chosen by the question's text (so
    every trajectory of a group, and the problem's SFT trace, render the same one)."""
    if variants <= 0:
        return [CALCULATOR_TOOL]
    return [calculator_tool_variant(zlib.crc32(question.encode()) % variants)]


_BINARY_OPS: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY_OPS: dict[type[ast.unaryop], Callable[[Any], Any]] = {
    ast.UAdd: operator.pos,
    ast.USub: operator.neg,
}


class CalculatorError(ValueError):
    """An expression the calculator rejects; the message is one short line for the model."""


@dataclass(frozen=True)
class _Limits:
    max_abs: float
    max_exponent: int
    deadline: float | None  # time.monotonic() value; None = no time limit


def format_number(x: int | float) -> str:
    """Render a calculator result for the model.

    Args:
        x: An int or float (not a bool).

    Returns:
        An int as is; a float with at most 10 significant digits, trailing zeros trimmed, shown
        as an integer when it rounds to one below 1e15 (``6.0`` -> ``"6"``, ``1/3`` ->
        ``"0.3333333333"``, ``1e20`` -> ``"1e+20"``).
    """
    if isinstance(x, bool) or not isinstance(x, int | float):
        raise TypeError(f"format_number expects an int or float, got {type(x).__name__}")
    if isinstance(x, int):
        return str(x)
    if not math.isfinite(x):
        return str(x)  # "inf", "-inf", "nan"; the evaluator never returns these
    text = f"{x:.10g}"
    rounded = float(text)
    if rounded.is_integer() and abs(rounded) < 1e15:
        return str(int(rounded))  # also maps "-0" to "0"
    return text


def evaluate_arithmetic(
    expression: str,
    *,
    max_abs: float = 1e15,
    max_exponent: int = 64,
    max_length: int = 200,
    max_nodes: int = 100,
    timeout_s: float | None = None,
) -> int | float:
    """Evaluate an arithmetic expression safely, with Python's semantics and hard bounds.

    Args:
        expression: Python-syntax arithmetic: int and float literals, unary + and -, binary
            + - * / // % **, parentheses. Surrounding whitespace is ignored.
        max_abs: Bound on the magnitude of every literal, intermediate and final value.
        max_exponent: Bound on ``|exponent|`` for ``**``; the exponent must be integer-valued.
        max_length: Bound on ``len(expression)``.
        max_nodes: Bound on the number of expression nodes (literals and operations).
        timeout_s: Wall-clock budget, checked at every node visit; None for no limit.

    Returns:
        The value: an int when every operand is an int and every operation is exact (+ - * //
        % and ** with a non-negative exponent), a float otherwise (``/`` always gives a float).

    Raises:
        CalculatorError: For anything outside the grammar or the bounds, or a division by zero.
    """
    if not (math.isfinite(max_abs) and max_abs > 0):
        raise ValueError(f"max_abs must be finite and > 0, got {max_abs}")
    if max_exponent < 0 or max_length < 1 or max_nodes < 1:
        raise ValueError(
            f"max_exponent must be >= 0 and max_length, max_nodes >= 1, got "
            f"{max_exponent}, {max_length}, {max_nodes}"
        )
    if timeout_s is not None and timeout_s < 0:
        raise ValueError(f"timeout_s must be >= 0 or None, got {timeout_s}")
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    if not isinstance(expression, str):
        raise CalculatorError(f"expression must be a string, got {type(expression).__name__}")
    if len(expression) > max_length:
        raise CalculatorError(f"expression longer than {max_length} characters")
    text = expression.strip()
    if not text:
        raise CalculatorError("empty expression")
    try:
        with warnings.catch_warnings():  # "37x" warns (invalid literal) before failing
            warnings.simplefilter("ignore", SyntaxWarning)
            tree = ast.parse(text, mode="eval")
    except SyntaxError as e:  # includes IndentationError
        raise CalculatorError(f"malformed expression: {e.msg}") from None
    except (ValueError, RecursionError, MemoryError) as e:  # e.g. null bytes, absurd nesting
        raise CalculatorError(f"malformed expression: {type(e).__name__}") from None
    nodes = [n for n in ast.walk(tree.body) if isinstance(n, ast.expr)]
    if len(nodes) > max_nodes:
        raise CalculatorError(f"expression has {len(nodes)} nodes, more than {max_nodes}")
    for node in nodes:  # reject forbidden syntax before computing anything
        _check_syntax(node)
    limits = _Limits(max_abs=max_abs, max_exponent=max_exponent, deadline=deadline)
    try:
        return _eval(tree.body, limits)
    except RecursionError:  # only reachable with a max_nodes far above the default
        raise CalculatorError("expression nested too deeply") from None


def _check_syntax(node: ast.expr) -> None:
    """Raise CalculatorError unless `node` is a number literal or an allowed operation."""
    if isinstance(node, ast.Constant):
        value = node.value
        if isinstance(value, bool) or not isinstance(value, int | float):
            shown = repr(value)
            shown = shown if len(shown) <= 20 else shown[:17] + "..."
            raise CalculatorError(f"unsupported syntax: {type(value).__name__} {shown}")
    elif isinstance(node, ast.BinOp):
        if type(node.op) not in _BINARY_OPS:
            raise CalculatorError(f"unsupported syntax: operator {type(node.op).__name__}")
    elif isinstance(node, ast.UnaryOp):
        if type(node.op) not in _UNARY_OPS:
            raise CalculatorError(f"unsupported syntax: operator {type(node.op).__name__}")
    elif isinstance(node, ast.Name):
        raise CalculatorError(f"unsupported syntax: Name {node.id!r}")
    elif isinstance(node, ast.Attribute):
        raise CalculatorError(f"unsupported syntax: Attribute {node.attr!r}")
    else:
        raise CalculatorError(f"unsupported syntax: {type(node).__name__}")


def _eval(node: ast.expr, limits: _Limits) -> int | float:
    """Evaluate a syntax-checked node left to right, bounding every value it produces."""
    if limits.deadline is not None and time.monotonic() >= limits.deadline:
        raise CalculatorError("time limit exceeded")
    if isinstance(node, ast.Constant):
        if abs(node.value) > limits.max_abs:  # also catches 1e999 == inf
            raise CalculatorError(f"number too large (limit {format_number(limits.max_abs)})")
        return node.value
    if isinstance(node, ast.UnaryOp):
        return _UNARY_OPS[type(node.op)](_eval(node.operand, limits))
    assert isinstance(node, ast.BinOp)  # guaranteed by _check_syntax
    left = _eval(node.left, limits)
    right = _eval(node.right, limits)
    if isinstance(node.op, ast.Pow):
        _check_power(left, right, limits)
    elif isinstance(node.op, ast.Div | ast.FloorDiv | ast.Mod) and right == 0:
        raise CalculatorError("division by zero")
    try:
        result = _BINARY_OPS[type(node.op)](left, right)
    except OverflowError:  # float overflow the estimates let through; a safety net
        raise CalculatorError(f"result too large (limit {format_number(limits.max_abs)})") from None
    # isinstance first: math.isfinite would overflow converting a huge int to float
    if (isinstance(result, float) and not math.isfinite(result)) or abs(result) > limits.max_abs:
        raise CalculatorError(f"result too large (limit {format_number(limits.max_abs)})")
    return result


def _check_power(base: int | float, exponent: int | float, limits: _Limits) -> None:
    """Reject ``base ** exponent`` before computing it unless its magnitude is within bounds."""
    if isinstance(exponent, float) and not exponent.is_integer():
        raise CalculatorError(f"exponent {format_number(exponent)} is not an integer")
    if abs(exponent) > limits.max_exponent:
        raise CalculatorError(f"exponent {format_number(exponent)} exceeds {limits.max_exponent}")
    if base == 0:
        if exponent < 0:
            raise CalculatorError("division by zero (zero to a negative power)")
        return
    # log10|base ** exponent| = exponent * log10|base|; the +1 leaves the borderline cases to
    # the exact check after computing, which the exponent bound keeps cheap.
    if exponent * math.log10(abs(base)) > math.log10(limits.max_abs) + 1:
        raise CalculatorError(f"result too large (limit {format_number(limits.max_abs)})")


def run_tool_call(call: ToolCall | ToolCallError, *, timeout_s: float = 1.0) -> tuple[str, bool]:
    """Execute one parsed tool call and return the observation to show the model.

    Args:
        call: An entry of `parse_tool_calls`.
        timeout_s: Wall-clock budget for the evaluation, checked at every node visit.

    Returns:
        ``(observation, valid)``: the formatted result and True on success; otherwise a line
        starting with ``"error: "`` and False (malformed call, unknown tool, bad arguments, or
        a `CalculatorError`).
    """
    if isinstance(call, ToolCallError):
        return f"error: {call.message}", False
    if call.name != CALCULATOR_NAME:
        return f"error: unknown tool {call.name!r}; available: {CALCULATOR_NAME}", False
    extra = sorted(set(call.arguments) - {"expression"})
    if extra:
        names = ", ".join(repr(k) for k in extra)
        return f"error: unexpected argument {names}; {CALCULATOR_NAME} takes 'expression'", False
    if "expression" not in call.arguments:
        return f"error: {CALCULATOR_NAME} needs the argument 'expression'", False
    expression = call.arguments["expression"]
    if not isinstance(expression, str):
        kind = json_type(expression)
        return f"error: argument 'expression' must be a string, got {kind}", False
    try:
        value = evaluate_arithmetic(expression, timeout_s=timeout_s)
    except CalculatorError as e:
        return f"error: {e}", False
    return format_number(value), True


class CalculatorEnv:
    """The `calculator` environment: the model may call the calculator tool in any turn.

    A turn with tool calls gets one `tool` message back holding each call's result (or its
    error: malformed JSON, unknown tool, bad arguments, a rejected or slow expression are
    answered and counted, never raised); a turn without a tool call is the final answer and
    ends the trajectory (the trajectory's reward functions score it).

    Args:
        tool_reward: step reward per valid call (the tutorial's "+0.1 per useful tool step").
        invalid_penalty: subtracted per invalid call.
        max_calls_per_turn: calls beyond this in one turn are answered with an error.
        timeout_s: time limit of one evaluation.
        system_prompt: with `use_template_tools`, the system message before the question.
        use_template_tools: start() returns the messages [system (optional), user question],
            which the chat template renders with the tool schemas (as `grpo serve` renders a
            request's `tools`); off: the row's own prompt is used, schemas not rendered.
        tools: the schemas rendered (default ``[CALCULATOR_TOOL]``), e.g. a client's own
            rendering of the calculator, to evaluate what that client's requests get.
        tool_variants: N > 0: each problem renders one of N renderings of the calculator's
            schema (`tools_for`; replaces `tools`), so the policy does not learn one text.

    `tools` (what the sampler renders) is set by start() for the row.
    """

    def __init__(
        self,
        tool_reward: float = 0.0,
        invalid_penalty: float = 0.0,
        max_calls_per_turn: int = 4,
        timeout_s: float = 1.0,
        system_prompt: str | None = None,
        use_template_tools: bool = False,
        tools: list[dict] | None = None,
        tool_variants: int = 0,
    ):
        if tools is not None and not (
            isinstance(tools, list) and tools and all(isinstance(t, dict) for t in tools)
        ):
            raise GrpoError(
                f"calculator: tools must be a non-empty list of tool schemas "
                f"(objects), got {tools!r:.80}"
            )
        variants_ok = isinstance(tool_variants, int) and not isinstance(tool_variants, bool)
        if not variants_ok or tool_variants < 0:
            raise GrpoError(
                f"calculator: tool_variants must be an integer >= 0, got {tool_variants!r}"
            )
        self.tools = list(tools) if tools is not None else [CALCULATOR_TOOL]
        self.tool_variants = tool_variants
        self.tool_reward = tool_reward
        self.invalid_penalty = invalid_penalty
        self.max_calls_per_turn = max_calls_per_turn
        self.timeout_s = timeout_s
        self.system_prompt = system_prompt
        self.use_template_tools = use_template_tools

    def start(self, row: dict) -> list[dict] | None:
        if self.tool_variants:
            self.tools = tools_for(str(row.get("question", "")), self.tool_variants)
        return question_messages(row, self.system_prompt, self.use_template_tools)

    def step(self, text: str, token_ids: list[int]):
        from grpo.envs.base import Step

        calls = parse_tool_calls(text)
        if not calls:
            return Step(done=True)
        results, valid = [], 0
        for i, call in enumerate(calls):
            if i >= self.max_calls_per_turn:
                results.append(f"error: at most {self.max_calls_per_turn} tool calls per turn")
                continue
            out, ok = run_tool_call(call, timeout_s=self.timeout_s)
            results.append(out)
            valid += ok
        invalid = len(calls) - valid
        reward = self.tool_reward * valid - self.invalid_penalty * invalid
        info = {"tool_calls": len(calls), "invalid_calls": invalid}
        return Step(observation="\n".join(results), reward=reward, info=info)

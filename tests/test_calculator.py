"""Tests for grpo.envs.calculator: the evaluator against Python, its bounds, tool-call handling."""

from __future__ import annotations

import json
import random
import time
import types

import pytest

from grpo.envs import calculator
from grpo.envs.calculator import (
    CALCULATOR_TOOL,
    CalculatorEnv,
    CalculatorError,
    ToolCall,
    ToolCallError,
    calculator_tool_variant,
    evaluate_arithmetic,
    format_number,
    parse_tool_calls,
    run_tool_call,
    tools_for,
)
from grpo.errors import GrpoError

FLOAT_LEAVES = ("0.5", "1.5", "2.25", "0.1", "3.0", "0.0")


def _leaf(rng: random.Random) -> str:
    """A small int (0 included, for zero divisors) or one of a few floats, maybe negated."""
    text = str(rng.randint(0, 9)) if rng.random() < 0.8 else rng.choice(FLOAT_LEAVES)
    return "-" + text if rng.random() < 0.15 else text


def _expr(rng: random.Random, depth: int) -> str:
    """A random expression tree of at most `depth` operator levels, fully parenthesized.

    ``**`` takes a leaf or a depth-1 base and an exponent literal in 0..4 (sometimes a float),
    so every value stays far below 1e300 and Python never overflows.
    """
    if depth == 0 or rng.random() < 0.2:
        return _leaf(rng)
    r = rng.random()
    if r < 0.1:
        return f"-({_expr(rng, depth - 1)})"
    if r < 0.25:
        base = _expr(rng, min(depth - 1, 1))
        exponent = str(rng.randint(0, 4)) + (".0" if rng.random() < 0.2 else "")
        return f"({base})**{exponent}"
    op = rng.choice(["+", "-", "*", "/", "//", "%"])
    space = " " if rng.random() < 0.5 else ""
    return f"({_expr(rng, depth - 1)}{space}{op}{space}{_expr(rng, depth - 1)})"


def _python(expression: str) -> int | float | None:
    """Python's own value of a generated expression (None for ZeroDivisionError)."""
    try:
        return eval(expression, {"__builtins__": {}})  # reference only, on generated strings
    except ZeroDivisionError:
        return None


def test_evaluator_matches_python_on_random_expressions():
    rng = random.Random(1234)
    counts = {"int": 0, "float": 0, "zero_division": 0, "too_large_default": 0}
    for _ in range(2500):
        expression = _expr(rng, 4)
        expected = _python(expression)
        # Limits wide enough that only division by zero can fail: exact agreement with Python.
        wide = dict(max_abs=1e300, max_length=10_000, max_nodes=10_000)
        if expected is None:
            with pytest.raises(CalculatorError, match="division by zero"):
                evaluate_arithmetic(expression, **wide)
            counts["zero_division"] += 1
            continue
        got = evaluate_arithmetic(expression, **wide)
        # repr equality checks type (int vs float), value, and the sign of -0.0
        assert repr(got) == repr(expected), expression
        counts[type(expected).__name__] += 1
        # Default limits: either the same value, or a rejection, which a final value over the
        # bound must get.
        try:
            bounded = evaluate_arithmetic(expression, max_length=10_000, max_nodes=10_000)
        except CalculatorError as e:
            assert "too large" in str(e), (expression, str(e))
            counts["too_large_default"] += 1
        else:
            assert abs(expected) <= 1e15 and repr(bounded) == repr(expected), expression
    assert counts["int"] >= 300 and counts["float"] >= 300, counts
    assert counts["zero_division"] >= 50 and counts["too_large_default"] >= 3, counts


@pytest.mark.parametrize(
    "expression, expected",
    [
        ("(12 + 7) * 3 / 4", 14.25),
        ("7 // 2", 3),
        ("-7 // 2", -4),  # floor, not truncation
        ("-7 % 3", 2),  # sign of the divisor
        ("7.5 % -2", -0.5),
        ("-2 ** 2", -4),  # ** binds tighter than unary minus
        ("2 ** 3 ** 2", 512),  # right-associative
        ("(-2) ** 3", -8),
        ("2 ** -1", 0.5),  # negative int exponent gives a float
        ("2 ** 3.0", 8.0),
        ("0 ** 0", 1),
        ("6 / 3", 2.0),  # / always gives a float
        ("2 ** 49", 562949953421312),
        ("999999999999999 + 1", 10**15),  # exactly max_abs is allowed
        ("123456789 * 1000000", 123456789000000),  # exact int, no float rounding
        ("  1 + 2\n", 3),
        ("1_000 + 0x10", 1016),  # Python int literals
    ],
)
def test_evaluator_exact_cases(expression, expected):
    got = evaluate_arithmetic(expression)
    assert repr(got) == repr(expected)


@pytest.mark.parametrize(
    "expression, fragment",
    [
        ("9**9**9", "exponent 387420489 exceeds 64"),
        ("10**10**10", "exponent 10000000000 exceeds 64"),
        ("2**1000000", "exponent 1000000 exceeds 64"),
        ("10**400", "exponent 400 exceeds 64"),
        ("(10**8)**3", "result too large"),  # 1e24, rejected by the log10 estimate
        ("2**50", "result too large"),  # 1.13e15, caught by the exact check after computing
        ("0.001 ** -64", "result too large"),
        ("99999999 * 99999999", "result too large"),
        ("999999999999999 + 2", "result too large"),
        ("1 / 1e-300", "result too large"),
        ("1e999", "number too large"),
        ("1000000000000001", "number too large"),
        ("2 ** 0.5", "exponent 0.5 is not an integer"),
        ("1/0", "division by zero"),
        ("5%0", "division by zero"),
        ("5//0.0", "division by zero"),
        ("0 ** -1", "division by zero"),
        ("__import__('os')", "unsupported syntax: Call"),
        ("__import__('os').system('true')", "unsupported syntax: Call"),
        ("x + 1", "unsupported syntax: Name 'x'"),
        ("(1).real", "unsupported syntax: Attribute 'real'"),
        ("'ab' * 3", "unsupported syntax: str 'ab'"),
        ("lambda: 1", "unsupported syntax: Lambda"),
        ("1 < 2", "unsupported syntax: Compare"),
        ("1 and 2", "unsupported syntax: BoolOp"),
        ("[1, 2][0]", "unsupported syntax: Subscript"),
        ("1 if 1 else 2", "unsupported syntax: IfExp"),
        ("2j", "unsupported syntax: complex 2j"),
        ("True + 1", "unsupported syntax: bool True"),
        ("1 << 2", "unsupported syntax: operator LShift"),
        ("~1", "unsupported syntax: operator Invert"),
        ("1" * 201, "expression longer than 200 characters"),
        ("-" * 150 + "1", "expression has 151 nodes, more than 100"),
        ("-(" * 99 + "1" + ")" * 99, "expression longer than 200 characters"),
        ("1 +", "malformed expression"),
        ("1 = 2", "malformed expression"),
        ("", "empty expression"),
    ],
)
def test_evaluator_rejects_quickly(expression, fragment):
    start = time.perf_counter()
    with pytest.raises(CalculatorError) as info:
        evaluate_arithmetic(expression)
    elapsed = time.perf_counter() - start
    assert fragment in str(info.value)
    assert "\n" not in str(info.value)
    assert elapsed < 0.05, f"{expression[:30]!r} took {elapsed * 1000:.1f} ms"


def test_node_limit_counts_literals_and_operations():
    # ((1+1)+1)+1: 3 BinOps + 4 literals = 7 nodes; parentheses add none
    assert evaluate_arithmetic("((1+1)+1)+1", max_nodes=7) == 4
    with pytest.raises(CalculatorError, match="7 nodes, more than 6"):
        evaluate_arithmetic("((1+1)+1)+1", max_nodes=6)


def test_custom_bounds():
    assert evaluate_arithmetic("2**70", max_exponent=70, max_abs=1e30) == 2**70
    with pytest.raises(CalculatorError, match="exponent 3 exceeds 2"):
        evaluate_arithmetic("2**3", max_exponent=2)
    with pytest.raises(CalculatorError, match="longer than 4 characters"):
        evaluate_arithmetic("1+2+3", max_length=4)
    with pytest.raises(ValueError, match="max_abs"):
        evaluate_arithmetic("1", max_abs=0)


def test_deadline_is_checked_at_every_node(monkeypatch):
    # A fake clock that advances 1 s per reading: the deadline is set at t=0 + 2.5, and node
    # visits read t=1, 2, 3, ... so a 1-node expression passes and the 3rd visit of "1+2" fails.
    ticks = iter(range(100))
    monkeypatch.setattr(calculator, "time", types.SimpleNamespace(monotonic=lambda: next(ticks)))
    assert evaluate_arithmetic("1", timeout_s=2.5) == 1
    ticks = iter(range(100))
    with pytest.raises(CalculatorError, match="time limit exceeded"):
        evaluate_arithmetic("1+2", timeout_s=2.5)


def test_deadline_zero_fails_and_none_disables():
    with pytest.raises(CalculatorError, match="time limit exceeded"):
        evaluate_arithmetic("1+2", timeout_s=0.0)
    assert evaluate_arithmetic("1+2", timeout_s=None) == 3


@pytest.mark.parametrize(
    "value, text",
    [
        (6, "6"),
        (-12, "-12"),
        (10**15, "1000000000000000"),
        (6.0, "6"),
        (-0.0, "0"),
        (14.25, "14.25"),
        (0.1 + 0.2, "0.3"),
        (1 / 3, "0.3333333333"),
        (2 / 3, "0.6666666667"),
        (-2.5, "-2.5"),
        (1e-5, "1e-05"),
        (1e20, "1e+20"),
        (123456789012.0, "123456789000"),  # 10 significant digits
        (299999999999.99997, "300000000000"),  # rounds to an integer below 1e15
    ],
)
def test_format_number(value, text):
    assert format_number(value) == text


def test_format_number_rejects_bool():
    with pytest.raises(TypeError, match="int or float"):
        format_number(True)


CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+2"}}\n</tool_call>'


def test_parse_well_formed_call():
    text = "I should add these.\n" + CALL
    assert parse_tool_calls(text) == [ToolCall("calculator", {"expression": "2+2"})]


def test_parse_multiple_calls_in_order():
    text = (
        '<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}</tool_call> then '
        "<tool_call>not json</tool_call>\n"
        '<tool_call>  {"name": "search", "arguments": {"q": "x"}}  </tool_call>'
    )
    calls = parse_tool_calls(text)
    assert len(calls) == 3
    assert calls[0] == ToolCall("calculator", {"expression": "1+1"})
    assert isinstance(calls[1], ToolCallError) and calls[1].raw == "not json"
    assert calls[2] == ToolCall("search", {"q": "x"})


@pytest.mark.parametrize(
    "inner, fragment",
    [
        ('{"name": "calculator", "arguments": {"expression": "1"}', "malformed JSON"),
        ("", "malformed JSON: Expecting value at 0"),
        ("[1, 2]", "tool call must be a JSON object, got array"),
        ('{"arguments": {"expression": "1"}}', 'tool call has no "name"'),
        ('{"name": 42, "arguments": {}}', '"name" must be a string, got number'),
        ('{"name": "calculator", "arguments": [1]}', '"arguments" must be an object, got array'),
        ('{"name": "calculator", "arguments": null}', '"arguments" must be an object, got null'),
        ('{"name": "calculator", "arguments": "1+1"}', '"arguments" is a string but not JSON'),
        ('{"name": "calculator", "arguments": "[1]"}', '"arguments" must be an object, got array'),
    ],
)
def test_parse_malformed_calls(inner, fragment):
    [call] = parse_tool_calls(f"<tool_call>{inner}</tool_call>")
    assert isinstance(call, ToolCallError)
    assert fragment in call.message and call.raw == inner


def test_parse_string_encoded_arguments_and_missing_arguments():
    inner = json.dumps({"name": "calculator", "arguments": json.dumps({"expression": "3*4"})})
    assert parse_tool_calls(f"<tool_call>{inner}</tool_call>") == [
        ToolCall("calculator", {"expression": "3*4"})
    ]
    assert parse_tool_calls('<tool_call>{"name": "calculator"}</tool_call>') == [
        ToolCall("calculator", {})
    ]


def test_parse_unterminated_call():
    text = CALL + '\n<tool_call>\n{"name": "calculator", "arguments": {"expr'
    calls = parse_tool_calls(text)
    assert calls[0] == ToolCall("calculator", {"expression": "2+2"})
    assert calls[1] == ToolCallError(
        "unterminated tool call", '\n{"name": "calculator", "arguments": {"expr'
    )


@pytest.mark.parametrize("text", ["", "The answer is 4.", "use </tool_call> tags", "<tool_call"])
def test_parse_no_calls(text):
    assert parse_tool_calls(text) == []


# The tool parts of Qwen3's chat template (Qwen/Qwen3-*, tokenizer_config.json), verbatim apart
# from the user/history handling that does not touch tools.
QWEN3_TOOL_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    '{{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n'
    'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}'
    '{%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}'
    '{{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and '
    "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    '{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n'
    '</tool_call><|im_end|>\\n" }}'
    "{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content }}"
    "{%- if message.tool_calls %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if (loop.first and message.content) or (not loop.first) %}{{- '\\n' }}{%- endif %}"
    "{%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif %}"
    '{{- \'<tool_call>\\n{"name": "\' }}{{- tool_call.name }}{{- \'", "arguments": \' }}'
    "{%- if tool_call.arguments is string %}{{- tool_call.arguments }}"
    "{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
)


def test_round_trip_through_qwen3_chat_template():
    from transformers.utils import chat_template_utils

    expressions = ['3 * (4 + 5) - "x" < 2 & 1', "10 / 4"]
    message = {
        "role": "assistant",
        "content": "Let me compute.",
        "tool_calls": [
            {"type": "function", "function": {"name": "calculator", "arguments": {"expression": e}}}
            for e in expressions[:1]
        ]
        + [  # a string-valued arguments field is rendered as is
            {
                "type": "function",
                "function": {
                    "name": "calculator",
                    "arguments": json.dumps({"expression": expressions[1]}),
                },
            }
        ],
    }
    [rendered], _ = chat_template_utils.render_jinja_template(
        [[message]], tools=[CALCULATOR_TOOL], chat_template=QWEN3_TOOL_TEMPLATE
    )
    system, assistant = rendered.split("<|im_start|>assistant\n")
    tools_json = system.split("<tools>\n")[1].split("\n</tools>")[0]
    assert json.loads(tools_json) == CALCULATOR_TOOL  # the schema is plain JSON
    calls = parse_tool_calls(assistant)
    assert calls == [ToolCall("calculator", {"expression": e}) for e in expressions]
    assert [run_tool_call(c) for c in calls] == [
        ("error: unsupported syntax: Compare", False),
        ("2.5", True),
    ]


def test_calculator_tool_schema():
    function = CALCULATOR_TOOL["function"]
    assert CALCULATOR_TOOL["type"] == "function" and function["name"] == "calculator"
    assert function["parameters"]["required"] == ["expression"]
    assert function["parameters"]["properties"]["expression"]["type"] == "string"
    assert function["description"] and json.loads(json.dumps(CALCULATOR_TOOL)) == CALCULATOR_TOOL


@pytest.mark.parametrize(
    "call, expected",
    [
        (ToolCall("calculator", {"expression": "(12 + 7) * 3 / 4"}), ("14.25", True)),
        (ToolCall("calculator", {"expression": "6 / 3"}), ("2", True)),
        (ToolCall("calculator", {"expression": "2**10"}), ("1024", True)),
        (ToolCall("calculator", {"expression": "1/0"}), ("error: division by zero", False)),
        (
            ToolCall("calculator", {"expression": "9**9**9"}),
            ("error: exponent 387420489 exceeds 64", False),
        ),
        (
            ToolCall("python", {"code": "1"}),
            ("error: unknown tool 'python'; available: calculator", False),
        ),
        (
            ToolCall("calculator", {}),
            ("error: calculator needs the argument 'expression'", False),
        ),
        (
            ToolCall("calculator", {"expression": "1", "precision": 3}),
            ("error: unexpected argument 'precision'; calculator takes 'expression'", False),
        ),
        (
            ToolCall("calculator", {"expression": 3}),
            ("error: argument 'expression' must be a string, got number", False),
        ),
        (ToolCallError("unterminated tool call", "{"), ("error: unterminated tool call", False)),
    ],
)
def test_run_tool_call(call, expected):
    assert run_tool_call(call) == expected


def test_run_tool_call_enforces_timeout():
    call = ToolCall("calculator", {"expression": "1+2"})
    assert run_tool_call(call, timeout_s=0.0) == ("error: time limit exceeded", False)
    assert run_tool_call(call, timeout_s=1.0) == ("3", True)


def test_schema_variants_describe_one_tool_many_ways():
    """16 renderings of the calculator's schema: every one a JSON Schema of the same call
    (name `calculator`, one required string `expression`, validating the same arguments),
    rendered 16 different ways, with the keywords clients add among them."""
    import jsonschema

    variants = [calculator_tool_variant(i) for i in range(16)]
    assert variants[0] == CALCULATOR_TOOL
    assert len({json.dumps(v) for v in variants}) == 16
    for v in variants:
        fn = v["function"]
        assert v["type"] == "function" and fn["name"] == "calculator"
        assert list(fn)[:1] == ["name"] and set(fn) <= {
            "name",
            "description",
            "parameters",
            "strict",
        }
        params = fn["parameters"]
        jsonschema.Draft202012Validator.check_schema(params)
        jsonschema.validate({"expression": "37 * 48"}, params)
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate({}, params)
        assert list(params["properties"]) == ["expression"] and params["required"] == ["expression"]
        if fn.get("strict"):  # OpenAI's strict mode: no other keys
            assert params["additionalProperties"] is False
    # what the Agents SDK and LangChain send appears: strict, titles, examples, no descriptions
    assert sum(bool(v["function"].get("strict")) for v in variants) >= 4
    assert any("title" in v["function"]["parameters"] for v in variants)
    assert any(
        "examples" in v["function"]["parameters"]["properties"]["expression"] for v in variants
    )
    assert any(
        "description" not in v["function"]["parameters"]["properties"]["expression"]
        for v in variants
    )
    # the key orders differ too
    assert len({tuple(v["function"]["parameters"]) for v in variants}) >= 4
    assert calculator_tool_variant(5) == calculator_tool_variant(5)  # deterministic


def test_tools_for_picks_one_variant_per_question():
    qs = [f"What is {a} * 13?" for a in range(10, 60)]
    assert all(tools_for(q, 0) == [CALCULATOR_TOOL] for q in qs)
    picked = [json.dumps(tools_for(q, 16)) for q in qs]
    assert picked == [json.dumps(tools_for(q, 16)) for q in qs]  # the same for every call
    assert len(set(picked)) >= 8  # spread over the variants


def test_env_renders_each_rows_schema():
    row = {"question": "What is 37 * 48?"}
    env = CalculatorEnv(use_template_tools=True, tool_variants=16)
    assert env.start(row) == [{"role": "user", "content": row["question"]}]
    assert env.tools == tools_for(row["question"], 16)
    custom = [{"type": "function", "function": {"name": "calculator"}}]
    env = CalculatorEnv(use_template_tools=True, tools=custom)
    env.start(row)
    assert env.tools == custom and CalculatorEnv().tools == [CALCULATOR_TOOL]


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"tools": []}, "tools must be a non-empty list"),
        ({"tools": "calculator"}, "tools must be a non-empty list"),
        ({"tool_variants": -1}, "tool_variants must be an integer >= 0"),
        ({"tool_variants": 2.5}, "tool_variants must be an integer >= 0"),
    ],
)
def test_env_kwargs_are_checked(kwargs, fragment):
    with pytest.raises(GrpoError, match=fragment):
        CalculatorEnv(**kwargs)

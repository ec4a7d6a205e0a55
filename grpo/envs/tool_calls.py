"""Tool calls in the Qwen3 / Hermes format, read and written in one place.

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "37 * 48"}}
    </tool_call>

The environments (`calculator`, `python`) and `grpo serve` (OpenAI `tool_calls`) use these
functions, so a model trained against an environment is read the same way when it is served:

    parse_tool_calls(text)    -> [ToolCall | ToolCallError, ...]   every block, in order
    find_tool_calls(text)     -> [(call or error, (start, end)), ...]
    split_tool_calls(text)    -> (content, [ToolCall, ...])        the server's view
    tool_call_text(name, args) -> the block, as Qwen3's chat template renders an assistant call

A malformed block is a `ToolCallError` value (never an exception): environments answer it with
an error observation, the server leaves it in the message's content.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
_TOOL_CALL_RE = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)" + re.escape(TOOL_CALL_CLOSE), re.S)


@dataclass(frozen=True)
class ToolCall:
    """One well-formed tool call: the tool's name and its keyword arguments."""

    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class ToolCallError:
    """A ``<tool_call>`` block that could not be read as a call (a value, not an exception).

    Attributes:
        message: What was wrong, one line (e.g. ``malformed JSON: Expecting value at 0``).
        raw: The text inside the block (after ``<tool_call>`` for an unterminated one).
    """

    message: str
    raw: str


def parse_tool_calls(text: str) -> list[ToolCall | ToolCallError]:
    """Find every Qwen3/Hermes ``<tool_call>{json}</tool_call>`` block in a completion.

    Args:
        text: Model output. Each block holds one JSON object ``{"name": str, "arguments":
            {...}}``; whitespace and newlines around the JSON are allowed. ``arguments`` may also
            be a JSON-encoded string of an object, as some models emit, or absent (= ``{}``).

    Returns:
        One entry per block, in order: a `ToolCall`, or a `ToolCallError` for malformed JSON,
        a missing or non-string name, or non-object arguments. An unclosed ``<tool_call>`` at
        the end is ``ToolCallError("unterminated tool call", rest)``. No blocks gives ``[]``.
    """
    return [call for call, _ in find_tool_calls(text)]


def split_tool_calls(text: str, limit: int | None = None) -> tuple[str, list[ToolCall]]:
    """A completion as an OpenAI assistant message: its content and its well-formed calls.

    Args:
        text: model output.
        limit: take at most this many calls (the first ones); later blocks stay text.

    Returns:
        ``(content, calls)``: `content` is `text` without the taken blocks and the white space
        next to them; a malformed or unterminated block stays in it, as text. Without calls,
        `content` is `text` unchanged.
    """
    taken = [(c, span) for c, span in find_tool_calls(text) if isinstance(c, ToolCall)]
    taken = taken[:limit] if limit is not None else taken
    if not taken:
        return text, []
    pieces, end = [], 0
    for _, (start, stop) in taken:
        pieces.append(text[end:start])
        end = stop
    pieces.append(text[end:])
    kept = [pieces[0].rstrip()] + [p.strip() for p in pieces[1:-1]] + [pieces[-1].lstrip()]
    return "\n".join(p for p in kept if p), [c for c, _ in taken]


def tool_call_text(name: str, arguments: dict[str, Any]) -> str:
    """One call as the Qwen3 template renders an assistant's ``tool_calls`` (and as
    `parse_tool_calls` reads it back)."""
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{TOOL_CALL_OPEN}\n{body}\n{TOOL_CALL_CLOSE}"


def find_tool_calls(text: str):
    """(`ToolCall` or `ToolCallError`, (start, end) of its block in `text`) for every block, in
    order; an unterminated block runs to the end of the text."""
    end = 0
    for match in _TOOL_CALL_RE.finditer(text):
        yield _parse_one(match.group(1)), match.span()
        end = match.end()
    start = text.find(TOOL_CALL_OPEN, end)
    if start != -1:
        rest = text[start + len(TOOL_CALL_OPEN) :]
        yield ToolCallError("unterminated tool call", rest), (start, len(text))


def _parse_one(raw: str) -> ToolCall | ToolCallError:
    """Read the JSON inside one ``<tool_call>`` block."""
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as e:
        return ToolCallError(f"malformed JSON: {e.msg} at {e.pos}", raw)
    except RecursionError:
        return ToolCallError("malformed JSON: nested too deeply", raw)
    if not isinstance(obj, dict):
        return ToolCallError(f"tool call must be a JSON object, got {json_type(obj)}", raw)
    if "name" not in obj:
        return ToolCallError('tool call has no "name"', raw)
    name = obj["name"]
    if not isinstance(name, str):
        return ToolCallError(f'"name" must be a string, got {json_type(name)}', raw)
    arguments = obj.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (json.JSONDecodeError, RecursionError):
            return ToolCallError('"arguments" is a string but not JSON', raw)
    if not isinstance(arguments, dict):
        return ToolCallError(f'"arguments" must be an object, got {json_type(arguments)}', raw)
    return ToolCall(name=name, arguments=arguments)


def json_type(value: Any) -> str:
    """The JSON name of a decoded value's type, for error messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"

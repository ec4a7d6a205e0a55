"""OpenAI function calling for `grpo serve`: the request's `tools` / `tool_choice`, the
assistant messages that carry `tool_calls`, and the model's tool calls read out of its text.

The model writes Qwen3 / Hermes blocks (``<tool_call>{"name": ..., "arguments": {...}}
</tool_call>``); they are parsed by the same function the environments use
(`grpo.envs.tool_calls.split_tool_calls`), so a model trained against `calculator` or `python`
is read the same way when it is served. Malformed blocks are not calls: they stay in the
message's content, as text, and the finish reason stays what the sampler gave.

`tool_choice`:
    "auto" (the default with tools): the tools are rendered through the chat template and the
        model decides.
    "none": the tools are not rendered and nothing is parsed.
    "required" / {"type": "function", "function": {"name": N}}: the assistant's reply is
        started for the model with ``<tool_call>\\n{"name": "`` (or ``...{"name": "N",
        "arguments":`` for N), so it continues inside a call; the reply's text includes that
        start. Each prefix ends where a BPE vocabulary splits such text anyway (before the
        space that a following word takes), so the model continues as it would have written
        it. This is a prefix, not a grammar: a model that then writes malformed JSON gets it
        back as content.

A `strict` function that may be called puts the reply under a grammar (`structured.py`):
under auto free text with every call well-formed, forced the rest of the begun call.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import MISSING, dataclass, field
from typing import Literal

from grpo.apps.serving.text import held_back
from grpo.envs.tool_calls import TOOL_CALL_OPEN, split_tool_calls
from grpo.settings import FieldError, Settings, non_empty, setting

_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def _function_name(name: str) -> str | None:
    if _NAME_RE.match(name):
        return None
    return f"must be 1-64 letters, digits, '_' or '-' (OpenAI's rule), got {name!r:.80}"


@dataclass(frozen=True, kw_only=True)
class FunctionSpec(Settings):
    name: str = setting(MISSING, check=_function_name)
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


@dataclass(frozen=True, kw_only=True)
class ToolSpec(Settings):
    """One entry of `tools`: only functions exist in OpenAI's chat API."""

    type: Literal["function"] = setting(MISSING)
    function: FunctionSpec = setting(MISSING)

    def schema(self) -> dict:
        """The tool as chat templates take it: OpenAI's shape, keys in OpenAI's order (name,
        description, parameters, strict), unset ones left out, `parameters` as the client sent
        it. Training renders an environment's schemas through the same template
        (`grpo.tokenizer.encode_chat`), so a schema in this form renders the same here."""
        f = self.function
        fn = {"name": f.name}
        if f.description is not None:
            fn["description"] = f.description
        if f.parameters is not None:
            fn["parameters"] = f.parameters
        if f.strict is not None:
            fn["strict"] = f.strict
        return {"type": "function", "function": fn}


@dataclass(frozen=True, kw_only=True)
class FunctionName(Settings):
    name: str = setting(MISSING, check=non_empty)


@dataclass(frozen=True, kw_only=True)
class NamedToolChoice(Settings):
    type: Literal["function"] = setting(MISSING)
    function: FunctionName = setting(MISSING)


@dataclass(frozen=True, kw_only=True)
class CalledFunction(Settings):
    name: str = setting(MISSING, check=non_empty)
    arguments: str = setting(MISSING)  # a JSON object, as a string (OpenAI's shape)

    def __post_init__(self):
        super().__post_init__()
        try:
            args = json.loads(self.arguments)
        except (ValueError, RecursionError):
            args = None
        if not isinstance(args, dict):
            raise FieldError(
                f"arguments: must be a JSON object in a string, got {self.arguments!r:.80}",
                field="arguments",
            )


@dataclass(frozen=True, kw_only=True)
class MessageToolCall(Settings):
    """One entry of an assistant message's `tool_calls` (sent back by the client)."""

    id: str = setting(MISSING)
    type: Literal["function"] = setting(MISSING)
    function: CalledFunction = setting(MISSING)

    def rendered(self) -> dict:
        """The call as chat templates take it: arguments as a mapping (Hugging Face's shape)."""
        f = self.function
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": f.name, "arguments": json.loads(f.arguments)},
        }


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


@dataclass(frozen=True)
class ToolUse:
    """How one chat request uses tools: the schemas to render, the text the reply starts
    with, and whether its calls are parsed (`None` for a request without tools or with
    tool_choice "none")."""

    schemas: list[dict]
    prefix: str = ""
    parallel: bool = True
    forced: str | None = None  # tool_choice required (""), or the named function; None: auto

    @property
    def strict(self) -> bool:
        """Calls whose arguments a grammar enforces: a function that may be called (any under
        auto or required; the named one) asks for `strict` arguments."""
        fns = [s["function"] for s in self.schemas]
        return any(f.get("strict") for f in fns if not self.forced or f["name"] == self.forced)

    def message(self, text: str, reason: str) -> tuple[dict, str]:
        """(assistant message, finish_reason) of a finished reply `text` (prefix included)."""
        content, calls = self.calls(text)
        if not calls:
            return {"role": "assistant", "content": content}, reason
        message = {"role": "assistant", "content": content or None, "tool_calls": calls}
        return message, "tool_calls" if reason == "stop" else reason

    def calls(self, text: str) -> tuple[str, list[dict]]:
        """(content, tool_calls in OpenAI's shape) of a reply's text."""
        content, calls = split_tool_calls(text, None if self.parallel else 1)
        out = [
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {
                    "name": c.name,
                    "arguments": json.dumps(c.arguments, ensure_ascii=False),
                },
            }
            for c in calls
        ]
        return content, out


def tool_use(tools, tool_choice, parallel: bool) -> ToolUse | None:
    """The request's `ToolUse`, or None; raises FieldError for a choice the tools cannot meet."""
    if tool_choice is not None and not tools and tool_choice != "none":
        raise FieldError("tool_choice: needs `tools`", field="tool_choice")
    if not tools or tool_choice == "none":
        return None
    names = [t.function.name for t in tools]
    if len(set(names)) < len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise FieldError(f"tools: the function name {dup!r} appears twice", field="tools")
    prefix, forced = "", None
    if tool_choice == "required":
        prefix, forced = f'{TOOL_CALL_OPEN}\n{{"name": "', ""
    elif isinstance(tool_choice, NamedToolChoice):
        name = tool_choice.function.name
        if name not in names:
            raise FieldError(
                f"tool_choice: no tool named {name!r:.80} in `tools` ({', '.join(names)})",
                field="tool_choice",
            )
        prefix, forced = f'{TOOL_CALL_OPEN}\n{{"name": {json.dumps(name)}, "arguments":', name
    return ToolUse([t.schema() for t in tools], prefix, parallel, forced)


@dataclass
class ToolStream:
    """One streamed choice of a request with tools: content streams until a tool call
    begins; the calls (and any content after them) come at the end, parsed from the full
    text. What streams is always a prefix of the final content."""

    use: ToolUse
    text: str = ""
    sent: int = 0
    held: bool = field(default=False)  # a call has begun: nothing more streams as content

    def __post_init__(self):
        self.text = self.use.prefix
        self.held = bool(self.use.prefix)

    def feed(self, delta: str) -> str:
        """Content to send now for a text delta ("" while held)."""
        self.text += delta
        if self.held:
            return ""
        start = self.text.find(TOOL_CALL_OPEN)
        if start >= 0:
            self.held = True
            end = start
        else:
            end = len(self.text) - held_back(self.text, (TOOL_CALL_OPEN,))
        end = len(self.text[:end].rstrip())  # whitespace before a call is not content
        out = self.text[self.sent : end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return out

    def finish(self, final: str, reason: str) -> tuple[list[dict], str]:
        """The last deltas (content the stream has not sent, then one per tool call) and the
        finish reason, from the choice's final text (prefix included)."""
        content, calls = self.use.calls(final)
        deltas = []
        rest = content[self.sent :] if content.startswith(final[: self.sent]) else ""
        if rest:
            deltas.append({"content": rest})
        for i, call in enumerate(calls):
            deltas.append({"tool_calls": [{"index": i, **call}]})
        if calls and reason == "stop":
            reason = "tool_calls"
        return deltas, reason

"""Requests of `grpo serve` parsed in one way: JSON bodies of /generate and the OpenAI routes
are frozen dataclasses read by the config's one builder (`grpo.settings.build_settings`: types,
unknown and required keys, each field's check; a bad field raises `RequestError` naming it:
HTTP 400). FIELDS classifies every OpenAI request field; the server's limits are here. What a
parsed body becomes (prompts rendered and encoded, the context enforced, `SamplingParams`) is
`Service`'s (service.py)."""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import MISSING, dataclass
from typing import Any, Literal

from grpo.apps.serving.tools import MessageToolCall, ToolChoice, ToolSpec, ToolUse, tool_use
from grpo.errors import GrpoError
from grpo.settings import (
    ConfigError,
    FieldError,
    Settings,
    between,
    brief_repr,
    build_settings,
    non_empty,
    only,
    setting,
    setting_key,
)

MAX_BODY_BYTES = 1 << 20
MAX_STOPS = 4
TEMPERATURE = between(0.0, 2.0)
TOP_P = between(0.0, 1.0, lo_open=True)
TOP_K = between(0, 1 << 20)
SEED = between(0, (1 << 63) - 1)
MAX_TOP_LOGPROBS = 20  # alternatives per position a scoring request may ask for


class RequestError(GrpoError):
    """A bad request field: HTTP 400, or `status` (404 an unknown model, 413 a body too large)."""

    def __init__(self, field: str, problem: str, status: int = 400):
        super().__init__(f"{field}: {problem}")
        self.field = field
        self.status = status


class Body(Settings):
    """Base of the request bodies."""


@dataclass(frozen=True, kw_only=True)
class GenerateRequest(Body):
    """A /generate body: `text` rendered with the chat template unless `raw`; `max_tokens`
    defaults to min(256, the server's limit)."""

    text: str = setting(MISSING, check=non_empty)
    max_tokens: int | None = setting(None, check=between(1))
    temperature: float = setting(1.0, check=TEMPERATURE)
    top_p: float = setting(1.0, check=TOP_P)
    top_k: int = setting(0, check=TOP_K)
    seed: int | None = setting(None, check=SEED)
    raw: bool = False


def _stops(stop: str | tuple[str, ...]) -> str | None:
    stops = (stop,) if isinstance(stop, str) else stop
    if len(stops) <= MAX_STOPS and all(stops):  # [] = no stop string
        return None
    return f"expected a non-empty string or a list of 0-{MAX_STOPS} of them, got {brief_repr(stop)}"


def refused(why: str, *neutral):
    """A check for an OpenAI field this server cannot honour: only a value that changes
    nothing (`neutral`, null always) passes; any other is refused saying `why`."""
    return lambda v: (
        None
        if v is None or v in neutral
        else (
            f"not supported: {why} (accepted: {' or '.join(map(repr, (None, *neutral)))}), "
            f"got {brief_repr(v)}"
        )
    )


def _format_name(name: str) -> str | None:
    if re.fullmatch(r"[A-Za-z0-9_-]{1,64}", name):
        return None
    return f"must be 1-64 letters, digits, '_' or '-' (OpenAI's rule), got {brief_repr(name)}"


def _logit_bias(bias: dict) -> str | None:
    for key, value in bias.items():
        if not (isinstance(key, str) and key.isdigit() and key.isascii()):
            return f"keys must be token ids as decimal strings, got {brief_repr(key)}"
        if isinstance(value, bool) or not isinstance(value, int | float):
            return f"[{key}]: expected a number in [-100, 100], got {brief_repr(value)}"
        if not -100 <= value <= 100:
            return f"[{key}]: must be in [-100, 100], got {brief_repr(value)}"
    return None


# How this server treats every field of OpenAI's request schemas (and its own extensions):
# "implemented"; "ignored" (accepted, and no value of it can change the output); "refused"
# (a 400 naming the field and why, except at the value that changes nothing, given in the
# note). docs/serving.md's field table mirrors this; tests/test_serve_fields.py checks both
# against the installed `openai` client's request types.
IMPLEMENTED, IGNORED, REFUSED = "implemented", "ignored", "refused"
_SAMPLING_FIELDS = {
    "model": (IMPLEMENTED, "required; must be the served name (else 404)"),
    "max_tokens": (IMPLEMENTED, "completion tokens per choice, at most --max-tokens-limit"),
    "temperature": (IMPLEMENTED, "0 = greedy, up to 2"),
    "top_p": (IMPLEMENTED, "nucleus mass, (0, 1]"),
    "n": (IMPLEMENTED, "completions per prompt"),
    "seed": (IMPLEMENTED, "a sampled request with a seed runs alone, reproducibly"),
    "stop": (IMPLEMENTED, "a string or a list of 0-4; [] = none"),
    "stream": (IMPLEMENTED, "server-sent events"),
    "stream_options": (IMPLEMENTED, "include_usage; include_obfuscation ignored"),
    "user": (IGNORED, "an end-user id for abuse monitoring"),
    "presence_penalty": (REFUSED, "not implemented; 0 accepted"),
    "frequency_penalty": (REFUSED, "not implemented; 0 accepted"),
    "logit_bias": (IMPLEMENTED, "{token id: bias in [-100, 100]} added to the row's logits"),
    "logprobs": (
        IMPLEMENTED,
        "true: the reply's tokens with their log-probs (the model's distribution); no streams",
    ),
    "top_k": (IMPLEMENTED, "extension (vLLM): keep the k most likely tokens, 0 = off"),
    "min_p": (IMPLEMENTED, "extension (vLLM): keep tokens with p >= min_p * p_max, 0 = off"),
    "repetition_penalty": (
        IMPLEMENTED,
        "extension (vLLM, HF semantics): logits of tokens in the prompt or completion "
        "/ penalty if > 0, * penalty if < 0; 1 = off",
    ),
}
FIELDS: dict[str, dict[str, tuple[str, str]]] = {
    "chat": {
        **_SAMPLING_FIELDS,
        "messages": (IMPLEMENTED, "rendered with the model's chat template"),
        "max_completion_tokens": (IMPLEMENTED, "wins over max_tokens"),
        "tools": (IMPLEMENTED, "function calling"),
        "tool_choice": (IMPLEMENTED, "auto, none, required, a named function"),
        "parallel_tool_calls": (IMPLEMENTED, "false: the first call only"),
        "top_logprobs": (IMPLEMENTED, "alternatives per reply token (0-20), with logprobs"),
        "store": (IGNORED, "nothing is stored"),
        "metadata": (IGNORED, "tags for stored completions"),
        "service_tier": (IGNORED, "a latency / pricing tier"),
        "prompt_cache_key": (IGNORED, "a prompt-cache routing hint"),
        "prompt_cache_options": (IGNORED, "a prompt-cache hint"),
        "prompt_cache_retention": (IGNORED, "a prompt-cache hint"),
        "safety_identifier": (IGNORED, "an end-user id for abuse monitoring"),
        "prediction": (IGNORED, "predicted output: a latency hint, the reply is the model's"),
        "verbosity": (REFUSED, 'no verbosity control; "medium" (the default) accepted'),
        "reasoning_effort": (
            REFUSED,
            "no per-request reasoning control (--enable-thinking is the server's)",
        ),
        "response_format": (
            IMPLEMENTED,
            "text, json_object, json_schema (strict or not): enforced while decoding by a "
            "grammar; not with tools unless tool_choice is none",
        ),
        "modalities": (REFUSED, 'text only; ["text"] accepted'),
        "audio": (REFUSED, "no audio output"),
        "web_search_options": (REFUSED, "no web search"),
        "moderation": (REFUSED, "no moderation"),
        "functions": (REFUSED, "deprecated: use tools"),
        "function_call": (REFUSED, "deprecated: use tool_choice"),
    },
    "completions": {
        **_SAMPLING_FIELDS,
        "prompt": (IMPLEMENTED, "a string, strings, token ids, or lists of them"),
        "logprobs": (
            IMPLEMENTED,
            "k (0-20): each token's log-prob and the k most likely at its position, of the "
            "reply (the model's distribution), or with echo of the prompt",
        ),
        "echo": (
            IMPLEMENTED,
            "prompt scoring: each token's log-prob (lm-eval loglikelihood); max_tokens 0, or 1 "
            "at temperature 0 (the greedy next token)",
        ),
        "best_of": (REFUSED, "not implemented; 1 accepted"),
        "suffix": (REFUSED, "not implemented; null accepted"),
    },
    "message": {  # messages[i], as clients send them and as the client's responses dump them
        "role": (IMPLEMENTED, "system, developer, user, assistant, tool (function refused)"),
        "content": (IMPLEMENTED, "a string or text parts; null for tool_calls"),
        "name": (IGNORED, "the chat templates have no place for it"),
        "tool_calls": (IMPLEMENTED, "an assistant message's calls, rendered"),
        "tool_call_id": (IMPLEMENTED, "a tool message's call"),
        "annotations": (IGNORED, "citations of an earlier reply; not part of the conversation"),
        "refusal": (REFUSED, "this server writes no refusals"),
        "audio": (REFUSED, "no audio"),
        "function_call": (REFUSED, "deprecated: use tool_calls"),
    },
    "stream_options": {
        "include_usage": (IMPLEMENTED, "a usage chunk before [DONE]"),
        "include_obfuscation": (IGNORED, "padding against side channels; none is sent"),
    },
}


@dataclass(frozen=True, kw_only=True)
class StreamOptions(Body):
    include_usage: bool = False
    include_obfuscation: Any = None  # ignored


@dataclass(frozen=True, kw_only=True)
class SamplingBody(Body):
    """What /v1/chat/completions and /v1/completions share. A null is the field's default.
    The OpenAI fields this server does not implement are accepted only at a value that
    changes nothing (some clients always send them)."""

    model: str | None = None  # required: checked against the served name (404)
    max_tokens: int | None = setting(None, check=between(1))
    temperature: float = setting(1.0, check=TEMPERATURE)
    top_p: float = setting(1.0, check=TOP_P)
    top_k: int = setting(0, check=TOP_K)
    n: int = setting(1, check=between(1))
    seed: int | None = setting(None, check=SEED)
    stop: str | tuple[str, ...] | None = setting(None, check=_stops)
    stream: bool = False
    stream_options: StreamOptions | None = None
    min_p: float = setting(0.0, check=between(0.0, 1.0))
    repetition_penalty: float = setting(1.0, check=between(0.0, 10.0, lo_open=True))
    user: str | None = None
    presence_penalty: float = setting(0.0, check=only(0))
    frequency_penalty: float = setting(0.0, check=only(0))
    logit_bias: dict | None = setting(None, check=_logit_bias)
    logprobs: bool | None = setting(None, check=only(False))
    top_logprobs: int | None = setting(None, check=only(0))
    echo: bool = setting(False, check=only(False))
    best_of: int | None = setting(None, check=only(1))
    suffix: Any = setting(None, check=only(None))

    @property
    def stops(self) -> tuple[str, ...]:
        return (
            () if self.stop is None else (self.stop,) if isinstance(self.stop, str) else self.stop
        )

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


@dataclass(frozen=True, kw_only=True)
class TextPart(Body):
    type: Literal["text"] = setting(MISSING)
    text: str = setting(MISSING)


@dataclass(frozen=True, kw_only=True)
class Message(Body):
    """A chat message. `content` may be null only for an assistant message with `tool_calls`;
    `tool_calls` belong to assistant messages and `tool_call_id` to tool messages."""

    role: Literal["system", "developer", "user", "assistant", "tool"] = setting(MISSING)
    content: str | tuple[TextPart, ...] | None = None
    name: str | None = None
    tool_calls: tuple[MessageToolCall, ...] | None = None
    tool_call_id: str | None = None
    annotations: Any = None  # ignored
    refusal: Any = setting(None, check=refused("this server writes no refusals"))
    audio: Any = setting(None, check=refused("no audio"))
    function_call: Any = setting(None, check=refused("deprecated: use tool_calls"))

    def __post_init__(self):
        super().__post_init__()
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise FieldError(
                "content: is required (null only for an assistant message with tool_calls)",
                field="content",
            )
        if self.tool_calls is not None and self.role != "assistant":
            raise FieldError(
                f"tool_calls: only an assistant message has them, not {self.role!r}",
                field="tool_calls",
            )
        if self.tool_call_id is not None and self.role != "tool":
            raise FieldError(
                f"tool_call_id: only a tool message has one, not {self.role!r}",
                field="tool_call_id",
            )

    def rendered(self) -> dict:
        """The message for the chat template: {role, content} (developer is OpenAI's newer
        name for system; text parts joined), plus tool_calls / tool_call_id when given."""
        content = self.content
        if content is None:
            text = ""
        else:
            text = content if isinstance(content, str) else "".join(p.text for p in content)
        out = {"role": "system" if self.role == "developer" else self.role, "content": text}
        if self.tool_calls:
            out["tool_calls"] = [c.rendered() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


@dataclass(frozen=True, kw_only=True)
class JsonSchemaFormat(Settings):
    """`response_format.json_schema`: OpenAI's shape (`schema` is the JSON Schema)."""

    name: str = setting(MISSING, check=_format_name)
    description: str | None = None
    schema: dict = setting(MISSING)
    strict: bool | None = None


@dataclass(frozen=True, kw_only=True)
class ResponseFormat(Settings):
    type: Literal["text", "json_object", "json_schema"] = setting(MISSING)
    json_schema: JsonSchemaFormat | None = None

    def __post_init__(self):
        super().__post_init__()
        if (self.type == "json_schema") != (self.json_schema is not None):
            want = "needs" if self.type == "json_schema" else "only with type json_schema"
            raise FieldError(f"json_schema: {want} (type is {self.type!r})", field="json_schema")


@dataclass(frozen=True, kw_only=True)
class ChatBody(SamplingBody):
    messages: tuple[Message, ...] = setting(MISSING, check=non_empty)
    max_completion_tokens: int | None = setting(None, check=between(1))
    tools: tuple[ToolSpec, ...] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    store: Any = None  # the fields below: FIELDS["chat"]
    metadata: Any = None
    service_tier: Any = None
    prompt_cache_key: Any = None
    prompt_cache_options: Any = None
    prompt_cache_retention: Any = None
    safety_identifier: Any = None
    prediction: Any = None
    verbosity: Any = setting(None, check=refused("no verbosity control", "medium"))
    reasoning_effort: Any = setting(
        None, check=refused("no per-request reasoning control (--enable-thinking is the server's)")
    )
    response_format: ResponseFormat | None = None
    modalities: Any = setting(None, check=refused("text only", ["text"]))
    audio: Any = setting(None, check=refused("no audio output"))
    web_search_options: Any = setting(None, check=refused("no web search"))
    moderation: Any = setting(None, check=refused("no moderation"))
    functions: Any = setting(None, check=refused("deprecated: use tools"))
    function_call: Any = setting(None, check=refused("deprecated: use tool_choice"))
    # the reply's tokens with their log-probs and the `top_logprobs` most likely at each
    logprobs: bool | None = None
    top_logprobs: int | None = setting(None, check=between(0, MAX_TOP_LOGPROBS))

    def __post_init__(self):
        super().__post_init__()
        use = tool_use(self.tools, self.tool_choice, self.parallel_tool_calls)  # the checks
        if use is not None and self.json_format is not None:
            raise FieldError(
                "response_format: not with tools (the reply would have to be both "
                "a tool call and JSON); send tool_choice: none or no tools",
                field="response_format",
            )
        if self.top_logprobs is not None and not self.logprobs:
            raise FieldError("top_logprobs: needs logprobs: true", field="top_logprobs")
        if self.logprobs and self.stream:
            raise FieldError(
                "stream: not with logprobs (not implemented for streams)", field="stream"
            )

    @property
    def json_format(self) -> ResponseFormat | None:
        """The response format when it asks for JSON (None: text)."""
        f = self.response_format
        return f if f is not None and f.type != "text" else None

    @property
    def reply_logprobs(self) -> int | None:
        """Alternatives per generated token when log-probs were asked for, else None."""
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def tool_use(self) -> ToolUse | None:
        return tool_use(self.tools, self.tool_choice, self.parallel_tool_calls)


@dataclass(frozen=True, kw_only=True)
class CompletionBody(SamplingBody):
    # a string, a list of strings, token ids, or lists of them: checked against the
    # vocabulary in `Service.prompts`
    prompt: Any = setting(MISSING)
    # prompt scoring (grpo/apps/serving/scoring.py): echo the prompt with the log-prob of each
    # token and the `logprobs` most likely at each position; max_tokens 0, or 1 at temperature
    # 0 (the greedy next token, as lm-eval's loglikelihood requests ask)
    max_tokens: int | None = setting(None, check=between(0))
    echo: bool = False
    logprobs: int | None = setting(None, check=between(0, MAX_TOP_LOGPROBS))

    def __post_init__(self):
        super().__post_init__()
        if not self.echo:
            if self.logprobs is not None and self.stream:
                raise FieldError(
                    "stream: not with logprobs (not implemented for streams)", field="stream"
                )
            if self.max_tokens == 0:
                raise FieldError(
                    "max_tokens: 0 only with echo: true (scoring the prompt)", field="max_tokens"
                )
            return
        if self.max_tokens not in (0, 1):
            raise FieldError(
                f"max_tokens: with echo, 0 (score the prompt) or 1 (and the greedy "
                f"next token), got {self.max_tokens}",
                field="max_tokens",
            )
        if self.max_tokens == 1 and self.temperature != 0:
            raise FieldError(
                "temperature: with echo and max_tokens 1, only 0 (the greedy next "
                f"token), got {self.temperature:g}",
                field="temperature",
            )
        if self.n != 1 or self.stream:
            field = "n" if self.n != 1 else "stream"
            raise FieldError(f"{field}: not with echo (one scored prompt per choice)", field=field)

    @property
    def reply_logprobs(self) -> int | None:
        """Alternatives per generated token when log-probs were asked for, else None."""
        return self.logprobs


@dataclass(frozen=True)
class ScoreRequest:
    """A /v1/completions request with echo: score the prompts (`Service.score`).

    Attributes:
        prompts: token ids per prompt.
        texts: each prompt as sent when it was a string (echoed as it is), else None.
        top_k: `logprobs`: alternatives per position (None: no log-probs in the answer).
        extend: append and score the greedy next token (max_tokens 1).
    """

    prompts: list[list[int]]
    texts: list[str | None]
    top_k: int | None
    extend: bool


def read_body(body: bytes, cls: type, ignored: list[str] | None = None):
    """The JSON body as `cls`; raises `RequestError` naming the first offending field. With an
    `ignored` list, unknown top-level keys are not refused: their names go into it."""
    try:
        data = json.loads(body)
    except ValueError as e:  # bad JSON, bad UTF-8, an integer of over 4300 digits
        raise RequestError("body", f"not valid JSON ({e})") from None
    except RecursionError:
        raise RequestError("body", "JSON nested too deeply") from None
    if not isinstance(data, dict):
        raise RequestError("body", f"expected a JSON object, got {type(data).__name__}")
    _check_text(data, "")
    if ignored is not None:
        known = {setting_key(f) for f in dataclasses.fields(cls) if f.init}
        ignored += sorted(k for k in data if k not in known)
        data = {k: v for k, v in data.items() if k in known}
    try:
        return build_settings(cls, data, null_is_default=True)
    except ConfigError as e:
        raise RequestError(e.field or "body", e.problem) from None


def not_text(value: str) -> str | None:
    """What makes `value` text no tokenizer can encode (a lone surrogate), or None."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        return (
            f"is not valid Unicode text: a lone surrogate {value[e.start]!r} at character "
            f"{e.start} (a \\ud800-\\udfff escape that is not half of a pair)"
        )
    return None


def _check_text(data: Any, field: str) -> None:
    """Every string in the decoded JSON (keys too) is text UTF-8 can encode: JSON's `\\ud800`
    escape decodes to a lone surrogate, which no tokenizer can encode. Raises `RequestError`
    naming the field (`messages[0].content`). Iterative: any depth json.loads accepted."""
    todo = [(data, field)]
    while todo:
        value, field = todo.pop()
        if isinstance(value, str):
            problem = not_text(value)
            if problem:
                raise RequestError(field or "body", problem)
        elif isinstance(value, dict):
            for key, item in reversed(value.items()):  # reversed: the first one found first
                todo.append((item, f"{field}.{key}" if field else key))
                todo.append((key, field))
        elif isinstance(value, list):
            todo.extend((item, f"{field}[{i}]") for i, item in reversed(list(enumerate(value))))


def check_limit(name: str, value: int, hi: int) -> None:
    """`value` in [1, hi]; else a `RequestError` naming the field `name`."""
    problem = between(1, hi)(value)
    if problem:
        raise RequestError(name, problem)


def parse_request(body: bytes, max_tokens_limit: int) -> GenerateRequest:
    """Validate a /generate body; raises `RequestError` naming the field."""
    req = read_body(body, GenerateRequest)
    if req.max_tokens is None:
        return dataclasses.replace(req, max_tokens=min(256, max_tokens_limit))
    check_limit("max_tokens", req.max_tokens, max_tokens_limit)
    return req

"""Requests of `grpo serve` parsed in one way: JSON bodies of /generate and the OpenAI routes
are frozen dataclasses read by the config's one builder (`grpo.settings.build_settings`: types,
unknown and required keys, each field's check; a bad field raises `RequestError` naming it:
HTTP 400), then prompts are rendered and encoded, the server's limits and the model's context
enforced, and `SamplingParams` made."""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import re
import threading
import time
from dataclasses import MISSING, dataclass
from typing import Any, Literal

from grpo.apps.serving.engine import Engine, Job, SamplingParams
from grpo.apps.serving.tools import MessageToolCall, ToolChoice, ToolSpec, ToolUse, tool_use
from grpo.envs.tool_calls import TOOL_CALL_CLOSE, TOOL_CALL_OPEN
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
from grpo.tokenizer import ChatStructureError, encode_chat

log = logging.getLogger(__name__)
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


def _top_dict(alternatives: list[tuple[int, float]], token) -> dict[str, float]:
    """OpenAI's top_logprobs entry: token text -> log-prob, most likely first (two ids that
    decode alike keep the likelier)."""
    out: dict[str, float] = {}
    for i, value in alternatives:
        out.setdefault(token(i), value)
    return out


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


def _not_text(value: str) -> str | None:
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
            problem = _not_text(value)
            if problem:
                raise RequestError(field or "body", problem)
        elif isinstance(value, dict):
            for key, item in reversed(value.items()):  # reversed: the first one found first
                todo.append((item, f"{field}.{key}" if field else key))
                todo.append((key, field))
        elif isinstance(value, list):
            todo.extend((item, f"{field}[{i}]") for i, item in reversed(list(enumerate(value))))


def _limit(name: str, value: int, hi: int) -> None:
    problem = between(1, hi)(value)
    if problem:
        raise RequestError(name, problem)


def parse_request(body: bytes, max_tokens_limit: int) -> GenerateRequest:
    """Validate a /generate body; raises `RequestError` naming the field."""
    req = read_body(body, GenerateRequest)
    if req.max_tokens is None:
        return dataclasses.replace(req, max_tokens=min(256, max_tokens_limit))
    _limit("max_tokens", req.max_tokens, max_tokens_limit)
    return req


@dataclass
class Service:
    """What the routes share: the engine, tokenizer, served name and request limits.

    Args:
        engine: runs the jobs.
        tokenizer: renders and encodes prompts.
        name: the model name clients pass (and /v1/models lists).
        max_tokens_limit: the largest max_tokens a request may ask for.
        system_prompt: put first in chat requests that have no system message.
        enable_thinking: passed to the chat template (Qwen3).
        max_body_bytes: larger request bodies get 413.
        strict_requests: refuse unknown fields of the OpenAI routes (else they are accepted,
            logged and named in the answer's `X-Ignored-Fields` header).
    """

    engine: Engine
    tokenizer: object
    name: str
    max_tokens_limit: int = 1024
    system_prompt: str | None = None
    enable_thinking: bool | None = None
    max_body_bytes: int = MAX_BODY_BYTES
    strict_requests: bool = False

    def __post_init__(self):
        self.created = int(time.time())
        self._grammars_lock = threading.Lock()

    def encode(self, text: str, field: str) -> list[int]:
        """Raw text (a /v1/completions prompt, /generate with `raw`, the server's own tool-call
        prefix) as ids, special-token strings parsed: the caller owns the whole string.
        Chat messages go through `render_chat` instead."""
        problem = _not_text(text)  # e.g. --system-prompt from argv's surrogateescape
        if problem:
            raise RequestError(field, problem)
        self.check_length([text], field)
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if not ids:
            raise RequestError(field, "encodes to no tokens")
        return ids

    def openai_job(self, body: bytes, chat: bool) -> tuple[Job, bool, ToolUse | None]:
        """A /v1/chat/completions (`chat`) or /v1/completions body -> (Job, include_usage,
        how the chat request uses tools)."""
        ignored = None if self.strict_requests else []
        req = read_body(body, ChatBody if chat else CompletionBody, ignored)
        if ignored:
            log.warning("ignored unknown request fields: %s", ", ".join(map(brief_repr, ignored)))
        self.check_model(req.model)
        if not chat and req.echo:  # prompt scoring: no generation job
            return self.score_request(req), False, None
        use = req.tool_use if chat else None
        if chat:
            messages = [m.rendered() for m in req.messages]
            prompt = self.render_chat(messages, tools=use.schemas if use else None)
            if use and use.prefix:  # tool_choice required / named: the reply starts in a call
                prompt += self.encode(use.prefix, "tool_choice")
            prompts = [prompt]
        else:
            prompts = self.prompts(req.prompt)
        # OpenAI's defaults: a chat completion may fill the context, a text completion 16 tokens
        params = self.params(req, prompts, "messages" if chat else "prompt", None if chat else 16)
        fmt = req.json_format if chat else None
        if fmt is not None:  # structured output: the grammar rides with the job's rows
            params = dataclasses.replace(params, grammar=self.grammar(fmt))
        elif use is not None and use.strict:  # calls to strict functions
            try:
                if use.forced is None:  # auto: free text, and every call well-formed
                    grammar = self.grammars().tool_calls(
                        use.schemas, use.parallel, TOOL_CALL_OPEN, TOOL_CALL_CLOSE
                    )
                else:  # the rest of the call the server began
                    grammar = self.grammars().tool_call(
                        use.schemas, use.forced or None, TOOL_CALL_CLOSE
                    )
            except FieldError as e:
                raise RequestError(e.field, e.problem) from None
            params = dataclasses.replace(params, grammar=grammar)
        top = req.reply_logprobs  # alternatives per reply token, if log-probs were asked for
        job = Job(
            prompts, params, stream=req.stream, ignored=tuple(ignored or ()), top_logprobs=top
        )
        return job, req.include_usage, use

    def grammars(self, field: str = "tools"):
        """The grammar engine (`structured.Grammars`), made on the first request that needs
        it; compiled grammars are cached by their text."""
        from grpo.apps.serving.structured import Grammars

        with self._grammars_lock:
            if self.engine.grammars is None:
                try:
                    self.engine.grammars = Grammars(self.tokenizer, self.engine.vocab_size)
                except ImportError:
                    need = "structured outputs need the grammar engine: pip install 'grpo[serve]'"
                    raise RequestError(field, need) from None
        return self.engine.grammars

    def grammar(self, fmt: ResponseFormat):
        """A JSON response format compiled for this model."""
        grammars = self.grammars("response_format")
        if fmt.type == "json_object":
            return grammars.compile("json_object")
        js = fmt.json_schema
        try:
            return grammars.compile(
                "json_schema",
                js.schema,
                bool(js.strict),
                field="response_format.json_schema.schema",
            )
        except FieldError as e:
            raise RequestError(e.field, e.problem) from None

    def score_request(self, req: CompletionBody) -> ScoreRequest:
        """A /v1/completions body with echo -> what `score` computes (checked against the
        context)."""
        prompts = self.prompts(req.prompt)
        extend = req.max_tokens == 1
        longest = max(len(p) for p in prompts)
        if longest + extend > self.engine.context:
            raise RequestError(
                "prompt",
                f"has {longest} tokens; with max_tokens={int(extend)} "
                f"it needs {longest + extend} positions > the model's context "
                f"of {self.engine.context}",
            )
        items = [req.prompt] if isinstance(req.prompt, str) or _is_ids(req.prompt) else req.prompt
        texts = [item if isinstance(item, str) else None for item in items]
        return ScoreRequest(prompts, texts, req.logprobs, extend)

    def score(self, request: ScoreRequest) -> tuple[list[dict], dict]:
        """Run a scoring request (the engine's lock held: one model user at a time) -> (the
        OpenAI completion choices with their `logprobs`, usage)."""
        from grpo.apps.serving.scoring import score

        engine = self.engine
        with engine.lock:
            scored = score(
                engine.sampler.model,
                request.prompts,
                request.top_k or 0,
                request.extend,
                engine.pad_id,
                engine.sampler.precision.head,
            )
        token = functools.lru_cache(maxsize=None)(lambda i: engine.decode([i]))
        choices = []
        for index, (s, text) in enumerate(zip(scored, request.texts)):
            prompt_len = len(request.prompts[index])
            echoed = text if text is not None else engine.decode(s.ids[:prompt_len])
            choice = {
                "index": index,
                "text": echoed + engine.decode(s.ids[prompt_len:]),
                "finish_reason": "length",
                "logprobs": None,
            }
            if request.top_k is not None:
                tokens = [token(i) for i in s.ids]
                offsets = [0]
                for t in tokens[:-1]:
                    offsets.append(offsets[-1] + len(t))
                top = [None if alts is None else _top_dict(alts, token) for alts in s.top]
                choice["logprobs"] = {
                    "tokens": tokens,
                    "token_logprobs": s.logprobs,
                    "top_logprobs": top,
                    "text_offset": offsets,
                }
            choices.append(choice)
        prompt_tokens = sum(len(p) for p in request.prompts)
        completion = len(request.prompts) if request.extend else 0
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
        }
        return choices, usage

    def choice_logprobs(self, job: Job, top_k: int) -> list[list]:
        """Per choice of a finished job, its counted tokens scored after its prompt (the model's
        own distribution, as training's log-probs: no temperature, bias or penalty): a list of
        (token id, log-prob, [(alternative id, log-prob), ...]) per token."""
        from grpo.apps.serving.scoring import score

        engine, n = self.engine, job.params.n
        rows = [job.prompts[c.index // n] + c.token_ids for c in job.result]
        with engine.lock:
            scored = score(
                engine.sampler.model,
                rows,
                top_k,
                False,
                engine.pad_id,
                engine.sampler.precision.head,
            )
        out = []
        for c, s in zip(job.result, scored):
            start = len(s.ids) - len(c.token_ids)  # the first generated position
            out.append([(s.ids[t], s.logprobs[t], s.top[t]) for t in range(start, len(s.ids))])
        return out

    def token_text(self, token_id: int) -> str:
        return self.engine.decode([token_id])

    def text_logprobs(self, tokens: list) -> dict:
        """A /v1/completions choice's legacy `logprobs` object for `choice_logprobs` tokens."""
        texts = [self.token_text(i) for i, _, _ in tokens]
        offsets = [0]
        for t in texts[:-1]:
            offsets.append(offsets[-1] + len(t))
        return {
            "tokens": texts,
            "token_logprobs": [lp for _, lp, _ in tokens],
            "top_logprobs": [_top_dict(top, self.token_text) for _, _, top in tokens],
            "text_offset": offsets,
        }

    def chat_logprobs(self, tokens: list) -> dict:
        """A chat choice's `logprobs` object ({"content": [...], "refusal": null}) for
        `choice_logprobs` tokens."""

        def entry(i: int, lp: float) -> dict:
            text = self.token_text(i)
            return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

        content = [
            {**entry(i, lp), "top_logprobs": [entry(j, v) for j, v in top]} for i, lp, top in tokens
        ]
        return {"content": content, "refusal": None}

    def generate_job(self, body: bytes) -> tuple[Job, GenerateRequest]:
        """A /generate body -> (Job, the parsed request)."""
        req = parse_request(body, self.max_tokens_limit)
        if not req.raw and getattr(self.tokenizer, "chat_template", None):
            ids = self.render_chat([{"role": "user", "content": req.text}], "text")
        else:
            ids = self.encode(req.text, "text")
        ctx = self.engine.context
        if len(ids) + req.max_tokens > ctx:
            raise RequestError(
                "text",
                f"has {len(ids)} tokens; with max_tokens={req.max_tokens} "
                f"it needs {len(ids) + req.max_tokens} positions > the model's "
                f"context of {ctx}",
            )
        params = SamplingParams(
            req.max_tokens, req.temperature, req.top_p, req.top_k, seed=req.seed
        )
        return Job([ids], params), req

    def render_chat(
        self, messages: list[dict], field: str = "messages", tools: list[dict] | None = None
    ) -> list[int]:
        """The chat template's rendering (with the generation prompt and `tools`) as ids
        (`grpo.tokenizer.encode_chat`): the template's own tags are special tokens, message
        contents plain text, so a message cannot forge a turn or a tool call."""
        tok = self.tokenizer
        if not getattr(tok, "chat_template", None):
            raise RequestError(
                field,
                "this model's tokenizer has no chat template; use /v1/completions with a prompt",
            )
        shift = 0  # messages put before the request's
        if self.system_prompt and not any(m["role"] == "system" for m in messages):
            problem = _not_text(self.system_prompt)  # from argv's surrogateescape
            if problem:
                raise RequestError("--system-prompt", problem)
            messages, shift = [{"role": "system", "content": self.system_prompt}, *messages], 1
        kwargs = {} if self.enable_thinking is None else {"enable_thinking": self.enable_thinking}
        self.check_length(
            [m["content"] for m in messages if isinstance(m.get("content"), str)], field
        )
        try:
            ids = encode_chat(tok, messages, tools=tools or None, **kwargs)
        except ChatStructureError as e:  # named as the request names it
            name = e.field  # tools[j], or messages[i].key of the rendered list
            if e.index is not None and e.index < shift:
                name = "--system-prompt"
            elif e.index is not None:
                key = e.field.split("]", 1)[1]
                name = f"messages[{e.index - shift}]{key}" if field == "messages" else field
            raise RequestError(name, e.problem) from None
        except GrpoError as e:  # the template's own checks (e.g. role order) raise here
            raise RequestError(field, str(e)) from None
        if not ids:
            raise RequestError(field, "encodes to no tokens")
        return ids

    def prompts(self, prompt: Any) -> list[list[int]]:
        """/v1/completions `prompt`: a string, a list of strings, token ids, or lists of them."""
        V = self.engine.sampler.model.config.vocab_size
        items = [prompt] if isinstance(prompt, str) or _is_ids(prompt) else prompt
        if not isinstance(items, list) or not items:
            raise RequestError(
                "prompt",
                "expected a string, a list of strings, a list of token ids or a list "
                f"of such lists, got {brief_repr(prompt)}",
            )
        out = []
        for i, item in enumerate(items):
            name = "prompt" if len(items) == 1 else f"prompt[{i}]"
            if isinstance(item, str) and item:
                out.append(self.encode(item, name))
            elif _is_ids(item) and item and all(0 <= t < V for t in item):
                out.append(list(item))
            else:
                raise RequestError(
                    name,
                    "expected a non-empty string or a non-empty list of "
                    f"token ids in [0, {V}), got {brief_repr(item)}",
                )
        return out

    def params(self, req: SamplingBody, prompts: list[list[int]], field: str, default_max):
        """SamplingParams of an OpenAI request, checked against the limits and the context."""
        engine, limit, n = self.engine, self.max_tokens_limit, req.n
        _limit("n", n, engine.max_batch_rows)
        if len(prompts) * n > engine.max_batch_rows:
            raise RequestError(
                field,
                f"{len(prompts)} prompts x n={n} completions exceed the "
                f"server's {engine.max_batch_rows} rows per request",
            )
        longest = max(len(p) for p in prompts)
        room = engine.context - longest
        if room < 1:
            raise RequestError(
                field, f"has {longest} tokens; the model's context is {engine.context}"
            )
        key, max_tokens = "max_tokens", req.max_tokens
        if getattr(req, "max_completion_tokens", None) is not None:
            key, max_tokens = "max_completion_tokens", req.max_completion_tokens
        if max_tokens is not None:
            _limit(key, max_tokens, limit)
        if max_tokens is None:
            max_tokens = min(limit, room) if default_max is None else min(default_max, limit, room)
        elif longest + max_tokens > engine.context:
            raise RequestError(
                field,
                f"has {longest} tokens; with {key}="
                f"{max_tokens} it needs {longest + max_tokens} positions > the "
                f"model's context of {engine.context}",
            )
        V = engine.sampler.model.config.vocab_size
        bias = tuple((int(k), float(v)) for k, v in (req.logit_bias or {}).items())
        for t, _ in bias:
            if t >= V:
                raise RequestError("logit_bias", f"token id {t} is not in the vocabulary [0, {V})")
        return SamplingParams(
            max_tokens,
            req.temperature,
            req.top_p,
            req.top_k,
            n=n,
            seed=req.seed,
            stop=req.stops,
            min_p=req.min_p,
            logit_bias=bias,
            repetition_penalty=req.repetition_penalty,
        )

    @functools.cached_property
    def max_token_chars(self) -> int:
        """Characters in the longest string of the vocabulary (0: unknown)."""
        vocab = getattr(self.tokenizer, "get_vocab", dict)()
        return max(map(len, vocab), default=0)

    def check_length(self, texts: list[str], field: str) -> None:
        """Refuse texts that cannot fit the context before tokenizing them (the tokenizer holds
        the GIL for up to a second on 1 MiB of text). A bound, not a count: a token covers at
        most `max_token_chars` characters (bytes, for byte-level BPE), white space may be
        dropped and normalization may shrink text up to 3x (NFC composing Hangul jamo), so
        n characters other than white space are at least n / (4 * max_token_chars) tokens."""
        per_token = 4 * self.max_token_chars
        if self.engine is None or not per_token:
            return
        ctx = self.engine.context
        if sum(map(len, texts)) < ctx * per_token:  # every request that could fit
            return
        chars = sum(len("".join(t.split())) for t in texts)
        if chars // per_token >= ctx:
            raise RequestError(
                field,
                f"has {chars} characters besides white space: at least "
                f"{chars // per_token} tokens; the model's context is "
                f"{ctx}",
            )

    def check_model(self, model: str | None) -> None:
        if model is None:
            raise RequestError("model", f"is required (this server serves {self.name!r})")
        if model != self.name:
            raise RequestError(
                "model",
                f"{brief_repr(model)} is not served here; this server "
                f"serves {self.name!r} (GET /v1/models)",
                status=404,
            )


def _is_ids(x) -> bool:
    return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

"""Requests of `grpo serve` parsed in one way: JSON bodies of /generate and the OpenAI routes
checked field by field (a bad one raises `RequestError` naming the field: HTTP 400), prompts
rendered and encoded, limits and the model's context enforced, `SamplingParams` out."""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass

from grpo.apps.serving.engine import Engine, Job, SamplingParams
from grpo.errors import GrpoError

MAX_BODY_BYTES = 1 << 20
FIELDS = ("text", "max_tokens", "temperature", "top_p", "top_k", "seed", "raw")
SAMPLING_FIELDS = ("model", "max_tokens", "temperature", "top_p", "top_k", "n", "seed", "stop",
                   "stream", "stream_options", "user")  # fmt: skip
CHAT_FIELDS = (*SAMPLING_FIELDS, "messages", "max_completion_tokens")
COMPLETION_FIELDS = (*SAMPLING_FIELDS, "prompt")
# OpenAI fields accepted only at a value that changes nothing (some clients always send them)
NEUTRAL = {
    "presence_penalty": (0,),
    "frequency_penalty": (0,),
    "logit_bias": (None, {}),
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "echo": (False,),
    "best_of": (None, 1),
    "suffix": (None,),
}
ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_STOPS = 4


class RequestError(GrpoError):
    """A bad request field: HTTP 400, or `status` (404 an unknown model, 413 a body too large)."""

    def __init__(self, field: str, problem: str, status: int = 400):
        super().__init__(f"{field}: {problem}")
        self.field = field
        self.status = status


@dataclass(frozen=True)
class GenerateRequest:
    """A /generate body: `text` rendered with the chat template unless `raw`."""

    text: str
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    raw: bool = False


def _show(value, limit: int = 80) -> str:
    """repr(value), cut short: an error line never echoes a whole prompt back."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _is_number(value) -> bool:
    """A finite JSON number (not a bool; a huge integer is no number either)."""
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return abs(value) <= 1 << 53
    return isinstance(value, float) and math.isfinite(value)


def _number(data: dict, key: str, default: float, lo: float, hi: float, lo_open=False) -> float:
    value = data.get(key, default)
    if value is None:
        value = default
    if not _is_number(value):
        raise RequestError(key, f"expected a number, got {_show(value)}")
    if value < lo or value > hi or (lo_open and value == lo):
        bracket = "(" if lo_open else "["
        raise RequestError(key, f"must be in {bracket}{lo}, {hi}], got {_show(value)}")
    return float(value)


def _integer(data: dict, key: str, default: int | None, lo: int, hi: int) -> int | None:
    value = data.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(key, f"expected an integer, got {_show(value)}")
    if not lo <= value <= hi:
        raise RequestError(key, f"must be in [{lo}, {hi}], got {_show(value)}")
    return value


def _json_object(body: bytes, fields: tuple[str, ...], neutral: dict | None = None) -> dict:
    """The body as a JSON object whose keys are all in `fields` (or `neutral` at a neutral
    value); raises `RequestError` naming the first offending key."""
    try:
        data = json.loads(body)
    except ValueError as e:  # bad JSON, bad UTF-8, an integer of over 4300 digits
        raise RequestError("body", f"not valid JSON ({e})") from None
    except RecursionError:
        raise RequestError("body", "JSON nested too deeply") from None
    if not isinstance(data, dict):
        raise RequestError("body", f"expected a JSON object, got {type(data).__name__}")
    neutral = neutral or {}
    for key in sorted(data):
        if key in fields:
            continue
        if key in neutral:
            if data[key] not in neutral[key]:
                raise RequestError(key, f"not supported (only {neutral[key][0]!r})")
            continue
        raise RequestError(key, f"unknown field; valid: {', '.join(fields)}")
    return data


def parse_request(body: bytes, max_tokens_limit: int) -> GenerateRequest:
    """Validate a /generate body; raises `RequestError` naming the field."""
    data = _json_object(body, FIELDS)
    text = data.get("text")
    if text is None:
        raise RequestError("text", "is required")
    if not isinstance(text, str) or not text.strip():
        raise RequestError("text", f"expected a non-empty string, got {_show(text)}")
    raw = data.get("raw", False)
    if not isinstance(raw, bool):
        raise RequestError("raw", f"expected true or false, got {_show(raw)}")
    return GenerateRequest(
        text=text,
        max_tokens=_integer(data, "max_tokens", min(256, max_tokens_limit), 1, max_tokens_limit),
        temperature=_number(data, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(data, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        top_k=_integer(data, "top_k", 0, 0, 1 << 20),
        seed=_integer(data, "seed", None, 0, (1 << 63) - 1),
        raw=raw,
    )


def _stops(data: dict) -> tuple[str, ...]:
    stop = data.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if (
        not isinstance(stops, list)
        or not 1 <= len(stops) <= MAX_STOPS
        or not all(isinstance(s, str) and s for s in stops)
    ):
        raise RequestError(
            "stop",
            f"expected a non-empty string or a list of 1-{MAX_STOPS} of them, got {_show(stop)}",
        )
    return tuple(stops)


def _flag(data: dict, key: str) -> bool:
    value = data.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise RequestError(key, f"expected true or false, got {_show(value)}")
    return value


def _include_usage(data: dict) -> bool:
    options = data.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise RequestError(
            "stream_options", f"expected {{include_usage: bool}}, got {_show(options)}"
        )
    return _flag(options, "include_usage")


def _text_content(content, field: str) -> str:
    """A message's content: a string, or a list of {"type": "text", "text": ...} parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
        for p in content
    ):
        return "".join(p["text"] for p in content)
    raise RequestError(field, f"expected a string or a list of text parts, got {_show(content)}")


def _messages(data: dict) -> list[dict]:
    messages = data.get("messages")
    if messages is None:
        raise RequestError("messages", "is required")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages", "expected a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(messages):
        name = f"messages[{i}]"
        if not isinstance(m, dict):
            raise RequestError(name, f"expected a {{role, content}} object, got {_show(m)}")
        for key in m:
            if key not in ("role", "content", "name"):
                raise RequestError(f"{name}.{key}", "not supported; valid: role, content, name")
        role = m.get("role")
        if role not in ROLES:
            raise RequestError(
                f"{name}.role", f"expected one of {', '.join(ROLES)}, got {_show(role)}"
            )
        if "content" not in m:
            raise RequestError(f"{name}.content", "is required")
        role = "system" if role == "developer" else role  # OpenAI's newer name for it
        out.append({"role": role, "content": _text_content(m["content"], f"{name}.content")})
    return out


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
    """

    engine: Engine
    tokenizer: object
    name: str
    max_tokens_limit: int = 1024
    system_prompt: str | None = None
    enable_thinking: bool | None = None
    max_body_bytes: int = MAX_BODY_BYTES

    def __post_init__(self):
        self.created = int(time.time())

    def encode(self, text: str, field: str) -> list[int]:
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if not ids:
            raise RequestError(field, "encodes to no tokens")
        return ids

    def openai_job(self, body: bytes, chat: bool) -> tuple[Job, bool]:
        """A /v1/chat/completions (`chat`) or /v1/completions body -> (Job, include_usage)."""
        data = _json_object(body, CHAT_FIELDS if chat else COMPLETION_FIELDS, NEUTRAL)
        self.check_model(data)
        prompts = [self.render_chat(_messages(data))] if chat else self.prompts(data)
        # OpenAI's defaults: a chat completion may fill the context, a text completion 16 tokens
        params = self.params(data, prompts, "messages" if chat else "prompt", None if chat else 16)
        return Job(prompts, params, stream=_flag(data, "stream")), _include_usage(data)

    def generate_job(self, body: bytes) -> tuple[Job, GenerateRequest]:
        """A /generate body -> (Job, the parsed request)."""
        req = parse_request(body, self.max_tokens_limit)
        if not req.raw and getattr(self.tokenizer, "chat_template", None):
            ids = self.render_chat([{"role": "user", "content": req.text}], "text")
        else:
            ids = self.encode(req.text, "text")
        ctx = self.engine.context
        if len(ids) + req.max_tokens > ctx:
            raise RequestError("text", f"has {len(ids)} tokens; with max_tokens={req.max_tokens} "
                               f"it needs {len(ids) + req.max_tokens} positions > the model's "
                               f"context of {ctx}")  # fmt: skip
        params = SamplingParams(req.max_tokens, req.temperature, req.top_p, req.top_k,
                                seed=req.seed)  # fmt: skip
        return Job([ids], params), req

    def render_chat(self, messages: list[dict], field: str = "messages") -> list[int]:
        """The chat template's rendering (with the generation prompt) as token ids."""
        tok = self.tokenizer
        if not getattr(tok, "chat_template", None):
            raise RequestError(field, "this model's tokenizer has no chat template; "
                               "use /v1/completions with a prompt")  # fmt: skip
        if self.system_prompt and not any(m["role"] == "system" for m in messages):
            messages = [{"role": "system", "content": self.system_prompt}, *messages]
        kwargs = {} if self.enable_thinking is None else {"enable_thinking": self.enable_thinking}
        try:
            text = tok.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True, **kwargs
            )
        except Exception as e:  # the template's own checks (e.g. role order) raise here
            raise RequestError(field, f"the chat template refused them: {e}") from None
        return self.encode(text, field)

    def prompts(self, data: dict) -> list[list[int]]:
        """/v1/completions `prompt`: a string, a list of strings, token ids, or lists of them."""
        prompt = data.get("prompt")
        if prompt is None:
            raise RequestError("prompt", "is required")
        V = self.engine.sampler.model.config.vocab_size
        items = [prompt] if isinstance(prompt, str) or _is_ids(prompt) else prompt
        if not isinstance(items, list) or not items:
            raise RequestError("prompt", "expected a string, a list of strings, a list of token "
                               f"ids or a list of such lists, got {_show(prompt)}")  # fmt: skip
        out = []
        for i, item in enumerate(items):
            name = "prompt" if len(items) == 1 else f"prompt[{i}]"
            if isinstance(item, str) and item:
                out.append(self.encode(item, name))
            elif _is_ids(item) and item and all(0 <= t < V for t in item):
                out.append(list(item))
            else:
                raise RequestError(name, "expected a non-empty string or a non-empty list of "
                                   f"token ids in [0, {V}), got {_show(item)}")  # fmt: skip
        return out

    def params(self, data: dict, prompts: list[list[int]], field: str, default_max: int | None):
        """SamplingParams of an OpenAI request, checked against the limits and the context."""
        engine, limit = self.engine, self.max_tokens_limit
        n = _integer(data, "n", 1, 1, engine.max_batch_rows)
        if len(prompts) * n > engine.max_batch_rows:
            raise RequestError(field, f"{len(prompts)} prompts x n={n} completions exceed the "
                               f"server's {engine.max_batch_rows} rows per request")  # fmt: skip
        longest = max(len(p) for p in prompts)
        room = engine.context - longest
        if room < 1:
            raise RequestError(field, f"has {longest} tokens; the model's context is "
                               f"{engine.context}")  # fmt: skip
        key = "max_completion_tokens" if data.get("max_completion_tokens") is not None else None
        max_tokens = _integer(data, key or "max_tokens", None, 1, limit)
        if max_tokens is None:
            max_tokens = min(limit, room) if default_max is None else min(default_max, limit, room)
        elif longest + max_tokens > engine.context:
            raise RequestError(field, f"has {longest} tokens; with {key or 'max_tokens'}="
                               f"{max_tokens} it needs {longest + max_tokens} positions > the "
                               f"model's context of {engine.context}")  # fmt: skip
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=_number(data, "temperature", 1.0, 0.0, 2.0),
            top_p=_number(data, "top_p", 1.0, 0.0, 1.0, lo_open=True),
            top_k=_integer(data, "top_k", 0, 0, 1 << 20),
            n=n,
            seed=_integer(data, "seed", None, 0, (1 << 63) - 1),
            stop=_stops(data),
        )

    def check_model(self, data: dict) -> None:
        model = data.get("model")
        if model is None:
            raise RequestError("model", f"is required (this server serves {self.name!r})")
        if not isinstance(model, str):
            raise RequestError("model", f"expected a string, got {_show(model)}")
        if model != self.name:
            raise RequestError("model", f"{_show(model)} is not served here; this server serves "
                               f"{self.name!r} (GET /v1/models)", status=404)  # fmt: skip


def _is_ids(x) -> bool:
    return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

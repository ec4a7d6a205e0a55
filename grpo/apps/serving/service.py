"""What the routes of `grpo serve` share (`Service`): a parsed request body (protocol.py) becomes a
`Job` for the engine: prompts rendered with the chat template and encoded (message contents as
plain text), the server's limits and the model's context enforced, `SamplingParams` made, and
grammars attached for structured outputs and strict tool calls; scoring requests (echo) and
the log-probs of a finished job answered in OpenAI's shapes."""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from grpo.apps.serving.engine import Engine, Job, SamplingParams
from grpo.apps.serving.protocol import (
    MAX_BODY_BYTES,
    ChatBody,
    CompletionBody,
    GenerateRequest,
    RequestError,
    ResponseFormat,
    SamplingBody,
    ScoreRequest,
    check_limit,
    not_text,
    parse_request,
    read_body,
)
from grpo.apps.serving.tools import ToolUse
from grpo.envs.tool_calls import TOOL_CALL_CLOSE, TOOL_CALL_OPEN
from grpo.errors import GrpoError
from grpo.settings import FieldError, brief_repr
from grpo.tokenizer import ChatStructureError, encode_chat

log = logging.getLogger(__name__)


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
        problem = not_text(text)  # e.g. --system-prompt from argv's surrogateescape
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
            problem = not_text(self.system_prompt)  # from argv's surrogateescape
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
        check_limit("n", n, engine.max_batch_rows)
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
            check_limit(key, max_tokens, limit)
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


def _top_dict(alternatives: list[tuple[int, float]], token) -> dict[str, float]:
    """OpenAI's top_logprobs entry: token text -> log-prob, most likely first (two ids that
    decode alike keep the likelier)."""
    out: dict[str, float] = {}
    for i, value in alternatives:
        out.setdefault(token(i), value)
    return out


def _is_ids(x) -> bool:
    return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

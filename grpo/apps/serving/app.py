"""The FastAPI application of `grpo serve`: routes, OpenAI response shapes, server-sent events,
the API key.

Bodies are parsed by `Service` (service.py) into `Job`s on a worker thread (JSON, checks,
chat rendering and tokenizing take seconds on a 1 MiB body; the event loop, and /health, go
on meanwhile); the `Engine` runs the jobs on its own thread, and its events come back to the
event loop through `call_soon_threadsafe`.
"""

# No `from __future__ import annotations` here: FastAPI reads the routes' annotations at
# definition time, and `Request` is imported inside `build_app` (fastapi is optional).
import asyncio
import hashlib
import hmac
import json
import logging
import time
import uuid

from grpo.apps.serving.engine import Job, Unavailable
from grpo.apps.serving.protocol import RequestError, ScoreRequest
from grpo.apps.serving.service import Service
from grpo.apps.serving.tools import ToolStream, ToolUse

log = logging.getLogger(__name__)
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    503: "server_busy",
}
IGNORED_HEADER = "X-Ignored-Fields"  # the unknown top-level fields a request sent (not used)
# the most of that header's value: a client reads headers of at most ~64 KB (h11, httpx)
IGNORED_HEADER_CHARS = 1024
OPEN_PATHS = ("/health",)  # answered without the API key (load balancers, probes)


def ignored_value(names) -> str:
    """`IGNORED_HEADER`'s value: the names, comma-separated, cut at `IGNORED_HEADER_CHARS`
    with how many more there were (20,000 unknown fields would make a header no client
    reads, and the reply with it)."""
    shown, size = [], 0
    for name in names:
        if size + len(name) + 2 > IGNORED_HEADER_CHARS:
            return ", ".join(shown) + f", ... ({len(names) - len(shown)} more)"
        shown.append(name)
        size += len(name) + 2
    return ", ".join(shown)


def _usage(job: Job) -> dict:
    completion = sum(c.tokens for c in job.result)
    return {
        "prompt_tokens": job.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": job.prompt_tokens + completion,
    }


def _sse(payload) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


def _call_soon(loop, fn, *args) -> None:
    """Run `fn(*args)` on `loop` from the engine's thread (dropped once the loop is gone)."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the loop has closed: nobody waits for the answer any more
        pass


class BearerAuth:
    """ASGI middleware: a request to any path but `OPEN_PATHS` must carry
    `Authorization: Bearer KEY` (what the openai client sends), else `unauthorized(path)`
    answers (401) before its body is read. The keys are compared as SHA-256 digests with
    `hmac.compare_digest`: constant time, and the length of the key does not show either.

    Args:
        app: the application behind.
        key: the key (never logged nor echoed).
        unauthorized: path -> the 401 response (an ASGI application).
    """

    def __init__(self, app, key: str, unauthorized):
        self.app = app
        self.digest = hashlib.sha256(key.encode()).digest()
        self.unauthorized = unauthorized

    def authorized(self, headers) -> bool:
        value = next((v for k, v in headers if k == b"authorization"), b"")
        scheme, _, token = value.strip().partition(b" ")
        sent = hashlib.sha256(token.strip()).digest()
        return hmac.compare_digest(sent, self.digest) and scheme.lower() == b"bearer"

    async def __call__(self, scope, receive, send):
        if (
            scope["type"] != "http"
            or scope["path"] in OPEN_PATHS
            or self.authorized(scope["headers"])
        ):
            return await self.app(scope, receive, send)
        await self.unauthorized(scope["path"])(scope, receive, send)


def build_app(service: Service, on_startup=None, api_key: str | None = None):
    """The FastAPI application over `service`.

    Args:
        service: parses requests and holds the engine.
        on_startup: called once the application has started (before the first request).
        api_key: when given, every route but /health answers 401 without
            `Authorization: Bearer API_KEY` (`BearerAuth`).

    Returns:
        a `fastapi.FastAPI`.
    """
    from contextlib import asynccontextmanager

    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from starlette.exceptions import HTTPException
    from starlette.requests import ClientDisconnect

    def error(status: int, message: str, field: str | None, openai: bool, headers=None):
        """OpenAI's error shape on /v1 routes; {"error", "field"} on /generate (its contract)."""
        if openai:
            codes = {401: "invalid_api_key", 404: "model_not_found" if field == "model" else None}
            code = codes.get(status)
            kind = ERROR_TYPES.get(status, "server_error")
            body = {"error": {"message": message, "type": kind, "param": field, "code": code}}
        else:
            body = {"error": message} if field is None else {"error": message, "field": field}
        return JSONResponse(body, status_code=status, headers=headers)

    def refused(e: Exception, openai: bool):
        if isinstance(e, Unavailable):
            return error(503, str(e), None, openai, headers={"Retry-After": "1"})
        field = e.field if e.status != 413 else None
        return error(e.status, str(e), field, openai)

    async def read_body(request: Request) -> bytes:
        """The body, refused (413) once over the limit, whatever Content-Length claims. A
        client that disconnects before sending it all costs one log line (not Starlette's
        `ClientDisconnect` traceback) and gets a 400 it will not read."""
        limit = service.max_body_bytes
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise RequestError("body", f"{length} bytes; the limit is {limit}", status=413)
        body = bytearray()
        try:
            async for chunk in request.stream():
                body += chunk
                if len(body) > limit:
                    raise RequestError("body", f"over the limit of {limit} bytes", status=413)
        except ClientDisconnect:
            log.info(
                "POST %s: the client disconnected after %d bytes of its body",
                request.url.path,
                len(body),
            )
            raise RequestError("body", "the client disconnected before sending it all") from None
        return bytes(body)

    async def run(job: Job) -> Job:
        """Submit `job` (raises `Unavailable`) and wait until it is done."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def notify(event):
            if event[0] == "done":
                _call_soon(loop, lambda: done.done() or done.set_result(None))

        job.notify = notify
        service.engine.submit(job)
        await done
        return job

    @asynccontextmanager
    async def lifespan(app):
        if on_startup is not None:
            on_startup()
        yield

    app = FastAPI(
        title="grpo serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    if api_key is not None:
        message = (
            "a valid API key is required: send the header 'Authorization: Bearer KEY' "
            "(the key given to grpo serve by --api-key or $GRPO_API_KEY)"
        )
        headers = {"WWW-Authenticate": "Bearer"}
        app.add_middleware(
            BearerAuth,
            key=api_key,
            unauthorized=lambda path: error(401, message, None, path.startswith("/v1"), headers),
        )

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        path = request.url.path
        if exc.status_code == 404:
            message = (
                f"no route {path!r}; the routes are POST /v1/chat/completions, "
                "/v1/completions, /generate and GET /v1/models, /v1/models/{id}, "
                "/health"
            )
        elif exc.status_code == 405:
            message = f"{request.method} is not allowed on {path}; use {exc.headers['Allow']}"
        else:
            message = str(exc.detail)
        return error(exc.status_code, message, None, path.startswith("/v1"), exc.headers)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):
        # a bug: JSON like every other answer (Starlette still logs the traceback)
        message = f"internal error: {type(exc).__name__}: {exc}"
        return error(500, message, None, request.url.path.startswith("/v1"))

    @app.get("/health")
    async def health():
        e = service.engine
        status = "ok" if e.accepting else "shutting_down"
        return {
            "status": status,
            "model": service.name,
            "queued": e.queued,
            "running": len(e.running),
            "in_flight": e.queued + len(e.running),
            "batches": e.calls,
        }

    @app.get("/v1/models")
    async def models():
        card = {
            "id": service.name,
            "object": "model",
            "created": service.created,
            "owned_by": "grpo",
            "max_model_len": service.engine.context,
        }
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        try:
            service.check_model(model_id)
        except RequestError as e:
            return refused(e, openai=True)
        return (await models())["data"][0]

    @app.post("/generate")
    async def generate(request: Request):
        try:
            job, req = await asyncio.to_thread(service.generate_job, await read_body(request))
            await run(job)
        except (RequestError, Unavailable) as e:
            return refused(e, openai=False)
        if job.error:
            return error(*job.error, None, False)
        c = job.result[0]
        return {
            "text": c.text,
            "tokens": c.tokens,
            "logprob": c.logprob,
            "finish_reason": c.finish_reason,
            "seed": req.seed,
        }

    async def openai_route(request: Request, chat: bool):
        try:
            body = await read_body(request)
            job, include_usage, use = await asyncio.to_thread(service.openai_job, body, chat)
            if isinstance(job, ScoreRequest):  # echo: the prompt's log-probs, no generation
                choices, usage = await asyncio.to_thread(service.score, job)
                head = {
                    "id": f"cmpl-{uuid.uuid4().hex[:24]}",
                    "object": "text_completion",
                    "created": int(time.time()),
                    "model": service.name,
                }
                return {**head, "choices": choices, "usage": usage}
            request.state.ignored = job.ignored
            head = {
                "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}",
                "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()),
                "model": service.name,
            }
            if job.stream:
                return streaming(job, head, chat, include_usage, use)
            await run(job)
        except (RequestError, Unavailable) as e:
            return refused(e, openai=True)
        if job.error:
            return error(*job.error, None, True)
        tokens = None
        if job.top_logprobs is not None:  # the reply's tokens scored (one more forward)
            tokens = await asyncio.to_thread(service.choice_logprobs, job, job.top_logprobs)
        if chat:
            choices = []
            for c in job.result:
                message = {"role": "assistant", "content": c.text}
                reason = c.finish_reason
                if use is not None:  # the reply's tool calls, read out of its text
                    message, reason = use.message(use.prefix + c.text, reason)
                lp = None if tokens is None else service.chat_logprobs(tokens[len(choices)])
                choices.append(
                    {"index": c.index, "message": message, "logprobs": lp, "finish_reason": reason}
                )
        else:
            choices = [
                {
                    "index": c.index,
                    "text": c.text,
                    "finish_reason": c.finish_reason,
                    "logprobs": None if tokens is None else service.text_logprobs(t),
                }
                for c, t in zip(job.result, tokens or [None] * len(job.result))
            ]
        return {**head, "choices": choices, "usage": _usage(job)}

    def streaming(job: Job, head: dict, chat: bool, include_usage: bool, use: ToolUse | None):
        """Submit `job` now (a 503 comes before any byte is sent), then its events as SSE:
        per choice the role (chat), text deltas, a finish_reason; usage if asked; [DONE].
        With tools, content streams until a call begins and the calls come at the end
        (`delta.tool_calls`, parsed from the choice's full text)."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        job.notify = lambda event: _call_soon(loop, events.put_nowait, event)
        service.engine.submit(job)
        if chat:
            head = {**head, "object": "chat.completion.chunk"}

        def chunk(index: int, delta: dict, reason: str | None = None) -> str:
            if chat:
                choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": reason}
            else:
                choice = {
                    "index": index,
                    "text": delta.get("content", ""),
                    "logprobs": None,
                    "finish_reason": reason,
                }
            return _sse({**head, "choices": [choice]})

        tool_streams = [ToolStream(use) for _ in range(job.rows)] if use else None

        async def body():
            # the role chunks are one write, each delta one, the end one: after a lost
            # connection asyncio logs a line for each write past the 5th, so a disconnected
            # client must be noticed (this generator closed) before more writes pile up
            finished = False
            try:
                if chat:
                    yield "".join(
                        chunk(i, {"role": "assistant", "content": ""}) for i in range(job.rows)
                    )
                while (event := await events.get())[0] == "delta":
                    text = event[2]
                    if tool_streams is not None:
                        text = tool_streams[event[1]].feed(text)
                    if text:
                        yield chunk(event[1], {"content": text})
                        await asyncio.sleep(0)  # a lost connection is noticed here
                end = []
                if job.error:  # after the 200: an error event, as OpenAI's API sends one
                    status, message = job.error
                    end.append(
                        _sse(
                            {
                                "error": {
                                    "message": message,
                                    "type": "server_error",
                                    "param": None,
                                    "code": status,
                                }
                            }
                        )
                    )
                else:
                    for c in job.result:
                        reason = c.finish_reason
                        if tool_streams is not None:
                            stream = tool_streams[c.index]
                            deltas, reason = stream.finish(use.prefix + c.text, reason)
                            end += [chunk(c.index, delta) for delta in deltas]
                        end.append(chunk(c.index, {}, reason))
                    if include_usage:
                        end.append(_sse({**head, "choices": [], "usage": _usage(job)}))
                end.append(_sse("[DONE]"))
                yield "".join(end)
                finished = True
            finally:
                if not finished:  # the client went away: its rows stop at the next step
                    job.cancelled = True

        return StreamingResponse(
            body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )

    def ignored_header(request: Request, answer):
        """The answer with `IGNORED_HEADER` naming the unknown fields the request sent."""
        names = getattr(request.state, "ignored", ())
        if not names:
            return answer
        if not isinstance(answer, Response):
            answer = JSONResponse(answer)
        answer.headers[IGNORED_HEADER] = ignored_value(names)
        return answer

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return ignored_header(request, await openai_route(request, chat=True))

    @app.post("/v1/completions")
    async def completions(request: Request):
        return ignored_header(request, await openai_route(request, chat=False))

    return app

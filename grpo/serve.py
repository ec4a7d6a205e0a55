"""`grpo serve`: a small HTTP JSON endpoint over our sampler (stdlib `http.server`).

    grpo serve --model runs/merged --port 8000
    curl -s localhost:8000/generate -d '{"text": "What is 48 + 24?", "max_tokens": 64}'
    -> {"text": "...", "tokens": 17, "logprob": -5.21, "finish_reason": "stop"}

POST /generate takes a JSON object {text (required), max_tokens, temperature, top_p, top_k,
seed, raw}. `text` is rendered with the model's chat template unless `raw` is true. `tokens`
is the number of completion tokens (the stop token included), `logprob` their summed log-prob
under the sampling distribution (softmax at `temperature`; 1 when greedy). A malformed request
gets 400 with {"error": ..., "field": ...}; when `max_queue` requests already wait behind the
running one, the answer is 503 at once. One model call runs at a time, behind a lock: the
sampler's KV cache is per call, and one batch at a time keeps memory bounded. GET /health says
which model is loaded and how many requests are in. Serve a merged checkpoint (`grpo merge`)
in production; `--adapter` folds an adapter in at start-up.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from grpo.errors import GrpoError

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 1 << 20
FIELDS = ("text", "max_tokens", "temperature", "top_p", "top_k", "seed", "raw")


class RequestError(GrpoError):
    """A bad request field (HTTP 400)."""

    def __init__(self, field: str, problem: str):
        super().__init__(f"{field}: {problem}")
        self.field = field


@dataclass(frozen=True)
class GenerateRequest:
    text: str
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    raw: bool = False


def _number(data: dict, key: str, default: float, lo: float, hi: float, lo_open=False) -> float:
    value = data.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RequestError(key, f"expected a number, got {value!r}")
    if value < lo or value > hi or (lo_open and value == lo):
        bracket = "(" if lo_open else "["
        raise RequestError(key, f"must be in {bracket}{lo}, {hi}], got {value!r}")
    return float(value)


def _integer(data: dict, key: str, default: int | None, lo: int, hi: int) -> int | None:
    value = data.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(key, f"expected an integer, got {value!r}")
    if not lo <= value <= hi:
        raise RequestError(key, f"must be in [{lo}, {hi}], got {value!r}")
    return value


def parse_request(body: bytes, max_tokens_limit: int) -> GenerateRequest:
    """Validate a /generate body; raises `RequestError` naming the field."""
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RequestError("body", f"not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise RequestError("body", f"expected a JSON object, got {type(data).__name__}")
    unknown = sorted(set(data) - set(FIELDS))
    if unknown:
        raise RequestError(unknown[0], f"unknown field; valid: {', '.join(FIELDS)}")
    text = data.get("text")
    if text is None:
        raise RequestError("text", "is required")
    if not isinstance(text, str) or not text.strip():
        raise RequestError("text", f"expected a non-empty string, got {text!r}")
    raw = data.get("raw", False)
    if not isinstance(raw, bool):
        raise RequestError("raw", f"expected true or false, got {raw!r}")
    return GenerateRequest(
        text=text,
        max_tokens=_integer(data, "max_tokens", min(256, max_tokens_limit), 1, max_tokens_limit),
        temperature=_number(data, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(data, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        top_k=_integer(data, "top_k", 0, 0, 1 << 20),
        seed=_integer(data, "seed", None, 0, (1 << 63) - 1),
        raw=raw,
    )


class Generator:
    """Prompt text -> completion with one model; one call at a time (`lock`).

    Args:
        model: a `Decoder`.
        tokenizer: its tokenizer.
        stop_ids: ids that end a completion.
        name: what /health reports.
        max_tokens_limit: the largest max_tokens a request may ask for.
        system_prompt / enable_thinking: passed to the chat template.
        seed: first seed of requests that give none (then +1 per request).
    """

    def __init__(
        self, model, tokenizer, stop_ids: list[int], name: str = "model",
        max_tokens_limit: int = 1024, system_prompt: str | None = None,
        enable_thinking: bool | None = None, seed: int = 0,
    ):  # fmt: skip
        from grpo.rollout import Sampler

        self.sampler = Sampler(model)
        self.tokenizer = tokenizer
        self.stop_ids = stop_ids
        self.name = name
        self.max_tokens_limit = max_tokens_limit
        self.system_prompt = system_prompt
        self.enable_thinking = enable_thinking
        self.lock = threading.Lock()
        self._seeds = itertools.count(seed)

    def generate(self, req: GenerateRequest) -> dict:
        from grpo.tokenizer import render_prompt

        tok = self.tokenizer
        chat = not req.raw and getattr(tok, "chat_template", None)
        prompt = (
            render_prompt(tok, req.text, self.system_prompt, self.enable_thinking)
            if chat
            else req.text
        )
        ids = tok(prompt, add_special_tokens=False)["input_ids"]
        if not ids:
            raise RequestError("text", "encodes to no tokens")
        with self.lock:
            seed = req.seed if req.seed is not None else next(self._seeds)
            r = self.sampler.sample(
                [ids], group_size=1, max_new_tokens=req.max_tokens, temperature=req.temperature,
                top_k=req.top_k, top_p=req.top_p, stop_ids=self.stop_ids, seed=seed,
                pad_id=tok.pad_token_id if tok.pad_token_id is not None else 0,
            )  # fmt: skip
        return {
            "text": r.decode(tok, skip_special_tokens=True)[0],
            "tokens": int(r.completion_lens[0]),
            "logprob": float(r.logprobs[0].sum()),
            "finish_reason": "stop" if bool(r.finished[0]) else "length",
            "seed": seed,
        }


class Slots:
    """A bounded count of requests in the server (running + waiting); full -> 503."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.count = 0
        self._lock = threading.Lock()

    def try_enter(self) -> bool:
        with self._lock:
            if self.count >= self.capacity:
                return False
            self.count += 1
            return True

    def leave(self) -> None:
        with self._lock:
            self.count -= 1


class GenerationServer(ThreadingHTTPServer):
    """A threading HTTP server holding the generator and the request slots."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], generator: Generator | None, max_queue: int = 8):
        self.generator = generator
        self.slots = Slots(max_queue + 1)  # one running + max_queue waiting
        super().__init__(address, _Handler)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"


class _Handler(BaseHTTPRequestHandler):
    server: GenerationServer

    def log_message(self, format, *args):  # http.server prints every request to stderr
        log.debug("%s " + format, self.address_string(), *args)

    def _send(self, code: int, payload: dict, headers: dict | None = None) -> None:
        body = json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(body)

    def _error(self, code: int, message: str, field: str | None = None, headers=None) -> None:
        payload = {"error": message} if field is None else {"error": message, "field": field}
        self._send(code, payload, headers)

    def do_GET(self):
        if self.path == "/health":
            g = self.server.generator
            self._send(200, {"status": "ok", "model": g.name, "in_flight": self.server.slots.count})
        elif self.path == "/generate":
            self._error(405, "use POST /generate with a JSON body", headers={"Allow": "POST"})
        else:
            self._error(404, f"no route {self.path!r}; POST /generate or GET /health")

    def do_POST(self):
        if self.path != "/generate":
            return self._error(404, f"no route {self.path!r}; POST /generate or GET /health")
        length = self.headers.get("Content-Length")
        if length is None:
            return self._error(411, "Content-Length is required")
        try:
            n = int(length)
        except ValueError:
            return self._error(400, f"bad Content-Length {length!r}")
        if n < 0 or n > MAX_BODY_BYTES:
            return self._error(413, f"body of {n} bytes; the limit is {MAX_BODY_BYTES}")
        body = self.rfile.read(n)
        try:
            req = parse_request(body, self.server.generator.max_tokens_limit)
        except RequestError as e:
            return self._error(400, str(e), e.field)
        if not self.server.slots.try_enter():
            return self._error(
                503,
                "server busy: the request queue is full, retry later",
                headers={"Retry-After": "1"},
            )
        try:
            out = self.server.generator.generate(req)
        except RequestError as e:
            return self._error(400, str(e), e.field)
        except GrpoError as e:  # e.g. prompt + max_tokens longer than the context
            return self._error(400, str(e))
        except Exception as e:
            log.exception("generation failed")
            return self._error(500, f"internal error: {type(e).__name__}: {e}")
        finally:
            self.server.slots.leave()
        self._send(200, out)


def load_generator(
    model: str, adapter: str | None = None, dtype: str = "float32", device: str = "auto", **kw
) -> Generator:
    """A `Generator` over a checkpoint (or a run / adapter directory) plus an optional adapter."""
    from grpo.pipeline import TrainedModel, load_trained_model, resolve_trained

    spec = resolve_trained(model)
    if adapter:
        spec = TrainedModel(spec.path, (*spec.adapters, adapter), spec.tokenizer)
    net, tok, stops, _ = load_trained_model(spec, dtype, device)
    name = model if not adapter else f"{model}+{adapter}"
    return Generator(net, tok, stops, name=name, **kw)


def cmd_serve(args) -> int:
    """`grpo serve`: load the model, then answer requests until interrupted."""
    if args.max_queue < 0:
        raise GrpoError(f"--max-queue must be >= 0, got {args.max_queue}")
    if args.max_tokens_limit < 1:
        raise GrpoError(f"--max-tokens-limit must be >= 1, got {args.max_tokens_limit}")
    thinking = {"true": True, "false": False, None: None}[args.enable_thinking]
    try:  # take the port before the (slow) model load, so a busy port fails at once
        server = GenerationServer((args.host, args.port), None, args.max_queue)
    except OSError as e:
        raise GrpoError(f"cannot listen on {args.host}:{args.port}: {e}") from None
    try:
        server.generator = generator = load_generator(
            args.model, args.adapter, dtype=args.dtype, device=args.device,
            max_tokens_limit=args.max_tokens_limit, system_prompt=args.system_prompt,
            enable_thinking=thinking, seed=args.seed,
        )  # fmt: skip
    except BaseException:
        server.server_close()
        raise
    print(f"serving {generator.name} on {server.url} (POST /generate, GET /health)", flush=True)
    if args.on_ready is not None:  # tests and embedders get the server (to call shutdown())
        args.on_ready(server)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


def add_parser(subparsers) -> None:
    """Add `grpo serve` to the CLI's subparsers."""
    p = subparsers.add_parser("serve", help="HTTP JSON endpoint: POST /generate {text, ...}")
    p.add_argument("--model", required=True, help="checkpoint dir, hub id, or a run directory")
    p.add_argument("--adapter", default=None, help="a LoRA adapter to fold in at start-up")
    p.add_argument("--host", default="127.0.0.1", help="interface (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (0: any free port)")
    p.add_argument("--max-queue", type=int, default=8, help="requests waiting before 503")
    p.add_argument("--max-tokens-limit", type=int, default=1024, help="largest max_tokens")
    p.add_argument("--system-prompt", default=None)
    p.add_argument("--enable-thinking", choices=("true", "false"), default=None)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    p.add_argument("--seed", type=int, default=0, help="seed of the first request without one")
    p.set_defaults(func=cmd_serve, on_ready=None)

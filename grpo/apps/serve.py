"""`grpo serve`: an OpenAI-compatible HTTP API over our sampler (FastAPI + uvicorn).

    grpo serve --model runs/merged --port 8000
    curl -s localhost:8000/v1/chat/completions -H 'Content-Type: application/json' -d \
      '{"model": "runs/merged", "messages": [{"role": "user", "content": "What is 48 + 24?"}]}'

Routes: POST /v1/chat/completions (messages rendered with the model's chat template) and
POST /v1/completions (raw text or token ids), each with max_tokens, temperature, top_p, top_k,
n, seed, stop and `stream: true` (server-sent events); GET /v1/models; GET /health; and the
original POST /generate {text, max_tokens, temperature, top_p, top_k, seed, raw} ->
{text, tokens, logprob, finish_reason, seed}. With --api-key (or $GRPO_API_KEY) every route
but /health wants `Authorization: Bearer KEY` (else 401). This module is the process: the
socket (taken before the model loads), uvicorn, and shutdown: on SIGINT / SIGTERM new requests
get 503, queued and running ones finish for up to --shutdown-timeout seconds (then 503); a
second signal stops at once; exit 0 with no traceback either way. `grpo.apps.serving` holds
the parts (engine, request parsing, app); docs/serving.md the guarantees.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import socket
from collections.abc import Mapping
from dataclasses import dataclass

from grpo.apps.serving.engine import Engine
from grpo.apps.serving.protocol import MAX_BODY_BYTES
from grpo.apps.serving.service import Service
from grpo.errors import GrpoError
from grpo.settings import between, check_value

log = logging.getLogger(__name__)
API_KEY_ENV = "GRPO_API_KEY"


@dataclass
class Running:
    """What `on_ready` gets once the server answers: its address, service and a way to stop."""

    url: str
    service: Service
    server: object  # the uvicorn.Server

    @property
    def engine(self) -> Engine:
        return self.service.engine

    def shutdown(self) -> None:
        """Stop as on SIGTERM (callable from any thread)."""
        self.service.engine.drain()
        self.server.should_exit = True


def api_key(flag: str | None, environ: Mapping[str, str] = os.environ) -> str | None:
    """The key clients must send: --api-key, else $GRPO_API_KEY; None when neither is set.

    Raises:
        GrpoError: the key is empty or not printable ASCII without white space (an HTTP
            header carries it). The message names where the key came from, never the key.
    """
    source, key = "--api-key", flag
    if flag is None:
        source, key = API_KEY_ENV, environ.get(API_KEY_ENV)
    if key is None:
        return None
    if not key:
        raise GrpoError(f"{source} is set but empty; unset it to serve without a key")
    if not (key.isascii() and key.isprintable()) or any(c.isspace() for c in key):
        raise GrpoError(
            f"{source}: the API key must be printable ASCII without white space "
            "(clients send it in the Authorization header)"
        )
    return key


class _NoCancelledTracebacks(logging.Filter):
    """Drops uvicorn's "Exception in ASGI application" records of a request task cancelled
    because the server stops now (a second signal): the stop is the expected outcome."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, asyncio.CancelledError)


def _uvicorn_server(config, engine: Engine, shutdown_timeout: float):
    """A uvicorn.Server whose shutdown lets the engine finish its jobs (up to the timeout,
    then 503) and which does not re-raise the signal afterwards (uvicorn's default), so
    SIGINT / SIGTERM end the process with exit code 0 and no traceback. A second signal stops
    at once, as quietly (`_stop_now`)."""
    import uvicorn

    class Server(uvicorn.Server):
        def run(self, sockets=None):
            quiet, logger = _NoCancelledTracebacks(), logging.getLogger("uvicorn.error")
            logger.addFilter(quiet)
            try:
                super().run(sockets)
            finally:
                logger.removeFilter(quiet)

        def handle_exit(self, sig, frame):
            engine.drain()
            if self.should_exit:  # a second signal: stop now, fail what is left
                log.info("%s again: stopping now", signal.Signals(sig).name)
                self.force_exit = True
                engine.abort()
            else:
                log.info(
                    "%s: finishing %d running and %d queued requests (up to %gs), then exiting",
                    signal.Signals(sig).name,
                    len(engine.running),
                    engine.queued,
                    shutdown_timeout,
                )
            self.should_exit = True

        async def shutdown(self, sockets=None):
            engine.drain()
            loop = asyncio.get_running_loop()
            closing = loop.run_in_executor(None, engine.close, shutdown_timeout)
            await super().shutdown(sockets)
            await closing
            if self.force_exit:
                await self._stop_now()

        async def _stop_now(self):
            """After a second signal uvicorn skips the application's shutdown and leaves the
            requests running, and asyncio.run then cancels them: a `CancelledError` traceback
            each. Instead: end the lifespan, and the requests (every job has failed with 503
            by now, so they end at once; connections still open after a second are cut)."""
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.lifespan.shutdown(), 5.0)
            for cut in (False, True):
                if cut:
                    for conn in list(self.server_state.connections):
                        conn.transport.close()
                tasks = [t for t in self.server_state.tasks if not t.done()]
                if tasks:
                    await asyncio.wait(tasks, timeout=1.0)

    return Server(config)


def _listen(host: str, port: int) -> socket.socket:
    """A listening socket, taken before the (slow) model load so a busy port fails at once.
    Its protocol is named: asyncio sets TCP_NODELAY only on connections whose socket says
    IPPROTO_TCP, and without it a keep-alive client (the openai client) waited 40 ms for
    each answer (Nagle's algorithm against the client's delayed ACK)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except (OSError, OverflowError) as e:  # in use, no such interface; a port over 65535
        sock.close()
        raise GrpoError(f"cannot listen on {host}:{port}: {e}") from None
    return sock


def load_engine(
    model: str, adapter: str | None = None, dtype: str = "float32", device: str = "auto", **kw
):
    """(Engine, tokenizer) over a checkpoint (or a run / adapter directory) plus an adapter."""
    from grpo.loading import TrainedModel, load_trained_model, resolve_trained

    spec = resolve_trained(model)
    if adapter:
        spec = TrainedModel(spec.path, (*spec.adapters, adapter), spec.tokenizer)
    net, tok, stops, _ = load_trained_model(spec, dtype, device)
    return Engine(net, tok, stops, **kw), tok


def cmd_serve(args) -> int:
    """`grpo serve`: load the model, then answer requests until SIGINT / SIGTERM."""
    for flag, value, lo in (
        ("--max-queue", args.max_queue, 0),
        ("--max-batch-rows", args.max_batch_rows, 1),
        ("--max-tokens-limit", args.max_tokens_limit, 1),
        ("--max-request-bytes", args.max_request_bytes, 1),
        ("--batch-window-ms", args.batch_window_ms, 0),
        ("--shutdown-timeout", args.shutdown_timeout, 0),
    ):
        check_value(flag, value, between(lo))  # (nan fails too)
    check_value("--port", args.port, between(0, 65535))
    key = api_key(args.api_key)
    try:
        import fastapi  # noqa: F401
        import uvicorn
    except ImportError as e:
        raise GrpoError(
            f"grpo serve needs fastapi and uvicorn ({e}); pip install 'grpo[serve]'"
        ) from None
    thinking = {"true": True, "false": False, None: None}[args.enable_thinking]
    sock = _listen(args.host, args.port)
    try:
        engine, tok = load_engine(
            args.model,
            args.adapter,
            dtype=args.dtype,
            device=args.device,
            max_queue=args.max_queue,
            max_batch_rows=args.max_batch_rows,
            batch_window_ms=args.batch_window_ms,
            seed=args.seed,
        )
    except BaseException:
        sock.close()
        raise
    name = args.served_model_name or (
        args.model if not args.adapter else f"{args.model}+{args.adapter}"
    )
    service = Service(
        engine,
        tok,
        name,
        args.max_tokens_limit,
        args.system_prompt,
        thinking,
        args.max_request_bytes,
        args.strict_requests,
    )
    host, port = sock.getsockname()[:2]
    url = f"http://{'[' + host + ']' if ':' in host else host}:{port}"
    holder: dict = {}

    def on_startup():
        auth = "; an API key on all but /health" if key is not None else ""
        print(
            f"serving {name} on {url} (POST /v1/chat/completions, /v1/completions, "
            f"/generate; GET /v1/models, /health){auth}",
            flush=True,
        )
        if args.on_ready is not None:  # tests and embedders get the handle (to shut down)
            args.on_ready(holder["running"])

    from grpo.apps.serving.app import build_app

    app = build_app(service, on_startup, api_key=key)
    config = uvicorn.Config(
        app,
        lifespan="on",
        log_config=None,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=None,
    )
    server = _uvicorn_server(config, engine, args.shutdown_timeout)
    holder["running"] = Running(url, service, server)
    engine.start()
    # the objects of torch, transformers and the model live as long as the server: frozen,
    # full collections (set off by a request that allocates much, e.g. a 1 MiB body) skip
    # them, instead of holding the GIL, and /health, for a third of a second
    gc.collect()
    gc.freeze()
    try:
        server.run(sockets=[sock])
    finally:
        gc.unfreeze()
        engine.close(0.0)  # a no-op after a graceful shutdown; else fails what is left
        sock.close()
    log.info("server stopped")
    return 0


def add_parser(subparsers) -> None:
    """Add `grpo serve` to the CLI's subparsers."""
    p = subparsers.add_parser(
        "serve", help="OpenAI-compatible HTTP API: /v1/chat/completions, /v1/completions, ..."
    )
    p.add_argument("--model", required=True, help="checkpoint dir, hub id, or a run directory")
    p.add_argument("--adapter", default=None, help="a LoRA adapter to fold in at start-up")
    p.add_argument(
        "--served-model-name",
        default=None,
        help="the name clients pass as `model` (default: --model as given)",
    )
    p.add_argument("--host", default="127.0.0.1", help="interface (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (0: any free port)")
    p.add_argument(
        "--api-key",
        default=None,
        help="clients must send 'Authorization: Bearer KEY' (all routes but /health); "
        f"default ${API_KEY_ENV}, which keeps the key out of the process list",
    )
    p.add_argument(
        "--max-queue",
        type=int,
        default=64,
        help="requests waiting for a batch before 503 (default 64)",
    )
    p.add_argument(
        "--max-batch-rows",
        type=int,
        default=32,
        help="rows (prompts x n) in one sampler call; also a request's limit",
    )
    p.add_argument(
        "--batch-window-ms",
        type=float,
        default=5.0,
        help="how long a request waits for others to share its batch",
    )
    p.add_argument("--max-tokens-limit", type=int, default=1024, help="largest max_tokens")
    p.add_argument(
        "--max-request-bytes",
        type=int,
        default=MAX_BODY_BYTES,
        help="larger request bodies get 413",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="on SIGINT/SIGTERM, seconds the queued requests may still run",
    )
    p.add_argument(
        "--system-prompt", default=None, help="system message for chat requests that bring none"
    )
    p.add_argument("--enable-thinking", choices=("true", "false"), default=None)
    p.add_argument(
        "--strict-requests",
        action="store_true",
        help="refuse (400) unknown fields on the OpenAI routes instead of ignoring them "
        "(logged, named in the X-Ignored-Fields header)",
    )
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="first seed of the server's sequence (requests without a seed)",
    )
    p.set_defaults(func=cmd_serve, on_ready=None)

"""`grpo serve`: an OpenAI-compatible HTTP API over our sampler (FastAPI + uvicorn).

    grpo serve --model runs/merged --port 8000
    curl -s localhost:8000/v1/chat/completions -H 'Content-Type: application/json' -d \
      '{"model": "runs/merged", "messages": [{"role": "user", "content": "What is 48 + 24?"}]}'

Routes: POST /v1/chat/completions (messages rendered with the model's chat template) and
POST /v1/completions (raw text or token ids), each with max_tokens, temperature, top_p, top_k,
n, seed, stop and `stream: true` (server-sent events); GET /v1/models; GET /health; and the
original POST /generate {text, max_tokens, temperature, top_p, top_k, seed, raw} ->
{text, tokens, logprob, finish_reason, seed}. This module is the process: the socket (taken
before the model loads), uvicorn, and shutdown: on SIGINT / SIGTERM new requests get 503,
queued and running ones finish for up to --shutdown-timeout seconds (then 503), exit 0 with
no traceback. `grpo.apps.serving` holds the parts (engine, request parsing, app);
docs/serving.md the guarantees.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from dataclasses import dataclass

from grpo.apps.serving.engine import Engine
from grpo.apps.serving.protocol import MAX_BODY_BYTES, Service
from grpo.errors import GrpoError
from grpo.settings import between, check_value

log = logging.getLogger(__name__)


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


def _uvicorn_server(config, engine: Engine, shutdown_timeout: float):
    """A uvicorn.Server whose shutdown lets the engine finish its jobs (up to the timeout,
    then 503) and which does not re-raise the signal afterwards (uvicorn's default), so
    SIGINT / SIGTERM end the process with exit code 0 and no traceback."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            engine.drain()
            if self.should_exit:  # a second signal: stop now, fail what is left
                log.info("%s again: stopping now", signal.Signals(sig).name)
                self.force_exit = True
                engine.abort()
            else:
                log.info("%s: finishing %d running and %d queued requests (up to %gs), then "
                         "exiting", signal.Signals(sig).name, len(engine.running), engine.queued,
                         shutdown_timeout)  # fmt: skip
            self.should_exit = True

        async def shutdown(self, sockets=None):
            engine.drain()
            loop = asyncio.get_running_loop()
            closing = loop.run_in_executor(None, engine.close, shutdown_timeout)
            await super().shutdown(sockets)
            await closing

    return Server(config)


def _listen(host: str, port: int) -> socket.socket:
    """A listening socket, taken before the (slow) model load so a busy port fails at once."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise GrpoError(f"cannot listen on {host}:{port}: {e}") from None
    return sock


def load_engine(model: str, adapter: str | None = None, dtype: str = "float32",
                device: str = "auto", **kw):  # fmt: skip
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
        ("--max-queue", args.max_queue, 0), ("--max-batch-rows", args.max_batch_rows, 1),
        ("--max-tokens-limit", args.max_tokens_limit, 1),
        ("--max-request-bytes", args.max_request_bytes, 1),
        ("--batch-window-ms", args.batch_window_ms, 0),
        ("--shutdown-timeout", args.shutdown_timeout, 0),
    ):  # fmt: skip
        check_value(flag, value, between(lo))  # (nan fails too)
    try:
        import fastapi  # noqa: F401
        import uvicorn
    except ImportError as e:
        raise GrpoError(f"grpo serve needs fastapi and uvicorn ({e}); "
                        "pip install 'grpo[serve]'") from None  # fmt: skip
    thinking = {"true": True, "false": False, None: None}[args.enable_thinking]
    sock = _listen(args.host, args.port)
    try:
        engine, tok = load_engine(
            args.model, args.adapter, dtype=args.dtype, device=args.device,
            max_queue=args.max_queue, max_batch_rows=args.max_batch_rows,
            batch_window_ms=args.batch_window_ms, seed=args.seed,
        )  # fmt: skip
    except BaseException:
        sock.close()
        raise
    name = args.served_model_name or (args.model if not args.adapter
                                       else f"{args.model}+{args.adapter}")  # fmt: skip
    service = Service(engine, tok, name, args.max_tokens_limit, args.system_prompt, thinking,
                      args.max_request_bytes)  # fmt: skip
    host, port = sock.getsockname()[:2]
    url = f"http://{'[' + host + ']' if ':' in host else host}:{port}"
    holder: dict = {}

    def on_startup():
        print(f"serving {name} on {url} (POST /v1/chat/completions, /v1/completions, "
              "/generate; GET /v1/models, /health)", flush=True)  # fmt: skip
        if args.on_ready is not None:  # tests and embedders get the handle (to shut down)
            args.on_ready(holder["running"])

    from grpo.apps.serving.app import build_app

    app = build_app(service, on_startup)
    config = uvicorn.Config(app, lifespan="on", log_config=None, log_level="warning",
                            access_log=False, timeout_graceful_shutdown=None)  # fmt: skip
    server = _uvicorn_server(config, engine, args.shutdown_timeout)
    holder["running"] = Running(url, service, server)
    engine.start()
    try:
        server.run(sockets=[sock])
    finally:
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
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="first seed of the server's sequence (requests without a seed)",
    )
    p.set_defaults(func=cmd_serve, on_ready=None)

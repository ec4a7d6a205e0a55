"""`grpo serve` under load: 16 concurrent clients, batched vs one request at a time.

    python -m benchmarks.bench_serve                                   # the recorded run
    python -m benchmarks.bench_serve --cases tiny --rounds 2 --out-dir /tmp/bench   # quick

One process serves, another one is the clients. The server is the real one (FastAPI app,
uvicorn on 127.0.0.1, `grpo.apps.serving.Engine`) twice over the same random-init model
(`benchmarks.models.CASES` shapes, `Decoder.init_weights(seed=0)`, float32; the tiny case with
the 384-token BPE of `grpo.tiny`, the 0.6B shape with bench_grammar's 151,646-token BPE, so
structured outputs mask a vocabulary of Qwen3's size): `batched` (up to --max-batch-rows rows
per sampler call, a 5 ms batching window) and `sequential` (max_batch_rows=1: one request per
sampler call, what the server did before batching). Each of `clients` threads sends
`requests` POST /v1/completions back to back on its own keep-alive connection: a prompt of
`prompt_len` random token ids, `max_tokens` new tokens, greedy (temperature 0), so both
servers do the same work and must give the same answers.

Before timing, every request of a round is sent to both servers and their completions must be
equal (`greedy_equal`: equal / total; batched rows are left-padded, which may flip an arg-max
near a tie in the last bits). Then `rounds` timed rounds, the two servers alternating (the
order rotates each round) so that a busy machine slows them alike. Columns:

- `tok_per_s`: completion tokens of a round / its wall time (first send to last answer),
  median over rounds; `req_per_s` the same for requests; `wall_s` the median round.
- `p50_ms` / `p95_ms`: latency of single requests (send to answer), pooled over rounds.
- `rows_per_call`: requests per sampler call (the batch size the server reached).
- `speedup`: batched tok_per_s / sequential tok_per_s of the same case; `target` the goal.
- `chat` / `chat+json_schema` (batched server): the same prompts as chat messages, free and
  under a strict `json_schema` response format that cannot end within max_tokens (an array of
  at least 64 digits), so both run max_tokens, their rounds interleaved; `constrained_x`:
  constrained tok_per_s / free tok_per_s (goal 0.8). `loglikelihood`: lm-eval's scoring
  payload for the same prompts.

Threads: the tiny case runs the model on one torch thread (at its shapes an op takes
microseconds and OpenMP fork/join on more threads costs more than it saves), the 0.6B shape
on torch's default threads.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import http.client
import json
import multiprocessing
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from benchmarks.harness import _percentile, add_output_args, comma_list, write_results

# per-case defaults (flags override): lengths in tokens, requests per client, timed rounds,
# torch threads (0 = torch's default), the throughput goal (batched / sequential)
CASES = {
    "tiny": dict(
        prompt_len=32, max_tokens=32, requests=4, rounds=5, threads=1, target=3.0, vocab="tiny"
    ),
    "qwen3-0.6b": dict(
        prompt_len=16, max_tokens=16, requests=1, rounds=2, threads=0, target=None, vocab="big"
    ),
}
COLUMNS = [
    "case",
    "mode",
    "clients",
    "requests",
    "max_tokens",
    "threads",
    "tok_per_s",
    "req_per_s",
    "wall_s",
    "p50_ms",
    "p95_ms",
    "rows_per_call",
    "speedup",
    "constrained_x",
    "target",
    "greedy_equal",
]
NAME = "bench"


# -- the clients (their own process) ---------------------------------------------------------


def client_round(url: str, bodies: list[list[dict]]) -> dict:
    """One round: a thread per client sends its bodies back to back on one connection.

    Returns:
        {"wall_s", "latencies_s": [...], "tokens", "texts": one list per client}.
    """
    host, port = url.removeprefix("http://").rsplit(":", 1)
    start = threading.Barrier(len(bodies) + 1)
    out = [None] * len(bodies)

    def client(i: int) -> None:
        conn = http.client.HTTPConnection(host, int(port), timeout=600)
        conn.connect()
        conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        start.wait()
        lat, tokens, texts = [], 0, []
        for body in bodies[i]:
            chat = "messages" in body
            t0 = time.perf_counter()
            conn.request(
                "POST",
                "/v1/chat/completions" if chat else "/v1/completions",
                json.dumps(body),
                {"Content-Type": "application/json"},
            )
            resp = conn.getresponse()
            data = json.loads(resp.read())
            lat.append(time.perf_counter() - t0)
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {data}")
            tokens += data["usage"]["completion_tokens"]
            choice = data["choices"][0]
            text = choice["message"]["content"] if chat else choice["text"]
            texts.append((text, data["usage"]["completion_tokens"]))
        conn.close()
        out[i] = (lat, tokens, texts)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if any(o is None for o in out):
        raise RuntimeError("a client failed (see its traceback above)")
    return {
        "wall_s": wall,
        "latencies_s": [x for lat, _, _ in out for x in lat],
        "tokens": sum(n for _, n, _ in out),
        "texts": [texts for _, _, texts in out],
    }


# -- the servers (this process) ----------------------------------------------------------------


def build_tokenizer(vocab: str, out_dir: str, cache: str):
    """The tokenizer of a case (prompts are token ids; it decodes the answers and, for the
    structured-output rows, is the vocabulary the grammar masks): "tiny", the 384-token BPE of
    `grpo.tiny`; "big", bench_grammar's 151,646-token byte-level BPE (a stand-in for Qwen3's
    vocabulary, cached in `cache`)."""
    from grpo.tiny import minimath_corpus
    from grpo.tokenizer import load_tokenizer, train_bpe_tokenizer

    if vocab == "big":
        from benchmarks.bench_grammar import big_tokenizer

        return big_tokenizer(151646, Path(cache) / "bpe151k")
    train_bpe_tokenizer(minimath_corpus(), 384, out_dir=out_dir)
    return load_tokenizer(out_dir)


def start_server(model, tok, max_batch_rows: int, max_queue: int):
    """The real app + engine on a free 127.0.0.1 port, uvicorn in a thread; (url, engine, stop)."""
    import uvicorn

    from grpo.apps.serve import _listen
    from grpo.apps.serving import Engine, Service
    from grpo.apps.serving.app import build_app

    engine = Engine(
        model,
        tok,
        [tok.eos_token_id],
        max_queue=max_queue,
        max_batch_rows=max_batch_rows,
        batch_window_ms=5.0,
    )
    service = Service(engine, tok, NAME, max_tokens_limit=1024)
    sock = _listen("127.0.0.1", 0)  # grpo serve's own listening socket (TCP_NODELAY)
    server = uvicorn.Server(
        uvicorn.Config(
            build_app(service),
            lifespan="on",
            log_config=None,
            log_level="warning",
            access_log=False,
        )
    )
    engine.start()
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)

    def stop():
        server.should_exit = True
        thread.join(60)
        engine.close(0.0)
        sock.close()

    return f"http://127.0.0.1:{sock.getsockname()[1]}", engine, stop


def run_case(case: str, args, pool, tmp: str) -> list[dict]:
    from benchmarks.bench_multiturn import build_model

    spec = CASES[case]
    tok = build_tokenizer(spec["vocab"], str(Path(tmp) / case), args.cache)
    threads = args.threads or spec["threads"] or args.default_threads
    torch.set_num_threads(threads)
    C = args.clients
    R = args.requests or spec["requests"]
    T_p = args.prompt_len or spec["prompt_len"]
    N = args.max_tokens or spec["max_tokens"]
    rounds = args.rounds or spec["rounds"]
    model = build_model(case, min_vocab=len(tok))  # chat prompts encode text: every id fits
    V = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    bodies = [
        [
            {
                "model": NAME,
                "prompt": torch.randint(3, V, (T_p,), generator=gen).tolist(),
                "max_tokens": N,
                "temperature": 0,
            }
            for _ in range(R)
        ]
        for _ in range(C)
    ]
    servers = {
        "batched": start_server(model, tok, args.max_batch_rows, max_queue=C * R),
        "sequential": start_server(model, tok, 1, max_queue=C * R),
    }
    try:
        # correctness before timing (and the warm-up): both give the same completions
        answers = {
            m: pool.submit(client_round, url, bodies).result() for m, (url, _, _) in servers.items()
        }
        got = [t for client in answers["batched"]["texts"] for t in client]
        want = [t for client in answers["sequential"]["texts"] for t in client]
        equal = f"{sum(a == b for a, b in zip(got, want))}/{len(want)}"
        runs = {m: [] for m in servers}
        calls = {m: -servers[m][1].calls for m in servers}
        names = list(servers)
        for r in range(rounds):
            for m in names[r % 2 :] + names[: r % 2]:
                runs[m].append(pool.submit(client_round, servers[m][0], bodies).result())
                print(f"{case} round {r} {m}: {runs[m][-1]['wall_s']:.2f} s", flush=True)
        for m in servers:
            calls[m] += servers[m][1].calls
        # lm-eval's loglikelihood requests (the same prompts scored, with the greedy next
        # token) on the batched server: scoring takes the engine's lock, one request a forward
        scoring = [
            [{**b, "max_tokens": 1, "echo": True, "logprobs": 1} for b in client]
            for client in bodies
        ]
        url = servers["batched"][0]
        pool.submit(client_round, url, scoring).result()  # warm-up
        runs["loglikelihood"] = [
            pool.submit(client_round, url, scoring).result() for _ in range(rounds)
        ]
        calls["loglikelihood"] = None
        # structured outputs: the same prompts as chat messages, free and under a JSON schema
        # that cannot end within max_tokens (at least 64 digits), so both run max_tokens
        digits = {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": 9},
            "minItems": 64,
        }
        fmt = {
            "type": "json_schema",
            "json_schema": {
                "name": "bench",
                "strict": True,
                "schema": {
                    "type": "object",
                    "properties": {"digits": digits},
                    "required": ["digits"],
                },
            },
        }
        chat = [
            [
                {
                    "model": NAME,
                    "max_tokens": N,
                    "temperature": 0,
                    "messages": [{"role": "user", "content": tok.decode(b["prompt"])}],
                }
                for b in client
            ]
            for client in bodies
        ]
        constrained = [[{**b, "response_format": fmt} for b in client] for client in chat]
        payloads = {"chat": chat, "chat+json_schema": constrained}
        for m, payload in payloads.items():
            pool.submit(client_round, url, payload).result()  # warm-up (compiles the schema)
            runs[m], calls[m] = [], 0
        names = list(payloads)
        for r in range(rounds):  # interleaved, the order rotating, as the servers above
            for m in names[r % 2 :] + names[: r % 2]:
                before = servers["batched"][1].calls
                runs[m].append(pool.submit(client_round, url, payloads[m]).result())
                calls[m] += servers["batched"][1].calls - before
    finally:
        for _, _, stop in servers.values():
            stop()
    rows = []
    for m, rs in runs.items():
        lat = [x * 1e3 for run in rs for x in run["latencies_s"]]
        rows.append(
            {
                "case": case,
                "mode": m,
                "clients": C,
                "requests": C * R,
                "max_tokens": N,
                "prompt_len": T_p,
                "threads": threads,
                "tokenizer_vocab": len(tok),
                "tok_per_s": statistics.median(run["tokens"] / run["wall_s"] for run in rs),
                "req_per_s": statistics.median(C * R / run["wall_s"] for run in rs),
                "wall_s": statistics.median(run["wall_s"] for run in rs),
                "p50_ms": _percentile(lat, 50),
                "p95_ms": _percentile(lat, 95),
                "rows_per_call": None if calls[m] is None else C * R * rounds / calls[m],
                "greedy_equal": equal,
                "rounds": rounds,
                "walls_s": [run["wall_s"] for run in rs],
            }
        )
    batched, sequential, scored, free, json_rows = rows
    json_rows["constrained_x"] = json_rows["tok_per_s"] / free["tok_per_s"]
    json_rows["target"] = 0.8
    scored["max_tokens"] = 1
    scored["tok_per_s"] = statistics.median(
        C * R * T_p / run["wall_s"] for run in runs["loglikelihood"]
    )  # prompt tokens scored per second
    batched["speedup"] = batched["tok_per_s"] / sequential["tok_per_s"]
    batched["target"] = spec["target"]
    return rows


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", default="tiny,qwen3-0.6b", help=f"of {list(CASES)}")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--requests", type=int, default=0, help="per client (default: per case)")
    parser.add_argument("--prompt-len", type=int, default=0, help="default: per case")
    parser.add_argument("--max-tokens", type=int, default=0, help="default: per case")
    parser.add_argument("--rounds", type=int, default=0, help="default: per case")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: per case)")
    parser.add_argument("--max-batch-rows", type=int, default=32)
    parser.add_argument(
        "--cache",
        default=str(Path(tempfile.gettempdir()) / "grpo-bench-grammar"),
        help="where the 151,646-token tokenizer is kept (shared with bench_grammar)",
    )
    add_output_args(parser, "serve_cpu")
    args = parser.parse_args(argv)
    cases = comma_list(parser, "--cases", args.cases, CASES)
    args.default_threads = torch.get_num_threads()
    spawn = multiprocessing.get_context("spawn")  # the clients: no torch threads, own GIL
    with (
        tempfile.TemporaryDirectory() as tmp,
        concurrent.futures.ProcessPoolExecutor(1, mp_context=spawn) as pool,
    ):
        rows = [row for case in cases for row in run_case(case, args, pool, tmp)]
    meta = {
        "command": " ".join(["python -m benchmarks.bench_serve", *argv]),
        "setup": f"{args.clients} concurrent clients (one process), each sending its requests "
        "back to back: POST /v1/completions, random token-id prompts, greedy, float32 "
        "random-init models; servers in another process on 127.0.0.1 (uvicorn + FastAPI)",
        "batched": f"max_batch_rows={args.max_batch_rows}, batch window 5 ms",
        "sequential": "max_batch_rows=1: one request per sampler call (the pre-batching server)",
        "speedup": "batched tok_per_s / sequential tok_per_s",
        "loglikelihood": "lm-eval's loglikelihood payload (echo, max_tokens 1, logprobs 1, "
        "temperature 0) for the same prompts on the batched server; its tok_per_s counts "
        "prompt tokens scored",
        "chat / chat+json_schema": "the same prompts decoded as chat messages on the batched "
        "server, free and with a strict json_schema response_format that cannot end within "
        "max_tokens (an array of at least 64 digits), so both generate max_tokens; "
        "constrained_x = constrained tok_per_s / free tok_per_s",
    }
    write_results(args.name, rows, COLUMNS, out_dir=args.out_dir, meta=meta)


if __name__ == "__main__":
    main(sys.argv[1:])

"""grpo serve: real HTTP on 127.0.0.1 (a free port) through the CLI function, with the real
`openai` client: chat and text completions (streamed and not) equal direct sampler calls,
n, seeds, stop strings, usage; malformed requests get 400 with a JSON error naming the field,
a full queue 503; concurrent requests share one sampler call; SIGINT / SIGTERM let the
running request finish and exit 0 without a traceback."""

from __future__ import annotations

import argparse
import http.client
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time

import openai
import pytest

from grpo.apps.serve import add_parser
from grpo.apps.serving import Engine, Job, RequestError, SamplingParams, Unavailable, parse_request
from grpo.rollout import sample

# every client here talks to 127.0.0.1 only (conftest.loopback_only)
pytestmark = pytest.mark.usefixtures("loopback_only")

NAME = "tiny"  # --served-model-name


@pytest.fixture(scope="module")
def server(shared_tiny_model, serve_cli):
    """`grpo serve --model TINY --port 0 --max-queue 4 ...` in a thread; yields its handle."""
    with serve_cli(
        "--model",
        str(shared_tiny_model),
        "--port",
        "0",
        "--max-queue",
        "4",
        "--max-tokens-limit",
        "32",
        "--served-model-name",
        NAME,
    ) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def request(srv, method: str, path: str, body: bytes | None = None, headers=None):
    host, port = srv.url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request(method, path, body=body, headers=headers or {})
    resp = conn.getresponse()
    data = json.loads(resp.read())
    conn.close()
    return resp.status, data, resp


def post(srv, payload, path: str = "/generate") -> tuple[int, dict]:
    body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    status, data, _ = request(srv, "POST", path, body, {"Content-Type": "application/json"})
    return status, data


def direct(srv, prompt_ids, n=1, **kw):
    """The sampler called directly on the served model: (texts, rollout)."""
    tok = srv.service.tokenizer
    r = sample(
        srv.engine.sampler.model,
        [prompt_ids],
        group_size=n,
        stop_ids=srv.engine.stop_ids,
        pad_id=srv.engine.pad_id,
        **{"seed": 0, **kw},
    )
    return r.decode(tok, skip_special_tokens=True), r


def chat_ids(srv, text: str) -> list[int]:
    tok = srv.service.tokenizer
    rendered = tok.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )
    return tok(rendered, add_special_tokens=False)["input_ids"]


def raw_ids(srv, text: str) -> list[int]:
    return srv.service.tokenizer(text, add_special_tokens=False)["input_ids"]


def wait_for(predicate, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


# -- the OpenAI routes through the openai client ---------------------------------------------


def test_chat_greedy_equals_sampler_streamed_or_not(server, client):
    msgs = [{"role": "user", "content": "Ann has 3 apples."}]
    out = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=8, temperature=0)
    ids = chat_ids(server, "Ann has 3 apples.")
    texts, r = direct(server, ids, max_new_tokens=8, temperature=0)
    (choice,) = out.choices
    assert choice.message.role == "assistant" and choice.message.content == texts[0]
    assert choice.finish_reason == ("stop" if bool(r.finished[0]) else "length")
    assert out.usage.prompt_tokens == len(ids)
    assert out.usage.completion_tokens == int(r.completion_lens[0])
    assert out.usage.total_tokens == len(ids) + int(r.completion_lens[0])
    assert out.model == NAME and out.object == "chat.completion"

    stream = client.chat.completions.create(
        model=NAME, messages=msgs, max_tokens=8, temperature=0, stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks][-1] == choice.finish_reason
    assert all(c.object == "chat.completion.chunk" for c in chunks)


@pytest.mark.parametrize("prompt", ["Ben", "What is 48 + 24?"])
def test_completion_greedy_equals_sampler_streamed_or_not(server, client, prompt):
    out = client.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0)
    texts, r = direct(server, raw_ids(server, prompt), max_new_tokens=12, temperature=0)
    assert out.choices[0].text == texts[0] and texts[0].strip()  # the model repeats itself
    assert out.usage.completion_tokens == int(r.completion_lens[0])
    stream = client.completions.create(
        model=NAME,
        prompt=prompt,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == texts[0]
    assert len(chunks) > 3  # text arrives token by token, not in one piece
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == (
        out.usage.completion_tokens
    )
    # token ids in, the same completion out
    by_ids = client.completions.create(
        model=NAME, prompt=raw_ids(server, prompt), max_tokens=12, temperature=0
    )
    assert by_ids.choices[0].text == texts[0]


def test_n_with_seed_equals_one_sampler_call(server, client):
    """n=3 with a seed runs alone, seeded with it: the choices are the sampler's 3 rows."""
    kw = dict(model=NAME, prompt="Ben", max_tokens=6, temperature=1.0, n=3, seed=11)
    out = client.completions.create(**kw)
    texts, r = direct(
        server, raw_ids(server, "Ben"), n=3, max_new_tokens=6, temperature=1.0, seed=11
    )
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert [c.text for c in out.choices] == texts
    assert len(set(texts)) == 3  # rows of a group differ
    assert out.usage.completion_tokens == int(r.completion_lens.sum())
    assert client.completions.create(**kw).choices == out.choices  # reproducible

    streamed = ["", "", ""]
    for c in client.completions.create(**kw, stream=True):
        streamed[c.choices[0].index] += c.choices[0].text
    assert streamed == texts
    # two prompts x n=2: index = prompt * n + k
    two = client.completions.create(
        model=NAME, prompt=["Ben", "hi"], max_tokens=4, temperature=1.0, n=2, seed=5
    )
    assert [c.index for c in two.choices] == [0, 1, 2, 3]


def test_stop_strings_cut_the_text(server, client):
    kw = dict(model=NAME, prompt="Tom buys 12 pens", max_tokens=24, temperature=1.0, seed=3)
    full = client.completions.create(**kw).choices[0]
    text = full.text
    # a two-character stop string from the middle of the text (printable ASCII)
    k = next(
        i
        for i in range(2, len(text) - 1)
        if text[i : i + 2].isascii() and text[i : i + 2].isprintable()
    )
    stop = text[k : k + 2]
    want = text[: text.index(stop)]
    cut = client.completions.create(**kw, stop=[stop, "never-there"]).choices[0]
    assert cut.text == want and cut.finish_reason == "stop"
    streamed = client.completions.create(**kw, stop=stop, stream=True)
    chunks = [c.choices[0] for c in streamed if c.choices]
    assert "".join(c.text for c in chunks) == want
    assert chunks[-1].finish_reason == "stop"
    same = client.completions.create(**kw, stop="never-there").choices[0]
    assert (same.text, same.finish_reason) == (text, full.finish_reason)


def test_models_and_health(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [NAME]
    status, health, _ = request(server, "GET", "/health")
    assert status == 200 and health["status"] == "ok" and health["model"] == NAME
    assert health["in_flight"] == 0 and health["batches"] >= 0


# -- bad input ----------------------------------------------------------------------------------

CHAT = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"model": NAME, "prompt": "hi", "max_tokens": 2}


@pytest.mark.parametrize(
    "path, body, field",
    [
        ("/v1/chat/completions", b"{not json", "body"),
        ("/v1/chat/completions", b"[1, 2]", "body"),
        ("/v1/chat/completions", b"[" * 100_000 + b"]" * 100_000, "body"),  # too deep to parse
        ("/v1/chat/completions", {"model": NAME}, "messages"),
        ("/v1/chat/completions", {**CHAT, "messages": "hi"}, "messages"),
        (
            "/v1/chat/completions",
            {**CHAT, "messages": [{"role": "robot", "content": "x"}]},
            "messages[0].role",
        ),
        (
            "/v1/chat/completions",
            {**CHAT, "messages": [{"role": "user", "content": 5}]},
            "messages[0].content",
        ),
        (
            "/v1/chat/completions",
            {**CHAT, "messages": [{"role": "user", "content": "x", "tool_calls": []}]},
            "messages[0].tool_calls",
        ),
        ("/v1/chat/completions", {**CHAT, "max_tokens": "8"}, "max_tokens"),
        ("/v1/chat/completions", {**CHAT, "max_tokens": 33}, "max_tokens"),  # over the limit
        ("/v1/chat/completions", {**CHAT, "temperature": 3}, "temperature"),
        ("/v1/chat/completions", {**CHAT, "temperature": 10**400}, "temperature"),
        ("/v1/chat/completions", {**CHAT, "top_p": 0}, "top_p"),
        ("/v1/chat/completions", {**CHAT, "n": 0}, "n"),
        ("/v1/chat/completions", {**CHAT, "n": 33}, "n"),  # over --max-batch-rows
        ("/v1/chat/completions", {**CHAT, "seed": -1}, "seed"),
        ("/v1/chat/completions", {**CHAT, "stop": 5}, "stop"),
        ("/v1/chat/completions", {**CHAT, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ("/v1/chat/completions", {**CHAT, "stop": [""]}, "stop"),
        ("/v1/chat/completions", {**CHAT, "stream": "yes"}, "stream"),
        ("/v1/chat/completions", {**CHAT, "presence_penalty": 0.5}, "presence_penalty"),
        # an unknown field is accepted and named in X-Ignored-Fields (tests/test_serve_fields.py);
        # --strict-requests refuses it
        ("/v1/chat/completions", {**CHAT, "model": 5}, "model"),
        ("/v1/chat/completions", {"messages": CHAT["messages"]}, "model"),
        ("/v1/completions", {"model": NAME}, "prompt"),
        ("/v1/completions", {**COMPLETION, "prompt": 5}, "prompt"),
        ("/v1/completions", {**COMPLETION, "prompt": ""}, "prompt"),
        ("/v1/completions", {**COMPLETION, "prompt": []}, "prompt"),
        ("/v1/completions", {**COMPLETION, "prompt": [1, 10**6]}, "prompt"),
        ("/v1/completions", {**COMPLETION, "prompt": ["a", 3]}, "prompt[1]"),
        ("/v1/completions", {**COMPLETION, "prompt": [5] * 500, "max_tokens": 32}, "prompt"),
        ("/v1/completions", {**COMPLETION, "prompt": ["a"] * 9, "n": 4}, "prompt"),
        # JSON's "\ud800" decodes to a lone surrogate: not text any tokenizer encodes
        (
            "/v1/chat/completions",
            {**CHAT, "messages": [{"role": "user", "content": "a\ud800"}]},
            "messages[0].content",
        ),
        (
            "/v1/chat/completions",
            {
                **CHAT,
                "messages": [{"role": "user", "content": [{"type": "text", "text": "\udc00"}]}],
            },
            "messages[0].content[0].text",
        ),
        ("/v1/chat/completions", {**CHAT, "stop": ["ok", "\ud800"]}, "stop[1]"),
        ("/v1/chat/completions", {**CHAT, "user": "\ud800"}, "user"),
        ("/v1/completions", {**COMPLETION, "prompt": "\ud800 hi"}, "prompt"),
        ("/v1/completions", {**COMPLETION, "prompt": ["ok", "\udfff"]}, "prompt[1]"),
    ],
)
def test_malformed_openai_requests_get_400(server, path, body, field):
    status, data = post(server, body, path)
    assert status == 400, data
    err = data["error"]
    assert err["param"] == field and err["type"] == "invalid_request_error"
    assert err["message"].startswith(f"{field}:")


def test_openai_client_sees_errors(server, client):
    with pytest.raises(openai.BadRequestError, match="max_tokens: must be in"):
        client.completions.create(model=NAME, prompt="hi", max_tokens=1000)
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt="hi")
    assert e.value.body["code"] == "model_not_found" and NAME in e.value.body["message"]
    status, data = post(server, b'{"prompt": "' + b"x" * (1 << 20) + b'"}', "/v1/completions")
    assert status == 413 and "limit" in data["error"]["message"]


@pytest.mark.parametrize(
    "body, field",
    [
        (b"{not json", "body"),
        (b"[1, 2]", "body"),
        ({"max_tokens": 4}, "text"),
        ({"text": ""}, "text"),
        ({"text": 5}, "text"),
        ({"text": "hi", "max_tokens": "8"}, "max_tokens"),
        ({"text": "hi", "max_tokens": 0}, "max_tokens"),
        ({"text": "hi", "max_tokens": 33}, "max_tokens"),  # over --max-tokens-limit
        ({"text": "hi", "temperature": -0.5}, "temperature"),
        ({"text": "hi", "temperature": "hot"}, "temperature"),
        ({"text": "hi", "top_p": 0}, "top_p"),
        ({"text": "hi", "raw": "yes"}, "raw"),
        ({"text": "hi", "tokens": 4}, "tokens"),
        ({"text": "a\ud800"}, "text"),  # a lone surrogate (JSON's "\ud800")
        ({"text": "\udc00", "raw": True}, "text"),
    ],
)
def test_malformed_generate_requests_get_400(server, body, field):
    status, data = post(server, body)
    assert status == 400
    assert data["field"] == field and data["error"].startswith(f"{field}:")


def test_routes_and_methods(server):
    assert request(server, "GET", "/nope")[0] == 404
    assert request(server, "POST", "/nope", b"{}")[0] == 404
    status, data, resp = request(server, "GET", "/generate")
    assert status == 405 and resp.getheader("Allow") == "POST" and "error" in data
    status, data, _ = request(server, "GET", "/v1/chat/completions")
    assert status == 405 and "not allowed" in data["error"]["message"]


def test_parse_request_defaults():
    req = parse_request(b'{"text": "What is 2+2?"}', max_tokens_limit=1024)
    assert (req.max_tokens, req.temperature, req.top_p, req.seed, req.raw) == (
        256,
        1.0,
        1.0,
        None,
        False,
    )
    assert parse_request(b'{"text": "x"}', max_tokens_limit=16).max_tokens == 16
    with pytest.raises(RequestError, match="seed"):
        parse_request(b'{"text": "x", "seed": -1}', 16)


# -- /generate, the original contract ----------------------------------------------------------


def test_generate_answers_over_http(server):
    status, out = post(server, {"text": "Ann has 3 apples.", "max_tokens": 8, "temperature": 0})
    assert status == 200, out
    texts, r = direct(
        server, chat_ids(server, "Ann has 3 apples."), max_new_tokens=8, temperature=0
    )
    assert out["text"] == texts[0] and out["tokens"] == int(r.completion_lens[0])
    assert out["logprob"] == pytest.approx(float(r.logprobs[0].sum()), abs=1e-5)
    assert out["finish_reason"] in ("stop", "length") and out["seed"] is None
    a = post(server, {"text": "Ben", "max_tokens": 6, "temperature": 1.0, "seed": 7})[1]
    b = post(server, {"text": "Ben", "max_tokens": 6, "temperature": 1.0, "seed": 7})[1]
    assert a == b and a["seed"] == 7  # same seed, same sample
    raw = post(server, {"text": "Ben", "max_tokens": 6, "temperature": 0, "raw": True})[1]
    assert (
        raw["text"] == direct(server, raw_ids(server, "Ben"), max_new_tokens=6, temperature=0)[0][0]
    )


# -- batching and the queue --------------------------------------------------------------------


def in_thread(fn, results: list, key):
    t = threading.Thread(target=lambda: results.append((key, fn())), daemon=True)
    t.start()
    return t


def test_concurrent_requests_share_one_sampler_call(server, client, monkeypatch):
    """Held behind a running call, three greedy requests (different prompts, max_tokens and n,
    one with a stop string) and one sampled request queue up; then the three greedy ones run as
    one sampler call, each cut to its own max_tokens / stop, equal to running alone; the
    sampled one runs apart."""
    engine = server.engine
    calls = []
    real = engine.sampler.sample
    monkeypatch.setattr(
        engine.sampler,
        "sample",
        lambda prompts, **kw: (calls.append((list(prompts), kw)), real(prompts, **kw))[1],
    )

    def complete(prompt, **kw):
        return lambda: client.completions.create(model=NAME, prompt=prompt, **kw)

    # prompt -> request; the model repeats a prompt's last token: "BenBenBen..." stops at "nBe"
    greedy = {
        "Ben": dict(max_tokens=4, stop="nBe"),
        "What is 48 + 24?": dict(max_tokens=9, n=2),
        "7 + 5 =": dict(max_tokens=6),
    }
    queue = [(p, dict(kw, temperature=0.0)) for p, kw in greedy.items()]
    queue.insert(2, ("sampled", dict(max_tokens=3, temperature=1.0)))  # another batch key
    results, threads = [], []
    with engine.lock:
        threads.append(in_thread(complete("hi", max_tokens=3, temperature=0), results, "first"))
        wait_for(lambda: len(engine.running) == 1, "the first request to start")
        for i, (prompt, kw) in enumerate(queue):
            threads.append(in_thread(complete(prompt, **kw), results, prompt))
            wait_for(lambda n=i + 1: engine.queued == n, "the request to queue")
    for t in threads:
        t.join(60)
    ids = {p: raw_ids(server, p) for p in greedy}
    assert [len(p) for p, _ in calls] == [1, 4, 1]
    batched_prompts, kw = calls[1]  # mixed n: one row per completion (G = 1)
    assert batched_prompts == [ids["Ben"], *[ids["What is 48 + 24?"]] * 2, ids["7 + 5 ="]]
    assert kw["max_new_tokens"] == 9 and kw["temperature"] == 0 and kw["group_size"] == 1
    assert calls[2][1]["temperature"] == 1.0
    out = dict(results)
    assert out["Ben"].choices[0].text == "Be" and out["Ben"].choices[0].finish_reason == "stop"
    for prompt, req in list(greedy.items())[1:]:
        texts, r = direct(server, ids[prompt], max_new_tokens=req["max_tokens"], temperature=0)
        assert [c.text for c in out[prompt].choices] == texts * req.get("n", 1)
        assert out[prompt].usage.completion_tokens == int(r.completion_lens[0]) * req.get("n", 1)
        reason = "stop" if bool(r.finished[0]) else "length"
        assert [c.finish_reason for c in out[prompt].choices] == [reason] * req.get("n", 1)
    assert direct(server, ids["Ben"], max_new_tokens=4, temperature=0)[0][0].startswith("BenB")


def test_full_queue_answers_503(server, client):
    """With --max-queue 4: one request runs (here: waits on the held engine lock), four wait,
    the sixth is refused at once with Retry-After; the others then all succeed."""
    engine = server.engine
    results, threads = [], []
    body = {"model": NAME, "prompt": "hi", "max_tokens": 2}
    with engine.lock:
        threads.append(in_thread(lambda: post(server, body, "/v1/completions"), results, 0))
        wait_for(lambda: len(engine.running) == 1, "the first request to start")
        for i in range(1, 5):
            threads.append(in_thread(lambda: post(server, body, "/v1/completions"), results, i))
            wait_for(lambda n=i: engine.queued == n, "the request to queue")
        status, data, resp = request(server, "POST", "/v1/completions", json.dumps(body).encode())
        assert status == 503 and "queue is full" in data["error"]["message"]
        assert resp.getheader("Retry-After") == "1"
        status, data = post(server, {"text": "hi", "max_tokens": 2})  # /generate: its own shape
        assert status == 503 and "queue is full" in data["error"]
        with pytest.raises(openai.InternalServerError):
            client.completions.create(model=NAME, prompt="hi", max_tokens=2)
    for t in threads:
        t.join(60)
    assert sorted(status for _, (status, _) in results) == [200] * 5
    assert engine.queued == 0


# -- stopping --------------------------------------------------------------------------------


def test_engine_stop_fails_what_is_left_with_503(server):
    """A second engine on the served model: after drain() nothing new is taken; close(0)
    fails the queued job and stops the running batch at its next step, both with 503."""
    engine = Engine(server.engine.sampler.model, server.service.tokenizer, server.engine.stop_ids)
    engine.start()
    done = []
    jobs = [
        Job(
            [[5, 6, 7]],
            SamplingParams(max_tokens=4, temperature=0),
            notify=lambda e, i=i: done.append(i),
        )
        for i in range(2)
    ]
    with engine.lock:
        engine.submit(jobs[0])
        wait_for(lambda: engine.running == [jobs[0]], "the first job to start")
        engine.submit(jobs[1])
        engine.drain()
        with pytest.raises(Unavailable, match="shutting down"):
            engine.submit(Job([[5]], SamplingParams(max_tokens=1)))
        closer = threading.Thread(target=engine.close, args=(0.0,))
        closer.start()
        wait_for(lambda: 1 in done, "the queued job to fail")
    closer.join(30)
    assert not closer.is_alive()
    assert [j.error for j in jobs] == [(503, "the server is shutting down")] * 2
    assert sorted(done) == [0, 1]


def test_cancelled_stream_stops_its_rows(server):
    """A streamed job whose client went away (cancelled at its first delta) stops decoding a
    few steps later instead of running its 300 tokens."""
    engine = Engine(server.engine.sampler.model, server.service.tokenizer, server.engine.stop_ids)
    widths, real = [], engine.sampler.sample
    engine.sampler.sample = lambda prompts, **kw: (
        r := real(prompts, **kw),
        widths.append(r.completion_ids.shape[1]),
    )[0]
    job = Job([raw_ids(server, "hi")], SamplingParams(max_tokens=300, temperature=0), stream=True)
    done = threading.Event()

    def notify(event):
        if event[0] == "delta":
            job.cancelled = True
        else:
            done.set()

    job.notify = notify
    engine.start()
    engine.submit(job)
    assert done.wait(60)
    engine.close(0.0)
    assert job.error is None and widths[0] <= 8  # the sampler checks "all done?" every 4 steps


def stream_then_signal(url: str, send_signal, out: dict) -> None:
    """Start a 400-token greedy stream, call `send_signal()` after its first event, then read
    the stream to its end into out["rest"]."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    body = {"model": NAME, "prompt": "hi", "max_tokens": 400, "temperature": 0, "stream": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    out["status"] = resp.status
    out["first"] = resp.readline()
    send_signal()  # while the request decodes its 400 tokens
    out["rest"] = resp.read().decode()


def check_stream_finished(out: dict) -> None:
    assert out["status"] == 200 and out["first"].startswith(b"data: {")
    rest = out["rest"]
    events = [json.loads(e[6:]) for e in rest.split("\n\n") if e.startswith("data: {")]
    assert rest.rstrip().endswith("data: [DONE]")
    assert events[-1]["choices"][0]["finish_reason"] == "length"  # all 400 tokens came


def test_sigint_lets_the_running_request_finish(shared_tiny_model, caplog):
    """The server in the main thread (where uvicorn takes the signals): SIGINT while a
    streamed request runs; the stream still ends normally and cmd_serve returns 0."""
    caplog.set_level(logging.INFO, logger="grpo.apps.serve")
    parser = argparse.ArgumentParser(prog="grpo")
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(
        [
            "serve",
            "--model",
            str(shared_tiny_model),
            "--port",
            "0",
            "--served-model-name",
            NAME,
            "--max-tokens-limit",
            "400",
        ]
    )
    out: dict = {}
    threads = []

    def on_ready(running):
        sigint = lambda: os.kill(os.getpid(), signal.SIGINT)  # noqa: E731
        threads.append(threading.Thread(target=stream_then_signal, args=(running.url, sigint, out)))
        threads[0].start()

    args.on_ready = on_ready
    assert args.func(args) == 0
    threads[0].join(60)
    check_stream_finished(out)
    assert "SIGINT: finishing 1 running" in caplog.text


def test_sigterm_process_exits_0_without_traceback(shared_tiny_model):
    """`python -m grpo serve` as a process: SIGTERM while a streamed request runs; the stream
    ends normally, the process exits 0 and prints no traceback."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "grpo",
            "serve",
            "--model",
            str(shared_tiny_model),
            "--port",
            "0",
            "--served-model-name",
            NAME,
            "--max-tokens-limit",
            "400",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith(f"serving {NAME} on http://"), (line, proc.stderr.read())
        out: dict = {}
        url = line.split(" on ")[1].split()[0]
        stream_then_signal(url, lambda: proc.send_signal(signal.SIGTERM), out)
        check_stream_finished(out)
        assert proc.wait(60) == 0
        stderr = proc.stderr.read()
        assert "Traceback" not in stderr, stderr
        assert "SIGTERM: finishing 1 running" in stderr, stderr
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_bad_port_is_one_line_error(shared_tiny_model, server):
    from grpo.errors import GrpoError

    parser = argparse.ArgumentParser(prog="grpo")
    add_parser(parser.add_subparsers(dest="command"))
    port = server.url.rsplit(":", 1)[1]  # taken by the running server
    args = parser.parse_args(["serve", "--model", str(shared_tiny_model), "--port", port])
    with pytest.raises(GrpoError, match=f"cannot listen on 127.0.0.1:{port}"):
        args.func(args)

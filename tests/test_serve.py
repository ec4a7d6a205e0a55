"""grpo serve: real HTTP on 127.0.0.1 (a free port) through the CLI function; malformed
requests get 400 with a JSON error, a full queue 503."""

from __future__ import annotations

import argparse
import http.client
import json
import threading
import time

import pytest

from grpo.serve import RequestError, add_parser, parse_request


@pytest.fixture(scope="module")
def server(shared_tiny_model):
    """`grpo serve --model TINY --port 0 --max-queue 1` in a thread; yields the server."""
    parser = argparse.ArgumentParser(prog="grpo")
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve", "--model", str(shared_tiny_model), "--port", "0",
                              "--max-queue", "1", "--max-tokens-limit", "32"])  # fmt: skip
    ready = threading.Event()
    holder: dict = {}

    def on_ready(srv):
        holder["server"] = srv
        ready.set()

    args.on_ready = on_ready
    thread = threading.Thread(target=lambda: holder.update(rc=args.func(args)), daemon=True)
    thread.start()
    assert ready.wait(60), "server did not start"
    srv = holder["server"]
    yield srv
    srv.shutdown()
    thread.join(10)
    assert holder.get("rc") == 0


def request(srv, method: str, path: str, body: bytes | None = None, headers=None):
    host, port = srv.server_address[:2]
    conn = http.client.HTTPConnection(host, port, timeout=60)
    conn.request(method, path, body=body, headers=headers or {})
    resp = conn.getresponse()
    data = json.loads(resp.read())
    conn.close()
    return resp.status, data, resp


def post(srv, payload) -> tuple[int, dict]:
    body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    status, data, _ = request(srv, "POST", "/generate", body, {"Content-Type": "application/json"})
    return status, data


def test_generate_answers_over_http(server):
    assert server.server_address[0] == "127.0.0.1"
    status, out = post(server, {"text": "Ann has 3 apples.", "max_tokens": 8, "temperature": 0})
    assert status == 200, out
    assert isinstance(out["text"], str) and 1 <= out["tokens"] <= 8
    assert out["logprob"] <= 0 and out["finish_reason"] in ("stop", "length")
    again = post(server, {"text": "Ann has 3 apples.", "max_tokens": 8, "temperature": 0})[1]
    assert again["text"] == out["text"]  # greedy is deterministic
    a = post(server, {"text": "Ben", "max_tokens": 6, "temperature": 1.0, "seed": 7})[1]
    b = post(server, {"text": "Ben", "max_tokens": 6, "temperature": 1.0, "seed": 7})[1]
    assert a == b  # same seed, same sample
    status, health, _ = request(server, "GET", "/health")
    assert status == 200 and health["status"] == "ok" and health["in_flight"] == 0


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
    ],
)
def test_malformed_requests_get_400(server, body, field):
    status, data = post(server, body)
    assert status == 400
    assert data["field"] == field and data["error"].startswith(f"{field}:")


def test_routes_and_methods(server):
    assert request(server, "GET", "/nope")[0] == 404
    assert request(server, "POST", "/nope", b"{}")[0] == 404
    status, data, resp = request(server, "GET", "/generate")
    assert status == 405 and resp.getheader("Allow") == "POST" and "error" in data


def test_full_queue_answers_503(server):
    """With --max-queue 1: one request runs (here: waits on the held model lock), one waits,
    the third is refused at once."""
    results = []
    with server.generator.lock:
        threads = [
            threading.Thread(target=lambda: results.append(post(server, {"text": "hi",
                                                                         "max_tokens": 2})))
            for _ in range(2)
        ]  # fmt: skip
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while server.slots.count < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.slots.count == 2
        status, data, resp = request(server, "POST", "/generate", b'{"text": "hi"}')
        assert status == 503 and "queue is full" in data["error"]
        assert resp.getheader("Retry-After") == "1"
    for t in threads:
        t.join(60)
    assert [status for status, _ in results] == [200, 200]
    assert server.slots.count == 0


def test_parse_request_defaults():
    req = parse_request(b'{"text": "What is 2+2?"}', max_tokens_limit=1024)
    assert (req.max_tokens, req.temperature, req.top_p, req.seed, req.raw) == (
        256, 1.0, 1.0, None, False,
    )  # fmt: skip
    assert parse_request(b'{"text": "x"}', max_tokens_limit=16).max_tokens == 16
    with pytest.raises(RequestError, match="seed"):
        parse_request(b'{"text": "x", "seed": -1}', 16)


def test_bad_port_is_one_line_error(shared_tiny_model, server):
    from grpo.errors import GrpoError

    parser = argparse.ArgumentParser(prog="grpo")
    add_parser(parser.add_subparsers(dest="command"))
    port = str(server.server_address[1])  # taken by the running server
    args = parser.parse_args(["serve", "--model", str(shared_tiny_model), "--port", port])
    with pytest.raises(GrpoError, match=f"cannot listen on 127.0.0.1:{port}"):
        args.func(args)

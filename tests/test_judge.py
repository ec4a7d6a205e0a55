"""The `judge` reward (grpo/rewards/judge.py): against `grpo serve` on 127.0.0.1 it scores the
replies the server gives a direct request, and parallel requests share its batches; parsers and
scale by hand; failures are loud or counted (closed port, 5xx / 429 retries, a timeout, a bad
reply), never silent; bad parameters fail at construction; one `grpo train` step is scored by
a fake judge and logs its metrics."""

from __future__ import annotations

import http.client
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from conftest import post_json, write_package

from grpo.config import load_config
from grpo.errors import GrpoError
from grpo.metrics import Sum, read_metrics
from grpo.rewards import build_rewards, compute_rewards, get_reward, reward_bounds
from grpo.rewards.judge import DEFAULT_TEMPLATE, score_parser

REPO = Path(__file__).resolve().parents[1]
NAME = "judge-tiny"  # --served-model-name

# every request here goes to 127.0.0.1 only (conftest.loopback_only)
pytestmark = pytest.mark.usefixtures("loopback_only")


def judge(base_url: str, **kwargs):
    """The `judge` reward as a config builds it (the registry path)."""
    return get_reward({"name": "judge", "base_url": base_url, "model": NAME, **kwargs})


def chat_reply(text: str) -> dict:
    return {
        "object": "chat.completion",
        "model": NAME,
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
        ],
    }


class FakeJudge:
    """An OpenAI-style server on 127.0.0.1 in a thread: ``respond(body, n)`` (the request's
    JSON, None for a GET, and its 1-based number) -> (status, JSON-able or str, headers).
    Records each request (method, path, body, Authorization) and the most requests it held at
    once."""

    def __init__(self, respond):
        self.respond, self.requests = respond, []
        self.lock, self.release = threading.Lock(), threading.Event()
        self.in_flight = self.max_in_flight = 0
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                with fake.lock:
                    fake.requests.append(
                        {
                            "method": self.command,
                            "path": self.path,
                            "body": body,
                            "auth": self.headers.get("Authorization"),
                        }
                    )
                    n = len(fake.requests)
                    fake.in_flight += 1
                    fake.max_in_flight = max(fake.max_in_flight, fake.in_flight)
                try:
                    status, payload, headers = fake.respond(body, n)
                finally:
                    with fake.lock:
                        fake.in_flight -= 1
                data = (payload if isinstance(payload, str) else json.dumps(payload)).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for key, value in headers.items():
                    self.send_header(key, value)
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST  # a redirected POST may arrive as a GET (no body)

            def log_message(self, *args):
                pass

        class Server(ThreadingHTTPServer):
            daemon_threads = True

            def handle_error(self, request, client_address):
                pass  # a client that gave up (timeout tests) closed the socket: expected

        self.server = Server(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_port}/v1"

    def contents(self) -> list[str]:
        return [r["body"]["messages"][0]["content"] for r in self.requests]

    def close(self):
        self.release.set()  # handlers that wait stop waiting
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(10)


@pytest.fixture
def fake_judge():
    """fake_judge(respond) -> a running `FakeJudge`, closed after the test."""
    started = []

    def start(respond):
        started.append(FakeJudge(respond))
        return started[-1]

    yield start
    for fake in started:
        fake.close()


@pytest.fixture
def echo(fake_judge):
    """A judge whose reply is the message it got: with template "{completion}", the
    completions are the replies."""
    return fake_judge(lambda body, n: (200, chat_reply(body["messages"][0]["content"]), {}))


@pytest.fixture
def hung_judge():
    """The base URL of a server on 127.0.0.1 that accepts connections and never answers."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.05)
    held, closing = [], threading.Event()

    def accept():
        while not closing.is_set():
            try:
                held.append(server.accept()[0])
            except TimeoutError:
                continue
            except OSError:
                return

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}/v1"
    closing.set()
    thread.join(5)
    server.close()
    for conn in held:
        conn.close()


def closed_port() -> int:
    """A port of 127.0.0.1 nothing listens on (bound, then closed)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


# -- against grpo serve ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def judge_model(tmp_path_factory):
    """A ci-size model with weights drawn at std 0.3: the init's std 0.02 makes a random
    model echo the prompt's last token (every reply "\\n\\n..."); these replies differ by
    prompt and hold digits now and then."""
    from grpo.models import load_model, save_pretrained
    from grpo.tiny import make_tiny_model

    path = make_tiny_model(tmp_path_factory.mktemp("judge_model"), size="ci")
    model = load_model(path)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    save_pretrained(model, path)
    return path


@pytest.fixture(scope="module")
def served(judge_model, serve_cli):
    """`grpo serve` of the judge model; requests arriving within 200 ms share a batch."""
    with serve_cli(
        "--model",
        str(judge_model),
        "--port",
        "0",
        "--served-model-name",
        NAME,
        "--batch-window-ms",
        "200",
        "--max-tokens-limit",
        "16",
    ) as running:
        yield running


COMPLETIONS = [
    "Step 1: 3 + 5 = 8\nFinal Answer: 8",
    "I think it is 12.",
    "no idea",
    "Final Answer: 6",
    "7",
    "Tom has 8 apples, so 8 - 2 = 6",
]
QUESTIONS = ["Tom has 3 apples and buys 5 more. How many?"] * 3 + ["What is 2 * 3?"] * 3
TRUTHS = ["8"] * 3 + ["6"] * 3


def direct_replies(served, max_tokens: int) -> list[str]:
    """What /v1/chat/completions answers, one request at a time, greedy, to each row's
    rendered default template."""
    out = []
    for c, q, t in zip(COMPLETIONS, QUESTIONS, TRUTHS):
        content = DEFAULT_TEMPLATE.format(question=q, reference=t, completion=c)
        status, data = post_json(
            served.url,
            "/v1/chat/completions",
            {
                "model": NAME,
                "messages": [{"role": "user", "content": content}],
                "max_tokens": max_tokens,
                "temperature": 0,
            },
        )
        assert status == 200, data
        out.append(data["choices"][0]["message"]["content"])
    return out


def test_scores_are_the_parsed_replies_of_grpo_serve(served, tmp_path, monkeypatch):
    write_package(
        tmp_path,
        {"parse.py": "def length(text):\n    return float(len(text))\n"},
        name="judge_parsers",
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    replies = direct_replies(served, max_tokens=12)
    assert len({len(r) for r in replies}) > 1, replies  # the rows can be told apart

    by_length = judge(
        served.url + "/v1", parser="judge_parsers.parse:length", max_tokens=12, concurrency=4
    )
    values, metrics = by_length(COMPLETIONS, question=QUESTIONS, ground_truth=TRUTHS)
    assert values == [float(len(r)) for r in replies]
    assert metrics["failures"] == 0 and metrics["retries"] == 0 and metrics["latency_s"] > 0

    # parser number, on_failure 0.5: the last number of each reply where it has one
    numbers = [score_parser("number")(r) for r in replies]
    values, metrics = judge(served.url + "/v1", max_tokens=12, on_failure=0.5)(
        COMPLETIONS, question=QUESTIONS, ground_truth=TRUTHS
    )
    assert values == [0.5 if x is None else x for x in numbers]
    assert metrics["failures"] == sum(x is None for x in numbers)


def health_batches(served) -> int:
    host, port = served.url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("GET", "/health")
    batches = json.loads(conn.getresponse().read())["batches"]
    conn.close()
    return batches


def test_parallel_requests_share_the_servers_batches(served):
    """concurrency 1: one sampler call per row; concurrency 6: the rows arrive together and
    share calls (the server batches requests that wait at the same time)."""
    n = len(COMPLETIONS)
    counts, results = {}, {}
    for concurrency in (1, n):
        before = health_batches(served)
        fn = judge(served.url + "/v1", max_tokens=4, on_failure=-1.0, concurrency=concurrency)
        results[concurrency] = fn(COMPLETIONS, question=QUESTIONS, ground_truth=TRUTHS)[0]
        counts[concurrency] = health_batches(served) - before
    assert counts[1] == n and counts[n] < n, counts
    assert results[1] == results[n]  # greedy: the same replies either way


def test_an_unknown_model_is_one_request_and_names_the_status(served):
    fn = judge(served.url + "/v1", model="not-served", retries=3, backoff_s=0.01)
    with pytest.raises(GrpoError, match=r"HTTP 404: .*not served here") as err:
        fn(["x"], question=["q"], ground_truth=["1"])
    assert f"{served.url}/v1/chat/completions" in str(err.value)
    assert "after" not in str(err.value)  # a 404 is not retried


# -- parsing and scale, by hand ---------------------------------------------------------------


@pytest.mark.parametrize(
    "reply, score",
    [
        ("Score: 7", 7.0),
        ("Score: 7/10", 7.0),  # a denominator is not the score
        ("**8**", 8.0),
        ("I give it 8.5 out of 10", 10.0),  # the last number: `pattern` reads such replies
        ("Score: -1", -1.0),
        ("gpt4 rates it 6.", 6.0),  # a number glued to a word is not one
        ("1-10 scale, answer 3", 3.0),
        ("no score here", None),
        ("", None),
    ],
)
def test_number_parser(reply, score):
    assert score_parser("number")(reply) == score


@pytest.mark.parametrize(
    "pattern, reply, score",
    [
        (r"(\d+(?:\.\d+)?) out of", "I give it 8.5 out of 10", 8.5),
        (r"Score:\s*(\d+)", "Score: 3\nOn reflection, Score: 9", 9.0),  # the last match
        (r"Score:\s*(\d+)", "score 3", None),  # case matters
        (r"\d+", "a 12 b 3", 3.0),  # no group: the whole match
        (r"verdict: (\w+)", "verdict: good", None),  # group 1 is not a number
    ],
)
def test_number_parser_with_a_pattern(pattern, reply, score):
    assert score_parser("number", pattern)(reply) == score


@pytest.mark.parametrize(
    "reply, score",
    [
        ("Yes, the answer is right.", 1.0),
        ("NO.", 0.0),
        ("The answer is not correct, so: no", 0.0),  # 'not' is not the word 'no'
        ("yes and no", 1.0),  # the first one decides
        ("Yesterday I knew", None),
        ("", None),
    ],
)
def test_yes_no_parser(reply, score):
    assert score_parser("yes_no")(reply) == score


@pytest.mark.parametrize(
    "scale, reply, value",
    [
        ([0, 10], "Score: 7", 0.7),
        ([0, 10], "Score: 0", 0.0),
        ([0, 10], "Score: 10/10", 1.0),
        ([1, 5], "4", 0.75),  # (4 - 1) / (5 - 1)
        ([-1, 1], "0", 0.5),
    ],
)
def test_scale_maps_linearly_to_0_1(echo, scale, reply, value):
    fn = judge(echo.url, template="{completion}", scale=scale)
    values, metrics = fn([reply])
    assert values == [pytest.approx(value, abs=1e-12)] and metrics["failures"] == 0
    assert reward_bounds(fn) == (0.0, 1.0)


@pytest.mark.parametrize(
    "reply, cause",
    [
        ("Score: 12", r"score 12 is outside scale \[0, 10\]: the judge did not follow the scale"),
        ("Score: -3", r"score -3 is outside scale \[0, 10\]"),
        # an exponent is read whole: 1e999 is inf, never the "1" before it
        ("Score: 1e999", r"parser 'number' returned inf .*expected a finite number"),
        ("Score: 2e1", r"score 20 is outside scale \[0, 10\]"),
        (
            "I cannot grade this.",
            r"no score in the reply 'I cannot grade this.' \(parser 'number'\)",
        ),
    ],
)
def test_an_unreadable_or_out_of_scale_score_is_a_failure(echo, reply, cause):
    fn = judge(echo.url, template="{completion}", scale=[0, 10])
    with pytest.raises(GrpoError, match=rf"row 1 .*{cause}"):
        fn(["Score: 5", reply])
    values, metrics = judge(echo.url, template="{completion}", scale=[0, 10], on_failure=-1.0)(
        ["Score: 5", reply]
    )
    assert values == [0.5, -1.0]
    assert metrics["failures"] == 1 and isinstance(metrics["failures"], Sum)


def test_a_reply_nested_too_deep_is_a_failure_under_on_failure(fake_judge):
    """A reply body of 100,000 nested lists (json.loads: RecursionError) is the row's failure,
    so on_failure applies, instead of an exception past it."""
    deep = "[" * 100_000 + "]" * 100_000
    server = fake_judge(lambda body, n: (200, deep, {}))
    fn = judge(server.url, template="{completion}", on_failure=-1.0, retries=0)
    values, metrics = fn(["a"])
    assert values == [-1.0] and metrics["failures"] == 1


def test_a_custom_parser_that_raises_fails_the_row(echo, tmp_path, monkeypatch):
    write_package(
        tmp_path, {"parse.py": "def strict(text):\n    return float(text)\n"}, name="judge_strict"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = judge(
        echo.url, template="{completion}", parser="judge_strict.parse:strict", on_failure=0.0
    )
    assert fn(["2.5", "two"])[0] == [2.5, 0.0]
    with pytest.raises(
        GrpoError,
        match=r"row 0 .*parser 'judge_strict.parse:strict' raised "
        r"ValueError",
    ):
        judge(echo.url, template="{completion}", parser="judge_strict.parse:strict")(["two"])


# -- the request -----------------------------------------------------------------------------


def test_the_request_carries_the_rendered_template_and_settings(fake_judge, monkeypatch):
    monkeypatch.setenv("GRPO_TEST_JUDGE_KEY", "sekret")
    fake = fake_judge(lambda body, n: (200, chat_reply("Score: 4"), {}))
    fn = judge(
        fake.url + "/",
        template="Q={question} R={reference} A={completion}",
        max_tokens=7,
        temperature=0.5,
        api_key_env="GRPO_TEST_JUDGE_KEY",
    )
    values, _ = fn(["x {y}", "z"], question=["q1", "q2"], answer=["1", "2"])  # answer: reference
    assert values == [4.0, 4.0]
    assert sorted(fake.contents()) == ["Q=q1 R=1 A=x {y}", "Q=q2 R=2 A=z"]
    for r in fake.requests:
        assert r["path"] == "/v1/chat/completions" and r["auth"] == "Bearer sekret"
        assert {k: v for k, v in r["body"].items() if k != "messages"} == {
            "model": NAME,
            "max_tokens": 7,
            "temperature": 0.5,
        }
    # ground_truth comes before answer
    fn(["z"], question=["q"], ground_truth=["gt"], answer=["a"])
    assert fake.contents()[-1] == "Q=q R=gt A=z"


def test_a_field_the_rows_lack_is_named_at_the_first_call(echo):
    with pytest.raises(
        GrpoError,
        match=r"uses \{question\} and the rows have no 'question' "
        r"column \(columns: ground_truth\)",
    ):
        judge(echo.url)(["x"], ground_truth=["1"])
    with pytest.raises(GrpoError, match=r"uses \{reference\} .* no 'ground_truth' or 'answer'"):
        judge(echo.url)(["x"], question=["q"])
    assert not echo.requests


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"base_url": None}, r"base_url is required"),
        ({"base_url": "file:///etc/passwd"}, r"base_url must be an http\(s\):// URL"),
        ({"model": None}, r"model is required"),
        ({"parser": "score"}, r"parser must be 'number', 'yes_no' or a 'package.module:function'"),
        ({"parser": "no_such_judge_pkg.mod:fn"}, r"cannot import module 'no_such_judge_pkg.mod'"),
        ({"parser": "yes_no", "pattern": r"\d"}, r"pattern is read by parser 'number'"),
        ({"pattern": "(unclosed"}, r"pattern '\(unclosed' is not a valid regex"),
        ({"template": "{question} {score}"}, r"template has unknown fields \['score'\]"),
        ({"template": "{question"}, r"template is not a valid format string"),
        ({"template": "{question:>x}"}, r"template is not a valid format string"),
        ({"scale": [10, 0]}, r"scale must be \[lo, hi\]"),
        ({"scale": [0]}, r"scale must be \[lo, hi\]"),
        ({"concurrency": 0}, r"concurrency must be a whole number >= 1, got 0"),
        ({"retries": -1}, r"retries must be a whole number >= 0"),
        ({"request_timeout_s": 0}, r"request_timeout_s must be a finite number > 0"),
        ({"on_failure": "skip"}, r"on_failure must be 'error' or a finite number"),
        ({"on_failure": True}, r"on_failure must be 'error' or a finite number"),
        ({"max_tokens": 0}, r"max_tokens must be a whole number >= 1"),
        ({"temperature": -1}, r"temperature must be a finite number >= 0"),
        ({"api_key_env": "GRPO_TEST_JUDGE_UNSET"}, r"GRPO_TEST_JUDGE_UNSET is not set"),
        ({"temperatur": 0.0}, r"reward 'judge': .*temperatur.* \(parameters: base_url, model"),
    ],
)
def test_bad_parameters_fail_at_construction(kwargs, message, monkeypatch):
    monkeypatch.delenv("GRPO_TEST_JUDGE_UNSET", raising=False)
    spec = {"name": "judge", "base_url": "http://127.0.0.1:1/v1", "model": NAME, **kwargs}
    with pytest.raises(GrpoError, match=message):
        get_reward({k: v for k, v in spec.items() if v is not None})


# -- failing loudly --------------------------------------------------------------------------


def test_a_closed_port_raises_naming_the_url_or_counts_failures(caplog):
    url = f"http://127.0.0.1:{closed_port()}/v1"
    fn = judge(url, retries=1, backoff_s=0.01)
    with pytest.raises(
        GrpoError,
        match=r"reward 'judge' failed at row 0 \(completion 'x'\): "
        rf"POST {url}/chat/completions failed after 2 attempts: connection "
        r"refused",
    ):
        fn(["x"], question=["q"], ground_truth=["1"])

    fn = judge(url, retries=1, backoff_s=0.01, on_failure=0.0)
    with caplog.at_level(logging.WARNING, logger="grpo.rewards.judge"):
        values, metrics = fn(["a", "b", "c"], question=["q"] * 3, ground_truth=["1"] * 3)
    assert values == [0.0, 0.0, 0.0]
    assert metrics["failures"] == 3 and metrics["retries"] == 3  # one retry each
    assert "3 of 3 judgments failed" in caplog.text and url in caplog.text


@pytest.mark.parametrize("status", [500, 503, 429])
def test_transient_errors_are_retried(fake_judge, status):
    """Two errors, then a reply: retries 2 succeed on the third attempt, retries 1 fail."""

    def flaky(body, n):
        if n % 3 in (1, 2):
            return status, {"error": {"message": "busy"}}, {}
        return 200, chat_reply("Score: 5"), {}

    fake = fake_judge(flaky)
    values, metrics = judge(fake.url, template="{completion}", retries=2, backoff_s=0.01)(["x"])
    assert values == [5.0] and metrics["retries"] == 2 and len(fake.requests) == 3
    fn = judge(fake.url, template="{completion}", retries=1, backoff_s=0.01)
    with pytest.raises(GrpoError, match=rf"failed after 2 attempts: HTTP {status}: 'busy'"):
        fn(["x"])
    assert len(fake.requests) == 5


def test_retry_after_is_waited(fake_judge):
    fake = fake_judge(
        lambda body, n: (429, "", {"Retry-After": "1"}) if n == 1 else (200, chat_reply("3"), {})
    )
    start = time.monotonic()
    values, _ = judge(fake.url, template="{completion}", backoff_s=0.0)(["x"])
    assert values == [3.0] and time.monotonic() - start >= 1.0


def test_a_client_error_is_not_retried(fake_judge):
    fake = fake_judge(lambda body, n: (401, {"error": {"message": "bad key"}}, {}))
    with pytest.raises(GrpoError, match=r"POST .*/v1/chat/completions: HTTP 401: 'bad key'"):
        judge(fake.url, template="{completion}", retries=3)(["x"])
    assert len(fake.requests) == 1


@pytest.mark.parametrize(
    "payload, cause",
    [
        ("not json", r"the reply has no choices\[0\].message.content: 'not json'"),
        ({"choices": []}, r"the reply has no choices\[0\].message.content"),
        ({"choices": [{"message": {"content": None}}]}, r"content is None, not text"),
    ],
)
def test_a_malformed_reply_is_a_failure(fake_judge, payload, cause):
    fake = fake_judge(lambda body, n: (200, payload, {}))
    with pytest.raises(GrpoError, match=cause):
        judge(fake.url, template="{completion}")(["x"])
    assert len(fake.requests) == 1  # the judge misbehaved: not retried


def test_a_slow_judge_fails_within_the_timeout(fake_judge):
    fake = fake_judge(lambda body, n: (fake.release.wait(10), (200, chat_reply("1"), {}))[1])
    fn = judge(fake.url, template="{completion}", request_timeout_s=0.5, retries=0)
    start = time.monotonic()
    with pytest.raises(GrpoError, match=r"no complete reply within request_timeout_s=0.5 s"):
        fn(["x"])
    assert time.monotonic() - start < 3.0

    fn = judge(
        fake.url,
        template="{completion}",
        request_timeout_s=0.5,
        retries=1,
        backoff_s=0.01,
        on_failure=0.25,
        concurrency=2,
    )
    start = time.monotonic()
    values, metrics = fn(["x", "y"])
    assert values == [0.25, 0.25] and metrics["failures"] == 2 and metrics["retries"] == 2
    assert time.monotonic() - start < 4.0  # two attempts of 0.5 s per row, rows in parallel


@pytest.mark.parametrize("status", [302, 307])
def test_a_redirect_is_not_followed_and_the_key_goes_nowhere_else(fake_judge, monkeypatch, status):
    """A judge answering a redirect to another origin (another port): the redirect is not
    followed, so the other server never sees the API key nor scores the row (it would answer
    9); the row fails at once (not retried) with one line naming the status and the Location."""
    monkeypatch.setenv("GRPO_TEST_JUDGE_KEY", "sekret")
    other = fake_judge(lambda body, n: (200, chat_reply("Score: 9"), {}))
    target = other.url + "/chat/completions"
    fake = fake_judge(lambda body, n: (status, "", {"Location": target}))
    kwargs = {"template": "{completion}", "api_key_env": "GRPO_TEST_JUDGE_KEY", "retries": 2}
    message = (
        rf"POST {fake.url}/chat/completions: HTTP {status}: the judge redirected to "
        rf"'{target}'; redirects are not followed \(base_url must be the endpoint itself\)"
    )
    with pytest.raises(GrpoError, match=message) as err:
        judge(fake.url, backoff_s=0.01, **kwargs)(["x"])
    assert "\n" not in str(err.value)
    values, metrics = judge(fake.url, on_failure=0.0, backoff_s=0.01, **kwargs)(["x"])
    assert values == [0.0] and metrics["failures"] == 1 and metrics["retries"] == 0
    assert other.requests == []  # neither the key nor any request reached the other origin
    assert [r["auth"] for r in fake.requests] == ["Bearer sekret"] * 2  # one attempt per call


def test_a_hung_judge_fails_within_total_timeout_s(hung_judge, caplog):
    """A judge that accepts and never answers, with retries without end: each row's judgment
    (its attempts and the waits between them) ends at total_timeout_s."""
    fn = judge(
        hung_judge,
        template="{completion}",
        request_timeout_s=0.4,
        retries=1_000_000,
        backoff_s=0.05,
        total_timeout_s=1.5,
        on_failure=-1.0,
        concurrency=2,
    )
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="grpo.rewards.judge"):
        values, metrics = fn(["x", "y"])
    elapsed = time.monotonic() - start
    assert values == [-1.0, -1.0] and metrics["failures"] == 2
    assert elapsed < 1.5 + 1.0, elapsed  # rows in parallel, each ended by 1.5 s
    assert metrics["retries"] >= 2  # it retried while time was left
    assert "no complete reply within" in caplog.text and "total_timeout_s=1.5 s" in caplog.text

    # one attempt longer than the total: cut at the total, which the cause names
    fn = judge(hung_judge, template="{completion}", request_timeout_s=30, total_timeout_s=0.5)
    start = time.monotonic()
    with pytest.raises(GrpoError, match=r"no complete reply within total_timeout_s=0.5 s"):
        fn(["x"])
    assert time.monotonic() - start < 0.5 + 1.0


EXIT_SCRIPT = """
import sys, time
from grpo.errors import GrpoError
from grpo.rewards import get_reward
from grpo.rewards.compute import call_reward

spec = {"name": "judge", "base_url": sys.argv[1], "model": "m", "template": "{completion}",
        "concurrency": 2, "retries": 0, "request_timeout_s": 60}
fn = get_reward(spec)
try:  # row 1 fails at once, row 0 hangs: the call raises, row 0's thread waits on
    fn(["hang", "bad"])
except GrpoError as e:
    print("failed:", e, flush=True)
try:  # the reward's own timeout: the call is abandoned, its threads wait on
    call_reward("judge", fn, ["hang", "hang"], {}, timeout_s=0.5)
except GrpoError as e:
    print("timed out:", e, flush=True)
print("end", time.time(), flush=True)
"""


def test_judge_threads_do_not_hold_the_process_open(fake_judge):
    """A process whose judge calls ended (a failure, the reward's timeout) while requests
    still hang exits at once: the judge's threads do not keep the interpreter alive."""
    hanging = threading.Event()

    def respond(body, n):
        if body["messages"][0]["content"] == "hang":
            hanging.set()
            fake.release.wait(60)
            return 200, chat_reply("1"), {}
        hanging.wait(10)  # the hanging row is in flight when this one fails
        return 400, {"error": {"message": "no"}}, {}

    fake = fake_judge(respond)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.Popen(
        [sys.executable, "-c", EXIT_SCRIPT, fake.url],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        lines = [proc.stdout.readline() for _ in range(3)]
        assert lines[0].startswith("failed: reward 'judge' failed at row 1"), lines
        assert "did not return within its timeout_s=0.5 s" in lines[1], lines
        assert lines[2].startswith("end "), lines
        ended = float(lines[2].split()[1])
        rc = proc.wait(timeout=10)
        exited = time.time()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert rc == 0 and exited - ended < 3.0, (rc, exited - ended)


def test_a_second_sigterm_during_a_judgment_stops_at_once(hung_judge, capfd):
    """The trainer's stop (`StopSignal`): a second SIGTERM during a hung judgment raises
    KeyboardInterrupt, which leaves the reward call as the stop it is, not as an error of the
    judge ("raised KeyboardInterrupt")."""
    from grpo.rewards.compute import call_reward
    from grpo.run.rundir import StopSignal

    fn = judge(hung_judge, template="{completion}", request_timeout_s=30, retries=0)
    stop = StopSignal()
    stop.install()

    def twice():
        for _ in range(2):
            time.sleep(0.3)
            os.kill(os.getpid(), signal.SIGTERM)

    sender = threading.Thread(target=twice, daemon=True)
    start = time.monotonic()
    try:
        sender.start()
        with pytest.raises(KeyboardInterrupt):
            call_reward("judge", fn, ["x"], {}, timeout_s=30)
    finally:
        stop.restore()
        sender.join(5)
    assert time.monotonic() - start < 5.0
    assert (
        stop.signum == signal.SIGTERM
        and "SIGTERM: stopping after this step" in capfd.readouterr().err
    )


def test_concurrency_bounds_the_requests_in_flight(fake_judge):
    """With concurrency 3 the judge holds exactly 3 requests at once: a barrier of 3 in the
    server passes only when 3 are in flight (else every request would time out)."""
    barrier = threading.Barrier(3, timeout=10)

    def together(body, n):
        barrier.wait()
        time.sleep(0.02)
        return 200, chat_reply(body["messages"][0]["content"]), {}

    fake = fake_judge(together)
    fn = judge(fake.url, template="{completion}", concurrency=3, retries=0)
    values, metrics = fn([str(i) for i in range(6)])
    assert values == [float(i) for i in range(6)]  # each row its own reply, in row order
    assert fake.max_in_flight == 3 and metrics["failures"] == 0


def test_the_trainer_does_not_send_the_requests_again_to_name_a_row(fake_judge):
    """A failed judgment names its row itself: compute_rewards does not call the reward again
    row by row to find it (which would send the requests again)."""
    barrier = threading.Barrier(3, timeout=10)  # the 3 rows' requests all arrive, then fail

    def refuse(body, n):
        barrier.wait()
        return 400, {"error": {"message": "no"}}, {}

    fake = fake_judge(refuse)
    fns = build_rewards(
        [
            {
                "name": "judge",
                "base_url": fake.url,
                "model": NAME,
                "template": "{completion}",
                "concurrency": 3,
            }
        ]
    )
    with pytest.raises(GrpoError, match=r"^reward 'judge' failed at row \d .*HTTP 400: 'no'"):
        compute_rewards(fns, ["a", "b", "c"], {})
    assert len(fake.requests) == 3


# -- through the trainer ---------------------------------------------------------------------


def test_one_grpo_step_is_scored_by_the_judge(shared_tiny_model, tmp_path, fake_judge):
    """A fake judge scores each completion len(completion) % 11 out of 10: the step's reward
    is the mean of those scores / 10, and the judge's metrics are logged."""

    def grade(body, n):
        completion = body["messages"][0]["content"].split("\nA: ", 1)[1]
        return 200, chat_reply(f"Score: {len(completion) % 11}"), {}

    fake = fake_judge(grade)
    spec = [
        {
            "name": "judge",
            "weight": 1.0,
            "kwargs": {
                "base_url": fake.url,
                "model": NAME,
                "template": "Q: {question}\nR: {reference}\nA: {completion}",
                "scale": [0, 10],
            },
        }
    ]
    cfg = load_config(
        REPO / "configs" / "tiny_ci.yaml",
        [
            f"model.path={shared_tiny_model}",
            f"train.output_dir={tmp_path / 'run'}",
            "train.max_steps=1",
            "train.save_every=0",
            "train.log_every=1",
            "data.eval_samples=0",
            "train.progress=false",
            "loss.num_iterations=1",
            f"rewards={json.dumps(spec)}",
        ],
    )
    from grpo.train.grpo import train_grpo

    train_grpo(cfg)
    (row,) = read_metrics(tmp_path / "run" / "metrics.jsonl")
    B = cfg.train.batch_size
    assert len(fake.requests) == B
    scores = []
    for content in fake.contents():
        question, rest = content.removeprefix("Q: ").split("\nR: ", 1)
        reference, completion = rest.split("\nA: ", 1)
        assert question.strip() and reference.strip().isdigit()  # a minimath row's columns
        scores.append(len(completion) % 11 / 10)
    assert row["rewards/judge"] == pytest.approx(sum(scores) / B, rel=1e-6)
    assert row["rollout/reward_mean"] == pytest.approx(sum(scores) / B, rel=1e-6)
    assert row["rewards/judge/failures"] == 0 and row["rewards/judge/retries"] == 0
    assert row["rewards/judge/latency_s"] > 0


def test_a_judge_outage_mid_run_names_the_checkpoint_and_the_resume_command(
    shared_tiny_model, tmp_path, fake_judge, monkeypatch, capsys
):
    """The judge answers the first step's 8 judgments (a checkpoint), then is down (503, no
    retries left): the run stops with one line naming the failed judgment, the last checkpoint
    and the command that resumes from it, as the guards' stops do; the resumed run goes on
    once the judge is back."""
    from grpo.apps import cli

    up = threading.Event()

    def grade(body, n):
        if n > 8 and not up.is_set():  # tiny_ci: 8 completions a step
            return 503, {"error": "overloaded"}, {}
        return 200, chat_reply("Score: 5"), {}

    fake = fake_judge(grade)
    spec = {"name": "judge", "kwargs": {"base_url": fake.url, "model": NAME, "retries": 0}}
    monkeypatch.chdir(tmp_path)
    args = ["train", "--config", str(REPO / "configs" / "tiny_ci.yaml")]
    args += [f"model.path={shared_tiny_model}", "train.output_dir=run", "train.save_every=1"]
    args += ["data.eval_samples=0", "train.progress=false", "rollout.max_new_tokens=8"]
    args += ["loss.num_iterations=1", "train.max_steps=2", f"rewards=[{json.dumps(spec)}]"]
    assert cli.main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err[-3000:]
    assert err.startswith("grpo train: error: reward 'judge' failed at row "), err
    assert "HTTP 503" in err or "503" in err
    assert err.endswith(
        "; the last checkpoint stays: run/checkpoints/step_000001 (step 1); resume from it "
        "with: grpo train --config run/config.yaml --resume"
    ), err
    up.set()
    assert cli.main(["train", "--config", "run/config.yaml", "--resume"]) == 0
    steps = [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "step" in r]
    assert sorted(set(steps)) == [1, 2]

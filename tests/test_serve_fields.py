"""grpo serve's request fields against the installed `openai` client: every field of its Chat
Completions / Completions request types (and of the messages it sends back) is classified in
`FIELDS` and in docs/serving.md's table; accepted fields at a typical client value are not
refused; refused ones name the field; unknown fields are ignored with a header (or refused
under strict requests). The sampler's logit_bias / repetition_penalty / min_p (pure functions
against hand-computed values, then served); GET /v1/models/{id}, 405s, and a disconnected
stream freeing its batch rows."""

from __future__ import annotations

import http.client
import json
import re
import time
from multiprocessing.pool import ThreadPool
from pathlib import Path

import openai
import openai.types.chat as chat_types
import pytest
import torch
from openai.types import completion_create_params as completion_params
from openai.types.chat import ChatCompletionMessage
from openai.types.chat import completion_create_params as chat_params

from grpo.apps.serving.protocol import (
    FIELDS,
    IGNORED,
    IMPLEMENTED,
    REFUSED,
    ChatBody,
    CompletionBody,
    Message,
    StreamOptions,
)
from grpo.rollout import Sampler
from grpo.rollout.sampling import (
    apply_logit_bias,
    apply_repetition_penalty,
    logit_bias_tensor,
    seen_tokens,
)
from grpo.settings import setting_key

# every client here talks to 127.0.0.1 only (conftest.loopback_only)
pytestmark = pytest.mark.usefixtures("loopback_only")

NAME = "tiny"
DOCS = Path(__file__).resolve().parents[1] / "docs" / "serving.md"
MESSAGE_PARAMS = (
    "ChatCompletionAssistantMessageParam",
    "ChatCompletionUserMessageParam",
    "ChatCompletionSystemMessageParam",
    "ChatCompletionDeveloperMessageParam",
    "ChatCompletionToolMessageParam",
)


# -- the field lists ---------------------------------------------------------------------------


def openai_fields() -> dict[str, set[str]]:
    """The installed client's request fields, by scope of `FIELDS`."""
    message = set(ChatCompletionMessage.model_fields)
    for name in MESSAGE_PARAMS:
        message |= set(getattr(chat_types, name).__annotations__)
    return {
        "chat": set(chat_params.CompletionCreateParamsBase.__annotations__),
        "completions": set(completion_params.CompletionCreateParamsBase.__annotations__),
        "message": message,
        "stream_options": set(chat_types.ChatCompletionStreamOptionsParam.__annotations__),
    }


@pytest.mark.parametrize("scope", ["chat", "completions", "message", "stream_options"])
def test_every_openai_field_is_classified_and_parsed(scope):
    fields = openai_fields()[scope]
    missing = sorted(fields - set(FIELDS[scope]))
    assert not missing, f"{scope}: fields of openai {openai.__version__} not in FIELDS: {missing}"
    cls = {
        "chat": ChatBody,
        "completions": CompletionBody,
        "message": Message,
        "stream_options": StreamOptions,
    }[scope]
    keys = {setting_key(f) for f in cls.__dataclass_fields__.values() if f.init}
    assert set(FIELDS[scope]) <= keys  # every classified field is read by the body
    assert {s for s, _ in FIELDS[scope].values()} <= {IMPLEMENTED, IGNORED, REFUSED}


def test_docs_table_mirrors_fields():
    text = DOCS.read_text()
    rows = re.findall(r"^\| (\w+) \| `(\w+)` \| (\w+) \| (.*) \|$", text, flags=re.M)
    table = {(scope, name): (status, note) for scope, name, status, note in rows}
    assert len(table) == len(rows)  # no field listed twice
    want = {(scope, name): v for scope, fields in FIELDS.items() for name, v in fields.items()}
    assert table == want


# -- the pure sampling functions ---------------------------------------------------------------


def test_repetition_penalty_hand_computed():
    logits = torch.tensor([[2.0, -1.0, 0.5, -3.0], [1.0, 1.0, -2.0, 4.0]])
    seen = torch.tensor([[True, True, False, False], [False, True, True, False]])
    out = apply_repetition_penalty(logits, seen, torch.tensor([2.0, 0.5]))
    # row 0, penalty 2: 2/2 = 1, -1*2 = -2, unseen kept; row 1, penalty 0.5: 1/0.5 = 2,
    # -2*0.5 = -1
    want = torch.tensor([[1.0, -2.0, 0.5, -3.0], [1.0, 2.0, -1.0, 4.0]])
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    same = apply_repetition_penalty(logits, seen, torch.tensor([1.0, 1.0]))
    torch.testing.assert_close(same, logits, rtol=0, atol=0)


def test_logit_bias_and_seen_tokens():
    bias = logit_bias_tensor([{1: 5.0, 3: -100.0}, None], 4)
    torch.testing.assert_close(bias, torch.tensor([[0.0, 5.0, 0.0, -100.0], [0.0] * 4]))
    out = apply_logit_bias(torch.ones(2, 4), bias)
    torch.testing.assert_close(out, torch.tensor([[1.0, 6.0, 1.0, -99.0], [1.0] * 4]))
    # left padding with pad id 0 does not count as a seen 0; a real 0 does
    ids = torch.tensor([[0, 0, 2, 3], [0, 1, 0, 2]])
    keep = torch.tensor([[False, False, True, True], [True, True, True, True]])
    seen = seen_tokens(ids, keep, 5)
    assert seen.tolist() == [[False, False, True, True, False], [True, True, True, False, False]]


def test_sampler_adjustments_equal_float64_recompute(tiny_checkpoints):
    """Greedy with a repetition penalty and a logit bias, per row, equals a float64 loop that
    recomputes the whole sequence each step and applies HF's rule by hand."""
    from grpo.models import load_model

    model = load_model(tiny_checkpoints("llama")).eval()
    V = model.config.vocab_size
    prompts = [[5, 6, 7, 5], [9, 10]]
    penalty = torch.tensor([1.7, 1.0])
    bias = logit_bias_tensor([{11: 3.0}, {12: 100.0}], V)
    r = Sampler(model).sample(
        prompts,
        group_size=1,
        max_new_tokens=6,
        temperature=0.0,
        stop_ids=[V - 1],
        seed=0,
        logit_bias=bias,
        repetition_penalty=penalty,
    )
    assert r.completion_ids[1].tolist() == [12] * 6  # +100 forces the token
    for b, prompt in enumerate(prompts):
        ids = list(prompt)
        for _ in range(6):
            with torch.no_grad():
                logits = model(torch.tensor([ids]))[0, -1].double()  # (V,)
            for t in set(ids):
                x = logits[t]
                logits[t] = x / penalty[b] if x > 0 else x * penalty[b]
            ids.append(int((logits + bias[b].double()).argmax()))
        assert r.completion_ids[b].tolist() == ids[len(prompt) :], b


# -- the server --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(shared_tiny_model, serve_cli):
    with serve_cli(
        "--model",
        str(shared_tiny_model),
        "--port",
        "0",
        "--max-tokens-limit",
        "64",
        "--served-model-name",
        NAME,
    ) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def call(srv, method: str, path: str, payload=None):
    host, port = srv.url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    body = None if payload is None else json.dumps(payload).encode()
    conn.request(method, path, body=body, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    data = json.loads(resp.read())
    conn.close()
    return resp.status, data, resp


def assert_openai_error(data: dict, param=None):
    assert set(data) == {"error"}
    assert set(data["error"]) == {"message", "type", "param", "code"}
    assert data["error"]["type"] == "invalid_request_error"
    assert data["error"]["param"] == param


def test_model_by_id_and_wrong_methods(server, client):
    assert client.models.retrieve(NAME).id == NAME
    status, data, _ = call(server, "GET", f"/v1/models/{NAME}")
    assert status == 200 and data == call(server, "GET", "/v1/models")[1]["data"][0]
    status, data, _ = call(server, "GET", "/v1/models/other")
    assert status == 404 and data["error"]["code"] == "model_not_found"
    assert_openai_error(data, "model")
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other")
    for method, path in [
        ("POST", "/v1/models"),
        ("DELETE", f"/v1/models/{NAME}"),
        ("GET", "/v1/chat/completions"),
        ("PUT", "/v1/completions"),
    ]:
        status, data, resp = call(server, method, path, {} if method != "GET" else None)
        assert status == 405, (method, path)
        assert_openai_error(data)
        assert method in data["error"]["message"] and resp.getheader("Allow")


CHAT = dict(
    model=NAME,
    messages=[{"role": "user", "content": "Ann has 3 apples."}],
    max_tokens=4,
    temperature=0,
)

# a typical value the openai client sends for each field that is implemented or ignored
TYPICAL = {
    "store": True,
    "metadata": {"run": "a"},
    "service_tier": "auto",
    "verbosity": "medium",
    "prompt_cache_key": "k1",
    "prompt_cache_options": {"mode": "implicit"},
    "prompt_cache_retention": "24h",
    "safety_identifier": "u-1",
    "user": "u-1",
    "prediction": {"type": "content", "content": "Ann"},
    "logit_bias": {"5": 10, "6": -100},
    "stop": [],
    "seed": 3,
    "n": 2,
    "top_p": 0.9,
    "parallel_tool_calls": True,
    "stream_options": None,
    "max_completion_tokens": 4,
    "presence_penalty": 0,
    "frequency_penalty": 0,
    "logprobs": False,
    "response_format": {"type": "text"},
    "modalities": ["text"],
}


def test_accepted_fields_at_typical_values(server, client):
    for key, value in TYPICAL.items():
        status, data, _ = call(server, "POST", "/v1/chat/completions", {**CHAT, key: value})
        assert status == 200, (key, data)
    out = client.chat.completions.create(
        **CHAT,
        **{
            k: TYPICAL[k]
            for k in (
                "store",
                "metadata",
                "service_tier",
                "verbosity",
                "prompt_cache_key",
                "safety_identifier",
                "logit_bias",
                "stop",
            )
        },
        extra_body={"min_p": 0.1, "repetition_penalty": 1.2, "top_k": 5},
    )
    assert out.choices[0].message.role == "assistant"
    out = client.completions.create(
        model=NAME,
        prompt="Ben",
        max_tokens=4,
        stop=[],
        logit_bias={"5": 1},
        user="u",
        extra_body={"min_p": 0.05, "repetition_penalty": 1.1},
    )
    assert out.choices[0].text is not None


def test_echoed_response_message_is_accepted(client):
    msg = client.chat.completions.create(**CHAT).choices[0].message
    dumped = msg.model_dump()  # annotations, refusal, audio, function_call: all there
    assert {"annotations", "refusal", "audio", "function_call"} <= set(dumped)
    messages = [*CHAT["messages"], dumped, {"role": "user", "content": "And Ben?"}]
    out = client.chat.completions.create(**{**CHAT, "messages": messages})
    assert out.choices[0].message.role == "assistant"


@pytest.mark.parametrize(
    "key,value,why",
    [
        ("reasoning_effort", "high", "reasoning"),
        ("verbosity", "low", "verbosity"),
        ("modalities", ["audio"], "text only"),
        ("audio", {"voice": "x"}, "audio"),
        ("functions", [{"name": "f"}], "tools"),
        ("web_search_options", {}, "web search"),
        ("presence_penalty", 0.5, "0"),
        ("logit_bias", {"5": 101}, "[-100, 100]"),
        ("logit_bias", {"a": 1}, "token ids"),
        ("logit_bias", {"999999": 1}, "vocabulary"),
        ("min_p", 1.5, "[0.0, 1.0]"),
        ("repetition_penalty", 0, "(0.0, 10.0]"),
    ],
)
def test_refused_fields_name_the_field_and_why(server, key, value, why):
    status, data, _ = call(server, "POST", "/v1/chat/completions", {**CHAT, key: value})
    assert status == 400
    assert_openai_error(data, key)
    assert data["error"]["message"].startswith(key) and why in data["error"]["message"]


def test_refused_message_fields(server):
    msg = {"role": "assistant", "content": "hi", "refusal": "no"}
    status, data, _ = call(
        server, "POST", "/v1/chat/completions", {**CHAT, "messages": [*CHAT["messages"], msg]}
    )
    assert status == 400 and data["error"]["param"] == "messages[1].refusal"


def test_the_ignored_fields_header_stays_readable(server, client):
    """20,000 unknown fields: the header names the first ones and how many more (at most
    IGNORED_HEADER_CHARS), so the client can still read the reply."""
    from grpo.apps.serving.app import IGNORED_HEADER_CHARS

    extra = {f"zz_field_{i:05d}": 1 for i in range(20_000)}
    raw = client.chat.completions.with_raw_response.create(**CHAT, extra_body=extra)
    value = raw.headers["X-Ignored-Fields"]
    assert len(value) <= IGNORED_HEADER_CHARS + 32 and value.endswith(" more)")
    assert value.startswith("zz_field_00000, zz_field_00001")
    assert raw.parse().choices[0].message.role == "assistant"


def test_unknown_fields_ignored_with_header_or_strict(server, client, caplog):
    raw = client.chat.completions.with_raw_response.create(
        **CHAT, extra_body={"guided_json": {"type": "object"}, "zz_custom": 1}
    )
    assert raw.headers["X-Ignored-Fields"] == "guided_json, zz_custom"
    assert raw.parse().choices[0].message.role == "assistant"
    assert "guided_json" in caplog.text
    raw = client.chat.completions.with_raw_response.create(**CHAT)
    assert "X-Ignored-Fields" not in raw.headers
    server.service.strict_requests = True
    try:
        status, data, _ = call(
            server, "POST", "/v1/completions", {"model": NAME, "prompt": "Ben", "zz_custom": 1}
        )
    finally:
        server.service.strict_requests = False
    assert status == 400 and data["error"]["param"] == "zz_custom"


def test_logit_bias_served_per_row(server, client):
    """+100 on a token forces it; a request with a bias and one without, batched together,
    each get their own (greedy = the plain request alone)."""
    plain = client.completions.create(model=NAME, prompt="Ben", max_tokens=5, temperature=0)
    forced = client.completions.create(
        model=NAME, prompt="Ben", max_tokens=5, temperature=0, logit_bias={"40": 100}
    )
    tok = server.service.tokenizer
    assert forced.choices[0].text == tok.decode([40] * 5, skip_special_tokens=True)
    assert plain.choices[0].text != forced.choices[0].text
    with ThreadPool(2) as pool:
        both = pool.map(
            lambda bias: client.completions.create(
                model=NAME, prompt="Ben", max_tokens=5, temperature=0, logit_bias=bias
            ),
            [{}, {"40": 100}],
        )
    assert [b.choices[0].text for b in both] == [plain.choices[0].text, forced.choices[0].text]


def test_stream_disconnect_frees_its_rows_within_one_step(server):
    """A streaming client that goes away: the decode step that sees it frees its rows
    (`Engine.active_rows`), and the batch ends long before its max_tokens."""
    engine = server.engine
    sampler = engine.sampler
    steps = []  # (cancelled before this step's hook ran?, active rows after it)
    decode = sampler.decode

    def slow_decode(*args, **kw):
        job = engine.running[0] if engine.running else None
        steps.append((job is not None and job.cancelled, engine.active_rows))
        time.sleep(0.02)
        return decode(*args, **kw)

    ban = {str(t): -100 for t in engine.stop_ids}  # never stops by itself
    payload = {
        "model": NAME,
        "prompt": "Ben",
        "max_tokens": 64,
        "temperature": 0,
        "n": 2,
        "stream": True,
        "logit_bias": ban,
    }
    sampler.decode = slow_decode
    try:
        host, port = server.url.removeprefix("http://").rsplit(":", 1)
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        conn.request(
            "POST",
            "/v1/completions",
            body=json.dumps(payload).encode(),
            headers={"Content-Type": "application/json"},
        )
        resp = conn.getresponse()
        assert resp.status == 200
        assert resp.readline().startswith(b"data: ")  # mid-stream
        conn.sock.close()  # the client goes away
        conn.close()
        deadline = time.monotonic() + 30
        while engine.running and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        sampler.decode = decode
    assert not engine.running and engine.active_rows == 0
    assert steps[0][1] == 2  # both rows generating at first
    assert len(steps) < 40  # ended early, not after 64 steps
    seen = [i for i, (cancelled, _) in enumerate(steps) if cancelled]
    assert seen, "the disconnect was not seen while the batch ran"
    # freed by the step that saw it: one step later at most
    assert all(active == 0 for _, active in steps[seen[0] + 1 :])

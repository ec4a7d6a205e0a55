"""Structured outputs: `response_format` json_object / json_schema enforced while decoding.

A random-init model writes whatever its weights favour, so every reply that parses and
validates does so because of the grammar: sampled at temperature 1 over several seeds, batched
with unconstrained rows (which the grammar must leave bitwise as they were), streamed and not,
through the raw HTTP API, the `openai` client, the Agents SDK's structured `output_type` and
LangChain's `with_structured_output`.
"""

from __future__ import annotations

import json
from typing import Literal

import jsonschema
import openai
import pytest
import torch
from conftest import post_json
from pydantic import BaseModel, Field

from grpo.apps.serving.structured import Grammars, strict_schema
from grpo.tokenizer import load_tokenizer

NAME = "tiny"
pytestmark = pytest.mark.usefixtures("loopback_only")

SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "answer": {"type": "integer", "minimum": 0, "maximum": 999},
            "unit": {"enum": ["apples", "pens", "dollars"]},
            "sure": {"type": "boolean"},
            "note": {"type": "string", "maxLength": 8},
        },
        "required": ["answer", "unit", "sure", "note"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "steps": {
                "type": "array",
                "items": {"type": "integer", "minimum": -9, "maximum": 9},
                "minItems": 1,
                "maxItems": 4,
            },
            "final": {
                "type": "object",
                "properties": {"value": {"type": "number", "minimum": 0, "maximum": 10}},
                "required": ["value"],
            },
        },
        "required": ["steps", "final"],
    },
]
CHAT = {"model": NAME, "messages": [{"role": "user", "content": "Tom has 3 apples."}]}


def response_format(schema: dict, strict: bool = True) -> dict:
    return {
        "type": "json_schema",
        "json_schema": {"name": "answer", "schema": schema, "strict": strict},
    }


@pytest.fixture(scope="module")
def server(shared_tiny_model, serve_cli):
    with serve_cli(
        "--model",
        str(shared_tiny_model),
        "--port",
        "0",
        "--served-model-name",
        NAME,
        "--batch-window-ms",
        "20",
    ) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def post(srv, payload: dict) -> tuple[int, dict]:
    return post_json(srv.url, "/v1/chat/completions", payload)


@pytest.mark.parametrize("schema", SCHEMAS, ids=["flat", "nested"])
def test_every_reply_parses_and_validates(server, client, schema):
    """Temperature 1, four seeds, four choices each: every reply that stopped is JSON valid
    under the schema, and every one stopped (the bounds keep a random model's JSON short)."""
    for seed in range(4):
        r = client.chat.completions.create(
            **CHAT,
            response_format=response_format(schema),
            temperature=1.0,
            n=4,
            seed=seed,
            max_tokens=120,
        )
        for choice in r.choices:
            assert choice.finish_reason == "stop", choice
            jsonschema.validate(json.loads(choice.message.content), schema)


def test_json_object_is_an_object(client):
    for seed in range(3):
        r = client.chat.completions.create(
            **CHAT,
            response_format={"type": "json_object"},
            temperature=1.0,
            seed=seed,
            max_tokens=200,
        )
        c = r.choices[0]
        if c.finish_reason == "stop":  # a random model's keys may run long: stop = complete
            assert isinstance(json.loads(c.message.content), dict)
        else:
            assert c.message.content.startswith("{")


def test_a_cut_reply_says_length(client):
    """max_tokens ends the reply mid-JSON: finish_reason length, never a claim of JSON."""
    r = client.chat.completions.create(
        **CHAT, response_format=response_format(SCHEMAS[0]), temperature=1.0, seed=0, max_tokens=4
    )
    c = r.choices[0]
    assert c.finish_reason == "length" and c.message.content.startswith('{"')
    with pytest.raises(json.JSONDecodeError):
        json.loads(c.message.content)


def test_streamed_equals_non_streamed(client):
    kw = dict(**CHAT, response_format=response_format(SCHEMAS[0]), temperature=0, max_tokens=120)
    whole = client.chat.completions.create(**kw).choices[0]
    streamed = "".join(
        chunk.choices[0].delta.content or ""
        for chunk in client.chat.completions.create(stream=True, **kw)
        if chunk.choices
    )
    assert streamed == whole.message.content and whole.finish_reason == "stop"
    jsonschema.validate(json.loads(streamed), SCHEMAS[0])


def test_constrained_and_free_rows_share_a_batch(shared_tiny_model, server):
    """One sampler call, rows with and without a grammar: the free rows are bitwise what an
    unconstrained call draws with the same seed; the constrained ones validate."""
    engine = server.engine
    sampler, stop = engine.sampler, engine.stop_ids
    grammars = Grammars(load_tokenizer(shared_tiny_model), engine.vocab_size)
    g = grammars.compile("json_schema", SCHEMAS[0], strict=True)
    prompts = [[5, 6, 7, 8]] * 4
    kw = dict(
        group_size=1,
        max_new_tokens=60,
        temperature=1.0,
        stop_ids=stop,
        seed=3,
        pad_id=engine.pad_id,
    )
    with engine.lock:
        free = sampler.sample(prompts, **kw)
        mixed = sampler.sample(prompts, constraint=grammars.constraint([g, None, g, None]), **kw)
    for b in (1, 3):
        assert torch.equal(mixed.completion_ids[b], free.completion_ids[b])
    for b in (0, 2):
        n = int(mixed.completion_lens[b])
        assert bool(mixed.finished[b])
        text = engine.decode(mixed.completion_ids[b, : n - 1].tolist())
        jsonschema.validate(json.loads(text), SCHEMAS[0])


@pytest.mark.parametrize(
    "fmt, field",
    [
        (
            {"type": "json_schema", "json_schema": {"name": "a", "schema": {"$ref": "#/nope"}}},
            "response_format.json_schema.schema",
        ),
        ({"type": "json_schema"}, "response_format.json_schema"),
        (
            {"type": "json_schema", "json_schema": {"name": "bad name", "schema": {}}},
            "response_format.json_schema.name",
        ),
        ({"type": "yaml"}, "response_format.type"),
    ],
)
def test_bad_formats_are_400s_naming_the_field(server, fmt, field):
    status, data = post(server, {**CHAT, "response_format": fmt})
    assert status == 400 and data["error"]["param"] == field, data
    assert data["error"]["message"].startswith(field)


ENDLESS = {  # A -> B -> A, each through a required property: no finite JSON matches
    "$defs": {
        "A": {"type": "object", "properties": {"b": {"$ref": "#/$defs/B"}}, "required": ["b"]},
        "B": {"type": "object", "properties": {"a": {"$ref": "#/$defs/A"}}, "required": ["a"]},
    },
    "$ref": "#/$defs/A",
}
TREE = {  # recursion that may stop: a node's children may be none
    "$defs": {
        "node": {
            "type": "object",
            "properties": {
                "v": {"type": "integer", "minimum": 0, "maximum": 9},
                "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2},
            },
            "required": ["v", "kids"],
        }
    },
    "$ref": "#/$defs/node",
}


@pytest.mark.parametrize(
    "schema, why",
    [
        ({"$ref": "#"}, 'its $ref "#" recurses on every path'),
        (ENDLESS, 'its $ref "#/$defs/A" recurses on every path'),
        (
            {"type": "string", "pattern": "^((a{1,1000}){1,1000}){1,1000}$"},
            "nests counted repetitions whose bounds multiply to 1e+09",
        ),
    ],
    ids=["self", "a-b-a", "pattern"],
)
def test_endless_schemas_are_400s_naming_the_field(server, schema, why):
    """Schemas the engine compiles but cannot finish (issue 64): refused up front, not a 200
    with "stop" and an empty or cut reply."""
    field = "response_format.json_schema.schema"
    for strict in (True, False):
        status, data = post(server, {**CHAT, "response_format": response_format(schema, strict)})
        assert status == 400 and data["error"]["param"] == field, data
        assert data["error"]["message"].startswith(field) and why in data["error"]["message"]


@pytest.mark.parametrize(
    "pattern, reason",
    [("a(b", "unclosed group"), ("x" * 5000 + "[z-a]", "invalid character class range")],
    ids=["unclosed", "long"],
)
def test_a_bad_pattern_is_one_bounded_line(server, pattern, reason):
    """A regex the engine cannot parse (issue 64): one line naming the field, where the
    pattern is and the engine's reason, not the first line of its multi-line message."""
    schema = {"type": "object", "properties": {"name": {"type": "string", "pattern": pattern}}}
    status, data = post(server, {**CHAT, "response_format": response_format(schema)})
    field = "response_format.json_schema.schema"
    message = data["error"]["message"]
    assert status == 400 and data["error"]["param"] == field, data
    assert message.startswith(f"{field}: the pattern at properties.name.pattern "), message
    assert message.endswith(reason) or reason in message.rsplit(": ", 1)[-1], message
    assert "\n" not in message and len(message) < 500, message


@pytest.mark.parametrize("tool_choice", ["required", "auto"])
def test_endless_strict_tool_parameters_are_400s(server, tool_choice):
    loose = {"type": "function", "function": {"name": "g", "parameters": {"$ref": "#"}}}
    endless = {
        "type": "function",
        "function": {"name": "f", "strict": True, "parameters": {"$ref": "#"}},
    }
    body = {**CHAT, "tools": [loose, endless], "tool_choice": tool_choice}
    status, data = post(server, body)
    field = "tools[1].function.parameters"
    assert status == 400 and data["error"]["param"] == field, data
    assert data["error"]["message"].startswith(field + ': its $ref "#" recurses')


def test_recursion_that_may_stop_is_served(client):
    """A tree whose children may be empty passes the check; every reply that stops is a
    valid tree."""
    for seed in range(3):
        r = client.chat.completions.create(
            **CHAT, response_format=response_format(TREE), temperature=1.0, seed=seed, max_tokens=80
        )
        c = r.choices[0]
        if c.finish_reason == "stop":
            jsonschema.validate(json.loads(c.message.content), TREE)
        else:
            assert c.finish_reason == "length" and c.message.content.startswith('{"v": ')


def test_nested_repeat_product():
    from grpo.apps.serving.structured import _nested_repeat

    assert _nested_repeat("^((a{1,1000}){1,1000}){1,1000}$") == 10**9
    assert _nested_repeat("(?:x{2,4}|y){100}") == 400
    assert _nested_repeat("(a{3,}){1,5}") == 15
    for single in ("a{1,100000}", r"\d{4}-\d{2}", "[{(]{3}(b){5,}", r"\p{L}{1,5}", "(a*)+"):
        assert _nested_repeat(single) == 1, single
    assert _nested_repeat("(a{1," + "9" * 5000 + "}){2}") == 1  # not a count: the engine's call


def test_a_stop_before_the_grammar_is_complete_is_a_500(server, client, monkeypatch, caplog):
    """The promise at response time: should a constrained row still draw end-of-sequence with
    its grammar incomplete (here a grammar with no reply, let past both checks), the server
    answers 500 and logs one line, never "stop" with an empty or cut reply."""
    from grpo.apps.serving import structured

    monkeypatch.setattr(structured, "check_schema", lambda schema, field: None)
    monkeypatch.setattr(structured.Grammars, "_only_eos", lambda self, matcher: False)
    fmt = response_format({"$ref": "#", "description": "let through"})  # its own cache entry
    with caplog.at_level("ERROR", logger="grpo.apps.serving.engine"):
        status, data = post(server, {**CHAT, "response_format": fmt})
    assert status == 500, data
    assert "before its structured output was complete" in data["error"]["message"]
    assert "stopped before its grammar was complete" in caplog.text
    with pytest.raises(openai.APIError, match="before its structured output was complete"):
        for _ in client.chat.completions.create(**CHAT, response_format=fmt, stream=True):
            pass  # the 200 went first: an error event, as OpenAI's API sends one


def test_text_is_accepted_and_tools_with_json_refused(server, client):
    r = client.chat.completions.create(
        **CHAT, response_format={"type": "text"}, max_tokens=4, temperature=0
    )
    plain = client.chat.completions.create(**CHAT, max_tokens=4, temperature=0)
    assert r.choices[0].message.content == plain.choices[0].message.content
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    status, data = post(
        server, {**CHAT, "tools": [tool], "response_format": {"type": "json_object"}}
    )
    assert status == 400 and data["error"]["param"] == "response_format"


def test_strict_refuses_unnamed_properties():
    s = strict_schema(
        {"type": "object", "properties": {"a": {"type": "object"}}, "items": [{"properties": {}}]}
    )
    assert s["additionalProperties"] is False
    assert s["properties"]["a"]["additionalProperties"] is False
    assert s["items"][0]["additionalProperties"] is False
    kept = strict_schema({"type": "object", "additionalProperties": True})
    assert kept["additionalProperties"] is True


class Reading(BaseModel):
    value: int = Field(ge=0, le=99)
    unit: Literal["apples", "pens"]
    checked: bool


def test_agents_sdk_structured_output_type(server):
    """The Agents SDK with a Pydantic `output_type` sends a strict json_schema response format
    and parses the reply into the model class."""
    import asyncio
    import os

    os.environ.setdefault("OPENAI_AGENTS_DISABLE_TRACING", "1")
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        Runner,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    set_tracing_disabled(True)

    async def run():
        client = AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        agent = Agent(
            name="reader",
            output_type=Reading,
            model=OpenAIChatCompletionsModel(model=NAME, openai_client=client),
            model_settings=ModelSettings(temperature=1.0, max_tokens=60),
        )
        out = [await Runner.run(agent, "How many apples?", max_turns=1) for _ in range(3)]
        await client.close()
        return out

    for result in asyncio.run(run()):
        assert isinstance(result.final_output, Reading), result.final_output


def test_langchain_with_structured_output(server):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        model=NAME,
        base_url=server.url + "/v1",
        api_key="unused",
        temperature=1.0,
        max_tokens=60,
        max_retries=0,
    )
    structured = llm.with_structured_output(Reading, method="json_schema", strict=True)
    for _ in range(3):
        reading = structured.invoke("How many pens?")
        assert isinstance(reading, Reading), reading


STRICT_TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "maxLength": 4}},
            "required": ["expression"],
            "additionalProperties": False,
        },
    },
}
FLAG_TOOL = {
    "type": "function",
    "function": {
        "name": "f",
        "strict": True,
        "parameters": {"type": "object", "properties": {"b": {"type": "boolean"}}},
    },
}
LOOSE_TOOL = {
    "type": "function",
    "function": {
        "name": "lookup",
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
    },
}


@pytest.mark.parametrize("choice", ["named", "required"])
def test_strict_tool_arguments_are_enforced(client, choice):
    """A forced call to a `strict` function: the wrapper is the server's fixed text and the
    arguments are JSON of the function's parameters, even from a random model at T 1."""
    tool_choice = (
        {"type": "function", "function": {"name": "calculator"}}
        if choice == "named"
        else "required"
    )
    tools = [STRICT_TOOL]  # two schemas would not leave room in the tiny model's context
    for seed in range(4):
        r = client.chat.completions.create(
            **CHAT,
            tools=tools,
            tool_choice=tool_choice,
            temperature=1.0,
            seed=seed,
            n=2,
            max_tokens=60,
        )
        for c in r.choices:
            assert c.finish_reason == "tool_calls", c
            [call] = c.message.tool_calls
            args = json.loads(call.function.arguments)
            [tool] = [t for t in tools if t["function"]["name"] == call.function.name]
            jsonschema.validate(args, tool["function"]["parameters"])


def test_only_strict_calls_get_a_grammar(server):
    """The job the server builds: a grammar for calls to a strict function (named, required
    or auto), none for a loose function, for tool_choice none, or without tools."""

    def grammar(**fields):
        body = json.dumps({**CHAT, "max_tokens": 8, **fields}).encode()
        job, _, _ = server.service.openai_job(body, chat=True)
        return job.params.grammar

    named = {"type": "function", "function": {"name": "calculator"}}
    assert grammar(tools=[STRICT_TOOL], tool_choice=named) is not None
    assert grammar(tools=[STRICT_TOOL], tool_choice="required") is not None
    auto = grammar(tools=[STRICT_TOOL])
    assert auto is not None and auto.key.startswith("tool_calls|")
    assert grammar(tools=[STRICT_TOOL], tool_choice="none") is None
    loose = {"type": "function", "function": {"name": "lookup"}}
    assert grammar(tools=[LOOSE_TOOL], tool_choice=loose) is None
    assert grammar(tools=[LOOSE_TOOL]) is None
    assert grammar() is None


CALL = '<tool_call>\n{{"name": "{}", "arguments": {}}}\n</tool_call>'


@pytest.mark.parametrize("parallel", [True, False])
def test_auto_grammar_frees_text_and_fixes_every_call(shared_tiny_model, parallel):
    """tool_choice auto with a strict function: any text, and from a `<tool_call>` tag on a
    call in the chat format to a listed function with arguments of its schema (strict ones
    validated, loose ones any object); text may follow a call; one call at most without
    parallel_tool_calls; the tag never appears in text outside a call."""
    tok = load_tokenizer(shared_tiny_model)
    g = Grammars(tok, len(tok)).tool_calls(
        [STRICT_TOOL, FLAG_TOOL, LOOSE_TOOL], parallel, "<tool_call>", "</tool_call>"
    )

    def accepts(text: str) -> bool:
        m = g.start.deep_copy()
        ids = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        return all(m.consume_token(t) for t in ids) and m.is_stopped()

    calc = CALL.format("calculator", '{"expression": "6*7"}')
    flag = CALL.format("f", '{"b": true}')
    for ok in (
        "",
        "Tom has 3 apples.\n<tool_call",
        "a < b > c",
        calc,
        "Let me see.\n" + calc,
        calc + " Done.",
        flag,
        CALL.format("lookup", '{"q": [1, {}]}'),
    ):
        assert accepts(ok), ok
    assert accepts(calc + "\n" + flag) == parallel
    for bad in (
        CALL.format("calculator", '{"expression": "6*7*8"}'),  # maxLength 4
        CALL.format("calculator", '{"expression": "6*7", "x": 1}'),  # strict
        CALL.format("f", '{"b": 1}'),
        CALL.format("other", "{}"),
        CALL.format("lookup", "[1]"),  # not an object
        '<tool_call>{"name": "f", "arguments": {"b": true}}</tool_call>',  # no newlines
        "text <tool_call> more text",
        calc + " then <tool_call>",
    ):
        assert not accepts(bad), bad


def test_hostile_parameters_cannot_rewrite_the_grammar(shared_tiny_model):
    """Descriptions holding grammar syntax (`}`, a new `start:` rule, an alternative) stay
    text inside the schema: the grammar accepts the schema's arguments and nothing else."""
    tok = load_tokenizer(shared_tiny_model)
    hostile = {
        "type": "function",
        "function": {
            "name": "calc",
            "strict": True,
            "parameters": {
                "type": "object",
                "description": '}\nstart: "x"\n%json {',
                "properties": {
                    "e": {"type": "string", "maxLength": 3, "description": '} | "pwned"'}
                },
                "required": ["e"],
            },
        },
    }
    g = Grammars(tok, len(tok)).tool_call([hostile], "calc", "</tool_call>")

    def accepts(text: str) -> bool:
        m = g.start.deep_copy()
        ids = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        return all(m.consume_token(t) for t in ids) and m.is_stopped()

    assert accepts(' {"e": "ab"}}\n</tool_call>')
    for text in ("x", " pwned", ' {"e": "abcd"}}\n</tool_call>', ' {"e": "ab"} | "pwned"'):
        assert not accepts(text), text
    # the auto grammar (free text, then calls) holds the same schema as text
    g = Grammars(tok, len(tok)).tool_calls([hostile], True, "<tool_call>", "</tool_call>")
    assert accepts("pwned")  # free text is free
    assert accepts(CALL.format("calc", '{"e": "ab"}'))
    for text in (
        CALL.format("calc", '{"e": "abcd"}'),
        CALL.format("calc", '"pwned"'),
        '<tool_call>\nstart: "x"',
    ):
        assert not accepts(text), text


def test_required_grammar_takes_any_listed_function(shared_tiny_model):
    """tool_choice required with two strict functions: after the server's `{"name": "` the
    grammar accepts either function's name and its own arguments, nothing else."""
    tok = load_tokenizer(shared_tiny_model)
    grammars = Grammars(tok, len(tok))
    g = grammars.tool_call([STRICT_TOOL, FLAG_TOOL], None, "</tool_call>")

    def accepts(text: str) -> bool:
        m = g.start.deep_copy()
        ids = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        return all(m.consume_token(t) for t in ids) and m.is_stopped()

    assert accepts('calculator", "arguments": {"expression": "6*7"}}\n</tool_call>')
    assert accepts('f", "arguments": {"b": true}}\n</tool_call>')
    assert not accepts('f", "arguments": {"expression": "6*7"}}\n</tool_call>')
    assert not accepts('calculator", "arguments": {"expression": "too long"}}\n</tool_call>')
    assert not accepts('other", "arguments": {}}\n</tool_call>')

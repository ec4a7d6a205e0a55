"""grpo serve speaks OpenAI function calling, and a trained tool-using model works as an
agent's LLM through the real clients: the plain `openai` loop, the OpenAI Agents SDK's `Runner`
and LangChain's `bind_tools`.

The module trains a tiny model (SFT) to call the calculator with the tool schema rendered by
the chat template, each problem's schema one of 16 renderings
(`grpo.envs.calculator.tools_for`), serves it, and runs each client's agent loop on held-out
problems, greedy: its per-problem results equal `grpo eval --env calculator`'s on the tool
schema that client itself generated and sent (captured from its requests), so the server
renders what training renders, for schemas the model never saw. The rest: request checks
(400s naming the field), tool_choice none / required / a named function, assistant tool_calls
rendered back through the template exactly as the model wrote them, streamed tool calls equal
to the non-streamed ones, malformed calls left as content. Every test that runs a client runs
under `loopback_only`: nothing may connect beyond 127.0.0.1.
"""

from __future__ import annotations

import json
import re

import openai
import pytest
from datasets import Dataset, DatasetDict

from grpo.apps.serving import clients
from grpo.apps.serving.protocol import ChatBody, RequestError, read_body
from grpo.apps.serving.tools import ToolStream, tool_use
from grpo.config import load_config
from grpo.data import register_dataset
from grpo.data.toolmath import TOOL_TOKENS, corpus, sft_pairs, toolmath, trace
from grpo.envs.calculator import CALCULATOR_TOOL, calculator_tool_variant, tools_for
from grpo.envs.tool_calls import tool_call_text
from grpo.eval import run_eval_command, score_completion
from grpo.tiny import make_tiny_model
from grpo.tokenizer import load_tokenizer
from grpo.train.sft import train_sft

# every client here talks to 127.0.0.1 only (conftest.loopback_only)
pytestmark = pytest.mark.usefixtures("loopback_only")

NAME = "agent"
TOOLS = [CALCULATOR_TOOL]
MAX_TURNS = 3
MAX_TOKENS = 32  # per turn, as the demo's rollout.max_new_tokens
N_TEST = 24
VARIANTS = 16  # renderings of the calculator's schema in training (none of the clients')


def _tool_spec(**fn) -> dict:
    return {"type": "function", "function": {"name": "calculator", **fn}}


# -- request parsing (no model) ---------------------------------------------------------------

CHAT = {"model": NAME, "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(
    "body, field",
    [
        ({**CHAT, "tools": [{"type": "retrieval"}]}, "tools[0].type"),
        ({**CHAT, "tools": [{"type": "function"}]}, "tools[0].function"),
        ({**CHAT, "tools": [_tool_spec(name="bad name")]}, "tools[0].function.name"),
        ({**CHAT, "tools": [CALCULATOR_TOOL, CALCULATOR_TOOL]}, "tools"),
        ({**CHAT, "tool_choice": "auto"}, "tool_choice"),  # no tools
        ({**CHAT, "tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        (
            {
                **CHAT,
                "tools": TOOLS,
                "tool_choice": {"type": "function", "function": {"name": "x"}},
            },
            "tool_choice",
        ),
        ({**CHAT, "messages": [{"role": "assistant", "content": None}]}, "messages[0].content"),
        (
            {**CHAT, "messages": [{"role": "user", "content": "x", "tool_call_id": "c"}]},
            "messages[0].tool_call_id",
        ),
        (
            {
                **CHAT,
                "messages": [
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [
                            {
                                "id": "c",
                                "type": "function",
                                "function": {"name": "calculator", "arguments": "{not json"},
                            }
                        ],
                    }
                ],
            },
            "messages[0].tool_calls[0].function.arguments",
        ),
        (
            {
                **CHAT,
                "messages": [
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [
                            {
                                "id": "c",
                                "type": "function",
                                "function": {"name": "calculator", "arguments": "[1]"},
                            }
                        ],
                    }
                ],
            },
            "messages[0].tool_calls[0].function.arguments",
        ),
    ],
)
def test_bad_tool_requests_name_the_field(body, field):
    with pytest.raises(RequestError) as e:
        read_body(json.dumps(body).encode(), ChatBody)
    assert e.value.field == field and str(e.value).startswith(f"{field}:"), str(e.value)


def test_tool_choice_sets_what_is_rendered_and_the_reply_start():
    def use(**kw):
        return read_body(json.dumps({**CHAT, **kw}).encode(), ChatBody).tool_use

    assert use() is None and use(tools=TOOLS, tool_choice="none") is None
    auto = use(tools=TOOLS)
    assert auto.schemas == [CALCULATOR_TOOL] and auto.prefix == "" and auto.parallel
    assert use(tools=TOOLS, tool_choice="required").prefix == '<tool_call>\n{"name": "'
    named = use(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "calculator"}})
    assert named.prefix == '<tool_call>\n{"name": "calculator", "arguments":'
    # the named prefix is the head of exactly what the model writes for that call
    assert tool_call_text("calculator", {"expression": "1"}).startswith(named.prefix)
    assert not use(tools=TOOLS, parallel_tool_calls=False).parallel


def test_reply_text_becomes_a_message():
    use = tool_use(
        read_body(json.dumps({**CHAT, "tools": TOOLS}).encode(), ChatBody).tools, None, True
    )
    call = tool_call_text("calculator", {"expression": "37 * 48"})
    message, reason = use.message(f"Let me compute.\n{call}", "stop")
    assert reason == "tool_calls" and message["content"] == "Let me compute."
    [c] = message["tool_calls"]
    assert c["type"] == "function" and c["id"].startswith("call_")
    assert c["function"] == {"name": "calculator", "arguments": '{"expression": "37 * 48"}'}
    # two calls; with parallel_tool_calls false the second stays text
    two = f"{call}\n{tool_call_text('calculator', {'expression': '2'})}"
    assert len(use.message(two, "stop")[0]["tool_calls"]) == 2
    single = tool_use(use_tools(), None, False)
    message, _ = single.message(two, "stop")
    assert len(message["tool_calls"]) == 1 and message["content"].startswith("<tool_call>")
    # malformed or unterminated: content, as text, and the finish reason unchanged
    for bad in ("<tool_call>\n{not json}\n</tool_call>", 'Final <tool_call>\n{"name": "c'):
        assert use.message(bad, "stop") == ({"role": "assistant", "content": bad}, "stop")
    # a call cut by the token limit keeps "length"
    assert use.message(call, "length")[1] == "length"


def use_tools():
    return read_body(json.dumps({**CHAT, "tools": TOOLS}).encode(), ChatBody).tools


@pytest.mark.parametrize("cut", [1, 3, 7])
def test_tool_stream_sends_a_prefix_of_the_final_content(cut):
    """Whatever the delta boundaries, the streamed content is the final content's start,
    nothing of a call streams as content, and the calls come once, at the end."""
    use = tool_use(use_tools(), None, True)
    call = tool_call_text("calculator", {"expression": "6 * 7"})
    for text in (f"Let me see. \n{call}", "Final Answer: 42", f"{call}\nthen <tool_call>oops"):
        stream = ToolStream(use)
        sent = "".join(stream.feed(text[i : i + cut]) for i in range(0, len(text), cut))
        deltas, reason = stream.finish(text, "stop")
        content, calls = use.calls(text)
        rest = "".join(d.get("content", "") for d in deltas)
        assert sent + rest == content
        assert "<tool_call>" not in sent
        streamed = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
        assert [c["function"] for c in streamed] == [c["function"] for c in calls]
        assert [c["index"] for c in streamed] == list(range(len(calls)))
        assert reason == ("tool_calls" if calls else "stop")


def test_template_renders_an_assistant_call_as_the_model_wrote_it(tool_model):
    """The conversation the client sends back renders, token for token, as the model's own
    turn followed by the environment's tool message: what the multi-turn sampler had."""
    from grpo.tokenizer import message_delta

    tok = load_tokenizer(tool_model["model"])
    user = [{"role": "user", "content": "What is 37 * 48?"}]
    call = tool_call_text("calculator", {"expression": "37 * 48"})
    sent = user + [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "calculator", "arguments": {"expression": "37 * 48"}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "1776"},
    ]
    server = tok.apply_chat_template(sent, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    start = tok.apply_chat_template(user, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    tool_msg = {"role": "tool", "content": "1776"}
    sampler = start + call + message_delta(tok, tool_msg, after_stop=False, tools=TOOLS)
    assert server == sampler


# -- a trained tool-using model, served ------------------------------------------------------


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory):
    """A ci-size model SFT-trained (200 steps) on calculator traces whose prompts render the
    tool schema through the chat template (as `calculator` with use_template_tools), and
    held-out problems as a .jsonl file."""
    root = tmp_path_factory.mktemp("tool_agent")
    train = toolmath(768, seed=0, split="train", hard_frac=1.0)
    test = toolmath(N_TEST, seed=0, split="test", hard_frac=1.0)
    model_dir = make_tiny_model(
        root / "base",
        size="ci",
        corpus=corpus(train, VARIANTS),
        vocab_size=768,
        extra_special_tokens=TOOL_TOKENS,
        max_position_embeddings=1024,
    )
    tok = load_tokenizer(model_dir)
    pairs = [
        {"question": r["question"], "answer": r["answer"], **p}
        for r in train
        for p in sft_pairs(tok, trace(r, use_tool=True), tools=tools_for(r["question"], VARIANTS))
    ]
    register_dataset(
        "test-tool-agent-sft", DatasetDict(train=Dataset.from_list(pairs)), overwrite=True
    )
    out = root / "sft"
    cfg = load_config(
        base={"model": {"path": str(model_dir), "device": "cpu"}},
        overrides=[
            "lora.enabled=false",
            "data.dataset=test-tool-agent-sft",
            "data.split=train",
            "data.eval_samples=0",
            "data.max_prompt_len=512",
            "rollout.max_new_tokens=32",
            "optim.lr=8e-3",
            "optim.warmup_ratio=0.05",
            "optim.min_lr_ratio=0.1",
            "train.max_steps=200",
            "train.batch_size=32",
            "train.log_every=100",
            "train.save_every=0",
            "train.progress=false",
            f"train.output_dir={out}",
            "train.seed=0",
        ],
    )
    train_sft(cfg)
    data = root / "test.jsonl"
    data.write_text(
        "".join(
            json.dumps({"question": r["question"], "answer": f"#### {r['answer']}"}) + "\n"
            for r in test
        )
    )
    return {"model": out / "final", "data": data, "problems": test, "root": root}


@pytest.fixture(scope="module")
def agent_server(tool_model, serve_cli):
    with serve_cli(
        "--model", str(tool_model["model"]), "--port", "0", "--served-model-name", NAME
    ) as running:
        yield running


@pytest.fixture(scope="module")
def client(agent_server):
    return openai.OpenAI(base_url=agent_server.url + "/v1", api_key="unused", max_retries=0)


def evaluate_on(tool_model, tools: list[dict], tmp_path) -> dict:
    """`grpo eval --env calculator` of the held-out problems, the schemas `tools` rendered."""
    payload = run_eval_command(
        model=str(tool_model["model"]),
        data=str(tool_model["data"]),
        env="calculator",
        env_kwargs={"use_template_tools": True, "tools": tools},
        max_turns=MAX_TURNS,
        max_new_tokens=MAX_TOKENS,
        batch_size=8,
        details=True,
        out=str(tmp_path / "eval.json"),
    )
    return payload["models"]["model"]


def served_tools(recorder: clients.Recorder) -> list[dict]:
    """The tools of the client's requests as the server renders them (`ToolSpec.schema`)."""
    body = {
        "model": NAME,
        "messages": [{"role": "user", "content": "x"}],
        "tools": recorder.sent_tools(),
    }
    return read_body(json.dumps(body).encode(), ChatBody).tool_use.schemas


def assert_same_as_eval(tool_model, episodes: list[clients.Episode], evaluated: dict):
    """Per problem the same final answer (not only the same verdict), so the same accuracy and
    tool calls; and the model does use the tool through the client."""
    by_question = {s["question"]: s for s in evaluated["samples"]}
    problems = [by_question[r["question"]] for r in tool_model["problems"]]
    scores = [
        score_completion(e.content, r["answer"])
        for e, r in zip(episodes, tool_model["problems"], strict=True)
    ]
    assert [s["pred"] for s in scores] == [s["pred"] for s in problems]
    assert [s["correct"] for s in scores] == [s["correct"] for s in problems]
    summary = evaluated["summary"]
    assert summary["accuracy"] == sum(s["correct"] for s in scores) / N_TEST
    assert summary["tool_calls_mean"] == sum(e.calls for e in episodes) / N_TEST
    # the model learned the tool's protocol under schemas it never saw, so the loops execute
    # calls on most problems. How often its SFT steps also learn to copy the numbers right
    # depends on the CPU's float rounding: the equality above is the acceptance, not accuracy.
    assert summary["tool_calls_mean"] >= 0.5, summary


def test_openai_agent_loop_equals_grpo_eval(tool_model, client, agent_server, tmp_path):
    """The same problems, greedy, the same per-turn limit: the plain `openai` loop over HTTP
    (each reply echoed back with `model_dump()`, nulls and all) gets exactly `grpo eval`'s
    per-problem results, with the library's schema and with one the model never saw."""
    unseen = calculator_tool_variant(VARIANTS + 3)
    for tools in ([CALCULATOR_TOOL], [unseen]):
        recorder = clients.Recorder()
        http = openai.OpenAI(
            base_url=agent_server.url + "/v1",
            api_key="unused",
            max_retries=0,
            http_client=recorder.client(),
        )
        episodes = [
            clients.openai_episode(
                http, NAME, r["question"], tools, max_turns=MAX_TURNS, max_tokens=MAX_TOKENS
            )
            for r in tool_model["problems"]
        ]
        assert_same_as_eval(
            tool_model, episodes, evaluate_on(tool_model, served_tools(recorder), tmp_path)
        )


def test_agents_sdk_runner_equals_grpo_eval(tool_model, agent_server, tmp_path):
    """The OpenAI Agents SDK: `Runner.run` of an `Agent` whose `@function_tool` the SDK turns
    into a `strict` schema (its own description, titles, key order), tracing off."""
    recorder = clients.Recorder()
    episodes = clients.agents_sdk_episodes(
        agent_server.url + "/v1",
        NAME,
        [r["question"] for r in tool_model["problems"]],
        recorder=recorder,
        max_turns=MAX_TURNS,
        max_tokens=MAX_TOKENS,
    )
    [sent] = recorder.sent_tools()
    assert sent["function"]["strict"] is True
    assert sent["function"]["parameters"]["additionalProperties"] is False
    assert_same_as_eval(
        tool_model, episodes, evaluate_on(tool_model, served_tools(recorder), tmp_path)
    )


def test_langchain_bind_tools_equals_grpo_eval(tool_model, agent_server, tmp_path):
    """LangChain: `ChatOpenAI(base_url=...).bind_tools([tool])`, `invoke`, `ToolMessage`s."""
    recorder = clients.Recorder()
    llm = clients.langchain_model(
        agent_server.url + "/v1", NAME, recorder=recorder, max_tokens=MAX_TOKENS
    )
    episodes = [
        clients.langchain_episode(llm, r["question"], max_turns=MAX_TURNS)
        for r in tool_model["problems"]
    ]
    assert_same_as_eval(
        tool_model, episodes, evaluate_on(tool_model, served_tools(recorder), tmp_path)
    )


GEN_TASK = """task: grpo_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["Final"]
  max_gen_toks: 12
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
"""


def test_lm_eval_chat_generation_task_equals_greedy_decoding(agent_server, tmp_path, lm_eval_tasks):
    """lm-eval's `local-chat-completions` model with `apply_chat_template`: each generated
    answer is the served model's greedy continuation of the chat prompt (the sampler called
    directly, cut at the task's stop string), so its scores are the model's own."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    from grpo.rollout import sample
    from grpo.tokenizer import encode_chat

    docs = [
        {"question": f"What is {a} * {b}?", "answer": str(a * b)}
        for a, b in [(37, 48), (12, 4), (7, 7), (23, 61)]
    ]
    data = tmp_path / "gen.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    tasks = lm_eval_tasks
    (tasks / "grpo_gen.yaml").write_text(GEN_TASK.format(data=data))
    args = (
        f"model={NAME},base_url={agent_server.url}/v1/chat/completions,num_concurrent=1,"
        "max_retries=1"
    )
    out = lm_eval.simple_evaluate(
        model="local-chat-completions",
        model_args=args,
        tasks=["grpo_gen"],
        apply_chat_template=True,
        task_manager=TaskManager(include_path=str(tasks)),
        batch_size=1,
        log_samples=True,
    )
    samples = sorted(out["samples"]["grpo_gen"], key=lambda s: s["doc_id"])
    engine, tok = agent_server.engine, agent_server.service.tokenizer
    for sample_, doc in zip(samples, docs, strict=True):
        prompt = encode_chat(tok, [{"role": "user", "content": doc["question"]}])
        r = sample(
            engine.sampler.model,
            [prompt],
            group_size=1,
            max_new_tokens=12,
            temperature=0.0,
            stop_ids=engine.stop_ids,
            pad_id=engine.pad_id,
            seed=0,
        )
        n = int(r.completion_mask[0].sum())
        text = tok.decode(r.completion_ids[0, :n].tolist(), skip_special_tokens=False)
        direct = text.removesuffix(tok.eos_token).split("Final")[0]
        assert sample_["resps"][0][0] == direct, (sample_["resps"], direct)
    assert sum(len(s["resps"][0][0].strip()) > 4 for s in samples) >= 2  # text, not nothing


def test_the_guard_refuses_other_addresses(loopback_only):
    """The fixture the client tests run under does refuse (and record) a connect beyond
    loopback; the address is TEST-NET-1 (RFC 5737), never routed."""
    import socket

    with socket.socket() as s, pytest.raises(ConnectionRefusedError):
        s.connect(("192.0.2.1", 9))
    with pytest.raises(socket.gaierror):
        socket.getaddrinfo("example.invalid", 443)
    assert loopback_only.attempts == [("192.0.2.1", 9), "example.invalid"]
    loopback_only.attempts.clear()  # what this test made; the teardown checks the rest


def test_streamed_tool_calls_equal_the_non_streamed(tool_model, client):
    q = tool_model["problems"][0]["question"]
    kw = dict(
        model=NAME,
        messages=[{"role": "user", "content": q}],
        tools=TOOLS,
        temperature=0,
        max_tokens=MAX_TOKENS,
    )
    whole = client.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    content, calls, reasons = "", {}, []
    for chunk in client.chat.completions.create(stream=True, **kw):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for tc in choice.delta.tool_calls or []:
                calls[tc.index] = (tc.function.name, tc.function.arguments)
            reasons.append(choice.finish_reason)
    assert content == ""
    assert list(calls.values()) == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls
    ]
    assert reasons[-1] == "tool_calls"


def test_tool_choice_over_http(tool_model, client):
    q = tool_model["problems"][1]["question"]
    base = dict(
        model=NAME, messages=[{"role": "user", "content": q}], temperature=0, max_tokens=MAX_TOKENS
    )
    # none: the tools are not rendered and nothing is parsed, so a call is plain text
    none = client.chat.completions.create(tools=TOOLS, tool_choice="none", **base).choices[0]
    plain = client.chat.completions.create(**base).choices[0]
    assert none.message.tool_calls is None and none.message.content == plain.message.content
    # a named function or "required": the reply starts inside a call to it
    named = {"type": "function", "function": {"name": "calculator"}}
    for choice in (named, "required"):
        r = client.chat.completions.create(tools=TOOLS, tool_choice=choice, **base).choices[0]
        assert r.finish_reason == "tool_calls", r
        assert [c.function.name for c in r.message.tool_calls] == ["calculator"]
    # the named call equals what the model writes unprompted with auto
    auto = client.chat.completions.create(tools=TOOLS, **base).choices[0]
    forced = client.chat.completions.create(tools=TOOLS, tool_choice=named, **base).choices[0]
    assert [c.function.arguments for c in forced.message.tool_calls] == [
        c.function.arguments for c in auto.message.tool_calls
    ]


@pytest.mark.parametrize("strict", [True, False])
def test_strict_tools_under_auto_hold_every_call_to_its_schema(tool_model, client, strict):
    """tool_choice auto (the Agents SDK's default) with a function whose parameters the model
    never saw (`expr`, digits and operators only, where it learned `expression`): with
    `strict` every call it writes, at temperature 1, is JSON of that schema and is parsed as a
    call (no `<tool_call>` left in content); without `strict` the same sampling writes its
    habit, which the schema refuses. The grammar, not the model, makes the calls valid."""
    params = {
        "type": "object",
        "required": ["expr"],
        "properties": {"expr": {"type": "string", "pattern": "^[0-9*+-]{1,9}$"}},
    }
    tools = [_tool_spec(description="Evaluate arithmetic.", parameters=params, strict=strict)]
    valid, calls = 0, 0
    for i, problem in enumerate(tool_model["problems"][:4]):
        r = client.chat.completions.create(
            model=NAME,
            messages=[{"role": "user", "content": problem["question"]}],
            tools=tools,
            temperature=1.0,
            seed=i,
            n=4,
            max_tokens=MAX_TOKENS,
        )
        for c in r.choices:
            if strict:
                assert "<tool_call>" not in (c.message.content or ""), c
            for call in c.message.tool_calls or []:
                calls += 1
                args = json.loads(call.function.arguments)
                ok = call.function.name == "calculator" and set(args) == {"expr"}
                valid += ok and bool(re.fullmatch(r"[0-9*+-]{1,9}", args["expr"]))
    assert calls >= 8  # the model calls its tool under auto, with either setting
    if strict:
        assert valid == calls
    else:
        assert valid < calls / 2

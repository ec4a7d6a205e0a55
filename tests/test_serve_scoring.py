"""Prompt log-likelihoods through `grpo serve` (/v1/completions with echo), as lm-eval-harness's
`local-completions` model asks for them: the numbers equal the trainer's own log-probs of the
same continuation (fp32, 1e-5), the top alternatives are the float64 log-softmax's, the greedy
next token is the sampler's, and lm-eval's parsing of the answer (its `parse_logprobs`, written
out below) picks the choice a direct computation with the model picks."""

from __future__ import annotations

import json

import openai
import pytest
import torch
from conftest import post_json

from grpo.algo.logprobs import completion_logprobs
from grpo.rollout import sample

# every client here talks to 127.0.0.1 only (conftest.loopback_only)
pytestmark = pytest.mark.usefixtures("loopback_only")

NAME = "tiny"


@pytest.fixture(scope="module")
def server(shared_tiny_model, serve_cli):
    with serve_cli(
        "--model", str(shared_tiny_model), "--port", "0", "--served-model-name", NAME
    ) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def post(srv, payload: dict) -> tuple[int, dict]:
    return post_json(srv.url, "/v1/completions", payload, timeout=60)


def ids_of(srv, text: str) -> list[int]:
    return srv.service.tokenizer(text, add_special_tokens=False)["input_ids"]


def trainer_logprobs(model, context: list[int], continuation: list[int]) -> list[float]:
    """The trainer's log-probs of `continuation` after `context` (`completion_logprobs`)."""
    ids = torch.tensor([context + continuation])
    mask = torch.ones_like(ids, dtype=torch.bool)
    cmask = torch.ones((1, len(continuation)), dtype=torch.bool)
    with torch.no_grad():
        return completion_logprobs(model, ids, mask, len(context), cmask)[0].tolist()


def test_echo_scores_equal_the_trainers_logprobs(server, client):
    model = server.engine.sampler.model
    context, continuation = ids_of(server, "12 + 7 ="), ids_of(server, " 19 and more")
    r = client.completions.create(
        model=NAME,
        prompt=[context + continuation],
        echo=True,
        max_tokens=1,
        logprobs=3,
        temperature=0,
    )
    (choice,) = r.choices
    lp = choice.logprobs
    n = len(context) + len(continuation)
    assert len(lp.token_logprobs) == n + 1 and lp.token_logprobs[0] is None  # + the next token
    want = trainer_logprobs(model, context, continuation)
    got = lp.token_logprobs[len(context) : n]
    assert max(abs(a - b) for a, b in zip(got, want)) <= 1e-5, (got, want)
    # the alternatives: float64 log-softmax of the same hidden states, most likely first
    with torch.no_grad():
        hidden = model(torch.tensor([context + continuation]), return_hidden=True)[0]
        ref = torch.log_softmax(model.lm_head(hidden).double(), dim=-1)  # (T, V)
    for t in range(1, n + 1):
        top = list(lp.top_logprobs[t].values())
        assert len(top) <= 3 and top == sorted(top, reverse=True)
        best = ref[t - 1].topk(3).values.tolist()
        assert max(abs(a - b) for a, b in zip(top, best[: len(top)])) <= 1e-5
    # the appended token is the sampler's greedy choice, and is its position's top entry
    r = sample(
        model,
        [context + continuation],
        group_size=1,
        max_new_tokens=1,
        temperature=0.0,
        stop_ids=server.engine.stop_ids,
        pad_id=server.engine.pad_id,
        seed=0,
    )
    greedy = int(r.completion_ids[0, 0])
    assert lp.tokens[-1] == server.engine.decode([greedy])
    assert lp.token_logprobs[-1] == max(lp.top_logprobs[-1].values())
    assert r.logprobs[0, 0].item() == pytest.approx(lp.token_logprobs[-1], abs=1e-5)
    assert choice.text.startswith(server.engine.decode(context + continuation))


def lm_eval_parse(out: dict, ctxlens: list[int]) -> list[tuple[float, bool]]:
    """lm-eval-harness 0.4's `LocalCompletionsAPI.parse_logprobs`: the continuation's summed
    log-prob and whether each of its tokens is its position's top one (the last token, the
    generated one, left out)."""
    res = []
    for choice, ctxlen in zip(sorted(out["choices"], key=lambda c: c["index"]), ctxlens):
        lps = choice["logprobs"]["token_logprobs"][ctxlen:-1]
        tops = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        greedy = all(tok == max(top.values()) for tok, top in zip(lps, tops))
        res.append((sum(lps), greedy))
    return res


def test_a_multiple_choice_question_as_lm_eval_asks_it(server):
    """lm-eval's loglikelihood payload (token ids, echo, max_tokens 1, logprobs 1,
    temperature 0) for each answer of a multiple-choice question: the choice its parsing picks
    is the one the trainer's log-probs pick, with the same sums."""
    model = server.engine.sampler.model
    context = ids_of(server, "Question: 3 + 4 = ?\nAnswer:")
    answers = [ids_of(server, f" {a}") for a in ("7", "8", "12", "34")]
    payload = {
        "model": NAME,
        "prompt": [context + a for a in answers],
        "temperature": 0,
        "max_tokens": 1,
        "logprobs": 1,
        "seed": 1234,
        "echo": True,
    }
    status, out = post(server, payload)
    assert status == 200, out
    parsed = lm_eval_parse(out, [len(context)] * len(answers))
    direct = [sum(trainer_logprobs(model, context, a)) for a in answers]
    for (total, _), want, a in zip(parsed, direct, answers):
        assert total == pytest.approx(want, abs=1e-5 * len(a))  # 1e-5 per token (fp32)
    assert max(range(4), key=lambda i: parsed[i][0]) == max(range(4), key=lambda i: direct[i])
    assert out["usage"] == {
        "prompt_tokens": sum(len(context + a) for a in answers),
        "completion_tokens": 4,
        "total_tokens": sum(len(context + a) for a in answers) + 4,
    }


def test_max_tokens_0_scores_the_prompt_alone(server):
    prompt = "5 + 5 = 10"
    status, out = post(
        server, {"model": NAME, "prompt": prompt, "echo": True, "max_tokens": 0, "logprobs": 0}
    )
    assert status == 200, out
    (choice,) = out["choices"]
    ids = ids_of(server, prompt)
    assert choice["text"] == prompt and len(choice["logprobs"]["tokens"]) == len(ids)
    assert choice["logprobs"]["top_logprobs"][1:] == [{}] * (len(ids) - 1)
    assert out["usage"]["completion_tokens"] == 0
    status, out = post(server, {"model": NAME, "prompt": prompt, "echo": True, "max_tokens": 0})
    assert status == 200 and out["choices"][0]["logprobs"] is None
    assert out["choices"][0]["text"] == prompt


@pytest.mark.parametrize(
    "payload, field",
    [
        ({"echo": True, "max_tokens": 2}, "max_tokens"),
        ({"echo": True}, "max_tokens"),  # OpenAI's default of 16 new tokens
        ({"echo": True, "max_tokens": 1, "temperature": 0.7}, "temperature"),
        ({"echo": True, "max_tokens": 0, "n": 2}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"echo": True, "max_tokens": 0, "logprobs": 21}, "logprobs"),
    ],
)
def test_what_scoring_does_not_do_is_a_400_naming_the_field(server, payload, field):
    status, out = post(server, {"model": NAME, "prompt": "1 + 1 =", **payload})
    assert status == 400, out
    assert out["error"]["param"] == field and out["error"]["type"] == "invalid_request_error"


# -- the real lm-eval-harness --------------------------------------------------------------

MC_TASK = """task: grpo_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: choices
doc_to_target: label
metric_list:
  - metric: acc
"""


def test_lm_eval_multiple_choice_task_equals_a_direct_computation(
    server, shared_tiny_model, tmp_path, lm_eval_tasks
):
    """lm-eval-harness's `local-completions` model (tokenized requests, the served model's
    tokenizer) runs a multiple-choice task from a local file against the server, offline; its
    accuracy equals picking, per question, the answer with the largest summed log-prob under
    the trainer's own log-probs (the continuation split as lm-eval splits it)."""
    import lm_eval  # the `clients` extra, part of `test`
    from lm_eval.tasks import TaskManager

    pairs = [(1, 2), (3, 4), (12, 7), (5, 5), (20, 3), (8, 9)]
    docs = [
        {
            "question": f"{a} + {b} = ?",
            "choices": [str(a + b + d) for d in (0, 1, 3, 10)],
            "label": 0,
        }
        for a, b in pairs
    ]
    data = tmp_path / "mc.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    tasks = lm_eval_tasks
    (tasks / "grpo_mc.yaml").write_text(MC_TASK.format(data=data))
    args = (
        f"model={NAME},base_url={server.url}/v1/completions,tokenizer={shared_tiny_model},"
        "tokenizer_backend=huggingface,tokenized_requests=True,num_concurrent=1,"
        "max_retries=1"
    )
    out = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=args,
        tasks=["grpo_mc"],
        task_manager=TaskManager(include_path=str(tasks)),
        batch_size=1,
        log_samples=False,
    )
    acc = out["results"]["grpo_mc"]["acc,none"]
    model, tok = server.engine.sampler.model, server.service.tokenizer
    right = 0
    for d in docs:
        context = f"Question: {d['question']}\nAnswer:"
        scores = []
        for choice in d["choices"]:
            whole = tok(context + " " + choice, add_special_tokens=False)["input_ids"]
            ctx = tok(context, add_special_tokens=False)["input_ids"]
            scores.append(sum(trainer_logprobs(model, ctx, whole[len(ctx) :])))
        right += max(range(len(scores)), key=scores.__getitem__) == d["label"]
    assert acc == pytest.approx(right / len(docs))


# -- log-probs of generated tokens ---------------------------------------------------------


def chat_prompt_ids(srv, text: str) -> list[int]:
    tok = srv.service.tokenizer
    rendered = tok.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )
    return tok(rendered, add_special_tokens=False)["input_ids"]


def greedy_ids(srv, prompt: list[int], n: int) -> list[int]:
    r = sample(
        srv.engine.sampler.model,
        [prompt],
        group_size=1,
        max_new_tokens=n,
        temperature=0.0,
        stop_ids=srv.engine.stop_ids,
        pad_id=srv.engine.pad_id,
        seed=0,
    )
    return r.completion_ids[0, : int(r.completion_lens[0])].tolist()


def test_completion_logprobs_of_generated_tokens(server, client):
    """`logprobs: k` on a generation: each reply token's log-prob under the model (the
    trainer's numbers, 1e-5) with its k most likely alternatives."""
    model = server.engine.sampler.model
    prompt = ids_of(server, "2 + 2 =")
    r = client.completions.create(
        model=NAME, prompt=[prompt], max_tokens=6, temperature=0, logprobs=2
    )
    (choice,) = r.choices
    reply = greedy_ids(server, prompt, 6)[: r.usage.completion_tokens]
    want = trainer_logprobs(model, prompt, reply)
    lp = choice.logprobs
    assert len(lp.token_logprobs) == len(reply) == r.usage.completion_tokens
    assert max(abs(a - b) for a, b in zip(lp.token_logprobs, want)) <= 1e-5
    assert lp.tokens == [server.engine.decode([i]) for i in reply]
    for got, top in zip(lp.token_logprobs, lp.top_logprobs):
        values = list(top.values())
        assert values == sorted(values, reverse=True) and got == values[0]  # greedy: the top


def test_chat_logprobs_and_top_logprobs(server, client):
    model = server.engine.sampler.model
    r = client.chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    (choice,) = r.choices
    prompt = chat_prompt_ids(server, "hi")
    reply = greedy_ids(server, prompt, 5)[: r.usage.completion_tokens]
    content = choice.logprobs.content
    assert len(content) == len(reply)
    want = trainer_logprobs(model, prompt, reply)
    assert max(abs(c.logprob - w) for c, w in zip(content, want)) <= 1e-5
    for c, i in zip(content, reply):
        assert c.token == server.engine.decode([i]) and bytes(c.bytes).decode() == c.token
        assert len(c.top_logprobs) == 3 and c.top_logprobs[0].logprob == c.logprob
    hi = [{"role": "user", "content": "hi"}]
    plain = client.chat.completions.create(model=NAME, max_tokens=2, messages=hi)
    assert plain.choices[0].logprobs is None


@pytest.mark.parametrize(
    "path, payload, field",
    [
        ("/v1/completions", {"prompt": "a", "logprobs": 1, "stream": True}, "stream"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "a"}], "logprobs": True, "stream": True},
            "stream",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "a"}], "top_logprobs": 2},
            "top_logprobs",
        ),
    ],
)
def test_logprobs_refusals_name_the_field(server, path, payload, field):
    status, data = post_json(server.url, path, {"model": NAME, **payload}, timeout=60)
    assert status == 400 and data["error"]["param"] == field, data

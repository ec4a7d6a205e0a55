"""The tools demo's agent through the clients people deploy with, against `grpo eval`.

    grpo demo --task tools --out runs/demo-tools --seed 0          # trains the agent
    python -m benchmarks.bench_clients --model runs/demo-tools/grpo/final

The model is served by the real `grpo serve` (its CLI, in a thread, on 127.0.0.1, port 0). On
the first `--n` held-out test problems of the demo (its data seed), greedy, at most 3 turns of
32 tokens (the demo's rollout), each row is one way of running the agent:

- `grpo eval`: the calculator environment's episodes, the library's schema (`CALCULATOR_TOOL`);
- `openai`: the plain `openai` client's loop, the same schema sent as `tools`;
- `agents-sdk`: the OpenAI Agents SDK's `Runner` (`@function_tool`: a `strict` schema, the
  SDK's own description, titles and key order), tracing off;
- `langchain`: `ChatOpenAI(base_url=...).bind_tools([tool])` + `invoke`;
- `grpo eval` on `<client>'s` schema: `grpo eval` again, rendering the schema that client sent
  (captured from its requests, as the server renders it).

The client functions are `grpo.apps.serving.clients` (the code docs/serving.md shows).
Columns: `correct` of `n`; `first_20_hard`: correct among the first 20 two-digit products
(the demo's task; the split's few one-digit products are left out of this count);
`tool_calls` (well-formed calls per problem), `turns` (model turns per problem); `within_1`:
`first_20_hard` within 1 of the first row's (`grpo eval`, the library's schema);
`same_verdicts` / `same_answers`: per problem the same verdict / the same final answer as
`grpo eval` rendering that client's schema (answers differ where a malformed call ends a
client's loop, which has no environment to answer it, but gets an error observation and
another turn in an episode); `seconds`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import tempfile
import threading
import time
from pathlib import Path

from benchmarks.harness import add_output_args, write_results

NAME = "agent"
COLUMNS = [
    "client",
    "schema",
    "correct",
    "n",
    "first_20_hard",
    "tool_calls",
    "turns",
    "within_1",
    "same_verdicts",
    "same_answers",
    "seconds",
]
MAX_TURNS, MAX_TOKENS = 3, 32


@contextlib.contextmanager
def serving(model: str):
    """`grpo serve --model MODEL --port 0` in a thread; yields its base URL."""
    from grpo.apps.serve import add_parser

    parser = argparse.ArgumentParser(prog="grpo")
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(
        ["serve", "--model", model, "--port", "0", "--served-model-name", NAME]
    )
    ready, holder = threading.Event(), {}
    args.on_ready = lambda running: (holder.update(running=running), ready.set())
    thread = threading.Thread(target=lambda: holder.update(rc=args.func(args)), daemon=True)
    thread.start()
    if not ready.wait(120):
        raise SystemExit("bench_clients: the server did not start")
    try:
        yield holder["running"].url + "/v1"
    finally:
        holder["running"].shutdown()
        thread.join(30)


def grpo_eval(model: str, data: Path, tools: list[dict], out: Path) -> list[dict]:
    """Per-problem samples of `grpo eval --env calculator` rendering `tools`."""
    from grpo.eval import run_eval_command

    payload = run_eval_command(
        model=model,
        data=str(data),
        env="calculator",
        env_kwargs={"use_template_tools": True, "tools": tools},
        max_turns=MAX_TURNS,
        max_new_tokens=MAX_TOKENS,
        batch_size=8,
        details=True,
        out=str(out),
    )
    return payload["models"]["model"]["samples"]


def served_schema(tools: list[dict]) -> list[dict]:
    """A client's `tools` as the server renders them."""
    from grpo.apps.serving.protocol import ChatBody, read_body

    body = {"model": NAME, "messages": [{"role": "user", "content": "x"}], "tools": tools}
    return read_body(json.dumps(body).encode(), ChatBody).tool_use.schemas


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="the trained agent (a model directory)")
    parser.add_argument(
        "--n",
        type=int,
        default=256,
        help="the first N held-out problems (default 256: the demo's test split)",
    )
    parser.add_argument("--data-seed", type=int, default=0, help="the demo's demo.data_seed")
    parser.add_argument("--hard-frac", type=float, default=0.7, help="the demo's hard_frac")
    add_output_args(parser, "clients_tools_cpu")
    a = parser.parse_args(argv)

    import openai

    from grpo.apps.serving import clients
    from grpo.data.toolmath import toolmath
    from grpo.envs.calculator import CALCULATOR_TOOL
    from grpo.envs.tool_calls import ToolCall, parse_tool_calls
    from grpo.eval import score_completion

    problems = toolmath(256, a.data_seed, "test", a.hard_frac)[: a.n]
    first_hard = [i for i, p in enumerate(problems) if p["kind"] == "hard"][:20]
    tmp = Path(tempfile.mkdtemp(prefix="bench_clients_"))
    data = tmp / "problems.jsonl"
    data.write_text(
        "".join(
            json.dumps({"question": p["question"], "answer": f"#### {p['answer']}"}) + "\n"
            for p in problems
        )
    )
    questions = [p["question"] for p in problems]

    def row(
        client: str,
        schema: str,
        preds: list,
        calls: list,
        turns: list,
        seconds: float,
        own: dict | None = None,
    ) -> dict:
        scores = [score_completion(c, p["answer"]) for c, p in zip(preds, problems, strict=True)]
        correct = [s["correct"] for s in scores]
        out = {
            "client": client,
            "schema": schema,
            "correct": sum(correct),
            "n": len(problems),
            "first_20_hard": sum(correct[i] for i in first_hard),
            "tool_calls": round(sum(calls) / len(problems), 3),
            "turns": round(sum(turns) / len(problems), 3),
            "seconds": round(seconds, 1),
            "per_problem": correct,
            "preds": [s["pred"] for s in scores],
        }
        if rows:  # the first row is grpo eval's on the library's schema: the reference
            out["within_1"] = abs(out["first_20_hard"] - rows[0]["first_20_hard"]) <= 1
        if own is not None:
            out["same_verdicts"] = out["per_problem"] == own["per_problem"]
            out["same_answers"] = out["preds"] == own["preds"]
        return out

    def eval_row(label: str, tools: list[dict]) -> dict:
        start = time.perf_counter()
        samples = {s["question"]: s for s in grpo_eval(a.model, data, tools, tmp / "e.json")}
        samples = [samples[q] for q in questions]
        transcripts = [s["transcript"] for s in samples]  # ChatML, special tokens kept
        calls = [sum(isinstance(c, ToolCall) for c in parse_tool_calls(t)) for t in transcripts]
        turns = [1 + t.count("<|im_start|>assistant") for t in transcripts]
        return row(
            "grpo eval",
            label,
            [s["completion"] for s in samples],
            calls,
            turns,
            time.perf_counter() - start,
        )

    rows: list[dict] = []
    rows.append(eval_row("CALCULATOR_TOOL", [CALCULATOR_TOOL]))
    with serving(a.model) as url:
        runs = {}
        recorder = clients.Recorder()
        t = time.perf_counter()
        http = openai.OpenAI(
            base_url=url, api_key="unused", max_retries=0, http_client=recorder.client()
        )
        eps = [
            clients.openai_episode(
                http, NAME, q, [CALCULATOR_TOOL], max_turns=MAX_TURNS, max_tokens=MAX_TOKENS
            )
            for q in questions
        ]
        runs["openai"] = (eps, time.perf_counter() - t, recorder)
        recorder = clients.Recorder()
        t = time.perf_counter()
        eps = clients.agents_sdk_episodes(
            url, NAME, questions, recorder=recorder, max_turns=MAX_TURNS, max_tokens=MAX_TOKENS
        )
        runs["agents-sdk"] = (eps, time.perf_counter() - t, recorder)
        recorder = clients.Recorder()
        t = time.perf_counter()
        llm = clients.langchain_model(url, NAME, recorder=recorder, max_tokens=MAX_TOKENS)
        eps = [clients.langchain_episode(llm, q, max_turns=MAX_TURNS) for q in questions]
        runs["langchain"] = (eps, time.perf_counter() - t, recorder)
    schemas = {}
    for client, (eps, seconds, recorder) in runs.items():
        schemas[client] = tools = served_schema(recorder.sent_tools())
        own = eval_row(f"{client}'s", tools)
        rows.append(
            row(
                client,
                f"{client}'s",
                [e.content for e in eps],
                [e.calls for e in eps],
                [e.turns for e in eps],
                seconds,
                own,
            )
        )
        rows.append(own)
    meta = {
        "model": a.model,
        "n": a.n,
        "max_turns": MAX_TURNS,
        "max_tokens": MAX_TOKENS,
        "problems": f"the first {a.n} of toolmath(256, {a.data_seed}, 'test', {a.hard_frac})",
        "schemas": schemas,
        "command": "python -m benchmarks.bench_clients --model " + a.model,
    }
    write_results(a.name, rows, COLUMNS, out_dir=a.out_dir, meta=meta)


if __name__ == "__main__":
    main()

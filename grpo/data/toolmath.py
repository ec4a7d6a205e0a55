"""Tool-math: offline arithmetic problems a tiny model cannot do in its head, and SFT traces
that solve them with the `calculator` tool (Qwen3 / Hermes tool-call format) or mentally.

Problems are products: "easy" ones of two one-digit numbers (mental arithmetic works) and
"hard" ones of two two-digit numbers (it does not, for a model of a few million parameters).
A problem row is {question, answer, ground_truth-ready answer, kind}; train and test are
disjoint (`grpo.data.minimath.is_test_question`).

A trace is a list of chat messages: [user, assistant tool call, tool result, assistant final
answer] or [user, assistant mental answer]. `sft_pairs` cuts a trace into (prompt, completion)
texts, one per assistant turn, rendered exactly as the multi-turn sampler will see them
(template deltas between turns), so SFT teaches both turns with the loss on assistant text only.
"""

from __future__ import annotations

import random

from grpo.data.minimath import is_test_question
from grpo.errors import GrpoError

TOOL_SYSTEM_PROMPT = (
    'You can call a calculator: <tool_call>{"name": "calculator", "arguments": '
    '{"expression": "..."}}</tool_call>. Finish with \'Final Answer: <number>\'.'
)
TOOL_TOKENS = ("<tool_call>", "</tool_call>")


def problem(rng: random.Random, hard: bool) -> dict:
    """One product problem: two one-digit factors (easy) or two two-digit factors (hard)."""
    lo, hi = (12, 99) if hard else (2, 9)
    a, b = rng.randint(lo, hi), rng.randint(lo, hi)
    return {
        "question": f"What is {a} * {b}?",
        "answer": str(a * b),
        "expression": f"{a} * {b}",
        "kind": "hard" if hard else "easy",
    }


def toolmath(n: int, seed: int, split: str = "train", hard_frac: float = 0.7) -> list[dict]:
    """`n` distinct problems of `split`, each drawn hard with probability `hard_frac`. There are
    only 64 easy products, so in large sets deduplication leaves a larger hard share."""
    if split not in ("train", "test", "validation"):
        raise GrpoError(f"toolmath split must be train, validation or test, got {split!r}")
    rng = random.Random(f"grpo-toolmath|{seed}|{split}")
    rows, seen = [], set()
    want_test = split == "test"
    while len(rows) < n:
        if len(seen) > 50 * n + 1000:
            raise GrpoError(f"toolmath: only {len(rows)} distinct {split} problems exist")
        row = problem(rng, rng.random() < hard_frac)
        q = row["question"]
        if q in seen or is_test_question(q) != want_test:
            seen.add(q)
            continue
        seen.add(q)
        rows.append(row)
    return rows


def tool_call_text(expression: str) -> str:
    """The assistant's calculator call, as Qwen3's template renders one."""
    from grpo.envs.tool_calls import tool_call_text as render

    return render("calculator", {"expression": expression})


def trace(row: dict, use_tool: bool) -> list[dict]:
    """The chat messages of one worked problem, with or without the calculator."""
    user = {"role": "user", "content": row["question"]}
    final = {"role": "assistant", "content": f"Final Answer: {row['answer']}"}
    if not use_tool:
        mental = f"{row['expression']} = {row['answer']}\nFinal Answer: {row['answer']}"
        return [user, {"role": "assistant", "content": mental}]
    call = {"role": "assistant", "content": tool_call_text(row["expression"])}
    return [user, call, {"role": "tool", "content": row["answer"]}, final]


def sft_pairs(
    tokenizer,
    messages: list[dict],
    system_prompt: str | None = None,
    tools: list[dict] | None = None,
) -> list[dict]:
    """One {prompt, completion} text pair per assistant turn of `messages`: the prompt is the
    conversation so far, built as the sampler builds it (the rendered first user turn, then
    each earlier assistant turn and the template's delta for the message after it). With
    `tools` the template renders the tool schemas (an environment's `use_template_tools`)."""
    from grpo.tokenizer import message_delta, render_prompt

    eos = tokenizer.eos_token
    prompt = render_prompt(tokenizer, messages[0]["content"], system_prompt, tools=tools)
    pairs = []
    i = 1
    while i < len(messages):
        turn = messages[i]
        if turn["role"] != "assistant":
            raise GrpoError(f"trace: message {i} should be the assistant's, got {turn['role']!r}")
        pairs.append({"prompt": prompt, "completion": turn["content"] + eos})
        after = messages[i + 1 : i + 2]
        if not after:
            break
        prompt += (
            turn["content"] + eos + message_delta(tokenizer, after[0], after_stop=True, tools=tools)
        )
        i += 2
    return pairs


def corpus(rows: list[dict], tool_variants: int = 0) -> list[str]:
    """Texts for training a tokenizer on the traces (tool and mental forms of every row) and,
    with `tool_variants`, each row's rendering of the calculator's schema
    (`grpo.envs.calculator.tools_for`, as the chat template's ``tojson`` writes it)."""
    import json

    from grpo.envs.calculator import tools_for

    out = [TOOL_SYSTEM_PROMPT]
    for row in rows:
        for use_tool in (True, False):
            out += [m["content"] for m in trace(row, use_tool)]
        if tool_variants:
            out += [
                json.dumps(t, ensure_ascii=False) for t in tools_for(row["question"], tool_variants)
            ]
    return out

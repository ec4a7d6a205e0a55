"""Tool-math: disjoint splits, and SFT pairs whose prompts are token for token what the
multi-turn sampler builds (the model's turn, then the template delta of the tool message)."""

from __future__ import annotations

import pytest

from grpo.data.minimath import is_test_question
from grpo.data.toolmath import TOOL_TOKENS, corpus, sft_pairs, toolmath, trace
from grpo.envs import CalculatorEnv
from grpo.tokenizer import message_delta_ids, render_prompt, train_bpe_tokenizer


@pytest.fixture(scope="module")
def tok():
    rows = toolmath(200, 0, "train")
    return train_bpe_tokenizer(corpus(rows), 384, extra_special_tokens=TOOL_TOKENS)


def test_splits_disjoint_and_mixed():
    train, test = toolmath(300, 0, "train"), toolmath(100, 0, "test")
    assert not {r["question"] for r in train} & {r["question"] for r in test}
    assert all(is_test_question(r["question"]) for r in test)
    # easy products repeat soon (64 of them), so deduplication leaves more hard ones than drawn
    hard = sum(r["kind"] == "hard" for r in train) / len(train)
    assert 0.7 <= hard < 1.0
    for r in train[:20]:
        a, b = (int(x) for x in r["expression"].split(" * "))
        assert int(r["answer"]) == a * b


def test_pairs_are_the_sampler_stream(tok):
    row = toolmath(5, 1, "train", hard_frac=1.0)[0]
    messages = trace(row, use_tool=True)
    first, second = sft_pairs(tok, messages)
    ids = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    assert first["prompt"] == render_prompt(tok, row["question"])
    call = messages[1]["content"]
    # the turn ended on the stop token (after_stop) or right after </tool_call> (turn-end id)
    stopped = ids(first["prompt"]) + ids(call + tok.eos_token)
    stopped += message_delta_ids(tok, messages[2], after_stop=True)
    at_turn_end = ids(first["prompt"]) + ids(call)
    at_turn_end += message_delta_ids(tok, messages[2], after_stop=False)
    assert ids(second["prompt"]) == stopped == at_turn_end
    assert second["completion"] == f"Final Answer: {row['answer']}{tok.eos_token}"
    # the environment answers the traced call with the traced result
    step = CalculatorEnv().step(call, [])
    assert step.observation == messages[2]["content"] == row["answer"]
    assert tok.convert_tokens_to_ids("</tool_call>") != tok.unk_token_id


def test_mental_trace_is_one_pair(tok):
    row = toolmath(5, 2, "train", hard_frac=0.0)[0]
    (pair,) = sft_pairs(tok, trace(row, use_tool=False))
    assert pair["completion"].endswith(f"Final Answer: {row['answer']}{tok.eos_token}")


def test_pairs_render_each_problems_schema_as_its_episode_does():
    """The demo's env_kwargs: each SFT prompt is, token for token, the prompt the calculator
    environment's episode of the same problem starts from, with that problem's rendering of
    the schema (`tools_for`), and the problems do not all render the same one."""
    from grpo.envs.calculator import tools_for
    from grpo.rollout.multiturn import env_prompts

    rows = toolmath(12, 3, "train", hard_frac=1.0)
    tok = train_bpe_tokenizer(corpus(rows, 16), 384, extra_special_tokens=TOOL_TOKENS)
    envs = [CalculatorEnv(use_template_tools=True, tool_variants=16) for _ in rows]
    prompts = env_prompts(tok, rows, envs, 1)
    for row, prompt, env in zip(rows, prompts, envs, strict=True):
        first, _ = sft_pairs(tok, trace(row, use_tool=True), tools=tools_for(row["question"], 16))
        assert tok(first["prompt"], add_special_tokens=False)["input_ids"] == prompt
        assert env.tools == tools_for(row["question"], 16)
        assert '"name": "calculator"' in first["prompt"]
    assert len({str(env.tools) for env in envs}) > 3

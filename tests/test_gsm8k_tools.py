"""GSM8K as code-interpreter traces (grpo.data.gsm8k_tools): annotation parsing, the programs
and what the `python` environment prints for them, the two trace forms, the row statuses on
the vendored test split, the SFT pairs as the multi-turn sampler sees them, and the
`grpo demo --task gsm8k-tools` smoke run (configs/gsm8k_tools_cpu.yaml)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from grpo.data import format_math_dataset, get_dataset
from grpo.data.gsm8k_tools import (
    TOOL_TOKENS,
    Annotation,
    ToolProgram,
    corpus,
    mental_completion,
    normalize,
    parse_annotations,
    question_numbers,
    tool_program,
    trace,
    trace_rows,
)
from grpo.envs.python import PythonEnv
from grpo.envs.tool_calls import parse_tool_calls
from grpo.errors import GrpoError
from grpo.rewards import compare_answers, extract_answer
from grpo.tokenizer import message_delta_ids, render_prompt, train_bpe_tokenizer

GSM8K = Path(__file__).resolve().parent / "data" / "gsm8k"  # the vendored test split
NATALIA_Q = (
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips "
    "in May. How many clips did Natalia sell altogether in April and May?"
)
NATALIA_A = (
    "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
    "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72"
)


@pytest.fixture(scope="module")
def rows():
    return [json.loads(line) for line in (GSM8K / "test.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def tok(rows):
    return train_bpe_tokenizer(corpus(rows[:200]), 384, extra_special_tokens=TOOL_TOKENS)


# ---------------------------------------------------------------- annotations


def test_parse_annotations():
    assert parse_annotations(NATALIA_A) == [Annotation("48/2", "24"), Annotation("48+24", "72")]
    assert parse_annotations("He pays 3*$4 = $<<3*$4=12>>12.") == [Annotation("3*$4", "12")]
    assert parse_annotations("no marks here\n#### 5") == []
    assert parse_annotations("<<1+1>>") == [Annotation("", "1+1")]  # no '=': empty expression


@pytest.mark.parametrize(
    "text, expected",
    [
        ("3*$4", "3*4"),
        ("1,000*2", "1000*2"),
        ("$1,234,567.5", "1234567.5"),
        ("50%*10", "(50/100)*10"),
        ("12.5 % ", "(12.5/100)"),
        ("10%3", "10%3"),  # % before a number: Python's modulo
        ("(1,5)", "(1,5)"),  # not a thousands group
    ],
)
def test_normalize(text, expected):
    assert normalize(text) == expected


def test_question_numbers():
    q = "A $1,200 TV and 3 radios at $4.50 for 25% off, .5 of them"
    assert question_numbers(q) == {1200, 3, 4.5, 25, 0.5}


# ---------------------------------------------------------------- programs


def test_earlier_results_become_variables():
    p = tool_program(NATALIA_Q, NATALIA_A)
    # 24 is step 1's result and not in the question; 48 is the question's
    assert p == ToolProgram("x1 = 48 / 2\nx2 = 48 + x1\nprint(x2)", "72.0", 2, 1)


def test_a_result_the_question_also_holds_stays_a_literal():
    p = tool_program("She has 24 and 48 beads.", "<<48/2=24>>24 <<48+24=72>>72\n#### 72")
    assert p.code == "x1 = 48 / 2\nx2 = 48 + 24\nprint(x2)" and p.output == "72"


@pytest.mark.parametrize(
    "answer, code, output",
    [
        ("He pays 3*$4 = $<<3*$4=12>>12.\n#### 12", "x1 = 3 * 4\nprint(x1)", "12"),
        ("<<1,000*2=2,000>>2,000 m\n#### 2,000", "x1 = 1000 * 2\nprint(x1)", "2000"),
        ("<<50%*10=5>>5\n#### 5", "x1 = 50 / 100 * 10\nprint(x1)", "5.0"),
        ("<<3/4=3/4>>3/4 of it\n#### 3/4", "x1 = 3 / 4\nprint(x1)", "0.75"),  # a fraction
        ("<<10%3=1>>1 left\n#### 1", "x1 = 10 % 3\nprint(x1)", "1"),
        ("<<5-8=-3>>-3\n#### -3", "x1 = 5 - 8\nprint(x1)", "-3"),
        # the answer at step 2: the program stops there (step 3 is a check)
        ("<<2*3=6>>6 <<6+1=7>>7 <<7-1=6>>6\n#### 7", "x1 = 2 * 3\nx2 = x1 + 1\nprint(x2)", "7"),
    ],
)
def test_programs(answer, code, output):
    p = tool_program("A question without numbers?", answer)
    assert (p.code, p.output) == (code, output)
    assert compare_answers(p.output, extract_answer(answer))


@pytest.mark.parametrize(
    "answer, status",
    [
        ("He has 5 apples.\n#### 5", "no_annotation"),
        ("<<2+2=5>>5\n#### 5", "bad_annotation"),  # does not evaluate to its result
        ("<<2x3=6>>6\n#### 6", "bad_annotation"),  # not Python arithmetic
        ("<<9**99=1>>1\n#### 1", "bad_annotation"),  # beyond the evaluator's bounds
        ("<<2+2=>>4\n#### 4", "bad_annotation"),  # no result
        ("<<10*4=40>>40 and 40/8 = 5 each\n#### 5", "answer_not_computed"),
    ],
)
def test_rows_without_a_program(answer, status):
    assert tool_program("Q?", answer) == status


def test_a_solution_without_a_final_answer_is_refused_naming_its_row():
    rows = [
        {"question": "Q?", "answer": "<<1+1=2>>2\n#### 2"},
        {"question": "Q?", "answer": "two lines\nand no final answer"},
    ]
    with pytest.raises(GrpoError, match=r"row 1: .*####"):
        trace_rows(rows)


def test_vendored_test_split_statuses(rows):
    traced, counts = trace_rows(rows, tool_frac=1.0)
    assert dict(counts) == {
        "ok": 1208,
        "no_annotation": 18,
        "answer_not_computed": 93,
        "form:tool": 1208,
        "form:mental": 111,
    }
    for row in traced:
        if row["form"] == "tool":  # every program prints the reference answer
            assert compare_answers(row["messages"][2]["content"], extract_answer(row["answer"]))


def test_the_python_environment_prints_each_traced_observation(rows):
    """The env runs the traced call and answers exactly the traced tool message."""
    traced, _ = trace_rows(rows[:60], tool_frac=1.0)
    tool_rows = [r for r in traced if r["form"] == "tool"][:12]
    assert len(tool_rows) == 12
    for row in tool_rows:
        _, call, observation, final = row["messages"]
        (parsed,) = parse_tool_calls(call["content"])
        assert parsed.name == "python" and parsed.arguments["code"].endswith(")")
        env = PythonEnv()
        step = env.step(call["content"], [])
        assert step.observation == observation["content"], row["question"]
        assert step.info == {"tool_calls": 1, "invalid_calls": 0, "tool_errors": 0}
        assert env.step(final["content"], []).done  # the final turn calls nothing


# ---------------------------------------------------------------- traces and SFT pairs


def test_trace_forms():
    row = {"question": NATALIA_Q, "answer": NATALIA_A}
    user, call, tool, final = trace(row, tool_program(NATALIA_Q, NATALIA_A))
    assert user == {"role": "user", "content": NATALIA_Q}
    assert call["content"] == (
        '<tool_call>\n{"name": "python", "arguments": {"code": "x1 = 48 / 2\\nx2 = 48 + x1\\n'
        'print(x2)"}}\n</tool_call>'
    )
    assert tool == {"role": "tool", "content": "72.0"}
    assert final == {"role": "assistant", "content": "Final Answer: 72.0"}
    (_, mental) = trace(row, None)
    assert (
        mental["content"]
        == mental_completion(NATALIA_A)
        == (
            "Step 1: Natalia sold 48/2 = 24 clips in May.\n"
            "Step 2: Natalia sold 48+24 = 72 clips altogether in April and May.\n"
            "Final Answer: 72"
        )
    )


def test_mental_form_is_the_plain_gsm8k_sft_completion(tok):
    row = {"question": NATALIA_Q, "answer": NATALIA_A}
    (plain,) = format_math_dataset([row], "sft", tokenizer=tok).to_list()
    assert plain["completion"] == mental_completion(NATALIA_A) + tok.eos_token


def test_tool_frac_draw_is_per_question(rows):
    half, counts = trace_rows(rows, tool_frac=0.5, seed=0)
    assert 0.4 < counts["form:tool"] / counts["ok"] < 0.6
    # the same question gets the same form in a slice, and 0 / 1 are all mental / all tool
    part, _ = trace_rows(rows[100:200], tool_frac=0.5, seed=0)
    assert [r["form"] for r in part] == [r["form"] for r in half[100:200]]
    other, _ = trace_rows(rows, tool_frac=0.5, seed=1)
    assert [r["form"] for r in other] != [r["form"] for r in half]
    assert trace_rows(rows[:50], 0.0)[1]["form:tool"] == 0
    with pytest.raises(GrpoError, match="tool_frac"):
        trace_rows(rows[:1], 1.5)


def test_sft_pairs_are_the_sampler_stream(tok):
    """gsm8k-tools-sft rendered for SFT: one pair per assistant turn; the second prompt is,
    token for token, the first prompt + the call + the template delta of the tool message."""
    ds = get_dataset("gsm8k-tools-sft", split="test[:30]", source=str(GSM8K), tool_frac=1.0)
    assert set(ds.column_names) >= {"question", "answer", "messages", "form", "status"}
    pairs = format_math_dataset(ds, "sft", tokenizer=tok, system_prompt="Use python.").to_list()
    n_tool = sum(f == "tool" for f in ds["form"])
    assert len(pairs) == len(ds) + n_tool and n_tool > 20
    ids = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    first, second = [p for p in pairs if p["form"] == "tool"][:2]
    row = next(r for r in ds.to_list() if r["question"] == first["question"])
    _, call, observation, final = row["messages"]
    assert (first["turn"], second["turn"]) == (0, 1)
    assert first["prompt"] == render_prompt(tok, row["question"], "Use python.")
    assert first["completion"] == call["content"] + tok.eos_token
    stream = ids(first["prompt"]) + ids(call["content"] + tok.eos_token)
    stream += message_delta_ids(tok, observation, after_stop=True)
    assert ids(second["prompt"]) == stream
    assert second["completion"] == final["content"] + tok.eos_token
    # the RL format (SFT's evaluation split) reads question and answer, not the trace
    rl = format_math_dataset(ds, "rl", tokenizer=tok).to_list()
    assert "messages" not in rl[0] and rl[0]["ground_truth"] == extract_answer(row["answer"])


def test_enable_thinking_renders_the_first_prompt_as_rl_rows_do(tok):
    template = tok.chat_template
    assert "enable_thinking" in template
    ds = get_dataset("gsm8k-tools-sft", split="test[:3]", source=str(GSM8K), tool_frac=1.0)
    pairs = format_math_dataset(ds, "sft", tokenizer=tok, enable_thinking=False).to_list()
    rl = format_math_dataset(ds, "rl", tokenizer=tok, enable_thinking=False).to_list()
    for pair in pairs:
        rl_prompt = next(r["prompt"] for r in rl if r["question"] == pair["question"])
        assert pair["prompt"].startswith(rl_prompt) and "<think>" in rl_prompt


def test_configs_select_it_with_data_source(tok):
    from grpo.config import DataConfig
    from grpo.loading import load_rows

    data = DataConfig(dataset="gsm8k-tools-sft", source=str(GSM8K), split="test[:4]")
    rows = load_rows(data, data.split, None, "sft", tok)
    assert len(rows) >= 4 and all(r["completion"].endswith(tok.eos_token) for r in rows)


# ---------------------------------------------------------------- the CPU recipe


def test_tool_use_summary_reads_transcripts():
    from grpo.apps.demo import tool_use_summary

    call = '<tool_call>\n{"name": "python", "arguments": {"code": "print(x)"}}\n</tool_call>'
    after = "<|im_end|>\n<|im_start|>assistant\n"
    samples = [
        {
            "transcript": f"{call}<|im_end|>\n<|im_start|>tool\n72.0{after}Final Answer: 72.0",
            "correct": True,
        },
        {
            "transcript": f"{call}<|im_end|>\n<|im_start|>tool\n"
            f"error: NameError: name 'x' is not defined{after}Final Answer: 1",
            "correct": False,
        },
        {"transcript": "Step 1: 2 + 1 = 3\nFinal Answer: 3<|im_end|>", "correct": True},
        {"transcript": "Final Answer: 4<|im_end|>", "correct": False},
        {"transcript": "Final Answer: 5<|im_end|>", "correct": False},
    ]
    assert tool_use_summary(samples) == {
        "problems": 5,
        "tool_use_rate": 0.4,
        "tool_messages": 2,
        "error_message_rate": 0.5,
        "accuracy_called": 0.5,
        "accuracy_not_called": 1 / 3,
    }


def test_gsm8k_tools_demo_quick_writes_every_output(tmp_path, capsys):
    """configs/gsm8k_tools_cpu.yaml as `grpo demo --task gsm8k-tools --quick` runs it, on the
    vendored test split (training on rows the evaluation does not use)."""
    from grpo.apps.cli import main

    out = tmp_path / "gsm8k-tools"
    assert (
        main(
            [
                "demo",
                "--task",
                "gsm8k-tools",
                "--out",
                str(out),
                "--quick",
                f"base.data.source={GSM8K}",
                "base.data.split=test[16:]",
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "without the tool" in printed and "tool use" in printed
    results = json.loads((out / "results.json").read_text())
    assert results["settings"]["task"] == "gsm8k-tools"
    assert results["problems"]["rows"] == 64 and results["problems"]["ok"] > 50
    for stage in ("sft", "grpo"):
        e = results[stage]["eval"]
        assert 1.0 <= e["turns_mean"] <= 3.0 and "tool_calls_mean" in e
        assert "turns_mean" not in results["without_tool"][stage]  # one turn, no tool
        use = results["tool_use"][stage]
        assert use["problems"] == 8 and 0 <= use["error_message_rate"] <= 1
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert any("env/tool_calls_mean" in r for r in records if r["stage"] == "grpo")
    assert (out / "model" / "config.json").is_file()
    assert (
        json.loads((out / "model" / "config.json").read_text())["max_position_embeddings"] == 1024
    )

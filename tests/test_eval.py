"""Evaluation metrics on hand-made completions with known answers, lengths, steps and errors."""

from __future__ import annotations

import pytest

from grpo.eval import (
    comparison_table,
    reference_steps,
    score_completion,
    summarize,
    wrong_calculation,
)

CORRECT = "Step 1: 3 + 5 = 8\nStep 2: 8 * 2 = 16\nFinal Answer: 16"
CALC_WRONG = "Step 1: 3 + 5 = 9\nStep 2: 9 * 2 = 18\nFinal Answer: 18"
OTHER_WRONG = "Step 1: 3 + 5 = 8\nFinal Answer: 8"  # arithmetic right, reasoning wrong
NO_FORMAT = "Step 1: 3 + 5 = 8\nthe answer is 16"  # right number, no Final Answer marker


def test_score_correct():
    s = score_completion(CORRECT, "16", n_tokens=20)
    assert s == {
        "correct": True,
        "format_ok": True,
        "steps": 2,
        "n_tokens": 20,
        "pred": "16",
        "abs_error": 0.0,
        "error_type": None,
    }


def test_error_categories():
    calc = score_completion(CALC_WRONG, "16")
    assert not calc["correct"] and calc["error_type"] == "calculation"
    assert calc["abs_error"] == pytest.approx(2.0)
    other = score_completion(OTHER_WRONG, "16")
    assert other["error_type"] == "other" and other["abs_error"] == pytest.approx(8.0)
    fmt = score_completion(NO_FORMAT, "16")
    assert fmt["error_type"] == "format" and not fmt["format_ok"] and not fmt["correct"]
    assert fmt["abs_error"] is None


def test_wrong_calculation_operators():
    assert not wrong_calculation("12 / 4 = 3 and 7 - 9 = -2 and 2 x 3 = 6 and 1,000 + 1 = 1,001")
    assert wrong_calculation("12 / 4 = 4")
    assert wrong_calculation("1 / 0 = 1")
    assert not wrong_calculation("no equations here")


def test_reference_steps_and_summary_by_difficulty():
    assert reference_steps("a = 1\nb = 2\n#### 3") == 2
    assert reference_steps("#### 3") == 1
    scored = [
        score_completion(CORRECT, "16", 20),  # difficulty 2
        score_completion(CALC_WRONG, "16", 30),  # difficulty 3
        score_completion(NO_FORMAT, "16", 10),  # difficulty 6
        score_completion(CORRECT, "16", 40),  # difficulty 4
    ]
    s = summarize(scored, difficulties=[2, 3, 6, 4])
    assert s["n"] == 4
    assert s["accuracy"] == 0.5
    assert s["format_rate"] == 0.75
    assert s["avg_length"] == 25.0  # (20 + 30 + 10 + 40) / 4
    assert s["avg_steps"] == (2 + 2 + 1 + 2) / 4  # NO_FORMAT: 1 marker
    assert s["mean_abs_error"] == pytest.approx((0 + 2 + 0) / 3)  # numeric predictions only
    assert s["errors"] == {"format": 1, "calculation": 1, "other": 0}
    assert s["by_difficulty"] == {
        "1-2": {"n": 1, "accuracy": 1.0},
        "3-4": {"n": 2, "accuracy": 0.5},
        "5+": {"n": 1, "accuracy": 0.0},
    }


def test_comparison_table():
    table = comparison_table({"sft": {"accuracy": 0.25}, "grpo": {"accuracy": 0.5, "pass@4": 0.75}})
    lines = table.splitlines()
    assert lines[0].startswith("| model | accuracy") and "pass@4" in lines[0]
    assert lines[2].startswith("| sft | 0.250") and lines[3].startswith("| grpo | 0.500")


def test_evaluate_runs_through_the_sampler(tiny_checkpoints, tiny_tokenizer):
    from grpo.eval import evaluate
    from grpo.models import load_model

    model = load_model(tiny_checkpoints("qwen3", vocab_size=len(tiny_tokenizer)))
    rows = [
        {
            "prompt_ids": tiny_tokenizer("What is 2+2?")["input_ids"],
            "ground_truth": "4",
            "full_answer": "2+2=4\n#### 4",
        },
        {
            "prompt_ids": tiny_tokenizer("What is 3+3?")["input_ids"],
            "ground_truth": "6",
            "full_answer": "#### 6",
        },
    ]
    res = evaluate(
        model,
        tiny_tokenizer,
        rows,
        stop_ids=[tiny_tokenizer.eos_token_id],
        max_new_tokens=8,
        k=3,
        details=True,
    )
    s = res.summary
    assert s["n"] == 2 and 0 <= s["accuracy"] <= s["pass@3"] <= 1
    assert 1 <= s["avg_length"] <= 8
    assert len(res.samples) == 2 and "completion" in res.samples[0]


def test_eval_compare_gives_each_model_prompts_from_its_own_tokenizer(
    shared_tiny_model, tiny_checkpoints, tiny_tokenizer, tmp_path, monkeypatch
):
    # `grpo eval --compare` once tokenized the problems with the first model's tokenizer and fed
    # those ids to every model; here the two tokenizers differ (a BPE of 384 tokens trained on
    # mini-math vs one of 300 on other text), so each model must get its own ids.
    import shutil

    import grpo.eval
    from grpo.config import DataConfig
    from grpo.eval import run_eval_command
    from grpo.loading import load_rows
    from grpo.tokenizer import load_tokenizer

    other = tmp_path / "other"
    shutil.copytree(tiny_checkpoints("qwen3", vocab_size=len(tiny_tokenizer)), other)
    tiny_tokenizer.save_pretrained(str(other))
    calls = []
    real = grpo.eval.evaluate

    def spy(model, tokenizer, rows, **kw):
        calls.append(rows)
        return real(model, tokenizer, rows, **kw)

    monkeypatch.setattr(grpo.eval, "evaluate", spy)
    payload = run_eval_command(
        str(shared_tiny_model),
        "minimath:test",
        max_samples=3,
        max_new_tokens=2,
        batch_size=4,
        compare=[f"other={other}"],
    )
    assert [m["summary"]["n"] for m in payload["models"].values()] == [3, 3]
    expected = [
        load_rows(DataConfig(), "test", 3, "rl", load_tokenizer(path))
        for path in (shared_tiny_model, other)
    ]
    for rows, want in zip(calls, expected, strict=True):
        assert [r["question"] for r in rows] == [r["question"] for r in expected[0]]
        assert [r["prompt_ids"] for r in rows] == [r["prompt_ids"] for r in want]
    assert calls[0][0]["prompt_ids"] != calls[1][0]["prompt_ids"]  # the tokenizers do differ


def test_eval_command_honours_max_prompt_len(shared_tiny_model, capsys):
    from grpo.apps import cli

    argv = ["eval", "--model", str(shared_tiny_model), "--max-samples", "2"]
    assert cli.main([*argv, "--max-prompt-len", "8"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert "prompt of row 0 of 'minimath' (test)" in err and "> --max-prompt-len 8" in err
    assert cli.main([*argv, "--max-prompt-len", "0"]) == 2
    assert "--max-prompt-len: must be > 0" in capsys.readouterr().err


def test_eval_env_kwargs_default_to_the_rollouts_for_the_same_env():
    from grpo.config import load_config
    from grpo.eval import eval_env_settings

    calc = {"use_template_tools": True, "tool_variants": 16}
    model = {"model": {"path": "unused"}}
    grpo = load_config(base={**model, "rollout": {"env": "calculator", "env_kwargs": calc}})
    assert eval_env_settings(grpo)["env_kwargs"] == calc
    # SFT: its rollout.env is single_turn; its evaluation episodes get none unless given
    sft = load_config(
        base={**model, "rollout": {"env_kwargs": calc}, "eval": {"env": "calculator"}}
    )
    assert eval_env_settings(sft)["env_kwargs"] == {}
    own = {"use_template_tools": True}
    for base in (
        {"rollout": {"env": "calculator", "env_kwargs": calc}},
        {"rollout": {"env": "single_turn"}},
    ):
        cfg = load_config(base={**model, **base, "eval": {"env": "calculator", "env_kwargs": own}})
        assert eval_env_settings(cfg)["env_kwargs"] == own

"""Tests for grpo.rewards: answer extraction, reward formulas, the registry, batch checks."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from grpo.data.formats import sft_solution, split_solution
from grpo.errors import GrpoError
from grpo.rewards import (
    NamedReward,
    build_rewards,
    compare_answers,
    compute_rewards,
    count_steps,
    extract_answer,
    get_reward,
    has_final_answer,
    make_combined,
    make_length_penalty,
    make_step,
    register_reward,
)
from grpo.rewards import registry as reward_registry

GSM8K_TEST = Path(__file__).resolve().parent / "data" / "gsm8k" / "test.jsonl"  # real, vendored


@pytest.fixture(autouse=True)
def _fresh_registry(monkeypatch):
    """Each test registers into its own empty registry."""
    monkeypatch.setattr(reward_registry, "_REGISTERED", {})


# ---------------------------------------------------------------- extraction


@pytest.mark.parametrize(
    "text, expected",
    [
        ("Step 1: 3+5 = 8\nFinal Answer: 8", "8"),
        ("final answer: 42", "42"),  # case-insensitive
        ("**Final Answer:** 72", "72"),
        ("**Final Answer**: 7 km", "7"),
        ("Final Answer:\n15", "15"),  # answer on the next line
        ("Final Answer: 5 + 3 = 8", "8"),  # keeps what follows the last '='
        ("Final Answer: $1,234.50", "1234.5"),  # currency, thousands, trailing zero
        ("Final Answer: 25%", "25"),
        ("Final Answer: 12 apples.", "12"),  # units and period
        ("Final Answer: -7", "-7"),
        ("Final Answer: 3/4", "3/4"),
        ("Final Answer: 0.50", "0.5"),
        ("Final Answer: .5", "0.5"),
        ("Final Answer: \\boxed{9}", "9"),
        ("Final Answer: yes.", "yes"),  # no number: the text itself
        ("Natalia sold 48+24 = <<48+24=72>>72 clips.\n#### 72", "72"),
        ("#### 1,200", "1200"),
        ("#### -3", "-3"),
        ("The answer is \\boxed{14}.", "14"),
        ("So \\boxed{\\frac{3}{4}} cup", "3/4"),
        ("\\boxed{\\text{5 dollars}}", "5"),
        ("\\boxed{1{,}000}", "1000"),  # LaTeX thousands separator
        ("He paid $18 in total.", "18"),  # last number
        ("It costs -$5 now", "-5"),
        ("costs $-5", "-5"),
        ("5-3 is 2 and then 10-4", "4"),  # a hyphen between numbers is not a sign
        ("temperature fell to -4.5 degrees", "-4.5"),
        ("about 1,000,000 people", "1000000"),
        ("he ate 3/8 of the pie", "3/8"),
        ("-0", "0"),
    ],
)
def test_extract_answer_cases(text, expected):
    assert extract_answer(text) == expected


def test_extract_answer_precedence():
    # Final Answer beats ####, which beats \boxed, which beats the last number.
    assert extract_answer("#### 1\n\\boxed{2} 3\nFinal Answer: 4\n5") == "4"
    assert extract_answer("\\boxed{2}\n#### 1\n9") == "1"
    assert extract_answer("\\boxed{2} then 9") == "2"
    # the last marker of a kind wins
    assert extract_answer("Final Answer: 1\nno wait\nFinal Answer: 2") == "2"
    # an empty marker falls through to the next rule
    assert extract_answer("#### 6\nFinal Answer:") == "6"


@pytest.mark.parametrize("text", ["", None, "no numbers here", "Final Answer:"])
def test_extract_answer_none(text):
    assert extract_answer(text) is None


@pytest.mark.parametrize(
    "pred, truth, expected",
    [
        ("72", "72", True),
        ("72.0", "72", True),
        ("1200", "1,200", True),
        ("0.75", "3/4", True),
        ("$5.50", "5.5", True),
        ("25%", "25", True),
        ("-3", "3", False),
        ("72", "73", False),
        ("1/3", "0.333", False),
        ("Yes", "yes.", True),  # string fallback
        ("yes", "no", False),
        ("7", "seven", False),
        (None, "1", False),
        ("3/0", "3/0", True),  # zero denominator: not a number, compared as text
    ],
)
def test_compare_answers(pred, truth, expected):
    assert compare_answers(pred, truth) is expected


def test_compare_answers_tolerance():
    assert compare_answers("1.0000001", "1")
    assert not compare_answers("1.001", "1")
    assert compare_answers("1.001", "1", tolerance=1e-2)


def test_count_steps_and_format_marker():
    assert count_steps("Step 1: a\nStep 2: b\nstep 3) c\nFinal Answer: 1") == 3
    assert count_steps("first line\n\nsecond line\nFinal Answer: 1") == 2  # lines, no markers
    assert count_steps("a\nb\n#### 3") == 2
    assert count_steps("") == 0
    assert has_final_answer("Step 1: x\nFinal Answer: 3")
    assert not has_final_answer("#### 3")
    assert not has_final_answer("Final Answer:")


def test_extract_answer_recovers_every_gsm8k_answer():
    with open(GSM8K_TEST, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    assert len(rows) == 1319  # GSM8K's whole test split
    for i, row in enumerate(rows):
        truth = row["answer"].rsplit("####", 1)[1].strip()
        canonical = truth.replace(",", "")
        # the raw GSM8K solution
        got = extract_answer(row["answer"])
        assert got == canonical and compare_answers(got, truth), (i, row["answer"], got)
        # the same solution rewritten in our SFT format
        steps, final = split_solution(row["answer"], row=i)
        sft = sft_solution(steps, final)
        assert "<<" not in sft and sft.startswith("Step 1: ")
        got = extract_answer(sft)
        assert got == canonical and compare_answers(got, truth), (i, sft, got)


# ---------------------------------------------------------------- reward formulas


def test_accuracy():
    fn = get_reward("accuracy")
    completions = ["Final Answer: 5", "Final Answer: 6", "#### 1,200", "nothing"]
    assert fn(completions, ground_truth=["5", "5", "1200", "3"]) == [1.0, 0.0, 1.0, 0.0]
    assert fn.name == "accuracy"


def test_strict_accuracy_needs_the_marker():
    rambling = "Step 1: Leo is 4/2 = 2 years old old old old"  # last number 2: scores unless strict
    completions = ["Final Answer: 2", rambling, "Final Answer: 3", "#### 2"]
    truths = ["2"] * 4
    assert get_reward("accuracy")(completions, ground_truth=truths) == [1.0, 1.0, 0.0, 1.0]
    strict, _ = build_rewards([{"name": "accuracy", "strict": True}])[0]
    assert strict(completions, ground_truth=truths) == [1.0, 0.0, 0.0, 0.0]


def test_length_penalty_formula():
    fn = make_length_penalty(target=200, alpha=0.001)
    right, wrong = "Final Answer: 5", "Final Answer: 4"
    # correct: 1 - 0.001 * (500 - 200) = 0.7; under target: 1.0; wrong: 0.0 whatever the length
    got = fn([right, right, wrong], ground_truth=["5"] * 3, completion_lengths=[500, 150, 900])
    assert got == pytest.approx([0.7, 1.0, 0.0])
    # very long and correct: 1 - 0.001 * 1800 = -0.8, floored at 0.0 by default
    assert fn([right], ground_truth=["5"], completion_lengths=[2000]) == [0.0]
    unfloored = make_length_penalty(target=200, alpha=0.001, floor=None)
    got = unfloored([right], ground_truth=["5"], completion_lengths=[2000])
    assert got == pytest.approx([-0.8])


def test_length_penalty_counts_characters_or_tokens():
    text = "x" * 35 + "\nFinal Answer: 5"  # 51 characters, 3 whitespace-separated "tokens"
    chars = make_length_penalty(target=41, alpha=0.01)
    assert chars([text], ground_truth=["5"]) == pytest.approx([1 - 0.01 * (51 - 41)])

    class WordTokenizer:
        def encode(self, text, add_special_tokens=False):
            return text.split()

    tokens = make_length_penalty(target=1, alpha=0.1, tokenizer=WordTokenizer())
    assert tokens([text], ground_truth=["5"]) == pytest.approx([1 - 0.1 * (4 - 1)])
    # completion_lengths from the trainer win over the tokenizer
    assert tokens([text], ground_truth=["5"], completion_lengths=[1]) == [1.0]


def test_step_formula():
    three = "Step 1: a\nStep 2: b\nStep 3: c\nFinal Answer: 5"
    fn = get_reward({"name": "step", "beta": 0.1})
    # correct: 1 + 0.1 * 3 = 1.3; wrong: 0 + 0.1 * 3 = 0.3
    assert fn([three, three], ground_truth=["5", "6"]) == pytest.approx([1.3, 0.3])
    capped = make_step(beta=0.1, cap=2)
    assert capped([three], ground_truth=["5"]) == pytest.approx([1.2])
    # without markers, the non-empty lines before the final answer count
    assert fn(["a\nb\n\nFinal Answer: 5"], ground_truth=["5"]) == pytest.approx([1.2])


def test_format_reward():
    fn = get_reward("format")
    got = fn(["Step 1: x\nFinal Answer: 3", "#### 3", "Final Answer:"], ground_truth=["3"] * 3)
    assert got == [1.0, 0.0, 0.0]
    assert fn(["Final Answer: 3"]) == [1.0]  # needs no ground truth


def test_combined_formula():
    fn = make_combined({"accuracy": 1.0, "length_penalty": 0.5})
    right = "Final Answer: 5"
    # 1.0 * 1 + 0.5 * (1 - 0.001 * 300) = 1.35; wrong: 0
    got = fn([right, "Final Answer: 4"], ground_truth=["5", "5"], completion_lengths=[500, 500])
    assert got == pytest.approx([1.35, 0.0])
    spec = {
        "name": "combined",
        "weights": {"format": 0.2, "length_penalty": {"weight": 2.0, "target": 100}},
    }
    # 0.2 * 1 + 2.0 * (1 - 0.001 * (300 - 100)) = 1.8
    cfg = get_reward(spec)
    assert cfg([right], ground_truth=["5"], completion_lengths=[300]) == pytest.approx([1.8])


# ---------------------------------------------------------------- registry


def test_get_reward_callable_and_register(tmp_path):
    def shouty(completions, **columns):
        return [float(c.isupper()) for c in completions]

    assert get_reward(shouty).name == "shouty"
    register_reward("shout", shouty)
    assert get_reward("shout")(["A", "b"]) == [1.0, 0.0]
    assert "shout" in reward_registry.available_rewards()
    with pytest.raises(GrpoError, match="already registered"):
        register_reward("shout", shouty)
    with pytest.raises(GrpoError, match="already registered"):
        register_reward("accuracy", shouty)
    register_reward("shout", lambda completions, **c: [2.0] * len(completions), overwrite=True)
    assert get_reward("shout")(["A"]) == [2.0]

    def make_const(value=1.0):
        return lambda completions, **c: [value] * len(completions)

    register_reward("const", make_const, factory=True)
    assert get_reward({"name": "const", "value": 3.0})(["x", "y"]) == [3.0, 3.0]
    with pytest.raises(GrpoError, match="parameters: value"):
        get_reward({"name": "const", "valu": 3.0})


def test_get_reward_module_path(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def brevity(completions, scale=1.0, **columns):\n"
        "    return [scale / (1 + len(c)) for c in completions]\n"
    )
    (tmp_path / "broken_rewards.py").write_text("import no_such_module_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = get_reward("my_rewards:brevity")
    assert fn.name == "brevity" and fn(["abc"]) == [0.25]
    assert get_reward({"name": "my_rewards:brevity", "scale": 2.0})(["abc"]) == [0.5]
    with pytest.raises(GrpoError, match="cannot import module 'broken_rewards'.*no_such_module"):
        get_reward("broken_rewards:anything")
    with pytest.raises(GrpoError, match="cannot import module 'nope_pkg.mod'"):
        get_reward("nope_pkg.mod:fn")
    with pytest.raises(GrpoError, match="has no attribute 'missing'"):
        get_reward("my_rewards:missing")


def test_get_reward_errors():
    with pytest.raises(GrpoError, match="unknown reward 'acc'.*accuracy, combined, format"):
        get_reward("acc")
    with pytest.raises(GrpoError, match="reward 'length_penalty'.*target, alpha"):
        get_reward({"name": "length_penalty", "targte": 3})
    with pytest.raises(GrpoError, match="has no 'name'"):
        get_reward({"beta": 0.1})
    with pytest.raises(GrpoError, match="must be >= 0"):
        get_reward({"name": "length_penalty", "alpha": -1})
    with pytest.raises(GrpoError, match="needs the column 'ground_truth'"):
        get_reward("accuracy")(["Final Answer: 1"])


def test_build_rewards_forms():
    pairs = build_rewards({"accuracy": 1.0, "step": {"weight": 0.5, "beta": 0.2}})
    assert [(fn.name, w) for fn, w in pairs] == [("accuracy", 1.0), ("step", 0.5)]
    pairs = build_rewards(["accuracy", {"name": "format", "weight": 0.1}])
    assert [(fn.name, w) for fn, w in pairs] == [("accuracy", 1.0), ("format", 0.1)]
    assert [w for _, w in build_rewards("accuracy")] == [1.0]
    with pytest.raises(GrpoError, match="weight of 'accuracy' must be a number"):
        build_rewards({"accuracy": "high"})
    with pytest.raises(GrpoError, match="non-empty list"):
        build_rewards([])


# ---------------------------------------------------------------- compute_rewards


def test_compute_rewards_total_and_parts():
    pairs = build_rewards({"accuracy": 1.0, "format": 0.5})
    completions = ["Final Answer: 5", "#### 5", "Final Answer: 2"]
    total, parts = compute_rewards(pairs, completions, {"ground_truth": ["5", "5", "5"]})
    assert total.shape == (3,) and total.dtype == torch.float32
    assert total.tolist() == pytest.approx([1.5, 1.0, 0.5])
    assert parts["accuracy"].tolist() == [1.0, 1.0, 0.0]
    assert parts["format"].tolist() == [1.0, 0.0, 1.0]
    # the same reward twice gets a distinct log name
    _, parts = compute_rewards(pairs + pairs[:1], completions, {"ground_truth": ["5"] * 3})
    assert set(parts) == {"accuracy", "format", "accuracy_2"}


def test_compute_rewards_errors_name_function_and_row():
    columns = {"ground_truth": ["1", "2", "3"]}
    completions = ["a", "b", "boom"]

    def explodes(completions, **columns):
        return [1.0 / (c != "boom") for c in completions]

    with pytest.raises(GrpoError, match=r"'explodes' raised ZeroDivisionError at row 2 .*boom"):
        compute_rewards([(explodes, 1.0)], completions, columns)

    def short(completions, **columns):
        return [0.0]

    with pytest.raises(GrpoError, match="'short' returned 1 values for 3 completions"):
        compute_rewards([(short, 1.0)], completions, columns)

    def nan_at_1(completions, **columns):
        return [0.0, math.nan, 0.0]

    with pytest.raises(GrpoError, match="'nan_at_1' returned nan at row 1"):
        compute_rewards([(nan_at_1, 1.0)], completions, columns)

    def none_at_0(completions, **columns):
        return [None, 1.0, 1.0]

    with pytest.raises(GrpoError, match="'none_at_0' returned None at row 0"):
        compute_rewards([(none_at_0, 1.0)], completions, columns)

    def scalar(completions, **columns):
        return 1.0

    with pytest.raises(GrpoError, match="'scalar' returned float"):
        compute_rewards([(scalar, 1.0)], completions, columns)

    # a failing component of `combined` is named as such
    combined = get_reward({"name": "combined", "weights": {"accuracy": 1.0, nan_at_1: 1.0}})
    with pytest.raises(GrpoError, match="'combined/nan_at_1' returned nan at row 1"):
        compute_rewards([(combined, 1.0)], completions, columns)

    with pytest.raises(GrpoError, match="'accuracy' raised GrpoError: needs the column 'ground"):
        compute_rewards(build_rewards("accuracy"), completions, {})
    # `rewards: []` (an estimator that reads none): the empty sum, 0 for every row
    total, per_fn = compute_rewards([], completions, columns)
    assert total.tolist() == [0.0] * len(completions) and per_fn == {}


# ---------------------------------------------------------------- isolation (issue 20, item 3)


def test_each_reward_gets_its_own_copy_of_the_inputs():
    """A reward that rewrites its inputs (here: the ground truth to whatever each completion
    says, which made a random model score accuracy 1.0) changes nothing for the next reward
    or the caller."""

    def cheat(completions, ground_truth, completion_ids, **_):
        for i, c in enumerate(completions):
            ground_truth[i] = extract_answer(c)  # every answer "right"
            completion_ids[i].append(99)
        completions.clear()
        return [0.0] * len(ground_truth)

    completions = ["Final Answer: 1", "Final Answer: 7", "Final Answer: 3"]
    columns = {"ground_truth": ["1", "2", "3"], "completion_ids": [[5], [6, 7], [8]]}
    before = (list(completions), json.loads(json.dumps(columns)))
    accuracy = get_reward("accuracy")
    _, parts = compute_rewards([(cheat, 1.0), (accuracy, 1.0)], completions, columns)
    assert parts["accuracy"].tolist() == [1.0, 0.0, 1.0]  # the true ground truth
    assert (completions, columns) == before  # the caller's objects are untouched
    # the same inside `combined`
    combined = get_reward({"name": "combined", "weights": {cheat: 1.0, "accuracy": 1.0}})
    total, _ = compute_rewards([(combined, 1.0)], completions, columns)
    assert total.tolist() == [1.0, 0.0, 1.0] and (completions, columns) == before


def test_exit_and_interrupt_inside_a_reward_are_errors_naming_it():
    import sys

    columns = {"ground_truth": ["1", "2"]}

    def quits(completions, **_):
        if "bad" in completions:
            sys.exit(0)
        return [0.0] * len(completions)

    with pytest.raises(
        GrpoError,
        match=r"'quits' raised SystemExit at row 1 \(completion 'bad'\)"
        r": sys.exit\(0\)",
    ):
        compute_rewards([(quits, 1.0)], ["ok", "bad"], columns)

    def interrupts(completions, **_):
        raise KeyboardInterrupt

    with pytest.raises(
        GrpoError,
        match="'interrupts' raised KeyboardInterrupt: raised by the function itself, not a Ctrl-C",
    ):
        compute_rewards([(interrupts, 1.0)], ["a", "b"], columns)
    # in a worker thread (timeout_s) too
    timed = get_reward({"name": interrupts, "timeout_s": 5})
    with pytest.raises(GrpoError, match="'interrupts' raised KeyboardInterrupt"):
        compute_rewards([(timed, 1.0)], ["a", "b"], columns)
    combined = get_reward({"name": "combined", "weights": {quits: 1.0}})
    with pytest.raises(GrpoError, match="'combined/quits' raised SystemExit"):
        compute_rewards([(combined, 1.0)], ["bad", "bad"], columns)


def test_a_real_ctrl_c_during_a_reward_still_interrupts():
    import signal

    # Python's own handler, as in a terminal (a process that a non-interactive shell started
    # in the background inherits SIGINT ignored: no Ctrl-C reaches it at all)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _ctrl_c_during_a_reward()
    finally:
        signal.signal(signal.SIGINT, previous)


def _ctrl_c_during_a_reward():
    import os
    import signal
    import threading
    import time

    handler = signal.getsignal(signal.SIGINT)

    def user_presses_ctrl_c(completions, **_):
        signal.raise_signal(signal.SIGINT)  # as a terminal's Ctrl-C: SIGINT to the process
        return [0.0] * len(completions)

    with pytest.raises(KeyboardInterrupt):
        compute_rewards([(user_presses_ctrl_c, 1.0)], ["a"], {})
    assert signal.getsignal(signal.SIGINT) is handler  # restored

    # while the main thread waits for a reward running under a timeout
    release = threading.Event()

    def slow(completions, **_):
        release.wait(10)
        return [0.0] * len(completions)

    # kill(), not raise_signal(): a terminal's SIGINT goes to the process (the main thread),
    # raise_signal() to the calling thread only
    timer = threading.Timer(0.2, os.kill, args=(os.getpid(), signal.SIGINT))
    timer.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            compute_rewards([(get_reward({"name": slow, "timeout_s": 10}), 1.0)], ["a"], {})
    finally:
        release.set()
        timer.join()
    assert time.monotonic() - t0 < 5
    assert signal.getsignal(signal.SIGINT) is handler


def test_timeout_fails_the_call_with_one_line_naming_the_function():
    import threading
    import time

    release = threading.Event()

    def hangs(completions, **_):
        release.wait(30)
        return [0.0] * len(completions)

    pairs = build_rewards([{"name": hangs, "weight": 1.0, "timeout_s": 0.3}])
    assert pairs[0][0].timeout_s == 0.3
    t0 = time.monotonic()
    try:
        with pytest.raises(GrpoError) as info:
            compute_rewards(pairs, ["a", "b"], {})
    finally:
        release.set()
    assert time.monotonic() - t0 < 2.0
    assert str(info.value) == (
        "reward function 'hangs' did not return within its timeout_s=0.3 s "
        "(rewards[].timeout_s); it was left running in a background thread"
    )

    # a function that returns in time is unaffected, per-token values included, and the worker
    # computes in the caller's grad mode
    def process(completions, completion_ids, **_):
        assert not torch.is_grad_enabled()
        return [[0.5] * len(ids) for ids in completion_ids]

    timed = build_rewards([{"name": process, "timeout_s": 5}, "format"])
    columns = {"completion_lengths": [2, 1], "completion_ids": [[3, 4], [5]]}
    with torch.no_grad():
        total, _ = compute_rewards(timed, ["Final Answer: 1", "x"], columns, token_width=3)
    torch.testing.assert_close(total, torch.tensor([[0.5, 1.5, 0.0], [0.5, 0.0, 0.0]]))
    for bad in (0, -1, float("inf"), "5"):
        with pytest.raises(GrpoError, match="timeout_s of 'accuracy' must be a number of seconds"):
            build_rewards([{"name": "accuracy", "timeout_s": bad}])


def test_timeout_in_the_config_is_validated_and_reaches_the_reward():
    from grpo.config import load_config
    from grpo.settings import ConfigError

    cfg = load_config(None, ["model.path=m", "rewards=[{name: format, timeout_s: 2.5}]"])
    ((fn, weight),) = build_rewards([r.spec for r in cfg.rewards])
    assert (fn.name, fn.timeout_s, weight) == ("format", 2.5, 1.0)
    assert cfg.rewards[0].spec == {"name": "format", "weight": 1.0, "timeout_s": 2.5}
    # by default a call may take 300 s (no hang); null: no limit, the call in this thread
    assert load_config(None, ["model.path=m"]).rewards[0].spec == {
        "name": "accuracy",
        "weight": 1.0,
        "timeout_s": 300.0,
    }
    cfg = load_config(None, ["model.path=m", "rewards=[{name: format, timeout_s: null}]"])
    assert cfg.rewards[0].spec == {"name": "format", "weight": 1.0}
    assert build_rewards([r.spec for r in cfg.rewards])[0][0].timeout_s is None
    for value in ("0", "-1", ".inf"):
        with pytest.raises(ConfigError, match=r"rewards\[0?\]\.timeout_s"):
            load_config(None, ["model.path=m", f"rewards=[{{name: format, timeout_s: {value}}}]"])


def test_wrong_return_types_are_errors_naming_the_function():
    import numpy as np

    columns = {"ground_truth": ["1", "2"]}
    cases = [
        (lambda c, **_: {"a": 1.0, "b": 0.0}, "returned dict, expected a list of floats"),
        (lambda c, **_: "1.0", "returned str, expected a list of floats"),
        (lambda c, **_: (x for x in [1.0, 1.0]), "returned generator, expected a list"),
        (lambda c, **_: ["1.0", 0.0], "returned '1.0' at row 0 .*expected a finite float"),
        (lambda c, **_: [1.0, [0.1, "x"]], "returned a list at row 1"),
        (lambda c, **_: [object(), 1.0], "returned <object object .*expected a finite float"),
    ]
    for fn, message in cases:
        with pytest.raises(GrpoError, match=message):
            compute_rewards([(NamedReward("typed", fn), 1.0)], ["a", "b"], columns)
    # numpy arrays and tensors are lists of floats
    total, _ = compute_rewards(
        [
            (lambda c, **_: np.array([0.25, 1.0]), 1.0),
            (lambda c, **_: torch.tensor([1.0, 0.0]), 2.0),
        ],
        ["a", "b"],
        columns,
    )
    assert total.tolist() == [2.25, 1.0]


def test_the_row_by_row_retry_is_bounded(monkeypatch):
    import threading
    import time

    from grpo.rewards import compute as reward_compute

    calls = []

    def fails_on_batches(completions, **_):
        calls.append(len(completions))
        raise ValueError("batch-level problem")

    monkeypatch.setattr(reward_compute, "RETRY_ROWS", 5)
    with pytest.raises(GrpoError, match="'fails_on_batches' raised ValueError: batch-level"):
        compute_rewards([(fails_on_batches, 1.0)], ["x"] * 1000, {})
    assert calls == [1000] + [1] * 5  # the batch, then at most RETRY_ROWS rows alone

    # a function that hangs when retried alone: the error still comes back in bounded time
    release = threading.Event()

    def hangs_alone(completions, **_):
        if len(completions) > 1:
            raise ValueError("bad batch")
        release.wait(30)
        return [0.0]

    monkeypatch.setattr(reward_compute, "RETRY_SECONDS", 0.3)
    t0 = time.monotonic()
    try:
        with pytest.raises(GrpoError, match="'hangs_alone' raised ValueError: bad batch"):
            compute_rewards([(hangs_alone, 1.0)], ["x"] * 10, {})
    finally:
        release.set()
    assert time.monotonic() - t0 < 2.0


# ---------------------------------------------------------------- through the commands

REWARDS_ISO = """
import sys, threading
RELEASE = threading.Event()
def quits(completions, **columns):
    sys.exit(0)
def interrupts(completions, **columns):
    raise KeyboardInterrupt
def hangs(completions, **columns):
    RELEASE.wait(60)
    return [0.0] * len(completions)
"""
TINY_CI = str(Path(__file__).resolve().parents[1] / "configs" / "tiny_ci.yaml")
PIPELINE_TINY = str(Path(__file__).resolve().parents[1] / "configs" / "pipeline_tiny.yaml")


@pytest.fixture
def iso_module(tmp_path, monkeypatch):
    import sys

    (tmp_path / "rewards_iso.py").write_text(REWARDS_ISO)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    module = sys.modules.pop("rewards_iso", None)
    if module is not None:
        module.RELEASE.set()  # lets an abandoned worker thread finish


def _one_line_error(code, capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_train_exits_2_when_a_reward_exits_interrupts_or_times_out(
    shared_tiny_model, iso_module, capsys
):
    from grpo.apps import cli

    base = [
        "train",
        "--config",
        TINY_CI,
        f"model.path={shared_tiny_model}",
        f"train.output_dir={iso_module}/run",
        "train.progress=false",
        "data.eval_samples=0",
        "train.max_steps=1",
        "data.max_samples=8",
        "rollout.max_new_tokens=4",
    ]
    err = _one_line_error(cli.main([*base, "rewards=[{name: 'rewards_iso:quits'}]"]), capsys)
    assert err.startswith("grpo train: error: reward function 'quits' raised SystemExit")
    err = _one_line_error(cli.main([*base, "rewards=[{name: 'rewards_iso:interrupts'}]"]), capsys)
    assert "reward function 'interrupts' raised KeyboardInterrupt" in err
    spec = "rewards=[{name: 'rewards_iso:hangs', timeout_s: 0.5}]"
    err = _one_line_error(cli.main([*base, spec]), capsys)
    assert err == (
        "grpo train: error: reward function 'hangs' did not return within its "
        "timeout_s=0.5 s (rewards[].timeout_s); it was left running in a background "
        "thread"
    )


def test_pipeline_and_sweep_exit_2_when_a_reward_exits(shared_tiny_model, iso_module, capsys):
    from grpo.apps import cli

    quits = "rewards=[{name: 'rewards_iso:quits'}]"
    code = cli.main(
        [
            "pipeline",
            "--config",
            PIPELINE_TINY,
            f"model.path={shared_tiny_model}",
            f"output_dir={iso_module}/pipe",
            "evaluate_base=true",
            "eval.max_samples=2",
            quits,
        ]
    )
    err = _one_line_error(code, capsys)
    assert "stage 'base_eval' failed: reward function 'quits' raised SystemExit" in err
    (iso_module / "space.yaml").write_text("optim.lr: [0.001]\n")
    code = cli.main(
        [
            "sweep",
            "--config",
            TINY_CI,
            "--space",
            str(iso_module / "space.yaml"),
            "--out",
            str(iso_module / "sweep"),
            f"model.path={shared_tiny_model}",
            "train.progress=false",
            "data.eval_samples=0",
            "train.max_steps=1",
            "data.max_samples=8",
            "rollout.max_new_tokens=4",
            quits,
        ]
    )
    err = _one_line_error(code, capsys)
    assert "every trial failed" in err
    trial = json.loads((iso_module / "sweep" / "trial_000" / "trial.json").read_text())
    assert "reward function 'quits' raised SystemExit" in trial["error"]


def test_quickstart_digit_share_by_hand():
    """configs/quickstart.yaml's reward, named as the config names it (path form), through the
    same machinery a run uses: digits / characters, empty -> 0 (hand-computed)."""
    from grpo.rewards import build_rewards, compute_rewards

    fns = build_rewards([{"name": "grpo.tiny:digit_share", "weight": 2.0}])
    total, per_fn = compute_rewards(fns, ["x 12", "", "abc", "2024"], {"answer": ["1"] * 4})
    # "x 12": 2 of 4; "": 0; "abc": 0 of 3; "2024": 4 of 4; weight 2 on the total
    assert list(per_fn.values())[0].tolist() == [0.5, 0.0, 0.0, 1.0]
    assert total.tolist() == [1.0, 0.0, 0.0, 2.0]

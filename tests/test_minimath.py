"""Tests for grpo.data.minimath: determinism, disjoint splits, and answers checked independently
(by solving the question text, by re-evaluating the `<<a op b=c>>` marks, and by evaluating the
returned expression)."""

from __future__ import annotations

import re
from fractions import Fraction

import pytest

from grpo.data import is_test_question, minimath
from grpo.errors import GrpoError
from grpo.rewards import extract_answer

_MARK_RE = re.compile(r"<<(\d+)([-+*/])(\d+)=(\d+)>>\4")
_OPS = {
    "+": lambda a, b: a + b,
    "-": lambda a, b: a - b,
    "*": lambda a, b: a * b,
    "/": lambda a, b: Fraction(a, b),
}


def solve_question(question: str) -> list[int]:
    """The chain of values a question describes, read from its sentences alone.

    Sentence kinds: "1/b as ..." divides; "more"/"older" adds; "fewer"/"less"/"younger"
    subtracts; "b times as ..." multiplies, except "OLD is b times as old as NEW", which
    divides (the subject is the person whose age we already know).
    """
    first, *relations, _question = re.split(r"(?<=[.?])\s+", question)
    value = Fraction(int(re.search(r"\d+", first).group()))
    known = first.split()[0]  # the person in the ages template
    values = [int(value)]
    for sentence in relations:
        b = int(re.findall(r"\d+", sentence)[-1])
        age = re.fullmatch(r"(\w+) is \d+ times as old as (\w+)\.", sentence)
        if age and age[1] == known:  # "OLD is b times as old as NEW"
            value /= b
            known = age[2]
        else:
            known = sentence.split()[0]
            if "1/" in sentence:
                value /= b
            elif re.search(r"\b(more|older)\b", sentence):
                value += b
            elif re.search(r"\b(fewer|less|younger)\b", sentence):
                value -= b
            else:
                assert "times as" in sentence, sentence
                value *= b
        assert value.denominator == 1 and value >= 0, (question, value)
        values.append(int(value))
    return values


def test_same_seed_same_problems():
    a = minimath(200, seed=7)
    assert a.to_list() == minimath(200, seed=7).to_list()
    assert a["question"] != minimath(200, seed=8)["question"]
    # a prefix does not depend on n
    assert minimath(50, seed=7).to_list() == a.to_list()[:50]


def test_train_and_test_are_disjoint():
    train, test = set(), set()
    for seed in (0, 1):
        for difficulty in (0, 1):
            questions = minimath(1000, seed=seed, difficulty=difficulty)["question"]
            assert len(set(questions)) == 1000  # distinct within a call
            train |= set(questions)
    for seed in (0, 1, 2):
        for difficulty in (0, 1):
            questions = minimath(200, seed=seed, split="test", difficulty=difficulty)["question"]
            assert len(set(questions)) == 200 and all(is_test_question(q) for q in questions)
            test |= set(questions)
    assert not train & test


@pytest.mark.parametrize("difficulty", [0, 1, 2])
def test_answers_are_correct(difficulty):
    ds = minimath(300, seed=difficulty, difficulty=difficulty)
    for row in ds:
        question, answer = row["question"], row["answer"]
        lines = answer.split("\n")
        final = int(lines[-1].removeprefix("#### "))
        assert lines[-1] == f"#### {final}" and extract_answer(answer) == str(final)
        # 1. the question text alone gives the chain of values
        chain = solve_question(question)
        assert chain[-1] == final and len(chain) - 1 == row["steps"], (question, answer)
        # 2. every mark is true arithmetic and the marks chain from the first quantity
        marks = [_MARK_RE.search(line) for line in lines[:-1]]
        assert all(marks) and len(marks) == row["steps"], answer
        for k, mark in enumerate(marks):
            a, op, b, c = int(mark[1]), mark[2], int(mark[3]), int(mark[4])
            assert _OPS[op](a, b) == c, mark[0]
            assert a == chain[k] and c == chain[k + 1], (question, answer)
        # 3. the expression evaluates to the final answer
        expression = row["expression"]
        assert re.fullmatch(r"[\d+\-*/()]+", expression)
        assert eval(expression) == final  # digits and operators only
        assert row["difficulty"] == difficulty


def test_difficulty_controls_ranges_and_steps():
    easy = minimath(500, seed=0, difficulty=0)
    assert set(easy["steps"]) == {1, 2}
    for question, answer in zip(easy["question"], easy["answer"]):
        numbers = [int(x) for x in re.findall(r"\d+", question)]
        assert all(1 <= x <= 20 for x in numbers), question
        assert all(0 <= int(x) <= 100 for x in re.findall(r"\d+", answer)), answer
    hard = minimath(300, seed=0, difficulty=2)
    assert set(hard["steps"]) == {2, 3, 4}
    assert max(int(a.rsplit("#### ", 1)[1]) for a in hard["answer"]) > 100
    assert set(minimath(100, seed=0, difficulty=2, max_steps=1)["steps"]) == {1}
    assert set(minimath(300, seed=0, difficulty=1, max_steps=2)["steps"]) == {1, 2}


def test_templates_all_appear():
    questions = " ".join(minimath(200, seed=0)["question"])
    for marker in ("years old", "km", "costs $", " has "):
        assert marker in questions


def test_errors():
    with pytest.raises(GrpoError, match="difficulty must be one of 0, 1, 2, got 3"):
        minimath(10, seed=0, difficulty=3)
    with pytest.raises(GrpoError, match="max_steps must be 1 to 4"):
        minimath(10, seed=0, max_steps=5)
    with pytest.raises(GrpoError, match="split must be 'train' or 'test'"):
        minimath(10, seed=0, split="val")
    with pytest.raises(GrpoError, match="n must be a non-negative integer"):
        minimath(-1, seed=0)
    assert len(minimath(0, seed=0)) == 0

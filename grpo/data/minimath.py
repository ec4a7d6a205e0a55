"""Mini-math: an offline, seedable generator of GSM8K-format word problems.

Each problem is a chain of 1-4 arithmetic steps told as a short story: a first quantity, then
one sentence per step relating a new quantity to the previous one (more / fewer, times as many,
1/b as many), then a question about the last one. Four templates: collections of things, ages,
distances by day, and prices. The worked solution has one line per step in GSM8K style,
``Ben has 5+3 = <<5+3=8>>8 marbles.``, and ends with ``#### 8``. Every intermediate value is a
non-negative integer (subtraction stays >= 1, division is exact).

Train and test are disjoint by construction: a question belongs to the test split when a hash
of its text falls in bucket 0 of 10, so no question can be generated for both splits, whatever
the seeds. The language is regular and the numbers small at low difficulty so that a tiny
transformer can learn the task on a CPU in minutes.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

from datasets import Dataset

from grpo.errors import GrpoError

MAX_STEPS = 4
SPLITS = ("train", "test")


@dataclass(frozen=True)
class Level:
    """Number ranges and step counts of one difficulty."""

    min_steps: int
    max_steps: int
    start_max: int  # first quantity in [1, start_max]
    add_max: int  # operand of + and - in [1, add_max]
    factor_max: int  # operand of * and / in [2, factor_max]
    value_max: int  # every intermediate value stays <= value_max


LEVELS = (
    Level(min_steps=1, max_steps=2, start_max=20, add_max=20, factor_max=5, value_max=100),
    Level(min_steps=1, max_steps=3, start_max=50, add_max=50, factor_max=10, value_max=1000),
    Level(min_steps=2, max_steps=4, start_max=100, add_max=100, factor_max=12, value_max=10000),
)


@dataclass(frozen=True)
class Template:
    """The sentences of one story kind. Placeholders: {new} {old} {first} {last} {a} {b} {unit}
    {expr} {c}; `ops` maps an operator to the sentence relating {new} to {old}."""

    start: str
    ops: dict[str, str]
    question: str
    line: str  # one worked-solution line; {work} is "expr = <<expr=c>>c"
    entities: tuple[str, ...]
    units: tuple[str, ...] = ("",)
    ordered: bool = False  # entities follow each other in order (days), else drawn at random


_NAMES = ("Ann", "Ben", "Cara", "Dan", "Eva", "Finn", "Gia", "Hugo", "Ivy", "Jack", "Kim", "Leo")
_DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
_ITEMS = ("pen", "book", "cup", "bag", "hat", "ball", "lamp", "kite", "mug", "toy")

TEMPLATES = {
    "collections": Template(
        start="{first} has {a} {unit}.",
        ops={
            "+": "{new} has {b} more {unit} than {old}.",
            "-": "{new} has {b} fewer {unit} than {old}.",
            "*": "{new} has {b} times as many {unit} as {old}.",
            "/": "{new} has 1/{b} as many {unit} as {old}.",
        },
        question="How many {unit} does {last} have?",
        line="{new} has {work} {unit}.",
        entities=_NAMES,
        units=("marbles", "stickers", "apples", "cards", "shells", "coins"),
    ),
    "ages": Template(
        start="{first} is {a} years old.",
        ops={
            "+": "{new} is {b} years older than {old}.",
            "-": "{new} is {b} years younger than {old}.",
            "*": "{new} is {b} times as old as {old}.",
            "/": "{old} is {b} times as old as {new}.",
        },
        question="How old is {last}?",
        line="{new} is {work} years old.",
        entities=_NAMES,
    ),
    "distances": Template(
        start="A cyclist rides {a} km on {first}.",
        ops={
            "+": "On {new} she rides {b} km more than on {old}.",
            "-": "On {new} she rides {b} km less than on {old}.",
            "*": "On {new} she rides {b} times as far as on {old}.",
            "/": "On {new} she rides 1/{b} as far as on {old}.",
        },
        question="How many km does she ride on {last}?",
        line="On {new} she rides {work} km.",
        entities=_DAYS,
        ordered=True,
    ),
    "prices": Template(
        start="A {first} costs ${a}.",
        ops={
            "+": "A {new} costs ${b} more than a {old}.",
            "-": "A {new} costs ${b} less than a {old}.",
            "*": "A {new} costs {b} times as much as a {old}.",
            "/": "A {new} costs 1/{b} as much as a {old}.",
        },
        question="How many dollars does a {last} cost?",
        line="A {new} costs {work} dollars.",
        entities=_ITEMS,
    ),
}


def minimath(
    n: int,
    seed: int = 0,
    split: str = "train",
    difficulty: int = 0,
    max_steps: int | None = None,
) -> Dataset:
    """Generate `n` distinct mini-math problems.

    Args:
        n: number of problems.
        seed: same seed, same problems (and order).
        split: ``"train"`` or ``"test"``; the two never share a question.
        difficulty: 0 (1-2 steps, operands 1-20, values <= 100), 1 (1-3 steps, <= 50, <= 1000)
            or 2 (2-4 steps, <= 100, <= 10000); see `LEVELS`.
        max_steps: cap on the step count (1-4), lowering the level's maximum.

    Returns:
        a Dataset with ``question``, ``answer`` (GSM8K worked solution ending ``#### N``),
        ``steps`` (int), ``difficulty`` (int) and ``expression`` (e.g. ``"((5+3)*2)"``, whose
        Python value is N).
    """
    level = _level(difficulty, max_steps)
    if split not in SPLITS:
        raise GrpoError(f"minimath: split must be 'train' or 'test', got {split!r}")
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise GrpoError(f"minimath: n must be a non-negative integer, got {n!r}")
    rng = random.Random(f"minimath|{seed}|{split}|{difficulty}|{max_steps}")
    where = f"minimath: difficulty {difficulty}, max_steps {max_steps}"
    rows = distinct_problems(rng, n, split, level, difficulty, where)
    if not rows:
        return Dataset.from_dict(
            {"question": [], "answer": [], "steps": [], "difficulty": [], "expression": []}
        )
    return Dataset.from_list(rows)


def distinct_problems(
    rng: random.Random, n: int, split: str, level: Level, difficulty: int = 0, where: str = ""
) -> list[dict]:
    """`n` problems drawn with `rng` at `level`, no question twice, each in `split` (the
    `is_test_question` rule); raises when the level cannot supply that many."""
    rows: list[dict] = []
    seen: set[str] = set()
    attempts = 0
    while len(rows) < n:
        attempts += 1
        if attempts > 100 * n + 1000:
            raise GrpoError(
                f"{where or 'minimath'}: only {len(rows)} distinct {split} problems exist at "
                f"this level; ask for fewer than {n}"
            )
        row = generate_problem(rng, level, difficulty)
        if row["question"] in seen or is_test_question(row["question"]) != (split == "test"):
            continue
        seen.add(row["question"])
        rows.append(row)
    return rows


def is_test_question(question: str) -> bool:
    """Whether a question belongs to the test split: its hash falls in bucket 0 of 10."""
    digest = hashlib.blake2b(question.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") % 10 == 0


def generate_problem(rng: random.Random, level: Level, difficulty: int = 0) -> dict:
    """One problem drawn with `rng` at `level` (see `minimath` for the fields)."""
    template = TEMPLATES[rng.choice(sorted(TEMPLATES))]
    steps = rng.randint(level.min_steps, level.max_steps)
    entities = _entities(rng, template, steps + 1)
    unit = rng.choice(template.units)
    value = rng.randint(1, level.start_max)
    expression = str(value)
    sentences = [template.start.format(first=entities[0], a=value, unit=unit)]
    lines = []
    for k in range(1, steps + 1):
        op, b = _draw_step(rng, level, value)
        result = _apply(op, value, b)
        fields = {"new": entities[k], "old": entities[k - 1], "b": b, "unit": unit}
        sentences.append(template.ops[op].format(**fields))
        expr = f"{value}{op}{b}"
        work = f"{expr} = <<{expr}={result}>>{result}"
        lines.append(template.line.format(work=work, **fields))
        expression = f"({expression}{op}{b})"
        value = result
    sentences.append(template.question.format(last=entities[-1], unit=unit))
    return {
        "question": " ".join(sentences),
        "answer": "\n".join([*lines, f"#### {value}"]),
        "steps": steps,
        "difficulty": difficulty,
        "expression": expression,
    }


def _level(difficulty: int, max_steps: int | None) -> Level:
    """The level of `difficulty`, with its step range capped by `max_steps`."""
    if isinstance(difficulty, bool) or difficulty not in range(len(LEVELS)):
        valid = ", ".join(str(d) for d in range(len(LEVELS)))
        raise GrpoError(f"minimath: difficulty must be one of {valid}, got {difficulty!r}")
    level = LEVELS[difficulty]
    if max_steps is None:
        return level
    if isinstance(max_steps, bool) or max_steps not in range(1, MAX_STEPS + 1):
        raise GrpoError(f"minimath: max_steps must be 1 to {MAX_STEPS} or None, got {max_steps!r}")
    top = min(level.max_steps, max_steps)
    return Level(
        min_steps=min(level.min_steps, top),
        max_steps=top,
        start_max=level.start_max,
        add_max=level.add_max,
        factor_max=level.factor_max,
        value_max=level.value_max,
    )


def _entities(rng: random.Random, template: Template, count: int) -> list[str]:
    """`count` distinct entities: consecutive (days) or drawn at random (names, items)."""
    if template.ordered:
        first = rng.randrange(len(template.entities))
        return [template.entities[(first + i) % len(template.entities)] for i in range(count)]
    return rng.sample(template.entities, count)


def _draw_step(rng: random.Random, level: Level, value: int) -> tuple[str, int]:
    """An operator and operand whose result is an integer in [1, level.value_max]."""
    choices: dict[str, list[int]] = {
        "+": list(range(1, min(level.add_max, level.value_max - value) + 1)),
        "-": list(range(1, min(level.add_max, value - 1) + 1)),
        "*": list(range(2, min(level.factor_max, level.value_max // value) + 1)),
        "/": [b for b in range(2, level.factor_max + 1) if value % b == 0],
    }
    ops = [op for op in sorted(choices) if choices[op]]
    op = rng.choice(ops)
    return op, rng.choice(choices[op])


def _apply(op: str, a: int, b: int) -> int:
    """a op b, exact for the operands `_draw_step` picks."""
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    quotient, remainder = divmod(a, b)
    assert remainder == 0, f"inexact division {a}/{b}"
    return quotient

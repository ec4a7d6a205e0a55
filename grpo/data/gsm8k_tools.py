"""GSM8K with a code interpreter: the calculator annotations of GSM8K solutions become a small
Python program for the `python` environment, and every row becomes an SFT trace.

GSM8K solutions mark each computation, ``Natalia sold 48/2 = <<48/2=24>>24 clips in May.``.
A row's trace is a list of chat messages in one of two forms:

    tool:    user       Natalia sold clips to 48 of her friends in April, ...
             assistant  <tool_call>
                        {"name": "python", "arguments": {"code": "x1 = 48 / 2\\nx2 = 48 + x1
                        \\nprint(x2)"}}                           (one line in the trace)
                        </tool_call>
             tool       72.0
             assistant  Final Answer: 72.0
    mental:  user       Natalia sold clips ...
             assistant  Step 1: Natalia sold 48/2 = 24 clips in May.
                        Step 2: Natalia sold 48+24 = 72 clips altogether in April and May.
                        Final Answer: 72

The tool form is chosen for a model of a few million parameters that learns it from scratch:

- **Earlier results are variables.** GSM8K writes step 2 as ``48+24``, with step 1's result
  as a literal, so a program of the annotations as written would need the very arithmetic the
  tool is there to do. A literal equal to an earlier step's stated result that the question
  does not contain becomes that step's variable (``x1``); every other literal is a number of
  the question (or a constant such as 100 or 12), which the model can copy.
- **One call, one print.** The program prints only the answer, so the observation is one
  number and the final turn copies it verbatim. After a division it is a float (``72.0``),
  which scores as 72: accuracy compares numbers.
- **No prose in the tool turn.** The program is the reasoning; the turn stays short (about
  as many tokens as the annotations), which fits small per-turn limits.

The mental form is the plain GSM8K SFT completion (`grpo.data.formats.sft_solution`), so a
mix of the two (`tool_frac`) teaches one model both, and GRPO can find out which works.

Which rows can take the tool form (`tool_program`, counted by `trace_rows`):

- ``ok``: every annotation evaluates (Python semantics, the calculator's bounded evaluator) to
  its stated result, and the final answer is one of the results (the program stops at the
  last step that gives it);
- ``no_annotation``: the solution marks no computation;
- ``bad_annotation``: an annotation that does not parse, exceeds the evaluator's bounds, or
  does not evaluate to its stated result (within 1e-6);
- ``answer_not_computed``: the final answer is no annotation's result (the last step was done
  in the text: ``... so each gets 20/4 = 5``).

Rows that are not ``ok`` are **kept in mental form**: their text is GSM8K's reference solution,
the same completion plain GSM8K SFT trains on; only a program would be wrong or incomplete.
Before parsing, ``$`` signs and thousands commas are dropped and a percent sign after a number
reads as ``/100`` (``<<3*$4=12>>``, ``<<1,000*2=2,000>>``, ``<<50%*10=5>>``).
"""

from __future__ import annotations

import ast
import math
import random
import re
from collections import Counter
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

from datasets import Dataset

from grpo.data.formats import sft_solution, split_solution
from grpo.data.gsm8k import load_gsm8k
from grpo.envs.calculator import CalculatorError, evaluate_arithmetic
from grpo.envs.tool_calls import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, tool_call_text
from grpo.errors import GrpoError

PYTHON_TOOL = "python"
TOOL_TOKENS = (TOOL_CALL_OPEN, TOOL_CALL_CLOSE)
STATUSES = ("ok", "no_annotation", "bad_annotation", "answer_not_computed")
DEFAULT_TOOL_FRAC = 0.5  # the `gsm8k-tools-sft` mix: half of the `ok` rows call the tool

_ANNOTATION_RE = re.compile(r"<<([^<>]*)>>")
_THOUSANDS_RE = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
_PERCENT_RE = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*%(?!\s*[\d.(])")
_QUESTION_NUMBER_RE = re.compile(r"\d{1,3}(?:,\d{3})+(?!\d)(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+")
_VARIABLE_RE = re.compile(r"\bx(\d+)\b")
_REL_TOL = 1e-6


@dataclass(frozen=True)
class Annotation:
    """One ``<<expression=result>>`` mark, as written."""

    expression: str
    result: str


@dataclass(frozen=True)
class ToolProgram:
    """A row's tool form: the program and what running it prints (stdout, no final newline)."""

    code: str
    output: str
    steps: int  # assignments in the program
    variables_used: int  # literals replaced by an earlier step's variable


def parse_annotations(answer: str) -> list[Annotation]:
    """Every ``<<expression=result>>`` of a GSM8K solution, in order.

    The result is the text after the last ``=`` (``<<a=b=c>>`` reads as expression ``a=b``,
    which then fails to parse). A mark without ``=`` has an empty expression.
    """
    out = []
    for inner in _ANNOTATION_RE.findall(answer):
        expression, _, result = inner.rpartition("=")
        out.append(Annotation(expression.strip(), result.strip()))
    return out


def normalize(text: str) -> str:
    """Annotation text as Python arithmetic: ``$`` and thousands commas dropped, ``N%`` as
    ``(N/100)`` (a ``%`` followed by a number stays Python's modulo)."""
    text = text.replace("$", "")
    text = _THOUSANDS_RE.sub("", text)
    return _PERCENT_RE.sub(r"(\1/100)", text).strip()


def question_numbers(question: str) -> set[Fraction]:
    """The values of the numbers written in a question (``1,200`` is 1200, ``$4.50`` 4.5)."""
    return {Fraction(m.replace(",", "")) for m in _QUESTION_NUMBER_RE.findall(question)}


def tool_program(question: str, answer: str) -> ToolProgram | str:
    """The Python program of a GSM8K solution, or why it has none.

    Args:
        question: the problem (its numbers stay literals in the program).
        answer: the GSM8K solution with ``<<...>>`` annotations and ``#### N``.

    Returns:
        a `ToolProgram` (``x1 = ...`` per annotation up to the last one whose result is the
        final answer, then ``print(xK)``), or a status of `STATUSES` other than ``ok``.
    """
    annotations = parse_annotations(answer)
    if not annotations:
        return "no_annotation"
    try:
        parsed = [_parse(a.expression) for a in annotations]
        stated = [_value(a.result) for a in annotations]
    except (CalculatorError, SyntaxError, ValueError, ZeroDivisionError):
        return "bad_annotation"
    if not all(_close(value, s) for (_, value), s in zip(parsed, stated)):
        return "bad_annotation"
    try:
        final = _value(split_solution(answer)[1])
    except (CalculatorError, ValueError, ZeroDivisionError):
        return "answer_not_computed"
    answer_steps = [k for k, s in enumerate(stated) if _close(s, final)]
    if not answer_steps:
        return "answer_not_computed"
    last = answer_steps[-1]
    known = question_numbers(question)
    values: list[int | float] = []
    lines, replaced = [], 0
    for k in range(last + 1):
        subst = _Substitute(stated[:k], known)
        code = ast.unparse(subst.visit(parsed[k][0]))
        replaced += subst.count
        # the step as Python computes it: earlier variables at their full values, parenthesized
        # (repr round-trips ints and floats exactly)
        inlined = _VARIABLE_RE.sub(lambda m: f"({values[int(m[1]) - 1]!r})", code)
        try:
            value = evaluate_arithmetic(inlined, max_length=10_000, max_nodes=1_000)
        except CalculatorError:
            return "bad_annotation"
        if not _close(value, stated[k]):  # an earlier result used at full precision drifted
            return "bad_annotation"
        values.append(value)
        lines.append(f"x{k + 1} = {code}")
    lines.append(f"print(x{last + 1})")
    return ToolProgram("\n".join(lines), str(values[last]), last + 1, replaced)


def mental_completion(answer: str) -> str:
    """The mental form's assistant turn: GSM8K's solution as ``Step k:`` lines (annotations
    removed) and ``Final Answer: N``, exactly the plain GSM8K SFT completion."""
    return sft_solution(*split_solution(answer))


def trace(row: dict, program: ToolProgram | None) -> list[dict]:
    """The chat messages of one row: the tool form with `program`, else the mental form."""
    user = {"role": "user", "content": row["question"]}
    if program is None:
        return [user, {"role": "assistant", "content": mental_completion(row["answer"])}]
    call = tool_call_text(PYTHON_TOOL, {"code": program.code})
    return [
        user,
        {"role": "assistant", "content": call},
        {"role": "tool", "content": program.output},
        {"role": "assistant", "content": f"Final Answer: {program.output}"},
    ]


def uses_tool(question: str, tool_frac: float, seed: int) -> bool:
    """Whether an ``ok`` row is traced with the tool: a draw per question and seed, so the
    choice does not depend on the row's position (slices and `max_samples` keep it)."""
    return random.Random(f"gsm8k-tools|{seed}|{question}").random() < tool_frac


def trace_rows(
    rows: list[dict], tool_frac: float = DEFAULT_TOOL_FRAC, seed: int = 0
) -> tuple[list[dict], Counter]:
    """Traces of GSM8K rows: each row with ``messages`` (its trace), ``form`` (tool | mental)
    and ``status`` (of `STATUSES`) added.

    Args:
        rows: {question, answer, ...} rows.
        tool_frac: the share of ``ok`` rows traced with the tool (the rest mentally).
        seed: which ``ok`` rows those are (`uses_tool`).

    Returns:
        (rows, counts): counts per status and per form (``form:tool``, ``form:mental``).
    """
    if not 0.0 <= tool_frac <= 1.0:
        raise GrpoError(f"gsm8k-tools: tool_frac must be in [0, 1], got {tool_frac}")
    out, counts = [], Counter()
    for i, row in enumerate(rows):
        try:
            program = tool_program(row["question"], row["answer"])
            status = "ok" if isinstance(program, ToolProgram) else program
            if status != "ok" or not uses_tool(row["question"], tool_frac, seed):
                program = None
            messages = trace(row, program)
        except GrpoError as e:  # a solution the plain GSM8K format cannot read either
            raise GrpoError(f"gsm8k-tools: row {i}: {e}") from None
        form = "mental" if program is None else "tool"
        counts[status] += 1
        counts[f"form:{form}"] += 1
        out.append({**row, "messages": messages, "form": form, "status": status})
    return out, counts


def gsm8k_tools_sft(
    split: str = "train",
    source: str | Path | None = None,
    tool_frac: float = DEFAULT_TOOL_FRAC,
    seed: int = 0,
) -> Dataset:
    """The built-in ``gsm8k-tools-sft`` dataset: GSM8K rows with their traces (``messages``).

    `grpo.data.format_math_dataset` renders such rows as one (prompt, completion) pair per
    assistant turn, each prompt built as the multi-turn sampler builds it; the RL format (SFT's
    own evaluation split) reads their question and answer as usual.

    Args:
        split: the GSM8K split (a slice is applied by `get_dataset`).
        source: as `data.source` of the ``gsm8k`` dataset: hub id (default ``openai/gsm8k``) or
            a local file / directory.
        tool_frac, seed: see `trace_rows`.
    """
    rows = load_gsm8k(split, source=source or "openai/gsm8k").to_list()
    traced, _ = trace_rows(rows, tool_frac, seed)
    return Dataset.from_list(traced)


def corpus(rows: list[dict]) -> list[str]:
    """Texts for training a tokenizer on the traces: every row in both forms (where it has a
    tool form) and the error lines a program can get back."""
    out = ["error: NameError: name 'x' is not defined", "error: SyntaxError: invalid syntax"]
    for row in rows:
        program = tool_program(row["question"], row["answer"])
        forms = [None] + ([program] if isinstance(program, ToolProgram) else [])
        for p in forms:
            out += [m["content"] for m in trace(row, p)]
    return out


def summary(counts: Counter) -> dict[str, Any]:
    """Counts of `trace_rows` as a plain dict: rows, per status and per form."""
    return {
        "rows": sum(counts[s] for s in STATUSES),
        **{s: counts[s] for s in STATUSES},
        "tool_traces": counts["form:tool"],
        "mental_traces": counts["form:mental"],
    }


class _Substitute(ast.NodeTransformer):
    """Replace a literal equal to an earlier step's stated result (and to no number of the
    question) with that step's variable, the most recent step first."""

    def __init__(self, earlier: list[Fraction], known: set[Fraction]):
        self.earlier, self.known, self.count = earlier, known, 0

    def visit_Constant(self, node: ast.Constant) -> ast.AST:
        value = Fraction(repr(node.value))  # the literal as written: 0.2 is 1/5
        if value in self.known:
            return node
        for k in range(len(self.earlier) - 1, -1, -1):
            if self.earlier[k] == value:
                self.count += 1
                return ast.copy_location(ast.Name(id=f"x{k + 1}", ctx=ast.Load()), node)
        return node


def _parse(expression: str) -> tuple[ast.expr, int | float]:
    """A normalized annotation as an expression tree the calculator accepts, and its value
    (raises CalculatorError for anything else: names, calls, a bound exceeded)."""
    text = normalize(expression)
    value = evaluate_arithmetic(text)  # grammar and bounds
    return ast.parse(text, mode="eval").body, value


def _value(text: str) -> Fraction:
    """A stated result or final answer (``24``, ``.5``, ``3/4``, ``$1,200``, ``20%``) as an
    exact fraction."""
    if not text.strip():
        raise ValueError("empty result")
    value = evaluate_arithmetic(normalize(text))
    return Fraction(repr(value)) if isinstance(value, float) else Fraction(value)


def _close(a: int | float | Fraction, b: int | float | Fraction) -> bool:
    return math.isclose(float(a), float(b), rel_tol=_REL_TOL, abs_tol=1e-9)

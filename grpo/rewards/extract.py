"""Read answers out of model text: the final answer, numeric comparison, step counting.

Extraction order (the first rule that yields an answer wins):

1. the text after the last ``Final Answer:`` (case-insensitive, markdown bold allowed),
2. the text after the last ``####`` (GSM8K),
3. the contents of the last ``\\boxed{...}``,
4. the last number anywhere in the text.

Inside the text that a marker points at, ``\\boxed{}`` and ``\\frac{a}{b}`` are unwrapped, a
trailing ``... = X`` keeps only ``X``, and the first number is taken; currency signs, thousands
commas, percent signs and units are dropped. Numbers come back canonical: ``"1,200.50"`` ->
``"1200.5"``, ``"$-3"`` -> ``"-3"``, ``"3/4"`` stays a fraction. A marker followed by text with
no number returns that text (so ``compare_answers`` can fall back to a string compare).
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

# A number: thousands-grouped or plain integer part, optional decimals, optional `/den`.
# The lookbehind keeps `5-3` from reading as `-3` and `x2` from reading as `2`.
_NUMBER_RE = re.compile(
    r"(?<![\w.])(?P<sign>[-−+]?)(?:\$\s?)?"
    r"(?P<num>(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|\.\d+)"
    r"(?:/(?P<den>\d+)(?![\d.]))?"
)
_FINAL_RE = re.compile(r"final\s+answer\s*\**\s*[:：]", re.IGNORECASE)
_HASHES_RE = re.compile(r"####")
_BOXED_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")
_FRAC_RE = re.compile(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}")
_STEP_RE = re.compile(r"^\s*[*#]*\s*step\s*\d+\s*\**\s*[:.)]", re.IGNORECASE | re.MULTILINE)
_LATEX_NOISE_RE = re.compile(r"\\[,!;: ]|\\text\{([^{}]*)\}|\\mathrm\{([^{}]*)\}|\\left|\\right")


def extract_answer(text: str | None) -> str | None:
    """The final answer of a solution, or None when the text holds none.

    Args:
        text: a model completion or a reference solution.

    Returns:
        the canonical number (``"72"``, ``"-3.5"``, ``"3/4"``), the marked text when it holds no
        number, or None (empty text, no marker and no number).
    """
    if not text:
        return None
    for segment in (_after_last(_FINAL_RE, text), _after_last(_HASHES_RE, text), _boxed(text)):
        if segment is not None:
            answer = _answer_from_segment(segment)
            if answer is not None:
                return answer
    numbers = list(_NUMBER_RE.finditer(text))
    return _canonical(numbers[-1]) if numbers else None


def compare_answers(pred: str | None, truth: str | None, tolerance: float = 1e-6) -> bool:
    """True when `pred` matches `truth`: numerically when both parse as numbers, else as text.

    Args:
        pred: an extracted answer (None never matches).
        truth: the reference answer, e.g. ``"72"``, ``"1,200"``, ``"3/4"``, ``"$5.50"``.
        tolerance: relative and absolute tolerance of the numeric compare.

    Returns:
        whether the answers agree; fractions compare by value (``"3/4"`` == ``"0.75"``) and the
        text fallback ignores case, surrounding whitespace and a trailing period.
    """
    if pred is None or truth is None:
        return False
    p, t = parse_number(pred), parse_number(truth)
    if p is not None and t is not None:
        return math.isclose(p, t, rel_tol=tolerance, abs_tol=tolerance)
    return _normalize_text(pred) == _normalize_text(truth)


def parse_number(text: str) -> float | None:
    """The value of a string that is one number (``"1,200"``, ``"$-3.5"``, ``"25%"``, ``"3/4"``).

    Returns None when the string is anything else, e.g. ``"72 apples"`` or ``"yes"``.
    """
    cleaned = text.strip().rstrip(".").replace("$", "").replace("%", "").strip()
    match = _NUMBER_RE.fullmatch(cleaned)
    if match is None:
        return None
    value = _value(match)
    return None if value is None else float(value)


def has_final_answer(text: str) -> bool:
    """True when the text has a ``Final Answer:`` marker followed by an answer."""
    segment = _after_last(_FINAL_RE, text)
    return segment is not None and _answer_from_segment(segment) is not None


def count_steps(text: str) -> int:
    """The number of reasoning steps in a solution.

    Counts ``Step k:`` markers (at line starts); a text without them counts its non-empty lines,
    leaving out the final-answer line (``Final Answer:`` or ``####``).
    """
    markers = len(_STEP_RE.findall(text))
    if markers:
        return markers
    lines = [line for line in text.splitlines() if line.strip()]
    return sum(1 for line in lines if not (_FINAL_RE.search(line) or "####" in line))


def _after_last(pattern: re.Pattern[str], text: str) -> str | None:
    """The rest of the line after the last match of `pattern` (or the next line if empty)."""
    matches = list(pattern.finditer(text))
    if not matches:
        return None
    rest = text[matches[-1].end() :].lstrip()
    return rest.split("\n", 1)[0]


def _boxed(text: str) -> str | None:
    """The contents of the last ``\\boxed{...}``, with nested braces balanced."""
    starts = [m.end() for m in _BOXED_RE.finditer(text)]
    if not starts:
        return None
    depth, start = 1, starts[-1]
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start:i]
    return text[start:]  # unclosed: take what is there


def _answer_from_segment(segment: str) -> str | None:
    """The answer inside the text a marker points at; None when it is empty."""
    boxed = _boxed(segment)
    if boxed is not None:
        segment = boxed
    segment = _FRAC_RE.sub(r"\1/\2", segment.replace("{,}", ","))
    segment = _LATEX_NOISE_RE.sub(lambda m: m.group(1) or m.group(2) or " ", segment)
    if "=" in segment:  # "5 + 3 = 8" -> "8"
        segment = segment.rsplit("=", 1)[1]
    match = _NUMBER_RE.search(segment)
    if match is not None:
        return _canonical(match)
    text = segment.strip().strip("*$").strip().rstrip(".").strip()
    return text or None


def _value(match: re.Match[str]) -> Fraction | None:
    """The exact value of a number match (None for a zero denominator)."""
    num = Fraction(match.group("num").replace(",", ""))
    if match.group("den") is not None:
        den = int(match.group("den"))
        if den == 0:
            return None
        num /= den
    return -num if match.group("sign") in ("-", "−") else num


def _canonical(match: re.Match[str]) -> str:
    """A number match written canonically: no commas or `$`, no trailing zeros, `-` sign."""
    digits = match.group("num").replace(",", "")
    if "." in digits:
        digits = digits.rstrip("0").rstrip(".")
        whole, _, frac = digits.partition(".")
        digits = str(int(whole or "0")) + (f".{frac}" if frac else "")
    else:
        digits = str(int(digits))
    if match.group("den") is not None:
        digits += f"/{int(match.group('den'))}"
    negative = match.group("sign") in ("-", "−") and digits.strip("0./") != ""
    return f"-{digits}" if negative else digits


def _normalize_text(text: str) -> str:
    """Lower case, single spaces, no trailing period: for the non-numeric fallback compare."""
    return " ".join(text.strip().rstrip(".").lower().split())

"""The built-in math reward functions, each made by a factory that takes its parameters.

Every reward function has the signature ``fn(completions: list[str], **columns) -> list[float]``
with one float per completion. ``columns`` are the dataset columns of the rows (each a list as
long as ``completions``), plus what the trainer adds:

- ``ground_truth`` (list[str]): the reference final answers; needed by every built-in except
  ``format``.
- ``completion_lengths`` (list[int], optional): completion lengths in tokens.

Functions ignore columns they do not use, so any dataset column can reach a custom reward.

| name | reward per completion |
|---|---|
| ``accuracy`` | r_acc = 1 if the extracted answer equals the ground truth (marked, if strict) |
| ``length_penalty`` | r_acc - alpha * max(0, length - target) if correct (floored), else 0 |
| ``step`` | r_acc + beta * min(steps, cap) |
| ``format`` | 1 if the completion ends its reasoning with ``Final Answer: <answer>``, else 0 |
| ``overlong`` | 0, then down to -penalty over the budget's last ``buffer`` tokens (DAPO) |

A function that declares a ``context`` parameter also gets a `RewardContext` (the step, the
completion budget, which completions were truncated, the tokenizer, the device, the precision
policy).

Each declares the bounds its values lie in (`grpo.rewards.bounds`), from its parameters, so
the trainer can tell a solved task from a stalled one: ``accuracy`` and ``format`` [0, 1];
``length_penalty`` [min(0, floor), 1] ([-inf, 1] with floor None); ``step`` [0, 1 + beta *
cap] for beta >= 0, [beta * cap, 1] below (cap None: unbounded on that side).

``combined`` (a weighted sum of other rewards) lives in ``registry.py`` because it resolves its
components by name.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from grpo.errors import GrpoError
from grpo.rewards.bounds import Bounds, reward_bounds, with_bounds
from grpo.rewards.extract import compare_answers, count_steps, extract_answer, has_final_answer

RewardFn = Callable[..., list[float]]


@dataclass(frozen=True)
class RewardContext:
    """What a reward function that declares a ``context`` parameter receives besides the
    columns (``fn(completions, *, context, **columns)``). Outside training (``grpo eval``'s
    average reward, ``grpo tool``) the fields not known there are None.

    Attributes:
        step: training steps completed by the policy that sampled the completions.
        max_new_tokens: the completion budget of the sampling call (rollout.max_new_tokens).
        truncated: per completion, whether it was cut at the budget (no stop token).
        tokenizer: the policy's tokenizer (it decoded the completions).
        device: where the policy runs (a reward model may run there too).
        precision: the run's precision policy (`grpo.precision.Precision`: its `autocast`
            is what a reward model computes under).
    """

    step: int | None = None
    max_new_tokens: int | None = None
    truncated: tuple[bool, ...] | None = None
    tokenizer: Any = None
    device: Any = None
    precision: Any = None

    def select(self, rows: slice) -> RewardContext:
        """The context of some rows (their `truncated` entries)."""
        if self.truncated is None:
            return self
        return dataclasses.replace(self, truncated=self.truncated[rows])


def wants_context(fn: Any) -> bool:
    """Whether a reward function declares a ``context`` parameter (a `NamedReward`'s function,
    a partial and a callable object are looked through)."""
    fn = getattr(fn, "fn", fn)
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # no signature (a builtin)
        return False
    p = params.get("context")
    return p is not None and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)


@dataclass(frozen=True)
class NamedReward:
    """A reward function with the name it is logged under (``rewards/<name>``) and, optionally,
    the most seconds one call may take (``timeout_s``; see `grpo.rewards.compute`)."""

    name: str
    fn: RewardFn
    timeout_s: float | None = None

    def __call__(self, completions: list[str], **columns: Any) -> list[float]:
        return self.fn(completions, **columns)

    @property
    def bounds(self) -> Bounds | None:
        """The bounds its function declares (`grpo.rewards.bounds`), or None (unknown)."""
        return reward_bounds(self.fn)


def make_accuracy(tolerance: float = 1e-6, strict: bool = False) -> RewardFn:
    """1.0 for a completion whose extracted answer equals its ``ground_truth``, else 0.0.

    Args:
        tolerance: relative and absolute tolerance of the numeric compare.
        strict: count only answers marked ``Final Answer:`` (no fallback to the last number
            of the text). Without it a policy can learn to drop the marker and ramble: the
            last number of ``"... = 6 years old old old"`` still scores.
    """

    def accuracy(completions: list[str], **columns: Any) -> list[float]:
        truths = _column(columns, "ground_truth", len(completions))
        return [
            float(
                (not strict or has_final_answer(c))
                and compare_answers(extract_answer(c), str(t), tolerance)
            )
            for c, t in zip(completions, truths)
        ]

    return with_bounds(accuracy, 0.0, 1.0)


def make_length_penalty(
    target: int = 200,
    alpha: float = 0.001,
    tokenizer: Any = None,
    floor: float | None = 0.0,
    tolerance: float = 1e-6,
) -> RewardFn:
    """Accuracy minus a penalty for length beyond `target`, applied to correct answers only.

    reward = r_acc - alpha * max(0, length - target) when correct (e.g. target 200, length 500,
    alpha 0.001 -> 0.7), and 0.0 when wrong. The length is in tokens when the trainer passes
    ``completion_lengths`` or a `tokenizer` is given, otherwise in characters.

    Args:
        target: length allowed without penalty.
        alpha: penalty per unit of length beyond `target`.
        tokenizer: counts tokens when ``completion_lengths`` is absent (optional).
        floor: lower bound of a correct answer's reward, so that a long correct answer never
            scores below a wrong one (default 0.0); None for no bound.
        tolerance: tolerance of the answer compare.
    """
    if target < 0 or alpha < 0:
        raise GrpoError(f"length_penalty: target and alpha must be >= 0, got {target}, {alpha}")

    def length_penalty(completions: list[str], **columns: Any) -> list[float]:
        truths = _column(columns, "ground_truth", len(completions))
        lengths = _lengths(completions, columns.get("completion_lengths"), tokenizer)
        rewards = []
        for c, t, n in zip(completions, truths, lengths):
            if not compare_answers(extract_answer(c), str(t), tolerance):
                rewards.append(0.0)
                continue
            r = 1.0 - alpha * max(0, n - target)
            rewards.append(r if floor is None else max(floor, r))
        return rewards

    # correct: 1 at most (alpha >= 0), down to the floor; wrong: 0
    lo = -math.inf if floor is None else min(0.0, floor)
    return with_bounds(length_penalty, lo, 1.0)


def make_step(beta: float = 0.1, cap: int | None = None, tolerance: float = 1e-6) -> RewardFn:
    """Accuracy plus a bonus per reasoning step: r_acc + beta * min(steps, cap).

    Steps are ``Step k:`` markers, or else the non-empty lines before the final answer (see
    `count_steps`); the bonus applies to wrong answers too (e.g. 3 steps, beta 0.1, correct ->
    1.3; wrong -> 0.3), so set `cap` to bound it.

    Args:
        beta: bonus per step.
        cap: most steps that earn a bonus (None: no cap).
        tolerance: tolerance of the answer compare.
    """
    if cap is not None and cap < 0:
        raise GrpoError(f"step: cap must be >= 0 or None, got {cap}")

    def step(completions: list[str], **columns: Any) -> list[float]:
        truths = _column(columns, "ground_truth", len(completions))
        rewards = []
        for c, t in zip(completions, truths):
            steps = count_steps(c) if cap is None else min(count_steps(c), cap)
            correct = compare_answers(extract_answer(c), str(t), tolerance)
            rewards.append(float(correct) + beta * steps)
        return rewards

    # r_acc in {0, 1} plus beta * steps, steps in [0, cap] (cap None: unbounded)
    most = math.inf if cap is None else cap
    bonus = (0.0, 0.0) if beta == 0 else tuple(sorted((0.0, beta * most)))
    return with_bounds(step, bonus[0], 1.0 + bonus[1])


def make_format() -> RewardFn:
    """1.0 for a completion with a ``Final Answer: <answer>`` line, else 0.0."""

    def format_reward(completions: list[str], **columns: Any) -> list[float]:
        return [float(has_final_answer(c)) for c in completions]

    return with_bounds(format_reward, 0.0, 1.0)


def make_overlong(
    buffer: int | None = None, penalty: float = 1.0, max_length: int | None = None
) -> RewardFn:
    """DAPO's soft overlong punishment: 0 up to ``L_max - buffer`` tokens, then falling
    linearly to ``-penalty`` at ``L_max`` (and ``-penalty`` beyond it):

        r = 0                                        if L <= L_max - buffer
        r = -penalty * (L - (L_max - buffer)) / buffer  if L_max - buffer < L <= L_max
        r = -penalty                                 if L > L_max

    L is the completion's length in tokens (the trainer's ``completion_lengths``), L_max the
    rollout's completion budget (the reward's `context`: rollout.max_new_tokens) unless
    `max_length` is given. Added to a correctness reward it tells a long answer from a cut one
    without the hard cliff of a truncated completion scoring 0 (DAPO, Yu et al. 2025, sec. 3.4).

    Args:
        buffer: the length of the punished zone before L_max (None: a fifth of L_max, DAPO's
            4096 of 20480).
        penalty: the punishment at L_max (>= 0).
        max_length: L_max (None: the context's max_new_tokens).
    """
    if buffer is not None and (
        isinstance(buffer, bool) or not isinstance(buffer, int) or buffer < 1
    ):
        raise GrpoError(f"overlong: buffer must be a whole number of tokens >= 1, got {buffer!r}")
    if not isinstance(penalty, (int, float)) or not math.isfinite(penalty) or penalty < 0:
        raise GrpoError(f"overlong: penalty must be a finite number >= 0, got {penalty!r}")

    def overlong(
        completions: list[str], *, context: RewardContext | None = None, **columns: Any
    ) -> list[float]:
        L_max = max_length if max_length is not None else getattr(context, "max_new_tokens", None)
        if L_max is None:
            raise GrpoError(
                "needs the completion budget: set max_length, or call it from the "
                "trainer (context.max_new_tokens)"
            )
        if columns.get("completion_lengths") is None:
            raise GrpoError("needs the column 'completion_lengths' (token counts)")
        lengths = _lengths(completions, columns["completion_lengths"], None)
        zone = min(buffer if buffer is not None else max(L_max // 5, 1), L_max)
        start = L_max - zone
        out = []
        for n in lengths:
            if n <= start:
                out.append(0.0)
            elif n <= L_max:
                out.append(-penalty * (n - start) / zone)
            else:
                out.append(-float(penalty))
        return out

    return with_bounds(overlong, -float(penalty), 0.0)


def _column(columns: dict[str, Any], name: str, n: int) -> Sequence[Any]:
    """A per-row column, checked to exist and to have one value per completion."""
    if name not in columns:
        have = ", ".join(sorted(columns)) or "none"
        raise GrpoError(f"needs the column {name!r} (columns given: {have})")
    values = columns[name]
    if len(values) != n:
        raise GrpoError(f"column {name!r} has {len(values)} values for {n} completions")
    return values


def _lengths(completions: list[str], lengths: Any, tokenizer: Any) -> list[int]:
    """Token lengths when given or countable with `tokenizer`, else character lengths."""
    if lengths is not None:
        if len(lengths) != len(completions):
            raise GrpoError(
                f"column 'completion_lengths' has {len(lengths)} values "
                f"for {len(completions)} completions"
            )
        return [int(n) for n in lengths]
    if tokenizer is not None:
        return [len(tokenizer.encode(c, add_special_tokens=False)) for c in completions]
    return [len(c) for c in completions]

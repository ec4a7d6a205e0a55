"""Call reward functions on a batch and check what they return.

A reward function that raises, returns the wrong number of values, or returns a value that is
not a finite float is a `GrpoError` naming the function and, where there is one, the row.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from grpo.errors import GrpoError
from grpo.rewards.functions import RewardFn


def reward_name(fn: RewardFn) -> str:
    """The name a reward is logged under: ``.name``, else ``__name__``, else its type."""
    return getattr(fn, "name", None) or getattr(fn, "__name__", None) or type(fn).__name__


def call_reward(
    name: str, fn: RewardFn, completions: list[str], columns: dict[str, Any]
) -> list[float]:
    """Call one reward function and check it returned one finite float per completion.

    Args:
        name: the name used in error messages.
        fn: ``fn(completions, **columns) -> list[float]``.
        completions: B completion texts.
        columns: per-row columns (lists of length B) and any extra keyword arguments.

    Returns:
        B floats.

    Raises:
        GrpoError: naming `name` and the first bad row.
    """
    try:
        values = fn(completions, **columns)
    except Exception as e:
        if getattr(e, "reward_name", None):  # already checked and named (a nested reward)
            raise
        row = _first_failing_row(fn, completions, columns)
        where = "" if row is None else f" at row {row} ({_preview(completions[row])})"
        raise _error(name, f"raised {type(e).__name__}{where}: {e}") from e
    if isinstance(values, torch.Tensor):
        values = values.tolist()
    if not isinstance(values, Sequence) or isinstance(values, str):
        raise _error(name, f"returned {type(values).__name__}, expected a list of floats")
    if len(values) != len(completions):
        raise _error(name, f"returned {len(values)} values for {len(completions)} completions")
    out = []
    for row, value in enumerate(values):
        try:
            value = float(value)
        except (TypeError, ValueError):
            value = None
        if value is None or not math.isfinite(value):
            shown = values[row] if value is None else value
            raise _error(
                name,
                f"returned {shown!r} at row {row} ({_preview(completions[row])}); "
                "expected a finite float",
            )
        out.append(value)
    return out


def compute_rewards(
    fns_with_weights: Sequence[tuple[RewardFn, float]],
    completions: list[str],
    columns: dict[str, Any],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The weighted reward r = sum_k w_k * reward_k(completions, **columns), and each part.

    Args:
        fns_with_weights: (reward function, weight) pairs, e.g. from `build_rewards`.
        completions: B completion texts.
        columns: per-row dataset columns (``ground_truth``, ...) and ``completion_lengths``.

    Returns:
        total: (B,) float32, the weighted sum.
        per_fn: name -> (B,) float32 unweighted rewards; a repeated name gets ``_2``, ``_3``...

    Raises:
        GrpoError: a function raised, returned the wrong length, or a non-finite value.
    """
    if not fns_with_weights:
        raise GrpoError("no reward functions given: configure at least one reward")
    total = torch.zeros(len(completions), dtype=torch.float64)  # (B,)
    per_fn: dict[str, torch.Tensor] = {}
    for fn, weight in fns_with_weights:
        name = base = reward_name(fn)
        k = 1
        while name in per_fn:
            k += 1
            name = f"{base}_{k}"
        values = torch.tensor(call_reward(name, fn, completions, columns), dtype=torch.float64)
        per_fn[name] = values.float()  # (B,)
        total += float(weight) * values
    return total.float(), per_fn


def _first_failing_row(fn: RewardFn, completions: list[str], columns: dict[str, Any]) -> int | None:
    """The first row on which `fn`, called on that row alone, raises; None when no row or
    every row does (the problem is then the batch, e.g. a missing column, not a row)."""
    n = len(completions)
    if n < 2:
        return 0 if n == 1 else None
    first_fail, any_pass = None, False
    for row in range(n):
        one = {k: v[row : row + 1] if _is_per_row(v, n) else v for k, v in columns.items()}
        try:
            fn(completions[row : row + 1], **one)
            any_pass = True
        except Exception:
            first_fail = row if first_fail is None else first_fail
        if first_fail is not None and any_pass:
            return first_fail
    return None


def _is_per_row(value: Any, n: int) -> bool:
    """True for a column holding one value per row (a list, tuple or tensor of length n)."""
    return isinstance(value, (list, tuple, torch.Tensor)) and len(value) == n


def _preview(text: str, limit: int = 60) -> str:
    """A short quoted view of a completion for error messages."""
    text = text if len(text) <= limit else text[: limit - 3] + "..."
    return f"completion {text!r}"


def _error(name: str, what: str) -> GrpoError:
    """A GrpoError about reward `name`, marked so that an enclosing reward does not rewrap it."""
    err = GrpoError(f"reward function {name!r} {what}")
    err.reward_name = name
    return err

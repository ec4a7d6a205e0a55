"""Call reward functions on a batch and check what they return.

A reward function returns one value per completion: a float (the sequence reward), or, for
process rewards, a list of floats with one value per completion token (the trainer passes
``completion_lengths`` and ``completion_ids`` columns to align them). A function that raises,
returns the wrong number of values, or a value that is not a finite float is a `GrpoError`
naming the function and, where there is one, the row.
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
    name: str,
    fn: RewardFn,
    completions: list[str],
    columns: dict[str, Any],
    token_lengths: Sequence[int] | None = None,
) -> list[float | list[float]]:
    """Call one reward function and check it returned one finite value per completion.

    Args:
        name: the name used in error messages.
        fn: ``fn(completions, **columns) -> list[float]`` (or per-token lists).
        completions: B completion texts.
        columns: per-row columns (lists of length B) and any extra keyword arguments.
        token_lengths: B completion lengths in tokens; when given, a row's value may be a list
            of that many floats (token-level rewards). Without it only floats are accepted.

    Returns:
        B floats (or per-token lists of floats).

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
    out: list[float | list[float]] = []
    for row, value in enumerate(values):
        if isinstance(value, torch.Tensor) and value.dim() == 1:
            value = value.tolist()
        if isinstance(value, (list, tuple)):
            out.append(_token_values(name, value, row, completions, token_lengths))
            continue
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
    token_width: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The weighted reward r = sum_k w_k * reward_k(completions, **columns), and each part.

    Args:
        fns_with_weights: (reward function, weight) pairs, e.g. from `build_rewards`.
        completions: B completion texts.
        columns: per-row dataset columns (``ground_truth``, ...) and ``completion_lengths``.
        token_width: T_c; when given (with ``completion_lengths``), functions may return
            per-token lists and the total is token-level.

    Returns:
        total: (B,) float32, the weighted sum; or (B, T_c) when some function returned
            per-token values: those at their tokens, sequence rewards on the row's last token.
        per_fn: name -> (B,) float32 unweighted rewards (per-token ones summed over the row);
            a repeated name gets ``_2``, ``_3``...

    Raises:
        GrpoError: a function raised, returned the wrong length, or a non-finite value.
    """
    if not fns_with_weights:
        raise GrpoError("no reward functions given: configure at least one reward")
    B = len(completions)
    lengths = columns.get("completion_lengths") if token_width is not None else None
    total = torch.zeros(B, dtype=torch.float64)  # (B,)
    tokens = None  # (B, T_c) float64 per-token parts, once a function returns them
    per_fn: dict[str, torch.Tensor] = {}
    for fn, weight in fns_with_weights:
        name = base = reward_name(fn)
        k = 1
        while name in per_fn:
            k += 1
            name = f"{base}_{k}"
        values = call_reward(name, fn, completions, columns, lengths)
        row_sums = []
        for row, v in enumerate(values):
            if isinstance(v, list):
                if tokens is None:
                    tokens = torch.zeros(B, token_width, dtype=torch.float64)
                tokens[row, : len(v)] += float(weight) * torch.tensor(v, dtype=torch.float64)
                row_sums.append(sum(v))
            else:
                total[row] += float(weight) * v
                row_sums.append(v)
        per_fn[name] = torch.tensor(row_sums, dtype=torch.float64).float()  # (B,)
    if tokens is None:
        return total.float(), per_fn
    last = (torch.tensor(lengths) - 1).clamp(min=0)  # (B,) sequence rewards' token
    tokens[torch.arange(B), last] += total
    return tokens.float(), per_fn


def _token_values(name, value, row, completions, token_lengths) -> list[float]:
    """A row's per-token reward list, checked: one finite float per completion token."""
    if token_lengths is None:
        raise _error(name, f"returned a list at row {row}; per-token rewards need the trainer "
                           "(expected one float per completion)")  # fmt: skip
    if len(value) != int(token_lengths[row]):
        raise _error(
            name,
            f"returned {len(value)} per-token values at row {row} for a completion of "
            f"{int(token_lengths[row])} tokens",
        )
    out = []
    for v in value:
        try:
            v = float(v)
        except (TypeError, ValueError):
            v = math.nan
        if not math.isfinite(v):
            raise _error(name, f"returned a non-finite per-token value at row {row}")
        out.append(v)
    return out


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

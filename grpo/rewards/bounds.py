"""Reward bounds: the range [lo, hi] a reward function's values lie in, declared on the function.

A reward that knows its range says so, and the trainer can then tell a solved task (every
completion of every group at the run's highest reward) from a stalled one (equal rewards
anywhere else); see `grpo.run.health` and docs/safety.md, "Learning health". Declare them
with the decorator or on a function a factory returns:

    @bounded(0.0, 1.0)
    def exact(completions, **columns): ...

    def make_mine(cap: int = 3):
        def mine(completions, **columns): ...
        return with_bounds(mine, 0.0, float(cap))

They are stored as the attribute ``fn.bounds = (lo, hi)``, which `reward_bounds` reads (also
through a `NamedReward`, a ``functools.partial`` and a ``functools.wraps`` wrapper). Either
side may be infinite (no bound). A function without the attribute has unknown bounds (None).
`grpo.rewards.compute.call_reward` checks every value a function with bounds returns (a
per-token reward: its row's sum) against them, so a declared bound is never silently wrong.

The run's total reward sum_k w_k * reward_k is bounded by `total_bounds`: sum_k w_k * [lo_k,
hi_k], with the ends swapped for a negative weight.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from grpo.errors import GrpoError

Bounds = tuple[float, float]
F = TypeVar("F", bound=Callable[..., Any])
TOLERANCE = 1e-9  # relative: a value this close past a bound is rounding, not a breach


def check_bounds(lo: Any, hi: Any, name: str = "reward") -> Bounds:
    """(lo, hi) as floats, checked: numbers, not NaN, lo <= hi (either may be infinite).

    Raises:
        GrpoError: naming `name` and the values.
    """
    ok = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (lo, hi))
    if not ok or math.isnan(lo) or math.isnan(hi) or lo > hi:
        raise GrpoError(
            f"{name}: bounds must be two numbers lo <= hi (either may be infinite), "
            f"got ({lo!r}, {hi!r})"
        )
    return float(lo), float(hi)


def with_bounds(fn: F, lo: float, hi: float) -> F:
    """Declare that every value `fn` returns lies in [lo, hi]; returns `fn` itself.

    Args:
        fn: a reward function ``fn(completions, **columns) -> list[float]``.
        lo, hi: the bounds (``-math.inf`` / ``math.inf``: none on that side).
    """
    name = getattr(fn, "__name__", type(fn).__name__)
    checked = check_bounds(lo, hi, f"reward {name!r}")
    try:
        fn.bounds = checked
    except AttributeError:  # a builtin or a class with __slots__: wrap it first
        raise GrpoError(
            f"reward {name!r}: cannot hold bounds (a {type(fn).__name__}); declare "
            "them on a Python function that calls it"
        ) from None
    return fn


def bounded(lo: float, hi: float) -> Callable[[F], F]:
    """Decorator form of `with_bounds`: ``@bounded(0.0, 1.0)`` above a reward function."""
    check_bounds(lo, hi, "bounded")
    return lambda fn: with_bounds(fn, lo, hi)


def reward_bounds(fn: Any) -> Bounds | None:
    """The bounds `fn` declares, or None when it declares none (unknown).

    Looks through a ``functools.partial`` (a plain function with bound keyword arguments), a
    ``functools.wraps`` wrapper and a `NamedReward` (whose ``bounds`` are its function's).
    """
    seen = 0
    while fn is not None and seen < 16:  # a wrapper chain, never a cycle
        declared = getattr(fn, "bounds", None)
        if declared is not None:
            return check_bounds(*declared, name=f"reward {getattr(fn, '__name__', fn)!r}")
        if isinstance(fn, functools.partial):
            fn = fn.func
        else:
            fn = getattr(fn, "__wrapped__", None)
        seen += 1
    return None


def total_bounds(fns_with_weights: Iterable[tuple[Any, float]]) -> Bounds | None:
    """The bounds of sum_k w_k * reward_k: each term w_k * [lo_k, hi_k] (swapped when w_k < 0,
    0 when w_k = 0), added; None when some reward's bounds are unknown.

    Args:
        fns_with_weights: (reward, weight) pairs, e.g. from `grpo.rewards.build_rewards`.
    """
    lo_sum, hi_sum = 0.0, 0.0
    for fn, weight in fns_with_weights:
        b = reward_bounds(fn)
        if b is None:
            return None
        if weight == 0:
            continue  # 0 * inf is NaN; the term is 0 whatever the reward
        lo, hi = (weight * b[0], weight * b[1]) if weight > 0 else (weight * b[1], weight * b[0])
        lo_sum, hi_sum = lo_sum + lo, hi_sum + hi
    return lo_sum, hi_sum


def outside(value: float, bounds: Bounds) -> bool:
    """Whether `value` lies past `bounds` by more than rounding (TOLERANCE, relative)."""
    lo, hi = bounds
    return value < lo - TOLERANCE * max(1.0, abs(lo)) or value > hi + TOLERANCE * max(1.0, abs(hi))

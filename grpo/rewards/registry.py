"""Turn reward specs from configs into named reward functions.

A spec is one of:

- a registered name: ``"accuracy"``, ``"length_penalty"``, ``"step"``, ``"format"``,
  ``"combined"``, ``"overlong"``, ``"judge"`` (`grpo.rewards.judge`), or a name given to
  `register_reward`;
- a callable ``fn(completions, **columns) -> list[float]``;
- a ``"package.module:function"`` path to such a callable;
- a dict ``{"name": <one of the above>, **kwargs}`` with parameters for the factory
  (``{"name": "length_penalty", "target": 100}``) or, for a plain function, keyword
  arguments bound to it; ``"timeout_s": seconds`` (not passed on) limits each call.

Reward lists for the trainer (`build_rewards`) add weights: ``{"accuracy": 1.0,
"length_penalty": {"weight": 0.5, "target": 100}}`` or ``[{"name": "accuracy", "weight": 1.0}]``.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from grpo.errors import GrpoError
from grpo.plugins import import_callable, note_replacement
from grpo.rewards.bounds import total_bounds, with_bounds
from grpo.rewards.compute import call_reward, reward_name
from grpo.rewards.functions import (
    NamedReward,
    RewardContext,
    RewardFn,
    make_accuracy,
    make_format,
    make_length_penalty,
    make_overlong,
    make_step,
)
from grpo.rewards.judge import make_judge
from grpo.rewards.model import make_reward_model

RewardSpec = str | RewardFn | Mapping[str, Any]

# Rewards registered by users: name -> (object, is_factory). Built-ins stay in `_builtins()`.
_REGISTERED: dict[str, tuple[Callable[..., Any], bool]] = {}


def register_reward(
    name: str, fn: Callable[..., Any], *, factory: bool = False, overwrite: bool = False
) -> None:
    """Make `fn` available to configs as `name`.

    Args:
        name: the name configs use (may shadow a built-in only with `overwrite`).
        fn: a reward function ``fn(completions, **columns) -> list[float]``, or with
            ``factory=True`` a factory ``fn(**params) -> reward function``.
        factory: whether `fn` is a factory.
        overwrite: allow replacing an existing name (logged and recorded in the run's
            metadata: `grpo.plugins.note_replacement`).
    """
    if not isinstance(name, str) or not name or ":" in name:
        raise GrpoError(f"reward name must be a non-empty string without ':', got {name!r}")
    if not callable(fn):
        raise GrpoError(f"reward {name!r}: expected a callable, got {type(fn).__name__}")
    if not overwrite and (name in _REGISTERED or name in _builtins()):
        raise GrpoError(f"reward {name!r} is already registered; pass overwrite=True to replace it")
    old = _REGISTERED[name][0] if name in _REGISTERED else _builtins().get(name)
    if old is not None and old is not fn:
        note_replacement("reward", name, old, fn)
    _REGISTERED[name] = (fn, factory)


def available_rewards() -> list[str]:
    """The names `get_reward` accepts (besides callables and module paths)."""
    return sorted(set(_builtins()) | set(_REGISTERED))


def get_reward(spec: RewardSpec) -> NamedReward:
    """Resolve a reward spec (name, callable, ``module:function`` path, or dict) to a function.

    Args:
        spec: see the module docstring.

    Returns:
        a `NamedReward`: callable as ``fn(completions, **columns) -> list[float]``, with ``.name``.

    Raises:
        GrpoError: unknown name (listing the valid ones), a module that fails to import, or
            parameters the reward does not accept.
    """
    if isinstance(spec, NamedReward):
        return spec
    if isinstance(spec, Mapping):
        params = dict(spec)
        if "name" not in params:
            raise GrpoError(f"reward spec {dict(spec)!r} has no 'name'")
        target = params.pop("name")
        params.update(params.pop("kwargs", None) or {})
        timeout_s = params.pop("timeout_s", None)
        reward = _resolve(target, params)
        if timeout_s is None:
            return reward
        return dataclasses.replace(reward, timeout_s=_check_timeout(reward.name, timeout_s))
    return _resolve(spec, {})


def reward_defaults(name: str) -> dict[str, Any]:
    """The parameters a built-in (or registered factory) reward `name` uses when a spec leaves
    them out, read from its factory's signature: ``reward_defaults("step")`` ->
    ``{"beta": 0.1, "cap": None, "tolerance": 1e-6}``. Empty for plain functions."""
    if name in _REGISTERED:
        fn, is_factory = _REGISTERED[name]
        factory = fn if is_factory else None
    else:
        factory = _builtins().get(name)
    if factory is None:
        return {}
    return {
        k: p.default
        for k, p in inspect.signature(factory).parameters.items()
        if p.default is not inspect.Parameter.empty
    }


def build_rewards(spec: Any) -> list[tuple[NamedReward, float]]:
    """(reward, weight) pairs from a config value, ready for `compute_rewards`.

    Args:
        spec: a single spec (weight 1); a mapping ``name -> weight`` or ``name -> {"weight": w,
            **params}``; or a list of specs, where dict specs may carry a ``"weight"``.

    Returns:
        the resolved rewards with their weights, in order.
    """
    if isinstance(spec, str) or callable(spec):
        items: list[tuple[Any, Any]] = [(spec, 1.0)]
    elif isinstance(spec, Mapping) and "name" in spec:
        params = dict(spec)
        items = [(params, params.pop("weight", 1.0))]
    elif isinstance(spec, Mapping):
        items = []
        for name, value in spec.items():
            if isinstance(value, Mapping):
                params = {"name": name, **value}
                items.append((params, params.pop("weight", 1.0)))
            else:
                items.append((name, value))
    elif isinstance(spec, Sequence) and spec:
        items = []
        for entry in spec:
            if isinstance(entry, Mapping):
                params = dict(entry)
                items.append((params, params.pop("weight", 1.0)))
            else:
                items.append((entry, 1.0))
    else:
        raise GrpoError(f"rewards: expected a name, a mapping or a non-empty list, got {spec!r}")
    out = []
    for entry, weight in items:
        reward = get_reward(entry)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)):
            raise GrpoError(f"rewards: weight of {reward.name!r} must be a number, got {weight!r}")
        if not math.isfinite(weight):
            raise GrpoError(f"rewards: weight of {reward.name!r} must be finite, got {weight!r}")
        out.append((reward, float(weight)))
    return out


def make_combined(weights: Any) -> RewardFn:
    """A weighted sum of rewards, e.g. ``make_combined({"accuracy": 1.0, "length_penalty": 0.5})``.

    Args:
        weights: anything `build_rewards` accepts; parameters go with the weight:
            ``{"length_penalty": {"weight": 0.5, "target": 100}}``.

    Returns:
        ``combined(completions, **columns) = sum_k w_k * reward_k(completions, **columns)``;
        each component is checked like a top-level reward and named ``combined/<name>``.
    """
    parts = build_rewards(weights)

    def combined(
        completions: list[str], *, context: RewardContext | None = None, **columns: Any
    ) -> list[float]:
        total = [0.0] * len(completions)
        for fn, weight in parts:
            name = f"combined/{reward_name(fn)}"
            timeout_s = getattr(fn, "timeout_s", None)
            values = call_reward(
                name, fn, completions, columns, timeout_s=timeout_s, context=context
            )
            total = [t + weight * v for t, v in zip(total, values)]
        return total

    bounds = total_bounds(parts)  # known when every part's are
    return with_bounds(combined, *bounds) if bounds is not None else combined


def _check_timeout(name: str, value: Any) -> float:
    """A reward's timeout_s: a finite number of seconds > 0."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or value <= 0:
        raise GrpoError(
            f"rewards: timeout_s of {name!r} must be a number of seconds > 0 (or "
            f"null for no limit), got {value!r}"
        )
    return float(value)


def _builtins() -> dict[str, Callable[..., RewardFn]]:
    """Built-in reward factories by name."""
    return {
        "accuracy": make_accuracy,
        "length_penalty": make_length_penalty,
        "step": make_step,
        "format": make_format,
        "combined": make_combined,
        "overlong": make_overlong,
        "judge": make_judge,
        "reward_model": make_reward_model,
    }


def _resolve(target: Any, params: dict[str, Any]) -> NamedReward:
    """A named reward from a name / path / callable plus parameters."""
    if callable(target):
        name = reward_name(target)
        return NamedReward(name, _bind(name, target, params) if params else target)
    if not isinstance(target, str):
        raise GrpoError(f"reward spec must be a name, a callable or a dict, got {target!r}")
    if target in _REGISTERED:
        fn, is_factory = _REGISTERED[target]
        made = _make(target, fn, params) if is_factory else _bind(target, fn, params)
        return NamedReward(target, made)
    if target in _builtins():
        return NamedReward(target, _make(target, _builtins()[target], params))
    if ":" in target:
        fn = import_callable(target, f"reward {target!r}")
        name = target.rsplit(":", 1)[1]
        return NamedReward(name, _bind(name, fn, params) if params else fn)
    raise GrpoError(
        f"unknown reward {target!r}; valid: {', '.join(available_rewards())} "
        "(or a callable, or a 'package.module:function' path)"
    )


def _make(name: str, factory: Callable[..., Any], params: dict[str, Any]) -> RewardFn:
    """Call a reward factory with `params`, turning a bad parameter into one clear error."""
    signature = inspect.signature(factory)
    try:
        signature.bind(**params)
    except TypeError as e:
        accepted = ", ".join(signature.parameters) or "none"
        raise GrpoError(f"reward {name!r}: {e} (parameters: {accepted})") from None
    fn = factory(**params)
    if not callable(fn):
        raise GrpoError(f"reward {name!r}: factory returned {type(fn).__name__}, not a function")
    return fn


def _bind(name: str, fn: RewardFn, params: dict[str, Any]) -> RewardFn:
    """A plain reward function with keyword arguments bound."""
    if not params:
        return fn
    try:
        inspect.signature(fn).bind_partial(None, **params)
    except TypeError as e:
        raise GrpoError(f"reward {name!r}: {e}") from None
    except ValueError:  # no signature (a builtin): let the call decide
        pass
    return functools.partial(fn, **params)

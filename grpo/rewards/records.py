"""What a run records about its rewards in its header (``run/rewards``, metrics.jsonl's first
record of each start): every reward's name, the name it is logged under, its weight, kwargs,
timeout and function, and whatever the function itself declares through ``run_record`` (the
`reward_model` reward: its checkpoint's path and hash).

A reward function declares extra records with an attribute, looked up like its bounds (through
a `NamedReward`, a ``functools.partial`` and a ``functools.wraps`` wrapper):

    def make_mine(path):
        def mine(completions, **columns): ...
        mine.run_record = lambda: {"table": path, "sha256": file_hash(path)}
        return mine

``run_record()`` is called once, on the main rank, when the run starts; it returns a
JSON-serialisable dict merged into the reward's record.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from typing import Any

from grpo.errors import GrpoError
from grpo.plugins import qualified_name
from grpo.rewards.compute import reward_keys


def declared(fn: Any, attribute: str) -> Any:
    """The value of `attribute` on `fn` or on the function it wraps (a `NamedReward`'s, a
    ``functools.partial``'s, a ``functools.wraps`` wrapper's); None when none declares it."""
    seen = 0
    while fn is not None and seen < 16:  # a wrapper chain, never a cycle
        value = getattr(fn, attribute, None)
        if value is not None:
            return value
        if isinstance(fn, functools.partial):
            fn = fn.func
        else:
            fn = getattr(fn, "fn", None) or getattr(fn, "__wrapped__", None)
        seen += 1
    return None


def reward_records(reward_fns: Sequence[tuple[Any, float]], configs: Sequence[Any] = ()) -> list:
    """One dict per reward of the run, in order: ``name`` (as configured), ``logged_as`` (its
    ``rewards/<name>`` key), ``weight``, ``kwargs``, ``timeout_s``, ``function``
    (``module:qualname``), then what its ``run_record()`` returns.

    Args:
        reward_fns: (reward, weight) pairs (`grpo.rewards.build_rewards`).
        configs: the `RewardConfig` entries they were built from, in the same order (their
            names and kwargs as written); without them the names are the logged ones.

    Raises:
        GrpoError: a ``run_record`` raised or returned something that is not a JSON object.
    """
    out = []
    keys = reward_keys(reward_fns)
    for i, ((fn, weight), key) in enumerate(zip(reward_fns, keys)):
        cfg = configs[i] if i < len(configs) else None
        inner = getattr(fn, "fn", fn)
        record = {
            "name": cfg.name if cfg is not None else key,
            "logged_as": key,
            "weight": float(weight),
            "kwargs": dict(cfg.kwargs) if cfg is not None else {},
            "timeout_s": getattr(fn, "timeout_s", None),
            "function": qualified_name(inner),
        }
        extra = declared(fn, "run_record")
        if extra is not None:
            try:
                made = extra()
                json.dumps(made)
            except GrpoError:
                raise
            except Exception as e:  # a reward's own code: one line naming it
                raise GrpoError(
                    f"reward {key!r}: its run_record() failed: {type(e).__name__}: {e}"
                ) from None
            if not isinstance(made, dict):
                raise GrpoError(
                    f"reward {key!r}: run_record() returned {type(made).__name__}, expected a dict"
                )
            record.update(made)
        out.append(record)
    return out


def rewards_header(reward_fns: Sequence[tuple[Any, float]], configs: Sequence[Any] = ()) -> dict:
    """``{"run/rewards": <JSON list of reward_records>}``, for the run header."""
    return {"run/rewards": json.dumps(reward_records(reward_fns, configs), default=str)}

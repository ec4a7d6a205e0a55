"""The environment protocol and its registry: what answers the policy between turns.

An environment is created per trajectory (a group's G trajectories each get their own, all
started from the same dataset row):

    env = make_env("calculator")          # or "package.module:Class", or a class / factory
    messages = env.start(row)             # None: the row's own rendered prompt
    step = env.step(text, token_ids)      # after each model turn -> Step

`Step.observation` is the message the environment answers with (a dict with "role" and
"content", or a plain string meaning a "tool" message), or None; the sampler renders it with the
chat template's delta (`grpo.tokenizer.message_delta_ids`) and appends it to the row's KV cache.
`Step.reward` is the turn's step reward; `done` ends the trajectory; `info` holds counters
summed over turns; tool_calls and invalid_calls (and the sampler's obs_truncated) are logged as
env/<name>_mean, with env/invalid_call_rate, env/turns_mean and env/turn_limit_frac.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from grpo.errors import GrpoError
from grpo.plugins import import_callable


@dataclass
class Step:
    """An environment's answer to one model turn."""

    observation: str | dict | None = None
    reward: float = 0.0
    done: bool = False
    info: dict = field(default_factory=dict)


@runtime_checkable
class Environment(Protocol):
    """One trajectory's environment.

    Attributes:
        tools: tool schemas (the chat template's ``tools`` format) rendered into the prompt;
            read after start(), which may set them for the row (every trajectory of a group
            renders its first environment's).
    """

    tools: list[dict]

    def start(self, row: dict) -> list[dict] | None:
        """Reset for a new trajectory from a dataset row; return the initial chat messages, or
        None to use the row's own rendered prompt."""
        ...

    def step(self, text: str, token_ids: list[int]) -> Step:
        """The model's turn (its text, stop token left out, and its token ids) -> a `Step`."""
        ...

    # Optional: ``metadata() -> dict[str, str]``, what a run records about the environment in
    # its header (`env_metadata`), e.g. the python environment's sandbox layers.


_REGISTERED: dict[str, Callable[..., Environment]] = {}


def register_env(name: str, cls: Callable[..., Environment], *, overwrite: bool = False) -> None:
    """Make an environment class (or factory) available to configs as ``rollout.env: name``;
    replacing another (`overwrite`) is logged and recorded in the run's metadata
    (`grpo.plugins.note_replacement`)."""
    from grpo.plugins import note_replacement

    if not isinstance(name, str) or not name or ":" in name:
        raise GrpoError(f"environment name must be a non-empty string without ':', got {name!r}")
    old = _REGISTERED.get(name)
    if old is not None and old is not cls:
        if not overwrite:
            raise GrpoError(f"environment {name!r} is already registered; pass overwrite=True")
        note_replacement("environment", name, old, cls)
    _REGISTERED[name] = cls


def available_envs() -> list[str]:
    return sorted(_REGISTERED)


def env_factory(
    spec: str | Callable[..., Environment],
    kwargs: Mapping[str, Any] | None = None,
    key: str = "rollout.env",
) -> Callable[[], Environment]:
    """A zero-argument factory of fresh environments from a name, a path or a class.

    Raises:
        GrpoError: unknown name (listing the registered ones), an import failure, or keyword
            arguments the class does not accept (named, with the field `key`).
    """
    if callable(spec):
        cls = spec
    elif isinstance(spec, str) and spec in _REGISTERED:
        cls = _REGISTERED[spec]
    elif isinstance(spec, str) and ":" in spec:
        cls = import_callable(spec, f"{key}: {spec!r}")
    else:
        raise GrpoError(
            f"{key}: unknown environment {spec!r}; registered: {', '.join(available_envs())} "
            "(or a 'package.module:Class' path)"
        )
    kwargs = dict(kwargs or {})
    try:
        inspect.signature(cls).bind(**kwargs)
    except TypeError as e:
        raise GrpoError(f"{key}_kwargs: {e} (environment {spec!r})") from None
    except ValueError:
        pass
    return lambda: cls(**kwargs)


def env_metadata(make_env: Callable[[], Environment], prefix: str = "run/env_") -> dict[str, str]:
    """What a run records about its environment, made once at the start of the run (so that
    its arguments and what it needs from the machine are checked before anything is written):
    the environment's optional ``metadata()`` (name -> string), keys prefixed with `prefix`."""
    env = make_env()
    describe = getattr(env, "metadata", None)
    if not callable(describe):
        return {}
    return {f"{prefix}{k}": str(v) for k, v in describe().items()}


def check_step(name: str, step: Any) -> Step:
    """The environment's return value, checked: one line naming the environment otherwise."""
    if not isinstance(step, Step):
        raise GrpoError(
            f"environment {name!r}: step() returned {type(step).__name__}, expected a "
            "grpo.envs.Step"
        )
    obs = step.observation
    if obs is not None and not isinstance(obs, str):
        ok = isinstance(obs, dict) and isinstance(obs.get("content"), str) and obs.get("role")
        if not ok:
            raise GrpoError(
                f"environment {name!r}: observation must be a string or a message dict with "
                f"'role' and 'content', got {obs!r:.80}"
            )
    try:
        reward = float(step.reward)
    except (TypeError, ValueError):
        reward = float("nan")
    if reward != reward or reward in (float("inf"), float("-inf")):
        raise GrpoError(
            f"environment {name!r}: step reward must be a finite number, got {step.reward!r}"
        )
    return step


def question_messages(row: dict, system_prompt: str | None, use_template_tools: bool):
    """`start()` of a tool environment: with `use_template_tools`, the messages [system
    (optional), user question], so the chat template renders the environment's tools; else
    None (the row's own rendered prompt)."""
    if not use_template_tools:
        return None
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return messages + [{"role": "user", "content": row["question"]}]


class SingleTurn:
    """Today's behaviour as an environment: one model turn, no observation."""

    tools: list[dict] = []

    def start(self, row: dict) -> None:
        return None

    def step(self, text: str, token_ids: list[int]) -> Step:
        return Step(done=True)


register_env("single_turn", SingleTurn)

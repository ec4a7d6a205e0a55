"""The environment check: a class (or factory) against the `grpo.envs.Environment` protocol,
as the multi-turn sampler uses it (a fresh instance per trajectory, one prompt per group)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from grpo.envs import check_step, env_factory
from grpo.testing.conformance import expect, run_checks, spec_name

ENV_ROWS = ({"question": "What is 2 * 3?", "ground_truth": "6", "prompt_ids": [1]},)
ENV_TEXTS = (
    "Final Answer: 6",
    '<tool_call>{"name": "calculator", "arguments": {"expression": "2 * 3"}}</tool_call>',
    "<tool_call>{oops",
    "\x00 \n",
    "",
)


def environment_checks(spec: Any = None) -> list[str]:
    """The checks of an environment (the same for every one)."""
    return ["fresh_instances", "start", "steps"]


def check_environment(
    spec: str | Callable,
    *,
    rows: Iterable[Mapping] = ENV_ROWS,
    texts: Iterable[str] = ENV_TEXTS,
    kwargs: Mapping | None = None,
    checks: Iterable[str] | None = None,
) -> None:
    """Check an environment (a registered name, ``package.module:Class`` or the class) against
    `grpo.envs.Environment`; raises ConformanceError naming the failed check.

    Args:
        rows: dataset rows to start trajectories from (your environment's row format).
        texts: model turns to answer, garbage included: step() must answer each (a `Step`
            passing `check_step`, numeric info), never raise.
        kwargs: ``rollout.env_kwargs`` for the class.
        checks: default all: fresh_instances (a new object per trajectory, a list of tool
            schema dicts), start (None or messages with role and content, the same for every
            instance from one row: a group shares one prompt), steps.
    """
    rows, texts = [dict(r) for r in rows], list(texts)
    make = env_factory(spec, kwargs)

    def fresh_instances():
        a, b = make(), make()
        expect(a is not b, "the factory returned the same object twice")
        for env in (a, b):
            tools = env.tools
            expect(
                isinstance(tools, list) and all(isinstance(t, dict) for t in tools),
                f"tools must be a list of schema dicts, got {tools!r:.80}",
            )

    def start():
        for row in rows:
            first, second = make().start(dict(row)), make().start(dict(row))
            ok = first is None or (
                isinstance(first, list)
                and all(
                    isinstance(m, dict) and m.get("role") and isinstance(m.get("content"), str)
                    for m in first
                )
            )
            expect(
                ok,
                f"start() must return None or a list of messages with 'role' and "
                f"'content', got {first!r:.80}",
            )
            expect(first == second, "start() from the same row differs between instances")

    def steps():
        for row in rows:
            for text in texts:
                env = make()
                env.start(dict(row))
                step = check_step(spec_name(spec), env.step(text, [1, 2, 3]))
                bad = {
                    k: v
                    for k, v in step.info.items()
                    if not isinstance(v, (int, float)) or not math.isfinite(v)
                }
                expect(not bad, f"info values must be finite numbers (summed over turns): {bad}")

    table = {"fresh_instances": fresh_instances, "start": start, "steps": steps}
    run_checks("environment", spec, table, environment_checks(spec) if checks is None else checks)

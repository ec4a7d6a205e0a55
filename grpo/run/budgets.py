"""Token budgets: the new tokens a run may add to a prompt, and the setting that names each.

The checks (`grpo.run.preflight`), the memory estimate (`grpo.run.memory`) and the start
notices (`grpo.run.notices`) all size a run by these.
"""

from __future__ import annotations

from dataclasses import dataclass

from grpo.config import Config, default_total_tokens


@dataclass(frozen=True)
class Evaluation:
    """One kind of evaluation a run does: its token budget and rows per sampler call."""

    budget: int
    rows: int
    field: str  # the setting to name when the budget does not fit


def eval_budget(cfg: Config, with_env: bool) -> int:
    """New tokens an evaluation may add to a prompt: eval.max_new_tokens (default
    rollout.max_new_tokens), or with a multi-turn environment the trajectory's budget."""
    n = cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens
    env = cfg.eval.env or cfg.rollout.env
    if not with_env or env == "single_turn":
        return n
    r = cfg.rollout
    return r.max_total_tokens or default_total_tokens(n, r.max_turns, r.max_obs_tokens)


def rollout_budget(cfg: Config, kind: str) -> tuple[str, int]:
    """(field, new tokens per prompt) of the training data: GRPO's rollout budget, SFT's
    completion limit."""
    r = cfg.rollout
    if kind == "sft" or not r.multi_turn:
        return "rollout.max_new_tokens", r.max_new_tokens
    if r.max_total_tokens is not None:
        return "rollout.max_total_tokens", r.max_total_tokens
    return f"rollout.max_new_tokens (x rollout.max_turns {r.max_turns} + observations)", (
        r.total_tokens
    )

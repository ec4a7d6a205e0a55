"""Rewards for math reasoning: answer extraction, built-in reward functions, a registry.

Reward functions have the signature ``fn(completions: list[str], **columns) -> list[float]``;
see `grpo.rewards.functions` for the columns and `grpo.rewards.registry` for specs.
"""

from grpo.rewards.bounds import bounded, reward_bounds, total_bounds, with_bounds
from grpo.rewards.compute import call_reward, compute_rewards, reward_name
from grpo.rewards.extract import (
    compare_answers,
    count_steps,
    extract_answer,
    has_final_answer,
    parse_number,
)
from grpo.rewards.functions import (
    NamedReward,
    RewardContext,
    RewardFn,
    make_accuracy,
    make_format,
    make_length_penalty,
    make_overlong,
    make_step,
    wants_context,
)
from grpo.rewards.registry import (
    available_rewards,
    build_rewards,
    get_reward,
    make_combined,
    register_reward,
    reward_defaults,
)

__all__ = [
    "NamedReward",
    "RewardContext",
    "RewardFn",
    "available_rewards",
    "bounded",
    "build_rewards",
    "call_reward",
    "compare_answers",
    "compute_rewards",
    "count_steps",
    "extract_answer",
    "get_reward",
    "has_final_answer",
    "make_accuracy",
    "make_combined",
    "make_format",
    "make_length_penalty",
    "make_overlong",
    "make_step",
    "parse_number",
    "register_reward",
    "reward_bounds",
    "reward_defaults",
    "reward_name",
    "total_bounds",
    "wants_context",
    "with_bounds",
]

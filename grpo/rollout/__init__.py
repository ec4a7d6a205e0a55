"""Rollouts: pure logits processing (`sampling`), prompt batching (`prompts`), the batched
sampler and its public steps (`sampler`), its decode weights (`decode_weights`) and continuous
refill (`refill`); multi-turn rollouts build on them (`multiturn`), and continuations of
partial completions (`extend`)."""

from grpo.rollout.prompts import check_prompts, check_settings, left_pad
from grpo.rollout.sampler import Observation, Rollout, Sampler, TokenConstraint, sample
from grpo.rollout.sampling import (
    apply_min_p,
    apply_temperature,
    apply_top_k,
    apply_top_p,
    next_tokens,
    process_logits,
    row_uniforms,
)

__all__ = [
    "Observation",
    "Rollout",
    "Sampler",
    "TokenConstraint",
    "apply_min_p",
    "apply_temperature",
    "apply_top_k",
    "apply_top_p",
    "check_prompts",
    "check_settings",
    "left_pad",
    "next_tokens",
    "process_logits",
    "row_uniforms",
    "sample",
]

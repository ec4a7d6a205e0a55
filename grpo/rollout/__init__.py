"""Rollout sampling: pure logits processing (`sampling`) and the batched sampler (`sampler`)."""

from grpo.rollout.sampler import Rollout, Sampler, sample
from grpo.rollout.sampling import (
    apply_min_p,
    apply_temperature,
    apply_top_k,
    apply_top_p,
    next_tokens,
    process_logits,
)

__all__ = [
    "Rollout",
    "Sampler",
    "apply_min_p",
    "apply_temperature",
    "apply_top_k",
    "apply_top_p",
    "next_tokens",
    "process_logits",
    "sample",
]

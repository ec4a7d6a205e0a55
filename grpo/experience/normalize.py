"""Reward normalisation over the step's global batch: a reward that declares
``global_normalize`` (the `reward_model` reward with ``normalize: global``) returns raw scores,
and the trainer replaces them, once the step's batch is complete, by (r - mean) / std over every
row that any trainer rank trains on this step (each rank's kept groups of all its sampling
rounds), computed in float64 with the ranks' sums all-reduced (two passes: the mean, then the
squared deviations). std is the unbiased one (N - 1), as ``normalize: batch`` uses; a std at or
below 1e-6 divides by 1, and a batch of one row is left as it is.

The normalised values replace the reward's ``per_fn`` entry, and the total reward and the token
rewards change by weight * (normalised - raw) on the tokens a sequence reward goes to (the
row's last completion token; multi-turn: its last generated token, scaled by the discount
gamma^(K-1) of its K turns), so ``rewards`` stays ``token_rewards`` summed.

Declare it on a reward function (looked up through a `NamedReward`, a ``functools.partial`` or
a ``functools.wraps`` wrapper, like ``bounds``):

    def mine(completions, **columns): ...   # raw scores
    mine.global_normalize = True
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch

from grpo.distributed import SINGLE, all_reduce_sum_dict
from grpo.experience.batch import RolloutBatch
from grpo.rewards.compute import reward_keys
from grpo.rewards.records import declared

MIN_STD = 1e-6  # as `normalize: batch`: a flatter batch is centred, not scaled


def global_keys(reward_fns: Sequence[tuple[object, float]]) -> list[tuple[str, float]]:
    """(per_fn key, weight) of each reward that declares ``global_normalize``."""
    keys = reward_keys(reward_fns)
    return [
        (k, float(w)) for (fn, w), k in zip(reward_fns, keys) if declared(fn, "global_normalize")
    ]


def normalize_globally(
    batch: RolloutBatch,
    reward_fns: Sequence[tuple[object, float]],
    dist=SINGLE,
    turn_discount: float = 1.0,
) -> RolloutBatch:
    """`batch` (this rank's rows of the step) with each ``global_normalize`` reward normalised
    over the rows of every rank of `dist` (module docstring). Collective when `dist` has
    several ranks: every rank calls it, with the same rewards. No such reward: `batch` itself.

    Args:
        batch: the step's batch on this rank, B rows (``per_fn`` holds each reward's raw (B,)).
        reward_fns: the run's (reward, weight) pairs (`grpo.rewards.build_rewards`).
        dist: the trainer ranks.
        turn_discount: rollout.turn_discount (multi-turn rows' outcome scaling).
    """
    chosen = global_keys(reward_fns)
    if not chosen:
        return batch
    raw = {k: batch.per_fn[k].detach().double().cpu() for k, _ in chosen}  # (B,) each
    sums = {f"{k}/n": float(v.numel()) for k, v in raw.items()}
    sums |= {f"{k}/sum": float(v.sum()) for k, v in raw.items()}
    sums = all_reduce_sum_dict(sums, dist)
    means = {k: sums[f"{k}/sum"] / max(sums[f"{k}/n"], 1.0) for k in raw}
    squares = all_reduce_sum_dict(
        {k: float(((v - means[k]) ** 2).sum()) for k, v in raw.items()}, dist
    )
    dev = batch.rewards.device
    delta = torch.zeros(batch.size, dtype=torch.float64)  # (B,) the total reward's change
    per_fn = dict(batch.per_fn)
    for key, weight in chosen:
        n = sums[f"{key}/n"]
        if n < 2:
            continue
        std = math.sqrt(squares[key] / (n - 1))
        values = (raw[key] - means[key]) / (std if std > MIN_STD else 1.0)
        delta += weight * (values - raw[key])
        per_fn[key] = values.to(dev, torch.float32)
    tokens = _outcome_tokens(delta, batch, turn_discount).to(dev)
    return dataclasses.replace(
        batch,
        per_fn=per_fn,
        rewards=(batch.rewards.double() + delta.to(dev)).float(),
        token_rewards=(batch.token_rewards.double() + tokens).float(),
    )


def _outcome_tokens(delta: torch.Tensor, batch: RolloutBatch, gamma: float) -> torch.Tensor:
    """(B, T_c) float64: each row's `delta` where a sequence reward goes (module docstring)."""
    r = batch.rollout
    if r.turn_rewards is None:  # as `outcome_token_rewards`, in float64
        mask = r.completion_mask.cpu()
        out = torch.zeros(mask.shape, dtype=torch.float64)
        if mask.shape[1]:
            last = (mask.long().sum(-1) - 1).clamp(min=0)  # (B,)
            out[torch.arange(mask.shape[0]), last] = delta
        return out
    generated = r.generated_mask.cpu()
    out = torch.zeros(generated.shape, dtype=torch.float64)
    cols = torch.arange(generated.shape[1])
    for b, steps in enumerate(r.turn_rewards):
        if generated[b].any():
            K = max(len(steps), 1)
            out[b, int(cols[generated[b]].max())] = gamma ** (K - 1) * float(delta[b])
    return out

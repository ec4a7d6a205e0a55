"""The rollout phase of a GRPO step: prompts -> sampled completions -> scores, as one
`RolloutBatch`.

    rollout_phase  the step's batch: draws prompts in lockstep with the other ranks, has the
                   configured rollout strategy (`grpo.experience.strategies`: by default
                   `sample_round` then `score_rollout`) sample and score each rank's share
                   and, with rollout.dynamic_sampling, refills groups that carry no signal
    rollout_batches  the same for several trainer ranks at once (what a rollout producer
                   samples for the trainers it serves)

`sample_round` and `score_rollout` live in `grpo.experience.strategies` (re-exported here).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from grpo.algo.advantages import zero_std_groups
from grpo.config import Config
from grpo.distributed import SINGLE, all_reduce_sum
from grpo.experience.batch import (
    RolloutBatch,
    cat_batches,
    derive_seed,
    next_prompts,
)
from grpo.experience.strategies import (  # noqa: F401  (sample_round, score_rollout: re-exported)
    Sampling,
    run_strategy,
    sample_round,
    score_rollout,
)
from grpo.experience.strategy_state import StrategyState
from grpo.metrics import Max, Sum, reduction, tagged
from grpo.rewards.bounds import total_bounds

if TYPE_CHECKING:
    from grpo.policy import Policy


def rollout_phase(
    cfg: Config,
    policy: Policy,
    sampler,
    rows,
    state,
    reward_fns,
    step: int,
    dist=SINGLE,
    make_env=None,
    strategy_state: StrategyState | None = None,
) -> RolloutBatch:
    """Sample G completions for P prompts and score them (advantages come later).

    With rollout.dynamic_sampling, groups whose rewards are all equal (no signal) are dropped and
    new prompts sampled in up to rollout.max_sampling_rounds rounds; if still short, dropped
    groups fill the batch so its size stays fixed (kept groups first, in the order sampled).

    Under DDP every rank walks the same global prompt order and takes its own slice of each
    draw (a group never spans ranks); sampler seeds come from (seed, rank, step, round).

    Args:
        step: training steps completed (the batch's policy_version).
        strategy_state: this rank's state of a strategy that keeps one (`keeps_state`).
    """
    show = cfg.train.progress and dist.is_main  # a bar when a sampling call runs long
    states = {dist.rank: strategy_state} if strategy_state is not None else None
    return rollout_batches(
        cfg,
        policy,
        sampler,
        rows,
        state,
        reward_fns,
        step,
        [dist.rank],
        dist.world_size,
        dist,
        make_env,
        show=show,
        strategy_states=states,
    )[0]


def rollout_batches(
    cfg: Config,
    policy: Policy,
    sampler,
    rows,
    state,
    reward_fns,
    step: int,
    ranks: Sequence[int],
    world: int,
    lockstep=SINGLE,
    make_env=None,
    policy_version: int | None = None,
    show: bool = False,
    strategy_states: dict[int, StrategyState] | None = None,
) -> list[RolloutBatch]:
    """`rollout_phase` for the trainer ranks `ranks` of a job of `world` trainer ranks, one
    batch each: what each of those ranks would sample for itself, bitwise (same prompts, same
    seeds, the same dynamic-sampling rounds). A rollout producer (grpo.experience.producer) calls it
    for the trainer ranks it serves; `lockstep` holds every process that samples for some of
    the `world` ranks (the trainer job itself, or the producer ranks), so all end their
    dynamic-sampling rounds together.

    Args:
        step: the batch index (training steps completed before the step that consumes it):
            it picks the sampler seeds.
        policy_version: updates the sampling policy had seen (default: `step`, synchronous).
        show: a progress bar of each sampling call that runs long (`sample_round`).
        strategy_states: trainer rank -> its `StrategyState` (a strategy that keeps state).
    """
    G = cfg.rollout.group_size
    P = cfg.train.batch_size // G
    version = step if policy_version is None else policy_version
    bounds = None if cfg.rollout.multi_turn else total_bounds(reward_fns)  # all right / wrong
    rounds: dict[int, list[RolloutBatch]] = {t: [] for t in ranks}
    kept: dict[int, list[tuple[int, int]]] = {t: [] for t in ranks}  # (round, group)
    spare: dict[int, list[tuple[int, int]]] = {t: [] for t in ranks}
    n_rounds = cfg.rollout.max_sampling_rounds if cfg.rollout.dynamic_sampling else 1
    for round_ in range(n_rounds):
        # every rank draws P prompts per round (so all advance the data order alike) and
        # samples the ones it still needs
        drawn = next_prompts(state, len(rows), P * world, cfg.train.seed)
        for t in ranks:
            idx = drawn[t * P : (t + 1) * P][: P - len(kept[t])]
            if not idx:  # this rank is full, others may not be: stay in lockstep
                continue
            seed = derive_seed(cfg.train.seed, t, step, round_)
            picked = [rows[i] for i in idx]
            sampling = Sampling(cfg, policy, sampler, reward_fns, make_env, seed, version, show)
            kept_state = strategy_states[t] if strategy_states is not None else None
            batch = run_strategy(cfg, sampling, picked, t, round_, kept_state)  # rollout.strategy
            dynamic = cfg.rollout.dynamic_sampling
            zero = zero_std_groups(batch.rewards, G).tolist() if dynamic else None
            for p in range(len(idx)):
                (spare[t] if zero is not None and zero[p] else kept[t]).append((len(rounds[t]), p))
            rounds[t].append(batch)
        short = sum(float(len(kept[t]) < P) for t in ranks)
        if all_reduce_sum(short, lockstep) == 0:
            break
    return [
        _join_rounds(rounds[t], (kept[t] + spare[t])[:P], policy.tokenizer, round_, bounds)
        for t in ranks
    ]


def sampling_metrics(
    rounds: list[RolloutBatch],
    batch: RolloutBatch,
    refills: int,
    bounds: tuple[float, float] | None,
) -> dict[str, float]:
    """What a step's sampling did, summed over ranks (`grpo.metrics.Sum`): groups sampled in
    all rounds, groups with signal (unequal rewards) in the batch trained on, sampling rounds
    after the first (`Max`: the ranks run them in lockstep), and, when the rewards declare
    bounds, the sampled groups whose every completion got the highest (`groups_all_right`) or
    the lowest (`groups_all_wrong`) total reward."""
    G = rounds[0].rollout.group_size
    sampled = sum(b.size // G for b in rounds)
    kept = int((~zero_std_groups(batch.rewards, G)).sum())
    out = {
        "rollout/groups_sampled": Sum(sampled),
        "rollout/groups_kept": Sum(kept),
        "rollout/refill_rounds": Max(refills),
    }
    if bounds is not None:
        r = torch.cat([b.rewards for b in rounds]).double().view(-1, G)  # (groups, G)
        for name, bound in (("all_right", bounds[1]), ("all_wrong", bounds[0])):
            if math.isfinite(bound):  # an unbounded side has no such group
                at = (r - bound).abs() <= 1e-6 * max(1.0, abs(bound))  # float32 totals
                out[f"rollout/groups_{name}"] = Sum(int(at.all(1).sum()))
    return out


def round_metrics(rounds: list[RolloutBatch]) -> dict[str, float]:
    """What the reward functions reported over all of a step's sampling rounds: sums added,
    maxima and minima taken, means weighted by the rows of each round."""
    out = {}
    for k, first in rounds[0].metrics.items():
        values = [(b.metrics[k], b.size) for b in rounds if k in b.metrics]
        op = reduction(first)
        if op == "mean":
            out[k] = sum(float(v) * n for v, n in values) / sum(n for _, n in values)
        else:
            pick = {"sum": sum, "max": max, "min": min}[op]
            out[k] = tagged(pick(float(v) for v, _ in values), op)
    return out


def _join_rounds(
    rounds: list[RolloutBatch], order: list[tuple[int, int]], tokenizer, last_round: int, bounds
) -> RolloutBatch:
    """One rank's batch: the groups `order` [(round, group), ...] of its sampling rounds, and
    its `sampling_metrics` (`last_round`: the lockstep's last round)."""
    G = rounds[0].rollout.group_size
    if len(rounds) == 1 and order == [(0, p) for p in range(rounds[0].size // G)]:
        batch = rounds[0]  # every group of the one round, in order: nothing to re-join
    else:  # runs of groups of the same round, in order
        runs: list[tuple[int, list[int]]] = []
        for r, g in order:
            if runs and runs[-1][0] == r:
                runs[-1][1].append(g)
            else:
                runs.append((r, [g]))
        batch = cat_batches([rounds[r].select_groups(gs) for r, gs in runs], tokenizer.pad_token_id)
    # the step's statistic is the first round's (what the policy gave before any refill)
    metrics = {**round_metrics(rounds), **sampling_metrics(rounds, batch, last_round, bounds)}
    return dataclasses.replace(batch, frac_zero_std=rounds[0].frac_zero_std, metrics=metrics)

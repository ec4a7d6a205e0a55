"""Where a GRPO step's rollouts come from: the trainer asks a rollout source for the batch of
each step (`source.next(state)`) and tells it about each update (`source.published`). One
schedule, three placements, picked by `rollout_source` from the config:

    InlineRollouts     rollout.async: off (grpo/experience/inline.py). The trainer samples the
                       step's batch itself, with the current weights: `rollout_phase`
                       (grpo/experience/collect.py) runs the rollout strategy
                       (grpo/experience/strategies.py) over the step's prompts.
    ColocatedRollouts  rollout.async: on, rollout.ranks: 0 (grpo/experience/producer.py). A
                       producer thread in the trainer's process samples ahead on its own copy
                       of the policy, refreshed after updates.
    RemoteRollouts     rollout.async: on, rollout.ranks: R (grpo/experience/producer.py). The
                       last R ranks of the torchrun job only sample (`run_producer`).

The asynchronous schedule and its guarantees are producer.py's docstring (docs/async.md).
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as td

from grpo.config import Config
from grpo.distributed import SINGLE, Dist, Roles
from grpo.experience.inline import InlineRollouts, RolloutSource, make_sampler
from grpo.experience.producer import ColocatedRollouts, RemoteRollouts
from grpo.policy import Policy
from grpo.run.state import TrainState


def rollout_source(
    cfg: Config,
    policy: Policy,
    rows,
    reward_fns,
    make_env,
    state: TrainState,
    dist=SINGLE,
    sharded: bool = False,
    roles: Roles | None = None,
    strategy_state=None,
) -> RolloutSource:
    """The rollout source a run's config asks for (see the module docstring). `strategy_state`:
    this rank's `StrategyState` of a strategy that keeps one (synchronous rollouts only)."""
    if not cfg.rollout.asynchronous:
        sampler = make_sampler(cfg, policy, policy.model, sharded)
        return InlineRollouts(
            cfg, policy, sampler, rows, reward_fns, make_env, dist, sharded, strategy_state
        )
    if roles is not None:
        return RemoteRollouts(cfg, policy, rows, roles, state)
    lockstep = SINGLE
    if dist.enabled:  # the producer threads' own group, apart from the trainers' collectives
        wait = max(cfg.rollout.async_timeout_s, cfg.train.dist_timeout_s)  # as split_roles
        group = td.new_group(
            list(range(dist.world_size)), backend="gloo", timeout=datetime.timedelta(seconds=wait)
        )
        lockstep = Dist(dist.rank, dist.world_size, dist.local_rank, torch.device("cpu"), group)

    def thread_sampler(model):
        return make_sampler(cfg, policy, model, producer_thread=True)

    return ColocatedRollouts(
        cfg, policy, thread_sampler, rows, reward_fns, make_env, state, dist, lockstep
    )

"""Rollout strategies: how one sampling round of a step turns its prompts into a scored batch.

A strategy is one function, selected by ``rollout.strategy`` (a registered name or a
``package.module:function``) with ``rollout.strategy_kwargs``:

    @register_rollout_strategy("two_temperatures")
    def two_temperatures(rows, sampling, *, low=0.6, high=1.2):
        G = sampling.group_size
        cold = sampling.sample(rows, group_size=G // 2, temperature=low)
        hot = sampling.sample(rows, group_size=G - G // 2, temperature=high)
        return sampling.score(sampling.join_groups([cold, hot]), rows)

It receives the round's P dataset rows (`rows`, each with ``prompt_ids``) and a `Sampling`
handle, and returns a `RolloutBatch` of P groups of ``rollout.group_size`` rows (a group's
rows adjacent, in the order of `rows`); the trainer checks that shape. Inputs by name, as the
algorithm's registries pass them: `rows`, `sampling`, `step` (updates the sampling policy
had), `rank` (the trainer rank the batch is for), `round` (the dynamic-sampling round), plus
its kwargs. Dynamic sampling (rollout.dynamic_sampling), the advantages and the update apply to
what it returns as to the default strategy's batch, under DDP and the asynchronous producer
alike (each rank, or the producer for it, calls the strategy for its own rows).

The default strategy is ``sampling.score(sampling.sample(rows), rows)``: G completions per row
(or G trajectories with the configured environment) at the config's settings (`sample_round`),
scored by the configured rewards (`score_rollout`, the one place rewards change device and
dtype: every tensor of the batch is float32 on the rollout's device from there on).

Log-probs: a rollout's log-probs are those of the settings that sampled it (its temperature).
The trainer scores every row at ``rollout.temperature``, so rows drawn at another temperature
are off-policy by construction and the importance ratio (clipped) corrects for it.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from grpo.algo.advantages import zero_std_groups
from grpo.algo.registry import Registry
from grpo.envs import Environment, env_factory
from grpo.errors import GrpoError
from grpo.experience.batch import (
    RolloutBatch,
    cat_batches,
    cat_rollouts,
    derive_seed,
    outcome_token_rewards,
    select_rows,
    turn_token_rewards,
)
from grpo.metrics import Sum, split_metrics
from grpo.plugins import time_limit
from grpo.precision import Precision
from grpo.rewards import NamedReward, RewardContext, compute_rewards
from grpo.rollout import Rollout, Sampler
from grpo.rollout.multiturn import sample_with_env, turn_end_ids
from grpo.run.perf import phase_bar

if TYPE_CHECKING:
    from grpo.config import Config
    from grpo.policy import Policy

ROLLOUT_STRATEGIES = Registry("rollout strategy", "rollout.strategy")
INPUTS = ("rows", "sampling", "step", "rank", "round")
SETTINGS = ("temperature", "top_k", "top_p", "min_p", "max_new_tokens")


def register_rollout_strategy(name: str, *, overwrite: bool = False):
    """Decorator: a rollout strategy selectable as ``rollout.strategy: name`` (module doc)."""
    return ROLLOUT_STRATEGIES.register(name, overwrite=overwrite)


def check_strategy(name: str, params: dict | None = None) -> None:
    """Fail early on an unknown strategy or a parameter it does not take (naming the field)."""
    ROLLOUT_STRATEGIES.check_params(name, params or {}, set(INPUTS))


def sample_round(
    cfg: Config,
    policy: Policy,
    sampler,
    rows: list[dict],
    seed: int,
    make_env=None,
    show: bool = False,
):
    """One sampling call: G completions per row (single turn), or G trajectories per row
    with the configured environment (multi-turn). The sampler holds the policy's precision
    (the trainer's autocast and float32 head). `show`: a progress bar of its decode steps
    (environment steps) when the call runs long (`grpo.run.perf.phase_bar`)."""
    c = cfg.rollout
    sampling = {
        "temperature": c.temperature,
        "top_k": c.top_k,
        "top_p": c.top_p,
        "min_p": c.min_p,
        "seed": seed,
        "pad_id": policy.tokenizer.pad_token_id,
        "stop_ids": policy.stop_ids,
    }
    B = len(rows) * c.group_size
    if not c.multi_turn:
        with phase_bar(show, f"rollout ({B} rows)", c.max_new_tokens, "tok") as bar:

            def counted(t: int, tokens: torch.Tensor) -> torch.Tensor:  # the draw unchanged
                bar.update(1)
                return tokens

            return sampler.sample(
                [r["prompt_ids"] for r in rows],
                group_size=c.group_size,
                max_new_tokens=c.max_new_tokens,
                on_step=counted if show else None,
                **sampling,
            )
    with phase_bar(show, f"rollout ({B} trajectories)", B * c.max_turns, "env step") as bar:
        return sample_with_env(
            sampler,
            policy.tokenizer,
            rows,
            make_env or env_factory(c.env, c.env_kwargs),
            env_name=c.env,
            group_size=c.group_size,
            max_new_tokens=c.max_new_tokens,
            max_turns=c.max_turns,
            max_total_tokens=c.total_tokens,
            max_obs_tokens=c.max_obs_tokens,
            step_timeout_s=c.env_timeout_s,
            turn_end_ids=turn_end_ids(policy.tokenizer, c.turn_end_tokens),
            progress=bar.update if show else None,
            **sampling,
        )


def score_rollout(
    cfg: Config, rollout: Rollout, rows: list[dict], tokenizer, reward_fns, policy_version: int
) -> RolloutBatch:
    """Score a rollout of P prompts x G rows with the reward functions.

    Args:
        cfg: the run config (rollout.turn_discount discounts multi-turn step rewards).
        rollout: B = P*G rows.
        rows: the P dataset rows sampled (their columns reach the reward functions).
        tokenizer: decodes the completions the rewards read.
        reward_fns: (function, weight) pairs (`grpo.rewards.build_rewards`).
        policy_version: training steps the sampling policy had completed.

    Returns:
        the `RolloutBatch`; frac_zero_std is that of this rollout's groups.
    """
    G = rollout.group_size
    brows = [r for r in rows for _ in range(G)]
    texts = rollout.decode(tokenizer, skip_special_tokens=True)
    columns = {k: [r[k] for r in brows] for k in brows[0] if k != "prompt_ids"}
    lengths = rollout.completion_lens.tolist()
    columns["completion_lengths"] = lengths
    columns["completion_ids"] = [
        ids[:n] for ids, n in zip(rollout.completion_ids.tolist(), lengths)
    ]
    if rollout.turn_texts is not None:  # multi-turn: what the trajectory did
        columns["num_turns"] = [len(t) for t in rollout.turn_texts]
        columns["env_info"] = rollout.infos
    T_c = rollout.completion_ids.shape[1]
    context = RewardContext(
        step=policy_version,
        max_new_tokens=cfg.rollout.max_new_tokens,
        truncated=tuple(not f for f in rollout.finished.tolist()),
        tokenizer=tokenizer,
        device=rollout.ids.device,
        precision=Precision.from_config(cfg.model, training=False),
    )
    reported: dict[str, float] = {}  # what the reward functions reported
    t0 = time.perf_counter()
    total, per_fn = compute_rewards(reward_fns, texts, columns, T_c, context, reported)
    # seconds the rewards took (a reward model's forwards, a judge's requests): summed over a
    # step's sampling rounds and over ranks
    reported["perf/reward_s"] = Sum(time.perf_counter() - t0)
    if rollout.turn_rewards is not None:  # step rewards and the discounted return
        tokens = turn_token_rewards(total, rollout, cfg.rollout.turn_discount)
        total = tokens.sum(-1)
    elif total.dim() == 1:  # (B,) sequence rewards -> on each row's last token
        tokens = outcome_token_rewards(total, rollout.completion_mask)
    else:  # (B, T_c) some rewards per token
        tokens, total = total, total.sum(-1)
    dev = rollout.ids.device
    zero = zero_std_groups(total, G)  # (P,)
    return RolloutBatch(
        rollout=rollout,
        rows=brows,
        texts=texts,
        rewards=total.to(dev, torch.float32),
        token_rewards=tokens.to(dev, torch.float32),
        per_fn={k: v.to(dev, torch.float32) for k, v in per_fn.items()},
        policy_version=policy_version,
        frac_zero_std=float(zero.float().mean()),
        metrics=reported,
    )


@dataclasses.dataclass
class Sampling:
    """What a strategy samples and scores with, for one round of one rank's step.

    Fields: `cfg` the run's config; `policy` the policy being trained (its tokenizer, model
    and precision); `sampler` the rollout sampler over the policy's model; `reward_fns` the
    (reward, weight) pairs of `rewards:`; `make_env` the environment factory of a
    multi-turn run (None: `rollout.env`); `seed` this round's seed; `step` below.

    Attributes:
        group_size: G, the rows per group the returned batch must have (rollout.group_size).
        settings: the config's sampling settings (temperature, top_k, top_p, min_p,
            max_new_tokens); `sample` overrides any of them per call.
        step: updates the sampling policy had (the batch's policy_version).
        tokenizer: the policy's tokenizer.
    """

    cfg: Config
    policy: Policy
    sampler: Sampler
    reward_fns: list[tuple[NamedReward, float]]  # (reward, weight): `build_rewards`
    make_env: Callable[[], Environment] | None  # None: rollout.env (multi-turn)
    seed: int
    step: int
    show: bool = False
    calls: int = 0

    @property
    def group_size(self) -> int:
        return self.cfg.rollout.group_size

    @property
    def settings(self) -> dict:
        r = self.cfg.rollout
        return {k: getattr(r, k) for k in SETTINGS}

    @property
    def tokenizer(self):
        return self.policy.tokenizer

    def sample(
        self,
        rows: Sequence[dict],
        *,
        group_size: int | None = None,
        seed: int | None = None,
        **settings,
    ) -> Rollout:
        """`group_size` completions (default G) of each row, adjacent, in the order of `rows`:
        one sampler call (multi-turn: trajectories with the configured environment). Settings
        not given are the config's. Each call draws from its own seed: the round's seed for
        the first call (the default strategy is the plain rollout, bitwise), then seeds derived
        from it; `seed` sets one."""
        unknown = sorted(set(settings) - set(SETTINGS))
        if unknown:
            raise GrpoError(
                f"Sampling.sample: unknown settings {unknown}; settings: {', '.join(SETTINGS)}"
            )
        if seed is None:
            seed = self.seed if self.calls == 0 else derive_seed(self.seed, self.calls)
        self.calls += 1
        r, cfg = self.cfg.rollout, self.cfg
        changed = {k: v for k, v in settings.items() if getattr(r, k) != v}
        if group_size not in (None, r.group_size):
            changed["group_size"] = group_size
        if changed:  # the config's own settings need no new config (the default strategy)
            cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(r, **changed))
        return sample_round(
            cfg, self.policy, self.sampler, list(rows), seed, self.make_env, self.show
        )

    def score(self, rollout: Rollout, rows: Sequence[dict]) -> RolloutBatch:
        """The rollout scored by the configured rewards (their context: this step, the
        config's completion budget): a `RolloutBatch` (group size: the rollout's)."""
        return score_rollout(
            self.cfg, rollout, list(rows), self.tokenizer, self.reward_fns, self.step
        )

    def join_groups(self, parts: Sequence[Rollout]) -> Rollout:
        """Rollouts of the same rows (groups of g_1, g_2, ... rows) as one rollout with groups
        of g_1 + g_2 + ... rows: each row's completions from every part, adjacent."""
        P = len(parts[0].ids) // parts[0].group_size
        if any(len(p.ids) // p.group_size != P for p in parts):
            raise GrpoError("Sampling.join_groups: the rollouts are not of the same rows")
        joined = cat_rollouts(list(parts), self.tokenizer.pad_token_id)
        offsets, start = [], 0
        for p in parts:
            offsets.append(start)
            start += len(p.ids)
        order = [
            off + q * p.group_size + j
            for q in range(P)
            for p, off in zip(parts, offsets)
            for j in range(p.group_size)
        ]
        G = sum(p.group_size for p in parts)
        out = select_rows(joined, torch.tensor(order, dtype=torch.long))
        return dataclasses.replace(out, group_size=G)

    def cat(self, batches: Sequence[RolloutBatch]) -> RolloutBatch:
        """Scored batches of the same group size, one after the other (the first one's
        metrics)."""
        if len({b.rollout.group_size for b in batches}) > 1:
            raise GrpoError("Sampling.cat: the batches have different group sizes")
        return cat_batches(list(batches), self.tokenizer.pad_token_id)

    def keep(self, batch: RolloutBatch, rows: Sequence[int], group_size: int) -> RolloutBatch:
        """The batch restricted to `rows` (indices, a new group every `group_size` of them):
        e.g. the best G of each group of k * G. Scores go with their rows."""
        if len(rows) % group_size:
            raise GrpoError(f"Sampling.keep: {len(rows)} rows do not make groups of {group_size}")
        out = batch.select_rows(rows)
        return dataclasses.replace(
            out, rollout=dataclasses.replace(out.rollout, group_size=group_size)
        )


@register_rollout_strategy("default")
def default(rows, sampling: Sampling) -> RolloutBatch:
    """G completions of each row at the config's settings, scored by the configured rewards."""
    return sampling.score(sampling.sample(rows), rows)


def run_strategy(cfg, sampling: Sampling, rows: list[dict], rank: int, round_: int):
    """The configured strategy's batch for `rows`, checked: P groups of G rows, in order, and
    rewards the update can train on (`check_rewards`). The strategy gets its own copy of the
    rows (as a reward does): what it changes in them never reaches the dataset."""
    r = cfg.rollout
    inputs = {
        "rows": copy.deepcopy(rows),
        "sampling": sampling,
        "step": sampling.step,
        "rank": rank,
        "round": round_,
        **(r.strategy_kwargs or {}),
    }
    name = r.strategy
    with time_limit(f"rollout strategy {name!r}", cfg.train.plugin_timeout_s):
        batch = ROLLOUT_STRATEGIES.call(r.strategy, inputs)
    if not isinstance(batch, RolloutBatch):
        raise GrpoError(
            f"rollout strategy {name!r} returned {type(batch).__name__}, expected a "
            "RolloutBatch (Sampling.score)"
        )
    G, want = r.group_size, len(rows) * r.group_size
    if batch.rollout.group_size != G or batch.size != want:
        raise GrpoError(
            f"rollout strategy {name!r} returned {batch.size} rows in groups of "
            f"{batch.rollout.group_size}; expected {len(rows)} groups of "
            f"rollout.group_size={G} ({want} rows)"
        )
    check_rewards(batch, f"rollout strategy {name!r}")
    batch = dataclasses.replace(batch, metrics=check_metrics(batch.metrics, name))
    # the dataset's own rows again (each prompt's, G times, in order, as checked above): later
    # stages and a producer rank's wire format name rows by identity, and edits stay behind
    return dataclasses.replace(batch, rows=[rows[i // G] for i in range(batch.size)])


def check_metrics(metrics, name: str) -> dict:
    """A strategy's `batch.metrics`, checked before they are merged over rounds and ranks:
    a dict of string names to finite numbers (`Sum` / `Max` / `Min` keep their type; a
    one-element tensor is read), else one line naming the strategy and the metric key
    (`grpo.metrics.split_metrics`'s rule, the rewards' own)."""
    who = f"rollout strategy {name!r}"
    if not isinstance(metrics, dict):
        raise GrpoError(
            f"{who} returned a batch whose metrics are a {type(metrics).__name__}, not a dict "
            "of names to numbers"
        )
    return split_metrics((None, metrics), who)[1]


def check_rewards(batch: RolloutBatch, who: str) -> None:
    """What the update trains on is what is logged: `batch.rewards` (B,) must be finite and
    equal to `batch.token_rewards` (B, T_c) summed over tokens (the update reads the token
    rewards; `Sampling.score` sets both), else a GrpoError naming `who` and the first row.
    Checked on the host (one copy of each, per sampling round)."""
    rewards = batch.rewards.detach().double().cpu()
    tokens = batch.token_rewards.detach().double().cpu()
    if rewards.shape != (batch.size,) or tokens.dim() != 2 or tokens.shape[0] != batch.size:
        raise GrpoError(
            f"{who}: rewards {tuple(rewards.shape)} and token_rewards {tuple(tokens.shape)}; "
            f"expected ({batch.size},) and ({batch.size}, T_c)"
        )
    summed = tokens.sum(-1)
    finite = torch.isfinite(rewards) & torch.isfinite(tokens).all(-1)
    # the built-in path sums in float32: 1e-5 of the largest reward covers its rounding
    scale = 1.0 + float(rewards.abs().nan_to_num(0, 0, 0).max()) if batch.size else 1.0
    agree = (rewards - summed).abs() <= 1e-5 * scale
    bad = (~(finite & agree)).nonzero()
    if len(bad):
        i = int(bad[0])
        what = "is not finite" if not bool(finite[i]) else "differs from token_rewards summed"
        raise GrpoError(
            f"{who}: the reward of row {i} ({float(rewards[i]):g}, token rewards summing to "
            f"{float(summed[i]):g}) {what}; the update trains on token_rewards, so set both "
            "(Sampling.score computes them together) and keep them finite"
        )

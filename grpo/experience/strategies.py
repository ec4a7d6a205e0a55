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
had), `rank` (the trainer rank the batch is for), `round` (the dynamic-sampling round),
`state` (below), plus its kwargs. Dynamic sampling (rollout.dynamic_sampling), the
advantages and the update apply to what it returns as to the default strategy's batch, under
DDP and the asynchronous producer alike (each rank, or the producer for it, calls the strategy
for its own rows).

The default strategy is ``sampling.score(sampling.sample(rows), rows)``: G completions per row
(or G trajectories with the configured environment) at the config's settings (`sample_round`),
scored by the configured rewards (`score_rollout`, the one place rewards change device and
dtype: every tensor of the batch is float32 on the rollout's device from there on).
`sampling.extend` continues prompts plus partial completions (tree rollouts,
`grpo.rollout.extend`).

State: a strategy that declares `state` gets its rank's `StrategyState`
(grpo/experience/strategy_state.py), the same object every step and round, saved with each
checkpoint and restored on ``--resume`` (synchronous rollouts only: `check_strategy`).

Replay: rows a strategy did not sample for this round's prompts (groups of earlier steps) are
marked in the per-row extra ``replayed``, bool (B,), whole groups (`replayed_groups`). Such a
group keeps its own rows; the fresh groups, in order, get the first prompts handed over. The
update logs the truncated importance weights by row kind (`grpo.algo.losses.tis_by_kind`).

Log-probs: a rollout's log-probs are those of the settings that sampled it (its temperature).
The trainer scores every row at ``rollout.temperature``, so rows drawn at another temperature
are off-policy by construction and the importance ratio (clipped) corrects for it.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from grpo.algo.advantages import zero_std_groups
from grpo.algo.registry import Registry, _signature
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
from grpo.experience.strategy_state import StrategyState
from grpo.metrics import Sum, split_metrics
from grpo.plugins import qualified_name, time_limit
from grpo.precision import Precision
from grpo.rewards import NamedReward, RewardContext, compute_rewards
from grpo.rollout import Rollout, Sampler
from grpo.rollout.extend import extend
from grpo.rollout.multiturn import sample_with_env, turn_end_ids
from grpo.run.perf import phase_bar

if TYPE_CHECKING:
    from grpo.config import Config
    from grpo.policy import Policy

ROLLOUT_STRATEGIES = Registry("rollout strategy", "rollout.strategy")
INPUTS = ("rows", "sampling", "step", "rank", "round", "state")
REPLAYED = "replayed"  # the per-row extra marking rows a strategy replayed (module doc)
SETTINGS = ("temperature", "top_k", "top_p", "min_p", "max_new_tokens")


def register_rollout_strategy(name: str, *, overwrite: bool = False):
    """Decorator: a rollout strategy selectable as ``rollout.strategy: name`` (module doc)."""
    return ROLLOUT_STRATEGIES.register(name, overwrite=overwrite)


def check_strategy(name: str, params: dict | None = None, asynchronous: bool = False) -> None:
    """Fail early on an unknown strategy or a parameter it does not take (naming the field),
    and on a strategy that keeps state (`keeps_state`) with asynchronous rollouts, whose
    producers sample ahead of the checkpoint that would save it."""
    ROLLOUT_STRATEGIES.check_params(name, params or {}, set(INPUTS))
    if asynchronous and keeps_state(name):
        raise GrpoError(
            f"rollout.strategy: {name!r} keeps state across steps (it declares `state`), "
            "which asynchronous rollouts do not save; set rollout.async=off"
        )


def keeps_state(name: str) -> bool:
    """Whether strategy `name` declares a `state` input (it keeps state across steps,
    saved with each checkpoint: `grpo.experience.strategy_state`)."""
    sig = _signature(ROLLOUT_STRATEGIES.get(name))
    return sig is not None and "state" in sig.parameters


def strategy_record(cfg: Config) -> str:
    """The run header's ``run/rollout_strategy``: JSON ``{"name", "kwargs", "function"}``
    (rollout.strategy, rollout.strategy_kwargs, the function's ``module:qualname``)."""
    r = cfg.rollout
    fn = qualified_name(ROLLOUT_STRATEGIES.get(r.strategy))
    record = {"name": r.strategy, "kwargs": dict(r.strategy_kwargs or {}), "function": fn}
    return json.dumps(record, default=str)


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

    def extend(
        self,
        rows: Sequence[dict],
        partials: Sequence[Sequence[int]],
        *,
        group_size: int | None = None,
        include_partial: bool = False,
        seed: int | None = None,
        **settings,
    ) -> Rollout:
        """`group_size` continuations (default G) of each row's prompt followed by its partial
        completion (`partials[i]` continues `rows[i]`; repeat a row to branch it from several
        partials), adjacent, in order: one sampler call (`grpo.rollout.extend`), each context
        prefilled once. Settings and seeds as `sample`; `max_new_tokens` bounds the whole
        completion, partial included. `include_partial` False: the partial is context
        (`completion_mask` and the rewards cover only the continuation); True: the completion
        is partial + continuation, all of it trained on and scored, the partial's log-probs
        computed as the trainer does (rows of several partials of one prompt then share the
        prompt and may form one group). Single-turn runs only.

        Returns:
            a `Rollout` of len(rows) * group_size rows, in groups of group_size."""
        unknown = sorted(set(settings) - set(SETTINGS))
        if unknown:
            raise GrpoError(
                f"Sampling.extend: unknown settings {unknown}; settings: {', '.join(SETTINGS)}"
            )
        if self.cfg.rollout.multi_turn:
            raise GrpoError(
                "Sampling.extend continues single-turn completions; this run is multi-turn "
                "(rollout.multi_turn)"
            )
        if seed is None:
            seed = self.seed if self.calls == 0 else derive_seed(self.seed, self.calls)
        self.calls += 1
        s = {**self.settings, **settings}
        return extend(
            self.sampler,
            [r["prompt_ids"] for r in rows],
            partials,
            group_size=self.group_size if group_size is None else group_size,
            include_partial=include_partial,
            seed=seed,
            pad_id=self.tokenizer.pad_token_id,
            stop_ids=self.policy.stop_ids,
            **s,
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


def run_strategy(
    cfg,
    sampling: Sampling,
    rows: list[dict],
    rank: int,
    round_: int,
    state: StrategyState | None = None,
):
    """The configured strategy's batch for `rows`, checked: P groups of G rows, in order, and
    rewards the update can train on (`check_rewards`). The strategy gets its own copy of the
    rows (as a reward does): what it changes in them never reaches the dataset. `state`: this
    rank's `StrategyState`, for a strategy that declares it (`keeps_state`)."""
    r = cfg.rollout
    inputs = {
        "rows": copy.deepcopy(rows),
        "sampling": sampling,
        "step": sampling.step,
        "rank": rank,
        "round": round_,
        **(r.strategy_kwargs or {}),
    }
    if state is not None:
        inputs["state"] = state
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
    replayed = replayed_groups(batch, f"rollout strategy {name!r}")
    check_prompts(batch, rows, replayed, f"rollout strategy {name!r}", multi_turn=r.multi_turn)
    if cfg.shared_prefix_groups is not None:
        check_shared_prompts(batch.rollout, f"rollout strategy {name!r}")
    # the dataset's own rows again (each prompt's, G times, in order, as checked above): later
    # stages and a producer rank's wire format name rows by identity, and edits stay behind.
    # A replayed group keeps the rows it was sampled for; the fresh groups, in order, are
    # those of the first prompts given.
    fresh = iter(rows)
    own = [batch.rows[g * G : (g + 1) * G] if old else [next(fresh)] * G for g, old in replayed]
    return dataclasses.replace(batch, rows=[row for group in own for row in group])


def replayed_groups(batch: RolloutBatch, who: str) -> list[tuple[int, bool]]:
    """(group, whether it is replayed) for each group of the batch, from its ``replayed``
    extra (bool (B,), the same within a group; absent: nothing replayed), checked (a
    GrpoError naming `who`)."""
    G = batch.rollout.group_size
    mark = batch.extras.get(REPLAYED)
    if mark is None:
        return [(g, False) for g in range(batch.size // G)]
    if mark.dtype != torch.bool or mark.shape != (batch.size,):
        raise GrpoError(
            f"{who}: extras[{REPLAYED!r}] is {mark.dtype} {tuple(mark.shape)}; expected bool "
            f"({batch.size},), True on the rows of replayed groups"
        )
    per_group = mark.detach().cpu().view(-1, G)
    mixed = (per_group.any(1) & ~per_group.all(1)).nonzero()
    if len(mixed):
        raise GrpoError(
            f"{who}: extras[{REPLAYED!r}] marks part of group {int(mixed[0])}; a group is "
            "replayed whole (its advantages compare its own rows)"
        )
    return list(enumerate(per_group[:, 0].tolist()))


def check_shared_prompts(rollout: Rollout, who: str) -> None:
    """Each group's rows hold one prompt (ids and length), as the training passes assume when
    they run it once per group (train.shared_prefix); else a GrpoError naming `who`, the
    group and the remedies. One comparison on the rollout's device, one host sync."""
    G, T_p = rollout.group_size, rollout.prompt_width
    ids = rollout.prompt_ids.reshape(-1, G, T_p)  # (P, G, T_p)
    lens = rollout.prompt_lens.reshape(-1, G)  # (P, G)
    same = (ids == ids[:, :1]).all(-1).all(-1) & (lens == lens[:, :1]).all(-1)  # (P,)
    bad = (~same).nonzero()
    if len(bad):
        raise GrpoError(
            f"{who}: the rows of group {int(bad[0])} do not share one prompt, but "
            "train.shared_prefix runs each group's prompt once; keep each group's prompt "
            "(Sampling.extend(include_partial=True) keeps partials in the completion) or set "
            "train.shared_prefix: off"
        )


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


def check_prompts(
    batch: RolloutBatch,
    rows: Sequence[dict],
    replayed: Sequence[tuple[int, bool]],
    who: str,
    multi_turn: bool,
) -> None:
    """Each fresh group answers the row it stands for (the fresh groups, in order, stand for
    the first rows given; a replayed group, `replayed_groups`, keeps its own): the rows it was
    scored with, and (single turn) the prompt tokens it was sampled from, begin with that row's
    ``prompt_ids`` (a strategy may append to a prompt, e.g. a hint or a partial answer, but
    not answer another row), else a GrpoError naming `who`, the group and the row its prompt
    came from. One host copy of the prompt columns per sampling round."""
    G = batch.rollout.group_size
    want = [list(r["prompt_ids"]) for r in rows]
    got_rows = [list(r.get("prompt_ids", ())) for r in batch.rows]
    got_tokens = None
    if not multi_turn:
        ro = batch.rollout
        ids, lens = ro.ids[:, : ro.prompt_width].tolist(), ro.prompt_lens.tolist()
        got_tokens = [row[ro.prompt_width - n :] for row, n in zip(ids, lens)]
    fresh = 0
    for g, old in replayed:
        if old:
            continue
        p, k = want[fresh], fresh
        fresh += 1
        for i in range(g * G, (g + 1) * G):
            for what, got in (("scored with", got_rows), ("sampled from", got_tokens)):
                if got is None or got[i][: len(p)] == p:
                    continue
                other = next((q for q, w in enumerate(want) if got[i][: len(w)] == w), None)
                whose = f"row {other}'s" if other is not None else "a prompt that is no row's"
                raise GrpoError(
                    f"{who}: group {g} (row {i}) was {what} {whose} prompt, not row {k}'s; "
                    "return one group per row it was given, in the order of `rows`"
                )

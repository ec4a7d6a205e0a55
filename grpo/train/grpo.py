"""The GRPO recipe (PPO too, with a critic among the trained modules). Each step runs four
numbered stages (`_train`'s loop), each a function from plain values to plain values (the
frozen dataclasses of grpo/experience/batch.py), and each naming the file that does it:

    1. rollout                  batch = source.next(state)                  grpo/experience/
         rows, sampler, rewards -> RolloutBatch: sources.py picks the source (inline.py samples
         in the step; producer.py ahead, asynchronously), collect.py runs the rollout
         strategy (strategies.py) over the step's prompts; balance.py evens tokens over
         ranks; the trained modules (grpo/modules/) attach their values
    2. reference and advantages step_batch(...)                              this file
         counted_mask, micro_batch_plan (grpo/experience/batch.py), reference_phase,
         advantage_phase (the estimator: grpo/algo/advantages.py, over the global batch),
         old_logprobs_phase -> UpdateBatch
    3. update                   update_phase(...)                            this file
         loss.num_iterations passes of the policy loss (grpo/algo/losses.py) over the
         micro-batches -> train/* metrics; then the trained modules' own steps
    4. the run's tail           run.end_of_step(...)                         grpo/run/loop.py
         learning health (grpo/run/health.py), evaluation, logging, the guards (a stop saves
         what it can first: `Run.guard_stop`), the checkpoint; shared with SFT and the reward
         model

Reference log-probs come before advantages so that an estimator can put the KL into the
reward (REINFORCE++). A `RolloutBatch` carries everything the later stages read (tokens, masks,
the sampler's log-probs, scores, the policy version that sampled it), so it could come from
another rank or an earlier step. Shapes: P prompts per step, G completions per prompt,
B = P*G rows, T_c completion tokens.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable

import torch
from tqdm.auto import tqdm

from grpo.algo.advantages import (
    EstimatorRollout,
    check_estimator,
    compute_advantages,
    wants_rollout,
)
from grpo.algo.kl import reward_minus_kl
from grpo.algo.logprobs import CompletionLogprobs
from grpo.algo.losses import (
    check_bad_row,
    check_policy_loss,
    loss_normalizer,
    policy_loss_on_device,
)
from grpo.algo.registry import POLICY_LOSSES
from grpo.checks import check_config
from grpo.config import Config
from grpo.distributed import (
    SINGLE,
    Roles,
    Where,
    all_gather_cat,
    all_reduce_max,
    all_reduce_mean_dict,
    all_reduce_sum,
    all_reduce_sum_dict,
    clip_grad_norm,
    describe_parallel,
    device_for,
    no_sync,
    rank_local,
    wrap_ddp,
)
from grpo.envs import env_factory, env_metadata
from grpo.errors import GrpoError
from grpo.eval import eval_env_settings, evaluate_policy
from grpo.experience.balance import balance_ranks
from grpo.experience.batch import (
    MicroBatch,
    RolloutBatch,
    UpdateBatch,
    counted_mask,
)
from grpo.experience.inline import make_sampler
from grpo.experience.normalize import normalize_globally
from grpo.experience.producer import run_producer
from grpo.experience.scoring import micro_logprobs, step_plan
from grpo.experience.sources import rollout_source
from grpo.experience.strategies import REPLAYED, keeps_state, strategy_record
from grpo.experience.strategy_state import StrategyState
from grpo.loading import load_rows, resolve_device
from grpo.lora import disabled_lora
from grpo.modules.module_set import ModuleSet
from grpo.policy import Policy, build_policy, shard_policy
from grpo.rewards import build_rewards
from grpo.rewards.bounds import total_bounds
from grpo.rewards.records import rewards_header
from grpo.rollout import Rollout
from grpo.run.health import LearningHealth, StallError, WeightChange
from grpo.run.loop import GuardStop, RunDir, run_training, start_run
from grpo.run.notices import start_notices
from grpo.run.optim import nonfinite_weights_error, weights_finite
from grpo.run.perf import StepClock, phase_bar
from grpo.run.preflight import check_prompt_room, preflight
from grpo.run.state import seed_everything
from grpo.run.stats import (
    OnPolicyCheck,
    StatSums,
    advantage_stats,
    check_first_pass,
    first_pass_gap_limit,
    reduce_metrics,
    rollout_metrics,
)

log = logging.getLogger(__name__)


# what the non-finite guard's stop (train.max_nonfinite_steps) says to change
HINT = "Lower optim.lr or check the rewards"


class NonfiniteWeights(GuardStop):
    """An update left a trainable weight NaN or inf (on some rank; every rank raises it at the
    same update): the run stops without saving that state (`grpo.run.loop.Run.unsaved_stop`)."""


def step_batch(
    cfg: Config, policy: Policy, batch: RolloutBatch, dist=SINGLE, step: int | None = None
) -> UpdateBatch:
    """The phases between rollout and update: what the loss counts, the micro-batch plan,
    reference log-probs (on the steps that measure the KL), advantages over the global batch,
    and pi_old recomputed by the trainer (when configured)."""
    mask = counted_mask(batch.rollout, cfg.loss.mask_truncated_completions)
    plan = step_plan(cfg, policy, batch.rollout, mask, dist)
    show = cfg.train.progress and dist.is_main  # bars of the passes that run long
    ref = reference_phase(cfg, policy, batch.rollout, mask, plan, step, show=show)
    reported: dict[str, float] = {}  # what the estimator reported (the same on every rank)
    returned: dict[str, torch.Tensor] = {}  # the extras it returned for the loss (this rank's)
    advantages = advantage_phase(cfg, batch, ref, dist, step, metrics=reported, extras=returned)
    old = old_logprobs_phase(cfg, policy, batch.rollout, mask, plan, show=show)
    return UpdateBatch(
        batch.rollout,
        mask,
        advantages,
        plan,
        ref_logprobs=ref,
        old_logprobs=old,
        metrics=reported,
        extras=loss_extras(cfg, batch, returned, step),
    )


def loss_extras(
    cfg: Config, batch: RolloutBatch, returned: dict[str, torch.Tensor], step: int | None = None
) -> dict[str, torch.Tensor]:
    """The extras the policy loss reads: the batch's (rollout strategy, trained modules) and
    those the estimator returned; a name both hold is refused (neither would win silently)."""
    both = sorted(set(batch.extras) & set(returned))
    if both:
        where = f"step {step}: " if step is not None else ""
        raise GrpoError(
            f"{where}advantage estimator {cfg.loss.advantage!r} returned the extra {both[0]!r}, "
            "which the batch already holds (from the rollout strategy or a trained module)"
        )
    return {**batch.extras, **returned}


def each_micro_batch(plan: tuple[MicroBatch, ...], show: bool, desc: str):
    """The micro-batches of a pass, with a progress bar when there are several and the pass
    runs long (`grpo.run.perf.phase_bar`; `show`: train.progress on rank 0)."""
    with phase_bar(show and len(plan) > 1, desc, len(plan), "micro-batch") as bar:
        for mb in plan:
            yield mb
            bar.update(1)


def advantage_phase(
    cfg: Config,
    batch: RolloutBatch,
    ref_logprobs: torch.Tensor | None = None,
    dist=SINGLE,
    step: int | None = None,
    metrics: dict | None = None,
    extras: dict | None = None,
) -> torch.Tensor:
    """(B, T_c) advantages from the configured estimator over the *global* batch.

    Token rewards (minus loss.kl_in_reward * KL_t when set, which needs `ref_logprobs`) of
    every rank are gathered, padded to the longest completion, so that batch statistics
    (batch_std, reinforce_pp, ...) are those of the combined batch; each rank keeps its rows.
    Only the generated tokens count (observations are not actions). An estimator that
    declares `rollout` also gets the sampled tokens and the batch's extras, gathered alike
    (`EstimatorRollout`); what it reports goes into `metrics` (``advantage/<name>``), the
    extras it returns for the policy loss into `extras` (this rank's rows, (B,) or (B, T_c)).
    """
    r = batch.rollout
    mask = r.generated_mask
    # REINFORCE++, classic PPO: KL(pi_old || ref) per token in the reward (loss.kl_in_reward)
    token_rewards = reward_minus_kl(batch.token_rewards, r.logprobs, ref_logprobs, mask, cfg.loss)
    try:
        return global_advantages(
            cfg, token_rewards, mask, dist, r.turn_ids, batch, metrics, step, extras
        )
    except GrpoError as e:
        raise GrpoError(f"step {step}: {e}" if step is not None else str(e)) from None


def global_advantages(
    cfg: Config,
    token_rewards,
    mask,
    dist=SINGLE,
    turn_ids=None,
    batch: RolloutBatch | None = None,
    metrics: dict | None = None,
    step: int | None = None,
    extras: dict | None = None,
):
    """This rank's (B, T_c) rows of the estimator run on all ranks' rows (rank order), each
    rank's tensors padded to the longest T_c (padding is masked out); the extras it returns,
    this rank's rows of them, into `extras`."""
    B, T = mask.shape
    T_max = int(all_reduce_max(T, dist))
    pad = (0, T_max - T)
    if turn_ids is None:
        turn_ids = torch.zeros_like(mask, dtype=torch.long)

    def gather(x: torch.Tensor, value=0) -> torch.Tensor:  # (B, T_c) or (B,), all ranks
        if x.dtype == torch.bool:
            return gather(x.to(torch.uint8)).bool()
        return all_gather_cat(
            torch.nn.functional.pad(x, pad, value=value) if x.dim() == 2 else x, dist
        )

    all_rewards = gather(token_rewards.float())
    all_mask = gather(mask)
    all_turns = gather(turn_ids, -1)
    rollout = None
    if batch is not None and wants_rollout(cfg.loss.advantage):
        r = batch.rollout
        rollout = EstimatorRollout(
            completion_ids=gather(r.completion_ids),
            completion_mask=gather(r.completion_mask),
            generated_mask=all_mask,
            turn_ids=all_turns,
            logprobs=gather(r.logprobs.float()),
            prompt_lens=gather(r.prompt_lens),
            extras={k: gather(v) for k, v in sorted(batch.extras.items())},
        )
    returned: dict[str, torch.Tensor] = {}  # extras for the loss, over the global batch
    adv = compute_advantages(
        cfg.loss.advantage,
        all_rewards,
        all_mask,
        group_size=cfg.rollout.group_size,
        eps=cfg.loss.advantage_eps,
        gamma=cfg.loss.token_discount,
        turn_ids=all_turns,
        turn_gamma=cfg.rollout.turn_discount,
        gae_lambda=cfg.loss.gae_lambda,
        params=cfg.loss.advantage_kwargs,
        rollout=rollout,
        metrics=metrics,
        step=step,
        extras=returned,
    )
    rows = slice(dist.rank * B, (dist.rank + 1) * B)
    if extras is not None:
        extras.update({k: v[rows, :T] if v.dim() == 2 else v[rows] for k, v in returned.items()})
    return adv[rows, :T]  # (B, T_c)


def kl_measured(cfg: Config, step: int | None) -> bool:
    """Whether the step (1-based) computes reference log-probs: every step when the loss or
    the reward uses the KL, else every log.kl_every-th step (never when it is 0)."""
    if cfg.loss.needs_reference:
        return True
    every = cfg.log.kl_every
    return bool(every) and step is not None and step % every == 0


@torch.no_grad()
def reference_phase(
    cfg: Config,
    policy: Policy,
    rollout: Rollout,
    mask: torch.Tensor,
    plan: tuple[MicroBatch, ...],
    step: int | None = None,
    show: bool = False,
) -> torch.Tensor | None:
    """Reference log-probs (B, T_c) at the counted tokens `mask`: the base model via disabled
    LoRA, or the frozen copy; None on the steps that do not need them (`kl_measured`).
    `show`: a progress bar when the pass runs long (`each_micro_batch`)."""
    if not kl_measured(cfg, step):
        return None
    plan_shown = each_micro_batch(plan, show, "reference log-probs")
    if policy.ref_model is not None:
        ref = CompletionLogprobs(policy.ref_model, policy.precision)
        parts = [micro_logprobs(cfg, ref, rollout, mask, mb) for mb in plan_shown]
    else:
        with disabled_lora(policy.model):
            ref = CompletionLogprobs(policy.model, policy.precision)
            parts = [micro_logprobs(cfg, ref, rollout, mask, mb) for mb in plan_shown]
    return torch.cat(parts)


@torch.no_grad()
def old_logprobs_phase(
    cfg: Config,
    policy: Policy,
    rollout: Rollout,
    mask: torch.Tensor,
    plan: tuple[MicroBatch, ...],
    show: bool = False,
) -> torch.Tensor | None:
    """With loss.old_logprobs: recompute (or loss.tis_cap): pi_old (B, T_c) as the trainer
    computes it (no grad, the sampler's eval mode), for the ratio (and the truncated-IS weight
    min(pi_old_trainer / pi_sampler, cap)); else None (the sampler's log-probs are pi_old).
    `show`: a progress bar when the pass runs long (`each_micro_batch`)."""
    if cfg.loss.old_logprobs != "recompute" and cfg.loss.tis_cap is None:
        return None
    scorer = CompletionLogprobs(policy.model, policy.precision)
    plan_shown = each_micro_batch(plan, show, "old log-probs")
    return torch.cat([micro_logprobs(cfg, scorer, rollout, mask, mb) for mb in plan_shown])


def update_phase(
    cfg: Config,
    policy: Policy,
    batch: UpdateBatch,
    optimizer,
    scheduler,
    params,
    scorer=None,
    dist=SINGLE,
    step: int | None = None,
    max_logprob_gap: float | None = None,
) -> dict:
    """mu passes over the batch; each pass is one optimizer step over all micro-batches.

    Under DDP the aggregation's normalizer is summed over ranks and each rank's loss is
    multiplied by the world size (DDP averages gradients), so the update equals the
    single-process update on the combined batch; gradients sync on the last micro-batch only.
    Stats are whatever the policy loss returns, token-weighted over the global batch, and the
    on-policy check: the first pass's log-probs (the policy that sampled, trainer numerics)
    against the sampler's, as rollout/logprob_diff_max, rollout/logprob_diff_mean and
    rollout/first_pass_ratio_mean (exp of the difference; 1 when they agree). An update that
    leaves a trainable weight NaN or inf (on any rank) raises `NonfiniteWeights` naming the
    step, its loss, grad norm and lr (`nonfinite_weights_error`), read with the stats: no extra
    sync. Before the first update (read with the first pass's loss: no extra sync),
    `check_first_pass` names a sampler, strategy or log-prob kernel whose log-probs are not
    finite, and with `max_logprob_gap` (`first_pass_gap_limit`) refuses a gap between the
    trainer's log-probs and the sampler's that no rounding explains.
    """
    model = policy.model
    scorer = scorer if scorer is not None else CompletionLogprobs(model, policy.precision)
    # the entropy the pass computes anyway is differentiable for a bonus, or for a loss that
    # declares it (its own bonus)
    entropy_grad = cfg.loss.entropy_coef > 0 or POLICY_LOSSES.declares(
        cfg.loss.policy_loss, "entropy"
    )
    model.train()
    mask = batch.counted_mask
    norm = loss_normalizer(mask, cfg.loss.aggregation, cfg.rollout.max_new_tokens)
    norm = all_reduce_sum(norm, dist)
    plan = batch.plan
    sampler_logprobs = batch.rollout.logprobs
    old = batch.old_logprobs if batch.old_logprobs is not None else sampler_logprobs
    replayed = batch.extras.get(REPLAYED)  # (B,) bool: rows a rollout strategy replayed
    # The stats stay on the device through the micro-batch loop (float64 sums: the numbers
    # Python floats would give). Host reads: one per pass (its loss, grad norm and blamed row,
    # for the non-finite check) and two after the loop, none per micro-batch.
    f64 = {"dtype": torch.float64, "device": sampler_logprobs.device}
    sums = StatSums()
    policy_share, losses, grad_norms, skipped = torch.zeros((), **f64), [], [], 0
    update_lrs, finite_after = [], []  # per update: its lr, whether the weights stayed finite
    lr = scheduler.get_last_lr()[0]  # this step's first update's; after it, the next one's
    on_policy = OnPolicyCheck.zeros(sampler_logprobs.device)
    n_passes = cfg.loss.num_iterations * len(plan)  # a bar when they are several and run long
    bar = phase_bar(
        cfg.train.progress and dist.is_main and n_passes > 1, "update", n_passes, "micro-batch"
    )
    for it in range(cfg.loss.num_iterations):
        optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), **f64)
        bad_row = torch.tensor(-1, device=sampler_logprobs.device)  # a row the loss is to blame
        for i, mb in enumerate(plan):
            sl = mb.rows
            ref = batch.ref_logprobs[sl] if batch.ref_logprobs is not None else None
            with no_sync(scorer, skip=i < len(plan) - 1):
                logprobs, entropy = micro_logprobs(
                    cfg,
                    scorer,
                    batch.rollout,
                    mask,
                    mb,
                    entropy=True,
                    entropy_grad=entropy_grad,
                )
                try:
                    loss, st, bad = policy_loss_on_device(
                        logprobs,
                        old[sl],
                        ref,
                        batch.advantages[sl],
                        mask[sl],
                        cfg.loss,
                        normalizer=norm,
                        max_new_tokens=cfg.rollout.max_new_tokens,
                        entropy=entropy,
                        behaviour_logprobs=sampler_logprobs[sl],
                        extras={k: v[sl] for k, v in batch.extras.items()},
                        step=step,
                        replayed=replayed[sl] if replayed is not None else None,
                    )
                except GrpoError as e:
                    raise GrpoError(f"step {step}: {e}" if step is not None else str(e)) from None
                (loss * dist.world_size).backward()  # DDP averages; we want the sum
            if it == 0:  # no host sync: summed here, read once after the loop
                on_policy = on_policy + OnPolicyCheck.of(logprobs, sampler_logprobs[sl], mask[sl])
            total += loss.detach()
            policy_share += st["policy_loss"]
            sums.add(st)
            bad_row = torch.where((bad_row < 0) & (bad >= 0), bad + sl.start, bad_row)
            bar.update(1)
        max_norm = cfg.optim.max_grad_norm or math.inf
        grad_norm = clip_grad_norm(params, max_norm)
        # the pass's one host read (the first pass's: with the on-policy check, before any
        # update)
        first = on_policy.tensors() if it == 0 else []
        read = torch.stack([total, grad_norm.to(total), bad_row.to(total), *first]).tolist()
        total, grad_norm = read[0], read[1]
        check_bad_row(cfg.loss.policy_loss, int(read[2]), step)  # a row of this rank's batch
        if it == 0:
            strategy, impl = cfg.rollout.strategy, cfg.model.logprob_impl
            check_first_pass(read[3:], step, strategy, impl, max_logprob_gap)
        finite = math.isfinite(grad_norm) and math.isfinite(total)
        if all_reduce_sum(float(not finite), dist):
            # A non-finite loss or gradient on any rank: skip this update everywhere.
            log.warning("non-finite loss (%s) or grad norm (%s): update skipped", total, grad_norm)
            optimizer.zero_grad(set_to_none=True)
            skipped += 1
            continue
        update_lrs.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
        losses.append(total)
        grad_norms.append(grad_norm)
        finite_after.append(weights_finite(params))  # read with the stats below: no extra sync
    bar.close()
    model.eval()
    mu = max(len(losses), 1)
    out = sums.reduce(dist)
    c = on_policy  # the step's second host read
    oks = [ok.to(policy_share) for ok in finite_after]
    diff_sum, ratio_sum, n_tokens, diff_max, policy_share, *finite = torch.stack(
        [c.diff_sum, c.ratio_sum, c.tokens, c.diff_max, policy_share, *oks]
    ).tolist()
    # every rank's loss is its share of the global loss: sum the shares over ranks
    sums_local = {
        "loss": sum(losses),
        "policy_loss": policy_share,
        "diff": diff_sum,
        "ratio": ratio_sum,
        "n": n_tokens,
    }
    for i, ok in enumerate(finite):  # update i left a weight NaN or inf (FSDP: some shard)
        sums_local[f"nonfinite_{i}"] = float(not ok)
    shares = all_reduce_sum_dict(sums_local, dist)
    bad = [i for i in range(len(finite)) if shares[f"nonfinite_{i}"]]
    if bad:  # stop before this step's checkpoint: the last one written stays finite
        i = bad[0]
        error = nonfinite_weights_error(step, losses[i], grad_norms[i], update_lrs[i])
        raise NonfiniteWeights(str(error), dist.rank)
    n_tokens = max(shares["n"], 1.0)
    out.update(
        {
            "train/loss": shares["loss"] / mu,
            "train/policy_loss": shares["policy_loss"] / mu,
            "train/grad_norm": sum(grad_norms) / mu if grad_norms else float("nan"),
            "train/nonfinite_skipped": skipped,  # the same on every rank
            "train/lr": lr,
            "rollout/logprob_diff_max": all_reduce_max(diff_max, dist),
            "rollout/logprob_diff_mean": shares["diff"] / n_tokens,
            "rollout/first_pass_ratio_mean": shares["ratio"] / n_tokens,
        }
    )
    if dist.enabled:  # grad norms are of the synced gradients, equal on all ranks
        out["train/grad_norm"] = all_reduce_mean_dict({"g": out["train/grad_norm"]}, dist)["g"]
    return out


def frozen_policy_metrics(scheduler) -> dict:
    """The update's metrics on a step that does not update the policy (train.
    critic_warmup_steps): its learning rate, no update, ``train/policy_frozen`` 1."""
    return {
        "train/lr": scheduler.get_last_lr()[0],
        "train/nonfinite_skipped": 0,
        "train/policy_frozen": 1.0,
    }


def run_header(
    cfg: Config,
    precision,
    device=None,
    parallel: str = "single process",
    env: dict[str, str] | None = None,
) -> dict[str, str]:
    """What a GRPO run computes, by name: logged at the start (rank 0) and written into the
    first metrics.jsonl record of each start (`MetricLogger(header=...)`). Values are strings,
    so consumers that read numeric metrics pass over them."""
    loss = cfg.loss
    return {
        "run/advantage": loss.advantage,
        "run/policy_loss": loss.policy_loss,
        "run/kl_estimator": loss.kl_estimator,
        "run/aggregation": loss.aggregation,
        "run/rollout_strategy": strategy_record(cfg),
        "run/env": cfg.rollout.env,
        "run/eval_env": cfg.eval.env or cfg.rollout.env,
        "run/precision": precision.describe(device),
        "run/parallel": parallel,
        **(env or {}),  # the environments' own records (`env_metadata`)
    }


def train_grpo(
    cfg: Config,
    resume: bool | str = False,
    on_step: Callable[[int, dict], None] | None = None,
    overwrite: bool = False,
) -> dict:
    """Run GRPO as configured (one process, or one rank of a torchrun job).

    Args:
        cfg: the run config.
        resume: continue from the run directory's newest valid checkpoint (refused if the
            config changes the model, LoRA shape, group size or data); "auto": continue if
            the directory holds a checkpoint, else start (`grpo.run.rundir.auto_start`).
        on_step: called on the main rank after every step, once its metrics are logged, with
            (step, metrics); eval/* metrics are present on evaluation steps. An exception it
            raises ends the run (e.g. a sweep pruning a trial).
        overwrite: start afresh in a directory holding an earlier run, whose outputs are
            removed once every input is checked (without it such a start is refused).

    Returns:
        the run's summary: output_dir, final, step, the last step's metrics, and `health`:
        each learning-health rule that fired, with its steps (grpo/run/health.py).
    """
    check_config(cfg, "grpo")  # the names and GRPO's rules, before anything loads
    return run_training(cfg, "train", resume, overwrite, _train, on_step, _produce)


def _produce(cfg: Config, roles: Roles, where: Where) -> dict:
    """A rollout producer rank (rollout.ranks): the policy without reference or optimizer,
    the data and rewards; it samples for the trainer ranks until they say stop."""
    device = device_for(roles.lockstep, resolve_device(cfg.model.device))
    seed_everything(cfg.train.seed)
    make_env = (
        env_factory(cfg.rollout.env, cfg.rollout.env_kwargs) if cfg.rollout.multi_turn else None
    )
    policy = build_policy(cfg, device, need_ref=False)
    policy.model.eval()
    rows = load_rows(cfg.data, cfg.data.split, cfg.data.max_samples, "rl", policy.tokenizer)
    reward_fns = build_rewards([r.spec for r in cfg.rewards]) if cfg.rewards else []
    sampler = make_sampler(cfg, policy, policy.model)
    return run_producer(cfg, policy, sampler, rows, reward_fns, make_env, roles, where)


def _train(cfg: Config, rundir: RunDir, dist, on_step, where: Where, roles=None) -> dict:
    device = device_for(dist, resolve_device(cfg.model.device))
    mc = preflight(cfg, "grpo", device, world_size=dist.world_size)  # before any load or write
    seed_everything(cfg.train.seed)
    check_estimator(cfg.loss.advantage, cfg.loss.advantage_kwargs)  # before anything is written
    check_policy_loss(cfg.loss)
    make_env = (
        env_factory(cfg.rollout.env, cfg.rollout.env_kwargs) if cfg.rollout.multi_turn else None
    )
    env_meta = env_metadata(make_env) if make_env is not None else {}
    if cfg.eval.env:
        eval_kwargs = eval_env_settings(cfg).get("env_kwargs")
        env_meta.update(
            env_metadata(env_factory(cfg.eval.env, eval_kwargs, key="eval.env"), "run/eval_env_")
        )
    policy = build_policy(cfg, device, need_ref=cfg.loss.needs_reference or cfg.log.kl_every > 0)
    sharded = shard_policy(policy, cfg, dist)  # train.parallel: fsdp (before the optimizer)
    rows = load_rows(cfg.data, cfg.data.split, cfg.data.max_samples, "rl", policy.tokenizer)
    eval_rows = None
    with rank_local(dist, where):  # rank 0 alone loads them: its failure stops every rank
        if cfg.data.eval_samples and dist.is_main:
            n_eval = cfg.data.eval_samples
            eval_rows = load_rows(cfg.data, cfg.data.eval_split, n_eval, "rl", policy.tokenizer)
        check_prompt_room(cfg, mc, "grpo", rows, eval_rows)
    reward_fns = build_rewards([r.spec for r in cfg.rewards]) if cfg.rewards else []
    if dist.is_main:  # limits that would act silently, said once (grpo config says them too)
        for line in start_notices(cfg, "grpo", tokenizer=policy.tokenizer):
            log.warning("%s", line)
    modules = ModuleSet(cfg, policy, dist, device, cfg.train.max_steps)  # trained beside it
    # what a rollout strategy keeps across steps (a replay buffer), checkpointed per rank
    strategy = StrategyState() if keeps_state(cfg.rollout.strategy) else None
    # Only now, with model, data and rewards checked, does the run directory get written.
    run = start_run(
        cfg,
        policy,
        dist,
        cfg.train.max_steps * cfg.loss.num_iterations,
        rundir,
        header={
            **run_header(
                cfg, policy.precision, policy.device, describe_parallel(dist, sharded), env_meta
            ),
            **modules.header(),
            # names, weights, kwargs, checkpoint hashes (rank 0 writes the header)
            **(rewards_header(reward_fns, cfg.rewards) if dist.is_main else {}),
        },
        modules=modules,
        strategy=strategy,
    )
    state = run.state
    policy.model.eval()
    scorer = wrap_ddp(CompletionLogprobs(policy.model, policy.precision), dist, device)
    clock = StepClock(device)  # perf/*: each stage's seconds and peak memory
    # learning that silently stops, or a task solved (train.stall_steps)
    reward_hi = None if modules.gives_rewards else highest_reward(cfg, reward_fns)
    health = LearningHealth(cfg, dist.rank, reward_hi)
    weight_change = WeightChange(run.params)  # train/weight_change, which it reads
    run_eval = functools.partial(evaluate_policy, cfg, policy, eval_rows)  # rank 0's rows
    metrics: dict = {}
    # the producers (asynchronous rollouts) stop with the block; on a clean end or an
    # interruption they first hand over what they sampled ahead
    with rollout_source(
        cfg, policy, rows, reward_fns, make_env, state, dist, sharded, roles, strategy
    ) as source:
        show = cfg.train.progress and dist.is_main
        bar = tqdm(total=cfg.train.max_steps, initial=state.step, desc="grpo", disable=not show)
        compiled_s = source.compile_s
        while state.step < cfg.train.max_steps:
            step = state.step + 1
            clock.start()
            # 1. Rollout (grpo/experience/): the step's prompts sampled and scored by the
            #    rollout strategy (sources.py -> collect.py -> strategies.py), tokens evened
            #    over ranks (balance.py), the trained modules' values attached (grpo/modules/)
            where.step, where.phase = step, "rollout"
            if source.asynchronous:
                where.phase = "waiting for rollouts"
            try:
                batch = source.next(state)
            except GrpoError as e:  # a reward's failure mid-run: the checkpoint to resume
                if getattr(e, "reward_name", None) or getattr(e.__cause__, "reward_name", None):
                    run.failed_stop(dist, e)  # completes its message
                raise
            # a reward normalised over the global batch (reward_model normalize: global)
            batch = normalize_globally(batch, reward_fns, dist, cfg.rollout.turn_discount)
            batch, balanced = balanced_batch(cfg, policy, batch, dist)
            batch = modules.attach(batch)
            clock.lap("rollout")
            # 2. Reference and advantages (this file: step_batch): the tokens the loss counts,
            #    the micro-batches, reference log-probs, advantages over the global batch
            #    (grpo/algo/advantages.py), pi_old when the trainer recomputes it
            where.phase = "reference / advantage"
            inputs = step_batch(cfg, policy, batch, dist, step)
            adv_stats = advantage_stats(inputs.advantages, inputs.counted_mask, dist)
            clock.lap("logprob")
            # 3. Update (this file: update_phase; grpo/algo/losses.py): loss.num_iterations
            #    passes of the policy loss, then each trained module's own step
            where.phase = "update"
            # the rollout's statistics and (async) the consumed batch's staleness and the time
            # each side waited, reduced as each value's type says (grpo/run/stats.py)
            metrics = reduce_metrics(rollout_metrics(batch, cfg.rollout.max_turns), dist)
            metrics |= reduce_metrics(source.metrics(), dist) | adv_stats | balanced
            metrics |= inputs.metrics  # the estimator's: of the global batch, as they are
            warm_up = state.step < cfg.train.critic_warmup_steps  # the modules alone train
            gap = first_pass_gap_limit(cfg, batch.policy_version, state.step)
            metrics |= policy_update(cfg, policy, inputs, run, scorer, dist, step, warm_up, gap)
            if modules:  # one step of each module on the same batch; means over ranks
                metrics |= reduce_metrics(modules.step(batch, inputs, step), dist)
            metrics["train/weight_change"] = weight_change.measure(dist)
            clock.lap("update")
            state.step = step
            source.published(policy.model, step)  # the producer may sample with it now
            tokens = all_reduce_sum(int(batch.rollout.completion_mask.sum()), dist)
            metrics |= clock.metrics(tokens) | source_perf(source, compiled_s)
            compiled_s = source.compile_s
            # 4. The run's tail (grpo/run/loop.py): learning health (grpo/run/health.py),
            #    evaluation, logging, the guards, the checkpoint
            stall = None
            try:  # warns (rank 0); every rank decides alike (reduced metrics)
                if not warm_up:  # a frozen policy is not a stall
                    health.observe(step, metrics)
            except StallError as e:  # train.stop_on_stall: raised once this step is logged
                stall = e
            if dist.is_main and cfg.train.sample_every and step % cfg.train.sample_every == 0:
                tqdm.write(f"[sample] reward {float(batch.rewards[0]):.2f}: {batch.texts[0]!r}")
            # the task solved with train.stop_on_stall: this step ends the run as the last would
            last = step == cfg.train.max_steps or health.finished
            run.end_of_step(
                policy,
                dist,
                where,
                metrics,
                last,
                on_step,
                run_eval,
                sharded,
                stall=stall,
                hint=HINT,
            )
            bar.update(1)
            if health.finished:
                break
        bar.close()
    summary = {**run.finish(policy, dist, metrics), "health": health.summary()}
    if health.converged is not None:
        summary["converged"] = health.converged_summary()
    return summary


def balanced_batch(cfg: Config, policy: Policy, batch: RolloutBatch, dist) -> tuple:
    """Stage 1's last move: with several ranks and train.balance_ranks, rows moved so that each
    rank runs about as many tokens (grpo/experience/balance.py); (batch, its metrics)."""
    if dist.world_size > 1 and cfg.train.balance_ranks:
        shared = cfg.shared_prefix_groups is not None
        return balance_ranks(batch, dist, policy.tokenizer.pad_token_id, shared)
    return batch, {}


def policy_update(
    cfg: Config,
    policy: Policy,
    inputs: UpdateBatch,
    run,
    scorer,
    dist,
    step: int,
    frozen: bool,
    max_logprob_gap: float | None = None,
) -> dict:
    """Stage 3's policy part: `update_phase`, or on a train.critic_warmup_steps step the frozen
    policy's metrics. An update that leaves a trainable weight NaN or inf (every rank raises it
    at the same update) ends the run without saving that state (`Run.unsaved_stop`)."""
    if frozen:
        return frozen_policy_metrics(run.scheduler)
    try:
        return update_phase(
            cfg,
            policy,
            inputs,
            run.optimizer,
            run.scheduler,
            run.params,
            scorer,
            dist,
            step,
            max_logprob_gap,
        )
    except NonfiniteWeights as e:
        what = str(e).split("; the checkpoints already written", 1)[0]
        why = f"the weights after the update of step {step} are not finite"
        raise run.unsaved_stop(dist, NonfiniteWeights(what), why) from None


def source_perf(source, compiled_s: float) -> dict[str, float]:
    """The rollout source's perf metrics: the compiled decode step's KV cache during the
    rollout (docs/precision.md), and the seconds spent compiling the decode step (a new shape)
    since `compiled_s` (with rollout.async: what the producer compiled since the last step)."""
    return {
        "perf/sampler_cache_mib": source.cache_bytes / 2**20,
        "perf/compile_s": source.compile_s - compiled_s,
    }


def highest_reward(cfg: Config, reward_fns) -> float | None:
    """The highest total reward a completion can get, for the learning-health `solved` rule:
    the weighted rewards' upper bound (`grpo.rewards.bounds.total_bounds`). None when a reward
    declares no bounds, with an environment (its step rewards add to the total), or with
    `rewards: []`."""
    if cfg.rollout.multi_turn or not reward_fns:
        return None
    bounds = total_bounds(reward_fns)
    return None if bounds is None else bounds[1]

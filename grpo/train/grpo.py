"""The GRPO loop: rollout + rewards -> ref log-probs -> advantages -> [old log-probs] -> mu
updates -> log -> save.

Each phase is one function over plain values; `train_grpo` only sequences them. Reference
log-probs come before advantages so that an estimator can put the KL into the reward
(REINFORCE++). Shapes: P prompts per step, G completions per prompt, B = P*G rows, T_c
completion tokens.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

import torch
from tqdm.auto import tqdm

from grpo.algo.advantages import check_estimator, compute_advantages, zero_std_groups
from grpo.algo.kl import kl_penalty
from grpo.algo.logprobs import CompletionLogprobs
from grpo.algo.losses import (
    check_bad_row,
    check_policy_loss,
    loss_normalizer,
    policy_loss_on_device,
)
from grpo.config import Config
from grpo.distributed import (
    SINGLE,
    Where,
    all_gather_cat,
    all_reduce_max,
    all_reduce_max_dict,
    all_reduce_mean_dict,
    all_reduce_sum,
    all_reduce_sum_dict,
    device_for,
    no_sync,
    rank_local,
    wrap_ddp,
)
from grpo.envs import env_factory
from grpo.errors import GrpoError
from grpo.eval import eval_env_settings, evaluate
from grpo.loading import load_rows, resolve_device
from grpo.lora import disabled_lora
from grpo.rewards import build_rewards, compute_rewards
from grpo.rollout import Sampler
from grpo.rollout.multiturn import env_metrics, sample_with_env, turn_end_ids
from grpo.rollout.sampler import resolve_compile
from grpo.train.batch import (
    Batch,
    cat_rollouts,
    column_bounds,
    derive_seed,
    micro_batches,
    next_prompts,
    outcome_token_rewards,
    select_rows,
    turn_token_rewards,
)
from grpo.train.common import (
    PhasePeaks,
    build_policy,
    due,
    seed_everything,
)
from grpo.train.loop import RunDir, run_training, start_run
from grpo.train.preflight import check_prompt_room, preflight, start_notices

log = logging.getLogger(__name__)


def sample_round(cfg: Config, policy, sampler, rows: list[dict], seed: int, make_env=None):
    """One sampling call: G completions per row (single turn), or G trajectories per row
    with the configured environment (multi-turn)."""
    c = cfg.rollout
    sampling = {"temperature": c.temperature, "top_k": c.top_k, "top_p": c.top_p,
                "min_p": c.min_p, "seed": seed, "pad_id": policy.tokenizer.pad_token_id,
                "stop_ids": policy.stop_ids}  # fmt: skip
    # the sampler holds the policy's precision: the trainer's autocast and float32 head
    if not c.multi_turn:
        return sampler.sample([r["prompt_ids"] for r in rows], group_size=c.group_size,
                              max_new_tokens=c.max_new_tokens, **sampling)  # fmt: skip
    return sample_with_env(
        sampler, policy.tokenizer, rows, make_env or env_factory(c.env, c.env_kwargs),
        env_name=c.env, group_size=c.group_size, max_new_tokens=c.max_new_tokens,
        max_turns=c.max_turns, max_total_tokens=c.total_tokens,
        max_obs_tokens=c.max_obs_tokens,
        turn_end_ids=turn_end_ids(policy.tokenizer, c.turn_end_tokens), **sampling,
    )  # fmt: skip


def rollout_phase(
    cfg: Config, policy, sampler, rows, state, reward_fns, step: int, dist=SINGLE, make_env=None
) -> Batch:
    """Sample G completions for P prompts and score them (advantages come later).

    With loss.dynamic_sampling, groups whose rewards are all equal (no signal) are dropped and
    new prompts sampled in up to loss.max_sampling_rounds rounds; if still short, dropped
    groups fill the batch so its size stays fixed.

    Under DDP every rank walks the same global prompt order and takes its own slice of each
    draw (a group never spans ranks); sampler seeds come from (seed, rank, step, round).
    """
    G = cfg.rollout.group_size
    P = cfg.train.batch_size // G
    kept: list[tuple] = []  # (rollout piece, rows, rewards, per_fn, texts, token rewards)
    spare: list[tuple] = []
    frac_zero = None
    rounds = cfg.loss.max_sampling_rounds if cfg.loss.dynamic_sampling else 1
    for round_ in range(rounds):
        # every rank draws P prompts per round (so all advance the data order alike) and
        # samples the ones it still needs
        drawn = next_prompts(state, len(rows), P * dist.world_size, cfg.train.seed)
        idx = drawn[dist.rank * P : (dist.rank + 1) * P][: P - len(kept)]
        if not idx:  # this rank is full, others may not be: stay in lockstep
            if all_reduce_sum(0.0, dist) == 0:
                break
            continue
        seed = derive_seed(cfg.train.seed, dist.rank, step, round_)
        rollout = sample_round(cfg, policy, sampler, [rows[i] for i in idx], seed, make_env)
        brows = [rows[i] for i in idx for _ in range(G)]
        texts = rollout.decode(policy.tokenizer, skip_special_tokens=True)
        columns = {k: [r[k] for r in brows] for k in brows[0] if k != "prompt_ids"}
        lengths = rollout.completion_lens.tolist()
        columns["completion_lengths"] = lengths
        columns["completion_ids"] = [ids[:n] for ids, n in zip(rollout.completion_ids.tolist(),
                                                              lengths)]  # fmt: skip
        if rollout.turn_texts is not None:  # multi-turn: what the trajectory did
            columns["num_turns"] = [len(t) for t in rollout.turn_texts]
            columns["env_info"] = rollout.infos
        T_c = rollout.completion_ids.shape[1]
        total, per_fn = compute_rewards(reward_fns, texts, columns, token_width=T_c)
        if rollout.turn_rewards is not None:  # step rewards and the discounted return
            tok = turn_token_rewards(total, rollout, cfg.rollout.gamma)
            total = tok.sum(-1)
        elif total.dim() == 1:  # (B,) sequence rewards -> on each row's last token
            tok = outcome_token_rewards(total, rollout.completion_mask)
        else:  # (B, T_c) some rewards per token
            tok, total = total, total.sum(-1)
        zero = zero_std_groups(total, G)  # (P_round,)
        frac_zero = float(zero.float().mean()) if frac_zero is None else frac_zero
        for p in range(len(idx)):
            sl = slice(p * G, (p + 1) * G)
            piece = (
                select_rows(rollout, torch.arange(sl.start, sl.stop)),
                brows[sl],
                total[sl],
                {k: v[sl] for k, v in per_fn.items()},
                texts[sl],
                tok[sl],
            )
            (spare if cfg.loss.dynamic_sampling and zero[p] else kept).append(piece)
        if all_reduce_sum(float(len(kept) < P), dist) == 0:
            break
    kept = (kept + spare)[:P]
    rollout = cat_rollouts([k[0] for k in kept], policy.tokenizer.pad_token_id)
    rewards = torch.cat([k[2] for k in kept])
    per_fn = {name: torch.cat([k[3][name] for k in kept]) for name in kept[0][3]}
    T_c = rollout.completion_ids.shape[1]
    token_rewards = torch.cat(
        [torch.nn.functional.pad(k[5], (0, T_c - k[5].shape[1])) for k in kept]
    )  # (B, T_c)
    loss_mask = rollout.scored_mask.clone()
    if cfg.loss.mask_truncated_completions:
        loss_mask &= rollout.finished[:, None]
    return Batch(
        rollout=rollout,
        rows=[r for k in kept for r in k[1]],
        rewards=rewards,
        per_fn=per_fn,
        loss_mask=loss_mask,
        texts=[t for k in kept for t in k[4]],
        frac_zero_std=frac_zero,
        token_rewards=token_rewards,
    )


def advantage_phase(cfg: Config, batch: Batch, dist=SINGLE, step: int | None = None) -> None:
    """batch.advantages (B, T_c) from the configured estimator over the *global* batch.

    Token rewards (minus loss.kl_in_reward * KL_t when set) of every rank are gathered, padded
    to the longest completion, so that batch statistics (batch_std, reinforce_pp, ...) are those
    of the combined batch; each rank keeps its own rows.
    """
    r = batch.rollout
    mask = r.scored_mask  # the policy's own tokens (observations are not actions)
    device = r.ids.device
    if batch.token_rewards is None:
        batch.token_rewards = outcome_token_rewards(batch.rewards, mask)
    token_rewards = batch.token_rewards.to(device)
    if cfg.loss.kl_in_reward > 0:  # REINFORCE++: KL(pi_old || ref) per token in the reward
        kl = kl_penalty(r.logprobs, batch.ref_logprobs, cfg.loss.kl_estimator,
                        cfg.loss.log_ratio_clamp, cfg.loss.kl_clamp)  # fmt: skip
        token_rewards = token_rewards - cfg.loss.kl_in_reward * torch.where(mask, kl, 0.0)
    try:
        batch.advantages = global_advantages(cfg, token_rewards, mask, dist, r.turn_ids)
    except GrpoError as e:
        raise GrpoError(f"step {step}: {e}" if step is not None else str(e)) from None


def global_advantages(cfg: Config, token_rewards, mask, dist=SINGLE, turn_ids=None):
    """This rank's (B, T_c) rows of the estimator run on all ranks' rows (rank order), each
    rank's tensors padded to the longest T_c (padding is masked out)."""
    B, T = mask.shape
    T_max = int(all_reduce_max(T, dist))
    pad = (0, T_max - T)
    if turn_ids is None:
        turn_ids = torch.zeros_like(mask, dtype=torch.long)
    all_rewards = all_gather_cat(torch.nn.functional.pad(token_rewards.float(), pad), dist)
    all_mask = all_gather_cat(torch.nn.functional.pad(mask.float(), pad), dist).bool()
    all_turns = all_gather_cat(torch.nn.functional.pad(turn_ids, pad, value=-1), dist)
    adv = compute_advantages(
        cfg.loss.advantage, all_rewards, all_mask, group_size=cfg.rollout.group_size,
        eps=cfg.loss.advantage_eps, gamma=cfg.loss.gamma, turn_ids=all_turns,
        turn_gamma=cfg.rollout.gamma, params=cfg.loss.advantage_kwargs,
    )  # fmt: skip
    return adv[dist.rank * B : (dist.rank + 1) * B, :T]  # (B, T_c)


def advantage_stats(advantages: torch.Tensor, mask: torch.Tensor, dist=SINGLE) -> dict:
    """adv/mean, adv/std (population), adv/min, adv/max and adv/zero_frac (exactly 0: e.g. a
    group of equal rewards) over the counted tokens of the global batch (`mask`: the loss
    mask, so what the update weighs); NaN when no token counts.

    Sums and extremes are taken on the device and read in one host sync; across ranks the
    counts and sums are added and the extremes reduced, so the numbers are those of the
    combined batch (not a mean of per-rank values).

    Args:
        advantages: (B, T_c) this rank's advantages.
        mask: (B, T_c) bool, the counted tokens.
    """
    with torch.no_grad():
        a = advantages.detach().double()
        inf = torch.tensor(math.inf, dtype=torch.float64, device=a.device)
        local = torch.stack([
            mask.sum().double(),
            torch.where(mask, a, 0.0).sum(),
            torch.where(mask, a * a, 0.0).sum(),
            (mask & (a == 0)).sum().double(),
            torch.where(mask, a, inf).min() if a.numel() else inf,
            torch.where(mask, -a, inf).min() if a.numel() else inf,  # -max
        ]).tolist()  # fmt: skip
    n, s, s2, zeros, lo, neg_hi = local
    sums = all_reduce_sum_dict({"n": n, "s": s, "s2": s2, "zeros": zeros}, dist)
    ext = all_reduce_max_dict({"neg_lo": -lo, "hi": -neg_hi}, dist)  # min = -max(-x)
    n = sums["n"]
    if n == 0:
        return dict.fromkeys(("adv/mean", "adv/std", "adv/min", "adv/max", "adv/zero_frac"),
                             float("nan"))  # fmt: skip
    mean = sums["s"] / n
    return {
        "adv/mean": mean,
        "adv/std": math.sqrt(max(sums["s2"] / n - mean * mean, 0.0)),
        "adv/min": -ext["neg_lo"],
        "adv/max": ext["hi"],
        "adv/zero_frac": sums["zeros"] / n,
    }


def _logprobs(cfg: Config, scorer, batch: Batch, sl: slice, cols: tuple[int, int],
              entropy: bool = False, entropy_grad: bool = False):  # fmt: skip
    """(micro-batch) completion log-probs (mb, T_c) through `scorer` (a CompletionLogprobs, maybe
    DDP), computed over the columns [lo, hi) = `cols` that hold its real tokens
    (`column_bounds`), zero-padded back to T_c."""
    r = batch.rollout
    lo, hi = cols
    T_p, T_c = r.prompt_width, r.ids.shape[1] - r.prompt_width
    out = scorer(  # autocast as the policy's precision says (CompletionLogprobs)
        r.ids[sl, lo:hi],
        r.attention_mask()[sl, lo:hi],
        T_p - lo,
        batch.loss_mask[sl, : hi - T_p],
        cfg.rollout.temperature or 1.0,  # greedy rollouts are scored at T = 1
        return_entropy=entropy,
        entropy_grad=entropy_grad,
        has_holes=r.loss_mask is not None,
        group_size=cfg.shared_prefix_groups,
    )
    pad = (0, T_c - (hi - T_p))  # the trimmed columns hold no scored token: 0 there
    if entropy:
        return tuple(torch.nn.functional.pad(t, pad) for t in out)
    return torch.nn.functional.pad(out, pad)


def _micro_batches(cfg: Config, batch: Batch):
    """The micro-batch slices of the batch and each one's column range (`column_bounds`),
    computed on the first call of a step and kept on the batch for the other passes."""
    mb = cfg.train.micro_batch_size or cfg.train.batch_size
    if mb not in batch.micro_batch_plan:
        r = batch.rollout
        slices = list(micro_batches(r.ids.shape[0], mb))
        bounds = column_bounds(r.attention_mask(), slices, r.prompt_width)
        batch.micro_batch_plan[mb] = list(zip(slices, bounds))
    return batch.micro_batch_plan[mb]


def kl_measured(cfg: Config, step: int | None) -> bool:
    """Whether the step (1-based) computes reference log-probs: every step when the loss or
    the reward uses the KL, else every log.kl_every-th step (never when it is 0)."""
    if cfg.loss.needs_reference:
        return True
    every = cfg.log.kl_every
    return bool(every) and step is not None and step % every == 0


@torch.no_grad()
def reference_phase(cfg: Config, policy, batch: Batch, step: int | None = None) -> None:
    """ref log-probs (B, T_c): the base model via disabled LoRA, or the frozen copy; only on
    the steps that need them (`kl_measured`)."""
    if not kl_measured(cfg, step):
        return
    parts = _micro_batches(cfg, batch)
    if policy.ref_model is not None:
        ref = CompletionLogprobs(policy.ref_model, policy.precision)
        parts = [_logprobs(cfg, ref, batch, sl, cols) for sl, cols in parts]
    else:
        with disabled_lora(policy.model):
            ref = CompletionLogprobs(policy.model, policy.precision)
            parts = [_logprobs(cfg, ref, batch, sl, cols) for sl, cols in parts]
    batch.ref_logprobs = torch.cat(parts)


@torch.no_grad()
def old_logprobs_phase(cfg: Config, policy, batch: Batch) -> None:
    """With loss.old_logprobs: recompute (or loss.tis_cap): pi_old as the trainer computes it
    (no grad, the sampler's eval mode), for the ratio (and the truncated-IS weight
    min(pi_old_trainer / pi_sampler, cap))."""
    if cfg.loss.old_logprobs != "recompute" and cfg.loss.tis_cap is None:
        return
    scorer = CompletionLogprobs(policy.model, policy.precision)
    batch.old_logprobs = torch.cat([_logprobs(cfg, scorer, batch, sl, cols)
                                    for sl, cols in _micro_batches(cfg, batch)])  # fmt: skip


class StatSums:
    """Token-weighted sums of a loss's stats over micro-batches, passes and ranks, so that
    ``train/<name>`` is the mean over all counted tokens (max / min for ``_max`` / ``_min``).

    A stat is a float or a 0-d tensor. Tensors are summed where they live, in float64 (the same
    numbers as Python floats would give), and read to the host once, in `reduce`: no host sync
    per micro-batch.
    """

    def __init__(self):
        self.sums: dict[str, float | torch.Tensor] = {}
        self.extremes: dict[str, float | torch.Tensor] = {}
        self.tokens: float | torch.Tensor = 0.0

    def add(self, stats: dict[str, float | torch.Tensor]) -> None:
        w = _f64(stats["tokens"])
        self.tokens = self.tokens + w
        for k, v in stats.items():
            if k in ("tokens", "policy_loss"):
                continue
            v = _f64(v)
            if k.endswith("_max") or k.endswith("_min"):
                self.extremes[k] = _pick(self.extremes.get(k, v), v, k.endswith("_max"))
            else:
                self.sums[k] = self.sums.get(k, 0.0) + v * w

    def reduce(self, dist) -> dict[str, float]:
        """The ``train/<name>`` means and extremes over all ranks (one host read, then the
        all-reduces)."""
        local = _read_floats({**self.sums, **self.extremes, "__tokens": self.tokens})
        extremes = {k: local.pop(k) for k in self.extremes}
        sums = all_reduce_sum_dict(local, dist)
        n = max(sums.pop("__tokens"), 1.0)
        out = {f"train/{k}": v / n for k, v in sums.items()}
        maxes = {k: v for k, v in extremes.items() if k.endswith("_max")}
        mins = {k: -v for k, v in extremes.items() if k.endswith("_min")}
        both = all_reduce_max_dict({**maxes, **mins}, dist)  # min = -max(-x)
        for k, v in both.items():
            v = -v if k.endswith("_min") else v
            out[f"train/{k}"] = v if math.isfinite(v) else float("nan")  # no counted token
        return out


def _f64(x: float | torch.Tensor) -> float | torch.Tensor:
    """A float64 tensor (exact for float32, bfloat16 and integer stats), or the float as is."""
    return x.detach().double() if isinstance(x, torch.Tensor) else x


def _pick(prev, v, larger: bool):
    """max(prev, v) (min when not `larger`) as Python computes it, on the device for tensors:
    v only when strictly better, so a NaN neither replaces nor is replaced."""
    better = v > prev if larger else v < prev
    if isinstance(better, torch.Tensor):
        return torch.where(better, v, prev)
    return v if better else prev


def _read_floats(values: dict) -> dict[str, float]:
    """`values` with its 0-d tensors read to Python floats in one host sync."""
    keys = [k for k, v in values.items() if isinstance(v, torch.Tensor)]
    if not keys:
        return dict(values)
    read = torch.stack([values[k].double() for k in keys]).tolist()
    return {**values, **dict(zip(keys, read))}


def update_phase(
    cfg: Config, policy, batch: Batch, optimizer, scheduler, params, scorer=None, dist=SINGLE,
    step: int | None = None,
) -> dict:  # fmt: skip
    """mu passes over the batch; each pass is one optimizer step over all micro-batches.

    Under DDP the aggregation's normalizer is summed over ranks and each rank's loss is
    multiplied by the world size (DDP averages gradients), so the update equals the
    single-process update on the combined batch; gradients sync on the last micro-batch only.
    Stats are whatever the policy loss returns, token-weighted over the global batch, and the
    on-policy check: the first pass's log-probs (the policy that sampled, trainer numerics)
    against the sampler's, as rollout/logprob_diff_max, rollout/logprob_diff_mean and
    rollout/first_pass_ratio_mean (exp of the difference; 1 when they agree).
    """
    model = policy.model
    scorer = scorer if scorer is not None else CompletionLogprobs(model, policy.precision)
    model.train()
    norm = loss_normalizer(batch.loss_mask, cfg.loss.aggregation, cfg.rollout.max_new_tokens)
    norm = all_reduce_sum(norm, dist)
    slices = _micro_batches(cfg, batch)
    sampler_logprobs = batch.rollout.logprobs
    old = batch.old_logprobs if batch.old_logprobs is not None else sampler_logprobs
    # The stats stay on the device through the micro-batch loop (float64 sums: the numbers
    # Python floats would give). Host reads: one per pass (its loss, grad norm and blamed row,
    # for the non-finite check) and two after the loop, none per micro-batch.
    f64 = {"dtype": torch.float64, "device": sampler_logprobs.device}
    sums = StatSums()
    policy_share, losses, grad_norms, skipped = torch.zeros((), **f64), [], [], 0
    lr = scheduler.get_last_lr()[0]  # this step's first update's; after it, the next one's
    on_policy = torch.zeros(4, **f64)
    for it in range(cfg.loss.num_iterations):
        optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), **f64)
        bad_row = torch.tensor(-1, device=sampler_logprobs.device)  # a row the loss is to blame
        for i, (sl, cols) in enumerate(slices):
            ref = batch.ref_logprobs[sl] if batch.ref_logprobs is not None else None
            with no_sync(scorer, skip=i < len(slices) - 1):
                logprobs, entropy = _logprobs(cfg, scorer, batch, sl, cols, entropy=True,
                                              entropy_grad=cfg.loss.entropy_coef > 0)  # fmt: skip
                try:
                    loss, st, bad = policy_loss_on_device(
                        logprobs,
                        old[sl],
                        ref,
                        batch.advantages[sl],
                        batch.loss_mask[sl],
                        cfg.loss,
                        normalizer=norm,
                        max_new_tokens=cfg.rollout.max_new_tokens,
                        entropy=entropy,
                        behaviour_logprobs=sampler_logprobs[sl],
                    )
                except GrpoError as e:
                    raise GrpoError(f"step {step}: {e}" if step is not None else str(e)) from None
                (loss * dist.world_size).backward()  # DDP averages; we want the sum
            if it == 0:  # no host sync: summed here, read once after the loop
                part = _on_policy_sums(logprobs, sampler_logprobs[sl], batch.loss_mask[sl])
                on_policy[:3] += part[:3]
                on_policy[3] = torch.maximum(on_policy[3], part[3])
            total += loss.detach()
            policy_share += st["policy_loss"]
            sums.add(st)
            bad_row = torch.where((bad_row < 0) & (bad >= 0), bad + sl.start, bad_row)
        max_norm = cfg.optim.max_grad_norm or math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        # the pass's one host read
        read = torch.stack([total, grad_norm.to(total), bad_row.to(total)]).tolist()
        total, grad_norm = read[0], read[1]
        check_bad_row(cfg.loss.policy_loss, int(read[2]), step)  # a row of this rank's batch
        finite = math.isfinite(grad_norm) and math.isfinite(total)
        if all_reduce_sum(float(not finite), dist):
            # A non-finite loss or gradient on any rank: skip this update everywhere.
            log.warning("non-finite loss (%s) or grad norm (%s): update skipped", total, grad_norm)
            optimizer.zero_grad(set_to_none=True)
            skipped += 1
            continue
        optimizer.step()
        scheduler.step()
        losses.append(total)
        grad_norms.append(grad_norm)
    model.eval()
    mu = max(len(losses), 1)
    out = sums.reduce(dist)
    diff_sum, ratio_sum, n_tokens, diff_max, policy_share = torch.cat(
        [on_policy, policy_share[None]]
    ).tolist()
    # every rank's loss is its share of the global loss: sum the shares over ranks
    sums_local = {"loss": sum(losses), "policy_loss": policy_share, "diff": diff_sum,
                  "ratio": ratio_sum, "n": n_tokens}  # fmt: skip
    shares = all_reduce_sum_dict(sums_local, dist)
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


def _on_policy_sums(logprobs, sampler_logprobs, mask) -> torch.Tensor:
    """(4,) float64: sum |logprobs - sampler's|, sum exp(logprobs - sampler's), counted tokens,
    max |difference| over the counted tokens of a micro-batch."""
    with torch.no_grad():
        d = torch.where(mask, logprobs.detach().double() - sampler_logprobs.double(), 0.0)
        ratio = torch.where(mask, torch.exp(d), 0.0)
        return torch.stack([d.abs().sum(), ratio.sum(), mask.sum().double(), d.abs().max()])


def run_header(cfg: Config, precision) -> dict[str, str]:
    """What a GRPO run computes, by name: logged at the start (rank 0) and written into the
    first metrics.jsonl record of each start (`MetricLogger(header=...)`). Values are strings,
    so consumers that read numeric metrics pass over them."""
    loss = cfg.loss
    return {
        "run/advantage": loss.advantage,
        "run/policy_loss": loss.policy_loss,
        "run/kl_estimator": loss.kl_estimator,
        "run/aggregation": loss.aggregation,
        "run/env": cfg.rollout.env,
        "run/eval_env": cfg.eval.env or cfg.rollout.env,
        "run/precision": precision.describe(),
    }


def rollout_metrics(batch: Batch, G: int, max_turns: int = 1) -> dict:
    """This rank's rollout/*, rewards/* and (multi-turn, `env_metrics`) env/* metrics."""
    lens = batch.rollout.scored_mask.sum(-1).float()  # generated tokens (all turns)
    out = {
        "rollout/reward_mean": float(batch.rewards.mean()),
        "rollout/reward_std": float(batch.rewards.std()) if len(batch.rewards) > 1 else 0.0,
        "rollout/frac_zero_std_groups": batch.frac_zero_std,
        "rollout/completion_len_mean": float(lens.mean()),
        "rollout/completion_len_min": float(lens.min()),
        "rollout/completion_len_max": float(lens.max()),
        "rollout/truncated_frac": float((~batch.rollout.finished).float().mean()),
    }
    for name, v in batch.per_fn.items():
        out[f"rewards/{name}"] = float(v.mean())
    if "accuracy" in batch.per_fn:
        out["rollout/accuracy"] = float(batch.per_fn["accuracy"].mean())
    out.update(env_metrics(batch.rollout, max_turns))
    return out


def train_grpo(
    cfg: Config,
    resume: bool = False,
    on_step: Callable[[int, dict], None] | None = None,
    overwrite: bool = False,
) -> dict:
    """Run GRPO as configured (one process, or one rank of a torchrun job).

    Args:
        cfg: the run config.
        resume: continue from the run directory's newest valid checkpoint (refused if the
            config changes the model, LoRA shape, group size or data).
        on_step: called on the main rank after every step, once its metrics are logged, with
            (step, metrics); eval/* metrics are present on evaluation steps. An exception it
            raises ends the run (e.g. a sweep pruning a trial).
        overwrite: start afresh in a directory holding an earlier run, whose outputs are
            removed once every input is checked (without it such a start is refused).

    Returns:
        the run's summary: output_dir, final, step and the last step's metrics.
    """
    cfg.check_grpo()
    return run_training(cfg, "train", resume, overwrite, _train, on_step)


def _train(cfg: Config, rundir: RunDir, dist, on_step, where: Where) -> dict:
    device = device_for(dist, resolve_device(cfg.model.device))
    mc = preflight(cfg, "grpo", device, world_size=dist.world_size)  # before any load or write
    seed_everything(cfg.train.seed)
    check_estimator(cfg.loss.advantage, cfg.loss.advantage_kwargs)  # before anything is written
    check_policy_loss(cfg.loss)
    make_env = (
        env_factory(cfg.rollout.env, cfg.rollout.env_kwargs) if cfg.rollout.multi_turn else None
    )
    if cfg.eval.env:
        env_factory(cfg.eval.env, key="eval.env")
    policy = build_policy(cfg, device, need_ref=cfg.loss.needs_reference or cfg.log.kl_every > 0)
    rows = load_rows(cfg.data, cfg.data.split, cfg.data.max_samples, "rl", policy.tokenizer)
    eval_rows = None
    with rank_local(dist, where):  # rank 0 alone loads them: its failure stops every rank
        if cfg.data.eval_samples and dist.is_main:
            n_eval = cfg.data.eval_samples
            eval_rows = load_rows(cfg.data, cfg.data.eval_split, n_eval, "rl", policy.tokenizer)
        check_prompt_room(cfg, mc, "grpo", rows, eval_rows)
    reward_fns = build_rewards([r.spec for r in cfg.rewards])
    if dist.is_main:  # limits that would act silently, said once (grpo config says them too)
        for line in start_notices(cfg, "grpo", tokenizer=policy.tokenizer):
            log.warning("%s", line)
    # Only now, with model, data and rewards checked, does the run directory get written.
    run = start_run(cfg, policy, dist, cfg.train.max_steps * cfg.loss.num_iterations, rundir,
                    header=run_header(cfg, policy.precision))  # fmt: skip
    state, optimizer, scheduler, params = run.state, run.optimizer, run.scheduler, run.params
    policy.model.eval()
    compile_ = resolve_compile(cfg.rollout.compile, device, cfg.rollout.multi_turn)
    sampler = Sampler(policy.model, compile=compile_, fallback=cfg.rollout.compile == "auto",
                      precision=policy.precision)  # fmt: skip
    scorer = wrap_ddp(CompletionLogprobs(policy.model, policy.precision), dist, device)
    G = cfg.rollout.group_size
    peaks = PhasePeaks(device)
    bad_steps = 0  # consecutive updates skipped as non-finite

    def run_eval() -> dict:
        res = evaluate(
            policy.model, policy.tokenizer, eval_rows, stop_ids=policy.stop_ids,
            max_new_tokens=cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens,
            batch_size=cfg.eval.batch_size, precision=policy.precision,
            **eval_env_settings(cfg),
        )  # fmt: skip
        return {f"eval/{k}": v for k, v in res.summary.items() if isinstance(v, (int, float))}

    metrics: dict = {}
    show = cfg.train.progress and dist.is_main
    bar = tqdm(total=cfg.train.max_steps, initial=state.step, desc="grpo", disable=not show)
    while state.step < cfg.train.max_steps:
        t0 = time.perf_counter()
        where.step, where.phase = state.step + 1, "rollout"
        peaks.start()
        batch = rollout_phase(
            cfg, policy, sampler, rows, state, reward_fns, state.step, dist, make_env
        )
        t1 = time.perf_counter()
        peaks.end("rollout")
        where.phase = "reference / advantage"
        reference_phase(cfg, policy, batch, state.step + 1)
        advantage_phase(cfg, batch, dist, state.step + 1)
        adv_stats = advantage_stats(batch.advantages, batch.loss_mask, dist)
        old_logprobs_phase(cfg, policy, batch)
        t2 = time.perf_counter()
        peaks.end("logprob")
        where.phase = "update"
        metrics = all_reduce_mean_dict(rollout_metrics(batch, G, cfg.rollout.max_turns), dist)
        metrics.update(adv_stats)
        metrics.update(
            update_phase(
                cfg, policy, batch, optimizer, scheduler, params, scorer, dist, state.step + 1
            )
        )
        t3 = time.perf_counter()
        peaks.end("update")
        state.step += 1
        tokens = all_reduce_sum(int(batch.rollout.completion_mask.sum()), dist)
        metrics.update(
            {
                "perf/step_s": t3 - t0,
                "perf/rollout_s": t1 - t0,
                "perf/logprob_s": t2 - t1,
                "perf/update_s": t3 - t2,
                "perf/tokens_per_s": tokens / max(t3 - t0, 1e-9),
                # the compiled decode step's KV cache, kept through the update (docs/precision.md)
                "perf/sampler_cache_mib": sampler.kept_cache_bytes / 2**20,
                **peaks.metrics(),
            }
        )
        skipped = int(metrics["train/nonfinite_skipped"])
        bad_steps = bad_steps + skipped if skipped else 0
        last = state.step == cfg.train.max_steps
        where.phase = "evaluation / logging"
        with rank_local(dist, where):  # rank 0's work: its failure stops every rank at once
            if eval_rows and due(state.step, cfg.train.eval_every, last):
                metrics.update(run_eval())
            if state.step % cfg.train.log_every == 0 or last:
                run.logger.log(state.step, metrics)
            if on_step is not None and dist.is_main:
                on_step(state.step, metrics)
        if dist.is_main and cfg.train.sample_every and state.step % cfg.train.sample_every == 0:
            tqdm.write(f"[sample] reward {float(batch.rewards[0]):.2f}: {batch.texts[0]!r}")
        if bad_steps >= cfg.train.max_nonfinite_steps:
            raise GrpoError(
                f"{bad_steps} consecutive updates had a non-finite loss or gradient (step "
                f"{state.step}); stopped. Lower optim.lr or check the rewards; resume from the "
                "last checkpoint with --resume"
            )
        where.phase = "checkpoint"
        run.end_step(policy, dist, last)
        bar.update(1)
    bar.close()
    return run.finish(policy, dist, metrics)

"""The GRPO loop: rollout -> rewards -> advantages -> ref log-probs -> mu updates -> log -> save.

Each phase is one function over plain values; `train_grpo` only sequences them. Shapes:
P prompts per step, G completions per prompt, B = P*G rows, T_c completion tokens.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import numpy as np
import torch
from tqdm.auto import tqdm

from grpo.algo.advantages import group_advantages, zero_std_groups
from grpo.algo.logprobs import CompletionLogprobs
from grpo.algo.losses import loss_normalizer, policy_loss
from grpo.config import Config
from grpo.distributed import (
    SINGLE,
    all_gather_cat,
    all_reduce_max,
    all_reduce_mean_dict,
    all_reduce_sum,
    device_for,
    init_distributed,
    no_sync,
    teardown,
    wrap_ddp,
)
from grpo.errors import GrpoError
from grpo.lora import disabled_lora
from grpo.rewards import build_rewards, compute_rewards
from grpo.rollout import Rollout, Sampler
from grpo.train.common import (
    build_policy,
    due,
    load_rows,
    resolve_device,
    seed_everything,
)
from grpo.train.loop import resume_checkpoint, start_run
from grpo.train.state import (
    TrainState,
)

log = logging.getLogger(__name__)


@dataclass
class Batch:
    """One step's training data: rollouts plus everything the loss needs, all (B, ...)."""

    rollout: Rollout
    rows: list[dict]  # B dataset rows (each prompt's row repeated G times)
    rewards: torch.Tensor  # (B,)
    per_fn: dict[str, torch.Tensor]  # name -> (B,)
    advantages: torch.Tensor  # (B,)
    loss_mask: torch.Tensor  # (B, T_c) bool: completion_mask, minus truncated rows if asked
    texts: list[str]
    frac_zero_std: float
    ref_logprobs: torch.Tensor | None = None  # (B, T_c)


def derive_seed(*parts: int) -> int:
    """A sampler seed from (seed, rank, step, round): distinct, reproducible streams."""
    return int(np.random.SeedSequence(list(parts)).generate_state(1)[0])


def next_prompts(state: TrainState, n_rows: int, count: int, seed: int) -> list[int]:
    """The next `count` row indices of a per-epoch shuffled order; advances `state`."""
    out = []
    while len(out) < count:
        order = np.random.default_rng([seed, state.epoch]).permutation(n_rows)
        take = order[state.data_index : state.data_index + count - len(out)]
        out.extend(int(i) for i in take)
        state.data_index += len(take)
        if state.data_index >= n_rows:
            state.epoch, state.data_index = state.epoch + 1, 0
    return out


def select_rows(r: Rollout, idx: torch.Tensor) -> Rollout:
    """The rollout restricted to rows `idx` (whole groups)."""
    return Rollout(
        ids=r.ids[idx],
        prompt_lens=r.prompt_lens[idx],
        prompt_width=r.prompt_width,
        completion_ids=r.completion_ids[idx],
        completion_mask=r.completion_mask[idx],
        completion_lens=r.completion_lens[idx],
        finished=r.finished[idx],
        logprobs=r.logprobs[idx],
        group_size=r.group_size,
    )


def rollout_phase(
    cfg: Config, policy, sampler, rows, state, reward_fns, step: int, dist=SINGLE
) -> Batch:
    """Sample G completions for P prompts, score them, compute advantages.

    With loss.dynamic_sampling, groups whose rewards are all equal (no signal) are dropped and
    new prompts sampled in up to loss.max_sampling_rounds rounds; if still short, dropped
    groups fill the batch so its size stays fixed.

    Under DDP every rank walks the same global prompt order and takes its own slice of each
    draw (a group never spans ranks); sampler seeds come from (seed, rank, step, round).
    """
    G = cfg.rollout.group_size
    P = cfg.train.batch_size // G
    kept: list[tuple] = []  # (rollout piece, rows, rewards, per_fn, texts)
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
        rollout = sampler.sample(
            [rows[i]["prompt_ids"] for i in idx],
            group_size=G,
            max_new_tokens=cfg.rollout.max_new_tokens,
            temperature=cfg.rollout.temperature,
            top_k=cfg.rollout.top_k,
            top_p=cfg.rollout.top_p,
            min_p=cfg.rollout.min_p,
            stop_ids=policy.stop_ids,
            seed=derive_seed(cfg.train.seed, dist.rank, step, round_),
            pad_id=policy.tokenizer.pad_token_id,
        )
        brows = [rows[i] for i in idx for _ in range(G)]
        texts = rollout.decode(policy.tokenizer, skip_special_tokens=True)
        columns = {k: [r[k] for r in brows] for k in brows[0] if k != "prompt_ids"}
        columns["completion_lengths"] = rollout.completion_lens.tolist()
        total, per_fn = compute_rewards(reward_fns, texts, columns)
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
            )
            (spare if cfg.loss.dynamic_sampling and zero[p] else kept).append(piece)
        if all_reduce_sum(float(len(kept) < P), dist) == 0:
            break
    kept = (kept + spare)[:P]
    rollout = _cat_rollouts([k[0] for k in kept], policy.tokenizer.pad_token_id)
    rewards = torch.cat([k[2] for k in kept])
    per_fn = {name: torch.cat([k[3][name] for k in kept]) for name in kept[0][3]}
    batch_std = None
    if cfg.loss.advantage_scale == "batch":  # std over the global batch (all ranks)
        batch_std = all_gather_cat(rewards, dist).std()
    advantages = group_advantages(
        rewards, G, cfg.loss.advantage_scale, cfg.loss.advantage_eps, batch_std=batch_std
    )
    loss_mask = rollout.completion_mask.clone()
    if cfg.loss.mask_truncated_completions:
        loss_mask &= rollout.finished[:, None]
    return Batch(
        rollout=rollout,
        rows=[r for k in kept for r in k[1]],
        rewards=rewards,
        per_fn=per_fn,
        advantages=advantages.to(rollout.ids.device),
        loss_mask=loss_mask,
        texts=[t for k in kept for t in k[4]],
        frac_zero_std=frac_zero,
    )


def _cat_rollouts(pieces: list[Rollout], pad_id: int) -> Rollout:
    """Concatenate rollout pieces of (maybe) different prompt widths and completion lengths."""
    if len(pieces) == 1:
        return pieces[0]
    T_p = max(p.prompt_width for p in pieces)
    T_c = max(p.completion_ids.shape[1] for p in pieces)

    def pad(x, left, right, value):
        return torch.nn.functional.pad(x, (left, right), value=value)

    ids, cids, cmask, lps = [], [], [], []
    for p in pieces:
        dl, dr = T_p - p.prompt_width, T_c - p.completion_ids.shape[1]
        cids.append(pad(p.completion_ids, 0, dr, pad_id))
        ids.append(torch.cat([pad(p.prompt_ids, dl, 0, pad_id), cids[-1]], 1))
        cmask.append(pad(p.completion_mask, 0, dr, False))
        lps.append(pad(p.logprobs, 0, dr, 0.0))
    return Rollout(
        ids=torch.cat(ids),
        prompt_lens=torch.cat([p.prompt_lens for p in pieces]),
        prompt_width=T_p,
        completion_ids=torch.cat(cids),
        completion_mask=torch.cat(cmask),
        completion_lens=torch.cat([p.completion_lens for p in pieces]),
        finished=torch.cat([p.finished for p in pieces]),
        logprobs=torch.cat(lps),
        group_size=pieces[0].group_size,
    )


def micro_batches(B: int, size: int):
    for start in range(0, B, size):
        yield slice(start, min(B, start + size))


def _logprobs(cfg: Config, scorer, batch: Batch, sl: slice, entropy: bool = False):
    """(micro-batch) completion log-probs through `scorer` (a CompletionLogprobs, maybe DDP)."""
    r = batch.rollout
    device = r.ids.device
    with torch.autocast(device.type, torch.bfloat16, enabled=cfg.model.autocast_bf16):
        return scorer(
            r.ids[sl],
            r.attention_mask()[sl],
            r.prompt_width,
            batch.loss_mask[sl],
            cfg.rollout.temperature or 1.0,  # greedy rollouts are scored at T = 1
            return_entropy=entropy,
        )


@torch.no_grad()
def kl_measured(cfg: Config, step: int | None) -> bool:
    """Whether the update that makes `step` (1-based) measures KL to the reference: every
    step with loss.beta > 0, else every log.kl_every-th step (never when it is 0)."""
    if cfg.loss.beta > 0:
        return True
    every = cfg.log.kl_every
    return bool(every) and step is not None and step % every == 0


def reference_phase(cfg: Config, policy, batch: Batch, step: int | None = None) -> None:
    """ref log-probs (B, T_c): the base model via disabled LoRA, or the frozen copy; only on
    the steps that need them (`kl_measured`)."""
    if not kl_measured(cfg, step):
        return
    mb = cfg.train.micro_batch_size or cfg.train.batch_size
    B = batch.rollout.ids.shape[0]
    if policy.ref_model is not None:
        ref = CompletionLogprobs(policy.ref_model)
        parts = [_logprobs(cfg, ref, batch, sl) for sl in micro_batches(B, mb)]
    else:
        with disabled_lora(policy.model):
            ref = CompletionLogprobs(policy.model)
            parts = [_logprobs(cfg, ref, batch, sl) for sl in micro_batches(B, mb)]
    batch.ref_logprobs = torch.cat(parts)


def update_phase(
    cfg: Config, policy, batch: Batch, optimizer, scheduler, params, scorer=None, dist=SINGLE
) -> dict:
    """mu passes over the batch; each pass is one optimizer step over all micro-batches.

    Under DDP the aggregation's normalizer is summed over ranks and each rank's loss is
    multiplied by the world size (DDP averages gradients), so the update equals the
    single-process update on the combined batch; gradients sync on the last micro-batch only.
    """
    model = policy.model
    scorer = scorer if scorer is not None else CompletionLogprobs(model)
    model.train()
    B = batch.rollout.ids.shape[0]
    mb = cfg.train.micro_batch_size or cfg.train.batch_size
    norm = loss_normalizer(batch.loss_mask, cfg.loss.aggregation, cfg.rollout.max_new_tokens)
    norm = all_reduce_sum(norm, dist, batch.rollout.ids.device)
    slices = list(micro_batches(B, mb))
    sums: dict[str, float] = {}
    ratio_max, losses, grad_norms, skipped = 0.0, [], [], 0
    for _ in range(cfg.loss.num_iterations):
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for i, sl in enumerate(slices):
            ref = batch.ref_logprobs[sl] if batch.ref_logprobs is not None else None
            with no_sync(scorer, skip=i < len(slices) - 1):
                logprobs, entropy = _logprobs(cfg, scorer, batch, sl, entropy=True)
                loss, st = policy_loss(
                    logprobs,
                    batch.rollout.logprobs[sl],
                    ref,
                    batch.advantages[sl],
                    batch.loss_mask[sl],
                    cfg.loss,
                    normalizer=norm,
                    max_new_tokens=cfg.rollout.max_new_tokens,
                    entropy=entropy,
                )
                (loss * dist.world_size).backward()  # DDP averages; we want the sum
            total += loss.item()
            w = st["tokens"]
            for k in ("kl", "clip_frac_low", "clip_frac_high", "ratio_mean", "entropy"):
                sums[k] = sums.get(k, 0.0) + st.get(k, 0.0) * w
            sums["tokens"] = sums.get("tokens", 0.0) + w
            sums["policy_loss"] = sums.get("policy_loss", 0.0) + st["policy_loss"]
            ratio_max = max(ratio_max, st["ratio_max"])
        max_norm = cfg.optim.max_grad_norm or math.inf
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        finite = math.isfinite(grad_norm) and math.isfinite(total)
        if all_reduce_sum(float(not finite), dist, batch.rollout.ids.device):
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
    mu, n = max(len(losses), 1), max(sums.get("tokens", 0.0), 1.0)
    out = {f"train/{k}": sums.get(k, 0.0) / n for k in ("clip_frac_low", "clip_frac_high")}
    if batch.ref_logprobs is not None:  # a step without a reference has no KL to report
        out["train/kl"] = sums.get("kl", 0.0) / n
    out.update(
        {
            "train/loss": sum(losses) / mu,
            "train/policy_loss": sums.get("policy_loss", 0.0) / mu,
            "train/ratio_mean": sums.get("ratio_mean", 0.0) / n,
            "train/ratio_max": ratio_max,
            "train/entropy": sums.get("entropy", 0.0) / n,
            "train/grad_norm": sum(grad_norms) / mu if grad_norms else float("nan"),
            "train/nonfinite_skipped": skipped,
            "train/lr": scheduler.get_last_lr()[0],
        }
    )
    if dist.enabled:  # every rank's loss is its share of the global loss: sum them
        device = batch.rollout.ids.device
        keys = ("train/loss", "train/policy_loss", "train/ratio_max", "train/nonfinite_skipped")
        shares = {k: out.pop(k) for k in keys}
        out = all_reduce_mean_dict(out, dist, device)
        out["train/loss"] = all_reduce_sum(shares["train/loss"], dist, device)
        out["train/policy_loss"] = all_reduce_sum(shares["train/policy_loss"], dist, device)
        out["train/ratio_max"] = all_reduce_max(shares["train/ratio_max"], dist, device)
        out["train/nonfinite_skipped"] = shares["train/nonfinite_skipped"]  # same on all ranks
    return out


def rollout_metrics(batch: Batch, G: int) -> dict:
    lens = batch.rollout.completion_lens.float()
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
    return out


def peak_mem_mib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def train_grpo(cfg: Config, resume: bool = False) -> dict:
    """Run GRPO as configured (one process, or one rank of a torchrun job)."""
    cfg.check_grpo()
    dist = init_distributed(resolve_device(cfg.model.device).type)
    try:
        return _train(cfg, resume, dist)
    finally:
        teardown()


def _train(cfg: Config, resume: bool, dist) -> dict:
    from grpo.eval import evaluate

    device = device_for(dist, resolve_device(cfg.model.device))
    seed_everything(cfg.train.seed)
    ckpt = resume_checkpoint(cfg, resume)
    policy = build_policy(cfg, device, need_ref=cfg.loss.beta > 0 or cfg.log.kl_every > 0)
    rows = load_rows(cfg, cfg.data.split, cfg.data.max_samples, "rl", policy.tokenizer)
    eval_rows = None
    if cfg.data.eval_samples and dist.is_main:
        n_eval = cfg.data.eval_samples
        eval_rows = load_rows(cfg, cfg.data.eval_split, n_eval, "rl", policy.tokenizer)
    reward_fns = build_rewards(
        [{"name": r.name, "weight": r.weight, **r.kwargs} for r in cfg.rewards]
    )
    # Only now, with model, data and rewards checked, does the run directory get written.
    run = start_run(cfg, policy, dist, cfg.train.max_steps * cfg.loss.num_iterations, ckpt, resume)
    state, optimizer, scheduler, params = run.state, run.optimizer, run.scheduler, run.params
    policy.model.eval()
    sampler = Sampler(policy.model, compile=cfg.rollout.compile)
    scorer = wrap_ddp(CompletionLogprobs(policy.model), dist, device)
    G = cfg.rollout.group_size
    bad_steps = 0  # consecutive updates skipped as non-finite

    def run_eval() -> dict:
        res = evaluate(
            policy.model, policy.tokenizer, eval_rows, stop_ids=policy.stop_ids,
            max_new_tokens=cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens,
            batch_size=cfg.eval.batch_size,
        )  # fmt: skip
        return {f"eval/{k}": v for k, v in res.summary.items() if isinstance(v, (int, float))}

    metrics: dict = {}
    show = cfg.train.progress and dist.is_main
    bar = tqdm(total=cfg.train.max_steps, initial=state.step, desc="grpo", disable=not show)
    while state.step < cfg.train.max_steps:
        t0 = time.perf_counter()
        batch = rollout_phase(cfg, policy, sampler, rows, state, reward_fns, state.step, dist)
        t1 = time.perf_counter()
        reference_phase(cfg, policy, batch, state.step + 1)
        t2 = time.perf_counter()
        metrics = all_reduce_mean_dict(rollout_metrics(batch, G), dist, device)
        metrics.update(update_phase(cfg, policy, batch, optimizer, scheduler, params, scorer, dist))
        t3 = time.perf_counter()
        state.step += 1
        tokens = all_reduce_sum(int(batch.rollout.completion_mask.sum()), dist, device)
        metrics.update(
            {
                "perf/step_s": t3 - t0,
                "perf/rollout_s": t1 - t0,
                "perf/logprob_s": t2 - t1,
                "perf/update_s": t3 - t2,
                "perf/tokens_per_s": tokens / max(t3 - t0, 1e-9),
                "perf/peak_mem_mib": peak_mem_mib(device),
            }
        )
        skipped = int(metrics["train/nonfinite_skipped"])
        bad_steps = bad_steps + skipped if skipped else 0
        last = state.step == cfg.train.max_steps
        if eval_rows and due(state.step, cfg.train.eval_every, last):
            metrics.update(run_eval())
        if state.step % cfg.train.log_every == 0 or last:
            run.logger.log(state.step, metrics)
        if dist.is_main and cfg.train.sample_every and state.step % cfg.train.sample_every == 0:
            tqdm.write(f"[sample] reward {float(batch.rewards[0]):.2f}: {batch.texts[0]!r}")
        if bad_steps >= cfg.train.max_nonfinite_steps:
            raise GrpoError(
                f"{bad_steps} consecutive updates had a non-finite loss or gradient (step "
                f"{state.step}); stopped. Lower optim.lr or check the rewards; resume from the "
                "last checkpoint with --resume"
            )
        run.end_step(policy, dist, last)
        bar.update(1)
    bar.close()
    return run.finish(policy, dist, metrics)

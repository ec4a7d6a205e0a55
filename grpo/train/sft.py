"""Supervised fine-tuning on worked solutions: completion-only token-mean cross-entropy.

Each example is a left-padded prompt followed by its completion; only completion tokens count
(prompt tokens are masked), and the loss of a step is the mean over all completion tokens of
the step's batch, so micro-batches with gradient accumulation equal one full batch.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Callable

import numpy as np
import torch
from tqdm.auto import tqdm

from grpo.algo.logprobs import CompletionLogprobs
from grpo.checks import check_config
from grpo.config import Config
from grpo.distributed import (
    Where,
    all_reduce_max,
    all_reduce_sum,
    clip_grad_norm,
    device_for,
    no_sync,
    rank_local,
    wrap_ddp,
)
from grpo.experience.batch import micro_batch_count, micro_batches, next_prompts, token_slices
from grpo.loading import load_rows, resolve_device
from grpo.models.packed_rows import pack_rows, packed_overhead
from grpo.models.varlen import packs_sequences
from grpo.policy import Policy, build_policy, shard_policy
from grpo.run.loop import RunDir, run_training, start_run
from grpo.run.optim import nonfinite_weights_error, weights_finite
from grpo.run.perf import peak_mem_mib, reset_peak_mem
from grpo.run.preflight import check_prompt_room, preflight
from grpo.run.rundir import check_resume_step
from grpo.run.state import seed_everything

log = logging.getLogger(__name__)


def tokenize_sft(rows: list[dict], tokenizer, max_completion: int) -> list[dict]:
    """Add `completion_ids` (truncated to max_completion tokens) to SFT rows."""
    for row in rows:
        ids = tokenizer(row["completion"], add_special_tokens=False)["input_ids"]
        row["completion_ids"] = ids[:max_completion]
    return rows


def collate(rows: list[dict], pad_id: int, device, packed_overhead: int | None = None) -> dict:
    """Left-padded prompts + right-padded completions, with masks from lengths.

    Args:
        packed_overhead: pack the rows (train.pack_sequences) with this attention-bucket cost
            (`grpo.algo.logprobs.packed_overhead`); None: padded.

    Returns:
        ids (B, T_p + T_c), attention_mask (same, bool), completion_mask (B, T_c) bool,
        prompt_width T_p, and `packed` (`grpo.algo.logprobs.PackedRows`) or None.
    """
    T_p = max(len(r["prompt_ids"]) for r in rows)
    T_c = max(len(r["completion_ids"]) for r in rows)
    B = len(rows)
    ids = torch.full((B, T_p + T_c), pad_id, dtype=torch.long)
    attn = torch.zeros(B, T_p + T_c, dtype=torch.bool)
    for b, r in enumerate(rows):
        p, c = r["prompt_ids"], r["completion_ids"]
        ids[b, T_p - len(p) : T_p] = torch.tensor(p)
        ids[b, T_p : T_p + len(c)] = torch.tensor(c)
        attn[b, T_p - len(p) : T_p + len(c)] = True
    packed = None
    if packed_overhead is not None:
        packed = pack_rows(attn, T_p, attn[:, T_p:], None, packed_overhead, device)
    return {
        "ids": ids.to(device),
        "attention_mask": attn.to(device),
        "completion_mask": attn[:, T_p:].to(device),
        "prompt_width": T_p,
        "packed": packed,
    }


def sft_loss(cfg: Config, scorer, batch: dict, normalizer: float) -> tuple[torch.Tensor, int]:
    """sum of -log p(completion tokens) / normalizer, and the number of tokens.

    Args:
        scorer: a `CompletionLogprobs` (maybe DDP-wrapped) around the model.
    """
    logprobs = scorer(  # under the policy's autocast (CompletionLogprobs)
        batch["ids"],
        batch["attention_mask"],
        batch["prompt_width"],
        batch["completion_mask"],
        packed=batch.get("packed"),
    )  # (B, T_c), 0 where masked
    return -logprobs.sum() / normalizer, int(batch["completion_mask"].sum())


def sft_update(
    cfg: Config,
    policy: Policy,
    scorer,
    batch_rows,
    optimizer,
    scheduler,
    params,
    dist,
    step: int | None = None,
):
    """One optimizer step on this rank's rows; returns (loss share, tokens, grad norm).

    A non-finite loss or gradient on any rank skips the step (the returned values show it).
    An update that leaves a weight NaN or inf (on any rank) raises GrpoError naming `step`
    (one host read after the update).

    The token-mean is over the completion tokens of the global batch (all micro-batches and
    ranks), so accumulation and DDP give the update of one full batch in one process.
    """
    device = policy.device
    local = float(sum(len(r["completion_ids"]) for r in batch_rows))
    norm = all_reduce_sum(local, dist)  # completion tokens of the global batch
    policy.model.train()
    optimizer.zero_grad(set_to_none=True)
    total, tokens = torch.zeros((), dtype=torch.float64, device=device), 0  # summed on device
    slices = sft_slices(cfg, batch_rows, dist)
    packed = packs_sequences(cfg.train.pack_sequences, device, cfg.train.micro_batch_tokens)
    overhead = packed_overhead(policy.model) if packed else None
    for i, sl in enumerate(slices):
        batch = collate(batch_rows[sl], policy.tokenizer.pad_token_id, device, overhead)
        with no_sync(scorer, skip=i < len(slices) - 1):
            loss, n = sft_loss(cfg, scorer, batch, norm)
            (loss * dist.world_size).backward()  # DDP averages; we want the sum
        total, tokens = total + loss.detach(), tokens + n  # float64: as Python floats sum
    grad_norm = clip_grad_norm(params, cfg.optim.max_grad_norm or np.inf)
    total, grad_norm = torch.stack([total, grad_norm.to(total)]).tolist()  # the one host read
    policy.model.eval()
    finite = math.isfinite(total) and math.isfinite(grad_norm)
    if all_reduce_sum(float(not finite), dist):  # skip the update on every rank
        log.warning("non-finite loss (%s) or grad norm (%s): update skipped", total, grad_norm)
        optimizer.zero_grad(set_to_none=True)
        return total, tokens, grad_norm
    lr = scheduler.get_last_lr()[0]
    optimizer.step()
    scheduler.step()
    if all_reduce_sum(float(not weights_finite(params)), dist):  # before any checkpoint of it
        raise nonfinite_weights_error(step, total, grad_norm, lr)
    return total, tokens, grad_norm


def sft_slices(cfg: Config, batch_rows: list[dict], dist) -> list[slice]:
    """This rank's micro-batches: train.micro_batch_size rows, or (train.micro_batch_tokens)
    consecutive rows of at most that many tokens, as many on every rank (`token_slices`)."""
    budget = cfg.train.micro_batch_tokens
    if budget is None:
        return list(micro_batches(len(batch_rows), cfg.train.micro_batch_size or len(batch_rows)))
    costs = [len(r["prompt_ids"]) + len(r["completion_ids"]) for r in batch_rows]
    count = int(all_reduce_max(micro_batch_count(costs, budget), dist))
    return token_slices(costs, budget, count)


def total_sft_steps(cfg: Config, n_rows: int) -> int:
    if cfg.train.epochs is None:
        return cfg.train.max_steps
    return max(1, math.ceil(cfg.train.epochs * n_rows / cfg.train.batch_size))


def train_sft(
    cfg: Config,
    resume: bool | str = False,
    on_step: Callable[[int, dict], None] | None = None,
    overwrite: bool = False,
) -> dict:
    """Run SFT as configured (one process, or one rank of a torchrun job); `resume`,
    `on_step` and `overwrite` mean what they mean for `train_grpo`, and so does the summary
    returned (output_dir, final, step and the last step's metrics)."""
    check_config(cfg, "sft")  # the names, before anything loads
    return run_training(cfg, "sft", resume, overwrite, _train, on_step)


def _train(cfg: Config, rundir: RunDir, dist, on_step, where: Where, roles=None) -> dict:
    from grpo.eval import evaluate_policy

    device = device_for(dist, resolve_device(cfg.model.device))
    mc = preflight(cfg, "sft", device, world_size=dist.world_size)  # before any load or write
    seed_everything(cfg.train.seed)
    policy = build_policy(cfg, device, need_ref=False)
    sharded = shard_policy(policy, cfg, dist)  # train.parallel: fsdp (before the optimizer)
    tok = policy.tokenizer
    rows = load_rows(cfg.data, cfg.data.split, cfg.data.max_samples, "sft", tok)
    rows = tokenize_sft(rows, tok, cfg.rollout.max_new_tokens)
    eval_rows = None
    with rank_local(dist, where):  # rank 0 alone loads them: its failure stops every rank
        if cfg.data.eval_samples and dist.is_main:
            eval_rows = load_rows(cfg.data, cfg.data.eval_split, cfg.data.eval_samples, "rl", tok)
        check_prompt_room(cfg, mc, "sft", rows, eval_rows)
    steps = total_sft_steps(cfg, len(rows) // dist.world_size)
    # --resume past the run's end (train.max_steps was checked before anything loaded; the
    # steps of train.epochs depend on the data), before anything is written
    if cfg.train.epochs is not None and rundir.checkpoint is not None:
        limit = f"train.epochs={cfg.train.epochs:g} ({steps} steps)"
        check_resume_step(rundir.path, rundir.checkpoint, steps, limit, dist.rank)
    run = start_run(cfg, policy, dist, steps, rundir)  # inputs checked: now write outputs
    state, optimizer, scheduler, params = run.state, run.optimizer, run.scheduler, run.params
    scorer = wrap_ddp(CompletionLogprobs(policy.model, policy.precision), dist, device)
    B = cfg.train.batch_size
    metrics: dict = {}

    run_eval = functools.partial(evaluate_policy, cfg, policy, eval_rows, env=False)

    show = cfg.train.progress and dist.is_main
    bar = tqdm(total=steps, initial=state.step, desc="sft", disable=not show)
    while state.step < steps:
        t0 = time.perf_counter()
        where.step, where.phase = state.step + 1, "update"
        reset_peak_mem(device)  # perf/peak_mem_mib: this step's peak
        # every rank walks the same global order and takes its own slice of the global batch
        idx = next_prompts(state, len(rows), B * dist.world_size, cfg.train.seed)
        batch_rows = [rows[i] for i in idx[dist.rank * B : (dist.rank + 1) * B]]
        lr = scheduler.get_last_lr()[0]  # this update's; after it, the next one's
        total, tokens, grad_norm = sft_update(
            cfg, policy, scorer, batch_rows, optimizer, scheduler, params, dist, state.step + 1
        )
        state.step += 1
        loss = all_reduce_sum(total, dist)  # the global batch's: every rank counts alike
        dt = time.perf_counter() - t0
        metrics = {
            "train/loss": loss,
            "train/grad_norm": grad_norm,
            # skipped on every rank alike: the guard it feeds (Run.end_of_step) is collective
            "train/nonfinite_skipped": int(not (math.isfinite(loss) and math.isfinite(grad_norm))),
            "train/lr": lr,
            "train/epoch": state.epoch + state.data_index / len(rows),
            "perf/step_s": dt,
            "perf/tokens_per_s": all_reduce_sum(tokens, dist) / max(dt, 1e-9),
            "perf/peak_mem_mib": peak_mem_mib(device),
        }
        # evaluation, logging, the non-finite guard, the checkpoint (grpo/run/loop.py)
        run.end_of_step(
            policy, dist, where, metrics, state.step == steps, on_step, run_eval, sharded
        )
        bar.update(1)
    bar.close()
    return run.finish(policy, dist, metrics)

"""`grpo rm`: a Bradley-Terry reward model trained on preference pairs.

The model is the checkpoint's decoder with a scalar `score` head (a sequence classifier,
`grpo.models.classifier`) read at each sequence's last real token. For a pair (x, y_c, y_r)
with an optional margin m (the rows' ``margin`` column):

    loss = -log sigmoid(r(x, y_c) - r(x, y_r) - m) + center_coef * (r(x, y_c) + r(x, y_r))^2

averaged over the pairs of the global batch (every micro-batch and rank), so accumulation and
DDP / FSDP give the update of one full batch in one process. The run directory, checkpoints,
exact resume, LoRA or full fine-tuning, precision policy and torchrun are `grpo sft`'s. The
final weights (out/final) are a Hugging Face `*ForSequenceClassification` checkpoint (LoRA
merged) with the tokenizer, that `transformers` and the `reward_model` reward load.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from grpo.algo.preference import collate_pairs, pair_loss
from grpo.checks import check_config
from grpo.config import Config
from grpo.distributed import (
    Where,
    all_reduce_sum,
    clip_grad_norm,
    device_for,
    no_sync,
    wrap_ddp,
)
from grpo.errors import GrpoError
from grpo.experience.batch import micro_batches, next_prompts
from grpo.loading import resolve_device
from grpo.models.classifier import sequence_scores
from grpo.policy import Policy, shard_policy
from grpo.precision import Precision
from grpo.run.loop import RunDir, run_training, start_run
from grpo.run.optim import nonfinite_weights_error, weights_finite
from grpo.run.perf import peak_mem_mib, reset_peak_mem
from grpo.run.rundir import check_resume_step
from grpo.run.state import seed_everything
from grpo.train.sft import total_sft_steps

log = logging.getLogger(__name__)


class PairScorer(torch.nn.Module):
    """Both sides of a micro-batch of pairs scored in one forward (so DDP wraps the decoder
    and the head together and syncs every trainable gradient), under the precision policy's
    autocast; float32 scores."""

    def __init__(self, model: torch.nn.Module, precision: Precision, pad_id: int):
        super().__init__()
        self.model, self.precision, self.pad_id = model, precision, pad_id

    def forward(self, ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        with self.precision.autocast(ids.device):
            return sequence_scores(self.model, ids, attention_mask, self.pad_id)[:, 0]


def pair_stats(
    scorer,
    pairs: list,
    pad_id: int,
    device,
    center_coef: float,
    normalizer: float,
    weights: torch.Tensor | None = None,
):
    """Score one micro-batch: (loss / normalizer with its graph, detached (loss sum, correct
    pairs, margin sum, score sum) as a float64 (4,) tensor). `weights` (N,) 0/1 drops padding
    pairs from every number (an evaluation's filler)."""
    batch = collate_pairs(pairs, pad_id, device)
    scores = scorer(batch["ids"], batch["attention_mask"])  # (2N,)
    n = len(pairs)
    chosen, rejected = scores[:n], scores[n:]
    losses = pair_loss(chosen, rejected, batch["margin"], center_coef)
    w = torch.ones(n, device=device) if weights is None else weights.to(device)
    loss = (losses * w).sum() / normalizer
    with torch.no_grad():
        diff = chosen - rejected
        stats = torch.stack(
            [
                (losses * w).sum(),
                ((diff > 0).float() * w).sum(),
                (diff * w).sum(),
                ((chosen + rejected) * w).sum(),
            ]
        )
    return loss, stats.double()


def rm_update(
    cfg: Config,
    model: Policy,
    scorer,
    batch_pairs: list,
    optimizer,
    scheduler,
    params,
    dist,
    step: int | None = None,
):
    """One optimizer step on this rank's pairs; returns the global batch's (loss, accuracy,
    mean margin, mean score, grad norm). A non-finite loss or gradient on any rank skips the
    step; an update that leaves a weight non-finite raises GrpoError naming `step`."""
    device = model.device
    norm = all_reduce_sum(float(len(batch_pairs)), dist)  # pairs of the global batch
    model.model.train()
    optimizer.zero_grad(set_to_none=True)
    totals = torch.zeros(4, dtype=torch.float64, device=device)
    slices = list(micro_batches(len(batch_pairs), cfg.train.micro_batch_size or len(batch_pairs)))
    pad = scorer_pad(scorer)
    for i, sl in enumerate(slices):
        with no_sync(scorer, skip=i < len(slices) - 1):
            loss, stats = pair_stats(scorer, batch_pairs[sl], pad, device, cfg.rm.center_coef, norm)
            (loss * dist.world_size).backward()  # DDP averages; we want the sum
        totals = totals + stats
    grad_norm = clip_grad_norm(params, cfg.optim.max_grad_norm or np.inf)
    values = torch.cat([totals, grad_norm.to(totals)[None]])
    model.model.eval()
    *sums, grad_norm = values.tolist()  # the one host read
    sums = [all_reduce_sum(x, dist) / norm for x in sums]  # means over the global batch
    loss, accuracy, margin, score = sums
    score /= 2  # the mean of both sides
    finite = math.isfinite(loss) and math.isfinite(grad_norm)
    if all_reduce_sum(float(not finite), dist):  # skip the update on every rank
        log.warning("non-finite loss (%s) or grad norm (%s): update skipped", loss, grad_norm)
        optimizer.zero_grad(set_to_none=True)
        return loss, accuracy, margin, score, grad_norm
    lr = scheduler.get_last_lr()[0]
    optimizer.step()
    scheduler.step()
    if all_reduce_sum(float(not weights_finite(params)), dist):  # before any checkpoint of it
        raise nonfinite_weights_error(step, loss, grad_norm, lr)
    return loss, accuracy, margin, score, grad_norm


def scorer_pad(scorer) -> int:
    """The pad id of a (maybe DDP-wrapped) `PairScorer`."""
    return getattr(scorer, "module", scorer).pad_id


@torch.no_grad()
def evaluate_pairs(cfg: Config, scorer, pairs: list, device, dist) -> dict[str, float]:
    """Held-out loss, pair accuracy, mean margin and mean score over `pairs`, every rank
    scoring its share (as many forwards on each, so an FSDP model's collectives pair up)."""
    world, rank = dist.world_size, dist.rank
    mine = pairs[rank::world]
    per_rank = -(-len(pairs) // world)
    weights = torch.ones(per_rank)
    weights[len(mine) :] = 0  # filler pairs count for nothing
    mine = mine + [pairs[0]] * (per_rank - len(mine))
    inner = getattr(scorer, "module", scorer)  # no gradient: DDP's forward hooks not needed
    totals = torch.zeros(4, dtype=torch.float64, device=device)
    size = cfg.train.micro_batch_size or cfg.train.batch_size
    for sl in micro_batches(len(mine), size):
        _, stats = pair_stats(
            inner, mine[sl], inner.pad_id, device, cfg.rm.center_coef, 1.0, weights[sl]
        )
        totals += stats
    loss, accuracy, margin, score = (all_reduce_sum(x, dist) / len(pairs) for x in totals.tolist())
    return {
        "loss": loss,
        "accuracy": accuracy,
        "margin": margin,
        "score": score / 2,
        "pairs": len(pairs),
    }


def build_reward_model(cfg: Config, device: torch.device) -> Policy:
    """The model to train: model.path's decoder with a zero `score` head (a causal LM's head
    dropped), or a classifier checkpoint as it is; LoRA (the head trains too) or every weight
    trainable; the precision policy applied. Returned as a `Policy` (no reference, no stop
    ids), so the run's checkpoints, FSDP and final save treat it as they treat a policy."""
    from grpo.lora import apply_lora
    from grpo.models import load_model
    from grpo.models.hf_checkpoint import resolve_model_dir
    from grpo.tokenizer import load_tokenizer

    precision = Precision.from_config(cfg.model)
    if cfg.model.adapter or cfg.lora.adapter:
        field = "model.adapter" if cfg.model.adapter else "lora.adapter"
        raise GrpoError(
            f"{field}: `grpo rm` starts from a checkpoint directory; merge the "
            "adapter first (grpo merge)"
        )
    tok = load_tokenizer(cfg.model.tokenizer or cfg.model.path)
    pad = reward_pad_id(cfg, tok)
    model_dir = resolve_model_dir(cfg.model.path)
    model = load_model(model_dir, cfg.model.dtype, device, num_labels=1, pad_token_id=pad)
    if model.config.pad_token_id != pad:  # a classifier checkpoint names its own
        import dataclasses

        model.config = dataclasses.replace(model.config, pad_token_id=pad)
    if cfg.lora.enabled:
        apply_lora(
            model,
            rank=cfg.lora.rank,
            alpha=cfg.lora.alpha,
            dropout=cfg.lora.dropout,
            targets=cfg.lora.targets,
            seed=cfg.train.seed,
        )
        model.score.weight.requires_grad_(True)  # the head is new: it always trains
    else:
        for p in model.parameters():
            p.requires_grad_(True)
    model.gradient_checkpointing = cfg.model.gradient_checkpointing
    precision.prepare(model)
    log.info("precision: %s", precision.describe(device))
    return Policy(
        model, tok, [], None, Path(model_dir), cfg.lora.enabled, precision, torch.device(device)
    )


def reward_pad_id(cfg: Config, tokenizer) -> int:
    """rm.pad_token_id, else the tokenizer's pad id, else its eos id."""
    for pad in (cfg.rm.pad_token_id, tokenizer.pad_token_id, tokenizer.eos_token_id):
        if pad is not None:
            return int(pad)
    raise GrpoError("rm.pad_token_id: the tokenizer has no pad or eos token; set one")


def check_rm(cfg: Config) -> None:
    """What `grpo rm` checks before loading anything: the output directory, and that a pair
    fits the model's context (rm.max_length)."""
    from grpo.models.decoder import meta_decoder
    from grpo.run.preflight import (
        PreflightError,
        check_lora,
        check_output_dir,
        read_model_config,
    )

    problems = []
    try:
        check_output_dir(cfg.train.output_dir, "train.output_dir")
    except PreflightError as e:
        problems.append(str(e))
    mc, source = read_model_config(cfg.model.path)
    pad = cfg.rm.pad_token_id
    if pad is not None and pad >= mc.vocab_size:
        problems.append(
            f"rm.pad_token_id: {pad} is not a token of the model (vocabulary of "
            f"{mc.vocab_size}, {source})"
        )
    if cfg.rm.max_length > mc.max_position_embeddings:
        problems.append(
            f"rm.max_length: {cfg.rm.max_length} tokens exceed the model's "
            f"context ({mc.max_position_embeddings}, {source})"
        )
    try:
        check_lora(cfg, meta_decoder(mc))
    except PreflightError as e:
        problems.append(str(e))
    if problems:
        raise PreflightError("; ".join(problems))


def load_pairs(cfg: Config, split: str, max_samples: int | None, tokenizer) -> list:
    """The preference pairs of `split` (grpo.data.preferences), over-length ones skipped with
    one log line counting them; none left is an error naming the split."""
    from grpo.data.preferences import load_preference_rows, preference_pairs

    source = f"data {cfg.data.dataset!r} ({split})"
    rows = load_preference_rows(cfg.data.dataset, split, max_samples)
    pairs, skipped = preference_pairs(rows, tokenizer, cfg.rm.max_length, source)
    if skipped:
        log.warning(
            "%s: %d of %d pairs skipped: a completion longer than rm.max_length (%d)",
            source,
            skipped,
            len(rows),
            cfg.rm.max_length,
        )
    if not pairs:
        raise GrpoError(f"{source}: no pair fits rm.max_length ({cfg.rm.max_length})")
    return pairs


def train_rm(
    cfg: Config,
    resume: bool | str = False,
    on_step: Callable[[int, dict], None] | None = None,
    overwrite: bool = False,
) -> dict:
    """Train a reward model as configured (one process, or one rank of a torchrun job);
    `resume`, `on_step`, `overwrite` and the summary returned are `train_sft`'s."""
    check_config(cfg, "rm")  # the names, before anything loads
    return run_training(cfg, "rm", resume, overwrite, _train, on_step)


def _train(cfg: Config, rundir: RunDir, dist, on_step, where: Where, roles=None) -> dict:
    device = device_for(dist, resolve_device(cfg.model.device))
    check_rm(cfg)  # before any load or write
    seed_everything(cfg.train.seed)
    policy = build_reward_model(cfg, device)
    shard_policy(policy, cfg, dist)  # train.parallel: fsdp (before the optimizer)
    tok = policy.tokenizer
    pairs = load_pairs(cfg, cfg.data.split, cfg.data.max_samples, tok)
    eval_pairs = []
    if cfg.data.eval_samples:
        eval_pairs = load_pairs(cfg, cfg.data.eval_split, cfg.data.eval_samples, tok)
    steps = total_sft_steps(cfg, len(pairs) // dist.world_size)  # pairs count as rows
    if cfg.train.epochs is not None and rundir.checkpoint is not None:
        limit = f"train.epochs={cfg.train.epochs:g} ({steps} steps)"
        check_resume_step(rundir.path, rundir.checkpoint, steps, limit, dist.rank)
    header = {
        "run/reward_model": f"pairs {len(pairs)} train / {len(eval_pairs)} held out, "
        f"pad id {policy.model.config.pad_token_id}"
    }
    run = start_run(cfg, policy, dist, steps, rundir, header)
    state, optimizer, scheduler, params = run.state, run.optimizer, run.scheduler, run.params
    pad = policy.model.config.pad_token_id
    scorer = wrap_ddp(PairScorer(policy.model, policy.precision, pad), dist, device)
    B = cfg.train.batch_size
    metrics: dict = {}

    def run_eval() -> dict:  # every rank scores its share of the held-out pairs
        if not eval_pairs:
            return {}
        policy.model.eval()
        return {
            f"eval/{k}": v for k, v in evaluate_pairs(cfg, scorer, eval_pairs, device, dist).items()
        }

    show = cfg.train.progress and dist.is_main
    bar = tqdm(total=steps, initial=state.step, desc="rm", disable=not show)
    while state.step < steps:
        t0 = time.perf_counter()
        where.step, where.phase = state.step + 1, "update"
        reset_peak_mem(device)
        idx = next_prompts(state, len(pairs), B * dist.world_size, cfg.train.seed)
        batch = [pairs[i] for i in idx[dist.rank * B : (dist.rank + 1) * B]]
        lr = scheduler.get_last_lr()[0]
        loss, accuracy, margin, score, grad_norm = rm_update(
            cfg, policy, scorer, batch, optimizer, scheduler, params, dist, state.step + 1
        )
        state.step += 1
        dt = time.perf_counter() - t0
        tokens = sum(2 * len(p.prompt_ids) + len(p.chosen_ids) + len(p.rejected_ids) for p in batch)
        metrics = {
            "train/loss": loss,
            "train/accuracy": accuracy,
            "train/margin": margin,
            "train/score_mean": score,
            "train/grad_norm": grad_norm,
            "train/nonfinite_skipped": int(not (math.isfinite(loss) and math.isfinite(grad_norm))),
            "train/lr": lr,
            "train/epoch": state.epoch + state.data_index / len(pairs),
            "perf/step_s": dt,
            "perf/tokens_per_s": all_reduce_sum(tokens, dist) / max(dt, 1e-9),
            "perf/peak_mem_mib": peak_mem_mib(device),
        }
        # evaluation (collective: every rank scores pairs), logging, the non-finite guard, the
        # checkpoint (grpo/run/loop.py)
        last = state.step == steps
        run.end_of_step(policy, dist, where, metrics, last, on_step, run_eval, collective_eval=True)
        bar.update(1)
    bar.close()
    return run.finish(policy, dist, metrics)

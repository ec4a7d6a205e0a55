"""The GRPO objective as pure functions: importance ratios, clipped surrogate, KL, aggregation.

Per token t of completion i (log-ratios are log pi_theta - log pi_old):

    rho      = exp(logprobs - old_logprobs)                      importance_level="token"
             = exp(mean_t(logprobs - old_logprobs)) per row      importance_level="sequence" (GSPO)
    surr     = min(rho * A, clip(rho, 1 - eps_low, 1 + eps_high) * A)
    surr     = max(surr, c * A)  where A < 0                       dual clip, c > 1
    loss_t   = -surr + beta * KL_t(logprobs, ref_logprobs)

and the KL estimators, with d = ref_logprobs - logprobs (samples come from pi_theta):

    k1 = -d          k2 = d^2 / 2          k3 = exp(d) - d - 1  (>= 0, exact 0 at d = 0)

Aggregation over the *global* batch (all micro-batches and ranks); each micro-batch returns
its share, sum(...) / normalizer, so that accumulating micro-batches gives the full-batch
gradient exactly:

    token_mean               sum_{i,t} loss_t / (number of completion tokens)        (DAPO)
    seq_mean_token_mean      sum_i (sum_t loss_t / len_i) / (number of completions)  (GRPO)
    seq_mean_token_sum_norm  sum_{i,t} loss_t / (number of completions * T_max)    (Dr. GRPO)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")


@dataclass(frozen=True)
class LossSettings:
    """The subset of `grpo.config.LossConfig` the loss reads (duck-typed: either works)."""

    beta: float = 0.0
    kl_estimator: str = "k3"
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    dual_clip: float | None = None
    importance_level: str = "token"
    aggregation: str = "token_mean"


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k3"):
    """Per-token estimate of KL(pi_theta || pi_ref) from samples of pi_theta (same shape)."""
    d = ref_logprobs - logprobs
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return 0.5 * d.square()
    if estimator == "k3":
        return torch.exp(d) - d - 1.0
    raise ValueError(f"kl_estimator must be k1, k2 or k3, got {estimator!r}")


def loss_normalizer(completion_mask: torch.Tensor, aggregation: str, max_new_tokens: int) -> float:
    """The denominator of `aggregation` for this batch (sum it over micro-batches and ranks).

    Args:
        completion_mask: (B, T_c) bool, True = token counts.
        aggregation: one of AGGREGATIONS.
        max_new_tokens: T_max, Dr. GRPO's constant length normalizer.
    """
    if aggregation == "token_mean":
        return float(completion_mask.sum())
    if aggregation == "seq_mean_token_mean":
        return float(completion_mask.shape[0])
    if aggregation == "seq_mean_token_sum_norm":
        return float(completion_mask.shape[0] * max_new_tokens)
    raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")


def aggregate(values: torch.Tensor, mask: torch.Tensor, aggregation: str, normalizer: float):
    """sum of masked per-token `values` (B, T_c) under `aggregation`, divided by normalizer."""
    mask = mask.to(values.dtype)
    if aggregation == "seq_mean_token_mean":
        per_seq = (values * mask).sum(-1) / mask.sum(-1).clamp(min=1)  # (B,)
        return per_seq.sum() / normalizer
    if aggregation in ("token_mean", "seq_mean_token_sum_norm"):
        return (values * mask).sum() / normalizer
    raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor | None,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor,
    cfg,
    normalizer: float | None = None,
    max_new_tokens: int | None = None,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The clipped GRPO loss of one (micro-)batch and its statistics.

    Args:
        logprobs: (B, T_c) log pi_theta of the sampled tokens (requires grad).
        old_logprobs: (B, T_c) log pi_old, from the sampler (no grad).
        ref_logprobs: (B, T_c) log pi_ref; None when cfg.beta == 0 (given with beta == 0, the
            KL is measured for the stats but stays out of the loss).
        advantages: (B,) one advantage per completion.
        completion_mask: (B, T_c) bool, True = token counts (truncated rows already removed
            when mask_truncated_completions is on).
        cfg: a `LossConfig` / `LossSettings`.
        normalizer: the aggregation's denominator over the global batch; default: this batch's
            own (`loss_normalizer`), i.e. the batch is the whole batch.
        max_new_tokens: T_max for seq_mean_token_sum_norm (default: T_c).
        entropy: (B, T_c) per-token entropy for the stats, if computed.

    Returns:
        loss (scalar, differentiable) and a dict of float stats over this batch's tokens:
        policy_loss, kl, clip_frac_low, clip_frac_high, ratio_mean, ratio_max, [entropy].
    """
    mask = completion_mask.bool()  # (B, T_c)
    fmask = mask.to(logprobs.dtype)
    if normalizer is None:
        normalizer = loss_normalizer(mask, cfg.aggregation, max_new_tokens or mask.shape[1])
    normalizer = max(float(normalizer), 1.0)

    log_ratio = logprobs - old_logprobs  # (B, T_c)
    if cfg.importance_level == "sequence":  # GSPO: one ratio per row, length-normalized
        seq = (log_ratio * fmask).sum(-1, keepdim=True) / fmask.sum(-1, keepdim=True).clamp(min=1)
        log_ratio = seq.expand_as(logprobs)  # (B, T_c), gradient flows to every token
    elif cfg.importance_level != "token":
        raise ValueError(f"importance_level must be token or sequence, got {cfg.importance_level}")
    ratio = torch.exp(log_ratio)  # (B, T_c)

    A = advantages.to(logprobs.dtype)[:, None]  # (B, 1)
    clipped = torch.clamp(ratio, 1.0 - cfg.epsilon_low, 1.0 + cfg.epsilon_high)
    surrogate = torch.minimum(ratio * A, clipped * A)  # (B, T_c)
    if cfg.dual_clip is not None:  # bound the loss of very unlikely negative-advantage tokens
        surrogate = torch.where(A < 0, torch.maximum(surrogate, cfg.dual_clip * A), surrogate)
    per_token = -surrogate
    kl = None
    if cfg.beta > 0:
        if ref_logprobs is None:
            raise ValueError("beta > 0 needs ref_logprobs")
        kl = kl_penalty(logprobs, ref_logprobs, cfg.kl_estimator)
        per_token = per_token + cfg.beta * kl
    elif ref_logprobs is not None:  # measured for the logs only: not part of the loss
        with torch.no_grad():
            kl = kl_penalty(logprobs, ref_logprobs, cfg.kl_estimator)

    loss = aggregate(per_token, mask, cfg.aggregation, normalizer)

    with torch.no_grad():
        n = fmask.sum().clamp(min=1)
        low = ((ratio < 1.0 - cfg.epsilon_low) & (A < 0) & mask).sum() / n
        high = ((ratio > 1.0 + cfg.epsilon_high) & (A > 0) & mask).sum() / n
        stats = {
            "policy_loss": float(aggregate(-surrogate, mask, cfg.aggregation, normalizer)),
            "kl": float((kl * fmask).sum() / n) if kl is not None else 0.0,
            "clip_frac_low": float(low),
            "clip_frac_high": float(high),
            "ratio_mean": float((ratio * fmask).sum() / n),
            "ratio_max": float(ratio.masked_fill(~mask, float("-inf")).max())
            if mask.any()
            else 1.0,
            "tokens": float(fmask.sum()),
        }
        if entropy is not None:
            stats["entropy"] = float((entropy * fmask).sum() / n)
    return loss, stats

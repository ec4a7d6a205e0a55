"""The GRPO objective around a registered policy loss: KL, entropy, importance weights, aggregation.

Per token t of completion i:

    pg_t     = policy_loss(logprobs, old_logprobs, advantages, ...)    (`grpo.algo.policy_losses`)
    pg_t     = w_t * pg_t,  w_t = min(pi_old_trainer / pi_sampler, tis_cap)   with loss.tis_cap
    loss_t   = pg_t + beta * KL_t(logprobs, ref_logprobs) - entropy_coef * H_t

KL estimators are in `grpo.algo.kl`. Aggregation over the *global* batch (all micro-batches
and ranks); each micro-batch returns its share, sum(...) / normalizer, so that accumulating
micro-batches gives the full-batch gradient exactly:

    token_mean               sum_{i,t} loss_t / (number of completion tokens)        (DAPO)
    seq_mean_token_mean      sum_i (sum_t loss_t / len_i) / (number of completions)  (GRPO)
    seq_mean_token_sum_norm  sum_{i,t} loss_t / (number of completions * T_max)    (Dr. GRPO)

Masked positions never reach the arithmetic: every input is replaced by 0 there (torch.where,
not a multiplication) before the policy loss sees it, and sums select, so a NaN or inf at a
padded position cannot poison the loss or its gradient.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from grpo.algo import policy_losses
from grpo.algo.kl import kl_penalty
from grpo.algo.registry import KL_ESTIMATORS, POLICY_LOSSES
from grpo.errors import GrpoError

AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")


@dataclass(frozen=True)
class LossSettings:
    """The fields of `grpo.config.LossConfig` the loss reads (duck-typed: either works), with
    beta 0, for callers that hand a policy loss in as a function (the conformance kit,
    benchmarks), which `LossConfig` refuses: it takes registered names only."""

    policy_loss: str = "clip"
    policy_loss_kwargs: dict = field(default_factory=dict)
    beta: float = 0.0
    kl_estimator: str = "k3"
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    dual_clip: float | None = None
    aggregation: str = "token_mean"
    entropy_coef: float = 0.0
    tis_cap: float | None = None
    log_ratio_clamp: float | None = 20.0
    kl_clamp: float | None = 10.0


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
    """Sum of the masked per-token `values` (B, T_c) under `aggregation`, divided by normalizer.
    Masked positions are selected away, never multiplied (a NaN there does not spread)."""
    mask = mask.bool()
    kept = torch.where(mask, values, torch.zeros((), dtype=values.dtype))
    if aggregation == "seq_mean_token_mean":
        per_seq = kept.sum(-1) / mask.sum(-1).to(values.dtype).clamp(min=1)  # (B,)
        return per_seq.sum() / normalizer
    if aggregation in ("token_mean", "seq_mean_token_sum_norm"):
        return kept.sum() / normalizer
    raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")


def reduce_stat(name: str, values: torch.Tensor, mask: torch.Tensor) -> float:
    """A per-token stat over the counted tokens: the max for names ending in ``_max``, the min
    for ``_min``, else the mean."""
    return float(_reduce_stat(name, values, mask))


def _reduce_stat(name: str, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`reduce_stat` as a 0-d float32 tensor on the values' device (no host sync)."""
    values = values.detach().float()
    if not values.numel() and (name.endswith("_max") or name.endswith("_min")):
        return torch.tensor(-math.inf if name.endswith("_max") else math.inf, device=values.device)
    if name.endswith("_max"):
        return values.masked_fill(~mask, -math.inf).max()
    if name.endswith("_min"):
        return values.masked_fill(~mask, math.inf).min()
    return torch.where(mask, values, 0.0).sum() / mask.sum().clamp(min=1)


def _zero_masked(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))


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
    behaviour_logprobs: torch.Tensor | None = None,
    extras: Mapping[str, torch.Tensor] | None = None,
    step: int | None = None,
    replayed: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss of one (micro-)batch under the configured policy loss, and its statistics.

    Reads the stats to the host (one sync); the trainer's micro-batch loop calls
    `policy_loss_on_device` instead and reads them once per step.

    Args:
        logprobs: (B, T_c) log pi_theta of the sampled tokens (requires grad).
        old_logprobs: (B, T_c) log pi_old (no grad): the sampler's, or the trainer's recompute.
        ref_logprobs: (B, T_c) log pi_ref, or None. With cfg.beta > 0 the KL enters the loss;
            with beta == 0 it is only measured for the stats.
        advantages: (B, T_c) token advantages, or (B,) one per completion (broadcast).
        completion_mask: (B, T_c) bool, True = the token counts.
        cfg: a `LossConfig` / `LossSettings`.
        normalizer: the aggregation's denominator over the global batch; default: this batch's
            own (`loss_normalizer`), i.e. the batch is the whole batch.
        max_new_tokens: T_max for seq_mean_token_sum_norm (default: T_c).
        entropy: (B, T_c) per-token entropy: differentiable when cfg.entropy_coef > 0 (the
            bonus) or the policy loss declares it, else for the stats only. Required when the
            policy loss declares `entropy`.
        behaviour_logprobs: (B, T_c) the sampler's log-probs when `old_logprobs` are the
            trainer's recompute; with cfg.tis_cap the policy loss is weighted by
            min(exp(old_logprobs - behaviour_logprobs), tis_cap) (truncated IS). A policy
            loss that declares it gets `old_logprobs` when None.
        extras: name -> (B,) or (B, T_c) tensors of this batch's rows, for a policy loss that
            declares `extras` (default none).
        step: the training step (1-based), for a policy loss that declares `step`.
        replayed: (B,) bool, the rows a rollout strategy replayed (``extras["replayed"]``):
            with tis_cap, the weights' stats by row kind (`tis_by_kind`).

    Returns:
        loss (scalar, differentiable) and float stats over this batch's counted tokens:
        policy_loss (this batch's share of the aggregated policy term), tokens, kl (when
        ref_logprobs are given), entropy (when given), tis_weight_mean (with tis_cap; by row
        kind too with `replayed`), and whatever the policy loss returns (clip_frac_*,
        ratio_mean, ...).

    Raises:
        GrpoError: the policy loss returned the wrong shape, or a non-finite value at a counted
            token from finite inputs.
    """
    loss, stats, bad_row = policy_loss_on_device(
        logprobs,
        old_logprobs,
        ref_logprobs,
        advantages,
        completion_mask,
        cfg,
        normalizer,
        max_new_tokens,
        entropy,
        behaviour_logprobs,
        extras,
        step,
        replayed,
    )
    row, *values = torch.stack([bad_row.double(), *(v.double() for v in stats.values())]).tolist()
    check_bad_row(cfg.policy_loss, int(row))
    return loss, dict(zip(stats, values))


def policy_loss_on_device(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor | None,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor,
    cfg,
    normalizer: float | None = None,
    max_new_tokens: int | None = None,
    entropy: torch.Tensor | None = None,
    behaviour_logprobs: torch.Tensor | None = None,
    extras: Mapping[str, torch.Tensor] | None = None,
    step: int | None = None,
    replayed: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """`policy_loss` without a host sync, for a training step that reads its stats once.

    Args: as `policy_loss`.

    Returns:
        loss (scalar, differentiable); the same stats as `policy_loss`, each a detached 0-d
        tensor on the loss's device (float32; ``tokens`` int64); and bad_row, a 0-d int64
        tensor: the first row where the policy loss returned a non-finite value at a counted
        token from finite inputs, else -1. Pass it, once on the host, to `check_bad_row`.

    Raises:
        GrpoError: the policy loss returned the wrong shape.
    """
    mask = completion_mask.bool()  # (B, T_c)
    if normalizer is None:
        normalizer = loss_normalizer(mask, cfg.aggregation, max_new_tokens or mask.shape[1])
    normalizer = max(float(normalizer), 1.0)
    if advantages.dim() == 1:
        advantages = advantages[:, None].expand(mask.shape)
    logprobs = _zero_masked(logprobs, mask)
    old_logprobs = _zero_masked(old_logprobs.to(logprobs.dtype), mask)
    advantages = _zero_masked(advantages.to(logprobs.dtype), mask)
    log_ratio = logprobs - old_logprobs  # (B, T_c)
    if cfg.log_ratio_clamp is not None:  # exp() stays finite; values inside are untouched
        log_ratio = torch.clamp(log_ratio, -cfg.log_ratio_clamp, cfg.log_ratio_clamp)
    if entropy is not None:
        entropy = _zero_masked(entropy.to(logprobs.dtype), mask)
    elif POLICY_LOSSES.declares(cfg.policy_loss, "entropy"):
        raise GrpoError(
            f"policy loss {_name(cfg.policy_loss)!r} declares `entropy`, but none was given"
        )
    behaviour = old_logprobs
    if behaviour_logprobs is not None:
        behaviour = _zero_masked(behaviour_logprobs.to(logprobs.dtype), mask)

    inputs = {
        "logprobs": logprobs,
        "old_logprobs": old_logprobs,
        "log_ratio": log_ratio,
        "advantages": advantages,
        "mask": mask,
        "epsilon_low": cfg.epsilon_low,
        "epsilon_high": cfg.epsilon_high,
        "dual_clip": cfg.dual_clip,
        "entropy": entropy,
        "behaviour_logprobs": behaviour,
        "extras": _loss_extras(extras, mask),
        "step": step,
        **(cfg.policy_loss_kwargs or {}),
    }
    out = POLICY_LOSSES.call(cfg.policy_loss, inputs)
    pg, loss_stats = out if isinstance(out, tuple) else (out, {})
    _check_shape(cfg.policy_loss, pg, mask)

    stats: dict[str, torch.Tensor] = {}  # 0-d, detached: read on the host by the caller
    if cfg.tis_cap is not None and behaviour_logprobs is not None:
        # pi_old (trainer numerics) / pi_sampler, truncated: corrects the sampler's mismatch
        d = old_logprobs - behaviour  # both 0 off the mask
        w = torch.exp(torch.clamp(d, max=math.log(cfg.tis_cap)))  # (B, T_c) min(ratio, cap)
        pg = pg * w.detach()
        stats["tis_weight_mean"] = _reduce_stat("tis_weight_mean", w, mask)
        if replayed is not None:
            stats |= tis_by_kind(d, mask, replayed, cfg.tis_cap)
    per_token = pg
    kl = None
    kl_stats: dict = {}  # what the KL estimator reported (train/kl_<name>)
    if cfg.beta > 0:
        if ref_logprobs is None:
            raise ValueError("beta > 0 needs ref_logprobs")
        ref = _zero_masked(ref_logprobs.to(logprobs.dtype), mask)
        kl = kl_penalty(
            logprobs, ref, cfg.kl_estimator, cfg.log_ratio_clamp, cfg.kl_clamp, kl_stats
        )
        per_token = per_token + cfg.beta * kl
    elif ref_logprobs is not None:  # measured for the logs only: not part of the loss
        with torch.no_grad():
            ref = _zero_masked(ref_logprobs.to(logprobs.dtype), mask)
            kl = kl_penalty(
                logprobs, ref, cfg.kl_estimator, cfg.log_ratio_clamp, cfg.kl_clamp, kl_stats
            )
    if entropy is not None and cfg.entropy_coef:
        per_token = per_token - cfg.entropy_coef * entropy

    loss = aggregate(per_token, mask, cfg.aggregation, normalizer)

    with torch.no_grad():
        stats["policy_loss"] = aggregate(pg, mask, cfg.aggregation, normalizer)
        if cfg.log_ratio_clamp is not None:
            bad_row = _bad_row(pg, mask, logprobs, old_logprobs, advantages)
        else:  # unclamped, a built-in loss can overflow from finite inputs: not its fault
            bad_row = torch.tensor(-1, device=mask.device)
        if kl is not None:  # no reference, no KL: never a fake 0
            stats["kl"] = _reduce_stat("kl", kl, mask)
        if entropy is not None:
            stats["entropy"] = _reduce_stat("entropy", entropy, mask)
        for name, values in {**kl_stats, **loss_stats}.items():  # (B, T_c), or broadcasts
            values = torch.as_tensor(values, dtype=torch.float32, device=mask.device)
            stats[name] = _reduce_stat(name, values.expand(mask.shape), mask)
        stats["tokens"] = mask.sum()
    return loss, stats, bad_row


def _name(spec) -> str:
    return spec if isinstance(spec, str) else getattr(spec, "__name__", repr(spec))


def _loss_extras(extras: Mapping[str, torch.Tensor] | None, mask: torch.Tensor) -> dict:
    """The extras as a policy loss gets them: a new dict (the loss may not change the batch's),
    per-token floating ones (B, T_c) 0 off the mask like every other input, so a NaN there
    cannot reach the gradient through a product."""
    out = {}
    for k, v in (extras or {}).items():
        if v.is_floating_point() and v.shape == mask.shape:
            v = _zero_masked(v, mask)
        out[k] = v
    return out


ROW_KINDS = ("fresh", "replayed")


@torch.no_grad()
def tis_by_kind(
    log_ratio: torch.Tensor, mask: torch.Tensor, replayed: torch.Tensor, cap: float
) -> dict[str, torch.Tensor]:
    """The truncated importance weights' stats by row kind, fresh rows and rows a rollout
    strategy replayed (0-d tensors, no host sync), for each kind K:

        tis_weight_mean_K   mean of min(ratio, cap) over K's counted tokens
        tis_clip_frac_K     fraction of K's counted tokens whose ratio exceeded the cap
        tis_ratio_K_max     the largest ratio (before the cap; -inf where K has no token)
        tokens_K            K's counted tokens (`grpo.run.stats.StatSums` weights K's means
                            by them over micro-batches and ranks)

    Args:
        log_ratio: (B, T_c) log(pi_old / pi_sampler), 0 at masked tokens.
        mask: (B, T_c) bool, the counted tokens.
        replayed: (B,) bool.
        cap: loss.tis_cap.
    """
    # the ratio itself stays finite: exp of at most log(float32 max) / 2
    ratio = torch.exp(torch.clamp(log_ratio.float(), max=40.0))
    out = {}
    for kind, rows in zip(ROW_KINDS, (~replayed.bool(), replayed.bool())):
        m = mask & rows.to(mask.device)[:, None]
        out[f"tis_weight_mean_{kind}"] = _reduce_stat("mean", ratio.clamp(max=cap), m)
        out[f"tis_clip_frac_{kind}"] = _reduce_stat("mean", (ratio > cap).float(), m)
        out[f"tis_ratio_{kind}_max"] = _reduce_stat("_max", ratio, m)
        out[f"tokens_{kind}"] = m.sum()
    return out


def _check_shape(name, pg, mask) -> None:
    """One clear line when a registered policy loss returns something other than (B, T_c)."""
    label = f"policy loss {name!r}"
    if not isinstance(pg, torch.Tensor):
        raise GrpoError(f"{label} returned {type(pg).__name__}, expected a (B, T_c) tensor")
    if pg.shape != mask.shape:
        raise GrpoError(f"{label} returned shape {tuple(pg.shape)}, expected {tuple(mask.shape)}")


def _bad_row(pg, mask, *inputs) -> torch.Tensor:
    """0-d int64, on the device (no host sync): the first row where `pg` is non-finite at a
    counted token while every input is finite at the counted tokens, else -1. With the
    log-ratio clamped a built-in loss is then finite, so the loss is to blame; a diverged
    model's non-finite inputs are the trainer's to skip, not an error."""
    bad = (~torch.isfinite(pg.detach()) & mask).any(-1)  # (B,)
    masked = ~mask
    inputs_finite = torch.stack([(torch.isfinite(x.detach()) | masked).all() for x in inputs])
    blame = bad.any() & inputs_finite.all()
    if not bad.numel():
        return torch.tensor(-1, device=mask.device)
    return torch.where(blame, bad.int().argmax(), -1)  # argmax: the first True row


def check_bad_row(name: str, row: int, step: int | None = None) -> None:
    """Raise the one-line error naming policy loss `name` when `row` (from
    `policy_loss_on_device`, read on the host) is a row, not -1."""
    if row >= 0:
        where = f"step {step}: " if step is not None else ""
        raise GrpoError(
            f"{where}policy loss {name!r} returned a non-finite value at row {row} from finite "
            "inputs"
        )


def check_policy_loss(cfg) -> None:
    """Fail early (before a run writes anything) on unknown names or parameters."""
    POLICY_LOSSES.check_params(
        cfg.policy_loss, cfg.policy_loss_kwargs or {}, set(policy_losses.INPUTS)
    )
    KL_ESTIMATORS.check_params(cfg.kl_estimator, {}, {"logprobs", "ref_logprobs"})


def value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's per-token value loss (a critic's, grpo.modules.critic), before aggregation:

        1/2 max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2)

    (unclipped, `clip` None: 1/2 (V - R)^2), as verl's and TRL's; the clipped branch keeps one
    update from moving a value further than c from the value that computed the advantages.

    Returns:
        (loss, clipped): (B, T_c) per-token losses and where the clipped branch was the larger.
    """
    err = (values - returns) ** 2
    if clip is None:
        return 0.5 * err, torch.zeros_like(err, dtype=torch.bool)
    v_clip = old_values + (values - old_values).clamp(-clip, clip)
    err_clip = (v_clip - returns) ** 2
    return 0.5 * torch.maximum(err, err_clip), err_clip > err


__all__ = [
    "AGGREGATIONS",
    "LossSettings",
    "aggregate",
    "check_bad_row",
    "loss_normalizer",
    "policy_loss",
    "policy_loss_on_device",
    "reduce_stat",
    "value_loss",
]

"""KL estimators: per-token estimates of KL(pi_theta || pi_ref) from samples of pi_theta.

A registered estimator is ``fn(logprobs, ref_logprobs) -> (B, T_c)`` (Schulman, "Approximating
KL divergence", 2020), with d = ref_logprobs - logprobs:

    k1 = -d                unbiased, can be negative
    k2 = d^2 / 2           biased, low variance; its gradient is the true KL gradient
    k3 = exp(d) - d - 1    unbiased, >= 0, exactly 0 at d = 0

`kl_penalty` clamps d to +-log_ratio_clamp before the estimator and the estimate to
+-kl_clamp after it (defaults 20 and 10, as verl's low_var_kl): exp(20) = 4.9e8 is still
finite in float32, and a token whose estimate reaches 10 (a reference probability e^10 times
the policy's) is an outlier whose gradient would otherwise dominate the batch.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from grpo.algo.registry import KL_ESTIMATORS, register_kl
from grpo.errors import GrpoError


@register_kl("k1")
def k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    return logprobs - ref_logprobs


@register_kl("k2")
def k2(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    return 0.5 * (ref_logprobs - logprobs).square()


@register_kl("k3")
def k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    d = ref_logprobs - logprobs
    return torch.exp(d) - d - 1.0


def kl_penalty(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    estimator: str = "k3",
    log_ratio_clamp: float | None = None,
    kl_clamp: float | None = None,
    metrics: dict | None = None,
) -> torch.Tensor:
    """Per-token KL estimate (same shape as the inputs) with optional clamps. An estimator may
    return ``(kl, {"name": value})``: the values (scalars or (B, T_c) per token) go into
    `metrics` as ``kl_<name>`` (the loss logs them as ``train/kl_<name>``, token-weighted over
    the batch; ``_max`` / ``_min`` names by max / min).

    Args:
        logprobs: log pi_theta of the sampled tokens.
        ref_logprobs: log pi_ref of the same tokens.
        estimator: registered name or ``package.module:function``.
        log_ratio_clamp: clamp d = ref - logp to [-c, c] first (None: no clamp).
        kl_clamp: clamp the estimate to [-c, c] (None: no clamp).
    """
    if log_ratio_clamp is not None:
        # Clamp d by moving logp to ref - clamp(d) where |d| > c; elsewhere logp is untouched
        # (bit for bit), so the clamp costs nothing when inactive. No gradient where clamped.
        d = ref_logprobs - logprobs
        over = d.abs() > log_ratio_clamp
        clamped = ref_logprobs - torch.clamp(d, -log_ratio_clamp, log_ratio_clamp)
        logprobs = torch.where(over, clamped.detach(), logprobs)
    kl = KL_ESTIMATORS.call(estimator, {"logprobs": logprobs, "ref_logprobs": ref_logprobs})
    if isinstance(kl, tuple) and len(kl) == 2 and isinstance(kl[1], Mapping):
        kl, reported = kl
        for name, value in reported.items():
            if not isinstance(name, str) or not name:
                raise GrpoError(f"KL estimator {estimator!r} reported a metric named {name!r}")
            if metrics is not None:
                metrics[f"kl_{name}"] = value
    if kl_clamp is not None:
        kl = torch.clamp(kl, -kl_clamp, kl_clamp)
    return kl


def reward_minus_kl(
    token_rewards: torch.Tensor,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor | None,
    mask: torch.Tensor,
    loss_cfg,
) -> torch.Tensor:
    """The token rewards an estimator (and PPO's critic) sees: with loss.kl_in_reward = b > 0,
    r_t - b * KL_t on the `mask` tokens (KL of the sampler's log-probs to the reference, by
    loss.kl_estimator and its clamps; REINFORCE++, classic PPO); else the rewards as they are."""
    if loss_cfg.kl_in_reward <= 0:
        return token_rewards
    if ref_logprobs is None:
        raise GrpoError("loss.kl_in_reward needs reference log-probs (reference_phase)")
    kl = kl_penalty(
        logprobs, ref_logprobs, loss_cfg.kl_estimator, loss_cfg.log_ratio_clamp, loss_cfg.kl_clamp
    )
    return token_rewards - loss_cfg.kl_in_reward * torch.where(mask, kl, 0.0)

"""Policy losses: per-token surrogate losses over (B, T_c) tensors, one function per variant.

A policy loss is a function under `@register_policy_loss(name)` that takes any of these inputs
by name (masked positions already hold 0, so the function needs no masking of its own except
for per-row reductions):

    logprobs       (B, T_c)  log pi_theta of the sampled tokens (requires grad)
    old_logprobs   (B, T_c)  log pi_old (no grad)
    log_ratio      (B, T_c)  logprobs - old_logprobs, clamped to +-loss.log_ratio_clamp
    advantages     (B, T_c)  from the advantage estimator
    mask           (B, T_c)  bool, True = the token counts
    epsilon_low, epsilon_high, dual_clip   from loss.*
    entropy        (B, T_c)  the exact per-token entropy of pi_theta (at the rollout's
                             temperature), the one the update computes anyway; differentiable
                             when the loss declares it (an entropy bonus of its own)
    behaviour_logprobs (B, T_c)  the sampler's log-probs (no grad); equal to old_logprobs
                             unless the trainer recomputes pi_old (loss.old_logprobs: recompute)
    extras         dict      the batch's named per-row tensors, (B,) or (B, T_c), the same rows
                             as the other inputs: what the rollout strategy and the trained
                             modules attached, and what the estimator returned over the global
                             batch (`grpo.algo.advantages`); per-token float ones hold 0 off
                             the mask
    step           int       the training step being taken (1-based, as in metrics.jsonl;
                             the loss.num_iterations updates of a step share it); None outside
                             the trainer

plus whatever `loss.policy_loss_kwargs` holds. It returns the (B, T_c) per-token loss (to be
minimized) or a pair (loss, stats) where stats maps names to (B, T_c) per-token values; the
trainer logs ``train/<name>`` as their mean over counted tokens of the global batch (the max
for names ending in ``_max``). Aggregation over tokens and rows, the KL and entropy terms and
truncated importance weights are added by `grpo.algo.losses.policy_loss`, the same for every
variant. A sequence-level loss puts its row's value on every token of the row; pair it with
``loss.aggregation: seq_mean_token_mean`` to weigh rows equally.

A loss sees one micro-batch of one rank, never the whole batch: what is selected or
normalised over the whole batch (KL-Cov's top tokens by covariance, a batch statistic) is
computed by the advantage estimator, which sees the global batch, returned as an extra and read
here from `extras`, sliced to the micro-batch (docs/extending.md, "Entropy control").
"""

from __future__ import annotations

import torch

from grpo.algo.registry import register_policy_loss

INPUTS = (
    "logprobs",
    "old_logprobs",
    "log_ratio",
    "advantages",
    "mask",
    "epsilon_low",
    "epsilon_high",
    "dual_clip",
    "entropy",
    "behaviour_logprobs",
    "extras",
    "step",
)


def row_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, 1) mean of each row's masked values (0 for an empty row)."""
    f = mask.to(values.dtype)
    return (values * f).sum(-1, keepdim=True) / f.sum(-1, keepdim=True).clamp(min=1)


def _ratio_stats(ratio: torch.Tensor) -> dict[str, torch.Tensor]:
    r = ratio.detach()
    return {"ratio_mean": r, "ratio_max": r}


@register_policy_loss("clip")
def clip(
    log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    *,
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    dual_clip: float | None = None,
):
    """PPO/GRPO clipped surrogate (Schulman et al. 2017; Shao et al. 2024), with DAPO's
    clip-higher (epsilon_high > epsilon_low, Yu et al. 2025) and dual clip (Ye et al. 2020):

        -min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A), bounded at -c A where A < 0.
    """
    ratio = torch.exp(log_ratio)  # (B, T_c)
    A = advantages
    clipped = torch.clamp(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high)
    surrogate = torch.minimum(ratio * A, clipped * A)  # (B, T_c)
    if dual_clip is not None:  # bound the loss of very unlikely negative-advantage tokens
        surrogate = torch.where(A < 0, torch.maximum(surrogate, dual_clip * A), surrogate)
    with torch.no_grad():
        stats = {
            "clip_frac_low": ((ratio < 1.0 - epsilon_low) & (A < 0)).float(),
            "clip_frac_high": ((ratio > 1.0 + epsilon_high) & (A > 0)).float(),
            **_ratio_stats(ratio),
        }
    return -surrogate, stats


@register_policy_loss("gspo")
def gspo(
    log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    dual_clip: float | None = None,
):
    """GSPO (Zheng et al. 2025): one ratio per sequence, s_i = exp(mean_t log rho_t), clipped
    like `clip`; its gradient reaches every token of the row. The paper's clip range is much
    narrower than PPO's (e.g. 3e-4 / 4e-4)."""
    seq = row_mean(log_ratio, mask).expand_as(log_ratio)  # (B, T_c)
    return clip(
        seq, advantages, epsilon_low=epsilon_low, epsilon_high=epsilon_high, dual_clip=dual_clip
    )


@register_policy_loss("gspo_token")
def gspo_token(
    logprobs: torch.Tensor,
    log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
):
    """GSPO-token (Zheng et al. 2025): s_i,t = sg[s_i] * pi(y_t) / sg[pi(y_t)]: the value of
    the sequence ratio, the gradient of each token's own log-prob, so token-level advantages
    can differ along the row. Equals `gspo` when advantages are constant per row."""
    seq = row_mean(log_ratio, mask).detach()  # (B, 1)
    log_s = seq + logprobs - logprobs.detach()  # (B, T_c), value seq, gradient of logprobs
    return clip(log_s, advantages, epsilon_low=epsilon_low, epsilon_high=epsilon_high)


@register_policy_loss("cispo")
def cispo(
    logprobs: torch.Tensor,
    log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    *,
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    clip_low: bool = False,
):
    """CISPO (MiniMax-M1, 2025): REINFORCE with a clipped, stop-gradient importance weight,

        -sg(min(rho, 1 + eps_high)) * A * log pi_theta,

    so every token keeps a gradient (clipping bounds its size instead of dropping it). The
    paper sets no lower bound; ``clip_low: true`` also bounds rho below at 1 - eps_low
    (verl's form). MiniMax-M1 uses a wide upper bound (e.g. eps_high = 5)."""
    ratio = torch.exp(log_ratio).detach()  # (B, T_c)
    weight = torch.clamp(ratio, 1.0 - epsilon_low if clip_low else None, 1.0 + epsilon_high)
    stats = {"clip_frac": (weight != ratio).float(), **_ratio_stats(ratio)}
    return -weight * advantages * logprobs, stats


@register_policy_loss("gmpo")
def gmpo(
    log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
):
    """GMPO (Zhao et al. 2025): the geometric mean of the token ratios instead of their
    arithmetic mean. Each token's log-ratio is clipped to [-eps_low, eps_high] in log space on
    the side that would increase the objective (the sign of A), then per row

        loss_i = -A_i * exp(mean_t clipped log rho_t),   A_i = mean_t A_t,

    put on every token of the row. The paper uses eps = 0.4 (log space)."""
    sign = torch.sign(advantages)
    clamped = torch.clamp(log_ratio, -epsilon_low, epsilon_high)
    lr = sign * torch.minimum(sign * log_ratio, sign * clamped)  # (B, T_c)
    ratio = torch.exp(row_mean(lr, mask))  # (B, 1) geometric-mean ratio
    A = row_mean(advantages, mask)  # (B, 1)
    with torch.no_grad():
        stats = {
            "clip_frac_high": ((log_ratio > epsilon_high) & (advantages > 0)).float(),
            "clip_frac_low": ((log_ratio < -epsilon_low) & (advantages < 0)).float(),
            **_ratio_stats(ratio.expand_as(log_ratio)),
        }
    return (-A * ratio).expand_as(log_ratio), stats


@register_policy_loss("sapo")
def sapo(
    log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    *,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
):
    """SAPO (Gao et al. 2025): a soft gate instead of a hard clip,

        -f(rho) A,   f(rho) = sigmoid(tau (rho - 1)) * 4 / tau,

    with tau = tau_pos where A > 0 and tau_neg otherwise: f(1) = 2/tau, f'(1) = 1, so on-policy
    it is the plain policy gradient and far from 1 the gradient fades smoothly."""
    ratio = torch.exp(log_ratio)
    tau = torch.where(advantages > 0, tau_pos, tau_neg).to(ratio.dtype)
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    return -gate * advantages, _ratio_stats(ratio)

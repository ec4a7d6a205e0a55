"""The algorithm as pure functions: advantages, losses, completion log-probs."""

from grpo.algo.advantages import group_advantages, zero_std_groups
from grpo.algo.losses import kl_penalty, loss_normalizer, policy_loss

__all__ = ["group_advantages", "kl_penalty", "loss_normalizer", "policy_loss", "zero_std_groups"]

"""The algorithm: registries of advantage estimators, policy losses and KL estimators (pure
functions over (B, T_c) tensors), the loss around them, and completion log-probs."""

from grpo.algo import kl, policy_losses  # noqa: F401  (registers the built-in variants)
from grpo.algo.advantages import (
    broadcast,
    check_estimator,
    compute_advantages,
    group_advantages,
    zero_std_groups,
)
from grpo.algo.kl import kl_penalty
from grpo.algo.losses import (
    AGGREGATIONS,
    LossSettings,
    check_policy_loss,
    loss_normalizer,
    policy_loss,
)
from grpo.algo.registry import (
    ADVANTAGES,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    register_advantage,
    register_kl,
    register_policy_loss,
)


def check_algorithm(loss_cfg) -> None:
    """Resolve every name of a `LossConfig` and check its kwargs; raises GrpoError naming the
    field (an unknown name lists the registered ones)."""
    check_estimator(loss_cfg.advantage, loss_cfg.advantage_kwargs)
    check_policy_loss(loss_cfg)


__all__ = [
    "ADVANTAGES",
    "AGGREGATIONS",
    "KL_ESTIMATORS",
    "LossSettings",
    "POLICY_LOSSES",
    "broadcast",
    "check_algorithm",
    "check_estimator",
    "check_policy_loss",
    "compute_advantages",
    "group_advantages",
    "kl_penalty",
    "loss_normalizer",
    "policy_loss",
    "register_advantage",
    "register_kl",
    "register_policy_loss",
    "zero_std_groups",
]

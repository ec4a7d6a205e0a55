"""Group-relative advantages: each completion's reward against its own group's."""

from __future__ import annotations

import torch


def group_advantages(
    rewards: torch.Tensor,
    group_size: int,
    scale: str = "group",
    eps: float = 1e-4,
    batch_std: torch.Tensor | None = None,
) -> torch.Tensor:
    """A_i = (r_i - mean of its group) / (std + eps), or unscaled.

    Rows of one group are adjacent: row b belongs to group b // G.

    Args:
        rewards: (B,) total reward per completion, B = P*G.
        group_size: G.
        scale: "group" divides by the group's std (GRPO); "batch" by the std of the whole
            batch (more robust when groups are small); "none" does not divide (Dr. GRPO).
        eps: added to the std, so a group of equal rewards gets advantage 0, never NaN.
        batch_std: with scale="batch", the std of the *global* batch (all ranks); computed
            from `rewards` when None.

    Returns:
        (B,) float32 advantages. std is the unbiased sample std (as TRL computes it).
    """
    B = rewards.shape[0]
    if B % group_size:
        raise ValueError(f"{B} rewards do not split into groups of {group_size}")
    r = rewards.float().view(-1, group_size)  # (P, G)
    centered = r - r.mean(dim=1, keepdim=True)  # (P, G)
    if scale == "group":
        centered = centered / (r.std(dim=1, keepdim=True) + eps)
    elif scale == "batch":
        std = rewards.float().std() if batch_std is None else batch_std
        centered = centered / (std + eps)
    elif scale != "none":
        raise ValueError(f"scale must be 'group', 'batch' or 'none', got {scale!r}")
    return centered.view(B)


def zero_std_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """(P,) bool: True for groups whose rewards are all equal (no learning signal)."""
    r = rewards.view(-1, group_size)
    return (r == r[:, :1]).all(dim=1)

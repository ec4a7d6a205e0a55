"""The Bradley-Terry preference loss of reward models (`grpo rm`, grpo/train/rm.py; the reward
model trained online, grpo/modules/online_rm.py) and the batching of its pairs. For a pair
(x, y_c, y_r) with an optional margin m:

    loss = -log sigmoid(r(x, y_c) - r(x, y_r) - m) + center_coef * (r(x, y_c) + r(x, y_r))^2
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def pair_loss(
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    margin: torch.Tensor | None = None,
    center_coef: float = 0.0,
) -> torch.Tensor:
    """Per-pair Bradley-Terry loss: -log sigmoid(r_c - r_r - m) + center_coef (r_c + r_r)^2.

    Args:
        chosen, rejected: (N,) scores.
        margin: (N,) required margins, or None (0).
        center_coef: the reward-centering coefficient.
    """
    diff = chosen - rejected
    if margin is not None:
        diff = diff - margin
    loss = -F.logsigmoid(diff)
    if center_coef:
        loss = loss + center_coef * (chosen + rejected) ** 2
    return loss


def collate_pairs(pairs: list, pad_id: int, device) -> dict:
    """2N right-padded sequences (the N chosen sides, then the N rejected), masks, margins."""
    seqs = [p.prompt_ids + p.chosen_ids for p in pairs]
    seqs += [p.prompt_ids + p.rejected_ids for p in pairs]
    T = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    mask = torch.zeros(len(seqs), T, dtype=torch.bool)
    for b, s in enumerate(seqs):
        ids[b, : len(s)] = torch.tensor(s)
        mask[b, : len(s)] = True
    margin = torch.tensor([float(p.margin) for p in pairs], dtype=torch.float32)
    return {"ids": ids.to(device), "attention_mask": mask.to(device), "margin": margin.to(device)}

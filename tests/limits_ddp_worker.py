"""Run by tests/test_limits.py under torchrun (2 gloo ranks): `advantage_stats` of one batch
split over the ranks, each rank holding its own rows and only as many columns as its longest
row (ranks differ in T_c).

    torchrun --nproc_per_node=2 tests/limits_ddp_worker.py OUT.json

Rank 0 writes the reduced stats; the test compares them with one process on the whole batch.
The test runs `rank_stats` in the session's ranks (tests/rank_pool.py) instead of torchrun.
"""

from __future__ import annotations

import json
import sys

import torch

from grpo.distributed import Dist, init_distributed, teardown
from grpo.run.stats import advantage_stats

B, T = 8, 7


def make_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) advantages with exact zeros and a (B, T) mask whose second half of rows is at
    most 4 tokens long; rows 4.. hold the batch's extremes (a mean of per-rank extremes or
    per-rank stds would differ from the global ones)."""
    g = torch.Generator().manual_seed(0)
    adv = torch.randn(B, T, generator=g)
    adv[adv.abs() < 0.4] = 0.0
    adv[5, 1], adv[6, 2] = 9.0, -7.0
    lengths = torch.tensor([7, 3, 5, 1, 4, 2, 4, 3])
    mask = torch.arange(T)[None, :] < lengths[:, None]
    return adv, mask


def rank_stats(dist: Dist) -> dict[str, float]:
    """This rank's rows of the batch (its own T_c), reduced over every rank (collective)."""
    adv, mask = make_inputs()
    half = B // dist.world_size
    rows = slice(dist.rank * half, (dist.rank + 1) * half)
    width = int(mask[rows].sum(-1).max())  # this rank's own T_c
    return advantage_stats(adv[rows, :width], mask[rows, :width], dist)


def main(out_path: str) -> None:
    dist = init_distributed("cpu")
    stats = rank_stats(dist)
    if dist.rank == 0:
        with open(out_path, "w") as f:
            json.dump(stats, f)
    teardown()


if __name__ == "__main__":
    main(sys.argv[1])

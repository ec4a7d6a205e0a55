"""tests/rank_pool.py: the two long-lived gloo ranks the "2 ranks = 1 process" tests share."""

from __future__ import annotations

import pytest


def rank_and_sum(dist, x: float):
    """Each rank's (rank, world size, the sum over ranks of x * (rank + 1))."""
    from grpo.distributed import all_reduce_sum

    return dist.rank, dist.world_size, all_reduce_sum(x * (dist.rank + 1), dist)


def raise_on_rank_1(dist):
    if dist.rank == 1:
        raise ValueError("boom on rank 1")


def test_a_task_runs_on_both_ranks_of_one_group(rank_pool):
    assert rank_pool.run("test_rank_pool:rank_and_sum", 2.0) == [(0, 2, 6.0), (1, 2, 6.0)]
    assert rank_pool.run("test_rank_pool:rank_and_sum", 1.0) == [(0, 2, 3.0), (1, 2, 3.0)]


def test_a_failing_rank_is_named_and_the_next_task_gets_a_fresh_pool(rank_pool):
    with pytest.raises(
        RuntimeError,
        match=r"rank 1 failed in test_rank_pool:raise_on_rank_1"
        r"(.|\n)*ValueError: boom on rank 1",
    ):
        rank_pool.run("test_rank_pool:raise_on_rank_1", timeout_s=60)
    assert rank_pool.run("test_rank_pool:rank_and_sum", 1.0)[1] == (1, 2, 3.0)

"""Token balancing over ranks (train.balance_ranks): after sampling, whole groups move between
trainer ranks so that each rank's training passes run about the same number of real tokens.

Every rank sampled its own P groups, whose completions differ in length; a DDP or FSDP step
waits for the rank with the most tokens. The ranks exchange their batches (the wire format of
`grpo.experience.wire`, no pickle of tensors), assign the W x P groups to ranks by longest
processing time first with P groups each (`assign_groups`, the same on every rank), and each
keeps its own. The global batch is unchanged, so the update is too (the loss normalizers and
the advantages are of the global batch); only which rank runs which group moves.
"""

from __future__ import annotations

import dataclasses
import heapq

import torch

from grpo.distributed import Dist, gather_objects
from grpo.errors import GrpoError
from grpo.experience.batch import RolloutBatch, cat_batches, unit_tokens
from grpo.experience.wire import decode_header, pack_batch, unpack_batch


def assign_groups(costs: list[int], world: int) -> list[list[int]]:
    """Groups (indices into `costs`, their real tokens) to `world` ranks, len(costs) / world
    each: the costliest first, each to the rank with the fewest tokens that still has room
    (ties to the lower rank); each rank's groups in ascending order. Deterministic."""
    n = len(costs)
    if n % world:
        raise ValueError(f"{n} groups do not split over {world} ranks")
    per_rank = n // world
    order = sorted(range(n), key=lambda g: (-costs[g], g))
    heap = [(0, r) for r in range(world)]  # (tokens, rank) of the ranks with room
    out: list[list[int]] = [[] for _ in range(world)]
    for g in order:
        tokens, r = heapq.heappop(heap)
        out[r].append(g)
        if len(out[r]) < per_rank:
            heapq.heappush(heap, (tokens + costs[g], r))
    return [sorted(x) for x in out]


def balance_ranks(
    batch: RolloutBatch, dist: Dist, pad_id: int, shared: bool = True
) -> tuple[RolloutBatch, dict[str, float]]:
    """This rank's groups after balancing, and what balancing did: `perf/rank_tokens_max_ratio`
    before and after (the most tokens on a rank / the mean over ranks, 1 = even).

    Args:
        batch: this rank's sampled batch (P whole groups, every rank the same P).
        dist: the trainer ranks.
        pad_id: the padding id (batches of different widths are concatenated).
        shared: count a group's prompt once (train.shared_prefix), else once per row.
    """
    G = batch.rollout.group_size
    r = batch.rollout
    costs = unit_tokens(r.attention_mask().cpu(), r.prompt_width, G if shared else None)
    if not shared:  # per row -> per group
        costs = [sum(costs[i : i + G]) for i in range(0, len(costs), G)]
    try:
        header, buffer = pack_batch(batch, list(range(batch.size)), {"rows": batch.rows})
    except GrpoError as e:  # a dataset row or an environment's info JSON cannot carry
        raise GrpoError(f"train.balance_ranks: {e}; set train.balance_ranks=false") from None
    parts = gather_objects((header.numpy().tobytes(), buffer.numpy().tobytes(), costs), dist)
    all_costs = [c for _, _, cs in parts for c in cs]
    plan = assign_groups(all_costs, dist.world_size)
    mine = plan[dist.rank]
    device = r.ids.device
    batches = []
    for head, buf, _ in parts:
        h = decode_header(torch.frombuffer(bytearray(head), dtype=torch.uint8))
        data = torch.frombuffer(bytearray(buf), dtype=torch.uint8)
        batches.append(unpack_batch(h, data, h["extra"]["rows"], device))
    whole = cat_batches(batches, pad_id)  # every rank's groups, in rank order
    keep = dataclasses.replace(
        whole.select_groups(mine),
        metrics=batch.metrics,
        policy_version=batch.policy_version,
        frac_zero_std=batch.frac_zero_std,
    )
    mean = sum(all_costs) / dist.world_size
    before = max(sum(cs) for _, _, cs in parts) / mean
    after = max(sum(all_costs[g] for g in p) for p in plan) / mean
    return keep, {"perf/rank_tokens_max_ratio_before": before, "perf/rank_tokens_max_ratio": after}

"""One rank of the two-rank conformance job (`grpo.testing.two_ranks.run_two_ranks`):

    torchrun --standalone --nproc_per_node=2 -m grpo.testing.two_ranks_worker SPEC.json OUT.json

SPEC names the plugins to load first and the entries to run (with their kwargs);
rank 0 writes the gathered advantages and gradients, the summed losses and the reduced stats.
A rank's work is `run_rank(dist, spec)`, which the repo's tests also call in ranks they keep for
the whole session (tests/rank_pool.py).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

from grpo.algo import loss_normalizer, policy_loss
from grpo.config import load_config
from grpo.distributed import Dist, all_reduce_sum, gather_objects, init_distributed, teardown
from grpo.plugins import load_plugins
from grpo.testing.conformance import (
    BUILTIN_EXTRAS,
    B,
    G,
    T,
    kit_rollout,
    loss_inputs,
    loss_settings,
    make_inputs,
)
from grpo.testing.two_ranks import reduced_stats
from grpo.train.grpo import global_advantages


def _batch(name: str, mask: torch.Tensor, rows: slice, width: int):
    """This rank's part of the kit's rollout (`kit_rollout`: a built-in's extras) in the shape
    `global_advantages` reads, or None for an estimator that reads no rollout."""
    r = kit_rollout(name, mask, BUILTIN_EXTRAS.get(name, ()))
    if r is None:
        return None
    rollout = SimpleNamespace(
        completion_ids=r.completion_ids[rows, :width],
        completion_mask=r.completion_mask[rows, :width],
        logprobs=r.logprobs[rows, :width],
        prompt_lens=r.prompt_lens[rows],
    )
    return SimpleNamespace(
        rollout=rollout, extras={k: v[rows, :width] for k, v in r.extras.items()}
    )


def run_rank(dist: Dist, spec: dict) -> dict | None:
    """Run `spec`'s entries (`two_ranks_spec`) on this rank's half of the conformance batch.
    Collective: every rank calls it. Returns the gathered advantages and gradients, summed
    losses and reduced stats on rank 0, None on the others."""
    load_plugins(spec["plugins"], "plugins")  # loaded already under torchrun (`main`)
    x = make_inputs()
    half = B // dist.world_size
    rows = slice(dist.rank * half, (dist.rank + 1) * half)
    width = int(x["mask"][rows].sum(-1).max())  # this rank's own T_c
    mine = {k: v[rows, :width] for k, v in x.items()}
    result: dict = {"advantages": {}, "grads": {}, "losses": {}, "stats": {}}
    for name, kw in spec["advantages"].items():
        base = {
            "model": {"path": "unused"},
            "rollout": {"group_size": G},
            "loss": {"advantage": name, "advantage_kwargs": kw, "gamma": 1.0, "gae_lambda": 1.0},
        }  # compute_advantages' defaults
        batch = _batch(name, x["mask"], rows, width)  # what the estimator reads beyond rewards
        adv = global_advantages(
            load_config(base=base), mine["token_rewards"], mine["mask"], dist, batch=batch
        )
        parts = gather_objects(torch.nn.functional.pad(adv, (0, T - width)).tolist(), dist)
        result["advantages"][name] = [row for part in parts for row in part]
    for name, kw in spec["losses"].items():
        cfg = loss_settings(name, kw)
        logprobs = mine["logprobs"].clone().requires_grad_(True)
        norm = all_reduce_sum(loss_normalizer(mine["mask"], cfg.aggregation, T), dist)
        loss, st = policy_loss(
            logprobs,
            mine["old_logprobs"],
            mine["ref_logprobs"],
            mine["advantages"],
            mine["mask"],
            cfg,
            normalizer=norm,
            max_new_tokens=T,
            **loss_inputs(mine),
        )
        loss.backward()
        grad = torch.nn.functional.pad(logprobs.grad, (0, T - width))
        parts = gather_objects(grad.tolist(), dist)
        result["grads"][name] = [row for part in parts for row in part]
        result["losses"][name] = all_reduce_sum(float(loss), dist)
        result["stats"][name] = reduced_stats(st, dist)
    return result if dist.is_main else None


def main(spec_path: str, out_path: str) -> None:
    """Run SPEC's entries on this rank's half of the conformance batch; rank 0 writes OUT."""
    spec = json.loads(Path(spec_path).read_text())
    load_plugins(spec["plugins"], "plugins")  # every rank, before the group (their agreement)
    dist = init_distributed("cpu")
    result = run_rank(dist, spec)
    if result is not None:
        Path(out_path).write_text(json.dumps(result))
    teardown()


if __name__ == "__main__":
    main(*sys.argv[1:3])

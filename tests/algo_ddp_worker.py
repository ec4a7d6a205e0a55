"""Run by tests/test_algo_conformance.py under torchrun (2 gloo ranks): every registered
advantage estimator and policy loss on fixed tensors, each rank holding half of the rows and
only as many completion columns as its own longest row (so ranks differ in T_c).

    torchrun --nproc_per_node=2 tests/algo_ddp_worker.py OUT.json

Rank 0 writes the gathered advantages, the gathered logprob gradients, the summed losses and
the reduced stats per variant; the test compares them with one process on the combined batch.
"""

from __future__ import annotations

import json
import sys

import torch

from grpo.algo import ADVANTAGES, POLICY_LOSSES, LossSettings, loss_normalizer, policy_loss
from grpo.config import load_config
from grpo.distributed import all_reduce_sum, gather_objects, init_distributed, teardown
from grpo.train.grpo import StatSums, global_advantages

B, G, T = 16, 4, 9


def make_inputs(seed: int = 0, rows: int = B, width: int = T) -> dict[str, torch.Tensor]:
    """Seeded (B, T) tensors: ragged completions (every row >= 1 token, row 0 full width),
    outcome rewards in {0, 1} plus small process rewards, log-probs near each other."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, width + 1, (rows,), generator=g)
    lengths[0] = width
    mask = torch.arange(width)[None, :] < lengths[:, None]  # (B, T)
    outcome = (torch.rand(rows, generator=g) > 0.5).float()
    token_rewards = (
        0.1 * torch.randn(rows, width, generator=g) * (torch.rand(rows, width, generator=g) > 0.7)
    )
    token_rewards[torch.arange(rows), lengths - 1] += outcome
    logprobs = -3 * torch.rand(rows, width, generator=g) - 0.05
    old = logprobs + 0.3 * torch.randn(rows, width, generator=g)
    ref = logprobs + 0.5 * torch.randn(rows, width, generator=g)
    advantages = torch.randn(rows, width, generator=g)
    return {"mask": mask, "token_rewards": torch.where(mask, token_rewards, 0.0),
            "logprobs": logprobs, "old_logprobs": old, "ref_logprobs": ref,
            "advantages": advantages}  # fmt: skip


def loss_settings(name: str) -> LossSettings:
    return LossSettings(policy_loss=name, beta=0.05, aggregation="seq_mean_token_mean")


def main(out_path: str) -> None:
    dist = init_distributed("cpu")
    x = make_inputs()
    half = B // dist.world_size
    rows = slice(dist.rank * half, (dist.rank + 1) * half)
    width = int(x["mask"][rows].sum(-1).max())  # this rank's own T_c
    mine = {k: v[rows, :width] for k, v in x.items()}
    result: dict = {"advantages": {}, "grads": {}, "losses": {}, "stats": {}}
    for name in ADVANTAGES.names():
        overrides = [f"loss.advantage={name}", f"rollout.group_size={G}"]
        cfg = load_config(base={"model": {"path": "unused"}}, overrides=overrides)
        adv = global_advantages(cfg, mine["token_rewards"], mine["mask"], dist)
        parts = gather_objects(torch.nn.functional.pad(adv, (0, T - width)).tolist(), dist)
        result["advantages"][name] = [row for part in parts for row in part]
    for name in POLICY_LOSSES.names():
        cfg = loss_settings(name)
        logprobs = mine["logprobs"].clone().requires_grad_(True)
        norm = all_reduce_sum(loss_normalizer(mine["mask"], cfg.aggregation, T), dist)
        loss, st = policy_loss(logprobs, mine["old_logprobs"], mine["ref_logprobs"],
                               mine["advantages"], mine["mask"], cfg, normalizer=norm,
                               max_new_tokens=T)  # fmt: skip
        loss.backward()
        grad = torch.nn.functional.pad(logprobs.grad, (0, T - width))
        parts = gather_objects(grad.tolist(), dist)
        result["grads"][name] = [row for part in parts for row in part]
        result["losses"][name] = all_reduce_sum(float(loss), dist)
        sums = StatSums()
        sums.add(st)
        result["stats"][name] = sums.reduce(dist)
    if dist.is_main:
        with open(out_path, "w") as f:
            json.dump(result, f)
    teardown()


if __name__ == "__main__":
    main(sys.argv[1])

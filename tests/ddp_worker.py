"""Run by tests/test_distributed.py under torchrun (and once without): one GRPO update per
loss aggregation (LoRA, full fine-tuning, shared prefix, multi-turn) and one SFT step (LoRA,
full) on fixed data, each rank taking its half of the batch.

    torchrun --nproc_per_node=2 tests/ddp_worker.py CKPT OUT_DIR        # DDP
    torchrun --nproc_per_node=2 tests/ddp_worker.py CKPT OUT_DIR fsdp   # FSDP2 shards
    torchrun --nproc_per_node=2 tests/ddp_worker.py CKPT OUT_DIR ddp,fsdp  # both: OUT_DIR/<mode>
    python tests/ddp_worker.py CKPT OUT_DIR                             # the reference

Rank 0 writes the updated trainable parameters to OUT_DIR/<case>.safetensors.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from grpo.algo.logprobs import CompletionLogprobs
from grpo.config import load_config
from grpo.distributed import (
    Dist,
    full_weights,
    init_distributed,
    shard_model,
    teardown,
    wrap_ddp,
)
from grpo.experience.balance import balance_ranks
from grpo.experience.batch import (
    RolloutBatch,
    UpdateBatch,
    counted_mask,
    micro_batch_count,
    micro_batch_plan,
    outcome_token_rewards,
    select_rows,
    turn_token_rewards,
    unit_tokens,
)
from grpo.lora import apply_lora
from grpo.models import load_model
from grpo.modules.module_set import ModuleSet
from grpo.policy import Policy
from grpo.rollout import sample
from grpo.rollout.multiturn import sample_turns
from grpo.rollout.sampler import Observation, Sampler
from grpo.run.optim import build_optimizer, build_scheduler
from grpo.run.stats import reduce_metrics
from grpo.train.grpo import advantage_phase, step_batch, step_plan, update_phase
from grpo.train.sft import sft_update

AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")
# AdamW's first step is g / (|g| + eps) x lr: with the default eps (1e-8) a gradient near 0,
# whose last bits depend on the order of the reduction (one process, DDP's all-reduce, FSDP's
# reduce-scatter, and each CPU's float32 kernels), moves its weight by a large fraction of lr
# either way. At eps 1 the step is about g x lr, so the two layouts differ by lr x their
# gradients' float32 rounding (~1e-7 |g|), whatever the CPU, and the test's bound holds with room.
EPS = "optim.eps=1.0"


class _Tok:
    pad_token_id = 0


def fixed_batch(model, rank: int, world: int, micro_batch_size: int) -> UpdateBatch:
    """The same 16-row rollout on every rank (fixed seed); this rank's contiguous half, with
    (B,) advantages."""
    r = sample(
        model,
        [[5, 17, 33, 9], [101, 7], [44, 45, 46], [8]],
        group_size=4,
        max_new_tokens=10,
        temperature=1.0,
        stop_ids=[3],
        seed=0,
        pad_id=0,
    )
    adv = torch.randn(16, generator=torch.Generator().manual_seed(0))
    B = 16 // world
    idx = torch.arange(rank * B, (rank + 1) * B)
    r = select_rows(r, idx)
    plan = micro_batch_plan(r, micro_batch_size)
    return UpdateBatch(r, counted_mask(r, False), adv[idx], plan)


def multiturn_batch(model, rank: int, world: int) -> RolloutBatch:
    """The same 16 multi-turn trajectories on every rank (fixed seed; rows take 1-3 turns,
    observations of different lengths); this rank's half, with rank-local advantages."""

    def observe(b, ids, stopped):
        k = len(turns.setdefault(b, []))
        turns[b].append(ids)
        if k >= b % 3:
            return Observation([], reward=0.0, done=True)
        return Observation([200 + b, 201, 202][: (b + k) % 3 + 1], reward=0.1 * (b % 4))

    turns: dict = {}
    r = sample_turns(
        Sampler(model),
        [[5, 17, 33, 9], [101, 7], [44, 45, 46], [8]],
        group_size=4,
        observe=observe,
        max_new_tokens=5,
        max_turns=3,
        max_total_tokens=30,
        stop_ids=[3],
        turn_end_ids=list(range(4, 40)),
        seed=0,
        pad_id=0,
    )
    rewards = torch.randn(16, generator=torch.Generator().manual_seed(0))
    B = 16 // world
    idx = torch.arange(rank * B, (rank + 1) * B)
    r = select_rows(r, idx)
    return RolloutBatch(
        rollout=r,
        rows=[{}] * B,
        texts=[""] * B,
        rewards=rewards[idx],
        token_rewards=turn_token_rewards(rewards[idx], r, 0.9),
        per_fn={},
        policy_version=0,
        frac_zero_std=0.0,
    )


def sft_rows(rank: int, world: int) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    rows = []
    for i in range(8):
        p = torch.randint(4, 250, (2 + i % 3,), generator=g).tolist()
        c = torch.randint(4, 250, (3 + i % 4,), generator=g).tolist()
        rows.append({"prompt_ids": p, "completion_ids": c})
    B = 8 // world
    return rows[rank * B : (rank + 1) * B]


def run_modes(dist: Dist, ckpt: str, out_dir: str, parallel: str = "ddp") -> None:
    """Every case in each mode of `parallel` (collective: every rank calls it). The test runs
    it in the session's ranks (tests/rank_pool.py), `main` under torchrun."""
    modes = parallel.split(",")  # "ddp,fsdp": both in one launch, into OUT_DIR/ddp, OUT_DIR/fsdp
    for mode in modes:
        out = Path(out_dir) / mode if len(modes) > 1 else Path(out_dir)
        out.mkdir(exist_ok=True)
        run_cases(ckpt, out, dist, mode == "fsdp" and dist.enabled)


def main(ckpt: str, out_dir: str, parallel: str = "ddp") -> None:
    dist = init_distributed("cpu")
    run_modes(dist, ckpt, out_dir, parallel)
    teardown()  # after run_cases returned: its DDP wrappers are gone (see grpo.distributed)


def trainer(model, cfg, dist, fsdp: bool):
    """The scorer, trainable parameters, optimizer and schedule of one case: under FSDP the
    model is sharded first (the optimizer holds the shards)."""
    if fsdp:
        shard_model(model, dist)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = build_optimizer(params, cfg.optim)
    sched = build_scheduler(opt, 10, cfg.optim)
    scorer = wrap_ddp(CompletionLogprobs(model), dist, torch.device("cpu"))  # FSDP: as is
    return scorer, params, opt, sched


def save_trainable(model, dist, path: Path) -> None:
    """Rank 0 writes the trainable weights (FSDP: gathered from every rank's shards)."""
    with full_weights(model):
        sd = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    if dist.is_main:
        save_file(sd, str(path))


def run_cases(ckpt: str, out: Path, dist, fsdp: bool = False) -> None:
    base = load_model(ckpt)
    full = copy.deepcopy(base)  # full fine-tuning: every weight trains
    apply_lora(base, rank=4, alpha=8, targets=["q_proj", "v_proj", "down_proj"], seed=0)
    cases = [(agg, "off", f"grpo_{agg}", base) for agg in AGGREGATIONS]
    cases.append(("token_mean", "on", "grpo_shared_prefix", base))  # each prompt run once
    cases.append(("token_mean", "off", "grpo_full", full))
    for agg, shared, name, start in cases:
        model = copy.deepcopy(start)
        cfg = load_config(
            base={"model": {"path": ckpt}},
            overrides=[
                f"loss.aggregation={agg}",
                "loss.beta=0",
                "optim.lr=1e-3",
                EPS,
                "train.batch_size=16",
                "train.micro_batch_size=4",
                f"train.shared_prefix={shared}",
            ],
        )
        policy = Policy(model, _Tok(), [3], None, Path(ckpt), lora=start is base)
        batch = fixed_batch(model, dist.rank, dist.world_size, cfg.train.micro_batch_size)
        scorer, params, opt, sched = trainer(model, cfg, dist, fsdp)
        update_phase(cfg, policy, batch, opt, sched, params, scorer, dist)
        save_trainable(model, dist, out / f"{name}.safetensors")
    model = copy.deepcopy(base)  # multi-turn: per-turn advantages over both ranks' rows
    cfg = load_config(
        base={"model": {"path": ckpt}},
        overrides=[
            "loss.advantage=grpo_turn",
            "rollout.turn_discount=0.9",
            "loss.beta=0",
            "optim.lr=1e-3",
            EPS,
            "train.batch_size=16",
            "train.micro_batch_size=4",
        ],
    )
    policy = Policy(model, _Tok(), [3], None, Path(ckpt), lora=True)
    batch = multiturn_batch(model, dist.rank, dist.world_size)
    scorer, params, opt, sched = trainer(model, cfg, dist, fsdp)
    r = batch.rollout
    advantages = advantage_phase(cfg, batch, dist=dist)
    plan = micro_batch_plan(r, cfg.train.micro_batch_size)
    inputs = UpdateBatch(r, counted_mask(r, False), advantages, plan)
    update_phase(cfg, policy, inputs, opt, sched, params, scorer, dist)
    save_trainable(model, dist, out / "grpo_multiturn.safetensors")
    # PPO: the critic (a trained module: replicated; on the policy's shared frozen base, or
    # under FSDP its own copy) and GAE over both ranks' multi-turn rows, whitened globally;
    # two critic updates, so the value clip acts on the second
    model = copy.deepcopy(base)
    cfg = load_config(
        base={
            "model": {"path": ckpt},
            "modules": [
                {
                    "name": "critic",
                    "kwargs": {"micro_batch_size": 3, "updates": 2},
                    "optim": {"lr": 1.0, "warmup_ratio": 0.0, "eps": 1.0},
                }
            ],
        },
        overrides=[
            "loss.advantage=gae",
            "loss.gae_lambda=0.9",
            "loss.token_discount=0.95",
            "loss.beta=0",
            "optim.lr=1e-3",
            EPS,
            "train.batch_size=16",
            "train.micro_batch_size=4",
            f"train.parallel={'fsdp' if fsdp else 'ddp'}",
        ],
    )
    policy = Policy(model, _Tok(), [3], None, Path(ckpt), lora=True)
    batch = multiturn_batch(model, dist.rank, dist.world_size)
    scorer, params, opt, sched = trainer(model, cfg, dist, fsdp)  # FSDP: the policy sharded
    modules = ModuleSet(cfg, policy, dist, torch.device("cpu"), total_steps=10)
    batch = modules.attach(batch)
    inputs = step_batch(cfg, policy, batch, dist)
    update_phase(cfg, policy, inputs, opt, sched, params, scorer, dist)
    reported = reduce_metrics(modules.step(batch, inputs), dist)  # as the trainer logs them
    save_trainable(model, dist, out / "ppo_policy.safetensors")
    state = modules.items[0].module.checkpoint_state()
    if dist.is_main:
        save_file(
            {k: v.detach().clone().contiguous() for k, v in state.items()},
            str(out / "ppo_critic.safetensors"),
        )
        (out / "ppo_metrics.json").write_text(json.dumps({**reported, **inputs.metrics}))
    # sequence packing: micro-batches of at most 22 real tokens, which this rank's rows (of
    # other lengths than the other rank's) need more or fewer of: every rank cuts as many
    for name, tokens in (("grpo_packed_tokens", "22"), ("grpo_packed_shared", None)):
        model = copy.deepcopy(base)
        size = (
            [f"train.micro_batch_tokens={tokens}", "train.shared_prefix=off"]
            if tokens
            else ["train.micro_batch_size=4", "train.shared_prefix=on"]
        )
        cfg = load_config(
            base={"model": {"path": ckpt}},
            overrides=[
                "loss.beta=0",
                "optim.lr=1e-3",
                EPS,
                "train.batch_size=16",
                "train.pack_sequences=on",
                *size,
            ],
        )
        policy = Policy(model, _Tok(), [3], None, Path(ckpt), lora=True)
        padded = fixed_batch(model, dist.rank, dist.world_size, 4)
        plan = step_plan(cfg, policy, padded.rollout, padded.counted_mask, dist)
        batch = dataclasses.replace(padded, plan=plan)
        scorer, params, opt, sched = trainer(model, cfg, dist, fsdp)
        update_phase(cfg, policy, batch, opt, sched, params, scorer, dist)
        save_trainable(model, dist, out / f"{name}.safetensors")
        if tokens:
            r = padded.rollout
            costs = unit_tokens(r.attention_mask(), r.prompt_width, None)
            counts = {"needed": micro_batch_count(costs, int(tokens)), "used": len(plan)}
            (out / f"{name}_counts_{dist.rank}.json").write_text(json.dumps(counts))
    # token balancing: the ranks swap whole groups before the step (one process: nothing to
    # swap); advantages and the update are of the same global batch
    model = copy.deepcopy(base)
    cfg = load_config(
        base={"model": {"path": ckpt}},
        overrides=[
            "loss.beta=0",
            "optim.lr=1e-3",
            EPS,
            "train.batch_size=16",
            "train.micro_batch_size=4",
            "train.pack_sequences=on",
        ],
    )
    policy = Policy(model, _Tok(), [3], None, Path(ckpt), lora=True)
    half = fixed_batch(model, dist.rank, dist.world_size, 4)
    rewards = torch.randn(16, generator=torch.Generator().manual_seed(1))
    mine = rewards[dist.rank * (16 // dist.world_size) : (dist.rank + 1) * (16 // dist.world_size)]
    r = half.rollout
    batch = RolloutBatch(
        rollout=r,
        rows=[{"i": i} for i in range(r.ids.shape[0])],
        texts=[""] * r.ids.shape[0],
        rewards=mine,
        token_rewards=outcome_token_rewards(mine, r.completion_mask),
        per_fn={},
        policy_version=0,
        frac_zero_std=0.0,
    )
    if dist.enabled:
        batch, moved = balance_ranks(batch, dist, 0, shared=True)
        (out / f"balance_{dist.rank}.json").write_text(json.dumps(moved))
    scorer, params, opt, sched = trainer(model, cfg, dist, fsdp)
    inputs = step_batch(cfg, policy, batch, dist)
    update_phase(cfg, policy, inputs, opt, sched, params, scorer, dist)
    save_trainable(model, dist, out / "grpo_balanced.safetensors")
    for name, start in (("sft", base), ("sft_full", full)):
        model = copy.deepcopy(start)
        cfg = load_config(
            base={"model": {"path": ckpt}},
            overrides=["optim.lr=1e-3", EPS, "train.batch_size=8", "train.micro_batch_size=2"],
        )
        policy = Policy(model, _Tok(), [3], None, Path(ckpt), lora=start is base)
        scorer, params, opt, sched = trainer(model, cfg, dist, fsdp)
        rows = sft_rows(dist.rank, dist.world_size)
        sft_update(cfg, policy, scorer, rows, opt, sched, params, dist)
        save_trainable(model, dist, out / f"{name}.safetensors")


if __name__ == "__main__":
    main(*sys.argv[1:4])

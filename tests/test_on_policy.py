"""On-policy numerics: the first update pass measures its log-probs against the sampler's
every step (rollout/logprob_diff_*, rollout/first_pass_ratio_mean), loss.old_logprobs
recomputes pi_old, the sampler holds the trainer's precision policy, and LoRA dropout is refused
for GRPO (it would make the first-pass ratio differ from 1 silently)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from conftest import update_batch

from grpo.config import TrainConfig, load_config
from grpo.experience.batch import micro_batch_plan
from grpo.experience.collect import sample_round
from grpo.models import load_model
from grpo.policy import Policy
from grpo.precision import Precision
from grpo.rollout import Sampler, sample
from grpo.run.optim import build_optimizer, build_scheduler
from grpo.run.stats import first_pass_gap_limit
from grpo.settings import ConfigError
from grpo.train.grpo import old_logprobs_phase, update_phase

PROMPTS = [[5, 17, 33, 9], [101, 7]]


def make_cfg(tmp_path, *overrides):
    base = {"model": {"path": str(tmp_path)}, "train": {"batch_size": 8}}
    return load_config(base=base, overrides=["rollout.group_size=4", *overrides])


def update(tmp_path, model, r, *overrides):
    """One update on rollout `r` with seeded random (B,) advantages."""
    adv = torch.randn(r.ids.shape[0], generator=torch.Generator().manual_seed(0))
    cfg = make_cfg(tmp_path, "loss.beta=0", *overrides)
    policy = Policy(
        model, None, [3], None, tmp_path, lora=False, precision=Precision.from_config(cfg.model)
    )
    params = [p for p in model.parameters() if p.requires_grad]
    opt = build_optimizer(params, cfg.optim)
    batch = update_batch(cfg, r, adv)
    sched = build_scheduler(opt, 10, cfg.optim)
    gap = cfg.train.max_logprob_gap  # the trainer's check of the first pass, at its default
    return update_phase(cfg, policy, batch, opt, sched, params, max_logprob_gap=gap)


def test_first_pass_agrees_with_the_sampler_and_the_check_sees_a_mismatch(
    tiny_checkpoints, tmp_path
):
    base = load_model(tiny_checkpoints("qwen3"))
    r = sample(
        base,
        PROMPTS,
        group_size=4,
        max_new_tokens=10,
        temperature=1.0,
        stop_ids=[3],
        seed=0,
        pad_id=0,
    )
    stats = update(tmp_path, copy.deepcopy(base), r)
    assert stats["rollout/logprob_diff_max"] <= 1e-5  # float32, no dropout: the same numbers
    assert stats["rollout/logprob_diff_mean"] <= stats["rollout/logprob_diff_max"]
    assert abs(stats["rollout/first_pass_ratio_mean"] - 1) <= 1e-5

    # the sampler's log-prob of one token off by 0.25: max diff 0.25, and the ratio mean moves
    # by (exp(-0.25) - 1) / n_tokens (hand-computed; the other tokens' ratios are 1 +- 1e-5)
    bad = copy.deepcopy(r)
    bad.logprobs[1, 2] += 0.25
    n = int(r.completion_mask.sum())
    stats = update(tmp_path, copy.deepcopy(base), bad)
    assert stats["rollout/logprob_diff_max"] == pytest.approx(0.25, abs=1e-5)
    assert stats["rollout/first_pass_ratio_mean"] == pytest.approx(
        1 + (math.exp(-0.25) - 1) / n, abs=1e-5
    )


def test_old_logprobs_recompute_is_the_trainer_forward(tiny_checkpoints, tmp_path):
    model = load_model(tiny_checkpoints("qwen3"))
    r = sample(
        model,
        PROMPTS,
        group_size=4,
        max_new_tokens=10,
        temperature=0.7,
        stop_ids=[3],
        seed=1,
        pad_id=0,
    )
    policy = Policy(model, None, [3], None, tmp_path, lora=False)
    m, plan = r.completion_mask, micro_batch_plan(r, 8)
    cfg = make_cfg(tmp_path, "rollout.temperature=0.7")
    assert old_logprobs_phase(cfg, policy, r, m, plan) is None  # sampler (the default)
    cfg = make_cfg(tmp_path, "rollout.temperature=0.7", "loss.old_logprobs=recompute")
    old = old_logprobs_phase(cfg, policy, r, m, plan)
    assert old.shape == r.logprobs.shape
    assert (old - r.logprobs)[m].abs().max().item() <= 1e-5
    assert (old[~m] == 0).all()


def test_sampler_runs_under_the_trainers_precision(tiny_checkpoints, tmp_path):
    """With model.autocast_bf16 the trainer's forward is bf16 autocast; the sampler holds the
    same policy (autocast, float32 head), so the first-pass difference is bf16 rounding between
    two kernels (KV cache vs full sequence), well below the gap a float32 sampler leaves."""
    model = load_model(tiny_checkpoints("qwen3"))
    cfg = make_cfg(tmp_path, "model.autocast_bf16=true", "rollout.max_new_tokens=12")
    precision = Precision.from_config(cfg.model)
    policy = Policy(model, None, [3], None, tmp_path, lora=False, precision=precision)

    class Tok:
        pad_token_id = 0

    policy.tokenizer = Tok()
    rows = [{"prompt_ids": p} for p in PROMPTS]
    matched = sample_round(cfg, policy, Sampler(model, precision=precision), rows, seed=3)
    fp32 = sample(
        model,
        PROMPTS,
        group_size=4,
        max_new_tokens=12,
        temperature=1.0,
        stop_ids=[3],
        seed=3,
        pad_id=0,
    )
    assert not torch.equal(matched.logprobs, fp32.logprobs)  # autocast did reach the sampler
    diffs = {}
    for name, r in (("matched", matched), ("fp32", fp32)):
        stats = update(
            tmp_path,
            copy.deepcopy(model),
            r,
            "model.autocast_bf16=true",
            "rollout.max_new_tokens=12",
        )
        diffs[name] = stats["rollout/logprob_diff_mean"]
    assert diffs["matched"] < diffs["fp32"], diffs
    # bf16 training against a bf16 or a float32 sampler: far below train.max_logprob_gap,
    # which refuses a step past it (update_phase ran that check at its default above)
    assert max(diffs.values()) < TrainConfig().max_logprob_gap / 10, diffs


def test_the_logprob_gap_is_checked_only_where_it_can_only_be_numeric(tmp_path):
    """train.max_logprob_gap applies to a batch the trained policy sampled with the default
    strategy; an older batch (asynchronous, staleness > 0), a plug-in strategy (which may
    replay rows or sample at another temperature) and 0 or null skip it."""
    cfg = make_cfg(tmp_path)
    assert first_pass_gap_limit(cfg, 4, 4) == 0.5  # the default, on a fresh batch
    assert first_pass_gap_limit(cfg, 3, 4) is None  # sampled one update ago
    strategy = make_cfg(tmp_path, "rollout.strategy=my_pkg.s:replay")
    assert first_pass_gap_limit(strategy, 4, 4) is None
    for off in ("0", "null"):
        assert (
            first_pass_gap_limit(make_cfg(tmp_path, f"train.max_logprob_gap={off}"), 4, 4) is None
        )
    with pytest.raises(ConfigError, match="train.max_logprob_gap: must be a finite number >= 0"):
        make_cfg(tmp_path, "train.max_logprob_gap=-1")


def test_grpo_refuses_lora_dropout(tmp_path):
    cfg = make_cfg(tmp_path, "lora.enabled=true", "lora.dropout=0.05")
    with pytest.raises(ConfigError, match="lora.dropout: must be 0 for GRPO"):
        cfg.check_grpo()
    make_cfg(tmp_path, "lora.enabled=true", "lora.dropout=0").check_grpo()

"""The trainer around the registries: KL in the reward, token-level rewards, the entropy bonus
through the fused pass, truncated IS, removed config spellings rejected, and every built-in
variant selectable from YAML end to end."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch
from conftest import update_batch

from grpo.algo import compute_advantages, kl_penalty
from grpo.apps import cli
from grpo.config import load_config
from grpo.experience.batch import RolloutBatch, micro_batch_plan, outcome_token_rewards
from grpo.models import load_model
from grpo.policy import Policy
from grpo.rewards import compute_rewards
from grpo.rollout import sample
from grpo.run.optim import build_optimizer, build_scheduler
from grpo.settings import ConfigError
from grpo.train.grpo import advantage_phase, old_logprobs_phase, update_phase

REPO = Path(__file__).resolve().parents[1]


def cfg_of(*overrides):
    return load_config(
        base={"model": {"path": "unused"}, "train": {"batch_size": 8}}, overrides=list(overrides)
    )


def sampled_batch(model, seed=0):
    r = sample(
        model,
        [[5, 17, 33, 9], [101, 7]],
        group_size=4,
        max_new_tokens=8,
        temperature=1.0,
        stop_ids=[3],
        seed=seed,
        pad_id=0,
    )
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.0, 0.0, 1.0, 1.0, 0.2])
    return RolloutBatch(
        rollout=r,
        rows=[{}] * 8,
        texts=[""] * 8,
        rewards=rewards,
        token_rewards=outcome_token_rewards(rewards, r.completion_mask),
        per_fn={},
        policy_version=0,
        frac_zero_std=0.0,
    )


def test_outcome_token_rewards_sit_on_the_last_token():
    mask = torch.tensor([[True, True, False], [True, False, False]])
    out = outcome_token_rewards(torch.tensor([2.0, -1.0]), mask)
    assert out.tolist() == [[0.0, 2.0, 0.0], [-1.0, 0.0, 0.0]]


def test_kl_in_reward_enters_the_token_rewards(tiny_checkpoints):
    model = load_model(tiny_checkpoints("qwen3"))
    batch = sampled_batch(model)
    mask = batch.rollout.completion_mask
    g = torch.Generator().manual_seed(0)
    ref = batch.rollout.logprobs + 0.3 * torch.randn(mask.shape, generator=g)
    cfg = cfg_of("loss.advantage=reinforce_pp", "loss.kl_in_reward=0.1", "loss.beta=0")
    assert cfg.loss.needs_reference  # the reference runs even with beta 0
    advantages = advantage_phase(cfg, batch, ref)
    kl = kl_penalty(batch.rollout.logprobs, ref, "k3", 20.0, 10.0)
    rewards = outcome_token_rewards(batch.rewards, mask) - 0.1 * torch.where(mask, kl, 0.0)
    want = compute_advantages("reinforce_pp", rewards, mask, group_size=4, eps=1e-4)
    torch.testing.assert_close(advantages, want, rtol=0, atol=0)
    # and the KL term matters: without it the advantages differ
    plain = compute_advantages(
        "reinforce_pp", outcome_token_rewards(batch.rewards, mask), mask, group_size=4, eps=1e-4
    )
    assert (plain - want).abs().max() > 1e-3


def test_token_level_reward_functions():
    def process(completions, completion_lengths, completion_ids, **_):
        # +0.1 on every token whose id is even: a per-token (process) reward
        return [[0.1 * (t % 2 == 0) for t in ids] for ids in completion_ids]

    def outcome(completions, **_):
        return [1.0, 0.0]

    ids = [[4, 5, 6], [7, 8]]
    columns = {"completion_lengths": [3, 2], "completion_ids": ids}
    total, per_fn = compute_rewards(
        [(process, 2.0), (outcome, 1.0)], ["a", "b"], columns, token_width=4
    )
    # row 0: 2 * (0.1, 0, 0.1) + outcome 1 on its last token; row 1: 2 * (0, 0.1)
    torch.testing.assert_close(total, torch.tensor([[0.2, 0.0, 1.2, 0.0], [0.0, 0.2, 0.0, 0.0]]))
    torch.testing.assert_close(per_fn["process"], torch.tensor([0.2, 0.1]))
    from grpo.errors import GrpoError

    with pytest.raises(
        GrpoError,
        match=r"'process' returned 3 per-token values at row 0 for a "
        r"completion of 2 tokens",
    ):
        short = {"completion_lengths": [2, 2], "completion_ids": ids}
        compute_rewards([(process, 1.0)], ["a", "b"], short, token_width=4)
    with pytest.raises(GrpoError, match="per-token rewards need the trainer"):
        compute_rewards([(process, 1.0)], ["a", "b"], columns)


def _update(model, rollout, advantages, *overrides, old_logprobs=None):
    cfg = cfg_of("optim.lr=1e-3", "optim.max_grad_norm=null", *overrides)
    policy = Policy(model, None, [3], None, Path("."), lora=False)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = build_optimizer(params, cfg.optim)
    sched = build_scheduler(opt, 10, cfg.optim)
    batch = update_batch(cfg, rollout, advantages, old_logprobs=old_logprobs)
    return cfg, update_phase(cfg, policy, batch, opt, sched, params)


def test_entropy_bonus_gradient_through_the_fused_pass(tiny_checkpoints):
    """Advantages 0 and beta 0: the only gradient is -coef * d(mean entropy). Compare with the
    entropy of the full softmax in float64, by autograd."""
    base = load_model(tiny_checkpoints("qwen3"))
    r = sampled_batch(base).rollout
    mask = r.completion_mask
    model = copy.deepcopy(base)
    policy = Policy(model, None, [3], None, Path("."), lora=False)
    cfg = cfg_of("loss.beta=0", "loss.entropy_coef=0.5", "optim.lr=1e-3")
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.0)  # a no-op step: read the gradient left behind
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    stats = update_phase(
        cfg, policy, update_batch(cfg, r, torch.zeros(mask.shape)), opt, sched, params
    )
    got = [p.grad.clone() for p in params]

    ref = copy.deepcopy(base).double()
    logits = ref(r.ids, attention_mask=r.attention_mask())[:, r.prompt_width - 1 : -1]
    logp = logits.log_softmax(-1)
    H = -(logp.exp() * logp).sum(-1)[mask]  # (N,)
    (-0.5 * H.mean()).backward()
    for g, p in zip(got, ref.parameters()):
        torch.testing.assert_close(g.double(), p.grad, rtol=1e-5, atol=1e-6)
    assert stats["train/entropy"] == pytest.approx(float(H.mean()), rel=1e-5)


def test_tis_weights_are_one_when_numerics_match(tiny_checkpoints):
    model = load_model(tiny_checkpoints("qwen3"))
    batch = sampled_batch(model)
    cfg = cfg_of("loss.tis_cap=2.0")
    r, m = batch.rollout, batch.rollout.completion_mask
    policy = Policy(model, None, [3], None, Path("."), lora=False)
    old = old_logprobs_phase(cfg, policy, r, m, micro_batch_plan(r, 8))
    assert (old - r.logprobs)[m].abs().max() <= 1e-5
    advantages = advantage_phase(cfg, batch)
    _, stats = _update(model, r, advantages, "loss.tis_cap=2.0", "loss.beta=0", old_logprobs=old)
    assert stats["train/tis_weight_mean"] == pytest.approx(1.0, abs=1e-5)


@pytest.mark.parametrize("key", ["advantage_scale", "importance_level"])
def test_removed_spellings_fail_as_unknown_keys(key, tmp_path):
    # loss.advantage_scale / loss.importance_level were removed (docs/CHANGES.md)
    with pytest.raises(ConfigError, match=f"loss.{key}: unknown key; valid keys of loss: "):
        cfg_of(f"loss.{key}=batch")
    path = tmp_path / "c.yaml"
    path.write_text(f"model: {{path: unused}}\nloss: {{{key}: batch}}\n")
    with pytest.raises(ConfigError, match=f"loss.{key}: unknown key; valid keys of loss: "):
        load_config(path)
    # a run directory of 0.1.0 saved both keys as null: such a config.yaml still loads
    path.write_text(
        "model: {path: unused}\nloss: {advantage_scale: null, importance_level: null}\n"
    )
    assert load_config(path).loss.advantage == "grpo"


@pytest.mark.parametrize("name", ["tiny_ci", "gsm8k_qwen3_0.6b_grpo", "gsm8k_qwen3_0.6b_sft"])
def test_shipped_configs_load_with_the_default_algorithm(name):
    loss = load_config(REPO / "configs" / f"{name}.yaml").loss
    assert (loss.advantage, loss.policy_loss, loss.kl_estimator) == ("grpo", "clip", "k3")


VARIANTS = [
    ["loss.advantage=rloo", "loss.policy_loss=cispo", "loss.policy_loss_kwargs={epsilon_high: 4}"],
    ["loss.advantage=opo", "loss.policy_loss=gmpo", "loss.aggregation=seq_mean_token_mean"],
    [
        "loss.advantage=reinforce_pp",
        "loss.kl_in_reward=0.01",
        "loss.beta=0",
        "loss.token_discount=0.99",
    ],
    ["loss.advantage=reinforce_pp_baseline", "loss.policy_loss=sapo", "loss.entropy_coef=0.01"],
    ["loss.advantage=batch_std", "loss.policy_loss=gspo", "loss.dual_clip=3"],
    [
        "loss.advantage=dr_grpo",
        "loss.policy_loss=gspo_token",
        "loss.tis_cap=2",
        "loss.kl_estimator=k2",
    ],
]


@pytest.mark.parametrize("overrides", VARIANTS, ids=lambda o: o[0].split("=")[1])
def test_variants_run_from_the_command_line(
    shared_tiny_model, tmp_path, monkeypatch, capsys, overrides
):
    # the step reward (lines of reasoning) varies even for a random-init model's replies
    monkeypatch.chdir(tmp_path)
    code = cli.main(
        [
            "train",
            "--config",
            str(REPO / "configs/tiny_ci.yaml"),
            f"model.path={shared_tiny_model}",
            "train.output_dir=run",
            "train.max_steps=2",
            "train.progress=false",
            "data.eval_samples=0",
            "rewards=[{name: step}]",
            *overrides,
        ]
    )
    assert code == 0, capsys.readouterr().err[-2000:]
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(math.isfinite(row["train/loss"]) for row in rows)

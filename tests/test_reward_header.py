"""The run header's reward and strategy records (``run/rewards``: names, weights, kwargs, the
reward model's checkpoint hash; ``run/rollout_strategy``), and `reward_model`'s
``normalize: global``: over two ranks and several sampling rounds it equals normalising the
concatenated global batch in float64."""

from __future__ import annotations

import json
import shutil
import types

import pytest
import torch
from test_reward_model_reward import reward_ckpt  # noqa: F401  (the module's fixture)

from grpo.config import load_config
from grpo.experience.batch import RolloutBatch, outcome_token_rewards
from grpo.experience.collect import _join_rounds
from grpo.experience.normalize import normalize_globally
from grpo.models import load_model, save_pretrained
from grpo.rewards import build_rewards, get_reward
from grpo.rewards.model import checkpoint_hash
from grpo.rewards.records import reward_records
from grpo.rollout import Rollout

G, T_C = 3, 5


def test_the_run_header_records_rewards_and_the_strategy(reward_ckpt, shared_tiny_model, tmp_path):  # noqa: F811
    from grpo.train.grpo import train_grpo

    rewards = (
        "rewards=[{name: accuracy, weight: 1.0}, {name: reward_model, weight: 0.5, "
        f"kwargs: {{path: '{reward_ckpt}', normalize: global}}}}]"
    )
    cfg = load_config(
        "configs/tiny_ci.yaml",
        [
            f"model.path={shared_tiny_model}",
            f"train.output_dir={tmp_path / 'run'}",
            "train.max_steps=1",
            "train.progress=false",
            "data.eval_samples=0",
            "rollout.compile=off",
            rewards,
        ],
    )
    train_grpo(cfg)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    header = rows[0]
    records = json.loads(header["run/rewards"])
    assert [(r["name"], r["weight"]) for r in records] == [("accuracy", 1.0), ("reward_model", 0.5)]
    assert records[1]["kwargs"] == {"path": str(reward_ckpt), "normalize": "global"}
    assert records[1]["checkpoint"]["sha256"] == checkpoint_hash(reward_ckpt)
    assert records[0]["function"].startswith("grpo.rewards.functions:make_accuracy")
    assert "checkpoint" not in records[0]
    strategy = json.loads(header["run/rollout_strategy"])
    assert strategy["name"] == "default" and strategy["kwargs"] == {}
    assert strategy["function"].startswith("grpo.experience.strategies:")
    # the step's one batch, normalised over itself: the model reward's mean is 0, the total
    # is accuracy + 0.5 * that
    (step,) = [r for r in rows if "rollout/reward_mean" in r]
    assert step["rewards/reward_model"] == pytest.approx(0.0, abs=1e-6)
    want = step["rewards/accuracy"] + 0.5 * step["rewards/reward_model"]
    assert step["rollout/reward_mean"] == pytest.approx(want, abs=1e-6)


def test_a_changed_checkpoint_changes_its_hash(reward_ckpt, tmp_path):  # noqa: F811
    copy = tmp_path / "rm"
    shutil.copytree(reward_ckpt, copy)
    spec = {"name": "reward_model", "weight": 1.0, "path": str(copy)}
    before = reward_records(build_rewards([spec]))[0]["checkpoint"]
    assert before == {"path": str(copy), "dir": str(copy), "sha256": checkpoint_hash(reward_ckpt)}
    model = load_model(copy)
    with torch.no_grad():
        model.score.weight[0, 0] += 1e-3  # one weight of the head
    save_pretrained(model, copy)
    after = reward_records(build_rewards([spec]))[0]["checkpoint"]
    assert after["sha256"] != before["sha256"]
    assert len(after["sha256"]) == 16


def test_a_bad_run_record_is_one_line_naming_the_reward():
    from grpo.errors import GrpoError

    def mine(completions, **columns):
        return [0.0] * len(completions)

    mine.run_record = lambda: ["not", "a", "dict"]
    with pytest.raises(GrpoError, match="reward 'mine': run_record\\(\\) returned list"):
        reward_records([(get_reward(mine), 1.0)])


# --------------------------------------------------------------- normalize: global, two ranks


def verifier(completions, **columns):
    return [0.0] * len(completions)


def scores(completions, **columns):
    return [0.0] * len(completions)


scores.global_normalize = True
REWARDS = [(get_reward(verifier), 1.0), (get_reward(scores), 0.5)]


def sampling_round(rank: int, round_: int, P: int) -> RolloutBatch:
    """One sampling round's scored batch of P groups: seeded raw scores per (rank, round), a
    verifier in {0, 1}; every other group of round 0 has all-equal totals (dropped, refilled)."""
    g = torch.Generator().manual_seed(100 * rank + round_)
    B = P * G
    lens = torch.randint(1, T_C + 1, (B,), generator=g)
    mask = torch.arange(T_C)[None] < lens[:, None]
    raw = 3.0 + 2.0 * torch.randn(B, generator=g)
    right = (torch.rand(B, generator=g) > 0.5).float()
    if round_ == 0:
        for p in range(0, P, 2):  # no signal: equal totals in the group
            raw[p * G : (p + 1) * G] = raw[p * G]
            right[p * G : (p + 1) * G] = 1.0
    total = right + 0.5 * raw
    ids = torch.randint(3, 50, (B, 2 + T_C), generator=g)
    rollout = Rollout(
        ids=ids,
        prompt_lens=torch.full((B,), 2),
        prompt_width=2,
        completion_ids=ids[:, 2:],
        completion_mask=mask,
        completion_lens=lens,
        finished=torch.ones(B, dtype=torch.bool),
        logprobs=torch.zeros(B, T_C),
        group_size=G,
    )
    return RolloutBatch(
        rollout=rollout,
        rows=[{"i": (rank, round_, b // G)} for b in range(B)],
        texts=[""] * B,
        rewards=total,
        token_rewards=outcome_token_rewards(total, mask),
        per_fn={"verifier": right, "scores": raw},
        policy_version=0,
        frac_zero_std=0.0,
    )


def normalize_on_rank(dist, P: int = 4) -> dict:
    """This rank's step batch (the kept groups of two rounds, then the dropped ones, as
    `rollout_batches` joins them), before and after `normalize_globally` over the ranks."""
    rounds = [sampling_round(dist.rank, r, P) for r in range(2)]
    kept = [(0, p) for p in range(1, P, 2)] + [(1, p) for p in range(P)]
    order = kept[: P - 1] + [(0, 0)]  # a dropped group fills the last place
    tok = types.SimpleNamespace(pad_token_id=0)
    batch = _join_rounds(rounds, order, tok, 1, None)
    out = normalize_globally(batch, REWARDS, dist)
    return {
        "raw": batch.per_fn["scores"].tolist(),
        "verifier": batch.per_fn["verifier"].tolist(),
        "scores": out.per_fn["scores"].tolist(),
        "rewards": out.rewards.tolist(),
        "token_sums": out.token_rewards.double().sum(-1).tolist(),
        "last": out.token_rewards[torch.arange(batch.size), out.rollout.completion_lens - 1]
        .double()
        .tolist(),
    }


def float64_reference(ranks: list[dict]) -> torch.Tensor:
    raw = torch.tensor([x for r in ranks for x in r["raw"]], dtype=torch.float64)
    return (raw - raw.mean()) / raw.std()


@pytest.mark.parametrize("world", [1, 2])
def test_global_normalisation_equals_the_concatenated_batch_in_float64(world, rank_pool):
    if world == 1:
        from grpo.distributed import SINGLE

        ranks = [normalize_on_rank(SINGLE, P=8)]
    else:
        ranks = rank_pool.run("test_reward_header:normalize_on_rank")
    want = float64_reference(ranks)
    got = torch.tensor([x for r in ranks for x in r["scores"]], dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=0, atol=2e-6)  # float32 storage of the result
    verifier_ = torch.tensor([x for r in ranks for x in r["verifier"]], dtype=torch.float64)
    rewards = torch.tensor([x for r in ranks for x in r["rewards"]], dtype=torch.float64)
    torch.testing.assert_close(rewards, verifier_ + 0.5 * want, rtol=0, atol=4e-6)
    sums = torch.tensor([x for r in ranks for x in r["token_sums"]], dtype=torch.float64)
    last = torch.tensor([x for r in ranks for x in r["last"]], dtype=torch.float64)
    torch.testing.assert_close(sums, rewards, rtol=0, atol=4e-6)  # on the last token
    torch.testing.assert_close(last, rewards, rtol=0, atol=4e-6)
    if world == 2:  # not each rank's own statistics
        own = torch.tensor(ranks[0]["raw"], dtype=torch.float64)
        alone = (own - own.mean()) / own.std()
        assert (torch.tensor(ranks[0]["scores"]).double() - alone).abs().max() > 1e-2

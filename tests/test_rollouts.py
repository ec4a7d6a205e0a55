"""The rollout phase as a value: `rollout_phase` returns one self-contained `RolloutBatch`; with
dynamic sampling its groups are those a per-group selection of each round gives (signal groups
first, in the order sampled, then the flat ones), with scores moved along."""

from __future__ import annotations

import pytest
import torch

import grpo.experience.collect as rollouts
from grpo.config import load_config
from grpo.experience.batch import cat_rollouts, outcome_token_rewards, select_rows
from grpo.experience.strategies import register_rollout_strategy
from grpo.models import load_model
from grpo.policy import Policy
from grpo.rollout import Sampler
from grpo.run.state import TrainState

G = 2


class _Tok:
    pad_token_id = 0

    def decode(self, ids, skip_special_tokens=False):
        return " ".join(map(str, ids))


def signal_only_when_varied(completions, kind, **_):
    """1/0 alternating inside a group of a 'varied' row, 0 for every row of a 'flat' one."""
    return [float(i % 2) if k == "varied" else 0.0 for i, k in enumerate(kind)]


def _setup(tiny_checkpoints, tmp_path, *overrides):
    calls = []  # (rows, rollout) of every sampling round

    @register_rollout_strategy("test_rollouts_recording", overwrite=True)
    def recording(rows, sampling):  # the default strategy, recorded
        r = sampling.sample(rows)
        calls.append((rows, r))
        return sampling.score(r, rows)

    model = load_model(tiny_checkpoints("qwen3"))
    cfg = load_config(
        base={"model": {"path": str(tmp_path)}},
        overrides=[
            f"rollout.group_size={G}",
            "train.batch_size=6",
            "rollout.max_new_tokens=6",
            "rollout.strategy=test_rollouts_recording",
            *overrides,
        ],
    )
    policy = Policy(model, _Tok(), [3], None, tmp_path, lora=False)
    g = torch.Generator().manual_seed(0)
    kinds = ["flat", "flat", "varied", "flat", "varied", "flat", "flat", "varied"] * 2
    rows = [
        {"prompt_ids": torch.randint(4, 200, (2 + i % 5,), generator=g).tolist(), "kind": kind}
        for i, kind in enumerate(kinds)
    ]
    return cfg, policy, Sampler(model), rows, calls


def test_without_dynamic_sampling_the_round_is_the_batch(tiny_checkpoints, tmp_path):
    cfg, policy, sampler, rows, calls = _setup(tiny_checkpoints, tmp_path)
    fns = [(signal_only_when_varied, 1.0)]
    batch = rollouts.rollout_phase(cfg, policy, sampler, rows, TrainState(), fns, step=4)
    assert len(calls) == 1 and batch.rollout is calls[0][1]  # not split and re-joined
    assert batch.policy_version == 4 and batch.size == 6
    picked = calls[0][0]
    assert batch.rows == [r for r in picked for _ in range(G)]
    want = torch.tensor(signal_only_when_varied(None, [r["kind"] for r in batch.rows]))
    assert torch.equal(batch.rewards, want)
    assert torch.equal(
        batch.token_rewards, outcome_token_rewards(want, batch.rollout.completion_mask)
    )
    flat = sum(r["kind"] == "flat" for r in picked)
    assert batch.frac_zero_std == pytest.approx(flat / 3)


@pytest.mark.parametrize("rounds", [2, 4])
def test_dynamic_sampling_equals_per_group_selection(tiny_checkpoints, tmp_path, rounds):
    cfg, policy, sampler, rows, calls = _setup(
        tiny_checkpoints,
        tmp_path,
        "rollout.dynamic_sampling=true",
        f"rollout.max_sampling_rounds={rounds}",
    )
    fns = [(signal_only_when_varied, 1.0)]
    batch = rollouts.rollout_phase(cfg, policy, sampler, rows, TrainState(), fns, step=0)
    # the reference: each round's groups one by one, signal ones kept, flat ones spare
    kept, spare = [], []
    for picked, r in calls:
        for p, row in enumerate(picked):  # a round samples only the prompts still needed
            (kept if row["kind"] == "varied" else spare).append((row, r, p))
    assert len(calls) <= rounds
    order = (kept + spare)[:3]
    if len(kept) >= 3:
        assert all(row["kind"] == "varied" for row, _, _ in order)
    pieces = [select_rows(r, torch.arange(p * G, (p + 1) * G)) for _, r, p in order]
    want = cat_rollouts(pieces, pad_id=0)
    for name in (
        "ids",
        "completion_ids",
        "completion_mask",
        "logprobs",
        "finished",
        "prompt_lens",
        "completion_lens",
        "generated_mask",
    ):
        assert torch.equal(getattr(batch.rollout, name), getattr(want, name)), name
    assert batch.rows == [row for row, _, _ in order for _ in range(G)]
    rewards = torch.tensor(signal_only_when_varied(None, [r["kind"] for r in batch.rows]))
    assert torch.equal(batch.rewards, rewards)
    assert torch.equal(batch.token_rewards, outcome_token_rewards(rewards, want.completion_mask))
    assert batch.texts == want.decode(_Tok(), skip_special_tokens=True)
    first = calls[0][0]
    assert batch.frac_zero_std == pytest.approx(sum(r["kind"] == "flat" for r in first) / 3)

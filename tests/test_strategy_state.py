"""A rollout strategy's state (`grpo.experience.strategy_state`): docs/extending.md's
off-policy replay strategy interrupted and resumed ends bitwise where the uninterrupted run
ends (weights, metrics, the buffer in the checkpoint); kept batches and saved states come back
bitwise; the `replayed` extra keeps replayed groups' rows and is checked; the truncated
importance weights' stats by row kind against a float64 reference, over micro-batches."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
from pathlib import Path

import pytest
import torch
from conftest import LENGTH_REWARD, docs_example, write_package

from grpo.algo.losses import LossSettings, policy_loss_on_device
from grpo.config import load_config
from grpo.distributed import SINGLE
from grpo.errors import GrpoError
from grpo.experience.inline import make_sampler
from grpo.experience.strategies import (
    Sampling,
    check_strategy,
    register_rollout_strategy,
    run_strategy,
)
from grpo.experience.strategy_state import (
    StrategyState,
    _raw,
    _unraw,
    load_state,
    save_states,
)
from grpo.io import load_safetensors
from grpo.loading import load_rows
from grpo.metrics import read_metrics
from grpo.policy import build_policy
from grpo.rewards import build_rewards
from grpo.run.rundir import TrainingInterrupted
from grpo.run.state import checkpoint_weights
from grpo.run.stats import StatSums

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs" / "tiny_ci.yaml")
PKG = "replay_inproc"  # a name of its own: this process keeps what it imported


def length_reward(completions, **_):
    return [len(c) / 10 for c in completions]


@pytest.fixture(scope="module")
def setup(shared_tiny_model):
    cfg = load_config(
        TINY, [f"model.path={shared_tiny_model}", "rollout.compile=off", "rollout.max_new_tokens=8"]
    )
    policy = build_policy(cfg, torch.device("cpu"), need_ref=False)
    policy.model.eval()
    rows = load_rows(cfg.data, cfg.data.split, 6, "rl", policy.tokenizer)[:3]
    sampler = make_sampler(cfg, policy, policy.model)
    rewards = build_rewards([length_reward])

    def sampling(seed=7):
        return Sampling(cfg, policy, sampler, rewards, None, seed, step=0)

    return cfg, rows, sampling


def equal_batches(a, b) -> None:
    for f in ("ids", "prompt_lens", "completion_ids", "completion_mask", "logprobs", "finished"):
        x, y = getattr(a.rollout, f), getattr(b.rollout, f)
        assert x.dtype == y.dtype and torch.equal(x, y), f
    assert torch.equal(a.rewards, b.rewards) and torch.equal(a.token_rewards, b.token_rewards)
    assert a.rows == b.rows and a.texts == b.texts and a.rollout.group_size == b.rollout.group_size
    assert a.extras.keys() == b.extras.keys()
    assert all(torch.equal(a.extras[k], b.extras[k]) for k in a.extras)


def mark_of(batch):
    return batch.extras["replayed"]


def test_a_kept_batch_and_a_saved_state_come_back_bitwise(setup, tmp_path):
    cfg, rows, sampling = setup
    s = sampling()
    batch = s.score(s.sample(rows), rows)
    batch = dataclasses.replace(
        batch, extras={"replayed": torch.arange(batch.size) % 2 == 0, "w": torch.rand(batch.size)}
    )
    state = StrategyState()
    state.put_batch("buffer", batch)
    state.tensors["bf16"] = torch.randn(3, 5).to(torch.bfloat16)
    state.values["count"] = 3
    equal_batches(state.batch("buffer"), batch)
    save_states(tmp_path, [state.packed("s"), StrategyState().packed("s")])  # two ranks
    back = StrategyState()
    load_state(tmp_path, 0, back, "s")
    equal_batches(back.batch("buffer"), batch)
    assert torch.equal(back.tensors["bf16"], state.tensors["bf16"])
    assert back.values == state.values and back.values["count"] == 3
    other = StrategyState()
    load_state(tmp_path, 1, other, "s")  # each rank its own
    assert other.values == {} and other.tensors == {}
    with pytest.raises(GrpoError, match="strategy states of 2 rank.*none of rank 2"):
        load_state(tmp_path, 2, StrategyState(), "s")
    # how tensors travel between ranks at a save (gather_states): rebuilt bitwise
    for t in (state.tensors["bf16"], torch.tensor(2.5), torch.zeros(0, 4), mark_of(batch)):
        back_t = _unraw(_raw("t", t))[1]
        assert back_t.dtype == t.dtype and back_t.shape == t.shape and torch.equal(back_t, t)
    state.values["bad"] = object()
    with pytest.raises(GrpoError, match="'s': state.values cannot be saved as JSON"):
        state.packed("'s'")


def test_replayed_groups_keep_their_rows_and_the_mark_is_checked(setup):
    cfg, rows, sampling = setup
    G = cfg.rollout.group_size
    s = sampling()
    scored = s.score(s.sample(rows), rows)
    fresh, old = scored.select_groups([0, 1]), scored.select_groups([2])  # old: "sampled earlier"
    mark = torch.tensor([False] * 2 * G + [True] * G)

    current = {}

    @register_rollout_strategy("test_replayed_rows")
    def fn(rows, sampling):  # the first two prompts fresh, then the replayed group
        return dataclasses.replace(sampling.cat([fresh, old]), extras=current)

    # the prompts handed over: the first two answered fresh, the third's slot replayed
    picked = [rows[0], rows[1], rows[0]]

    def run(extras):
        current.clear()
        current.update(extras)
        r = dataclasses.replace(cfg.rollout, strategy="test_replayed_rows")
        return run_strategy(dataclasses.replace(cfg, rollout=r), sampling(), picked, 0, 0)

    out = run({"replayed": mark})
    assert out.rows[: 2 * G] == [picked[0]] * G + [picked[1]] * G
    assert out.rows[2 * G :] == [rows[2]] * G  # its own row, not the prompt in its place
    part = torch.tensor([False] * (2 * G) + [True] * (G - 1) + [False])
    for bad, message in (
        (mark.float(), rf"extras\['replayed'\] is torch.float32 \({3 * G},\); expected bool"),
        (part, "marks part of group 2"),
    ):
        with pytest.raises(GrpoError, match=message):
            run({"replayed": bad})


def test_a_strategy_with_state_is_refused_with_async_rollouts():
    def keeper(rows, sampling, state):
        return sampling.score(sampling.sample(rows), rows)

    check_strategy(keeper, {}, asynchronous=False)
    with pytest.raises(GrpoError, match="rollout.strategy: .* keeps state .* rollout.async=off"):
        check_strategy(keeper, {}, asynchronous=True)


def test_importance_weights_by_row_kind_match_float64_over_micro_batches():
    """Two micro-batches (the first without a replayed row): the means are over each kind's
    tokens of the whole batch, the clip fraction and max as defined, against float64."""
    g = torch.Generator().manual_seed(0)
    B, T, cap = 6, 5, 1.5
    mask = torch.rand(B, T, generator=g) > 0.3
    mask[:, 0] = True
    old = -torch.rand(B, T, generator=g) * 2
    behaviour = old + torch.randn(B, T, generator=g) * 0.6
    replayed = torch.tensor([False, False, False, True, False, True])
    adv = torch.randn(B, generator=g)
    cfg = LossSettings(tis_cap=cap)
    sums = StatSums()
    for sl in (slice(0, 3), slice(3, 6)):
        _, st, _ = policy_loss_on_device(
            old[sl].clone().requires_grad_(),
            old[sl],
            None,
            adv[sl],
            mask[sl],
            cfg,
            behaviour_logprobs=behaviour[sl],
            replayed=replayed[sl],
        )
        sums.add(st)
    got = sums.reduce(SINGLE)
    ratio = torch.exp(old.double() - behaviour.double())
    for kind, rows in (("fresh", ~replayed), ("replayed", replayed)):
        m = mask & rows[:, None]
        r = ratio[m]
        assert got[f"train/tis_weight_mean_{kind}"] == pytest.approx(
            float(r.clamp(max=cap).mean()), rel=1e-6
        )
        assert got[f"train/tis_clip_frac_{kind}"] == pytest.approx(float((r > cap).double().mean()))
        assert got[f"train/tis_ratio_{kind}_max"] == pytest.approx(float(r.max()), rel=1e-6)
    assert got["train/tis_weight_mean"] == pytest.approx(
        float(ratio[mask].clamp(max=cap).mean()), rel=1e-6
    )
    # no replayed row anywhere: no mean (NaN), not a 0
    sums = StatSums()
    _, st, _ = policy_loss_on_device(
        old.clone().requires_grad_(),
        old,
        None,
        adv,
        mask,
        cfg,
        behaviour_logprobs=behaviour,
        replayed=torch.zeros(B, dtype=torch.bool),
    )
    sums.add(st)
    got = sums.reduce(SINGLE)
    assert math.isnan(got["train/tis_weight_mean_replayed"])
    assert math.isnan(got["train/tis_ratio_replayed_max"])
    assert not math.isnan(got["train/tis_weight_mean_fresh"])


def test_the_docs_replay_strategy_survives_resume_bitwise(shared_tiny_model, tmp_path, monkeypatch):
    """docs/extending.md's replay strategy (1 fresh + 1 replayed group a step from step 2,
    loss.tis_cap): 3 steps straight, against 2 steps, a stop (SIGTERM: checkpoint at step 2),
    and --resume to 3 (whose replayed group comes from the restored buffer: an empty one would
    replay none). The weights, every metric but timings and headers, and the buffer in the
    step-3 checkpoint are bitwise the straight run's."""
    from grpo.train.grpo import train_grpo

    write_package(
        tmp_path,
        {"replay.py": docs_example("# my_pkg/replay.py"), "rewards.py": LENGTH_REWARD},
        name=PKG,
    )
    monkeypatch.syspath_prepend(str(tmp_path))

    def config(out: str):
        return load_config(
            TINY,
            [
                f"model.path={shared_tiny_model}",
                f"train.output_dir={tmp_path / out}",
                "train.progress=false",
                "data.eval_samples=0",
                "rollout.compile=off",
                "train.save_every=2",
                "train.log_every=1",
                "train.max_steps=3",
                "rollout.max_new_tokens=6",
                "loss.beta=0",
                "loss.num_iterations=1",
                "loss.tis_cap=2.0",
                f"rollout.strategy={PKG}.replay:replay",
                "rollout.strategy_kwargs={k: 1, capacity: 3}",
                f"rewards=[{{name: {PKG}.rewards:length}}]",
            ],
        )

    train_grpo(config("straight"))

    def stop_at_2(step, metrics):
        if step == 2:  # as a scheduler's SIGTERM: the run checkpoints this step and stops
            os.kill(os.getpid(), signal.SIGTERM)

    with pytest.raises(TrainingInterrupted):
        train_grpo(config("cut"), on_step=stop_at_2)
    assert not (tmp_path / "cut" / "checkpoints" / "step_000003").exists()
    train_grpo(config("cut"), resume=True)

    a = checkpoint_weights(tmp_path / "straight" / "checkpoints" / "step_000003")
    b = checkpoint_weights(tmp_path / "cut" / "checkpoints" / "step_000003")
    assert a.keys() == b.keys() and a
    assert all(torch.equal(a[k], b[k]) for k in a)

    def steps(out: str) -> dict[int, dict]:
        rows = read_metrics(tmp_path / out / "metrics.jsonl")
        return {
            r["step"]: {k: v for k, v in r.items() if k.split("/")[0] not in ("perf", "run")}
            for r in rows
            if "strategy/replayed_groups" in r
        }

    want, got = steps("straight"), steps("cut")
    assert sorted(want) == sorted(got) == [1, 2, 3]
    assert json.dumps(got[3], sort_keys=True) == json.dumps(want[3], sort_keys=True)
    assert [want[s]["strategy/replayed_groups"] for s in (1, 2, 3)] == [0, 1, 1]
    assert math.isnan(want[1]["train/tis_weight_mean_replayed"])
    for s in (2, 3):
        assert 0 < want[s]["train/tis_weight_mean_replayed"] <= 2.0
        assert 0 <= want[s]["train/tis_clip_frac_replayed"] <= 1
        assert want[s]["train/tis_ratio_replayed_max"] > 0
    for out in ("straight", "cut"):
        d = tmp_path / out / "checkpoints" / "step_000003" / "strategy"
        assert sorted(p.name for p in d.iterdir()) == ["rank_00000.json", "rank_00000.safetensors"]
    saved = []
    for out in ("straight", "cut"):
        base = tmp_path / out / "checkpoints" / "step_000003" / "strategy" / "rank_00000"
        saved.append(
            (
                json.loads(base.with_suffix(".json").read_text()),
                load_safetensors(base.with_suffix(".safetensors")),
            )
        )
    (va, ta), (vb, tb) = saved
    assert va == vb and va["replayed"] == 2 and len(va["buffer"]["rows"]) == 3 * 4
    assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)


@pytest.mark.process
def test_each_rank_resumes_its_own_buffer_under_torchrun(shared_tiny_model, tmp_path):
    """2 torchrun ranks, each with its own buffer (its own prompts and seeds): a checkpoint
    holds both ranks' states, different; the run cut after step 2 (its step-3 checkpoint and
    records removed, as a kill would leave it) resumes to step 3 bitwise: weights, metrics,
    and each rank's buffer."""
    import shutil
    import subprocess
    import sys

    write_package(
        tmp_path,
        {"replay.py": docs_example("# my_pkg/replay.py"), "rewards.py": LENGTH_REWARD},
        name="my_pkg",
    )
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO), str(REPO / "kernels")]),
    }
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "-m",
        "grpo",
        "train",
        "--config",
        TINY,
        f"model.path={shared_tiny_model}",
        "train.progress=false",
        "data.eval_samples=0",
        "rollout.compile=off",
        "train.save_every=2",
        "train.log_every=1",
        "train.max_steps=3",
        "train.batch_size=8",
        "rollout.max_new_tokens=6",
        "loss.beta=0",
        "loss.num_iterations=1",
        "loss.tis_cap=2.0",
        "rollout.strategy=my_pkg.replay:replay",
        "rollout.strategy_kwargs={k: 1, capacity: 3}",
        "rewards=[{name: my_pkg.rewards:length}]",
    ]

    def train(*more: str) -> None:
        r = subprocess.run(
            [*cmd, *more], cwd=tmp_path, capture_output=True, text=True, env=env, timeout=600
        )
        assert r.returncode == 0, r.stderr[-3000:]

    train("train.output_dir=straight")
    shutil.copytree(tmp_path / "straight", tmp_path / "cut")
    shutil.rmtree(tmp_path / "cut" / "checkpoints" / "step_000003")
    shutil.rmtree(tmp_path / "cut" / "final")
    (tmp_path / "cut" / "checkpoints" / "latest").write_text("step_000002\n")
    train("train.output_dir=cut", "--resume")

    def state(out: str, rank: int):
        base = tmp_path / out / "checkpoints" / "step_000003" / "strategy" / f"rank_{rank:05d}"
        values = json.loads(base.with_suffix(".json").read_text())
        return values, load_safetensors(base.with_suffix(".safetensors"))

    for rank in (0, 1):
        (va, ta), (vb, tb) = state("straight", rank), state("cut", rank)
        assert va == vb and va["replayed"] == 2
        assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)
    assert state("straight", 0)[0]["buffer"]["rows"] != state("straight", 1)[0]["buffer"]["rows"]
    a = checkpoint_weights(tmp_path / "straight" / "checkpoints" / "step_000003")
    b = checkpoint_weights(tmp_path / "cut" / "checkpoints" / "step_000003")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    want, got = (
        {
            r["step"]: {k: v for k, v in r.items() if k.split("/")[0] not in ("perf", "run")}
            for r in read_metrics(tmp_path / out / "metrics.jsonl")
            if "strategy/replayed_groups" in r
        }
        for out in ("straight", "cut")
    )
    assert json.dumps(got[3], sort_keys=True) == json.dumps(want[3], sort_keys=True)
    assert want[3]["strategy/replayed_groups"] == 2  # one a rank, summed

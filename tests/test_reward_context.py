"""Rewards that know their context (`RewardContext`), report metrics beside their values, the
built-in `overlong` reward (DAPO's soft overlong punishment) against a hand computation, and
what a step's sampling reports (groups sampled / kept / all right / all wrong, refill rounds),
reduced over ranks as each value's type declares. docs/extending.md's example runs as written
under torchrun with 2 ranks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import docs_example, torchrun_train, write_package

from grpo.errors import GrpoError
from grpo.metrics import Max, Min, Sum, reduction
from grpo.rewards import (
    RewardContext,
    build_rewards,
    compute_rewards,
    get_reward,
    make_combined,
    make_overlong,
    wants_context,
)
from grpo.rewards.bounds import reward_bounds
from grpo.run.stats import reduce_metrics

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs" / "tiny_ci.yaml")


# -- overlong: DAPO's soft overlong punishment ------------------------------------------------


def dapo_overlong(n: int, L_max: int, buffer: int, penalty: float) -> float:
    """Eq. (13) of DAPO (Yu et al. 2025), times the penalty, in float64 arithmetic."""
    if n <= L_max - buffer:
        return 0.0
    if n <= L_max:
        return penalty * ((L_max - buffer) - n) / buffer
    return -penalty


@pytest.mark.parametrize("L_max, buffer, penalty", [(20, 5, 0.5), (16, 8, 1.0), (7, 7, 2.0)])
def test_overlong_equals_the_definition(L_max, buffer, penalty):
    lengths = list(range(0, L_max + 4))
    texts = ["x"] * len(lengths)
    want = [dapo_overlong(n, L_max, buffer, penalty) for n in lengths]
    by_context = make_overlong(buffer=buffer, penalty=penalty)(
        texts, completion_lengths=lengths, context=RewardContext(max_new_tokens=L_max)
    )
    by_kwarg = make_overlong(buffer=buffer, penalty=penalty, max_length=L_max)(
        texts, completion_lengths=lengths
    )
    assert by_context == pytest.approx(want, abs=1e-12) and by_kwarg == by_context
    assert reward_bounds(make_overlong(penalty=penalty)) == (-penalty, 0.0)
    assert min(by_context) == -penalty and max(by_context) == 0.0


def test_overlong_default_buffer_is_a_fifth_and_errors_name_the_problem():
    lengths = [16, 17, 18, 20]  # L_max 20: the zone is (16, 20]
    got = make_overlong()(
        ["x"] * 4, completion_lengths=lengths, context=RewardContext(max_new_tokens=20)
    )
    assert got == pytest.approx([0.0, -0.25, -0.5, -1.0])
    with pytest.raises(GrpoError, match="buffer must be a whole number"):
        make_overlong(buffer=0)
    with pytest.raises(GrpoError, match="penalty must be a finite number >= 0"):
        make_overlong(penalty=-1)
    with pytest.raises(GrpoError, match="needs the completion budget"):
        make_overlong()(["x"], completion_lengths=[3])
    with pytest.raises(GrpoError, match="overlong.*completion_lengths"):
        compute_rewards(build_rewards([{"name": "overlong", "max_length": 8}]), ["x"], {})


# -- the context and reported metrics through compute_rewards --------------------------------


def test_a_reward_declaring_context_gets_it_and_others_do_not():
    seen = {}

    def with_context(completions, *, context, **_):
        seen["context"] = context
        return [float(c) for c in context.truncated]

    def plain(completions, **columns):
        seen["plain"] = sorted(columns)
        return [0.0] * len(completions)

    ctx = RewardContext(step=3, max_new_tokens=16, truncated=(True, False), device="cpu")
    total, per_fn = compute_rewards(
        build_rewards([with_context, plain]), ["a", "b"], {"ground_truth": ["1", "2"]}, context=ctx
    )
    assert seen["context"] is ctx and seen["plain"] == ["ground_truth"]
    assert total.tolist() == [1.0, 0.0] and per_fn["with_context"].tolist() == [1.0, 0.0]
    assert wants_context(get_reward("overlong")) and not wants_context(plain)
    # combined passes the context on to its parts
    both = make_combined([with_context, {"name": "overlong", "buffer": 2}])
    got = both(["a", "b"], completion_lengths=[16, 10], context=ctx)
    assert got == pytest.approx([1.0 - 1.0, 0.0])
    # called without one (outside training): an empty context, fields None
    seen.clear()
    with pytest.raises(GrpoError, match="with_context.*NoneType"):
        compute_rewards(build_rewards([with_context]), ["a"], {})
    assert seen["context"] == RewardContext()


def test_a_context_column_and_a_context_parameter_are_refused_together():
    def with_context(completions, *, context, **_):
        return [0.0] * len(completions)

    with pytest.raises(
        GrpoError,
        match="'with_context' declares a `context` parameter and the "
        "rows have a column named 'context'",
    ):
        compute_rewards(build_rewards([with_context]), ["a"], {"context": ["some passage"]})


def test_reported_metrics_keep_their_reduction_and_bad_ones_are_named():
    def counted(completions, **_):
        return [1.0] * len(completions), {
            "n": Sum(len(completions)),
            "top": Max(2.5),
            "low": Min(-1),
            "avg": torch.tensor(0.25),
        }

    out: dict = {}
    total, _ = compute_rewards(build_rewards([counted]), ["a", "b"], {}, metrics=out)
    assert total.tolist() == [1.0, 1.0]
    assert out == {
        "rewards/counted/n": 2,
        "rewards/counted/top": 2.5,
        "rewards/counted/low": -1,
        "rewards/counted/avg": 0.25,
    }
    assert [reduction(out[f"rewards/counted/{k}"]) for k in ("n", "top", "low", "avg")] == [
        "sum",
        "max",
        "min",
        "mean",
    ]

    def bad(completions, **_):
        return [0.0] * len(completions), {"n": float("nan")}

    with pytest.raises(GrpoError, match="'bad' reported the metric 'n': nan"):
        compute_rewards(build_rewards([bad]), ["a"], {}, metrics={})


def test_reduce_metrics_on_one_process_is_the_identity():
    values = {"a": 1.5, "b": Sum(3), "c": Max(2), "d": Min(-4)}
    assert reduce_metrics(values) == {"a": 1.5, "b": 3.0, "c": 2.0, "d": -4.0}


# -- sampling metrics: a step's groups ------------------------------------------------------


def test_sampling_metrics_count_groups_by_hand():
    from grpo.experience.collect import sampling_metrics

    class B:  # what sampling_metrics reads of a RolloutBatch
        def __init__(self, rewards, G=2):
            self.rewards = torch.tensor(rewards)
            self.size = len(rewards)
            self.rollout = type("R", (), {"group_size": G})()

    first = B([1.0, 1.0, 0.0, 0.0, 0.0, 1.0])  # all right, all wrong, mixed
    refill = B([0.0, 1.0, 1.0, 1.0])  # mixed, all right
    batch = B([0.0, 1.0, 0.0, 1.0, 1.0, 1.0])  # trained on: 2 groups with signal
    out = sampling_metrics([first, refill], batch, 1, (0.0, 1.0))
    assert out == {
        "rollout/groups_sampled": 5,
        "rollout/groups_kept": 2,
        "rollout/refill_rounds": 1,
        "rollout/groups_all_right": 2,
        "rollout/groups_all_wrong": 1,
    }
    assert [reduction(v) for v in out.values()] == ["sum", "sum", "max", "sum", "sum"]
    no_bounds = sampling_metrics([first], first, 0, None)
    assert "rollout/groups_all_right" not in no_bounds
    unbounded_below = sampling_metrics([first], first, 0, (float("-inf"), 1.0))
    assert "rollout/groups_all_wrong" not in unbounded_below


# -- docs/extending.md's example under torchrun, 2 ranks ---------------------------------------


@pytest.mark.process
def test_docs_example_under_torchrun_two_ranks(shared_tiny_model, tmp_path):
    """The example's reward on 2 ranks: its counts are sums over the ranks (a mean would give
    half), and with dynamic sampling the step's sampling counts add up over rounds."""
    write_package(tmp_path, {"rewards.py": docs_example("# my_pkg/rewards.py")})
    rewards = (
        "rewards=[{name: my_pkg.rewards:finished_right}, {name: overlong, kwargs: {buffer: 8}}]"
    )
    B, G, rounds = 16, 4, 3  # tiny_ci: 8 rows per rank, groups of 4; 3 sampling rounds at most
    for m in torchrun_train(tmp_path, shared_tiny_model, "plain", rewards):
        assert m["rewards/finished_right/cut"] == pytest.approx(m["rollout/truncated_frac"] * B)
        assert m["rewards/finished_right/budget"] == 16
        assert m["rollout/groups_sampled"] == B // G and m["rollout/refill_rounds"] == 0
        assert m["rollout/groups_kept"] == pytest.approx(
            (1 - m["rollout/frac_zero_std_groups"]) * B // G
        )
        # the total's bounds are [-1, 1]; a random model is never right
        assert m["rollout/groups_all_right"] == 0
        assert 0 <= m["rollout/groups_all_wrong"] <= B // G
        assert -1.0 <= m["rewards/overlong"] <= 0.0
    for m in torchrun_train(
        tmp_path, shared_tiny_model, "dynamic", rewards, "rollout.dynamic_sampling=true"
    ):
        n = m["rollout/refill_rounds"]
        assert n in range(rounds)
        assert B // G <= m["rollout/groups_sampled"] <= (B // G) * (1 + n)
        assert 0 <= m["rollout/groups_kept"] <= B // G
        assert m["rewards/finished_right/cut"] <= m["rollout/groups_sampled"] * G


# -- a KL estimator's metrics ----------------------------------------------------------------


def test_a_kl_estimators_metrics_are_token_weighted_in_the_loss_stats():
    """A KL estimator returning (kl, {"d_max": per-token, "d": per-token}): the loss stats get
    kl_d (the mean over counted tokens) and kl_d_max (their max), by hand."""
    from grpo.algo import register_kl
    from grpo.algo.losses import LossSettings, policy_loss

    @register_kl("test_k3_reporting", overwrite=True)
    def k3_reporting(logprobs, ref_logprobs):
        d = ref_logprobs - logprobs
        return torch.exp(d) - d - 1.0, {"d": d.abs(), "d_max": d.abs()}

    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(3, 5, generator=g, dtype=torch.float64)
    ref = -torch.rand(3, 5, generator=g, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.bool)
    cfg = LossSettings(beta=0.04, kl_estimator="test_k3_reporting")
    _, stats = policy_loss(logp.float(), logp.float(), ref.float(), torch.ones(3), mask, cfg)
    d = (ref - logp).abs()
    assert stats["kl_d"] == pytest.approx(float(d[mask].mean()), rel=1e-5)
    assert stats["kl_d_max"] == pytest.approx(float(d[mask].max()), rel=1e-6)

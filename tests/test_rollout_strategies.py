"""Rollout strategies (`rollout.strategy`): the `Sampling` handle's parts against the sampler
itself (per-call settings, joined groups, kept rows), the default strategy as the plain
rollout, shape and config errors, and docs/extending.md's strategies (two temperatures,
best-of-k, per-prompt counts from a file) as a user writes them, through `grpo train` under
torchrun with 2 ranks and with the asynchronous producer."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from conftest import LENGTH_REWARD, docs_example, torchrun_train, write_package

from grpo.checks import check_config
from grpo.config import load_config
from grpo.errors import GrpoError
from grpo.experience.batch import derive_seed
from grpo.experience.inline import make_sampler
from grpo.experience.strategies import (
    Sampling,
    register_rollout_strategy,
    run_strategy,
    sample_round,
    score_rollout,
)
from grpo.loading import load_rows
from grpo.policy import build_policy
from grpo.rewards import build_rewards
from grpo.settings import ConfigError
from grpo.tokenizer import load_tokenizer

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs" / "tiny_ci.yaml")


def length_reward(completions, **_):
    """Spread in every group, so that picking the best is visible."""
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

    return cfg, policy, sampler, rewards, rows, sampling


def test_the_default_strategy_is_the_plain_rollout_bitwise(setup):
    cfg, policy, sampler, rewards, rows, sampling = setup
    got = run_strategy(cfg, sampling(), rows, rank=0, round_=0)
    want = score_rollout(
        cfg, sample_round(cfg, policy, sampler, rows, 7), rows, policy.tokenizer, rewards, 0
    )
    assert torch.equal(got.rollout.ids, want.rollout.ids)
    assert torch.equal(got.rollout.logprobs, want.rollout.logprobs)
    assert torch.equal(got.rewards, want.rewards) and got.texts == want.texts


def test_sample_takes_per_call_settings_and_seeds(setup):
    """Each call is the sampler at those settings: the first with the round's seed, the next
    with seeds derived from it; greedy at temperature 0 whatever the seed."""
    cfg, policy, sampler, rewards, rows, sampling = setup
    s = sampling()
    first = s.sample(rows, group_size=2, temperature=0.6)
    second = s.sample(rows, group_size=3, temperature=1.2, max_new_tokens=4)
    c = dataclasses.replace(cfg.rollout, group_size=2, temperature=0.6)
    want1 = sample_round(dataclasses.replace(cfg, rollout=c), policy, sampler, rows, 7)
    c = dataclasses.replace(cfg.rollout, group_size=3, temperature=1.2, max_new_tokens=4)
    want2 = sample_round(
        dataclasses.replace(cfg, rollout=c), policy, sampler, rows, derive_seed(7, 1)
    )
    assert torch.equal(first.ids, want1.ids) and torch.equal(first.logprobs, want1.logprobs)
    assert torch.equal(second.ids, want2.ids) and second.completion_ids.shape[1] <= 4
    greedy = [s.sample(rows, group_size=2, temperature=0.0, seed=k) for k in (1, 2)]
    assert torch.equal(greedy[0].ids, greedy[1].ids)
    with pytest.raises(GrpoError, match="unknown settings \\['temprature'\\]"):
        s.sample(rows, temprature=1.0)


def test_join_groups_puts_each_rows_completions_together(setup):
    cfg, policy, sampler, rewards, rows, sampling = setup
    s = sampling()
    cold = s.sample(rows, group_size=2, temperature=0.6)
    hot = s.sample(rows, group_size=3, temperature=1.2)
    joined = s.join_groups([cold, hot])
    assert joined.group_size == 5 and joined.ids.shape[0] == 15
    pad = policy.tokenizer.pad_token_id
    for q in range(3):
        for j in range(5):
            part, row = (cold, q * 2 + j) if j < 2 else (hot, q * 3 + j - 2)
            n = int(part.completion_lens[row])
            got = joined.completion_ids[q * 5 + j]
            assert got[:n].tolist() == part.completion_ids[row, :n].tolist()
            assert (got[n:] == pad).all()
            assert torch.equal(joined.logprobs[q * 5 + j, :n], part.logprobs[row, :n])
            assert int(joined.prompt_lens[q * 5 + j]) == int(part.prompt_lens[row])
    with pytest.raises(GrpoError, match="not of the same rows"):
        s.join_groups([cold, s.sample(rows[:2], group_size=2)])


def test_keep_takes_rows_with_their_scores(setup):
    cfg, policy, sampler, rewards, rows, sampling = setup
    s = sampling()
    batch = s.score(s.sample(rows, group_size=6), rows)
    best = []
    for q in range(3):  # the 4 longest of each group of 6, in row order
        r = batch.rewards[q * 6 : (q + 1) * 6]
        best += sorted(q * 6 + i for i in r.topk(4).indices.tolist())
    kept = s.keep(batch, best, 4)
    assert kept.rollout.group_size == 4 and kept.size == 12
    assert torch.equal(kept.rewards, batch.rewards[best])
    assert kept.texts == [batch.texts[i] for i in best]
    assert torch.equal(kept.rollout.ids, batch.rollout.ids[best])
    with pytest.raises(GrpoError, match="do not make groups of 4"):
        s.keep(batch, best[:5], 4)


def test_a_wrong_shape_and_an_unknown_strategy_are_named(setup, shared_tiny_model):
    cfg, policy, sampler, rewards, rows, sampling = setup

    @register_rollout_strategy("test_half", overwrite=True)
    def half(rows, sampling):
        return sampling.score(sampling.sample(rows, group_size=2), rows)

    bad = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, strategy="test_half"))
    want = "'test_half' returned 6 rows in groups of 2; expected 3 groups of rollout.group_size=4"
    with pytest.raises(GrpoError, match=want):
        run_strategy(bad, sampling(), rows, 0, 0)

    def checked(*overrides: str):
        return check_config(load_config(TINY, [f"model.path={shared_tiny_model}", *overrides]))

    with pytest.raises(ConfigError, match="rollout.strategy: unknown rollout strategy 'nope'"):
        checked("rollout.strategy=nope")
    with pytest.raises(ConfigError, match="'kk' is not a parameter of rollout strategy"):
        checked("rollout.strategy=default", "rollout.strategy_kwargs={kk: 1}")


# -- docs/extending.md's strategies, through grpo train ---------------------------------------


def train(tmp_path, model, out: str, *overrides) -> list[dict]:
    return torchrun_train(
        tmp_path,
        model,
        out,
        "rollout.max_new_tokens=8",
        "rewards=[{name: my_pkg.rewards:length}]",
        *overrides,
    )


@pytest.fixture()
def my_pkg(tmp_path):
    return write_package(
        tmp_path,
        {
            "strategies.py": docs_example("# my_pkg/strategies.py"),
            "estimators.py": docs_example("# my_pkg/estimators.py"),
            "rewards.py": LENGTH_REWARD,
        },
    )


def test_the_docs_strategies_train_in_one_process(shared_tiny_model, tmp_path, monkeypatch):
    """The docs' strategies through `grpo train`'s recipe in this process (their torchrun and
    producer runs are the process tier's, below): two temperatures with the docs' estimator
    reading the strategy's extra (hot rows: 4 of 8; every generated token), and best-of-3
    (2 prompts x 12 drawn a step)."""
    from grpo.metrics import read_metrics
    from grpo.train.grpo import train_grpo

    pkg = "strategies_inproc"  # a name of its own: this process keeps what it imported
    write_package(
        tmp_path,
        {
            "strategies.py": docs_example("# my_pkg/strategies.py"),
            "estimators.py": docs_example("# my_pkg/estimators.py"),
            "rewards.py": LENGTH_REWARD,
        },
        name=pkg,
    )
    monkeypatch.syspath_prepend(str(tmp_path))

    def run(out: str, *overrides: str) -> list[dict]:
        cfg = load_config(
            TINY,
            [
                f"model.path={shared_tiny_model}",
                f"train.output_dir={tmp_path / out}",
                "train.progress=false",
                "data.eval_samples=0",
                "rollout.compile=off",
                "train.save_every=0",
                "train.log_every=1",
                "train.max_steps=2",
                "rollout.max_new_tokens=8",
                f"rewards=[{{name: {pkg}.rewards:length}}]",
                *overrides,
            ],
        )
        train_grpo(cfg)
        rows = read_metrics(tmp_path / out / "metrics.jsonl")
        return [r for r in rows if "rollout/groups_sampled" in r]

    rows = run(
        "two",
        f"rollout.strategy={pkg}.strategies:two_temperatures",
        "rollout.strategy_kwargs={low: 0.3, high: 2.0}",
        f"loss.advantage={pkg}.estimators:hot_discount",
    )
    assert len(rows) == 2
    for m in rows:
        assert m["strategy/cold_reward"] >= 0 and m["strategy/hot_reward"] >= 0
        assert m["rollout/groups_sampled"] == 2 and m["advantage/hot_rows"] == 4
        assert m["advantage/tokens"] == pytest.approx(8 * m["rollout/completion_len_mean"])
    rows = run(
        "best3", f"rollout.strategy={pkg}.strategies:best_of", "rollout.strategy_kwargs={k: 3}"
    )
    assert len(rows) == 2
    assert all(m["strategy/drawn"] == 24 and m["rollout/groups_sampled"] == 2 for m in rows)


@pytest.mark.process
def test_two_temperatures_under_ddp_and_the_async_producer(my_pkg, shared_tiny_model):
    """Both halves reported for the step, over both ranks, synchronous and with the producer;
    synchronous, the docs' estimator reads the strategy's extra on the global batch: both
    ranks' hot rows (8 of 16) and all their generated tokens (a rank-local view: half)."""
    strategy = "rollout.strategy=my_pkg.strategies:two_temperatures"
    estimator = "loss.advantage=my_pkg.estimators:hot_discount"
    for out, extra in (("ddp", [estimator]), ("async", ["rollout.async=on"])):
        for m in train(
            my_pkg,
            shared_tiny_model,
            out,
            strategy,
            "rollout.strategy_kwargs={low: 0.3, high: 2.0}",
            *extra,
        ):
            assert m["strategy/cold_reward"] >= 0 and m["strategy/hot_reward"] >= 0
            assert m["rollout/groups_sampled"] == 4  # 2 ranks x 2 groups of 4
            if out == "ddp":
                assert m["advantage/hot_rows"] == 8
                assert m["advantage/tokens"] == pytest.approx(16 * m["rollout/completion_len_mean"])
        if out == "async":
            assert "async/staleness" in m


@pytest.mark.process
def test_best_of_k_and_counts_from_a_file_under_ddp(my_pkg, shared_tiny_model):
    """Best-of-3 draws 3 G per prompt (all ranks: 4 prompts x 12 = 48 a step); with a counts
    file of 4 or 8 per question (and the asynchronous producer), what the file says of each
    prompt drawn."""
    cfg = load_config(TINY, [f"model.path={shared_tiny_model}"])
    tok = load_tokenizer(shared_tiny_model)
    data = load_rows(cfg.data, cfg.data.split, cfg.data.max_samples, "rl", tok)
    questions = [r["question"] for r in data]
    counts = {q: 8 if i % 2 else 4 for i, q in enumerate(questions)}
    (my_pkg / "counts.json").write_text(json.dumps(counts))
    strategy = "rollout.strategy=my_pkg.strategies:best_of"
    for m in train(my_pkg, shared_tiny_model, "best3", strategy, "rollout.strategy_kwargs={k: 3}"):
        assert m["strategy/drawn"] == 48
        assert m["rollout/groups_sampled"] == 4
    for m in train(
        my_pkg,
        shared_tiny_model,
        "counts",
        strategy,
        "rollout.async=on",
        f"rollout.strategy_kwargs={{counts: {my_pkg / 'counts.json'}}}",
    ):
        assert 16 <= m["strategy/drawn"] <= 32 and m["strategy/drawn"] % 4 == 0


# -- what a strategy (and any plug-in) cannot do to the run -----------------------------------


def test_a_strategy_that_edits_its_rows_leaves_the_dataset_alone(setup):
    """A strategy gets its own copy of the rows (as a reward does): what it writes into them
    never reaches the dataset the next steps draw from."""
    cfg, policy, sampler, rewards, rows, sampling = setup
    before = json.dumps(rows, sort_keys=True, default=str)

    @register_rollout_strategy("test_editor", overwrite=True)
    def editor(rows, sampling):
        for row in rows:
            row["prompt"] = "edited"
            row["prompt_ids"].append(0)
        return sampling.score(sampling.sample(rows), rows)

    edit = dataclasses.replace(
        cfg, rollout=dataclasses.replace(cfg.rollout, strategy="test_editor")
    )
    run_strategy(edit, sampling(), rows, 0, 0)
    assert json.dumps(rows, sort_keys=True, default=str) == before


@pytest.mark.parametrize(
    "change, row, message",
    [
        ("arange", "0", "differs from token_rewards summed"),  # logged, never trained on
        ("nan", "1", "is not finite"),
    ],
)
def test_rewards_the_update_would_not_train_on_are_refused(setup, change, row, message):
    """The update trains on `token_rewards`: a strategy that changes `rewards` alone (logged
    as reward_mean, never trained on) or returns non-finite rewards is an error naming it and
    the row, not a run that logs one thing and learns another."""
    cfg, policy, sampler, rewards, rows, sampling = setup

    @register_rollout_strategy("test_rewriter", overwrite=True)
    def rewriter(rows, sampling):
        batch = sampling.score(sampling.sample(rows), rows)
        if change == "arange":
            return dataclasses.replace(batch, rewards=torch.arange(batch.size).float())
        nan = batch.rewards.clone()
        nan[1] = float("nan")
        return dataclasses.replace(batch, rewards=nan)

    bad = dataclasses.replace(cfg.rollout, strategy="test_rewriter")
    want = f"rollout strategy 'test_rewriter': the reward of row {row} .*{message}"
    with pytest.raises(GrpoError, match=want):
        run_strategy(dataclasses.replace(cfg, rollout=bad), sampling(), rows, 0, 0)


@pytest.mark.parametrize(
    "metrics, message",
    [
        ({"note": "warm"}, "reported the metric 'note': 'warm'"),
        ({"both": torch.tensor([1.0, 2.0])}, "reported the metric 'both': a tensor of shape (2,)"),
        ({"gone": None}, "reported the metric 'gone': None"),
        ({"flag": True}, "reported the metric 'flag': True"),
        ({"nested": {"a": 1.0}}, "reported the metric 'nested': {'a': 1.0}"),
        ([("a", 1.0)], "metrics are a list, not a dict"),
    ],
)
def test_a_strategys_metrics_of_odd_types_are_one_line_naming_it(setup, metrics, message):
    """What a strategy puts in `batch.metrics` is merged over rounds and ranks and logged: a
    value that is not a number (a string, None, a tensor of several elements) is one line
    naming the strategy and the key, not a traceback from the reduction; a one-element tensor
    is read as its number."""
    cfg, policy, sampler, rewards, rows, sampling = setup

    @register_rollout_strategy("test_reporter", overwrite=True)
    def reporter(rows, sampling, odd=True):
        batch = sampling.score(sampling.sample(rows), rows)
        got = metrics if odd else {**batch.metrics, "one": torch.tensor([0.5])}
        return dataclasses.replace(batch, metrics=got)

    bad = dataclasses.replace(cfg.rollout, strategy="test_reporter")
    with pytest.raises(GrpoError) as e:
        run_strategy(dataclasses.replace(cfg, rollout=bad), sampling(), rows, 0, 0)
    assert str(e.value).startswith("rollout strategy 'test_reporter'") and message in str(e.value)
    assert len(str(e.value).splitlines()) == 1
    good = dataclasses.replace(bad, strategy_kwargs={"odd": False})
    batch = run_strategy(dataclasses.replace(cfg, rollout=good), sampling(), rows, 0, 0)
    assert batch.metrics["one"] == 0.5 and type(batch.metrics["one"]) is float
    assert batch.metrics["perf/reward_s"].op == "sum"  # a Sum stays one


EXIT_PLUGINS = """
import dataclasses
import sys
import time

import torch

from grpo.modules import TrainedModule


def strategy(**inputs):
    sys.exit(0)


def hangs(**inputs):
    time.sleep(3600)


def nan_logprobs(rows, sampling):
    batch = sampling.score(sampling.sample(rows), rows)
    logprobs = batch.rollout.logprobs.clone()
    logprobs[1, 0] = float("nan")  # every row generates at least its first token
    rollout = dataclasses.replace(batch.rollout, logprobs=logprobs)
    return dataclasses.replace(batch, rollout=rollout)


def estimator(**inputs):
    sys.exit(0)


def kernel(*args, **kwargs):
    sys.exit(0)


class Exits(TrainedModule):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))

    def attach(self, batch):
        return {}

    def loss(self, batch, update):
        if self.hang == "raise":
            raise ValueError("a bug in the loss")
        if self.hang:
            time.sleep(3600)
        sys.exit(0)


def module(hang=False):
    m = Exits()
    m.hang = hang
    return m
"""


def train_with_plugins(tmp_path, monkeypatch, model, *overrides: str) -> int:
    """`grpo train` (one step of tiny_ci, in this process) with EXIT_PLUGINS importable as
    `exit_plugins`; its exit code."""
    from grpo.apps import cli

    (tmp_path / "exit_plugins.py").write_text(EXIT_PLUGINS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    args = ["train", "--config", TINY, f"model.path={model}", "train.max_steps=1"]
    return cli.main([*args, "train.progress=false", "data.eval_samples=0", *overrides])


@pytest.mark.parametrize(
    "override, who",
    [
        ("rollout.strategy=exit_plugins:strategy", "rollout strategy 'exit_plugins:strategy'"),
        pytest.param(
            "loss.advantage=exit_plugins:estimator",
            "advantage estimator 'exit_plugins:estimator'",
            marks=pytest.mark.process,
        ),
        pytest.param(
            "model.logprob_impl=exit_plugins:kernel",
            "log-prob kernel 'exit_plugins:kernel'",
            marks=pytest.mark.process,
        ),
        pytest.param(
            "modules=[{name: 'exit_plugins:module'}]",
            "module 'module' loss",
            marks=pytest.mark.process,
        ),
    ],
)
def test_sys_exit_in_a_plug_in_stops_the_run_with_one_line(
    shared_tiny_model, tmp_path, monkeypatch, capsys, override, who
):
    """`sys.exit(0)` in a strategy, an estimator, a log-prob kernel or a module's `loss` is an
    error naming the plug-in (one line, exit 2), as in a reward: never exit 0 with no message
    and no final weights."""
    assert train_with_plugins(tmp_path, monkeypatch, shared_tiny_model, override) == 2
    err = capsys.readouterr().err
    assert f"{who} called sys.exit(0)" in err, err[-2000:]


@pytest.mark.parametrize(
    "override, who",
    [
        ("rollout.strategy=exit_plugins:hangs", "rollout strategy 'exit_plugins:hangs'"),
        pytest.param(
            "modules=[{name: 'exit_plugins:module', kwargs: {hang: true}}]",
            "module 'module' loss",
            marks=pytest.mark.process,
        ),
    ],
)
def test_a_hanging_plug_in_stops_the_run_at_its_time_limit(
    shared_tiny_model, tmp_path, monkeypatch, capsys, override, who
):
    """A strategy or a module's `loss` that never returns: at train.plugin_timeout_s the run
    stops with one line naming it and the rank, where it hung with no output."""
    import time

    start = time.monotonic()
    limit = "train.plugin_timeout_s=1"
    assert train_with_plugins(tmp_path, monkeypatch, shared_tiny_model, limit, override) == 2
    assert time.monotonic() - start < 60
    err = capsys.readouterr().err
    assert f"{who} did not return within train.plugin_timeout_s=1 s (rank 0)" in err, err[-2000:]


def test_nan_log_probs_from_a_strategy_name_the_strategy(
    shared_tiny_model, tmp_path, monkeypatch, capsys
):
    """A strategy that returns a NaN behaviour log-prob (where the trainer's own log-prob of
    that token, before any update, is finite) is named at its step, not a skipped update that
    the non-finite guard later blames on optim.lr and the rewards."""
    strategy = "rollout.strategy=exit_plugins:nan_logprobs"
    assert train_with_plugins(tmp_path, monkeypatch, shared_tiny_model, strategy) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err[-2000:]
    assert (
        "step 1: the log-probs of the batch rollout strategy 'exit_plugins:nan_logprobs' "
        "returned (its rollout.logprobs) are not finite at 1 of "
    ) in err, err
    assert "optim.lr" not in err


def test_an_error_in_a_module_loss_is_one_line_naming_it(
    shared_tiny_model, tmp_path, monkeypatch, capsys
):
    """A module's `loss` that raises: one line naming the module (the original chained in a
    verbose run), not a 25-60-line traceback."""
    module = "modules=[{name: 'exit_plugins:module', kwargs: {hang: raise}}]"
    assert train_with_plugins(tmp_path, monkeypatch, shared_tiny_model, module) == 2
    err = capsys.readouterr().err
    assert "module 'module' loss raised ValueError: a bug in the loss" in err, err[-2000:]
    assert "Traceback" not in err


@pytest.mark.parametrize("where", ["sampled", "scored"])
def test_a_strategy_that_skips_a_prompt_is_refused(setup, where):
    """The right number of groups is not enough: a group that answers another row's prompt
    (here every group answers row 0, so rows 1 and 2 are never trained on) is named."""
    cfg, policy, sampler, rewards, rows, sampling = setup

    @register_rollout_strategy("test_skipper", overwrite=True)
    def skipper(rows, sampling):
        first = [rows[0]] * len(rows)
        if where == "sampled":  # sampled from row 0 only, scored against the rows given
            return sampling.score(sampling.sample(first), rows)
        return sampling.score(sampling.sample(first), first)

    skip = dataclasses.replace(
        cfg, rollout=dataclasses.replace(cfg.rollout, strategy="test_skipper")
    )
    verb = "sampled from" if where == "sampled" else "scored with"
    want = f"'test_skipper': group 1 \\(row 4\\) was {verb} row 0's prompt, not row 1's"
    with pytest.raises(GrpoError, match=want):
        run_strategy(skip, sampling(), rows, 0, 0)

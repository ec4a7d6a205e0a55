"""`grpo.rollout.extend`: continuing prompts plus partial completions. Log-probs against a
float64 forward of the whole row and the trainer's own pass (shared prefix), the partial as
context or as completion, per-row budgets, stops, seeds, an empty partial as a plain sample,
the compiled step, LoRA, and one-line errors."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest
import torch
from conftest import LENGTH_REWARD, docs_example, torchrun_train, write_package

from grpo.algo.logprobs import completion_logprobs
from grpo.config import load_config
from grpo.errors import GrpoError
from grpo.experience.batch import derive_seed
from grpo.experience.inline import make_sampler
from grpo.experience.strategies import Sampling, register_rollout_strategy, run_strategy
from grpo.loading import load_rows
from grpo.lora.layers import apply_lora, lora_modules
from grpo.models import load_model
from grpo.policy import build_policy
from grpo.rewards import build_rewards
from grpo.rollout import Rollout, Sampler
from grpo.rollout.extend import extend

V = 256
STOPS = list(range(3, 13))  # ~4% of draws stop: some rows stop, others reach their budget


def tokens(lengths, seed=0):
    """Lists of ids in [13, V): never a stop id."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(13, V, (n,), generator=g).tolist() for n in lengths]


PROMPTS = tokens((7, 3, 5))
PARTIALS = tokens((4, 0, 9), seed=1)


@pytest.fixture(scope="module")
def qwen3(tiny_checkpoints):
    return load_model(tiny_checkpoints("qwen3")).eval()


def float64_logprobs(model, r: Rollout, temperature: float) -> torch.Tensor:
    """(B, T_c) log p(completion token) from one float64 forward of the whole rows."""
    ref = copy.deepcopy(model).double()
    with torch.no_grad():
        logits = ref(r.ids, attention_mask=r.attention_mask())  # (B, T, V)
    T_p = r.prompt_width
    pred = (logits[:, T_p - 1 : -1] / (temperature or 1.0)).log_softmax(-1)  # (B, T_c, V)
    return pred.gather(-1, r.completion_ids[..., None])[..., 0]


def check_logprobs(model, r: Rollout, temperature: float) -> None:
    """The rollout's log-probs are those of a float64 forward (1e-5: float32 rounding of a
    tiny model) and of the trainer's pass with each group's prompt run once; 0 off the mask."""
    m = r.completion_mask
    want = float64_logprobs(model, r, temperature)
    assert (r.logprobs.double() - want)[m].abs().max().item() <= 1e-5
    assert (r.logprobs[~m] == 0).all() and r.logprobs.dtype == torch.float32
    with torch.no_grad():
        trainer = completion_logprobs(
            model,
            r.ids,
            r.attention_mask(),
            r.prompt_width,
            m,
            temperature or 1.0,
            group_size=r.group_size,
        )
    assert (trainer - r.logprobs)[m].abs().max().item() <= 1e-5


def run(model, include_partial=False, sampler=None, **kw):
    args = dict(group_size=3, max_new_tokens=16, stop_ids=STOPS, seed=5, temperature=0.8)
    return extend(
        sampler or Sampler(model),
        PROMPTS,
        PARTIALS,
        include_partial=include_partial,
        **{**args, **kw},
    )


def test_the_partial_as_context(qwen3):
    """The prompt region is prompt + partial; the completion only what was generated, within
    max_new_tokens - len(partial); the log-probs the trainer's."""
    r = run(qwen3)
    G, budgets = 3, [16 - len(q) for q in PARTIALS]
    assert r.group_size == G and r.ids.shape[0] == 9
    assert r.prompt_lens.tolist() == [
        len(p) + len(q) for p, q in zip(PROMPTS, PARTIALS) for _ in "abc"
    ]
    for b in range(9):
        i, n = b // G, int(r.completion_lens[b])
        context = r.prompt_ids[b, r.prompt_width - int(r.prompt_lens[b]) :].tolist()
        assert context == PROMPTS[i] + PARTIALS[i]
        assert r.completion_mask[b].tolist() == [True] * n + [False] * (
            r.completion_ids.shape[1] - n
        )
        row = r.completion_ids[b, :n].tolist()
        assert not set(STOPS) & set(row[:-1]) and n <= budgets[i]
        assert bool(r.finished[b]) == (row[-1] in STOPS)
        if not r.finished[b]:
            assert n == budgets[i]  # ran to its own budget
    assert r.finished.any() and not r.finished.all()
    check_logprobs(qwen3, r, 0.8)


def test_the_partial_as_completion(qwen3):
    """include_partial: the same continuations (same seed), after the partial in the
    completion region, every token counted and its log-prob the trainer's."""
    ctx = run(qwen3)
    r = run(qwen3, include_partial=True)
    assert r.prompt_width == max(map(len, PROMPTS))
    assert r.prompt_lens.tolist() == [len(p) for p in PROMPTS for _ in "abc"]
    for b in range(9):
        q, n = PARTIALS[b // 3], int(ctx.completion_lens[b])
        assert int(r.completion_lens[b]) == len(q) + n
        row = r.completion_ids[b].tolist()
        assert row[: len(q) + n] == q + ctx.completion_ids[b, :n].tolist()
        assert r.completion_mask[b].sum() == len(q) + n
        assert torch.equal(r.logprobs[b, len(q) : len(q) + n], ctx.logprobs[b, :n])
    assert torch.equal(r.finished, ctx.finished)
    assert (r.logprobs[0, :4] < 0).all()  # the partial's log-probs are there, not zeros
    check_logprobs(qwen3, r, 0.8)


@pytest.mark.parametrize("include_partial", [False, True])
def test_empty_partials_are_a_plain_sample_and_seeds_reproduce(qwen3, include_partial):
    sampler = Sampler(qwen3)
    kw = dict(group_size=2, max_new_tokens=10, stop_ids=STOPS, seed=9, temperature=1.0)
    got = extend(sampler, PROMPTS, [[], [], []], include_partial=include_partial, **kw)
    want = sampler.sample(PROMPTS, **kw)
    for field in ("ids", "prompt_lens", "completion_mask", "completion_lens", "finished"):
        assert torch.equal(getattr(got, field), getattr(want, field)), field
    assert torch.equal(got.logprobs, want.logprobs)
    a, b = (run(qwen3, include_partial, sampler) for _ in range(2))
    assert torch.equal(a.ids, b.ids) and torch.equal(a.logprobs, b.logprobs)
    assert not torch.equal(a.ids, run(qwen3, include_partial, sampler, seed=6).ids)


def test_budgets_are_per_row_and_greedy_scores_at_temperature_one(qwen3):
    """No stop id: each row generates exactly max_new_tokens - len(partial); greedy rows of a
    context agree, and the partial's log-probs are at temperature 1."""
    r = run(qwen3, include_partial=True, stop_ids=[], temperature=0.0, max_new_tokens=10)
    assert r.completion_lens.tolist() == [10] * 9 and not r.finished.any()
    assert torch.equal(r.completion_ids[0], r.completion_ids[2])
    check_logprobs(qwen3, r, 0.0)
    ctx = run(qwen3, stop_ids=[], max_new_tokens=10)
    assert ctx.completion_lens.tolist() == [10 - len(q) for q in PARTIALS for _ in "abc"]
    # a partial one token short of the budget: one token generated
    one = extend(
        Sampler(qwen3), [[20, 21]], [[30] * 5], group_size=2, max_new_tokens=6, stop_ids=[], seed=0
    )
    assert one.completion_ids.shape == (2, 1)


def test_compiled_refilled_and_lora(qwen3):
    """The compiled decode step and continuous refill (4 rows in flight) give the eager
    rollout; a LoRA model's log-probs (adapters live: B nonzero) are its float64 forward's."""
    eager = run(qwen3, include_partial=True)
    compiled = run(qwen3, True, Sampler(qwen3, compile=True, compile_options={"backend": "eager"}))
    refilled = run(qwen3, True, Sampler(qwen3, max_rows=4))
    for other in (compiled, refilled):
        assert torch.equal(other.ids, eager.ids)
        assert (other.logprobs - eager.logprobs).abs().max().item() <= 1e-5
    model = copy.deepcopy(qwen3)
    apply_lora(model, rank=4, alpha=8, seed=0)
    with torch.no_grad():
        for m in lora_modules(model).values():
            m.lora_b.normal_(0, 0.2, generator=torch.Generator().manual_seed(1))
    r = run(model, include_partial=True)
    assert not torch.equal(r.ids, eager.ids)  # the adapters change what is sampled
    check_logprobs(model, r, 0.8)


def test_bad_inputs_are_one_line(qwen3):
    s = Sampler(qwen3)
    ok = dict(group_size=2, max_new_tokens=8, stop_ids=[3], seed=0)
    cases = [
        ([[5, 6]], [[7], [8]], ok, r"2 partial completions for 1 prompts"),
        ([[5, 6]], [[7] * 8], ok, r"partial 0 has 8 tokens; max_new_tokens=8 .* none to generate"),
        ([[5], [6]], [[], [7, 3, 9]], ok, r"partial 1 has the stop id 3 at position 1"),
        ([[5]], [[300]], ok, r"partial 0 has token ids outside \[0, 256\)"),
        ([[5] * 250], [[7]], ok, r"prompt 0 and its partial \(250 \+ 1 tokens.* need 258"),
        ([[5], [6]], [7, 8], ok, r"partial 0 is int, not a token-id list"),
        ([[5]], [[7]], {**ok, "group_size": 0}, r"group_size must be >= 1"),
    ]
    for prompts, partials, kw, message in cases:
        with pytest.raises(GrpoError, match=message) as e:
            extend(s, prompts, partials, **kw)
        assert "\n" not in str(e.value)


# -- Sampling.extend and docs/extending.md's tree rollout --------------------------------------

TINY = str(Path(__file__).resolve().parents[1] / "configs" / "tiny_ci.yaml")


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

    def sampling(cfg=cfg, seed=7):
        return Sampling(cfg, policy, sampler, rewards, None, seed, step=0)

    return cfg, policy, sampler, rows, sampling


def length_reward(completions, **_):
    return [len(c) / 10 for c in completions]


def test_sampling_extend_is_the_sampler_call_with_the_rounds_seeds(setup):
    """Settings from the config unless given, the policy's stop ids and pad id, seeds as
    `sample`'s (the round's first, then derived); unknown settings and multi-turn runs are
    named."""
    cfg, policy, sampler, rows, sampling = setup
    s = sampling()
    partials = [[], [40, 41], [50]]
    got = s.extend(rows, partials, group_size=2)
    again = s.extend(rows, partials, group_size=3, include_partial=True, temperature=0.5)
    kw = dict(stop_ids=policy.stop_ids, pad_id=policy.tokenizer.pad_token_id, max_new_tokens=8)
    prompts = [r["prompt_ids"] for r in rows]
    want = extend(sampler, prompts, partials, group_size=2, seed=7, **kw)
    want2 = extend(
        sampler,
        prompts,
        partials,
        group_size=3,
        seed=derive_seed(7, 1),
        include_partial=True,
        temperature=0.5,
        **kw,
    )
    assert torch.equal(got.ids, want.ids) and torch.equal(got.logprobs, want.logprobs)
    assert torch.equal(again.ids, want2.ids) and again.group_size == 3
    with pytest.raises(GrpoError, match=r"Sampling.extend: unknown settings \['temprature'\]"):
        s.extend(rows, partials, temprature=1.0)
    multi = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, env="calculator"))
    with pytest.raises(GrpoError, match="single-turn .*rollout.multi_turn"):
        sampling(multi).extend(rows, partials)


@pytest.fixture()
def tree_pkg(tmp_path, monkeypatch):
    """docs/extending.md's tree strategy as `tree_doc.tree` (a package name of its own)."""
    write_package(tmp_path, {"tree.py": docs_example("# my_pkg/tree.py")}, name="tree_doc")
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_the_docs_tree_rollout(setup, tree_pkg):
    """Each prompt's group: 2 trunks x 2 branches; a branch starts with its trunk's cut (half
    the trunk's tokens before a stop), continues within the budget, and the batch's log-probs
    are the trainer's (shared prefix) over the whole completion."""
    cfg, policy, sampler, rows, sampling = setup
    tree_cfg = dataclasses.replace(
        cfg, rollout=dataclasses.replace(cfg.rollout, strategy="tree_doc.tree:tree")
    )
    batch = run_strategy(tree_cfg, sampling(), rows, rank=0, round_=0)
    trunks = sampling().sample(rows, group_size=2)  # the strategy's first call, same seed
    r = batch.rollout
    assert batch.size == 12 and r.group_size == 4
    cuts = []
    for t in range(6):
        n = int(trunks.completion_lens[t]) - int(trunks.finished[t])
        cuts.append(trunks.completion_ids[t, : n // 2].tolist())
        for leaf in (2 * t, 2 * t + 1):  # the trunk's two branches
            k = int(r.completion_lens[leaf])
            assert r.completion_ids[leaf, : len(cuts[-1])].tolist() == cuts[-1]
            assert len(cuts[-1]) < k <= 8 and bool(r.completion_mask[leaf, :k].all())
    assert any(cuts) and batch.metrics["strategy/cut_tokens"] == sum(map(len, cuts)) / 6
    assert batch.texts == r.decode(policy.tokenizer, skip_special_tokens=True)
    with torch.no_grad():
        trainer = completion_logprobs(
            policy.model,
            r.ids,
            r.attention_mask(),
            r.prompt_width,
            r.completion_mask,
            cfg.rollout.temperature,
            group_size=4,
        )
    m = r.completion_mask
    assert (trainer - r.logprobs)[m].abs().max().item() <= 1e-5


def test_the_docs_tree_rollout_trains(shared_tiny_model, tree_pkg):
    """Two steps of `grpo train`'s recipe with the tree strategy (shared prefix on: every
    group holds one prompt), its metric logged, the partials' recomputed log-probs and the
    continuations' equal to the update's."""
    from grpo.metrics import read_metrics
    from grpo.train.grpo import train_grpo

    cfg = load_config(
        TINY,
        [
            f"model.path={shared_tiny_model}",
            f"train.output_dir={tree_pkg / 'run'}",
            "train.progress=false",
            "data.eval_samples=0",
            "rollout.compile=off",
            "train.save_every=0",
            "train.log_every=1",
            "train.max_steps=2",
            "rollout.max_new_tokens=8",
            "rollout.strategy=tree_doc.tree:tree",
        ],
    )
    assert cfg.shared_prefix_groups == 4
    train_grpo(cfg)
    logged = [m for m in read_metrics(tree_pkg / "run" / "metrics.jsonl") if "step" in m]
    assert len(logged) == 2 and all("strategy/cut_tokens" in m for m in logged)
    # the update's first pass (packed, each group's prompt once) meets the sampler's log-probs
    assert all(m["rollout/logprob_diff_max"] < 1e-5 for m in logged)


@pytest.mark.process
def test_the_docs_tree_rollout_under_ddp_and_the_async_producer(shared_tiny_model, tmp_path):
    """`grpo train` with the tree strategy on 2 torchrun ranks, synchronous and with the
    asynchronous producer (which calls the strategy for the trainer ranks it serves)."""
    write_package(
        tmp_path, {"tree.py": docs_example("# my_pkg/tree.py"), "rewards.py": LENGTH_REWARD}
    )
    for out, extra in (("ddp", []), ("async", ["rollout.async=on"])):
        for m in torchrun_train(
            tmp_path,
            shared_tiny_model,
            out,
            "rollout.max_new_tokens=8",
            "rewards=[{name: my_pkg.rewards:length}]",
            "rollout.strategy=my_pkg.tree:tree",
            *extra,
        ):
            assert m["rollout/groups_sampled"] == 4  # 2 ranks x 2 groups of 4
            assert "strategy/cut_tokens" in m
            if out == "ddp":  # synchronous: the first pass meets the sampler's log-probs
                assert m["rollout/logprob_diff_max"] < 1e-5


def test_groups_mixing_prompts_are_refused_under_shared_prefix(setup):
    """Partials as context, regrouped by prompt: a group holds several prompt regions, which
    the shared-prefix passes would silently run as one; refused, naming the strategy and the
    group. With train.shared_prefix off the batch is accepted."""
    cfg, policy, sampler, rows, sampling = setup

    @register_rollout_strategy("test_mixed_contexts", overwrite=True)
    def mixed(rows, sampling):
        cuts = [[40 + j] * j for _ in rows for j in range(2)]  # partials of 0 and 1 tokens
        per_cut = [row for row in rows for _ in range(2)]
        leaves = sampling.extend(per_cut, cuts, group_size=2)
        return sampling.score(dataclasses.replace(leaves, group_size=4), rows)

    bad = dataclasses.replace(cfg.rollout, strategy="test_mixed_contexts")
    on = dataclasses.replace(cfg, rollout=bad)
    assert on.shared_prefix_groups == 4
    with pytest.raises(GrpoError, match="'test_mixed_contexts': the rows of group 0 do not share"):
        run_strategy(on, sampling(), rows, 0, 0)
    off = dataclasses.replace(on, train=dataclasses.replace(cfg.train, shared_prefix="off"))
    assert run_strategy(off, sampling(), rows, 0, 0).size == 12

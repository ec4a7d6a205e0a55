"""The reward model trained online (`modules: [{name: online_reward_model}]`,
grpo/modules/online_rm.py): its pairs come from the step's rollout groups, the labeller is
asked at most `label_budget` times, its score is the step's reward (as the `reward_model`
reward scores), its update is `grpo rm`'s Bradley-Terry loss (against a float64 hand
computation) and lowers that loss, and a checkpoint resumes it bitwise (weights, optimizer,
counters, the pairs it draws next)."""

from __future__ import annotations

import dataclasses
import math
import shutil
import types
from collections import Counter
from pathlib import Path

import pytest
import torch

from grpo.config import ModuleConfig, load_config
from grpo.distributed import SINGLE
from grpo.errors import GrpoError
from grpo.experience.batch import RolloutBatch
from grpo.modules.module_set import ModuleSet
from grpo.modules.online_rm import REWARD_KEY, verifier

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs" / "tiny_ci.yaml")
G = 4
# three prompts, four completions each; group 1 has two equal texts (never a pair), group 2
# is all correct (every pair a tie for the verifier)
PROBLEMS = [("Ann has 3 apples and buys 4. How many?", "7"), ("9 - 5?", "4"), ("2 * 3?", "6")]
TEXTS = [
    ["Step 1: 3+4 = 7.\nFinal Answer: 7", "Step 1: 3+4 = 8.\nFinal Answer: 8", "3+4 = 7", "7?"],
    ["Step 1: 9-5 = 4.\nFinal Answer: 4", "Final Answer: 5", "Final Answer: 5", "9-5 = 3"],
    ["Final Answer: 6", "Step 1: 2*3 = 6.\nFinal Answer: 6", "2*3 = 6\nFinal Answer: 6", "x"],
]


@pytest.fixture(scope="module")
def rm_dir(shared_tiny_model, tmp_path_factory):
    """A reward model on the shared tiny model: a random score head, the model's tokenizer."""
    from grpo.models import load_model, save_pretrained

    out = tmp_path_factory.mktemp("online_rm") / "rm"
    rm = load_model(shared_tiny_model, num_labels=1, pad_token_id=0)
    with torch.no_grad(), torch.random.fork_rng():
        torch.manual_seed(0)
        rm.score.weight.normal_(0, 0.5)
    save_pretrained(rm, out)
    for f in Path(shared_tiny_model).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy(f, out / f.name)
    return out


def make_batch(texts=TEXTS) -> RolloutBatch:
    """A step's batch of P = 3 groups of G = 4 (the fields the module reads)."""
    rows = [{"question": q, "ground_truth": t} for q, t in PROBLEMS for _ in range(G)]
    flat = [t for group in texts for t in group]
    B, T_c = len(flat), 5
    lengths = torch.tensor([1 + b % T_c for b in range(B)])
    generated = torch.arange(T_c)[None] < lengths[:, None]  # (B, T_c)
    rollout = types.SimpleNamespace(group_size=G, generated_mask=generated)
    rewards = torch.arange(B, dtype=torch.float32) / 10
    tokens = torch.zeros(B, T_c)
    tokens[torch.arange(B), lengths - 1] = rewards
    return RolloutBatch(
        rollout=rollout,
        rows=rows,
        texts=flat,
        rewards=rewards,
        token_rewards=tokens,
        per_fn={"accuracy": torch.zeros(B)},
        policy_version=0,
        frac_zero_std=0.0,
    )


class Counting:
    """A labeller that records its calls and asks the verifier."""

    def __init__(self):
        self.calls = []

    def __call__(self, row, completion_a, completion_b):
        self.calls.append((row["question"], completion_a, completion_b))
        return verifier(row, completion_a, completion_b)


def build(model, rm_dir, labeller, budget, lr=1e-2, dist=SINGLE, **more) -> ModuleSet:
    from grpo.precision import Precision

    cfg = load_config(TINY, [f"model.path={model}", "lora.enabled=false", "loss.beta=0"])
    kwargs = {"init": str(rm_dir), "labeller": labeller, "label_budget": budget, **more}
    module = ModuleConfig("online_reward_model", kwargs=kwargs, optim={"lr": lr})
    cfg = dataclasses.replace(cfg, modules=(module,))
    # what the module and ModuleSet read of the policy (its device and precision)
    policy = types.SimpleNamespace(
        device=torch.device("cpu"),
        precision=Precision.from_config(cfg.model),
        model=types.SimpleNamespace(config=None),
        tokenizer=None,
    )
    return ModuleSet(cfg, policy, dist, torch.device("cpu"), total_steps=4)


def candidate_pairs() -> Counter:
    """(question, text a, text b) of every two completions of one group whose texts differ
    (group 1's (a, b) twice: once with each of its equal texts)."""
    out = Counter()
    for (q, _), group in zip(PROBLEMS, TEXTS):
        for i in range(G):
            for j in range(i + 1, G):
                if group[i] != group[j]:
                    out[(q, group[i], group[j])] += 1
    return out


@pytest.mark.parametrize("budget", [1, 5, 100])
def test_pairs_come_from_the_rollouts_groups_within_the_label_budget(
    shared_tiny_model, rm_dir, budget
):
    labeller = Counting()
    modules = build(shared_tiny_model, rm_dir, labeller, budget)
    module = modules.items[0].module
    batch = make_batch()
    allowed = candidate_pairs()  # 6 + 5 + 6 = 17: group 1's equal texts make no pair
    assert allowed.total() == 17
    modules.step(batch, None, 1)
    assert len(labeller.calls) == min(budget, 17)  # the budget, or every pair once
    asked = Counter(labeller.calls)
    assert all(asked[k] <= allowed[k] for k in asked)  # two completions of one prompt
    assert int(module.steps) == 1 and int(module.labels) == len(labeller.calls)
    first = list(labeller.calls)
    modules.step(batch, None, 2)
    assert int(module.labels) == 2 * len(first) and int(module.steps) == 2
    if budget == 5:  # another step draws other pairs from the same batch
        assert labeller.calls[5:] != first


def test_the_budget_is_split_over_the_ranks(shared_tiny_model, rm_dir):
    module = build(shared_tiny_model, rm_dir, Counting(), 5).items[0].module
    shares = []
    for rank in range(3):
        module.dist = types.SimpleNamespace(world_size=3, rank=rank)
        shares.append(module.budget())
    assert shares == [2, 2, 1]


def test_its_score_is_the_steps_reward_as_the_reward_model_reward_scores(shared_tiny_model, rm_dir):
    from grpo.rewards.model import make_reward_model

    modules = build(shared_tiny_model, rm_dir, Counting(), 2)
    assert modules.gives_rewards
    batch = make_batch()
    out = modules.attach(batch)
    questions = [r["question"] for r in batch.rows]
    want, _ = make_reward_model(str(rm_dir), max_length=1024)(batch.texts, question=questions)
    want = torch.tensor(want)
    torch.testing.assert_close(out.per_fn[REWARD_KEY], want, rtol=0, atol=1e-6)
    torch.testing.assert_close(out.rewards, batch.rewards + want, rtol=0, atol=1e-6)
    # on each row's last generated token, so the token rewards still sum to the total
    torch.testing.assert_close(out.token_rewards.sum(-1), out.rewards, rtol=0, atol=1e-6)
    moved = out.token_rewards - batch.token_rewards
    last = batch.rollout.generated_mask.long().sum(-1) - 1
    assert (moved[torch.arange(batch.size), last] != 0).all()
    assert (moved.abs().sum(-1) == moved[torch.arange(batch.size), last].abs()).all()
    assert out.per_fn["accuracy"] is batch.per_fn["accuracy"]
    assert out.frac_zero_std == 0.0  # the scores differ within every group


def test_label_first_scores_the_step_with_the_model_its_labels_trained(shared_tiny_model, rm_dir):
    """`label_first: true` (`TrainedModule.trains_first`): the labels and the update come at
    `attach`, before the rewards, so the step's reward is the updated model's score; `step`
    after the policy's update reports that update and takes no other (nor asks again)."""
    labeller = Counting()
    modules = build(shared_tiny_model, rm_dir, labeller, 100, label_first=True)
    module = modules.items[0].module
    batch = make_batch()
    before = module.scores(batch.rows, batch.texts)
    out = modules.attach(batch)
    assert len(labeller.calls) == 17 and int(module.steps) == 1
    after = module.scores(batch.rows, batch.texts)
    assert not torch.equal(before, after)
    torch.testing.assert_close(out.per_fn[REWARD_KEY], after, rtol=0, atol=1e-6)
    weights = {k: v.clone() for k, v in module.model.state_dict().items()}
    metrics = modules.step(out, None, 1)
    assert metrics["module/online_reward_model/labels"] == 17  # attach's update, reported
    assert len(labeller.calls) == 17 and int(module.steps) == 1
    assert all(torch.equal(weights[k], v) for k, v in module.model.state_dict().items())


def float64_bt_loss(module, pairs) -> float:
    """-mean log sigmoid(r_c - r_r) with every sequence scored alone by a float64 copy."""
    from grpo.models.classifier import sequence_scores

    model = _float64(module.model)
    total = 0.0
    for p in pairs:
        r = []
        for side in (p.chosen_ids, p.rejected_ids):
            ids = torch.tensor([p.prompt_ids + side])
            with torch.no_grad():
                r.append(float(sequence_scores(model, ids, torch.ones_like(ids).bool(), 0)[0, 0]))
        d = r[0] - r[1]
        total += math.log1p(math.exp(-d)) if d > 0 else -d + math.log1p(math.exp(d))
    return total / len(pairs)


def _float64(model):
    import copy

    m = copy.deepcopy(model).double()
    m.inv_freq = model.inv_freq.double()
    return m


def test_the_update_is_the_bradley_terry_loss_of_grpo_rm_and_lowers_it(shared_tiny_model, rm_dir):
    labeller = Counting()
    modules = build(shared_tiny_model, rm_dir, labeller, 100)
    module = modules.items[0].module
    batch = make_batch()
    labelled = module.label(batch, module.draw_pairs(batch))
    labeller.calls.clear()
    # the verifier's preferences: each chosen completion right, each rejected one wrong
    for c, r in labelled:
        assert verifier(batch.rows[c], batch.texts[c], batch.texts[r]) == 1
    assert len(labelled) == 9  # group 2 all right: ties; groups 0 and 1 mixed
    pairs = module.encode(batch, labelled)
    before = float64_bt_loss(module, pairs)
    metrics = modules.step(batch, None, 1)
    name = "module/online_reward_model"
    assert metrics[f"{name}/loss"] == pytest.approx(before, rel=1e-5, abs=1e-6)
    assert metrics[f"{name}/labels"] == 17 and metrics[f"{name}/pairs"] == 9
    assert float64_bt_loss(module, pairs) < before  # one AdamW step on them lowers it


def test_a_step_without_a_labelled_pair_leaves_the_model(shared_tiny_model, rm_dir):
    modules = build(shared_tiny_model, rm_dir, lambda row, completion_a, completion_b: 0, 3)
    module = modules.items[0].module
    before = {k: v.clone() for k, v in module.model.state_dict().items()}
    metrics = modules.step(make_batch(), None, 1)
    assert metrics["module/online_reward_model/pairs"] == 0
    assert metrics["module/online_reward_model/labels"] == 3  # ties count against the budget
    after = module.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize(
    "more", [{}, {"pairs": "ranked", "replay": 3, "updates": 2}], ids=["plain", "replay"]
)
def test_a_checkpoint_resumes_it_bitwise(shared_tiny_model, rm_dir, tmp_path, more):
    """Two steps straight, against one step, a checkpoint, a fresh module loading it and the
    second step: the same pairs asked, the same weights, optimizer state and counters (and
    replay buffer)."""
    straight_labels, resumed_labels = Counting(), Counting()
    straight = build(shared_tiny_model, rm_dir, straight_labels, 6, **more)
    batch = make_batch()
    first = straight.step(batch, None, 1)
    straight.save(tmp_path / "ckpt")
    second = straight.step(batch, None, 2)
    resumed = build(shared_tiny_model, rm_dir, resumed_labels, 6, **more)
    resumed.load(tmp_path / "ckpt")
    assert resumed.step(batch, None, 2) == second
    assert resumed_labels.calls == straight_labels.calls[6:]
    a, b = straight.items[0], resumed.items[0]
    sa, sb = a.module.checkpoint_state(), b.module.checkpoint_state()
    assert set(sa) == set(sb) and {"steps", "labels"} <= set(sa)
    if more:  # both steps' labelled pairs, kept
        assert {"replay/tokens", "replay/lengths"} <= set(sa)
        pairs = "module/online_reward_model/pairs"
        assert len(b.module.buffer) == first[pairs] + second[pairs]
        assert second["module/online_reward_model/replayed"] == 3
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert int(sb["steps"]) == 2 and int(sb["labels"]) == 12
    oa, ob = a.optimizer.state_dict()["state"], b.optimizer.state_dict()["state"]
    assert all(torch.equal(oa[i][k], ob[i][k]) for i in oa for k in oa[i])


def test_ranked_pairs_are_each_groups_best_against_its_worst(shared_tiny_model, rm_dir):
    """`pairs: ranked`: by the step's scores (rewards/online_rm), each group's best against
    its worst, then second against second-worst; every group's first pair before any second;
    two equal texts never a pair."""
    scores = torch.tensor([0.3, 0.9, -0.5, 0.1, 2.0, 1.0, 1.5, -1.0, 0.0, 0.4, 0.2, 0.6])
    batch = make_batch()
    batch = dataclasses.replace(batch, per_fn={**batch.per_fn, REWARD_KEY: scores})
    want = {  # rows by score: group 0 [1, 0, 3, 2], group 1 [4, 6, 5, 7], group 2 [11, 9, 10, 8]
        0: [(1, 2), (0, 3)],
        1: [(4, 7)],  # (6, 5): the two equal texts "Final Answer: 5"
        2: [(11, 8), (9, 10)],
    }
    assert batch.texts[5] == batch.texts[6]
    for budget in (3, 4, 100):
        labeller = Counting()
        module = build(shared_tiny_model, rm_dir, labeller, budget, pairs="ranked").items[0].module
        drawn = module.draw_pairs(batch)
        assert len(drawn) == min(budget, 5)
        assert sorted(drawn[:3]) == [(1, 2), (4, 7), (11, 8)]  # every group's first
        assert set(drawn) <= {p for g in want.values() for p in g}
    # unattached (a batch built by hand): scored by the module itself, as its reward would be
    module = build(shared_tiny_model, rm_dir, Counting(), 100, pairs="ranked").items[0].module
    plain = make_batch()
    own = module.scores(plain.rows, plain.texts)
    scored = dataclasses.replace(plain, per_fn={**plain.per_fn, REWARD_KEY: own})
    assert module.draw_pairs(plain) == module.draw_pairs(scored)


def test_replay_rehearsal_and_updates_train_on_pairs_labelled_once(
    shared_tiny_model, rm_dir, tmp_path
):
    """`updates: 2, replay: 4, rehearsal: 2`: the labeller is asked once per step (the
    budget), each update's loss is the Bradley-Terry mean over the step's pairs, 4 pairs of
    earlier steps and 2 of the rehearsal data (a float64 recompute), and the buffer keeps the
    last `replay_size` pairs."""
    import json

    from grpo.data.preferences import preference_pairs
    from grpo.tokenizer import load_tokenizer

    rows = [  # the rehearsal data: a worked solution against a wrong one
        {"prompt": q, "chosen": f"Final Answer: {t}", "rejected": w}
        for (q, t), w in zip(PROBLEMS, ["Final Answer: 8", "9-5 = 3", "x"])
    ]
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    labeller = Counting()
    modules = build(
        shared_tiny_model,
        rm_dir,
        labeller,
        100,
        updates=2,
        replay=4,
        replay_size=12,
        rehearsal=2,
        rehearsal_data=str(data),
    )
    module = modules.items[0].module
    assert module.rehearsal_pairs == preference_pairs(rows, load_tokenizer(rm_dir), 1024)[0]
    batch = make_batch()
    name = "module/online_reward_model"
    first = modules.step(batch, None, 1)
    assert len(labeller.calls) == 17 and int(module.labels) == 17 and int(module.steps) == 1
    assert first[f"{name}/pairs"] == 9 and first[f"{name}/replayed"] == 0  # nothing earlier yet
    assert len(module.buffer) == 9
    step1 = list(module.buffer)
    seen, rehearsed = [], []
    real = module._draw

    def spy(pool, n, what):
        picked = real(pool, n, what)
        if what.startswith("replay"):
            seen.append((picked, _float64(module.model)))  # before the update
        else:
            assert what.startswith("rehearsal") and pool is module.rehearsal_pairs
            rehearsed.append(picked)
        return picked

    module._draw = spy
    new = module.encode(batch, module.label(batch, module.draw_pairs(batch)))  # step 2's draw
    labeller.calls.clear()
    second = modules.step(batch, None, 2)
    assert len(labeller.calls) == 17  # labelled once over both updates
    assert second[f"{name}/replayed"] == 4 and second[f"{name}/pairs"] == 9
    assert second[f"{name}/rehearsed"] == 2 and [len(p) for p in rehearsed] == [2, 2]
    assert [len(p) for p, _ in seen] == [4, 4]
    assert all(any(q is r for r in step1) for p, _ in seen for q in p)  # earlier pairs only
    assert seen[0][0] != seen[1][0]  # drawn afresh for each update
    losses = [
        float64_bt_loss(types.SimpleNamespace(model=m), new + p + r)
        for (p, m), r in zip(seen, rehearsed)
    ]
    assert second[f"{name}/loss"] == pytest.approx(sum(losses) / 2, rel=1e-5, abs=1e-6)
    assert len(module.buffer) == 12  # 18 kept pairs: the oldest 6 dropped
    assert list(module.buffer)[:3] == step1[6:]


def replay_on_two_ranks(dist, model: str, rm_dir: str) -> dict:
    """On each rank of the pool: two steps of a replaying online reward model, rank 1's
    groups in reverse order (other pairs); what the ranks must agree on."""
    modules = build(model, Path(rm_dir), Counting(), 34, dist=dist, replay=5)
    module = modules.items[0].module
    texts = TEXTS if dist.rank == 0 else [list(reversed(g)) for g in TEXTS]
    batch = make_batch(texts)
    steps = [modules.step(batch, None, s) for s in (1, 2)]
    pairs = [(p.prompt_ids, p.chosen_ids, p.rejected_ids) for p in module.buffer]
    weights = {k: v.tolist() for k, v in module.model.state_dict().items()}
    return {"steps": steps, "buffer": pairs, "weights": weights, "labels": int(module.labels)}


def test_two_ranks_keep_one_buffer_of_every_ranks_pairs(rank_pool, shared_tiny_model, rm_dir):
    """Under torchrun the budget is split (34: 17 + 17 labels), every rank keeps the same buffer
    (both ranks' labelled pairs of both steps), the ranks replay 5 pairs of it between them,
    report the same metrics and end with the same weights."""
    r0, r1 = rank_pool.run("test_online_rm:replay_on_two_ranks", shared_tiny_model, str(rm_dir))
    assert (r0["labels"], r1["labels"]) == (2 * 17, 2 * 17)  # each rank's every pair
    name = "module/online_reward_model"
    for a, b in zip(r0["steps"], r1["steps"]):  # the loss: each rank's share (the mean logged)
        assert {k: v for k, v in a.items() if k != f"{name}/loss"} == {
            k: v for k, v in b.items() if k != f"{name}/loss"
        }
    first, second = r0["steps"]
    assert first[f"{name}/labels"] == second[f"{name}/labels"] == 34
    assert first[f"{name}/pairs"] == 2 * 9  # each rank's 9 pairs with a right and a wrong side
    assert first[f"{name}/replayed"] == 0 and second[f"{name}/replayed"] == 5
    assert r0["buffer"] == r1["buffer"]
    assert len(r0["buffer"]) == first[f"{name}/pairs"] + second[f"{name}/pairs"]
    assert r0["weights"] == r1["weights"]


def test_bad_settings_and_labels_are_named(shared_tiny_model, rm_dir):
    with pytest.raises(GrpoError, match="label_budget must be an integer >= 1"):
        build(shared_tiny_model, rm_dir, Counting(), 0)
    with pytest.raises(GrpoError, match="pairs must be one of random, ranked, got 'best'"):
        build(shared_tiny_model, rm_dir, Counting(), 2, pairs="best")
    with pytest.raises(GrpoError, match="updates must be an integer >= 1, got 0"):
        build(shared_tiny_model, rm_dir, Counting(), 2, updates=0)
    with pytest.raises(GrpoError, match="label_first must be true or false, got 'yes'"):
        build(shared_tiny_model, rm_dir, Counting(), 2, label_first="yes")
    with pytest.raises(GrpoError, match="replay must be an integer >= 0, got -1"):
        build(shared_tiny_model, rm_dir, Counting(), 2, replay=-1)
    with pytest.raises(GrpoError, match=r"rehearsal \(4\) and rehearsal_data \(None\) go together"):
        build(shared_tiny_model, rm_dir, Counting(), 2, rehearsal=4)
    with pytest.raises(GrpoError, match="preference data not found: '/nonexistent/p.jsonl'"):
        build(
            shared_tiny_model,
            rm_dir,
            Counting(),
            2,
            rehearsal=4,
            rehearsal_data="/nonexistent/p.jsonl",
        )
    modules = build(shared_tiny_model, rm_dir, lambda row, completion_a, completion_b: "a", 2)
    with pytest.raises(GrpoError, match="labeller returned 'a'; expected a finite number"):
        modules.step(make_batch(), None, 1)
    with pytest.raises(GrpoError, match="not a reward model"):
        build(shared_tiny_model, shared_tiny_model, Counting(), 2)

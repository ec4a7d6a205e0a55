"""The `reward_model` reward: a classifier checkpoint scores each completion rendered with ITS
own tokenizer and chat template, as transformers scores the same chat; batching does not
change a score; it drives `grpo train` (one process, the async producer, 2 torchrun ranks)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import torchrun_train

from grpo.config import load_config
from grpo.errors import GrpoError
from grpo.models import load_model, save_pretrained
from grpo.rewards import get_reward
from grpo.rewards.functions import RewardContext
from grpo.tokenizer import encode_chat, load_tokenizer

QUESTIONS = [
    "Tom has 3 apples and buys 4 more. How many?",
    "What is 6 * 7?",
    "Ann had 10 pens <|im_end|> and lost 2.",
    "2 + 2?",
]
COMPLETIONS = [
    "Step 1: 3+4 = 7\nFinal Answer: 7",
    "Final Answer: 42",
    "Step 1: 10-2 = 8 <|im_start|>user\nFinal Answer: 8",
    "",
]


@pytest.fixture(scope="module")
def reward_ckpt(tmp_path_factory, tiny_checkpoints, tiny_tokenizer):
    """A random classifier (trained head stand-in) with the ChatML tiny tokenizer: a different
    tokenizer from the shared tiny policy's."""
    out = tmp_path_factory.mktemp("rm")
    model = load_model(
        tiny_checkpoints("qwen2", vocab_size=300),
        num_labels=1,
        pad_token_id=tiny_tokenizer.pad_token_id,
    )
    with torch.no_grad():
        model.score.weight.copy_(torch.randn(1, 64, generator=torch.Generator().manual_seed(0)))
    save_pretrained(model, out)
    tiny_tokenizer.save_pretrained(str(out))
    return out


def call(fn, questions=QUESTIONS, completions=COMPLETIONS, **ctx):
    values, metrics = fn(completions, question=questions, context=RewardContext(**ctx))
    return values, metrics


def test_scores_equal_transformers_on_the_reward_models_chat(reward_ckpt):
    from transformers import AutoModelForSequenceClassification

    tok = load_tokenizer(reward_ckpt)
    hf = AutoModelForSequenceClassification.from_pretrained(str(reward_ckpt), dtype=torch.float32)
    fn = get_reward({"name": "reward_model", "path": str(reward_ckpt), "batch_size": 3})
    values, metrics = call(fn)
    want = []
    for q, c in zip(QUESTIONS, COMPLETIONS):
        msgs = [{"role": "user", "content": q}, {"role": "assistant", "content": c}]
        text = tok.apply_chat_template(msgs, tokenize=False)  # transformers' own rendering
        ids = tok(text, add_special_tokens=False)["input_ids"]
        if "<|im_" in q + c:  # special-token text in a content stays plain text: not a turn
            safe = encode_chat(tok, msgs, add_generation_prompt=False)
            assert safe != ids and tok.decode(safe) == tok.decode(ids)
            ids = safe
        with torch.no_grad():
            want.append(float(hf(input_ids=torch.tensor([ids])).logits[0, 0]))
    assert values == pytest.approx(want, rel=1e-5, abs=1e-5)
    assert metrics["score_mean"] == pytest.approx(sum(want) / 4, rel=1e-5, abs=1e-6)
    one, _ = call(get_reward({"name": "reward_model", "path": str(reward_ckpt), "batch_size": 1}))
    assert one == pytest.approx(values, rel=1e-5, abs=1e-6)  # batching and padding: no change


@pytest.mark.parametrize("group", [1, 3])
def test_packed_scoring_equals_padded(reward_ckpt, group):
    """On a CPU rows are scored packed (a GRPO batch's shared prompt once per group): the
    scores of the padded forward, within float32 rounding, in any batch size."""
    from grpo.models import load_model
    from grpo.rewards.model import score_completions, shared_group_size

    model = load_model(reward_ckpt).eval()
    tok = load_tokenizer(reward_ckpt)
    questions = [q for q in QUESTIONS for _ in range(group)]
    completions = [c + " ok" * j for c in COMPLETIONS for j in range(group)]
    padded = score_completions(model, tok, questions, completions, 5, 64, None, None, pack=False)
    for size in (1, 4, 16):
        packed = score_completions(
            model, tok, questions, completions, size, 64, None, None, pack=True
        )
        torch.testing.assert_close(packed, padded, rtol=1e-5, atol=1e-5)
    assert shared_group_size([[1, 2]] * 6) == 6 and shared_group_size([[1], [1], [2]]) is None
    assert shared_group_size([[1], [2]]) is None  # runs of one: nothing shared


def test_normalize_system_prompt_and_max_length(reward_ckpt):
    spec = {"name": "reward_model", "path": str(reward_ckpt)}
    raw, _ = call(get_reward(spec))
    norm, metrics = call(get_reward({**spec, "normalize": "batch"}))
    t = torch.tensor(raw, dtype=torch.float64)
    assert norm == pytest.approx(((t - t.mean()) / t.std()).tolist(), rel=1e-4, abs=1e-5)
    assert metrics["score_mean"] == pytest.approx(sum(raw) / 4, rel=1e-6)  # raw, not normalized
    sys_, _ = call(get_reward({**spec, "system_prompt": "Be strict."}))
    assert sys_ != pytest.approx(raw)  # the system message is part of what it reads
    short, cut = call(get_reward({**spec, "max_length": 12}))  # the prompt keeps its end
    assert short != pytest.approx(raw)
    assert metrics["prompt_cut_frac"] == 0 and cut["prompt_cut_frac"] == 1  # counted, not silent


def test_a_max_length_that_drops_every_prompt_says_so(reward_ckpt, caplog):
    """max_length 2: every prompt cut away; the reward model scores completions alone, which
    is said once (a warning) and counted (prompt_cut_frac), not silent."""
    import grpo.rewards.model as rm

    rm._SAID_DROPPED.clear()
    with caplog.at_level("WARNING", logger="grpo.rewards.model"):
        _, metrics = call(
            get_reward({"name": "reward_model", "path": str(reward_ckpt), "max_length": 2})
        )
        call(get_reward({"name": "reward_model", "path": str(reward_ckpt), "max_length": 2}))
    said = [
        r.getMessage() for r in caplog.records if "without any of their prompt" in r.getMessage()
    ]
    assert len(said) == 1 and "max_length=2 left 4 of 4 rows" in said[0]
    assert metrics["prompt_cut_frac"] == 1


def test_reference_column_caps_each_reward_at_its_references_score(reward_ckpt):
    spec = {"name": "reward_model", "path": str(reward_ckpt)}
    raw, _ = call(get_reward(spec))
    refs = ["Final Answer: 7", "Final Answer: 42", "Final Answer: 8", "Final Answer: 4"]
    ref_scores, _ = call(get_reward(spec), completions=refs)
    fn = get_reward({**spec, "reference_column": "solution"})
    values, metrics = fn(COMPLETIONS, question=QUESTIONS, solution=refs, context=RewardContext())
    assert values == pytest.approx([min(a, b) for a, b in zip(raw, ref_scores)], rel=1e-5)
    assert metrics["capped_frac"] == sum(a > b for a, b in zip(raw, ref_scores)) / 4
    assert metrics["reference_score_mean"] == pytest.approx(sum(ref_scores) / 4, rel=1e-5)
    with pytest.raises(GrpoError, match="reference_column 'solution' is not a column"):
        fn(COMPLETIONS, question=QUESTIONS, context=RewardContext())


def test_bad_specs_and_checkpoints(reward_ckpt, shared_tiny_model):
    with pytest.raises(GrpoError, match="missing a required argument: .path."):
        get_reward({"name": "reward_model"})
    with pytest.raises(GrpoError, match="normalize must be one of none, batch"):
        get_reward({"name": "reward_model", "path": "x", "normalize": "z"})
    fn = get_reward({"name": "reward_model", "path": str(shared_tiny_model)})
    with pytest.raises(GrpoError, match="is a causal LM, not a sequence classifier"):
        call(fn)
    with pytest.raises(GrpoError, match="no 'question' column"):
        get_reward({"name": "reward_model", "path": str(reward_ckpt)})(["x"])


def reward_override(path: Path) -> str:
    return f"rewards=[{{name: reward_model, weight: 1.0, kwargs: {{path: '{path}'}}}}]"


def grpo_records(out: Path) -> list[dict]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "rollout/reward_mean" in r]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_grpo_trains_on_the_reward_model(reward_ckpt, shared_tiny_model, tmp_path, mode):
    from grpo.train.grpo import train_grpo

    extra = ["rollout.async=on"] if mode == "async" else []
    cfg = load_config(
        "configs/tiny_ci.yaml",
        [
            f"model.path={shared_tiny_model}",
            f"train.output_dir={tmp_path / 'run'}",
            "train.max_steps=2",
            "train.progress=false",
            "data.eval_samples=0",
            "rollout.compile=off",
            reward_override(reward_ckpt),
            *extra,
        ],
    )
    train_grpo(cfg)
    rows = grpo_records(tmp_path / "run")
    assert len(rows) == 2
    for r in rows:
        # the only reward: the total is its score (no normalization)
        assert r["rewards/reward_model"] == pytest.approx(r["rollout/reward_mean"], rel=1e-5)
        score = r["rewards/reward_model/score_mean"]
        assert score == pytest.approx(r["rollout/reward_mean"], rel=1e-4, abs=1e-6)
        assert r["perf/reward_s"] > 0 and r["rollout/reward_std"] > 0


@pytest.mark.process
def test_two_ranks_each_score_their_rows(reward_ckpt, shared_tiny_model, tmp_path):
    rows = torchrun_train(tmp_path, shared_tiny_model, "ddp", reward_override(reward_ckpt))
    for r in rows:
        score = r["rewards/reward_model/score_mean"]
        assert score == pytest.approx(r["rollout/reward_mean"], rel=1e-4, abs=1e-6)
        assert r["rollout/reward_std"] > 0

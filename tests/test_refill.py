"""Continuous refill (`Sampler(max_rows=S)`, grpo.rollout.refill): the same completions as
decoding every row at once, fewer decode steps at a spread of lengths, one host sync per
`sync_every` steps."""

from __future__ import annotations

import pytest
import torch
from conftest import LENGTH_REWARD, head_rounding, tiny_train_here, write_package

from grpo.errors import GrpoError
from grpo.models.config import ModelConfig
from grpo.models.decoder import Decoder
from grpo.models.kv_cache import RowKVCache
from grpo.rollout import Sampler
from grpo.testing.launches import count_ops

PROMPTS = [[5 + 3 * i + j for j in range(3 + 4 * i)] for i in range(5)]  # widths 3..19


@pytest.fixture(scope="module")
def model64():
    cfg = ModelConfig(
        family="qwen3", qk_norm=True, max_position_embeddings=256, tie_word_embeddings=False
    )
    m = Decoder(cfg)
    m.init_weights(std=0.2, seed=0)  # peaked logits: stop ids get drawn at varied steps
    return m.double().eval()


def stops_for(model):
    return list(range(3, 40))  # ~15% of the vocabulary: lengths spread from 1 to the limit


@pytest.mark.parametrize("max_rows,sync_every", [(3, 4), (7, 1), (4, 3)])
def test_refill_gives_the_completions_of_one_batch(model64, max_rows, sync_every):
    """float64: every row's tokens identical whatever slot it ran in and whoever ran beside it."""
    kw = dict(
        group_size=3, max_new_tokens=20, temperature=1.0, stop_ids=stops_for(model64), seed=11
    )
    whole = Sampler(model64, sync_every=sync_every).sample(PROMPTS, **kw)
    refilled = Sampler(model64, sync_every=sync_every, max_rows=max_rows).sample(PROMPTS, **kw)
    lens = whole.completion_lens
    assert lens.min() < 5 and lens.max() == 20  # a real spread: some stop early, some never
    assert torch.equal(refilled.completion_lens, lens)
    assert torch.equal(refilled.finished, whole.finished)
    assert torch.equal(refilled.ids, whole.ids)
    assert torch.equal(refilled.completion_mask, whole.completion_mask)
    # log-probs: the head multiplies in float32 (`model.head_precision`) over other batch
    # shapes; they agree within that rounding's worst case
    assert (refilled.logprobs - whole.logprobs).abs().max().item() <= head_rounding(model64)


def test_refill_takes_about_sum_of_lengths_over_slots_decode_steps(model64, monkeypatch):
    kw = dict(group_size=4, max_new_tokens=24, temperature=1.0, stop_ids=stops_for(model64), seed=2)
    steps = []
    sampler = Sampler(model64, sync_every=2, max_rows=5)
    real = sampler._decode_step
    monkeypatch.setattr(sampler, "_decode_step", lambda *a: steps.append(1) or real(*a))
    r = sampler.sample(PROMPTS, **kw)
    B, S = 20, 5
    lens = r.completion_lens
    ideal = lens.sum().item() / S
    batched = -(-B // S) * lens.max().item()  # ceil(B / S) batches, each to its longest row
    # each row holds its slot until the next sync (< sync_every steps after it finished)
    print(f"refill: {len(steps)} decode steps, sum/S = {ideal:.1f}, batches {batched}")
    assert len(steps) <= ideal + B / S * 2 + lens.max().item()
    assert len(steps) < 0.8 * batched


def test_refill_syncs_once_per_sync_every_steps(model64):
    kw = dict(group_size=2, max_new_tokens=12, temperature=1.0, stop_ids=[], seed=0)
    s = Sampler(model64, sync_every=4, max_rows=4)
    c = count_ops(lambda: s.sample(PROMPTS, **kw))  # 10 rows, none stops: 3 waves of 12
    # one sync before each 4 steps (3 waves x 3 + the final check) and the trim to the longest
    assert c.syncs == 3 * 3 + 1 + 1


def test_row_cache_writes_each_slot_at_its_own_length():
    c = RowKVCache(1, 3, 1, 8, 2, torch.float32, "cpu")
    c.lens[:] = torch.tensor([0, 2, 5])
    c.limit = 6  # the caller's bound: the longest slot + 1
    k = torch.arange(6.0).view(3, 1, 1, 2)
    keys, _ = c.update(0, k, k)
    assert keys.shape == (3, 1, 6, 2)
    assert torch.equal(c.k_layers[0][[0, 1, 2], 0, [0, 2, 5]], k[:, 0, 0])
    c.advance(1)
    assert c.lens.tolist() == [1, 3, 6] and c.pos_tensor is c.lens
    with pytest.raises(ValueError, match="one token per slot"):
        c.update(0, torch.zeros(3, 1, 2, 2), torch.zeros(3, 1, 2, 2))


def test_max_rows_must_not_be_negative(model64):
    with pytest.raises(GrpoError, match="max_rows must be >= 0"):
        Sampler(model64, max_rows=-1)


def test_compiled_refill_is_one_graph_per_step_and_equals_eager(model64):
    """A compiling sampler runs each refill step as one graph (no sync, no tensor from Python
    values): the same completions as eager refill, rows coming and going without a
    recompile once the call's attended lengths were seen."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    kw = dict(
        group_size=3, max_new_tokens=20, temperature=1.0, stop_ids=stops_for(model64), seed=11
    )
    eager = Sampler(model64, max_rows=4).sample(PROMPTS, **kw)
    s = Sampler(model64, max_rows=4, compile=True, compile_options={"backend": backend})
    out = s.sample(PROMPTS, **kw)
    assert torch.equal(out.ids, eager.ids) and torch.equal(out.finished, eager.finished)
    steps = [g for g in graphs if any("isin" in str(n.target) for n in g.graph.nodes)]
    assert steps  # the whole step, draw and stop test included
    for g in steps:
        calls = [n for n in g.graph.nodes if n.op in ("call_function", "call_method")]
        names = {getattr(n.target, "__name__", str(n.target)) for n in calls}
        assert not names & {"_local_scalar_dense", "item", "tolist", "nonzero", "tensor"}
    with torch._dynamo.config.patch(error_on_recompile=True):
        again = s.sample(PROMPTS, **{**kw, "seed": 12})  # other rows finish at other steps
    assert again.ids.shape[0] == eager.ids.shape[0]


def test_grpo_train_refills_with_rollout_max_rows(tmp_path, shared_tiny_model, monkeypatch, capsys):
    """`rollout.max_rows` reaches the run's sampler: `grpo train` samples through refill (the
    tiny config's 8 rows through 3 slots) and trains; a negative value is one line, exit 2."""
    import json

    import grpo.rollout.sampler as sampler_mod

    calls = []
    real = sampler_mod.refill_loop
    monkeypatch.setattr(sampler_mod, "refill_loop", lambda *a: calls.append(a[7]) or real(*a))
    pkg = write_package(tmp_path, {"rewards.py": LENGTH_REWARD})
    code = tiny_train_here(
        monkeypatch,
        pkg,
        shared_tiny_model,
        "train.output_dir=run",
        "train.max_steps=1",
        "rollout.max_rows=3",
    )
    assert code == 0, capsys.readouterr().err[-3000:]
    assert calls and set(calls) == {3}
    rows = [json.loads(x) for x in (pkg / "run" / "metrics.jsonl").read_text().splitlines()]
    assert any("train/policy_loss" in r for r in rows)
    capsys.readouterr()
    code = tiny_train_here(monkeypatch, pkg, shared_tiny_model, "rollout.max_rows=-1")
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "rollout.max_rows" in err[0], err

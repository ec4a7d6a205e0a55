"""Multi-turn rollouts in one KV cache: the sampler's tokens equal a loop that re-runs the whole
conversation at every step, and its log-probs equal a fresh training forward over the whole
multi-turn sequence (holes and all), for LoRA and full weights, at T 1.0 and 0.7."""

from __future__ import annotations

import pytest
import torch
from conftest import live_lora

from grpo.algo.logprobs import completion_logprobs
from grpo.models import load_model
from grpo.rollout import Sampler
from grpo.rollout.sampler import Observation

PROMPTS = [[5, 17, 33, 9], [101, 7]]
STOP = 3
TURN_END = list(range(4, 60))  # many ids end a turn, so rows end their turns at different steps


def fake_env(calls: list):
    """Row b answers turn k with (b + k) % 3 + 1 observation tokens (rows differ), and ends
    after turn (b % 3) + 1: rows take 1, 2 or 3 model turns."""

    def observe(b: int, ids: list[int], stopped: bool) -> Observation:
        k = sum(1 for c in calls if c[0] == b)
        calls.append((b, list(ids), stopped))
        if k >= b % 3:
            return Observation([], reward=1.0, done=True, info={"turns": 1})
        obs = [200 + b, 201 + k, 202][: (b + k) % 3 + 1]
        return Observation(obs, reward=0.1, info={"turns": 1, "tool_calls": 1})

    return observe


def run(model, temperature=1.0, seed=0, **kw):
    calls: list = []
    r = Sampler(model).sample_turns(
        PROMPTS, group_size=3, observe=fake_env(calls), max_new_tokens=6, max_turns=4,
        max_total_tokens=48, stop_ids=[STOP], turn_end_ids=TURN_END,
        temperature=temperature, seed=seed, **kw,
    )  # fmt: skip
    return r, calls


@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_multiturn_logprobs_equal_training_forward(tiny_checkpoints, lora, temperature):
    model = load_model(tiny_checkpoints("qwen3"))
    if lora:
        live_lora(model, ["q_proj", "v_proj", "lm_head"], std=0.05, seed=0)
    r, _ = run(model, temperature)
    assert r.loss_mask is not None and (r.loss_mask <= r.completion_mask).all()
    assert (r.completion_mask & ~r.loss_mask).any()  # observations were appended
    holes = (~r.completion_mask).cumsum(1) * r.loss_mask  # a generated token after a hole
    assert (holes > 0).any()
    lens = [len(t) for turns in r.turn_texts for t in turns]
    assert min(lens) < max(lens)  # turns of different lengths: holes inside model turns too
    model.train()
    recomputed = completion_logprobs(model, r.ids, r.attention_mask(), r.prompt_width,
                                     r.loss_mask, temperature, has_holes=True)  # fmt: skip
    diff = (recomputed - r.logprobs)[r.loss_mask].abs().max().item()
    assert diff <= 1e-5
    # without the hole-aware gather the holes would shift the predictions: the flag matters
    naive = completion_logprobs(model, r.ids, r.attention_mask(), r.prompt_width, r.loss_mask,
                                temperature)  # fmt: skip
    assert (naive - r.logprobs)[r.loss_mask].abs().max().item() > 1e-3


def reference_greedy(model, prompt, row, observe, max_new_tokens, max_turns):
    """One row, no cache: re-run the whole conversation for every token (the slow twin)."""
    seq, gen_mask = list(prompt), []
    for _turn in range(max_turns):
        turn_ids, stopped = [], False
        for _ in range(max_new_tokens):
            with torch.no_grad():
                logits = model(torch.tensor([seq]))[0, -1]
            tok = int(logits.argmax())
            seq.append(tok)
            gen_mask.append(True)
            turn_ids.append(tok)
            if tok == STOP or tok in TURN_END:
                stopped = tok == STOP
                break
        o = observe(row, turn_ids[:-1] if stopped else turn_ids, stopped)
        if o.done or not o.ids:
            break
        seq.extend(o.ids)
        gen_mask.extend([False] * len(o.ids))
    return seq[len(prompt) :], gen_mask


def test_greedy_multiturn_equals_rerunning_the_conversation(tiny_checkpoints):
    model = load_model(tiny_checkpoints("qwen3", vocab_size=257))
    r, calls = run(model, temperature=0.0)
    ref_calls: list = []
    observe = fake_env(ref_calls)
    for b in range(r.ids.shape[0]):
        want_ids, want_gen = reference_greedy(model, PROMPTS[b // 3], b, observe, 6, 4)
        keep = r.completion_mask[b]
        got = r.completion_ids[b][keep].tolist()
        assert got == want_ids, b
        assert r.loss_mask[b][keep].tolist() == want_gen, b
    assert sorted(calls, key=lambda c: c[0]) == sorted(ref_calls, key=lambda c: c[0])


def test_turn_bookkeeping(tiny_checkpoints):
    model = load_model(tiny_checkpoints("qwen3"))
    r, calls = run(model, seed=3)
    B = r.ids.shape[0]
    for b in range(B):
        turns = [c for c in calls if c[0] == b]
        assert len(r.turn_texts[b]) == len(turns) == len(r.turn_rewards[b])
        # turn ids: 0, 1, ... in order on real tokens, -1 on holes
        t = r.turn_ids[b]
        assert ((t == -1) == ~r.completion_mask[b]).all()
        real = t[r.completion_mask[b]].tolist()
        assert real == sorted(real)
        # what observe saw is exactly the generated tokens of that turn (stop id left out)
        for k, (_, ids, stopped) in enumerate(turns):
            gen = r.completion_ids[b][(t == k) & r.loss_mask[b]].tolist()
            assert (gen[:-1] if stopped else gen) == ids == r.turn_texts[b][k]
        if r.finished[b]:
            assert r.turn_rewards[b][-1] == 1.0
    assert r.infos[0]["turns"] == len(r.turn_texts[0])
    assert (r.logprobs[~r.loss_mask] == 0).all()


def test_same_seed_same_rollout(tiny_checkpoints):
    model = load_model(tiny_checkpoints("qwen3"))
    a, _ = run(model, seed=5)
    b, _ = run(model, seed=5)
    assert torch.equal(a.ids, b.ids) and torch.equal(a.logprobs, b.logprobs)


def test_ended_trajectories_leave_the_batch(tiny_checkpoints):
    model = load_model(tiny_checkpoints("qwen3"))
    sampler, sizes = Sampler(model), []
    decode = sampler._decode

    def counting(tok, *args):
        sizes.append(tok.shape[0])
        return decode(tok, *args)

    sampler._decode = counting
    calls: list = []
    r = sampler.sample_turns(
        PROMPTS, group_size=3, observe=fake_env(calls), max_new_tokens=6, max_turns=4,
        max_total_tokens=48, stop_ids=[STOP], turn_end_ids=TURN_END, temperature=0.0, seed=0,
    )  # fmt: skip
    # rows end after 1, 2 or 3 turns: the decode batch shrinks from 6 to 4 to 2
    assert sizes[0] == 6 and sorted(set(sizes)) == [2, 4, 6]
    assert [len(t) for t in r.turn_texts] == [1, 2, 3, 1, 2, 3]

"""Multi-turn rollouts in one KV cache: the sampler's tokens equal a loop that re-runs the whole
conversation at every step, and its log-probs equal a fresh training forward over the whole
multi-turn sequence (holes and all), for LoRA and full weights, at T 1.0 and 0.7."""

from __future__ import annotations

import math
from dataclasses import fields

import pytest
import torch
from conftest import live_lora

from grpo.algo.logprobs import completion_logprobs
from grpo.models import load_model
from grpo.models.kv_cache import KVCache
from grpo.rollout import Sampler, multiturn
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
    r = multiturn.sample_turns(
        Sampler(model),
        PROMPTS,
        group_size=3,
        observe=fake_env(calls),
        max_new_tokens=6,
        max_turns=4,
        max_total_tokens=48,
        stop_ids=[STOP],
        turn_end_ids=TURN_END,
        temperature=temperature,
        seed=seed,
        **kw,
    )
    return r, calls


@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_multiturn_logprobs_equal_training_forward(tiny_checkpoints, lora, temperature):
    model = load_model(tiny_checkpoints("qwen3"))
    if lora:
        live_lora(model, ["q_proj", "v_proj", "lm_head"], std=0.05, seed=0)
    r, _ = run(model, temperature)
    assert r.multi_turn and (r.generated_mask <= r.completion_mask).all()
    assert (r.completion_mask & ~r.generated_mask).any()  # observations were appended
    holes = (~r.completion_mask).cumsum(1) * r.generated_mask  # a generated token after a hole
    assert (holes > 0).any()
    lens = [len(t) for turns in r.turn_texts for t in turns]
    assert min(lens) < max(lens)  # turns of different lengths: holes inside model turns too
    model.train()
    recomputed = completion_logprobs(
        model,
        r.ids,
        r.attention_mask(),
        r.prompt_width,
        r.generated_mask,
        temperature,
        has_holes=True,
    )
    diff = (recomputed - r.logprobs)[r.generated_mask].abs().max().item()
    assert diff <= 1e-5
    # without the hole-aware gather the holes would shift the predictions: the flag matters
    naive = completion_logprobs(
        model, r.ids, r.attention_mask(), r.prompt_width, r.generated_mask, temperature
    )
    assert (naive - r.logprobs)[r.generated_mask].abs().max().item() > 1e-3


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
        assert r.generated_mask[b][keep].tolist() == want_gen, b
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
            gen = r.completion_ids[b][(t == k) & r.generated_mask[b]].tolist()
            assert (gen[:-1] if stopped else gen) == ids == r.turn_texts[b][k]
        if r.finished[b]:
            assert r.turn_rewards[b][-1] == 1.0
    assert r.infos[0]["turns"] == len(r.turn_texts[0])
    assert (r.logprobs[~r.generated_mask] == 0).all()


def test_same_seed_same_rollout(tiny_checkpoints):
    model = load_model(tiny_checkpoints("qwen3"))
    a, _ = run(model, seed=5)
    b, _ = run(model, seed=5)
    assert torch.equal(a.ids, b.ids) and torch.equal(a.logprobs, b.logprobs)


def test_ended_trajectories_leave_the_batch(tiny_checkpoints):
    model = load_model(tiny_checkpoints("qwen3"))
    sampler, sizes = Sampler(model), []
    decode = sampler.decode

    def counting(tok, *args):
        sizes.append(tok.shape[0])
        return decode(tok, *args)

    sampler.decode = counting
    calls: list = []
    r = multiturn.sample_turns(
        sampler,
        PROMPTS,
        group_size=3,
        observe=fake_env(calls),
        max_new_tokens=6,
        max_turns=4,
        max_total_tokens=48,
        stop_ids=[STOP],
        turn_end_ids=TURN_END,
        temperature=0.0,
        seed=0,
    )
    # rows end after 1, 2 or 3 turns: the decode batch shrinks from 6 to 4 to 2
    assert sizes[0] == 6 and sorted(set(sizes)) == [2, 4, 6]
    assert [len(t) for t in r.turn_texts] == [1, 2, 3, 1, 2, 3]


# --- host syncs: "has every row ended its turn?" every sync_every steps, one copy per turn ---


def reference_turn_loop(
    sampler,
    logits,
    cache,
    kv_mask,
    pos,
    T_p,
    observe,
    max_new_tokens,
    max_turns,
    draw,
    gen,
    stops,
    ends,
    pad_id,
    total,
):
    """The slow twin of `multiturn._turn_loop`: its code before the sparse host syncs. It reads
    "every row ended its turn?" after every decode step and does the turn's bookkeeping row by
    row (each `.tolist()` / `bool()` a device->host sync on CUDA); `gen` is unused."""
    B = kv_mask.shape[0]
    dev = logits.device
    T = total
    tokens = torch.full((B, T), pad_id, dtype=torch.long, device=dev)
    logprobs = torch.zeros(B, T, device=dev)
    exists = torch.zeros(B, T, dtype=torch.bool, device=dev)
    scored = torch.zeros_like(exists)
    turn_ids = torch.full((B, T), -1, dtype=torch.long, device=dev)
    kv_mask[:, T_p:] = False
    live = torch.ones(B, dtype=torch.bool, device=dev)
    finished = torch.zeros(B, dtype=torch.bool, device=dev)
    act = torch.arange(B, device=dev)
    rewards: list[list[float]] = [[] for _ in range(B)]
    texts: list[list[list[int]]] = [[] for _ in range(B)]
    infos: list[dict] = [{} for _ in range(B)]
    col = 0
    for turn in range(max_turns):
        in_turn, start = live[act].clone(), col
        stopped = torch.zeros(B, dtype=torch.bool, device=dev)
        for _ in range(max_new_tokens):
            if col >= T:
                break
            tok, lp = draw(logits)
            tokens[act, col] = torch.where(in_turn, tok, pad_id)
            logprobs[act, col] = torch.where(in_turn, lp, 0.0)
            exists[act, col] = in_turn
            scored[act, col] = in_turn
            turn_ids[act, col] = torch.where(in_turn, turn, -1)
            kv_mask[:, T_p + col] = in_turn
            logits = sampler.decode(tok[:, None], pos[:, None], kv_mask, cache)
            pos += in_turn.long()
            col += 1
            stopped[act] |= in_turn & torch.isin(tok, stops)
            in_turn &= ~torch.isin(tok, ends)
            if not bool(in_turn.any()):
                break
        obs: dict[int, list[int]] = {}
        for b in act[live[act]].tolist():
            ids = tokens[b, start:col][scored[b, start:col]].tolist()
            if stopped[b]:
                ids = ids[:-1]
            texts[b].append(ids)
            o = observe(b, ids, bool(stopped[b]))
            rewards[b].append(float(o.reward))
            for k, v in o.info.items():
                infos[b][k] = infos[b].get(k, 0) + v
            if o.done or not o.ids:
                live[b] = False
                finished[b] = True
            else:
                obs[b] = list(o.ids)
        L = max((len(o) for o in obs.values()), default=0)
        if turn == max_turns - 1 or L == 0 or col + L + 1 > T:
            break
        keep = live[act]
        if not sampler.compile and not bool(keep.all()):
            idx = keep.nonzero().flatten()
            act, kv_mask, pos = act[idx], kv_mask[idx], pos[idx]
            cache = cache.select_rows(idx)
        b_now = act.shape[0]
        chunk = torch.full((b_now, L), pad_id, dtype=torch.long, device=dev)
        lens = torch.zeros(b_now, dtype=torch.long, device=dev)
        for i, b in enumerate(act.tolist()):
            if b in obs:
                chunk[i, : len(obs[b])] = torch.tensor(obs[b], device=dev)
                lens[i] = len(obs[b])
        real = torch.arange(L, device=dev)[None, :] < lens[:, None]
        kv_mask[:, T_p + col : T_p + col + L] = real
        tokens[act, col : col + L] = chunk
        exists[act, col : col + L] = real
        turn_ids[act, col : col + L] = torch.where(real, turn, -1)
        positions = pos[:, None] + torch.arange(L, device=dev)[None, :]
        hidden = sampler.hidden_states(
            chunk, position_ids=positions, attention_mask=kv_mask, kv_cache=cache
        )
        last = hidden[torch.arange(b_now, device=dev), (lens - 1).clamp(min=0)]
        logits = sampler.logits(last)
        pos += lens
        col += L
    extra = {"turn_rewards": rewards, "turn_texts": texts, "infos": infos}
    return tokens, logprobs, exists, scored, turn_ids, finished, extra


def varied_env(calls: list):
    """Observations of 1..9 tokens; a row ends on a stop id (odd rows), on an empty observation
    (every fifth row-turn) or after 5 turns."""

    def observe(b: int, ids: list[int], stopped: bool) -> Observation:
        k = sum(1 for c in calls if c[0] == b)
        calls.append((b, list(ids), stopped))
        if (stopped and b % 2) or k >= 4:
            return Observation([], reward=float(len(ids)), done=True)
        if (b + k) % 5 == 4:
            return Observation([], reward=0.5)
        obs = [(7 * b + 3 * k + i) % 250 for i in range((b * k) % 9 + 1)]
        return Observation(obs, reward=0.2, info={"n": len(ids)})

    return observe


def rollout_turns(sampler, env, *, seed, temperature, max_new_tokens, total, turn_end, **kw):
    calls: list = []
    r = multiturn.sample_turns(
        sampler,
        [[5, 17, 33, 9], [101, 7], [9] * 7],
        group_size=3,
        observe=env(calls),
        max_new_tokens=max_new_tokens,
        max_turns=5,
        max_total_tokens=total,
        stop_ids=[STOP, 11],
        turn_end_ids=turn_end,
        temperature=temperature,
        seed=seed,
        **kw,
    )
    return r, calls


def assert_same_rollout(a, b):
    """Every field of two Rollouts equal, bit for bit (float compared as int32 patterns)."""
    for f in fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and x.shape == y.shape, f.name
            if x.is_floating_point():
                x, y = x.view(torch.int32), y.view(torch.int32)
            assert torch.equal(x, y), f.name
        else:
            assert x == y, f.name


# (seed, temperature, sampling filters, max_new_tokens, max_total_tokens): turns cut by the
# token limit (12, 21) and by max_new_tokens (3, 200), greedy and filtered sampling
CASES = [
    (0, 1.0, {}, 6, 48),
    (1, 0.7, {"top_k": 20}, 9, 40),
    (2, 0.0, {}, 12, 21),
    (3, 1.3, {"top_p": 0.9}, 3, 200),
    (4, 1.0, {"min_p": 0.05}, 10, 60),
]


@pytest.mark.parametrize("sync_every", [1, 3, 100])
@pytest.mark.parametrize("env", [fake_env, varied_env])
def test_sparse_syncs_give_the_reference_rollout(tiny_checkpoints, monkeypatch, env, sync_every):
    """Checking for the turn's end every sync_every steps (and undoing the steps run after the
    last row ended) gives the rollout of checking after every step, bit for bit."""
    model = load_model(tiny_checkpoints("qwen3", vocab_size=257))
    sampler = Sampler(model, sync_every=sync_every)
    undone = []
    advance = KVCache.advance
    monkeypatch.setattr(KVCache, "advance", lambda c, T: (undone.append(T < 0), advance(c, T)))
    for seed, temperature, filters, mnt, total in CASES:
        r, calls = rollout_turns(
            sampler,
            env,
            seed=seed,
            temperature=temperature,
            max_new_tokens=mnt,
            total=total,
            turn_end=TURN_END,
            **filters,
        )
        with monkeypatch.context() as m:
            m.setattr(multiturn, "_turn_loop", reference_turn_loop)
            want, want_calls = rollout_turns(
                sampler,
                env,
                seed=seed,
                temperature=temperature,
                max_new_tokens=mnt,
                total=total,
                turn_end=TURN_END,
                **filters,
            )
        assert_same_rollout(r, want)
        assert calls == want_calls
    assert any(undone) == (sync_every > 1)  # the cases do run (and undo) extra steps


def test_sparse_syncs_compiled(tiny_checkpoints, monkeypatch):
    """The same with a compiled decode step (static cache: all rows stay in the batch)."""
    model = load_model(tiny_checkpoints("qwen3"))
    sampler = Sampler(model, compile=True, compile_options={"backend": "aot_eager"}, sync_every=4)
    for seed, temperature, filters, mnt, total in CASES[:2]:
        r, calls = rollout_turns(
            sampler,
            varied_env,
            seed=seed,
            temperature=temperature,
            max_new_tokens=mnt,
            total=total,
            turn_end=TURN_END,
            **filters,
        )
        with monkeypatch.context() as m:
            m.setattr(multiturn, "_turn_loop", reference_turn_loop)
            want, want_calls = rollout_turns(
                sampler,
                varied_env,
                seed=seed,
                temperature=temperature,
                max_new_tokens=mnt,
                total=total,
                turn_end=TURN_END,
                **filters,
            )
        assert_same_rollout(r, want)
        assert calls == want_calls


SYNCS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__")  # device->host


def count_syncs(monkeypatch, fn):
    """fn() and the number of tensor -> Python conversions it made (host syncs on CUDA)."""
    n = [0]
    with monkeypatch.context() as m:
        for name in SYNCS:
            orig = getattr(torch.Tensor, name)

            def counted(self, *args, _orig=orig):
                n[0] += 1
                return _orig(self, *args)

            m.setattr(torch.Tensor, name, counted)
        out = fn()
    return out, n[0]


@pytest.mark.parametrize("sync_every", [4, 8])
def test_host_syncs_per_turn_not_per_token(tiny_checkpoints, monkeypatch, sync_every):
    """Host syncs of a rollout: at most ceil(steps / sync_every) + 1 checks and one copy of
    the turn's ids per turn (+ 2 for the whole rollout), whatever the row count; the per-step
    reference makes one per step and several per row."""
    model = load_model(tiny_checkpoints("qwen3"))
    sampler = Sampler(model, sync_every=sync_every)
    kw = dict(seed=1, temperature=1.0, max_new_tokens=24, total=200,
              turn_end=list(range(4, 12)))  # fmt: skip  # few turn-end ids: long turns
    (r, _), n = count_syncs(monkeypatch, lambda: rollout_turns(sampler, varied_env, **kw))
    with monkeypatch.context() as m:
        m.setattr(multiturn, "_turn_loop", reference_turn_loop)
        (want, _), n_ref = count_syncs(
            monkeypatch, lambda: rollout_turns(sampler, varied_env, **kw)
        )
    assert_same_rollout(r, want)
    # decode steps of turn k: until its last row ended (or a limit cut it)
    steps = [int((r.generated_mask & (r.turn_ids == k)).sum(1).max()) for k in range(5)]
    steps = [s for s in steps if s > 0]
    assert len(steps) >= 3 and max(steps) > 2 * sync_every  # several turns, some long
    assert n <= sum(math.ceil(s / sync_every) + 2 for s in steps) + 2, (n, steps)
    assert n_ref >= sum(steps) + r.ids.shape[0]  # per step, and per row

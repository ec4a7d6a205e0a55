"""Sequence packing (train.pack_sequences): rows packed on one token axis with no pad token
give the padded forward's log-probs and gradients (fp32, 1e-5), shared prefix on and off,
LoRA and full, single and multi-turn; labels never cross a row boundary; attention costs the
sum of the rows' own squares, not the square of their sum."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import live_lora
from test_shared_prefix import logprobs_and_grads, multiturn, rollout

from grpo.algo.logprobs import completion_logprobs, pack_rows, packed_overhead
from grpo.models import load_model
from grpo.models.varlen import PackedSegments, plan_buckets


def packed_logprobs_and_grads(model, r, shared: bool):
    model.zero_grad(set_to_none=True)
    packed = pack_rows(r.attention_mask(), r.prompt_width, r.generated_mask,
                       r.group_size if shared else None, packed_overhead(model))  # fmt: skip
    lp = completion_logprobs(model, r.ids, None, r.prompt_width, None, 0.7, packed=packed)
    weights = torch.linspace(-1, 1, lp.numel()).view_as(lp)  # the padded test's loss
    (lp * weights).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return lp.detach(), grads, packed


@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("turns", ["single", "multi"])
@pytest.mark.parametrize("shared", [False, True])
def test_packed_equals_padded(tiny_checkpoints, lora, turns, shared):
    model = load_model(tiny_checkpoints("qwen3"))
    if lora:
        live_lora(model, ["q_proj", "v_proj", "down_proj"], std=0.05, seed=0)
    r = rollout(model) if turns == "single" else multiturn(model)
    model.train()
    pad_lp, pad_g = logprobs_and_grads(model, r, shared=False, holes=turns == "multi")
    lp, g, packed = packed_logprobs_and_grads(model, r, shared)
    m = r.generated_mask
    assert (lp - pad_lp)[m].abs().max().item() <= 1e-5
    assert (lp[~m] == 0).all()
    assert pad_g.keys() == g.keys() and g
    for n in pad_g:
        scale = pad_g[n].abs().max().clamp(min=1e-12)
        assert ((g[n] - pad_g[n]).abs().max() / scale).item() <= 1e-5, n
    # only real tokens ran: the prompt once per group with a shared prefix
    attn = r.attention_mask()
    real = (
        int(attn.sum())
        if not shared
        else (
            int(attn[:: r.group_size, : r.prompt_width].sum())
            + int(attn[:, r.prompt_width :].sum())
        )
    )
    assert packed.real_tokens == real < packed.padded_tokens


@pytest.mark.parametrize("shared", [False, True])
def test_no_label_crosses_a_row_boundary(tiny_checkpoints, shared):
    """Changing every token of one row (its prompt too, without a shared prefix) leaves the
    next row's log-probs, its first completion token's included, unchanged."""
    model = load_model(tiny_checkpoints("qwen3"))
    r = rollout(model, G=3)
    G, w = r.group_size, r.prompt_width
    attn = r.attention_mask()
    packed = pack_rows(attn, w, r.generated_mask, G if shared else None, packed_overhead(model))
    with torch.no_grad():
        before = completion_logprobs(model, r.ids, None, w, None, packed=packed)
        ids = r.ids.clone()
        prev = G - 1  # the last row of the first group; the next row opens the second group
        cols = slice(w, None) if shared else slice(None)  # a shared prompt is the group's own
        old = ids[prev, cols]
        ids[prev, cols] = torch.where(attn[prev, cols], (old + 7) % 256, old)
        after = completion_logprobs(model, ids, None, w, None, packed=packed)
    m = r.generated_mask
    assert (before[prev] - after[prev])[m[prev]].abs().max() > 1e-3  # the row itself changed
    assert torch.equal(before[prev + 1], after[prev + 1])
    assert torch.equal(before[:prev], after[:prev]) and torch.equal(
        before[prev + 1 :], after[prev + 1 :]
    )


def test_attention_scores_scale_with_each_rows_square():
    """A layout of rows of lengths 3..200: the scores computed are within 1.5x of the sum of
    each row's len x len (plus its prefix), far under the square of the total, and each query
    sees exactly its causal own keys plus its whole prefix (checked against a dense mask)."""
    rng = np.random.default_rng(0)
    lens = rng.integers(3, 200, size=40)
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
    segs = [(int(s), int(n), 0, 0) for s, n in zip(starts, lens)]
    pos = np.concatenate([np.arange(n) for n in lens])
    layout = PackedSegments(segs, pos, overhead=256)
    own = int((lens * lens).sum())
    assert own <= layout.score_elements <= 1.5 * own
    assert layout.score_elements < lens.sum() ** 2 / 10
    # a prefix layout: 2 prompts of 5 and 9, each with 3 completions
    segs = [(0, 5, 0, 0), (5, 9, 0, 0), (14, 4, 0, 5), (18, 1, 0, 5), (19, 6, 0, 5),
            (25, 2, 5, 9), (27, 7, 5, 9), (34, 3, 5, 9)]  # fmt: skip
    N = 37
    layout = PackedSegments(segs, np.zeros(N, dtype=np.int64), overhead=1)
    dense = np.zeros((N, N), dtype=bool)
    for s, n, p0, pn in segs:
        for t in range(n):
            dense[s + t, p0 : p0 + pn] = True
            dense[s + t, s : s + t + 1] = True
    seen = np.zeros((N, N), dtype=bool)
    for bk in layout.buckets:
        q, k, keep, valid = bk.q_index.numpy(), bk.k_index.numpy(), bk.keep[:, 0].numpy(), bk.valid
        for i in range(q.shape[0]):
            for t in range(q.shape[1]):
                if valid.view(q.shape)[i, t]:
                    seen[q[i, t], k[i][keep[i, t]]] = True
    assert (seen == dense).all()


def test_buckets_trade_padding_against_calls():
    """Equal lengths take one bucket; with a large per-call cost everything is one bucket;
    with none, each distinct length is its own."""
    lens = np.array([50, 50, 50, 50])
    assert len(plan_buckets(lens, lens, 100)) == 1
    lens = np.array([100, 60, 30, 10])
    assert len(plan_buckets(lens, lens, 10**9)) == 1
    assert len(plan_buckets(lens, lens, 0)) == 4
    assert sorted(np.concatenate(plan_buckets(lens, lens, 500)).tolist()) == [0, 1, 2, 3]


def test_packed_under_bf16_autocast_matches_padded(tiny_checkpoints):
    """The precision path a GPU run takes: bf16 autocast, packed vs padded within the bf16
    error budget of the same-dtype padded forward against fp32."""
    model = load_model(tiny_checkpoints("qwen3"))
    r = rollout(model)
    m = r.generated_mask
    packed = pack_rows(r.attention_mask(), r.prompt_width, m, r.group_size, packed_overhead(model))
    with torch.no_grad():
        ref = completion_logprobs(model, r.ids, r.attention_mask(), r.prompt_width, m)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            pad = completion_logprobs(model, r.ids, r.attention_mask(), r.prompt_width, m)
            lp = completion_logprobs(model, r.ids, None, r.prompt_width, None, packed=packed)
    budget = (pad - ref)[m].abs().max().item()
    assert budget > 0
    assert (lp - ref)[m].abs().max().item() <= 2 * budget + 1e-3


def test_bad_layouts_are_refused(tiny_checkpoints):
    model = load_model(tiny_checkpoints("qwen3"))
    r = rollout(model)
    with pytest.raises(ValueError, match="do not split into groups of 4"):
        pack_rows(r.attention_mask(), r.prompt_width, r.generated_mask, 4)
    holes = multiturn(model)  # holes between turns are no real token
    with pytest.raises(ValueError, match="not a real token"):
        every = torch.ones_like(holes.completion_mask)
        pack_rows(holes.attention_mask(), holes.prompt_width, every)
    packed = pack_rows(r.attention_mask(), r.prompt_width, r.generated_mask)
    with pytest.raises(ValueError, match="packed layout is of 9 rows"):
        completion_logprobs(model, r.ids[:3], None, r.prompt_width, None, packed=packed)

"""Logits processing: hand-computed cases and agreement with `transformers`' warpers."""

from __future__ import annotations

import math

import pytest
import torch

from grpo.rollout.sampling import (
    apply_min_p,
    apply_temperature,
    apply_top_k,
    apply_top_p,
    next_tokens,
    process_logits,
    sample_categorical,
)

NEG_INF = float("-inf")
# probabilities 0.5, 0.3, 0.15, 0.05 as logits (log-probs)
P4 = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
L4 = P4.log()


def random_logits(B=5, V=37, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, V, generator=g) * 3


def kept(logits):
    return torch.isfinite(logits)


def test_temperature_scales_in_float32():
    logits = torch.tensor([[2.0, -4.0]], dtype=torch.bfloat16)
    out = apply_temperature(logits, 2.0)
    assert out.dtype == torch.float32
    assert out.tolist() == [[1.0, -2.0]]
    assert apply_temperature(logits, 1.0).dtype == torch.float32
    with pytest.raises(ValueError, match="temperature"):
        apply_temperature(logits, 0.0)


def test_top_k_hand_cases():
    logits = torch.tensor([[1.0, 3.0, 2.0, 3.0], [4.0, 3.0, 2.0, 1.0]])
    # row 0: the 2nd largest is 3.0 (a tie) -> both 3.0 kept; row 1: 4 and 3 kept
    assert kept(apply_top_k(logits, 2)).tolist() == [
        [False, True, False, True],
        [True, True, False, False],
    ]
    assert torch.equal(apply_top_k(logits, 0), logits)  # off
    assert torch.equal(apply_top_k(logits, 4), logits)  # k >= V: off
    assert kept(apply_top_k(logits, 1))[1].tolist() == [True, False, False, False]


def test_top_p_hand_cases():
    # ascending probs 0.05, 0.15, 0.3, 0.5 -> cumulative 0.05, 0.2, 0.5, 1.0.
    # top_p=0.75: drop while cumulative <= 0.25 -> drop 0.05 and 0.15, keep 0.5 + 0.3 = 0.8.
    assert kept(apply_top_p(L4, 0.75)).tolist() == [[True, True, False, False]]
    # top_p=0.9: drop while cumulative <= 0.1 -> drop only 0.05.
    assert kept(apply_top_p(L4, 0.9)).tolist() == [[True, True, True, False]]
    # a tiny top_p still keeps the arg-max
    assert kept(apply_top_p(L4, 1e-6)).tolist() == [[True, False, False, False]]
    assert torch.equal(apply_top_p(L4, 1.0), L4)


def test_min_p_hand_cases():
    # min_p=0.2: threshold 0.2 * 0.5 = 0.1 -> only 0.05 removed
    assert kept(apply_min_p(L4, 0.2)).tolist() == [[True, True, True, False]]
    # min_p=0.7: threshold 0.35 -> only the arg-max survives
    assert kept(apply_min_p(L4, 0.7)).tolist() == [[True, False, False, False]]
    assert torch.equal(apply_min_p(L4, 0.0), L4)


@pytest.mark.parametrize(
    "temperature,top_k,top_p,min_p",
    [(1.0, 5, 1.0, 0.0), (0.7, 0, 0.9, 0.0), (1.3, 0, 1.0, 0.1), (0.6, 10, 0.8, 0.05)],
)
def test_process_logits_matches_transformers(temperature, top_k, top_p, min_p):
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    logits = random_logits()
    procs = [TemperatureLogitsWarper(temperature)]
    if top_k:
        procs.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        procs.append(TopPLogitsWarper(top_p))
    if min_p:
        procs.append(MinPLogitsWarper(min_p))
    want = LogitsProcessorList(procs)(None, logits.clone())
    got = process_logits(logits, temperature, top_k, top_p, min_p)
    assert torch.equal(kept(got), kept(want))
    torch.testing.assert_close(got[kept(got)], want[kept(want)], rtol=0, atol=1e-6)


def test_greedy_is_argmax_with_temperature_one_logprob():
    logits = random_logits()
    tokens, logprobs = next_tokens(logits, None, temperature=0.0)
    assert torch.equal(tokens, logits.argmax(-1))
    want = logits.log_softmax(-1).gather(-1, tokens[:, None])[:, 0]
    torch.testing.assert_close(logprobs, want, rtol=0, atol=1e-6)


def test_sampled_logprob_is_untruncated_temperature_logprob():
    logits = random_logits(B=64)
    gen = torch.Generator().manual_seed(0)
    tokens, logprobs = next_tokens(logits, gen, temperature=0.8, top_k=3, top_p=0.9)
    # tokens come from the truncated set ...
    allowed = kept(process_logits(logits, 0.8, 3, 0.9, 0.0))
    assert allowed.gather(-1, tokens[:, None]).all()
    # ... but the log-prob is under the full temperature distribution
    want = (logits / 0.8).log_softmax(-1).gather(-1, tokens[:, None])[:, 0]
    torch.testing.assert_close(logprobs, want, rtol=0, atol=1e-6)
    assert logprobs.dtype == torch.float32


def test_draws_follow_the_distribution_and_the_generator():
    # 20000 independent rows of the same 4-way distribution: frequencies within 0.015
    # (about 5 standard deviations of a binomial with p <= 0.5).
    logits = L4.expand(20000, 4)
    tokens, _ = next_tokens(logits, torch.Generator().manual_seed(1))
    freq = torch.bincount(tokens, minlength=4).float() / 20000
    assert (freq - P4[0]).abs().max().item() < 0.015
    again, _ = next_tokens(logits, torch.Generator().manual_seed(1))
    assert torch.equal(tokens, again)
    other, _ = next_tokens(logits, torch.Generator().manual_seed(2))
    assert not torch.equal(tokens, other)


def test_temperature_sharpens():
    logits = L4.expand(20000, 4)
    tokens, logprobs = next_tokens(logits, torch.Generator().manual_seed(0), temperature=0.5)
    # p^2 normalized: 0.25 / (0.25 + 0.09 + 0.0225 + 0.0025) = 0.6849...
    p0 = 0.25 / 0.365
    assert abs((tokens == 0).float().mean().item() - p0) < 0.015
    assert math.isclose(logprobs[tokens == 0][0].item(), math.log(p0), abs_tol=1e-6)


# one-level CDF (small_vocab >= V) and two-level (small_vocab=0), V a multiple of the block
# width (128) or not
@pytest.mark.parametrize("V,small_vocab", [(4, 4096), (300, 4096), (4, 0), (300, 0), (256, 0)])
def test_sample_categorical_frequencies(V, small_vocab):
    g = torch.Generator().manual_seed(0)
    probs = torch.rand(1, V, generator=g) ** 4  # uneven, unnormalized
    probs[0, ::3] = 0.0  # some impossible tokens, including index 0
    n = 40000
    tokens = sample_categorical(probs.expand(n, V), torch.Generator().manual_seed(1), small_vocab)
    freq = torch.bincount(tokens, minlength=V).double() / n
    want = (probs[0] / probs[0].sum()).double()
    assert freq[probs[0] == 0].sum() == 0
    # binomial standard deviation per token, 5 of them
    assert ((freq - want).abs() <= 5 * (want * (1 - want) / n).sqrt() + 1e-4).all()


@pytest.mark.parametrize("small_vocab", [4096, 0])  # one-level and two-level CDF
def test_sample_categorical_never_picks_zero_mass_at_the_edges(small_vocab):
    g = torch.Generator().manual_seed(0)
    V = 256
    probs = torch.zeros(6, V)
    probs[0, 0] = 1.0  # all mass on the first token
    probs[1, V - 1] = 1.0  # ... on the last token
    probs[2, 127], probs[2, 128] = 0.5, 0.5  # across a block boundary
    probs[3, :5] = 1e-30  # tiny masses, last tokens impossible
    probs[4, 200] = 1e-38  # a single denormal-sized token
    probs[5] = torch.rand(V, generator=g)
    probs[5, -10:] = 0.0
    tokens = sample_categorical(probs.repeat(500, 1), g, small_vocab).view(500, 6)
    assert (tokens[:, 0] == 0).all() and (tokens[:, 1] == V - 1).all()
    assert set(tokens[:, 2].tolist()) == {127, 128}
    assert (tokens[:, 3] < 5).all() and (tokens[:, 4] == 200).all()
    assert (tokens[:, 5] < V - 10).all()

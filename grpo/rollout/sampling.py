"""Pure logits processing for sampling: repetition penalty, logit bias, temperature, top-k,
top-p, min-p, and the draw.

Every function takes (B, V) tensors and has no state; randomness comes only from what the
caller passes to `next_tokens` / `sample_categorical`: one uniform per row (`row_uniforms`: a
counter-based stream keyed by seed, row and step, what the sampler uses) or an explicit
`torch.Generator`. The filters follow `transformers`'
`TopKLogitsWarper`, `TopPLogitsWarper` and `MinPLogitsWarper` (keeping at least one token),
applied in the same order: temperature, top-k, top-p, min-p. The per-row adjustments a server
asks for (`apply_repetition_penalty`, HF's `RepetitionPenaltyLogitsProcessor`, then
`apply_logit_bias`, OpenAI's `logit_bias`) come before them, on the raw logits.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F

# Inverse-CDF block width: the CDF over V is taken in two levels (block sums, then one block)
# so that float64 accumulation costs O(V / BLOCK + BLOCK) per row instead of O(V).
BLOCK = 128
SMALL_VOCAB = 4096  # up to this V, one float64 CDF over the row


_MASK32 = 0xFFFFFFFF
# odd multipliers below 2**31, so that a 32-bit value times one fits an int64 (no overflow)
_MIX = (0x7FEB352D, 0x2C1B3C6D, 0x297A2D39, 0x68E31DA5)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xor-shift-multiply rounds) of int64 values in [0, 2**32)."""
    for c in _MIX[:2]:
        x = ((x ^ (x >> 16)) * c) & _MASK32
    return x ^ (x >> 15)


def row_uniforms(seed: int, rows: torch.Tensor | int, steps: int, device=None) -> torch.Tensor:
    """Uniforms in [0, 1) keyed by (seed, row, step): one per row and decode step.

    A counter-based stream (a hash of the three integers, no generator state): the number
    row r draws at step t depends only on (seed, r, t), not on which batch or slot the row
    runs in, how many rows run beside it, or the device. Built once per rollout (a few
    launches for the whole (rows, steps) table), read one column per step.

    Args:
        seed: the rollout's seed (an int below 2**64 in absolute value).
        rows: (B,) long row keys (a row's index in its sample call), or B for 0 .. B-1.
        steps: T, the number of steps to draw for.
        device: where to build the table (default: the rows' device, or the CPU).

    Returns:
        (B, T) float64 uniforms with 53 random bits each.
    """
    if isinstance(rows, int):
        rows = torch.arange(rows, device=device)
    rows = rows.to(device=device or rows.device, dtype=torch.long)
    t = torch.arange(steps, device=rows.device)[None, :]  # (1, T)
    s = _mix32(_mix32(torch.full_like(rows, seed & _MASK32)) ^ ((seed >> 32) & _MASK32))
    key = _mix32(s ^ (rows & _MASK32))  # (B,)
    h = _mix32(key[:, None] ^ t)  # (B, T)
    hi = _mix32(h ^ _MIX[2]) >> 5  # 27 bits
    lo = _mix32((h * _MIX[3]) & _MASK32 ^ _MIX[3]) >> 6  # 26 bits
    return ((hi << 26) | lo).double() * 2.0**-53  # 53 bits: exact in float64


def apply_repetition_penalty(
    logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor
) -> torch.Tensor:
    """HF's repetition penalty, per row: a token already in the row (prompt or completion) has
    its logit divided by the row's penalty when positive, multiplied by it when negative.

    Args:
        logits: (B, V) raw logits.
        seen: (B, V) bool, True where the token occurs in the row's ids.
        penalty: (B,) > 0; 1 leaves the row unchanged.

    Returns:
        (B, V) float32 logits.
    """
    logits = logits.float()
    p = penalty.to(logits)[:, None]  # (B, 1)
    penalized = torch.where(logits > 0, logits / p, logits * p)  # (B, V)
    return torch.where(seen, penalized, logits)


def apply_logit_bias(logits: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """OpenAI's `logit_bias`: `bias` added to the raw logits (-100 bans a token in practice,
    100 all but forces it).

    Args:
        logits: (B, V) raw logits.
        bias: (B, V) float32, 0 where a row has no bias.

    Returns:
        (B, V) float32 logits.
    """
    return logits.float() + bias


def logit_bias_tensor(
    biases: Sequence[Mapping[int, float] | None], vocab_size: int, device=None
) -> torch.Tensor:
    """The (B, V) float32 bias of `apply_logit_bias` from one {token id: bias} per row."""
    out = torch.zeros(len(biases), vocab_size)  # (B, V)
    for b, bias in enumerate(biases):
        if bias:
            out[b, list(bias)] = torch.tensor(list(bias.values()), dtype=torch.float32)
    return out.to(device)


def seen_tokens(ids: torch.Tensor, keep: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Which tokens occur in each row: (B, T) ids with (B, T) bool `keep` (False on padding)
    -> (B, V) bool (the `seen` of `apply_repetition_penalty`)."""
    counts = torch.zeros(ids.shape[0], vocab_size, device=ids.device)  # (B, V)
    return counts.scatter_add_(1, ids, keep.float()) > 0


def apply_temperature(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits / temperature in float32.

    Args:
        logits: (B, V) raw logits, any float dtype.
        temperature: > 0.

    Returns:
        (B, V) float32 scaled logits.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 to scale logits, got {temperature}")
    logits = logits.float()
    return logits if temperature == 1.0 else logits / temperature


def apply_top_k(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """Keep the `top_k` largest logits of each row (ties with the k-th are kept); -inf elsewhere.

    Args:
        logits: (B, V).
        top_k: number of tokens kept; 0 (or >= V) disables the filter.

    Returns:
        (B, V) logits with the removed tokens at -inf.
    """
    if top_k <= 0 or top_k >= logits.shape[-1]:
        return logits
    kth = logits.topk(top_k, dim=-1).values[:, -1:]  # (B, 1)
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Nucleus filter: keep the most likely tokens whose probabilities sum to >= `top_p`.

    Tokens are removed from the unlikely end while the cumulative probability of the removed
    ones stays <= 1 - top_p; the most likely token is always kept.

    Args:
        logits: (B, V).
        top_p: in (0, 1]; 1 disables the filter.

    Returns:
        (B, V) logits with the removed tokens at -inf.
    """
    if top_p >= 1.0:
        return logits
    sorted_logits, order = logits.sort(dim=-1)  # ascending, (B, V)
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)  # (B, V)
    remove_sorted = cum <= 1.0 - top_p
    remove_sorted[:, -1] = False  # the arg-max survives
    remove = remove_sorted.scatter(-1, order, remove_sorted)  # back to vocab order
    return logits.masked_fill(remove, float("-inf"))


def apply_min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Keep tokens whose probability is >= min_p * (probability of the most likely token).

    Args:
        logits: (B, V).
        min_p: in [0, 1]; 0 disables the filter.

    Returns:
        (B, V) logits with the removed tokens at -inf.
    """
    if min_p <= 0.0:
        return logits
    probs = logits.softmax(dim=-1)  # (B, V)
    threshold = min_p * probs.amax(dim=-1, keepdim=True)  # (B, 1)
    return logits.masked_fill(probs < threshold, float("-inf"))


def process_logits(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p, in that order (as `transformers` does).

    Args:
        logits: (B, V) raw logits.
        temperature: > 0.
        top_k, top_p, min_p: filters; 0, 1.0 and 0.0 disable them.

    Returns:
        (B, V) float32 logits to sample from (removed tokens at -inf).
    """
    logits = apply_temperature(logits, temperature)
    logits = apply_top_k(logits, top_k)
    logits = apply_top_p(logits, top_p)
    return apply_min_p(logits, min_p)


def sample_categorical(
    probs: torch.Tensor,
    generator: torch.Generator | None,
    small_vocab: int = SMALL_VOCAB,
    uniforms: torch.Tensor | None = None,
) -> torch.Tensor:
    """One draw per row from unnormalized probabilities, by inverse CDF in two levels.

    `torch.multinomial` draws one exponential variate per vocab entry (B*V of them, ~300 ms
    per step at B=32, V=151936 on a CPU core); this needs one uniform per row. A float32
    cumulative sum over V would swallow tail tokens smaller than its rounding step, so the
    CDF is taken in two levels: each block of 128 tokens is summed on its own (float32, no
    long accumulation), a block is picked on the float64 CDF of the block masses, then a token
    inside it on the block's float64 CDF; up to V = small_vocab, one float64 CDF over the row.
    A zero-probability token is never returned (when rounding lands past the end, the last
    token with positive probability is taken).

    Args:
        probs: (B, V) non-negative, each row with a positive sum.
        generator: the explicit source of randomness (when `uniforms` is None).
        small_vocab: largest V sampled with a one-level CDF.
        uniforms: (B,) float64 in [0, 1), one per row (`row_uniforms`); no generator needed.

    Returns:
        (B,) long token ids.
    """
    B, V = probs.shape
    if uniforms is not None:
        u = uniforms.to(torch.float64)[:, None]  # (B, 1)
    else:
        u = torch.rand(B, 1, generator=generator, dtype=torch.float64, device=probs.device)
    if V <= small_vocab:  # one level: a float64 CDF over a short row is cheap
        cdf = probs.double().cumsum(-1)  # (B, V)
        j = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)
        return torch.minimum(j, torch.searchsorted(cdf, cdf[:, -1:].contiguous()))[:, 0]
    nb = -(-V // BLOCK)
    if nb * BLOCK != V:
        probs = F.pad(probs, (0, nb * BLOCK - V))  # zero mass: never picked
    blocks = probs.view(B, nb, BLOCK)
    mass = blocks.sum(-1).double()  # (B, nb); a float32 sum of 128 terms, then float64
    cdf = mass.cumsum(-1)  # (B, nb)
    u = u * cdf[:, -1:]  # (B, 1) uniform in [0, total)
    # first block whose CDF exceeds u; capped at the last block with mass (first to reach total)
    blk = torch.searchsorted(cdf, u, right=True)
    blk = torch.minimum(blk, torch.searchsorted(cdf, cdf[:, -1:].contiguous()))  # (B, 1)
    u = u - (cdf.gather(1, blk) - mass.gather(1, blk))  # offset inside the block
    inner = blocks.gather(1, blk[:, :, None].expand(B, 1, BLOCK))[:, 0].double()  # (B, BLOCK)
    inner_cdf = inner.cumsum(-1)
    j = torch.searchsorted(inner_cdf, u, right=True)
    j = torch.minimum(j, torch.searchsorted(inner_cdf, inner_cdf[:, -1:].contiguous()))  # (B, 1)
    return (blk * BLOCK + j)[:, 0]


def next_tokens(
    logits: torch.Tensor,
    generator: torch.Generator | None,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    uniforms: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row and return its log-probability.

    The log-prob is taken under the *untruncated* temperature distribution
    log_softmax(logits / temperature), whatever top-k / top-p / min-p removed: that is the
    quantity a training forward recomputes (it never applies the filters), so the sampler's
    log-probs and the trainer's agree exactly. With temperature == 0 the draw is greedy (the
    arg-max, lowest index on ties) and the log-prob is under the temperature-1 distribution.

    Args:
        logits: (B, V) raw logits of the next position.
        generator: the explicit source of randomness (unused when greedy or given `uniforms`).
        temperature: 0 for greedy, else > 0.
        top_k, top_p, min_p: filters, see `process_logits`.
        uniforms: (B,) float64, one uniform per row (`row_uniforms`) instead of the generator.

    Returns:
        tokens (B,) long and logprobs (B,) float32.
    """
    if temperature == 0:
        logits = logits.float()
        tokens = logits.argmax(dim=-1)  # (B,)
        logprobs = logits.log_softmax(dim=-1)  # (B, V)
        return tokens, logprobs.gather(-1, tokens[:, None])[:, 0]
    scaled = apply_temperature(logits, temperature)  # (B, V) float32
    logprobs = scaled.log_softmax(dim=-1)  # (B, V)
    if top_k <= 0 and top_p >= 1.0 and min_p <= 0.0:
        probs = logprobs.exp()  # no filter: reuse the log-softmax
    else:
        probs = process_logits(scaled, 1.0, top_k, top_p, min_p).softmax(dim=-1)
    tokens = sample_categorical(probs, generator, uniforms=uniforms)  # (B,)
    return tokens, logprobs.gather(-1, tokens[:, None])[:, 0]

"""Prompt log-likelihoods for `/v1/completions` with ``echo``: what lm-eval-harness's
``local-completions`` model asks for its loglikelihood and multiple-choice tasks.

    {"prompt": [[ids...]], "echo": true, "max_tokens": 1, "logprobs": 1, "temperature": 0}

One forward over the prompts (right-padded, so every real position sees only itself and what
came before it), the hidden states turned into float32 log-probs by `grpo.precision.head_logits`
(the sampler's logits, which the trainer's fused log-probs equal) in chunks of positions, so no
(B, T, V) tensor is built at once. Every prompt token but the first gets log p(token | before)
and the `top_k` most likely tokens at its position with theirs; with ``max_tokens: 1`` and
temperature 0 the greedy next token is appended with the same numbers (its arg-max is the
sampler's greedy choice). A token's log-prob and the top list's entries come from one
log-softmax, so "the token is the top one" is an exact equality, as lm-eval tests it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from grpo.precision import head_logits

_CHUNK = 256  # positions whose (N, V) float32 logits exist at once


@dataclass
class Scored:
    """One prompt, scored.

    Attributes:
        ids: the prompt's tokens, plus the greedy next token when one was asked for.
        logprobs: log p(ids[t] | ids[:t]) for t >= 1; None for t = 0 (nothing predicts it).
        top: the `top_k` most likely (token id, log-prob) at each position t >= 1, most likely
            first; None for t = 0.
    """

    ids: list[int]
    logprobs: list[float | None]
    top: list[list[tuple[int, float]] | None]


@torch.no_grad()
def score(
    model,
    prompts: list[list[int]],
    top_k: int,
    extend: bool,
    pad_id: int = 0,
    head_precision: str = "float32",
) -> list[Scored]:
    """Log-probs of every prompt token after the first (and of the greedy next token if
    `extend`), with the `top_k` alternatives at each position.

    Args:
        model: a `Decoder` in eval mode.
        prompts: token ids, each non-empty; with `extend` each leaves room for one more.
        top_k: alternatives per position (0: none).
        extend: append the greedy next token (arg-max at the last position) and score it.
        pad_id: the right padding (masked out).
        head_precision: the lm_head's precision (`grpo.precision.Precision.head`).

    Returns:
        one `Scored` per prompt.
    """
    dev = model.device
    B, T = len(prompts), max(len(p) for p in prompts)
    ids = torch.full((B, T), pad_id, dtype=torch.long, device=dev)
    mask = torch.zeros((B, T), dtype=torch.bool, device=dev)
    for b, p in enumerate(prompts):
        ids[b, : len(p)] = torch.tensor(p, device=dev)
        mask[b, : len(p)] = True
    hidden = model(ids, attention_mask=mask, return_hidden=True)  # (B, T, C)
    out = []
    for b, p in enumerate(prompts):
        L = len(p)
        n = L if extend else L - 1  # positions 0..n-1 predict tokens 1..n
        targets = p[1:]
        logprobs: list[float | None] = [None]
        top: list[list[tuple[int, float]] | None] = [None]
        nxt = None
        for start in range(0, n, _CHUNK):
            h = hidden[b, start : min(n, start + _CHUNK)]  # (N, C)
            lsm = F.log_softmax(head_logits(model.lm_head, h, head_precision).float(), dim=-1)
            if extend and start + h.shape[0] == n:  # the last position: the greedy next token
                nxt = int(lsm[-1].argmax())
            want = targets[start : start + h.shape[0]] + ([nxt] if nxt is not None else [])
            picked = lsm[torch.arange(len(want), device=dev), torch.tensor(want, device=dev)]
            logprobs.extend(picked.tolist())
            if top_k > 0:
                values, indices = lsm.topk(top_k, dim=-1)  # (N, k)
                top.extend([list(zip(i, v)) for i, v in zip(indices.tolist(), values.tolist())])
            else:
                top.extend([[] for _ in want])
        out.append(Scored(list(p) + ([nxt] if nxt is not None else []), logprobs, top))
    return out

"""Sequence scores of a classifier `Decoder` (a reward model): its `score` head read at each
row's last real token that is not the pad id, the position `transformers`'
`*ForSequenceClassification` reads (the rightmost token != pad_token_id), so a checkpoint
scores alike in both libraries, with left or right padding, also when a row's last real token
is the pad id (pad = eos in Qwen base models: that row is read one token earlier, as there).
"""

from __future__ import annotations

import torch


def score_positions(ids: torch.Tensor, attention_mask: torch.Tensor, pad_id: int | None):
    """(B,) the position each row is scored at: the rightmost real token whose id is not
    `pad_id` (0 in a row with none, as `transformers` picks).

    Args:
        ids: (B, T) token ids.
        attention_mask: (B, T) bool, True = real token.
        pad_id: the classifier's pad_token_id (None: every real token counts).
    """
    keep = attention_mask.bool() if pad_id is None else attention_mask.bool() & (ids != pad_id)
    index = torch.arange(ids.shape[1], device=ids.device)
    return (index * keep).argmax(-1)


def sequence_scores(
    model, ids: torch.Tensor, attention_mask: torch.Tensor, pad_id: int | None
) -> torch.Tensor:
    """(B, num_labels) float32 scores of a classifier `Decoder` (`ModelConfig.num_labels`; the
    model may be DDP-wrapped, so its pad id comes as `pad_id`): one forward (gradients flow
    when enabled) in which only the scored positions reach the head."""
    pos = score_positions(ids, attention_mask, pad_id)
    return model(ids, attention_mask=attention_mask, select=pos).float()


def packed_sequence_scores(
    model,
    ids: torch.Tensor,
    attention_mask: torch.Tensor,
    prompt_width: int,
    pad_id: int | None,
    group_size: int | None,
    overhead: int,
) -> torch.Tensor:
    """`sequence_scores` of rows of left-padded prompt + right-padded completion, packed on
    one token axis (`grpo.algo.logprobs.pack_rows`): no pad token runs, and with `group_size`
    G each group's shared prompt runs once for its G completions. Each row is scored where
    `score_positions` says, which must lie in its completion (a completion with a token that
    is not the pad id).

    Args:
        ids, attention_mask: (B, T_p + T_c); prompts end at `prompt_width`.
        group_size: G when rows b*G .. b*G + G - 1 share one prompt, else None.
        overhead: the attention buckets' per-call cost (`grpo.algo.logprobs.packed_overhead`).
    """
    from grpo.models.packed_rows import pack_rows

    B, T = ids.shape
    pos = score_positions(ids, attention_mask, pad_id)  # (B,)
    if bool((pos < prompt_width).any()):
        raise ValueError("a row's scored token lies in its prompt (an empty completion)")
    scored = torch.zeros(B, T - prompt_width, dtype=torch.bool, device=ids.device)
    scored[torch.arange(B, device=ids.device), pos - prompt_width] = True
    packed = pack_rows(attention_mask, prompt_width, scored, group_size, overhead, ids.device)
    where = torch.full((B * T,), -1, dtype=torch.long, device=ids.device)
    where[packed.src] = torch.arange(packed.src.numel(), device=ids.device)  # flat -> stream
    select = where[torch.arange(B, device=ids.device) * T + pos]  # (B,) completion tokens: unique
    flat = ids.reshape(-1)[packed.src][None]  # (1, N)
    return model(flat, packed=packed.segments, select=select).float()

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


def sequence_scores(model, ids: torch.Tensor, attention_mask: torch.Tensor,
                    pad_id: int | None) -> torch.Tensor:  # fmt: skip
    """(B, num_labels) float32 scores of a classifier `Decoder` (`ModelConfig.num_labels`; the
    model may be DDP-wrapped, so its pad id comes as `pad_id`): one forward (gradients flow
    when enabled) in which only the scored positions reach the head."""
    pos = score_positions(ids, attention_mask, pad_id)
    return model(ids, attention_mask=attention_mask, select=pos).float()

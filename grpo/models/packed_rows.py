"""Sequence packing of B rows (prompt + completion) on one token axis for the training passes
(train.pack_sequences): `pack_rows` lays the rows' real tokens end to end (each group's prompt
once with `group_size`), builds the attention layout (`grpo.models.varlen.PackedSegments`) and
records where each scored token and its predicting position sit (`PackedRows`); the log-prob
passes (`grpo.algo.logprobs.packed_completion_logprobs`) and the reward model's scores
(`grpo.models.classifier.packed_sequence_scores`) read it."""

from __future__ import annotations

import numpy as np
import torch

from grpo.models.varlen import PackedSegments, bucket_overhead


class PackedRows:
    """B rows of prompt + completion packed on one token axis (`pack_rows`): the stream's
    attention layout and where each scored token and its predicting position sit. Index
    tensors live on the model's device; built once per micro-batch and step, read by every
    log-prob pass (reference, pi_old, update). A plain class: DDP passes it through as is.

    Attributes:
        src: (N,) flat index into the rows' ids (B * T) of each stream token.
        segments: the attention layout (`grpo.models.varlen.PackedSegments`).
        pred: (N_s,) stream index of the hidden state that predicts each scored token: the
            previous token of its own row (for a completion's first token, its prompt's last),
            so no label crosses a row boundary.
        target: (N_s,) flat index into the rows' ids of each scored token.
        dst: (N_s,) flat index into the (B, T_c) output of each scored token.
        shape: (B, T_c).
        real_tokens: N, the tokens the forward runs.
    """

    __slots__ = ("src", "segments", "pred", "target", "dst", "shape", "real_tokens")

    def __init__(self, src, segments, pred, target, dst, shape):
        self.src, self.segments, self.pred, self.target, self.dst = src, segments, pred, target, dst
        self.shape, self.real_tokens = shape, segments.num_tokens


def pack_rows(
    attention_mask: torch.Tensor,
    prompt_width: int,
    scored: torch.Tensor,
    group_size: int | None = None,
    overhead: int = 1024,
    device: torch.device | str = "cpu",
) -> PackedRows:
    """Pack B rows of left-padded prompt + completion on one token axis, padding dropped.

    Each row's real tokens keep their order and rotary positions (counted over the attention
    mask, as the padded forward counts them); holes between turns (multi-turn) simply vanish,
    so each token is predicted by the real token before it. With `group_size` G, rows
    b*G .. b*G + G - 1 share one prompt: it runs once, as a prefix segment all G completion
    segments attend to in full (`train.shared_prefix`).

    Args:
        attention_mask: (B, T_p + T_c) bool, True = real token (read on the host).
        prompt_width: T_p.
        scored: (B, T_c) bool, the completion tokens to score (real ones).
        group_size: G when the rows' prompts are shared per group, else None.
        overhead: the attention buckets' per-call cost (`grpo.models.varlen.bucket_overhead`).
        device: where the index tensors go.

    Returns:
        the `PackedRows`.
    """
    real = attention_mask.detach().bool().cpu().numpy()  # (B, T)
    score = scored.detach().bool().cpu().numpy()  # (B, T_c)
    B, T = real.shape
    w, T_c = prompt_width, T - prompt_width
    if score.shape != (B, T_c):
        raise ValueError(f"scored mask {score.shape} does not match {B} rows of {T_c} tokens")
    if (score & ~real[:, w:]).any():
        raise ValueError("a scored token is not a real token of its row")
    if (real[:, :w].sum(1)[score.any(1)] == 0).any():  # its first token would have no predictor
        raise ValueError("a row with scored tokens has an empty prompt")
    rows_flat = np.arange(B)[:, None] * T
    if group_size is None:
        src = np.flatnonzero(real)  # row-major: each row's tokens together
        lens = real.sum(1)
        starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
        positions = (np.cumsum(real, 1) - 1)[real]
        segments = [(int(s), int(n), 0, 0) for s, n in zip(starts, lens) if n]
    else:
        G = group_size
        if B % G:
            raise ValueError(f"{B} rows do not split into groups of {G}")
        p_real = real[::G, :w]  # (P, T_p): the group's prompt, from its first row
        c_real = real[:, w:]  # (B, T_c)
        p_lens, c_lens = p_real.sum(1), c_real.sum(1)
        N_p = int(p_lens.sum())
        p_starts = np.concatenate([[0], np.cumsum(p_lens)[:-1]])
        c_starts = N_p + np.concatenate([[0], np.cumsum(c_lens)[:-1]])
        src = np.concatenate(
            [
                (rows_flat[::G] + np.arange(w)[None])[p_real],
                (rows_flat + w + np.arange(T_c)[None])[c_real],
            ]
        )
        group_of = np.arange(B) // G
        positions = np.concatenate(
            [
                (np.cumsum(p_real, 1) - 1)[p_real],
                (p_lens[group_of][:, None] + np.cumsum(c_real, 1) - 1)[c_real],
            ]
        )
        segments = [(int(s), int(n), 0, 0) for s, n in zip(p_starts, p_lens) if n]
        segments += [
            (int(c_starts[r]), int(c_lens[r]), int(p_starts[group_of[r]]), int(p_lens[group_of[r]]))
            for r in range(B)
            if c_lens[r]
        ]
    where = np.full(B * T, -1, dtype=np.int64)  # flat (row, column) -> stream index
    where[src] = np.arange(len(src))
    target = (rows_flat + w + np.arange(T_c)[None])[score]  # (N_s,) flat ids index
    pred = where[target] - 1  # the stream token before it: the row's previous real token
    if group_size is not None:  # a completion's first token: its group's prompt's last
        first = score & (np.cumsum(c_real, 1) == 1)
        prompt_last = p_starts + p_lens - 1  # (P,)
        pred[first[score]] = prompt_last[(np.arange(B)[:, None] // G).repeat(T_c, 1)[first]]
    dst = (np.arange(B)[:, None] * T_c + np.arange(T_c)[None])[score]

    def to(x):
        return torch.as_tensor(np.ascontiguousarray(x), dtype=torch.long).to(device)

    layout = PackedSegments(segments, positions, overhead, device)
    return PackedRows(to(src), layout, to(pred), to(target), to(dst), (B, T_c))


def packed_overhead(model: torch.nn.Module) -> int:
    """`bucket_overhead` of a `Decoder` (its attention heads and head dim, its device type)."""
    cfg = model.config
    device = next(model.parameters()).device
    return bucket_overhead(cfg.num_attention_heads, cfg.head_dim, device.type)

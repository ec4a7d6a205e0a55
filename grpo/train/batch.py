"""One GRPO step's data: the `Batch`, row selection and concatenation of rollouts, token
rewards from sequence and per-turn rewards, and the prompt order / micro-batch helpers that
SFT and GRPO share. Shapes: B = P*G rows (a group's rows adjacent), T_c completion tokens."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from grpo.rollout import Rollout
from grpo.train.state import TrainState


@dataclass
class Batch:
    """One step's training data: rollouts plus everything the loss needs, all (B, ...)."""

    rollout: Rollout
    rows: list[dict]  # B dataset rows (each prompt's row repeated G times)
    rewards: torch.Tensor  # (B,) total reward of each completion (its token rewards summed)
    per_fn: dict[str, torch.Tensor]  # name -> (B,)
    loss_mask: torch.Tensor  # (B, T_c) bool: completion_mask, minus truncated rows if asked
    texts: list[str]
    frac_zero_std: float
    token_rewards: torch.Tensor | None = None  # (B, T_c); None: `rewards` on the last token
    advantages: torch.Tensor | None = None  # (B, T_c) (or (B,), broadcast), from advantage_phase
    ref_logprobs: torch.Tensor | None = None  # (B, T_c)
    old_logprobs: torch.Tensor | None = None  # (B, T_c) trainer recompute; None: the sampler's
    # micro-batch size -> [(row slice, column range)]: computed once per step, read by every
    # training-side pass (`grpo.train.grpo._micro_batches`)
    micro_batch_plan: dict = field(default_factory=dict, init=False, repr=False)


def derive_seed(*parts: int) -> int:
    """A sampler seed from (seed, rank, step, round): distinct, reproducible streams."""
    return int(np.random.SeedSequence(list(parts)).generate_state(1)[0])


def next_prompts(state: TrainState, n_rows: int, count: int, seed: int) -> list[int]:
    """The next `count` row indices of a per-epoch shuffled order; advances `state`."""
    out = []
    while len(out) < count:
        order = np.random.default_rng([seed, state.epoch]).permutation(n_rows)
        take = order[state.data_index : state.data_index + count - len(out)]
        out.extend(int(i) for i in take)
        state.data_index += len(take)
        if state.data_index >= n_rows:
            state.epoch, state.data_index = state.epoch + 1, 0
    return out


def select_rows(r: Rollout, idx: torch.Tensor) -> Rollout:
    """The rollout restricted to rows `idx` (whole groups)."""
    rows = idx.tolist()

    def pick(x):
        if x is None:
            return None
        return x[idx] if isinstance(x, torch.Tensor) else [x[i] for i in rows]

    return Rollout(
        ids=r.ids[idx],
        prompt_lens=r.prompt_lens[idx],
        prompt_width=r.prompt_width,
        completion_ids=r.completion_ids[idx],
        completion_mask=r.completion_mask[idx],
        completion_lens=r.completion_lens[idx],
        finished=r.finished[idx],
        logprobs=r.logprobs[idx],
        group_size=r.group_size,
        **{k: pick(getattr(r, k)) for k in MULTI_TURN_FIELDS},
    )


MULTI_TURN_FIELDS = ("loss_mask", "turn_ids", "turn_rewards", "turn_texts", "infos")


def turn_token_rewards(rewards: torch.Tensor, r: Rollout, gamma: float) -> torch.Tensor:
    """(B, T_c) token rewards of multi-turn trajectories: each turn's step reward r_k on the
    last generated token of turn k, scaled by gamma^k, and the trajectory reward R on the last
    generated token, scaled by gamma^(K-1) (K turns), so a row sums to its discounted return
    sum_k gamma^k r_k + gamma^(K-1) R. Per-token trajectory rewards (B, T_c) are added as is."""
    scored = r.scored_mask
    token = rewards.float().clone() if rewards.dim() == 2 else torch.zeros(scored.shape)
    token = token.to(scored.device)
    cols = torch.arange(scored.shape[1], device=scored.device)
    for b, steps in enumerate(r.turn_rewards):
        for k, value in enumerate(steps):
            here = scored[b] & (r.turn_ids[b] == k)
            if value and here.any():
                token[b, int(cols[here].max())] += gamma**k * value
        if rewards.dim() == 1 and scored[b].any():
            K = max(len(steps), 1)
            token[b, int(cols[scored[b]].max())] += gamma ** (K - 1) * float(rewards[b])
    return token


def outcome_token_rewards(rewards: torch.Tensor, completion_mask: torch.Tensor) -> torch.Tensor:
    """(B,) sequence rewards -> (B, T_c) token rewards: each on its row's last completion token."""
    B, T = completion_mask.shape
    out = torch.zeros(B, T, dtype=torch.float32, device=completion_mask.device)
    if T == 0:
        return out
    last = (completion_mask.long().sum(-1) - 1).clamp(min=0)  # (B,)
    return out.scatter(1, last[:, None], rewards.float().to(out.device)[:, None])


def cat_rollouts(pieces: list[Rollout], pad_id: int) -> Rollout:
    """Concatenate rollout pieces of (maybe) different prompt widths and completion lengths."""
    if len(pieces) == 1:
        return pieces[0]
    T_p = max(p.prompt_width for p in pieces)
    T_c = max(p.completion_ids.shape[1] for p in pieces)

    def pad(x, left, right, value):
        return torch.nn.functional.pad(x, (left, right), value=value)

    ids, cids, cmask, lps = [], [], [], []
    multi = pieces[0].loss_mask is not None
    lmask, tids = [], []
    for p in pieces:
        dl, dr = T_p - p.prompt_width, T_c - p.completion_ids.shape[1]
        cids.append(pad(p.completion_ids, 0, dr, pad_id))
        ids.append(torch.cat([pad(p.prompt_ids, dl, 0, pad_id), cids[-1]], 1))
        cmask.append(pad(p.completion_mask, 0, dr, False))
        lps.append(pad(p.logprobs, 0, dr, 0.0))
        if multi:
            lmask.append(pad(p.loss_mask, 0, dr, False))
            tids.append(pad(p.turn_ids, 0, dr, -1))
    extra = {}
    if multi:
        extra = {"loss_mask": torch.cat(lmask), "turn_ids": torch.cat(tids)}
        for k in ("turn_rewards", "turn_texts", "infos"):
            extra[k] = [x for p in pieces for x in getattr(p, k)]
    return Rollout(
        ids=torch.cat(ids),
        prompt_lens=torch.cat([p.prompt_lens for p in pieces]),
        prompt_width=T_p,
        completion_ids=torch.cat(cids),
        completion_mask=torch.cat(cmask),
        completion_lens=torch.cat([p.completion_lens for p in pieces]),
        finished=torch.cat([p.finished for p in pieces]),
        logprobs=torch.cat(lps),
        group_size=pieces[0].group_size,
        **extra,
    )


def micro_batches(B: int, size: int):
    for start in range(0, B, size):
        yield slice(start, min(B, start + size))


def column_bounds(attention_mask: torch.Tensor, slices: list[slice], prompt_width: int):
    """For each micro-batch, the column range [lo, hi) that holds all of its rows' real tokens:
    a training forward over ids[:, lo:hi] gives the same log-probs as over all columns (the
    columns left of lo are padding in every row, so rotary positions do not move; the ones at
    and right of hi are later than every scored token, which causal attention never sees).
    Micro-batches of short prompts and completions then cost only their own length.

    Args:
        attention_mask: (B, T_p + T_c) bool, True = real token.
        slices: the micro-batches (row slices).
        prompt_width: T_p.

    Returns:
        [(lo, hi)] per slice, lo <= T_p - 1 (the prompt's last column predicts the first
        completion token) and hi >= T_p + 1; one host sync for all of them.
    """
    T = attention_mask.shape[1]
    cols = torch.arange(T, device=attention_mask.device)
    ends = []
    for sl in slices:
        real = attention_mask[sl].any(dim=0)  # (T,)
        ends += [torch.where(real, cols, T).min(), torch.where(real, cols, -1).max()]
    flat = torch.stack(ends).tolist() if ends else []
    return [(min(flat[2 * i], prompt_width - 1), max(flat[2 * i + 1] + 1, prompt_width + 1))
            for i in range(len(slices))]  # fmt: skip

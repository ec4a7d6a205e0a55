"""The values one GRPO step passes from phase to phase, and the helpers that build them.

    RolloutBatch  sampled + scored rollouts (rollout phase): self-contained, so it may come
                  from this rank's sampler, another rank or an earlier step (`policy_version`)
    UpdateBatch   what the update reads: the rollout's tokens, the counted mask, advantages,
                  reference / old log-probs and the micro-batch plan
    MicroBatch    one micro-batch: its rows and the columns that hold their real tokens

All are frozen: a phase returns a new value, it never fills in an old one. Also here: prompt
order and seeds, row selection and concatenation of rollouts, token rewards from sequence and
per-turn rewards, micro-batch planning. Shapes: B = P*G rows (a group's rows adjacent), T_c
completion tokens.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from grpo.distributed import SINGLE, Dist, all_reduce_max
from grpo.models.packed_rows import PackedRows, pack_rows
from grpo.rollout import Rollout
from grpo.run.state import TrainState

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RolloutBatch:
    """One step's rollouts with their scores; every tensor on the rollout's device.

    Attributes:
        rollout: token ids, masks and the sampler's log-probs (`grpo.rollout.Rollout`).
        rows: B dataset rows (each prompt's row repeated G times).
        texts: B completion texts (what the reward functions scored).
        rewards: (B,) float32 total reward of each completion (its token rewards summed).
        token_rewards: (B, T_c) float32 rewards on tokens: a sequence reward on the row's last
            generated token; step rewards (multi-turn) on their turn's last token, discounted.
        per_fn: reward name -> (B,) float32 unweighted reward.
        policy_version: training steps the sampling policy had completed (the step it was
            sampled for is policy_version + 1).
        frac_zero_std: fraction of groups with all-equal rewards in the first sampling round.
        metrics: what producing the batch reported, logged with the step's metrics (full
            names, e.g. ``rollout/groups_kept``; values typed for their reduction over ranks,
            `grpo.metrics.Sum` / `Max` / `Min`, else averaged).
        extras: named per-row tensors, (B,) or (B, T_c), that a rollout strategy or a trained
            module attached for the later phases (an estimator reads them by name).
    """

    rollout: Rollout
    rows: list[dict]
    texts: list[str]
    rewards: torch.Tensor
    token_rewards: torch.Tensor
    per_fn: dict[str, torch.Tensor]
    policy_version: int
    frac_zero_std: float
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    extras: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)

    @property
    def size(self) -> int:
        """B, the number of rows."""
        return len(self.rows)

    def select_groups(self, groups: Sequence[int]) -> RolloutBatch:
        """The batch restricted to whole groups (indices of groups of G rows), in that order."""
        G = self.rollout.group_size
        return self.select_rows([g * G + j for g in groups for j in range(G)])

    def select_rows(self, rows: Sequence[int]) -> RolloutBatch:
        """The batch restricted to rows (indices), in that order; every score and extra goes
        with its row (the group size stays: a caller picking part of each group sets it)."""
        idx = torch.tensor(list(rows), dtype=torch.long)
        rows = idx.tolist()
        on_dev = idx.to(self.rewards.device)  # every score lives on the rollout's device
        return dataclasses.replace(
            self,
            rollout=select_rows(self.rollout, idx),
            rows=[self.rows[i] for i in rows],
            texts=[self.texts[i] for i in rows],
            rewards=self.rewards[on_dev],
            token_rewards=self.token_rewards[on_dev],
            per_fn={k: v[on_dev] for k, v in self.per_fn.items()},
            extras={k: v[on_dev] for k, v in self.extras.items()},
        )


def cat_batches(batches: Sequence[RolloutBatch], pad_id: int) -> RolloutBatch:
    """Concatenate rollout batches (maybe of different prompt widths and completion lengths:
    prompts are left-padded, completions and token rewards right-padded); the first one's
    policy_version and frac_zero_std are kept."""
    if len(batches) == 1:
        return batches[0]
    rollout = cat_rollouts([b.rollout for b in batches], pad_id)
    T_c = rollout.completion_ids.shape[1]
    first = batches[0]
    widths = [(0, T_c - b.token_rewards.shape[1]) for b in batches]
    return dataclasses.replace(
        first,
        rollout=rollout,
        rows=[r for b in batches for r in b.rows],
        texts=[t for b in batches for t in b.texts],
        rewards=torch.cat([b.rewards for b in batches]),
        token_rewards=torch.cat(
            [torch.nn.functional.pad(b.token_rewards, w) for b, w in zip(batches, widths)]
        ),
        per_fn={k: torch.cat([b.per_fn[k] for b in batches]) for k in first.per_fn},
        extras={k: _cat_rows([b.extras[k] for b in batches]) for k in first.extras},
    )


def _cat_rows(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per-row tensors of several batches: (B_i,) concatenated, (B_i, T_i) right-padded with
    zeros to the longest T first."""
    if parts[0].dim() == 1:
        return torch.cat(parts)
    T = max(p.shape[1] for p in parts)
    return torch.cat([torch.nn.functional.pad(p, (0, T - p.shape[1])) for p in parts])


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch of a step: `rows` of the batch, and the column range [lo, hi) of
    prompt + completion that holds all their real tokens (`column_bounds`); with sequence
    packing (train.pack_sequences) `packed`, its rows on one token axis (`pack_rows`)."""

    rows: slice
    cols: tuple[int, int]
    packed: PackedRows | None = None


@dataclass(frozen=True)
class UpdateBatch:
    """What the update phase reads; all (B, T_c) tensors on the rollout's device.

    Attributes:
        rollout: the sampled tokens; `rollout.logprobs` are the behaviour (sampler's) log-probs.
        counted_mask: bool, the tokens the loss counts: the generated ones, minus truncated
            rows under loss.mask_truncated_completions (`counted_mask`).
        advantages: float32 advantage of each token.
        plan: the micro-batches (`micro_batch_plan`), shared by every log-prob pass of a step.
        ref_logprobs: the reference policy's log-probs, when the step computed them.
        old_logprobs: pi_old as the trainer recomputed it (loss.old_logprobs: recompute or
            loss.tis_cap); None: the sampler's are pi_old.
        metrics: what the phases before the update reported (the estimator's
            ``advantage/<name>``), logged with the step's metrics.
        extras: named per-row tensors, (B,) or (B, T_c), for the policy loss (its `extras`
            input, sliced to each micro-batch's rows): the rollout batch's (a rollout
            strategy's, a trained module's, e.g. ``replayed`` (B,) bool,
            which also splits the importance weights' stats by row kind) and those the estimator
            returned, computed over the global batch.
    """

    rollout: Rollout
    counted_mask: torch.Tensor
    advantages: torch.Tensor
    plan: tuple[MicroBatch, ...]
    ref_logprobs: torch.Tensor | None = None
    old_logprobs: torch.Tensor | None = None
    metrics: dict = dataclasses.field(default_factory=dict)
    extras: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)


def counted_mask(rollout: Rollout, mask_truncated: bool) -> torch.Tensor:
    """(B, T_c) bool: the generated tokens, minus the rows cut at the length limit when
    `mask_truncated` (loss.mask_truncated_completions). A new tensor."""
    mask = rollout.generated_mask.clone()
    if mask_truncated:
        mask &= rollout.finished[:, None]
    return mask


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


MULTI_TURN_FIELDS = ("turn_ids", "turn_rewards", "turn_texts", "infos")


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
        generated_mask=r.generated_mask[idx] if r.multi_turn else None,
        **{k: pick(getattr(r, k)) for k in MULTI_TURN_FIELDS},
    )


def cat_rollouts(pieces: Sequence[Rollout], pad_id: int) -> Rollout:
    """Concatenate rollout pieces of (maybe) different prompt widths and completion lengths."""
    if len(pieces) == 1:
        return pieces[0]
    T_p = max(p.prompt_width for p in pieces)
    T_c = max(p.completion_ids.shape[1] for p in pieces)

    def pad(x, left, right, value):
        return torch.nn.functional.pad(x, (left, right), value=value)

    ids, cids, cmask, lps = [], [], [], []
    multi = pieces[0].multi_turn
    gmask, tids = [], []
    for p in pieces:
        dl, dr = T_p - p.prompt_width, T_c - p.completion_ids.shape[1]
        cids.append(pad(p.completion_ids, 0, dr, pad_id))
        ids.append(torch.cat([pad(p.prompt_ids, dl, 0, pad_id), cids[-1]], 1))
        cmask.append(pad(p.completion_mask, 0, dr, False))
        lps.append(pad(p.logprobs, 0, dr, 0.0))
        if multi:
            gmask.append(pad(p.generated_mask, 0, dr, False))
            tids.append(pad(p.turn_ids, 0, dr, -1))
    extra = {}
    if multi:
        extra = {"generated_mask": torch.cat(gmask), "turn_ids": torch.cat(tids)}
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


def turn_token_rewards(rewards: torch.Tensor, r: Rollout, gamma: float) -> torch.Tensor:
    """(B, T_c) token rewards of multi-turn trajectories: each turn's step reward r_k on the
    last generated token of turn k, scaled by gamma^k, and the trajectory reward R on the last
    generated token, scaled by gamma^(K-1) (K turns), so a row sums to its discounted return
    sum_k gamma^k r_k + gamma^(K-1) R. Per-token trajectory rewards (B, T_c) are added as is."""
    generated = r.generated_mask
    token = rewards.float().clone() if rewards.dim() == 2 else torch.zeros(generated.shape)
    token = token.to(generated.device)
    cols = torch.arange(generated.shape[1], device=generated.device)
    for b, steps in enumerate(r.turn_rewards):
        for k, value in enumerate(steps):
            here = generated[b] & (r.turn_ids[b] == k)
            if value and here.any():
                token[b, int(cols[here].max())] += gamma**k * value
        if rewards.dim() == 1 and generated[b].any():
            K = max(len(steps), 1)
            token[b, int(cols[generated[b]].max())] += gamma ** (K - 1) * float(rewards[b])
    return token


def outcome_token_rewards(rewards: torch.Tensor, completion_mask: torch.Tensor) -> torch.Tensor:
    """(B,) sequence rewards -> (B, T_c) token rewards: each on its row's last completion token."""
    B, T = completion_mask.shape
    out = torch.zeros(B, T, dtype=torch.float32, device=completion_mask.device)
    if T == 0:
        return out
    last = (completion_mask.long().sum(-1) - 1).clamp(min=0)  # (B,)
    return out.scatter(1, last[:, None], rewards.float().to(out.device)[:, None])


def micro_batches(B: int, size: int):
    for start in range(0, B, size):
        yield slice(start, min(B, start + size))


def micro_batch_plan(
    rollout: Rollout,
    size: int,
    scored: torch.Tensor | None = None,
    pack: bool = False,
    group_size: int | None = None,
    max_tokens: int | None = None,
    overhead: int = 1024,
    dist: Dist = SINGLE,
) -> tuple[MicroBatch, ...]:
    """The micro-batches of a rollout.

    Padded (`pack` False): slices of `size` rows, each with its column range
    (`column_bounds`; one host sync for all of them). Packed: each micro-batch's rows packed on
    one token axis (`pack_rows`; the attention mask read on the host once), scoring `scored`
    (B, T_c) (the counted tokens); with `max_tokens` (train.micro_batch_tokens) the rows (whole
    groups of `group_size` when the prompt is shared) are cut into consecutive micro-batches
    of at most that many real tokens, as even as they can be (`token_slices`), as many on every
    rank of `dist` as the rank that needs the most (one all-reduce), so that FSDP's per-block
    collectives pair up.
    """
    B = rollout.ids.shape[0]
    if not pack:
        slices = list(micro_batches(B, size))
        bounds = column_bounds(rollout.attention_mask(), slices, rollout.prompt_width)
        return tuple(MicroBatch(sl, cols) for sl, cols in zip(slices, bounds))
    attn = rollout.attention_mask().cpu()
    T_p, T = rollout.prompt_width, rollout.ids.shape[1]
    if scored is None:
        scored = rollout.generated_mask
    scored = scored.cpu()
    if max_tokens is None:
        slices = list(micro_batches(B, size))
    else:
        unit = group_size or 1
        costs = unit_tokens(attn, T_p, group_size)
        count = int(all_reduce_max(micro_batch_count(costs, max_tokens), dist))
        what = "row" if unit == 1 else "group"
        cuts = token_slices(costs, max_tokens, count, what)
        slices = [slice(a.start * unit, a.stop * unit) for a in cuts]
    dev = rollout.ids.device
    return tuple(
        MicroBatch(sl, (0, T), pack_rows(attn[sl], T_p, scored[sl], group_size, overhead, dev))
        for sl in slices
    )


def unit_tokens(attention_mask: torch.Tensor, prompt_width: int, group_size: int | None):
    """The real tokens a packed forward runs per row, or per group of `group_size` rows when
    the group's prompt runs once (prompt + its G completions). A list of ints."""
    real = attention_mask.bool()
    if group_size is None:
        return real.sum(1).tolist()
    G, w = group_size, prompt_width
    prompts = real[::G, :w].sum(1)  # (P,)
    completions = real[:, w:].sum(1).view(-1, G).sum(1)  # (P,)
    return (prompts + completions).tolist()


def micro_batch_count(costs: Sequence[int], max_tokens: int) -> int:
    """The fewest consecutive micro-batches of at most `max_tokens` tokens (a unit longer than
    that is a micro-batch of its own)."""
    return len(_fill(costs, max_tokens))


def _fill(costs: Sequence[int], cap: int) -> list[list[int]]:
    """Units in order into consecutive parts of at most `cap` tokens, each as full as it can
    be (a unit over `cap` alone): the fewest parts under that cap."""
    parts: list[list[int]] = []
    filled = cap + 1
    for i, c in enumerate(costs):
        if filled + c > cap or c > cap:
            parts.append([i])
            filled = c
        else:
            parts[-1].append(i)
            filled += c
    return parts


def token_slices(
    costs: Sequence[int], max_tokens: int, count: int | None = None, unit: str = "row"
) -> list[slice]:
    """Consecutive slices of units (rows or groups) of `costs` tokens each: `count` of them
    (default: the fewest, `micro_batch_count`), the largest as small as it can be and none
    over `max_tokens` but a unit that alone exceeds it (said in one log line per step).

    The smallest cap X <= max_tokens that a greedy fill splits into at most `count` slices is
    found by bisection; slices are then split further (the one of most tokens first) until
    there are `count`. `count` may not exceed the number of units."""
    n = len(costs)
    if count is None:
        count = micro_batch_count(costs, max_tokens)
    if not 1 <= count <= n:
        raise ValueError(f"cannot cut {n} {unit}s into {count} micro-batches")
    longest = max(costs)
    if longest > max_tokens:
        log.info(
            "a %s of %d tokens exceeds train.micro_batch_tokens (%d): it runs as a "
            "micro-batch of its own",
            unit,
            longest,
            max_tokens,
        )

    lo, hi = 1, max_tokens  # _fill(max_tokens) has the fewest slices, <= count
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if len(_fill(costs, mid)) <= count else (mid + 1, hi)
    parts = _fill(costs, lo)
    while len(parts) < count:  # split the part of most tokens (of two units or more) in two
        i = max(
            (j for j in range(len(parts)) if len(parts[j]) > 1),
            key=lambda j: sum(costs[u] for u in parts[j]),
        )
        part = parts[i]
        before = np.cumsum([costs[u] for u in part])  # tokens up to and including each unit
        cut = 1 + int(np.argmin(np.abs(2 * before[:-1] - before[-1])))  # nearest to half
        parts[i : i + 1] = [part[:cut], part[cut:]]
    return [slice(p[0], p[-1] + 1) for p in parts]


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
    return [
        (min(flat[2 * i], prompt_width - 1), max(flat[2 * i + 1] + 1, prompt_width + 1))
        for i in range(len(slices))
    ]

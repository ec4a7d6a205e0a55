"""Completion log-probs of a model on a rollout, as the trainer computes them: the step's
micro-batch plan (padded by train.micro_batch_size, or packed on one token axis under
train.pack_sequences / train.micro_batch_tokens, each group's prompt once under
train.shared_prefix), the policy's precision (autocast, head precision) and its log-prob kernel
(model.logprob_impl). The trainer's passes (reference, pi_old, the update: grpo.train.grpo) and
the frozen scorers (a teacher's log-probs: grpo.modules.teacher) all score through here, so a
teacher's numbers are computed the way the policy's are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from grpo.algo.logprobs import CompletionLogprobs
from grpo.distributed import SINGLE
from grpo.experience.batch import MicroBatch, micro_batch_plan
from grpo.models.packed_rows import packed_overhead
from grpo.models.varlen import packs_sequences
from grpo.rollout import Rollout

if TYPE_CHECKING:
    from grpo.config import Config
    from grpo.policy import Policy


def step_plan(cfg: Config, policy: Policy, rollout: Rollout, mask: torch.Tensor, dist=SINGLE):
    """The step's micro-batches (`micro_batch_plan`): packed when train.pack_sequences says so
    (by train.micro_batch_tokens when set, as many on every rank), else padded, by
    train.micro_batch_size rows."""
    t = cfg.train
    size = t.micro_batch_size or t.batch_size
    if not packs_sequences(t.pack_sequences, rollout.ids.device, t.micro_batch_tokens):
        return micro_batch_plan(rollout, size)
    return micro_batch_plan(
        rollout,
        size,
        mask,
        pack=True,
        group_size=cfg.shared_prefix_groups,
        max_tokens=cfg.train.micro_batch_tokens,
        overhead=packed_overhead(policy.model),
        dist=dist,
    )


def micro_logprobs(
    cfg: Config,
    scorer,
    rollout: Rollout,
    mask: torch.Tensor,
    mb: MicroBatch,
    entropy: bool = False,
    entropy_grad: bool = False,
):
    """A micro-batch's completion log-probs (mb, T_c) through `scorer` (a CompletionLogprobs,
    maybe DDP), computed over the columns `mb.cols` that hold its real tokens and only at the
    counted tokens of `mask` (B, T_c), zero-padded back to T_c; with `entropy`, also the
    entropies."""
    r, sl = rollout, mb.rows
    if mb.packed is not None:  # the rows on one token axis: (mb, T_c) out, as scored
        temperature = cfg.rollout.temperature or 1.0
        return scorer(
            r.ids[sl],
            None,
            r.prompt_width,
            None,
            temperature,
            return_entropy=entropy,
            entropy_grad=entropy_grad,
            packed=mb.packed,
        )
    lo, hi = mb.cols
    T_p, T_c = r.prompt_width, r.ids.shape[1] - r.prompt_width
    out = scorer(  # autocast as the policy's precision says (CompletionLogprobs)
        r.ids[sl, lo:hi],
        r.attention_mask()[sl, lo:hi],
        T_p - lo,
        mask[sl, : hi - T_p],
        cfg.rollout.temperature or 1.0,  # greedy rollouts are scored at T = 1
        return_entropy=entropy,
        entropy_grad=entropy_grad,
        has_holes=r.multi_turn,
        group_size=cfg.shared_prefix_groups,
    )
    pad = (0, T_c - (hi - T_p))  # the trimmed columns hold no scored token: 0 there
    if entropy:
        return tuple(torch.nn.functional.pad(t, pad) for t in out)
    return torch.nn.functional.pad(out, pad)


@dataclass(frozen=True)
class Scoring:
    """The trainer's way of scoring completions, for a module (a factory's ``scoring`` input,
    grpo.modules.module_set): the run's config, its policy (whose precision and log-prob kernel
    every model scored here runs under) and its ranks (a packed plan under
    train.micro_batch_tokens has as many micro-batches on every rank: one all-reduce, so every
    rank calls `logprobs` at the same point of the step).
    """

    cfg: Any  # the run's Config
    policy: Any  # the grpo.policy.Policy
    dist: Any = SINGLE

    def plan(self, rollout: Rollout, mask: torch.Tensor) -> tuple[MicroBatch, ...]:
        """The step's micro-batches for `rollout`, scoring `mask` (B, T_c): `step_plan`."""
        return step_plan(self.cfg, self.policy, rollout, mask, self.dist)

    @torch.no_grad()
    def logprobs(
        self, model: torch.nn.Module, rollout: Rollout, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """log p_model(token) of the completion tokens (B, T_c) float32, at
        rollout.temperature (as the policy's), 0 off `mask` (default: the generated tokens),
        without gradient, in the policy's precision and through its log-prob kernel.

        Args:
            model: a `Decoder` over the policy's vocabulary (a teacher, a frozen copy).
            rollout: the step's rollout (this rank's rows).
            mask: (B, T_c) bool, the tokens to score.
        """
        mask = rollout.generated_mask if mask is None else mask
        scorer = CompletionLogprobs(model, self.policy.precision)
        plan = self.plan(rollout, mask)
        parts = [micro_logprobs(self.cfg, scorer, rollout, mask, mb) for mb in plan]
        return torch.where(mask, torch.cat(parts).float(), 0.0)


__all__ = ["Scoring", "micro_logprobs", "step_plan"]

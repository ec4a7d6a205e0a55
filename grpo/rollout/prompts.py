"""Prompt batching for rollouts: validate prompts and sampling settings, left-pad a batch.

Shared by the single-turn sampler (`grpo.rollout.sampler`) and multi-turn rollouts
(`grpo.rollout.multiturn`), and public for custom rollout loops built on `Sampler.prefill` /
`Sampler.decode`. Shapes: P prompts, T_p the padded prompt width, S cache slots.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from grpo.errors import GrpoError


def check_prompts(prompts, vocab_size: int) -> list[list[int]]:
    """Prompts as lists of ints; an empty list, an empty prompt or an id out of range is named.

    Args:
        prompts: P token-id sequences (lists, tuples or 1-D tensors), each non-empty.
        vocab_size: V; every id must lie in [0, V).

    Returns:
        P lists of ints (unpadded).

    Raises:
        GrpoError: no prompts, a tensor instead of a list, an empty prompt, or an id that is
            not an int in [0, V), naming the prompt's index.
    """
    if isinstance(prompts, torch.Tensor) or not isinstance(prompts, Sequence) or not prompts:
        raise GrpoError("prompts must be a non-empty list of token-id lists")
    out = []
    for i, p in enumerate(prompts):
        ids = p.tolist() if isinstance(p, torch.Tensor) else list(p)
        if not ids:
            raise GrpoError(f"prompt {i} is empty (every prompt needs at least one token)")
        if not all(isinstance(x, int) and 0 <= x < vocab_size for x in ids):
            raise GrpoError(f"prompt {i} has token ids outside [0, {vocab_size}) or non-integers")
        out.append(ids)
    return out


def check_settings(cfg, prompts, group_size, max_new_tokens, temperature, top_k, top_p, min_p):
    """One clear GrpoError per bad setting, naming it and the value expected.

    Args:
        cfg: the model config (reads `max_position_embeddings`).
        prompts: P token-id lists (as returned by `check_prompts`).
        group_size: G rows per prompt, >= 1.
        max_new_tokens: completion slots after the prompt, >= 1; each prompt plus these must
            fit in max_position_embeddings.
        temperature: >= 0 (0 = greedy).
        top_k: >= 0 (0 = off).
        top_p: in (0, 1].
        min_p: in [0, 1].

    Raises:
        GrpoError: the first bad setting, named with the value it got.
    """
    if group_size < 1:
        raise GrpoError(f"group_size must be >= 1, got {group_size}")
    if max_new_tokens < 1:
        raise GrpoError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if temperature < 0:
        raise GrpoError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if top_k < 0:
        raise GrpoError(f"top_k must be >= 0 (0 = off), got {top_k}")
    if not 0.0 < top_p <= 1.0:
        raise GrpoError(f"top_p must be in (0, 1], got {top_p}")
    if not 0.0 <= min_p <= 1.0:
        raise GrpoError(f"min_p must be in [0, 1], got {min_p}")
    ctx = cfg.max_position_embeddings
    if max_new_tokens >= ctx:
        raise GrpoError(
            f"max_new_tokens={max_new_tokens} does not fit in the model's context "
            f"(max_position_embeddings={ctx}, and a prompt needs at least one token)"
        )
    for i, p in enumerate(prompts):
        if len(p) + max_new_tokens > ctx:
            raise GrpoError(
                f"prompt {i} has {len(p)} tokens; with max_new_tokens={max_new_tokens} it needs "
                f"{len(p) + max_new_tokens} positions > max_position_embeddings={ctx}"
            )


def left_pad(
    prompts: list[list[int]], pad_id: int, new_slots: int, cfg, device, slot_multiple: int = 1
):
    """The P prompts left-padded, with the attention mask over every KV-cache slot.

    Args:
        prompts: P non-empty token-id lists (as returned by `check_prompts`).
        pad_id: the id of the left padding, in [0, V) (never used to build masks).
        new_slots: cache slots to open after the prompts (completion tokens, and in
            multi-turn rollouts observations too).
        cfg: the model config (reads `vocab_size`).
        device: where the returned tensors live.
        slot_multiple: round the slot count S up to a multiple of this (a compiled decode
            step then sees few distinct cache lengths).

    Returns:
        prompt_ids (P, T_p) long, left-padded with pad_id; prompt_lens (P,) long, real tokens
        per prompt; kv_mask (P, S) bool, True on real prompt tokens only, where
        S = T_p + new_slots rounded up to a multiple of `slot_multiple`.

    Raises:
        GrpoError: pad_id outside [0, V).
    """
    dev = device
    if not 0 <= pad_id < cfg.vocab_size:
        raise GrpoError(f"pad_id must be in [0, {cfg.vocab_size}), got {pad_id}")
    P, T_p = len(prompts), max(len(p) for p in prompts)
    prompt_ids = torch.full((P, T_p), pad_id, dtype=torch.long)
    for i, p in enumerate(prompts):
        prompt_ids[i, T_p - len(p) :] = torch.tensor(p, dtype=torch.long)
    prompt_lens = torch.tensor([len(p) for p in prompts], device=dev)  # (P,)
    S = -(-(T_p + new_slots) // slot_multiple) * slot_multiple  # slots past the last one
    kv_mask = torch.zeros(P, S, dtype=torch.bool, device=dev)  # written stay hidden (causal)
    kv_mask[:, :T_p] = torch.arange(T_p, device=dev) >= (T_p - prompt_lens)[:, None]
    return prompt_ids.to(dev), prompt_lens, kv_mask

"""Continuous refill within one sample call: at most S rows in flight, finished rows replaced.

A call of B = P*G rows decoded all at once runs as long as its longest row, every row to the
end (a stopped row keeps decoding until the batch stops). With `Sampler(max_rows=S)` and
B > S, S slots decode together; at each of the loop's host syncs (every `sync_every` steps)
the slots whose row drew a stop id (or its last token) take the next waiting rows: their
prompts are prefilled (each prompt once for the rows of it that join), the keys and values
copied into the freed slots (`RowKVCache.load`), their first tokens drawn from the prefill's
logits. At a realistic spread of lengths the call takes about sum(lengths) / S decode steps
instead of ceil(B / S) x the longest.

A row's tokens do not depend on its slot or on the rows beside it: its random numbers are its
own (`row_uniforms`, keyed by seed, row and step), its slot holds its prompt exactly as the
prefill laid it out (left-padded to the call's T_p, completions from slot T_p on), and the
mask hides the rest. So refill on and off give the same completions (tests/test_refill.py,
float64: identical tokens).

Host syncs: one per `sync_every` steps (which slots finished), as the plain loop. Runs eagerly
(the plain loop's compiled iteration keeps one cache layout; a refill changes the attended
length at each sync).
"""

from __future__ import annotations

from collections import deque

import torch

from grpo.models.kv_cache import RowKVCache
from grpo.rollout.sampling import next_tokens


def refill_loop(sampler, prompt_ids, kv_mask, G, uniforms, sampling, stops, max_rows):
    """Decode B = P*G rows through `max_rows` slots, refilling finished slots.

    Args:
        sampler: the `Sampler` (its `prefill`, `logits`, `_decode_step`, `sync_every`).
        prompt_ids: (P, T_p) left-padded prompts.
        kv_mask: (P, T_p) bool, True on real prompt tokens.
        G: rows per prompt; row b samples prompt b // G.
        uniforms: (B, T + sync_every) float64 per-row random numbers (`row_uniforms`).
        sampling: (temperature, top_k, top_p, min_p).
        stops: (n,) stop ids.
        max_rows: S, the slots decoding together.

    Returns:
        tokens (B, T) long, logprobs (B, T) float32, done (B,) bool (the row drew a stop id)
        with T = uniforms.shape[1] - sync_every, the call's max_new_tokens.
    """
    P, T_p = prompt_ids.shape
    B, width = uniforms.shape
    k = sampler.sync_every
    T = width - k
    S = min(max_rows, B)
    dev = prompt_ids.device
    model = sampler.model
    # one extra row (B) takes what idle slots draw; k extra columns what a finished row draws
    # until the next sync frees its slot
    out_tok = torch.zeros(B + 1, width, dtype=torch.long, device=dev)
    out_lp = torch.zeros(B + 1, width, device=dev)
    uniforms = torch.cat([uniforms, uniforms.new_zeros(1, width)])  # (B + 1, width)
    cache = RowKVCache.for_model(model, S, T_p + width, sampler.precision.kv_dtype)
    mask = sampler.decode_mask(torch.zeros(S, T_p + width, dtype=torch.bool, device=dev))
    row_of = torch.full((S,), B, dtype=torch.long, device=dev)  # (S,) the row in each slot
    step_of = torch.zeros(S, dtype=torch.long, device=dev)  # (S,) its next column
    last = torch.zeros(S, 1, dtype=torch.long, device=dev)  # (S, 1) the tokens to feed
    positions = torch.zeros(S, 1, dtype=torch.long, device=dev)  # (S, 1) their positions
    finished = torch.ones(S, dtype=torch.bool, device=dev)  # (S,) the slot is free
    slots_rows = [B] * S  # host: the row in each slot (B = none)
    steps_host = [0] * S  # host: columns drawn by each slot's row
    waiting = deque(range(B))
    prompt_lens = kv_mask.sum(-1)  # (P,)
    cols = torch.arange(mask.shape[-1], device=dev)

    def fill(slots: list[int]) -> None:
        rows = [waiting.popleft() for _ in slots[: len(waiting)]]
        idle = slots[len(rows) :]
        slots = slots[: len(rows)]
        if idle:  # nothing left to run: these slots start over and are never read
            cache.reset(idle)
            idle_t = torch.tensor(idle, device=dev)
            row_of[idle_t], step_of[idle_t] = B, 0
            for s in idle:
                slots_rows[s], steps_host[s] = B, 0
        if not rows:
            return
        prompts = sorted({r // G for r in rows})
        p_idx = torch.tensor(prompts, device=dev)
        logits, prefix = sampler.prefill(prompt_ids[p_idx], kv_mask[p_idx], 1)  # (P', V)
        which = torch.tensor([prompts.index(r // G) for r in rows], device=dev)
        cache.load(slots, prefix, which, T_p)
        s_idx, r_idx = torch.tensor(slots, device=dev), torch.tensor(rows, device=dev)
        # each newcomer's first token, from its prompt's logits and its own uniform of step 0
        u = uniforms[r_idx, 0]
        tok, lp = next_tokens(logits.index_select(0, which), None, *sampling, uniforms=u)
        out_tok[r_idx, 0], out_lp[r_idx, 0] = tok, lp
        real = kv_mask[p_idx].index_select(0, which)  # (n, T_p)
        fresh = torch.full((len(rows), mask.shape[-1]), float("-inf"), dtype=mask.dtype,
                           device=dev)  # fmt: skip
        fresh[:, :T_p].masked_fill_(real, 0.0)
        mask[s_idx, 0, 0] = fresh
        row_of[s_idx], step_of[s_idx] = r_idx, 1
        last[s_idx, 0] = tok
        positions[s_idx, 0] = prompt_lens[p_idx].index_select(0, which)
        finished[s_idx] = torch.isin(tok, stops) | (T <= 1)
        for s, r in zip(slots, rows):
            slots_rows[s], steps_host[s] = r, 1

    fill(list(range(S)))
    while True:
        # the loop's only host sync: which slots are free (a stop drawn, or T tokens)
        free = [s for s, f in enumerate(finished.tolist()) if f or steps_host[s] >= T]
        if waiting and free:
            fill(free)
        elif not waiting and len(free) == S:
            break
        elif not waiting:
            fill([s for s in free if slots_rows[s] != B])  # finished rows' slots go idle
        for _ in range(k):
            # open the slot each row writes now (before the forward attends over it)
            mask[:, 0, 0].masked_fill_(cols[None, :] == cache.lens[:, None], 0.0)
            logits = sampler._decode_step(last, positions, mask, cache)  # (S, V)
            u = uniforms[row_of, step_of]  # (S,) each row's own number of this step
            tok, lp = next_tokens(logits, None, *sampling, uniforms=u)
            out_tok[row_of, step_of], out_lp[row_of, step_of] = tok, lp
            finished |= torch.isin(tok, stops) | (step_of + 1 >= T)
            last[:, 0] = tok
            positions += 1
            step_of += 1
            steps_host = [n + 1 for n in steps_host]
    tokens = out_tok[:B, :T]
    return tokens, out_lp[:B, :T], torch.isin(tokens, stops).any(dim=1)

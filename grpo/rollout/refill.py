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

The decode step (`refill_step`) reads and writes device tensors only, the same S rows every
step: a compiled sampler compiles it whole (one graph per token, no recompile as rows come
and go; the attended length is bucketed by 64 slots). Host syncs: one per `sync_every` steps
(which slots finished), as the plain loop.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass

import torch

from grpo.models.kv_cache import RowKVCache
from grpo.rollout.sampling import next_tokens


@dataclass
class RefillState:
    """What one refill decode step reads and writes: S slots, B rows, W columns per row."""

    out_tok: torch.Tensor  # (B + 1, W) long; row B takes what idle slots draw
    out_lp: torch.Tensor  # (B + 1, W) float32
    uniforms: torch.Tensor  # (B + 1, W) float64, each row's random numbers
    mask: torch.Tensor  # (S, 1, 1, L) additive mask over each slot's cache positions
    row_of: torch.Tensor  # (S,) long, the row in each slot (B: none)
    step_of: torch.Tensor  # (S,) long, its next column
    last: torch.Tensor  # (S, 1) long, the tokens to feed
    positions: torch.Tensor  # (S, 1) long, their rotary positions
    finished: torch.Tensor  # (S,) bool, the slot's row drew a stop id or its last token
    cols: torch.Tensor  # (L,) long, 0 .. L-1
    stops: torch.Tensor  # (n,) long, stop ids
    T: torch.Tensor  # () long, max_new_tokens

    def tensors(self) -> list[torch.Tensor]:
        return [getattr(self, f.name) for f in dataclasses.fields(self)]


def refill_step(sampler, st: RefillState, cache: RowKVCache, sampling) -> None:
    """One decode step of every slot on device tensors only: open the slot each row writes,
    the last tokens through the model, the next ones drawn with each row's own uniform of its
    own step and written at (row, step); stop test and counters advanced in place."""
    st.mask[:, 0, 0].masked_fill_(st.cols[None, :] == cache.lens[:, None], 0.0)
    logits = sampler._decode_step(st.last, st.positions, st.mask, cache)  # (S, V)
    u = st.uniforms[st.row_of, st.step_of]  # (S,)
    tok, lp = next_tokens(logits, None, *sampling, uniforms=u)
    st.out_tok[st.row_of, st.step_of] = tok
    st.out_lp[st.row_of, st.step_of] = lp
    st.finished |= torch.isin(tok, st.stops) | (st.step_of + 1 >= st.T)
    st.last.copy_(tok[:, None])
    st.positions.add_(1)
    st.step_of.add_(1)


def refill_loop(
    sampler, prompt_ids, kv_mask, G, uniforms, sampling, stops, max_rows, step, prepare
):
    """Decode B = P*G rows through `max_rows` slots, refilling finished slots.

    Args:
        sampler: the `Sampler` (its `prefill`, `decode_mask`, `_bound`, `sync_every`).
        prompt_ids: (P, T_p) left-padded prompts.
        kv_mask: (P, T_p) bool, True on real prompt tokens.
        G: rows per prompt; row b samples prompt b // G.
        uniforms: (B, T + sync_every) float64 per-row random numbers (`row_uniforms`).
        sampling: (temperature, top_k, top_p, min_p).
        stops: (n,) stop ids.
        max_rows: S, the slots decoding together.
        step: (state, cache) -> None, runs `refill_step` (compiled or not).
        prepare: (state, cache) -> None, called once on the call's new tensors.

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
    L = T_p + width  # a row's prompt, its tokens and up to k - 1 drawn after it finished
    cache = RowKVCache.for_model(sampler.model, S, L, sampler.precision.kv_dtype)
    st = RefillState(
        out_tok=torch.zeros(B + 1, width, dtype=torch.long, device=dev),
        out_lp=torch.zeros(B + 1, width, device=dev),
        uniforms=torch.cat([uniforms, uniforms.new_zeros(1, width)]),
        mask=sampler.decode_mask(torch.zeros(S, L, dtype=torch.bool, device=dev)),
        row_of=torch.full((S,), B, dtype=torch.long, device=dev),
        step_of=torch.zeros(S, dtype=torch.long, device=dev),
        last=torch.zeros(S, 1, dtype=torch.long, device=dev),
        positions=torch.zeros(S, 1, dtype=torch.long, device=dev),
        finished=torch.ones(S, dtype=torch.bool, device=dev),
        cols=torch.arange(L, device=dev),
        stops=stops,
        T=torch.tensor(T, device=dev),
    )
    prepare(st, cache)
    lens = [0] * S  # host: each slot's written length (cache.lens, counted without syncs)
    in_slot = [B] * S  # host: the row in each slot (B = none)
    waiting = deque(range(B))
    prompt_lens = kv_mask.sum(-1)  # (P,)

    def fill(slots: list[int]) -> None:
        """The next waiting rows into `slots` (prefilled, first token drawn); slots left
        over go idle (start over at 0; what they compute is never read)."""
        rows = [waiting.popleft() for _ in slots[: len(waiting)]]
        idle, slots = slots[len(rows) :], slots[: len(rows)]
        if idle:
            i = torch.tensor(idle, device=dev)
            cache.lens[i], st.row_of[i], st.step_of[i] = 0, B, 0
            for s in idle:
                lens[s], in_slot[s] = 0, B
        if not rows:
            return
        prompts = sorted({r // G for r in rows})
        p_idx = torch.tensor(prompts, device=dev)
        logits, prefix = sampler.prefill(prompt_ids[p_idx], kv_mask[p_idx], 1)  # (P', V)
        which = torch.tensor([prompts.index(r // G) for r in rows], device=dev)
        s_idx, r_idx = torch.tensor(slots, device=dev), torch.tensor(rows, device=dev)
        cache.load(s_idx, prefix, which, T_p)
        # each newcomer's first token, from its prompt's logits and its own uniform of step 0
        tok, lp = next_tokens(
            logits.index_select(0, which), None, *sampling, uniforms=st.uniforms[r_idx, 0]
        )
        st.out_tok[r_idx, 0], st.out_lp[r_idx, 0] = tok, lp
        fresh = torch.full((len(rows), L), float("-inf"), dtype=st.mask.dtype, device=dev)
        fresh[:, :T_p].masked_fill_(kv_mask[p_idx].index_select(0, which), 0.0)
        st.mask[s_idx, 0, 0] = fresh
        st.row_of[s_idx], st.step_of[s_idx] = r_idx, 1
        st.last[s_idx, 0] = tok
        st.positions[s_idx, 0] = prompt_lens[p_idx].index_select(0, which)
        st.finished[s_idx] = torch.isin(tok, stops) | (T <= 1)
        for s, r in zip(slots, rows):
            lens[s], in_slot[s] = T_p, r

    fill(list(range(S)))
    while True:
        # the loop's only host sync: which slots are free (a stop drawn, or T tokens)
        free = [s for s, f in enumerate(st.finished.tolist()) if f]
        if len(free) == S and not waiting:
            break
        if waiting:
            fill(free)
        else:  # finished rows' slots go idle
            fill([s for s in free if in_slot[s] != B])
        for _ in range(k):
            # attend over the longest slot's written positions + the one written now, bucketed
            # as the plain loop's static cache (a compiled step sees a handful of lengths)
            sampler._bound(cache, max(lens) + 1)
            step(st, cache)
            lens = [n + 1 for n in lens]
    tokens = st.out_tok[:B, :T]
    return tokens, st.out_lp[:B, :T], torch.isin(tokens, stops).any(dim=1)

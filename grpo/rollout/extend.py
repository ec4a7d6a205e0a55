"""Continue generation from prompts plus partial completions (tree rollouts, branching).

`extend` runs the sampler on each prompt followed by its partial completion: each context is
prefilled once for its G rows, as `Sampler.sample` does, and every row draws from its own
seeded stream. The partial tokens are either the rollout's context (the default: they join
the prompt region, and `completion_mask` covers only what was generated) or part of its
completion (`include_partial=True`: the completion region is partial + continuation, every
token counted, the partial's log-probs computed by one more forward of the contexts).

Shapes: N contexts (prompt + partial), G continuations each, B = N*G rows, T_p the padded
prompt width, T_c the completion width, M the longest partial.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from grpo.errors import GrpoError
from grpo.rollout.prompts import check_prompts
from grpo.rollout.sampler import Rollout, Sampler


def check_partials(
    prompts: list[list[int]],
    partials,
    max_new_tokens: int,
    stop_ids: Sequence[int],
    vocab_size: int,
    ctx: int,
) -> list[list[int]]:
    """The partial completions as lists of ints, each checked against its prompt.

    Raises:
        GrpoError: one line naming the partial (its index) and what was expected: a count
            other than one per prompt, an id outside [0, V), a stop id (a stopped completion
            cannot go on), no budget left to generate, or no room in the model's context
            (every row decodes the steps of the shortest partial's budget).
    """
    if isinstance(partials, torch.Tensor) or not isinstance(partials, Sequence):
        raise GrpoError("extend: partials must be a list of token-id lists, one per prompt")
    if len(partials) != len(prompts):
        raise GrpoError(
            f"extend: {len(partials)} partial completions for {len(prompts)} prompts; give one "
            "per prompt (repeat a prompt to branch it from several partials)"
        )
    stops = set(stop_ids)
    out = []
    for i, q in enumerate(partials):
        if isinstance(q, str) or not isinstance(q, (Sequence, torch.Tensor)):
            raise GrpoError(f"extend: partial {i} is {type(q).__name__}, not a token-id list")
        ids = q.tolist() if isinstance(q, torch.Tensor) else list(q)
        if not all(isinstance(x, int) and 0 <= x < vocab_size for x in ids):
            raise GrpoError(
                f"extend: partial {i} has token ids outside [0, {vocab_size}) or non-integers"
            )
        if len(ids) >= max_new_tokens:
            raise GrpoError(
                f"extend: partial {i} has {len(ids)} tokens; max_new_tokens={max_new_tokens} "
                "(the whole completion's budget, partial included) leaves none to generate"
            )
        hit = next((j for j, x in enumerate(ids) if x in stops), None)
        if hit is not None:
            raise GrpoError(
                f"extend: partial {i} has the stop id {ids[hit]} at position {hit}; a stopped "
                "completion cannot be continued (cut it before its stop token)"
            )
        out.append(ids)
    # every row decodes as many steps as the row with the shortest partial may take
    steps = max_new_tokens - min(map(len, out))
    for i, (p, q) in enumerate(zip(prompts, out)):
        if len(p) + len(q) + steps > ctx:
            raise GrpoError(
                f"extend: prompt {i} and its partial ({len(p)} + {len(q)} tokens, then up to "
                f"{steps} decode steps) need {len(p) + len(q) + steps} positions > "
                f"max_position_embeddings={ctx}"
            )
    return out


def extend(
    sampler: Sampler,
    prompts: Sequence[Sequence[int]],
    partials: Sequence[Sequence[int]],
    *,
    group_size: int,
    max_new_tokens: int,
    stop_ids: Sequence[int],
    seed: int,
    include_partial: bool = False,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    pad_id: int = 0,
) -> Rollout:
    """`group_size` continuations of each prompt + partial completion, as one `Rollout`.

    Each context (prompt i followed by partial i) is prefilled once and decoded for its G
    rows by `sampler.sample` (eager, compiled, refilled or LoRA alike: whatever the sampler
    does), with the same seed giving the same rollout bitwise; an empty partial is a plain
    sample of its prompt. `max_new_tokens` is the budget of the whole completion, partial
    included (as `rollout.max_new_tokens` bounds a plain sample): row b generates at most
    max_new_tokens - len(partial) tokens, so a branch is never longer than a sample. The
    log-probs of generated tokens are the sampler's (what the trainer recomputes, at the
    sampling temperature; temperature 0: at 1).

    Args:
        sampler: the sampler over the policy's model.
        prompts: N token-id lists (unpadded, each non-empty).
        partials: N token-id lists, partial i continuing prompt i (may be empty; no stop id;
            shorter than max_new_tokens). Branch a prompt k ways by repeating it.
        group_size: G continuations of each context.
        max_new_tokens: the completion budget, the partial counted.
        stop_ids: ids that end a completion (the stop token counts in the mask).
        seed: keys the rows' random streams (`row_uniforms`, row b of this call).
        include_partial: False: the partial is context: it sits in the prompt region
            (`prompt_lens` = prompt + partial), `completion_ids` hold only the continuation
            and `completion_mask` is True on the generated tokens only (the loss and the
            rewards see the continuation). True: the prompt region is the prompt and the
            completion region holds partial + continuation, every token in
            `completion_mask` (trained on, read by the rewards), the partial's log-probs
            computed through the model as the trainer does (one forward of the N contexts).
            With True, every row of prompt i shares its prompt region, so the rows of
            several partials of one prompt may form one group.
        temperature, top_k, top_p, min_p: sampling settings (see `Sampler.sample`).
        pad_id: the id of padding (never used to build masks).

    Returns:
        a `Rollout` of B = N*G rows, row b continuing context b // G, groups of G.
        completion_lens count the partial when `include_partial`; `finished` is False
        where a row reached its budget without a stop id.

    Raises:
        GrpoError: bad inputs, in one line (`check_partials`, and the sampler's checks).
    """
    cfg = sampler.model.config
    prompts = check_prompts(prompts, cfg.vocab_size)
    partials = check_partials(
        prompts, partials, max_new_tokens, stop_ids, cfg.vocab_size, cfg.max_position_embeddings
    )
    dev = sampler.model.device
    G = group_size
    m = torch.tensor([len(q) for q in partials], dtype=torch.long, device=dev)  # (N,)
    # decode for the row with the shortest partial; rows past their own budget are cut after
    # (a row's tokens never depend on what follows them, nor on the rows beside it)
    r = sampler.sample(
        [p + q for p, q in zip(prompts, partials)],
        group_size=G,
        max_new_tokens=max_new_tokens - int(m.min()),
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        stop_ids=stop_ids,
        seed=seed,
        pad_id=pad_id,
    )
    m_rows = m.repeat_interleave(G)  # (B,)
    budget = max_new_tokens - m_rows  # (B,) tokens each row may generate
    over = r.completion_lens > budget
    lens = torch.minimum(r.completion_lens, budget)  # (B,)
    finished = r.finished & ~over
    T_c = int(lens.max())
    mask = torch.arange(T_c, device=dev)[None, :] < lens[:, None]  # (B, T_c)
    new_ids = r.completion_ids[:, :T_c].masked_fill(~mask, pad_id)
    new_lps = r.logprobs[:, :T_c].masked_fill(~mask, 0.0)
    if not include_partial:
        return Rollout(
            ids=torch.cat([r.prompt_ids, new_ids], dim=1),
            prompt_lens=r.prompt_lens,
            prompt_width=r.prompt_width,
            completion_ids=new_ids,
            completion_mask=mask,
            completion_lens=lens,
            finished=finished,
            logprobs=new_lps,
            group_size=G,
        )
    # the prompt region: prompt i alone, left-padded; the completion: partial + continuation
    T_p = max(len(p) for p in prompts)
    M = int(m.max())
    prompt_ids = torch.full((len(prompts), T_p), pad_id, dtype=torch.long)
    partial_ids = torch.full((len(prompts), M), pad_id, dtype=torch.long)
    for i, (p, q) in enumerate(zip(prompts, partials)):
        prompt_ids[i, T_p - len(p) :] = torch.tensor(p, dtype=torch.long)
        partial_ids[i, : len(q)] = torch.tensor(q, dtype=torch.long)
    prompt_ids, partial_ids = prompt_ids.to(dev), partial_ids.to(dev)
    prompt_lens = torch.tensor([len(p) for p in prompts], device=dev)  # (N,)
    partial_lps = partial_logprobs(sampler, prompt_ids, prompt_lens, partial_ids, m, temperature)
    W = M + T_c
    ids = torch.full((len(m_rows), W), pad_id, dtype=torch.long, device=dev)  # (B, W)
    lps = torch.zeros(len(m_rows), W, device=dev)
    ids[:, :M] = partial_ids.repeat_interleave(G, dim=0)
    lps[:, :M] = partial_lps.repeat_interleave(G, dim=0)
    at = m_rows[:, None] + torch.arange(T_c, device=dev)[None, :]  # (B, T_c) continuation cols
    ids.scatter_(1, at, new_ids)  # overwrites the partial's right padding, never its tokens
    lps.scatter_(1, at, new_lps)
    total = m_rows + lens  # (B,)
    W = int(total.max())
    completion_mask = torch.arange(W, device=dev)[None, :] < total[:, None]  # (B, W)
    completion_ids = ids[:, :W].masked_fill(~completion_mask, pad_id)
    return Rollout(
        ids=torch.cat([prompt_ids.repeat_interleave(G, dim=0), completion_ids], dim=1),
        prompt_lens=prompt_lens.repeat_interleave(G),
        prompt_width=T_p,
        completion_ids=completion_ids,
        completion_mask=completion_mask,
        completion_lens=total,
        finished=finished,
        logprobs=lps[:, :W].masked_fill(~completion_mask, 0.0),
        group_size=G,
    )


def partial_logprobs(
    sampler: Sampler,
    prompt_ids: torch.Tensor,
    prompt_lens: torch.Tensor,
    partial_ids: torch.Tensor,
    partial_lens: torch.Tensor,
    temperature: float,
) -> torch.Tensor:
    """Log-probs of the partial completions' tokens under the sampler's model, as the trainer
    computes them: one forward of prompt + partial under the precision policy, the head in
    its precision (`Sampler.hidden_states`, `Sampler.logits`), log_softmax(logits / T)
    (T = 1 when greedy), the model in eval mode.

    Args:
        prompt_ids: (N, T_p) left-padded prompts.
        prompt_lens: (N,) real prompt tokens.
        partial_ids: (N, M) right-padded partials.
        partial_lens: (N,) real partial tokens.
        temperature: the sampling temperature (0: greedy).

    Returns:
        (N, M) float32 log-probs, 0 past each partial's length.
    """
    N, M = partial_ids.shape
    out = torch.zeros(N, M, device=partial_ids.device)
    if M == 0:
        return out
    T_p = prompt_ids.shape[1]
    cols = torch.arange(T_p + M, device=prompt_ids.device)[None, :]  # (1, T_p + M)
    attn = (cols >= (T_p - prompt_lens)[:, None]) & (cols < (T_p + partial_lens)[:, None])
    keep = torch.arange(M, device=partial_ids.device)[None, :] < partial_lens[:, None]  # (N, M)
    model = sampler.model
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            hidden = sampler.hidden_states(
                torch.cat([prompt_ids, partial_ids], dim=1), attention_mask=attn
            )  # (N, T_p + M, C)
            # position T_p - 1 + j predicts partial token j
            logits = sampler.logits(hidden[:, T_p - 1 : T_p - 1 + M][keep])  # (n, V) float32
    finally:
        model.train(was_training)
    scaled = logits if temperature in (0, 1) else logits / temperature
    lp = scaled.log_softmax(-1).gather(-1, partial_ids[keep][:, None])[:, 0]  # (n,)
    return out.masked_scatter(keep, lp)

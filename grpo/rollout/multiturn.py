"""Multi-turn rollouts with an environment: dataset rows -> prompts -> `Sampler.sample_turns`.

Each of the B = P*G trajectories gets its own environment (a group's G start from the same
row). After every model turn the environment's observation message is rendered as the chat
template's delta (`grpo.tokenizer.message_delta_ids`: the closing glue of the model's turn, the
message, the next assistant header) and appended token-in, token-out: earlier turns are never
re-tokenized. Observations longer than `max_obs_tokens` are cut (their content, not the
template's glue) and counted as env/obs_truncated.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from grpo.envs.base import Environment, check_step
from grpo.errors import GrpoError
from grpo.rollout.sampler import Observation, Rollout, Sampler
from grpo.tokenizer import message_delta_ids

TRUNCATION_MARK = " ...[truncated]"


def env_prompts(tokenizer, rows: Sequence[dict], envs: Sequence[Environment], G: int):
    """Start every environment; the prompt of each group: the row's own `prompt_ids`, or the
    rendering (with the environment's tools) of the messages its first environment returned."""
    prompts = []
    for p, row in enumerate(rows):
        messages = [envs[p * G + g].start(row) for g in range(G)][0]
        if messages is None:
            prompts.append(list(row["prompt_ids"]))
            continue
        kwargs = {"tools": envs[p * G].tools} if envs[p * G].tools else {}
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                             **kwargs)  # fmt: skip
        prompts.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return prompts


def sample_with_env(
    sampler: Sampler,
    tokenizer,
    rows: Sequence[dict],
    make_env: Callable[[], Environment],
    *,
    env_name: str,
    group_size: int,
    max_new_tokens: int,
    max_turns: int,
    max_total_tokens: int,
    max_obs_tokens: int,
    stop_ids: Sequence[int],
    turn_end_ids: Sequence[int] = (),
    seed: int,
    pad_id: int = 0,
    **sampling,
) -> Rollout:
    """G multi-turn trajectories for each of the P rows (see the module docstring).

    Args:
        sampler: the `Sampler` of the policy.
        tokenizer: its tokenizer (chat template for the observation deltas).
        rows: P dataset rows with `prompt_ids` (and whatever the environment reads).
        make_env: a zero-argument environment factory (`grpo.envs.env_factory`).
        env_name: for messages.
        group_size, max_new_tokens (per turn), max_turns, max_total_tokens, stop_ids,
            turn_end_ids, seed, pad_id, **sampling: as in `Sampler.sample_turns`.
        max_obs_tokens: most tokens of one observation message's content.

    Returns:
        the `Rollout`; `infos` also count obs_truncated.

    Raises:
        GrpoError: an environment that raises or returns the wrong type, named in one line.
    """
    G = group_size
    envs = [make_env() for _ in range(len(rows) * G)]
    tools = envs[0].tools or None if envs else None
    try:
        prompts = env_prompts(tokenizer, rows, envs, G)
    except GrpoError:
        raise
    except Exception as e:
        raise GrpoError(f"environment {env_name!r}: start() raised {type(e).__name__}: {e}") from e

    def observe(b: int, ids: list[int], stopped: bool) -> Observation:
        text = tokenizer.decode(ids, skip_special_tokens=False)
        try:
            step = envs[b].step(text, ids)
        except Exception as e:
            raise GrpoError(
                f"environment {env_name!r}: step() raised {type(e).__name__}: {e}"
            ) from e
        step = check_step(env_name, step)
        info = dict(step.info)
        if step.done or step.observation is None:
            return Observation([], step.reward, True, info)
        message = step.observation
        if isinstance(message, str):
            message = {"role": "tool", "content": message}
        content_ids = tokenizer(message["content"], add_special_tokens=False)["input_ids"]
        if len(content_ids) > max_obs_tokens:
            cut = tokenizer.decode(content_ids[:max_obs_tokens], skip_special_tokens=False)
            message = {**message, "content": cut + TRUNCATION_MARK}
            info["obs_truncated"] = info.get("obs_truncated", 0) + 1
        delta = message_delta_ids(tokenizer, message, after_stop=stopped, tools=tools)
        return Observation(delta, step.reward, False, info)

    return sampler.sample_turns(
        prompts,
        group_size=G,
        observe=observe,
        max_new_tokens=max_new_tokens,
        max_turns=max_turns,
        max_total_tokens=max_total_tokens,
        stop_ids=stop_ids,
        turn_end_ids=turn_end_ids,
        seed=seed,
        pad_id=pad_id,
        **sampling,
    )


def turn_end_ids(tokenizer, tokens: Sequence[str]) -> list[int]:
    """Ids of the given turn-ending token strings that are single tokens of this vocabulary
    (e.g. "</tool_call>" for Qwen3); the others are skipped (the stop id still ends a turn)."""
    out = []
    vocab = tokenizer.get_vocab()
    for t in tokens:
        if t in vocab:
            out.append(int(vocab[t]))
    return out


COUNTERS = ("tool_calls", "invalid_calls", "obs_truncated")


def env_metrics(r: Rollout) -> dict[str, float]:
    """Per-trajectory means of a multi-turn rollout (empty for a single-turn one): turns, tool
    calls, the invalid-call rate (over all calls), the fraction cut by a turn or token limit,
    the counters in COUNTERS, and the summed step reward. The keys are fixed (ranks all-reduce
    them)."""
    if r.turn_texts is None:
        return {}
    B = len(r.turn_texts)
    keys = COUNTERS
    totals = {k: sum(float(info.get(k, 0)) for info in r.infos) for k in keys}
    out = {
        "env/turns_mean": sum(len(t) for t in r.turn_texts) / B,
        "env/turn_limit_frac": float((~r.finished).float().mean()),
        "env/invalid_call_rate": totals["invalid_calls"] / max(totals["tool_calls"], 1.0),
        "env/step_reward_mean": sum(sum(x) for x in r.turn_rewards) / B,
    }
    out.update({f"env/{k}_mean": v / B for k, v in totals.items()})
    return out

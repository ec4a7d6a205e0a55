"""Multi-turn rollouts: `sample_turns` (turns and observations in one KV cache) and, with an
environment, `sample_with_env` (dataset rows -> prompts -> `sample_turns`).

Each of the B = P*G trajectories gets its own environment (a group's G start from the same
row). After every model turn the environment's observation message is rendered as the chat
template's delta (`grpo.tokenizer.message_delta_ids`: the closing glue of the model's turn, the
message, the next assistant header) and appended token-in, token-out: earlier turns are never
re-tokenized. The observation's content is plain text: a `<|im_start|>` it holds (a program
that prints one) is encoded as text, never as the template's tag. Observations longer than
`max_obs_tokens` are cut (their content, not the template's glue) and counted in each
trajectory's `obs_truncated` (only observations that entered the trajectory: the one answering
a turn cut by a limit is never appended). Each environment call runs under a time limit
(`EnvCalls`, rollout.env_timeout_s), so an environment that never returns cannot hang the
rollout.
`env_metrics` turns a rollout's bookkeeping into the per-step `env/*` metrics.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence

import torch

from grpo.envs.base import Environment, check_step
from grpo.errors import GrpoError
from grpo.rollout.prompts import check_prompts, check_settings, left_pad
from grpo.rollout.sampler import Observation, ObserveFn, Rollout, Sampler
from grpo.rollout.sampling import next_tokens
from grpo.tokenizer import encode_chat, message_delta_ids, plain_ids

TRUNCATION_MARK = " ...[truncated]"


def sample_turns(
    sampler: Sampler,
    prompts: Sequence[Sequence[int]],
    *,
    group_size: int,
    observe: ObserveFn,
    max_new_tokens: int,
    max_turns: int,
    max_total_tokens: int,
    stop_ids: Sequence[int],
    turn_end_ids: Sequence[int] = (),
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    seed: int,
    pad_id: int = 0,
) -> Rollout:
    """Multi-turn rollouts: model turn, observation, model turn, ... in one KV cache.

    All B rows share one cache slot pointer. A model turn decodes until every live row has
    ended its turn (a stop id, a turn-end id such as a tool call's closing token, or
    `max_new_tokens` for this turn); then `observe(row, turn_ids, stopped)` is called for
    each live row, and the returned ids are prefilled for all rows at once (rows append
    different lengths, or nothing). Slots a row does not use (it finished its turn early,
    or its observation is shorter) become holes: masked out of attention, skipped by the
    rotary positions, exactly as a training forward over the whole sequence sees them. So
    the sampler's log-prob of every generated token equals a fresh forward's.

    Built from the sampler's public steps only: `Sampler.prefill`, `Sampler.decode` (model
    turns), `Sampler.hidden_states` and `Sampler.logits` (observations).

    Args:
        sampler: the `Sampler` of the policy (compiled or eager).
        prompts: P token-id lists.
        group_size: G.
        observe: (row b, this turn's generated ids, ended on a stop id) -> `Observation`.
        max_new_tokens: tokens per model turn.
        max_turns: model turns per trajectory.
        max_total_tokens: completion-region slots (turns, observations and holes).
        stop_ids / turn_end_ids: ids that end a turn (a stop id also may end the trajectory:
            the environment decides through `done`).
        temperature, top_k, top_p, min_p, seed, pad_id: as in `sample`.

    Returns:
        a `Rollout` with `generated_mask` (the model's turns; `completion_mask` also covers the
        observations), `turn_ids`, `turn_rewards`, `turn_texts`, `infos`;
        `finished` is True for trajectories the environment ended (not cut by a limit).
    """
    model = sampler.model
    cfg = model.config
    prompts = check_prompts(prompts, cfg.vocab_size)
    check_settings(cfg, prompts, group_size, max_total_tokens, temperature, top_k, top_p, min_p)
    if max_turns < 1 or max_new_tokens < 1:
        raise GrpoError("max_turns and max_new_tokens must be >= 1")
    dev = model.device
    G = group_size
    prompt_ids, p_lens, kv_mask = left_pad(
        prompts, pad_id, max_total_tokens, cfg, dev, sampler.slot_multiple
    )
    T_p = prompt_ids.shape[1]
    gen = torch.Generator(device=dev).manual_seed(seed)
    stops = torch.tensor(sorted(set(stop_ids)), dtype=torch.long, device=dev)
    ends = torch.tensor(sorted(set(stop_ids) | set(turn_end_ids)), dtype=torch.long, device=dev)
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode(), sampler.packing():
            logits, cache = sampler.prefill(prompt_ids, kv_mask, G)
            out = _turn_loop(
                sampler,
                logits,
                cache,
                kv_mask.repeat_interleave(G, dim=0),
                p_lens.repeat_interleave(G),
                T_p,
                observe,
                max_new_tokens,
                max_turns,
                lambda lg: next_tokens(lg, gen, temperature, top_k, top_p, min_p),
                gen,
                stops,
                ends,
                pad_id,
                max_total_tokens,
            )
    finally:
        model.train(was_training)
    tokens, logprobs, exists, scored, turn_ids, finished, extra = out
    T_c = int(exists.any(0).nonzero().max()) + 1 if exists.any() else 1
    exists, scored = exists[:, :T_c].clone(), scored[:, :T_c].clone()
    completion_ids = tokens[:, :T_c].clone().masked_fill(~exists, pad_id)
    logprobs = logprobs[:, :T_c].clone().masked_fill(~scored, 0.0)
    cols = torch.arange(T_c, device=dev)
    lens = torch.where(exists, cols + 1, 0).amax(dim=1)  # (B,) up to the last real token
    return Rollout(
        ids=torch.cat([prompt_ids.repeat_interleave(G, dim=0), completion_ids], dim=1),
        prompt_lens=p_lens.repeat_interleave(G),
        prompt_width=T_p,
        completion_ids=completion_ids,
        completion_mask=exists,
        completion_lens=lens,
        finished=finished.clone(),
        logprobs=logprobs,
        group_size=G,
        generated_mask=scored,
        turn_ids=turn_ids[:, :T_c].clone(),
        **extra,
    )


def _turn_loop(
    sampler: Sampler,
    logits,
    cache,
    kv_mask,
    pos,
    T_p,
    observe,
    max_new_tokens,
    max_turns,
    draw,
    gen,
    stops,
    ends,
    pad_id,
    total,
):
    """The multi-turn decode/observe loop (see `sample_turns`). Column c of the completion
    region is cache slot T_p + c for every row; it has `total` columns (the cache may have
    more slots: a compiled sampler rounds its length up).

    Rows whose trajectory has ended leave the batch at the next turn boundary (their KV
    rows are dropped from the cache), so they stop costing decode work; with a compiled
    decode step the batch keeps its shape instead (no recompiles). `act` maps the cache's
    rows to trajectory rows (`rows` is the same on the host); `logits`, `cache`, `kv_mask`
    and `pos` are the active rows'.

    Host syncs, as in `Sampler.sample`'s loop: "has every row ended its turn?" is read every
    `sampler.sync_every` decode steps and when a turn hits its limit; the steps run after the
    last row ended are then undone (their slots were masked out: the column pointer, the
    cache's write position and the generator go back), so the result is the same, bit for
    bit, as checking after every step. At each turn boundary the turn's ids go to the host
    in one copy and the observations come back in one.

    Returns:
        tokens, logprobs (B, T) and exists, scored (B, T) bool, turn_ids (B, T) long,
        finished (B,) bool, and the per-row lists (turn_rewards, turn_texts, infos).
    """
    B = kv_mask.shape[0]
    dev = logits.device
    T = total
    tokens = torch.full((B, T), pad_id, dtype=torch.long, device=dev)
    logprobs = torch.zeros(B, T, dtype=torch.float32, device=dev)  # as the sampler's
    exists = torch.zeros(B, T, dtype=torch.bool, device=dev)
    scored = torch.zeros_like(exists)
    turn_ids = torch.full((B, T), -1, dtype=torch.long, device=dev)
    kv_mask[:, T_p:] = False  # completion slots open as rows write them
    live = [True] * B  # trajectory still running (host: read and written between turns)
    finished = [False] * B
    act = torch.arange(B, device=dev)  # trajectory row of each cache row
    rows = list(range(B))  # act on the host
    ready = torch.ones(B, dtype=torch.bool, device=dev)  # (b,) cache rows that take a turn
    rewards: list[list[float]] = [[] for _ in range(B)]
    texts: list[list[list[int]]] = [[] for _ in range(B)]
    infos: list[dict] = [{} for _ in range(B)]
    col = 0
    for turn in range(max_turns):
        in_turn, start = ready, col  # (b,) over the cache's rows
        stopped = torch.zeros(B, dtype=torch.bool, device=dev)
        # steps after which some row was still in its turn; as rows only leave their turn, the
        # turn (checked after every step) runs min(alive + 1, steps run) steps
        alive = torch.zeros((), dtype=torch.long, device=dev)
        states, checked = [], 0  # generator state after each draw since step `checked`
        for step in range(1, max_new_tokens + 1):
            tok, lp = draw(logits)  # (b,), (b,)
            states.append(gen.get_state())
            tokens[act, col] = torch.where(in_turn, tok, pad_id)
            logprobs[act, col] = torch.where(in_turn, lp, 0.0)
            exists[act, col] = in_turn
            scored[act, col] = in_turn
            turn_ids[act, col] = torch.where(in_turn, turn, -1)
            kv_mask[:, T_p + col] = in_turn
            # write this token's keys/values (the next turn's history) and get the logits of
            # the next one; rows not in their turn write a masked-out slot
            logits = sampler.decode(tok[:, None], pos[:, None], kv_mask, cache)
            pos += in_turn.long()
            col += 1
            stopped[act] |= in_turn & torch.isin(tok, stops)
            in_turn &= ~torch.isin(tok, ends)
            alive += in_turn.any()
            limit = step == max_new_tokens or col >= T
            if not limit and step % sampler.sync_every:
                continue
            n_alive = int(alive)  # the host sync: once per sync_every steps, once at a limit
            if n_alive == step and not limit:
                states, checked = [], step
                continue
            ran = min(n_alive + 1, step)  # the steps a check after every step would have run
            if ran < step:  # undo the rest: they wrote masked-out slots, nothing else
                gen.set_state(states[ran - checked - 1])
                cache.advance(ran - step)
                col -= step - ran
            break
        obs: dict[int, list[int]] = {}
        for b, (stop, *ids) in zip(rows, _turn_ids(tokens, scored, stopped, act, start, col)):
            if not live[b]:
                continue
            ids = [t for t in ids if t >= 0]
            if stop:
                ids = ids[:-1]
            texts[b].append(ids)
            o = observe(b, ids, bool(stop))
            rewards[b].append(float(o.reward))
            for k, v in o.info.items():
                infos[b][k] = infos[b].get(k, 0) + v
            if o.done or not o.ids:
                live[b] = False
                finished[b] = True
            else:
                obs[b] = list(o.ids)
        L = max((len(o) for o in obs.values()), default=0)
        if turn == max_turns - 1 or L == 0 or col + L + 1 > T:
            break  # the limits cut the live rows here (not finished)
        keep = [i for i, b in enumerate(rows) if live[b]]
        drop = not sampler.compile and len(keep) < len(rows)  # ended trajectories leave
        if drop:
            rows = [rows[i] for i in keep]
        b_now = len(rows)
        obs_ids = [obs.get(b, []) for b in rows]
        padded = [t for o in obs_ids for t in o + [pad_id] * (L - len(o))]  # (b * L,)
        idx, lens, chunk = _upload(dev, keep if drop else [], [len(o) for o in obs_ids], padded)
        chunk = chunk.view(b_now, L)
        if drop:
            act, kv_mask, pos = act[idx], kv_mask[idx], pos[idx]
            cache = cache.select_rows(idx)
        ready = lens > 0  # (b,) the live rows: each got an observation
        real = torch.arange(L, device=dev)[None, :] < lens[:, None]  # (b, L)
        kv_mask[:, T_p + col : T_p + col + L] = real
        tokens[act, col : col + L] = chunk
        exists[act, col : col + L] = real
        turn_ids[act, col : col + L] = torch.where(real, turn, -1)
        positions = pos[:, None] + torch.arange(L, device=dev)[None, :]  # (b, L)
        hidden = sampler.hidden_states(
            chunk, position_ids=positions, attention_mask=kv_mask, kv_cache=cache
        )  # (b, L, C)
        last = hidden[torch.arange(b_now, device=dev), (lens - 1).clamp(min=0)]  # (b, C)
        logits = sampler.logits(last)  # (b, V) after each row's observation
        pos += lens
        col += L
    extra = {"turn_rewards": rewards, "turn_texts": texts, "infos": infos}
    finished = torch.tensor(finished, dtype=torch.bool, device=dev)
    return tokens, logprobs, exists, scored, turn_ids, finished, extra


def _turn_ids(tokens, scored, stopped, act, start: int, col: int) -> list[list[int]]:
    """One turn of the cache's rows on the host, in one device->host copy: per row
    [stopped, id, id, ...] over columns [start, col), -1 where the row generated nothing.

    Args:
        tokens, scored: (B, T) completion ids and the generated-token mask.
        stopped: (B,) bool, the row ended this turn on a stop id.
        act: (b,) trajectory row of each cache row.
    """
    span = torch.where(scored[:, start:col], tokens[:, start:col], -1)  # (B, col - start)
    return torch.cat([stopped[:, None].long(), span], dim=1)[act].tolist()  # (b, 1 + ...)


def _upload(dev, *parts: list[int]) -> tuple[torch.Tensor, ...]:
    """Lists of ints -> long tensors on `dev`, in one host->device copy."""
    flat = torch.tensor([x for p in parts for x in p], dtype=torch.long, device=dev)
    return flat.split([len(p) for p in parts])


class EnvTimeout(Exception):
    """An environment call did not return within its time limit (its thread is abandoned)."""


class EnvCalls:
    """Calls into environments (start, step) made in one daemon worker thread, each waited for
    at most `timeout_s` seconds; None calls them directly in this thread. A call still running
    at its limit raises `EnvTimeout` and is abandoned: Python cannot stop a thread, so it runs
    on until it returns (being a daemon, it does not keep the process alive). The calls are
    sequential, as without a limit, so an environment never sees two at once."""

    def __init__(self, timeout_s: float | None):
        self.timeout_s = timeout_s
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._worker: threading.Thread | None = None

    def __call__(self, fn: Callable, *args):
        if self.timeout_s is None:
            return fn(*args)
        if self._worker is None:
            self._worker = threading.Thread(
                target=self._serve, args=(self._jobs,), name="env-calls", daemon=True
            )
            self._worker.start()
        box: dict = {}
        done = threading.Event()
        self._jobs.put((fn, args, box, done))
        if not done.wait(self.timeout_s):  # a signal still interrupts this wait
            self.close()  # the stuck thread ends when (if) the call returns
            self._jobs = queue.SimpleQueue()  # a later call gets a fresh thread and queue
            raise EnvTimeout()
        if "error" in box:
            raise box["error"]
        return box["value"]

    @staticmethod
    def _serve(jobs: queue.SimpleQueue) -> None:
        while (job := jobs.get()) is not None:
            fn, args, box, done = job
            try:
                box["value"] = fn(*args)
            except BaseException as e:  # handed to the caller, which names it
                box["error"] = e
            done.set()

    def close(self) -> None:
        """Let the worker thread end (once it is idle)."""
        if self._worker is not None:
            self._jobs.put(None)
            self._worker = None


def env_prompts(
    tokenizer,
    rows: Sequence[dict],
    envs: Sequence[Environment],
    G: int,
    call: Callable | None = None,
):
    """Start every environment; the prompt of each group: the row's own `prompt_ids`, or the
    rendering (with the environment's tools) of the messages its first environment returned,
    their contents encoded as plain text (`grpo.tokenizer.encode_chat`).
    `call(fn, *args)` makes the calls (`EnvCalls`: under a time limit); default: directly."""
    call = call or (lambda fn, *args: fn(*args))
    prompts = []
    for p, row in enumerate(rows):
        messages = [call(envs[p * G + g].start, row) for g in range(G)][0]
        if messages is None:
            prompts.append(list(row["prompt_ids"]))
            continue
        prompts.append(encode_chat(tokenizer, messages, tools=envs[p * G].tools or None))
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
    step_timeout_s: float | None = 60.0,
    progress: Callable[[int], None] | None = None,
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
            turn_end_ids, seed, pad_id, **sampling: as in `sample_turns`.
        max_obs_tokens: most tokens of one observation message's content.
        step_timeout_s: most seconds one environment call (start or step) may take
            (rollout.env_timeout_s; `EnvCalls`); None: no limit, called in this thread.
        progress: called with 1 after each environment step (a progress bar's `update`).

    Returns:
        the `Rollout`; `infos` also count obs_truncated: the trajectory's observations that
        were cut at `max_obs_tokens` among those appended to it (at most its turns - 1).

    Raises:
        GrpoError: an environment that raises, returns the wrong type or does not return
            within `step_timeout_s`, named in one line.
    """
    G = group_size
    envs = [make_env() for _ in range(len(rows) * G)]
    cut: list[list[bool]] = [[] for _ in envs]  # per row, per observe call: content was cut
    call = EnvCalls(step_timeout_s)

    def late(what: str) -> GrpoError:
        return GrpoError(
            f"environment {env_name!r}: {what} did not return within rollout.env_timeout_s="
            f"{step_timeout_s:g} s; it was left running in a background thread (raise the "
            "limit, or null for none)"
        )

    try:
        prompts = env_prompts(tokenizer, rows, envs, G, call)
    except GrpoError:
        raise
    except EnvTimeout:
        raise late("start()") from None
    except Exception as e:
        raise GrpoError(f"environment {env_name!r}: start() raised {type(e).__name__}: {e}") from e

    def observe(b: int, ids: list[int], stopped: bool) -> Observation:
        text = tokenizer.decode(ids, skip_special_tokens=False)
        try:
            step = call(envs[b].step, text, ids)
        except EnvTimeout:
            raise late(f"step() of trajectory {b} (turn {len(cut[b]) + 1})") from None
        except Exception as e:
            raise GrpoError(
                f"environment {env_name!r}: step() raised {type(e).__name__}: {e}"
            ) from e
        if progress is not None:
            progress(1)
        step = check_step(env_name, step)
        info = dict(step.info)
        cut[b].append(False)
        if step.done or step.observation is None:
            return Observation([], step.reward, True, info)
        message = step.observation
        if isinstance(message, str):
            message = {"role": "tool", "content": message}
        content_ids = plain_ids(tokenizer, message["content"])  # as the delta encodes it
        if len(content_ids) > max_obs_tokens:
            kept = tokenizer.decode(content_ids[:max_obs_tokens], skip_special_tokens=False)
            message = {**message, "content": kept + TRUNCATION_MARK}
            cut[b][-1] = True
        tools = envs[b].tools or None  # the row's schemas, as start() set them
        delta = message_delta_ids(tokenizer, message, after_stop=stopped, tools=tools)
        return Observation(delta, step.reward, False, info)

    try:
        rollout = sample_turns(
            sampler,
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
    finally:
        call.close()
    # The observation after turn k entered the trajectory iff turn k + 1 ran: the first
    # (turns - 1) observe calls of a row. The last one answered a turn the limits cut.
    for b, info in enumerate(rollout.infos):
        n = sum(cut[b][: len(rollout.turn_texts[b]) - 1])
        if n:
            info["obs_truncated"] = info.get("obs_truncated", 0) + n
    return rollout


def turn_end_ids(tokenizer, tokens: Sequence[str]) -> list[int]:
    """Ids of the given turn-ending token strings that are single tokens of this vocabulary
    (e.g. "</tool_call>" for Qwen3); the others are skipped (the stop id still ends a turn)."""
    out = []
    vocab = tokenizer.get_vocab()
    for t in tokens:
        if t in vocab:
            out.append(int(vocab[t]))
    return out


COUNTERS = ("tool_calls", "invalid_calls", "tool_errors", "obs_truncated")


def env_metrics(r: Rollout, max_turns: int) -> dict[str, float]:
    """The `env/*` metrics of a multi-turn rollout (empty for a single-turn one); the keys are
    fixed (ranks all-reduce them). Over the B trajectories:

    - turns_mean: model turns per trajectory;
    - turn_limit_frac: fraction the environment had not ended after `max_turns` turns (cut by
      rollout.max_turns);
    - budget_cut_frac: fraction cut with fewer than `max_turns` turns: the completion region
      (rollout.max_total_tokens) had no room for the next observation and turn;
    - obs_truncated_mean: observations cut at rollout.max_obs_tokens per trajectory (counting
      the observations appended to it, at most turns - 1 each);
    - obs_truncated_rate: cut observations / all appended observations;
    - tool_calls_mean, invalid_calls_mean, tool_errors_mean (the environment's counters),
      invalid_call_rate (invalid / all calls: calls that could not be run) and tool_error_rate
      (tool errors / all calls: calls that ran and failed, e.g. code that raised);
    - step_reward_mean: the environment's step rewards summed over a trajectory.

    A trajectory is cut (`finished` False) by exactly one of the two limits, so turn_limit_frac
    + budget_cut_frac is the fraction not ended by the environment.
    """
    if r.turn_texts is None:
        return {}
    B = len(r.turn_texts)
    totals = {k: sum(float(info.get(k, 0)) for info in r.infos) for k in COUNTERS}
    turns = [len(t) for t in r.turn_texts]
    cut = (~r.finished).tolist()
    observations = sum(max(n - 1, 0) for n in turns)  # each turn but the last answered one
    out = {
        "env/turns_mean": sum(turns) / B,
        "env/turn_limit_frac": sum(c and n >= max_turns for c, n in zip(cut, turns)) / B,
        "env/budget_cut_frac": sum(c and n < max_turns for c, n in zip(cut, turns)) / B,
        "env/obs_truncated_rate": totals["obs_truncated"] / max(observations, 1),
        "env/invalid_call_rate": totals["invalid_calls"] / max(totals["tool_calls"], 1.0),
        "env/tool_error_rate": totals["tool_errors"] / max(totals["tool_calls"], 1.0),
        "env/step_reward_mean": sum(sum(x) for x in r.turn_rewards) / B,
    }
    out.update({f"env/{k}_mean": v / B for k, v in totals.items()})
    return out

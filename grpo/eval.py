"""Evaluation of math reasoning: accuracy, pass@k, lengths, steps, format, error categories.

Scoring is pure (`score_completion`, `summarize`) and tested on hand-made completions;
`evaluate` batches prompts through our sampler (greedy, plus k samples for pass@k);
`evaluate_config` evaluates a trained model as a run config says (the pipeline, demo and tool);
`run_eval_command` is `grpo eval`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from tqdm.auto import tqdm

from grpo.config import Config, DataConfig
from grpo.errors import GrpoError
from grpo.loading import TrainedModel, load_rows, load_trained_model, resolve_device
from grpo.rewards import compare_answers, count_steps, extract_answer, has_final_answer
from grpo.rewards.extract import parse_number

_EQ_RE = re.compile(
    r"(-?\d+(?:\.\d+)?)\s*([-+*/x×÷])\s*(-?\d+(?:\.\d+)?)\s*=\s*(-?\d+(?:\.\d+)?)(?![\d.])"
)
DIFFICULTY_BUCKETS = (("1-2", 1, 2), ("3-4", 3, 4), ("5+", 5, 10**9))


def wrong_calculation(text: str) -> bool:
    """True when a line holds an `a op b = c` whose c is not a op b."""
    for a, op, b, c in _EQ_RE.findall(text.replace(",", "")):
        a, b, c = float(a), float(b), float(c)
        if op in "x×*":
            want = a * b
        elif op in "/÷":
            if b == 0:
                return True
            want = a / b
        elif op == "+":
            want = a + b
        else:
            want = a - b
        if abs(want - c) > 1e-6 * max(1.0, abs(want)):
            return True
    return False


def reference_steps(solution: str) -> int:
    """Steps of a GSM8K-style reference solution: its non-empty lines before `####`."""
    body = solution.split("####")[0]
    return max(1, sum(1 for line in body.splitlines() if line.strip()))


def score_completion(text: str, ground_truth: str, n_tokens: int | None = None) -> dict:
    """Everything evaluation reads off one completion.

    Returns:
        dict with correct (bool), format_ok (has a Final Answer marker with an answer),
        steps, n_tokens, pred, abs_error (None unless both numeric), and error_type:
        None when correct, else "format" (no extractable final answer), "calculation" (a wrong
        `a op b = c`), or "other".
    """
    pred = extract_answer(text) if has_final_answer(text) else None
    correct = pred is not None and compare_answers(pred, ground_truth)
    p, t = (parse_number(pred) if pred else None), parse_number(ground_truth)
    if correct:
        error = None
    elif pred is None:
        error = "format"
    elif wrong_calculation(text):
        error = "calculation"
    else:
        error = "other"
    return {
        "correct": bool(correct),
        "format_ok": pred is not None,
        "steps": count_steps(text),
        "n_tokens": n_tokens,
        "pred": pred,
        "abs_error": abs(p - t) if p is not None and t is not None else None,
        "error_type": error,
    }


def summarize(scored: list[dict], difficulties: list[int] | None = None) -> dict:
    """Aggregate `score_completion` dicts of greedy completions into the summary metrics."""
    n = len(scored)
    if n == 0:
        return {"n": 0}
    errors = [s["abs_error"] for s in scored if s["abs_error"] is not None]
    tokens = [s["n_tokens"] for s in scored if s["n_tokens"] is not None]
    out = {
        "n": n,
        "accuracy": sum(s["correct"] for s in scored) / n,
        "format_rate": sum(s["format_ok"] for s in scored) / n,
        "avg_steps": sum(s["steps"] for s in scored) / n,
        "avg_length": sum(tokens) / len(tokens) if tokens else 0.0,
        "mean_abs_error": sum(errors) / len(errors) if errors else 0.0,
        "errors": {
            kind: sum(s["error_type"] == kind for s in scored)
            for kind in ("format", "calculation", "other")
        },
    }
    if difficulties is not None:
        by = {}
        for name, lo, hi in DIFFICULTY_BUCKETS:
            hits = [s["correct"] for s, d in zip(scored, difficulties) if lo <= d <= hi]
            if hits:
                by[name] = {"n": len(hits), "accuracy": sum(hits) / len(hits)}
        out["by_difficulty"] = by
    return out


@dataclass
class EvalResult:
    summary: dict
    samples: list[dict] = field(default_factory=list)


def evaluate(
    model,
    tokenizer,
    rows: list[dict],
    *,
    stop_ids: list[int],
    max_new_tokens: int = 256,
    batch_size: int = 32,
    k: int = 1,
    temperature: float = 0.8,
    seed: int = 0,
    details: bool = False,
    progress: bool = False,
    env: str | None = None,
    env_kwargs: dict | None = None,
    max_turns: int = 4,
    max_total_tokens: int | None = None,
    max_obs_tokens: int = 64,
    turn_end_tokens: tuple[str, ...] = ("</tool_call>",),
    precision=None,
    env_timeout_s: float | None = 60.0,
) -> EvalResult:
    """Greedy accuracy and, with k > 1, pass@k / mean@k from k samples per prompt.

    Args:
        model: a `Decoder` (with or without LoRA).
        tokenizer: its tokenizer.
        rows: RL-format rows with `prompt_ids`, `ground_truth` and `full_answer`.
        stop_ids: ids that end a completion.
        max_new_tokens: completion length limit.
        batch_size: prompts per sampler call.
        k: samples per prompt for pass@k (pass@k = some sample correct; mean@k = the mean).
        temperature: temperature of the k samples.
        seed: sampling seed.
        details: keep per-sample records (prompt, completion, scores).
        env: an environment (`rollout.env` names) for multi-turn episodes: the final turn is
            scored (math accuracy against `ground_truth`, whatever the environment), and the
            `env_metrics` (turns, tool calls, limits, ...) are reported per problem.
        env_kwargs, max_turns, max_total_tokens, max_obs_tokens, turn_end_tokens,
            env_timeout_s: as the `rollout.*` settings of the same names (max_new_tokens is
            per turn).
        precision: the run's `grpo.precision.Precision` (a trainer's evaluation runs in the
            numerics it trains in); default: compute in the weights' dtype.

    Returns:
        `EvalResult(summary, samples)`.

    Raises:
        GrpoError: a row without `ground_truth` (named).
    """
    from grpo.rollout import Sampler
    from grpo.rollout.multiturn import env_metrics

    unscorable = next((i for i, r in enumerate(rows) if "ground_truth" not in r), None)
    if unscorable is not None:
        raise GrpoError(
            f"evaluation: row {unscorable} has no 'ground_truth' to score its final "
            "answer against (evaluation scores math accuracy)"
        )
    sampler = Sampler(model, precision=precision)
    generate = _generator(
        sampler,
        tokenizer,
        stop_ids,
        max_new_tokens,
        env,
        env_kwargs,
        max_turns,
        max_total_tokens,
        max_obs_tokens,
        turn_end_tokens,
        env_timeout_s,
    )
    scored, samples, diffs, pass_hits, mean_hits = [], [], [], [], []
    env_sums: dict[str, float] = {}
    batches = range(0, len(rows), batch_size)
    for start in tqdm(batches, desc="eval", disable=not progress, leave=False):
        chunk = rows[start : start + batch_size]
        greedy = generate(chunk, 1, 0.0, seed)
        texts = greedy.decode(tokenizer, skip_special_tokens=True)
        lengths = greedy.generated_mask.sum(-1).tolist()  # generated tokens (all turns)
        for key, value in env_metrics(greedy, max_turns).items():
            env_sums[key] = env_sums.get(key, 0.0) + value * len(chunk)
        for i, (row, text) in enumerate(zip(chunk, texts)):
            s = score_completion(text, row["ground_truth"], int(lengths[i]))
            scored.append(s)
            diffs.append(reference_steps(row.get("full_answer", "")))
            if details:
                record = {"question": row.get("question"), "completion": text, **s}
                if greedy.turn_texts is not None:
                    record["transcript"] = greedy.transcript(tokenizer)[i]
                samples.append(record)
        if k > 1:
            many = generate(chunk, k, temperature, seed + start + 1)
            ktexts = many.decode(tokenizer, skip_special_tokens=True)
            for i, row in enumerate(chunk):
                hits = [
                    score_completion(t, row["ground_truth"])["correct"]
                    for t in ktexts[i * k : (i + 1) * k]
                ]
                pass_hits.append(any(hits))
                mean_hits.append(sum(hits) / k)
    summary = summarize(scored, diffs)
    for key, total in env_sums.items():  # env/turns_mean -> turns_mean, per problem
        summary[key.split("/", 1)[1]] = total / max(len(rows), 1)
    if k > 1 and rows:
        summary[f"pass@{k}"] = sum(pass_hits) / len(pass_hits)
        summary[f"mean@{k}"] = sum(mean_hits) / len(mean_hits)
    return EvalResult(summary, samples)


def _generator(
    sampler,
    tokenizer,
    stop_ids,
    max_new_tokens,
    env,
    env_kwargs,
    max_turns,
    max_total_tokens,
    max_obs_tokens,
    turn_end_tokens,
    env_timeout_s=60.0,
):
    """(rows, group size, temperature, seed) -> Rollout: single turn, or episodes with `env`."""
    pad = tokenizer.pad_token_id
    if env is None or env == "single_turn":

        def single(chunk, G, temperature, seed):
            return sampler.sample(
                [r["prompt_ids"] for r in chunk],
                group_size=G,
                max_new_tokens=max_new_tokens,
                temperature=temperature,
                stop_ids=stop_ids,
                seed=seed,
                pad_id=pad,
            )

        return single
    from grpo.config import default_total_tokens
    from grpo.envs import env_factory
    from grpo.rollout.multiturn import sample_with_env, turn_end_ids

    make_env = env_factory(env, env_kwargs, key="eval.env")
    ends = turn_end_ids(tokenizer, turn_end_tokens)
    total = max_total_tokens or default_total_tokens(max_new_tokens, max_turns, max_obs_tokens)

    def episodes(chunk, G, temperature, seed):
        return sample_with_env(
            sampler,
            tokenizer,
            chunk,
            make_env,
            env_name=env,
            group_size=G,
            max_new_tokens=max_new_tokens,
            max_turns=max_turns,
            max_total_tokens=total,
            max_obs_tokens=max_obs_tokens,
            stop_ids=stop_ids,
            turn_end_ids=ends,
            seed=seed,
            pad_id=pad,
            temperature=temperature,
            step_timeout_s=env_timeout_s,
        )

    return episodes


def comparison_table(results: dict[str, dict]) -> str:
    """A Markdown table comparing summaries side by side (e.g. base / SFT / GRPO)."""
    keys = ["accuracy", "format_rate", "avg_length", "avg_steps", "mean_abs_error"]
    extra = sorted({k for s in results.values() for k in s if k.startswith(("pass@", "mean@"))})
    keys += extra
    env_keys = (
        "turns_mean",
        "tool_calls_mean",
        "invalid_call_rate",
        "tool_error_rate",
        "turn_limit_frac",
    )
    keys += [k for k in env_keys if any(k in s for s in results.values())]
    lines = ["| model | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
    for name, s in results.items():
        vals = [f"{s[k]:.3f}" if isinstance(s.get(k), float) else str(s.get(k, "")) for k in keys]
        lines.append(f"| {name} | " + " | ".join(vals) + " |")
    return "\n".join(lines)


def eval_env_settings(cfg: Config) -> dict:
    """`evaluate` keyword arguments for the configured environment (eval.env, else rollout.env);
    its kwargs eval.env_kwargs (default: rollout.env_kwargs for the same environment), its
    limits rollout.*'s."""
    env = cfg.eval.env or cfg.rollout.env
    if env == "single_turn":
        return {}
    r = cfg.rollout
    kwargs = cfg.eval.env_kwargs
    if kwargs is None:
        kwargs = r.env_kwargs if env == r.env else {}
    return {
        "env": env,
        "env_kwargs": kwargs,
        "max_turns": r.max_turns,
        "max_total_tokens": r.max_total_tokens,
        "max_obs_tokens": r.max_obs_tokens,
        "turn_end_tokens": r.turn_end_tokens,
        "env_timeout_s": r.env_timeout_s,
    }


def average_reward(cfg: Config, rows: list[dict], samples: list[dict]) -> float:
    """Mean weighted reward (cfg.rewards) of evaluation completions."""
    from grpo.rewards import RewardContext, build_rewards, compute_rewards

    if not samples or not cfg.rewards:  # `rewards: []`: the empty sum
        return 0.0
    fns = build_rewards([r.spec for r in cfg.rewards])
    columns = {k: [r[k] for r in rows] for k in rows[0] if k != "prompt_ids"}
    columns["completion_lengths"] = [s["n_tokens"] for s in samples]
    budget = cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens
    cut = tuple((s["n_tokens"] or 0) >= budget for s in samples)  # at the budget: cut there
    context = RewardContext(max_new_tokens=budget, truncated=cut)
    total, _ = compute_rewards(fns, [s["completion"] for s in samples], columns, context=context)
    return float(total.mean())


def evaluate_policy(cfg: Config, policy, rows, env: bool = True) -> dict:
    """A training run's eval/* metrics of its policy (`grpo.policy.Policy`) on `rows` (rank 0's;
    none elsewhere: {}): greedy, eval.max_new_tokens (else rollout.max_new_tokens), in the
    policy's precision; with `env`, in the evaluation environment (eval.env, else
    rollout.env; SFT evaluates single-turn)."""
    if not rows:
        return {}
    res = evaluate(
        policy.model,
        policy.tokenizer,
        rows,
        stop_ids=policy.stop_ids,
        max_new_tokens=cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens,
        batch_size=cfg.eval.batch_size,
        precision=policy.precision,
        **(eval_env_settings(cfg) if env else {}),
    )
    return {f"eval/{k}": v for k, v in res.summary.items() if isinstance(v, (int, float))}


def evaluate_config(cfg: Config, spec: TrainedModel, details: bool = False) -> dict:
    """Evaluate `spec` on `eval.max_samples` rows of `data.eval_split` as `cfg` says, the rows
    rendered with `spec`'s own tokenizer.

    Returns:
        the `evaluate` summary plus `average_reward` (cfg.rewards on the greedy completions),
        and `samples` (with ground truths) when `details`.
    """
    import torch

    from grpo.precision import Precision

    model, tok, stops, dev = load_trained_model(spec, cfg.model.dtype, cfg.model.device)
    rows = load_rows(cfg.data, cfg.data.eval_split, cfg.eval.max_samples, "rl", tok)
    res = evaluate(
        model,
        tok,
        rows,
        stop_ids=stops,
        max_new_tokens=cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens,
        batch_size=cfg.eval.batch_size,
        k=cfg.eval.k,
        temperature=cfg.eval.temperature,
        seed=cfg.train.seed,
        details=True,
        progress=cfg.train.progress,
        precision=Precision.from_config(cfg.model, training=False),
        **eval_env_settings(cfg),
    )
    summary = dict(res.summary)
    summary["average_reward"] = average_reward(cfg, rows, res.samples)
    if details:
        for sample, row in zip(res.samples, rows):
            sample["ground_truth"] = row["ground_truth"]
            sample["ground_truth_steps"] = reference_steps(row.get("full_answer", ""))
        summary["samples"] = res.samples
    del model
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return summary


def eval_data(data: str, max_prompt_len: int = DataConfig.max_prompt_len) -> tuple[DataConfig, str]:
    """`grpo eval --data NAME[:SPLIT]` (or a local file / directory) -> (data settings, split)."""
    from pathlib import Path

    name, split = data, "test"
    if ":" in data and not Path(data).exists():
        name, split = data.rsplit(":", 1)
    try:
        return DataConfig(dataset=name, max_prompt_len=max_prompt_len), split
    except GrpoError as e:
        raise GrpoError(str(e).replace("data.max_prompt_len", "--max-prompt-len")) from None


def run_eval_command(
    model: str,
    data: str,
    adapter: str | None = None,
    max_samples: int | None = None,
    k: int = 1,
    out: str | None = None,
    max_new_tokens: int = 256,
    batch_size: int = 32,
    details: bool = False,
    compare: list[str] | None = None,
    env: str | None = None,
    max_turns: int = 4,
    skip_memory_check: bool = False,
    max_prompt_len: int = DataConfig.max_prompt_len,
    env_kwargs: dict | None = None,
    without_tool: bool = True,
) -> dict:
    """`grpo eval`: evaluate one model (and optionally others) on the same problems; print a
    comparison table; write JSON to `out`. Each model reads the problems rendered by its own
    tokenizer. Sizes, contexts and memory are checked before any model loads
    (grpo/run/preflight.py; `skip_memory_check` skips the memory part).

    With an environment (`env`, its `env_kwargs`), each model is also evaluated on the same
    problems without it (`without_tool`): one turn from the row's own prompt, nothing executed,
    shown as "NAME (no tool)" and stored under the model's "without_tool" summary."""
    from pathlib import Path

    from grpo.io import check_output_file, write_json
    from grpo.run.preflight import check_eval_rows, eval_command_budget, preflight_eval
    from grpo.tokenizer import load_tokenizer

    if k < 1:
        raise GrpoError(f"--k must be >= 1, got {k}")
    if out:
        check_output_file(out, "--out")  # a directory or an impossible path fails before any work
    if max_turns < 1:
        raise GrpoError(f"--max-turns must be >= 1, got {max_turns}")
    data_cfg, split = eval_data(data, max_prompt_len)
    if env_kwargs is not None and not env:
        raise GrpoError("--env-kwargs needs --env")
    if env == "single_turn":
        env = None
    if env:
        from grpo.envs import env_factory

        # an unknown environment or a bad keyword fails before any model loads
        env_factory(env, env_kwargs, key="--env")
    specs = {"model": TrainedModel(model, (adapter,) if adapter else ())}
    for item in compare or []:
        name, _, spec = item.partition("=")
        if not spec:
            raise GrpoError(f"--compare {item!r} must look like NAME=MODEL or NAME=MODEL+ADAPTER")
        path, _, ad = spec.partition("+")
        specs[name] = TrainedModel(path, (ad,) if ad else ())
    configs = preflight_eval(
        [s.path for s in specs.values()],
        data=data,
        max_new_tokens=max_new_tokens,
        batch_size=batch_size,
        max_samples=max_samples,
        env=env,
        max_turns=max_turns,
    )
    device = resolve_device("auto")
    budget = eval_command_budget(max_new_tokens, env, max_turns)
    # Every model's prompts, rendered by its own tokenizer, fit its context and its memory
    # estimate fits the device: all checked before any model loads.
    rows_of: dict[str, list[dict]] = {}
    by_tokenizer: dict[str, list[dict]] = {}
    for (name, spec), mc in zip(specs.items(), configs):
        if spec.tokenizer_path not in by_tokenizer:
            tok = load_tokenizer(spec.tokenizer_path)
            by_tokenizer[spec.tokenizer_path] = load_rows(
                data_cfg, split, max_samples, "rl", tok, limit_name="--max-prompt-len"
            )
        rows_of[name] = by_tokenizer[spec.tokenizer_path]
        check_eval_rows(rows_of[name], [mc], budget, batch_size * k, device, skip_memory_check)
    results: dict[str, dict] = {}
    payload = {"data": data, "k": k, "env": env, "env_kwargs": env_kwargs or {}, "models": {}}
    for name, spec in specs.items():
        net, tok, stops, _ = load_trained_model(spec, device=device)
        res = evaluate(
            net,
            tok,
            rows_of[name],
            stop_ids=stops,
            max_new_tokens=max_new_tokens,
            batch_size=batch_size,
            k=k,
            details=details,
            progress=True,
            env=env,
            env_kwargs=env_kwargs,
            max_turns=max_turns,
        )
        results[name] = res.summary
        ad = spec.adapters[0] if spec.adapters else None
        payload["models"][name] = {"path": spec.path, "adapter": ad, "summary": res.summary}
        if details:
            payload["models"][name]["samples"] = res.samples
        if env and without_tool:  # the same problems, one turn, nothing executed
            off = evaluate(
                net,
                tok,
                rows_of[name],
                stop_ids=stops,
                max_new_tokens=max_new_tokens,
                batch_size=batch_size,
                k=k,
                progress=True,
            )
            results[f"{name} (no tool)"] = off.summary
            payload["models"][name]["without_tool"] = off.summary
        del net
    print(comparison_table(results))
    for name, s in results.items():
        print(f"{name}: errors {s.get('errors')}, by difficulty {s.get('by_difficulty')}")
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        write_json(out, payload)
    return payload

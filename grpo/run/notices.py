"""Start notices: limits and mismatches a run states once before it starts, one line each,
where they would otherwise act silently (nothing is refused; the refusals are
`grpo.run.preflight`'s): a multi-turn budget that cannot fit rollout.max_turns turns
(`turn_budget_notices`, `guaranteed_turns`), an evaluation that scores what training does not
(`eval_fit_notice`), an evaluation that reads the training problems (`same_data_notice`).
"""

from __future__ import annotations

from grpo.config import Config
from grpo.errors import GrpoError
from grpo.run.budgets import eval_budget


def start_notices(
    cfg: Config, kind: str = "grpo", *, pipeline: bool = False, tokenizer=None
) -> list[str]:
    """The limits and mismatches a run states once before it starts (each one line; nothing
    is refused): `turn_budget_notices`, `eval_fit_notice`, `same_data_notice` and
    `unused_critic_notice`. `grpo train`
    logs them as warnings on rank 0 once the tokenizer is loaded; without `tokenizer` the
    template's glue is the estimate `default_total_tokens` uses (OBS_GLUE_TOKENS), so a
    config-only check may state fewer.

    Args:
        cfg: the run's config.
        kind: "grpo" or "sft" (SFT samples nothing: only a pipeline's evaluation counts).
        pipeline: the run is a stage of `grpo pipeline`, whose evaluation stages also run.
        tokenizer: the policy's tokenizer, to measure the template's glue.
    """
    out = turn_budget_notices(cfg, kind, pipeline=pipeline, tokenizer=tokenizer)
    evaluates = (kind == "grpo" and cfg.data.eval_samples > 0) or pipeline
    fit = eval_fit_notice(cfg) if evaluates else None
    same = same_data_notice(cfg) if evaluates else None
    unused = unused_critic_notice(cfg) if kind == "grpo" else None
    return out + [n for n in (fit, same, unused) if n]


def unused_critic_notice(cfg: Config) -> str | None:
    """One line when a critic trains beside an estimator that reads no values (one that
    does not declare `rollout`, where a module's extras arrive): it costs its forward,
    backward and optimizer, and only its own metrics use it (a choice, not an error)."""
    if not any(m.name == "critic" for m in cfg.modules):
        return None
    from grpo.algo.advantages import wants_rollout

    if wants_rollout(cfg.loss.advantage):
        return None
    return (
        f"modules: the critic trains beside loss.advantage={cfg.loss.advantage!r}, which reads "
        "no values: they only reach its metrics (loss.advantage=gae uses them)"
    )


def same_data_notice(cfg: Config) -> str | None:
    """One line when the evaluation reads the training problems: one local file serves both
    splits (a file is used whatever the split name), or the two splits are the same."""
    from pathlib import Path

    from grpo.data.gsm8k import parse_split

    d = cfg.data
    try:
        train, evaluation = parse_split(d.split), parse_split(d.eval_split)
    except GrpoError:
        return None  # the data loader names the bad split
    source = d.source if d.source is not None else d.dataset
    path = Path(str(source)).expanduser()
    if path.is_file() and train[1:] == evaluation[1:]:
        field = "data.source" if d.source is not None else "data.dataset"
        return (
            f"{field}: one file ({source}) serves both data.split={d.split!r} and "
            f"data.eval_split={d.eval_split!r} (a file is read whatever the split name): "
            "the evaluation scores training problems; give a directory with a file per "
            "split, or slice the file (e.g. data.split='train[:90%]', "
            "data.eval_split='train[90%:]')"
        )
    if train == evaluation:
        return (
            f"data.eval_split: {d.eval_split!r} is data.split: the evaluation scores "
            "training problems; name a held-out split (e.g. test)"
        )
    return None


OBS_GLUE_TOKENS = 16  # template tokens per observation that default_total_tokens allows for


def observation_overhead(tokenizer=None) -> int:
    """Most tokens one observation adds to the completion region besides its max_obs_tokens of
    content: the chat template's glue around a tool message (closing the model's turn, the
    message header, the next assistant header; the larger of after a stop id or not) plus
    the mark a cut observation ends with. Without a tokenizer (or a chat template):
    OBS_GLUE_TOKENS, the estimate of `default_total_tokens`."""
    if tokenizer is None:
        return OBS_GLUE_TOKENS
    from grpo.rollout.multiturn import TRUNCATION_MARK
    from grpo.tokenizer import message_delta_ids

    try:
        glue = max(
            len(message_delta_ids(tokenizer, {"role": "tool", "content": ""}, after_stop=s))
            for s in (True, False)
        )
        mark = len(tokenizer(TRUNCATION_MARK, add_special_tokens=False)["input_ids"])
    except Exception:  # no chat template: the sampler fails on its own, naming it
        return OBS_GLUE_TOKENS
    return glue + mark


def guaranteed_turns(
    max_new_tokens: int, max_turns: int, max_obs_tokens: int, total: int, overhead: int
) -> int:
    """Turns every trajectory gets within `total` completion slots when each turn runs to
    max_new_tokens and each observation to max_obs_tokens (+ `overhead`): the largest k <=
    max_turns with k * max_new_tokens + (k - 1) * (max_obs_tokens + overhead) <= total
    (at least 1: a first turn always runs, cut at `total`)."""
    k = max_turns
    while k > 1 and k * max_new_tokens + (k - 1) * (max_obs_tokens + overhead) > total:
        k -= 1
    return k


def turn_budget_notices(
    cfg: Config, kind: str = "grpo", *, pipeline: bool = False, tokenizer=None
) -> list[str]:
    """One line for each multi-turn budget (the rollout's; the evaluation's when its per-turn
    limit differs) that cannot fit rollout.max_turns turns at their limits with observations
    cut at rollout.max_obs_tokens: how many turns are guaranteed and what to set
    rollout.max_total_tokens to. Such trajectories are counted per step in env/budget_cut_frac
    (and eval/budget_cut_frac)."""
    r = cfg.rollout
    overhead = observation_overhead(tokenizer)
    budgets = []  # (metric prefix, per-turn limit setting, its value, completion budget)
    if kind == "grpo" and r.multi_turn:
        budgets.append(("env", "rollout.max_new_tokens", r.max_new_tokens, r.total_tokens))
    evaluates = (kind == "grpo" and cfg.data.eval_samples > 0) or pipeline
    if evaluates and (cfg.eval.env or r.env) != "single_turn":
        n = cfg.eval.max_new_tokens or r.max_new_tokens
        setting = "eval.max_new_tokens" if cfg.eval.max_new_tokens else "rollout.max_new_tokens"
        total = eval_budget(cfg, True)
        if not budgets or (n, total) != budgets[0][2:]:  # else the same line twice
            budgets.append(("eval", setting, n, total))
    out = []
    for metric, setting, n, total in budgets:
        k = guaranteed_turns(n, r.max_turns, r.max_obs_tokens, total, overhead)
        if k >= r.max_turns:
            continue
        need = r.max_turns * n + (r.max_turns - 1) * (r.max_obs_tokens + overhead)
        which = "set" if r.max_total_tokens is not None else "default"
        what = "a rollout" if metric == "env" else "an evaluation episode"
        out.append(
            f"rollout.max_total_tokens ({which}: {total} tokens) guarantees {what} {k} of "
            f"rollout.max_turns={r.max_turns} turns: with turns at {setting}={n} and "
            f"observations cut at rollout.max_obs_tokens={r.max_obs_tokens} (+ {overhead} "
            f"tokens of template and truncation mark each) all {r.max_turns} need {need}; "
            f"trajectories the budget cuts are counted in {metric}/budget_cut_frac. Set "
            f"rollout.max_total_tokens={need} to guarantee every turn"
        )
    return out


# Environments whose final turn answers the row's math question by construction, and rewards
# that score a final answer against ground_truth as `evaluate` does.
ANSWER_ENVS = ("single_turn", "calculator", "python")
ANSWER_REWARDS = ("accuracy", "step")


def eval_fit_notice(cfg: Config) -> str | None:
    """One line when a run's evaluation would score what its training does not, else None.

    Evaluation always scores math accuracy: the final turn's answer against each row's
    `ground_truth` (`score_completion`). It fits the environment it runs (eval.env, by
    default rollout.env) when that environment's episodes end in such an answer
    (ANSWER_ENVS) or when a training reward scores that answer (ANSWER_REWARDS, also inside
    `combined`). Otherwise, say a custom environment trained on its step rewards or a reward
    of its own, eval/accuracy measures something no reward asks for and can read 0.000
    throughout: the line says so and how to change it. (Rows always have a ground_truth once
    loaded; `evaluate` refuses one without.)
    """
    env = cfg.eval.env or cfg.rollout.env
    if env in ANSWER_ENVS:
        return None
    names = {n for r in cfg.rewards for n in _reward_names(r.name, r.kwargs)}
    if names & set(ANSWER_REWARDS):
        return None
    source = "eval.env" if cfg.eval.env else "rollout.env's, as eval.env is unset"
    return (
        f"eval.env: evaluation episodes run in {env!r} ({source}) and are scored by math "
        f"accuracy of the final turn against each row's ground_truth (eval/accuracy), which "
        f"no training reward measures (rewards: {', '.join(r.name for r in cfg.rewards)}); "
        "add an accuracy reward if the final turn answers the row, set eval.env to an "
        "environment that does, or set data.eval_samples=0 to skip evaluation"
    )


def _reward_names(name: str, kwargs: dict) -> list[str]:
    """A reward's name and, for `combined`, its components' names."""
    if name != "combined":
        return [name]
    weights = kwargs.get("weights", {})
    if isinstance(weights, dict):
        return [name, *map(str, weights)]
    if isinstance(weights, (list, tuple)):
        return [name, *(w.get("name", "") if isinstance(w, dict) else str(w) for w in weights)]
    return [name]

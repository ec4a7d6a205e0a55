"""Preflight: the checks a run can make from its config and the checkpoint's config.json alone,
before any weights load or any file is written.

Without them some limits showed only when a run reached them: the evaluation's max_new_tokens
against the context at the final evaluation (after training; with the default save_every: 0
nothing was saved), an oversized batch, data size or LoRA rank by allocating until the machine
swapped. `preflight` runs them all at the start and fails with one line naming the field
(several problems are joined with "; "):

- train.output_dir (the pipeline's output_dir) can be created and written;
- the checkpoint's config.json is readable and of a supported architecture (no weights read);
- GRPO: a critic's `init` and each `reward_model` reward's path are checkpoints of the right
  kind (`check_scorer_checkpoints`, their config.json only);
- every token budget leaves room for a prompt in the context (max_position_embeddings): the
  rollout's (rollout.max_new_tokens, or the multi-turn budget), SFT's completion limit, the
  evaluation's (eval.max_new_tokens, and its multi-turn budget);
- lora.targets match a linear layer and lora.rank <= the smaller width of each one;
- generated data (minimath) asks for at most GENERATED_ROWS_MAX rows;
- the memory estimate (`grpo.run.memory`, the formula in its docstring) fits the memory
  available (train.skip_memory_check: true skips it).

`check_prompt_room` runs once the data is loaded (after the model, still before anything is
written): every prompt (and SFT completion) plus its budget fits the context. The budgets are
`grpo.run.budgets`'; limits a run states without refusing anything are `grpo.run.notices`'.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from grpo.config import Config, default_total_tokens
from grpo.errors import GrpoError
from grpo.models import Decoder, ModelConfig
from grpo.models.decoder import meta_decoder
from grpo.run.budgets import Evaluation, eval_budget, rollout_budget
from grpo.run.memory import (
    MemoryEstimate,
    available_memory,
    estimate_memory,
    lora_layers,
    memory_fields,
    sampling_bytes,
)
from grpo.settings import ConfigError

GENERATED_DATASETS = ("minimath",)  # made on the fly: a huge size allocates or loops
GENERATED_ROWS_MAX = 100_000  # ~2 s and ~250 MiB of minimath
_GIB = 2**30


class PreflightError(ConfigError):
    """A setting that cannot work with this model or machine; the message names the field."""


def preflight(
    cfg: Config,
    kind: str,
    device: torch.device | str | None = None,
    *,
    world_size: int = 1,
    pipeline: bool = False,
) -> ModelConfig:
    """Check everything that needs no weights and no data; raise before anything is written.

    Args:
        cfg: the run's config.
        kind: "grpo" or "sft".
        device: where the run computes (default: model.device resolved); sets which memory
            the estimate is compared with.
        world_size: ranks of the job (CPU ranks share the machine's memory).
        pipeline: the run is a stage of `grpo pipeline`, whose evaluation stages also run
            (eval.max_samples rows, eval.k samples each, the configured environment).

    Returns:
        the checkpoint's `ModelConfig` (for `check_prompt_room` once the data is loaded).

    Raises:
        PreflightError: naming the field(s); GrpoError: the checkpoint cannot be read.
    """
    if kind not in ("grpo", "sft"):
        raise ValueError(f"kind must be 'grpo' or 'sft', got {kind!r}")
    problems: list[str] = []

    def check(fn, *args) -> None:
        try:
            fn(*args)
        except PreflightError as e:
            problems.append(str(e))

    check(check_output_dir, cfg.train.output_dir, "train.output_dir")
    if kind == "grpo":
        check(check_scorer_checkpoints, cfg)
    mc, source = read_model_config(cfg.model.path)
    ctx = mc.max_position_embeddings
    rollout_field, rollout_tokens = rollout_budget(cfg, kind)
    evaluations = _evaluations(cfg, kind, pipeline)
    check(check_budget, rollout_tokens, ctx, rollout_field, source)
    for ev in evaluations:
        check(check_budget, ev.budget, ctx, ev.field, source)
    meta = meta_decoder(mc)
    check(check_lora, cfg, meta)
    check(check_generated_sizes, cfg, pipeline)
    if not problems and not cfg.train.skip_memory_check:
        dev = torch.device(device) if device is not None else _resolve(cfg.model.device)
        estimate = estimate_memory(cfg, mc, kind, evaluations, meta, world_size)
        check(check_memory, estimate, dev, world_size, memory_fields(cfg))
    if problems:
        raise PreflightError("; ".join(problems))
    return mc


# --------------------------------------------------------------------------- files and model


def check_output_dir(path: str | Path, field: str) -> None:
    """`path` is a writable directory or can be created as one; nothing is created here.

    Raises:
        PreflightError: `path` (or an ancestor) is a file, or the directory that would hold it
            is not writable.
    """
    p = Path(path).expanduser()
    if p.exists() and not p.is_dir():
        raise PreflightError(f"{field}: {str(p)!r} exists and is not a directory")
    existing = p
    while not existing.exists():  # the nearest ancestor that exists gets the new directories
        if existing.parent == existing:
            break
        existing = existing.parent
    if not existing.is_dir():
        raise PreflightError(
            f"{field}: {str(p)!r} cannot be created: {str(existing)!r} is a file, not a directory"
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        raise PreflightError(
            f"{field}: {str(existing)!r} is not writable, so {str(p)!r} can not be written"
        )


def read_model_config(path_or_id: str | Path) -> tuple[ModelConfig, str]:
    """The checkpoint's architecture from its config.json alone: (ModelConfig, where it was read).

    A local directory is read directly; a hub id fetches config.json only (no weights).
    """
    path = Path(path_or_id)
    if path.is_dir():
        return ModelConfig.from_hf(path), str(path / "config.json")
    name = str(path_or_id)
    if path.exists() or name.startswith((".", "/")) or name.count("/") != 1:  # as load_model
        raise GrpoError(f"model path {name!r} is not a directory or a hub id")
    try:
        from huggingface_hub import hf_hub_download

        file = hf_hub_download(name, "config.json")
    except Exception as e:  # offline, unknown repo, auth...
        raise GrpoError(f"could not fetch model {name!r} from the hub: {e}") from None
    return ModelConfig.from_hf(file), f"{name}/config.json"


def check_scorer_checkpoints(cfg: Config) -> None:
    """The checkpoints a GRPO run loads beside the policy, from their config.json alone (no
    weights): a critic's ``modules[i].kwargs.init`` is a supported checkpoint, and the path of
    each ``reward_model`` reward is a reward model (a sequence classifier with one output),
    not a causal LM. A hub id is not fetched here (the run loads it when it starts).

    Raises:
        PreflightError: naming the field and the file.
    """
    for i, spec in enumerate(cfg.modules):
        init = spec.kwargs.get("init") if spec.name == "critic" else None
        if isinstance(init, str):
            _local_config(init, f"modules[{i}].kwargs.init")
    for i, r in enumerate(cfg.rewards):
        path = r.kwargs.get("path") if r.name == "reward_model" else None
        if not isinstance(path, str):
            continue
        field = f"rewards[{i}].kwargs.path"
        mc = _local_config(path, field)
        if mc is None:
            continue
        if not mc.num_labels:
            raise PreflightError(
                f"{field}: {path!r} is a causal LM (its config.json names no "
                "*ForSequenceClassification architecture), not a reward model; train one with "
                "`grpo rm`"
            )
        if mc.num_labels != 1:
            raise PreflightError(
                f"{field}: {path!r} has {mc.num_labels} outputs (num_labels); a reward model has 1"
            )


def _local_config(path: str, field: str) -> ModelConfig | None:
    """The `ModelConfig` of a local checkpoint directory; None for a hub id (not fetched)."""
    p = Path(path).expanduser()
    if not p.is_dir():
        if p.exists() or path.startswith((".", "/", "~")) or path.count("/") != 1:
            raise PreflightError(f"{field}: {path!r} is not a checkpoint directory (nor a hub id)")
        return None
    try:
        return ModelConfig.from_hf(p)
    except GrpoError as e:
        raise PreflightError(f"{field}: {e}") from None


# --------------------------------------------------------------------------- token budgets


def _evaluations(cfg: Config, kind: str, pipeline: bool) -> list[Evaluation]:
    """The evaluations the run does: during training (data.eval_samples > 0; GRPO's in its
    environment, SFT's single-turn) and, in the pipeline, its evaluation stage."""
    field = "eval.max_new_tokens"
    out = []
    if cfg.data.eval_samples > 0:
        out.append(Evaluation(eval_budget(cfg, kind == "grpo"), cfg.eval.batch_size, field))
    if pipeline:
        rows = cfg.eval.batch_size * cfg.eval.k
        out.append(Evaluation(eval_budget(cfg, True), rows, field))
    return out


def check_budget(budget: int, ctx: int, field: str, source: str) -> None:
    """`budget` new tokens leave room for at least a one-token prompt in `ctx` positions."""
    if budget >= ctx:
        raise PreflightError(
            f"{field}: {budget} new tokens leave no room for a prompt in the model's context "
            f"(max_position_embeddings={ctx} in {source})"
        )


def check_rows_fit(
    rows: Sequence[dict], ctx: int, budget: int, field: str, where: str, completions: bool = False
) -> None:
    """Every row's prompt_ids (+ completion_ids when `completions`) plus `budget` new tokens
    fit in `ctx` positions; else a PreflightError naming the first row that does not."""
    for i, row in enumerate(rows):
        n_prompt = len(row["prompt_ids"])
        n_completion = len(row["completion_ids"]) if completions else 0
        if n_prompt + n_completion + budget <= ctx:
            continue
        if completions:
            raise PreflightError(
                f"{field}: row {i} of {where} has a {n_prompt}-token prompt and a "
                f"{n_completion}-token completion (cut at {field}): {n_prompt + n_completion} "
                f"positions > the model's context {ctx}; lower {field} or data.max_prompt_len"
            )
        raise PreflightError(
            f"{field}: {budget} new tokens leave {ctx - budget} positions of the model's context "
            f"({ctx}) for a prompt, but row {i} of {where} has a {n_prompt}-token prompt; lower "
            f"{field}, or set data.max_prompt_len to {ctx - budget} to name such prompts"
        )


def check_prompt_room(
    cfg: Config,
    mc: ModelConfig,
    kind: str,
    rows: Sequence[dict] | None = None,
    eval_rows: Sequence[dict] | None = None,
    pipeline: bool = False,
) -> None:
    """Once the data is loaded: every training row and evaluation prompt fits the context
    with its budget (see `preflight` for the budgets).

    Args:
        cfg: the run's config.
        mc: the checkpoint's config (from `preflight`).
        kind: "grpo" (rows with prompt_ids) or "sft" (rows with prompt_ids + completion_ids).
        rows: the training rows, or None.
        eval_rows: the evaluation rows, or None.
        pipeline: the evaluation is the pipeline's (its environment's budget).
    """
    ctx = mc.max_position_embeddings
    data = cfg.data
    if rows:
        where = f"{data.dataset!r} ({data.split})"
        if kind == "sft":
            check_rows_fit(rows, ctx, 0, "rollout.max_new_tokens", where, completions=True)
        else:
            field, budget = rollout_budget(cfg, kind)
            check_rows_fit(rows, ctx, budget, field, where)
    if eval_rows:
        budget = eval_budget(cfg, kind == "grpo" or pipeline)
        where = f"{data.dataset!r} ({data.eval_split})"
        check_rows_fit(eval_rows, ctx, budget, "eval.max_new_tokens", where)


# --------------------------------------------------------------------------- LoRA and data


def check_lora(cfg: Config, meta: Decoder) -> None:
    """lora.targets select a layer and lora.rank fits the narrowest selected one (a new
    adapter only: one loaded from lora.adapter brings its own rank)."""
    if not cfg.lora.enabled or cfg.lora.adapter:
        return
    layers = lora_layers(cfg, meta)
    if not layers:
        names = sorted(
            {n.rsplit(".", 1)[-1] for n, m in meta.named_modules() if type(m) is nn.Linear}
        )
        raise PreflightError(
            f"lora.targets: {list(cfg.lora.targets)} match no linear layer; available: {names}"
        )
    name, layer = min(layers.items(), key=lambda kv: min(kv[1].in_features, kv[1].out_features))
    width = min(layer.in_features, layer.out_features)
    if cfg.lora.rank > width:
        raise PreflightError(
            f"lora.rank: {cfg.lora.rank} > the width of {name} ({layer.in_features} -> "
            f"{layer.out_features}); at most {width} for these lora.targets"
        )


def check_generated_sizes(cfg: Config, pipeline: bool = False) -> None:
    """Generated datasets (minimath) ask for at most GENERATED_ROWS_MAX rows per split."""
    if cfg.data.dataset not in GENERATED_DATASETS:
        return
    sizes = {"data.max_samples": cfg.data.max_samples, "data.eval_samples": cfg.data.eval_samples}
    if pipeline:
        sizes["eval.max_samples"] = cfg.eval.max_samples
    for field, n in sizes.items():
        if n is not None and n > GENERATED_ROWS_MAX:
            raise PreflightError(
                f"{field}: {n} rows of generated {cfg.data.dataset!r} data; at most "
                f"{GENERATED_ROWS_MAX}"
            )


# --------------------------------------------------------------------------- memory


def check_memory(
    estimate: MemoryEstimate,
    device: torch.device,
    world_size: int,
    fields: dict[str, str],
    override: str = "set train.skip_memory_check=true",
) -> None:
    """The estimate (times the ranks sharing the memory) fits what `available_memory` says.

    Args:
        estimate: from `estimate_memory`.
        device: where the run computes.
        world_size: ranks of the job (on CPU they share the memory).
        fields: the part -> the setting to name when that part is the largest.
        override: how the message says to skip the check.
    """
    free, where = available_memory(device)
    if free is None:
        return
    sharing = world_size if device.type == "cpu" else 1
    need = estimate.total * sharing
    if need <= free:
        return
    parts = {
        k: getattr(estimate, k)
        for k in (
            "weights",
            "reference",
            "optimizer",
            "rollout",
            "training",
            "evaluation",
            "producer",
        )
    }
    shown = ", ".join(f"{k} {v / _GIB:.2f}" for k, v in parts.items() if v)
    largest = max(parts, key=parts.get)
    ranks = f" x {sharing} ranks" if sharing > 1 else ""
    raise PreflightError(
        f"{fields[largest]}: the run needs an estimated {need / _GIB:.2f} GiB ({shown} GiB{ranks})"
        f" but {free / _GIB:.2f} GiB is available ({where}); lower {fields[largest]}, or "
        f"{override} if the estimate is wrong for your data (docs/safety.md)"
    )


def _resolve(name: str) -> torch.device:
    from grpo.loading import resolve_device

    return resolve_device(name)


# --------------------------------------------------------------------------- `grpo eval`


def eval_command_budget(max_new_tokens: int, env: str | None, max_turns: int) -> int:
    """New tokens `grpo eval` may add to a prompt (an environment: every turn at its limit
    plus observations, as `evaluate` does)."""
    if not env:
        return max_new_tokens
    return default_total_tokens(max_new_tokens, max_turns, 64)


def preflight_eval(
    models: Sequence[str],
    *,
    data: str,
    max_new_tokens: int,
    batch_size: int,
    max_samples: int | None,
    env: str | None,
    max_turns: int,
) -> list[ModelConfig]:
    """`grpo eval`'s checks before any model loads or file is written: the sizes, every
    model's config.json and its context against the budget (--out is checked by the command).

    Returns:
        each model's `ModelConfig`, in order (for `check_eval_rows`).
    """
    problems: list[str] = []
    for flag, value in (
        ("--max-new-tokens", max_new_tokens),
        ("--batch-size", batch_size),
        ("--max-samples", max_samples),
    ):
        if value is not None and value < 1:
            problems.append(f"{flag}: must be >= 1, got {value}")
    if max_samples is not None and data.split(":")[0] in GENERATED_DATASETS:
        if max_samples > GENERATED_ROWS_MAX:
            problems.append(
                f"--max-samples: {max_samples} rows of generated data; at most {GENERATED_ROWS_MAX}"
            )
    configs = []
    budget = eval_command_budget(max_new_tokens, env, max_turns)
    for model in models:
        mc, source = read_model_config(model)
        configs.append(mc)
        try:
            check_budget(budget, mc.max_position_embeddings, "--max-new-tokens", source)
        except PreflightError as e:
            problems.append(str(e))
    if problems:
        raise PreflightError("; ".join(problems))
    return configs


def check_eval_rows(
    rows: Sequence[dict],
    configs: Sequence[ModelConfig],
    budget: int,
    rows_per_call: int,
    device: torch.device,
    skip_memory_check: bool = False,
) -> None:
    """`grpo eval` once its prompts are tokenized, before any model loads: every prompt fits
    each model's context with the budget, and the sampler's memory (real prompt lengths) plus
    the float32 weights fit the device (--skip-memory-check skips that part).

    Args:
        rows: RL rows with prompt_ids.
        configs: the evaluated models' configs.
        budget: new tokens per prompt (`eval_command_budget`).
        rows_per_call: sampler rows at once: --batch-size x --k.
        device: where the models will run.
    """
    ctx = min(mc.max_position_embeddings for mc in configs)
    check_rows_fit(rows, ctx, budget, "--max-new-tokens", "--data")
    if skip_memory_check or not rows:
        return
    tokens = max(len(r["prompt_ids"]) for r in rows) + budget
    for mc in configs:
        weights = sum(p.numel() for p in meta_decoder(mc).parameters()) * 4  # float32 load
        estimate = MemoryEstimate(weights, 0, 0, 0, 0, sampling_bytes(mc, rows_per_call, tokens, 4))
        fields = dict.fromkeys(
            ("weights", "reference", "optimizer", "rollout", "training"), "--model"
        )
        fields["evaluation"] = "--batch-size"
        check_memory(estimate, device, 1, fields, override="pass --skip-memory-check")

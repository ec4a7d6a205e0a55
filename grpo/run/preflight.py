"""Preflight: the checks a run can make from its config and the checkpoint's config.json alone,
before any weights load or any file is written.

Without them some limits showed only when a run reached them: the evaluation's max_new_tokens
against the context at the final evaluation (after training; with the default save_every: 0
nothing was saved), an oversized batch, data size or LoRA rank by allocating until the machine
swapped. `preflight` runs them all at the start and fails with one line naming the field
(several problems are joined with "; "):

- train.output_dir (the pipeline's output_dir) can be created and written;
- the checkpoint's config.json is readable and of a supported architecture (no weights read);
- every token budget leaves room for a prompt in the context (max_position_embeddings): the
  rollout's (rollout.max_new_tokens, or the multi-turn budget), SFT's completion limit, the
  evaluation's (eval.max_new_tokens, and its multi-turn budget);
- lora.targets match a linear layer and lora.rank <= the smaller width of each one;
- generated data (minimath) asks for at most GENERATED_ROWS_MAX rows;
- the memory estimate below fits the memory available (train.skip_memory_check: true skips it).

`check_prompt_room` runs once the data is loaded (after the model, still before anything is
written): every prompt (and SFT completion) plus its budget fits the context.

`start_notices` are not refusals but limits that would otherwise act silently, stated in one
line each before the run starts: a multi-turn budget that cannot fit rollout.max_turns turns
(`turn_budget_notices`), an evaluation that scores what training does not
(`grpo.run.preflight.eval_fit_notice`).

Memory estimate, in bytes, by the precision policy (docs/precision.md; e = bytes per element of
model.dtype: 4 float32, 2 bf16/fp16; k = 2 under autocast (bf16 compute), else e; trainable
weights are float32 master weights; shapes from config.json: L layers, C width, I MLP width,
H / H_kv heads of D, V vocabulary):

    weights     N * e                    N: the checkpoint's parameters (full fine-tuning: N * 4)
    reference   N * e                    GRPO with full fine-tuning and a KL reference only
    optimizer   N_t * 4 * 3 (+ N_t * 4)  gradient + AdamW's two moments (+ the LoRA weights);
                                         N_t trainable: r * (in + out) per LoRA layer, or N
    rollout     B * S * 2*L*H_kv*D * k   the sampler's KV cache, B = train.batch_size rows
              + B * V * 4 * 2            (P*G per rank); fp32 logits and probabilities of a step
    training    M * L * A * e            activations kept for backward over M tokens of one
              + 2**23 * 4                micro-batch (train.micro_batch_size rows of S tokens;
                                         a shared prefix counts each group's prompt once; or
                                         train.micro_batch_tokens, at least one row or group),
                                         A = 2C + 2H*D + 2H_kv*D + 3I per token and layer (with
                                         gradient checkpointing C, plus one layer's A, plus
                                         2*H_kv*D per shared prompt token and layer); one
                                         32 MiB fp32 tile of the fused log-prob kernel
    evaluation  as rollout with B = eval.batch_size (x eval.k in the pipeline) and S = prompt
                + the evaluation's budget

    total = weights + reference + optimizer + producer + max(rollout, training, evaluation)

With rollout.async on and a producer thread (rollout.ranks: 0), sampling runs while training
does: producer = the rollout part above + N_t * 4 * (k + 2) (the producer's copy of the
trainable weights and up to k + 1 published snapshots, k = rollout.max_staleness), and the
rollout part leaves the max; on trainer ranks of a job with producer ranks nothing samples
(rollout = 0). Otherwise producer = 0.

Under train.parallel: fsdp with W ranks, weights, reference and optimizer are each rank's 1/W
shard; a rollout and an evaluation gather the whole weights (+ weights * (W - 1) / W), and a
training pass gathers the root (embeddings, head, final norm) and one block at a time.

S counts the prompt at data.max_prompt_len (capped by the context) plus the completion budget:
the estimate is of the worst case the settings allow, and it leaves out allocator slack and
framework overhead. It compares with the free CUDA memory of the run's device, or with
MemAvailable of /proc/meminfo on CPU (times the world size: a CPU torchrun job's ranks share
it); where neither can be read the check is skipped. When the estimate is too pessimistic for
your data (short prompts), lower data.max_prompt_len to fit them or set
train.skip_memory_check: true.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from grpo.config import Config, default_total_tokens
from grpo.errors import GrpoError
from grpo.models import Decoder, ModelConfig
from grpo.models.decoder import meta_decoder
from grpo.precision import Precision
from grpo.settings import ConfigError

GENERATED_DATASETS = ("minimath",)  # made on the fly: a huge size allocates or loops
GENERATED_ROWS_MAX = 100_000  # ~2 s and ~250 MiB of minimath
LOGPROB_TILE_BYTES = 2**23 * 4  # kernels/grpo_kernels/reference.py default_blocks: one fp32 tile
_GIB = 2**30


class PreflightError(ConfigError):
    """A setting that cannot work with this model or machine; the message names the field."""


@dataclass(frozen=True)
class MemoryEstimate:
    """The parts of a run's estimated peak memory, in bytes (see the module docstring)."""

    weights: int
    reference: int
    optimizer: int
    rollout: int
    training: int
    evaluation: int
    producer: int = 0  # asynchronous rollouts in the trainer's process (rollout.async)

    @property
    def total(self) -> int:
        return (
            self.weights
            + self.reference
            + self.optimizer
            + self.producer
            + max(self.rollout, self.training, self.evaluation)
        )


@dataclass(frozen=True)
class Evaluation:
    """One kind of evaluation a run does: its token budget and rows per sampler call."""

    budget: int
    rows: int
    field: str  # the setting to name when the budget does not fit


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
    mc, source = read_model_config(cfg.model.path)
    ctx = mc.max_position_embeddings
    rollout_field, rollout_budget = _rollout_budget(cfg, kind)
    evaluations = _evaluations(cfg, kind, pipeline)
    check(check_budget, rollout_budget, ctx, rollout_field, source)
    for ev in evaluations:
        check(check_budget, ev.budget, ctx, ev.field, source)
    meta = meta_decoder(mc)
    check(check_lora, cfg, meta)
    check(check_generated_sizes, cfg, pipeline)
    if not problems and not cfg.train.skip_memory_check:
        dev = torch.device(device) if device is not None else _resolve(cfg.model.device)
        estimate = estimate_memory(cfg, mc, kind, evaluations, meta, world_size)
        check(check_memory, estimate, dev, world_size, _memory_fields(cfg))
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


# --------------------------------------------------------------------------- token budgets


def eval_budget(cfg: Config, with_env: bool) -> int:
    """New tokens an evaluation may add to a prompt: eval.max_new_tokens (default
    rollout.max_new_tokens), or with a multi-turn environment the trajectory's budget."""
    n = cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens
    env = cfg.eval.env or cfg.rollout.env
    if not with_env or env == "single_turn":
        return n
    r = cfg.rollout
    return r.max_total_tokens or default_total_tokens(n, r.max_turns, r.max_obs_tokens)


def _rollout_budget(cfg: Config, kind: str) -> tuple[str, int]:
    """(field, new tokens per prompt) of the training data: GRPO's rollout budget, SFT's
    completion limit."""
    r = cfg.rollout
    if kind == "sft" or not r.multi_turn:
        return "rollout.max_new_tokens", r.max_new_tokens
    if r.max_total_tokens is not None:
        return "rollout.max_total_tokens", r.max_total_tokens
    return f"rollout.max_new_tokens (x rollout.max_turns {r.max_turns} + observations)", (
        r.total_tokens
    )


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
            field, budget = _rollout_budget(cfg, kind)
            check_rows_fit(rows, ctx, budget, field, where)
    if eval_rows:
        budget = eval_budget(cfg, kind == "grpo" or pipeline)
        where = f"{data.dataset!r} ({data.eval_split})"
        check_rows_fit(eval_rows, ctx, budget, "eval.max_new_tokens", where)


# --------------------------------------------------------------------------- notices


def start_notices(
    cfg: Config, kind: str = "grpo", *, pipeline: bool = False, tokenizer=None
) -> list[str]:
    """The limits and mismatches a run states once before it starts (each one line; nothing
    is refused): `turn_budget_notices` and `grpo.run.preflight.eval_fit_notice`. `grpo train` logs
    them as warnings on rank 0 once the tokenizer is loaded; without `tokenizer` the template's
    glue is the estimate `default_total_tokens` uses (OBS_GLUE_TOKENS), so a config-only check
    may state fewer.

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
    return out + [n for n in (fit, same) if n]


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


# --------------------------------------------------------------------------- LoRA and data


def _lora_layers(cfg: Config, meta: Decoder) -> dict[str, nn.Linear]:
    """The linear layers lora.targets select (PEFT's rule, as `apply_lora`)."""
    from grpo.lora.layers import _matches

    return {
        name: m
        for name, m in meta.named_modules()
        if type(m) is nn.Linear and _matches(name, cfg.lora.targets)
    }


def check_lora(cfg: Config, meta: Decoder) -> None:
    """lora.targets select a layer and lora.rank fits the narrowest selected one (a new
    adapter only: one loaded from lora.adapter brings its own rank)."""
    if not cfg.lora.enabled or cfg.lora.adapter:
        return
    layers = _lora_layers(cfg, meta)
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


def estimate_memory(
    cfg: Config,
    mc: ModelConfig,
    kind: str,
    evaluations: Sequence[Evaluation] = (),
    meta: Decoder | None = None,
    world_size: int = 1,
) -> MemoryEstimate:
    """The run's estimated peak memory by part, per rank (the formula is in the module
    docstring).

    Args:
        cfg: the run's config.
        mc: the checkpoint's config.
        kind: "grpo" or "sft".
        evaluations: the run's evaluations (budget and rows).
        meta: the model on the meta device (built from `mc` if not given).
        world_size: ranks of the job (train.parallel: fsdp shards over them).
    """
    meta = meta if meta is not None else meta_decoder(mc)
    prec = Precision.from_config(cfg.model, training=False)  # the dtypes the run will use
    e = prec.param_dtype.itemsize
    n_params = sum(p.numel() for p in meta.parameters())  # a tied head counts once
    weights = n_params * e
    if cfg.lora.enabled:
        layers = _lora_layers(cfg, meta)
        n_train = sum(cfg.lora.rank * (m.in_features + m.out_features) for m in layers.values())
        optimizer = n_train * 4 * 4  # float32 LoRA weights, their gradients, two AdamW moments
    else:
        n_train = n_params
        weights = n_params * 4  # every weight trains: float32 master weights
        optimizer = n_params * 4 * 3
    full_ref = kind == "grpo" and not cfg.lora.enabled
    needs_ref = cfg.loss.needs_reference or cfg.log.kl_every > 0
    reference = n_params * e if full_ref and needs_ref else 0

    ctx = mc.max_position_embeddings
    L, C, I = mc.num_hidden_layers, mc.hidden_size, mc.intermediate_size  # noqa: E741
    H, H_kv, D = mc.num_attention_heads, mc.num_key_value_heads, mc.head_dim

    def prompt(budget: int) -> int:
        return max(1, min(cfg.data.max_prompt_len, ctx - budget))

    kv = prec.kv_dtype.itemsize

    def sampling(rows: int, budget: int) -> int:
        return sampling_bytes(mc, rows, prompt(budget) + budget, kv)

    _, budget = _rollout_budget(cfg, kind)
    rollout = sampling(cfg.train.batch_size, budget) if kind == "grpo" else 0
    mb = cfg.train.micro_batch_size or cfg.train.batch_size
    groups = cfg.shared_prefix_groups if kind == "grpo" else None
    prompt_rows = mb // groups if groups else mb  # a shared prefix runs once per group
    tokens = prompt_rows * prompt(budget) + mb * budget  # M
    if cfg.train.micro_batch_tokens is not None:  # packed micro-batches of at most this many
        unit = prompt(budget) + (groups or 1) * budget  # but a longer row or group runs alone
        tokens = max(cfg.train.micro_batch_tokens, unit)
    per_layer = 2 * C + 2 * H * D + 2 * H_kv * D + 3 * I  # A
    act = prec.compute_dtype.itemsize  # activations are bf16 under autocast
    if cfg.model.gradient_checkpointing:
        activations = tokens * (L * C + per_layer) * act
        if groups:  # the shared prompt's keys and values stay for the recompute
            activations += prompt_rows * prompt(budget) * L * 2 * H_kv * D * act
    else:
        activations = tokens * L * per_layer * act
    training = activations + LOGPROB_TILE_BYTES
    evaluation = max((sampling(ev.rows, ev.budget) for ev in evaluations), default=0)
    if cfg.train.parallel == "fsdp" and world_size > 1:
        whole = weights
        weights, reference, optimizer = (x // world_size for x in (weights, reference, optimizer))
        gathered = whole - weights  # what a rollout or an evaluation adds to this rank's shard
        rollout = rollout + gathered if rollout else 0
        evaluation = evaluation + gathered if evaluation else 0
        per_param = whole // max(n_params, 1)
        root = sum(p.numel() for n, p in meta.named_parameters() if not n.startswith("layers."))
        block = sum(p.numel() for p in meta.layers[0].parameters())
        training += (root + block) * per_param  # gathered while a training pass runs them
    producer = 0
    if kind == "grpo" and cfg.rollout.asynchronous:
        if cfg.rollout.ranks == 0:  # sampling alongside training, on a copy + snapshots
            producer = rollout + n_train * 4 * (cfg.rollout.max_staleness + 2)
        rollout = 0  # (producer ranks sample; these trainer ranks do not)
    return MemoryEstimate(
        weights=weights,
        reference=reference,
        optimizer=optimizer,
        rollout=rollout,
        training=training,
        evaluation=evaluation,
        producer=producer,
    )


def sampling_bytes(mc: ModelConfig, rows: int, tokens: int, e: int) -> int:
    """The sampler's memory for `rows` rows of `tokens` positions: the KV cache (keys and
    values of every layer) and one decode step's fp32 logits and probabilities (rows, V)."""
    kv_per_token = 2 * mc.num_hidden_layers * mc.num_key_value_heads * mc.head_dim * e
    return rows * tokens * kv_per_token + rows * mc.vocab_size * 4 * 2


def available_memory(device: torch.device) -> tuple[int | None, str]:
    """(bytes free for the run, where that was read): free CUDA memory of `device`, else
    MemAvailable of /proc/meminfo; (None, why) when neither can be read."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free), f"free on {device}"
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "MemAvailable in /proc/meminfo"
    except OSError:
        pass
    return None, "no /proc/meminfo"


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


def _memory_fields(cfg: Config) -> dict[str, str]:
    """The setting that sizes each part of the estimate."""
    return {
        "weights": "model.dtype" if cfg.model.dtype == "float32" else "model.path",
        "reference": "lora.enabled",
        "optimizer": "lora.rank" if cfg.lora.enabled else "lora.enabled",
        "rollout": "train.batch_size",
        "training": "train.micro_batch_size",
        "evaluation": "eval.batch_size",
        "producer": "rollout.max_staleness",
    }


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

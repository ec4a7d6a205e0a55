"""Run configuration: frozen dataclasses per concern, YAML + dotted overrides, strict keys.

    cfg = load_config("configs/tiny_ci.yaml", ["optim.lr=1e-5", "rollout.temperature=0.7"])

Unknown keys fail and list the valid ones; every validation message names the dotted field.
Model architecture is never configured here: it comes from the checkpoint's config.json.

Only the run's config lives here: the dataclasses, their defaults, load / save / overrides,
and what a value alone can say: types, ranges and rules across fields. The names a config gives
(log-prob kernel, rollout strategy, estimator, policy loss, KL estimator, trained modules) are
resolved in their registries by `grpo.checks.check_config`, which every command runs right
after `load_config`: this module imports no registry (tests/test_layers.py). The typed-settings
framework that reads the dataclasses (`build_settings`, `Settings`, `setting`, the checks,
`ConfigError`) is `grpo.settings`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

import yaml

from grpo.errors import GrpoError
from grpo.io import read_text, write_text
from grpo.plugins import load_plugins
from grpo.settings import (
    ConfigError,
    build_settings,
    coerce,
    require,
    setting,
    setting_key,
    type_hints,
)

log = logging.getLogger(__name__)

# The longest accepted timeout: beyond a week a number is a typo, not a setting (and
# torch.distributed's timedelta overflows on inf).
MAX_TIMEOUT_S = 7 * 24 * 3600.0


def _check_seconds(value: float | None, key: str, nullable: bool = False) -> None:
    if value is None and nullable:
        return
    ok = isinstance(value, int | float) and math.isfinite(value) and 0 < value <= MAX_TIMEOUT_S
    extra = " or null" if nullable else ""
    require(ok, key, f"must be > 0 and at most {MAX_TIMEOUT_S:.0f} (seconds){extra}, got {value}")


@dataclass(frozen=True)
class ModelSourceConfig:
    """Which checkpoint to train and how to hold it."""

    path: str = ""  # local HF-format directory or hub id
    tokenizer: str | None = None  # default: the model path
    adapter: str | None = None  # a LoRA adapter merged into the weights at load (e.g. SFT's)
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: str = "auto"  # auto: cuda when available, else cpu
    gradient_checkpointing: bool = False
    autocast_bf16: bool = False  # bf16 autocast of forward passes (GPU)
    # lm_head operands in the sampler and the trainer alike: float32 (exact) | tf32 (TF32
    # matmuls on CUDA, float32 on a CPU) | bf16 (fp32 accumulation); docs/precision.md
    head_precision: Literal["float32", "tf32", "bf16"] = "float32"
    # the fused log-prob kernel of the trainer's passes: auto (triton on CUDA, chunked torch
    # elsewhere) | naive | chunked | triton | a registered name | package.module:function
    # (docs/extending.md, "Log-prob kernels")
    logprob_impl: str = "auto"

    def __post_init__(self):
        require(bool(self.path), "model.path", "is required (a local directory or a hub id)")


@dataclass(frozen=True)
class LoRAConfig:
    """Low-rank adapters; `enabled: false` means full fine-tuning."""

    enabled: bool = True
    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    adapter: str | None = None  # start from this adapter directory

    def __post_init__(self):
        require(self.rank > 0, "lora.rank", f"must be > 0, got {self.rank}")
        require(self.alpha > 0, "lora.alpha", f"must be > 0, got {self.alpha}")
        require(0 <= self.dropout < 1, "lora.dropout", f"must be in [0, 1), got {self.dropout}")
        require(len(self.targets) > 0, "lora.targets", "must name at least one module")


@dataclass(frozen=True)
class DataConfig:
    """Where prompts come from and how they are rendered."""

    dataset: str = "minimath"  # gsm8k | minimath | a name given to register_dataset
    source: str | None = None  # gsm8k: hub id (default openai/gsm8k) or a local path
    split: str = "train"
    eval_split: str = "test"
    max_samples: int | None = None
    eval_samples: int = 64
    system_prompt: str | None = None
    enable_thinking: bool | None = None
    max_prompt_len: int = 512
    difficulty: int = 0  # minimath only
    seed: int = 0  # minimath only: which problems

    def __post_init__(self):
        require(self.max_prompt_len > 0, "data.max_prompt_len", "must be > 0")
        if self.max_samples is not None:
            require(self.max_samples > 0, "data.max_samples", "must be > 0")
        require(self.eval_samples >= 0, "data.eval_samples", "must be >= 0")


@dataclass(frozen=True)
class RewardConfig:
    """One reward function with its weight: r = sum_k weight_k * reward_k."""

    name: str  # registered name or package.module:function (required: never guessed)
    weight: float = 1.0
    kwargs: dict = field(default_factory=dict)
    # Most seconds one call (the whole batch) may take; longer fails the step naming the
    # function, so a reward that never returns cannot hang the run. The call runs in a worker
    # thread, abandoned (still running) on a timeout. null: no limit, called in the caller's
    # thread (for a function that must run in the main thread, e.g. to set signal handlers).
    timeout_s: float | None = 300.0

    def __post_init__(self):
        _check_seconds(self.timeout_s, "rewards[].timeout_s", nullable=True)

    @property
    def spec(self) -> dict:
        """What `grpo.rewards.build_rewards` takes: name, weight, kwargs and timeout_s."""
        spec = {"name": self.name, "weight": self.weight, **self.kwargs}
        if self.timeout_s is not None:
            spec["timeout_s"] = self.timeout_s
        return spec


def default_total_tokens(max_new_tokens: int, max_turns: int, max_obs_tokens: int) -> int:
    """A trajectory's completion-region budget: every turn at its limit plus an observation
    (and the template's glue around it, 16 tokens) between each two."""
    return max_turns * max_new_tokens + (max_turns - 1) * (max_obs_tokens + 16)


@dataclass(frozen=True)
class ModuleConfig:
    """A module trained beside the policy (grpo/modules/module_set.py, docs/extending.md)."""

    name: str  # registered name or package.module:factory (the factory makes the module)
    kwargs: dict = field(default_factory=dict)  # the factory's keyword arguments
    optim: dict = field(default_factory=dict)  # its AdamW and schedule: optim's keys
    label: str | None = None  # its name in metrics and checkpoints (default: from `name`)

    @property
    def key(self) -> str:
        """The name metrics and checkpoints use: `label`, else the factory's name."""
        return self.label or self.name.rsplit(":", 1)[-1].rsplit(".", 1)[-1]

    def __post_init__(self):
        require(isinstance(self.name, str) and bool(self.name), "modules[].name", "must be a name")
        if self.label is not None:
            ok = isinstance(self.label, str) and re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", self.label)
            want = "must be 1-64 characters of [A-Za-z0-9_.-]"
            require(bool(ok), "modules[].label", f"{want}, got {self.label!r}")
        known = {f.name for f in fields(OptimConfig)}
        for k in self.optim:
            require(
                k in known,
                f"modules[].optim.{k}",
                f"unknown key; valid keys: {', '.join(sorted(known))}",
            )
        try:
            OptimConfig(**self.optim)
        except ConfigError as e:
            raise ConfigError(f"modules[].{e}", field=f"modules[].{e.field}") from None


@dataclass(frozen=True)
class RolloutConfig:
    """Sampling of G completions per prompt."""

    group_size: int = 4
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    # Compile the sampler's decode step (torch.compile, static shapes): on | off | auto (on
    # CUDA, single-turn, where it pays; eager on a CPU, where per-shape compiles cost more than
    # they save; falls back to eager if compiling fails; GRPO_COMPILE=0 in the environment turns
    # auto off). docs/sampler.md.
    compile: Literal["auto", "on", "off"] = "auto"
    # Decode at most this many rows of a rollout at once; as rows finish, waiting rows take
    # their slots (continuous refill, single-turn; docs/sampler.md). 0 = every row at once.
    max_rows: int = 0
    # Multi-turn (agentic) rollouts: an environment answers each model turn (docs/agentic.md).
    env: str = "single_turn"  # single_turn | calculator | a registered name | package.module:Class
    env_kwargs: dict = field(default_factory=dict)
    # How a step's prompts become its scored batch (docs/extending.md, "Rollout strategies"):
    # default | a registered name | package.module:function, with its keyword arguments
    strategy: str = "default"
    strategy_kwargs: dict = field(default_factory=dict)
    max_turns: int = 4  # model turns per trajectory (env other than single_turn)
    max_total_tokens: int | None = None  # completion-region budget; default: see total_tokens
    max_obs_tokens: int = 64  # most tokens of one observation's content (longer ones are cut)
    # discount per turn of multi-turn returns: return = sum_k d^k r_k (+ d^(K-1) R_final)
    turn_discount: float = 1.0
    dynamic_sampling: bool = False  # DAPO: drop zero-variance groups and sample more prompts
    max_sampling_rounds: int = 3  # sampling rounds per step with dynamic_sampling
    turn_end_tokens: tuple[str, ...] = ("</tool_call>",)  # also end a turn (if single tokens)
    # Most seconds one environment call (start() or step() of one trajectory) may take; longer
    # fails the rollout naming the environment, the trajectory and turn (it runs in a worker
    # thread, abandoned on a timeout). null: no limit, called in the sampler's thread.
    env_timeout_s: float | None = 60.0
    # Asynchronous rollouts (docs/async.md): a producer samples batch j with the policy of
    # update max(0, j - max_staleness) while the trainer updates; off = generate, then train.
    async_: Literal["off", "on"] = setting("off", key="async")
    max_staleness: int = 1  # k: a batch is sampled by a policy exactly min(j, k) updates old
    ranks: int = 0  # under torchrun: this many (last) ranks generate, the others train; 0 =
    # colocated (every rank trains and runs a producer thread on its own copy of the policy)
    async_timeout_s: float = 600.0  # the trainer waits this long for a batch, then fails

    @property
    def asynchronous(self) -> bool:
        return self.async_ == "on"

    @property
    def multi_turn(self) -> bool:
        return self.env != "single_turn"

    @property
    def total_tokens(self) -> int:
        """The completion-region budget of a trajectory: max_total_tokens, or by default every
        turn at its limit plus an observation between each two."""
        if self.max_total_tokens is not None:
            return self.max_total_tokens
        if not self.multi_turn:
            return self.max_new_tokens
        return default_total_tokens(self.max_new_tokens, self.max_turns, self.max_obs_tokens)

    def __post_init__(self):
        require(self.group_size >= 2, "rollout.group_size", f"must be >= 2, got {self.group_size}")
        require(self.max_turns >= 1, "rollout.max_turns", f"must be >= 1, got {self.max_turns}")
        require(self.max_obs_tokens >= 1, "rollout.max_obs_tokens", "must be >= 1")
        require(
            0 < self.turn_discount <= 1,
            "rollout.turn_discount",
            f"must be in (0, 1], got {self.turn_discount}",
        )
        require(self.max_sampling_rounds >= 1, "rollout.max_sampling_rounds", "must be >= 1")
        if self.max_total_tokens is not None:
            require(
                self.max_total_tokens >= self.max_new_tokens,
                "rollout.max_total_tokens",
                f"must be >= rollout.max_new_tokens ({self.max_new_tokens})",
            )
        require(isinstance(self.env, str) and bool(self.env), "rollout.env", "must be a name")
        require(self.max_new_tokens > 0, "rollout.max_new_tokens", "must be > 0")
        require(
            self.max_rows >= 0,
            "rollout.max_rows",
            f"must be >= 0 (0 = every row at once), got {self.max_rows}",
        )
        require(self.temperature >= 0, "rollout.temperature", "must be >= 0")
        require(self.top_k >= 0, "rollout.top_k", "must be >= 0 (0 = off)")
        require(0 < self.top_p <= 1, "rollout.top_p", f"must be in (0, 1], got {self.top_p}")
        require(0 <= self.min_p < 1, "rollout.min_p", f"must be in [0, 1), got {self.min_p}")
        require(
            self.max_staleness >= 0,
            "rollout.max_staleness",
            f"must be >= 0, got {self.max_staleness}",
        )
        require(self.ranks >= 0, "rollout.ranks", f"must be >= 0, got {self.ranks}")
        require(
            self.ranks == 0 or self.asynchronous,
            "rollout.ranks",
            f"{self.ranks} producer ranks need rollout.async: on",
        )
        _check_seconds(self.async_timeout_s, "rollout.async_timeout_s")
        _check_seconds(self.env_timeout_s, "rollout.env_timeout_s", nullable=True)
        require(
            isinstance(self.strategy, str) and bool(self.strategy),
            "rollout.strategy",
            "must be a name",
        )


@dataclass(frozen=True)
class LossConfig:
    """The GRPO objective and its variants (see docs/algorithm.md).

    advantage / policy_loss / kl_estimator name a registered function (`grpo.algo`) or a
    ``package.module:function``; their *_kwargs are passed to it as keyword arguments.
    """

    advantage: str = "grpo"  # grpo | dr_grpo | batch_std | rloo | opo | reinforce_pp | ...
    advantage_kwargs: dict = field(default_factory=dict)
    policy_loss: str = "clip"  # clip | gspo | gspo_token | cispo | gmpo | sapo | ...
    policy_loss_kwargs: dict = field(default_factory=dict)
    beta: float = 0.04  # KL coefficient in the loss; 0 skips the reference model entirely
    kl_estimator: str = "k3"  # k1 | k2 | k3 | a registered name
    kl_in_reward: float = 0.0  # > 0: subtract this * KL_t from the token rewards (REINFORCE++)
    token_discount: float = 1.0  # per token, of token rewards in returns (reinforce_pp, gae)
    gae_lambda: float = 0.95  # GAE's lambda (advantage: gae, PPO with a critic)
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2  # > epsilon_low is DAPO's clip-higher
    dual_clip: float | None = None  # c > 1: bound -A*rho at -c*A for A < 0
    entropy_coef: float = 0.0  # > 0: subtract entropy_coef * H_t from the loss (a bonus)
    tis_cap: float | None = None  # truncated IS: weight by min(pi_old_trainer / pi_sampler, cap)
    # pi_old of the ratio: the sampler's log-probs (free), or a no-grad trainer forward before
    # the update (verl's default; exact under bf16 autocast or sampler/trainer kernel mismatch).
    # tis_cap implies recompute. docs/algorithm.md "On-policy numerics".
    old_logprobs: Literal["sampler", "recompute"] = "sampler"
    log_ratio_clamp: float | None = 20.0  # |log ratio| and |ref - logp| bound (exp stays finite)
    kl_clamp: float | None = 10.0  # |KL_t| bound (verl's low_var_kl)
    aggregation: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"] = (
        "token_mean"
    )
    advantage_eps: float = 1e-4
    mask_truncated_completions: bool = False
    num_iterations: int = 1  # mu: updates per rollout batch

    def __post_init__(self):
        require(self.beta >= 0, "loss.beta", f"must be >= 0, got {self.beta}")
        require(self.epsilon_low > 0, "loss.epsilon_low", f"must be > 0, got {self.epsilon_low}")
        require(self.epsilon_high > 0, "loss.epsilon_high", f"must be > 0, got {self.epsilon_high}")
        require(self.epsilon_low < 1, "loss.epsilon_low", "must be < 1")
        if self.dual_clip is not None:
            require(self.dual_clip > 1, "loss.dual_clip", f"must be > 1, got {self.dual_clip}")
        require(self.advantage_eps > 0, "loss.advantage_eps", "must be > 0")
        require(self.num_iterations >= 1, "loss.num_iterations", "must be >= 1")
        require(self.kl_in_reward >= 0, "loss.kl_in_reward", f"must be >= 0: {self.kl_in_reward}")
        require(
            0 < self.token_discount <= 1,
            "loss.token_discount",
            f"must be in (0, 1], got {self.token_discount}",
        )
        require(
            0 <= self.gae_lambda <= 1,
            "loss.gae_lambda",
            f"must be in [0, 1], got {self.gae_lambda}",
        )
        require(self.entropy_coef >= 0, "loss.entropy_coef", "must be >= 0")
        if self.tis_cap is not None:
            require(
                self.tis_cap >= 1, "loss.tis_cap", f"must be >= 1 (or null), got {self.tis_cap}"
            )
        for name in ("log_ratio_clamp", "kl_clamp"):
            value = getattr(self, name)
            if value is not None:
                require(value > 0, f"loss.{name}", f"must be > 0 (or null), got {value}")
        for name in ("advantage", "policy_loss", "kl_estimator"):
            value = getattr(self, name)
            require(isinstance(value, str) and bool(value), f"loss.{name}", "must be a name")

    @property
    def needs_reference(self) -> bool:
        """Whether every step needs reference log-probs (KL in the loss or in the reward)."""
        return self.beta > 0 or self.kl_in_reward > 0


@dataclass(frozen=True)
class OptimConfig:
    """AdamW with warmup + cosine (or constant) learning rate."""

    lr: float = 1e-5
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    schedule: Literal["cosine", "constant"] = "cosine"
    warmup_ratio: float = 0.0
    min_lr_ratio: float = 0.0
    max_grad_norm: float | None = 1.0

    def __post_init__(self):
        # finite first: inf passes `> 0` and would make every update non-finite
        for name in ("lr", "weight_decay", "eps", "max_grad_norm", "betas"):
            values = getattr(self, name)
            for v in values if isinstance(values, tuple) else (values,):
                ok = v is None or math.isfinite(v)
                require(ok, f"optim.{name}", f"must be a finite number, got {values}")
        require(self.lr > 0, "optim.lr", f"must be > 0, got {self.lr}")
        # AdamW moves every weight by about lr per update (|m/sqrt(v)| ~ 1): above 1 one update
        # outgrows the weights themselves (fine-tuning uses 1e-7 .. 1e-3) and they soon overflow
        require(
            self.lr <= 1,
            "optim.lr",
            f"must be <= 1 (AdamW moves every weight by about lr per update), got {self.lr:g}",
        )
        require(self.weight_decay >= 0, "optim.weight_decay", "must be >= 0")
        # decoupled decay multiplies the weights by 1 - lr * weight_decay every update
        factor = 1 - self.lr * self.weight_decay
        require(
            factor > 0,
            "optim.weight_decay",
            f"times optim.lr must be < 1 (each update multiplies the weights by 1 - lr * "
            f"weight_decay = {factor:g}), got {self.weight_decay:g}",
        )
        require(self.eps > 0, "optim.eps", f"must be > 0, got {self.eps}")
        ok = all(0 <= b < 1 for b in self.betas)
        require(ok, "optim.betas", f"must both be in [0, 1), got {list(self.betas)}")
        require(0 <= self.warmup_ratio < 1, "optim.warmup_ratio", "must be in [0, 1)")
        require(0 <= self.min_lr_ratio <= 1, "optim.min_lr_ratio", "must be in [0, 1]")
        if self.max_grad_norm is not None:
            require(self.max_grad_norm > 0, "optim.max_grad_norm", "must be > 0 (or null)")


@dataclass(frozen=True)
class TrainConfig:
    """Loop sizes, cadence and outputs (shared by `grpo sft` and `grpo train`).

    batch_size is per rank and per optimizer step: completions (P*G) for GRPO, examples for
    SFT. micro_batch_size rows go through one forward/backward; the rest is accumulation.
    stall_steps and stop_on_stall (GRPO only) watch for learning that silently stops.
    """

    output_dir: str = "runs/run"
    seed: int = 0
    max_steps: int = 100
    epochs: float | None = None  # SFT: if set, overrides max_steps
    batch_size: int = 8
    micro_batch_size: int | None = None  # default: batch_size
    log_every: int = 1
    eval_every: int = 0  # 0 = only at the end
    save_every: int = 0  # 0 = only at the end
    sample_every: int = 0  # print a sample completion every N steps (0 = never)
    keep_last: int = 2
    max_nonfinite_steps: int = 3  # stop after this many consecutive non-finite updates
    # GRPO: refuse a step whose first-pass log-probs (before any update: the policy that
    # sampled) differ from the sampler's by more than this many nats per counted token on
    # average (a log-prob kernel that is wrong, not rounding: bf16 gaps are ~1e-2; docs/safety.md
    # says where it is not checked); 0 or null: not checked
    max_logprob_gap: float | None = 0.5
    # GRPO learning health (grpo/run/health.py, docs/safety.md): warn (rank 0) when, over this
    # many consecutive steps, most completions are truncated with no signal left, every group's
    # rewards are equal, the gradient norm is 0, the trainable weights do not move, or the
    # reward mean is flat; the run summary's `health` lists each. 0 turns the checks off. When
    # the rewards declare bounds (grpo/rewards/bounds.py) and every group sits at the highest
    # reward for as many steps, the task is `solved` instead (INFO; summary `converged`).
    stall_steps: int = 10
    # End the run when one of those checks fires: a stall saves the step's checkpoint, names
    # the resume command and exits 2; a solved task ends as at max_steps (checkpoint, final/,
    # exit 0, "converged at step N").
    stop_on_stall: bool = False
    # torchrun jobs: a collective that waits longer than this fails the job, each rank printing
    # one line naming itself, the phase and the step (docs/distributed.md)
    dist_timeout_s: float = 600.0
    # the longest one call of a rollout strategy or of a trained module's `loss` may run (in
    # the trainer's main thread; null: no bound); past it the run stops with one line naming
    # it and the rank (a hang otherwise shows nothing in a single process)
    plugin_timeout_s: float | None = 3600.0
    progress: bool = True
    # GRPO: run each group's prompt once in the training passes (reference, old log-probs,
    # update) and repeat its keys/values to the group's rows: the full-row forward's numbers
    # (tests/test_shared_prefix.py) for fewer tokens. on | off | auto (on when every
    # micro-batch holds whole groups). Works with model.gradient_checkpointing: both passes
    # checkpoint every block (tests/test_attention.py). docs/benchmarks.md.
    shared_prefix: Literal["auto", "on", "off"] = "auto"
    # Sequence packing: the training passes (reference, old log-probs, update; SFT's too) run
    # each micro-batch's real tokens on one token axis, no pad token, attention kept inside
    # each row (grpo/models/varlen.py); log-probs and gradients equal the padded forward's
    # (tests/test_packing.py). on | off | auto: on where measured faster (a CPU, and wherever
    # train.micro_batch_tokens is set; CUDA not measured yet: padded, docs/benchmarks.md).
    pack_sequences: Literal["auto", "on", "off"] = "auto"
    # With packing: micro-batches of at most this many real tokens (prompt + completion; a
    # group's prompt counted once when shared) instead of train.micro_batch_size rows. Whole
    # groups (shared prefix) or rows, consecutive, as even as they can be, the same number on
    # every rank; a row or group longer than this runs alone (one log line says so).
    micro_batch_tokens: int | None = None
    # GRPO under torchrun: after sampling, move whole groups between ranks so each runs about
    # as many real tokens (longest first to the emptiest rank, P groups each;
    # grpo/experience/balance.py). The global batch, and so the update, is the same either way.
    balance_ranks: bool = True
    # GRPO with trained modules (modules:): the first N steps update only the modules, not the
    # policy: PPO's critic warm-up (a fresh value head learns the returns before they steer the
    # policy; docs/algorithm.md "PPO with a critic")
    critic_warmup_steps: int = 0
    # The start-up check that the run's estimated memory fits (grpo/run/preflight.py); true
    # skips it, e.g. when the estimate is too pessimistic for short prompts (docs/safety.md).
    skip_memory_check: bool = False
    # torchrun jobs: ddp keeps a whole copy of weights, gradients and optimizer states on every
    # rank; fsdp shards them (torch FSDP2 `fully_shard`: each decoder block and the root), so
    # each rank holds about 1/N (docs/distributed.md). One process trains unsharded either way.
    parallel: Literal["ddp", "fsdp"] = "ddp"
    # fsdp: keep the sharded parameters, gradients and optimizer states in CPU memory
    # (`CPUOffloadPolicy`), moved to the device block by block
    fsdp_offload: bool = False

    def __post_init__(self):
        require(self.max_steps > 0, "train.max_steps", f"must be > 0, got {self.max_steps}")
        require(self.batch_size > 0, "train.batch_size", f"must be > 0, got {self.batch_size}")
        if self.epochs is not None:
            require(self.epochs > 0, "train.epochs", "must be > 0")
        mb = self.micro_batch_size
        if mb is not None:
            require(mb > 0, "train.micro_batch_size", "must be > 0")
            require(
                self.batch_size % mb == 0,
                "train.micro_batch_size",
                f"must divide train.batch_size ({self.batch_size}), got {mb}",
            )
        if self.micro_batch_tokens is not None:
            require(self.micro_batch_tokens > 0, "train.micro_batch_tokens", "must be > 0")
            require(
                mb is None, "train.micro_batch_tokens", "set it or train.micro_batch_size, not both"
            )
            require(
                self.pack_sequences != "off",
                "train.micro_batch_tokens",
                "cuts packed micro-batches: needs train.pack_sequences on or auto",
            )
        require(self.log_every >= 1, "train.log_every", f"must be >= 1, got {self.log_every}")
        for name in ("eval_every", "save_every", "sample_every"):
            require(getattr(self, name) >= 0, f"train.{name}", "must be >= 0")
        require(self.keep_last >= 1, "train.keep_last", "must be >= 1")
        require(self.max_nonfinite_steps >= 1, "train.max_nonfinite_steps", "must be >= 1")
        gap = self.max_logprob_gap
        require(
            gap is None or (math.isfinite(gap) and gap >= 0),
            "train.max_logprob_gap",
            f"must be a finite number >= 0 or null (0 and null: not checked), got {gap}",
        )
        require(self.stall_steps >= 0, "train.stall_steps", "must be >= 0 (0 = no checks)")
        require(self.critic_warmup_steps >= 0, "train.critic_warmup_steps", "must be >= 0")
        require(
            not self.stop_on_stall or self.stall_steps > 0,
            "train.stop_on_stall",
            "needs train.stall_steps > 0 (0 turns the checks off)",
        )
        _check_seconds(self.dist_timeout_s, "train.dist_timeout_s")
        _check_seconds(self.plugin_timeout_s, "train.plugin_timeout_s", nullable=True)
        out = str(self.output_dir).strip()
        require(
            out not in ("", ".", "./") and Path(out).expanduser().resolve() != Path("/"),
            "train.output_dir",
            f"must name a directory of its own for the run, got {out!r} (the run would write "
            "its checkpoints and final/ into the current directory or the root)",
        )
        require(
            self.parallel == "fsdp" or not self.fsdp_offload,
            "train.fsdp_offload",
            "needs train.parallel: fsdp (DDP keeps whole copies on every rank's device)",
        )


@dataclass(frozen=True)
class EvalConfig:
    """Held-out evaluation: greedy accuracy plus pass@k from k samples."""

    max_samples: int | None = 64
    max_new_tokens: int | None = None  # default: rollout.max_new_tokens
    k: int = 1
    temperature: float = 0.8  # for the k samples
    batch_size: int = 32
    env: str | None = None  # multi-turn evaluation episodes; None: the same as rollout.env
    # the evaluation environment's keyword arguments; None: rollout.env_kwargs when eval.env is
    # rollout.env, else none (e.g. SFT, whose rollout.env is single_turn, evaluating episodes)
    env_kwargs: dict | None = None
    sft_accuracy_threshold: float = 0.0  # pipeline: stop after SFT below this

    def __post_init__(self):
        require(self.k >= 1, "eval.k", "must be >= 1")
        require(self.batch_size >= 1, "eval.batch_size", "must be >= 1")
        require(0 <= self.sft_accuracy_threshold <= 1, "eval.sft_accuracy_threshold", "in [0, 1]")


@dataclass(frozen=True)
class LogConfig:
    """Where numbers go besides stdout and metrics.jsonl."""

    tensorboard: bool = False
    wandb: bool = False
    wandb_project: str = "grpo"
    # GRPO with loss.beta = 0 has no reference model; kl_every = N > 0 keeps one anyway and
    # measures KL(policy || reference) on every N-th step's batch, for the curves only (one
    # reference forward on those steps; the update is unchanged). With beta > 0 KL is
    # measured every step regardless.
    kl_every: int = 0

    def __post_init__(self):
        require(
            self.kl_every >= 0, "log.kl_every", f"must be >= 0 (0 = never), got {self.kl_every}"
        )


@dataclass(frozen=True)
class RewardModelConfig:
    """`grpo rm`: a Bradley-Terry reward model on preference pairs (grpo/train/rm.py,
    docs/rewards.md). Its data are data.dataset / split / max_samples (train) and
    data.eval_split / eval_samples (held-out pairs); the model starts from model.path."""

    # the longest pair side in tokens (prompt + completion): a longer one keeps the end of
    # its prompt (the completions are never cut); a completion longer than this is skipped
    max_length: int = 1024
    # loss += center_coef * mean((r_chosen + r_rejected)^2): keeps rewards centred on 0
    center_coef: float = 0.0
    # the pad id the model scores around (its last real token that is not this id, as
    # transformers' *ForSequenceClassification reads it) and its config.json names; None:
    # the tokenizer's pad token, else its eos
    pad_token_id: int | None = None

    def __post_init__(self):
        require(self.max_length > 1, "rm.max_length", f"must be > 1, got {self.max_length}")
        ok = math.isfinite(self.center_coef) and self.center_coef >= 0
        require(ok, "rm.center_coef", f"must be >= 0, got {self.center_coef}")
        if self.pad_token_id is not None:
            require(self.pad_token_id >= 0, "rm.pad_token_id", "must be >= 0 or null")


@dataclass(frozen=True)
class Config:
    """Everything one run needs."""

    model: ModelSourceConfig
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rewards: tuple[RewardConfig, ...] = (RewardConfig("accuracy"),)
    # modules trained beside the policy (a value head, a learned baseline): grpo/modules/
    modules: tuple[ModuleConfig, ...] = ()
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    log: LogConfig = field(default_factory=LogConfig)
    rm: RewardModelConfig = field(default_factory=RewardModelConfig)  # `grpo rm` only
    # Modules imported before the rest of the config is checked, so the names they register
    # (advantage, policy loss, KL, reward, environment) are valid in it: `package.module`, or
    # `package.module:function` (called with no arguments). grpo/plugins.py, docs/extending.md.
    plugins: tuple[str, ...] = ()

    # `rewards: []` is allowed when the estimator reads no rewards (grpo.checks)

    def check_grpo(self) -> Config:
        """The rules across fields only GRPO has (SFT configs need not follow them); returns
        self. The names a GRPO run resolves (its trained modules among them) are checked by
        `grpo.checks.check_config(cfg, "grpo")`, which calls this."""
        G = self.rollout.group_size
        mb = self.train.micro_batch_size or self.train.batch_size
        require(
            not (self.lora.enabled and self.lora.dropout > 0),
            "lora.dropout",
            f"must be 0 for GRPO (got {self.lora.dropout}): the sampler runs without dropout, so "
            "the trainer's first-pass ratio to it would not be 1 (SFT may use dropout)",
        )
        require(
            self.train.shared_prefix != "on" or mb % G == 0,
            "train.shared_prefix",
            f"'on' needs micro-batches of whole groups: train.micro_batch_size ({mb}) is not "
            f"divisible by rollout.group_size ({G})",
        )
        require(
            self.train.batch_size % G == 0,
            "train.batch_size",
            f"GRPO needs whole groups: {self.train.batch_size} is not divisible by "
            f"rollout.group_size ({G})",
        )
        require(
            self.train.parallel != "fsdp" or self.rollout.compile != "on",
            "rollout.compile",
            "'on' cannot run under train.parallel: fsdp (the sampler reads the gathered weights "
            "through FSDP's hooks, eagerly); set rollout.compile: auto or off",
        )
        require(
            not (self.rollout.asynchronous and self.train.parallel == "fsdp"),
            "rollout.async",
            "'on' cannot run under train.parallel: fsdp yet (a producer needs whole weights); "
            "use train.parallel: ddp",
        )
        require(
            not self.train.critic_warmup_steps or bool(self.modules),
            "train.critic_warmup_steps",
            "needs a module to train during the warm-up (modules:, e.g. [{name: critic}])",
        )
        require(
            self.train.critic_warmup_steps < self.train.max_steps,
            "train.critic_warmup_steps",
            f"({self.train.critic_warmup_steps}) must be below train.max_steps "
            f"({self.train.max_steps}): the policy would never be updated",
        )
        if self.loss.advantage == "gae":
            require(
                bool(self.modules),
                "loss.advantage",
                "'gae' needs a value model: add modules: [{name: critic}] (docs/algorithm.md)",
            )
            require(
                self.rollout.turn_discount == 1.0,
                "rollout.turn_discount",
                f"must be 1 with loss.advantage: gae ({self.rollout.turn_discount}): GAE "
                "discounts per token with loss.token_discount; a per-turn discount on top would "
                "discount twice",
            )
        return self

    @property
    def shared_prefix_groups(self) -> int | None:
        """G when the training passes share each group's prompt (train.shared_prefix), else
        None."""
        G = self.rollout.group_size
        mb = self.train.micro_batch_size or self.train.batch_size
        mode = self.train.shared_prefix
        if mode == "off" or (mb % G and self.train.micro_batch_tokens is None):
            return None  # token budgets cut whole groups
        return G


# --------------------------------------------------------------------------- loading


def _set_dotted(data: dict, dotted: str, value: Any) -> None:
    """Set data['a']['b'] = value for 'a.b', checking each key against the schema."""
    parts = dotted.split(".")
    cls: Any = Config
    node = data
    for i, key in enumerate(parts):
        prefix = ".".join(parts[:i])
        if not dataclasses.is_dataclass(cls):
            raise ConfigError(f"{prefix}: is not a section, cannot set {dotted!r}")
        keys = {setting_key(f): f.name for f in dataclasses.fields(cls)}
        names = list(keys)
        if key not in keys:
            where = f" of {prefix}" if prefix else ""
            raise ConfigError(
                f"{dotted}: unknown key; valid keys{where}: {', '.join(sorted(names))}",
                field=dotted,
            )
        if i == len(parts) - 1:
            node[key] = value
            return
        cls = type_hints(cls)[keys[key]]
        child = node.get(key)
        if not isinstance(child, dict):
            child = {}
            node[key] = child
        node = child


def parse_overrides(overrides: list[str] | None) -> list[tuple[str, Any]]:
    out = []
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like section.key=value")
        key, raw = item.split("=", 1)
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        out.append((key.strip(), value))
    return out


def load_config(
    path: str | Path | None = None,
    overrides: list[str] | None = None,
    base: dict | None = None,
    plugins: Sequence[str] = (),
) -> Config:
    """Read a YAML config, apply dotted overrides (values parsed as YAML), import its plugins,
    validate.

    Args:
        path: a YAML file, or None to start from `base` (or defaults).
        overrides: ["optim.lr=1e-5", "lora.targets=[q_proj,v_proj]", ...].
        base: a dict used instead of (or, with a path, under) the file's content.
        plugins: more plugins (the CLI's `--plugin`), added to the config's `plugins` (kept in
            the result, so a run's saved config imports them again).

    Returns:
        the frozen `Config`, its types and ranges checked. Raises `ConfigError` naming the
        dotted field on any problem (a plugin that fails to import: `plugins[i]: cannot import
        ...`). The installed entry-point plugins and then the config's `plugins` are imported
        before anything else is checked (grpo/plugins.py), so the names they register resolve
        in `grpo.checks.check_config(cfg)`, the check of the names that follows.
    """
    data: dict = json.loads(json.dumps(base)) if base else {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist")
        try:
            loaded = yaml.safe_load(read_text(p, "a YAML config")) or {}
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            problem = getattr(e, "problem", None) or "cannot be parsed"
            raise ConfigError(
                f"config file {str(p)!r} is not valid YAML{where}: {problem}"
            ) from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {str(p)!r} must hold a mapping at the top level")
        data.update(loaded)
    _drop_retired(data)
    _rename_moved(data)
    parsed = [(_moved_key(key), value) for key, value in parse_overrides(overrides)]
    for key, value in parsed:
        _set_dotted(data, key, value)
    _max_steps_wins(data, {key for key, _ in parsed})
    listed = coerce(data.get("plugins", []), tuple[str, ...], "plugins")
    data["plugins"] = [*listed, *(p for p in plugins if p not in listed)]
    try:  # first: loss, reward and environment names may be theirs
        load_plugins(data["plugins"])
    except GrpoError as e:
        raise ConfigError(str(e)) from None
    return build_settings(Config, data)


def _max_steps_wins(data: dict, overridden: set[str]) -> None:
    """A command-line `train.max_steps` wins over the config's `train.epochs` (which otherwise
    decides an SFT run's length), as in Hugging Face's Trainer; said in one line."""
    train = data.get("train")
    if "train.max_steps" not in overridden or "train.epochs" in overridden:
        return
    if isinstance(train, dict) and train.get("epochs") is not None:
        log.warning(
            "train.max_steps=%s (command line) wins over the config's train.epochs=%s",
            train.get("max_steps"),
            train["epochs"],
        )
        train["epochs"] = None


# Keys removed after 0.1.0 (docs/CHANGES.md) that every run directory of that release saved, as
# null, in its config.yaml: a null is dropped so those runs still load (eval, resume); any
# other value fails as an unknown key.
RETIRED = {"loss": ("advantage_scale", "importance_level")}


def _drop_retired(data: dict) -> None:
    for section, keys in RETIRED.items():
        node = data.get(section)
        for key in keys if isinstance(node, dict) else ():
            if key in node and node[key] is None:
                del node[key]


# Keys moved or renamed after 0.1.0 (docs/CHANGES.md): old key -> new key. Every run directory
# saved its config.yaml with the old names, so they keep loading: the value is carried to the
# new key (one line says so); a config holding both fails naming them.
RENAMED = {
    "loss.dynamic_sampling": "rollout.dynamic_sampling",
    "loss.max_sampling_rounds": "rollout.max_sampling_rounds",
    "loss.gamma": "loss.token_discount",
    "rollout.gamma": "rollout.turn_discount",
}


def _moved_key(dotted: str) -> str:
    """A dotted override's current key (a pipeline stage's prefix, e.g. `grpo.`, kept)."""
    for old, new in RENAMED.items():
        if dotted == old or dotted.endswith("." + old):
            log.warning("%s is now %s (renamed; the value is carried over)", old, new)
            return dotted[: len(dotted) - len(old)] + new
    return dotted


def _rename_moved(data: dict) -> None:
    for old, new in RENAMED.items():
        (old_section, old_key), (new_section, new_key) = old.split("."), new.split(".")
        node = data.get(old_section)
        if not isinstance(node, dict) or old_key not in node:
            continue
        target = data.setdefault(new_section, {})
        if not isinstance(target, dict):
            continue  # the section's own error names it
        if new_key in target:
            raise ConfigError(
                f"{old} and {new} are both set; {old} is the old name of {new}", field=new
            )
        log.warning("%s is now %s (renamed; the value is carried over)", old, new)
        target[new_key] = node.pop(old_key)


def config_to_dict(cfg) -> dict:
    """A plain dict (tuples as lists) that `load_config(base=...)` reads back to `cfg`."""

    def plain(x):
        if dataclasses.is_dataclass(x):
            return {setting_key(f): plain(getattr(x, f.name)) for f in dataclasses.fields(x)}
        if isinstance(x, (list, tuple)):
            return [plain(v) for v in x]
        if isinstance(x, dict):
            return {k: plain(v) for k, v in x.items()}
        return x

    return plain(cfg)


def save_config(cfg: Config, path: str | Path) -> Path:
    """Write the resolved config as YAML (beside a run's outputs)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text(path, yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
    return path

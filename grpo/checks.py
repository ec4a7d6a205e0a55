"""The checks of a loaded config that need the registries: every command runs them right after
`load_config`, before anything loads.

    cfg = check_config(load_config("configs/tiny_ci.yaml"), "grpo")

`grpo.config` holds types, ranges and rules across fields, and imports no registry; this module
resolves the names a config gives, with their keyword arguments, where they are registered:
`model.logprob_impl` (grpo_kernels), `rollout.strategy` (grpo.experience.strategies),
`loss.advantage` / `policy_loss` / `kl_estimator` (grpo.algo), and for GRPO `modules[i]`
(grpo.modules.module_set) and GRPO's own rules (`Config.check_grpo`). It sits above those
registries, so it lives at the core's top level.

Who runs it, right after loading: the trainers (`train_grpo`, `train_sft`, `train_rm`, so a
library user calling one gets the same checks; `grpo train` / `sft` / `rm` reach it that way),
`grpo config` (cli.check_before_model), the pipeline's stages, each sweep trial and the tool's
actions. Plugins are imported by `load_config`, so the names they register resolve here.
"""

from __future__ import annotations

import re

import grpo_kernels
from grpo.algo import check_algorithm
from grpo.algo.advantages import reads_rewards
from grpo.config import Config
from grpo.errors import GrpoError
from grpo.experience.strategies import check_strategy
from grpo.modules.module_set import check_trained_module
from grpo.settings import ConfigError

# the dotted field a registry's message starts with: "loss.advantage: unknown ..."
_FIELD = re.compile(r"[A-Za-z_][\w.\[\]]*(?=: )")


def check_config(cfg: Config, trainer: str | None = None) -> Config:
    """Resolve every name of `cfg` in its registry and check its keyword arguments; for GRPO
    also its trained modules and the rules only GRPO has.

    Args:
        cfg: a config from `load_config` (its types and ranges already checked, its plugins
            imported).
        trainer: "grpo" adds `modules[i]` (factory and kwargs) and `Config.check_grpo`; "sft",
            "rm" or None: the names every config gives (SFT and reward-model configs carry a
            rollout and a loss section too).

    Returns:
        `cfg`, so a caller writes `cfg = check_config(load_config(...))`.

    Raises:
        ConfigError: one line naming the dotted field (an unknown name lists the registered
            ones).
    """
    try:  # an unknown name or a path that does not import, naming the field
        grpo_kernels.get_logprob_impl(cfg.model.logprob_impl)
    except ValueError as e:
        raise ConfigError(f"model.logprob_impl: {e}", field="model.logprob_impl") from None
    r = cfg.rollout
    _named(check_strategy, r.strategy, r.strategy_kwargs, r.asynchronous)
    _named(check_algorithm, cfg.loss)
    if trainer == "grpo":
        for i, spec in enumerate(cfg.modules):  # an unknown factory or keyword, named
            _named(check_trained_module, spec, i)
        cfg.check_grpo()
        if not cfg.rewards:
            _check_no_rewards(cfg)
    return cfg


def _check_no_rewards(cfg: Config) -> None:
    """`rewards: []`: only with an estimator that drives learning without rewards (it names
    neither token_rewards nor scores: `grpo.algo.advantages.reads_rewards`), or an environment
    whose step rewards are the rewards; dynamic sampling would drop every group."""
    if not cfg.rollout.multi_turn and reads_rewards(cfg.loss.advantage):
        raise ConfigError(
            f"rewards: [] leaves loss.advantage {cfg.loss.advantage!r} nothing to learn from "
            "(it reads the rewards); add a reward, or use an estimator that reads none "
            "(e.g. distill with a teacher module)",
            field="rewards",
        )
    if cfg.rollout.dynamic_sampling and not cfg.rollout.multi_turn:
        raise ConfigError(
            "rollout.dynamic_sampling drops groups of equal rewards: with rewards: [] it "
            "would drop every group; set it to false",
            field="rollout.dynamic_sampling",
        )


def _named(check, *args) -> None:
    """`check(*args)`, its GrpoError as the ConfigError of a config field."""
    try:
        check(*args)
    except GrpoError as e:
        field = _FIELD.match(str(e))
        raise ConfigError(str(e), field=field.group() if field else None) from None


__all__ = ["check_config"]

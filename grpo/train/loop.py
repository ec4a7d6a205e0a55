"""The run lifecycle the SFT and GRPO loops share: resume lookup, optimizer and schedule,
restored state, run directory and metric logger at the start; checkpoints during; final
weights at the end. The loops keep only what differs (their batches and their updates)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpo.config import Config, config_to_dict
from grpo.distributed import barrier, gather_objects
from grpo.errors import GrpoError
from grpo.metrics import MetricLogger
from grpo.train.common import Policy, due, prepare_run_dir, save_final
from grpo.train.optim import build_optimizer, build_scheduler
from grpo.train.state import (
    TrainState,
    latest_checkpoint,
    load_checkpoint,
    rng_state,
    save_checkpoint,
)

log = logging.getLogger(__name__)


def resume_checkpoint(cfg: Config, resume: bool) -> Path | None:
    """The checkpoint `--resume` continues from (None without --resume); checked before any
    model is built so that a missing one fails at once."""
    if not resume:
        return None
    out_dir = Path(cfg.train.output_dir)
    ckpt = latest_checkpoint(out_dir)
    if ckpt is None:
        raise GrpoError(f"--resume: no checkpoint in {out_dir / 'checkpoints'}")
    return ckpt


@dataclass
class Run:
    """One training run's moving parts."""

    cfg: Config
    out_dir: Path
    params: list
    optimizer: Any
    scheduler: Any
    state: TrainState
    logger: MetricLogger

    def end_step(self, policy: Policy, dist, last: bool) -> None:
        """Checkpoint when due (every rank's RNG state, rank 0 writes), then wait for all."""
        cfg = self.cfg
        if due(self.state.step, cfg.train.save_every, last):
            rngs = gather_objects(rng_state(), dist)
            if dist.is_main:
                save_checkpoint(
                    self.out_dir, self.state, policy.model, self.optimizer, self.scheduler,
                    config_to_dict(cfg), cfg.train.keep_last, rng_states=rngs,
                )  # fmt: skip
        barrier(dist)  # nobody runs ahead of a checkpoint or an evaluation

    def finish(self, policy: Policy, dist, metrics: dict) -> dict:
        """Close the logger, write out_dir/final, and return the run's summary."""
        self.logger.close()
        final = (
            save_final(policy, self.out_dir, self.cfg) if dist.is_main else self.out_dir / "final"
        )
        barrier(dist)
        return {
            "output_dir": str(self.out_dir),
            "final": str(final),
            "step": self.state.step,
            **metrics,
        }


def start_run(
    cfg: Config, policy: Policy, dist, total_steps: int, ckpt: Path | None, resume: bool
) -> Run:
    """Optimizer and schedule over `total_steps` updates, the state restored from `ckpt`,
    then (inputs all checked by now) the run directory and the metric logger."""
    params = policy.trainable_parameters()
    optimizer = build_optimizer(params, cfg.optim)
    scheduler = build_scheduler(optimizer, total_steps, cfg.optim)
    state = TrainState()
    if ckpt is not None:
        state = load_checkpoint(ckpt, policy.model, optimizer, scheduler, rank=dist.rank)
        log.info("resumed from %s (step %d)", ckpt, state.step)
    out_dir = prepare_run_dir(cfg, resume, rank0=dist.is_main)
    logger = MetricLogger(
        out_dir, dist.is_main, cfg.log.tensorboard, cfg.log.wandb, cfg.log.wandb_project,
        config_to_dict(cfg), resume_step=state.step if resume else None,
    )  # fmt: skip
    return Run(cfg, out_dir, params, optimizer, scheduler, state, logger)

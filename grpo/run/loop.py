"""The run lifecycle the GRPO, SFT and reward-model recipes share: optimizer and schedule,
restored state, the claimed run directory (grpo/run/rundir.py) and metric logger at the start;
the tail of every step (`Run.end_of_step`: evaluation, logging, the guards, the checkpoint and
the agreed stop on SIGTERM / SIGINT); a guard's stop that saves what it can first and names
the resume command (`Run.guard_stop`, `Run.unsaved_stop`); final weights at the end. The
recipes keep only what differs (their batches and their updates)."""

from __future__ import annotations

import functools
import logging
import os
import shutil
import signal
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpo.config import Config, config_to_dict
from grpo.distributed import (
    Where,
    all_reduce_max,
    all_reduce_sum,
    fsdp_units,
    full_weights,
    gather_objects,
    init_distributed,
    rank_local,
    split_roles,
    teardown,
)
from grpo.errors import GrpoError
from grpo.experience.strategy_state import gather_states, load_state, save_states
from grpo.loading import resolve_device
from grpo.metrics import MetricLogger
from grpo.policy import Policy, save_final
from grpo.run.failures import Failures
from grpo.run.optim import build_optimizer, build_scheduler, weights_finite
from grpo.run.rundir import RunDir, TrainingInterrupted, run_directory
from grpo.run.state import (
    TrainState,
    checkpoint_tmp,
    find_checkpoint,
    load_checkpoint,
    prepare_tmp,
    rng_state,
    save_checkpoint,
    save_shards,
    this_host,
)

__all__ = [
    "GuardStop",
    "Run",
    "RunDir",
    "nonfinite_stop",
    "run_directory",
    "run_training",
    "start_run",
]

log = logging.getLogger(__name__)

# what a learning-health stop (train.stop_on_stall) adds after the resume command
STALL_THEN = "(append the settings to change, e.g. train.stop_on_stall=false)"


class GuardStop(GrpoError):
    """A guard ended the run at a step every rank decided alike (from numbers reduced over the
    ranks): the message says what was saved or kept and the resume command. The CLI prints it
    once, rank 0's, and exits 2; the ranks leave the job together (`teardown`)."""

    def __init__(self, message: str, rank: int = 0):
        super().__init__(message)
        self.rank = rank


def nonfinite_stop(bad_steps: int, step: int, hint: str = "Lower optim.lr") -> GuardStop:
    """The guard every recipe raises after train.max_nonfinite_steps consecutive skipped
    updates, through `Run.guard_stop` (which saves first: skipped updates leave the weights
    those of the last update applied)."""
    return GuardStop(
        f"{bad_steps} consecutive updates had a non-finite loss or gradient (step {step}); "
        f"stopped. {hint} (the weights are those of the last update applied)"
    )


def run_training(
    cfg: Config, kind: str, resume: bool | str, overwrite: bool, train_fn, on_step, producer_fn=None
):
    """One process (or torchrun rank) of a training job around `train_fn`: join the job, claim
    the run directory, report a failure on any rank as one line per rank naming the rank that
    failed, its phase and step and the cause (`grpo.run.failures`; `train_fn` keeps the `Where`
    current), leave the job however it ends.

    Args:
        cfg: the run config.
        kind: "train" (GRPO) or "sft", for the run directory.
        resume, overwrite: see `train_grpo`.
        train_fn: ``(cfg, rundir, dist, on_step, where, roles) -> summary``.
        on_step: passed through to `train_fn`.
        producer_fn: ``(cfg, roles, where) -> summary``, what the rollout producer ranks run
            when rollout.ranks splits the job (`split_roles`): they claim no run directory and
            write nothing; the trainer ranks get their own group as `dist`, and `roles`.
    """
    offload = cfg.train.parallel == "fsdp" and cfg.train.fsdp_offload  # CPU shards: gloo too
    dist = init_distributed(
        resolve_device(cfg.model.device).type, cfg.train.dist_timeout_s, cpu_collectives=offload
    )
    where = Where()
    failures = Failures(dist, where, f"grpo {kind}")
    try:
        with failures.reported(cfg.train.dist_timeout_s):
            roles = None
            if producer_fn is not None and cfg.rollout.asynchronous and cfg.rollout.ranks:
                timeout = max(cfg.rollout.async_timeout_s, cfg.train.dist_timeout_s)
                roles = split_roles(dist, cfg.rollout.ranks, timeout)
                if roles.is_producer:
                    return producer_fn(cfg, roles, where)
                dist = roles.trainers
            job = failures if failures.active else None  # torchrun: signals see the job's state
            with run_directory(cfg, kind, resume, overwrite, dist, job) as rundir:
                return train_fn(cfg, rundir, dist, on_step, where, roles)
    finally:
        teardown()
        failures.close()


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
    rundir: RunDir
    modules: Any = None  # the modules trained beside the policy (grpo.modules.ModuleSet)
    strategy: Any = None  # this rank's rollout-strategy state (grpo.experience.strategy_state)
    bad_steps: int = 0  # consecutive updates skipped as non-finite (train.max_nonfinite_steps)

    def end_of_step(
        self,
        policy: Policy,
        dist,
        where: Where,
        metrics: dict,
        last: bool,
        on_step: Callable[[int, dict], None] | None = None,
        evaluate: Callable[[], dict] | None = None,
        sharded: bool = False,
        collective_eval: bool = False,
        stall: GrpoError | None = None,
        hint: str = "Lower optim.lr",
    ) -> None:
        """The tail of every recipe's step, once its update is counted in `state.step`.
        Collective: every rank calls it at every step, with metrics reduced over the ranks.

        1. evaluate when due (data.eval_samples, train.eval_every and the last step): its
           metrics join `metrics`;
        2. log (train.log_every and the last step), then `on_step(step, metrics)` (rank 0);
        3. the guards, which save and stop (`guard_stop`): train.max_nonfinite_steps
           consecutive skipped updates (each step's ``train/nonfinite_skipped``; `hint` says
           what to change), then a learning-health `stall` (train.stop_on_stall);
        4. the checkpoint when due, and the stop every rank agrees on after SIGTERM / SIGINT
           (`end_step`).

        Args:
            evaluate: () -> eval/* metrics. Run as rank 0's work (a failure stops every rank
                at once; FSDP: the weights gathered first when `sharded`), or on every rank
                with `collective_eval` (an evaluation that is itself collective).
        """
        cfg, step = self.cfg, self.state.step
        where.phase = "evaluation / logging"
        due_eval = cfg.data.eval_samples > 0 and due(step, cfg.train.eval_every, last)
        evaluating = evaluate is not None and due_eval
        if evaluating and collective_eval:
            metrics.update(evaluate())
        with full_weights(policy.model, sharded and evaluating), rank_local(dist, where):
            # rank 0's work: its failure stops every rank at once (FSDP: all gather first)
            if evaluating and not collective_eval:
                metrics.update(evaluate())
            if step % cfg.train.log_every == 0 or last:
                self.logger.log(step, {k: v for k, v in metrics.items() if not isinstance(v, dict)})
            if on_step is not None and dist.is_main:
                on_step(step, metrics)
        where.phase = "checkpoint"
        skipped = int(metrics.get("train/nonfinite_skipped", 0))
        self.bad_steps = self.bad_steps + skipped if skipped else 0
        if self.bad_steps >= cfg.train.max_nonfinite_steps:  # skipped updates: weights intact
            raise self.guard_stop(policy, dist, nonfinite_stop(self.bad_steps, step, hint))
        if stall is not None:
            raise self.guard_stop(policy, dist, stall, STALL_THEN)
        self.end_step(policy, dist, last)

    def end_step(self, policy: Policy, dist, last: bool) -> None:
        """Checkpoint when due (every rank's RNG state, rank 0 writes), then wait for all.

        After SIGTERM / SIGINT on any rank (the flag's max over ranks, so every rank stops at
        this same step): checkpoint now, then raise TrainingInterrupted saying how to resume.
        """
        cfg = self.cfg
        signum = int(all_reduce_max(self.rundir.stop.signum, dist))
        stop = signum > 0 and not last  # at the last step the run simply finishes
        save = due(self.state.step, cfg.train.save_every, last) or stop
        ckpt = self._checkpoint(policy, dist, save)
        if stop:
            self.logger.close()
            raise TrainingInterrupted(
                f"interrupted by {signal.Signals(signum).name} at step {self.state.step}: "
                f"checkpoint saved in {ckpt}; resume with: {self.rundir.resume_command(dist)}",
                signum,
                dist.rank,
            )

    def guard_stop(self, policy: Policy, dist, error: GrpoError, then: str = "") -> GrpoError:
        """A guard ends the run at this step boundary. Collective: every rank calls it at the
        same step, as every guard decides from numbers reduced over the ranks. Checkpoints the
        step, unless a trainable weight is NaN or inf on some rank (a corrupted state never
        replaces a good checkpoint: then as `unsaved_stop`), and returns `error` to raise, its
        message completed with the checkpoint and the resume command (then `then`), and its
        `rank` set (the CLI prints rank 0's line once).

        Args:
            error: the guard's error: what happened, what to change.
            then: appended after the resume command (e.g. which override to add).
        """
        finite = not all_reduce_sum(float(not bool(weights_finite(self.params))), dist)
        if not finite:
            why = f"a trainable weight is not finite at step {self.state.step}"
            return self.unsaved_stop(dist, error, why)
        ckpt = self._checkpoint(policy, dist, True)
        self.logger.close()
        more = f" {then}" if then else ""
        cmd = self.rundir.resume_command(dist)
        return _completed(error, f"checkpoint saved in {ckpt}; resume with: {cmd}{more}", dist)

    def unsaved_stop(self, dist, error: GrpoError, why: str) -> GrpoError:
        """A guard ends the run without saving (`why`: the state is corrupted): returns `error`
        to raise, its message completed with the newest good checkpoint that stays and the
        resume command (or that none was written yet), and its `rank` set."""
        self.logger.close()
        return _completed(error, f"nothing saved ({why}); {self._kept(dist)}", dist)

    def failed_stop(self, dist, error: GrpoError) -> GrpoError:
        """A failure outside the training state ends the run mid-way (a reward's service gone:
        the judge after its retries, a reward model's endpoint): returns `error`, its message
        completed as a guard's stop is, with the newest checkpoint and the resume command (or
        that none was written yet). Not collective (one rank may fail alone; the others hear
        of it from grpo.run.failures) and nothing is saved. A run that has finished no step and
        has no checkpoint to resume gets `error` as it is."""
        ckpt, _ = find_checkpoint(self.out_dir)
        if ckpt is None and self.state.step == 0:
            return error
        self.logger.close()
        error.args = (f"{error}; {self._kept(dist, ckpt)}",)
        return error

    def _kept(self, dist, ckpt: Path | None = None) -> str:
        """What a stop that saves nothing leaves: the newest checkpoint and the resume command,
        or that none was written."""
        ckpt = ckpt or find_checkpoint(self.out_dir)[0]
        if ckpt is None:
            every = self.cfg.train.save_every
            when = f"every {every} steps" if every else "at the end only"
            return (
                f"no checkpoint was written before it (train.save_every={every}: "
                f"{when}); start again with --overwrite"
            )
        step = int(ckpt.name.removeprefix("step_"))
        return (
            f"the last checkpoint stays: {ckpt} (step {step}); resume from it with: "
            f"{self.rundir.resume_command(dist)}"
        )

    def _checkpoint(self, policy: Policy, dist, save: bool) -> Path:
        """Checkpoint this step when `save` (every rank's RNG state, rank 0 writes), then wait
        for all (collective either way); returns the step's checkpoint directory."""
        cfg = self.cfg
        rngs = gather_objects(rng_state(), dist) if save else None
        # every rank's strategy state, which rank 0 writes with the rest
        who = f"rollout strategy {cfg.rollout.strategy!r}"
        strategy = gather_states(self.strategy, who, dist) if save and self.strategy else None
        where = Where("checkpoint", self.state.step)
        # FSDP: every rank writes its shards into rank 0's temporary directory first
        sharded = (
            self._save_shards(policy, dist, where) if save and fsdp_units(policy.model) else None
        )
        # rank 0 writes; the section's all-reduce is also the barrier (nobody runs ahead of a
        # checkpoint or an evaluation), and a failed write stops every rank at once
        with rank_local(dist, where):
            if save and dist.is_main:
                save_checkpoint(
                    self.out_dir,
                    self.state,
                    policy.model,
                    self.optimizer,
                    self.scheduler,
                    config_to_dict(cfg),
                    cfg.train.keep_last,
                    rng_states=rngs,
                    sharded=sharded,
                    extra=functools.partial(self._save_extra, strategy),
                )
        return self.out_dir / "checkpoints" / f"step_{self.state.step:06d}"

    def _save_extra(self, strategy: list | None, directory: Path) -> None:
        """What a checkpoint holds besides the policy's state: the trained modules' states and
        every rank's rollout-strategy state (`gather_states`)."""
        if self.modules:
            self.modules.save(directory)
        if strategy is not None:
            save_states(directory, strategy)

    def _save_shards(self, policy: Policy, dist, where: Where) -> tuple[Path, list[dict]]:
        """Every rank's shards of the weights and optimizer states into the temporary directory
        rank 0 named and made (collective); (that directory, the param groups) for
        `save_checkpoint`."""
        host, pid = gather_objects((this_host(), os.getpid()), dist)[0]  # rank 0's
        tmp = checkpoint_tmp(self.out_dir, self.state.step, host, pid)
        with rank_local(dist, where):
            if dist.is_main:
                prepare_tmp(tmp)
        try:
            groups = save_shards(tmp, policy.model, self.optimizer)
        except Exception as e:
            if dist.is_main:  # every rank gets DCP's verdict: nothing partial stays
                shutil.rmtree(tmp, ignore_errors=True)
            final = tmp.parent / f"step_{self.state.step:06d}"
            lines = str(e).strip().splitlines()
            why = lines[0] if lines else type(e).__name__
            raise GrpoError(
                f"could not write checkpoint {final}: {why}; the checkpoints already written stay"
            ) from None
        return tmp, groups

    def finish(self, policy: Policy, dist, metrics: dict) -> dict:
        """Close the logger, write out_dir/final, and return the run's summary."""
        self.logger.close()
        final = self.out_dir / "final"
        # rank 0 writes; all wait (FSDP: every rank gathers the whole weights first)
        with full_weights(policy.model), rank_local(dist, Where("final save", self.state.step)):
            if dist.is_main:
                final = save_final(policy, self.out_dir, self.cfg)
                if self.modules:  # the trained modules' weights beside the policy's
                    self.modules.save(final, weights_only=True)
        return {
            "output_dir": str(self.out_dir),
            "final": str(final),
            "step": self.state.step,
            **metrics,
        }


def start_run(
    cfg: Config,
    policy: Policy,
    dist,
    total_steps: int,
    rundir: RunDir,
    header: dict[str, str] | None = None,
    modules=None,
    strategy=None,
) -> Run:
    """Optimizer and schedule over `total_steps` updates, the state restored from the
    checkpoint `rundir` resumes, then (inputs all checked by now) the run directory claimed
    (lock, overwrite, config; see `RunDir.claim`) and the metric logger.

    `header` (the run's choices by name, e.g. `grpo.train.grpo.run_header`) is logged once on
    rank 0 and written into the first metrics.jsonl record of this start, with what runs
    besides the config: ``run/plugins`` (every plugin loaded, with its version) and
    ``run/replaced`` (every registry name a plugin or user code replaced;
    `grpo.plugins.plugin_header`), which a resumed run compares (`grpo.run.rundir`), and
    ``run/start``: how this start began (fresh, resumed from which checkpoint, what
    `--resume auto` chose). `strategy`: this rank's `StrategyState` of a rollout strategy that
    keeps one, restored from the checkpoint and saved with every later one."""
    from grpo.plugins import plugin_header

    header = {**(header or {}), "run/start": rundir.start, **plugin_header()}
    params = policy.trainable_parameters()
    optimizer = build_optimizer(params, cfg.optim)
    scheduler = build_scheduler(optimizer, total_steps, cfg.optim)
    state = TrainState()
    if rundir.checkpoint is not None:
        ckpt = rundir.checkpoint
        state = load_checkpoint(ckpt, policy.model, optimizer, scheduler, rank=dist.rank)
        if modules:  # the modules trained beside the policy: theirs too
            modules.load(ckpt)
        if strategy is not None:  # the rollout strategy's, this rank's
            who = f"rollout strategy {cfg.rollout.strategy!r}"
            load_state(ckpt, dist.rank, strategy, who, dist.world_size)
        log.info("resumed from %s (step %d)", ckpt, state.step)
    rundir.claim(cfg, dist)
    if header and dist.is_main:
        log.info("run: %s", " | ".join(f"{k.split('/', 1)[-1]} {v}" for k, v in header.items()))
    logger = MetricLogger(
        rundir.path,
        dist.is_main,
        cfg.log.tensorboard,
        cfg.log.wandb,
        cfg.log.wandb_project,
        config_to_dict(cfg),
        resume_step=state.step if rundir.resume else None,
        header=header,
    )
    return Run(
        cfg, rundir.path, params, optimizer, scheduler, state, logger, rundir, modules, strategy
    )


def due(step: int, every: int, last: bool) -> bool:
    """True at the last step and every `every` steps (every = 0: only the last)."""
    return last or (every > 0 and step % every == 0)


def _completed(error: GrpoError, tail: str, dist) -> GrpoError:
    """`error` with "; `tail`" added to its message and this rank as its `rank`."""
    error.args = (f"{error}; {tail}",)
    error.rank = dist.rank
    return error

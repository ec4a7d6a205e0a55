"""The synchronous rollout source (rollout.async: off) and what every source shares: the trainer
samples each step's batch itself, with the current weights (`InlineRollouts`), through the
sampler `make_sampler` builds (the asynchronous sources, grpo/experience/producer.py, build
theirs with it too). `grpo.experience.sources.rollout_source` picks a run's source."""

from __future__ import annotations

from grpo.config import Config
from grpo.distributed import SINGLE, full_weights
from grpo.experience.batch import RolloutBatch
from grpo.experience.collect import rollout_phase
from grpo.policy import Policy
from grpo.rollout import Sampler
from grpo.rollout.sampler import resolve_compile
from grpo.run.rundir import TrainingInterrupted
from grpo.run.state import TrainState


class RolloutSource:
    """A rollout source is a context manager: leaving it stops the producers, handing over
    what they sampled ahead first on a clean end or an interruption (`close(drain=True)`)."""

    asynchronous = False
    cache_bytes = 0  # the compiled step's KV cache in the last rollout (perf/sampler_cache_mib)
    compile_s = 0.0  # seconds the sampler spent compiling so far (perf/compile_s)

    def __enter__(self):
        return self

    def __exit__(self, kind, error, tb) -> None:
        self.close(drain=kind is None or issubclass(kind, TrainingInterrupted))

    def close(self, drain: bool = True) -> None:
        pass

    def published(self, model, version: int) -> None:
        """Called after update `version` (every rank)."""

    def metrics(self) -> dict:
        return {}


class InlineRollouts(RolloutSource):
    """rollout.async: off: each step samples its batch with the current weights."""

    def __init__(
        self,
        cfg: Config,
        policy: Policy,
        sampler,
        rows,
        reward_fns,
        make_env,
        dist=SINGLE,
        sharded: bool = False,
        strategy_state=None,
    ):
        self.cfg, self.policy, self.sampler, self.rows = cfg, policy, sampler, rows
        self.reward_fns, self.make_env = reward_fns, make_env
        self.dist, self.sharded = dist, sharded
        self.strategy_state = strategy_state  # a strategy's kept state (strategy_state.py)

    def next(self, state: TrainState) -> RolloutBatch:
        with full_weights(self.policy.model, self.sharded):  # FSDP: the sampler needs them whole
            batch = rollout_phase(
                self.cfg,
                self.policy,
                self.sampler,
                self.rows,
                state,
                self.reward_fns,
                state.step,
                self.dist,
                self.make_env,
                self.strategy_state,
            )
        # the compiled step's KV cache (17.5 GiB at B=128, 1280 slots, Qwen3-0.6B in bf16) is
        # not kept through the reference and update passes
        self.cache_bytes = self.sampler.release_caches()
        return batch

    @property
    def compile_s(self) -> float:
        return self.sampler.compile_s


def make_sampler(
    cfg: Config, policy: Policy, model, sharded: bool = False, producer_thread: bool = False
) -> Sampler:
    """The run's sampler over `model`: the compiled decode step as rollout.compile says (FSDP:
    eager, the sampler reads the gathered weights through FSDP's hooks). A colocated producer
    thread's compiled step records no CUDA graphs (mode "default"): CUDA-graph trees belong to
    the thread that records them, and the trainer's thread replays its own."""
    compile_ = not sharded and resolve_compile(
        cfg.rollout.compile, model.device, cfg.rollout.multi_turn
    )
    options = {"mode": "default"} if producer_thread else None
    return Sampler(
        model,
        compile=compile_,
        fallback=cfg.rollout.compile == "auto",
        precision=policy.precision,
        compile_options=options,
        max_rows=cfg.rollout.max_rows,
    )

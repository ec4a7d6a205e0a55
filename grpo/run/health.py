"""Learning health: notice a GRPO run that has stopped learning while it goes on without error.

Every completion cut at the token budget (reward 0), every group of equal rewards (advantages
0), a gradient norm of 0, weights that no longer move, a reward mean that does not move: each
leaves the loop running, for hours, and reporting success. `LearningHealth` reads each step's
metrics (already reduced over ranks, so every rank decides the same at the same step) and
applies one rule per symptom over the last `train.stall_steps` steps (docs/safety.md,
"Learning health"). A rule that starts to hold is one WARNING line on rank 0 naming the
symptom, its numbers and the setting to change, and one more when it stops holding; the run
summary lists every rule that fired (`health`). With `train.stop_on_stall` the first one to
fire stops the run (`StallError`, exit 2; the trainer saves a checkpoint first and names the
resume command).

A task can also be solved: when the rewards declare bounds (`grpo.rewards.bounds`) and every
completion of every group scores the run's highest reward on each of the last stall_steps
steps, the `solved` rule holds instead of the stall rules, whose symptoms a solved task
shows (equal rewards, a flat reward, a zero gradient, unmoving weights, truncated completions
with no signal left). It is an INFO line, not a warning; the summary's `converged` records
it; with `train.stop_on_stall` the run ends there as at its last step (final/ weights, exit
0, "converged at step N").

A run whose estimator drives learning without the rewards (on-policy distillation: it reads no
rewards, `grpo.algo.advantages.reads_rewards`, or declares the metric it minimises,
`register_advantage(..., minimises=...)`) is judged by what it optimises, not by the rewards
(none, or riding along): the rules that read the rewards (equal rewards, a flat reward, solved,
truncated completions that leave no reward signal) do not apply, and `flat_objective` fires
when the estimator's metric (``advantage/<minimises>``) stops moving; the gradient and weight
rules apply as ever. Such a run is never `solved` by constant rewards, and
`train.stop_on_stall` does not stop it while its objective still moves.

`WeightChange` measures the metric the frozen-weights rule reads, `train/weight_change`.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from grpo.algo.advantages import estimator_objective, reads_rewards
from grpo.config import Config
from grpo.distributed import SINGLE, all_reduce_sum_dict
from grpo.errors import GrpoError

log = logging.getLogger(__name__)

TRUNCATED_FRAC = 0.9  # "most completions": at least this fraction cut at the budget
ZERO = 1e-12  # a grad norm or relative weight change at or below this counts as none
FLAT = 1e-6  # a reward-mean range at or below this over the window counts as flat
SAMPLE_BUDGET = 1 << 24  # most elements of the trainable weights WeightChange keeps (64 MiB f32)
AT_MAX = 1e-6  # a reward mean this close (relative) to the rewards' upper bound is at it


class StallError(GrpoError):
    """train.stop_on_stall: a learning-health rule fired. Printed once, by rank 0; the trainer
    adds the checkpoint it saved and the resume command to the message."""

    def __init__(self, message: str, rank: int = 0):
        super().__init__(message)
        self.rank = rank


# --------------------------------------------------------------------------- the rules


@dataclass(frozen=True)
class Window:
    """The steps a rule judges: the last `train.stall_steps` steps' metrics, oldest first."""

    steps: tuple[int, ...]
    metrics: tuple[dict, ...]
    lowest_reward: tuple[float, ...]  # per step: the run's lowest rollout/reward_mean until then
    reward_hi: float | None = None  # the run's highest possible reward (None: unknown)
    judge_rewards: bool = True  # the estimator learns from the rewards (module docstring)
    objective: str | None = None  # the metric the estimator minimises (advantage/<name>)

    def values(self, key: str) -> list[float]:
        """`key` on every step of the window (NaN where a step lacks it)."""
        return [_num(m.get(key)) for m in self.metrics]

    @property
    def span(self) -> str:
        a, b = self.steps[0], self.steps[-1]
        return f"step {a}" if a == b else f"steps {a}-{b}"


def _num(v) -> float:
    return float(v) if isinstance(v, (int, float)) else math.nan


def _truncated(cfg: Config, w: Window) -> bool:
    """Most completions cut at the budget, on every step, and no learning signal left in them:
    the loss drops them (loss.mask_truncated_completions), or nearly every group has equal
    rewards while the reward mean is at the run's lowest so far (the budget cuts the answers
    off; equal rewards at a high reward are a solved task, not the budget's doing)."""
    if not w.judge_rewards and not cfg.loss.mask_truncated_completions:
        return False  # a cut completion's tokens still carry the estimator's signal
    for m, lowest in zip(w.metrics, w.lowest_reward):
        t, z, r = (_num(m.get(k)) for k in TRUNCATION_KEYS)
        if not t >= TRUNCATED_FRAC:
            return False
        if not cfg.loss.mask_truncated_completions and not (
            z >= TRUNCATED_FRAC and r <= lowest + FLAT
        ):
            return False
    return True


TRUNCATION_KEYS = ("rollout/truncated_frac", "rollout/frac_zero_std_groups", "rollout/reward_mean")


def _truncated_message(cfg: Config, w: Window) -> str:
    t, z, r = (w.values(k)[-1] for k in TRUNCATION_KEYS)
    ro = cfg.rollout
    if ro.multi_turn:
        what = (
            f"{t:.0%} of trajectories were cut by rollout.max_turns={ro.max_turns} or the "
            f"token budget (rollout.max_total_tokens={ro.total_tokens})"
        )
        fix = "raise rollout.max_total_tokens / rollout.max_turns or ask for shorter turns"
    else:
        what = f"{t:.0%} of completions hit rollout.max_new_tokens={ro.max_new_tokens}"
        fix = "raise rollout.max_new_tokens or ask for shorter answers (data.system_prompt)"
    if cfg.loss.mask_truncated_completions or not w.judge_rewards:
        why = "loss.mask_truncated_completions drops them from the loss"
    else:
        why = f"reward mean {r:.3f}, {z:.0%} of groups with equal rewards: no learning signal"
    n = len(w.steps)
    return f"completions truncated: {what} for {n} steps ({w.span}; {why}); {fix}"


def _zero_variance(cfg: Config, w: Window) -> bool:
    """Every group's completions got equal rewards, on every step (advantages all 0)."""
    return w.judge_rewards and all(z >= 1 - 1e-9 for z in w.values("rollout/frac_zero_std_groups"))


def _zero_variance_message(cfg: Config, w: Window) -> str:
    r = w.values("rollout/reward_mean")[-1]
    G, temp = cfg.rollout.group_size, cfg.rollout.temperature
    return (
        f"no reward variance: in every group all {G} completions got equal rewards for "
        f"{len(w.steps)} steps ({w.span}; reward mean {r:.3f}), so every advantage and the "
        f"policy gradient are 0; give partial credit in the rewards, use prompts the model "
        f"sometimes solves, or raise rollout.group_size ({G}) or rollout.temperature ({temp:g}) "
        "(if the reward is at its maximum, the task is learned)"
    )


def _zero_gradient(cfg: Config, w: Window) -> bool:
    """The gradient norm (before clipping) at most ZERO on every step (NaN: skipped updates,
    the non-finite check's business, does not count)."""
    return all(g <= ZERO for g in w.values("train/grad_norm"))


def _zero_gradient_message(cfg: Config, w: Window) -> str:
    g = max(w.values("train/grad_norm"))
    return (
        f"zero gradient: train/grad_norm <= {ZERO:g} for {len(w.steps)} steps ({w.span}; at most "
        f"{g:.3g}): the loss does not move the weights; check the rewards (equal within every "
        "group?), loss.mask_truncated_completions with every completion truncated, and "
        "lora.targets / which weights are trainable"
    )


def _frozen_weights(cfg: Config, w: Window) -> bool:
    """The trainable weights moved by at most ZERO (relative, `WeightChange`) on every step."""
    return all(c <= ZERO for c in w.values("train/weight_change"))


def _frozen_weights_message(cfg: Config, w: Window) -> str:
    c = max(w.values("train/weight_change"))
    lr = w.values("train/lr")[-1]
    g = w.values("train/grad_norm")[-1]
    why = (
        "the gradient is 0 too"
        if g <= ZERO
        else f"optim.lr={cfg.optim.lr:g} (this step {lr:.3g}) is too small for the weights' "
        "precision; raise optim.lr"
    )
    return (
        f"weights unchanged: the trainable weights moved by at most {c:.3g} (relative, "
        f"train/weight_change) per step for {len(w.steps)} steps ({w.span}): {why}"
    )


def _flat_reward(cfg: Config, w: Window) -> bool:
    """The reward mean's range (max - min) over the window at most FLAT; the window holds at
    least two steps."""
    r = w.values("rollout/reward_mean")
    flat = len(r) >= 2 and all(math.isfinite(x) for x in r) and max(r) - min(r) <= FLAT
    return w.judge_rewards and flat


def _flat_reward_message(cfg: Config, w: Window) -> str:
    r = w.values("rollout/reward_mean")
    names = ", ".join(rc.name for rc in cfg.rewards)
    return (
        f"reward flat: rollout/reward_mean stayed at {r[-1]:.3f} (range {max(r) - min(r):.2g} "
        f"<= {FLAT:g}) for {len(r)} steps ({w.span}): nothing is being learned; check the "
        f"rewards ({names}) against the completions, and the warnings above (a reward at its "
        "maximum: the task is learned)"
    )


def _solved(cfg: Config, w: Window) -> bool:
    """Every completion of every group at the rewards' upper bound, on every step: every group
    has equal rewards and the reward mean is at the bound (no reward exceeds its declared
    bounds: `grpo.rewards.compute` checks them). Never with unknown or infinite bounds."""
    hi = w.reward_hi
    if hi is None or not math.isfinite(hi) or not w.judge_rewards:
        return False
    at_max = all(r >= hi - AT_MAX * max(1.0, abs(hi)) for r in w.values("rollout/reward_mean"))
    return at_max and _zero_variance(cfg, w)


def _solved_message(cfg: Config, w: Window) -> str:
    return (
        f"every completion in every group got the rewards' maximum ({w.reward_hi:g}) for "
        f"{len(w.steps)} steps ({w.span}): the task is learned; harder prompts (data) would "
        "give the policy more to learn"
    )


def _flat_objective(cfg: Config, w: Window) -> bool:
    """The estimator's objective (`Window.objective`) moved by at most FLAT over the window
    (at least two steps, every value finite)."""
    if w.objective is None:
        return False
    v = w.values(w.objective)
    return len(v) >= 2 and all(math.isfinite(x) for x in v) and max(v) - min(v) <= FLAT


def _flat_objective_message(cfg: Config, w: Window) -> str:
    v = w.values(w.objective)
    return (
        f"objective flat: {w.objective} (what loss.advantage={cfg.loss.advantage!r} minimises) "
        f"stayed at {v[-1]:.4g} (range {max(v) - min(v):.2g} <= {FLAT:g}) for {len(v)} steps "
        f"({w.span}): nothing is being learned; check optim.lr and the module that attaches "
        "its inputs (e.g. the teacher)"
    )


@dataclass(frozen=True)
class Rule:
    """One symptom: `holds(cfg, window)` over the last stall_steps steps, and the warning's
    text. `min_steps`: the window the rule needs (the flat reward compares two steps at least)."""

    name: str
    holds: Callable[[Config, Window], bool]
    message: Callable[[Config, Window], str]
    min_steps: int = 1


# In order of cause: a stop names the first that fired.
RULES = (
    Rule("truncated", _truncated, _truncated_message),
    Rule("zero_variance", _zero_variance, _zero_variance_message),
    Rule("zero_gradient", _zero_gradient, _zero_gradient_message),
    Rule("frozen_weights", _frozen_weights, _frozen_weights_message),
    Rule("flat_reward", _flat_reward, _flat_reward_message, min_steps=2),
    Rule("flat_objective", _flat_objective, _flat_objective_message, min_steps=2),
)
# Not a stall: the task is learned. While it holds no stall rule does: each of their symptoms
# (equal rewards, a flat reward, no gradient, unmoving weights, truncated completions that
# leave no signal) is what a solved task looks like, and nothing is left to fix.
SOLVED = Rule("solved", _solved, _solved_message)


# --------------------------------------------------------------------------- the watcher


@dataclass
class Stall:
    """What the run summary says of a rule that fired.

    Attributes:
        first_step: the first step of the window that made it fire (its first firing).
        fired_step: the step it first fired.
        last_step: the last step on which it held.
        times: how often it fired (it may clear and fire again).
        message: the warning of its first firing.
    """

    first_step: int
    fired_step: int
    last_step: int
    times: int
    message: str


@dataclass(frozen=True)
class Event:
    """A rule that started (`fired`) or stopped holding at `step`; `message` says what, `line`
    is the warning."""

    rule: str
    step: int
    fired: bool
    message: str

    @property
    def line(self) -> str:
        if self.fired and self.rule == SOLVED.name:
            return f"learning health: solved at step {self.step}: {self.message}"
        if self.fired:
            return f"learning stalled at step {self.step}: {self.message}"
        return f"learning health: {self.rule} cleared at step {self.step} ({self.message})"


@dataclass
class LearningHealth:
    """Feed it every step's reduced metrics (`observe`); it warns, records and stops.

    Args:
        cfg: the run config (train.stall_steps, train.stop_on_stall, and the settings named).
        rank: this process's rank: rank 0 logs the warnings and prints a stop.
        reward_hi: the highest total reward a completion can get (`grpo.rewards.bounds.
            total_bounds`), or None when unknown: then no run is ever `solved`.

    Attributes:
        objective: the metric the estimator minimises (``advantage/<name>``), or None.
        judge_rewards: whether the rules that read the rewards apply (module docstring).
        stalls: rule name -> `Stall`, for every stall rule that fired.
        converged: the `solved` rule's record once it fired (None before).
        finished: train.stop_on_stall and the task solved at the step just observed: the
            trainer ends the run there as at its last step.
    """

    cfg: Config
    rank: int = 0
    reward_hi: float | None = None
    _recent: deque = field(init=False)
    _active: dict[str, int] = field(init=False, default_factory=dict)  # rule -> firing step
    _lowest: float = field(init=False, default=math.inf)
    objective: str | None = field(init=False, default=None)
    judge_rewards: bool = field(init=False, default=True)
    stalls: dict[str, Stall] = field(init=False, default_factory=dict)
    converged: Stall | None = field(init=False, default=None)
    finished: bool = field(init=False, default=False)

    def __post_init__(self):
        self._recent = deque(maxlen=max(self.cfg.train.stall_steps, 2))
        # what the run optimises (module docstring): the rewards, or the estimator's metric
        adv = self.cfg.loss.advantage
        name = estimator_objective(adv)
        self.objective = f"advantage/{name}" if name else None
        self.judge_rewards = name is None and reads_rewards(adv)

    @property
    def enabled(self) -> bool:
        return self.cfg.train.stall_steps > 0

    def observe(self, step: int, metrics: dict) -> list[Event]:
        """One step's metrics (the same on every rank): log what fired or cleared (rank 0);
        with train.stop_on_stall raise `StallError` when a stall rule fired, or set `finished`
        when the task is solved (every rank decides the same at the same step).

        Returns:
            the rules that fired or cleared at this step.
        """
        if not self.enabled:
            return []
        r = _num(metrics.get("rollout/reward_mean"))
        if math.isfinite(r):
            self._lowest = min(self._lowest, r)
        self._recent.append((step, dict(metrics), self._lowest))
        events = []
        for rule in (SOLVED, *RULES):
            w = self._window(max(self.cfg.train.stall_steps, rule.min_steps))
            holds = w is not None and rule.holds(self.cfg, w)
            if holds and rule is not SOLVED and _solved(self.cfg, w):
                holds = False  # the task is learned: no signal is left, nothing is stuck
            if holds and rule.name not in self._active:
                events.append(self._fire(rule, w, step))
            elif holds:
                self._record(rule.name).last_step = step
            elif rule.name in self._active:
                since, last = self._active.pop(rule.name), self._record(rule.name).last_step
                what = f"it fired at step {since} and held through step {last}"
                events.append(Event(rule.name, step, False, what))
        for e in events if self.rank == 0 else ():
            log.log(logging.INFO if e.rule == SOLVED.name else logging.WARNING, "%s", e.line)
        fired = [e for e in events if e.fired]
        if not fired or not self.cfg.train.stop_on_stall:
            return events
        if fired[0].rule == SOLVED.name:  # ends like the last step: no stall to report
            self.finished = True
            return events
        also = [e.rule for e in fired[1:]]
        more = f" (also fired: {', '.join(also)})" if also else ""
        raise StallError(
            f"learning stalled at step {step}: {fired[0].message}{more}; stopped by "
            "train.stop_on_stall",
            self.rank,
        )

    def _window(self, n: int) -> Window | None:
        """The last n steps, or None before n steps were seen."""
        if len(self._recent) < n:
            return None
        steps, metrics, lowest = zip(*list(self._recent)[-n:])
        return Window(steps, metrics, lowest, self.reward_hi, self.judge_rewards, self.objective)

    def _record(self, name: str) -> Stall | None:
        return self.converged if name == SOLVED.name else self.stalls.get(name)

    def _fire(self, rule: Rule, w: Window, step: int) -> Event:
        message = rule.message(self.cfg, w)
        self._active[rule.name] = step
        old = self._record(rule.name)
        if old is None:
            new = Stall(w.steps[0], step, step, 1, message)
            if rule.name == SOLVED.name:
                self.converged = new
            else:
                self.stalls[rule.name] = new
        else:
            old.last_step, old.times = step, old.times + 1
        return Event(rule.name, step, True, message)

    def summary(self) -> dict[str, dict]:
        """The run summary's `health` section: rule name -> its `Stall` as a dict, for every
        stall rule that fired (empty: none did; `solved` is not a stall, see `converged`)."""
        return {name: vars(s).copy() for name, s in self.stalls.items()}

    def converged_summary(self) -> dict | None:
        """The run summary's `converged` section: the `solved` rule's `Stall` as a dict plus
        `stopped` (whether it ended the run, train.stop_on_stall); None when it never fired."""
        if self.converged is None:
            return None
        return {**vars(self.converged), "stopped": self.finished}


def describe(health: dict[str, dict]) -> str:
    """A run summary's `health` section as one line for the end of `grpo train`."""
    parts = [f"{name} (steps {s['first_step']}-{s['last_step']})" for name, s in health.items()]
    return (
        f"learning stalled: {', '.join(parts)}; the warnings above say what to change "
        "(train.stall_steps sets the window)"
    )


# --------------------------------------------------------------------------- weight change


def _local(p: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter: its shard under FSDP (a DTensor), else itself."""
    return p.to_local() if hasattr(p, "to_local") else p


class WeightChange:
    """`train/weight_change`: how far one step moved the trainable weights,
    ||w_t - w_{t-1}|| / ||w_{t-1}|| (absolute where w_{t-1} is all 0), from a fixed strided
    sample of their elements: every `stride`-th element of each tensor, at most SAMPLE_BUDGET
    elements in all (every element of a LoRA adapter or a small model). The sample is kept
    between steps; no copy of the model is made.

    Args:
        params: the trainable parameters (this rank's shards under FSDP).
        budget: most elements to keep.
    """

    def __init__(self, params: Iterable[torch.Tensor], budget: int = SAMPLE_BUDGET):
        self.params = list(params)
        n = sum(_local(p).numel() for p in self.params)
        self.stride = max(1, math.ceil(n / budget))
        self.prev = self._sample()

    @torch.no_grad()
    def _sample(self) -> list[torch.Tensor]:
        # float32 copies: the difference of two bf16 samples would round away small steps
        return [
            _local(p).detach().reshape(-1)[:: self.stride].to(torch.float32, copy=True)
            for p in self.params
        ]

    @torch.no_grad()
    def measure(self, dist=SINGLE) -> float:
        """The change since the last call (or construction), then remember the weights. Sums
        of squares are added over ranks (FSDP shards; DDP copies give the same ratio), so
        every rank returns the same number. One host read."""
        cur = self._sample()
        if not cur:
            return 0.0
        dev = cur[0].device
        # multi-tensor kernels: a few launches whatever the number of tensors
        diff = [d.to(dev) for d in torch._foreach_norm(torch._foreach_sub(cur, self.prev))]
        norm = [d.to(dev) for d in torch._foreach_norm(self.prev)]
        d2, n2 = (torch.stack(x).double().square().sum() for x in (diff, norm))
        d2, n2 = torch.stack([d2, n2]).tolist()
        self.prev = cur
        sums = all_reduce_sum_dict({"d2": d2, "n2": n2}, dist)
        d2, n2 = sums["d2"], sums["n2"]
        return math.sqrt(d2 / n2) if n2 > 0 else math.sqrt(d2)

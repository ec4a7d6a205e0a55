"""What a GRPO step reports: token-weighted loss statistics over micro-batches, passes and
ranks (`StatSums`), the on-policy check (`OnPolicyCheck`), advantage statistics and the
rollout / reward / env metrics of a batch. Tensors are summed where they live and read to the
host once per step, not once per micro-batch."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from grpo.distributed import (
    SINGLE,
    all_reduce_max_dict,
    all_reduce_sum_dict,
)
from grpo.experience.batch import RolloutBatch
from grpo.metrics import reduction
from grpo.rollout.multiturn import env_metrics


class StatSums:
    """Token-weighted sums of a loss's stats over micro-batches, passes and ranks, so that
    ``train/<name>`` is the mean over all counted tokens (max / min for ``_max`` / ``_min``).

    A stat is a float or a 0-d tensor. Tensors are summed where they live, in float64 (the same
    numbers as Python floats would give), and read to the host once, in `reduce`: no host sync
    per micro-batch.
    """

    def __init__(self):
        self.sums: dict[str, float | torch.Tensor] = {}
        self.extremes: dict[str, float | torch.Tensor] = {}
        self.tokens: float | torch.Tensor = 0.0

    def add(self, stats: dict[str, float | torch.Tensor]) -> None:
        """One micro-batch's stats. A mean over part of the tokens comes with their count:
        ``tokens_<kind>`` weights the means named ``..._<kind>`` (`grpo.algo.losses.
        tis_by_kind`: fresh and replayed rows), every other mean is weighted by ``tokens``."""
        w = _f64(stats["tokens"])
        self.tokens = self.tokens + w
        kinds = {k.removeprefix("tokens_"): _f64(v) for k, v in stats.items() if k[:7] == "tokens_"}
        for kind, n in kinds.items():
            key = f"__tokens_{kind}"
            self.sums[key] = self.sums.get(key, 0.0) + n
        for k, v in stats.items():
            if k in ("tokens", "policy_loss") or k[:7] == "tokens_":
                continue
            v = _f64(v)
            if k.endswith("_max") or k.endswith("_min"):
                self.extremes[k] = _pick(self.extremes.get(k, v), v, k.endswith("_max"))
            else:
                kind = k.rsplit("_", 1)[-1]
                self.sums[k] = self.sums.get(k, 0.0) + v * kinds.get(kind, w)

    def reduce(self, dist) -> dict[str, float]:
        """The ``train/<name>`` means and extremes over all ranks (one host read, then the
        all-reduces)."""
        local = _read_floats({**self.sums, **self.extremes, "__tokens": self.tokens})
        extremes = {k: local.pop(k) for k in self.extremes}
        sums = all_reduce_sum_dict(local, dist)
        n = max(sums.pop("__tokens"), 1.0)
        kinds = {k[len("__tokens_") :]: sums.pop(k) for k in list(sums) if k[:9] == "__tokens_"}
        out = {}
        for k, v in sums.items():
            kind = k.rsplit("_", 1)[-1]
            if kind in kinds:  # over that kind's tokens; none anywhere: no mean (NaN)
                out[f"train/{k}"] = v / kinds[kind] if kinds[kind] else float("nan")
            else:
                out[f"train/{k}"] = v / n
        maxes = {k: v for k, v in extremes.items() if k.endswith("_max")}
        mins = {k: -v for k, v in extremes.items() if k.endswith("_min")}
        both = all_reduce_max_dict({**maxes, **mins}, dist)  # min = -max(-x)
        for k, v in both.items():
            v = -v if k.endswith("_min") else v
            out[f"train/{k}"] = v if math.isfinite(v) else float("nan")  # no counted token
        return out


def reduce_metrics(values: dict, dist=SINGLE) -> dict[str, float]:
    """Metrics of this rank -> the step's, over all ranks: each value reduced as its type
    declares (`grpo.metrics.Sum` / `Max` / `Min`; anything else, a float or a 0-d tensor, is
    averaged). Every rank must pass the same keys with the same types. Plain floats out."""
    groups: dict[str, dict[str, float]] = {"mean": {}, "sum": {}, "max": {}, "min": {}}
    for k, v in values.items():
        groups[reduction(v)][k] = float(v)
    # two collectives at most: one sum (means are sums over the world size), one max
    out = all_reduce_sum_dict({**groups["mean"], **groups["sum"]}, dist)
    for k in groups["mean"]:
        out[k] /= dist.world_size
    both = {**groups["max"], **{k: -v for k, v in groups["min"].items()}}  # min = -max(-x)
    for k, v in all_reduce_max_dict(both, dist).items():
        out[k] = -v if k in groups["min"] else v
    return {k: out[k] for k in values}  # the order given


def _f64(x: float | torch.Tensor) -> float | torch.Tensor:
    """A float64 tensor (exact for float32, bfloat16 and integer stats), or the float as is."""
    return x.detach().double() if isinstance(x, torch.Tensor) else x


def _pick(prev, v, larger: bool):
    """max(prev, v) (min when not `larger`) as Python computes it, on the device for tensors:
    v only when strictly better, so a NaN neither replaces nor is replaced."""
    better = v > prev if larger else v < prev
    if isinstance(better, torch.Tensor):
        return torch.where(better, v, prev)
    return v if better else prev


def _read_floats(values: dict) -> dict[str, float]:
    """`values` with its 0-d tensors read to Python floats in one host sync."""
    keys = [k for k, v in values.items() if isinstance(v, torch.Tensor)]
    if not keys:
        return dict(values)
    read = torch.stack([values[k].double() for k in keys]).tolist()
    return {**values, **dict(zip(keys, read))}


@dataclass(frozen=True)
class OnPolicyCheck:
    """The first pass's log-probs (the policy that sampled, trainer numerics) against the
    sampler's, summed over counted tokens: 0-d float64 tensors on the device, so micro-batches
    add up without a host sync.

    Attributes:
        diff_sum: sum |logprobs - sampler's|.
        ratio_sum: sum exp(logprobs - sampler's).
        tokens: counted tokens.
        diff_max: max |difference| (0 when no token counts).
        sampler_bad: counted tokens whose sampler log-prob is NaN or inf.
        trainer_bad: counted tokens whose trainer log-prob is NaN or inf.
    """

    diff_sum: torch.Tensor
    ratio_sum: torch.Tensor
    tokens: torch.Tensor
    diff_max: torch.Tensor
    sampler_bad: torch.Tensor
    trainer_bad: torch.Tensor

    @classmethod
    def zeros(cls, device) -> OnPolicyCheck:
        z = torch.zeros((), dtype=torch.float64, device=device)
        return cls(z, z, z, z, z, z)

    @classmethod
    def of(cls, logprobs, sampler_logprobs, mask) -> OnPolicyCheck:
        """One micro-batch's sums; logprobs, sampler_logprobs and mask (mb, T_c)."""
        with torch.no_grad():
            d = torch.where(mask, logprobs.detach().double() - sampler_logprobs.double(), 0.0)
            ratio = torch.where(mask, torch.exp(d), 0.0)
            sampler_bad = (mask & ~torch.isfinite(sampler_logprobs)).sum().double()
            trainer_bad = (mask & ~torch.isfinite(logprobs.detach())).sum().double()
            return cls(
                d.abs().sum(),
                ratio.sum(),
                mask.sum().double(),
                d.abs().max(),
                sampler_bad,
                trainer_bad,
            )

    def __add__(self, other: OnPolicyCheck) -> OnPolicyCheck:
        return OnPolicyCheck(
            self.diff_sum + other.diff_sum,
            self.ratio_sum + other.ratio_sum,
            self.tokens + other.tokens,
            torch.maximum(self.diff_max, other.diff_max),
            self.sampler_bad + other.sampler_bad,
            self.trainer_bad + other.trainer_bad,
        )

    def tensors(self) -> list[torch.Tensor]:
        """What `check_first_pass` reads, in its order (stacked into a pass's one host read)."""
        return [self.diff_sum, self.tokens, self.diff_max, self.sampler_bad, self.trainer_bad]


def check_first_pass(
    values: list[float],
    step: int | None,
    strategy: str,
    logprob_impl: str,
    max_gap: float | None,
) -> None:
    """Before the first update of a step, where the trainer's log-probs are the sampling
    policy's own (the same weights; only numerics differ), say where a broken log-prob comes
    from instead of letting the non-finite guard blame the learning rate steps later:

    - the sampler's (or the strategy's) log-probs not finite where the trainer's are: the
      rollout strategy, or the sampler under the default one, named;
    - the trainer's not finite where the sampler's are: the log-prob kernel (model.logprob_impl)
      named; both not finite: the weights or the model, left to the non-finite guard;
    - `max_gap` (train.max_logprob_gap; None: not checked): the mean |trainer - sampler| over
      the counted tokens above it, e.g. a kernel without the log-sum-exp (a gap of nats, where
      bf16 sampling against fp32 or bf16 training gives ~1e-2).

    Args:
        values: `OnPolicyCheck.tensors` of the step's first pass over this rank's batch, read.
        step: the step, for the message.
        strategy: rollout.strategy. logprob_impl: model.logprob_impl.

    Raises:
        GrpoError: one line naming the strategy or the kernel.
    """
    from grpo.errors import GrpoError

    diff_sum, tokens, diff_max, sampler_bad, trainer_bad = values
    at = f"step {step}: " if step is not None else ""
    n = int(tokens)
    if sampler_bad and not trainer_bad:
        source = (
            "the sampler's log-probs (rollout.logprobs)"
            if strategy == "default"
            else f"the log-probs of the batch rollout strategy {strategy!r} returned "
            "(its rollout.logprobs)"
        )
        raise GrpoError(
            f"{at}{source} are not finite at {int(sampler_bad)} of {n} counted tokens, where "
            "the trainer's log-probs of the same tokens (before any update: the policy that "
            "sampled them) are finite; the update's ratio needs finite behaviour log-probs"
        )
    if trainer_bad and not sampler_bad:
        raise GrpoError(
            f"{at}the trainer's log-probs ({_kernel(logprob_impl)}) are not finite at "
            f"{int(trainer_bad)} of {n} counted tokens before any update, where the sampler's "
            "log-probs of the same tokens are finite: the log-prob kernel (or the model's "
            "training forward) made them, not the learning rate"
        )
    if not max_gap or sampler_bad or trainer_bad or n == 0:
        return
    mean = diff_sum / n
    if mean > max_gap:
        raise GrpoError(
            f"{at}the trainer's log-probs ({_kernel(logprob_impl)}) differ from the sampler's "
            f"(its float32 log_softmax) by {mean:.3g} nats per counted token on average (max "
            f"{diff_max:.3g}) before any update, above train.max_logprob_gap={max_gap:g}: "
            "the policy that sampled scored the same tokens, so this is the kernel's number, "
            "not rounding (bf16: ~1e-2), e.g. a log-softmax without its log-sum-exp; fix the "
            "kernel, or set train.max_logprob_gap=0 to train on it anyway"
        )


def first_pass_gap_limit(cfg, policy_version: int, trained_steps: int) -> float | None:
    """train.max_logprob_gap where the first pass's gap can only be numeric, else None: the
    batch was sampled by the policy being trained (`policy_version` == the updates it had,
    `trained_steps`: an asynchronous batch sampled `staleness` > 0 updates ago differs by
    learning) and by the default strategy (a plug-in strategy may replay earlier rows or
    sample at another temperature than the trainer scores at). Tokens an environment or tool
    wrote are not counted by the check at all (they have no sampler log-prob)."""
    gap = cfg.train.max_logprob_gap
    if not gap or cfg.rollout.strategy != "default" or policy_version != trained_steps:
        return None
    return gap


def _kernel(name: str) -> str:
    """``model.logprob_impl='chunked'``, with the function the name means now when a plug-in
    or user code replaced it (`grpo.plugins.replacements`)."""
    from grpo.plugins import replacements

    replaced = [r for r in replacements() if r.kind == "logprob impl" and r.name == name]
    if replaced:
        return f"model.logprob_impl={name!r}, replaced by {replaced[-1].new} ({replaced[-1].by})"
    return f"model.logprob_impl={name!r}"


def advantage_stats(advantages: torch.Tensor, mask: torch.Tensor, dist=SINGLE) -> dict:
    """adv/mean, adv/std (population), adv/min, adv/max and adv/zero_frac (exactly 0: e.g. a
    group of equal rewards) over the counted tokens of the global batch (`mask`: the loss
    mask, so what the update weighs); NaN when no token counts.

    Sums and extremes are taken on the device and read in one host sync; across ranks the
    counts and sums are added and the extremes reduced, so the numbers are those of the
    combined batch (not a mean of per-rank values).

    Args:
        advantages: (B, T_c) this rank's advantages.
        mask: (B, T_c) bool, the counted tokens.
    """
    with torch.no_grad():
        a = advantages.detach().double()
        inf = torch.tensor(math.inf, dtype=torch.float64, device=a.device)
        local = torch.stack(
            [
                mask.sum().double(),
                torch.where(mask, a, 0.0).sum(),
                torch.where(mask, a * a, 0.0).sum(),
                (mask & (a == 0)).sum().double(),
                torch.where(mask, a, inf).min() if a.numel() else inf,
                torch.where(mask, -a, inf).min() if a.numel() else inf,  # -max
            ]
        ).tolist()
    n, s, s2, zeros, lo, neg_hi = local
    sums = all_reduce_sum_dict({"n": n, "s": s, "s2": s2, "zeros": zeros}, dist)
    ext = all_reduce_max_dict({"neg_lo": -lo, "hi": -neg_hi}, dist)  # min = -max(-x)
    n = sums["n"]
    if n == 0:
        return dict.fromkeys(
            ("adv/mean", "adv/std", "adv/min", "adv/max", "adv/zero_frac"), float("nan")
        )
    mean = sums["s"] / n
    return {
        "adv/mean": mean,
        "adv/std": math.sqrt(max(sums["s2"] / n - mean * mean, 0.0)),
        "adv/min": -ext["neg_lo"],
        "adv/max": ext["hi"],
        "adv/zero_frac": sums["zeros"] / n,
    }


def rollout_metrics(batch: RolloutBatch, max_turns: int = 1) -> dict:
    """This rank's rollout/*, rewards/* and (multi-turn, `env_metrics`) env/* metrics."""
    lens = batch.rollout.generated_mask.sum(-1).float()  # generated tokens (all turns)
    out = {
        "rollout/reward_mean": float(batch.rewards.mean()),
        "rollout/reward_std": float(batch.rewards.std()) if len(batch.rewards) > 1 else 0.0,
        "rollout/frac_zero_std_groups": batch.frac_zero_std,
        "rollout/completion_len_mean": float(lens.mean()),
        "rollout/completion_len_min": float(lens.min()),
        "rollout/completion_len_max": float(lens.max()),
        "rollout/truncated_frac": float((~batch.rollout.finished).float().mean()),
        **batch.metrics,  # what sampling and the rewards reported, typed for the reduction
    }
    for name, v in batch.per_fn.items():
        out[f"rewards/{name}"] = float(v.mean())
    if "accuracy" in batch.per_fn:
        out["rollout/accuracy"] = float(batch.per_fn["accuracy"].mean())
    out.update(env_metrics(batch.rollout, max_turns))
    return out

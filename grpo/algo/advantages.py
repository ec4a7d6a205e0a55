"""Advantage estimators: token rewards of a batch -> (B, T_c) advantages.

Rows of one group are adjacent: row b belongs to group b // G. An estimator is a function under
`@register_advantage(name)` that takes any of these inputs by name (plain tensors; the trainer
hands it the *global* batch, all ranks concatenated, so batch statistics are exact under DDP):

    token_rewards  (B, T_c) float32  reward of each completion token: the sequence reward sits on
                                     the last completion token, per-token (process) rewards where
                                     the reward function put them, minus loss.kl_in_reward * KL_t
    scores         (B,)     float32  token_rewards summed over the row (the outcome reward)
    mask           (B, T_c) bool     True on completion tokens (the tokens that exist)
    group_size     int               G
    eps            float             loss.advantage_eps, added to a std before dividing
    gamma          float             loss.token_discount, discount per token for returns
    turn_ids       (B, T_c) long     the turn of each token (multi-turn; all 0 for one turn)
    turn_gamma     float             rollout.turn_discount: token rewards of turn k already carry
                                     turn_gamma^k, so each row sums to its discounted return
    gae_lambda     float             loss.gae_lambda, GAE's lambda (the `gae` estimator)
    rollout        EstimatorRollout  the sampled tokens of the global batch (below); gathered
                                     over ranks only for an estimator that declares it
    step           int               the training step being taken (1-based, as in
                                     metrics.jsonl); None outside the trainer

plus whatever `loss.advantage_kwargs` holds. It returns (B, T_c) advantages, or
``(advantages, {"name": scalar})``: the metrics are logged as ``advantage/<name>`` (computed
on the global batch, so the same on every rank: logged as they are), or
``(advantages, metrics, {"name": tensor})``: extras for the policy loss, (B,) or (B, T_c) over
the global batch, of which the trainer hands each micro-batch its own rows (the loss's
`extras` input): what must be computed over the whole batch, such as KL-Cov's selection of
tokens, is computed here. Only that shape; values
outside `mask` are ignored (set to 0). Sequence-level estimators broadcast one value per row
with `broadcast`. A 1-d result is refused, not broadcast: (B,) and (T_c,) are the same shape
whenever T_c == B, so a per-token vector returned by mistake would pass as per-row values on
exactly those steps.

An estimator that names neither `token_rewards` nor `scores` (nor takes **kwargs) reads no
rewards (`reads_rewards`): it drives learning on its own (`distill`), so a run may configure
``rewards: []``; one registered with ``minimises="metric"`` is judged by that metric by the
learning-health check (grpo.run.health).

eps: GRPO divides by (std + eps) with eps = 1e-4 by default, as TRL does; verl uses 1e-6.
A group of equal rewards gets advantage exactly 0 (never NaN) either way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from grpo.algo.registry import ADVANTAGES, estimator_objective, register_advantage
from grpo.errors import GrpoError
from grpo.metrics import split_metrics

INPUTS = (
    "token_rewards",
    "scores",
    "mask",
    "group_size",
    "eps",
    "gamma",
    "turn_ids",
    "turn_gamma",
    "gae_lambda",
    "rollout",
    "step",
)


@dataclass(frozen=True)
class EstimatorRollout:
    """What was sampled, for an estimator that reads more than rewards (a learned baseline, a
    critic's values): the global batch's rows, each rank's padded to the longest T_c.

    Attributes:
        completion_ids: (B, T_c) long, the completion region's token ids (pad after a row).
        completion_mask: (B, T_c) bool, its real tokens (multi-turn: observations too).
        generated_mask: (B, T_c) bool, the tokens the policy generated (= `mask`).
        turn_ids: (B, T_c) long, each token's turn (0 for one turn; -1 on holes and padding).
        logprobs: (B, T_c) float32, the sampler's log-probs (pi_old; 0 off `generated_mask`).
        prompt_lens: (B,) long, real prompt tokens of each row.
        extras: the named per-row tensors a rollout strategy or trained module attached to the
            batch (`RolloutBatch.extras`): (B,) or (B, T_c) each.
    """

    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    generated_mask: torch.Tensor
    turn_ids: torch.Tensor
    logprobs: torch.Tensor
    prompt_lens: torch.Tensor
    extras: dict[str, torch.Tensor] = field(default_factory=dict)


def wants_rollout(name) -> bool:
    """Whether the estimator `name` declares the `rollout` input (the trainer gathers the
    sampled tokens over ranks only then)."""
    import inspect

    try:
        params = inspect.signature(ADVANTAGES.get(name)).parameters
    except (TypeError, ValueError):
        return False
    return "rollout" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def reads_rewards(name) -> bool:
    """Whether the estimator `name` reads the rewards: declares `token_rewards` or `scores` (or
    takes **kwargs). One that does not drives learning on its own: ``rewards: []`` is allowed
    with it (grpo.checks)."""
    import inspect

    try:
        params = inspect.signature(ADVANTAGES.get(name)).parameters
    except (TypeError, ValueError):
        return True
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return True
    return "token_rewards" in params or "scores" in params


def broadcast(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B,) per-row values -> (B, T_c), the row's value on its completion tokens, 0 elsewhere."""
    return torch.where(mask, values[:, None], torch.zeros((), dtype=values.dtype))


def _groups(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    B = scores.shape[0]
    if B % group_size:
        raise ValueError(f"{B} rewards do not split into groups of {group_size}")
    return scores.float().view(-1, group_size)  # (P, G)


def _masked_whiten(values: torch.Tensor, mask: torch.Tensor, eps: float) -> torch.Tensor:
    """(values - mean) / (std + eps) over the masked entries of the whole batch (unbiased std)."""
    x = values[mask]  # (N,)
    if x.numel() < 2:
        return torch.zeros_like(values)
    return (values - x.mean()) / (x.std() + eps)


@register_advantage("grpo", claims=("shift_invariant", "group_zero_sum"))
def grpo(scores: torch.Tensor, mask: torch.Tensor, *, group_size: int, eps: float):
    """GRPO (Shao et al. 2024): (r_i - mean_g) / (std_g + eps), unbiased std of the group."""
    r = _groups(scores, group_size)
    a = (r - r.mean(dim=1, keepdim=True)) / (r.std(dim=1, keepdim=True) + eps)  # (P, G)
    return broadcast(a.view(-1), mask)


@register_advantage("dr_grpo", claims=("shift_invariant", "group_zero_sum"))
def dr_grpo(scores: torch.Tensor, mask: torch.Tensor, *, group_size: int):
    """Dr. GRPO (Liu et al. 2025): r_i - mean_g, no division by the std."""
    r = _groups(scores, group_size)
    return broadcast((r - r.mean(dim=1, keepdim=True)).view(-1), mask)


@register_advantage("batch_std", claims=("shift_invariant", "group_zero_sum"))
def batch_std(scores: torch.Tensor, mask: torch.Tensor, *, group_size: int, eps: float):
    """(r_i - mean_g) / (std_batch + eps): group baseline, the whole batch's std (unbiased)."""
    r = _groups(scores, group_size)
    centered = r - r.mean(dim=1, keepdim=True)  # (P, G)
    return broadcast((centered / (scores.float().std() + eps)).view(-1), mask)


@register_advantage("rloo", claims=("shift_invariant", "group_zero_sum"))
def rloo(scores: torch.Tensor, mask: torch.Tensor, *, group_size: int):
    """RLOO (Ahmadian et al. 2024): r_i - mean of the other G - 1 rewards of its group
    = G / (G - 1) * (r_i - mean_g)."""
    G = group_size
    if G < 2:
        raise ValueError("rloo needs group_size >= 2")
    r = _groups(scores, G)
    baseline = (r.sum(dim=1, keepdim=True) - r) / (G - 1)  # (P, G) leave-one-out mean
    return broadcast((r - baseline).view(-1), mask)


@register_advantage("opo", claims=("shift_invariant",))
def opo(scores: torch.Tensor, mask: torch.Tensor, *, group_size: int):
    """OPO (Hao et al. 2025): r_i - b_g with the length-weighted baseline
    b_g = sum_j L_j r_j / sum_j L_j (L = completion length), optimal for the sequence
    policy gradient's variance."""
    r = _groups(scores, group_size)
    lengths = mask.sum(-1).float().view(-1, group_size).clamp(min=1)  # (P, G)
    baseline = (lengths * r).sum(dim=1, keepdim=True) / lengths.sum(dim=1, keepdim=True)
    return broadcast((r - baseline).view(-1), mask)


def discounted_returns(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float):
    """R_t = sum over the row's later counted tokens t' of gamma^k r_t', k = the number of
    counted tokens from t to t'; (B, T_c), 0 outside the mask.

    The discount counts the model's own tokens only: a masked stretch inside a row (a tool's
    output in a multi-turn trajectory) is skipped, neither discounted nor a reset, so earlier
    turns see the final reward."""
    r = torch.where(mask, token_rewards.float(), 0.0)
    out = torch.zeros_like(r)
    running = torch.zeros_like(r[:, 0])
    for t in range(r.shape[1] - 1, -1, -1):
        running = torch.where(mask[:, t], r[:, t] + gamma * running, running)
        out[:, t] = running
    return torch.where(mask, out, 0.0)


def token_extra(rollout, key: str, mask: torch.Tensor, estimator: str, what: str, remedy: str):
    """The batch's per-token extra `key` (B, T_c) that estimator `estimator` reads (`what`,
    for messages): a GrpoError naming the extras the batch has and `remedy` when it is missing,
    or the shape it should have when it is not `mask`'s."""
    extras = rollout.extras if rollout is not None else {}
    if key not in extras:
        have = ", ".join(sorted(extras)) or "none"
        raise GrpoError(
            f"loss.advantage={estimator} reads {what} from the batch's extras ({key!r}; extras "
            f"here: {have}): {remedy}"
        )
    value = extras[key]
    if value.shape != mask.shape:
        raise GrpoError(
            f"loss.advantage={estimator}: extras[{key!r}] has shape {tuple(value.shape)}, "
            f"expected (B, T_c) = {tuple(mask.shape)}"
        )
    return value


def gae_returns(
    token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation (Schulman et al. 2016) over each row's counted tokens.

    Over the row's consecutive counted tokens t_1 < t_2 < ... (a masked stretch, e.g. a tool's
    output, is skipped: neither a step nor a reset), with V(t_{n+1}) = 0 after the last one:

        delta_i = r_{t_i} + gamma * V(t_{i+1}) - V(t_i)
        A_i     = delta_i + gamma * lam * A_{i+1}
        R_i     = A_i + V(t_i)          (the value target, lambda-returns)

    gamma = lam = 1 gives A = returns-to-go minus values. Computed in the inputs' dtype (pass
    float64 for a reference).

    Args:
        token_rewards: (B, T_c) reward of each token (0 off the mask is assumed, never read).
        values: (B, T_c) V(s_t), the value of the state before token t (never read off the mask).
        mask: (B, T_c) bool, the tokens that are actions.
        gamma, lam: the discount per counted token and GAE's lambda.

    Returns:
        (advantages, returns), (B, T_c) each, 0 off the mask.
    """
    mask = mask.bool()
    r = torch.where(mask, token_rewards, torch.zeros((), dtype=token_rewards.dtype))
    v = torch.where(mask, values.to(r.dtype), torch.zeros((), dtype=r.dtype))
    adv = torch.zeros_like(r)
    next_value = torch.zeros_like(r[:, 0])  # V(t_{i+1}) of each row: 0 after its last token
    running = torch.zeros_like(r[:, 0])  # A_{i+1}
    for t in range(r.shape[1] - 1, -1, -1):
        m = mask[:, t]
        a = r[:, t] + gamma * next_value - v[:, t] + gamma * lam * running
        adv[:, t] = torch.where(m, a, 0.0)
        running = torch.where(m, a, running)
        next_value = torch.where(m, v[:, t], next_value)
    returns = torch.where(mask, adv + v, 0.0)
    return adv, returns


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """1 - Var(R - V) / Var(R) over the masked tokens: 1 a perfect critic, 0 one no better than
    the mean return, < 0 worse; NaN when the returns do not vary (or fewer than 2 tokens)."""
    v, r = values[mask].double(), returns[mask].double()
    if r.numel() < 2 or float(r.var()) == 0.0:
        return float("nan")
    return float(1.0 - (r - v).var() / r.var())


@register_advantage("gae")
def gae(
    token_rewards: torch.Tensor,
    mask: torch.Tensor,
    rollout: EstimatorRollout | None,
    *,
    gamma: float,
    gae_lambda: float,
    eps: float,
    whiten: bool = True,
    values_key: str = "values",
):
    """PPO's advantages: GAE (`gae_returns`, loss.token_discount and loss.gae_lambda) over the token
    rewards (with the KL in them under loss.kl_in_reward, the classic PPO objective) and a
    critic's values, read from the batch's extras (`values_key`, (B, T_c): the `critic` module
    attaches them, grpo/modules/critic.py). `whiten`: (A - mean) / (std + eps) over the counted
    tokens of the global batch (all ranks), as verl and TRL do. Group structure is not used.

    Reports (global batch, before whitening): explained_variance of the values against the
    returns (left out on a step where the returns do not vary), value_mean, return_mean."""
    values = token_extra(
        rollout,
        values_key,
        mask,
        "gae",
        "the critic's values",
        "add the value model, modules: [{name: critic}] (docs/algorithm.md)",
    )  # (B, T_c)
    adv, returns = gae_returns(token_rewards.float(), values.float(), mask, gamma, gae_lambda)
    n = max(int(mask.sum()), 1)
    metrics = {
        "value_mean": float(torch.where(mask, values.float(), 0.0).sum()) / n,
        "return_mean": float(returns.sum()) / n,
    }
    ev = explained_variance(values.float(), returns, mask)
    if math.isfinite(ev):  # undefined (left out) when every return is the same
        metrics["explained_variance"] = ev
    if whiten:
        adv = torch.where(mask, _masked_whiten(adv, mask, eps), 0.0)
    return adv, metrics


@register_advantage("reinforce_pp", claims=("shift_invariant",))
def reinforce_pp(token_rewards: torch.Tensor, mask: torch.Tensor, *, eps: float, gamma: float):
    """REINFORCE++ (Hu 2025): discounted returns of the token rewards (which carry the KL
    penalty when loss.kl_in_reward > 0), whitened over all completion tokens of the batch."""
    return _masked_whiten(discounted_returns(token_rewards, mask, gamma), mask, eps)


@register_advantage("reinforce_pp_baseline", claims=("shift_invariant",))
def reinforce_pp_baseline(
    scores: torch.Tensor, mask: torch.Tensor, *, group_size: int, eps: float
) -> torch.Tensor:
    """REINFORCE++-baseline (Hu 2025): r_i - mean_g broadcast to the row's tokens, then
    whitened over all completion tokens of the batch (a token-weighted global std)."""
    r = _groups(scores, group_size)
    centered = broadcast((r - r.mean(dim=1, keepdim=True)).view(-1), mask)  # (B, T_c)
    return _masked_whiten(centered, mask, eps)


@register_advantage("grpo_turn", claims=("shift_invariant",))
def grpo_turn(
    token_rewards: torch.Tensor,
    mask: torch.Tensor,
    turn_ids: torch.Tensor,
    *,
    group_size: int,
    eps: float,
    turn_gamma: float,
) -> torch.Tensor:
    """Group-relative returns-to-go per turn (multi-turn credit): the tokens of turn k get
    (R_k - mean) / (std + eps), where R_k = sum_{k' >= k} turn_gamma^(k' - k) r_k' is the
    row's return from turn k on and mean / std are over the rows of its group that reached
    turn k (unbiased std; a turn only one row reached gets 0). With one turn it is `grpo`."""
    B = token_rewards.shape[0]
    r = torch.where(mask, token_rewards.float(), 0.0)
    rtg = r.flip(1).cumsum(1).flip(1)  # (B, T_c) sum of the row's rewards from t on
    turns = torch.where(mask, turn_ids, -1)
    K = int(turns.max()) + 1 if mask.any() else 0
    R = torch.full((B, max(K, 1)), float("nan"))  # (B, K) return from turn k, NaN: not reached
    for b in range(B):
        for k in range(K):
            at = (turns[b] == k).nonzero()
            if at.numel():
                R[b, k] = rtg[b, int(at[0])] / turn_gamma**k  # undo the turn_gamma^k weighting
    out = torch.zeros_like(r)
    groups = R.view(-1, group_size, R.shape[1])  # (P, G, K)
    for p in range(groups.shape[0]):
        for k in range(K):
            values = groups[p, :, k]
            reached = ~torch.isnan(values)
            if reached.sum() < 2:
                continue
            v = values[reached]
            a = (v - v.mean()) / (v.std() + eps)
            rows = p * group_size + reached.nonzero().flatten()
            for row, value in zip(rows.tolist(), a.tolist()):
                out[row] = torch.where(turns[row] == k, value, out[row])
    return out


@register_advantage("distill", claims=("shift_invariant",), minimises="reverse_kl")
def distill(
    mask: torch.Tensor,
    rollout: EstimatorRollout | None,
    *,
    teacher_key: str = "teacher_logprobs",
    coef: float = 1.0,
):
    """On-policy distillation (reverse-KL descent): the student samples, a frozen teacher
    scores each sampled token (the `teacher` module, grpo/modules/teacher.py, attaches
    log p_teacher under `teacher_key`), and each token's advantage is

        A_t = coef * (log p_teacher(y_t) - log pi_old(y_t))

    with pi_old the behaviour policy's log-probs (the sampler's, `rollout.logprobs`), both at
    rollout.temperature. Per token, with no discount: the policy gradient of
    sum_t A_t log pi(y_t) is the per-token gradient of the reverse KL(pi || p_teacher) on the
    sampled tokens. Reads no rewards (a run may set ``rewards: []``).

    Reports reverse_kl: the mean over the generated tokens of the global batch of
    log pi_old(y_t) - log p_teacher(y_t), a sampled estimate of the per-token reverse KL
    (the run's objective, `minimises`), and teacher_logprob_mean."""
    teacher = token_extra(
        rollout,
        teacher_key,
        mask,
        "distill",
        "the teacher's log-probs",
        "add the teacher, modules: [{name: teacher, kwargs: {path: ...}}] (docs/extending.md)",
    )  # (B, T_c)
    gap = torch.where(mask, teacher.float() - rollout.logprobs.float(), 0.0)  # (B, T_c)
    n = max(int(mask.sum()), 1)
    metrics = {
        "reverse_kl": -float(gap.double().sum()) / n,
        "teacher_logprob_mean": float(torch.where(mask, teacher.double(), 0.0).sum()) / n,
    }
    return coef * gap, metrics


def compute_advantages(
    name: str,
    token_rewards: torch.Tensor,
    mask: torch.Tensor,
    *,
    group_size: int,
    eps: float = 1e-4,
    gamma: float = 1.0,
    turn_ids: torch.Tensor | None = None,
    turn_gamma: float = 1.0,
    gae_lambda: float = 1.0,
    params: dict | None = None,
    rollout: EstimatorRollout | None = None,
    metrics: dict[str, float] | None = None,
    step: int | None = None,
    extras: dict[str, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Run the estimator `name` and check what it returned.

    Args:
        name: registered name or ``package.module:function``.
        token_rewards: (B, T_c) float rewards per completion token.
        mask: (B, T_c) bool, True on completion tokens.
        group_size: G.
        eps, gamma, turn_gamma, gae_lambda: as in the module docstring.
        turn_ids: (B, T_c) turn of each token (default: all 0, one turn).
        params: extra keyword arguments (``loss.advantage_kwargs``).
        rollout: the sampled tokens (`EstimatorRollout`), for estimators that declare it.
        metrics: when given, gets what the estimator reported, as ``advantage/<name>``.
        step: the training step (1-based), for an estimator that declares `step`.
        extras: when given, gets the extras the estimator returned for the policy loss,
            each (B,) or (B, T_c) (else they are checked and dropped).

    Returns:
        (B, T_c) float32 advantages, exactly 0 outside `mask`.

    Raises:
        GrpoError: the estimator returned anything but a (B, T_c) tensor (a 1-d (B,) too) or a
            non-finite value on a completion token (named, with the first bad row), or an extra
            that is not a (B,) or (B, T_c) tensor.
    """
    mask = mask.bool()
    token_rewards = torch.where(mask, token_rewards.float(), 0.0)  # nothing leaks from padding
    inputs = {
        "token_rewards": token_rewards,
        "scores": token_rewards.sum(-1),  # (B,)
        "mask": mask,
        "group_size": group_size,
        "eps": eps,
        "gamma": gamma,
        "turn_ids": torch.zeros_like(mask, dtype=torch.long) if turn_ids is None else turn_ids,
        "turn_gamma": turn_gamma,
        "gae_lambda": gae_lambda,
        "rollout": rollout,
        "step": step,
        **(params or {}),
    }
    out = ADVANTAGES.call(name, inputs)
    label = f"advantage estimator {name!r}"
    returned: dict[str, torch.Tensor] = {}
    if isinstance(out, tuple) and len(out) == 3:
        out, reported, returned = out
        out = (out, reported)
        returned = _check_extras(label, returned, mask)
    if extras is not None:
        extras.update(returned)
    out, reported = split_metrics(out, label)
    if metrics is not None:
        metrics.update({f"advantage/{k}": float(v) for k, v in reported.items()})
    if not isinstance(out, torch.Tensor):
        raise GrpoError(f"{label} returned {type(out).__name__}, expected a (B, T_c) tensor")
    if out.shape != mask.shape:
        # a 1-d result is never broadcast: (B,) cannot be told from (T_c,) when T_c == B
        hint = "; for one value per row return grpo.algo.broadcast(values, mask)"
        raise GrpoError(
            f"{label} returned shape {tuple(out.shape)}, expected (B, T_c) = {tuple(mask.shape)}"
            + (hint if out.dim() == 1 else "")
        )
    bad = ~torch.isfinite(out) & mask
    if bad.any():
        row = int(bad.any(-1).nonzero()[0])
        raise GrpoError(f"{label} returned a non-finite advantage at row {row}")
    return torch.where(mask, out.float(), 0.0)


def _check_extras(label: str, extras, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """The extras an estimator returned, checked: a dict of (B,) or (B, T_c) tensors."""
    if not isinstance(extras, dict):
        raise GrpoError(
            f"{label} returned {type(extras).__name__} as its third value, expected a dict of "
            "extras (name -> (B,) or (B, T_c) tensor)"
        )
    B, T = mask.shape
    for key, v in extras.items():
        if not isinstance(key, str) or not key:
            raise GrpoError(f"{label} returned the extra {key!r}: a name is a non-empty string")
        ok = isinstance(v, torch.Tensor) and (tuple(v.shape) in ((B,), (B, T)))
        if not ok:
            got = tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
            raise GrpoError(
                f"{label} returned the extra {key!r} of shape {got}, expected (B,) = ({B},) "
                f"or (B, T_c) = {(B, T)}"
            )
    return {k: v.detach() for k, v in extras.items()}


def group_advantages(
    rewards: torch.Tensor, group_size: int, scale: str = "group", eps: float = 1e-4
) -> torch.Tensor:
    """Per-sequence group-relative advantages (B,): the `grpo` ("group"), `batch_std`
    ("batch") or `dr_grpo` ("none") estimator on one value per row.

    Args:
        rewards: (B,) total reward per completion, B = P*G.
        group_size: G.
        scale: "group" divides by the group's std (GRPO); "batch" by the std of the whole
            batch; "none" does not divide (Dr. GRPO).
        eps: added to the std.

    Returns:
        (B,) float32 advantages.
    """
    names = {"group": "grpo", "batch": "batch_std", "none": "dr_grpo"}
    if scale not in names:
        raise ValueError(f"scale must be 'group', 'batch' or 'none', got {scale!r}")
    mask = torch.ones(rewards.shape[0], 1, dtype=torch.bool, device=rewards.device)
    fn = ADVANTAGES.get(names[scale])
    out = ADVANTAGES.call(
        fn, {"scores": rewards.float(), "mask": mask, "group_size": group_size, "eps": eps}
    )
    return out[:, 0]


def zero_std_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """(P,) bool: True for groups whose rewards are all equal (no learning signal)."""
    r = rewards.view(-1, group_size)
    return (r == r[:, :1]).all(dim=1)


def check_estimator(name: str, params: dict | None = None) -> None:
    """Fail early (before a run writes anything) on an unknown name or a bad parameter."""
    ADVANTAGES.check_params(name, params or {}, set(INPUTS))


__all__ = [
    "EstimatorRollout",
    "broadcast",
    "check_estimator",
    "compute_advantages",
    "discounted_returns",
    "estimator_objective",
    "explained_variance",
    "gae_returns",
    "group_advantages",
    "reads_rewards",
    "register_advantage",
    "zero_std_groups",
]

"""Agreement of our algorithm variants with verl's `core_algos.py` and TRL's `GRPOTrainer` math.

Every comparison feeds the same seeded float32 tensors (B=8 rows, G=4, T=7) to our registered
variant and to the reference, reports the max abs difference of the result (advantages; scalar
loss *and* gradient w.r.t. logprobs; per-token KL and its gradient) and, where they differ,
re-runs with one convention aligned to show that the stated convention is the whole difference.
Nothing of verl or TRL is copied here: their functions are called from the installed packages;
the one exception (TRL's advantages, which live inline in `_generate_and_score_completions`) is
evaluated from the formula read at the cited lines, and the script checks those lines still say so.

Run with a Python that has verl and trl (this repo's own env stays free of them):

    python -m venv /tmp/cmpenv --system-site-packages
    /tmp/cmpenv/bin/pip install --no-deps verl==0.9.1 trl==1.16.0 tensordict==0.15.3 \
        pyvers codetiming
    /tmp/cmpenv/bin/pip install omegaconf
    /tmp/cmpenv/bin/python -m benchmarks.compare_reference_impls

verl's package `__init__` imports ray (via `verl.protocol`); core_algos itself needs only torch,
numpy, omegaconf and tensordict. So `import_verl_core_algos` registers an empty `verl` package
(its real `__path__`, its `__init__` not run) and MagicMock stand-ins for `ray` and the ray
submodules that `verl.single_controller` imports for decorators; no ray code is ever called.

Writes benchmarks/results/algo_agreement.{json,md}.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import os
import sys
import types
from collections import defaultdict
from collections.abc import Callable
from importlib import metadata
from unittest import mock

import numpy as np
import torch

from benchmarks.harness import write_results
from grpo.algo import LossSettings, compute_advantages, kl_penalty, policy_loss
from grpo.algo.advantages import discounted_returns
from grpo.algo.losses import aggregate

B, G, T = 8, 4, 7
SEED = 1234
TOL = 1e-5  # fp32 agreement (STYLE.md)
EPS_LOW, EPS_HIGH = 0.2, 0.28  # asymmetric on purpose (DAPO clip-higher), so low/high mix-ups show
AGG_VERL = {
    "token_mean": "token-mean",
    "seq_mean_token_mean": "seq-mean-token-mean",
    "seq_mean_token_sum_norm": "seq-mean-token-sum-norm",
}
VERL_FILE = "verl/trainer/ppo/core_algos.py"


# ---------------------------------------------------------------------------------------------
# Importing the references
# ---------------------------------------------------------------------------------------------


def import_verl_core_algos():
    """verl.trainer.ppo.core_algos without ray: see the module docstring."""
    spec = importlib.util.find_spec("verl")
    if spec is None or spec.origin is None:
        sys.exit(
            "verl is not installed in this Python; see the docstring of "
            "benchmarks/compare_reference_impls.py for the venv commands"
        )
    root = os.path.dirname(spec.origin)
    pkg = types.ModuleType("verl")
    pkg.__path__ = [root]  # submodules import from the real files; verl/__init__.py is skipped
    sys.modules.setdefault("verl", pkg)
    if "ray" not in sys.modules and importlib.util.find_spec("ray") is None:
        for name in (
            "ray",
            "ray.util",
            "ray.actor",
            "ray.experimental",
            "ray.util.placement_group",
            "ray.util.scheduling_strategies",
        ):
            sys.modules[name] = mock.MagicMock(name=name)
    try:
        import verl.trainer.ppo.core_algos as core_algos
        from verl.trainer.config import AlgoConfig
        from verl.workers.config import ActorConfig
    except ImportError as e:
        sys.exit(
            f"cannot import verl core_algos ({e}); install the light deps listed in the "
            "docstring of benchmarks/compare_reference_impls.py"
        )
    return core_algos, AlgoConfig, ActorConfig


def import_trl():
    if importlib.util.find_spec("trl") is None:
        sys.exit(
            "trl is not installed in this Python; see the docstring of "
            "benchmarks/compare_reference_impls.py for the venv commands"
        )
    import trl.trainer.grpo_trainer as grpo_trainer
    import trl.trainer.rloo_trainer as rloo_trainer
    from trl.trainer.utils import nanstd

    return grpo_trainer, rloo_trainer, nanstd


# Filled by main(): the references are imported only when the comparison runs.
ca = AlgoConfig = ActorConfig = trl_grpo = trl_rloo = trl_nanstd = None


def where_in(obj, anchor: str) -> str:
    """'file:function Lnnn' of the line of `obj`'s source holding `anchor` (fails if it moved)."""
    lines, start = inspect.getsourcelines(obj)
    for i, line in enumerate(lines):
        if anchor in line:
            path = inspect.getsourcefile(obj)
            top = "/verl/" if "/verl/" in path else "/trl/"
            short = path[path.index(top) + 1 :]  # verl/trainer/ppo/core_algos.py
            return f"{short}:{obj.__qualname__} L{start + i}"
    raise SystemExit(f"{obj.__qualname__} no longer contains {anchor!r}: re-read the reference")


# ---------------------------------------------------------------------------------------------
# Data: identical seeded tensors for every comparison
# ---------------------------------------------------------------------------------------------


def make_mask(kind: str, gen: torch.Generator) -> torch.Tensor:
    """(B, T) bool, every row >= 1 token. right_padded: a prefix per row (what a sampler gives);
    holes: Bernoulli(0.6) positions (multi-turn responses with masked tool/observation tokens)."""
    if kind == "right_padded":
        lengths = torch.randint(1, T + 1, (B,), generator=gen)
        lengths[0] = T  # one full row
        return torch.arange(T)[None, :] < lengths[:, None]
    mask = torch.rand(B, T, generator=gen) < 0.6
    mask[torch.arange(B), torch.randint(0, T, (B,), generator=gen)] = True
    return mask


def make_rewards(kind: str, mask: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """(B, T) token rewards, 0 outside mask. binary: one reward in {0, 1} on each row's last
    token, group 0 mixed, group 1 all equal (a zero-std group); continuous: N(0, 1) on every
    token (process rewards), so the sequence reward (row sum) is continuous."""
    if kind == "binary":
        r = torch.randint(0, 2, (B,), generator=gen).float()
        r[0], r[1] = 1.0, 0.0
        r[G : 2 * G] = 1.0
        last = (mask.float() * torch.arange(1, T + 1)).argmax(-1)  # (B,) last completion token
        out = torch.zeros(B, T)
        out[torch.arange(B), last] = r
        return out
    return torch.where(mask, torch.randn(B, T, generator=gen), 0.0)


def make_loss_inputs(mask_kind: str, adv_kind: str, seed: int) -> dict[str, torch.Tensor]:
    """Log-probs, advantages and mask for the policy losses. Ratios exp(logprobs - old) have
    log-std 0.4 (some below 1 - eps_low, some above 1 + eps_high); one negative-advantage token
    gets ratio e^1.5 > 3 so the dual clip bites. Values outside the mask are random, not 0."""
    gen = torch.Generator().manual_seed(seed)
    mask = make_mask(mask_kind, gen)
    logprobs = -torch.empty(B, T).exponential_(1.0, generator=gen)  # (B, T)
    old = logprobs - 0.4 * torch.randn(B, T, generator=gen)
    ref = logprobs + 0.3 * torch.randn(B, T, generator=gen)
    if adv_kind == "seq":  # one value per row, as GRPO gives
        scores = torch.randn(B, generator=gen)
        adv = torch.where(mask, scores[:, None], 0.0)
    else:  # token-level advantages (process rewards, REINFORCE++)
        adv = torch.where(mask, torch.randn(B, T, generator=gen), 0.0)
    neg = (adv < 0) & mask
    b, t = (int(i) for i in neg.nonzero()[0])
    old[b, t] = logprobs[b, t] - 1.5  # ratio 4.48 on a negative-advantage token
    return {"logprobs": logprobs, "old": old, "ref": ref, "adv": adv, "mask": mask}


ADV_CASES = [(m, r) for m in ("right_padded", "holes") for r in ("binary", "continuous")]
LOSS_CASES = [(m, a) for m in ("right_padded", "holes") for a in ("seq", "token")]


def adv_case(mask_kind: str, reward_kind: str, seed: int = SEED):
    gen = torch.Generator().manual_seed(seed)
    mask = make_mask(mask_kind, gen)
    return make_rewards(reward_kind, mask, gen), mask


# ---------------------------------------------------------------------------------------------
# Calling each side
# ---------------------------------------------------------------------------------------------

INDEX = np.repeat(np.arange(B // G), G)  # verl's per-row group ids (rows of a group adjacent)


def verl_adv(name: str, rewards, mask, **kw) -> torch.Tensor:
    fn = ca.get_adv_estimator_fn(name)
    cfg = AlgoConfig(gamma=kw.pop("gamma", 1.0))
    adv, _ = fn(
        token_level_rewards=rewards.clone(),
        response_mask=mask.float(),
        index=INDEX,
        config=cfg,
        **kw,
    )
    return adv.float()


def ours_adv(name: str, rewards, mask, **kw) -> torch.Tensor:
    return compute_advantages(name, rewards, mask, group_size=G, **kw)


def trl_group_adv(rewards, mask, scale: str) -> torch.Tensor:
    """TRL GRPOTrainer advantages (sum_then_normalize), evaluated from the formula at
    grpo_trainer.py:_generate_and_score_completions (line cited in the row) with TRL's `nanstd`:
    a = r - nanmean_g(r), divided by (nanstd_g(r) or nanstd(r)) + 1e-4 unless scale == 'none'.
    The method itself needs a model, tokenizer and generation, so it is not called."""
    r = rewards.sum(-1)  # (B,) one reward function, weight 1
    mean_g = torch.nanmean(r.view(-1, G), dim=1).repeat_interleave(G)
    if scale == "batch":
        std = trl_nanstd(r).expand_as(r)
    else:
        std = trl_nanstd(r.view(-1, G), dim=1).repeat_interleave(G)
    a = r - mean_g
    if scale != "none":
        a = a / (std + 1e-4)
    return torch.where(mask, a[:, None], 0.0)


def trl_rloo_adv(rewards, mask) -> torch.Tensor:
    """TRL RLOOTrainer advantages from the formula at rloo_trainer.py (line cited in the row):
    baseline = (group sum - r) / (G - 1), normalize_advantages=False (its default)."""
    r = rewards.sum(-1).view(-1, G)
    base = (torch.nansum(r, dim=1, keepdim=True) - r) / (G - 1)
    return torch.where(mask, (r - base).reshape(-1)[:, None], 0.0)


def ours_loss(
    inp, *, loss: str, agg: str, kwargs=None, beta=0.0, kl="k3", dual_clip=None, eps_high=EPS_HIGH
):
    """Our scalar loss and d loss / d logprobs."""
    lp = inp["logprobs"].clone().requires_grad_(True)
    cfg = LossSettings(
        policy_loss=loss,
        policy_loss_kwargs=kwargs or {},
        aggregation=agg,
        beta=beta,
        kl_estimator=kl,
        epsilon_low=EPS_LOW,
        epsilon_high=eps_high,
        dual_clip=dual_clip,
    )
    out, _ = policy_loss(lp, inp["old"], inp["ref"], inp["adv"], inp["mask"], cfg, max_new_tokens=T)
    out.backward()
    return out.detach(), lp.grad


def verl_actor_cfg(inp, agg: str, clip_ratio_c=3.0, global_batch_size=B) -> object:
    """ActorConfig for one process: global_batch_info as workers/utils/losses.py:ppo_loss sets it
    (dp_size 1, this batch's tokens and rows), so no dp_size rescaling happens."""
    info = {
        "dp_size": 1,
        "batch_num_tokens": int(inp["mask"].sum()),
        "global_batch_size": global_batch_size,
        "loss_scale_factor": None,
    }
    return ActorConfig(
        strategy="fsdp",
        rollout_n=G,
        ppo_micro_batch_size_per_gpu=B,
        clip_ratio=EPS_LOW,
        clip_ratio_low=EPS_LOW,
        clip_ratio_high=EPS_HIGH,
        clip_ratio_c=clip_ratio_c,
        loss_agg_mode=AGG_VERL[agg],
        global_batch_info=info,
    )


def verl_loss(inp, *, mode: str, agg: str, clip_ratio_c=3.0, kl_coef=0.0):
    """verl's registered policy loss (and, with kl_coef, the KL term composed as
    workers/utils/losses.py:ppo_loss does: agg_loss(kl_penalty(low_var_kl)) * kl_loss_coef)."""
    lp = inp["logprobs"].clone().requires_grad_(True)
    cfg = verl_actor_cfg(inp, agg, clip_ratio_c)
    fn = ca.get_policy_loss_fn(mode)
    out, _ = fn(
        old_log_prob=inp["old"],
        log_prob=lp,
        advantages=inp["adv"],
        response_mask=inp["mask"],
        loss_agg_mode=AGG_VERL[agg],
        config=cfg,
    )
    if kl_coef:
        kld = ca.kl_penalty(lp, inp["ref"], "low_var_kl")
        out = out + kl_coef * ca.agg_loss(kld, inp["mask"], AGG_VERL[agg], **cfg.global_batch_info)
    out.backward()
    return out.detach(), lp.grad


class _OneProcessAccelerator:
    """What GRPOTrainer._compute_loss asks of its accelerator, for a single process."""

    num_processes = 1
    is_main_process = True
    sync_gradients = True

    def gather(self, x):
        return x

    def gather_for_metrics(self, x):
        return x

    def reduce(self, x, reduction="sum"):
        return x


def trl_loss(
    inp, *, loss_type: str, level="token", beta=0.0, eps_high=EPS_HIGH, bias_correction_kl=True
):
    """TRL's real GRPOTrainer._compute_loss on our tensors: a GRPOTrainer made without __init__
    (no model, no data), holding only the attributes the method reads, with
    `_get_per_token_logps_and_entropies` returning our logprobs (B, T) as if from the model.
    One process, no gradient accumulation, no vLLM, no entropy mask or bonus."""
    trainer = trl_grpo.GRPOTrainer.__new__(trl_grpo.GRPOTrainer)
    lp = inp["logprobs"].clone().requires_grad_(True)
    args = types.SimpleNamespace(
        use_bias_correction_kl=bias_correction_kl,
        delta=None,
        sapo_temperature_pos=1.0,
        sapo_temperature_neg=1.05,
        steps_per_generation=1,
    )
    trainer.__dict__.update(
        args=args,
        loss_type=loss_type,
        importance_sampling_level=level,
        beta=beta,
        epsilon_low=EPS_LOW,
        epsilon_high=eps_high,
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        use_vllm=False,
        aux_loss_enabled=False,
        _entropy_bonus_enabled=False,
        current_gradient_accumulation_steps=1,
        max_completion_length=T,
        model=torch.nn.Module(),
        accelerator=_OneProcessAccelerator(),
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        _get_per_token_logps_and_entropies=lambda *a, **k: (lp, torch.zeros(B, T), None),
    )
    mask = inp["mask"]
    inputs = {
        "prompt_ids": torch.zeros(B, 1, dtype=torch.long),
        "prompt_mask": torch.ones(B, 1, dtype=torch.long),
        "completion_ids": torch.zeros(B, T, dtype=torch.long),
        "completion_mask": mask.long(),
        "advantages": inp["adv"],
        "old_per_token_logps": inp["old"],
        "ref_per_token_logps": inp["ref"],
        "num_items_in_batch": mask.sum(),
    }
    out = trl_grpo.GRPOTrainer._compute_loss(trainer, trainer.model, inputs)
    out.backward()
    return out.detach(), lp.grad


# ---------------------------------------------------------------------------------------------
# Alignment helpers (used only to *verify* a stated convention difference)
# ---------------------------------------------------------------------------------------------


def whiten_eps(values: torch.Tensor, mask: torch.Tensor) -> float:
    """eps with std + eps == sqrt(var + 1e-8): our (x - m) / (std + eps) then equals verl's
    masked_whiten (x - m) * rsqrt(var + 1e-8) (unbiased var in both)."""
    x = values[mask].double()
    return float(torch.sqrt(x.var() + 1e-8) - x.std())


def compact(x: torch.Tensor, mask: torch.Tensor):
    """Move each row's completion tokens to the front (order kept); returns (x', mask', idx)."""
    idx = torch.sort((~mask).int(), dim=1, stable=True).indices  # (B, T)
    return x.gather(1, idx), mask.gather(1, idx), idx


def uncompact(y: torch.Tensor, mask: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Inverse of `compact`: y (B, T) back to the original positions; `mask` is the original."""
    return torch.where(mask, torch.zeros_like(y).scatter(1, idx, y), 0.0)


def ours_rpp_verl_aligned(rewards, mask, gamma: float) -> torch.Tensor:
    """Ours `reinforce_pp` with both verl conventions adopted: returns discounted per completion
    token (holes skipped, via compaction) and eps inside the sqrt (via whiten_eps)."""
    rc, mc, idx = compact(rewards, mask)
    eps = whiten_eps(discounted_returns(rc, mc, gamma), mc)
    return uncompact(ours_adv("reinforce_pp", rc, mc, eps=eps, gamma=gamma), mask, idx)


def ours_rpp_eps_aligned(rewards, mask, gamma: float) -> torch.Tensor:
    """Ours `reinforce_pp` with only verl's whitening eps adopted (discount per position kept)."""
    eps = whiten_eps(discounted_returns(rewards, mask, gamma), mask)
    return ours_adv("reinforce_pp", rewards, mask, eps=eps, gamma=gamma)


def ours_rppb_verl_aligned(rewards, mask) -> torch.Tensor:
    centered = ours_adv("dr_grpo", rewards, mask)  # r - mean_g on the row's tokens
    return ours_adv("reinforce_pp_baseline", rewards, mask, eps=whiten_eps(centered, mask))


# ---------------------------------------------------------------------------------------------
# Comparisons
# ---------------------------------------------------------------------------------------------


def diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max())


def _jsonable(x: torch.Tensor):
    """A scalar as a float; a (B, T) tensor as B strings of 5 significant digits (the exact
    differences are in the *_max_abs_diff fields)."""
    if x.dim() == 0:
        return float(x)
    return [" ".join(f"{v:.5g}" for v in row) for row in x.tolist()]


def run_cases(cases, fn: Callable, aligned: Callable | None = None) -> dict:
    """fn(*case) -> (ours, theirs) or (ours_loss, ours_grad, theirs_loss, theirs_grad);
    aligned(*case) -> the same, with the convention difference removed."""

    def split(res):  # -> (ours, theirs, ours_grad, theirs_grad or None)
        return (res[0], res[1], None, None) if len(res) == 2 else (res[0], res[2], res[1], res[3])

    def worst_of(res) -> float:
        o, t, og, tg = split(res)
        return max(diff(o, t), diff(og, tg) if og is not None else 0.0)

    out, worst, worst_aligned = {}, 0.0, None
    for case in cases:
        o, t, og, tg = split(fn(*case))
        name = "/".join(case)
        rec = {"ours": _jsonable(o), "theirs": _jsonable(t), "value_max_abs_diff": diff(o, t)}
        if og is not None:
            rec["grad_max_abs_diff"] = diff(og, tg)
        d = max(rec["value_max_abs_diff"], rec.get("grad_max_abs_diff", 0.0))
        if aligned is not None:
            rec["aligned_diff"] = worst_of(aligned(*case))
            worst_aligned = max(worst_aligned or 0.0, rec["aligned_diff"])
        rec["max_abs_diff"] = d
        out[name] = rec
        worst = max(worst, d)
    return {"cases": out, "max_abs_diff": worst, "aligned_diff": worst_aligned}


def differing(result: dict) -> str:
    bad = [k for k, v in result["cases"].items() if v["max_abs_diff"] > TOL]
    return ", ".join(bad) if bad else "none"


def record(rows: list, variant: str, ref: str, result: dict, note: str, setting: str = ""):
    """Append one comparison (a table row; its per-case values stay in the JSON)."""
    agree = result["max_abs_diff"] <= TOL
    rows.append(
        {
            "variant": variant + (f" ({setting})" if setting else ""),
            "compared_with": ref,
            "max_abs_diff": result["max_abs_diff"],
            "aligned_diff": result["aligned_diff"],
            "agrees": agree,
            "cases_over_tol": differing(result),
            "note": note or "-",
            "cases": result["cases"],
        }
    )


def compare_advantages(record: Callable) -> None:
    fn = ca.compute_grpo_outcome_advantage
    at = where_in(fn, "(id2std[index[i]] + epsilon)")
    record(
        "grpo",
        f"{at} (norm_adv_by_std_in_grpo=True)",
        run_cases(
            ADV_CASES,
            lambda m, r: (ours_adv("grpo", *adv_case(m, r)), verl_adv("grpo", *adv_case(m, r))),
            lambda m, r: (
                ours_adv("grpo", *adv_case(m, r), eps=1e-6),
                verl_adv("grpo", *adv_case(m, r)),
            ),
        ),
        "eps outside the sqrt in both, unbiased group std in both; only eps differs: ours "
        "1e-4 (TRL's) vs verl 1e-6. Aligned: ours eps=1e-6.",
    )
    fnv = ca.compute_grpo_vectorized_outcome_advantage
    record(
        "grpo",
        f"{where_in(fnv, '(std_g[g] + epsilon)')} (grpo_vectorized)",
        run_cases(
            ADV_CASES,
            lambda m, r: (
                ours_adv("grpo", *adv_case(m, r)),
                verl_adv("grpo_vectorized", *adv_case(m, r)),
            ),
            lambda m, r: (
                ours_adv("grpo", *adv_case(m, r), eps=1e-6),
                verl_adv("grpo_vectorized", *adv_case(m, r)),
            ),
        ),
        "as grpo: eps 1e-4 vs 1e-6 outside the sqrt. Aligned: ours eps=1e-6.",
    )
    record(
        "dr_grpo",
        f"{at} (norm_adv_by_std_in_grpo=False)",
        run_cases(
            ADV_CASES,
            lambda m, r: (
                ours_adv("dr_grpo", *adv_case(m, r)),
                verl_adv("grpo", *adv_case(m, r), norm_adv_by_std_in_grpo=False),
            ),
        ),
        "",
    )
    record(
        "rloo",
        where_in(ca.compute_rloo_outcome_advantage, "response_num / (response_num - 1)"),
        run_cases(
            ADV_CASES,
            lambda m, r: (ours_adv("rloo", *adv_case(m, r)), verl_adv("rloo", *adv_case(m, r))),
        ),
        "verl writes G/(G-1) * (r - mean_g); ours r - leave-one-out mean: same value.",
    )
    record(
        "opo",
        where_in(ca.compute_opo_outcome_advantage, "(len_tensor * score_tensor).sum()"),
        run_cases(
            ADV_CASES,
            lambda m, r: (ours_adv("opo", *adv_case(m, r)), verl_adv("opo", *adv_case(m, r))),
        ),
        "length = number of completion tokens (mask sum) in both, holes excluded.",
    )
    rpp = ca.compute_reinforce_plus_plus_outcome_advantage
    rpp_at = where_in(rpp, "verl_F.masked_whiten(returns, response_mask)")
    record(
        "reinforce_pp",
        f"{rpp_at} (gamma=1)",
        run_cases(
            ADV_CASES,
            lambda m, r: (
                ours_adv("reinforce_pp", *adv_case(m, r), gamma=1.0),
                verl_adv("reinforce_plus_plus", *adv_case(m, r), gamma=1.0),
            ),
            lambda m, r: (
                ours_rpp_verl_aligned(*adv_case(m, r), 1.0),
                verl_adv("reinforce_plus_plus", *adv_case(m, r), gamma=1.0),
            ),
        ),
        "whitening eps: ours (x-m)/(std+eps), eps=1e-4 outside the sqrt; verl "
        "utils/torch_functional.py:masked_whiten (x-m)*rsqrt(var+1e-8), inside (unbiased "
        "var in both; verl's +1e-8 in masked_mean's denominator is below fp32 resolution). "
        "Aligned: ours eps chosen so std+eps = sqrt(var+1e-8).",
    )
    record(
        "reinforce_pp",
        f"{rpp_at} (gamma=0.9)",
        run_cases(
            ADV_CASES,
            lambda m, r: (
                ours_adv("reinforce_pp", *adv_case(m, r), gamma=0.9),
                verl_adv("reinforce_plus_plus", *adv_case(m, r), gamma=0.9),
            ),
            lambda m, r: (
                ours_rpp_verl_aligned(*adv_case(m, r), 0.9),
                verl_adv("reinforce_plus_plus", *adv_case(m, r), gamma=0.9),
            ),
        ),
        "eps as at gamma=1 only. Masks with holes: both carry the running return across a "
        "masked position undiscounted (the discount counts completion tokens), so the "
        "holes cases agree too. Aligned: eps as at gamma=1 (ours on rows with completion "
        "tokens moved to the front, which must not change ours).",
    )
    record(
        "reinforce_pp",
        f"{rpp_at} (gamma=0.9)",
        run_cases(
            ADV_CASES,
            lambda m, r: (
                ours_rpp_eps_aligned(*adv_case(m, r), 0.9),
                verl_adv("reinforce_plus_plus", *adv_case(m, r), gamma=0.9),
            ),
            lambda m, r: (
                ours_rpp_verl_aligned(*adv_case(m, r), 0.9),
                verl_adv("reinforce_plus_plus", *adv_case(m, r), gamma=0.9),
            ),
        ),
        "the discount convention alone: ours with verl's whitening eps; agreement on the "
        "holes cases shows the same per-completion-token discount. Aligned: completion "
        "tokens moved to the front.",
        setting="eps aligned, discount not",
    )
    rppb = ca.compute_reinforce_plus_plus_baseline_outcome_advantage
    record(
        "reinforce_pp_baseline",
        where_in(rppb, "verl_F.masked_whiten(scores, response_mask)"),
        run_cases(
            ADV_CASES,
            lambda m, r: (
                ours_adv("reinforce_pp_baseline", *adv_case(m, r)),
                verl_adv("reinforce_plus_plus_baseline", *adv_case(m, r)),
            ),
            lambda m, r: (
                ours_rppb_verl_aligned(*adv_case(m, r)),
                verl_adv("reinforce_plus_plus_baseline", *adv_case(m, r)),
            ),
        ),
        "group-centred reward broadcast to tokens, whitened over all completion tokens in "
        "both; eps: ours 1e-4 outside the sqrt, verl 1e-8 inside (its `epsilon` argument is "
        "unused). Aligned: ours eps chosen so std+eps = sqrt(var+1e-8).",
    )

    gen_fn = trl_grpo.GRPOTrainer._generate_and_score_completions
    trl_at = where_in(gen_fn, "advantages = advantages / (std_rewards + 1e-4)")
    where_in(gen_fn, "std_rewards = nanstd(rewards).expand_as(rewards)")  # the batch branch
    formula = (
        "formula read from TRL source (method needs a model + generation), evaluated "
        "with TRL's trl.trainer.utils.nanstd"
    )
    for ours_name, scale in (("grpo", "group"), ("dr_grpo", "none"), ("batch_std", "batch")):
        record(
            ours_name,
            f"{trl_at} (scale_rewards={scale!r})",
            run_cases(
                ADV_CASES,
                lambda m, r, s=scale, n=ours_name: (
                    ours_adv(n, *adv_case(m, r)),
                    trl_group_adv(*adv_case(m, r), s),
                ),
            ),
            f"{formula}; both eps=1e-4 outside the sqrt, unbiased std.",
        )
    rloo_at = where_in(
        trl_rloo.RLOOTrainer._generate_and_score_completions,
        "baselines = (grouped_sum - grouped_rewards) / (scorable_counts - 1)",
    )
    record(
        "rloo",
        f"{rloo_at} (normalize_advantages=False)",
        run_cases(
            ADV_CASES,
            lambda m, r: (ours_adv("rloo", *adv_case(m, r)), trl_rloo_adv(*adv_case(m, r))),
        ),
        "formula read from TRL source, evaluated here.",
    )


def loss_case(m: str, a: str) -> dict:
    return make_loss_inputs(m, a, SEED + 17)


def compare_policy_losses(record: Callable) -> None:
    van = where_in(ca.compute_policy_loss_vanilla, "pg_losses3 = -advantages * clip_ratio_c")
    for agg in AGG_VERL:
        record(
            "clip",
            f"{van} (loss_agg_mode={AGG_VERL[agg]})",
            run_cases(
                LOSS_CASES,
                lambda m, a, g=agg: (
                    *ours_loss(loss_case(m, a), loss="clip", agg=g),
                    *verl_loss(loss_case(m, a), mode="vanilla", agg=g),
                ),
                lambda m, a, g=agg: (
                    *ours_loss(loss_case(m, a), loss="clip", agg=g, dual_clip=3.0),
                    *verl_loss(loss_case(m, a), mode="vanilla", agg=g),
                ),
            ),
            "verl's vanilla loss always applies the dual clip (clip_ratio_c=3.0 default; it "
            "asserts c > 1, so it cannot be switched off); ours only with loss.dual_clip. "
            "The forced ratio-4.5 token with A<0 differs. Aligned: ours dual_clip=3.0. "
            "Aggregation: verl's agg_loss with global_batch_info for one process equals "
            "ours (seq-mean over B rows; sum-norm by T).",
            setting=agg,
        )
    gspo_at = where_in(ca.compute_policy_loss_gspo, "log_prob - log_prob.detach()")
    for agg in AGG_VERL:
        record(
            "gspo",
            f"{gspo_at} (loss_agg_mode={AGG_VERL[agg]})",
            run_cases(
                LOSS_CASES,
                lambda m, a, g=agg: (
                    *ours_loss(loss_case(m, a), loss="gspo", agg=g),
                    *verl_loss(loss_case(m, a), mode="gspo", agg=g),
                ),
                lambda m, a, g=agg: (
                    *ours_loss(loss_case(m, a), loss="gspo_token", agg=g),
                    *verl_loss(loss_case(m, a), mode="gspo", agg=g),
                ),
            ),
            "verl's 'gspo' is the GSPO-token form sg[s_i]*pi/sg[pi]; ours 'gspo' sends the "
            "gradient through s_i = exp(mean log rho). Same loss and gradient when A is "
            "constant per row (seq cases); with token-level A the gradients differ. Aligned: "
            "ours gspo_token.",
            setting=agg,
        )
        record(
            "gspo_token",
            f"{gspo_at} (loss_agg_mode={AGG_VERL[agg]})",
            run_cases(
                LOSS_CASES,
                lambda m, a, g=agg: (
                    *ours_loss(loss_case(m, a), loss="gspo_token", agg=g),
                    *verl_loss(loss_case(m, a), mode="gspo", agg=g),
                ),
            ),
            "verl additionally clamps log s_i,t at 10 (not reached here).",
            setting=agg,
        )
    cis_at = where_in(ca.compute_policy_loss_cispo, "torch.clamp(ratio, 1 - clip_ratio_low")
    for agg in AGG_VERL:
        record(
            "cispo",
            f"{cis_at} (loss_agg_mode={AGG_VERL[agg]})",
            run_cases(
                LOSS_CASES,
                lambda m, a, g=agg: (
                    *ours_loss(loss_case(m, a), loss="cispo", agg=g),
                    *verl_loss(loss_case(m, a), mode="cispo", agg=g),
                ),
                lambda m, a, g=agg: (
                    *ours_loss(loss_case(m, a), loss="cispo", agg=g, kwargs={"clip_low": True}),
                    *verl_loss(loss_case(m, a), mode="cispo", agg=g),
                ),
            ),
            "verl clips the IS weight on both sides [1-eps_low, 1+eps_high]; ours (the "
            "paper's form) only above unless clip_low=true. Aligned: ours clip_low=true.",
            setting=agg,
        )
    sapo_at = where_in(ca.compute_policy_loss_sapo, 'loss_agg_mode="seq-mean-token-mean"')
    record(
        "sapo",
        sapo_at,
        run_cases(
            LOSS_CASES,
            lambda m, a: (
                *ours_loss(loss_case(m, a), loss="sapo", agg="seq_mean_token_mean"),
                *verl_loss(loss_case(m, a), mode="sapo", agg="seq_mean_token_mean"),
            ),
        ),
        "tau_pos 1.0 / tau_neg 1.05 in both. verl always aggregates seq-mean-token-mean, "
        "whatever loss_agg_mode says; compared under that.",
        setting="seq_mean_token_mean",
    )
    geo_at = where_in(ca.compute_policy_loss_geo_mean, "pg_loss = torch.mean(pg_losses)")
    record(
        "gmpo",
        f"{geo_at} (geo_mean)",
        run_cases(
            LOSS_CASES,
            lambda m, a: (
                *ours_loss(loss_case(m, a), loss="gmpo", agg="seq_mean_token_mean"),
                *verl_loss(loss_case(m, a), mode="geo_mean", agg="seq_mean_token_mean"),
            ),
        ),
        "eps_low/eps_high are log-space bounds in both; the row advantage is the row's mean A "
        "in both. verl ignores loss_agg_mode (mean over rows); ours with seq_mean_token_mean "
        "gives the same mean over rows.",
        setting="seq_mean_token_mean",
    )
    record(
        "clip + 0.04*k3",
        f"{van} + {VERL_FILE}:kl_penalty(low_var_kl) composed as "
        "verl/workers/utils/losses.py:ppo_loss",
        run_cases(
            LOSS_CASES,
            lambda m, a: (
                *ours_loss(
                    loss_case(m, a), loss="clip", agg="token_mean", beta=0.04, dual_clip=3.0
                ),
                *verl_loss(loss_case(m, a), mode="vanilla", agg="token_mean", kl_coef=0.04),
            ),
        ),
        "KL as a loss term (use_kl_loss), k3 clamped at +-20 / +-10 in both.",
        setting="token_mean, dual_clip=3",
    )


def compare_kl(record: Callable) -> None:
    def kl_inputs(kind: str):
        gen = torch.Generator().manual_seed(SEED + 31)
        lp = -torch.empty(B, T).exponential_(1.0, generator=gen)
        if kind == "normal":
            return lp, lp + 0.5 * torch.randn(B, T, generator=gen)
        d = torch.tensor([-25.0, -15.0, -5.0, 0.0, 2.5, 3.0, 12.0, 25.0])  # ref - logp, clamps bite
        return lp, lp + d.repeat(B * T // 8 + 1)[: B * T].view(B, T)

    def run(kind: str, ours_est: str, verl_est: str, clamps: bool):
        lp, ref = kl_inputs(kind)
        a, b = lp.clone().requires_grad_(True), lp.clone().requires_grad_(True)
        ko = kl_penalty(a, ref, ours_est, *((20.0, 10.0) if clamps else (None, None)))
        kv = ca.kl_penalty(b, ref, verl_est)
        ko.sum().backward()
        kv.sum().backward()
        return ko.detach(), a.grad, kv.detach(), b.grad

    kl_at = where_in(ca.kl_penalty_forward, 'if kl_penalty in ("low_var_kl", "k3"):')
    cases = [("normal",), ("extreme",)]
    for ours_est, verl_est in (("k1", "k1"), ("k2", "k2"), ("k3", "low_var_kl")):
        aligned = None
        note = "clamps: d to +-20 then the estimate to +-10 in both."
        if ours_est != "k3":
            aligned = lambda kind, o=ours_est, v=verl_est: run(kind, o, v, clamps=False)  # noqa: E731
            note = (
                "ours applies loss.log_ratio_clamp=20 / loss.kl_clamp=10 (LossSettings "
                "defaults) to every estimator; verl clamps only k3 (low_var_kl). The extreme "
                "case differs. Aligned: ours with both clamps None."
            )
        record(
            f"kl {ours_est}",
            f"{kl_at.rsplit(' L', 1)[0]} ({verl_est!r})",
            run_cases(cases, lambda kind, o=ours_est, v=verl_est: run(kind, o, v, True), aligned),
            note,
            setting="log_ratio_clamp=20, kl_clamp=10",
        )


def compare_trl_losses(record: Callable) -> None:
    cl = trl_grpo.GRPOTrainer._compute_loss
    line = lambda anchor: where_in(cl, anchor)  # noqa: E731
    grpo_at = line('if self.loss_type in ["grpo", "sapo"]:')
    pairs = [
        ("clip", "seq_mean_token_mean", "grpo", grpo_at),
        ("clip", "token_mean", "bnpo", line('elif self.loss_type == "bnpo":')),
        ("clip", "token_mean", "dapo", line('elif self.loss_type in ["cispo", "dapo", "vespo"]:')),
        ("clip", "seq_mean_token_sum_norm", "dr_grpo", line('elif self.loss_type == "dr_grpo":')),
        ("sapo", "seq_mean_token_mean", "sapo", grpo_at),
    ]
    for ours_name, agg, lt, at in pairs:
        record(
            ours_name,
            f"{at} (loss_type={lt!r})",
            run_cases(
                LOSS_CASES,
                lambda m, a, o=ours_name, g=agg, t=lt: (
                    *ours_loss(loss_case(m, a), loss=o, agg=g),
                    *trl_loss(loss_case(m, a), loss_type=t),
                ),
            ),
            "real _compute_loss called; TRL has no dual clip (ours off by default).",
            setting=agg,
        )
    seq_at = line('elif self.importance_sampling_level == "sequence":')
    record(
        "gspo",
        f"{seq_at} (loss_type='grpo', importance_sampling_level='sequence')",
        run_cases(
            LOSS_CASES,
            lambda m, a: (
                *ours_loss(loss_case(m, a), loss="gspo", agg="seq_mean_token_mean"),
                *trl_loss(loss_case(m, a), loss_type="grpo", level="sequence"),
            ),
        ),
        "TRL's sequence level sends the gradient through exp(mean log rho), like ours "
        "'gspo' (not gspo_token).",
        setting="seq_mean_token_mean",
    )
    cis_at = line("clamped_ratios = torch.clamp(coef_1, max=self.epsilon_high)")
    record(
        "cispo",
        f"{cis_at} (loss_type='cispo')",
        run_cases(
            LOSS_CASES,
            lambda m, a: (
                *ours_loss(loss_case(m, a), loss="cispo", agg="token_mean"),
                *trl_loss(loss_case(m, a), loss_type="cispo"),
            ),
            lambda m, a: (
                *ours_loss(loss_case(m, a), loss="cispo", agg="token_mean"),
                *trl_loss(loss_case(m, a), loss_type="cispo", eps_high=1.0 + EPS_HIGH),
            ),
        ),
        f"TRL caps the IS weight at epsilon_high itself (ScaleRL's eps_max, e.g. 5.0); ours "
        f"at 1 + epsilon_high. Same number ({EPS_HIGH}) in both configs differs. Aligned: TRL "
        f"epsilon_high = 1 + {EPS_HIGH}. No lower clip in either; TRL divides by "
        "num_items_in_batch (= tokens here): token_mean.",
        setting="token_mean",
    )
    kl_at = line("per_token_kl = per_token_kl * coef_1")
    record(
        "clip + 0.04*k3",
        f"{kl_at} (loss_type='grpo', beta=0.04)",
        run_cases(
            LOSS_CASES,
            lambda m, a: (
                *ours_loss(loss_case(m, a), loss="clip", agg="seq_mean_token_mean", beta=0.04),
                *trl_loss(loss_case(m, a), loss_type="grpo", beta=0.04),
            ),
            lambda m, a: (
                *ours_loss(loss_case(m, a), loss="clip", agg="seq_mean_token_mean", beta=0.04),
                *trl_loss(loss_case(m, a), loss_type="grpo", beta=0.04, bias_correction_kl=False),
            ),
        ),
        "TRL's use_bias_correction_kl=True (its default) multiplies the k3 KL by the "
        "differentiable ratio pi/pi_old; ours does not. Aligned: use_bias_correction_kl="
        "False. TRL does not clamp k3; ours does at 20/10 (not reached here).",
        setting="seq_mean_token_mean",
    )


def compare_empty_row_aggregation(record: Callable) -> None:
    """Outside the main data (every row there has >= 1 token): which rows a seq-mean counts."""
    gen = torch.Generator().manual_seed(SEED + 5)
    mask = make_mask("right_padded", gen)
    mask[3] = False  # one row with no completion tokens
    values = torch.randn(B, T, generator=gen)

    def run(agg: str, global_batch_size):
        ours = aggregate(values, mask, agg, float(B * T if agg.endswith("norm") else B))
        theirs = ca.agg_loss(
            values, mask, AGG_VERL[agg], dp_size=1, global_batch_size=global_batch_size
        )
        return ours, theirs

    agg_at = where_in(ca.agg_loss, "seq_mask = (seq_mask > 0).float()  # exclude fully masked")
    for agg in ("seq_mean_token_mean", "seq_mean_token_sum_norm"):
        record(
            f"aggregation {agg}",
            f"{agg_at} (one empty row, global_batch_size=None)",
            run_cases([("empty_row",)], lambda _, g=agg: run(g, None), lambda _, g=agg: run(g, B)),
            "extra case with one empty row: ours divides by all B rows, verl's default "
            "(global_batch_size=None) by the rows with >= 1 token. Aligned: verl "
            "global_batch_size=B, the value trainer/ppo/ray_trainer.py passes "
            "(ppo_mini_batch_size * rollout.n: all rows).",
        )


def main() -> None:
    global ca, AlgoConfig, ActorConfig, trl_grpo, trl_rloo, trl_nanstd
    ca, AlgoConfig, ActorConfig = import_verl_core_algos()
    trl_grpo, trl_rloo, trl_nanstd = import_trl()
    torch.manual_seed(SEED)
    rows: list[dict] = []
    rec = functools.partial(record, rows)
    for compare in (
        compare_advantages,
        compare_policy_losses,
        compare_kl,
        compare_trl_losses,
        compare_empty_row_aggregation,
    ):
        compare(rec)
    os.environ["GIT_OPTIONAL_LOCKS"] = "0"  # env_stamp's `git status` must not touch the index
    meta = {
        "command": "/tmp/cmpenv/bin/python -m benchmarks.compare_reference_impls",
        "shape": f"B={B} G={G} T={T}, float32, seed {SEED}; tolerance {TOL}",
        "cases": "advantages: mask right_padded|holes x reward binary|continuous; losses: mask "
        "right_padded|holes x advantages seq|token; eps_low/high "
        f"{EPS_LOW}/{EPS_HIGH}",
        "verl": metadata.version("verl"),
        "trl": metadata.version("trl"),
        "torch": torch.__version__,
        "verl_import": "verl/__init__.py skipped (module stub with the real __path__); ray and "
        "5 ray submodules replaced by MagicMock; deps: omegaconf, tensordict "
        "(--no-deps), pyvers, codetiming",
        "diffs": "max_abs_diff = max over cases of the value and (losses, KL) gradient w.r.t. "
        "logprobs; aligned_diff = the same after removing the stated convention",
    }
    for row in rows:
        row["agreement"] = ("agree" if row["agrees"] else "DIFFER") + f" {row['max_abs_diff']:.2g}"
        if row["aligned_diff"] is not None:
            row["aligned"] = f"{row['aligned_diff']:.2g}"
    write_results(
        "algo_agreement",
        rows,
        ["variant", "compared_with", "agreement", "aligned", "cases_over_tol", "note"],
        meta=meta,
    )
    bad = [
        r["variant"]
        for r in rows
        if not r["agrees"] and (r["aligned_diff"] is None or r["aligned_diff"] > TOL)
    ]
    if bad:
        print(f"unexplained differences: {bad}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()

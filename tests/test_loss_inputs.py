"""What a policy loss and an estimator read beyond the basics (docs/extending.md, "Entropy
control"): the exact entropy with its gradient, the sampler's log-probs, the batch's extras cut to
the micro-batch, the step; extras an estimator computes over the global batch. The docs'
examples run as written: the adaptive entropy bonus against a float64 computation from the
logits, KL-Cov equal at micro-batches of 1 and of the whole batch and on two ranks."""

from __future__ import annotations

import copy
import dataclasses
import importlib
import re
import sys
from pathlib import Path

import pytest
import torch
from test_algo_trainer import cfg_of, sampled_batch

from grpo.algo import LossSettings, compute_advantages, policy_loss
from grpo.algo.advantages import EstimatorRollout
from grpo.algo.losses import aggregate, loss_normalizer, policy_loss_on_device
from grpo.errors import GrpoError
from grpo.models import load_model
from grpo.policy import Policy
from grpo.testing.conformance import make_inputs
from grpo.train.grpo import step_batch, update_phase

REPO = Path(__file__).resolve().parents[1]
MOD = "my_pkg.entropy_control"


def doc_block() -> str:
    """The docs' `my_pkg/entropy_control.py` block, as written."""
    text = (REPO / "docs" / "extending.md").read_text()
    blocks = re.findall(r"```python\n(# my_pkg/entropy_control\.py\n.*?)```", text, re.S)
    assert len(blocks) == 1
    return blocks[0]


@pytest.fixture()
def ec(tmp_path, monkeypatch):
    """The docs' module, imported afresh as my_pkg.entropy_control (on sys.path)."""
    (tmp_path / "my_pkg").mkdir()
    (tmp_path / "my_pkg" / "__init__.py").write_text("")
    (tmp_path / "my_pkg" / "entropy_control.py").write_text(doc_block())
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m == "my_pkg" or m.startswith("my_pkg.")]:
        monkeypatch.delitem(sys.modules, name)
    return importlib.import_module(MOD)


def sgd_noop(params):
    """An optimizer that steps by 0: the gradient stays behind to be read."""
    opt = torch.optim.SGD(params, lr=0.0)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)


def completion_logp64(model, r):
    """(B, T_c, V) float64 log-softmax of the completion positions, from a float64 copy."""
    ref = copy.deepcopy(model).double()
    logits = ref(r.ids, attention_mask=r.attention_mask())[:, r.prompt_width - 1 : -1]
    return ref, logits.log_softmax(-1)


def test_entropy_bonus_of_a_loss_has_the_exact_entropy_gradient(ec, tiny_checkpoints):
    """`entropy_floor` at step 51 of 100 (weight coef / 2), advantages 0: its gradient is
    -c * d(sum of the low rows' entropies) / N, which float64 autograd of the full softmax
    gives. The first update's entropy is what the loss got: train/entropy equals it too."""
    model = load_model(tiny_checkpoints("qwen3"))
    batch = sampled_batch(model)
    r = batch.rollout
    mask = r.completion_mask
    ref, logp = completion_logp64(model, r)
    H = -(logp.exp() * logp).sum(-1)  # (B, T_c)
    row_H = torch.where(mask, H, 0.0).sum(-1) / mask.sum(-1)  # (B,)
    s = row_H.detach().sort().values
    i = int((s[1:] - s[:-1]).argmax())  # the widest gap: some rows below the target, some above
    target = float((s[i] + s[i + 1]) / 2)
    assert (s[i + 1] - s[i]) > 1e-5, s  # float32 vs float64 cannot move a row across it
    kwargs = f"loss.policy_loss_kwargs={{target: {target}, coef: 0.3, decay_steps: 100}}"
    cfg = cfg_of(
        f"loss.policy_loss={MOD}:entropy_floor",
        kwargs,
        "loss.beta=0",
        "optim.max_grad_norm=null",
        "train.micro_batch_size=2",
    )
    policy = Policy(model, None, [3], None, Path("."), lora=False)
    inputs = dataclasses.replace(
        step_batch(cfg, policy, batch, step=51), advantages=torch.zeros(mask.shape)
    )
    params = [p for p in model.parameters() if p.requires_grad]
    stats = update_phase(cfg, policy, inputs, *sgd_noop(params), params, step=51)

    low = (row_H < target).double()[:, None]  # (B, 1)
    c = 0.3 * (1 - 50 / 100)
    (-c * (low * torch.where(mask, H, 0.0)).sum() / mask.sum()).backward()
    for p, want in zip(params, ref.parameters()):
        torch.testing.assert_close(p.grad.double(), want.grad, rtol=1e-5, atol=1e-6)
    assert stats["train/low_entropy_rows"] == pytest.approx(
        float((low.expand_as(H)[mask]).mean()), abs=1e-6
    )
    assert stats["train/entropy"] == pytest.approx(float(H.detach()[mask].mean()), rel=1e-5)


def kl_cov_reference(ref_model, r, old, adv, chosen, mask, kl_coef):
    """The KL-Cov objective by definition in float64, token mean over the batch."""
    logp = ref_model(r.ids, attention_mask=r.attention_mask())[:, r.prompt_width - 1 : -1]
    lp = logp.log_softmax(-1).gather(-1, r.completion_ids[..., None])[..., 0]  # (B, T_c)
    lr = torch.where(mask, lp - old.double(), 0.0)
    per_token = -torch.exp(lr) * adv.double() + kl_coef * lr.abs() * chosen
    return torch.where(mask, per_token, 0.0).sum() / mask.sum()


def test_kl_cov_chooses_over_the_global_batch_whatever_the_micro_batch(ec, tiny_checkpoints):
    """The docs' KL-Cov through the trainer: the tokens are chosen by the estimator over the
    whole batch, so micro-batches of 1 row and of all 8 rows give the same gradient, each the
    float64 gradient of the objective written out; train/kl_cov_frac is k / N."""
    base = load_model(tiny_checkpoints("qwen3"))
    batch = sampled_batch(base)
    r, mask = batch.rollout, batch.rollout.completion_mask
    model = copy.deepcopy(base)
    with torch.no_grad():  # pi_theta away from the sampler: |log rho| has a definite sign
        g = torch.Generator().manual_seed(1)
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    policy = Policy(model, None, [3], None, Path("."), lora=False)
    grads, chosen, adv = [], None, None
    for size in (1, 8):
        cfg = cfg_of(
            f"loss.advantage={MOD}:kl_cov_advantages",
            f"loss.policy_loss={MOD}:kl_cov",
            "loss.advantage_kwargs={top_frac: 0.2}",
            "loss.policy_loss_kwargs={kl_coef: 2.0}",
            "loss.beta=0",
            "optim.max_grad_norm=null",  # the gradient as computed, not clipped
            f"train.micro_batch_size={size}",
        )
        inputs = step_batch(cfg, policy, batch, step=1)
        assert len(inputs.plan) == 8 // size
        assert inputs.metrics["advantage/kl_cov_tokens"] == int(0.2 * int(mask.sum()))
        chosen, adv = inputs.extras["kl_cov"], inputs.advantages
        params = [p for p in model.parameters() if p.requires_grad]
        model.zero_grad(set_to_none=True)
        stats = update_phase(cfg, policy, inputs, *sgd_noop(params), params, step=1)
        assert stats["train/kl_cov_frac"] == pytest.approx(
            int(0.2 * int(mask.sum())) / int(mask.sum()), abs=1e-6
        )
        grads.append([p.grad.clone() for p in params])

    ref = copy.deepcopy(model).double()
    kl_cov_reference(ref, r, r.logprobs, adv, chosen, mask, 2.0).backward()
    for a, b, want in zip(*grads, ref.parameters()):
        torch.testing.assert_close(a.double(), want.grad, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(b.double(), want.grad, rtol=1e-5, atol=1e-6)


def kl_cov_per_micro_batch(log_ratio, advantages, logprobs, mask, *, top_frac, kl_coef=2.0):
    """KL-Cov choosing its tokens inside what the loss sees (one micro-batch): what a loss
    without the estimator's extra would do."""
    lp, a = logprobs.detach(), advantages
    cov = torch.where(mask, (lp - lp[mask].mean()) * (a - a[mask].mean()), -torch.inf)
    k = max(1, int(top_frac * int(mask.sum())))
    chosen = torch.zeros(mask.numel(), dtype=torch.bool)
    chosen[cov.flatten().topk(k).indices] = True
    chosen = chosen.view_as(mask)
    return -torch.exp(log_ratio) * advantages + kl_coef * log_ratio.abs() * chosen


def test_kl_cov_gradient_in_float64_at_any_micro_batch(ec):
    """float64: the estimator's extra sliced to micro-batches of 1 row gives the full batch's
    gradient (1e-12); a choice made inside each micro-batch does not."""
    x = make_inputs(7, rows=8, width=6)
    mask, scores = x["mask"], (x["token_rewards"].sum(-1) > 0.5).float()
    token_rewards = torch.zeros(mask.shape)
    token_rewards[torch.arange(8), mask.sum(-1) - 1] = scores
    rollout = EstimatorRollout(
        completion_ids=torch.zeros(mask.shape, dtype=torch.long),
        completion_mask=mask,
        generated_mask=mask,
        turn_ids=torch.zeros(mask.shape, dtype=torch.long),
        logprobs=torch.where(mask, x["old_logprobs"], 0.0),
        prompt_lens=torch.ones(8, dtype=torch.long),
    )
    extras: dict = {}
    adv = compute_advantages(
        f"{MOD}:kl_cov_advantages",
        token_rewards,
        mask,
        group_size=4,
        params={"top_frac": 0.25},
        rollout=rollout,
        extras=extras,
    )
    assert set(extras) == {"kl_cov"} and int(extras["kl_cov"].sum()) == int(0.25 * mask.sum())
    old = rollout.logprobs.double()
    lp = torch.where(mask, x["logprobs"], 0.0).double()

    def grad(spec, kwargs, size):
        cfg = LossSettings(policy_loss=spec, policy_loss_kwargs=kwargs, beta=0.0)
        norm = loss_normalizer(mask, cfg.aggregation, 6)
        leaf = lp.clone().requires_grad_(True)
        for lo in range(0, 8, size):
            sl = slice(lo, lo + size)
            loss, _, _ = policy_loss_on_device(
                leaf[sl],
                old[sl],
                None,
                adv[sl].double(),
                mask[sl],
                cfg,
                normalizer=norm,
                extras={k: v[sl] for k, v in extras.items()},
            )
            loss.backward()
        return leaf.grad

    kw = {"kl_coef": 2.0}
    full, single = grad(f"{MOD}:kl_cov", kw, 8), grad(f"{MOD}:kl_cov", kw, 1)
    torch.testing.assert_close(single, full, rtol=1e-12, atol=1e-12)
    # written out: d/d lp of mean_t(-rho A + 2 |log rho| [chosen])
    leaf = lp.clone().requires_grad_(True)
    lr = torch.where(mask, leaf - old, 0.0)
    per_token = -torch.exp(lr) * adv.double() + 2.0 * lr.abs() * extras["kl_cov"]
    aggregate(per_token, mask, "token_mean", float(mask.sum())).backward()
    torch.testing.assert_close(full, leaf.grad, rtol=1e-12, atol=1e-12)
    # the choice made inside each micro-batch depends on the micro-batch
    kw_local = {"top_frac": 0.25}
    local = [grad(kl_cov_per_micro_batch, kw_local, n) for n in (8, 1)]
    assert (local[0] - local[1]).abs().max() > 1e-3


def test_loss_reads_behaviour_logprobs_extras_and_step():
    """Each input arrives as documented: the sampler's log-probs (not pi_old), this batch's
    rows of every extra (a per-row flag and per-token values, 0 off the mask), the step."""
    x = make_inputs(2, rows=4, width=5)
    mask = x["mask"]
    seen = {}

    def spy(logprobs, behaviour_logprobs, extras, step):
        seen.update(behaviour=behaviour_logprobs, extras=extras, step=step)
        return -logprobs

    behaviour = x["old_logprobs"] - 0.5
    flag = torch.tensor([True, False, True, False])
    values = torch.full(mask.shape, float("nan"))
    cfg = LossSettings(policy_loss=spy)
    policy_loss(
        x["logprobs"][1:3],
        x["old_logprobs"][1:3],
        None,
        x["advantages"][1:3],
        mask[1:3],
        cfg,
        behaviour_logprobs=behaviour[1:3],
        extras={"replayed": flag[1:3], "values": values[1:3]},
        step=7,
    )
    m = mask[1:3]
    torch.testing.assert_close(seen["behaviour"], torch.where(m, behaviour[1:3], 0.0))
    assert seen["extras"]["replayed"].tolist() == [False, True]
    assert bool((seen["extras"]["values"][~m] == 0).all())
    assert bool(seen["extras"]["values"][m].isnan().all())  # the values themselves untouched
    assert seen["step"] == 7
    # without the sampler's log-probs (pi_old is the sampler's), behaviour_logprobs is pi_old
    policy_loss(x["logprobs"], x["old_logprobs"], None, x["advantages"], mask, cfg)
    torch.testing.assert_close(seen["behaviour"], torch.where(mask, x["old_logprobs"], 0.0))
    assert seen["extras"] == {} and seen["step"] is None


def test_a_loss_declaring_entropy_without_one_is_named():
    def needs(logprobs, entropy):
        return -logprobs - entropy

    x = make_inputs(1, rows=2, width=3)
    cfg = LossSettings(policy_loss=needs)
    with pytest.raises(GrpoError, match=r"policy loss 'needs' declares `entropy`"):
        policy_loss(x["logprobs"], x["old_logprobs"], None, x["advantages"], x["mask"], cfg)


def test_estimator_reads_the_step_and_its_extras_are_checked():
    mask = torch.ones(4, 3, dtype=torch.bool)
    rewards = torch.zeros(4, 3)

    def by_step(mask, step):
        return torch.full(mask.shape, float(step)), {}, {"row": torch.arange(4)}

    extras: dict = {}
    out = compute_advantages(by_step, rewards, mask, group_size=2, step=5, extras=extras)
    assert bool((out == 5).all()) and extras["row"].tolist() == [0, 1, 2, 3]

    def bad(mask):
        return torch.zeros(mask.shape), {}, {"sel": torch.zeros(3, 3)}

    with pytest.raises(GrpoError, match=r"returned the extra 'sel' of shape \(3, 3\)"):
        compute_advantages(bad, rewards, mask, group_size=2)


def test_an_estimator_extra_may_not_shadow_the_batchs(tiny_checkpoints):
    model = load_model(tiny_checkpoints("qwen3"))
    batch = sampled_batch(model)
    batch = dataclasses.replace(batch, extras={"replayed": torch.zeros(8, dtype=torch.bool)})
    cfg = cfg_of("loss.advantage=test_loss_inputs:shadowing", "loss.beta=0")
    policy = Policy(model, None, [3], None, Path("."), lora=False)
    with pytest.raises(GrpoError, match=r"step 3: .* returned the extra 'replayed', which the"):
        step_batch(cfg, policy, batch, step=3)


def shadowing(scores, mask):
    """An estimator returning an extra the batch already holds."""
    return torch.zeros(mask.shape), {}, {"replayed": torch.ones(scores.shape[0])}


def entropy_floor_reference(
    log_ratio, advantages, entropy, mask, step, *, target, coef, epsilon_low, epsilon_high
):
    """`entropy_floor` written out in float64, token by token, at the default decay (200
    steps)."""
    out = torch.zeros_like(log_ratio)
    c = coef * max(0.0, 1.0 - (step - 1) / 200)
    for i in range(mask.shape[0]):
        counted = [t for t in range(mask.shape[1]) if mask[i, t]]
        low = bool(counted) and sum(float(entropy[i, t]) for t in counted) / len(counted) < target
        for t in counted:
            rho, A = torch.exp(log_ratio[i, t]), advantages[i, t]
            surrogate = torch.minimum(rho * A, rho.clamp(1 - epsilon_low, 1 + epsilon_high) * A)
            out[i, t] = -surrogate - (c * entropy[i, t] if low else 0.0)
    return out


def test_the_conformance_kit_checks_a_loss_that_reads_the_entropy(ec):
    """The kit hands a loss the inputs it may declare (a fixed entropy, the sampler's
    log-probs, the step), so the docs' entropy bonus passes every check against its float64
    twin."""
    from grpo.testing import check_policy_loss

    kwargs = {"target": 1.0, "coef": 0.1}  # the kit's entropies are uniform in [0, 2)
    check_policy_loss(f"{MOD}:entropy_floor", entropy_floor_reference, kwargs=kwargs)


def kl_cov_rows(dist, doc_dir: str):
    """KL-Cov's estimator on this rank's half of a fixed batch (each rank only its own
    completion width), through the trainer's `global_advantages`: (this rank's extra, its
    advantages). Runs in the session's ranks (`rank_pool`) and in this process (`SINGLE`)."""
    from types import SimpleNamespace

    from grpo.config import load_config
    from grpo.train.grpo import global_advantages

    sys.path.insert(0, doc_dir)
    try:
        x = make_inputs(7, rows=8, width=6)
        mask = x["mask"]
        token_rewards = torch.zeros(mask.shape)
        token_rewards[torch.arange(8), mask.sum(-1) - 1] = 1.0 + x["advantages"][:, 0]
        half = 8 // dist.world_size
        rows = slice(dist.rank * half, (dist.rank + 1) * half)
        width = int(mask[rows].sum(-1).max())
        mine = (rows, slice(0, width))
        rollout = SimpleNamespace(
            completion_ids=torch.where(mask, 5, 0)[mine],
            completion_mask=mask[mine],
            logprobs=torch.where(mask, x["old_logprobs"], 0.0)[mine],
            prompt_lens=torch.full((8,), 3)[rows],
        )
        loss = {"advantage": f"{MOD}:kl_cov_advantages", "advantage_kwargs": {"top_frac": 0.25}}
        base = {"model": {"path": "unused"}, "rollout": {"group_size": 4}, "loss": loss}
        extras: dict = {}
        batch = SimpleNamespace(rollout=rollout, extras={})
        adv = global_advantages(
            load_config(base=base),
            token_rewards[mine],
            mask[mine],
            dist,
            None,
            batch,
            step=1,
            extras=extras,
        )
        return extras["kl_cov"].tolist(), adv.tolist()
    finally:
        sys.path.remove(doc_dir)
        for name in [m for m in sys.modules if m == "my_pkg" or m.startswith("my_pkg.")]:
            del sys.modules[name]


def test_kl_cov_chooses_over_every_ranks_rows(ec, rank_pool):
    """Two ranks, each with half the rows and its own completion width: each gets its rows of
    the one choice over the whole batch, as one process on all rows."""
    from grpo.distributed import SINGLE

    doc_dir = str(Path(ec.__file__).parents[1])
    chosen, adv = (torch.tensor(v) for v in kl_cov_rows(SINGLE, doc_dir))
    assert int(chosen.sum()) == int(0.25 * int(make_inputs(7, rows=8, width=6)["mask"].sum()))
    for rank, (got, got_adv) in enumerate(rank_pool.run("test_loss_inputs:kl_cov_rows", doc_dir)):
        got, rows = torch.tensor(got), slice(4 * rank, 4 * rank + 4)
        assert got.tolist() == chosen[rows, : got.shape[1]].tolist()
        assert not chosen[rows, got.shape[1] :].any()  # nothing chosen past its width
        torch.testing.assert_close(torch.tensor(got_adv), adv[rows, : got.shape[1]])

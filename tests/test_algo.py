"""Advantages and losses on hand-computed cases (worked out in the comments)."""

from __future__ import annotations

import math

import pytest
import torch

from grpo.algo.advantages import (
    compute_advantages,
    discounted_returns,
    group_advantages,
    zero_std_groups,
)
from grpo.algo.kl import kl_penalty
from grpo.algo.losses import (
    AGGREGATIONS,
    LossSettings,
    aggregate,
    loss_normalizer,
    policy_loss,
    policy_loss_on_device,
)

EPS = 1e-4


def test_group_advantages_hand_computed():
    r = torch.tensor([1.0, 0.0, 1.0, 1.0])  # groups of 2: (1, 0) and (1, 1)
    # group: mean 0.5, unbiased std sqrt(0.25 + 0.25) = 0.70711 -> +-0.5 / (0.70711 + eps)
    a = group_advantages(r, 2, "group", EPS)
    s = 0.5 / (math.sqrt(0.5) + EPS)
    torch.testing.assert_close(a, torch.tensor([s, -s, 0.0, 0.0]), rtol=0, atol=1e-7)
    # none (Dr. GRPO): just centered
    torch.testing.assert_close(group_advantages(r, 2, "none"), torch.tensor([0.5, -0.5, 0, 0]))
    # batch: std of (1, 0, 1, 1) = sqrt(((.25)^2 * 3 + (.75)^2) / 3) = 0.5 -> 0.5 / 0.5 = 1
    b = group_advantages(r, 2, "batch", EPS)
    torch.testing.assert_close(b, torch.tensor([1.0, -1.0, 0, 0]) * 0.5 / (0.5 + EPS))


def test_equal_rewards_give_zero_not_nan():
    r = torch.full((8,), 3.0)
    for scale in ("group", "batch", "none"):
        a = group_advantages(r, 4, scale)
        assert torch.isfinite(a).all() and (a == 0).all()
    assert zero_std_groups(torch.tensor([1.0, 1, 0, 1]), 2).tolist() == [True, False]
    with pytest.raises(ValueError):
        group_advantages(torch.ones(5), 2)


def test_kl_estimators_hand_computed():
    logp, ref = torch.tensor([0.0]), torch.tensor([math.log(2.0)])
    # d = ref - logp = ln 2: k1 = -ln2, k2 = (ln2)^2 / 2, k3 = e^d - d - 1 = 2 - ln2 - 1
    assert kl_penalty(logp, ref, "k1").item() == pytest.approx(-math.log(2))
    assert kl_penalty(logp, ref, "k2").item() == pytest.approx(0.5 * math.log(2) ** 2)
    assert kl_penalty(logp, ref, "k3").item() == pytest.approx(1 - math.log(2))


def test_k3_nonnegative_and_zero_when_equal():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(1000, generator=g) * 3, torch.randn(1000, generator=g) * 3
    assert (kl_penalty(a, b, "k3") >= 0).all()
    assert (kl_penalty(a, a, "k3") == 0).all()


def one_row(logprobs, A, **kw):
    lp = torch.tensor([logprobs])
    return policy_loss(
        lp,
        torch.zeros_like(lp),
        None,
        torch.tensor([A]),
        torch.ones_like(lp, dtype=bool),
        LossSettings(**kw),
    )


def test_clipped_surrogate_positive_advantage():
    # ratios 1.5 and 0.9, A = +1, eps 0.2: min(1.5, 1.2) = 1.2 and min(0.9, 0.9) = 0.9
    # token_mean loss = -(1.2 + 0.9) / 2 = -1.05; one of two tokens clipped high.
    loss, st = one_row([math.log(1.5), math.log(0.9)], 1.0)
    assert loss.item() == pytest.approx(-1.05)
    assert st["clip_frac_high"] == 0.5 and st["clip_frac_low"] == 0.0
    assert st["ratio_max"] == pytest.approx(1.5) and st["ratio_mean"] == pytest.approx(1.2)


def test_clipped_surrogate_negative_advantage():
    # ratios 0.5 and 1.1, A = -1: min(-0.5, -0.8) = -0.8 and min(-1.1, -1.1) = -1.1
    # loss = (0.8 + 1.1) / 2 = 0.95; the ratio-0.5 token is clipped low.
    loss, st = one_row([math.log(0.5), math.log(1.1)], -1.0)
    assert loss.item() == pytest.approx(0.95)
    assert st["clip_frac_low"] == 0.5 and st["clip_frac_high"] == 0.0


def test_clip_higher_and_dual_clip():
    # eps_high 0.28 (DAPO): ratio 1.25, A = 1 -> not clipped: loss = -1.25
    loss, st = one_row([math.log(1.25)], 1.0, epsilon_high=0.28)
    assert loss.item() == pytest.approx(-1.25) and st["clip_frac_high"] == 0.0
    # ratio 5, A = -1: min(-5, -1.2) = -5; dual clip c=3 bounds it at max(-5, -3) = -3
    assert one_row([math.log(5.0)], -1.0)[0].item() == pytest.approx(5.0)
    assert one_row([math.log(5.0)], -1.0, dual_clip=3.0)[0].item() == pytest.approx(3.0)


def test_kl_term_added_with_beta():
    # on-policy ratio 1, A = 0, ref = ln 2 at logp 0: loss = beta * k3 = 0.1 * (1 - ln 2)
    lp = torch.zeros(1, 1)
    loss, st = policy_loss(
        lp,
        lp,
        torch.full((1, 1), math.log(2)),
        torch.zeros(1),
        torch.ones(1, 1, dtype=bool),
        LossSettings(beta=0.1),
    )
    assert loss.item() == pytest.approx(0.1 * (1 - math.log(2)))
    assert st["kl"] == pytest.approx(1 - math.log(2))


def test_gspo_sequence_ratio():
    # log-ratios ln 1.5 and ln(2/3) average to 0 -> sequence ratio 1 for both tokens:
    # nothing is clipped and loss = -A = -1 (token level would clip the 1.5)
    loss, st = one_row([math.log(1.5), math.log(2 / 3)], 1.0, policy_loss="gspo")
    assert loss.item() == pytest.approx(-1.0)
    assert st["clip_frac_high"] == 0.0 and st["ratio_max"] == pytest.approx(1.0)


def test_aggregations_hand_computed():
    # row 0 has one token (value 2), row 1 three tokens (value 1 each), T_max = 3
    values = torch.tensor([[2.0, 9.0, 9.0], [1.0, 1.0, 1.0]])
    mask = torch.tensor([[True, False, False], [True, True, True]])
    expect = {
        "token_mean": 5 / 4,  # (2 + 3) / 4 tokens
        "seq_mean_token_mean": (2 + 1) / 2,  # mean of row means
        "seq_mean_token_sum_norm": 5 / (2 * 3),  # sum / (rows * T_max)
    }
    for agg, want in expect.items():
        norm = loss_normalizer(mask, agg, max_new_tokens=3)
        assert aggregate(values, mask, agg, norm).item() == pytest.approx(want)


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_on_policy_gradient_is_reinforce(aggregation, level):
    # With beta 0, mu 1 and old = logp (detached), rho = 1 with grad(rho) = grad(logp), so
    # grad(loss) = -aggregate(A * grad logp) for token level. For sequence level the per-token
    # gradient is A * mean_t grad(logp) of its row, broadcast to every token of the row.
    torch.manual_seed(0)
    logits = torch.randn(4, 5, 7, requires_grad=True)
    ids = torch.randint(0, 7, (4, 5))
    mask = torch.rand(4, 5) > 0.3
    mask[:, 0] = True
    A = torch.randn(4)
    cfg = LossSettings(aggregation=aggregation, policy_loss="clip" if level == "token" else "gspo")

    logp = logits.log_softmax(-1).gather(-1, ids[..., None])[..., 0]
    loss, _ = policy_loss(logp, logp.detach(), None, A, mask, cfg, max_new_tokens=5)
    (g_loss,) = torch.autograd.grad(loss, logits)

    logp = logits.log_softmax(-1).gather(-1, ids[..., None])[..., 0]
    if level == "sequence":
        f = mask.float()
        logp = ((logp * f).sum(-1, keepdim=True) / f.sum(-1, keepdim=True)).expand_as(logp)
    norm = loss_normalizer(mask, aggregation, 5)
    reinforce = -aggregate(A[:, None] * logp, mask, aggregation, norm)
    (g_ref,) = torch.autograd.grad(reinforce, logits)
    torch.testing.assert_close(g_loss, g_ref, rtol=0, atol=1e-6)


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_micro_batches_sum_to_full_batch(aggregation):
    torch.manual_seed(1)
    logp = torch.randn(6, 4, requires_grad=True)
    old, ref = torch.randn(6, 4) * 0.1 + logp.detach(), torch.randn(6, 4)
    A, mask = torch.randn(6), torch.rand(6, 4) > 0.2
    cfg = LossSettings(beta=0.05, aggregation=aggregation)
    norm = loss_normalizer(mask, aggregation, 4)
    full, _ = policy_loss(logp, old, ref, A, mask, cfg, normalizer=norm)
    (g_full,) = torch.autograd.grad(full, logp)
    parts = [
        policy_loss(logp[s], old[s], ref[s], A[s], mask[s], cfg, normalizer=norm)[0]
        for s in (slice(0, 2), slice(2, 6))
    ]
    (g_parts,) = torch.autograd.grad(sum(parts), logp)
    assert sum(parts).item() == pytest.approx(full.item(), abs=1e-6)
    torch.testing.assert_close(g_parts, g_full, rtol=0, atol=1e-7)


# ------------------------------------------------------------- registered variants, by hand


def adv(name, rewards, lengths, G, **kw):
    """compute_advantages on outcome rewards placed on each row's last token."""
    lengths = torch.tensor(lengths)
    T = int(lengths.max())
    mask = torch.arange(T)[None, :] < lengths[:, None]
    tr = torch.zeros(len(rewards), T)
    tr[torch.arange(len(rewards)), lengths - 1] = torch.tensor(rewards)
    return compute_advantages(name, tr, mask, group_size=G, **kw), mask


def test_sequence_estimators_hand_computed():
    r, lens = [1.0, 0.0, 1.0, 1.0], [1, 2, 2, 1]
    a, mask = adv("grpo", r, lens, 2, eps=EPS)
    s = 0.5 / (math.sqrt(0.5) + EPS)  # as in test_group_advantages_hand_computed
    assert a[0, 0] == pytest.approx(s) and (a[1] == torch.tensor([-s, -s])).all()
    assert (a[~mask] == 0).all() and (a[2:] == 0).all()
    a, _ = adv("dr_grpo", r, lens, 2)  # centered: 0.5, -0.5, 0, 0
    assert a[:, 0].tolist() == [0.5, -0.5, 0.0, 0.0]
    a, _ = adv("batch_std", r, lens, 2, eps=EPS)  # batch std of (1, 0, 1, 1) = 0.5
    assert a[0, 0] == pytest.approx(0.5 / (0.5 + EPS))
    # rloo, G = 3, r = (1, 0, 0): baselines 0, 0.5, 0.5 -> A = 1, -0.5, -0.5
    a, _ = adv("rloo", [1.0, 0.0, 0.0], [1, 1, 1], 3)
    torch.testing.assert_close(a[:, 0], torch.tensor([1.0, -0.5, -0.5]))
    # opo, G = 2, lengths (1, 3), r = (1, 0): b = (1*1 + 3*0) / 4 = 0.25 -> 0.75, -0.25
    a, _ = adv("opo", [1.0, 0.0], [1, 3], 2)
    torch.testing.assert_close(a[:, 0], torch.tensor([0.75, -0.25]))
    assert (a[1] == -0.25).all()


def test_reinforce_pp_hand_computed():
    # row 0: token rewards (0, 1), row 1: one token, reward 0; gamma 0.5:
    # returns (0 + 0.5 * 1, 1) and (0): values 0.5, 1, 0 -> mean 0.5, unbiased std 0.5
    tr = torch.tensor([[0.0, 1.0], [0.0, 0.0]])
    mask = torch.tensor([[True, True], [True, False]])
    a = compute_advantages("reinforce_pp", tr, mask, group_size=2, eps=EPS, gamma=0.5)
    d = 0.5 + EPS
    torch.testing.assert_close(a, torch.tensor([[0.0, 0.5 / d], [-0.5 / d, 0.0]]))
    # a masked stretch inside a row (tool output) is skipped: counted tokens at 0, 3, reward
    # 1 at 3, gamma 0.5 -> returns 0.5 and 1, nothing at the masked 1, 2
    hole = torch.tensor([[True, False, False, True]])
    R = discounted_returns(torch.tensor([[0.0, 9.0, 9.0, 1.0]]), hole, 0.5)
    assert R.tolist() == [[0.5, 0.0, 0.0, 1.0]]
    # baseline variant, G = 2, r = (1, 0), lengths (1, 2): centered 0.5 | -0.5 -0.5
    # token mean -1/6 -> 2/3, -1/3, -1/3; unbiased std sqrt((4/9 + 1/9 + 1/9) / 2) = 1/sqrt(3)
    a, _ = adv("reinforce_pp_baseline", [1.0, 0.0], [1, 2], 2, eps=EPS)
    d = 1 / math.sqrt(3) + EPS
    torch.testing.assert_close(a, torch.tensor([[2 / 3 / d, 0.0], [-1 / 3 / d, -1 / 3 / d]]))


def test_estimator_errors_name_the_function():
    from grpo.algo import register_advantage
    from grpo.errors import GrpoError

    @register_advantage("test_wrong_shape", overwrite=True)
    def wrong(scores):
        return scores[:1]

    @register_advantage("test_nan", overwrite=True)
    def nan(scores, mask):
        return torch.full(mask.shape, float("nan"))

    with pytest.raises(GrpoError, match=r"'test_wrong_shape' returned shape \(1,\)"):
        adv("test_wrong_shape", [1.0, 0.0], [1, 2], 2)
    with pytest.raises(GrpoError, match=r"'test_nan' returned a non-finite advantage at row 0"):
        adv("test_nan", [1.0, 0.0], [1, 2], 2)
    with pytest.raises(GrpoError, match=r"unknown advantage estimator 'nope'; registered: .*grpo"):
        adv("nope", [1.0, 0.0], [1, 2], 2)


def one_tok(logprobs, A, old=None, **kw):
    lp = torch.tensor([logprobs], requires_grad=True)
    old = torch.zeros_like(lp) if old is None else torch.tensor([old])
    loss, st = policy_loss(
        lp, old, None, torch.tensor([A]), torch.ones(lp.shape, dtype=bool), LossSettings(**kw)
    )
    (grad,) = torch.autograd.grad(loss, lp)
    return loss.item(), grad[0].tolist(), st


def test_cispo_hand_computed():
    # ratio 1.5, A = 1, eps_high 0.2: weight sg(min(1.5, 1.2)) = 1.2, loss = -1.2 * ln 1.5,
    # gradient -1.2 (the clipped token still learns, at a bounded rate)
    loss, grad, st = one_tok([math.log(1.5)], 1.0, policy_loss="cispo")
    assert loss == pytest.approx(-1.2 * math.log(1.5)) and grad == pytest.approx([-1.2])
    assert st["clip_frac"] == 1.0
    # ratio 0.5: no lower bound by default (weight 0.5), 0.8 with clip_low
    _, grad, _ = one_tok([math.log(0.5)], 1.0, policy_loss="cispo")
    assert grad == pytest.approx([-0.5])
    _, grad, _ = one_tok(
        [math.log(0.5)], 1.0, policy_loss="cispo", policy_loss_kwargs={"clip_low": True}
    )
    assert grad == pytest.approx([-0.8])


def test_gmpo_hand_computed():
    # log-ratios (0.5, -0.1), A = +1: the upper side clips 0.5 -> 0.2; geometric mean
    # exp((0.2 - 0.1) / 2) = e^0.05; loss -e^0.05 on both tokens; only the unclipped token
    # has a gradient: d/dlp_2 of -exp(mean) = -e^0.05 / 2, token_mean over 2 -> same value
    loss, grad, st = one_tok([0.5, -0.1], 1.0, policy_loss="gmpo")
    assert loss == pytest.approx(-math.exp(0.05))
    assert grad == pytest.approx([0.0, -math.exp(0.05) / 2])
    assert st["clip_frac_high"] == 0.5
    # A = -1: the lower side clips -0.5 -> -0.2, the upper is free: exp((0.3 - 0.2) / 2)
    loss, _, st = one_tok([0.3, -0.5], -1.0, policy_loss="gmpo")
    assert loss == pytest.approx(math.exp(0.05)) and st["clip_frac_low"] == 0.5


def test_sapo_hand_computed():
    # on-policy (ratio 1): gate sigmoid(0) * 4 / tau = 2 / tau, and d gate / d ratio = 1
    loss, grad, _ = one_tok([0.0], 1.0, policy_loss="sapo")
    assert loss == pytest.approx(-2.0) and grad == pytest.approx([-1.0])
    loss, grad, _ = one_tok([0.0], -1.0, policy_loss="sapo")  # tau_neg 1.05
    assert loss == pytest.approx(2 / 1.05) and grad == pytest.approx([1.0])
    # ratio e: gate = sigmoid(e - 1) * 4; its slope sigmoid' * 4 = 4 s (1 - s), times e
    s = 1 / (1 + math.exp(-(math.e - 1)))
    loss, grad, _ = one_tok([1.0], 1.0, policy_loss="sapo")
    assert loss == pytest.approx(-4 * s) and grad == pytest.approx([-4 * s * (1 - s) * math.e])


def test_gspo_token_equals_gspo_for_row_constant_advantages():
    # log-ratios ln 1.5, ln 2/3: sequence ratio 1, loss -A; gradient A-weighted per token
    lr = [math.log(1.5), math.log(2 / 3)]
    a = one_tok(lr, 1.0, policy_loss="gspo", aggregation="seq_mean_token_mean")
    b = one_tok(lr, 1.0, policy_loss="gspo_token", aggregation="seq_mean_token_mean")
    assert a[0] == pytest.approx(-1.0) and b[0] == pytest.approx(-1.0)
    assert a[1] == pytest.approx([-0.5, -0.5]) and b[1] == pytest.approx([-0.5, -0.5])


def test_entropy_bonus_and_truncated_is():
    lp = torch.zeros(1, 2, requires_grad=True)
    H = torch.tensor([[2.0, 4.0]], requires_grad=True)
    mask = torch.ones(1, 2, dtype=bool)
    cfg = LossSettings(entropy_coef=0.1)
    # on-policy, A = 1: pg = -1 per token; bonus -0.1 * H: loss = -1 - 0.1 * 3 = -1.3
    loss, st = policy_loss(lp, lp.detach(), None, torch.ones(1), mask, cfg, entropy=H)
    assert loss.item() == pytest.approx(-1.3) and st["entropy"] == pytest.approx(3.0)
    (g,) = torch.autograd.grad(loss, H)
    assert g[0].tolist() == pytest.approx([-0.05, -0.05])
    # TIS: pi_old_trainer / pi_sampler = 3 and 0.5, cap 2 -> weights 2 and 0.5 on pg = -1
    cfg = LossSettings(tis_cap=2.0)
    sampler = torch.tensor([[-math.log(3.0), math.log(2.0)]])
    loss, st = policy_loss(
        lp, lp.detach(), None, torch.ones(1), mask, cfg, behaviour_logprobs=sampler
    )
    assert loss.item() == pytest.approx(-(2.0 + 0.5) / 2)
    assert st["tis_weight_mean"] == pytest.approx(1.25)


def test_clamps_keep_the_loss_finite():
    # log-ratio 100 at A = -1: rho = e^100 overflows float32; the default clamp (20) bounds it
    loss, grad, _ = one_tok([100.0], -1.0)
    assert loss == pytest.approx(math.exp(20), rel=1e-5) and grad == [0.0]
    loss, _, _ = one_tok([100.0], -1.0, log_ratio_clamp=None)
    assert math.isinf(loss)
    # k3 at d = ref - logp = 30: d clamped to 20, the estimate to 10
    kl = kl_penalty(torch.zeros(1), torch.full((1,), 30.0), "k3", 20.0, 10.0)
    assert kl.item() == 10.0
    assert kl_penalty(torch.zeros(1), torch.full((1,), 3.0), "k3", 20.0, None).item() == (
        pytest.approx(math.exp(3) - 4)
    )


def test_policy_loss_errors_name_the_function():
    from grpo.algo import register_policy_loss
    from grpo.errors import GrpoError

    @register_policy_loss("test_bad_loss", overwrite=True)
    def bad(log_ratio):
        return log_ratio.sum()

    with pytest.raises(GrpoError, match=r"policy loss 'test_bad_loss' returned shape \(\)"):
        one_tok([0.0], 1.0, policy_loss="test_bad_loss")

    @register_policy_loss("test_inf_loss", overwrite=True)
    def inf(log_ratio):
        return log_ratio + float("inf")

    with pytest.raises(GrpoError, match=r"'test_inf_loss' returned a non-finite value at row 0"):
        one_tok([0.0], 1.0, policy_loss="test_inf_loss")


def test_policy_loss_on_device_is_policy_loss_without_a_host_read():
    """The same loss and stats, as detached 0-d tensors (float stats of a registered loss, a
    Python float too, are accepted), and the row to blame computed on the device: the first
    row with a non-finite value at a counted token from finite inputs, else -1."""
    from grpo.algo import register_policy_loss
    from grpo.errors import GrpoError

    @register_policy_loss("test_stats_and_inf", overwrite=True)
    def stats_and_inf(log_ratio, advantages):
        # inf where A = 9 (rows 1 and 2 below); per-token, (B, 1) and Python-float stats
        pg = -log_ratio.exp() * advantages + torch.where(advantages == 9.0, math.inf, 0.0)
        return pg, {"w_mean": log_ratio.exp(), "w_max": log_ratio[:, :1], "const_mean": 0.5}

    torch.manual_seed(0)
    B, T = 4, 5
    mask = torch.arange(T)[None, :] < torch.tensor([5, 3, 4, 2])[:, None]  # (B, T)
    lp = (-torch.rand(B, T)).requires_grad_(True)
    old, ref, behaviour = (lp.detach() + 0.1 * torch.randn(B, T) for _ in range(3))
    A = torch.tensor([1.0, -0.5, 2.0, 0.3])
    H = torch.rand(B, T)
    args = (lp, old, ref, A, mask)
    cfg = LossSettings(policy_loss="test_stats_and_inf", beta=0.1, tis_cap=1.5)
    kw = {"entropy": H, "behaviour_logprobs": behaviour}
    loss, st = policy_loss(*args, cfg, **kw)
    loss_d, st_d, bad = policy_loss_on_device(*args, cfg, **kw)
    assert torch.equal(loss, loss_d) and loss_d.requires_grad
    assert (
        st_d.keys()
        == st.keys()
        == {
            "tis_weight_mean",
            "policy_loss",
            "kl",
            "entropy",
            "w_mean",
            "w_max",
            "const_mean",
            "tokens",
        }
    )
    for k, v in st_d.items():
        assert v.dim() == 0 and not v.requires_grad, k
        assert float(v) == st[k] and isinstance(st[k], float), k
    assert st["const_mean"] == 0.5 and st["tokens"] == 14.0
    assert int(bad) == -1
    # inf at rows 1 and 2 from finite inputs: row 1 is named
    A_inf = torch.tensor([1.0, 9.0, 9.0, 0.3])
    assert int(policy_loss_on_device(lp, old, ref, A_inf, mask, cfg)[2]) == 1
    with pytest.raises(GrpoError, match="returned a non-finite value at row 1 "):
        policy_loss(lp, old, ref, A_inf, mask, cfg)
    # a NaN input at a counted token: the trainer's to skip, nobody to blame
    lp_nan = lp.detach().clone()
    lp_nan[1, 0] = math.nan
    assert int(policy_loss_on_device(lp_nan, old, ref, A_inf, mask, cfg)[2]) == -1
    # ... but a NaN input at a masked token never reaches the loss: row 1 is named again
    lp_nan[1, 0], lp_nan[1, 4] = lp[1, 0], math.nan
    assert int(policy_loss_on_device(lp_nan, old, ref, A_inf, mask, cfg)[2]) == 1


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_default_path_is_bitwise_the_sequence_level_formula(aggregation):
    """The registries changed nothing for the defaults: grpo advantages on the last token,
    broadcast, and the clip loss + beta * k3 give bit for bit what the (B,) formulas give."""
    torch.manual_seed(2)
    B, T, G = 8, 6, 4
    lengths = torch.randint(1, T + 1, (B,))
    mask = torch.arange(T)[None, :] < lengths[:, None]
    rewards = torch.rand(B)
    tr = torch.zeros(B, T)
    tr[torch.arange(B), lengths - 1] = rewards
    a_tok = compute_advantages("grpo", tr, mask, group_size=G, eps=EPS)
    a_seq = group_advantages(rewards, G, "group", EPS)
    assert torch.equal(a_tok[mask], a_seq[:, None].expand(B, T)[mask])

    logp = (-torch.rand(B, T) * 2).masked_fill(~mask, 0.0).requires_grad_(True)
    old = (logp.detach() + 0.2 * torch.randn(B, T)).masked_fill(~mask, 0.0)
    ref = (logp.detach() + 0.3 * torch.randn(B, T)).masked_fill(~mask, 0.0)
    cfg = LossSettings(beta=0.04, aggregation=aggregation, epsilon_high=0.28)
    norm = loss_normalizer(mask, aggregation, T)
    loss, _ = policy_loss(logp, old, ref, a_tok, mask, cfg, normalizer=norm)
    (g,) = torch.autograd.grad(loss, logp)
    # the sequence-level formula, written out: A (B, 1) broadcast, masks multiplied
    ratio = torch.exp(logp - old)
    A = a_seq[:, None]
    surrogate = torch.minimum(ratio * A, torch.clamp(ratio, 0.8, 1.28) * A)
    d = ref - logp
    per_token = -surrogate + 0.04 * (torch.exp(d) - d - 1.0)
    f = mask.float()
    if aggregation == "seq_mean_token_mean":
        want = ((per_token * f).sum(-1) / f.sum(-1).clamp(min=1)).sum() / norm
    else:
        want = (per_token * f).sum() / norm
    (g_want,) = torch.autograd.grad(want, logp)
    assert torch.equal(loss, want) and torch.equal(g, g_want)


def test_grpo_turn_hand_computed():
    # G = 2. Row 0: turn 0 (cols 0-1, step reward 0.5), an observation (col 2), turn 1
    # (cols 3-4, final reward 1); row 1: one turn (cols 0-1), final reward 0. turn_gamma 0.5:
    # the trainer's token rewards carry 0.5^k, so row 0 = (0, 0.5, -, 0, 0.5), row 1 = 0.
    tr = torch.tensor([[0.0, 0.5, 0.0, 0.0, 0.5], [0.0, 0.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, False, True, True], [True, True, False, False, False]])
    turns = torch.tensor([[0, 0, 0, 1, 1], [0, 0, -1, -1, -1]])
    a = compute_advantages(
        "grpo_turn", tr, mask, group_size=2, eps=EPS, turn_ids=turns, turn_gamma=0.5
    )
    # turn 0: returns R_0 = 0.5 + 0.5 * 1 = 1 and 0 -> +-0.5 / (std sqrt(0.5) + eps)
    s = 0.5 / (math.sqrt(0.5) + EPS)
    torch.testing.assert_close(a[:, :2], torch.tensor([[s, s], [-s, -s]]))
    # turn 1: only row 0 reached it -> no group to compare with: 0
    assert a[0, 3:].tolist() == [0.0, 0.0] and a[0, 2] == 0.0
    # one turn everywhere: exactly grpo
    one = compute_advantages("grpo_turn", tr[:, :2], mask[:, :2], group_size=2, eps=EPS)
    assert torch.equal(
        one, compute_advantages("grpo", tr[:, :2], mask[:, :2], group_size=2, eps=EPS)
    )
